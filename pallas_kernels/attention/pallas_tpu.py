"""The "pallas_tpu" backend: splash attention (jax.experimental.pallas.ops.tpu.splash_attention)
for out and its gradients, plus the blockwise max-logit pass of xla.py for max_logit.

Splash takes segment ids and a static causal mask (CausalMask with offset = q_offset), Dk ≠ Dv
(its kernels size the value tiles by Dv), and has its own custom_vjp. The softmax scale is
applied to q before the kernel. Splash gives rows with no allowed key a uniform average
(it masks with a finite value); those rows are set to 0 here with the max-logit pass's row maxima
(−inf exactly on such rows), which also zeroes their cotangents.

Falls back to the xla backend (same results) when splash cannot express the call: a traced
q_offset (the mask is static), or Tq / Tk without a block of at least MIN_BLOCK rows dividing
them.

Verification status: the splash path runs in Pallas' TPU interpret mode on CPU in the tests
(outputs, gradients and max_logit against the reference). It has not been compiled by Mosaic or
timed on a TPU; the block sizes are splash's defaults, untuned.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

from pallas_kernels.attention import xla

MIN_BLOCK = 128   # smallest splash block used (the TPU lane width)


@dataclasses.dataclass(frozen=True)
class Config:
  """Largest splash blocks (each shrunk by halving until it divides the sequence length) and the
  key block of the max-logit pass."""
  block_q: int = 512
  block_kv: int = 512
  max_logit_block_k: int = 512


CONFIG = Config()


def _fit(block: int, t: int) -> int | None:
  while block >= MIN_BLOCK and t % block:
    block //= 2
  return block if block >= MIN_BLOCK else None


def splash_blocks(tq: int, tk: int, config: Config) -> splash.BlockSizes | None:
  """Splash block sizes for these lengths, or None when no block ≥ MIN_BLOCK divides them."""
  bq, bkv = _fit(config.block_q, tq), _fit(config.block_kv, tk)
  if bq is None or bkv is None:
    return None
  return splash.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq,
                           block_kv_dkv=bkv, block_kv_dkv_compute=bkv, block_q_dq=bq,
                           block_kv_dq=bkv)


def attention_pallas_tpu(q, k, v, q_seg, kv_seg, q_last, *, scale: float, causal: bool,
                         q_offset: int | None, config: Config | None = None,
                         interpret: bool = False):
  """(out [B,Tq,H,Dv] in q's dtype, row_max [B,H,Tq]) on the canonical form (op.py); q_offset is
  the static offset (None when traced: falls back to xla). Differentiable in q, k, v."""
  config = CONFIG if config is None else config
  b, tq, h, _ = q.shape
  tk = k.shape[1]
  blocks = splash_blocks(tq, tk, config)
  if q_offset is None or blocks is None:
    return xla.attention_xla(q, k, v, q_seg, kv_seg, q_last, scale=scale)
  row_max_bhq = xla.row_max_xla(q, k, q_seg, kv_seg, q_last, scale=scale,
                                block_k=config.max_logit_block_k)
  if causal:
    masks = [splash_mask.CausalMask((tq, tk), offset=q_offset) for _ in range(h)]
  else:
    masks = [splash_mask.FullMask((tq, tk)) for _ in range(h)]
  kernel = splash.make_splash_mha(splash_mask.MultiHeadMask(masks), block_sizes=blocks,
                                  head_shards=1, q_seq_shards=1, interpret=interpret)

  def one_row(q_hqd, k_hkd, v_hke, seg_q, seg_k):
    return kernel(q_hqd, k_hkd, v_hke, segment_ids=splash.SegmentIds(seg_q, seg_k))

  q_scaled = q * jnp.asarray(scale, q.dtype)
  to_heads = lambda x: jnp.swapaxes(x, 1, 2)                 # [B, T, H, D] → [B, H, T, D]
  out_bhqe = jax.vmap(one_row)(to_heads(q_scaled), to_heads(k), to_heads(v), q_seg, kv_seg)
  out_bqhe = to_heads(out_bhqe)
  has_key_bqh1 = jnp.swapaxes(row_max_bhq > -jnp.inf, 1, 2)[..., None]
  out_bqhe = jnp.where(has_key_bqh1, out_bqhe, jnp.zeros((), out_bqhe.dtype))
  return out_bqhe.astype(q.dtype), row_max_bhq
