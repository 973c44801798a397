"""The oracle: SiTU-GLU written from its definition, in the inputs' own precision.

Tests call it on float64 inputs (under jax.enable_x64) and differentiate it with autodiff; it
rounds nothing, so its float64 values and gradients are the ones the backends approximate.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def situ_glu(g, u, beta: float, linear_beta: float | None, row_scale=None):
  """β·tanh(g/β)·σ(g) · (β₂·tanh(u/β₂) or u) · row_scale[..., None], in the promoted dtype."""
  dtype = jnp.promote_types(jnp.promote_types(g.dtype, u.dtype), jnp.float32)
  g, u = g.astype(dtype), u.astype(dtype)
  gate = beta * jnp.tanh(g / beta) * (1 / (1 + jnp.exp(-g)))
  up = u if linear_beta is None else linear_beta * jnp.tanh(u / linear_beta)
  h = gate * up
  if row_scale is not None:
    h = h * row_scale.astype(dtype)[..., None]
  return h


def situ_glu_grads(g, u, dh, beta: float, linear_beta: float | None, row_scale=None):
  """(dg, du, d_row_scale or None) of `situ_glu` for the cotangent dh, by autodiff."""
  if row_scale is None:
    _, pull = jax.vjp(lambda a, b: situ_glu(a, b, beta, linear_beta), g, u)
    return (*pull(dh.astype(jnp.promote_types(g.dtype, jnp.float32))), None)
  _, pull = jax.vjp(lambda a, b, r: situ_glu(a, b, beta, linear_beta, r), g, u, row_scale)
  return pull(dh.astype(jnp.promote_types(g.dtype, jnp.float32)))
