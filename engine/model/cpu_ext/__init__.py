"""kvchat's C++ CPU extension for MLX: a quantized matmul and paged attention.

Built on first use on the machine that runs it (`build`), with MLX's own path as the
fallback whenever it cannot be built or fails; `linear` installs the quantized linears,
`attention` routes CPU decode and prefill attention to it. Importing this package builds
nothing.
"""
