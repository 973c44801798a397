"""Blockwise attention in plain JAX: the CPU path and the fallback everywhere.

One `lax.fori_loop` over key blocks of BLOCK_K keys, every query at once, online softmax: the
loop carries the output accumulator [B, Tq, H, Dv], the row maxima and the row sums, and one step
holds a [B, H, Tq, BLOCK_K] logit tile, so memory is linear in T. The loop runs only over the key
blocks that can hold an allowed pair (tiles.key_block_span). Tk is padded to a multiple of the
block internally; padding keys lie past every q_last and are never seen.

The backward (same custom_vjp as the kernels, vjp.py) is one loop over the same key blocks:
probabilities are recomputed from the saved logsumexp; dk and dv of a block are written into the
carried gradients, dq accumulates.

Numerics: 16-bit inputs are dot operands in their own dtype with fp32 accumulation (the
probabilities and dS are cast to that dtype before their dots, as in the kernels); fp32 and fp64
inputs run at full precision in their own dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.attention import tiles
from pallas_kernels.attention.reference import compute_dtype
from pallas_kernels.attention.vjp import differentiable_attention

BLOCK_K = 128   # keys per loop step (read by op.attention at each call)


def _precision(dtype):
  return None if jnp.dtype(dtype).itemsize < 4 else lax.Precision.HIGHEST


def _pad_keys(k, v, kv_seg, block_k: int):
  pad = -k.shape[1] % block_k
  if not pad:
    return k, v, kv_seg
  widths = ((0, 0), (0, pad), (0, 0), (0, 0))
  return (jnp.pad(k, widths), jnp.pad(v, widths),
          jnp.pad(kv_seg, ((0, 0), (0, pad)), mode="edge"))


def _tile(q, k_blk, q_seg, kv_seg_blk, q_last, start, scale, cdt):
  """Masked logits [B, H, Tq, bk] of one key block (−inf where not allowed) and the mask."""
  s_bhqk = jnp.einsum("bqhd,bkhd->bhqk", q, k_blk, preferred_element_type=cdt,
                      precision=_precision(q.dtype)) * jnp.asarray(scale, cdt)
  cols_k = start + jnp.arange(k_blk.shape[1], dtype=jnp.int32)
  ok_bqk = ((q_seg[:, :, None] == kv_seg_blk[:, None, :])
            & (cols_k[None, None, :] <= q_last[None, :, None]))
  ok_b1qk = ok_bqk[:, None]
  return jnp.where(ok_b1qk, s_bhqk, -jnp.inf), ok_b1qk


def _slice_block(x, j, block_k):
  return lax.dynamic_slice_in_dim(x, j * block_k, block_k, axis=1)


def forward(q, k, v, q_seg, kv_seg, q_last, *, scale, options):
  """(out [B,Tq,H,Dv] in q's dtype, lse [B,H,Tq], row_max [B,H,Tq]) — see vjp.py."""
  block_k = options
  cdt = compute_dtype(q.dtype)
  b, tq, h, _ = q.shape
  dv = v.shape[3]
  k, v, kv_seg = _pad_keys(k, v, kv_seg, block_k)
  lo, hi = tiles.key_block_span(q_seg, kv_seg, q_last, block_k)

  def step(j, carry):
    acc_bqhe, m_bhq, l_bhq = carry
    k_blk, v_blk, seg_blk = (_slice_block(x, j, block_k) for x in (k, v, kv_seg))
    s_bhqk, _ = _tile(q, k_blk, q_seg, seg_blk, q_last, j * block_k, scale, cdt)
    m_new = jnp.maximum(m_bhq, jnp.max(s_bhqk, axis=3))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)      # empty so far: keep exp finite
    alpha_bhq = jnp.exp(m_bhq - m_use)
    p_bhqk = jnp.exp(s_bhqk - m_use[..., None])
    l_bhq = alpha_bhq * l_bhq + jnp.sum(p_bhqk, axis=3)
    pv_bqhe = jnp.einsum("bhqk,bkhe->bqhe", p_bhqk.astype(v.dtype), v_blk,
                         preferred_element_type=cdt, precision=_precision(v.dtype))
    acc_bqhe = jnp.swapaxes(alpha_bhq, 1, 2)[..., None] * acc_bqhe + pv_bqhe
    return acc_bqhe, m_new, l_bhq

  init = (jnp.zeros((b, tq, h, dv), cdt), jnp.full((b, h, tq), -jnp.inf, cdt),
          jnp.zeros((b, h, tq), cdt))
  acc_bqhe, m_bhq, l_bhq = lax.fori_loop(lo, hi, step, init)
  l_safe = jnp.where(l_bhq > 0, l_bhq, 1.0)
  out = acc_bqhe / jnp.swapaxes(l_safe, 1, 2)[..., None]
  lse_bhq = jnp.where(l_bhq > 0, m_bhq + jnp.log(l_safe), -jnp.inf)
  return out.astype(q.dtype), lse_bhq, m_bhq


