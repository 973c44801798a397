"""Gated NoPE multi-head latent attention (docs/maths.md §2), training / prefill path.

No rotary embedding anywhere: the 64-dim "rope" slot of q and the shared key k^R are used
unrotated, and the softmax scale counts them (1/sqrt(d_nope + d_rope)). A sigmoid gate on the
concatenated head outputs precedes o_proj. Attention never crosses documents (segment ids).

Generation (docs/maths.md §2.3): each layer caches, per token, the normalised latent c and the
shared key k^R, [c ; k^R] of kv_lora_rank + qk_rope_head_dim values (576 for K3) whatever the
number of heads. `prefill` is the training forward plus those rows; `decode_step` attends one
new token over the cache with the absorbed weights: W^UK folded into the query, W^UV applied
after the softmax, so per-head keys and values are never formed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from k3train.parallel import attention as parallel_attention
from k3train.parallel import axes as ax
from k3train.parallel.rules import constrain
from k3train.model import layers


class MaxLogit(nnx.Variable):
  """Per-head maximum pre-softmax logit of the last forward pass [H], for QK-Clip and metrics."""


def softmax_scale(cfg: ml_collections.ConfigDict) -> float:
  return float(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5


class GatedMLA(nnx.Module):
  """One gated NoPE MLA mixer. Input and output [B, T, d]."""

  def __init__(self, cfg: ml_collections.ConfigDict, *, d_model: int, init_std: float, dtype,
               param_dtype, rngs: nnx.Rngs):
    h = cfg.num_heads
    self.num_heads = h
    self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    self.kv_lora_rank = cfg.kv_lora_rank
    self.scale = softmax_scale(cfg)
    self.output_gate = cfg.output_gate
    self.backend = cfg.backend
    self.dtype = dtype
    kw = dict(std=init_std, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.q_a_proj = layers.Linear((d_model,), (cfg.q_lora_rank,), (ax.EMBED, ax.Q_LORA), **kw)
    self.q_a_norm = layers.RMSNorm(cfg.q_lora_rank, eps=cfg.latent_norm_eps, param_dtype=param_dtype, rngs=rngs)
    self.q_b_proj = layers.Linear((cfg.q_lora_rank,), (h, self.nope + self.rope),
                                  (ax.Q_LORA, ax.HEADS, ax.HEAD_DIM), **kw)
    self.kv_a_proj = layers.Linear((d_model,), (cfg.kv_lora_rank + self.rope,), (ax.EMBED, ax.KV_LORA), **kw)
    self.kv_a_norm = layers.RMSNorm(cfg.kv_lora_rank, eps=cfg.latent_norm_eps, param_dtype=param_dtype, rngs=rngs)
    self.kv_b_proj = layers.Linear((cfg.kv_lora_rank,), (h, self.nope + self.v_dim),
                                   (ax.KV_LORA, ax.HEADS, ax.HEAD_DIM), **kw)
    if self.output_gate:
      self.g_proj = layers.Linear((d_model,), (h, self.v_dim), (ax.EMBED, ax.HEADS, ax.HEAD_DIM), **kw)
    self.o_proj = layers.Linear((h, self.v_dim), (d_model,), (ax.HEADS, ax.HEAD_DIM, ax.EMBED), **kw)
    self.max_logit = MaxLogit(jnp.zeros((h,), jnp.float32))

  def _down_projections(self, x_btd: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(x W^DQ [B, T, q_lora_rank], x W^DKV [B, T, kv_lora_rank + rope]) from one GEMM over the
    two kernels side by side: x's gradient of both comes from one fp32-accumulated GEMM. Each
    column is the same dot product as its own projection's."""
    w_dr = jnp.concatenate([self.q_a_proj.kernel[...], self.kv_a_proj.kernel[...]], axis=1)
    a = layers.project(x_btd, w_dr, 1, self.q_a_proj.dtype)
    q_rank = self.q_a_proj.out_shape[0]
    return a[..., :q_rank], a[..., q_rank:]

  def project_qkv(self, x_btd: jax.Array):
    """Returns q_c [B,T,H,nope], q_r [B,T,H,rope], k_c [B,T,H,nope], k_r [B,T,rope], v [B,T,H,v]."""
    q_a, kv_a = self._down_projections(x_btd)
    q = self.q_b_proj(self.q_a_norm(q_a))
    q_c, q_r = q[..., :self.nope], q[..., self.nope:]
    c = self.kv_a_norm(kv_a[..., :self.kv_lora_rank])   # the 512-wide latent (cached at decode)
    k_r = kv_a[..., self.kv_lora_rank:]                   # shared by all heads, never rotated
    kv = self.kv_b_proj(c)
    k_c, v = kv[..., :self.nope], kv[..., self.nope:]
    return q_c, q_r, k_c, k_r, v

  @jax.named_scope("mla")
  def __call__(self, x_btd: jax.Array, segment_ids_bt: jax.Array | None = None) -> jax.Array:
    q_c, q_r, k_c, k_r, v = self.project_qkv(x_btd)
    # One 192-wide q·k per head: [q_c, q_r]·[k_c, k_r] = q_c·k_c + q_r·k_r (k_r shared by heads).
    q = jnp.concatenate([q_c, q_r], axis=-1)
    k = jnp.concatenate([k_c, jnp.broadcast_to(k_r[:, :, None, :], (*k_c.shape[:3], self.rope))],
                        axis=-1)
    names = (ax.BATCH, ax.SEQ, ax.HEADS, ax.HEAD_DIM)
    q, k, v = (constrain(t.astype(self.dtype), *names) for t in (q, k, v))
    out, max_logit_bh = parallel_attention.attention(q, k, v, segment_ids_bt, scale=self.scale,
                                                     backend=self.backend)
    self.max_logit[...] = jax.lax.stop_gradient(jnp.max(max_logit_bh, axis=0))
    f32 = jnp.float32
    if self.output_gate:
      out = out * jax.nn.sigmoid(self.g_proj(x_btd).astype(f32))
    out = constrain(out.astype(self.dtype), ax.BATCH, ax.SEQ, ax.HEADS, ax.HEAD_DIM)
    return self.o_proj(out)

  # ------------------------------------------------------------------ generation (§2.3)

  def latent(self, x_btd: jax.Array) -> jax.Array:
    """[c ; k^R] [B, T, kv_lora_rank + rope]: what the decode cache holds per token."""
    return self._latent_rows(self._down_projections(x_btd)[1])

  def _latent_rows(self, kv_a: jax.Array) -> jax.Array:
    """[norm(c) ; k^R] from the kv down-projection x W^DKV [..., kv_lora_rank + rope]."""
    c = self.kv_a_norm(kv_a[..., :self.kv_lora_rank])
    return jnp.concatenate([c, kv_a[..., self.kv_lora_rank:]], axis=-1)

  def prefill(self, x_btd: jax.Array, segment_ids_bt: jax.Array | None = None):
    """(out [B, T, d] of the training path, latent rows [B, T, kv_lora_rank + rope])."""
    return self(x_btd, segment_ids_bt), self.latent(x_btd)

  def decode_step(self, x_b1d: jax.Array, latent_bsc: jax.Array, pos: jax.Array,
                  allowed_bs: jax.Array):
    """One new token per row attending over the latent cache with absorbed weights.

    x_b1d [B, 1, d]; latent_bsc [B, S, kv_lora_rank + rope] (rows before `pos` filled); pos the
    slot of this token; allowed_bs [B, S] bool: the cache slots the token may attend to (its
    own slot included). Returns (out [B, 1, d], the cache with this token's row at `pos`).
    """
    f32, hp = jnp.float32, jax.lax.Precision.HIGHEST
    q_a, kv_a = self._down_projections(x_b1d)                               # one GEMM for both
    row = self._latent_rows(kv_a).astype(latent_bsc.dtype)                  # [B, 1, C + R]
    latent_bsc = jax.lax.dynamic_update_slice_in_dim(latent_bsc, row, pos, axis=1)
    q = self.q_b_proj(self.q_a_norm(q_a))[:, 0].astype(f32)                # [B, H, n + r]
    q_c, q_r = q[..., :self.nope], q[..., self.nope:]
    w_kvb = self.kv_b_proj.kernel[...].astype(self.dtype).astype(f32)       # [C, H, n + v]
    w_uk, w_uv = w_kvb[..., :self.nope], w_kvb[..., self.nope:]
    cache = latent_bsc.astype(f32)
    c_bsc, kr_bsr = cache[..., :self.kv_lora_rank], cache[..., self.kv_lora_rank:]
    q_lat = jnp.einsum("bhn,chn->bhc", q_c, w_uk, precision=hp)            # W^UK folded into q
    scores = (jnp.einsum("bhc,bsc->bhs", q_lat, c_bsc, precision=hp)
              + jnp.einsum("bhr,bsr->bhs", q_r, kr_bsr, precision=hp)) * self.scale
    scores = jnp.where(allowed_bs[:, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    a_lat = jnp.einsum("bhs,bsc->bhc", probs, c_bsc, precision=hp)         # [B, H, C]
    out = jnp.einsum("bhc,chv->bhv", a_lat, w_uv, precision=hp)[:, None]    # W^UV after attention
    if self.output_gate:
      out = out * jax.nn.sigmoid(self.g_proj(x_b1d).astype(f32))
    return self.o_proj(out.astype(self.dtype)), latent_bsc
