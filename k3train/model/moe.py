"""K3 Stable LatentMoE: sigmoid router with a Quantile-Balancing bias, latent routed experts.

    s, idx, w = Router(x)                        full-width x, fp32 (docs/maths.md §5.1)
    x_ℓ       = x W_down                         d → ℓ before dispatch (§5.5)
    r         = Σ_{i∈idx} w_i E_i(x_ℓ)           SiTU-GLU experts in width ℓ, sort + gmm, dropless
    y         = RMSNorm(r) W_up + Shared(x)      "stable": norm before the up-projection

Expert balance comes from the router bias b (`RouterBias`), which only chooses experts. It is not
an `nnx.Param`, so neither `nnx.grad` nor the optimiser sees it. Each forward pass writes the
bias that Quantile Balancing (§5.3) proposes for the next step into `QBPending`; the train step
copies it into the bias with `qb_bias_update` (on split states) or `apply_quantile_balancing`
(on a module).

State paths (the convention `qb_bias_update` relies on), for a StableLatentMoE at module path P:

    P/router/bias    RouterBias   [E]   (checkpoint name: e_score_correction_bias)
    P/qb_pending     QBPending    [E]
    P/qb_mean_score  QBMeanScore  [E]   (only with moe.qb_mean_correction)
    P/expert_load    ExpertLoad   [E]

Stacked (scanned) layers add a leading layer axis to all of them; the update is elementwise per
layer, so it is the same for them.

Training routing (docs/maths.md §5.3, "QB under a moving router"): QB's proposal is computed from
one batch's scores but would route the next batch, after an optimiser step has moved the router
and every layer below it. When that moves an expert's mean score by more than the spread of
scores between tokens, the stored proposal is stale and the load collapses onto a few experts.
Inside a `qb_training_routing()` block (the train step opens one) each layer therefore routes
with `qb_rounds` QB rounds applied to the batch's own scores, starting from the stored bias
(optionally first moved by each expert's mean-score change since the proposal's batch,
`qb_mean_correction`, which records the batch's means). The next proposal is one more round
from the bias the batch routed with. Outside the block (evaluation, decoding, export) the bias
is used as stored.

MX quantisation-aware training (docs/maths.md §7.5, `model.quant`): the routed-expert weights
P/experts/{gate,up,down} are fake-quantised along their input dimension (axis −2, stacked or
not) once per step by `fake_quant_expert_weights` (the train step's hook), and inside an
`expert_quantization` block the expert GEMMs quantise their input activations along the
contraction dimension; everything else in the layer stays in the model dtype. With
`gemm="mx"` the GEMMs read MX encodings through `pallas_kernels.moe.gmm_mx`. Whether a step is
quantised is a traced boolean (from the step counter), so turning QAT on never retraces.
`export_routed_experts` writes the experts as MXFP4 in the release byte layout.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from k3train.parallel import axes as ax
from k3train.model import expert_tail
from k3train.model import remat
from k3train.model.layers import (GluMLP, Linear, RMSNorm, fp32_weight_matmul, normal_init, param,
                                  situ_glu)
from k3train.parallel import expert as expert_parallel
from k3train.quant import mx
from pallas_kernels import moe as moe_ops
from pallas_kernels import qb as qb_kernels
from pallas_kernels.situ_glu import op as situ_glu_op


# ----------------------------------------------------------------------------- variables


class RouterBias(nnx.Variable):
  """The QB expert bias b [E] fp32 (zeros at init). It only picks experts, top_k(s + b), and
  never scales them. It gets no gradients; the train step sets it from `QBPending`."""


class QBPending(nnx.Variable):
  """[E] fp32: the bias QB proposes for the next step, computed from this forward's scores over
  real tokens. It equals the current bias when QB is off, so applying it changes nothing then."""


class QBMeanScore(nnx.Variable):
  """[E] fp32: each expert's mean router score over the real tokens of the batch the QB proposal
  in QBPending was computed from (all zeros before the first training forward: no correction)."""


class ExpertLoad(nnx.Variable):
  """[E] fp32: the number of real (non-padding) tokens routed to each expert in the last
  forward. Used for metrics such as max/mean load."""


def _expert_vector(kind: type[nnx.Variable], num_experts: int) -> nnx.Variable:
  """A zero [E] fp32 variable of the given kind, with the logical axis "experts" attached."""
  return kind(jnp.zeros((num_experts,), jnp.float32), out_sharding=(ax.EXPERTS,),
              eager_sharding=False)


# ----------------------------------------------------------------------------- router


def route(scores_te: jax.Array, bias_e: jax.Array, top_k: int, *, renormalize: bool,
          routed_scaling_factor: float) -> tuple[jax.Array, jax.Array]:
  """Top-k on biased scores, weights from the unbiased scores (docs/maths.md §5.1).

  scores_te [T, E] fp32 sigmoid affinities → (weights_tk fp32, idx_tk int32). With
  `renormalize` (and k > 1, as in DeepSeek-V3) the k weights are divided by their sum + 1e-20,
  then all are multiplied by `routed_scaling_factor`. The bias reaches the output only through
  the integer indices, so it gets no gradient; the stop_gradient makes that explicit.
  """
  biased_te = scores_te + jax.lax.stop_gradient(bias_e.astype(jnp.float32))
  _, idx_tk = jax.lax.top_k(biased_te, top_k)
  idx_tk = remat.tag(idx_tk, remat.ROUTING)
  weights_tk = jnp.take_along_axis(scores_te, idx_tk, axis=-1)
  if renormalize and top_k > 1:
    weights_tk = weights_tk / (jnp.sum(weights_tk, axis=-1, keepdims=True) + 1e-20)
  return weights_tk * routed_scaling_factor, idx_tk.astype(jnp.int32)


class Router(nnx.Module):
  """K3 router: s = σ(x W_r) in fp32, idx = top_k(s + b), w = normalised s[idx] × scale.

  The weight [d, E] has logical axes ("embed", "experts"). The bias is a `RouterBias`, not a
  parameter.
  """

  def __init__(self, d_model: int, num_experts: int, top_k: int, *,
               routed_scaling_factor: float = 1.0, renormalize: bool = True, std: float = 0.02,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    if not 1 <= top_k <= num_experts:
      raise ValueError(f"Router needs 1 <= top_k <= num_experts, got top_k={top_k}, "
                       f"num_experts={num_experts}")
    self.num_experts = num_experts
    self.top_k = top_k
    self.routed_scaling_factor = float(routed_scaling_factor)
    self.renormalize = bool(renormalize)
    self.weight = param(rngs, normal_init(std), (d_model, num_experts), (ax.EMBED, ax.EXPERTS),
                        param_dtype)
    self.bias = _expert_vector(RouterBias, num_experts)

  def scores(self, x_td: jax.Array) -> jax.Array:
    """scores_te = σ(x W_r) in fp32 (full-precision matmul: routing decisions are sensitive).
    A bf16 x runs as three exact bf16 GEMMs (`fp32_weight_matmul`), other dtypes as one fp32
    matmul at full precision."""
    if x_td.dtype == jnp.bfloat16:
      return jax.nn.sigmoid(fp32_weight_matmul(x_td, self.weight.get_value()))
    logits_te = jax.lax.dot_general(
        x_td.astype(jnp.float32), self.weight.get_value().astype(jnp.float32),
        (((x_td.ndim - 1,), (0,)), ((), ())),
        precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return jax.nn.sigmoid(logits_te)

  @jax.named_scope("router")
  def __call__(self, x_td: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x_td [..., d] → (weights_tk fp32, idx_tk int32, scores_te fp32)."""
    scores_te = self.scores(x_td)
    weights_tk, idx_tk = route(scores_te, self.bias.get_value(), self.top_k,
                               renormalize=self.renormalize,
                               routed_scaling_factor=self.routed_scaling_factor)
    return weights_tk, idx_tk, scores_te


