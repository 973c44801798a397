"""Public op: validation, backend choice, one entry point.

  logsumexp_and_pick(logits [..., V], targets [...], backend=…) -> (lse [...], picked [...])

lse = log Σ_v exp(logits[..., v]) and picked = logits[..., t] (0 for a target outside [0, V)),
both fp32 from fp32 logits. No gradient rule: the fused head loss forms its gradient itself.
Backends: "xla" (xla.py), "pallas_gpu" (pallas_gpu.py; interpret mode off a GPU, for tests) and
"auto".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import platform
from pallas_kernels.logsumexp import pallas_gpu, xla

BACKENDS = ("auto", "xla", "pallas_gpu")


def resolve_backend(backend: str, num_rows: int | None = None, vocab: int | None = None,
                    dtype=jnp.float32) -> str:
  """"auto": "pallas_gpu" on a single GPU when its kernel takes [num_rows, vocab] logits, else
  "xla". With more than one device the vocabulary axis may be sharded, which only XLA's
  reductions (partitioned and all-reduced) handle."""
  if backend not in BACKENDS:
    raise ValueError(f"logsumexp: unknown backend {backend!r}; allowed: {', '.join(BACKENDS)}")
  if backend != "auto":
    return backend
  if (platform.current() == "gpu" and jax.device_count() == 1 and
      (num_rows is None or pallas_gpu.supports(num_rows, vocab, dtype))):
    return "pallas_gpu"
  return "xla"


def logsumexp_and_pick(logits: jax.Array, targets: jax.Array, *, backend: str = "auto"):
  """(lse, picked) [...] fp32 for logits [..., V] (floating point) and integer targets [...]."""
  if logits.ndim < 1 or targets.shape != logits.shape[:-1]:
    raise ValueError(f"logsumexp: logits [..., V] and targets [...] must share their leading "
                     f"shape, got {logits.shape} and {targets.shape}")
  if not jnp.issubdtype(logits.dtype, jnp.floating) or not jnp.issubdtype(targets.dtype,
                                                                         jnp.integer):
    raise ValueError(f"logsumexp: needs floating logits and integer targets, got {logits.dtype} "
                     f"and {targets.dtype}")
  lead, v = logits.shape[:-1], logits.shape[-1]
  n = targets.size
  backend = resolve_backend(backend, n, v, logits.dtype)
  if backend == "pallas_gpu":
    lse, picked = pallas_gpu.logsumexp_and_pick(logits.reshape(n, v), targets.reshape(n),
                                                interpret=platform.interpret("gpu"))
    return lse.reshape(lead), picked.reshape(lead)
  return xla.logsumexp_and_pick(logits.astype(jnp.float32), targets)
