"""One custom_vjp for every Pallas grouped-matmul backend (ragged_dot's own gradient rules).

Forward: gmm(lhs, rhs). Backward: dlhs = gmm of the cotangent with rhs[g]ᵀ (the same kernel,
transposed B operand), drhs = tgmm(lhs, cotangent) per group. A backend supplies its gmm / tgmm
kernels (both take `config=` and `interpret=`) and, optionally, a step that cleans lhs before the
tgmm (the GPU kernel zeroes padding rows there; the TPU kernel masks them itself).

`straight_through_gmm_mx` is the custom_vjp of the MX grouped matmul (`gmm_mx`): a forward on
MX-encoded operands, the backward of a plain gmm at the dequantised (straight-through) operands.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from pallas_kernels.moe import mx_operands


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


def straight_through_gmm_mx(mx_forward: Callable, gmm_impl: Callable) -> Callable:
  """Returns gmm_mx(lhs, rhs, group_sizes, lhs_codes, lhs_scales, rhs_packed, rhs_scales) → [M, N].

  The forward is `mx_forward(lhs_codes, lhs_scales, rhs_packed, rhs_scales, group_sizes, dtype)`:
  the grouped matmul of the dequantised MX operands (mx_operands.py), in dtype = the promoted
  dtype of lhs and rhs. lhs and rhs are the unquantised operands the codes were made from; only
  their gradients are read from them (straight-through, docs/maths.md §7.5): the backward is the
  VJP of `gmm_impl` (a plain gmm backend) at the dequantised operands in dtype, so dlhs =
  dout · deq(rhs)ᵀ and drhs = deq(lhs)ᵀ · dout per group, exactly the gradients of
  gmm(Q(lhs), Q(rhs)) under fake quantisation. Residuals are the MX operands (4.25 and 8.25 bits
  per element), dequantised again in the backward. The codes get no gradient.
  """

  @functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
  def _gmm_mx(lhs_dtype, rhs_dtype, lhs_mk, rhs_gkn, group_sizes_g, lhs_codes, lhs_scales,
              rhs_packed, rhs_scales):
    dtype = jnp.result_type(lhs_dtype, rhs_dtype)
    return mx_forward(lhs_codes, lhs_scales, rhs_packed, rhs_scales, group_sizes_g, dtype)

  def _fwd(lhs_dtype, rhs_dtype, lhs_mk, rhs_gkn, group_sizes_g, *mx_ops):
    out = _gmm_mx(lhs_dtype, rhs_dtype, lhs_mk, rhs_gkn, group_sizes_g, *mx_ops)
    return out, (group_sizes_g, *mx_ops)

  def _bwd(lhs_dtype, rhs_dtype, res, dout_mn):
    group_sizes_g, lhs_codes, lhs_scales, rhs_packed, rhs_scales = res
    dtype = jnp.result_type(lhs_dtype, rhs_dtype)
    lhs_q = mx_operands.dequantize_lhs(lhs_codes, lhs_scales, dtype)
    rhs_q = mx_operands.dequantize_rhs(rhs_packed, rhs_scales, dtype)
    _, pullback = jax.vjp(lambda a, b: gmm_impl(a, b, group_sizes_g), lhs_q, rhs_q)
    dlhs, drhs = pullback(dout_mn.astype(dtype))
    return dlhs.astype(lhs_dtype), drhs.astype(rhs_dtype), None, None, None, None, None

  _gmm_mx.defvjp(_fwd, _bwd)

  def gmm_mx(lhs_mk, rhs_gkn, group_sizes_g, lhs_codes, lhs_scales, rhs_packed, rhs_scales):
    return _gmm_mx(jnp.dtype(lhs_mk.dtype), jnp.dtype(rhs_gkn.dtype), lhs_mk, rhs_gkn,
                   group_sizes_g.astype(jnp.int32), lhs_codes, lhs_scales, rhs_packed, rhs_scales)

  return gmm_mx
