"""Block Attention Residuals (docs/maths.md §3): each sublayer input is a softmax mix over block sums.

The stream a decoder carries is (blocks [N_blocks, B, T, d], num_blocks, partial sum p [B, T, d]):
a fixed-size buffer of completed block sums with a count of valid slots, so that the scanned
decoder carries a static shape, and the running sum of the current block. A mixing site sees the
sources blocks[:num_blocks] + [p].

Two implementations of one function:
  attn_res_mix   the sources as one [N, B, T, d] buffer with a valid count, differentiated by
                 autodiff: the reference the fast path is tested against.
  mix_stream     the stream itself, without materialising blocks + [p], with an explicit VJP that
                 keeps three [N + 1, B, T] statistics (mixing weights, inverse RMS, scores)
                 instead of fp32 copies of the sources: the backward reads each source twice and
                 writes its gradient once. The model uses this one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from k3train.parallel import axes as ax
from k3train.model import layers
from k3train.model import remat


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


# ----------------------------------------------------------------------------- the fast path


def _source_stats(v_btd: jax.Array, w_d: jax.Array, eps: float):
  """(inverse RMS r, score s = r · (v · w)) of one source, [..., B, T] fp32, in one pass."""
  v32 = v_btd.astype(jnp.float32)
  r = jax.lax.rsqrt(jnp.mean(v32 * v32, axis=-1) + eps)
  return r, r * jnp.sum(v32 * w_d, axis=-1)


def _mix_forward(blocks_nbtd, num_blocks, p_btd, w_d, eps):
  """Output [B, T, d] in p's dtype and the statistics (probs, r, s), each [N + 1, B, T] fp32,
  with the partial sum in the last row."""
  r_blocks, s_blocks = _source_stats(blocks_nbtd, w_d, eps)
  r_p, s_p = _source_stats(p_btd, w_d, eps)
  valid_n = jnp.arange(blocks_nbtd.shape[0]) < num_blocks
  scores = jnp.concatenate([jnp.where(valid_n[:, None, None], s_blocks, -jnp.inf), s_p[None]])
  probs = jax.nn.softmax(scores, axis=0)            # the partial sum is always valid
  # A sum of per-slot products, not a reduction over the slot axis: elementwise, so that the
  # consumer's RMSNorm fuses it as a producer (a reduction over slots fused with the norm's
  # reduction over d runs several times slower on GPUs).
  out = probs[-1, ..., None] * p_btd.astype(jnp.float32)
  for i in range(blocks_nbtd.shape[0]):
    out = out + probs[i, ..., None] * blocks_nbtd[i].astype(jnp.float32)
  r = jnp.concatenate([r_blocks, r_p[None]])
  s = jnp.concatenate([s_blocks, s_p[None]])
  return out.astype(p_btd.dtype), (probs, r, s)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _mix(blocks_nbtd, num_blocks, p_btd, query_d, gain_d, eps):
  w = gain_d.astype(jnp.float32) * query_d.astype(jnp.float32)
  return _mix_forward(blocks_nbtd, num_blocks, p_btd, w, eps)[0]


def _mix_fwd(blocks_nbtd, num_blocks, p_btd, query_d, gain_d, eps):
  w = gain_d.astype(jnp.float32) * query_d.astype(jnp.float32)
  out, stats = _mix_forward(blocks_nbtd, num_blocks, p_btd, w, eps)
  stats = tuple(remat.tag(x, remat.ATTNRES_STATS) for x in stats)
  return out, (blocks_nbtd, num_blocks, p_btd, query_d, gain_d, stats)


def _mix_bwd(eps, residuals, g_btd):
  """Gradients from the statistics: with π the weights, r the inverse RMS and s = r (v · w),

    ∂L/∂π_i = g · v_i,   ∂L/∂s_i = π_i (∂L/∂π_i − Σ_j π_j ∂L/∂π_j),
    ∂L/∂v_i = π_i g + (∂L/∂s_i) (r_i w − s_i r_i² v_i / d),   ∂L/∂w = Σ (∂L/∂s_i) r_i v_i.
  """
  del eps
  blocks_nbtd, num_blocks, p_btd, query_d, gain_d, (probs, r, s) = residuals
  d = p_btd.shape[-1]
  g32 = g_btd.astype(jnp.float32)
  w = gain_d.astype(jnp.float32) * query_d.astype(jnp.float32)
  b32, p32 = blocks_nbtd.astype(jnp.float32), p_btd.astype(jnp.float32)
  dprobs = jnp.concatenate([jnp.sum(g32 * b32, axis=-1), jnp.sum(g32 * p32, axis=-1)[None]])
  dscores = probs * (dprobs - jnp.sum(probs * dprobs, axis=0, keepdims=True))
  c = dscores * r                                   # coefficient of w, and of v in ∂L/∂w
  e = dscores * s * r * r / d                       # coefficient of v from the RMS

  def source_grad(i, v32):
    return probs[i, ..., None] * g32 + c[i, ..., None] * w - e[i, ..., None] * v32

  d_blocks = source_grad(slice(None, -1), b32).astype(blocks_nbtd.dtype)
  d_p = source_grad(-1, p32).astype(p_btd.dtype)
  dw = jnp.sum(c[:-1, ..., None] * b32, axis=(0, 1, 2)) + jnp.sum(c[-1, ..., None] * p32, axis=(0, 1))
  d_query = (dw * gain_d.astype(jnp.float32)).astype(query_d.dtype)
  d_gain = (dw * query_d.astype(jnp.float32)).astype(gain_d.dtype)
  return d_blocks, None, d_p, d_query, d_gain


_mix.defvjp(_mix_fwd, _mix_bwd)


@jax.named_scope("attnres")
def mix_stream(blocks_nbtd: jax.Array, num_blocks: jax.Array | int, p_btd: jax.Array,
               query_d: jax.Array, gain_d: jax.Array, eps: float) -> jax.Array:
  """`attn_res_mix(with_partial(blocks, num_blocks, p), num_blocks + 1, ...)` without building
  the sources buffer, with an explicit VJP; in p's dtype."""
  return _mix(blocks_nbtd, jnp.asarray(num_blocks, jnp.int32), p_btd, query_d, gain_d, eps)


