"""Intra-chunk KDA kernel bodies for the Mosaic (TPU) launchers, one chunk per program.

`intra_kernel` computes what `intra.intra_all` defines (A_qk, W, U, e^Γ⊙Q, e^{Γ_C−Γ}⊙K, plus
the masked A_kk and the WY inverse for the backward); `intra_bwd_kernel` is its VJP (the jnp twin
is `jax.vjp` of `intra.intra_all`). Scores use the sub-chunk factorisation of docs/maths.md §1.4
so no exponent is ever positive: blocks below the diagonal go through the first row of the row's
sub-chunk, diagonal sub×sub blocks are built one column at a time with the exact pairwise
exponent masked before exp; the WY inverse is a row-by-row forward substitution. Only value-level
ops that Mosaic lowers (2-D dots, elementwise maths, iota masks, row reductions, row loads).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kda.kernels import gated, mm, mm_nt, mm_tn

F32 = jnp.float32


def _iota(shape, axis):
  return lax.broadcasted_iota(jnp.int32, shape, axis)


def intra_kernel(q_ref, k_ref, v_ref, gam_ref, beta_ref, cnt_ref, cntr_ref,
                 aqk_ref, w_ref, u_ref, qg_ref, kt_ref, akk_ref, inv_ref, *, scale, sub, mm_dtype):
  """One chunk of one (batch, head): A_qk, W, U, e^Γ⊙Q, e^{Γ_C−Γ}⊙K (see intra.intra_all).

  Refs: q, k, gam [C, K]; v [C, V]; beta, cnt [C, 1]; cntr [1, C] (cnt as a row); outputs
  aqk [C, C], w/qg/kt [C, K], u [C, V], and for the backward akk (masked A_kk) and inv
  ((I + Diag(β) A_kk)⁻¹), both [C, C] fp32. Scores use the sub-chunk factorisation so no exponent is
  ever positive: blocks below the diagonal go through the first row of the row's sub-chunk
  (two factors ≤ 1, one dot per sub-chunk), diagonal sub×sub blocks are built one column at a
  time with the exact pairwise exponent masked before exp.
  """
  c, dk = q_ref.shape
  nsub = c // sub
  q = q_ref[...].astype(F32) * scale
  k = k_ref[...].astype(F32)
  gam = gam_ref[...]
  beta = beta_ref[...].astype(F32)
  cnt = cnt_ref[...]
  cnt_row = cntr_ref[...]
  row_cc, col_cc = _iota((c, c), 0), _iota((c, c), 1)
  blk_ck = lax.div(_iota((c, dk), 0), sub)
  pos_ck = lax.rem(_iota((c, dk), 0), sub)
  blk_cc = lax.div(row_cc, sub)

  # Decayed q/k against S₀ and towards S_next, with the segment masks.
  gam_last = gam_ref[pl.ds(c - 1, 1), :]
  cnt_last = cnt_ref[pl.ds(c - 1, 1), :]
  qg, kg, kt = gated(q, k, gam, cnt == 0.0, cnt == cnt_last, gam_last)

  # Below-diagonal sub-chunk blocks: reference row = first row of the row's sub-chunk.
  a_qk = jnp.zeros((c, c), F32)
  a_kk = jnp.zeros((c, c), F32)
  for i in range(1, nsub):
    ref = gam_ref[pl.ds(i * sub, 1), :]
    rows_i = blk_ck == i
    e_row = jnp.exp(jnp.where(rows_i, gam - ref, 0.0))
    q_i = jnp.where(rows_i, q * e_row, 0.0)
    k_i = jnp.where(rows_i, k * e_row, 0.0)
    before = blk_ck < i
    k_back = jnp.where(before, k * jnp.exp(jnp.where(before, ref - gam, 0.0)), 0.0)
    a_qk = a_qk + mm_nt(q_i, k_back, mm_dtype)
    a_kk = a_kk + mm_nt(k_i, k_back, mm_dtype)

  # Diagonal blocks, column j of every sub-chunk at once (exact exponent, masked before exp).
  def diag_column(j, carry):
    a_qk, a_kk = carry
    k_s = jnp.zeros((c, dk), F32)
    gam_s = jnp.zeros((c, dk), F32)
    for i in range(nsub):
      k_s = jnp.where(blk_ck == i, k_ref_row(k_ref, i * sub + j), k_s)
      gam_s = jnp.where(blk_ck == i, gam_ref[pl.ds(i * sub + j, 1), :], gam_s)
    valid = pos_ck >= j
    k_dec = jnp.where(valid, k_s * jnp.exp(jnp.where(valid, gam - gam_s, 0.0)), 0.0)
    col_q = jnp.sum(q * k_dec, axis=1, keepdims=True)
    col_k = jnp.sum(k * k_dec, axis=1, keepdims=True)
    target = col_cc == blk_cc * sub + j
    return jnp.where(target, col_q, a_qk), jnp.where(target, col_k, a_kk)

  a_qk, a_kk = lax.fori_loop(0, sub, diag_column, (a_qk, a_kk))
  same = cnt == cnt_row
  a_qk = jnp.where(same & (col_cc <= row_cc), a_qk, 0.0)
  a_kk = jnp.where(same & (col_cc < row_cc), a_kk, 0.0)

  # WY: X = (I + N)⁻¹, N = Diag(β) A_kk strictly lower, by row-wise forward substitution
  # X[r] = e_r − Σ_s N[r, s] X[s]; N[r, :] is read as column r of Nᵀ.
  n_t = jnp.transpose(beta * a_kk)
  eye = (row_cc == col_cc).astype(F32)

  def next_row(r, x):
    n_r = jnp.sum(jnp.where(col_cc == r, n_t, 0.0), axis=1, keepdims=True)   # [C, 1]
    contrib = jnp.sum(n_r * x, axis=0, keepdims=True)                          # [1, C]
    return x - jnp.where(row_cc == r, contrib, 0.0)

  inv = lax.fori_loop(1, c, next_row, eye)
  w = mm(inv, beta * kg, mm_dtype)
  u = mm(inv, beta * v_ref[...].astype(F32), mm_dtype)

  aqk_ref[...] = a_qk.astype(aqk_ref.dtype)
  w_ref[...] = w.astype(w_ref.dtype)
  u_ref[...] = u.astype(u_ref.dtype)
  qg_ref[...] = qg.astype(qg_ref.dtype)
  kt_ref[...] = kt.astype(kt_ref.dtype)
  akk_ref[...] = a_kk
  inv_ref[...] = inv


def k_ref_row(ref, r):
  """Row r of a [C, K] ref as a [1, K] fp32 value."""
  return ref[pl.ds(r, 1), :].astype(F32)


def intra_bwd_kernel(q_ref, k_ref, v_ref, gam_ref, beta_ref, cnt_ref, cntr_ref, akk_ref, inv_ref,
                     w_ref, u_ref, daqk_ref, dw_ref, du_ref, dqg_ref, dkt_ref,
                     dq_ref, dk_ref, dv_ref, dbeta_ref, dgam_ref, *, scale, sub, mm_dtype):
  """VJP of `intra_kernel` for one chunk (the jnp twin is jax.vjp of intra.intra_all).

  Inputs as the forward plus its akk/inv/w/u and the cotangents of aqk, w, u, qg, kt.
  Outputs fp32: dq (wrt the unscaled q), dk, dv [C, ·], dbeta [C, 1], dgam [C, K] (wrt Γ; the
  caller turns it into dg with a reverse in-chunk cumsum). Steps: WY solve backward
  (dR = Xᵀ dY, dN = −dR Yᵀ), the elementwise decays, then the score gradients with the same
  sub-chunk factorisation as the forward (nothing exponentiates a positive number).
  """
  c, dk = q_ref.shape
  nsub = c // sub
  q = q_ref[...].astype(F32) * scale
  k = k_ref[...].astype(F32)
  v = v_ref[...].astype(F32)
  gam = gam_ref[...]
  beta = beta_ref[...].astype(F32)
  cnt = cnt_ref[...]
  row_cc, col_cc = _iota((c, c), 0), _iota((c, c), 1)
  blk_ck = lax.div(_iota((c, dk), 0), sub)
  pos_ck = lax.rem(_iota((c, dk), 0), sub)
  blk_cc = lax.div(row_cc, sub)
  same = cnt == cntr_ref[...]
  lower = same & (col_cc < row_cc)
  gam_last = gam_ref[pl.ds(c - 1, 1), :]
  cnt_last = cnt_ref[pl.ds(c - 1, 1), :]
  sees = cnt == 0.0
  in_last = cnt == cnt_last
  decay = jnp.exp(gam)
  kg = jnp.where(sees, k * decay, 0.0)
  e_tail = jnp.where(in_last, jnp.exp(gam_last - gam), 0.0)
  kt = k * e_tail

  # WY backward: Y = X R with R = Diag(β)[kg | v], X = (I + N)⁻¹, N = Diag(β) A_kk.
  inv = inv_ref[...]
  dw = dw_ref[...].astype(F32)
  du = du_ref[...].astype(F32)
  dr_k = mm_tn(inv, dw, mm_dtype)
  dr_v = mm_tn(inv, du, mm_dtype)
  dn = -(mm_nt(dr_k, w_ref[...], mm_dtype) + mm_nt(dr_v, u_ref[...], mm_dtype))
  dn = jnp.where(lower, dn, 0.0)
  dbeta = (jnp.sum(dn * akk_ref[...], axis=1, keepdims=True)
           + jnp.sum(dr_k * kg, axis=1, keepdims=True) + jnp.sum(dr_v * v, axis=1, keepdims=True))
  dakk = beta * dn
  dkg = beta * dr_k
  dv_ref[...] = beta * dr_v

  # Elementwise decays: qg = e^Γ⊙q, kg = e^Γ⊙k (rows that see S₀), kt = e^{Γ_C−Γ}⊙k (last segment).
  dqg = dqg_ref[...].astype(F32)
  dkt = dkt_ref[...].astype(F32)
  dq = jnp.where(sees, dqg * decay, 0.0)
  dk_ = jnp.where(sees, dkg * decay, 0.0) + dkt * e_tail
  dgam = jnp.where(sees, (dqg * q + dkg * k) * decay, 0.0) - dkt * kt
  dgam = dgam + jnp.where(_iota((c, 1), 0) == c - 1, jnp.sum(dkt * kt, axis=0, keepdims=True), 0.0)

  # Score gradients. dq_a/dk_row: Σ_s dA[r,s] k_s e^{Γ_r−Γ_s}; dk_col: Σ_r dA[r,s] a_r e^{Γ_r−Γ_s}.
  daqk = jnp.where(same & (col_cc <= row_cc), daqk_ref[...].astype(F32), 0.0)
  dq_a = jnp.zeros((c, dk), F32)
  dk_row = jnp.zeros((c, dk), F32)
  dk_col = jnp.zeros((c, dk), F32)
  for i in range(1, nsub):
    ref = gam_ref[pl.ds(i * sub, 1), :]
    rows_i = blk_ck == i
    e_row = jnp.where(rows_i, jnp.exp(jnp.where(rows_i, gam - ref, 0.0)), 0.0)
    before = blk_ck < i
    e_back = jnp.where(before, jnp.exp(jnp.where(before, ref - gam, 0.0)), 0.0)
    k_back = k * e_back
    in_i = blk_cc == i
    daqk_i = jnp.where(in_i, daqk, 0.0)
    dakk_i = jnp.where(in_i, dakk, 0.0)
    dq_a = dq_a + e_row * mm(daqk_i, k_back, mm_dtype)
    dk_row = dk_row + e_row * mm(dakk_i, k_back, mm_dtype)
    dk_col = dk_col + e_back * (mm_tn(daqk_i, q * e_row, mm_dtype)
                                + mm_tn(dakk_i, k * e_row, mm_dtype))

  daqk_t = jnp.transpose(daqk)
  dakk_t = jnp.transpose(dakk)

  def diag_column(j, carry):
    dq_a, dk_row, dk_col = carry
    k_j = jnp.zeros((c, dk), F32)
    q_j = jnp.zeros((c, dk), F32)
    gam_j = jnp.zeros((c, dk), F32)
    for i in range(nsub):
      sel = blk_ck == i
      k_j = jnp.where(sel, k_ref_row(k_ref, i * sub + j), k_j)
      q_j = jnp.where(sel, k_ref_row(q_ref, i * sub + j) * scale, q_j)
      gam_j = jnp.where(sel, gam_ref[pl.ds(i * sub + j, 1), :], gam_j)
    target = col_cc == blk_cc * sub + j
    return diag_column_grads((dq_a, dk_row, dk_col), j, pos_ck, target, q_j, k_j, gam_j, gam,
                             daqk, dakk, daqk_t, dakk_t)

  dq_a, dk_row, dk_col = lax.fori_loop(0, sub, diag_column, (dq_a, dk_row, dk_col))
  dq = dq + dq_a
  dk_ = dk_ + dk_row + dk_col
  dgam = dgam + q * dq_a + k * dk_row - k * dk_col
  dq_ref[...] = dq * scale
  dk_ref[...] = dk_
  dbeta_ref[...] = dbeta
  dgam_ref[...] = dgam


def diag_column_grads(acc, j, pos, target, q_j, k_j, gam_j, gam, dqk, dkk, dqk_t, dkk_t):
  """One column step s = j of the score gradients inside a diagonal block (rows `pos` = their
  place in the block): row side, r ≥ s: dq_a, dk_row += dA[r, s] · k_s e^{Γ_r−Γ_s}; column side,
  row r = j ≥ s: dk_col += e^{Γ_r−Γ_s} (dA_qk[r, s] q_r + dA_kk[r, s] k_r). `target` marks where
  column j's coefficients sit in dqk / dkk and row j's in their transposes dqk_t / dkk_t."""
  dq_a, dk_row, dk_col = acc
  pick = lambda m: jnp.sum(jnp.where(target, m, 0.0), axis=1, keepdims=True)
  later = pos >= j
  k_dec = jnp.where(later, k_j * jnp.exp(jnp.where(later, gam - gam_j, 0.0)), 0.0)
  earlier = pos <= j
  e = jnp.where(earlier, jnp.exp(jnp.where(earlier, gam_j - gam, 0.0)), 0.0)
  return (dq_a + pick(dqk) * k_dec, dk_row + pick(dkk) * k_dec,
          dk_col + e * (pick(dqk_t) * q_j + pick(dkk_t) * k_j))
