"""Intra-chunk KDA kernel bodies built from dots only ("levels"), for the Triton (GPU) launchers.

Same contracts as `kernels.intra_kernel` / `kernels.intra_bwd_kernel` (their jnp twin is
`intra.intra_all`), computed so that almost all work is tensor-core dots on [C, C] and [C, bk]
tiles, with no row-by-row loops:

* Scores. Every pair s < r of a chunk is split at the highest bit where r and s differ: at that
  level L (a power of two < C) both lie in one block of 2L rows, r in its upper half and s in its
  lower half, and m = the block's middle row lies between them. So
      e^{Γ_r − Γ_s} = e^{Γ_r − Γ_m} · e^{Γ_m − Γ_s},  both factors ≤ 1 (g ≤ 0),
  and with E_L[x] = exp(−|Γ_x − Γ_{m(x)}|) one masked dot per level gives that level's pairs:
      A_qk += M_L ⊙ ((Q ⊙ E_L)(K ⊙ E_L)ᵀ),  A_kk += M_L ⊙ ((K ⊙ E_L)(K ⊙ E_L)ᵀ).
  log2(C) levels cover all pairs exactly once; the diagonal of A_qk is the row dot q_r · k_r.
  Nothing exponentiates a positive number, so Γ may fall to −∞ inside a chunk.
* WY inverse X = (I + N)⁻¹ (N = Diag(β) A_kk, strictly lower) by block doubling: X starts as I
  (the inverse of the 1×1 blocks) and each level joins pairs of diagonal blocks,
      X ← X − X (M_L ⊙ N) X,
  which is [[A⁻¹, 0], [−D⁻¹ C A⁻¹, D⁻¹]] for every 2L-block. Dots here are "precise" (fp32 IEEE
  for fp32 inputs; otherwise three bf16 dots of a hi/lo split, or one TF32 dot).
* Backward: the WY solve's VJP (dR = Xᵀ dY, dN = −dR Yᵀ), then the score gradients per level with
  the same E_L factors, and dΓ → dg (reverse in-chunk cumsum, plus the state-decay cotangent on the
  last row) as one precise dot with an upper-triangular ones matrix.

K is walked in column blocks of `bk` (scores and per-column gradients are separable over K), so
the live register tiles are [C, bk]; Γ_{m(x)} is a gathered row load per level.

Kernels (pallas_gpu.Settings picks them): `intra_fwd_kernel` (one chunk per program, levels);
the "strips" forward: scores per 16-row strip (`strip_scores_kernel`, or `strip_blocks_kernel`
walking the earlier 16-row blocks), then either `wy_kernel` (inverse, W and U per chunk) or the
split WY step (`inverse_kernel` per chunk, then `wu_kernel` — or `w_kernel` and `u_kernel` — per
chunk and column block; `wu_gated_kernel` / `w_gated_kernel` when the score kernel already wrote
the gated operands, `_store_gates`); `intra_bwd_kernel` (one chunk per program) or `wy_bwd_kernel` +
`score_bwd_kernel` (the "kblocks" backward: per chunk, then per chunk and K-block).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kda.kernels import diag_column_grads, gated, mm, mm_nt, mm_tn

F32 = jnp.float32
BF16 = jnp.bfloat16


def levels(c: int) -> tuple[int, ...]:
  """Half-block sizes L = 1, 2, 4, … < C."""
  return tuple(1 << i for i in range(c.bit_length() - 1))


def _iota(shape, axis):
  return lax.broadcasted_iota(jnp.int32, shape, axis)


def level_mask(c: int, half):
  """M_L [C, C]: r in the upper half, s in the lower half of the same 2L-block (`half` may be a
  traced int: the kernels loop over levels with fori_loop so nothing per level stays live)."""
  row, col = _iota((c, c), 0), _iota((c, c), 1)
  size = 2 * half
  return ((lax.div(row, size) == lax.div(col, size)) & (lax.rem(row, size) >= half)
          & (lax.rem(col, size) < half))


def level_decay(gam_ref, gam, cols, c: int, half, base=0):
  """E_L [C, bk] = exp(−|Γ_x − Γ_{m(x)}|), m(x) the middle row of x's 2L-block; the rows are
  rows base … base + C of `gam_ref` (a strip of a chunk when base > 0)."""
  size = 2 * half
  mid = lax.div(_iota((c,), 0), size) * size + half
  return jnp.exp(-jnp.abs(gam - gam_ref[base + mid, cols]))


def _split(x):
  hi = x.astype(BF16)
  return hi, (x - hi.astype(F32)).astype(BF16)


def mm_precise(a, b, mm_dtype, *, mode: str = "bf16x3", a_exact: bool = False):
  """a [M, D] @ b [D, N] to about fp32 accuracy: IEEE fp32 dots for fp32 inputs; else
  mode "bf16x3", three bf16 tensor-core dots of a hi/lo split (a_hi b_hi + a_hi b_lo + a_lo b_hi;
  two when `a_exact`: a is exactly representable in bf16, e.g. a 0/1 matrix), or mode "tf32",
  one TF32 tensor-core dot (10-bit mantissas; on CPU, interpret mode, it is plain fp32)."""
  if jnp.dtype(mm_dtype) == F32:
    return mm(a, b, F32)
  if mode == "tf32":
    return lax.dot_general(a.astype(F32), b.astype(F32), (((1,), (0,)), ((), ())),
                           precision=lax.Precision.DEFAULT, preferred_element_type=F32)
  if mode != "bf16x3":
    raise ValueError(f"mm_precise: mode must be 'bf16x3' or 'tf32', got {mode!r}")
  b_hi, b_lo = _split(b.astype(F32))
  if a_exact:
    a_hi = a.astype(BF16)
    return mm(a_hi, b_hi, BF16) + mm(a_hi, b_lo, BF16)
  a_hi, a_lo = _split(a.astype(F32))
  return mm(a_hi, b_hi, BF16) + (mm(a_hi, b_lo, BF16) + mm(a_lo, b_hi, BF16))


def _half(i):
  """L = 2^i for a (traced) level index i."""
  return lax.shift_left(jnp.int32(1), i)


def wy_inverse(n, mm_dtype, mode: str = "bf16x3", unroll: bool = False):
  """(I + N)⁻¹ for N [C, C] strictly lower, by block doubling (module docstring); `mode`: the
  precise dots' ("bf16x3" or "tf32", see mm_precise). `unroll` writes the levels out in Python
  (small blocks: independent inverses then interleave)."""
  c = n.shape[0]

  def join(i, x):
    half = (1 << i) if unroll else _half(i)
    n_l = jnp.where(level_mask(c, half), n, 0.0)
    return x - mm_precise(mm_precise(x, n_l, mm_dtype, mode=mode), x, mm_dtype, mode=mode)

  x = (_iota((c, c), 0) == _iota((c, c), 1)).astype(F32)
  if not unroll:
    return lax.fori_loop(0, len(levels(c)), join, x)
  for i in range(len(levels(c))):
    x = join(i, x)
  return x


def place_columns(block, base, width: int, mm_dtype):
  """block [R, S] (fp32) as columns base … base + S of an [R, width] matrix, zeros elsewhere:
  dots with a one-hot [S, width] matrix (exact: IEEE fp32, or three bf16 dots of a hi/mid/lo
  split), since Triton has no dynamic-offset concatenation of register tiles."""
  s = block.shape[1]
  onehot = (_iota((s, width), 1) == base + _iota((s, width), 0)).astype(F32)
  if jnp.dtype(mm_dtype) == F32:
    return mm(block, onehot, F32)
  hi = block.astype(BF16)
  rest = block - hi.astype(F32)
  mid = rest.astype(BF16)
  lo = (rest - mid.astype(F32)).astype(BF16)
  return mm(hi, onehot, BF16) + (mm(mid, onehot, BF16) + mm(lo, onehot, BF16))


def _k_block(q_ref, k_ref, gam_ref, kb, bk: int, scale: float):
  """Columns kb·bk … of one chunk: (the slice, scaled q, k, Γ), each [C, bk] fp32."""
  cols = pl.ds(kb * bk, bk)
  return (cols, q_ref[:, cols].astype(F32) * scale, k_ref[:, cols].astype(F32),
          gam_ref[:, cols])


def intra_fwd_kernel(q_ref, k_ref, v_ref, gam_ref, beta_ref, cnt_ref, cntr_ref,
                     aqk_ref, w_ref, u_ref, qg_ref, kt_ref, *saved_refs, scale, bk, mm_dtype,
                     wy_dots="bf16x3"):
  """One chunk of one (batch, head): A_qk, W, U, e^Γ⊙Q, e^{Γ_C−Γ}⊙K, and when `saved_refs` are
  given (training) also akk (masked A_kk) and inv ((I + Diag(β) A_kk)⁻¹), [C, C] fp32.

  Refs: q, k, gam [C, K]; v [C, V]; beta, cnt [C, 1]; cntr [1, C]; outputs as
  `kernels.intra_kernel`.
  """
  c, dk = q_ref.shape
  row, col = _iota((c, c), 0), _iota((c, c), 1)
  cnt = cnt_ref[...]
  same = cnt == cntr_ref[...]
  beta = beta_ref[...].astype(F32)
  n_lev = len(levels(c))

  def score_block(kb, carry):
    cols, q, k, gam = _k_block(q_ref, k_ref, gam_ref, kb, bk, scale)

    level = lambda i, acc: _level_scores(acc, q, k, gam, gam_ref, cols, _half(i), mm_dtype)
    a_qk, a_kk, diag = carry
    a_qk, a_kk = lax.fori_loop(0, n_lev, level, (a_qk, a_kk))
    return a_qk, a_kk, diag + jnp.sum(q * k, axis=1, keepdims=True)

  zeros_cc = jnp.zeros((c, c), F32)
  a_qk, a_kk, diag = lax.fori_loop(0, dk // bk, score_block,
                                   (zeros_cc, zeros_cc, jnp.zeros((c, 1), F32)))
  a_qk = jnp.where(same & (col <= row), jnp.where(row == col, diag, a_qk), 0.0)
  a_kk = jnp.where(same & (col < row), a_kk, 0.0)
  inv = _write_wy(q_ref, k_ref, v_ref, gam_ref, cnt_ref, beta, a_kk, w_ref, u_ref, qg_ref,
                  kt_ref, scale=scale, bk=bk, mm_dtype=mm_dtype, wy_dots=wy_dots)
  aqk_ref[...] = a_qk.astype(aqk_ref.dtype)
  if saved_refs:
    saved_refs[0][...] = a_kk
    saved_refs[1][...] = inv


def _level_scores(acc, q, k, gam, gam_ref, cols, half, mm_dtype, base=0):
  """One level L of the in-block scores (module docstring): (A_qk, A_kk) [R, R] gain
  M_L ⊙ ((Q⊙E_L)(K⊙E_L)ᵀ) and M_L ⊙ ((K⊙E_L)(K⊙E_L)ᵀ) for the R rows at `base` of gam_ref."""
  rows = q.shape[0]
  e = level_decay(gam_ref, gam, cols, rows, half, base)
  ke = k * e
  mask = level_mask(rows, half)
  return (acc[0] + jnp.where(mask, mm_nt(q * e, ke, mm_dtype), 0.0),
          acc[1] + jnp.where(mask, mm_nt(ke, ke, mm_dtype), 0.0))


def _write_wy(q_ref, k_ref, v_ref, gam_ref, cnt_ref, beta, a_kk, w_ref, u_ref, qg_ref, kt_ref, *,
              scale, bk, mm_dtype, wy_dots):
  """From the masked A_kk [C, C]: X = (I + Diag(β) A_kk)⁻¹, then W = X Diag(β) e^Γ⊙K (rows that
  see S₀), U = X Diag(β) V, e^Γ⊙Q and e^{Γ_C−Γ}⊙K (rows of the last segment) into their refs.
  Returns X (fp32)."""
  c, dk = q_ref.shape
  dv = v_ref.shape[1]
  cnt = cnt_ref[...]
  inv = wy_inverse(beta * a_kk, mm_dtype, wy_dots)
  inv_mm = inv.astype(mm_dtype)
  sees = cnt == 0.0
  in_last = cnt == cnt_ref[pl.ds(c - 1, 1), :]

  def out_block(kb, _):
    cols, q, k, gam = _k_block(q_ref, k_ref, gam_ref, kb, bk, scale)
    _store_w_qg_kt(inv_mm, beta, q, k, gam, sees, in_last, gam_ref[pl.ds(c - 1, 1), cols],
                   w_ref, qg_ref, kt_ref, cols, mm_dtype)
    return _

  lax.fori_loop(0, dk // bk, out_block, 0)
  for vb in range(max(dv // bk, 1)):
    cols = pl.ds(vb * bk, min(bk, dv))
    u_ref[:, cols] = mm(inv_mm, beta * v_ref[:, cols].astype(F32), mm_dtype).astype(u_ref.dtype)
  return inv


def _strip_diag_step(carry, q, k, gam, gamc_ref, cols, base, mm_dtype):
  """One K-block of a strip's own [sub, sub] block: (d_qk, d_kk, diag) gain its pairs by levels
  (static L: the index maths becomes shifts) and the row dots q_r · k_r."""
  d_qk, d_kk, diag = carry
  for half in levels(q.shape[0]):
    d_qk, d_kk = _level_scores((d_qk, d_kk), q, k, gam, gamc_ref, cols, half, mm_dtype, base)
  return d_qk, d_kk, diag + jnp.sum(q * k, axis=1, keepdims=True)


def _earlier_rows(kc, gamc, ref, before):
  """K ⊙ e^{Γ_ref − Γ} on the chunk rows before the strip (0 elsewhere; every factor ≤ 1):
  the column operand of the pairs (r in the strip, s in an earlier strip)."""
  return jnp.where(before, kc * jnp.exp(jnp.where(before, ref - gamc, 0.0)), 0.0)


def _gate_context(refs, gate: bool, cnt_ref, cntr_ref):
  """(aqk_ref, akk_ref, gates) from a strip kernel's trailing refs — beta, aqk, akk, qg, kt, kb
  with `gate`, else aqk, akk. gates (None without `gate`): the strip's loop-invariant masks and β,
  loaded once here (sees S₀ [sub, 1], in the chunk's last segment [sub, 1], β [sub, 1] fp32),
  then the qg, kt, kb refs, for `_store_gates` in the K-block loop."""
  if not gate:
    return refs[0], refs[1], None
  beta_ref, aqk_ref, akk_ref, qg_ref, kt_ref, kb_ref = refs
  cnt = cnt_ref[...]
  in_last = cnt == cntr_ref[:, pl.ds(cntr_ref.shape[1] - 1, 1)]
  return aqk_ref, akk_ref, (cnt == 0.0, in_last, beta_ref[...].astype(F32), qg_ref, kt_ref, kb_ref)


def _store_gates(gates, q, k, gam, cols, gamc_ref):
  """Columns `cols` of a strip's e^Γ⊙Q, e^{Γ_C−Γ}⊙K and β⊙e^Γ⊙K (q scaled): the score kernel has
  these q, k, Γ tiles loaded already, so the W/U kernel then reads one [C, K] operand
  (`wu_gated_kernel`) instead of q, k and fp32 Γ. No-op when `gates` is None."""
  if gates is None:
    return
  sees, in_last, beta, qg_ref, kt_ref, kb_ref = gates
  gam_last = gamc_ref[pl.ds(gamc_ref.shape[0] - 1, 1), cols]
  kb_ref[:, cols] = (beta * _store_qg_kt(q, k, gam, sees, in_last, gam_last, qg_ref, kt_ref,
                                         cols)).astype(kb_ref.dtype)


def _store_qg_kt(q, k, gam, sees, in_last, gam_last, qg_ref, kt_ref, cols):
  """Gate scaled q and k tiles (kernels.gated), store columns `cols` of e^Γ⊙Q and e^{Γ_C−Γ}⊙K,
  and return e^Γ⊙K (fp32), W's operand before β."""
  qg, kg, kt = gated(q, k, gam, sees, in_last, gam_last)
  qg_ref[:, cols] = qg.astype(qg_ref.dtype)
  kt_ref[:, cols] = kt.astype(kt_ref.dtype)
  return kg


def strip_scores_kernel(q_ref, k_ref, gam_ref, kc_ref, gamc_ref, cnt_ref, cntr_ref, *refs,
                        strips, scale, bk, mm_dtype, gate=False):
  """Rows of A_qk and A_kk for one strip of `sub` rows of a chunk (the "strips" forward: one
  small program per strip, as fla does, instead of one per chunk).

  Pairs with s in an earlier strip factor through the strip's first row m (s < m ≤ r: both
  factors ≤ 1), one dot per K-block; pairs inside the strip by levels (module docstring) on the
  strip's [sub, sub] block, then placed in its columns. Refs: q, k, gam [sub, K] (the strip);
  kc, gamc [C, K] (its whole chunk); cnt [sub, 1]; cntr [1, C]. Writes aqk (masked to s ≤ r in
  one segment) and akk (s < r) [sub, C]. With `gate` (Settings.gate_in_scores) `refs` are
  beta [sub, 1], aqk, akk and then qg, kt, kb [sub, K] (`_store_gates`), else aqk, akk.
  """
  aqk_ref, akk_ref, gates = _gate_context(refs, gate, cnt_ref, cntr_ref)
  sub, dk = q_ref.shape
  c = kc_ref.shape[0]
  base = lax.rem(pl.program_id(1), strips) * sub         # first row of the strip in its chunk
  row = base + _iota((sub, c), 0)
  col = _iota((sub, c), 1)
  before = _iota((c, 1), 0) < base

  def k_block(kb, carry):
    cols, q, k, gam = _k_block(q_ref, k_ref, gam_ref, kb, bk, scale)
    ref = gamc_ref[pl.ds(base, 1), cols]                   # Γ of the strip's first row
    e_row = jnp.exp(gam - ref)
    k_back = _earlier_rows(kc_ref[:, cols].astype(F32), gamc_ref[:, cols], ref, before)
    a_qk, a_kk, *own = carry
    _store_gates(gates, q, k, gam, cols, gamc_ref)
    a_qk = a_qk + mm_nt(q * e_row, k_back, mm_dtype)
    a_kk = a_kk + mm_nt(k * e_row, k_back, mm_dtype)
    return (a_qk, a_kk, *_strip_diag_step(own, q, k, gam, gamc_ref, cols, base, mm_dtype))

  zeros, zeros_d = jnp.zeros((sub, c), F32), jnp.zeros((sub, sub), F32)
  a_qk, a_kk, d_qk, d_kk, diag = lax.fori_loop(
      0, dk // bk, k_block, (zeros, zeros, zeros_d, zeros_d, jnp.zeros((sub, 1), F32)))
  d_qk = jnp.where(_iota((sub, sub), 0) == _iota((sub, sub), 1), diag, d_qk)
  a_qk = a_qk + place_columns(d_qk, base, c, mm_dtype)
  a_kk = a_kk + place_columns(d_kk, base, c, mm_dtype)
  same = cnt_ref[...] == cntr_ref[...]
  aqk_ref[...] = jnp.where(same & (col <= row), a_qk, 0.0).astype(aqk_ref.dtype)
  akk_ref[...] = jnp.where(same & (col < row), a_kk, 0.0)


def strip_blocks_kernel(q_ref, k_ref, gam_ref, kc_ref, gamc_ref, cnt_ref, cntr_ref, *refs,
                        strips, scale, bk, mm_dtype, gate=False):
  """`strip_scores_kernel` with the earlier pairs block by block (Settings.strip_earlier =
  "blocks"): strip r's program computes only the [sub, sub] column blocks j < r it needs, in a
  loop of r steps (one [sub, K] load of K and Γ and one dot over all of K each), and stores every
  block at its columns directly — no [C, K] operand masked to the rows before the strip, no
  one-hot placement of the diagonal block. Same refs, maths (pairs across blocks factor through
  the strip's first row) and outputs."""
  aqk_ref, akk_ref, gates = _gate_context(refs, gate, cnt_ref, cntr_ref)
  sub, dk = q_ref.shape
  r = lax.rem(pl.program_id(1), strips)                 # the strip's block index in its chunk
  base = r * sub
  row, col = _iota((sub, sub), 0), _iota((sub, sub), 1)
  cnt = cnt_ref[...]

  def diag_block(kb, carry):
    cols, q, k, gam = _k_block(q_ref, k_ref, gam_ref, kb, bk, scale)
    _store_gates(gates, q, k, gam, cols, gamc_ref)
    return _strip_diag_step(carry, q, k, gam, gamc_ref, cols, base, mm_dtype)

  zeros = jnp.zeros((sub, sub), F32)
  d_qk, d_kk, diag = lax.fori_loop(0, dk // bk, diag_block,
                                   (zeros, zeros, jnp.zeros((sub, 1), F32)))
  own = pl.ds(base, sub)
  same = cnt == cntr_ref[:, own]
  aqk_ref[:, own] = jnp.where(same & (col <= row), jnp.where(row == col, diag, d_qk),
                              0.0).astype(aqk_ref.dtype)
  akk_ref[:, own] = jnp.where(same & (col < row), d_kk, 0.0)

  ref = gamc_ref[pl.ds(base, 1), :]                     # Γ of the strip's first row, [1, K]
  e_row = jnp.exp(gam_ref[...] - ref)                   # ≤ 1: rows at or after the reference
  qe = (q_ref[...].astype(F32) * scale * e_row).astype(mm_dtype)
  ke = (k_ref[...].astype(F32) * e_row).astype(mm_dtype)

  def earlier(j, _):                                    # block j < r: every factor ≤ 1
    blk = pl.ds(j * sub, sub)
    k_back = kc_ref[blk, :].astype(F32) * jnp.exp(ref - gamc_ref[blk, :])
    same_j = cnt == cntr_ref[:, blk]
    aqk_ref[:, blk] = jnp.where(same_j, mm_nt(qe, k_back, mm_dtype), 0.0).astype(aqk_ref.dtype)
    akk_ref[:, blk] = jnp.where(same_j, mm_nt(ke, k_back, mm_dtype), 0.0)
    return _

  def later(j, _):
    blk = pl.ds(j * sub, sub)
    aqk_ref[:, blk] = jnp.zeros((sub, sub), aqk_ref.dtype)
    akk_ref[:, blk] = jnp.zeros((sub, sub), akk_ref.dtype)
    return _

  lax.fori_loop(0, r, earlier, 0)
  lax.fori_loop(r + 1, strips, later, 0)


def wy_kernel(q_ref, k_ref, v_ref, gam_ref, beta_ref, cnt_ref, akk_ref,
              w_ref, u_ref, qg_ref, kt_ref, *inv_ref, scale, bk, mm_dtype, wy_dots="bf16x3",
              sub=16):
  """Second kernel of the "strips" forward, one chunk, in [sub, sub] blocks so the live tiles
  stay small: X = (I + N)⁻¹ (N = Diag(β) A_kk) by block forward substitution — X_ii = (I +
  N_ii)⁻¹ by block doubling, X_ij = −X_ii Σ_{j≤m<i} N_im X_mj — then W_i = Σ_j X_ij Diag(β)
  e^Γ⊙K_j (rows that see S₀), U_i = Σ_j X_ij Diag(β) V_j, e^Γ⊙Q and e^{Γ_C−Γ}⊙K (rows of the
  last segment). Writes X [C, C] (in inv_ref's dtype) too when `inv_ref` is given (training)."""
  c, dk = q_ref.shape
  dv = v_ref.shape[1]
  nb = c // sub
  rows = [pl.ds(i * sub, sub) for i in range(nb)]
  beta = [beta_ref[r, :].astype(F32) for r in rows]                     # [sub, 1] each
  cnt = [cnt_ref[r, :] for r in rows]
  cnt_last = cnt_ref[pl.ds(c - 1, 1), :]
  x = _blocked_inverse(beta_ref, akk_ref, sub=sub, mm_dtype=mm_dtype, wy_dots=wy_dots)
  x_mm = {key: val.astype(mm_dtype) for key, val in x.items()}

  def apply_x(operands, out_ref, cols):
    """out rows of block i = Σ_{j≤i} X_ij operands[j] (operands: [sub, ·] per row block)."""
    for i in range(nb):
      acc = mm(x_mm[i, 0], operands[0], mm_dtype)
      for j in range(1, i + 1):
        acc = acc + mm(x_mm[i, j], operands[j], mm_dtype)
      out_ref[rows[i], cols] = acc.astype(out_ref.dtype)

  def out_block(kb, _):
    cols = pl.ds(kb * bk, bk)
    gam_last = gam_ref[pl.ds(c - 1, 1), cols]
    operands = []
    for j in range(nb):
      q = q_ref[rows[j], cols].astype(F32) * scale
      k = k_ref[rows[j], cols].astype(F32)
      qg, kg, kt = gated(q, k, gam_ref[rows[j], cols], cnt[j] == 0.0, cnt[j] == cnt_last,
                         gam_last)
      operands.append(beta[j] * kg)
      qg_ref[rows[j], cols] = qg.astype(qg_ref.dtype)
      kt_ref[rows[j], cols] = kt.astype(kt_ref.dtype)
    apply_x(operands, w_ref, cols)
    return _

  lax.fori_loop(0, dk // bk, out_block, 0)
  for vb in range(max(dv // bk, 1)):
    cols = pl.ds(vb * bk, min(bk, dv))
    apply_x([beta[j] * v_ref[rows[j], cols].astype(F32) for j in range(nb)], u_ref, cols)
  if inv_ref:
    _write_blocks(inv_ref[0], x, sub)


def _blocked_inverse(beta_ref, akk_ref, *, sub, mm_dtype, wy_dots):
  """X = (I + Diag(β) A_kk)⁻¹ of one chunk as {(i, j): [sub, sub] block, j ≤ i}: X_ii = (I +
  N_ii)⁻¹ by block doubling (written out, so the diagonal blocks' chains interleave), then
  X_ij = −X_ii Σ_{j≤m<i} N_im X_mj (block forward substitution). Refs: beta [C, 1], akk [C, C]."""
  nb = akk_ref.shape[0] // sub
  rows = [pl.ds(i * sub, sub) for i in range(nb)]
  beta = [beta_ref[r, :].astype(F32) for r in rows]
  dot = lambda a, b: mm_precise(a, b, mm_dtype, mode=wy_dots)
  x = {}
  for i in range(nb):
    x[i, i] = wy_inverse(beta[i] * akk_ref[rows[i], rows[i]], mm_dtype, wy_dots, unroll=True)
  for i in range(1, nb):
    n_i = [beta[i] * akk_ref[rows[i], rows[m]] for m in range(i)]
    for j in range(i - 1, -1, -1):
      acc = dot(n_i[j], x[j, j])
      for m in range(j + 1, i):
        acc = acc + dot(n_i[m], x[m, j])
      x[i, j] = -dot(x[i, i], acc)
  return x


def _write_blocks(ref, x, sub):
  """The lower-triangular block dict of `_blocked_inverse` into ref [C, C] (zeros above), in the
  ref's dtype (the dots' operand dtype: every reader casts X to it, so storing it rounded is
  exact and halves X's traffic for bf16)."""
  nb = ref.shape[0] // sub
  zero = jnp.zeros((sub, sub), ref.dtype)
  for i in range(nb):
    for j in range(nb):
      ref[pl.ds(i * sub, sub), pl.ds(j * sub, sub)] = (x[i, j].astype(ref.dtype) if j <= i
                                                      else zero)


def inverse_kernel(beta_ref, akk_ref, inv_ref, *, sub, mm_dtype, wy_dots="bf16x3"):
  """First half of the split WY step ("wy_split"), one chunk: X [C, C] only (see
  `_blocked_inverse`); `w_kernel` / `u_kernel` then apply it per column block."""
  _write_blocks(inv_ref, _blocked_inverse(beta_ref, akk_ref, sub=sub, mm_dtype=mm_dtype,
                                          wy_dots=wy_dots), sub)


def w_kernel(q_ref, k_ref, gam_ref, beta_ref, cnt_ref, inv_ref, w_ref, qg_ref, kt_ref, *,
             scale, mm_dtype):
  """Second half of the split WY step for one chunk and one block of K columns (grid B × N·K/bk ×
  H, like fla's recompute_w_u): W = X Diag(β) e^Γ⊙K (rows that see S₀), e^Γ⊙Q and e^{Γ_C−Γ}⊙K
  (rows of the last segment). Refs q, k, gam, outputs [C, bk]; beta, cnt [C, 1]; inv [C, C]."""
  _write_w(q_ref, k_ref, gam_ref, beta_ref[...].astype(F32), cnt_ref,
           inv_ref[...].astype(mm_dtype), w_ref, qg_ref, kt_ref, scale=scale, mm_dtype=mm_dtype)


def u_kernel(v_ref, beta_ref, inv_ref, u_ref, *, mm_dtype):
  """U = X Diag(β) V for one chunk and one block of V columns (the split WY step)."""
  _write_u(v_ref, beta_ref[...].astype(F32), inv_ref[...].astype(mm_dtype), u_ref,
           mm_dtype=mm_dtype)


def wu_kernel(q_ref, k_ref, v_ref, gam_ref, beta_ref, cnt_ref, inv_ref, w_ref, u_ref, qg_ref,
              kt_ref, *, scale, mm_dtype):
  """`w_kernel` and `u_kernel` in one program when the K- and V-blocks coincide (K = V): X and
  β are read once per block instead of twice, and one launch fewer."""
  beta, x = beta_ref[...].astype(F32), inv_ref[...].astype(mm_dtype)
  _write_w(q_ref, k_ref, gam_ref, beta, cnt_ref, x, w_ref, qg_ref, kt_ref, scale=scale,
           mm_dtype=mm_dtype)
  _write_u(v_ref, beta, x, u_ref, mm_dtype=mm_dtype)


def wu_gated_kernel(kb_ref, v_ref, beta_ref, inv_ref, w_ref, u_ref, *, mm_dtype):
  """`wu_kernel` after a gating strip kernel (`_store_gates`): W = X kb with kb = β⊙e^Γ⊙K read
  ready-made, U = X Diag(β) V, for one chunk and one column block."""
  x = inv_ref[...].astype(mm_dtype)
  w_ref[...] = mm(x, kb_ref[...], mm_dtype).astype(w_ref.dtype)
  _write_u(v_ref, beta_ref[...].astype(F32), x, u_ref, mm_dtype=mm_dtype)


def w_gated_kernel(kb_ref, inv_ref, w_ref, *, mm_dtype):
  """`w_kernel` after a gating strip kernel: W = X kb for one chunk and one K-block."""
  w_ref[...] = mm(inv_ref[...].astype(mm_dtype), kb_ref[...], mm_dtype).astype(w_ref.dtype)


def _write_w(q_ref, k_ref, gam_ref, beta, cnt_ref, x, w_ref, qg_ref, kt_ref, *, scale, mm_dtype):
  """W = X Diag(β) e^Γ⊙K, e^Γ⊙Q, e^{Γ_C−Γ}⊙K for one block of columns (x: X in mm_dtype)."""
  c = q_ref.shape[0]
  cnt = cnt_ref[...]
  _store_w_qg_kt(x, beta, q_ref[...].astype(F32) * scale, k_ref[...].astype(F32), gam_ref[...],
                 cnt == 0.0, cnt == cnt_ref[pl.ds(c - 1, 1), :], gam_ref[pl.ds(c - 1, 1), :],
                 w_ref, qg_ref, kt_ref, slice(None), mm_dtype)


def _store_w_qg_kt(x, beta, q, k, gam, sees, in_last, gam_last, w_ref, qg_ref, kt_ref, cols,
                   mm_dtype):
  """Columns `cols` of W = X Diag(β) e^Γ⊙K, e^Γ⊙Q and e^{Γ_C−Γ}⊙K (see kernels.gated) from one
  chunk's [C, ·] tiles of scaled q, k and Γ (x: X in mm_dtype)."""
  kg = _store_qg_kt(q, k, gam, sees, in_last, gam_last, qg_ref, kt_ref, cols)
  w_ref[:, cols] = mm(x, beta * kg, mm_dtype).astype(w_ref.dtype)


def _write_u(v_ref, beta, x, u_ref, *, mm_dtype):
  u_ref[...] = mm(x, beta * v_ref[...].astype(F32), mm_dtype).astype(u_ref.dtype)


def intra_bwd_kernel(q_ref, k_ref, v_ref, gam_ref, beta_ref, cnt_ref, cntr_ref, akk_ref, inv_ref,
                     w_ref, u_ref, daqk_ref, dw_ref, du_ref, dqg_ref, dkt_ref, ddl_ref,
                     dq_ref, dk_ref, dv_ref, dbeta_ref, dg_ref, *, scale, bk, mm_dtype):
  """VJP of `intra_fwd_kernel` for one chunk, ending at dg (not dΓ).

  Inputs as the forward plus its akk/inv/w/u, the cotangents of aqk, w, u, qg, kt, and
  ddl [1, K] = dd ⊙ d (the state decay d = e^{Γ_C} and its cotangent), which joins dΓ's last row.
  Outputs: dq (wrt the unscaled q), dk [C, K], dv [C, V] (their refs' dtypes), dbeta [C, 1] fp32,
  dg [C, K] fp32 = Σ_{r' ≥ r in the chunk} dΓ_{r'}. `_wy_bwd`, then `_score_grads`.
  """
  beta = beta_ref[...].astype(F32)
  inv = inv_ref[...]
  dakk = _wy_bwd(k_ref, v_ref, gam_ref, cnt_ref, cntr_ref, beta, akk_ref, inv, w_ref, u_ref,
                 dw_ref, du_ref, dv_ref, dbeta_ref, bk=bk, mm_dtype=mm_dtype)
  _score_grads(q_ref, k_ref, gam_ref, cnt_ref, cntr_ref, beta, inv, daqk_ref, dakk, dw_ref,
               dqg_ref, dkt_ref, ddl_ref, dq_ref, dk_ref, dg_ref, scale=scale, bk=bk,
               mm_dtype=mm_dtype)


def wy_bwd_kernel(k_ref, v_ref, gam_ref, beta_ref, cnt_ref, cntr_ref, akk_ref, inv_ref, w_ref,
                  u_ref, dw_ref, du_ref, dv_ref, dbeta_ref, dakk_ref, *, bk, mm_dtype):
  """First kernel of the K-block-parallel backward, one chunk: `_wy_bwd`, writing dv, dbeta and
  dA_kk [C, C] fp32 (masked) for `score_bwd_kernel`."""
  dakk_ref[...] = _wy_bwd(k_ref, v_ref, gam_ref, cnt_ref, cntr_ref, beta_ref[...].astype(F32),
                          akk_ref, inv_ref[...], w_ref, u_ref, dw_ref, du_ref, dv_ref, dbeta_ref,
                          bk=bk, mm_dtype=mm_dtype)


def score_bwd_kernel(q_ref, k_ref, gam_ref, beta_ref, cnt_ref, cntr_ref, inv_ref, daqk_ref,
                     dakk_ref, dw_ref, dqg_ref, dkt_ref, ddl_ref, dq_ref, dk_ref, dg_ref, *,
                     scale, mm_dtype, unroll=False):
  """Second kernel of the K-block-parallel backward: `_score_grads` for one chunk and one block
  of K columns (the per-column gradients need nothing from other columns once dA is known).
  Refs q, k, gam, dw, dqg, dkt, outputs [C, bk]; ddl [1, bk]; inv, daqk, dakk [C, C]."""
  _score_grads(q_ref, k_ref, gam_ref, cnt_ref, cntr_ref, beta_ref[...].astype(F32), inv_ref[...],
               daqk_ref, dakk_ref[...], dw_ref, dqg_ref, dkt_ref, ddl_ref, dq_ref, dk_ref, dg_ref,
               scale=scale, bk=q_ref.shape[1], mm_dtype=mm_dtype, unroll=unroll)


def _wy_bwd(k_ref, v_ref, gam_ref, cnt_ref, cntr_ref, beta, akk_ref, inv, w_ref, u_ref, dw_ref,
            du_ref, dv_ref, dbeta_ref, *, bk, mm_dtype):
  """WY backward of one chunk, streamed over column blocks: Y = X R, R = Diag(β)[kg | v],
  X = (I + N)⁻¹, N = Diag(β) A_kk: dR = Xᵀ dY, dN = −dR Yᵀ. Writes dv and dbeta; returns
  dA_kk = β ⊙ dN masked to s < r in one segment, [C, C] fp32."""
  c, dk = k_ref.shape
  dv = v_ref.shape[1]
  row, col = _iota((c, c), 0), _iota((c, c), 1)
  cnt = cnt_ref[...]
  sees = cnt == 0.0
  dn = jnp.zeros((c, c), F32)
  dbeta = jnp.zeros((c, 1), F32)
  for vb in range(max(dv // bk, 1)):
    cols = pl.ds(vb * bk, min(bk, dv))
    dr_v = mm_tn(inv, du_ref[:, cols].astype(F32), mm_dtype)
    dn = dn - mm_nt(dr_v, u_ref[:, cols], mm_dtype)
    dbeta = dbeta + jnp.sum(dr_v * v_ref[:, cols].astype(F32), axis=1, keepdims=True)
    dv_ref[:, cols] = (beta * dr_v).astype(dv_ref.dtype)
  for kb in range(dk // bk):
    cols = pl.ds(kb * bk, bk)
    dr_k = mm_tn(inv, dw_ref[:, cols].astype(F32), mm_dtype)
    dn = dn - mm_nt(dr_k, w_ref[:, cols], mm_dtype)
    kg = jnp.where(sees, k_ref[:, cols].astype(F32) * jnp.exp(gam_ref[:, cols]), 0.0)
    dbeta = dbeta + jnp.sum(dr_k * kg, axis=1, keepdims=True)
  dn = jnp.where((cnt == cntr_ref[...]) & (col < row), dn, 0.0)
  dbeta_ref[...] = dbeta + jnp.sum(dn * akk_ref[...], axis=1, keepdims=True)
  return beta * dn


def _score_grads(q_ref, k_ref, gam_ref, cnt_ref, cntr_ref, beta, inv, daqk_ref, dakk, dw_ref,
                 dqg_ref, dkt_ref, ddl_ref, dq_ref, dk_ref, dg_ref, *, scale, bk, mm_dtype,
                 unroll=False):
  """Everything after the WY backward, per block of `bk` columns of the refs: the score
  gradients by level, the elementwise decays, and dg (reverse in-chunk cumsum of dΓ as one precise
  dot, with the state-decay cotangent on the last row). dakk: masked dA_kk [C, C]."""
  c, width = q_ref.shape
  row, col = _iota((c, c), 0), _iota((c, c), 1)
  cnt = cnt_ref[...]
  sees = cnt == 0.0
  in_last = cnt == cnt_ref[pl.ds(c - 1, 1), :]
  daqk = jnp.where((cnt == cntr_ref[...]) & (col <= row), daqk_ref[...].astype(F32), 0.0)
  d_diag = jnp.sum(jnp.where(row == col, daqk, 0.0), axis=1, keepdims=True)       # [C, 1]
  tri_up = (col >= row).astype(F32)                 # dg = tri_up @ dΓ (reverse in-chunk cumsum)
  last_row = _iota((c, 1), 0) == c - 1
  n_lev = len(levels(c))

  def grad_block(kb, _):
    cols, q, k, gam = _k_block(q_ref, k_ref, gam_ref, kb, bk, scale)

    # Score gradients: dq_a (row side of A_qk), dk_row (row side of A_kk), dk_col (column sides).
    def level(i, acc):
      dq_a, dk_row, dk_col = acc
      half = (1 << i) if unroll else _half(i)
      mask = level_mask(c, half)
      daqk_l = jnp.where(mask, daqk, 0.0)
      dakk_l = jnp.where(mask, dakk, 0.0)
      e = level_decay(gam_ref, gam, cols, c, half)
      qe, ke = q * e, k * e
      return (dq_a + e * mm(daqk_l, ke, mm_dtype),
              dk_row + e * mm(dakk_l, ke, mm_dtype),
              dk_col + e * (mm_tn(daqk_l, qe, mm_dtype) + mm_tn(dakk_l, ke, mm_dtype)))

    acc = (d_diag * k, jnp.zeros_like(k), d_diag * q)
    if unroll:                      # static L: the masks' and gathers' index maths are shifts
      for i in range(n_lev):
        acc = level(i, acc)
      dq_a, dk_row, dk_col = acc
    else:
      dq_a, dk_row, dk_col = lax.fori_loop(0, n_lev, level, acc)
    decay = jnp.exp(gam)
    e_tail = jnp.where(in_last, jnp.exp(gam_ref[pl.ds(c - 1, 1), cols] - gam), 0.0)
    kt = k * e_tail
    dkg = beta * mm_tn(inv, dw_ref[:, cols].astype(F32), mm_dtype)
    dqg = dqg_ref[:, cols].astype(F32)
    dkt = dkt_ref[:, cols].astype(F32)
    dq = jnp.where(sees, dqg * decay, 0.0) + dq_a
    dk_ = jnp.where(sees, dkg * decay, 0.0) + dkt * e_tail + dk_row + dk_col
    dgam = (jnp.where(sees, (dqg * q + dkg * k) * decay, 0.0) - dkt * kt
            + q * dq_a + k * dk_row - k * dk_col)
    dgam = dgam + jnp.where(last_row, jnp.sum(dkt * kt, axis=0, keepdims=True)
                            + ddl_ref[:, cols], 0.0)
    dq_ref[:, cols] = (dq * scale).astype(dq_ref.dtype)
    dk_ref[:, cols] = dk_.astype(dk_ref.dtype)
    dg_ref[:, cols] = mm_precise(tri_up, dgam, mm_dtype, a_exact=True).astype(dg_ref.dtype)
    return _

  lax.fori_loop(0, width // bk, grad_block, 0)


def strip_grads_kernel(q_ref, k_ref, gam_ref, qc_ref, kc_ref, gamc_ref, beta_ref, cnt_ref,
                       cntc_ref, cntr_ref, daqk_rows_ref, dakk_rows_ref, daqk_cols_ref,
                       dakk_cols_ref, inv_cols_ref, dwc_ref, dqg_ref, dkt_ref,
                       dq_ref, dk_ref, dgam_ref, *, strips, scale, bk, mm_dtype):
  """The "strips" backward's score gradients for one strip of `sub` rows: dq, dk and dΓ of the
  strip (dΓ without the last-row state terms; `dg_kernel` adds those and the cumsum).

  Row side (r in the strip): pairs with earlier strips through the strip's first row (as
  `strip_scores_kernel`), pairs inside the strip one column at a time. Column side (s in the
  strip): pairs with later strips through the next strip's first row m (s < m ≤ r), pairs
  inside the strip one row at a time. Refs: q, k, gam, dqg, dkt [sub, K] (the strip); qc, kc,
  gamc, dwc [C, K] (the chunk); beta, cnt [sub, 1]; cntc [C, 1]; cntr [1, C]; daqk/dakk rows
  [sub, C] and columns [C, sub] (dakk already masked); inv columns [C, sub].
  """
  sub, dk = q_ref.shape
  c = kc_ref.shape[0]
  base = lax.rem(pl.program_id(1), strips) * sub
  nxt = jnp.minimum(base + sub, c - 1)                    # next strip's first row (clamped)
  local = _iota((sub, 1), 0)
  lcol = _iota((sub, sub), 1)
  crow = _iota((c, 1), 0)
  before, after = crow < base, crow >= base + sub
  cnt = cnt_ref[...]
  cnt_strip_row = cntr_ref[:, pl.ds(base, sub)]            # [1, sub]
  beta = beta_ref[...].astype(F32)
  sees = cnt == 0.0
  in_last = cnt == cntc_ref[pl.ds(c - 1, 1), :]
  # dA_qk masked to s ≤ r in one segment: rows of the strip, and columns of the strip.
  row_g, col_g = base + _iota((sub, c), 0), _iota((sub, c), 1)
  daqk_rows = jnp.where((cnt == cntr_ref[...]) & (col_g <= row_g),
                        daqk_rows_ref[...].astype(F32), 0.0)
  rr, ss = _iota((c, sub), 0), base + _iota((c, sub), 1)
  daqk_cols = jnp.where((cntc_ref[...] == cnt_strip_row) & (ss <= rr),
                        daqk_cols_ref[...].astype(F32), 0.0)
  dakk_rows = dakk_rows_ref[...]
  dakk_cols = dakk_cols_ref[...]
  # The strip's diagonal [sub, sub] blocks ([r, s]) give the in-strip coefficients: the row side
  # reads their columns, the column side the columns of their transposes ([s, r]).
  diag_ok = (cnt == cnt_strip_row) & (lcol <= local)      # s ≤ r, one segment
  dq_diag = jnp.where(diag_ok, daqk_rows_ref[:, pl.ds(base, sub)].astype(F32), 0.0)
  dk_diag = dakk_rows_ref[:, pl.ds(base, sub)]
  dq_diag_t, dk_diag_t = jnp.transpose(dq_diag), jnp.transpose(dk_diag)
  inv_cols = inv_cols_ref[...]

  def k_block(kb, _):
    cols, q, k, gam = _k_block(q_ref, k_ref, gam_ref, kb, bk, scale)
    qc, kc, gamc = _k_block(qc_ref, kc_ref, gamc_ref, kb, bk, scale)[1:]
    ref = gamc_ref[pl.ds(base, 1), cols]
    refm = gamc_ref[pl.ds(nxt, 1), cols]
    e_row = jnp.exp(gam - ref)
    e_col = jnp.exp(refm - gam)
    k_back = _earlier_rows(kc, gamc, ref, before)
    e_fwd = jnp.where(after, jnp.exp(jnp.where(after, gamc - refm, 0.0)), 0.0)
    dq_a = e_row * mm(daqk_rows, k_back, mm_dtype)
    dk_row = e_row * mm(dakk_rows, k_back, mm_dtype)
    dk_col = e_col * (mm_tn(daqk_cols, qc * e_fwd, mm_dtype)
                      + mm_tn(dakk_cols, kc * e_fwd, mm_dtype))

    def inside(j, acc):          # column / row base + j of the strip
      q_j = qc_ref[pl.ds(base + j, 1), cols].astype(F32) * scale
      k_j = kc_ref[pl.ds(base + j, 1), cols].astype(F32)
      gam_j = gamc_ref[pl.ds(base + j, 1), cols]
      return diag_column_grads(acc, j, local, lcol == j, q_j, k_j, gam_j, gam,
                               dq_diag, dk_diag, dq_diag_t, dk_diag_t)

    dq_a, dk_row, dk_col = lax.fori_loop(0, sub, inside, (dq_a, dk_row, dk_col))
    decay = jnp.exp(gam)
    e_tail = jnp.where(in_last, jnp.exp(gamc_ref[pl.ds(c - 1, 1), cols] - gam), 0.0)
    dkg = beta * mm_tn(inv_cols, dwc_ref[:, cols].astype(F32), mm_dtype)
    dqg = dqg_ref[:, cols].astype(F32)
    dkt = dkt_ref[:, cols].astype(F32)
    dq_ref[:, cols] = ((jnp.where(sees, dqg * decay, 0.0) + dq_a) * scale).astype(dq_ref.dtype)
    dk_ref[:, cols] = (jnp.where(sees, dkg * decay, 0.0) + dkt * e_tail + dk_row
                       + dk_col).astype(dk_ref.dtype)
    dgam_ref[:, cols] = (jnp.where(sees, (dqg * q + dkg * k) * decay, 0.0) - dkt * k * e_tail
                         + q * dq_a + k * dk_row - k * dk_col)
    return _

  lax.fori_loop(0, dk // bk, k_block, 0)


def dg_kernel(dgam_ref, k_ref, gam_ref, cnt_ref, dkt_ref, ddl_ref, dg_ref, *, bk, mm_dtype):
  """Last step of the "strips" backward, one chunk: dΓ's last row gains Σ_rows dKt ⊙ Kt (Kt =
  e^{Γ_C−Γ}⊙K on the last segment) and dd ⊙ d, then dg = reverse in-chunk cumsum (one precise
  dot with a triangular ones matrix). Refs: dgam, k, gam, dkt, dg [C, K]; cnt [C, 1]; ddl [1, K]."""
  c, dk = dgam_ref.shape
  cnt = cnt_ref[...]
  in_last = cnt == cnt_ref[pl.ds(c - 1, 1), :]
  tri_up = (_iota((c, c), 1) >= _iota((c, c), 0)).astype(F32)
  last_row = _iota((c, 1), 0) == c - 1

  def k_block(kb, _):
    cols = pl.ds(kb * bk, bk)
    kt = jnp.where(in_last, k_ref[:, cols].astype(F32)
                   * jnp.exp(gam_ref[pl.ds(c - 1, 1), cols] - gam_ref[:, cols]), 0.0)
    extra = jnp.sum(dkt_ref[:, cols].astype(F32) * kt, axis=0, keepdims=True) + ddl_ref[:, cols]
    dgam = dgam_ref[:, cols] + jnp.where(last_row, extra, 0.0)
    dg_ref[:, cols] = mm_precise(tri_up, dgam, mm_dtype, a_exact=True).astype(dg_ref.dtype)
    return _

  lax.fori_loop(0, dk // bk, k_block, 0)
