"""MoE ops: grouped matmul (`gmm`) and dropless sort-based token `dispatch` / `combine`.

Backends: "reference" (dense, readable), "ragged_dot" (`jax.lax.ragged_dot`, portable),
"pallas_gpu" (Mosaic GPU kernels, mgpu.py), "pallas_tpu" (Mosaic TPU kernels, pallas_tpu.py) and
"auto" (pallas_gpu on GPU for bf16/f16 shapes it tiles, ragged_dot elsewhere; pallas_tpu by name
until it has run on a TPU).
"""

from pallas_kernels.moe.op import BACKENDS, combine, dispatch, gmm, resolve_backend
from pallas_kernels.moe.pallas_gpu import gmm_pallas_gpu
from pallas_kernels.moe.pallas_tpu import gmm_pallas_tpu
from pallas_kernels.moe.ragged import gmm_ragged_dot
from pallas_kernels.moe.reference import gmm_reference, group_membership

__all__ = ["BACKENDS", "combine", "dispatch", "gmm", "gmm_pallas_gpu", "gmm_pallas_tpu",
           "gmm_ragged_dot", "gmm_reference",
           "group_membership", "resolve_backend"]