def backward(q, k, v, q_seg, kv_seg, q_last, out, lse, dout, *, scale, options):
  """(dq, dk, dv) in the inputs' dtypes: one loop over the key blocks (see module doc)."""
  block_k = options
  cdt = compute_dtype(q.dtype)
  tk = k.shape[1]
  k_dtype, v_dtype = k.dtype, v.dtype
  k, v, kv_seg = _pad_keys(k, v, kv_seg, block_k)
  lo, hi = tiles.key_block_span(q_seg, kv_seg, q_last, block_k)
  delta_bhq = jnp.swapaxes(jnp.sum(dout.astype(cdt) * out.astype(cdt), axis=3), 1, 2)
  lse_use = jnp.where(lse == -jnp.inf, 0.0, lse)
  prec = _precision(q.dtype)

  def step(j, carry):
    dq_bqhd, dk_bkhd, dv_bkhe = carry
    k_blk, v_blk, seg_blk = (_slice_block(x, j, block_k) for x in (k, v, kv_seg))
    s_bhqk, ok_b1qk = _tile(q, k_blk, q_seg, seg_blk, q_last, j * block_k, scale, cdt)
    p_bhqk = jnp.where(ok_b1qk, jnp.exp(s_bhqk - lse_use[..., None]), 0.0)
    dv_blk = jnp.einsum("bhqk,bqhe->bkhe", p_bhqk.astype(dout.dtype), dout,
                        preferred_element_type=cdt, precision=prec)
    dp_bhqk = jnp.einsum("bqhe,bkhe->bhqk", dout, v_blk, preferred_element_type=cdt,
                         precision=prec)
    ds_bhqk = (p_bhqk * (dp_bhqk - delta_bhq[..., None])).astype(q.dtype)
    dk_blk = jnp.einsum("bhqk,bqhd->bkhd", ds_bhqk, q, preferred_element_type=cdt,
                        precision=prec)
    dq_bqhd = dq_bqhd + jnp.einsum("bhqk,bkhd->bqhd", ds_bhqk, k_blk,
                                   preferred_element_type=cdt, precision=prec)
    dk_bkhd = lax.dynamic_update_slice_in_dim(dk_bkhd, dk_blk, j * block_k, axis=1)
    dv_bkhe = lax.dynamic_update_slice_in_dim(dv_bkhe, dv_blk, j * block_k, axis=1)
    return dq_bqhd, dk_bkhd, dv_bkhe

  init = (jnp.zeros(q.shape, cdt), jnp.zeros(k.shape, cdt), jnp.zeros(v.shape, cdt))
  dq, dk, dv = lax.fori_loop(lo, hi, step, init)
  s = jnp.asarray(scale, cdt)
  return ((dq * s).astype(q.dtype), (dk[:, :tk] * s).astype(k_dtype),
          dv[:, :tk].astype(v_dtype))


_attention = differentiable_attention(forward, backward)


def attention_xla(q, k, v, q_seg, kv_seg, q_last, *, scale: float, block_k: int = BLOCK_K):
  """(out [B,Tq,H,Dv], row_max [B,H,Tq]) on the canonical form (op.py); differentiable in q, k,
  v. block_k is clipped to the (padded) key length so tiny inputs take one step."""
  block_k = min(block_k, _round_up(k.shape[1], 8))
  return _attention(q, k, v, q_seg, kv_seg, q_last, float(scale), block_k)


def row_max_xla(q, k, q_seg, kv_seg, q_last, *, scale: float, block_k: int = BLOCK_K):
  """row_max [B,H,Tq] only (the max-logit pass): maximum of scale·q·k over each row's allowed
  keys, −inf for rows with none; the same loop as the forward without softmax or values. No
  gradient."""
  block_k = min(block_k, _round_up(k.shape[1], 8))
  cdt = compute_dtype(q.dtype)
  b, tq, h, _ = q.shape
  q, k, q_seg, kv_seg = (lax.stop_gradient(x) for x in (q, k, q_seg, kv_seg))
  k, _, kv_seg = _pad_keys(k, k[..., :1], kv_seg, block_k)
  lo, hi = tiles.key_block_span(q_seg, kv_seg, q_last, block_k)

  def step(j, m_bhq):
    k_blk, seg_blk = _slice_block(k, j, block_k), _slice_block(kv_seg, j, block_k)
    s_bhqk, _ = _tile(q, k_blk, q_seg, seg_blk, q_last, j * block_k, float(scale), cdt)
    return jnp.maximum(m_bhq, jnp.max(s_bhqk, axis=3))

  return lax.fori_loop(lo, hi, step, jnp.full((b, h, tq), -jnp.inf, cdt))


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m
