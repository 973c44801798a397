"""The "cudnn" backend: cuDNN's packed (varlen) flash attention for out and its gradients, the
Pallas max-logit pass (pallas_gpu.row_max_pallas_gpu) for max_logit.

cuDNN's packed layout runs each document as its own sequence (q/kv offsets and lengths per
document), so no cross-document tile is ever computed. Documents are the runs of equal segment
ids along T, found here with a static cap of MAX_SEGMENTS runs per row. That equals the op's
"same id" rule exactly when no id comes back after a different one; both conditions (at most
MAX_SEGMENTS runs, no repeated id) are checked at run time, and calls that fail them take the
pallas_gpu kernels instead (a `lax.cond`, so one compiled program serves both).

Statically, only self-attention goes to cuDNN: Tq == Tk, one segment array for queries and keys,
q_offset 0 (static), 16-bit inputs, head dims multiples of 8 and ≤ 256; anything else is the
pallas_gpu path. The gradient is the one jax defines for its cuDNN call; the max-logit pass
carries none.

v is zero-padded to Dk when Dv ≠ Dk: jax 0.11's packed-layout wrapper scales the kv offsets by
the head dim of q/k for v too, so an unpadded narrower v is read out of bounds (an illegal
address on an H200, cuDNN 9.19).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.attention import pallas_gpu


@dataclasses.dataclass(frozen=True)
class Config:
  max_segments: int = 16   # static cap on documents per row (cuDNN's [B, M] offsets)


CONFIG = Config()


def supports_static(tq: int, tk: int, dk: int, dv: int, dtype, same_segments: bool,
                    static_offset) -> bool:
  """Whether a call can use cuDNN at all (before the run-time segment checks)."""
  return (tq == tk and same_segments and static_offset == 0
          and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
          and dk % 8 == 0 and dv % 8 == 0 and dv <= dk <= 256)


def segment_runs(seg_bt: jax.Array, max_segments: int):
  """Documents of each row as cuDNN's packed-layout arguments.

  seg [B, T] int → (ok [] bool: every row has ≤ max_segments runs of equal ids and no id in two
  runs, lengths [B, M] int32 (−1 past the row's runs), offsets [B, M + 1] int32 (run starts,
  −1 past the row's runs and in the last column)), M = max_segments.
  """
  b, t = seg_bt.shape
  m = max_segments
  pos_t = jnp.arange(t, dtype=jnp.int32)
  new_bt = jnp.concatenate([jnp.ones((b, 1), bool), seg_bt[:, 1:] != seg_bt[:, :-1]], axis=1)
  run_bt = jnp.cumsum(new_bt, axis=1, dtype=jnp.int32) - 1
  count_b = run_bt[:, -1] + 1
  slot_bt = jnp.where(new_bt, run_bt, m)                    # non-starts go to a dropped slot
  rows_b1 = jnp.arange(b)[:, None]
  starts_bm = jnp.full((b, m), -1, jnp.int32).at[rows_b1, slot_bt].set(
      jnp.broadcast_to(pos_t, (b, t)), mode="drop")
  ids_bm = jnp.zeros((b, m), seg_bt.dtype).at[rows_b1, slot_bt].set(seg_bt, mode="drop")
  valid_bm = jnp.arange(m)[None, :] < count_b[:, None]
  next_bm = jnp.concatenate([starts_bm[:, 1:], jnp.full((b, 1), -1, jnp.int32)], axis=1)
  ends_bm = jnp.where(next_bm >= 0, next_bm, t)
  lengths_bm = jnp.where(valid_bm, ends_bm - starts_bm, -1)
  pair_bmm = valid_bm[:, :, None] & valid_bm[:, None, :] & ~jnp.eye(m, dtype=bool)[None]
  repeated = jnp.any(pair_bmm & (ids_bm[:, :, None] == ids_bm[:, None, :]))
  ok = jnp.all(count_b <= m) & ~repeated
  offsets_bm1 = jnp.concatenate([starts_bm, jnp.full((b, 1), -1, jnp.int32)], axis=1)
  return ok, lengths_bm, offsets_bm1


def _cudnn_out(q, k, v, lengths_bm, offsets_bm1, *, scale, causal):
  from jax._src.cudnn import fused_attention_stablehlo as cudnn_fa
  dv = v.shape[3]
  if dv != q.shape[3]:
    v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, q.shape[3] - dv)))
  mask = cudnn_fa.MaskType.CAUSAL if causal else cudnn_fa.MaskType.NO_MASK
  out = cudnn_fa.dot_product_attention(q, k, v, q_seqlen=lengths_bm, kv_seqlen=lengths_bm,
                                       q_offsets=offsets_bm1, kv_offsets=offsets_bm1,
                                       scale=scale, mask_type=mask)
  return out[..., :dv]


def attention_cudnn(q, k, v, seg, q_last, *, scale: float, causal: bool,
                    config: Config | None = None, gpu_config=None):
  """(out [B,T,H,Dv], row_max [B,H,T]) for self-attention on the canonical form (op.py; seg is
  both q_seg and kv_seg). Differentiable in q, k, v. GPU only (no interpret mode)."""
  config = CONFIG if config is None else config
  ok, lengths_bm, offsets_bm1 = segment_runs(seg, config.max_segments)

  def with_cudnn(q, k, v):
    out = _cudnn_out(q, k, v, lengths_bm, offsets_bm1, scale=scale, causal=causal)
    row_max = pallas_gpu.row_max_pallas_gpu(q, k, seg, seg, q_last, scale=scale,
                                            config=gpu_config)
    return out, row_max

  def with_pallas(q, k, v):
    return pallas_gpu.attention_pallas_gpu(q, k, v, seg, seg, q_last, scale=scale,
                                           config=gpu_config)

  return lax.cond(ok, with_cudnn, with_pallas, q, k, v)
