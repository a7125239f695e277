"""The model side: loading (GGUF, mlx-lm dirs), fingerprints, the paged forward,
attention dispatch and kernels, the CPU fast path (BLAS shim, memory facts)."""
