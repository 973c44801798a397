"""Fused, chunked output head + cross-entropy: the loss without a [B, T, V] logits array.

`fused_head_cross_entropy(x_btd, w_dv, targets_bt, mask_bt, chunk_tokens=c, dtype=...)` equals
`cross_entropy(x · W)` (k3train/train/step.py) but computes the logits c sequence positions at a
time ([B, c, V], fp32 from a `dtype` GEMM with fp32 accumulation) inside one `lax.scan`, so no
[B, T, V] array — neither the logits nor their gradient — ever exists.

Chunks are strided: position t = j·(T/c) + k lies in chunk k, i.e. chunk k holds positions
k, k + T/c, k + 2·T/c, … of every row. Cross-entropy is a sum over positions, so the order does
not matter; strided chunks keep each chunk spread over the sequence shards when the sequence
axis is sharded (contiguous T-sharding splits the major factor c of T = c·(T/c)), so the scan
runs over an unsharded axis and every device works on every chunk. c must divide T (checked
here and by `k3train.config.validate` for `train.loss_chunk_tokens`); there is no padding.

Under differentiation the forward pass also computes the gradients, in the same chunk loop
(d_logits = (softmax − onehot) · mask / max(n, 1), rounded to `dtype` for the two GEMMs with fp32
accumulation, as `layers.low_precision_matmul` does): dx [B, T, d] in x's dtype and dW [d, V] in
fp32 are the residuals and the backward pass only scales them by the loss cotangent. The head is
therefore never recomputed and the backward pass stores nothing of size V per token. Without
differentiation (evaluation) the loop computes the loss only. `chunked_token_stats` runs the
same chunk loop for per-position evals: each position's cross-entropy and argmax, no gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from k3train.parallel import axes as ax
from k3train.parallel.rules import constrain
from pallas_kernels import logsumexp as logsumexp_op

CONFIG_KEY = "train.loss_chunk_tokens"


def fused_head_cross_entropy(x_btd: jax.Array, w_dv: jax.Array, targets_bt: jax.Array,
                             mask_bt: jax.Array, *, chunk_tokens: int, dtype,
                             lse_backend: str = "xla") -> tuple[jax.Array, jax.Array]:
  """(mean cross-entropy of softmax(x · W) over mask, number of counted tokens), both fp32.

  x [B, T, d] (normalised final hidden states), W [d, V] (the head kernel), targets [B, T] int,
  mask [B, T]; the logits are computed in `dtype` with fp32 accumulation, `chunk_tokens`
  positions of every row at a time. Gradients flow to x and W only; the count has none.
  lse_backend: who computes each row's log-normaliser and target logit
  (pallas_kernels.logsumexp: "xla", "pallas_gpu" or "auto"; `model.head_lse_backend`).
  """
  _check_inputs(x_btd, w_dv, targets_bt, chunk_tokens, mask_bt)
  logsumexp_op.resolve_backend(lse_backend)          # a bad name fails here, not in the loop
  mask_bt = mask_bt.astype(jnp.float32)
  loss = _fused_ce(x_btd, w_dv, targets_bt, mask_bt, chunk_tokens, jnp.dtype(dtype), lse_backend)
  return loss, jnp.sum(mask_bt)


def chunked_token_stats(x_btd: jax.Array, w_dv: jax.Array, targets_bt: jax.Array, *,
                        chunk_tokens: int, dtype,
                        lse_backend: str = "xla") -> tuple[jax.Array, jax.Array]:
  """(per-position cross-entropy nll [B, T] fp32, argmax of the logits [B, T] int32), no gradient.

  The logits of softmax(x · W) are computed as in `fused_head_cross_entropy` (`dtype` GEMM, fp32
  accumulation, the same strided chunks of `chunk_tokens` positions in one `lax.scan`), so no
  [B, T, V] array exists. The argmax is `jnp.argmax` over V of each chunk's fp32 logits: ties go
  to the lowest vocabulary index, as for the full logits. lse_backend: as for
  `fused_head_cross_entropy`.
  """
  _check_inputs(x_btd, w_dv, targets_bt, chunk_tokens)
  logsumexp_op.resolve_backend(lse_backend)
  dtype = jnp.dtype(dtype)
  w_dv = w_dv.astype(dtype)          # cast once, not in every chunk

  def body(_, xs):
    x_bcd, targets_bc = xs
    logits_bcv = _chunk_logits(x_bcd, w_dv, dtype)
    nll_bc, _, _ = _chunk_ce(logits_bcv, targets_bc, lse_backend)
    return None, (nll_bc, jnp.argmax(logits_bcv, axis=-1).astype(jnp.int32))

  chunks = (_to_chunks(x_btd, chunk_tokens), _to_chunks(targets_bt, chunk_tokens))
  _, (nll_nbc, argmax_nbc) = jax.lax.scan(body, None, chunks)
  return _from_chunks(nll_nbc), _from_chunks(argmax_nbc)


def _check_inputs(x_btd, w_dv, targets_bt, chunk_tokens: int, mask_bt=None):
  """Shapes x [B, T, d], W [d, V], targets (and mask) [B, T]; c a positive divisor of T."""
  b, t, d = x_btd.shape
  if w_dv.ndim != 2 or w_dv.shape[0] != d:
    raise ValueError(f"head kernel of shape {w_dv.shape} does not match hidden states {x_btd.shape}")
  if targets_bt.shape != (b, t) or (mask_bt is not None and mask_bt.shape != (b, t)):
    what = f"targets {targets_bt.shape}"
    if mask_bt is not None:
      what += f" and mask {mask_bt.shape}"
    raise ValueError(f"{what} must be [B, T] = {(b, t)}")
  if chunk_tokens < 1 or t % chunk_tokens:
    raise ValueError(f"{CONFIG_KEY}={chunk_tokens} must be a positive divisor of the sequence "
                     f"length T={t} (or 0 for the unfused head)")


# --- chunk layout -------------------------------------------------------------------------------


def _to_chunks(a_bt, chunk_tokens: int):
  """[B, T, ...] → [T/c, B, c, ...]: chunk k holds positions k, k + T/c, k + 2·T/c, …"""
  b, t = a_bt.shape[:2]
  a = a_bt.reshape(b, chunk_tokens, t // chunk_tokens, *a_bt.shape[2:])
  return jnp.moveaxis(a, 2, 0)


def _from_chunks(a_nbc):
  """Inverse of `_to_chunks`: [T/c, B, c, ...] → [B, T, ...]."""
  n, b, c = a_nbc.shape[:3]
  return jnp.moveaxis(a_nbc, 0, 2).reshape(b, c * n, *a_nbc.shape[3:])


# --- one chunk ----------------------------------------------------------------------------------


def _chunk_logits(x_bcd, w_dv, dtype):
  """fp32 logits [B, c, V] of one chunk: a `dtype` GEMM with fp32 accumulation."""
  x_bcd = constrain(x_bcd, ax.BATCH, ax.SEQ, ax.EMBED)
  logits = jax.lax.dot_general(x_bcd.astype(dtype), w_dv.astype(dtype), (((2,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32)
  return constrain(logits, ax.BATCH, ax.SEQ, ax.VOCAB)


def _chunk_ce(logits_bcv, targets_bc, lse_backend: str):
  """(per-token cross-entropy [B, c], log-normaliser [B, c], target one-hot [B, c, V]), fp32."""
  logz_bc, target_bc = logsumexp_op.logsumexp_and_pick(logits_bcv, targets_bc, backend=lse_backend)
  onehot_bcv = jax.lax.broadcasted_iota(jnp.int32, logits_bcv.shape, 2) == targets_bc[..., None]
  return logz_bc - target_bc, logz_bc, onehot_bcv


def _chunk_grads(x_bcd, w_dv, logits_bcv, logz_bc, onehot_bcv, weight_bc, dtype, x_dtype):
  """(dx [B, c, d] in x's dtype, dW [d, V] fp32) of Σ weight · CE over one chunk."""
  probs_bcv = jnp.exp(logits_bcv - logz_bc[..., None])
  dlogits_bcv = ((probs_bcv - onehot_bcv) * weight_bc[..., None]).astype(dtype)
  dlogits_bcv = constrain(dlogits_bcv, ax.BATCH, ax.SEQ, ax.VOCAB)
  # dx straight from the GEMM in x's dtype when that is the operands' (see layers._contract).
  written = x_dtype if jnp.dtype(x_dtype) == jnp.dtype(dtype) else jnp.float32
  dx_bcd = jax.lax.dot_general(dlogits_bcv, w_dv.astype(dtype), (((2,), (1,)), ((), ())),
                               preferred_element_type=written).astype(x_dtype)
  dw_dv = jax.lax.dot_general(x_bcd.astype(dtype), dlogits_bcv, (((0, 1), (0, 1)), ((), ())),
                              preferred_element_type=jnp.float32)
  return constrain(dx_bcd, ax.BATCH, ax.SEQ, ax.EMBED), constrain(dw_dv, ax.EMBED, ax.VOCAB)


# --- the loss and its custom VJP ------------------------------------------------------------


def _inverse_count(mask_bt):
  return 1.0 / jnp.maximum(jnp.sum(mask_bt), 1.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _fused_ce(x_btd, w_dv, targets_bt, mask_bt, chunk_tokens, dtype, lse_backend):
  """Mean masked cross-entropy, loss only (the primal: no gradient work)."""
  chunks = (_to_chunks(x_btd, chunk_tokens), _to_chunks(targets_bt, chunk_tokens),
            _to_chunks(mask_bt, chunk_tokens))
  w_c = w_dv.astype(dtype)           # cast once, not in every chunk

  def body(total, xs):
    x_bcd, targets_bc, mask_bc = xs
    ce_bc, _, _ = _chunk_ce(_chunk_logits(x_bcd, w_c, dtype), targets_bc, lse_backend)
    return total + jnp.sum(ce_bc * mask_bc), None

  total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), chunks)
  return total * _inverse_count(mask_bt)


