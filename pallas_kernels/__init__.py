"""Custom ops of k3train: one folder per kernel (reference, pure-JAX path, Pallas kernels, op)."""
