"""One custom_vjp for every Pallas grouped-matmul backend (ragged_dot's own gradient rules).

Forward: gmm(lhs, rhs). Backward: dlhs = gmm of the cotangent with rhs[g]ᵀ (the same kernel,
transposed B operand), drhs = tgmm(lhs, cotangent) per group. A backend supplies its gmm / tgmm
kernels (both take `config=` and `interpret=`) and, optionally, a step that cleans lhs before the
tgmm (the GPU kernel zeroes padding rows there; the TPU kernel masks them itself).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp


def differentiable_gmm(gmm_kernel: Callable, tgmm_kernel: Callable,
                       prepare_tgmm_lhs: Callable | None = None) -> Callable:
  """Returns gmm(lhs [M,K], rhs [G,K,N], group_sizes [G], *, config, interpret) → [M, N].

  Inputs are cast to their promoted dtype first (the kernels take one dtype); the result has
  that dtype. Differentiable in lhs and rhs.
  """

  @functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
  def _gmm(lhs_mk, rhs_gkn, group_sizes_g, config, interpret):
    return gmm_kernel(lhs_mk, rhs_gkn, group_sizes_g, config=config, interpret=interpret)

  def _fwd(lhs_mk, rhs_gkn, group_sizes_g, config, interpret):
    out_mn = gmm_kernel(lhs_mk, rhs_gkn, group_sizes_g, config=config, interpret=interpret)
    return out_mn, (lhs_mk, rhs_gkn, group_sizes_g)

  def _bwd(config, interpret, res, dout_mn):
    lhs_mk, rhs_gkn, group_sizes_g = res
    dout_mn = dout_mn.astype(lhs_mk.dtype)
    dlhs_mk = gmm_kernel(dout_mn, rhs_gkn, group_sizes_g, transpose_rhs=True, config=config,
                         interpret=interpret)
    if prepare_tgmm_lhs is not None:
      lhs_mk = prepare_tgmm_lhs(lhs_mk, group_sizes_g, config)
    drhs_gkn = tgmm_kernel(lhs_mk, dout_mn, group_sizes_g, config=config, interpret=interpret)
    return dlhs_mk, drhs_gkn, None

  _gmm.defvjp(_fwd, _bwd)

  def gmm(lhs_mk, rhs_gkn, group_sizes_g, *, config, interpret):
    dtype = jnp.result_type(lhs_mk.dtype, rhs_gkn.dtype)
    return _gmm(lhs_mk.astype(dtype), rhs_gkn.astype(dtype), group_sizes_g.astype(jnp.int32),
                config, interpret)

  return gmm
