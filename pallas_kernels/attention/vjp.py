"""One custom_vjp for the blockwise attention backends (xla and the Pallas GPU kernels).

A backend supplies
  forward(q, k, v, q_seg, kv_seg, q_last, *, scale, options) -> (out, lse, row_max)
  backward(q, k, v, q_seg, kv_seg, q_last, out, lse, dout, *, scale, options) -> (dq, dk, dv)
on the canonical form of op.py (q [B,Tq,H,Dk], k [B,Tk,H,Dk], v [B,Tk,H,Dv]; lse and row_max
[B,H,Tq] in the compute dtype, -inf for rows with no allowed key). The backward is the
flash-attention one: probabilities are recomputed from the saved logsumexp, nothing of size
Tq × Tk is kept. row_max (the per-row maximum logit, from which the op takes max_logit) has no
gradient: its cotangent is dropped.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
from jax.ad_checkpoint import checkpoint_name

# The name the forward's residuals (output and log-sum-exp) carry, so that a remat policy can keep
# them instead of running the forward kernel again in the backward pass.
RESIDUAL_NAME = "attention_residuals"


def differentiable_attention(forward: Callable, backward: Callable) -> Callable:
  """Returns attn(q, k, v, q_seg, kv_seg, q_last, scale, options) -> (out, row_max [B,H,Tq]).

  scale (a Python float) and options (hashable backend settings) are static; the integer
  inputs get no cotangent.
  """

  @functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
  def attn(q, k, v, q_seg, kv_seg, q_last, scale, options):
    out, _, row_max = forward(q, k, v, q_seg, kv_seg, q_last, scale=scale, options=options)
    return out, row_max

  def attn_fwd(q, k, v, q_seg, kv_seg, q_last, scale, options):
    out, lse, row_max = forward(q, k, v, q_seg, kv_seg, q_last, scale=scale, options=options)
    out, lse = checkpoint_name(out, RESIDUAL_NAME), checkpoint_name(lse, RESIDUAL_NAME)
    return (out, row_max), (q, k, v, q_seg, kv_seg, q_last, out, lse)

  def attn_bwd(scale, options, res, cotangents):
    dout, _ = cotangents                      # row_max: no gradient
    q, k, v, q_seg, kv_seg, q_last, out, lse = res
    dq, dk, dv = backward(q, k, v, q_seg, kv_seg, q_last, out, lse, dout.astype(out.dtype),
                          scale=scale, options=options)
    return dq, dk, dv, None, None, None

  attn.defvjp(attn_fwd, attn_bwd)
  return attn
