"""Intra-chunk KDA kernel bodies for the Triton (GPU) launchers: scores, WY step and their backward.

The jnp twin of what they compute is `intra.intra_all` (forward) and its VJP (backward). Almost
all work is tensor-core dots on [C, C], [16, 16] and [C, bk] tiles, with no row-by-row loops:

* Scores by levels. Every pair s < r of a block is split at the highest bit where r and s differ:
  at that level L (a power of two) both lie in one block of 2L rows, r in its upper half and s in
  its lower half, and m = the block's middle row lies between them. So
      e^{Γ_r − Γ_s} = e^{Γ_r − Γ_m} · e^{Γ_m − Γ_s},  both factors ≤ 1 (g ≤ 0),
  and with E_L[x] = exp(−|Γ_x − Γ_{m(x)}|) one masked dot per level gives that level's pairs:
      A_qk += M_L ⊙ ((Q ⊙ E_L)(K ⊙ E_L)ᵀ),  A_kk += M_L ⊙ ((K ⊙ E_L)(K ⊙ E_L)ᵀ).
  log2 of the block size levels cover all pairs exactly once; the diagonal of A_qk is the row
  dot q_r · k_r. Nothing exponentiates a positive number, so Γ may fall to −∞ inside a chunk.
* WY inverse X = (I + N)⁻¹ (N = Diag(β) A_kk, strictly lower) by block doubling: X starts as I
  (the inverse of the 1×1 blocks) and each level joins pairs of diagonal blocks,
      X ← X − X (M_L ⊙ N) X,
  which is [[A⁻¹, 0], [−D⁻¹ C A⁻¹, D⁻¹]] for every 2L-block. Dots here are "precise" (fp32 IEEE
  for fp32 inputs; otherwise three bf16 dots of a hi/lo split).
* Backward: the WY solve's VJP (dR = Xᵀ dY, dN = −dR Yᵀ), then the score gradients per level with
  the same E_L factors, and dΓ → dg (reverse in-chunk cumsum, plus the state-decay cotangent on the
  last row) as one precise dot with an upper-triangular ones matrix.

K is walked in column blocks of `bk` (scores and per-column gradients are separable over K), so
the live register tiles are [·, bk]; Γ_{m(x)} is a gathered row load per level.

Kernels, in launch order (pallas_gpu.py): forward `strip_scores_kernel` (one 16-row strip per
program: its rows of A_qk and A_kk, plus the gated operands e^Γ⊙Q, e^{Γ_C−Γ}⊙K, β⊙e^Γ⊙K),
`inverse_kernel` (X per chunk, by 16-row blocks), then `wu_kernel` (W and U per chunk and column
block, K = V) or `w_kernel` and `u_kernel`; backward `wy_bwd_kernel` (per chunk) then
`score_bwd_kernel` (per chunk and K-block).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kda.kernels import gated, mm, mm_nt, mm_tn

F32 = jnp.float32
BF16 = jnp.bfloat16


def levels(c: int) -> tuple[int, ...]:
  """Half-block sizes L = 1, 2, 4, … < C."""
  return tuple(1 << i for i in range(c.bit_length() - 1))


def _iota(shape, axis):
  return lax.broadcasted_iota(jnp.int32, shape, axis)


def level_mask(c: int, half):
  """M_L [C, C]: r in the upper half, s in the lower half of the same 2L-block (`half` may be a
  traced int: the backward loops over levels with fori_loop so nothing per level stays live)."""
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


def mm_precise(a, b, mm_dtype, *, a_exact: bool = False):
  """a [M, D] @ b [D, N] to about fp32 accuracy: IEEE fp32 dots for fp32 inputs; else three bf16
  tensor-core dots of a hi/lo split (a_hi b_hi + a_hi b_lo + a_lo b_hi; two when `a_exact`: a is
  exactly representable in bf16, e.g. a 0/1 matrix)."""
  if jnp.dtype(mm_dtype) == F32:
    return mm(a, b, F32)
  b_hi, b_lo = _split(b.astype(F32))
  if a_exact:
    a_hi = a.astype(BF16)
    return mm(a_hi, b_hi, BF16) + mm(a_hi, b_lo, BF16)
  a_hi, a_lo = _split(a.astype(F32))
  return mm(a_hi, b_hi, BF16) + (mm(a_hi, b_lo, BF16) + mm(a_lo, b_hi, BF16))


def _half(i):
  """L = 2^i for a (traced) level index i."""
  return lax.shift_left(jnp.int32(1), i)


def wy_inverse(n, mm_dtype):
  """(I + N)⁻¹ for N [C, C] strictly lower, by block doubling (module docstring), the levels
  written out in Python (small blocks: independent inverses then interleave)."""
  c = n.shape[0]
  x = (_iota((c, c), 0) == _iota((c, c), 1)).astype(F32)
  for i in range(len(levels(c))):
    n_l = jnp.where(level_mask(c, 1 << i), n, 0.0)
    x = x - mm_precise(mm_precise(x, n_l, mm_dtype), x, mm_dtype)
  return x


def _k_block(q_ref, k_ref, gam_ref, kb, bk: int, scale: float):
  """Columns kb·bk … of one chunk: (the slice, scaled q, k, Γ), each [C, bk] fp32."""
  cols = pl.ds(kb * bk, bk)
  return (cols, q_ref[:, cols].astype(F32) * scale, k_ref[:, cols].astype(F32),
          gam_ref[:, cols])


def _level_scores(acc, q, k, gam, gam_ref, cols, half, mm_dtype, base=0):
  """One level L of the in-block scores (module docstring): (A_qk, A_kk) [R, R] gain
  M_L ⊙ ((Q⊙E_L)(K⊙E_L)ᵀ) and M_L ⊙ ((K⊙E_L)(K⊙E_L)ᵀ) for the R rows at `base` of gam_ref."""
  rows = q.shape[0]
  e = level_decay(gam_ref, gam, cols, rows, half, base)
  ke = k * e
  mask = level_mask(rows, half)
  return (acc[0] + jnp.where(mask, mm_nt(q * e, ke, mm_dtype), 0.0),
          acc[1] + jnp.where(mask, mm_nt(ke, ke, mm_dtype), 0.0))


def _strip_diag_step(carry, q, k, gam, gamc_ref, cols, base, mm_dtype):
  """One K-block of a strip's own [sub, sub] block: (d_qk, d_kk, diag) gain its pairs by levels
  (static L: the index maths becomes shifts) and the row dots q_r · k_r."""
  d_qk, d_kk, diag = carry
  for half in levels(q.shape[0]):
    d_qk, d_kk = _level_scores((d_qk, d_kk), q, k, gam, gamc_ref, cols, half, mm_dtype, base)
  return d_qk, d_kk, diag + jnp.sum(q * k, axis=1, keepdims=True)


def _store_gates(gates, q, k, gam, cols, gamc_ref):
  """Columns `cols` of a strip's e^Γ⊙Q, e^{Γ_C−Γ}⊙K and β⊙e^Γ⊙K (q scaled): the score kernel has
  these q, k, Γ tiles loaded already, so the W/U kernels then read one [C, K] operand instead of
  q, k and fp32 Γ. gates: (sees S₀ [sub, 1], in the chunk's last segment [sub, 1], β [sub, 1]
  fp32, then the qg, kt, kb refs)."""
  sees, in_last, beta, qg_ref, kt_ref, kb_ref = gates
  gam_last = gamc_ref[pl.ds(gamc_ref.shape[0] - 1, 1), cols]
  qg, kg, kt = gated(q, k, gam, sees, in_last, gam_last)
  qg_ref[:, cols] = qg.astype(qg_ref.dtype)
  kt_ref[:, cols] = kt.astype(kt_ref.dtype)
  kb_ref[:, cols] = (beta * kg).astype(kb_ref.dtype)


def strip_scores_kernel(q_ref, k_ref, gam_ref, kc_ref, gamc_ref, cnt_ref, cntr_ref, beta_ref,
                        aqk_ref, akk_ref, qg_ref, kt_ref, kb_ref, *, strips, scale, bk, mm_dtype):
  """Rows of A_qk and A_kk for one strip of `sub` rows of a chunk, and the strip's gated operands.

  Pairs inside the strip by levels (module docstring) on the strip's [sub, sub] block; pairs with
  an earlier [sub, sub] column block j < r (r = the strip's block index) factor through the
  strip's first row m (s < m ≤ r: both factors ≤ 1), one dot over all of K per block, each stored
  at its columns directly; later blocks are zeros. Refs: q, k, gam [sub, K] (the strip); kc, gamc
  [C, K] (its whole chunk); cnt, beta [sub, 1]; cntr [1, C]. Writes aqk (masked to s ≤ r in one
  segment) and akk (s < r) [sub, C], and qg, kt, kb [sub, K] (`_store_gates`).
  """
  cnt = cnt_ref[...]
  in_last = cnt == cntr_ref[:, pl.ds(cntr_ref.shape[1] - 1, 1)]
  gates = (cnt == 0.0, in_last, beta_ref[...].astype(F32), qg_ref, kt_ref, kb_ref)
  sub, dk = q_ref.shape
  r = lax.rem(pl.program_id(1), strips)                 # the strip's block index in its chunk
  base = r * sub
  row, col = _iota((sub, sub), 0), _iota((sub, sub), 1)

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


def _blocked_inverse(beta_ref, akk_ref, *, sub, mm_dtype):
  """X = (I + Diag(β) A_kk)⁻¹ of one chunk as {(i, j): [sub, sub] block, j ≤ i}: X_ii = (I +
  N_ii)⁻¹ by block doubling (written out, so the diagonal blocks' chains interleave), then
  X_ij = −X_ii Σ_{j≤m<i} N_im X_mj (block forward substitution). Refs: beta [C, 1], akk [C, C]."""
  nb = akk_ref.shape[0] // sub
  rows = [pl.ds(i * sub, sub) for i in range(nb)]
  beta = [beta_ref[r, :].astype(F32) for r in rows]
  dot = lambda a, b: mm_precise(a, b, mm_dtype)
  x = {}
  for i in range(nb):
    x[i, i] = wy_inverse(beta[i] * akk_ref[rows[i], rows[i]], mm_dtype)
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


def inverse_kernel(beta_ref, akk_ref, inv_ref, *, sub, mm_dtype):
  """First half of the WY step, one chunk: X [C, C] only (see `_blocked_inverse`); `wu_kernel`
  (or `w_kernel` and `u_kernel`) then apply it per column block."""
  _write_blocks(inv_ref, _blocked_inverse(beta_ref, akk_ref, sub=sub, mm_dtype=mm_dtype), sub)


def wu_kernel(kb_ref, v_ref, beta_ref, inv_ref, w_ref, u_ref, *, mm_dtype):
  """Second half of the WY step when the K- and V-blocks coincide (K = V), for one chunk and one
  column block: W = X kb with kb = β⊙e^Γ⊙K from the score kernel, U = X Diag(β) V (X and β are
  read once for both)."""
  x = inv_ref[...].astype(mm_dtype)
  w_ref[...] = mm(x, kb_ref[...], mm_dtype).astype(w_ref.dtype)
  _write_u(v_ref, beta_ref[...].astype(F32), x, u_ref, mm_dtype=mm_dtype)


def w_kernel(kb_ref, inv_ref, w_ref, *, mm_dtype):
  """W = X kb for one chunk and one K-block (K ≠ V; U then by `u_kernel`)."""
  w_ref[...] = mm(inv_ref[...].astype(mm_dtype), kb_ref[...], mm_dtype).astype(w_ref.dtype)


def u_kernel(v_ref, beta_ref, inv_ref, u_ref, *, mm_dtype):
  """U = X Diag(β) V for one chunk and one block of V columns (K ≠ V)."""
  _write_u(v_ref, beta_ref[...].astype(F32), inv_ref[...].astype(mm_dtype), u_ref,
           mm_dtype=mm_dtype)


def _write_u(v_ref, beta, x, u_ref, *, mm_dtype):
  u_ref[...] = mm(x, beta * v_ref[...].astype(F32), mm_dtype).astype(u_ref.dtype)


def wy_bwd_kernel(k_ref, v_ref, gam_ref, beta_ref, cnt_ref, cntr_ref, akk_ref, inv_ref, w_ref,
                  u_ref, dw_ref, du_ref, dv_ref, dbeta_ref, dakk_ref, *, bk, mm_dtype):
  """First kernel of the intra-chunk backward, one chunk: `_wy_bwd`, writing dv, dbeta and
  dA_kk [C, C] fp32 (masked) for `score_bwd_kernel`."""
  dakk_ref[...] = _wy_bwd(k_ref, v_ref, gam_ref, cnt_ref, cntr_ref, beta_ref[...].astype(F32),
                          akk_ref, inv_ref[...], w_ref, u_ref, dw_ref, du_ref, dv_ref, dbeta_ref,
                          bk=bk, mm_dtype=mm_dtype)


def score_bwd_kernel(q_ref, k_ref, gam_ref, beta_ref, cnt_ref, cntr_ref, inv_ref, daqk_ref,
                     dakk_ref, dw_ref, dqg_ref, dkt_ref, ddl_ref, dq_ref, dk_ref, dg_ref, *,
                     scale, mm_dtype):
  """Second kernel of the intra-chunk backward: `_score_grads` for one chunk and one block of K
  columns (the per-column gradients need nothing from other columns once dA is known).
  Refs q, k, gam, dw, dqg, dkt, outputs [C, bk]; ddl [1, bk]; inv, daqk, dakk [C, C]."""
  _score_grads(q_ref, k_ref, gam_ref, cnt_ref, cntr_ref, beta_ref[...].astype(F32), inv_ref[...],
               daqk_ref, dakk_ref[...], dw_ref, dqg_ref, dkt_ref, ddl_ref, dq_ref, dk_ref, dg_ref,
               scale=scale, bk=q_ref.shape[1], mm_dtype=mm_dtype)


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
                 dqg_ref, dkt_ref, ddl_ref, dq_ref, dk_ref, dg_ref, *, scale, bk, mm_dtype):
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
      half = _half(i)
      mask = level_mask(c, half)
      daqk_l = jnp.where(mask, daqk, 0.0)
      dakk_l = jnp.where(mask, dakk, 0.0)
      e = level_decay(gam_ref, gam, cols, c, half)
      qe, ke = q * e, k * e
      return (dq_a + e * mm(daqk_l, ke, mm_dtype),
              dk_row + e * mm(dakk_l, ke, mm_dtype),
              dk_col + e * (mm_tn(daqk_l, qe, mm_dtype) + mm_tn(dakk_l, ke, mm_dtype)))

    acc = (d_diag * k, jnp.zeros_like(k), d_diag * q)
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
