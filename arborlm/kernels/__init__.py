"""Attention kernels over the paged KV layout: torch reference / CPU path, Triton on CUDA."""