def _fused_ce_fwd(x_btd, w_dv, targets_bt, mask_bt, chunk_tokens, dtype, lse_backend):
  """The loss plus dx and dW of the loss, from one pass over the chunks."""
  inv_n = _inverse_count(mask_bt)
  chunks = (_to_chunks(x_btd, chunk_tokens), _to_chunks(targets_bt, chunk_tokens),
            _to_chunks(mask_bt, chunk_tokens))

  w_c = w_dv.astype(dtype)           # cast once, not in every chunk (XLA leaves it in the loop)

  def body(carry, xs):
    total, dw_dv = carry
    x_bcd, targets_bc, mask_bc = xs
    logits_bcv = _chunk_logits(x_bcd, w_c, dtype)
    ce_bc, logz_bc, onehot_bcv = _chunk_ce(logits_bcv, targets_bc, lse_backend)
    dx_bcd, dw_chunk = _chunk_grads(x_bcd, w_c, logits_bcv, logz_bc, onehot_bcv, mask_bc * inv_n,
                                    dtype, x_btd.dtype)
    return (total + jnp.sum(ce_bc * mask_bc), dw_dv + dw_chunk), dx_bcd

  dw0 = constrain(jnp.zeros(w_dv.shape, jnp.float32), ax.EMBED, ax.VOCAB)
  (total, dw_dv), dx_nbcd = jax.lax.scan(body, (jnp.zeros((), jnp.float32), dw0), chunks)
  # A zero of W's dtype stands in for it (residuals must be arrays).
  return total * inv_n, (_from_chunks(dx_nbcd), dw_dv, jnp.zeros((), w_dv.dtype))


def _fused_ce_bwd(chunk_tokens, dtype, lse_backend, residuals, g):
  """Scale the forward's gradients by the loss cotangent; targets and mask get none."""
  dx_btd, dw_dv, w_like = residuals
  dx = (dx_btd.astype(jnp.float32) * g).astype(dx_btd.dtype)
  dw = (dw_dv * g).astype(w_like.dtype)
  return dx, dw, None, None


_fused_ce.defvjp(_fused_ce_fwd, _fused_ce_bwd)


__all__ = ["CONFIG_KEY", "chunked_token_stats", "fused_head_cross_entropy"]
