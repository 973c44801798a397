"""SiTU-GLU, the gated activation of every K3 FFN (docs/maths.md §5.4), with an optional
per-row scale (the routed experts' routing weight):

  h = β₁·tanh(g/β₁)·σ(g) · β₂·tanh(u/β₂) · r        (β₂ None: the up branch is u itself)

Backends: "xla" (pure JAX, autodiff), "pallas_gpu" (one Pallas-Triton kernel forward and one
backward, the backward recomputing every term from g and u: nothing but the inputs is kept and
no fp32 intermediate reaches memory) and "auto" (op.resolve_backend). The oracle is
reference.situ_glu. There is no pallas_tpu module: on TPUs "auto" takes "xla". Measurements:
benchmarks/situ_glu.md.
"""

from pallas_kernels.situ_glu.op import BACKENDS, resolve_backend, situ_glu, value_and_grads
from pallas_kernels.situ_glu.reference import situ_glu as reference_situ_glu

__all__ = ["BACKENDS", "reference_situ_glu", "resolve_backend", "situ_glu", "value_and_grads"]
