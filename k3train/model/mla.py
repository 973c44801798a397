"""Gated NoPE multi-head latent attention (docs/maths.md §2), training / prefill path.

No rotary embedding anywhere: the 64-dim "rope" slot of q and the shared key k^R are used
unrotated, and the softmax scale counts them (1/sqrt(d_nope + d_rope)). A sigmoid gate on the
concatenated head outputs precedes o_proj. Attention never crosses documents (segment ids).
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

  def project_qkv(self, x_btd: jax.Array):
    """Returns q_c [B,T,H,nope], q_r [B,T,H,rope], k_c [B,T,H,nope], k_r [B,T,rope], v [B,T,H,v]."""
    q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x_btd)))
    q_c, q_r = q[..., :self.nope], q[..., self.nope:]
    kv_a = self.kv_a_proj(x_btd)
    c = self.kv_a_norm(kv_a[..., :self.kv_lora_rank])   # the 512-wide latent (cached at decode)
    k_r = kv_a[..., self.kv_lora_rank:]                   # shared by all heads, never rotated
    kv = self.kv_b_proj(c)
    k_c, v = kv[..., :self.nope], kv[..., self.nope:]
    return q_c, q_r, k_c, k_r, v

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
