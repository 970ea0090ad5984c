"""Linear-attention kernels: pure JAX functions (reference, chunked, step, pallas)."""
