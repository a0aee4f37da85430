"""Triton kernels for pdserve's CUDA path, each beside a pure-torch reference."""
