"""The oracle: one AttnRes mix over an explicit sources buffer, differentiated by autodiff."""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.named_scope("attnres")
def attn_res_mix(sources_nbtd: jax.Array, num_valid: jax.Array | int, query_d: jax.Array,
                 gain_d: jax.Array, eps: float) -> jax.Array:
  """AR(V) = Σ_i softmax_i(rms_normalise(V_i) · (γ ⊙ w)) V_i over the first `num_valid` sources.

  Computed in fp32 and cast back to the sources' dtype. With one valid source it is the identity;
  with w = 0 it is the mean of the valid sources.
  """
  v32 = sources_nbtd.astype(jnp.float32)
  keys = v32 * jax.lax.rsqrt(jnp.mean(v32 * v32, axis=-1, keepdims=True) + eps)
  w = (gain_d.astype(jnp.float32) * query_d.astype(jnp.float32))
  scores = jnp.einsum("nbtd,d->nbt", keys, w)
  valid = (jnp.arange(sources_nbtd.shape[0]) < num_valid)[:, None, None]
  scores = jnp.where(valid, scores, -jnp.inf)
  probs = jax.nn.softmax(scores, axis=0)
  probs = jnp.where(valid, probs, 0.0)
  return jnp.einsum("nbt,nbtd->btd", probs, v32).astype(sources_nbtd.dtype)
