"""Per-chunk ("intra-chunk") KDA quantities in plain jnp, in the Pallas kernels' storage layout.

The Pallas backends split the chunked WY form (docs/maths.md §1.4) into an intra-chunk part that is
independent of the state (scores, WY solve, decayed q/k) and a state-passing part. This module is
the jnp definition of the intra-chunk part: `intra_all` returns exactly the tensors the Pallas
intra kernel writes (plus the per-chunk state decay), so its `jax.vjp` is the intra-chunk backward
of the Pallas custom_vjp, and tests can compare kernel outputs against it tensor by tensor.

Layout: every per-token tensor stays [B, T, H, ·] (T a multiple of the chunk C); per-chunk rows
of a [C, C] matrix are stored as [B, T, H, C] (row r of chunk n at time n·C + r).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.kda.xla import decay_scores, solve_unit_lower

SUB_CHUNK = 16


def chunk_cumsum(g_bthk: jax.Array, chunk: int) -> jax.Array:
  """Γ: cumulative log-decay restarted at every chunk start, fp32 [B, T, H, K]."""
  b, t, h, dk = g_bthk.shape
  g_bnchk = g_bthk.astype(jnp.float32).reshape(b, t // chunk, chunk, h, dk)
  return jnp.cumsum(g_bnchk, axis=2).reshape(b, t, h, dk)


def reset_counts(reset_bt: jax.Array, chunk: int) -> jax.Array:
  """cnt [B, T] fp32: resets in the token's chunk at positions ≤ its own (0 = still sees S₀)."""
  b, t = reset_bt.shape
  cnt_bnc = jnp.cumsum(reset_bt.reshape(b, t // chunk, chunk).astype(jnp.int32), axis=-1)
  return cnt_bnc.reshape(b, t).astype(jnp.float32)


def state_decay(gam_bthk: jax.Array, cnt_bt: jax.Array, chunk: int) -> jax.Array:
  """d [B, N, H, K, 1]: exp(Γ_C) per chunk, 0 where a reset inside the chunk cut S₀ off."""
  b, t, h, dk = gam_bthk.shape
  last_bnhk = gam_bthk.reshape(b, t // chunk, chunk, h, dk)[:, :, -1]
  carries_bn = cnt_bt.reshape(b, t // chunk, chunk)[:, :, -1] == 0
  return jnp.where(carries_bn[:, :, None, None], jnp.exp(last_bnhk), 0.0)[..., None]


def _chunks(x_bth_: jax.Array, chunk: int) -> jax.Array:
  """[B, T, H, D] -> [B, N, H, C, D]."""
  b, t, h, d = x_bth_.shape
  return jnp.transpose(x_bth_.reshape(b, t // chunk, chunk, h, d), (0, 1, 3, 2, 4))


def _unchunks(x_bnhcd: jax.Array) -> jax.Array:
  """[B, N, H, C, D] -> [B, T, H, D]."""
  b, n, h, c, d = x_bnhcd.shape
  return jnp.transpose(x_bnhcd, (0, 1, 3, 2, 4)).reshape(b, n * c, h, d)


def intra_all(q, k, v, g, beta, cnt_bt, *, scale: float, chunk: int):
  """All state-independent per-chunk tensors, fp32 (docs/maths.md §1.4 with §1.5 masks).

  q, k: [B, T, H, K] (q unscaled); v: [B, T, H, V]; g: [B, T, H, K]; beta: [B, T, H];
  cnt_bt: `reset_counts`. Returns (aqk [B,T,H,C], w [B,T,H,K], u [B,T,H,V], qg [B,T,H,K],
  kt [B,T,H,K], d [B,N,H,K,1]) where, per chunk, aqk is A_qk masked to s ≤ r in one segment,
  [w | u] = (I + Diag(β) A_kk)⁻¹ Diag(β) [e^Γ⊙K | V], qg = e^Γ⊙Q (rows before the first reset),
  kt = e^{Γ_C−Γ}⊙K (rows of the last segment) and d = exp(Γ_C) (0 if the chunk resets).
  """
  f32 = jnp.float32
  gam = chunk_cumsum(g, chunk)
  q_c, k_c, v_c, gam_c = (_chunks(x.astype(f32), chunk) for x in (q, k, v, gam))
  q_c = q_c * scale
  beta_c = _chunks(beta.astype(f32)[..., None], chunk)                   # [B,N,H,C,1]
  b, t = cnt_bt.shape
  cnt_bn1c = cnt_bt.reshape(b, t // chunk, 1, chunk)
  same = cnt_bn1c[..., :, None] == cnt_bn1c[..., None, :]                # [B,N,1,C,C]
  sees = (cnt_bn1c == 0)[..., None]                                      # [B,N,1,C,1]
  in_last = (cnt_bn1c == cnt_bn1c[..., -1:])[..., None]

  sub = SUB_CHUNK if chunk % SUB_CHUNK == 0 else chunk
  a_qk, a_kk = decay_scores(gam_c, k_c, (q_c, k_c), sub)
  tri = jnp.tril(jnp.ones((chunk, chunk), bool))
  a_qk = jnp.where(same & tri, a_qk, 0.0)
  a_kk = jnp.where(same & jnp.tril(tri, -1), a_kk, 0.0)

  decay = jnp.exp(gam_c)
  qg = jnp.where(sees, q_c * decay, 0.0)
  kg = jnp.where(sees, k_c * decay, 0.0)
  kt = jnp.where(in_last, k_c * jnp.exp(gam_c[..., -1:, :] - gam_c), 0.0)
  dk = k.shape[-1]
  rhs = beta_c * jnp.concatenate([kg, v_c], axis=-1)
  wu = solve_unit_lower(beta_c * a_kk, rhs, sub)
  w, u = wu[..., :dk], wu[..., dk:]
  d = state_decay(gam, cnt_bt, chunk)
  return (_unchunks(a_qk), _unchunks(w), _unchunks(u), _unchunks(qg), _unchunks(kt), d)


def gamma_to_g_grad(dgam_bthk: jax.Array, dd_bnhk1: jax.Array, d_bnhk1: jax.Array, chunk: int
                    ) -> jax.Array:
  """dg from dΓ (Γ = in-chunk cumsum of g) plus the state-decay cotangent dd (d = e^{Γ_C}):
  dΓ_C += dd·d, then dg_r = Σ_{r' ≥ r in the chunk} dΓ_{r'}."""
  b, t, h, dk = dgam_bthk.shape
  dgam = dgam_bthk.reshape(b, t // chunk, chunk, h, dk)
  dgam = dgam.at[:, :, -1].add(dd_bnhk1[..., 0] * d_bnhk1[..., 0])
  return jnp.flip(jnp.cumsum(jnp.flip(dgam, 2), axis=2), 2).reshape(b, t, h, dk)
