"""Public short-conv op: validation, backend choice, one entry point.

  causal_conv(x [B, T, C…], w [W, C…], segment_ids [B, T] | None, backend=…) → y [B, T, C…]

y[b, t] = Σ_j w[j] · x[b, t − W + 1 + j] per channel (w[W−1] multiplies the current token, as a
PyTorch Conv1d with W − 1 left padding), a tap counted only when its token is in the sequence and
in token t's document (equal segment id). The taps are summed in fp32 and y is rounded once to
x's dtype; the weight gradient is an fp32 sum over all tokens, returned in w's dtype.

Backends: "xla" (xla.py, pure JAX, autodiff), "pallas_gpu" (vjp.py's custom_vjp: pallas_gpu.py's
backward kernel, and as forward xla.py's fused pass or the forward kernel, by
pallas_gpu.SETTINGS.forward; interpret mode off a GPU, for tests) and "auto".
"""

from __future__ import annotations

import jax

from pallas_kernels import platform
from pallas_kernels.short_conv import pallas_gpu, vjp, xla

BACKENDS = ("auto", "xla", "pallas_gpu")


def pallas_gpu_conv(settings: pallas_gpu.Settings | None = None):
  """conv(x, w, segment_ids, interpret) of the "pallas_gpu" backend: vjp.py's custom_vjp with
  pallas_gpu.py's backward kernel and, by `settings.forward`, xla.py's fused pass or the forward
  kernel (the same fp32 sums rounded once, either way). settings None: pallas_gpu.SETTINGS as
  they stand when the conv is traced."""
  def forward(x, w, segment_ids, *, interpret: bool):
    if (settings or pallas_gpu.SETTINGS).forward == "kernel":
      return pallas_gpu.forward(x, w, segment_ids, interpret=interpret, settings=settings)
    return xla.causal_conv(x, w, segment_ids)

  def backward(x, dy, w, segment_ids, *, interpret: bool):
    return pallas_gpu.backward(x, dy, w, segment_ids, interpret=interpret, settings=settings)

  return vjp.differentiable_conv(forward, backward)


_pallas_gpu_conv = pallas_gpu_conv()


def resolve_backend(backend: str, num_rows: int | None = None,
                    channels: int | None = None) -> str:
  """"auto": "pallas_gpu" on a GPU when its kernels tile N = num_rows tokens × C = channels,
  else "xla"."""
  if backend not in BACKENDS:
    raise ValueError(f"short_conv: unknown backend {backend!r}; allowed: {', '.join(BACKENDS)}")
  if backend != "auto":
    return backend
  if platform.current() == "gpu" and (num_rows is None
                                         or pallas_gpu.supports(num_rows, channels)):
    return "pallas_gpu"
  return "xla"


def _validate(x, w, segment_ids) -> None:
  if x.ndim < 3:
    raise ValueError(f"short_conv: x must be [B, T, channels…], got shape {x.shape}")
  if w.ndim != x.ndim - 1 or w.shape[1:] != x.shape[2:]:
    raise ValueError(f"short_conv: w must be [W, {', '.join(map(str, x.shape[2:]))}] for x of "
                     f"shape {x.shape}, got {w.shape}")
  if w.shape[0] < 1:
    raise ValueError("short_conv: the conv needs at least one tap")
  if segment_ids is not None and segment_ids.shape != x.shape[:2]:
    raise ValueError(f"short_conv: segment_ids must be [B, T] = {x.shape[:2]}, got "
                     f"{segment_ids.shape}")


def causal_conv(x, w, segment_ids=None, *, backend: str = "auto") -> jax.Array:
  """The depthwise causal conv (module docstring)."""
  _validate(x, w, segment_ids)
  channels = w[0].size
  backend = resolve_backend(backend, x.shape[0] * x.shape[1], channels)
  if backend == "pallas_gpu":
    pallas_gpu.checked_tiles(x, w)        # the backward kernel's blocks, whichever forward runs
    return _pallas_gpu_conv(x, w, segment_ids, platform.interpret("gpu"))
  return xla.causal_conv(x, w, segment_ids)
