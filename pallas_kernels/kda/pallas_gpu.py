"""Pallas-Triton (GPU) launchers for the chunked KDA kernels, in the native [B, T, H, ·] layout.

No transposes: BlockSpecs squeeze the B and H axes, so a kernel sees strided tiles of one
(batch, head) — a 16-row strip, a [C, ·] chunk or one column block of it — or a whole [T, ·]
column that the state passes walk chunk by chunk with `pl.ds` (sequential over chunks, parallel
over batch × head × V-blocks). With interpret=True the same kernels run on CPU (CI).

Forward: `chunk_cumsum` (Γ), `intra` (pallas_gpu_intra: strip scores, WY inverse, W and U),
`state_fwd`. Backward: `state_bwd`, `chunk_bwd`, `intra_bwd` (WY backward, then score gradients
per K-block, ending at dg). `vjp.py` drives them.

The forward state pass has two forms with the same contract and the same numbers (kernels.py),
chosen per call by the grid rule `split_forward`:
* fused: one sequential kernel computes Δ = U − W S, O = Qg S + A_qk Δ and S' = d⊙S + Ktᵀ Δ per
  chunk (4 dots), at V-block `bv`; used while the B·H·V/bv programs fit the GPU's SMs in one wave;
* split: the sequential kernel computes only Δ and S' (2 dots) at V-block `split_fwd_bv` and
  stores every chunk's entering state h [B,N,H,K,V] and Δ; a chunk-parallel kernel (`output`)
  then computes O = Qg h + A_qk Δ. Used when the programs outnumber the SMs.
The backward state pass is always fused (dΔ = A_qkᵀ dO + Kt dS', dS = Qgᵀ dO + d⊙dS' − Wᵀ dΔ), at
V-block `wide_bwd_bv` with `wide_bwd_warps` warps by the same rule (`wide_backward`), else at
`bv` / `state_warps`. Launch parameters live in one frozen `Settings` (module default SETTINGS);
`configured` swaps them for a block of code (benchmarks, tests). Measurements behind the
defaults: benchmarks/kda_kernel.md.
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import launch, platform
from pallas_kernels.kda import kernels, pallas_gpu_intra

F32 = jnp.float32
SUB = 16             # rows of one strip of the score kernel (and of the WY inverse's blocks)


@dataclasses.dataclass(frozen=True)
class Settings:
  """Launch parameters of the GPU kernels (module default SETTINGS; `configured` swaps it for a
  block of code). Validated on construction."""
  bv: int = 32                   # V-block of the fused state passes (power of two >= 16)
  state_warps: int = 4           # num_warps of the sequential state kernels
  state_stages: int = 3          # their num_stages at V-blocks <= 32 with 16-bit operands
  wide_stages: int = 2           # their num_stages otherwise (3 overflow shared memory there)
  split_fwd: bool | None = None  # forward state pass split / fused; None: by `split_forward`
  split_fwd_bv: int = 64         # V-block of the split forward's sequential kernel
  wide_bwd: bool | None = None   # backward state pass wide; None: by `wide_backward`
  wide_bwd_bv: int = 64          # V-block of the wide backward state pass
  wide_bwd_warps: int = 8        # num_warps of the wide backward state pass
  strip_bk: int = 32             # K-columns per block in the strip score kernel
  strip_warps: int = 2           # num_warps of the strip score kernel
  strip_stages: int = 2          # num_stages of the strip score kernel
  inverse_warps: int = 1         # num_warps of the WY inverse kernel
  wu_bk: int = 128               # K-/V-columns per W/U program
  intra_bk: int = 32             # K-columns per block in the intra-chunk backward kernels
  intra_warps: int = 4           # num_warps of the W/U and intra-chunk backward kernels
  intra_stages: int = 3          # num_stages of the WY inverse, W/U and backward kernels

  def __post_init__(self):
    for name in ("bv", "split_fwd_bv", "wide_bwd_bv", "strip_bk", "wu_bk", "intra_bk"):
      _check_bv(getattr(self, name), name)
    for name in ("state_warps", "wide_bwd_warps", "strip_warps", "inverse_warps",
                 "intra_warps"):
      _check_warps(getattr(self, name), name)
    for name in ("state_stages", "wide_stages", "strip_stages", "intra_stages"):
      if getattr(self, name) not in (1, 2, 3, 4):
        raise ValueError(f"kda pallas_gpu: {name} must be 1, 2, 3 or 4, got "
                         f"{getattr(self, name)!r}")


def _params(num_warps: int, num_stages: int = 2):
  from jax.experimental.pallas import triton as plgpu
  return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _state_params(warps: int, bv: int, dtype, interpret: bool):
  """Compiler params of the sequential state kernels at V-block `bv` with operands of `dtype`
  (None in interpret mode): state_stages for 16-bit operands at V-blocks <= 32, else
  wide_stages (3 stages there ask for more shared memory than an H200 SM has)."""
  if interpret:
    return None
  narrow = bv <= 32 and jnp.dtype(dtype).itemsize <= 2
  return _params(warps, SETTINGS.state_stages if narrow else SETTINGS.wide_stages)


def _check_bv(bv, name="block_v") -> int:
  if not isinstance(bv, int) or isinstance(bv, bool) or bv < 16 or bv & (bv - 1):
    raise ValueError(f"kda pallas_gpu: {name} must be a power of two >= 16, got {bv!r}")
  return bv


def _check_warps(warps, name="state_warps") -> int:
  if warps not in (1, 2, 4, 8, 16):
    raise ValueError(f"kda pallas_gpu: {name} must be 1, 2, 4, 8 or 16, got {warps!r}")
  return warps


SETTINGS = Settings()


def block_v(dv: int, bv: int | None = None) -> int:
  """V-block of a state pass (default SETTINGS.bv = 32: S [K, 32] stays in registers and there
  are B·H·V/32 independent sequential programs), capped at V."""
  return min(dv, _check_bv(SETTINGS.bv if bv is None else bv))


def configured(**overrides):
  """Context manager: SETTINGS with these fields replaced for a block (`launch.swapped`; the
  jitted callers, e.g. op._kda_pallas_core, retrace inside it)."""
  return launch.swapped(sys.modules[__name__], overrides)


def many_programs(b: int, h: int, dv: int, sm_count: int | None) -> bool:
  """Whether the state passes' B·H·V/bv sequential programs (bv = SETTINGS.bv) outnumber the
  `sm_count` SMs (False when unknown: interpret mode)."""
  return sm_count is not None and b * h * (dv // block_v(dv)) > sm_count


def split_forward(b: int, h: int, dv: int, sm_count: int | None) -> bool:
  """Whether the forward state pass runs split: SETTINGS.split_fwd, or `many_programs` when None
  (in one wave the fused kernel wins; past it the split form's shorter sequential loop does)."""
  if SETTINGS.split_fwd is not None:
    return SETTINGS.split_fwd
  return many_programs(b, h, dv, sm_count)


def wide_backward(b: int, h: int, dv: int, sm_count: int | None) -> bool:
  """Whether the backward state pass runs at (wide_bwd_bv, wide_bwd_warps) instead of
  (bv, state_warps): SETTINGS.wide_bwd, or `many_programs` when None."""
  if SETTINGS.wide_bwd is not None:
    return SETTINGS.wide_bwd
  return many_programs(b, h, dv, sm_count)


def _sm_count(interpret: bool) -> int | None:
  return None if interpret else platform.gpu_sm_count()


def _intra_bk(dk: int, dtype, bk: int) -> int:
  """K-block `bk` of an intra-chunk kernel, capped at K and at 16 for fp32 inputs (IEEE fp32
  dots stage more shared memory; fp32 is the checking path)."""
  return min(dk, bk if jnp.dtype(dtype) != F32 else min(bk, 16))


def _cumsum_kernel(g_ref, gam_ref):
  gam_ref[...] = jnp.cumsum(g_ref[...].astype(F32), axis=0)


def chunk_cumsum(g, chunk, *, interpret):
  """Γ [B,T,H,K] fp32: the in-chunk cumulative sum of g (intra.chunk_cumsum), one program per
  (batch, chunk, head)."""
  b, t, h, dk = g.shape
  tok = _tok(chunk, dk)
  return pl.pallas_call(
      _cumsum_kernel, grid=(b, t // chunk, h), in_specs=[tok], out_specs=tok,
      out_shape=jax.ShapeDtypeStruct(g.shape, F32), interpret=interpret,
      compiler_params=None if interpret else _params(4, 1), name="chunk_cumsum_kernel",
  )(g)


def intra(q, k, v, gam, beta, cnt, *, scale, chunk, interpret, save=True):
  """Intra-chunk forward: pallas_gpu_intra.strip_scores_kernel per 16-row strip (grid
  B × N·C/16 × H; it also writes the gated operands), then inverse_kernel per chunk and the W/U
  kernels per chunk and column block (`_wy`).
  Returns aqk [B,T,H,C], w/qg/kt [B,T,H,K], u [B,T,H,V] in q's dtype (the dots' operand dtype),
  then, when `save` (training), akk [B,T,H,C] fp32 and inv [B,T,H,C] in q's dtype for the
  backward (else None, None)."""
  b, t, h, dk = q.shape
  n = t // chunk
  st = q.dtype
  sub = min(SUB, chunk)
  strips = chunk // sub
  strip = functools.partial(_tok, sub)
  whole = lambda d: _tok(chunk, d, strips)
  aqk, akk, qg, kt, kb = pl.pallas_call(
      functools.partial(pallas_gpu_intra.strip_scores_kernel, strips=strips, scale=scale,
                        bk=_intra_bk(dk, st, SETTINGS.strip_bk), mm_dtype=st),
      grid=(b, n * strips, h),
      in_specs=[strip(dk), strip(dk), strip(dk), whole(dk), whole(dk), _cnt_col(sub),
                _cnt_row(chunk, strips), _tok(sub, 1)],
      out_specs=[strip(chunk), strip(chunk)] + [strip(dk)] * 3,
      out_shape=[jax.ShapeDtypeStruct((b, t, h, chunk), st),
                 jax.ShapeDtypeStruct((b, t, h, chunk), F32)]
      + [jax.ShapeDtypeStruct((b, t, h, dk), st)] * 3,
      interpret=interpret,
      compiler_params=None if interpret else _params(SETTINGS.strip_warps, SETTINGS.strip_stages),
  )(q, k, gam, k, gam, cnt[..., None], cnt.reshape(b, n, 1, chunk), beta[..., None])
  w, u, inv = _wy(v, beta, akk, kb, chunk=chunk, sub=sub, bk=_intra_bk(dk, st, SETTINGS.wu_bk),
                  interpret=interpret)
  return (aqk, w, u, qg, kt) + ((akk, inv) if save else (None, None))


def _wy(v, beta, akk, kb, *, chunk, sub, bk, interpret):
  """The WY step from the masked A_kk and kb = β⊙e^Γ⊙K: X per chunk (inverse_kernel), then
  W = X kb and U = X Diag(β) V per chunk and column block of `bk` — one kernel for both when
  K = V (wu_kernel), else w_kernel and u_kernel. Returns w, u and X [B,T,H,C], all in kb's dtype
  (every reader of X casts it to the dots' dtype, kb's)."""
  b, t, h, dk = kb.shape
  dv = v.shape[-1]
  n = t // chunk
  st = kb.dtype
  tok = functools.partial(_tok, chunk)
  params = lambda warps: None if interpret else _params(warps, SETTINGS.intra_stages)
  inv = pl.pallas_call(
      functools.partial(pallas_gpu_intra.inverse_kernel, sub=sub, mm_dtype=st),
      grid=(b, n, h), in_specs=[tok(1), tok(chunk)], out_specs=tok(chunk),
      out_shape=jax.ShapeDtypeStruct((b, t, h, chunk), st), interpret=interpret,
      compiler_params=params(SETTINGS.inverse_warps),
  )(beta[..., None], akk)
  nkb = dk // bk
  kblk = _col_block(chunk, bk, nkb)
  if dv == dk:
    w, u = pl.pallas_call(
        functools.partial(pallas_gpu_intra.wu_kernel, mm_dtype=st),
        grid=(b, n * nkb, h),
        in_specs=[kblk, kblk, _tok(chunk, 1, nkb), _tok(chunk, chunk, nkb)],
        out_specs=[kblk] * 2, out_shape=[jax.ShapeDtypeStruct((b, t, h, dk), st)] * 2,
        interpret=interpret, compiler_params=params(SETTINGS.intra_warps),
    )(kb, v, beta[..., None], inv)
    return w, u, inv
  w = pl.pallas_call(
      functools.partial(pallas_gpu_intra.w_kernel, mm_dtype=st),
      grid=(b, n * nkb, h), in_specs=[kblk, _tok(chunk, chunk, nkb)], out_specs=kblk,
      out_shape=jax.ShapeDtypeStruct((b, t, h, dk), st), interpret=interpret,
      compiler_params=params(SETTINGS.intra_warps),
  )(kb, inv)
  return w, _u_pass(v, beta, inv, chunk=chunk, bk=bk,
                    params=params(SETTINGS.intra_warps), interpret=interpret), inv


def _u_pass(v, beta, inv, *, chunk, bk, params, interpret):
  """U = X Diag(β) V [B,T,H,V] in v's dtype, per chunk and V-block of min(bk, V) columns
  (pallas_gpu_intra.u_kernel)."""
  b, t, h, dv = v.shape
  vb = min(bk, dv)
  nvb = dv // vb
  vblk = _col_block(chunk, vb, nvb)
  return pl.pallas_call(
      functools.partial(pallas_gpu_intra.u_kernel, mm_dtype=v.dtype),
      grid=(b, t // chunk * nvb, h),
      in_specs=[vblk, _tok(chunk, 1, nvb), _tok(chunk, chunk, nvb)],
      out_specs=vblk, out_shape=jax.ShapeDtypeStruct(v.shape, v.dtype), interpret=interpret,
      compiler_params=params,
  )(v, beta[..., None], inv)


def _cnt_col(rows, per=1):
  """cnt [B, T, 1] rows of block P // per of `rows` tokens (grid (B, P, H); see _tok)."""
  return pl.BlockSpec((None, rows, 1), lambda ib, ip, ih: (ib, ip // per, 0))


def _cnt_row(chunk, strips=1):
  """cnt as a [1, C] row of the block's chunk, from cnt.reshape(B, N, 1, C)."""
  return pl.BlockSpec((None, None, 1, chunk), lambda ib, ic, ih: (ib, ic // strips, 0, 0))


def _seq(t, d):
  """Whole-sequence column [T, d] of one (batch, head, V-block) for grid (B, H, nV)."""
  return pl.BlockSpec((None, t, None, d), lambda ib, ih, iv: (ib, 0, ih, 0))


def _seq_v(t, bv):
  return pl.BlockSpec((None, t, None, bv), lambda ib, ih, iv: (ib, 0, ih, iv))


def _state_spec(dk, bv):
  """State tile [K, bv] of (batch, head, V-block) for grid (B, H, nV)."""
  return pl.BlockSpec((None, None, dk, bv), lambda ib, ih, iv: (ib, ih, 0, iv))


def _chunks_v(n, dk, bv):
  """All N chunk states [N, K, bv] of (batch, head, V-block) in a [B, N, H, K, V] array."""
  return pl.BlockSpec((None, n, None, dk, bv), lambda ib, ih, iv: (ib, 0, ih, 0, iv))


def _decay_spec(n, dk):
  return pl.BlockSpec((None, n, None, dk, 1), lambda ib, ih, iv: (ib, 0, ih, 0, 0))


def _tok(rows, d, per=1):
  """A [rows, d] tile of a [B, T, H, d] array for grid (B, P, H): block P // per along T. With
  per = 1 one block per program (a chunk, or a strip when rows is a strip); with `per` programs
  per chunk (strips, K-blocks) each sees its whole chunk."""
  return pl.BlockSpec((None, rows, None, d), lambda ib, ip, ih: (ib, ip // per, ih, 0))


def _col_block(chunk, width, per):
  """Columns (P % per)·width … of chunk P // per, [C, width], of a [B, T, H, ·] array (grid
  (B, P, H) with `per` programs per chunk: K-blocks, or a strip's columns of a [T, C] matrix)."""
  return pl.BlockSpec((None, chunk, None, width),
                      lambda ib, ip, ih: (ib, ip // per, ih, ip % per))


def _chunk_vec(width, per=1):
  """Columns (P % per)·width … of a per-chunk [1, K] row in a [B, N, H, 1, K] array."""
  return pl.BlockSpec((None, None, None, 1, width),
                      lambda ib, ip, ih: (ib, ip // per, ih, 0, ip % per))


def _chunk_state(dk, dv):
  """One chunk's [K, V] state of a [B, N, H, K, V] array for grid (B, N, H)."""
  return pl.BlockSpec((None, None, None, dk, dv), lambda ib, ic, ih: (ib, ic, ih, 0, 0))


def state_fwd(qg, kt, w, u, aqk, d, s0, *, chunk, save, interpret):
  """State pass + outputs, fused or split by `split_forward` (module docstring). Returns (o
  [B,T,H,V] in qg's dtype (fp32 sums, rounded once: no XLA convert after the kernel), S_final
  [B,H,K,V] fp32) and, when `save`, the per-chunk entering states h [B,N,H,K,V] and Δ [B,T,H,V]
  (storage dtype)."""
  b, _, h, _ = qg.shape
  dv = u.shape[-1]
  warps = SETTINGS.state_warps
  if not split_forward(b, h, dv, _sm_count(interpret)):
    return _state_fwd_fused(qg, kt, w, u, aqk, d, s0, chunk=chunk, save=save,
                            interpret=interpret, bv=block_v(dv), warps=warps)
  sf, hs, delta = _state_fwd_seq(kt, w, u, d, s0, chunk=chunk, interpret=interpret,
                                 bv=block_v(dv, SETTINGS.split_fwd_bv), warps=warps)
  o = output(qg, hs, aqk, delta, chunk=chunk, interpret=interpret)
  return (o, sf, hs, delta) if save else (o, sf)


def _state_fwd_fused(qg, kt, w, u, aqk, d, s0, *, chunk, save, interpret, bv, warps):
  """Fused form: one sequential kernel computes Δ, O and S' per chunk."""
  b, t, h, dk = qg.shape
  dv = u.shape[-1]
  n = t // chunk
  st = qg.dtype

  def state_fwd_kernel(qg_ref, kt_ref, w_ref, u_ref, aqk_ref, d_ref, s0_ref, o_ref, sf_ref,
                       *saved):
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

  out_specs = [_seq_v(t, bv), _state_spec(dk, bv)]
  out_shape = [jax.ShapeDtypeStruct((b, t, h, dv), st),
               jax.ShapeDtypeStruct((b, h, dk, dv), F32)]
  if save:
    out_specs += [_chunks_v(n, dk, bv), _seq_v(t, bv)]
    out_shape += [jax.ShapeDtypeStruct((b, n, h, dk, dv), st),
                  jax.ShapeDtypeStruct((b, t, h, dv), st)]
  return pl.pallas_call(
      state_fwd_kernel, grid=(b, h, dv // bv),
      in_specs=[_seq(t, dk), _seq(t, dk), _seq(t, dk), _seq_v(t, bv), _seq(t, chunk),
                _decay_spec(n, dk), _state_spec(dk, bv)],
      out_specs=out_specs, out_shape=out_shape, interpret=interpret,
      compiler_params=_state_params(warps, bv, st, interpret),
  )(qg, kt, w, u, aqk, d, s0)


def _state_fwd_seq(kt, w, u, d, s0, *, chunk, interpret, bv, warps):
  """Split form, sequential part: per chunk store h = S, then Δ = U − W S, S' = d⊙S + Ktᵀ Δ.
  Returns (S_final [B,H,K,V] fp32, h [B,N,H,K,V], Δ [B,T,H,V]) with h, Δ in kt's dtype."""
  b, t, h, dk = kt.shape
  dv = u.shape[-1]
  n = t // chunk
  st = kt.dtype

  def state_seq_kernel(kt_ref, w_ref, u_ref, d_ref, s0_ref, sf_ref, hs_ref, delta_ref):
    def body(i, s):
      rows = pl.ds(i * chunk, chunk)
      hs_ref[i] = s.astype(hs_ref.dtype)
      s, delta = kernels.state_step(s, kt_ref[rows, :], w_ref[rows, :], u_ref[rows, :],
                                    d_ref[i], st)
      delta_ref[rows, :] = delta.astype(delta_ref.dtype)
      return s

    sf_ref[...] = jax.lax.fori_loop(0, n, body, s0_ref[...].astype(F32))

  return pl.pallas_call(
      state_seq_kernel, grid=(b, h, dv // bv),
      in_specs=[_seq(t, dk), _seq(t, dk), _seq_v(t, bv), _decay_spec(n, dk),
                _state_spec(dk, bv)],
      out_specs=[_state_spec(dk, bv), _chunks_v(n, dk, bv), _seq_v(t, bv)],
      out_shape=[jax.ShapeDtypeStruct((b, h, dk, dv), F32),
                 jax.ShapeDtypeStruct((b, n, h, dk, dv), st),
                 jax.ShapeDtypeStruct((b, t, h, dv), st)],
      interpret=interpret, compiler_params=_state_params(warps, bv, st, interpret),
  )(kt, w, u, d, s0)


def output(qg, hs, aqk, delta, *, chunk, interpret):
  """Split form, chunk-parallel part of the forward over grid (B, N, H): O = Qg h + A_qk Δ
  (kernels.out_kernel). qg [B,T,H,K]; hs [B,N,H,K,V]; aqk [B,T,H,C]; delta [B,T,H,V].
  Returns o [B,T,H,V] in qg's dtype."""
  b, n, h, dk, dv = hs.shape
  t = n * chunk
  kernel = functools.partial(kernels.out_kernel, mm_dtype=qg.dtype)
  return pl.pallas_call(
      kernel, grid=(b, n, h),
      in_specs=[_tok(chunk, dk), _chunk_state(dk, dv), _tok(chunk, chunk), _tok(chunk, dv)],
      out_specs=_tok(chunk, dv),
      out_shape=jax.ShapeDtypeStruct((b, t, h, dv), qg.dtype),
      interpret=interpret, compiler_params=None if interpret else _params(4, 1),
  )(qg, hs, aqk, delta)


def state_bwd(do, dsf, qg, kt, w, aqk, d, *, chunk, interpret):
  """Reverse state pass: one reverse sequential kernel computes dΔ and dS per chunk, over grid
  (B, H, V-blocks) — wide (`wide_backward`) or at (bv, state_warps). Returns (dS₀ [B,H,K,V]
  fp32, dS' per chunk [B,N,H,K,V] (storage dtype; the grad of the state leaving chunk n),
  dΔ [B,T,H,V] fp32)."""
  b, t, h, dk = qg.shape
  dv = do.shape[-1]
  n = t // chunk
  st = qg.dtype
  if wide_backward(b, h, dv, _sm_count(interpret)):
    bv, warps = block_v(dv, SETTINGS.wide_bwd_bv), SETTINGS.wide_bwd_warps
  else:
    bv, warps = block_v(dv), SETTINGS.state_warps

  def state_bwd_kernel(do_ref, dsf_ref, qg_ref, kt_ref, w_ref, aqk_ref, d_ref, ds0_ref, dh_ref,
                       ddelta_ref):
    def body(j, ds):
      i = n - 1 - j
      rows = pl.ds(i * chunk, chunk)
      dh_ref[i] = ds.astype(dh_ref.dtype)
      ds, ddelta = kernels.bwd_step(ds, do_ref[rows, :], qg_ref[rows, :], kt_ref[rows, :],
                                    w_ref[rows, :], aqk_ref[rows, :], d_ref[i], st)
      ddelta_ref[rows, :] = ddelta
      return ds

    ds0_ref[...] = jax.lax.fori_loop(0, n, body, dsf_ref[...].astype(F32))

  return pl.pallas_call(
      state_bwd_kernel, grid=(b, h, dv // bv),
      in_specs=[_seq_v(t, bv), _state_spec(dk, bv), _seq(t, dk), _seq(t, dk), _seq(t, dk),
                _seq(t, chunk), _decay_spec(n, dk)],
      out_specs=[_state_spec(dk, bv), _chunks_v(n, dk, bv), _seq_v(t, bv)],
      out_shape=[jax.ShapeDtypeStruct((b, h, dk, dv), F32),
                 jax.ShapeDtypeStruct((b, n, h, dk, dv), st),
                 jax.ShapeDtypeStruct((b, t, h, dv), F32)],
      interpret=interpret, compiler_params=_state_params(warps, bv, st, interpret),
  )(do, dsf, qg, kt, w, aqk, d)


def chunk_bwd(hs, dhs, delta, ddelta, do, *, chunk, interpret):
  """Per-chunk gradient kernel over grid (B, N, H); see kernels.chunk_bwd_kernel. Returns fp32
  (dqg, dw, dkt [B,T,H,K], daqk [B,T,H,C], dd [B,N,H,K,1])."""
  b, n, h, dk, dv = hs.shape
  t = n * chunk
  tok = functools.partial(_tok, chunk)
  state = _chunk_state(dk, dv)
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


def intra_bwd(q, k, v, gam, beta, cnt, akk, inv, w, u, daqk, dw, du, dqg, dkt, dd, d, *, scale,
              chunk, interpret):
  """Intra-chunk backward, ending at dg: pallas_gpu_intra.wy_bwd_kernel per chunk (grid
  (B, N, H)), then pallas_gpu_intra.score_bwd_kernel per chunk and K-block (grid
  (B, N·K/bk, H)). dd, d [B,N,H,K,1]: the state decay's cotangent and value.
  Returns dq, dk [B,T,H,K], dv [B,T,H,V] in q's dtype, dbeta [B,T,H,1] fp32 and dg [B,T,H,K]
  fp32."""
  b, t, h, dk = q.shape
  dv = v.shape[-1]
  n = t // chunk
  bk = _intra_bk(dk, q.dtype, SETTINGS.intra_bk)
  tok = functools.partial(_tok, chunk)
  ddl = (dd * d).reshape(b, n, h, 1, dk)                    # [K, 1] and [1, K]: same memory order
  cnt_row = cnt.reshape(b, n, 1, chunk)
  params = None if interpret else _params(SETTINGS.intra_warps, SETTINGS.intra_stages)
  dv_, dbeta, dakk = pl.pallas_call(
      functools.partial(pallas_gpu_intra.wy_bwd_kernel, bk=bk, mm_dtype=q.dtype),
      grid=(b, n, h),
      in_specs=[tok(dk), tok(dv), tok(dk), tok(1), _cnt_col(chunk), _cnt_row(chunk), tok(chunk),
                tok(chunk), tok(dk), tok(dv), tok(dk), tok(dv)],
      out_specs=[tok(dv), tok(1), tok(chunk)],
      out_shape=[jax.ShapeDtypeStruct((b, t, h, dv), q.dtype),
                 jax.ShapeDtypeStruct((b, t, h, 1), F32),
                 jax.ShapeDtypeStruct((b, t, h, chunk), F32)],
      interpret=interpret, compiler_params=params,
  )(k, v, gam, beta[..., None], cnt[..., None], cnt_row, akk, inv, w, u, dw, du)
  nkb = dk // bk
  kblk = _col_block(chunk, bk, nkb)
  whole = lambda d_: _tok(chunk, d_, nkb)
  dq, dk_, dg = pl.pallas_call(
      functools.partial(pallas_gpu_intra.score_bwd_kernel, scale=scale, mm_dtype=q.dtype),
      grid=(b, n * nkb, h),
      in_specs=[kblk, kblk, kblk, whole(1), _cnt_col(chunk, nkb), _cnt_row(chunk, nkb),
                whole(chunk), whole(chunk), whole(chunk), kblk, kblk, kblk, _chunk_vec(bk, nkb)],
      out_specs=[kblk, kblk, kblk],
      out_shape=[jax.ShapeDtypeStruct((b, t, h, dk), q.dtype)] * 2
      + [jax.ShapeDtypeStruct((b, t, h, dk), F32)],
      interpret=interpret, compiler_params=params,
  )(q, k, gam, beta[..., None], cnt[..., None], cnt_row, inv, daqk, dakk, dw, dqg, dkt, ddl)
  return dq, dk_, dv_, dbeta, dg
