"""MoE ops: grouped matmul (`gmm`) and dropless sort-based token `dispatch` / `combine` (or
`sorted_pair_weights` + `combine_scaled` for experts that apply the routing weight themselves).

gmm backends (BACKENDS): "reference", "ragged_dot", "pallas_gpu", "pallas_tpu" and "auto"; see op.py.
`gmm_mx`: the grouped matmul on MX operands (MXFP8 activations, MXFP4 weights), MX_BACKENDS.
`count_ids`: rows per expert (group sizes, expert load) as a reduction, not a scatter-add.
GATHERS: who copies the dispatch's rows ("xla", "pallas_gpu", "auto"; permute.py).
"""

from pallas_kernels.moe.permute import GATHERS
from pallas_kernels.moe.op import (BACKENDS, MX_BACKENDS, combine, combine_scaled, count_ids,
                                   dispatch, gmm, gmm_mx, resolve_backend, sorted_pair_weights)

__all__ = ["BACKENDS", "GATHERS", "MX_BACKENDS", "combine", "combine_scaled", "count_ids",
           "dispatch", "gmm", "gmm_mx", "resolve_backend", "sorted_pair_weights"]
