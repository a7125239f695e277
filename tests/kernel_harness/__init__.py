"""Linux test harness for the GPU kernels: MSL/CUDA-on-CPU emulation, lint, cases."""
