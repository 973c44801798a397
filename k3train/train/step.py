"""Train state and the jitted train step: loss, gradients, optimizer update, QB bias update.

The model is split once into (graphdef, params, rest): `params` are the nnx.Param leaves the
optimizer trains; `rest` holds non-gradient state (router biases, QB proposals, expert loads,
MLA max logits) that the forward pass writes and the step carries.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from k3train.model import moe
from k3train.model.mla import MaxLogit
from k3train.optim.qk_clip import qk_clip


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
  step: jax.Array          # int32 scalar: steps taken (updates applied or skipped)
  params: Any              # nnx.State of nnx.Param
  rest: Any                # nnx.State of all other model variables
  opt_state: Any
  loss_ema: jax.Array      # fp32 running mean of the loss, for the loss-spike guard (0 = unset)
  skipped: jax.Array       # int32 number of updates the loss-spike guard skipped


def init_state(model: nnx.Module, optimizer: optax.GradientTransformation):
  """(graphdef, TrainState) for a freshly initialised model."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  # Distinct buffers for every scalar: the jitted step donates the whole state.
  return graphdef, TrainState(jnp.zeros((), jnp.int32), params, rest, optimizer.init(params),
                              jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))


def cross_entropy(logits_btv: jax.Array, targets_bt: jax.Array, mask_bt: jax.Array):
  """Mean next-token cross-entropy over mask, in fp32; returns (loss, number of counted tokens)."""
  logits = logits_btv.astype(jnp.float32)
  logz = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, targets_bt[..., None], axis=-1)[..., 0]
  mask = mask_bt.astype(jnp.float32)
  n = jnp.sum(mask)
  return jnp.sum((logz - target_logit) * mask) / jnp.maximum(n, 1.0), n


def _collect(rest, variable_type):
  """All leaves of one variable type in `rest`, flattened to a list of arrays."""
  return jax.tree.leaves(rest.filter(variable_type))


def forward_loss(graphdef, params, rest, batch):
  """Loss and the updated non-parameter state for one batch."""
  model = nnx.merge(graphdef, params, rest, copy=True)  # fresh Variables at this trace level
  token_mask = (batch["segment_ids"] > 0).astype(jnp.float32)
  logits = model(batch["tokens"], batch["segment_ids"], token_mask)
  loss, n_tokens = cross_entropy(logits, batch["targets"], batch["loss_mask"])
  _, _, new_rest = nnx.split(model, nnx.Param, ...)
  return loss, (new_rest, n_tokens)


def spike_guard(loss, loss_ema, *, factor: float, decay: float):
  """(skip, new_ema): skip when loss > factor × running mean (never on the first step, never when
  factor is 0); the mean only absorbs losses of updates that were applied."""
  first = loss_ema == 0
  skip = jnp.logical_and(jnp.logical_not(first), loss > factor * loss_ema) if factor > 0 else jnp.bool_(False)
  blended = jnp.where(first, loss, decay * loss_ema + (1 - decay) * loss)
  return skip, jnp.where(skip, loss_ema, blended)


def make_train_step(graphdef, optimizer: optax.GradientTransformation, *, loss_spike_factor: float = 0.0,
                    loss_spike_ema: float = 0.99, qk_clip_tau: float | None = None,
                    mla_nope_dim: int | None = None):
  """train_step(state, batch) -> (state, metrics); jit it with explicit shardings at the call site.

  After the optimizer update: QK-Clip on MLA heads whose max logit of this batch exceeded
  `qk_clip_tau` (None: off), the Quantile-Balancing router-bias update, and the loss-spike guard.
  """

  def train_step(state: TrainState, batch: dict):
    grad_fn = jax.value_and_grad(forward_loss, argnums=1, has_aux=True)
    (loss, (rest, n_tokens)), grads = grad_fn(graphdef, state.params, state.rest, batch)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    clip_stats = {}
    if qk_clip_tau is not None:
      params, clip_stats = qk_clip(params, rest, tau=qk_clip_tau, nope=mla_nope_dim)
    rest = moe.qb_bias_update(rest)
    skip, loss_ema = spike_guard(loss, state.loss_ema, factor=loss_spike_factor, decay=loss_spike_ema)
    if loss_spike_factor > 0:  # a skipped step keeps parameters, optimizer state and router biases
      keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(skip, o, n), new, old)
      params, opt_state, rest = keep(params, state.params), keep(opt_state, state.opt_state), keep(rest, state.rest)
    metrics = {"loss": loss, "grad_norm": optax.global_norm(grads), "tokens": n_tokens,
               "skipped_update": skip.astype(jnp.float32), **clip_stats}
    loads = _collect(rest, moe.ExpertLoad)
    if loads:
      load_le = jnp.concatenate([l.reshape(-1, l.shape[-1]) for l in loads])  # [MoE layers, E]
      mean = jnp.maximum(jnp.mean(load_le, axis=-1, keepdims=True), 1e-9)
      metrics["moe_max_load"] = jnp.max(load_le / mean)  # worst layer's max/mean expert load
    logits_max = _collect(rest, MaxLogit)
    if logits_max:
      metrics["mla_max_logit"] = jnp.max(jnp.concatenate([x.reshape(-1) for x in logits_max]))
    skipped = state.skipped + skip.astype(jnp.int32)
    return TrainState(state.step + 1, params, rest, opt_state, loss_ema, skipped), metrics

  return train_step
