"""The "ragged_dot" gmm backend: `jax.lax.ragged_dot`, which XLA lowers on CPU, GPU and TPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gmm_ragged_dot(lhs_mk: jax.Array, rhs_gkn: jax.Array, group_sizes_g: jax.Array) -> jax.Array:
  """`jax.lax.ragged_dot` with fp32 accumulation; returns the promoted input dtype.

  Gradients come from ragged_dot's own autodiff rules (dlhs is again a ragged_dot, drhs a
  per-group lhsᵀ·dout), the rules the Pallas backends' custom_vjp (vjp.py) follows too.
  """
  dtype = jnp.result_type(lhs_mk.dtype, rhs_gkn.dtype)
  out_mn = jax.lax.ragged_dot(lhs_mk.astype(dtype), rhs_gkn.astype(dtype),
                              group_sizes_g.astype(jnp.int32),
                              preferred_element_type=jnp.float32)
  return out_mn.astype(dtype)
