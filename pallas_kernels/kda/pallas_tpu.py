"""Pallas-Mosaic (TPU) launchers for the chunked KDA kernels.

TPU blocks must tile the last two dims by (8, 128) or take them whole, so the kernels work in a
head-major [B, H, T, ·] layout (transposed here, outside the kernels) with per-chunk [C, ·]
blocks. The chunk loop of the state passes is the innermost grid axis ("arbitrary"), the state
lives in a VMEM scratch across it, and the other axes are "parallel". Entry points take and
return the same [B, T, H, ·] layouts as `pallas_gpu`, so `vjp` drives either. Kernel bodies:
`kernels` (state passes, chunk backward, shared with the GPU) and `pallas_tpu_intra` (intra-chunk).
Only interpret mode has run (no TPU available); see benchmarks/kda_kernel.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kda import intra as intra_lib
from pallas_kernels.kda import kernels, pallas_tpu_intra

F32 = jnp.float32
SUB = 16


def _hm(x):
  """[B, T, H, D] <-> [B, H, T, D] (also [B, N, H, K, D] <-> [B, H, N, K, D])."""
  return jnp.swapaxes(x, 1, 2)


def _params(*semantics):
  return pltpu.CompilerParams(dimension_semantics=semantics)


def block_v(dv: int) -> int:
  """V-block of the state passes: one lane-width tile."""
  return min(dv, 128)


def chunk_cumsum(g, chunk, *, interpret):
  """Γ: the in-chunk cumulative sum of g, by XLA (intra.chunk_cumsum)."""
  del interpret
  return intra_lib.chunk_cumsum(g, chunk)


def intra(q, k, v, gam, beta, cnt, *, scale, chunk, interpret, save=True):
  """Same contract as pallas_gpu.intra (akk and inv are always computed, `save` or not:
  pallas_tpu_intra.intra_kernel); grid (B, H, N), all parallel."""
  b, t, h, dk = q.shape
  dv = v.shape[-1]
  n = t // chunk
  st = q.dtype
  tok = lambda d: pl.BlockSpec((None, None, chunk, d), lambda ib, ih, ic: (ib, ih, ic, 0))
  kernel = functools.partial(pallas_tpu_intra.intra_kernel, scale=scale, sub=SUB, mm_dtype=st)
  outs = pl.pallas_call(
      kernel, grid=(b, h, n),
      in_specs=[tok(dk), tok(dk), tok(dv), tok(dk), tok(1),
                pl.BlockSpec((None, chunk, 1), lambda ib, ih, ic: (ib, ic, 0)),
                pl.BlockSpec((None, None, 1, chunk), lambda ib, ih, ic: (ib, ic, 0, 0))],
      out_specs=[tok(chunk), tok(dk), tok(dv), tok(dk), tok(dk), tok(chunk), tok(chunk)],
      out_shape=[jax.ShapeDtypeStruct((b, h, t, d), st) for d in (chunk, dk, dv, dk, dk)]
      + [jax.ShapeDtypeStruct((b, h, t, chunk), F32)] * 2,
      interpret=interpret, compiler_params=_params("parallel", "parallel", "parallel"),
  )(_hm(q), _hm(k), _hm(v), _hm(gam), _hm(beta[..., None]), cnt[..., None],
    cnt.reshape(b, n, 1, chunk))
  return tuple(_hm(x) for x in outs)


def state_fwd(qg, kt, w, u, aqk, d, s0, *, chunk, save, interpret):
  """Same contract as pallas_gpu.state_fwd; grid (B, H, nV, N) with the state in VMEM."""
  b, t, h, dk = qg.shape
  dv = u.shape[-1]
  n = t // chunk
  bv = block_v(dv)
  st = qg.dtype

  def kernel(qg_ref, kt_ref, w_ref, u_ref, aqk_ref, d_ref, s0_ref, o_ref, sf_ref, *rest):
    *saved, s_scr = rest
    i = pl.program_id(3)

    @pl.when(i == 0)
    def _():
      s_scr[...] = s0_ref[...]

    s = s_scr[...]
    if save:
      saved[0][...] = s.astype(saved[0].dtype)
    s, o, delta = kernels.fwd_step(s, qg_ref[...], kt_ref[...], w_ref[...], u_ref[...],
                                   aqk_ref[...], d_ref[...], st)
    s_scr[...] = s
    o_ref[...] = o.astype(o_ref.dtype)
    if save:
      saved[1][...] = delta.astype(saved[1].dtype)

    @pl.when(i == n - 1)
    def _():
      sf_ref[...] = s

  tok = lambda d: pl.BlockSpec((None, None, chunk, d), lambda ib, ih, iv, ic: (ib, ih, ic, 0))
  tok_v = pl.BlockSpec((None, None, chunk, bv), lambda ib, ih, iv, ic: (ib, ih, ic, iv))
  state = pl.BlockSpec((None, None, dk, bv), lambda ib, ih, iv, ic: (ib, ih, 0, iv))
  per_chunk = pl.BlockSpec((None, None, None, dk, bv), lambda ib, ih, iv, ic: (ib, ih, ic, 0, iv))
  out_specs = [tok_v, state]
  out_shape = [jax.ShapeDtypeStruct((b, h, t, dv), st), jax.ShapeDtypeStruct((b, h, dk, dv), F32)]
  if save:
    out_specs += [per_chunk, tok_v]
    out_shape += [jax.ShapeDtypeStruct((b, h, n, dk, dv), st),
                  jax.ShapeDtypeStruct((b, h, t, dv), st)]
  outs = pl.pallas_call(
      kernel, grid=(b, h, dv // bv, n),
      in_specs=[tok(dk), tok(dk), tok(dk), tok_v, tok(chunk),
                pl.BlockSpec((None, None, None, dk, 1), lambda ib, ih, iv, ic: (ib, ih, ic, 0, 0)),
                state],
      out_specs=out_specs, out_shape=out_shape,
      scratch_shapes=[pltpu.VMEM((dk, bv), F32)], interpret=interpret,
      compiler_params=_params("parallel", "parallel", "parallel", "arbitrary"),
      name="state_seq_kernel",
  )(_hm(qg), _hm(kt), _hm(w), _hm(u), _hm(aqk), _hm(d), s0)
  o, sf = _hm(outs[0]), outs[1]
  if save:
    return o, sf, _hm(outs[2]), _hm(outs[3])
  return o, sf


def state_bwd(do, dsf, qg, kt, w, aqk, d, *, chunk, interpret):
  """Same contract as pallas_gpu.state_bwd; the chunk axis runs backwards through index maps."""
  b, t, h, dk = qg.shape
  dv = do.shape[-1]
  n = t // chunk
  bv = block_v(dv)
  st = qg.dtype

  def kernel(do_ref, dsf_ref, qg_ref, kt_ref, w_ref, aqk_ref, d_ref, ds0_ref, dh_ref, ddelta_ref,
             ds_scr):
    j = pl.program_id(3)

    @pl.when(j == 0)
    def _():
      ds_scr[...] = dsf_ref[...]

    ds = ds_scr[...]
    dh_ref[...] = ds.astype(dh_ref.dtype)
    ds, ddelta = kernels.bwd_step(ds, do_ref[...], qg_ref[...], kt_ref[...], w_ref[...],
                                  aqk_ref[...], d_ref[...], st)
    ds_scr[...] = ds
    ddelta_ref[...] = ddelta

    @pl.when(j == n - 1)
    def _():
      ds0_ref[...] = ds

  rev = lambda ic: n - 1 - ic
  tok = lambda d: pl.BlockSpec((None, None, chunk, d),
                               lambda ib, ih, iv, ic: (ib, ih, rev(ic), 0))
  tok_v = pl.BlockSpec((None, None, chunk, bv), lambda ib, ih, iv, ic: (ib, ih, rev(ic), iv))
  state = pl.BlockSpec((None, None, dk, bv), lambda ib, ih, iv, ic: (ib, ih, 0, iv))
  outs = pl.pallas_call(
      kernel, grid=(b, h, dv // bv, n),
      in_specs=[tok_v, state, tok(dk), tok(dk), tok(dk), tok(chunk),
                pl.BlockSpec((None, None, None, dk, 1),
                             lambda ib, ih, iv, ic: (ib, ih, rev(ic), 0, 0))],
      out_specs=[state,
                 pl.BlockSpec((None, None, None, dk, bv),
                              lambda ib, ih, iv, ic: (ib, ih, rev(ic), 0, iv)),
                 tok_v],
      out_shape=[jax.ShapeDtypeStruct((b, h, dk, dv), F32),
                 jax.ShapeDtypeStruct((b, h, n, dk, dv), st),
                 jax.ShapeDtypeStruct((b, h, t, dv), F32)],
      scratch_shapes=[pltpu.VMEM((dk, bv), F32)], interpret=interpret,
      compiler_params=_params("parallel", "parallel", "parallel", "arbitrary"),
      name="state_bwd_kernel",
  )(_hm(do), dsf, _hm(qg), _hm(kt), _hm(w), _hm(aqk), _hm(d))
  return outs[0], _hm(outs[1]), _hm(outs[2])


def chunk_bwd(hs, dhs, delta, ddelta, do, *, chunk, interpret):
  """Same contract as pallas_gpu.chunk_bwd; grid (B, H, N), all parallel."""
  b, n, h, dk, dv = hs.shape
  t = n * chunk
  tok = lambda d: pl.BlockSpec((None, None, chunk, d), lambda ib, ih, ic: (ib, ih, ic, 0))
  state = pl.BlockSpec((None, None, None, dk, dv), lambda ib, ih, ic: (ib, ih, ic, 0, 0))
  kernel = functools.partial(kernels.chunk_bwd_kernel, mm_dtype=hs.dtype)
  outs = pl.pallas_call(
      kernel, grid=(b, h, n),
      in_specs=[state, state, tok(dv), tok(dv), tok(dv)],
      out_specs=[tok(dk), tok(dk), tok(dk), tok(chunk),
                 pl.BlockSpec((None, None, None, dk, 1), lambda ib, ih, ic: (ib, ih, ic, 0, 0))],
      out_shape=[jax.ShapeDtypeStruct((b, h, t, dk), F32)] * 3
      + [jax.ShapeDtypeStruct((b, h, t, chunk), F32),
         jax.ShapeDtypeStruct((b, h, n, dk, 1), F32)],
      interpret=interpret, compiler_params=_params("parallel", "parallel", "parallel"),
  )(_hm(hs), _hm(dhs), _hm(delta), _hm(ddelta), _hm(do))
  return tuple(_hm(x) for x in outs)


def intra_bwd(q, k, v, gam, beta, cnt, akk, inv, w, u, daqk, dw, du, dqg, dkt, dd, d, *, scale,
              chunk, interpret):
  """Same contract as pallas_gpu.intra_bwd; grid (B, H, N), all parallel. The kernel returns dΓ;
  dg (reverse in-chunk cumsum plus the state-decay term) is formed in XLA here."""
  b, t, h, dk = q.shape
  dv = v.shape[-1]
  n = t // chunk
  tok = lambda d: pl.BlockSpec((None, None, chunk, d), lambda ib, ih, ic: (ib, ih, ic, 0))
  kernel = functools.partial(pallas_tpu_intra.intra_bwd_kernel, scale=scale, sub=SUB,
                             mm_dtype=q.dtype)
  outs = pl.pallas_call(
      kernel, grid=(b, h, n),
      in_specs=[tok(dk), tok(dk), tok(dv), tok(dk), tok(1),
                pl.BlockSpec((None, chunk, 1), lambda ib, ih, ic: (ib, ic, 0)),
                pl.BlockSpec((None, None, 1, chunk), lambda ib, ih, ic: (ib, ic, 0, 0)),
                tok(chunk), tok(chunk), tok(dk), tok(dv),
                tok(chunk), tok(dk), tok(dv), tok(dk), tok(dk)],
      out_specs=[tok(dk), tok(dk), tok(dv), tok(1), tok(dk)],
      out_shape=[jax.ShapeDtypeStruct((b, h, t, d), F32) for d in (dk, dk, dv, 1, dk)],
      interpret=interpret, compiler_params=_params("parallel", "parallel", "parallel"),
  )(*(_hm(x) for x in (q, k, v, gam, beta[..., None])), cnt[..., None],
    cnt.reshape(b, n, 1, chunk), *(_hm(x) for x in (akk, inv, w, u, daqk, dw, du, dqg, dkt)))
  dq, dk_, dv_, dbeta, dgam = (_hm(x) for x in outs)
  dg = intra_lib.gamma_to_g_grad(dgam, dd, d, chunk)
  return dq.astype(q.dtype), dk_.astype(q.dtype), dv_.astype(q.dtype), dbeta, dg
