"""The engine's GPU hot paths as Triton kernels, each beside its pure-torch reference."""
