"""Kimi Delta Attention (KDA) op: gated delta-rule linear attention with per-channel decay."""

from pallas_kernels.kda.op import BACKENDS, kda, kda_decode_step

__all__ = ["BACKENDS", "kda", "kda_decode_step"]
