"""Kimi Delta Attention layer (docs/maths.md §1): projections, short conv, gates, delta-rule op, gated output norm.

The recurrence itself lives in `pallas_kernels.kda.kda` (reference / chunked JAX / Pallas backends);
this module computes its inputs and post-processes its output.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from k3train.parallel import axes as ax
from k3train.parallel.rules import constrain
from k3train.model import layers
from k3train.parallel import sequence as seq_parallel

L2_EPS = 1e-6


def l2_normalize(x: jax.Array, eps: float = L2_EPS) -> jax.Array:
  """x / sqrt(Σx² + eps) over the last axis, in fp32 (FLA's l2norm)."""
  x32 = x.astype(jnp.float32)
  return x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)


def lower_bound_gate(z: jax.Array, a_log: jax.Array, lower_bound: float) -> jax.Array:
  """g = lb · σ(exp(A_log) · z) ∈ (lb, 0): K3's lower-bounded log-decay (docs/maths.md §1.2 step 5), fp32.

  z: [..., H, K]; a_log: [H].
  """
  rate = jnp.exp(a_log.astype(jnp.float32))[:, None]
  return lower_bound * jax.nn.sigmoid(rate * z.astype(jnp.float32))


def causal_conv(x_bthk: jax.Array, w_whk: jax.Array, segment_ids_bt: jax.Array | None) -> jax.Array:
  """Depthwise causal conv: y_t = Σ_j w[j] · x_{t-W+1+j}, zero before the sequence or document start.

  w[W-1] multiplies the current token (PyTorch cross-correlation with left padding W-1). Inputs
  from an earlier document (different segment id) are treated as zeros, so the conv history
  resets at every document start.
  """
  width = w_whk.shape[0]
  t = x_bthk.shape[1]
  y = x_bthk * w_whk[width - 1].astype(x_bthk.dtype)
  for shift in range(1, width):
    if shift >= t:
      break
    x_shift = jnp.pad(x_bthk, ((0, 0), (shift, 0), (0, 0), (0, 0)))[:, :t]
    if segment_ids_bt is not None:
      seg_shift = jnp.pad(segment_ids_bt, ((0, 0), (shift, 0)), constant_values=-1)[:, :t]
      same = (seg_shift == segment_ids_bt)[:, :, None, None]
      x_shift = jnp.where(same, x_shift, 0)
    y = y + x_shift * w_whk[width - 1 - shift].astype(x_bthk.dtype)
  return y


def _dt_bias_init(key, shape, dtype):
  """softplus⁻¹(dt), dt log-uniform in [1e-3, 1e-1] clamped ≥ 1e-4 (FLA / Mamba safe-gate init)."""
  log_dt = jax.random.uniform(key, shape, jnp.float32, math.log(1e-3), math.log(1e-1))
  dt = jnp.maximum(jnp.exp(log_dt), 1e-4)
  return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)


class KimiDeltaAttention(nnx.Module):
  """One KDA mixer. Input and output [B, T, d]."""

  def __init__(self, cfg: ml_collections.ConfigDict, *, d_model: int, init_std: float, norm_eps: float,
               dtype, param_dtype, rngs: nnx.Rngs):
    h, k = cfg.num_heads, cfg.head_dim
    self.num_heads, self.head_dim = h, k
    self.lower_bound = cfg.gate_lower_bound
    self.chunk_size = cfg.chunk_size
    self.backend = cfg.backend
    self.norm_eps = norm_eps
    self.dtype = dtype
    kw = dict(std=init_std, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    head_axes = (ax.EMBED, ax.HEADS, ax.HEAD_DIM)
    self.q_proj = layers.Linear((d_model,), (h, k), head_axes, **kw)
    self.k_proj = layers.Linear((d_model,), (h, k), head_axes, **kw)
    self.v_proj = layers.Linear((d_model,), (h, k), head_axes, **kw)
    bound = 1.0 / math.sqrt(cfg.conv_size)
    conv_init = nnx.initializers.uniform(scale=2 * bound)
    conv_axes = (ax.CONV, ax.HEADS, ax.HEAD_DIM)
    shifted = lambda key, shape, dt: conv_init(key, shape, dt) - bound  # U(-1/√W, 1/√W)
    self.q_conv = layers.param(rngs, shifted, (cfg.conv_size, h, k), conv_axes, param_dtype)
    self.k_conv = layers.param(rngs, shifted, (cfg.conv_size, h, k), conv_axes, param_dtype)
    self.v_conv = layers.param(rngs, shifted, (cfg.conv_size, h, k), conv_axes, param_dtype)
    self.f_a_proj = layers.Linear((d_model,), (k,), (ax.EMBED, ax.KDA_GATE_RANK), **kw)
    self.f_b_proj = layers.Linear((k,), (h, k), (ax.KDA_GATE_RANK, ax.HEADS, ax.HEAD_DIM), **kw)
    self.A_log = layers.param(rngs, nnx.initializers.zeros, (h,), (ax.HEADS,), jnp.float32)
    self.dt_bias = layers.param(rngs, _dt_bias_init, (h, k), (ax.HEADS, ax.HEAD_DIM), jnp.float32)
    self.b_proj = layers.Linear((d_model,), (h,), (ax.EMBED, ax.HEADS), **kw)
    self.g_proj = layers.Linear((d_model,), (h, k), head_axes, **kw)
    self.o_norm = layers.RMSNorm(k, eps=norm_eps, name=ax.HEAD_DIM, param_dtype=param_dtype, rngs=rngs)
    self.o_proj = layers.Linear((h, k), (d_model,), (ax.HEADS, ax.HEAD_DIM, ax.EMBED), **kw)

  def __call__(self, x_btd: jax.Array, segment_ids_bt: jax.Array | None = None) -> jax.Array:
    act = (ax.BATCH, ax.SEQ, ax.HEADS, ax.HEAD_DIM)
    def branch(proj, conv):
      y = seq_parallel.causal_conv(proj(x_btd), conv[...], segment_ids_bt, causal_conv)
      return constrain(jax.nn.silu(y), *act)
    q = l2_normalize(branch(self.q_proj, self.q_conv))
    k = l2_normalize(branch(self.k_proj, self.k_conv))
    v = branch(self.v_proj, self.v_conv)
    beta = jax.nn.sigmoid(self.b_proj(x_btd).astype(jnp.float32))                  # [B, T, H]
    z = self.f_b_proj(self.f_a_proj(x_btd)).astype(jnp.float32) + self.dt_bias[...]
    g = lower_bound_gate(z, self.A_log[...], self.lower_bound)                      # [B, T, H, K]
    o = seq_parallel.kda(q.astype(self.dtype), k.astype(self.dtype), v, g, beta, segment_ids_bt,
                         chunk_size=self.chunk_size, backend=self.backend)
    o = self.o_norm(o.astype(jnp.float32)) * jax.nn.sigmoid(self.g_proj(x_btd).astype(jnp.float32))
    o = constrain(o.astype(self.dtype), *act)
    return self.o_proj(o)
