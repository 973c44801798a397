"""Public SiTU-GLU op: validation, backend choice, one entry point.

  situ_glu(g [..., F], u [..., F], beta, linear_beta, row_scale [...] | None, backend=…) → h [..., F]

h = β₁·tanh(g/β₁)·σ(g) · β₂·tanh(u/β₂) · row_scale (docs/maths.md §5.4; the up branch is u when
linear_beta is None, the scale 1 when row_scale is None), computed in fp32 and rounded once to
g's dtype; gradients come back in their inputs' dtypes.

Backends: "xla" (xla.py, pure JAX, autodiff), "pallas_gpu" (vjp.py's custom_vjp over
pallas_gpu.py's two kernels; interpret mode off a GPU, for tests) and "auto".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import platform
from pallas_kernels.situ_glu import pallas_gpu, vjp, xla

BACKENDS = ("auto", "xla", "pallas_gpu")

_pallas_gpu_situ_glu = vjp.differentiable_situ_glu(pallas_gpu.forward, pallas_gpu.backward)


def resolve_backend(backend: str, num_rows: int | None = None, hidden: int | None = None,
                    dtype=None) -> str:
  """"auto": "pallas_gpu" on a GPU when its kernels take N = num_rows rows of F = hidden units
  in `dtype`, else "xla"."""
  if backend not in BACKENDS:
    raise ValueError(f"situ_glu: unknown backend {backend!r}; allowed: {', '.join(BACKENDS)}")
  if backend != "auto":
    return backend
  if platform.current() == "gpu" and (num_rows is None or
                                       pallas_gpu.supports(num_rows, hidden, dtype)):
    return "pallas_gpu"
  return "xla"


def backend_for(g: jax.Array, backend: str) -> str:
  """The backend `backend` resolves to for inputs shaped and typed like g [..., F]."""
  hidden = g.shape[-1]
  return resolve_backend(backend, g.size // max(hidden, 1), hidden, g.dtype)


def _validate(g, u, row_scale) -> None:
  if g.ndim < 1 or g.shape != u.shape:
    raise ValueError(f"situ_glu: g and u must have one shape [..., F], got {g.shape} and "
                     f"{u.shape}")
  if not (jnp.issubdtype(g.dtype, jnp.floating) and jnp.issubdtype(u.dtype, jnp.floating)):
    raise ValueError(f"situ_glu: g and u must be floating point, got {g.dtype} and {u.dtype}")
  if row_scale is not None and row_scale.shape != g.shape[:-1]:
    raise ValueError(f"situ_glu: row_scale must have g's leading shape {g.shape[:-1]}, got "
                     f"{row_scale.shape}")


def _prepared(g, u, row_scale, beta, linear_beta, backend: str):
  """Validated inputs (and, for "pallas_gpu", the kernels' tiles) → (the resolved backend, β₁
  and β₂ as Python floats)."""
  _validate(g, u, row_scale)
  backend = backend_for(g, backend)
  if backend == "pallas_gpu":
    pallas_gpu.checked_tiles(g)
  return backend, float(beta), None if linear_beta is None else float(linear_beta)


def value_and_grads(g: jax.Array, u: jax.Array, dh: jax.Array, beta: float,
                    linear_beta: float | None = None, row_scale: jax.Array | None = None, *,
                    backend: str = "auto"):
  """(h, dg, du, d_row_scale or None): SiTU-GLU's value and its gradients for the cotangent dh,
  in one pass over g, u and dh ("pallas_gpu": the backward kernel writing h too; "xla": autodiff,
  which XLA fuses). For an op whose own backward needs h only once dh is known (the experts'
  down projection: its weight gradient reads h), so no forward pass is rematerialised for h."""
  if dh.shape != g.shape:
    raise ValueError(f"situ_glu: dh must have g's shape {g.shape}, got {dh.shape}")
  backend, beta, linear_beta = _prepared(g, u, row_scale, beta, linear_beta, backend)
  if backend == "pallas_gpu":
    return pallas_gpu.backward(g, u, dh, row_scale, beta=beta, linear_beta=linear_beta,
                               interpret=platform.interpret("gpu"), with_h=True)
  if row_scale is None:
    h, pull = jax.vjp(lambda a, b: xla.situ_glu(a, b, beta, linear_beta), g, u)
    return (h, *pull(dh.astype(h.dtype)), None)
  h, pull = jax.vjp(lambda a, b, c: xla.situ_glu(a, b, beta, linear_beta, c), g, u, row_scale)
  return (h, *pull(dh.astype(h.dtype)))


def situ_glu(g: jax.Array, u: jax.Array, beta: float, linear_beta: float | None = None,
             row_scale: jax.Array | None = None, *, backend: str = "auto") -> jax.Array:
  """SiTU-GLU (module docstring)."""
  backend, beta, linear_beta = _prepared(g, u, row_scale, beta, linear_beta, backend)
  if backend == "pallas_gpu":
    return _pallas_gpu_situ_glu(g, u, row_scale, beta, linear_beta, platform.interpret("gpu"))
  return xla.situ_glu(g, u, beta, linear_beta, row_scale)
