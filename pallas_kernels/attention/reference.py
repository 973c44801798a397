"""Dense attention with document masking: the oracle every other backend is tested against.

Builds the whole [B, H, Tq, Tk] logit array, so it is only for tests and tiny shapes. The mask is
written straight from the definition (same segment id, and with `causal` key position ≤ query
position q_offset + i), independently of the canonical form the blockwise backends share.
Runs in fp32 for 16-bit and fp32 inputs and in fp64 for fp64 inputs (x64 enabled).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_HIGHEST = jax.lax.Precision.HIGHEST


def compute_dtype(dtype) -> jnp.dtype:
  """fp64 for fp64 inputs (oracle runs), fp32 for everything else."""
  if jax.dtypes.canonicalize_dtype(dtype) == jnp.float64:
    return jnp.dtype(jnp.float64)
  return jnp.dtype(jnp.float32)


def allowed_pairs(q_segment_ids, kv_segment_ids, *, causal: bool, q_offset) -> jax.Array:
  """allowed_bqk [B, Tq, Tk] bool: same document and, with `causal`, key j ≤ q_offset + i."""
  tq, tk = q_segment_ids.shape[1], kv_segment_ids.shape[1]
  same_bqk = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
  if not causal:
    return same_bqk
  pos_q = jnp.asarray(q_offset, jnp.int32) + jnp.arange(tq, dtype=jnp.int32)
  pos_k = jnp.arange(tk, dtype=jnp.int32)
  return same_bqk & (pos_k[None, None, :] <= pos_q[None, :, None])


def attention_reference(q_bqhd, k_bkhd, v_bkhe, q_segment_ids, kv_segment_ids, *, scale,
                        causal: bool = True, q_offset=0):
  """Softmax attention over the allowed pairs.

  q [B, Tq, H, Dk], k [B, Tk, H, Dk], v [B, Tk, H, Dv], segment ids [B, Tq] / [B, Tk] int.
  Returns (out [B, Tq, H, Dv] in q's dtype, max_logit [B, H] in the compute dtype): out rows with
  no allowed key are 0; max_logit is the maximum of scale·q·k over all allowed pairs of (b, h),
  -inf where there is none. Differentiable in q, k, v (max_logit carries no gradient).
  """
  dtype = compute_dtype(q_bqhd.dtype)
  q, k, v = (x.astype(dtype) for x in (q_bqhd, k_bkhd, v_bkhe))
  logits_bhqk = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=_HIGHEST) * jnp.asarray(scale, dtype)
  allowed_b1qk = allowed_pairs(q_segment_ids, kv_segment_ids, causal=causal,
                               q_offset=q_offset)[:, None]
  masked_bhqk = jnp.where(allowed_b1qk, logits_bhqk, -jnp.inf)
  max_logit_bh = jax.lax.stop_gradient(jnp.max(masked_bhqk, axis=(2, 3)))
  # Row maxima with empty rows set to 0 so exp never sees -inf - (-inf); the masked entries are
  # -inf before the exp, so neither the value nor its derivative can overflow there.
  row_max_bhq1 = jax.lax.stop_gradient(jnp.max(masked_bhqk, axis=3, keepdims=True))
  row_max_bhq1 = jnp.where(jnp.isfinite(row_max_bhq1), row_max_bhq1, 0.0)
  weights_bhqk = jnp.exp(masked_bhqk - row_max_bhq1)
  denom_bhq1 = jnp.sum(weights_bhqk, axis=3, keepdims=True)
  probs_bhqk = weights_bhqk / jnp.where(denom_bhq1 > 0, denom_bhq1, 1.0)
  out_bqhe = jnp.einsum("bhqk,bkhe->bqhe", probs_bhqk, v, precision=_HIGHEST)
  return out_bqhe.astype(q_bqhd.dtype), max_logit_bh
