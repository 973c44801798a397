"""The oracle: Quantile Balancing's order statistics by sorting (slow, obviously right)."""

from __future__ import annotations

import jax.numpy as jnp


def margin_quantile(scores_te, bias_e, real_t, top_k: int, q):
  """β [E] fp32: per expert the (q+1)-th largest over real tokens t of the margin
  μ_te = s_te − α_t, where α_t is the (k+1)-th largest over experts of s_te + b_e. Padding
  tokens (real_t false) sort last. Needs top_k < E and 0 ≤ q < T."""
  scores_te = jnp.asarray(scores_te, jnp.float32)
  biased_te = scores_te + jnp.asarray(bias_e, jnp.float32)
  cutoff_t = -jnp.sort(-biased_te, axis=1)[:, top_k]
  margin_te = jnp.where(jnp.asarray(real_t, bool)[:, None], scores_te - cutoff_t[:, None], -jnp.inf)
  return -jnp.sort(-margin_te, axis=0)[q]
