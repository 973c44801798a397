"""The mix of one site in pure JAX: the forward with its statistics, and the backward from them.

The stream a site reads is (blocks [N, B, T, d], num_blocks, partial sum p [B, T, d]); its
sources are blocks[:num_blocks] + [p]. Neither direction builds that sources buffer. The forward
keeps three [N + 1, B, T] fp32 statistics per source (mixing weight π, inverse RMS r, score
s = r (v · w)), the partial sum in the last row, so that the backward needs no pass over the
sources to recompute them.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

F32 = jnp.float32


def source_stats(v_btd: jax.Array, w_d: jax.Array, eps: float):
  """(inverse RMS r, score s = r · (v · w)) of one source, [..., B, T] fp32, in one pass."""
  v32 = v_btd.astype(F32)
  r = jax.lax.rsqrt(jnp.mean(v32 * v32, axis=-1) + eps)
  return r, r * jnp.sum(v32 * w_d, axis=-1)


def mix_forward(blocks_nbtd, num_blocks, p_btd, w_d, eps):
  """Output [B, T, d] in p's dtype and the statistics (probs, r, s), each [N + 1, B, T] fp32,
  with the partial sum in the last row. Slots at or past num_blocks get weight 0."""
  r_blocks, s_blocks = source_stats(blocks_nbtd, w_d, eps)
  r_p, s_p = source_stats(p_btd, w_d, eps)
  valid_n = jnp.arange(blocks_nbtd.shape[0]) < num_blocks
  scores = jnp.concatenate([jnp.where(valid_n[:, None, None], s_blocks, -jnp.inf), s_p[None]])
  probs = jax.nn.softmax(scores, axis=0)            # the partial sum is always valid
  # A sum of per-slot products, not a reduction over the slot axis: elementwise, so that the
  # consumer's RMSNorm fuses it as a producer (a reduction over slots fused with the norm's
  # reduction over d runs several times slower on GPUs).
  out = probs[-1, ..., None] * p_btd.astype(F32)
  for i in range(blocks_nbtd.shape[0]):
    out = out + probs[i, ..., None] * blocks_nbtd[i].astype(F32)
  r = jnp.concatenate([r_blocks, r_p[None]])
  s = jnp.concatenate([s_blocks, s_p[None]])
  return out.astype(p_btd.dtype), (probs, r, s)


def score_coefficients(probs: Sequence, dprobs: Sequence, r: Sequence, s: Sequence, d: int):
  """Per source i, the coefficients (c_i, e_i) of ∂L/∂v_i = π_i g + c_i w − e_i v_i, from the
  weights π_i, ∂L/∂π_i = g · v_i, the inverse RMS r_i and the score s_i (each a sequence over
  sources of equal-shaped arrays):

    ∂L/∂s_i = π_i (∂L/∂π_i − Σ_j π_j ∂L/∂π_j),   c_i = r_i ∂L/∂s_i,   e_i = s_i r_i² ∂L/∂s_i / d.

  c_i is also the coefficient of v_i in ∂L/∂w = Σ_i c_i v_i.
  """
  mean = sum(pi * dp for pi, dp in zip(probs, dprobs))
  ds = [pi * (dp - mean) for pi, dp in zip(probs, dprobs)]
  return ([dsi * ri for dsi, ri in zip(ds, r)],
          [dsi * si * ri * ri / d for dsi, si, ri in zip(ds, s, r)])


def mix_backward(blocks_nbtd, p_btd, w_d, stats, g_btd, ct_blocks_nbtd, ct_p_btd):
  """(ct_blocks + ∂L/∂blocks, ct_p + ∂L/∂p, ∂L/∂w [d] fp32) of a site with output cotangent g:
  the source gradients added to the cotangents that reach the stream from later sites. Empty
  slots (π = 0) get nothing added."""
  probs, r, s = stats
  n, d = blocks_nbtd.shape[0], p_btd.shape[-1]
  g32 = g_btd.astype(F32)
  sources = [blocks_nbtd[i].astype(F32) for i in range(n)] + [p_btd.astype(F32)]
  dprobs = [jnp.sum(g32 * v, axis=-1) for v in sources]
  c, e = score_coefficients(list(probs), dprobs, list(r), list(s), d)
  grads = [probs[i, ..., None] * g32 + c[i][..., None] * w_d - e[i][..., None] * v
           for i, v in enumerate(sources)]
  ct_blocks = jnp.stack([ct_blocks_nbtd[i].astype(F32) + grads[i] for i in range(n)])
  ct_p = ct_p_btd.astype(F32) + grads[n]
  dw = sum(jnp.sum(c[i][..., None] * v, axis=tuple(range(v.ndim - 1)))
           for i, v in enumerate(sources))
  return ct_blocks.astype(ct_blocks_nbtd.dtype), ct_p.astype(ct_p_btd.dtype), dw
