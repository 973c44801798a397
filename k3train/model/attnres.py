"""Block Attention Residuals (docs/maths.md §3): each sublayer input is a softmax mix over block sums.

The stream a decoder carries is (blocks [N_blocks, B, T, d], num_blocks, partial sum p [B, T, d]):
a fixed-size buffer of completed block sums with a count of valid slots, so that the scanned
decoder carries a static shape, and the running sum of the current block. A mixing site sees the
sources blocks[:num_blocks] + [p].

The mix itself lives in pallas_kernels/attnres (the oracle `attn_res_mix` over an explicit
sources buffer; `mix_pass` over the stream, with an explicit VJP that keeps three [N + 1, B, T]
statistics and, on GPUs, a backward kernel); k3train/parallel/attnres.py runs it under a mesh.
A site returns the stream it read, passed through `mix_pass`, and the layer carries that one
on, so that the backward adds each site's source gradients into the stream's cotangent in
place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3train.parallel import attnres as parallel_attnres
from k3train.parallel import axes as ax
from k3train.model import layers


# ----------------------------------------------------------------------------- sites and stream


class AttnResMix(nnx.Module):
  """One mixing site: a zero-initialised pseudo-query w [d] and an RMSNorm gain γ [d]."""

  def __init__(self, d_model: int, *, eps: float, backend: str = "auto", param_dtype=jnp.float32,
               rngs: nnx.Rngs):
    self.eps = eps
    self.backend = backend
    self.query = layers.param(rngs, nnx.initializers.zeros, (d_model,), (ax.EMBED,), param_dtype)
    self.norm_scale = layers.param(rngs, nnx.initializers.ones, (d_model,), (ax.EMBED,), param_dtype)

  def __call__(self, stream):
    """(the mix over the stream's sources blocks[:num_blocks] + [p], [B, T, d]; the stream to
    carry on: the same values, passed through the mix so that its backward sees their
    cotangents)."""
    blocks, num_blocks, p = stream
    h, blocks, p = parallel_attnres.mix_pass(blocks, num_blocks, p, self.query[...],
                                             self.norm_scale[...], eps=self.eps,
                                             backend=self.backend)
    return h, (blocks, num_blocks, p)


def init_stream(embed_btd: jax.Array, max_blocks: int):
  """(blocks [max_blocks, B, T, d] zeros, num_blocks 0, partial sum p = embedding)."""
  blocks = jnp.zeros((max_blocks,) + embed_btd.shape, embed_btd.dtype)
  return blocks, jnp.zeros((), jnp.int32), embed_btd


def with_partial(blocks_nbtd: jax.Array, num_blocks: jax.Array, p_btd: jax.Array) -> jax.Array:
  """The sources as one buffer (valid count num_blocks + 1): blocks with p written into slot
  num_blocks, one slot longer than blocks so that a full buffer has room for p."""
  room = jnp.concatenate([blocks_nbtd, jnp.zeros_like(blocks_nbtd[:1])])
  return jax.lax.dynamic_update_index_in_dim(room, p_btd, num_blocks, axis=0)


def maybe_start_block(stream, layer_index: jax.Array | int, block_size: int):
  """At a block start (layer_index % block_size == 0) close the running sum into the block list.

  Touches one slot of the buffer (an in-place update inside a scan), not the whole buffer, and so
  does its backward (`_close_block`'s VJP). A layer index known when tracing (a Python int: the
  unscanned layers) decides statically: a layer that starts no block leaves the stream as it
  is, so the buffer is neither written nor, where an earlier version of it is still needed
  (a rematerialised layer's saved input), copied first.
  """
  blocks, num_blocks, p = stream
  if isinstance(layer_index, (int, np.integer)):
    if layer_index % block_size:
      return stream
    blocks, p = _close_block(blocks, num_blocks, p, jnp.bool_(True))
    return blocks, num_blocks + 1, p
  start = (layer_index % block_size) == 0
  blocks, p = _close_block(blocks, num_blocks, p, start)
  return blocks, num_blocks + start.astype(jnp.int32), p


@jax.custom_vjp
def _close_block(blocks_nbtd, num_blocks, p_btd, start):
  """(blocks with slot num_blocks set to p, zeros for p) where `start`, else (blocks, p)."""
  slot = jax.lax.dynamic_index_in_dim(blocks_nbtd, num_blocks, axis=0, keepdims=False)
  blocks_nbtd = jax.lax.dynamic_update_index_in_dim(blocks_nbtd, jnp.where(start, p_btd, slot),
                                                    num_blocks, axis=0)
  return blocks_nbtd, jnp.where(start, jnp.zeros_like(p_btd), p_btd)


def _close_block_fwd(blocks_nbtd, num_blocks, p_btd, start):
  return _close_block(blocks_nbtd, num_blocks, p_btd, start), (num_blocks, start)


def _close_block_bwd(residuals, cotangents):
  """At a start the slot's cotangent moves to p and the slot's is zeroed; otherwise both pass
  through. One slot is read and rewritten in place (autodiff would add two full buffers)."""
  num_blocks, start = residuals
  ct_blocks, ct_p = cotangents
  ct_slot = jax.lax.dynamic_index_in_dim(ct_blocks, num_blocks, axis=0, keepdims=False)
  ct_blocks = jax.lax.dynamic_update_index_in_dim(
      ct_blocks, jnp.where(start, jnp.zeros_like(ct_slot), ct_slot), num_blocks, axis=0)
  return ct_blocks, None, jnp.where(start, ct_slot, ct_p), None


_close_block.defvjp(_close_block_fwd, _close_block_bwd)


def max_blocks(num_layers: int, block_size: int) -> int:
  """Block slots needed: one per block start (the embedding is block 0)."""
  return -(-num_layers // block_size)


def max_sources(num_layers: int, block_size: int) -> int:
  """Sources a site can see at most: every block plus the running partial sum."""
  return max_blocks(num_layers, block_size) + 1
