"""The disk prefix store: full KV blocks kept across runs, one file per block, named by its
chained hash (`prefix_key.chain_hash`), under a private directory (`store.DiskPrefixStore`).

Entries live at ``<root>/<hex[:2]>/<hex>.kvb``; the file format and its checks are `entry`,
what a block's tensors are (geometry, dtype, quantized format) is `spec`. What the store
promises:

- Atomic writes: temp file, fsync, rename, directory fsync (`root.write_temp`,
  `files.EntryFiles.commit`). A crash leaves a complete entry or a stray kvchat temp file,
  never a torn entry under a real name; old temp files are swept.
- Verify on read: the whole file's checksum, then salt, block hash, token ids, format and
  tensors against what the reader asked for. Nothing corrupt, foreign (another model, tenant
  or format), of another pool's spec or expired is ever served: a failing entry is a miss, is
  deleted and is counted by reason. `store.DiskPrefixStore.get` never raises.
- Budget: total file bytes are kept within ``budget_bytes``, least recently used first, at
  open and after every write (`catalog`); "last used" is the file's mtime, so LRU order
  survives restarts without an index file.
- TTL: cached K/V is user data; an entry expires at its header's time or earlier under its
  tenant's TTL (`index.TenantTTLs`, saved in the directory so every process agrees).
- Private files: directories kvchat creates are 0700 and entries 0600; entries are read only
  from directories owned by the user (or root) and writable by no one else, never written
  through a symlink, and only entry-named or kvchat temp files are ever deleted (`root`,
  `files`) -- and, in a writable root, what kvchat never makes and would block it for good:
  a symlink at a shard's name (unlinked, never followed) or a directory at an entry's name.

No MLX in this package: its modules load without it (a crash test runs them in a bare child).
"""
