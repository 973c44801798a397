"""MoE ops: grouped matmul (`gmm`) and dropless sort-based token `dispatch` / `combine`.

gmm backends (BACKENDS): "reference", "ragged_dot", "pallas_gpu", "pallas_tpu" and "auto"; see op.py.
"""

from pallas_kernels.moe.op import BACKENDS, combine, dispatch, gmm, resolve_backend

__all__ = ["BACKENDS", "combine", "dispatch", "gmm", "resolve_backend"]
