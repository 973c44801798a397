"""The custom_vjp of the kernel backend: its forward kernel, and its backward kernel for
(dg, du, d_row_scale).

Residuals are the inputs (g, u, row_scale): the backward recomputes every term from them and
keeps nothing the forward computed, so under rematerialisation the forward pass that runs again
writes only h (which the down projection's weight gradient reads).
"""

from __future__ import annotations

import functools
from typing import Callable


def differentiable_situ_glu(forward: Callable, backward: Callable) -> Callable:
  """f(g, u, row_scale, beta, linear_beta, interpret) from forward(g, u, r, *, beta, linear_beta,
  interpret) → h and backward(g, u, dh, r, *, ...) → (dg, du, dr or None). Differentiable in g,
  u and row_scale (which may be None)."""
  import jax

  @functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
  def situ_glu(g, u, row_scale, beta, linear_beta, interpret):
    return forward(g, u, row_scale, beta=beta, linear_beta=linear_beta, interpret=interpret)

  def fwd(g, u, row_scale, beta, linear_beta, interpret):
    h = forward(g, u, row_scale, beta=beta, linear_beta=linear_beta, interpret=interpret)
    return h, (g, u, row_scale)

  def bwd(beta, linear_beta, interpret, res, dh):
    g, u, row_scale = res
    dg, du, dr = backward(g, u, dh, row_scale, beta=beta, linear_beta=linear_beta,
                          interpret=interpret)
    return dg, du, (None if row_scale is None else dr.astype(row_scale.dtype))

  situ_glu.defvjp(fwd, bwd)
  return situ_glu