# ----------------------------------------------------------------------------- quantile balancing


def quantile_balancing_bias(scores_te: jax.Array, bias_e: jax.Array, token_mask_t: jax.Array,
                            top_k: int, *, bisection_unroll: int | bool | None = None,
                            digit_bits: int | None = None, backend: str = "auto") -> jax.Array:
  """One Quantile-Balancing step (docs/maths.md §5.3), in sigmoid-score space, over real tokens.

      α_t  = (k+1)-th largest over e of (s_te + b_e)     token cutoff with the current bias
      μ_te = s_te − α_t                                  margin
      β̂_e  = (q+1)-th largest over real t of μ_te,  q = ⌊m_real·k / E⌋ clamped to [0, m_real−1]
      b_new = −β̂ − mean(−β̂)

  m_real = number of tokens with token_mask_t true. It is dynamic, so the quantile is a dynamic
  rank among the margins, padding tokens at −inf (last). Adding a constant to s or to b gives the
  same result. With no real tokens the bias is returned unchanged; with top_k == E every expert
  takes every token and the result is zeros. The result is wrapped in stop_gradient.

  The order statistics are exact, equal to sorting bit for bit, by radix selection over the float
  bit patterns (pallas_kernels.qb; `backend`: "auto", "xla" or "pallas_gpu"). On the XLA path
  only [E, 2^digit_bits − 1] counts per round are all-reduced under data sharding, never the
  [T, E] margins; bisection_unroll: how many of its rounds one loop iteration runs (True: all,
  no loop); None for either: the backend's defaults.
  """
  scores_te = jax.lax.stop_gradient(scores_te.astype(jnp.float32))
  bias_e = jax.lax.stop_gradient(bias_e.astype(jnp.float32))
  num_experts = scores_te.shape[-1]
  if top_k >= num_experts:
    return jnp.zeros_like(bias_e)
  real_t = token_mask_t.reshape(scores_te.shape[0]).astype(bool)
  m_real = jnp.sum(real_t, dtype=jnp.int32)
  q = jnp.clip((m_real * top_k) // num_experts, 0, jnp.maximum(m_real - 1, 0))
  beta_e = qb_kernels.margin_quantile(scores_te, bias_e, real_t, top_k, q, backend=backend,
                                      unroll=bisection_unroll, digit_bits=digit_bits)
  new_bias_e = -beta_e
  new_bias_e = new_bias_e - jnp.mean(new_bias_e)
  return jax.lax.stop_gradient(jnp.where(m_real > 0, new_bias_e, bias_e))


def count_expert_load(idx_tk: jax.Array, token_mask_t: jax.Array, num_experts: int) -> jax.Array:
  """load_e [E] fp32: (token, expert) pairs per expert, counting real tokens only."""
  # Integer counting (padding pairs get the id num_experts, which no bin counts), so counts are
  # exact; a reduction, not a scatter-add (moe_ops.count_ids).
  real_tk = jnp.broadcast_to(token_mask_t.reshape(-1, 1).astype(bool), idx_tk.shape)
  idx = jnp.where(real_tk, idx_tk.astype(jnp.int32), num_experts)
  return moe_ops.count_ids(idx, num_experts).astype(jnp.float32)


# ----------------------------------------------------------------------------- MX QAT settings

@dataclasses.dataclass(frozen=True)
class ExpertQuant:
  """Static QAT settings of the routed-expert GEMMs (from `model.quant`, docs/maths.md §7.5).

  weights: MX format of the expert weights (blocks along their input dimension).
  activations: MX format of the GEMM inputs (blocks along the contraction dim), or "none".
  gemm: "fake_quant" (quantise-dequantise, then the plain gmm) or "mx" (`gmm_mx` reads the MX
  encodings: MXFP4 weights and MXFP8 activations only). Both give the same values.
  start_step: the first quantised step (a step is quantised iff state.step >= start_step).
  """
  weights: str = "mxfp4"
  activations: str = "mxfp8"
  scale_rule: str = "floor"
  gemm: str = "fake_quant"
  start_step: int = 0

  def __post_init__(self):
    mx.element_format(self.weights)
    if self.activations != "none":
      mx.element_format(self.activations)
    if self.scale_rule not in mx.SCALE_RULES:
      raise ValueError(f"unknown MX scale rule {self.scale_rule!r}; allowed: {mx.SCALE_RULES}")
    if self.gemm not in ("fake_quant", "mx"):
      raise ValueError(f"ExpertQuant.gemm must be fake_quant or mx, got {self.gemm!r}")
    if self.gemm == "mx" and (self.weights, self.activations) != ("mxfp4", "mxfp8"):
      raise ValueError("ExpertQuant.gemm='mx' reads MXFP4 weights and MXFP8 activations; got "
                       f"weights={self.weights!r}, activations={self.activations!r}")


def expert_quant_from_config(q: Any) -> ExpertQuant | None:
  """`model.quant` → ExpertQuant, or None when QAT is off. gemm "auto" is "mx" on a GPU (with
  MXFP4 weights and MXFP8 activations) and "fake_quant" elsewhere (TPU, CPU)."""
  if not q.enabled:
    return None
  gemm = q.gemm
  if gemm == "auto":
    # The MX kernel reads 4-bit weights but is bound by their in-register decode (4× the bf16
    # gmm's time on an H200: benchmarks/moe_gmm_mx.md), so the fake-quant GEMMs are the default.
    gemm = "fake_quant"
  return ExpertQuant(weights=q.weights, activations=q.activations, scale_rule=q.scale_rule,
                     gemm=gemm, start_step=int(q.start_step))


_EXPERT_QUANT: contextvars.ContextVar = contextvars.ContextVar("k3train_expert_quant",
                                                               default=None)


@contextlib.contextmanager
def expert_quantization(settings: ExpertQuant | None, active=True, *,
                        weights_quantized: bool = False):
  """Within this block (at trace time) every RoutedExperts GEMM is quantised where `active`.

  active: a bool or a traced boolean scalar (the train step passes state.step >= start_step);
  the experts choose between the quantised and the plain GEMMs with `lax.cond`.
  weights_quantized: the expert weights given to the model already hold Q(W) (the train step
  quantises them once per step with `fake_quant_expert_weights`); otherwise each GEMM
  fake-quantises its weight itself (the same values, Q being idempotent). settings None: no-op.
  """
  token = _EXPERT_QUANT.set(None if settings is None
                            else (settings, active, bool(weights_quantized)))
  try:
    yield
  finally:
    _EXPERT_QUANT.reset(token)


_QB_TRAINING: contextvars.ContextVar = contextvars.ContextVar("k3train_qb_training", default=False)


@contextlib.contextmanager
def qb_training_routing():
  """Within this block (at trace time) layers with moe.qb_mean_correction route with the
  mean-corrected QB proposal and record their batch means (the train step opens it around the
  forward / backward); outside it every layer routes with its stored bias."""
  token = _QB_TRAINING.set(True)
  try:
    yield
  finally:
    _QB_TRAINING.reset(token)


# ----------------------------------------------------------------------------- experts


class RoutedExperts(nnx.Module):
  """E SiTU-GLU experts in the latent width ℓ, stored stacked, applied to expert-sorted rows.

  gate/up [E, ℓ, F] with logical axes ("experts", "latent", "expert_mlp"); down [E, F, ℓ] with
  ("experts", "expert_mlp", "latent"). Each of the three matmuls is one grouped matmul
  (`pallas_kernels.moe.gmm`) over rows sorted by expert.
  """

  def __init__(self, num_experts: int, latent_dim: int, hidden: int, *, beta: float,
               linear_beta: float | None, backend: str = "auto", situ_backend: str = "xla",
               std: float = 0.02, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
    moe_ops.resolve_backend(backend)      # fail at construction on a bad name
    situ_glu_op.resolve_backend(situ_backend)
    self.beta = beta
    self.linear_beta = linear_beta
    self.backend = backend
    self.situ_backend = situ_backend
    self.dtype = dtype
    init = normal_init(std)
    in_axes = (ax.EXPERTS, ax.LATENT, ax.EXPERT_MLP)
    self.gate = param(rngs, init, (num_experts, latent_dim, hidden), in_axes, param_dtype)
    self.up = param(rngs, init, (num_experts, latent_dim, hidden), in_axes, param_dtype)
    self.down = param(rngs, init, (num_experts, hidden, latent_dim),
                      (ax.EXPERTS, ax.EXPERT_MLP, ax.LATENT), param_dtype)

  def weights(self) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(gate [E, ℓ, F], up [E, ℓ, F], down [E, F, ℓ]) as arrays (for the expert-parallel op)."""
    return self.gate.get_value(), self.up.get_value(), self.down.get_value()

  @jax.named_scope("moe_gmm")
  def apply(self, x_sorted_ml, group_sizes_e, gate_elf, up_elf, down_efl,
            row_weights_m=None) -> jax.Array:
    """The expert MLP on rows grouped by expert, with explicit (possibly device-local) weights.

    row_weights_m [M] (optional, fp32): each row's routing weight, applied to the SiTU-GLU output
    in fp32 before the down GEMM, so the result rows are already weighted (`combine_scaled`).
    Inside an `expert_quantization` block the GEMMs are MX-quantised where the block is active."""
    quant = _EXPERT_QUANT.get()
    operands = (x_sorted_ml, group_sizes_e, gate_elf, up_elf, down_efl, row_weights_m)
    if quant is None:
      return self._mlp(*operands)
    settings, active, weights_quantized = quant
    quantised = functools.partial(self._mlp, quant=(settings, weights_quantized))
    return jax.lax.cond(active, quantised, self._mlp, *operands)

  def _mlp(self, x_sorted_ml, group_sizes_e, gate_elf, up_elf, down_efl, row_weights_m=None, *,
           quant=None):
    x_ml = x_sorted_ml.astype(self.dtype)
    if quant is None:
      mm = lambda a, w: moe_ops.gmm(a, w.astype(self.dtype), group_sizes_e, backend=self.backend)
    else:
      mm = lambda a, w: self._mx_gmm(a, w, group_sizes_e, *quant)
    gate_mf = remat.tag(mm(x_ml, gate_elf), remat.EXPERT_MLP)
    up_mf = remat.tag(mm(x_ml, up_elf), remat.EXPERT_MLP)
    if quant is None and situ_glu_op.backend_for(gate_mf, self.situ_backend) == "pallas_gpu":
      # The activation's kernels with the down GEMM as one op: its backward writes h beside the
      # activation's gradients, so no forward pass runs again for h (model/expert_tail.py).
      gmm = functools.partial(moe_ops.gmm, backend=self.backend)
      return expert_tail.situ_glu_down(gate_mf, up_mf, row_weights_m, down_efl.astype(self.dtype),
                                       (group_sizes_e,), down=gmm, beta=self.beta,
                                       linear_beta=self.linear_beta, situ_backend="pallas_gpu")
    h_mf = situ_glu(gate_mf, up_mf, self.beta, self.linear_beta, row_weights_m,
                    backend=self.situ_backend)
    return mm(h_mf, down_efl)

  def _mx_gmm(self, a_mk, w_ekn, group_sizes_e, q: ExpertQuant, weights_quantized: bool):
    """gmm(fq(a), fq(w)): a blocked along K (its last axis), w [E, K, N] along K (axis 1)."""
    rule = q.scale_rule
    if q.gemm == "mx":
      codes, scales = mx.quantize(a_mk, q.activations, axis=-1, rule=rule)
      # Re-encoding weights that already hold Q(W) is exact (Q is idempotent, tests/quant).
      packed, w_scales = mx.export_mxfp4(w_ekn, in_axis=1, rule=rule)   # release [E, N, K/2]
      return moe_ops.gmm_mx(a_mk, w_ekn.astype(self.dtype), group_sizes_e, lhs_codes=codes,
                            lhs_scales=mx.scale_bytes(scales), rhs_packed=packed,
                            rhs_scales=w_scales, backend=self.backend)
    if q.activations != "none":
      a_mk = mx.fake_quant(a_mk, q.activations, axis=-1, rule=rule)
    if not weights_quantized:
      w_ekn = mx.fake_quant(w_ekn, q.weights, axis=1, rule=rule)
    return moe_ops.gmm(a_mk, w_ekn.astype(self.dtype), group_sizes_e, backend=self.backend)

  def __call__(self, x_sorted_ml: jax.Array, group_sizes_e: jax.Array) -> jax.Array:
    """x_sorted_ml [M, ℓ] grouped by expert, group_sizes_e [E] → y_sorted_ml [M, ℓ] (dtype)."""
    return self.apply(x_sorted_ml, group_sizes_e, *self.weights())

  def all_experts(self, x_nl: jax.Array) -> jax.Array:
    """Dense: every expert on every token, x_nl [N, ℓ] → y_nel [N, E, ℓ]. For references.

    The products are computed from fp32 copies of the inputs at full precision. This matches
    low-precision inputs multiplied with fp32 accumulation (XLA:CPU has no batched bf16 dot that
    outputs fp32). Results are rounded to `dtype` at the same points as in `__call__`.
    """
    hp = jax.lax.Precision.HIGHEST
    f32 = lambda a: a.astype(self.dtype).astype(jnp.float32)
    x_nl = f32(x_nl)
    gate_nef = jnp.einsum("nl,elf->nef", x_nl, f32(self.gate.get_value()), precision=hp)
    up_nef = jnp.einsum("nl,elf->nef", x_nl, f32(self.up.get_value()), precision=hp)
    h_nef = situ_glu(gate_nef.astype(self.dtype), up_nef.astype(self.dtype), self.beta,
                     self.linear_beta)
    y_nel = jnp.einsum("nef,efl->nel", f32(h_nef), f32(self.down.get_value()), precision=hp)
    return y_nel.astype(self.dtype)


# ----------------------------------------------------------------------------- the MoE layer


class StableLatentMoE(nnx.Module):
  """K3 Stable LatentMoE layer (docs/maths.md §5.5): a router on the full-width token, routed SiTU-GLU
  experts in latent width ℓ with sort-based dropless dispatch, an RMSNorm on the combined latent,
  an up-projection, and shared experts on the full-width input.

  moe_cfg fields: num_experts, top_k, latent_dim, expert_hidden, num_shared_experts,
  shared_hidden (all shared experts together, stored as one GluMLP), routed_scaling_factor,
  renormalize, latent_norm, quantile_balancing, backend (a `pallas_kernels.moe` gmm backend),
  situ_backend (the routed and shared experts' SiTU-GLU, a `pallas_kernels.situ_glu` backend),
  gather_backend (who copies the dispatch's rows, `pallas_kernels.moe.GATHERS`).
  All weights start as N(0, init_std), the norm gain as 1 and the bias as 0.
  """

  def __init__(self, moe_cfg: Any, *, d_model: int, init_std: float, norm_eps: float,
               situ_beta: float, situ_linear_beta: float | None, dtype=jnp.float32,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    num_experts = int(moe_cfg.num_experts)
    latent = int(moe_cfg.latent_dim)
    self.num_experts = num_experts
    self.top_k = int(moe_cfg.top_k)
    self.quantile_balancing = bool(moe_cfg.quantile_balancing)
    self.qb_mean_correction = (self.quantile_balancing
                               and bool(getattr(moe_cfg, "qb_mean_correction", False)))
    self.qb_rounds = int(getattr(moe_cfg, "qb_rounds", 0)) if self.quantile_balancing else 0
    self.qb_training_rule = self.qb_mean_correction or self.qb_rounds > 0
    self.qb_backend = str(getattr(moe_cfg, "qb_backend", "auto"))
    self.gather_backend = str(getattr(moe_cfg, "gather_backend", "xla"))
    if self.gather_backend not in moe_ops.GATHERS:
      raise ValueError(f"model.moe.gather_backend: unknown {self.gather_backend!r}; allowed: "
                       f"{moe_ops.GATHERS}")
    self.dtype = dtype
    lin = dict(std=init_std, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    self.router = Router(d_model, num_experts, self.top_k,
                         routed_scaling_factor=moe_cfg.routed_scaling_factor,
                         renormalize=moe_cfg.renormalize, std=init_std,
                         param_dtype=param_dtype, rngs=rngs)
    self.down_proj = Linear((d_model,), (latent,), (ax.EMBED, ax.LATENT), **lin)
    situ_backend = str(getattr(moe_cfg, "situ_backend", "xla"))
    self.experts = RoutedExperts(num_experts, latent, int(moe_cfg.expert_hidden),
                                 beta=situ_beta, linear_beta=situ_linear_beta,
                                 backend=moe_cfg.backend, situ_backend=situ_backend, **lin)
    self.latent_norm = (RMSNorm(latent, eps=norm_eps, param_dtype=param_dtype, rngs=rngs)
                        if moe_cfg.latent_norm else None)
    self.up_proj = Linear((latent,), (d_model,), (ax.LATENT, ax.EMBED), **lin)
    self.shared = (GluMLP(d_model, int(moe_cfg.shared_hidden), beta=situ_beta,
                          linear_beta=situ_linear_beta, situ_backend=situ_backend, **lin)
                   if int(moe_cfg.num_shared_experts) > 0 else None)
    self.qb_pending = _expert_vector(QBPending, num_experts)
    if self.qb_mean_correction:
      self.qb_mean_score = _expert_vector(QBMeanScore, num_experts)
    self.expert_load = _expert_vector(ExpertLoad, num_experts)

  @jax.named_scope("router_qb")
  def _record_routing_stats(self, scores_te: jax.Array, idx_tk: jax.Array,
                            real_t: jax.Array) -> None:
    """Write expert_load and qb_pending from this forward's routing, over real tokens only."""
    self.expert_load.set_value(
        jax.lax.stop_gradient(count_expert_load(idx_tk, real_t, self.num_experts)))
    bias_e = self.router.bias.get_value()
    if self.quantile_balancing:
      pending_e = quantile_balancing_bias(scores_te, bias_e, real_t, self.top_k,
                                          backend=self.qb_backend)
    else:
      pending_e = bias_e
    self.qb_pending.set_value(jax.lax.stop_gradient(pending_e.astype(jnp.float32)))

  @jax.named_scope("router")
  def _route_training(self, x_nd, real_n):
    """Training routing (docs/maths.md §5.3, "QB under a moving router"): the stored proposal,
    moved by each expert's mean-score change since its batch (qb_mean_correction; this batch's
    means are recorded), then `qb_rounds` QB rounds on this batch's own scores."""
    scores_ne = self.router.scores(x_nd)
    bias_e = self.router.bias.get_value()
    if self.qb_mean_correction:
      real = real_n.astype(jnp.float32)
      mean_e = jax.lax.stop_gradient(jnp.sum(scores_ne * real[:, None], axis=0)
                                     / jnp.maximum(jnp.sum(real), 1.0))
      ref_e = self.qb_mean_score.get_value()
      shift_e = jnp.where(jnp.all(ref_e == 0), 0.0, mean_e - ref_e)   # no reference yet: none
      bias_e = bias_e - (shift_e - jnp.mean(shift_e))
      self.qb_mean_score.set_value(jnp.where(jnp.sum(real) > 0, mean_e, ref_e))
    with jax.named_scope("router_qb"):
      # One copy of the QB round in the compiled step, run qb_rounds times (a short loop).
      bias_e = jax.lax.fori_loop(
          0, self.qb_rounds,
          lambda _, b: quantile_balancing_bias(scores_ne, b, real_n, self.top_k,
                                               backend=self.qb_backend), bias_e)
    self.router.bias.set_value(bias_e)     # the bias this batch routed with (QB's α reads it)
    weights_nk, idx_nk = route(scores_ne, bias_e, self.top_k, renormalize=self.router.renormalize,
                               routed_scaling_factor=self.router.routed_scaling_factor)
    return weights_nk, idx_nk, scores_ne

  @jax.named_scope("moe_proj")
  def _finish(self, r_nl: jax.Array, x_btd: jax.Array) -> jax.Array:
    """Latent combine result r_nl [N, ℓ] → y_btd: norm, up-projection, + shared experts."""
    if self.latent_norm is not None:
      r_nl = self.latent_norm(r_nl)
    y_btd = self.up_proj(r_nl).reshape(x_btd.shape)
    if self.shared is not None:
      y_btd = y_btd + self.shared(x_btd)
    return y_btd.astype(self.dtype)

  def __call__(self, x_btd: jax.Array, token_mask_bt: jax.Array | None = None) -> jax.Array:
    """x_btd [B, T, d], token_mask_bt [B, T] (true = real token; None = all real) → y_btd.

    Padding tokens are still routed and computed (the layer is dropless and shape-static). They
    are left out of expert_load and qb_pending.
    """
    b, t, d = x_btd.shape
    x_nd = x_btd.reshape(b * t, d)
    real_n = (jnp.ones((b * t,), bool) if token_mask_bt is None
              else token_mask_bt.reshape(b * t).astype(bool))

    if self.qb_training_rule and _QB_TRAINING.get():
      weights_nk, idx_nk, scores_ne = self._route_training(x_nd, real_n)
    else:
      weights_nk, idx_nk, scores_ne = self.router(x_nd)
    self._record_routing_stats(scores_ne, idx_nk, real_n)

    with jax.named_scope("moe_proj"):
      x_nl = self.down_proj(x_nd)
    # Dispatch → experts → combine; over the `expert` mesh axis when a layout is active.
    with jax.named_scope("moe_dispatch_combine"):
      r_btl = expert_parallel.routed_experts(
          x_nl.reshape(b, t, -1), weights_nk.reshape(b, t, -1), idx_nk.reshape(b, t, -1),
          num_experts=self.num_experts, expert_fn=self.experts.apply,
          expert_weights=self.experts.weights(), gather=self.gather_backend,
          order_name=remat.ROUTING)
    # Kept under selective remat (a [N, ℓ] row per token): the latent norm's backward reads it,
    # and with the routing weights applied inside the experts nothing else needs the expert
    # outputs, so the down GEMM is not run again.
    r_btl = remat.tag(r_btl, remat.EXPERT_MLP)
    return self._finish(r_btl.reshape(b * t, -1), x_btd)


def moe_dense_reference(moe: StableLatentMoE, x_btd: jax.Array) -> jax.Array:
  """The layer's output computed densely, for tests: r = Σ_e mask_e w_e E_e(x_ℓ) with every
  expert run on every token (mask_e = 1 iff e was selected). Uses moe's parameters and current
  bias. It does not write qb_pending or expert_load."""
  b, t, d = x_btd.shape
  x_nd = x_btd.reshape(b * t, d)
  weights_nk, idx_nk, _ = moe.router(x_nd)
  # gate_ne = w_e where e is among the token's selected experts, 0 elsewhere.
  gate_ne = jnp.sum(jax.nn.one_hot(idx_nk, moe.num_experts, dtype=jnp.float32)
                    * weights_nk[:, :, None], axis=1)
  y_nel = moe.experts.all_experts(moe.down_proj(x_nd))
  r_nl = jnp.einsum("ne,nel->nl", gate_ne, y_nel.astype(jnp.float32),
                    precision=jax.lax.Precision.HIGHEST).astype(y_nel.dtype)
  return moe._finish(r_nl, x_btd)


# ----------------------------------------------------------------------------- applying QB


def qb_bias_update(rest_state: nnx.State) -> nnx.State:
  """Return a copy of `rest_state` in which each RouterBias holds its layer's QBPending value.

  Pure and jit-friendly: only the pytree structure is inspected. For every QBPending leaf at path
  P + (name,), the RouterBias at P + ("router", "bias") is replaced (see the module docstring).
  Works the same for stacked/scanned layers, whose leaves carry a leading layer axis. Other
  leaves are passed through unchanged. It raises KeyError if a QBPending has no RouterBias at the
  expected path, so a state split without the biases fails loudly instead of silently doing
  nothing. With gradient accumulation, call it once per optimiser step, after averaging the
  micro-batches' QBPending values (as Megatron averages β̂) or after the last micro-batch.
  """
  flat = list(nnx.to_flat_state(rest_state))
  by_path = dict(flat)
  new_bias: dict[tuple, nnx.Variable] = {}
  for path, var in flat:
    if not isinstance(var, QBPending):
      continue
    bias_path = tuple(path[:-1]) + ("router", "bias")
    target = by_path.get(bias_path)
    if not isinstance(target, RouterBias):
      raise KeyError(f"qb_bias_update: QBPending at {path} has no RouterBias at {bias_path}")
    pending = var.get_value()
    bias = target.get_value()
    if pending.shape != bias.shape:
      raise ValueError(f"qb_bias_update: QBPending {pending.shape} vs RouterBias {bias.shape} "
                       f"at {bias_path}")
    new_bias[bias_path] = target.replace(pending.astype(bias.dtype))
  return nnx.from_flat_state([(p, new_bias.get(tuple(p), v)) for p, v in flat])


def apply_quantile_balancing(model: nnx.Module) -> None:
  """In place: set every StableLatentMoE's router bias (stacked ones included) to its qb_pending."""
  nnx.update(model, qb_bias_update(nnx.state(model, nnx.Any(RouterBias, QBPending))))


# ----------------------------------------------------------------------------- MX QAT and export

EXPERT_WEIGHTS = ("gate", "up", "down")   # RoutedExperts parameters; input dimension at axis −2


def is_routed_expert_weight(path: tuple) -> bool:
  """True for the state path of a RoutedExperts weight: (..., "experts", gate|up|down)."""
  return len(path) >= 2 and path[-2] == "experts" and path[-1] in EXPERT_WEIGHTS


def fake_quant_expert_weights(params: nnx.State, settings: ExpertQuant, active=True) -> nnx.State:
  """A copy of `params` in which every routed-expert weight holds Q(W) where `active`.

  Q quantises to `settings.weights` along the input dimension (axis −2: [E, in, out], or
  [L, E, in, out] when stacked) and dequantises into the parameter's dtype. The train step calls
  it once per step, before the micro-batches, and differentiates with respect to its result, so
  the update of the fp32 master weights is the straight-through one. `active` may be traced
  (`lax.cond`); other leaves pass through unchanged.
  """
  quantise = lambda ws: [mx.quantize_dequantize(w, settings.weights, axis=-2,
                                                rule=settings.scale_rule) for w in ws]
  return _replace_expert_weights(params, lambda ws: jax.lax.cond(active, quantise, list, ws))


def _replace_expert_weights(params: nnx.State, new_values) -> nnx.State:
  """A copy of `params` whose routed-expert weights are new_values(list of their arrays); other
  leaves are the same arrays. `params` itself when it holds no routed experts."""
  flat = list(nnx.to_flat_state(params))
  chosen = [i for i, (path, _) in enumerate(flat) if is_routed_expert_weight(tuple(path))]
  if not chosen:
    return params
  for i, value in zip(chosen, new_values([flat[i][1].get_value() for i in chosen])):
    path, var = flat[i]
    flat[i] = (path, var.replace(value))
  return nnx.from_flat_state(flat)


def cast_expert_weights(params: nnx.State, dtype) -> nnx.State:
  """A copy of `params` in which every routed-expert weight is cast to `dtype` (the model's
  compute dtype); other leaves are the same arrays.

  Each grouped matmul casts its weight to the compute dtype and writes the weight gradient in
  that dtype, so differentiating with respect to this copy gives the same gradients, bit for
  bit, while the cast runs once per step instead of in every micro-batch's forward, recompute
  and backward. The train step calls it once per step, before the micro-batches.
  """
  return _replace_expert_weights(params, lambda ws: [w.astype(dtype) for w in ws])


def _path_name(path: tuple) -> str:
  return "/".join(str(p) for p in path)


def export_routed_experts(params: nnx.State, *, rule: str = "floor") -> dict[str, dict]:
  """Every routed-expert weight as MXFP4 in the release layout (docs/maths.md §7.4).

  Returns {path: {"weight_packed": uint8 [..., E, out, in/2], "weight_scale": uint8
  [..., E, out, in/32]}} with path like "stack/layers/0/ffn/experts/gate" (stacked layers keep
  their leading layer axis). `import_routed_experts` inverts it; the QAT forward is reproduced
  bit for bit by the imported weights (tests/quant/test_qat.py)."""
  out = {}
  for path, var in nnx.to_flat_state(params):
    if is_routed_expert_weight(tuple(path)):
      packed, scales = mx.export_mxfp4(var.get_value(), in_axis=-2, rule=rule)
      out[_path_name(tuple(path))] = {"weight_packed": packed, "weight_scale": scales}
  return out


def import_routed_experts(params: nnx.State, exported: dict[str, dict]) -> nnx.State:
  """A copy of `params` whose routed-expert weights are the dequantised exported ones (in the
  parameters' dtype); every routed-expert weight must be present in `exported`."""
  flat = []
  for path, var in nnx.to_flat_state(params):
    if is_routed_expert_weight(tuple(path)):
      entry = exported[_path_name(tuple(path))]
      value = mx.import_mxfp4(entry["weight_packed"], entry["weight_scale"], in_axis=-2,
                              dtype=var.get_value().dtype)
      var = var.replace(value)
    flat.append((path, var))
  return nnx.from_flat_state(flat)