# ----------------------------------------------------------------------------- sites and stream


class AttnResMix(nnx.Module):
  """One mixing site: a zero-initialised pseudo-query w [d] and an RMSNorm gain γ [d]."""

  def __init__(self, d_model: int, *, eps: float, param_dtype=jnp.float32, rngs: nnx.Rngs):
    self.eps = eps
    self.query = layers.param(rngs, nnx.initializers.zeros, (d_model,), (ax.EMBED,), param_dtype)
    self.norm_scale = layers.param(rngs, nnx.initializers.ones, (d_model,), (ax.EMBED,), param_dtype)

  def __call__(self, stream) -> jax.Array:
    """The mix over the stream's sources blocks[:num_blocks] + [p], [B, T, d]."""
    blocks, num_blocks, p = stream
    return mix_stream(blocks, num_blocks, p, self.query[...], self.norm_scale[...], self.eps)


def init_stream(embed_btd: jax.Array, max_blocks: int):
  """(blocks [max_blocks, B, T, d] zeros, num_blocks 0, partial sum p = embedding)."""
  blocks = jnp.zeros((max_blocks,) + embed_btd.shape, embed_btd.dtype)
  return blocks, jnp.zeros((), jnp.int32), embed_btd


def with_partial(blocks_nbtd: jax.Array, num_blocks: jax.Array, p_btd: jax.Array) -> jax.Array:
  """The sources as one buffer (valid count num_blocks + 1): blocks with p written into slot
  num_blocks, one slot longer than blocks so that a full buffer has room for p."""
  room = jnp.concatenate([blocks_nbtd, jnp.zeros_like(blocks_nbtd[:1])])
  return jax.lax.dynamic_update_index_in_dim(room, p_btd, num_blocks, axis=0)


def maybe_start_block(stream, layer_index: jax.Array, block_size: int):
  """At a block start (layer_index % block_size == 0) close the running sum into the block list.

  Touches one slot of the buffer (an in-place update inside a scan), not the whole buffer.
  """
  blocks, num_blocks, p = stream
  start = (layer_index % block_size) == 0
  slot = jax.lax.dynamic_index_in_dim(blocks, num_blocks, axis=0, keepdims=False)
  blocks = jax.lax.dynamic_update_index_in_dim(blocks, jnp.where(start, p, slot), num_blocks, axis=0)
  return blocks, num_blocks + start.astype(jnp.int32), jnp.where(start, jnp.zeros_like(p), p)


def max_blocks(num_layers: int, block_size: int) -> int:
  """Block slots needed: one per block start (the embedding is block 0)."""
  return -(-num_layers // block_size)


def max_sources(num_layers: int, block_size: int) -> int:
  """Sources a site can see at most: every block plus the running partial sum."""
  return max_blocks(num_layers, block_size) + 1
