"""Public AttnRes mixing ops: validation, backend choice, and the two entry points.

  mix_pass    (out, blocks, p): the model threads the returned stream on (vjp.py says why);
  mix_stream  out only, for callers that do not differentiate through the stream afterwards.

Both compute `attn_res_mix(blocks[:num_blocks] + [p], num_blocks + 1, …)` (reference.py) without
building the sources buffer. Backends: "xla" (xla.py), "pallas_gpu" (the backward kernel of
pallas_gpu.py; the forward is xla.py's, which XLA fuses into the consumer's RMSNorm) and "auto".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import platform
from pallas_kernels.attnres import pallas_gpu, vjp, xla

BACKENDS = ("auto", "xla", "pallas_gpu")


def resolve_backend(backend: str, num_rows: int | None = None, d: int | None = None) -> str:
  """"auto": "pallas_gpu" on a GPU when the kernel tiles B·T = num_rows rows of width d, else
  "xla". "pallas_gpu" off a GPU runs the kernel in interpret mode (tests)."""
  if backend not in BACKENDS:
    raise ValueError(f"attnres: unknown backend {backend!r}; allowed: {', '.join(BACKENDS)}")
  if backend != "auto":
    return backend
  if platform.current() == "gpu" and (num_rows is None or pallas_gpu.supports(num_rows, d)):
    return "pallas_gpu"
  return "xla"


def backward_fn(backend: str):
  """The backward of a resolved backend, with xla.mix_backward's contract."""
  if backend == "pallas_gpu":
    return functools.partial(pallas_gpu.mix_backward, interpret=platform.interpret("gpu"))
  if backend == "xla":
    return xla.mix_backward
  raise ValueError(f"attnres: {backend!r} is not a resolved backend (xla | pallas_gpu)")


def validate(blocks_nbtd, p_btd, query_d, gain_d):
  """Shapes of a site's operands, with a message that names the mismatch."""
  if blocks_nbtd.ndim != 4 or p_btd.ndim != 3 or blocks_nbtd.shape[1:] != p_btd.shape:
    raise ValueError(f"attnres: blocks {tuple(blocks_nbtd.shape)} and partial sum "
                     f"{tuple(p_btd.shape)} must be [N, B, T, d] and [B, T, d]")
  d = p_btd.shape[-1]
  if query_d.shape != (d,) or gain_d.shape != (d,):
    raise ValueError(f"attnres: query {tuple(query_d.shape)} and gain {tuple(gain_d.shape)} "
                     f"must be [d] = [{d}]")


@jax.named_scope("attnres")
def mix_pass(blocks_nbtd, num_blocks, p_btd, query_d, gain_d, eps: float, backend: str = "auto"):
  """(the mix over blocks[:num_blocks] + [p], [B, T, d] in p's dtype; blocks; p)."""
  validate(blocks_nbtd, p_btd, query_d, gain_d)
  b, t, d = p_btd.shape
  backend = resolve_backend(backend, b * t, d)
  if backend == "pallas_gpu" and not pallas_gpu.supports(b * t, d):
    raise ValueError(f"attnres: backend pallas_gpu does not tile B·T = {b * t} rows of width {d}")
  return vjp.mix_pass(blocks_nbtd, jnp.asarray(num_blocks, jnp.int32), p_btd, query_d, gain_d,
                      float(eps), backward_fn(backend))


def mix_stream(blocks_nbtd, num_blocks, p_btd, query_d, gain_d, eps: float,
               backend: str = "auto") -> jax.Array:
  """The mix over blocks[:num_blocks] + [p], [B, T, d] in p's dtype."""
  return mix_pass(blocks_nbtd, num_blocks, p_btd, query_d, gain_d, eps, backend)[0]
