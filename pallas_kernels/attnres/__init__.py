"""Block Attention Residuals mixing (docs/maths.md §3): the softmax mix of a site over the stream's
completed block sums and its running partial sum, with an explicit backward.

Backends: "xla" (pure JAX, runs anywhere), "pallas_gpu" (the backward as one Pallas-Triton
kernel that skips the empty block slots and adds into the incoming cotangents in place) and
"auto" (see op.resolve_backend). The oracle is reference.attn_res_mix. There is no pallas_tpu
module: on TPUs "auto" takes "xla". Measurements: benchmarks/attnres.md.
"""

from pallas_kernels.attnres.op import BACKENDS, mix_pass, mix_stream, resolve_backend
from pallas_kernels.attnres.reference import attn_res_mix

__all__ = ["BACKENDS", "attn_res_mix", "mix_pass", "mix_stream", "resolve_backend"]
