"""Flash attention for gated NoPE MLA: document masking, causal or not, query shards with an
offset, and the exact per-head max logit (for QK-Clip) from the same pass.

Backends: "reference" (dense oracle), "xla" (blockwise pure JAX), "pallas_gpu" (Pallas-Triton
kernels with segment-aware block skipping), "cudnn" (cuDNN packed varlen attention + the Pallas
max-logit pass), "pallas_tpu" (splash attention + a max-logit pass) and "auto" (see
op.resolve_backend). Measurements: benchmarks/attention.md.
"""

from pallas_kernels.attention.op import BACKENDS, attention, resolve_backend
from pallas_kernels.attention.reference import attention_reference

__all__ = ["BACKENDS", "attention", "attention_reference", "resolve_backend"]
