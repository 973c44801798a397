"""Pallas-Triton (GPU) launchers for the chunked KDA kernels, in the native [B, T, H, ·] layout.

No transposes: BlockSpecs squeeze the B and H axes, so a kernel sees strided [C, K] tiles (intra,
chunk backward, split-variant output/local kernels) or a whole [T, K] column of one (batch, head)
that it walks chunk by chunk with `pl.ds` (state passes, sequential over chunks, parallel over
batch × head × V-blocks). With interpret=True the same kernels run on CPU (CI).

Two variants of the state passes, same contracts and the same numbers (see kernels.py):
* fused: the sequential forward loop computes Δ, O and S' (4 dots per chunk), the reverse loop
  dΔ = A_qkᵀ dO + Kt dS' and dS = Qgᵀ dO + d⊙dS' − Wᵀ dΔ (4 dots). The default backward, and
  the default forward while the B·H·V/32 programs fit the GPU's SMs in one wave.
* split (split=True): the sequential loops keep only what depends on the carried state. Forward:
  the loop computes Δ and S' (2 dots) and stores every chunk's entering state h [B,N,H,K,V] and Δ;
  a chunk-parallel kernel then computes O = Qg h + A_qk Δ. Backward: a chunk-parallel kernel
  computes dΔ_local = A_qkᵀ dO and (hoist_qdo) dS_local = Qgᵀ dO first, and the loop does
  dΔ = dΔ_local + Kt dS', dS = dS_local + d⊙dS' − Wᵀ dΔ (2 dots; 3 without hoist_qdo, which
  saves the fp32 [B,N,H,K,V] dS_local buffer). The default forward when the programs outnumber
  the SMs (`split_forward`); then the fused backward runs wider too (`wide_backward`).
The intra-chunk kernels come in variants too (`intra`, `intra_bwd`); the defaults are the
"strips" forward (scores per 16-row strip, then the WY inverse per chunk in 16-row blocks, then
W and U per chunk and column block) and
the "kblocks" backward (WY backward per chunk, score gradients per chunk and K-block). All
choices live in one frozen `Settings` (module default SETTINGS); state launchers also take theirs
as keywords; `configured` swaps the settings for a block of code (benchmarks, tests).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda import intra as intra_lib
from pallas_kernels.kda import intra_levels, kernels

F32 = jnp.float32
INTRA_FWDS = ("columns", "levels", "strips")
INTRA_BWDS = ("chunk", "kblocks", "strips")
SUB = 16             # sub-chunk rows of the "columns" forward kernel

@dataclasses.dataclass(frozen=True)
class Settings:
  """Which kernel variants the launchers use and how they launch them (module default SETTINGS;
  `configured` swaps it for a block of code). Validated on construction."""
  # Defaults: the fastest measured on an H200 (benchmarks/kda_kernel.md, sessions 5 and 6).
  split: bool = False          # both state passes split (else: chosen per pass, below)
  split_fwd: bool | None = None  # forward state pass split (True) or fused (False); None: split
                               # when B·H·V/bv programs outnumber the SMs (`split_forward`)
  split_fwd_bv: int = 64       # V-block of that split forward's sequential kernel
  wide_bwd: bool | None = None   # fused backward state pass at V-block wide_bwd_bv and
  wide_bwd_bv: int = 64        # wide_bwd_warps warps; None: by the same grid rule
  wide_bwd_warps: int = 8      # (`wide_backward`)
  bv: int = 32                 # V-columns per sequential state program (power of two >= 16)
  hoist_qdo: bool = True       # split backward: precompute Qgᵀ dO per chunk (fp32 [B,N,H,K,V])
  state_warps: int = 4         # num_warps of the sequential state kernels
  state_stages: int = 3        # their Triton num_stages (prefetch of the next chunk's loads)
                               # at V-blocks <= 32 (session-7 traces, 2×8192×16: fused forward
                               # 0.281 / 0.317 ms, backward 0.312 / 0.342 at 3 / 2 stages)
  wide_stages: int = 2         # ... at V-blocks > 32 (split forward, wide backward) and for fp32
                               # operands: 3 stages there ask for 237 / 256 KB of shared memory
                               # (the H200 has 227 KB)
  intra_fwd: str = "strips"    # forward intra kernel: "columns", "levels" or "strips" (see intra)
  intra_bwd: str = "kblocks"   # backward intra kernel: "chunk", "kblocks" or "strips" (intra_bwd)
  intra_bk: int = 32           # K-columns per block in the levels / WY / backward kernels
  intra_warps: int = 4         # num_warps of the levels and backward kernels
  columns_warps: int = 8       # num_warps of the "columns" forward kernel
  strip_warps: int = 2         # num_warps of the "strips" score kernel (one 16-row strip each)
  wy_warps: int = 2            # num_warps of the "strips" WY kernel (one chunk in 16-row blocks)
  strip_bk: int = 32           # K-columns per block in the "strips" score kernel
  strip_earlier: str = "blocks"  # its pairs with earlier strips: "chunk" (one masked [C, K]
                               # operand) or "blocks" (a loop over the earlier 16-row blocks:
                               # 2.5× fewer loads and exps on average). Session-7 traces,
                               # 2×8192×16: blocks at 2 warps 0.319 ms, chunk at 1 warp 0.377;
                               # 1×8192×96: 1.056 / 1.043
  wy_split: bool = True        # "strips" WY step as inverse + per-K-block W + per-V-block U
                               # kernels (fla's layout) instead of one kernel
  inverse_warps: int = 1       # num_warps of its inverse kernel (session-6 traces, 2×8192×16:
                               # 0.058 / 0.095 / 0.164 ms at 1 / 2 / 4 warps)
  fuse_wu: bool = True         # wy_split with K = V: W and U in one kernel (wu_kernel)
  wu_bk: int | None = 128      # K-/V-columns per W/U program (None: intra_bk); wider = fewer
                               # re-reads of X, bigger accumulators (session-7 traces, gated
                               # W/U at 128 / 64 / 32: 0.088 / 0.096 / 0.131 ms at 2×8192×16,
                               # 0.281 / 0.318 / 0.450 at 1×8192×96)
  wu_warps: int | None = None  # num_warps of the W/U kernel(s) (None: intra_warps)
  gate_in_scores: bool = True  # wy_split: the strips score kernel also writes e^Γ⊙Q, e^{Γ_C−Γ}⊙K
                               # and β⊙e^Γ⊙K for its rows (q, k, Γ are loaded there already),
                               # so W/U read one [C, K] operand instead of q, k and fp32 Γ
                               # (session-7 traces, forward kernels: 0.905 vs 0.937 ms at
                               # 2×8192×16, 2.627 vs 2.836 at 1×8192×96)
  cumsum_kernel: bool = True   # in-chunk cumsum of g by `chunk_cumsum` (a Pallas kernel) instead
                               # of XLA's reduce-window (0.16 ms at 2×8192×16, session 6)
  intra_stages: int = 3        # Triton num_stages (software pipelining of the K-block loops' loads)
                               # of the intra-chunk kernels (1 → 3: −8 % fwd+bwd, session 6)
  strip_stages: int = 2        # ... of the strips score kernel (session-6 traces: 0.382 / 0.423 /
                               # 0.534 ms at 2 / 3 / 4 stages, 2×8192×16; 3 stages' 53 KB of
                               # shared memory leave 4 one-warp programs per SM)
  unroll_bwd: bool = False     # "kblocks" backward: levels written out (static masks) or a loop
  wy_dots: str = "bf16x3"      # dots of the block-doubling WY inverse: "bf16x3" or "tf32"

  def __post_init__(self):
    for name in ("bv", "intra_bk", "strip_bk", "split_fwd_bv", "wide_bwd_bv"):
      _check_bv(getattr(self, name), name)
    if self.wu_bk is not None:
      _check_bv(self.wu_bk, "wu_bk")
    for name in ("state_warps", "intra_warps", "columns_warps", "strip_warps", "wy_warps",
                 "inverse_warps", "wide_bwd_warps"):
      _check_warps(getattr(self, name), name)
    if self.wu_warps is not None:
      _check_warps(self.wu_warps, "wu_warps")
    for name in ("intra_stages", "strip_stages", "state_stages", "wide_stages"):
      if getattr(self, name) not in (1, 2, 3, 4):
        raise ValueError(f"kda pallas_gpu: {name} must be 1, 2, 3 or 4, got "
                         f"{getattr(self, name)!r}")
    for name, allowed in (("intra_fwd", INTRA_FWDS), ("intra_bwd", INTRA_BWDS),
                          ("wy_dots", ("bf16x3", "tf32")), ("strip_earlier", ("chunk", "blocks"))):
      if getattr(self, name) not in allowed:
        raise ValueError(f"kda pallas_gpu: {name} must be one of {allowed}, "
                         f"got {getattr(self, name)!r}")


def _params(num_warps: int, num_stages: int = 2):
  from jax.experimental.pallas import triton as plgpu
  return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _state_params(warps: int, bv: int, dtype, interpret: bool):
  """Compiler params of the sequential state kernels at V-block `bv` with operands of `dtype`
  (None in interpret mode): state_stages for 16-bit operands at V-blocks <= 32, else
  wide_stages (fp32 operands at 3 stages ask for 256 KB of shared memory: session 7)."""
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
  """V-block of the state passes (default SETTINGS.bv = 32: S [K, 32] stays in registers and there
  are B·H·V/32 independent sequential programs), capped at V."""
  return min(dv, _check_bv(SETTINGS.bv if bv is None else bv))


@contextlib.contextmanager
def configured(**overrides):
  """Temporarily replace fields of SETTINGS (keywords of `Settings`; None leaves one unchanged),
  e.g. to time variants. Bad values raise before anything changes.

  Jitted callers (op._kda_pallas_core) cache their traces without these settings in the key, so
  JAX's caches are cleared on entry and on exit: compile and run what should use the variant
  inside the block.
  """
  global SETTINGS
  saved = SETTINGS
  new = dataclasses.replace(saved, **{k: v for k, v in overrides.items() if v is not None})
  jax.clear_caches()
  try:
    SETTINGS = new
    yield
  finally:
    SETTINGS = saved
    jax.clear_caches()


def _variant(split, bv, dv, warps):
  """Resolve the per-call keywords against the module defaults."""
  split = SETTINGS.split if split is None else split
  warps = _check_warps(SETTINGS.state_warps if warps is None else warps)
  return split, block_v(dv, bv), warps


def many_programs(b: int, h: int, dv: int, sm_count: int | None) -> bool:
  """Whether the state passes' B·H·V/bv sequential programs (bv = SETTINGS.bv) outnumber the
  `sm_count` SMs (False when unknown: interpret mode). Then the split forward and a wider
  backward win; in one wave the fused forward and narrow blocks do (session-6 H200 traces)."""
  return sm_count is not None and b * h * (dv // block_v(dv)) > sm_count


def split_forward(b: int, h: int, dv: int, sm_count: int | None) -> bool:
  """Whether the forward state pass runs split (SETTINGS.split or split_fwd; split_fwd None:
  `many_programs`). Measured on an H200 (132 SMs, session 6): 2×8192×16 (128 programs) fused
  0.345 vs split 0.416 ms; 1×8192×96 (384 programs) fused 1.260 vs split 0.806 ms."""
  if SETTINGS.split or SETTINGS.split_fwd is not None:
    return SETTINGS.split or SETTINGS.split_fwd
  return many_programs(b, h, dv, sm_count)


def wide_backward(b: int, h: int, dv: int, sm_count: int | None) -> bool:
  """Whether the fused backward state pass runs at (wide_bwd_bv, wide_bwd_warps) instead of
  (bv, state_warps): SETTINGS.wide_bwd, or `many_programs` when None. Measured on an H200
  (session 6): 1×8192×96 0.991 ms at V-block 64 / 8 warps vs 1.170 at 32 / 4; 2×8192×16
  0.526 vs 0.345 ms."""
  if SETTINGS.wide_bwd is not None:
    return SETTINGS.wide_bwd
  return many_programs(b, h, dv, sm_count)


def _sm_count(interpret: bool) -> int | None:
  return None if interpret else getattr(jax.devices()[0], "core_count", None)


def _intra_bk(dk: int, dtype, bk: int | None = None) -> int:
  """K-block of the levels kernels (SETTINGS.intra_bk unless `bk` is given), at most 16 for fp32
  inputs (IEEE fp32 dots stage more shared memory; an H200 run at 64 overflowed it, and fp32 is
  the checking path)."""
  bk = SETTINGS.intra_bk if bk is None else bk
  return min(dk, bk if jnp.dtype(dtype) != F32 else min(bk, 16))


def _cumsum_kernel(g_ref, gam_ref):
  gam_ref[...] = jnp.cumsum(g_ref[...].astype(F32), axis=0)


def chunk_cumsum(g, chunk, *, interpret):
  """Γ [B,T,H,K] fp32: the in-chunk cumulative sum of g. With SETTINGS.cumsum_kernel one program
  per (batch, chunk, head); else intra.chunk_cumsum, which XLA lowers to a 64-wide reduce-window
  ("loop_add_fusion": 0.16 ms at 2×8192×16 on an H200, where one read and one write of g would
  take ~0.08)."""
  if not SETTINGS.cumsum_kernel:
    return intra_lib.chunk_cumsum(g, chunk)
  b, t, h, dk = g.shape
  tok = _tok(chunk, dk)
  return pl.pallas_call(
      _cumsum_kernel, grid=(b, t // chunk, h), in_specs=[tok], out_specs=tok,
      out_shape=jax.ShapeDtypeStruct(g.shape, F32), interpret=interpret,
      compiler_params=None if interpret else _params(4, 1),
  )(g)


def intra(q, k, v, gam, beta, cnt, *, scale, chunk, interpret, save=True):
  """Intra-chunk forward over the chunks, by SETTINGS.intra_fwd:
  "columns": kernels.intra_kernel, one program per chunk (diagonal sub-chunk blocks one column at
             a time, WY inverse row by row);
  "levels":  intra_levels.intra_fwd_kernel, one program per chunk, dots only;
  "strips":  intra_levels.strip_scores_kernel, one program per 16-row strip, then
             intra_levels.wy_kernel per chunk (inverse by 16-row blocks, W, U).
  Returns aqk [B,T,H,C], w/qg/kt [B,T,H,K], u [B,T,H,V] in q's dtype (the dots' operand dtype),
  then, when `save` (training), akk [B,T,H,C] fp32 and inv [B,T,H,C] (fp32 from the columns /
  levels kernels, q's dtype from strips) for the backward (else None, None)."""
  if SETTINGS.intra_fwd == "strips":
    return _intra_strips(q, k, v, gam, beta, cnt, scale=scale, chunk=chunk, interpret=interpret,
                         save=save)
  b, t, h, dk = q.shape
  dv = v.shape[-1]
  n = t // chunk
  st = q.dtype
  tok = functools.partial(_tok, chunk)
  columns = SETTINGS.intra_fwd == "columns"
  if columns:
    kernel = functools.partial(kernels.intra_kernel, scale=scale, sub=SUB, mm_dtype=st)
  else:
    kernel = functools.partial(intra_levels.intra_fwd_kernel, scale=scale, bk=_intra_bk(dk, st),
                               mm_dtype=st, wy_dots=SETTINGS.wy_dots)
  shapes = [jax.ShapeDtypeStruct((b, t, h, d), st) for d in (chunk, dk, dv, dk, dk)]
  out_specs = [tok(chunk), tok(dk), tok(dv), tok(dk), tok(dk)]
  if save or columns:                    # the columns kernel always writes akk and inv
    shapes += [jax.ShapeDtypeStruct((b, t, h, chunk), F32)] * 2
    out_specs += [tok(chunk), tok(chunk)]
  outs = pl.pallas_call(
      kernel, grid=(b, n, h),
      in_specs=[tok(dk), tok(dk), tok(dv), tok(dk), tok(1), _cnt_col(chunk), _cnt_row(chunk)],
      out_specs=out_specs, out_shape=shapes, interpret=interpret,
      compiler_params=None if interpret else _params(
          SETTINGS.columns_warps if columns else SETTINGS.intra_warps, SETTINGS.intra_stages),
  )(q, k, v, gam, beta[..., None], cnt[..., None], cnt.reshape(b, n, 1, chunk))
  return tuple(outs) if save else tuple(outs[:5]) + (None, None)


def _cnt_col(rows, per=1):
  """cnt [B, T, 1] rows of block P // per of `rows` tokens (grid (B, P, H); see _tok)."""
  return pl.BlockSpec((None, rows, 1), lambda ib, ip, ih: (ib, ip // per, 0))


def _cnt_row(chunk, strips=1):
  """cnt as a [1, C] row of the block's chunk, from cnt.reshape(B, N, 1, C)."""
  return pl.BlockSpec((None, None, 1, chunk), lambda ib, ic, ih: (ib, ic // strips, 0, 0))


def _intra_strips(q, k, v, gam, beta, cnt, *, scale, chunk, interpret, save):
  """The "strips" forward: scores per 16-row strip (grid B × N·C/16 × H), then the WY kernel per
  chunk (grid B × N × H). Same outputs as `intra`."""
  b, t, h, dk = q.shape
  dv = v.shape[-1]
  n = t // chunk
  st = q.dtype
  sub = min(SUB, chunk)
  strips = chunk // sub
  bk = _intra_bk(dk, st)
  strip = functools.partial(_tok, sub)
  whole = lambda d: _tok(chunk, d, strips)
  cnt_row = cnt.reshape(b, n, 1, chunk)
  scores_kernel = {"chunk": intra_levels.strip_scores_kernel,
                   "blocks": intra_levels.strip_blocks_kernel}[SETTINGS.strip_earlier]
  gate = SETTINGS.wy_split and SETTINGS.gate_in_scores
  in_specs = [strip(dk), strip(dk), strip(dk), whole(dk), whole(dk), _cnt_col(sub),
              _cnt_row(chunk, strips)]
  args = [q, k, gam, k, gam, cnt[..., None], cnt_row]
  out_specs = [strip(chunk), strip(chunk)]
  out_shape = [jax.ShapeDtypeStruct((b, t, h, chunk), st),
               jax.ShapeDtypeStruct((b, t, h, chunk), F32)]
  if gate:    # + β in; e^Γ⊙Q, e^{Γ_C−Γ}⊙K, β⊙e^Γ⊙K out (intra_levels._store_gates)
    in_specs.append(_tok(sub, 1))
    args.append(beta[..., None])
    out_specs += [strip(dk)] * 3
    out_shape += [jax.ShapeDtypeStruct((b, t, h, dk), st)] * 3
  aqk, akk, *gates = pl.pallas_call(
      functools.partial(scores_kernel, strips=strips, scale=scale,
                        bk=_intra_bk(dk, st, SETTINGS.strip_bk), mm_dtype=st, gate=gate),
      grid=(b, n * strips, h), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      interpret=interpret,
      compiler_params=None if interpret else _params(SETTINGS.strip_warps, SETTINGS.strip_stages),
  )(*args)
  if SETTINGS.wy_split:
    w, u, qg, kt, inv = _wy_split(q, k, v, gam, beta, cnt, akk, tuple(gates) if gate else None,
                                  scale=scale, chunk=chunk, sub=sub,
                                  bk=_intra_bk(dk, st, SETTINGS.wu_bk), interpret=interpret)
    return (aqk, w, u, qg, kt) + ((akk, inv) if save else (None, None))
  tok = functools.partial(_tok, chunk)
  shapes = [jax.ShapeDtypeStruct((b, t, h, d), st) for d in (dk, dv, dk, dk)]
  out_specs = [tok(dk), tok(dv), tok(dk), tok(dk)]
  if save:
    shapes.append(jax.ShapeDtypeStruct((b, t, h, chunk), st))   # X in the dots' dtype
    out_specs.append(tok(chunk))
  outs = pl.pallas_call(
      functools.partial(intra_levels.wy_kernel, scale=scale, bk=bk, mm_dtype=st,
                        wy_dots=SETTINGS.wy_dots, sub=sub),
      grid=(b, n, h),
      in_specs=[tok(dk), tok(dk), tok(dv), tok(dk), tok(1), _cnt_col(chunk), tok(chunk)],
      out_specs=out_specs, out_shape=shapes, interpret=interpret,
      compiler_params=None if interpret else _params(SETTINGS.wy_warps, SETTINGS.intra_stages),
  )(q, k, v, gam, beta[..., None], cnt[..., None], akk)
  w, u, qg, kt = outs[:4]
  return (aqk, w, u, qg, kt) + ((akk, outs[4]) if save else (None, None))


def _wy_split(q, k, v, gam, beta, cnt, akk, gates, *, scale, chunk, sub, bk, interpret):
  """The WY step as three chunk-parallel kernels ("wy_split"): X per chunk (inverse_kernel), then
  W, e^Γ⊙Q, e^{Γ_C−Γ}⊙K per chunk and K-block (w_kernel) and U per chunk and V-block
  (u_kernel), or W and U in one kernel (fuse_wu). `gates`: (qg, kt, kb) from the score kernel
  (Settings.gate_in_scores), so W is X kb alone; None: the W kernels gate q and k themselves.
  Returns w, u, qg, kt and X [B,T,H,C] (always written) in q's dtype (X: every reader casts it
  to the dots' dtype, q's)."""
  b, t, h, dk = q.shape
  dv = v.shape[-1]
  n = t // chunk
  st = q.dtype
  tok = functools.partial(_tok, chunk)
  params = lambda warps: None if interpret else _params(warps, SETTINGS.intra_stages)
  inv = pl.pallas_call(
      functools.partial(intra_levels.inverse_kernel, sub=sub, mm_dtype=st,
                        wy_dots=SETTINGS.wy_dots),
      grid=(b, n, h), in_specs=[tok(1), tok(chunk)], out_specs=tok(chunk),
      out_shape=jax.ShapeDtypeStruct((b, t, h, chunk), st), interpret=interpret,
      compiler_params=params(SETTINGS.inverse_warps),
  )(beta[..., None], akk)
  nkb = dk // bk
  wu_warps = SETTINGS.intra_warps if SETTINGS.wu_warps is None else SETTINGS.wu_warps
  kblk = _col_block(chunk, bk, nkb)
  if gates is not None:
    return _wy_gated(v, beta, inv, gates, chunk=chunk, bk=bk, params=params(wu_warps),
                     interpret=interpret) + (inv,)
  if SETTINGS.fuse_wu and dv == dk:
    w, u, qg, kt = pl.pallas_call(
        functools.partial(intra_levels.wu_kernel, scale=scale, mm_dtype=st),
        grid=(b, n * nkb, h),
        in_specs=[kblk, kblk, kblk, kblk, _tok(chunk, 1, nkb), _cnt_col(chunk, nkb),
                  _tok(chunk, chunk, nkb)],
        out_specs=[kblk] * 4,
        out_shape=[jax.ShapeDtypeStruct((b, t, h, dk), st)] * 4, interpret=interpret,
        compiler_params=params(wu_warps),
    )(q, k, v, gam, beta[..., None], cnt[..., None], inv)
    return w, u, qg, kt, inv
  w, qg, kt = pl.pallas_call(
      functools.partial(intra_levels.w_kernel, scale=scale, mm_dtype=st),
      grid=(b, n * nkb, h),
      in_specs=[kblk, kblk, kblk, _tok(chunk, 1, nkb), _cnt_col(chunk, nkb),
                _tok(chunk, chunk, nkb)],
      out_specs=[kblk, kblk, kblk],
      out_shape=[jax.ShapeDtypeStruct((b, t, h, dk), st)] * 3, interpret=interpret,
      compiler_params=params(wu_warps),
  )(q, k, gam, beta[..., None], cnt[..., None], inv)
  return w, _u_pass(v, beta, inv, chunk=chunk, bk=bk, params=params(wu_warps),
                    interpret=interpret), qg, kt, inv


def _wy_gated(v, beta, inv, gates, *, chunk, bk, params, interpret):
  """W = X kb and U = X Diag(β) V from X and the gating score kernel's kb = β⊙e^Γ⊙K: one kernel
  per chunk and column block when K = V and fuse_wu, else a W and a U kernel. Returns (w, u, qg,
  kt) with qg, kt passed through from `gates`."""
  qg, kt, kb = gates
  b, t, h, dk = kb.shape
  dv = v.shape[-1]
  n = t // chunk
  st = kb.dtype
  nkb = dk // bk
  kblk = _col_block(chunk, bk, nkb)
  if SETTINGS.fuse_wu and dv == dk:
    w, u = pl.pallas_call(
        functools.partial(intra_levels.wu_gated_kernel, mm_dtype=st),
        grid=(b, n * nkb, h),
        in_specs=[kblk, kblk, _tok(chunk, 1, nkb), _tok(chunk, chunk, nkb)],
        out_specs=[kblk] * 2, out_shape=[jax.ShapeDtypeStruct((b, t, h, dk), st)] * 2,
        interpret=interpret, compiler_params=params,
    )(kb, v, beta[..., None], inv)
    return w, u, qg, kt
  w = pl.pallas_call(
      functools.partial(intra_levels.w_gated_kernel, mm_dtype=st),
      grid=(b, n * nkb, h), in_specs=[kblk, _tok(chunk, chunk, nkb)], out_specs=kblk,
      out_shape=jax.ShapeDtypeStruct((b, t, h, dk), st), interpret=interpret,
      compiler_params=params,
  )(kb, inv)
  return w, _u_pass(v, beta, inv, chunk=chunk, bk=bk, params=params, interpret=interpret), qg, kt


def _u_pass(v, beta, inv, *, chunk, bk, params, interpret):
  """U = X Diag(β) V [B,T,H,V] in v's dtype, per chunk and V-block of min(bk, V) columns
  (intra_levels.u_kernel)."""
  b, t, h, dv = v.shape
  vb = min(bk, dv)
  nvb = dv // vb
  vblk = _col_block(chunk, vb, nvb)
  return pl.pallas_call(
      functools.partial(intra_levels.u_kernel, mm_dtype=v.dtype),
      grid=(b, t // chunk * nvb, h),
      in_specs=[vblk, _tok(chunk, 1, nvb), _tok(chunk, chunk, nvb)],
      out_specs=vblk, out_shape=jax.ShapeDtypeStruct(v.shape, v.dtype), interpret=interpret,
      compiler_params=params,
  )(v, beta[..., None], inv)


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


def state_fwd(qg, kt, w, u, aqk, d, s0, *, chunk, save, interpret, split=None, bv=None,
              state_warps=None):
  """State pass + outputs. Returns (o [B,T,H,V] in qg's dtype (fp32 sums, rounded once: no XLA
  convert after the kernel), S_final [B,H,K,V] fp32) and, when `save`,
  the per-chunk entering states h [B,N,H,K,V] and Δ [B,T,H,V] (storage dtype).
  split/bv/state_warps: the variant (None = SETTINGS)."""
  b, _, h, _ = qg.shape
  dv = u.shape[-1]
  if split is None and not SETTINGS.split and split_forward(b, h, dv, _sm_count(interpret)):
    split, bv = True, bv or SETTINGS.split_fwd_bv
  split, bv, warps = _variant(split, bv, dv, state_warps)
  if not split:
    return _state_fwd_fused(qg, kt, w, u, aqk, d, s0, chunk=chunk, save=save,
                            interpret=interpret, bv=bv, warps=warps)
  sf, hs, delta = _state_fwd_seq(kt, w, u, d, s0, chunk=chunk, interpret=interpret, bv=bv,
                                 warps=warps)
  o = output(qg, hs, aqk, delta, chunk=chunk, interpret=interpret)
  return (o, sf, hs, delta) if save else (o, sf)


def _state_fwd_fused(qg, kt, w, u, aqk, d, s0, *, chunk, save, interpret, bv, warps):
  """Fused variant: one sequential kernel computes Δ, O and S' per chunk."""
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
  """Split variant, sequential part: per chunk store h = S, then Δ = U − W S, S' = d⊙S + Ktᵀ Δ.
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
  """Split variant, chunk-parallel part of the forward over grid (B, N, H): O = Qg h + A_qk Δ
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


def state_bwd(do, dsf, qg, kt, w, aqk, d, *, chunk, interpret, split=None, bv=None,
              hoist_qdo=None, state_warps=None):
  """Reverse state pass. Returns (dS₀ [B,H,K,V] fp32, dS' per chunk [B,N,H,K,V] (storage
  dtype; the grad of the state leaving chunk n), dΔ [B,T,H,V] fp32).
  split/bv/hoist_qdo/state_warps: the variant (None = module defaults)."""
  b, _, h, _ = qg.shape
  dv = do.shape[-1]
  if (split is None and bv is None and state_warps is None and not SETTINGS.split
      and wide_backward(b, h, dv, _sm_count(interpret))):
    bv, state_warps = SETTINGS.wide_bwd_bv, SETTINGS.wide_bwd_warps
  split, bv, warps = _variant(split, bv, dv, state_warps)
  hoist = SETTINGS.hoist_qdo if hoist_qdo is None else hoist_qdo
  if not split:
    return _state_bwd_fused(do, dsf, qg, kt, w, aqk, d, chunk=chunk, interpret=interpret, bv=bv,
                            warps=warps)
  local = bwd_local(aqk, qg, do, chunk=chunk, hoist_qdo=hoist, interpret=interpret)
  return _state_bwd_seq(local, do, dsf, qg, kt, w, d, chunk=chunk, interpret=interpret, bv=bv,
                        warps=warps)


def _state_bwd_outputs(b, t, h, n, dk, dv, bv, st) -> dict:
  """out_specs / out_shape of both reverse state passes: dS₀ [B,H,K,V] fp32, dS' per chunk
  [B,N,H,K,V] (storage dtype), dΔ [B,T,H,V] fp32."""
  return dict(out_specs=[_state_spec(dk, bv), _chunks_v(n, dk, bv), _seq_v(t, bv)],
              out_shape=[jax.ShapeDtypeStruct((b, h, dk, dv), F32),
                         jax.ShapeDtypeStruct((b, n, h, dk, dv), st),
                         jax.ShapeDtypeStruct((b, t, h, dv), F32)])


def _state_bwd_fused(do, dsf, qg, kt, w, aqk, d, *, chunk, interpret, bv, warps):
  """Fused variant: one reverse sequential kernel computes dΔ and dS per chunk."""
  b, t, h, dk = qg.shape
  dv = do.shape[-1]
  n = t // chunk
  st = qg.dtype

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
      **_state_bwd_outputs(b, t, h, n, dk, dv, bv, st),
      interpret=interpret, compiler_params=_state_params(warps, bv, st, interpret),
  )(do, dsf, qg, kt, w, aqk, d)


def bwd_local(aqk, qg, do, *, chunk, hoist_qdo, interpret):
  """Split variant, chunk-parallel part of the backward over grid (B, N, H)
  (kernels.bwd_local_kernel). Returns dΔ_local = A_qkᵀ dO [B,T,H,V] fp32 and, if `hoist_qdo`,
  dS_local = Qgᵀ dO [B,N,H,K,V] fp32 (a 1-tuple otherwise)."""
  b, t, h, dk = qg.shape
  dv = do.shape[-1]
  n = t // chunk
  out_specs = [_tok(chunk, dv)]
  out_shape = [jax.ShapeDtypeStruct((b, t, h, dv), F32)]
  if hoist_qdo:
    out_specs.append(_chunk_state(dk, dv))
    out_shape.append(jax.ShapeDtypeStruct((b, n, h, dk, dv), F32))
  kernel = functools.partial(kernels.bwd_local_kernel, mm_dtype=qg.dtype)
  return tuple(pl.pallas_call(
      kernel, grid=(b, n, h),
      in_specs=[_tok(chunk, chunk), _tok(chunk, dk), _tok(chunk, dv)],
      out_specs=out_specs, out_shape=out_shape,
      interpret=interpret, compiler_params=None if interpret else _params(4, 1),
  )(aqk, qg, do))


def _state_bwd_seq(local, do, dsf, qg, kt, w, d, *, chunk, interpret, bv, warps):
  """Split variant, sequential part of the backward: dΔ = dΔ_local + Kt dS',
  dS = dS_local + d⊙dS' − Wᵀ dΔ, with dS_local read from `local` (hoisted) or computed in the
  loop as Qgᵀ dO. Same outputs as `_state_bwd_fused`."""
  b, t, h, dk = qg.shape
  dv = do.shape[-1]
  n = t // chunk
  st = qg.dtype
  hoisted = len(local) == 2

  def state_bwd_seq_kernel(ddl_ref, dsl_or_do_ref, dsf_ref, qg_ref, kt_ref, w_ref, d_ref,
                           ds0_ref, dh_ref, ddelta_ref):
    def body(j, ds):
      i = n - 1 - j
      rows = pl.ds(i * chunk, chunk)
      dh_ref[i] = ds.astype(dh_ref.dtype)
      if hoisted:
        dsl = dsl_or_do_ref[i]
      else:
        dsl = kernels.mm_tn(qg_ref[rows, :], dsl_or_do_ref[rows, :].astype(F32), st)
      ds, ddelta = kernels.bwd_state_step(ds, ddl_ref[rows, :], dsl, kt_ref[rows, :],
                                          w_ref[rows, :], d_ref[i], st)
      ddelta_ref[rows, :] = ddelta
      return ds

    ds0_ref[...] = jax.lax.fori_loop(0, n, body, dsf_ref[...].astype(F32))

  second = (local[1], _chunks_v(n, dk, bv)) if hoisted else (do, _seq_v(t, bv))
  return pl.pallas_call(
      state_bwd_seq_kernel, grid=(b, h, dv // bv),
      in_specs=[_seq_v(t, bv), second[1], _state_spec(dk, bv), _seq(t, dk), _seq(t, dk),
                _seq(t, dk), _decay_spec(n, dk)],
      **_state_bwd_outputs(b, t, h, n, dk, dv, bv, st),
      interpret=interpret, compiler_params=_state_params(warps, bv, st, interpret),
  )(local[0], second[0], dsf, qg, kt, w, d)


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
  """Intra-chunk backward, ending at dg: SETTINGS.intra_bwd = "chunk"
  (intra_levels.intra_bwd_kernel over grid (B, N, H)), "kblocks" (intra_levels.wy_bwd_kernel per
  chunk, then intra_levels.score_bwd_kernel over grid (B, N·K/bk, H)) or "strips"
  (wy_bwd_kernel, then intra_levels.strip_grads_kernel per 16-row strip and
  intra_levels.dg_kernel per chunk). dd, d [B,N,H,K,1]: the state decay's cotangent and value.
  Returns dq, dk [B,T,H,K], dv [B,T,H,V] in q's dtype, dbeta [B,T,H,1] fp32 and dg [B,T,H,K]
  fp32."""
  b, t, h, dk = q.shape
  dv = v.shape[-1]
  n = t // chunk
  bk = _intra_bk(dk, q.dtype)
  tok = functools.partial(_tok, chunk)
  ddl = (dd * d).reshape(b, n, h, 1, dk)                    # [K, 1] and [1, K]: same memory order
  cnt_row = cnt.reshape(b, n, 1, chunk)
  params = None if interpret else _params(SETTINGS.intra_warps, SETTINGS.intra_stages)
  k_shapes = [jax.ShapeDtypeStruct((b, t, h, dk), q.dtype)] * 2
  grad_shapes = [jax.ShapeDtypeStruct((b, t, h, dv), q.dtype),
                 jax.ShapeDtypeStruct((b, t, h, 1), F32)]
  if SETTINGS.intra_bwd == "chunk":
    dq, dk_, dv_, dbeta, dg = pl.pallas_call(
        functools.partial(intra_levels.intra_bwd_kernel, scale=scale, bk=bk, mm_dtype=q.dtype),
        grid=(b, n, h),
        in_specs=[tok(dk), tok(dk), tok(dv), tok(dk), tok(1), _cnt_col(chunk), _cnt_row(chunk),
                  tok(chunk), tok(chunk), tok(dk), tok(dv),
                  tok(chunk), tok(dk), tok(dv), tok(dk), tok(dk), _chunk_vec(dk)],
        out_specs=[tok(dk), tok(dk), tok(dv), tok(1), tok(dk)],
        out_shape=k_shapes + grad_shapes + [jax.ShapeDtypeStruct((b, t, h, dk), F32)],
        interpret=interpret, compiler_params=params,
    )(q, k, v, gam, beta[..., None], cnt[..., None], cnt_row, akk, inv, w, u,
      daqk, dw, du, dqg, dkt, ddl)
    return dq, dk_, dv_, dbeta, dg
  dv_, dbeta, dakk = pl.pallas_call(
      functools.partial(intra_levels.wy_bwd_kernel, bk=bk, mm_dtype=q.dtype),
      grid=(b, n, h),
      in_specs=[tok(dk), tok(dv), tok(dk), tok(1), _cnt_col(chunk), _cnt_row(chunk), tok(chunk),
                tok(chunk), tok(dk), tok(dv), tok(dk), tok(dv)],
      out_specs=[tok(dv), tok(1), tok(chunk)],
      out_shape=grad_shapes + [jax.ShapeDtypeStruct((b, t, h, chunk), F32)],
      interpret=interpret, compiler_params=params,
  )(k, v, gam, beta[..., None], cnt[..., None], cnt_row, akk, inv, w, u, dw, du)
  if SETTINGS.intra_bwd == "strips":
    dq, dk_, dg = _grads_strips(q, k, gam, beta, cnt, cnt_row, inv, daqk, dakk, dw, dqg, dkt,
                                ddl, scale=scale, chunk=chunk, bk=bk, interpret=interpret)
    return dq, dk_, dv_, dbeta, dg
  nkb = dk // bk
  kblk = _col_block(chunk, bk, nkb)
  whole = lambda d_: _tok(chunk, d_, nkb)
  dq, dk_, dg = pl.pallas_call(
      functools.partial(intra_levels.score_bwd_kernel, scale=scale, mm_dtype=q.dtype,
                        unroll=SETTINGS.unroll_bwd),
      grid=(b, n * nkb, h),
      in_specs=[kblk, kblk, kblk, whole(1), _cnt_col(chunk, nkb), _cnt_row(chunk, nkb),
                whole(chunk), whole(chunk), whole(chunk), kblk, kblk, kblk, _chunk_vec(bk, nkb)],
      out_specs=[kblk, kblk, kblk],
      out_shape=k_shapes + [jax.ShapeDtypeStruct((b, t, h, dk), F32)],
      interpret=interpret, compiler_params=params,
  )(q, k, gam, beta[..., None], cnt[..., None], cnt_row, inv, daqk, dakk, dw, dqg, dkt, ddl)
  return dq, dk_, dv_, dbeta, dg


def _grads_strips(q, k, gam, beta, cnt, cnt_row, inv, daqk, dakk, dw, dqg, dkt, ddl, *, scale,
                  chunk, bk, interpret):
  """The "strips" backward after the WY kernel: score gradients per 16-row strip (grid
  B × N·C/16 × H), then dg per chunk. Returns dq, dk [B,T,H,K] in q's dtype and dg fp32."""
  b, t, h, dk = q.shape
  n = t // chunk
  sub = min(SUB, chunk)
  strips = chunk // sub
  strip = functools.partial(_tok, sub)
  whole = lambda d: _tok(chunk, d, strips)
  col_block = _col_block(chunk, sub, strips)
  cnt_chunk = _cnt_col(chunk, strips)
  params = None if interpret else _params(SETTINGS.strip_warps, SETTINGS.intra_stages)
  dq, dk_, dgam = pl.pallas_call(
      functools.partial(intra_levels.strip_grads_kernel, strips=strips, scale=scale, bk=bk,
                        mm_dtype=q.dtype),
      grid=(b, n * strips, h),
      in_specs=[strip(dk), strip(dk), strip(dk), whole(dk), whole(dk), whole(dk), strip(1),
                _cnt_col(sub), cnt_chunk, _cnt_row(chunk, strips), strip(chunk), strip(chunk),
                col_block, col_block, col_block, whole(dk), strip(dk), strip(dk)],
      out_specs=[strip(dk), strip(dk), strip(dk)],
      out_shape=[jax.ShapeDtypeStruct((b, t, h, dk), q.dtype)] * 2
      + [jax.ShapeDtypeStruct((b, t, h, dk), F32)],
      interpret=interpret, compiler_params=params,
  )(q, k, gam, q, k, gam, beta[..., None], cnt[..., None], cnt[..., None], cnt_row, daqk, dakk,
    daqk, dakk, inv, dw, dqg, dkt)
  tok = functools.partial(_tok, chunk)
  dg = pl.pallas_call(
      functools.partial(intra_levels.dg_kernel, bk=bk, mm_dtype=q.dtype),
      grid=(b, n, h),
      in_specs=[tok(dk), tok(dk), tok(dk), _cnt_col(chunk), tok(dk),
                _chunk_vec(dk)],
      out_specs=tok(dk), out_shape=jax.ShapeDtypeStruct((b, t, h, dk), F32),
      interpret=interpret, compiler_params=None if interpret else _params(4, 1),
  )(dgam, k, gam, cnt[..., None], dkt, ddl)
  return dq, dk_, dg
