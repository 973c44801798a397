"""The experts' activation and down projection as one differentiable op.

  y [M, ℓ] = gmm(SiTU-GLU(g, u) · r, W_down)        (routed: g, u [M, F]; r [M]; W_down [E, F, ℓ])
  y [..., d] = SiTU-GLU(g, u) · W_down               (shared: g, u [..., F]; W_down [F, d])

Autodiff of the two ops in a rematerialised layer runs the activation twice before its backward:
in the forward pass, and again in the backward pass to rebuild h, which the down projection's
weight gradient reads. Here the backward first takes dh = dy · W_downᵀ (the projection's input
gradient: linear in its input, so taken at a zero input, whose forward and weight-gradient
kernels XLA then drops as unused), then one pass of the activation's backward
(`pallas_kernels.situ_glu.value_and_grads`) writes h beside dg, du and r's gradient, then
W_down's gradient hᵀ · dy. The residuals are the op's inputs, so no forward pass runs again.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from pallas_kernels import situ_glu as situ_ops


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _situ_glu_down(g, u, row_scale, w, down_operands, down, beta, linear_beta, situ_backend):
  h = situ_ops.situ_glu(g, u, beta, linear_beta, row_scale, backend=situ_backend)
  return down(h, w, *down_operands)


def _fwd(g, u, row_scale, w, down_operands, down, beta, linear_beta, situ_backend):
  y = _situ_glu_down(g, u, row_scale, w, down_operands, down, beta, linear_beta, situ_backend)
  return y, (g, u, row_scale, w, down_operands)


def _bwd(down, beta, linear_beta, situ_backend, residuals, dy):
  g, u, row_scale, w, down_operands = residuals
  _, pull_input = jax.vjp(lambda a: down(a, w, *down_operands), jnp.zeros_like(g))
  (dh,) = pull_input(dy)
  h, dg, du, dr = situ_ops.value_and_grads(g, u, dh, beta, linear_beta, row_scale,
                                           backend=situ_backend)
  _, pull_weight = jax.vjp(lambda b: down(h, b, *down_operands), w)
  (dw,) = pull_weight(dy)
  dr = None if row_scale is None else dr.astype(row_scale.dtype)
  return dg, du, dr, dw, jax.tree.map(lambda _: None, down_operands)


_situ_glu_down.defvjp(_fwd, _bwd)


def situ_glu_down(g: jax.Array, u: jax.Array, row_scale: jax.Array | None, w: jax.Array,
                  down_operands: tuple = (), *, down: Callable, beta: float,
                  linear_beta: float | None, situ_backend: str) -> jax.Array:
  """down(situ_glu(g, u, β, β₂, r), W, *down_operands) with the backward above.

  down(h [..., F], W, *down_operands) is a differentiable projection, linear in h and in W: the
  routed experts' grouped matmul (`pallas_kernels.moe.gmm` with its backend bound; the
  operands: the group sizes [E]) or a dense one (`layers.project`). The operands get
  no gradient. h is rounded to g's dtype, as in `pallas_kernels.situ_glu.situ_glu`."""
  return _situ_glu_down(g, u, row_scale, w, tuple(down_operands), down, float(beta),
                        None if linear_beta is None else float(linear_beta), situ_backend)
