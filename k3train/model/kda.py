"""Kimi Delta Attention layer (docs/maths.md §1): projections, short conv, gates, delta-rule op, gated output norm.

The recurrence itself lives in `pallas_kernels.kda.kda` (reference / chunked JAX / Pallas backends);
this module computes its inputs and post-processes its output.

Generation (docs/maths.md §1.5) uses two more entry points with a per-layer cache
{"state": S [B, H, K, V] fp32, "conv": the last W−1 pre-convolution inputs [B, W−1, 3, H, K]
(q, k, v branches)}: `prefill` (the training forward plus the cache it leaves) and
`decode_step` (one token: the causal conv from the cached inputs, then one step of the
recurrence). A token that starts a new document zeroes both before it is processed.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from pallas_kernels import short_conv
from pallas_kernels.kda import kda as kda_op, kda_decode_step

from k3train.parallel import axes as ax
from k3train.parallel.rules import constrain
from k3train.model import layers
from k3train.model import remat
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


def causal_conv(x_bthk: jax.Array, w_whk: jax.Array, segment_ids_bt: jax.Array | None,
                backend: str = "xla") -> jax.Array:
  """Depthwise causal conv: y_t = Σ_j w[j] · x_{t-W+1+j}, zero before the sequence or document start.

  w[W-1] multiplies the current token (PyTorch cross-correlation with left padding W-1). Inputs
  from an earlier document (different segment id) are treated as zeros, so the conv history
  resets at every document start. The taps are summed in fp32 and the result rounded once to x's
  dtype; the weight gradient, a sum over every token, is an fp32 sum as well (in bf16 it would
  round its partial sums to 8 bits). `backend`: pallas_kernels.short_conv's.
  """
  return short_conv.causal_conv(x_bthk, w_whk, segment_ids_bt, backend=backend)


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
    self.conv_backend = cfg.get("conv_backend", "auto")
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

  def _conv(self, x_bthk: jax.Array, w_whk: jax.Array, segment_ids_bt: jax.Array | None):
    return causal_conv(x_bthk, w_whk, segment_ids_bt, backend=self.conv_backend)

  def _project_qkv(self, x_btd: jax.Array) -> jax.Array:
    """The pre-convolution q, k, v projections as one [B, T, 3, H, K] array (the branch axis
    third): one GEMM over the three kernels stacked as [d, 3, H, K], so the backward pass makes
    x's gradient of all three in one fp32-accumulated GEMM instead of three rounded ones and
    their sum. Each column is the same dot product as its own projection's."""
    w_d3hk = jnp.stack([self.q_proj.kernel[...], self.k_proj.kernel[...],
                        self.v_proj.kernel[...]], axis=1)
    return layers.project(x_btd, w_d3hk, 1, self.q_proj.dtype)

  def _conv_weights(self) -> jax.Array:
    """The q, k, v conv taps stacked as [W, 3, H, K], matching `_project_qkv`'s branch axis."""
    return jnp.stack([self.q_conv[...], self.k_conv[...], self.v_conv[...]], axis=1)

  @jax.named_scope("kda")
  def __call__(self, x_btd: jax.Array, segment_ids_bt: jax.Array | None = None) -> jax.Array:
    act = (ax.BATCH, ax.SEQ, ax.HEADS, ax.HEAD_DIM)
    # The three branches' convs as one depthwise conv over [B, T, 3, H, K] (one kernel launch
    # each way; the taps never mix branches).
    pre = constrain(self._project_qkv(x_btd), ax.BATCH, ax.SEQ, None, ax.HEADS, ax.HEAD_DIM)
    y = seq_parallel.causal_conv(pre, self._conv_weights(), segment_ids_bt, self._conv)
    # q and k normalised as slices of their own (one pass over all three branches, v passed
    # through, ran 10 % slower per update: benchmarks/train_step.md, 2026-12-06).
    y = jax.nn.silu(remat.tag(y, remat.KDA_CONV))
    q, k, v = (constrain(y[:, :, i], *act) for i in range(3))
    q, k = l2_normalize(q), l2_normalize(k)
    beta = jax.nn.sigmoid(self.b_proj(x_btd).astype(jnp.float32))                  # [B, T, H]
    z = self.f_b_proj(self.f_a_proj(x_btd)).astype(jnp.float32) + self.dt_bias[...]
    g = lower_bound_gate(z, self.A_log[...], self.lower_bound)                      # [B, T, H, K]
    o = seq_parallel.kda(q.astype(self.dtype), k.astype(self.dtype), v, g, beta, segment_ids_bt,
                         chunk_size=self.chunk_size, backend=self.backend)
    o = self.o_norm(o.astype(jnp.float32)) * jax.nn.sigmoid(self.g_proj(x_btd).astype(jnp.float32))
    o = constrain(o.astype(self.dtype), *act)
    return self.o_proj(o)

  # ------------------------------------------------------------------ generation (§1.5)

  def _gates(self, x_btd: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(β [B, T, H], g [B, T, H, K]) in fp32, as in `__call__`."""
    beta = jax.nn.sigmoid(self.b_proj(x_btd).astype(jnp.float32))
    z = self.f_b_proj(self.f_a_proj(x_btd)).astype(jnp.float32) + self.dt_bias[...]
    return beta, lower_bound_gate(z, self.A_log[...], self.lower_bound)

  def _output(self, o_bthv: jax.Array, x_btd: jax.Array) -> jax.Array:
    o = self.o_norm(o_bthv.astype(jnp.float32)) * jax.nn.sigmoid(self.g_proj(x_btd).astype(jnp.float32))
    return self.o_proj(o.astype(self.dtype))

  def prefill(self, x_btd: jax.Array, segment_ids_bt: jax.Array | None = None):
    """(out [B, T, d], cache): `__call__`'s numbers on one device, plus the decode cache.

    The cache's conv history holds the last W−1 pre-conv inputs of the last token's document
    (zeros where an earlier document or the sequence start lies), the state is the recurrence's
    final state (reset at every document start, so it belongs to the last document).
    """
    pre = self._project_qkv(x_btd)                                            # [B, T, 3, H, K]
    y = self._conv(pre, self._conv_weights(), segment_ids_bt)
    y = jax.nn.silu(y)
    q, k = l2_normalize(y[:, :, 0]), l2_normalize(y[:, :, 1])
    beta, g = self._gates(x_btd)
    o, state = kda_op(q.astype(self.dtype), k.astype(self.dtype), y[:, :, 2], g, beta,
                      segment_ids=segment_ids_bt, chunk_size=self.chunk_size, backend=self.backend,
                      output_final_state=True)
    return self._output(o, x_btd), {"state": state, "conv": _conv_history(pre, segment_ids_bt,
                                                                          self.q_conv.shape[0])}

  def decode_step(self, x_b1d: jax.Array, cache: dict, reset_b: jax.Array):
    """One token per row: x_b1d [B, 1, d] → (out [B, 1, d], new cache).

    reset_b [B] bool: the token starts a new document (state and conv history restart at zero).
    """
    reset = reset_b.astype(bool)
    hist = jnp.where(reset[:, None, None, None, None], 0, cache["conv"])       # [B, W-1, 3, H, K]
    x_t = self._project_qkv(x_b1d)[:, 0]                                   # [B, 3, H, K]
    w32 = self._conv_weights().astype(jnp.float32)                          # [W, 3, H, K]
    width = w32.shape[0]
    # Same terms in the same order and precision as `causal_conv` (the current tap first).
    y = x_t.astype(jnp.float32) * w32[width - 1]
    for shift in range(1, width):
      y = y + hist[:, width - 1 - shift].astype(x_t.dtype).astype(jnp.float32) * w32[width - 1 - shift]
    y = jax.nn.silu(y.astype(x_t.dtype))
    q, k = l2_normalize(y[:, 0]), l2_normalize(y[:, 1])
    beta, g = self._gates(x_b1d)
    state = jnp.where(reset[:, None, None, None], 0.0, cache["state"])
    o, state = kda_decode_step(q.astype(self.dtype), k.astype(self.dtype), y[:, 2], g[:, 0],
                               beta[:, 0], state)
    new_in = x_t[:, None].astype(hist.dtype)                                # [B, 1, 3, H, K]
    hist = jnp.concatenate([hist[:, 1:], new_in], axis=1) if width > 1 else hist
    return self._output(o[:, None], x_b1d), {"state": state, "conv": hist}

  def empty_cache(self, batch: int, dtype) -> dict:
    """A cache for `batch` rows before any token (zero state and history)."""
    h, k = self.num_heads, self.head_dim
    width = self.q_conv.shape[0]
    return {"state": jnp.zeros((batch, h, k, k), jnp.float32),
            "conv": jnp.zeros((batch, width - 1, 3, h, k), dtype)}


def _conv_history(x: jax.Array, segment_ids_bt: jax.Array | None, width: int) -> jax.Array:
  """The last W−1 pre-conv inputs of q, k, v [B, W−1, 3, H, K] (from x [B, T, 3, H, K]), zero
  outside the last document."""
  b, t = x.shape[:2]
  keep = width - 1
  if keep == 0:
    return x[:, :0]
  if segment_ids_bt is not None:
    same = segment_ids_bt == segment_ids_bt[:, -1:]
    x = jnp.where(same[:, :, None, None, None], x, 0)
  if t < keep:
    x = jnp.pad(x, ((0, 0), (keep - t, 0), (0, 0), (0, 0), (0, 0)))
  return x[:, -keep:]
