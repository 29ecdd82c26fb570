"""Quantized GEMV kernels: GGUF codebooks, execution layout, CUDA sources, candidates, launchers and the
bit-exact CPU emulator of the arithmetic contract. Never imports `dispatch`."""
