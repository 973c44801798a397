"""The routed experts' activation and down projection as one differentiable op.

  y [M, ℓ] = gmm(SiTU-GLU(g, u) · r, W_down)        (g, u [M, F]; r [M]; W_down [E, F, ℓ])

Autodiff of the two ops in a rematerialised layer runs the activation twice before its backward:
in the forward pass, and again in the backward pass to rebuild h, which the down projection's
weight gradient reads. Here the backward first takes dh = dy · W_downᵀ (the grouped matmul's
input gradient: linear in its input, so taken at a zero input, whose forward and weight-gradient
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
def _situ_glu_down(g_mf, u_mf, row_scale_m, w_efl, group_sizes_e, gmm, beta, linear_beta,
                   situ_backend):
  h_mf = situ_ops.situ_glu(g_mf, u_mf, beta, linear_beta, row_scale_m, backend=situ_backend)
  return gmm(h_mf, w_efl, group_sizes_e)


def _fwd(g_mf, u_mf, row_scale_m, w_efl, group_sizes_e, gmm, beta, linear_beta, situ_backend):
  y = _situ_glu_down(g_mf, u_mf, row_scale_m, w_efl, group_sizes_e, gmm, beta, linear_beta,
                     situ_backend)
  return y, (g_mf, u_mf, row_scale_m, w_efl, group_sizes_e)


def _bwd(gmm, beta, linear_beta, situ_backend, residuals, dy_ml):
  g_mf, u_mf, row_scale_m, w_efl, group_sizes_e = residuals
  _, pull_input = jax.vjp(lambda a: gmm(a, w_efl, group_sizes_e), jnp.zeros_like(g_mf))
  (dh_mf,) = pull_input(dy_ml)
  h_mf, dg_mf, du_mf, dr_m = situ_ops.value_and_grads(g_mf, u_mf, dh_mf, beta, linear_beta,
                                                      row_scale_m, backend=situ_backend)
  _, pull_weight = jax.vjp(lambda w: gmm(h_mf, w, group_sizes_e), w_efl)
  (dw_efl,) = pull_weight(dy_ml)
  dr_m = None if row_scale_m is None else dr_m.astype(row_scale_m.dtype)
  return dg_mf, du_mf, dr_m, dw_efl, None


_situ_glu_down.defvjp(_fwd, _bwd)


def situ_glu_down(g_mf: jax.Array, u_mf: jax.Array, row_scale_m: jax.Array | None,
                  w_efl: jax.Array, group_sizes_e: jax.Array, *, gmm: Callable, beta: float,
                  linear_beta: float | None, situ_backend: str) -> jax.Array:
  """gmm(situ_glu(g, u, β, β₂, r), W_down, group_sizes) with the backward above.

  gmm(lhs [M, F], rhs [E, F, ℓ], group_sizes [E]) → [M, ℓ] is a differentiable grouped matmul
  (`pallas_kernels.moe.gmm` with its backend bound); h is rounded to g's dtype, as in
  `pallas_kernels.situ_glu.situ_glu`."""
  return _situ_glu_down(g_mf, u_mf, row_scale_m, w_efl, group_sizes_e, gmm, float(beta),
                        None if linear_beta is None else float(linear_beta), situ_backend)
