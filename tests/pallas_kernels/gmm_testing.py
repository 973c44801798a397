"""Shared inputs and float64 ground truth for the grouped-matmul tests."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def normal(shape, seed, dtype=jnp.float32):
  """Standard-normal test input from numpy (no XLA compile per shape), cast to dtype."""
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32).astype(dtype)


def loop_gmm(lhs_mk, rhs_gkn, group_sizes) -> np.ndarray:
  """ragged_dot by a numpy loop over groups in float64; rows past sum(group_sizes) stay zero."""
  lhs, rhs = np.asarray(lhs_mk, np.float64), np.asarray(rhs_gkn, np.float64)
  out, row = np.zeros((lhs.shape[0], rhs.shape[2])), 0
  for g, size in enumerate(group_sizes):
    out[row:row + size] = lhs[row:row + size] @ rhs[g]
    row += size
  return out
