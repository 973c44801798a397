"""Token-by-token KDA recurrence (docs/maths.md §1.2 step 6): the oracle of every fast path.

Readable rather than fast: one `lax.scan` step per token. Runs in whatever float dtype it is given
(float64 included). Inputs are expected canonical (see `pallas_kernels.kda.op`): q already scaled,
everything in the compute dtype, segment changes given as per-token reset flags.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_HIGHEST = jax.lax.Precision.HIGHEST


def recurrent_step(s_bhkv: jax.Array, q_bhk: jax.Array, k_bhk: jax.Array, v_bhv: jax.Array,
                   g_bhk: jax.Array, beta_bh: jax.Array) -> tuple[jax.Array, jax.Array]:
  """One KDA token: decay the key rows of S, erase-and-write along k, read with q.

  S ← Diag(exp g) S;  S ← S + β k (v − Sᵀk)ᵀ;  o = Sᵀ q  (the read sees S after the write).
  Returns (o [B,H,V], new S [B,H,K,V]).
  """
  s_bhkv = jnp.exp(g_bhk)[..., None] * s_bhkv
  v_pred_bhv = jnp.einsum("bhkv,bhk->bhv", s_bhkv, k_bhk, precision=_HIGHEST)
  delta_bhv = beta_bh[..., None] * (v_bhv - v_pred_bhv)
  s_bhkv = s_bhkv + k_bhk[..., :, None] * delta_bhv[..., None, :]
  o_bhv = jnp.einsum("bhkv,bhk->bhv", s_bhkv, q_bhk, precision=_HIGHEST)
  return o_bhv, s_bhkv


def kda_recurrent(q_bthk: jax.Array, k_bthk: jax.Array, v_bthv: jax.Array, g_bthk: jax.Array,
                  beta_bth: jax.Array, s0_bhkv: jax.Array, reset_bt: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
  """Scan `recurrent_step` over time; the state is zeroed before every token with reset_bt True.

  Returns (o [B,T,H,V], final state [B,H,K,V]) in the input dtype.
  """

  def step(s_bhkv, xs):
    q_bhk, k_bhk, v_bhv, g_bhk, beta_bh, reset_b = xs
    # A new document starts from zero state (its own decay then acts on zeros).
    s_bhkv = jnp.where(reset_b[:, None, None, None], jnp.zeros_like(s_bhkv), s_bhkv)
    o_bhv, s_bhkv = recurrent_step(s_bhkv, q_bhk, k_bhk, v_bhv, g_bhk, beta_bh)
    return s_bhkv, o_bhv

  time_major = lambda x: jnp.moveaxis(x, 1, 0)
  xs = tuple(map(time_major, (q_bthk, k_bthk, v_bthv, g_bthk, beta_bth, reset_bt)))
  s_bhkv, o_tbhv = jax.lax.scan(step, s0_bhkv, xs)
  return jnp.moveaxis(o_tbhv, 0, 1), s_bhkv
