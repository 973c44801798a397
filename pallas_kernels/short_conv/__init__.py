"""KDA's depthwise causal short conv (docs/maths.md §1, step 1), fp32 taps and fp32 weight
gradients in bf16 training.

Backends: "xla" (pure JAX, runs anywhere), "pallas_gpu" (the backward as a Pallas-Triton kernel
that gathers a tap's tokens by index: no padded copy, the weight gradient reduced in registers;
the forward XLA's fused pass, or a Triton kernel by launch setting) and "auto"
(op.resolve_backend). The oracle is reference.causal_conv. There is no
pallas_tpu module: on TPUs "auto" takes "xla". Measurements: benchmarks/short_conv.md.
"""

from pallas_kernels.short_conv.op import BACKENDS, causal_conv, resolve_backend
from pallas_kernels.short_conv.reference import causal_conv as reference_causal_conv

__all__ = ["BACKENDS", "causal_conv", "reference_causal_conv", "resolve_backend"]
