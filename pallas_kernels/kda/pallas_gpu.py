"""Pallas-Triton (GPU) launchers for the chunked KDA kernels, in the native [B, T, H, ·] layout.

No transposes: BlockSpecs squeeze the B and H axes, so a kernel sees strided [C, K] tiles (intra,
chunk backward) or a whole [T, K] column of one (batch, head) that it walks chunk by chunk with
`pl.ds` (state passes, sequential over chunks, parallel over batch × head × V-blocks).
With interpret=True the same kernels run on CPU (CI).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda import kernels

F32 = jnp.float32
SUB = 16


def _params(num_warps: int, num_stages: int = 2):
  from jax.experimental.pallas import triton as plgpu
  return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def block_v(dv: int) -> int:
  """V-block of the state passes: 32 columns keeps S [K, BV] in registers and gives B·H·V/32
  independent sequential programs."""
  return min(dv, 32)


def intra(q, k, v, gam, beta, cnt, *, scale, chunk, interpret):
  """Intra-chunk kernel over grid (B, N, H). Returns aqk [B,T,H,C], w/qg/kt [B,T,H,K], u [B,T,H,V]
  in q's dtype (the dots' operand dtype), then akk, inv [B,T,H,C] fp32 for the backward."""
  b, t, h, dk = q.shape
  dv = v.shape[-1]
  n = t // chunk
  st = q.dtype
  beta4 = beta[..., None]                                   # [B, T, H, 1]
  cnt_col = cnt[..., None]                                  # [B, T, 1]
  cnt_row = cnt.reshape(b, n, 1, chunk)                     # [B, N, 1, C]
  tok = lambda d: pl.BlockSpec((None, chunk, None, d), lambda ib, ic, ih: (ib, ic, ih, 0))
  kernel = functools.partial(kernels.intra_kernel, scale=scale, sub=SUB, mm_dtype=st)
  shapes = [jax.ShapeDtypeStruct((b, t, h, d), st) for d in (chunk, dk, dv, dk, dk)]
  shapes += [jax.ShapeDtypeStruct((b, t, h, chunk), F32)] * 2
  return pl.pallas_call(
      kernel, grid=(b, n, h),
      in_specs=[tok(dk), tok(dk), tok(dv), tok(dk), tok(1),
                pl.BlockSpec((None, chunk, 1), lambda ib, ic, ih: (ib, ic, 0)),
                pl.BlockSpec((None, None, 1, chunk), lambda ib, ic, ih: (ib, ic, 0, 0))],
      out_specs=[tok(chunk), tok(dk), tok(dv), tok(dk), tok(dk), tok(chunk), tok(chunk)],
      out_shape=shapes, interpret=interpret,
      compiler_params=None if interpret else _params(8, 1),
  )(q, k, v, gam, beta4, cnt_col, cnt_row)


def _seq(t, d):
  """Whole-sequence column [T, d] of one (batch, head, V-block) for grid (B, H, nV)."""
  return pl.BlockSpec((None, t, None, d), lambda ib, ih, iv: (ib, 0, ih, 0))


def _seq_v(t, bv):
  return pl.BlockSpec((None, t, None, bv), lambda ib, ih, iv: (ib, 0, ih, iv))


def state_fwd(qg, kt, w, u, aqk, d, s0, *, chunk, save, interpret):
  """Sequential state pass + outputs. Returns (o [B,T,H,V] fp32, S_final [B,H,K,V] fp32) and,
  when `save`, the per-chunk entering states h [B,N,H,K,V] and Δ [B,T,H,V] (storage dtype)."""
  b, t, h, dk = qg.shape
  dv = u.shape[-1]
  n = t // chunk
  bv = block_v(dv)
  st = qg.dtype

  def kernel(qg_ref, kt_ref, w_ref, u_ref, aqk_ref, d_ref, s0_ref, o_ref, sf_ref, *saved):
    def body(i, s):
      rows = pl.ds(i * chunk, chunk)
      if save:
        saved[0][i] = s.astype(saved[0].dtype)
      s, o, delta = kernels.fwd_step(s, qg_ref[rows, :], kt_ref[rows, :], w_ref[rows, :],
                                     u_ref[rows, :], aqk_ref[rows, :], d_ref[i], st)
      o_ref[rows, :] = o.astype(o_ref.dtype)
      if save:
        saved[1][rows, :] = delta.astype(saved[1].dtype)
      return s

    sf_ref[...] = jax.lax.fori_loop(0, n, body, s0_ref[...].astype(F32))

  state_spec = pl.BlockSpec((None, None, dk, bv), lambda ib, ih, iv: (ib, ih, 0, iv))
  out_specs = [_seq_v(t, bv), state_spec]
  out_shape = [jax.ShapeDtypeStruct((b, t, h, dv), F32),
               jax.ShapeDtypeStruct((b, h, dk, dv), F32)]
  if save:
    out_specs += [pl.BlockSpec((None, n, None, dk, bv), lambda ib, ih, iv: (ib, 0, ih, 0, iv)),
                  _seq_v(t, bv)]
    out_shape += [jax.ShapeDtypeStruct((b, n, h, dk, dv), st),
                  jax.ShapeDtypeStruct((b, t, h, dv), st)]
  return pl.pallas_call(
      kernel, grid=(b, h, dv // bv),
      in_specs=[_seq(t, dk), _seq(t, dk), _seq(t, dk), _seq_v(t, bv), _seq(t, chunk),
                pl.BlockSpec((None, n, None, dk, 1), lambda ib, ih, iv: (ib, 0, ih, 0, 0)),
                state_spec],
      out_specs=out_specs, out_shape=out_shape, interpret=interpret,
      compiler_params=None if interpret else _params(4, 2),
  )(qg, kt, w, u, aqk, d, s0)


def state_bwd(do, dsf, qg, kt, w, aqk, d, *, chunk, interpret):
  """Reverse state pass. Returns (dS₀ [B,H,K,V] fp32, dS' per chunk [B,N,H,K,V] (storage
  dtype; the grad of the state leaving chunk n), dΔ [B,T,H,V] fp32)."""
  b, t, h, dk = qg.shape
  dv = do.shape[-1]
  n = t // chunk
  bv = block_v(dv)
  st = qg.dtype

  def kernel(do_ref, dsf_ref, qg_ref, kt_ref, w_ref, aqk_ref, d_ref, ds0_ref, dh_ref, ddelta_ref):
    def body(j, ds):
      i = n - 1 - j
      rows = pl.ds(i * chunk, chunk)
      dh_ref[i] = ds.astype(dh_ref.dtype)
      ds, ddelta = kernels.bwd_step(ds, do_ref[rows, :], qg_ref[rows, :], kt_ref[rows, :],
                                    w_ref[rows, :], aqk_ref[rows, :], d_ref[i], st)
      ddelta_ref[rows, :] = ddelta
      return ds

    ds0_ref[...] = jax.lax.fori_loop(0, n, body, dsf_ref[...].astype(F32))

  state_spec = pl.BlockSpec((None, None, dk, bv), lambda ib, ih, iv: (ib, ih, 0, iv))
  return pl.pallas_call(
      kernel, grid=(b, h, dv // bv),
      in_specs=[_seq_v(t, bv), state_spec, _seq(t, dk), _seq(t, dk), _seq(t, dk),
                _seq(t, chunk),
                pl.BlockSpec((None, n, None, dk, 1), lambda ib, ih, iv: (ib, 0, ih, 0, 0))],
      out_specs=[state_spec,
                 pl.BlockSpec((None, n, None, dk, bv), lambda ib, ih, iv: (ib, 0, ih, 0, iv)),
                 _seq_v(t, bv)],
      out_shape=[jax.ShapeDtypeStruct((b, h, dk, dv), F32),
                 jax.ShapeDtypeStruct((b, n, h, dk, dv), st),
                 jax.ShapeDtypeStruct((b, t, h, dv), F32)],
      interpret=interpret, compiler_params=None if interpret else _params(4, 2),
  )(do, dsf, qg, kt, w, aqk, d)


def chunk_bwd(hs, dhs, delta, ddelta, do, *, chunk, interpret):
  """Per-chunk gradient kernel over grid (B, N, H); see kernels.chunk_bwd_kernel. Returns fp32
  (dqg, dw, dkt [B,T,H,K], daqk [B,T,H,C], dd [B,N,H,K,1])."""
  b, n, h, dk, dv = hs.shape
  t = n * chunk
  tok = lambda d: pl.BlockSpec((None, chunk, None, d), lambda ib, ic, ih: (ib, ic, ih, 0))
  state = pl.BlockSpec((None, None, None, dk, dv), lambda ib, ic, ih: (ib, ic, ih, 0, 0))
  kernel = functools.partial(kernels.chunk_bwd_kernel, mm_dtype=hs.dtype)
  return pl.pallas_call(
      kernel, grid=(b, n, h),
      in_specs=[state, state, tok(dv), tok(dv), tok(dv)],
      out_specs=[tok(dk), tok(dk), tok(dk), tok(chunk),
                 pl.BlockSpec((None, None, None, dk, 1), lambda ib, ic, ih: (ib, ic, ih, 0, 0))],
      out_shape=[jax.ShapeDtypeStruct((b, t, h, dk), F32)] * 3
      + [jax.ShapeDtypeStruct((b, t, h, chunk), F32),
         jax.ShapeDtypeStruct((b, n, h, dk, 1), F32)],
      interpret=interpret, compiler_params=None if interpret else _params(8, 1),
  )(hs, dhs, delta, ddelta, do)


def intra_bwd(q, k, v, gam, beta, cnt, akk, inv, w, u, daqk, dw, du, dqg, dkt, *, scale, chunk,
              interpret):
  """Intra-chunk backward over grid (B, N, H); see kernels.intra_bwd_kernel. Returns fp32
  dq, dk [B,T,H,K], dv [B,T,H,V], dbeta [B,T,H,1], dgam [B,T,H,K]."""
  b, t, h, dk = q.shape
  dv = v.shape[-1]
  n = t // chunk
  tok = lambda d: pl.BlockSpec((None, chunk, None, d), lambda ib, ic, ih: (ib, ic, ih, 0))
  kernel = functools.partial(kernels.intra_bwd_kernel, scale=scale, sub=SUB, mm_dtype=q.dtype)
  return pl.pallas_call(
      kernel, grid=(b, n, h),
      in_specs=[tok(dk), tok(dk), tok(dv), tok(dk), tok(1),
                pl.BlockSpec((None, chunk, 1), lambda ib, ic, ih: (ib, ic, 0)),
                pl.BlockSpec((None, None, 1, chunk), lambda ib, ic, ih: (ib, ic, 0, 0)),
                tok(chunk), tok(chunk), tok(dk), tok(dv),
                tok(chunk), tok(dk), tok(dv), tok(dk), tok(dk)],
      out_specs=[tok(dk), tok(dk), tok(dv), tok(1), tok(dk)],
      out_shape=[jax.ShapeDtypeStruct((b, t, h, d), F32) for d in (dk, dk, dv, 1, dk)],
      interpret=interpret, compiler_params=None if interpret else _params(8, 1),
  )(q, k, v, gam, beta[..., None], cnt[..., None], cnt.reshape(b, n, 1, chunk), akk, inv, w, u,
    daqk, dw, du, dqg, dkt)
