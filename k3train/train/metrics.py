"""Training FLOPs per token (explicit formula), MFU and a small progress formatter.

Forward FLOPs per token =
    2 · (active matmul parameters, i.e. active params minus the embedding table)
  + Σ_MLA layers  H · (d_nope + d_rope + d_v) · T                 (causal QKᵀ and PV: 2·H·(dqk+dv)·T/2)
  + Σ_KDA layers  H · (6·K·V + 3·C·K + 2·C·V)                      (chunked WY form, chunk C:
        A_kk and A_qk 2CK, W and U C(K+V), W·S₀ + Q·S₀ + state update 6KV, A_qk·Δ CV)
  + vision forward FLOPs per row / T                               (model.vision on, below)
Training FLOPs per token = 3 × forward (backward = 2 × forward). Packing only lowers the true
attention cost, so this is an upper bound for packed batches.

Vision forward FLOPs per row, at the row's patch budget P = data.vision.max_patches_per_row (the
tower runs on all P patch slots; padding slots are counted too):
    2 · P · (588·D + L·(3·D·H·K + H·K·D + 2·D·F))                   patch embedding, q/k/v, o, MLP
  + 4 · L · P · H · K · S                                           QKᵀ and PV, bidirectional, over
        S = min(P, the largest grid: max(max_patches, frames_per_chunk · max_video_frame_patches))
  + 2 · (P/4) · (4D·4D + 4D·d)                                      PatchMergerMLPV2
"""

from __future__ import annotations

import math

import ml_collections

from k3train import config as config_lib


def forward_flops_per_token(cfg: ml_collections.ConfigDict, active_params: int, embedding_params: int,
                            seq_len: int) -> float:
  m = cfg.model
  sched = config_lib.layer_schedule(m)
  a, k = m.mla, m.kda
  mla = a.num_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim + a.v_head_dim) * seq_len
  c = min(k.chunk_size, seq_len)
  kda = k.num_heads * (6 * k.head_dim * k.head_dim + 3 * c * k.head_dim + 2 * c * k.head_dim)
  text = 2.0 * (active_params - embedding_params) + sched.num_mla * mla + sched.num_kda * kda
  return text + vision_forward_flops_per_row(cfg) / seq_len


def vision_forward_flops_per_row(cfg: ml_collections.ConfigDict) -> float:
  """Forward FLOPs of the vision tower and projector for one batch row (module docstring); 0
  without model.vision."""
  w, v = cfg.model.vision, cfg.data.vision
  if not w.enabled:
    return 0.0
  d, h, k, f, n_layers = w.d_model, w.num_heads, w.head_dim, w.mlp_hidden, w.num_layers
  p = v.max_patches_per_row
  span = min(p, max(v.max_patches, v.frames_per_chunk * v.max_video_frame_patches))
  patch_dim = 3 * w.patch_size * w.patch_size
  matmul = 2.0 * p * (patch_dim * d + n_layers * (3 * d * h * k + h * k * d + 2 * d * f))
  attention = 4.0 * n_layers * p * h * k * span
  projector = 2.0 * (p // 4) * (4 * d * 4 * d + 4 * d * cfg.model.d_model)
  return matmul + attention + projector


def train_flops_per_token(cfg, active_params: int, embedding_params: int, seq_len: int) -> float:
  return 3.0 * forward_flops_per_token(cfg, active_params, embedding_params, seq_len)


# Dense bf16 peak FLOP/s of one device (datasheet values without structured sparsity), found by
# a substring of jax's `device_kind`; the first match wins, so the longer names come first.
PEAK_BF16_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("TPU v6 lite", 918e12),      # v6e
    ("TPU v5 lite", 197e12),      # v5e
    ("TPU v5", 459e12),           # v5p
    ("TPU v4", 275e12),
)


def peak_flops_per_device(configured: float, device_kind: str) -> float | None:
  """The peak MFU divides by: `train.peak_flops_per_device` when > 0, else the table's value for
  this device kind; None for a kind the table does not know (e.g. CPU): no MFU then."""
  if configured and configured > 0:
    return float(configured)
  for fragment, peak in PEAK_BF16_FLOPS:
    if fragment.lower() in device_kind.lower():
      return peak
  return None


def describe_peak(configured: float, device_kind: str) -> str:
  """One line for the run's log: which peak MFU uses, and where it comes from."""
  peak = peak_flops_per_device(configured, device_kind)
  if peak is None:
    return (f"MFU: not reported (no peak known for device kind {device_kind!r}; set "
            "train.peak_flops_per_device)")
  source = "train.peak_flops_per_device" if configured and configured > 0 else "the device-kind table"
  return f"MFU: against {peak / 1e12:,.0f} TFLOP/s per device ({device_kind!r}, {source})"


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops_per_device: float | None,
        num_devices: int) -> float:
  """Model FLOPs utilisation; NaN without a known peak."""
  if not peak_flops_per_device or peak_flops_per_device <= 0:
    return math.nan
  return tokens_per_s * flops_per_token / (peak_flops_per_device * num_devices)


def format_eta(seconds: float) -> str:
  if not math.isfinite(seconds) or seconds < 0:
    return "?"
  h, rem = divmod(int(seconds), 3600)
  mnt, s = divmod(rem, 60)
  return f"{h}h{mnt:02d}m{s:02d}s" if h else f"{mnt}m{s:02d}s"
