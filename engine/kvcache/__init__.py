"""The KV cache: block pool, block manager, prefix keys and cache, disk store, host swap.

It works on sequence ids, token ids, hashes and salts; it knows no requests or models."""
