"""The "xla" backend: SiTU-GLU as jnp ops in fp32, rounded once to g's dtype; autodiff gives the
gradients. XLA fuses it with its neighbours (on a GPU, one elementwise pass forward; backward,
autodiff's fp32 residuals tanh(g/β₁), tanh(u/β₂) are written and read again)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def situ(g: jax.Array, beta: float) -> jax.Array:
  """SiTU_β(g) = β·tanh(g/β)·σ(g), fp32."""
  g = g.astype(jnp.float32)
  return beta * jnp.tanh(g / beta) * jax.nn.sigmoid(g)


def situ_glu(g: jax.Array, u: jax.Array, beta: float, linear_beta: float | None,
             row_scale: jax.Array | None = None) -> jax.Array:
  """SiTU_β₁(g) · β₂·tanh(u/β₂) (· row_scale) in fp32, rounded once to g's dtype."""
  u32 = u.astype(jnp.float32)
  up = u32 if linear_beta is None else linear_beta * jnp.tanh(u32 / linear_beta)
  h = situ(g, beta) * up
  if row_scale is not None:
    h = h * row_scale.astype(jnp.float32)[..., None]
  return h.astype(g.dtype)
