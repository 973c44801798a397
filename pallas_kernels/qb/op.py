"""Public QB order-statistics op: validation, backend choice, one entry point.

  margin_quantile(scores [T, E], bias [E], real [T], top_k, q) -> β [E] fp32

β_e is the (q+1)-th largest over real tokens of the margin s_te − α_t, where α_t is the
(k+1)-th largest biased score s_te + b_e of token t (reference.py). Backends: "xla" (xla.py),
"pallas_gpu" (pallas_gpu.py) and "auto". Every backend returns the same bits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import platform
from pallas_kernels.qb import pallas_gpu, xla

BACKENDS = ("auto", "xla", "pallas_gpu")


def resolve_backend(backend: str, num_tokens: int | None = None) -> str:
  """"auto": "pallas_gpu" on a single GPU when its columns kernel holds T = num_tokens margins
  in registers (T a power of two up to pallas_gpu.SETTINGS.resident), else "xla".
  With more than one device the token axis may be sharded, and only the XLA rounds (per-expert
  counts, all-reduced by the partitioner) see every shard. "pallas_gpu" off a GPU runs the
  kernels in interpret mode (tests)."""
  if backend not in BACKENDS:
    raise ValueError(f"qb: unknown backend {backend!r}; allowed: {', '.join(BACKENDS)}")
  if backend != "auto":
    return backend
  if (platform.current() == "gpu" and jax.device_count() == 1
      and (num_tokens is None or pallas_gpu.keeps_column(num_tokens))):
    return "pallas_gpu"
  return "xla"


def margin_quantile(scores_te, bias_e, real_t, top_k: int, q, *, backend: str = "auto",
                    unroll: int | bool | None = None, digit_bits: int | None = None):
  """β [E] fp32 (see the module docstring). top_k must lie in [0, E); q in [0, T) (dynamic).
  unroll, digit_bits: the XLA backend's radix rounds (xla.kth_largest_per_column)."""
  if scores_te.ndim != 2 or bias_e.shape != scores_te.shape[1:] or \
      real_t.size != scores_te.shape[0]:
    raise ValueError(f"qb: scores {tuple(scores_te.shape)}, bias {tuple(bias_e.shape)} and real "
                     f"mask {tuple(real_t.shape)} must be [T, E], [E] and T elements")
  t, e = scores_te.shape
  if not 0 <= top_k < e:
    raise ValueError(f"qb: top_k must lie in [0, E = {e}), got {top_k}")
  backend = resolve_backend(backend, t)
  real_t = real_t.reshape(t).astype(bool)
  if backend == "pallas_gpu":
    return pallas_gpu.margin_quantile(scores_te, bias_e, real_t, top_k, q,
                                      interpret=platform.interpret("gpu"))
  return xla.margin_quantile(scores_te.astype(jnp.float32), bias_e.astype(jnp.float32), real_t,
                             top_k, q, unroll=unroll, digit_bits=digit_bits)
