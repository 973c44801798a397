"""MoE ops: grouped matmul (`gmm`) and dropless sort-based token `dispatch` / `combine`.

Backends now: "reference" (dense, readable) and "ragged_dot" (`jax.lax.ragged_dot`, portable);
"auto" picks ragged_dot. Pallas GPU/TPU grouped-matmul kernels will be added behind the same API.
"""

from pallas_kernels.moe.op import BACKENDS, combine, dispatch, gmm, resolve_backend
from pallas_kernels.moe.ragged import gmm_ragged_dot
from pallas_kernels.moe.reference import gmm_reference, group_membership

__all__ = ["BACKENDS", "combine", "dispatch", "gmm", "gmm_ragged_dot", "gmm_reference",
           "group_membership", "resolve_backend"]
