"""Quantile Balancing's order statistics (docs/maths.md §5.3): per token the (k+1)-th largest
biased score (the cutoff), then per expert the (q+1)-th largest margin s − cutoff over real
tokens, exact to the bit.

Backends: "xla" (radix selection in pure JAX, any device and any sharding: each round needs only
per-expert counts), "pallas_gpu" (the same radix selection as two Pallas-Triton kernels: one
pass over token rows for the cutoffs and margins, one program per expert for the quantile) and
"auto" (see op.resolve_backend). The oracle is reference.margin_quantile (sorts). There is no
pallas_tpu module: on TPUs "auto" takes "xla". Measurements: benchmarks/qb_bisection.md.
"""

from pallas_kernels.qb.op import BACKENDS, margin_quantile, resolve_backend
from pallas_kernels.qb.reference import margin_quantile as margin_quantile_reference

__all__ = ["BACKENDS", "margin_quantile", "margin_quantile_reference", "resolve_backend"]
