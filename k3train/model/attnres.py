"""Block Attention Residuals (docs/maths.md §3): each sublayer input is a softmax mix over block sums.

Sources live in a fixed-size buffer `[N_max, B, T, d]` with a count of valid slots so that the
scanned decoder carries a static shape; unused slots get zero probability.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3train.parallel import axes as ax
from k3train.model import layers


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


class AttnResMix(nnx.Module):
  """One mixing site: a zero-initialised pseudo-query w [d] and an RMSNorm gain γ [d]."""

  def __init__(self, d_model: int, *, eps: float, param_dtype=jnp.float32, rngs: nnx.Rngs):
    self.eps = eps
    self.query = layers.param(rngs, nnx.initializers.zeros, (d_model,), (ax.EMBED,), param_dtype)
    self.norm_scale = layers.param(rngs, nnx.initializers.ones, (d_model,), (ax.EMBED,), param_dtype)

  def __call__(self, sources_nbtd: jax.Array, num_valid: jax.Array | int) -> jax.Array:
    return attn_res_mix(sources_nbtd, num_valid, self.query[...], self.norm_scale[...], self.eps)


def init_stream(embed_btd: jax.Array, max_blocks: int):
  """(blocks [N_max, B, T, d] zeros, num_blocks 0, partial sum p = embedding)."""
  blocks = jnp.zeros((max_blocks,) + embed_btd.shape, embed_btd.dtype)
  return blocks, jnp.zeros((), jnp.int32), embed_btd


def with_partial(blocks_nbtd: jax.Array, num_blocks: jax.Array, p_btd: jax.Array) -> jax.Array:
  """The sources `blocks + [p]`: p written into slot num_blocks (valid count num_blocks + 1)."""
  return jax.lax.dynamic_update_index_in_dim(blocks_nbtd, p_btd, num_blocks, axis=0)


def maybe_start_block(stream, layer_index: jax.Array, block_size: int):
  """At a block start (layer_index % block_size == 0) close the running sum into the block list."""
  blocks, num_blocks, p = stream
  start = (layer_index % block_size) == 0
  new_blocks = jnp.where(start, with_partial(blocks, num_blocks, p), blocks)
  return new_blocks, num_blocks + start.astype(jnp.int32), jnp.where(start, jnp.zeros_like(p), p)


def max_sources(num_layers: int, block_size: int) -> int:
  """Slots needed: one per block start (the embedding is block 0) plus the running partial sum."""
  return -(-num_layers // block_size) + 1
