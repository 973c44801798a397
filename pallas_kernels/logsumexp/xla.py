"""`op.logsumexp_and_pick` in plain JAX: XLA's reductions over the last axis."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def logsumexp_and_pick(logits, targets):
  """(lse, picked), fp32, for fp32 logits [..., V] and int targets [...] (op.py)."""
  lse = jax.nn.logsumexp(logits, axis=-1)
  onehot = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1) == targets[..., None]
  return lse, jnp.sum(jnp.where(onehot, logits, 0.0), axis=-1)
