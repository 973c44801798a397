"""Per-row log-normaliser and target logit of a cross-entropy: lse = log Σ_v exp(x_v) and x_t.

The fused head loss (k3train/train/head_loss.py) needs both for every row of a chunk's fp32
logits [rows, V] (V = 163,840 for K3). Backends: "xla" (xla.py: XLA's reductions, which read the
logits twice: the maximum, then Σ exp with the target pick), "pallas_gpu" (pallas_gpu.py: one
Pallas-Triton pass with a running maximum, one exponential per element) and "auto" (op.py).
The oracle is reference.py (float64). Measurements: benchmarks/logsumexp.md.
"""

from pallas_kernels.logsumexp.op import BACKENDS, logsumexp_and_pick, resolve_backend
from pallas_kernels.logsumexp.reference import logsumexp_and_pick as logsumexp_and_pick_reference

__all__ = ["BACKENDS", "logsumexp_and_pick", "logsumexp_and_pick_reference", "resolve_backend"]
