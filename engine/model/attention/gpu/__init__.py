"""Paged decode attention kernels on Metal or CUDA through `mx.fast.metal_kernel` /
`mx.fast.cuda_kernel`: the inputs both kernels share (`abi`), the one-pass kernel
(`one_pass`) and the two-pass split-K kernels for long contexts (`two_pass`).

The kernel bodies live in `metal_kernels/`; one body serves plain and quantized pools
(K and V each float rows, or `QuantizedBlocks` dequantized in registers, chosen by
template values). Routing, the first-launch check and the fallback are
`engine.model.attention`'s; these modules only build and launch.
"""
