"""The custom_vjp of a kernel backend: its forward, and its backward kernel for (dx, dw).

Residuals are the inputs (x, w, segment ids): the backward reads x again and needs nothing the
forward computed.
"""

from __future__ import annotations

import functools
from typing import Callable


def differentiable_conv(forward: Callable, backward: Callable) -> Callable:
  """conv(x, w, segment_ids, interpret) from forward(x, w, seg, *, interpret) → y and
  backward(x, dy, w, seg, *, interpret) → (dx, dw fp32). Differentiable in x and w."""
  import jax

  @functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
  def conv(x, w, seg, interpret):
    return forward(x, w, seg, interpret=interpret)

  def fwd(x, w, seg, interpret):
    return forward(x, w, seg, interpret=interpret), (x, w, seg)

  def bwd(interpret, res, dy):
    x, w, seg = res
    dx, dw = backward(x, dy, w, seg, interpret=interpret)
    return dx, dw.astype(w.dtype), None

  conv.defvjp(fwd, bwd)
  return conv
