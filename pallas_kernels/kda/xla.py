"""Chunkwise-parallel KDA in plain jnp (docs/maths.md §1.4, WY/UT form), the "jax" backend.

All intra-chunk quantities (decay-weighted scores, the WY solve) are computed for every chunk at
once in 16-token sub-chunks; only the state hand-off between chunks is a `lax.scan` (body
rematerialised). Inputs are canonical (see `op.py`): q already scaled, one float dtype, T a
multiple of the chunk size, segment changes given as reset flags. `kda_xla` is the entry point
of the "jax" backend; `decay_scores` and `solve_unit_lower` are shared with `intra.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import platform

_HIGHEST = jax.lax.Precision.HIGHEST
SUB_CHUNK = 16


def _to_chunks(x_bth_: jax.Array, chunk: int) -> jax.Array:
  """[B, T, H, ...] -> [N, B, H, C, ...] (chunk index leading, so the scan can walk it)."""
  b, t, h = x_bth_.shape[:3]
  x_bnch_ = x_bth_.reshape(b, t // chunk, chunk, h, *x_bth_.shape[3:])
  return jnp.transpose(x_bnch_, (1, 0, 3, 2) + tuple(range(4, x_bnch_.ndim)))


def _from_chunks(x_nbhc_: jax.Array) -> jax.Array:
  """[N, B, H, C, ...] -> [B, N·C, H, ...]; the inverse of `_to_chunks`."""
  n, b, h, c = x_nbhc_.shape[:4]
  x_bnch_ = jnp.transpose(x_nbhc_, (1, 0, 3, 2) + tuple(range(4, x_nbhc_.ndim)))
  return x_bnch_.reshape(b, n * c, h, *x_nbhc_.shape[4:])


def decay_scores(gam_ck: jax.Array, k_ck: jax.Array, rows: tuple[jax.Array, ...], sub: int
                 ) -> list[jax.Array]:
  """For each a in rows: A[r, s] = Σ_c a[r,c] k[s,c] exp(Γ_r[c] − Γ_s[c]) for s ≤ r, else 0.

  Sub-chunk form (docs/maths.md §1.4, option 2) so no exponent is ever positive: diagonal
  sub×sub blocks use the exact pairwise exponent masked *before* exp; off-diagonal blocks factor
  through the first row n of the row's sub-chunk, (a_r e^{Γ_r−Γ_n})·(k_s e^{Γ_n−Γ_s}), with both
  factors ≤ 1.
  Leading dims of all arrays are batch; gam, k, a: [..., C, K]; returns [..., C, C] each.
  """
  *batch, c, dk = gam_ck.shape
  n = c // sub
  gam_nsk = gam_ck.reshape(*batch, n, sub, dk)
  k_nsk = k_ck.reshape(*batch, n, sub, dk)

  # Diagonal blocks: exp(Γ_r − Γ_s) for s ≤ r inside the sub-chunk, masked before exp.
  tri_ss1 = jnp.tril(jnp.ones((sub, sub), bool))[:, :, None]
  diff_nssk = gam_nsk[..., :, :, None, :] - gam_nsk[..., :, None, :, :]
  decay_nssk = jnp.where(tri_ss1, jnp.exp(jnp.where(tri_ss1, diff_nssk, 0.0)), 0.0)

  # Off-diagonal blocks: columns s in earlier sub-chunks than the row's, referenced to its first row.
  ref_nk = gam_nsk[..., :, 0, :]
  earlier_nc1 = (jnp.arange(c)[None, :] < (jnp.arange(n) * sub)[:, None])[:, :, None]
  to_ref_nck = ref_nk[..., :, None, :] - gam_ck[..., None, :, :]
  k_ref_nck = jnp.where(earlier_nc1,
                        k_ck[..., None, :, :] * jnp.exp(jnp.where(earlier_nc1, to_ref_nck, 0.0)),
                        0.0)
  eye_1n1n = jnp.eye(n, dtype=gam_ck.dtype)[:, None, :, None]

  scores = []
  for a_ck in rows:
    a_nsk = a_ck.reshape(*batch, n, sub, dk)
    diag_nss = jnp.einsum("...nrk,...nsk,...nrsk->...nrs", a_nsk, k_nsk, decay_nssk,
                          precision=_HIGHEST)
    a_ref_nsk = a_nsk * jnp.exp(gam_nsk - ref_nk[..., :, None, :])
    off_nsc = jnp.einsum("...nrk,...nck->...nrc", a_ref_nsk, k_ref_nck, precision=_HIGHEST)
    diag_cc = (diag_nss[..., :, :, None, :] * eye_1n1n).reshape(*batch, c, c)
    scores.append(off_nsc.reshape(*batch, c, c) + diag_cc)
  return scores


def _unit_lower_inverse(n_bb: jax.Array) -> jax.Array:
  """(I + N)⁻¹ for strictly lower-triangular N [..., b, b] by row-wise forward substitution.

  Row r of the inverse is e_r − N[r, :] · inv: N[r, s ≥ r] = 0, so only finished rows contribute.
  """
  b = n_bb.shape[-1]
  eye_bb = jnp.eye(b, dtype=n_bb.dtype)

  def next_row(r, inv_bb):
    n_row_b = jax.lax.dynamic_index_in_dim(n_bb, r, axis=-2, keepdims=False)
    row_b = eye_bb[r] - jnp.einsum("...s,...sk->...k", n_row_b, inv_bb, precision=_HIGHEST)
    return jax.lax.dynamic_update_index_in_dim(inv_bb, row_b, r, axis=-2)

  return jax.lax.fori_loop(1, b, next_row, jnp.broadcast_to(eye_bb, n_bb.shape))


def solve_unit_lower(n_cc: jax.Array, rhs_cd: jax.Array, block: int) -> jax.Array:
  """X with (I + N) X = rhs for strictly lower-triangular N [..., C, C]: blocked forward substitution.

  Diagonal block×block blocks are inverted all at once, then block rows are solved in order with
  matmuls (X_i = D_i⁻¹ (rhs_i − N[i, :i] X[:i])). Plain dots only: no LAPACK custom call, whose
  batched CPU version (jaxlib 0.10.2) deadlocks when several run concurrently on a small pool.
  """
  *batch, c, _ = n_cc.shape
  m = c // block
  # Diagonal blocks [..., m, block, block] of N.
  n_mbmb = n_cc.reshape(*batch, m, block, m, block)
  n_diag_mbb = jnp.moveaxis(jnp.diagonal(n_mbmb, axis1=-4, axis2=-2), -1, -3)
  d_inv_mbb = _unit_lower_inverse(n_diag_mbb)
  x_blocks = []
  for i in range(m):
    rows = slice(i * block, (i + 1) * block)
    acc_bd = rhs_cd[..., rows, :]
    if i:
      x_done_id = jnp.concatenate(x_blocks, axis=-2)
      acc_bd = acc_bd - jnp.einsum("...rs,...sd->...rd", n_cc[..., rows, :i * block], x_done_id,
                                   precision=_HIGHEST)
    x_blocks.append(jnp.einsum("...rs,...sd->...rd", d_inv_mbb[..., i, :, :], acc_bd,
                               precision=_HIGHEST))
  return jnp.concatenate(x_blocks, axis=-2)


def _segment_masks(reset_bt: jax.Array, chunk: int):
  """Per-chunk segment bookkeeping from reset flags (a reset at position 0 is vs the previous chunk).

  cnt[r] = resets in the chunk at positions ≤ r. Returns [N, B, 1, ...] masks (H broadcast):
  same [C, C] (r, s in one segment), sees_s0 [C] (row still continues S₀), in_last [C] (token in
  the chunk's last segment, so it reaches S_next), carries [] (S_next still contains S₀).
  """
  b, t = reset_bt.shape
  reset_nbc = jnp.transpose(reset_bt.reshape(b, t // chunk, chunk), (1, 0, 2))
  cnt_nb1c = jnp.cumsum(reset_nbc.astype(jnp.int32), axis=-1)[:, :, None, :]
  same_nb1cc = cnt_nb1c[..., :, None] == cnt_nb1c[..., None, :]
  sees_s0_nb1c = cnt_nb1c == 0
  in_last_nb1c = cnt_nb1c == cnt_nb1c[..., -1:]
  carries_nb1 = cnt_nb1c[..., -1] == 0
  return same_nb1cc, sees_s0_nb1c, in_last_nb1c, carries_nb1


def kda_chunked(q_bthk: jax.Array, k_bthk: jax.Array, v_bthv: jax.Array, g_bthk: jax.Array,
                beta_bth: jax.Array, s0_bhkv: jax.Array, reset_bt: jax.Array, chunk: int
                ) -> tuple[jax.Array, jax.Array]:
  """Chunked KDA forward; returns (o [B,T,H,V], final state [B,H,K,V]) in the input dtype."""
  t, dk = q_bthk.shape[1], q_bthk.shape[3]
  if t % chunk:
    raise ValueError(f"kda_chunked needs T ({t}) to be a multiple of chunk ({chunk}); pad first")
  sub = SUB_CHUNK if chunk % SUB_CHUNK == 0 else chunk
  q_nbhck, k_nbhck, v_nbhcv, g_nbhck, beta_nbhc = (
      _to_chunks(x, chunk) for x in (q_bthk, k_bthk, v_bthv, g_bthk, beta_bth))
  same_nb1cc, sees_s0_nb1c, in_last_nb1c, carries_nb1 = _segment_masks(reset_bt, chunk)

  # Γ_r: cumulative log-decay inside each chunk (≤ 0, decreasing).
  gam_nbhck = jnp.cumsum(g_nbhck, axis=-2)
  a_qk_nbhcc, a_kk_nbhcc = decay_scores(gam_nbhck, k_nbhck, (q_nbhck, k_nbhck), sub)
  tri_cc = jnp.tril(jnp.ones((chunk, chunk), bool))
  a_qk_nbhcc = jnp.where(same_nb1cc & tri_cc, a_qk_nbhcc, 0.0)
  a_kk_nbhcc = jnp.where(same_nb1cc & jnp.tril(tri_cc, -1), a_kk_nbhcc, 0.0)

  # Rows after an in-chunk reset never see S₀: zero their e^Γ-decayed q and k. (The WY solve is
  # block-diagonal per segment, so masking k before it equals masking the rows of W after it.)
  sees_s0_nb1c1 = sees_s0_nb1c[..., None]
  decay_nbhck = jnp.exp(gam_nbhck)
  q_s0_nbhck = jnp.where(sees_s0_nb1c1, q_nbhck * decay_nbhck, 0.0)
  k_s0_nbhck = jnp.where(sees_s0_nb1c1, k_nbhck * decay_nbhck, 0.0)

  # WY form: (I + Diag(β) A_kk) [W | U] = Diag(β) [e^Γ⊙K | V], a unit-lower-triangular solve.
  rhs_nbhc_ = beta_nbhc[..., None] * jnp.concatenate([k_s0_nbhck, v_nbhcv], axis=-1)
  wu_nbhc_ = solve_unit_lower(beta_nbhc[..., :, None] * a_kk_nbhcc, rhs_nbhc_, sub)
  w_nbhck, u_nbhcv = wu_nbhc_[..., :dk], wu_nbhc_[..., dk:]

  # State hand-off: only the chunk's last segment writes S_next; S₀ survives only without a reset.
  gam_last_nbh1k = gam_nbhck[..., -1:, :]
  k_tail_nbhck = jnp.where(in_last_nb1c[..., None],
                           k_nbhck * jnp.exp(gam_last_nbh1k - gam_nbhck), 0.0)
  s0_decay_nbhk = jnp.where(carries_nb1[..., None], jnp.exp(gam_last_nbh1k[..., 0, :]), 0.0)

  @jax.checkpoint
  def chunk_step(s_bhkv, xs):
    q_s0_bhck, w_bhck, u_bhcv, a_qk_bhcc, k_tail_bhck, s0_decay_bhk = xs
    delta_bhcv = u_bhcv - jnp.einsum("bhck,bhkv->bhcv", w_bhck, s_bhkv, precision=_HIGHEST)
    o_bhcv = (jnp.einsum("bhck,bhkv->bhcv", q_s0_bhck, s_bhkv, precision=_HIGHEST)
              + jnp.einsum("bhcs,bhsv->bhcv", a_qk_bhcc, delta_bhcv, precision=_HIGHEST))
    s_bhkv = (s0_decay_bhk[..., None] * s_bhkv
              + jnp.einsum("bhck,bhcv->bhkv", k_tail_bhck, delta_bhcv, precision=_HIGHEST))
    return s_bhkv, o_bhcv

  xs = (q_s0_nbhck, w_nbhck, u_nbhcv, a_qk_nbhcc, k_tail_nbhck, s0_decay_nbhk)
  s_bhkv, o_nbhcv = jax.lax.scan(chunk_step, s0_bhkv, xs)
  return _from_chunks(o_nbhcv), s_bhkv


def kda_xla(q_bthk: jax.Array, k_bthk: jax.Array, v_bthv: jax.Array, g_bthk: jax.Array,
            beta_bth: jax.Array, s0_bhkv: jax.Array, reset_bt: jax.Array, chunk: int
            ) -> tuple[jax.Array, jax.Array]:
  """`kda_chunked`, padding B, H or the chunk count from 1 to 2 with no-op rows on XLA:CPU.

  XLA:CPU (jaxlib 0.10.2) segfaults running the autodiff of the chunked form when some but not
  all of (B, H, T / chunk) equal 1. Zero rows / heads / trailing tokens (q = k = v = g = β = 0,
  S₀ = 0) are exact no-ops: their outputs are dropped, the final state is unchanged and they get
  zero gradients. Other platforms run `kda_chunked` directly.
  """
  b, t, h = q_bthk.shape[:3]
  units = (b == 1, h == 1, t == chunk)
  if platform.current() != "cpu" or not any(units) or all(units):
    return kda_chunked(q_bthk, k_bthk, v_bthv, g_bthk, beta_bth, s0_bhkv, reset_bt, chunk)

  def pad(x, axis, extra):
    if not extra:
      return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)

  pb, ph, pt = int(b == 1), int(h == 1), chunk * int(t == chunk)
  q, k, v, g = (pad(pad(pad(x, 0, pb), 1, pt), 2, ph) for x in (q_bthk, k_bthk, v_bthv, g_bthk))
  beta = pad(pad(pad(beta_bth, 0, pb), 1, pt), 2, ph)
  s0 = pad(pad(s0_bhkv, 0, pb), 1, ph)
  reset = pad(pad(reset_bt, 0, pb), 1, pt)
  o, s = kda_chunked(q, k, v, g, beta, s0, reset, chunk)
  return o[:b, :t, :h], s[:b, :h]
