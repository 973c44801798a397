"""The run builder: one place that turns a validated config into everything a run needs.

    run = builder.build(cfg)              # layout, sharded model state, optimizer, jitted step
    state, metrics = run.step(run.state, run.layout.global_batch(host_batch))

    shapes = builder.abstract_state(cfg)   # parameter / variable / optimizer-state shapes only

The train loop, the tools (parameter count, memory plan) and the benchmarks all build through
here, so they measure and plan the step that training runs. The config must already be
validated (`k3train.config.validate`, done once by each entry point).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx

from k3train import config as config_lib
from k3train.model import counting
from k3train.model.decoder import abstract_model
from k3train.optim.optimizer import make_optimizer
from k3train.train import layout as layout_lib
from k3train.train import metrics as metrics_lib
from k3train.train.step import StepPhases, TrainState, make_train_step, mtp_metrics


@dataclasses.dataclass
class ModelSize:
  """Parameter counts and the training FLOPs per token at the config's sequence length."""
  total_params: int
  active_params: int
  components: dict
  flops_per_token: float


def model_size(cfg: ml_collections.ConfigDict) -> ModelSize:
  counts = counting.count(cfg)
  embedding = counts["components"].get("embedding", {}).get("params", 0)
  flops = metrics_lib.train_flops_per_token(cfg, counts["active_params"], embedding, cfg.data.seq_len)
  return ModelSize(counts["total_params"], counts["active_params"], counts["components"], flops)


@dataclasses.dataclass
class AbstractState:
  """Shapes of parameters, other model variables and optimizer state (no arrays)."""
  params: Any          # nnx.State of ShapeDtypeStructs
  rest: Any            # nnx.State (router bias, QB, loads, max logits)
  opt: Any             # optax state pytree of ShapeDtypeStructs


def abstract_state(cfg: ml_collections.ConfigDict) -> AbstractState:
  """The run's state as shapes: the real model and optimizer under `eval_shape`."""
  _, params, rest = nnx.split(abstract_model(cfg.model), nnx.Param, ...)
  optimizer = make_optimizer(cfg, params)
  return AbstractState(params, rest, jax.eval_shape(optimizer.init, params))


def restore_target(cfg: ml_collections.ConfigDict, layout: layout_lib.Layout):
  """(graphdef, the run's TrainState as ShapeDtypeStructs, TrainState of shardings) on `layout`:
  what a checkpoint restores into when nothing needs initialising (evaluation, export)."""
  import jax.numpy as jnp
  from k3train.parallel import state_sharding
  graphdef, params, rest = nnx.split(abstract_model(cfg.model), nnx.Param, ...)
  opt = jax.eval_shape(make_optimizer(cfg, params).init, params)
  p_sh = state_sharding.nnx_state_shardings(params, layout.rules, layout.mesh)
  r_sh = state_sharding.nnx_state_shardings(rest, layout.rules, layout.mesh)
  o_sh = state_sharding.mirror_shardings(opt, params, p_sh, layout.mesh)
  rep = layout.replicated
  shardings = TrainState(rep, p_sh, r_sh, o_sh, rep, rep)
  scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype)
  like = TrainState(scalar(jnp.int32), params, rest, opt, scalar(jnp.float32), scalar(jnp.int32))
  sds = lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh)
  return graphdef, jax.tree.map(sds, like, shardings), shardings


def train_step_fn(cfg: ml_collections.ConfigDict, graphdef, optimizer: optax.GradientTransformation
                  ) -> StepPhases:
  """The un-jitted train step (its two phases; called, the whole step) with the config's
  optimizer-side settings; with model.mtp on its metrics also hold "mtp_loss" and "mtp_tokens"."""
  o = cfg.optim
  step = make_train_step(graphdef, optimizer, loss_spike_factor=o.loss_spike_factor,
                         loss_spike_ema=o.loss_spike_ema,
                         qk_clip_tau=o.qk_clip_tau if o.qk_clip else None,
                         mla_nope_dim=cfg.model.mla.qk_nope_head_dim,
                         microbatches=cfg.train.microbatches, quant=cfg.model.quant,
                         loss_chunk_tokens=cfg.train.loss_chunk_tokens,
                         compute_dtype=jnp.dtype(cfg.model.dtype))
  return step.with_update(with_mtp_metrics) if cfg.model.mtp.enabled else step


def with_mtp_metrics(train_step: Callable) -> Callable:
  """train_step (or its update phase) whose metrics add the MTP loss per MTP position and the
  positions' number, read from the state the forward wrote (a step the loss-spike guard skipped
  shows the previous step's values, since it keeps the old state)."""
  def step(state: TrainState, inputs):
    new_state, metrics = train_step(state, inputs)
    return new_state, {**metrics, **mtp_metrics(new_state.rest)}
  return step


def jit_train_step(cfg, graphdef, optimizer, layout: layout_lib.Layout, shardings: TrainState):
  """The train step jitted with explicit shardings on `layout` (the state is donated): as a
  gradient program and an update program (`train.split_step`, k3train/train/phased.py) or as
  one program."""
  step = train_step_fn(cfg, graphdef, optimizer)
  return layout.jit_step(step if cfg.train.split_step else step.whole, shardings,
                         compiler_options=config_lib.xla_options(cfg.train.xla_options))


@dataclasses.dataclass
class Run:
  cfg: ml_collections.ConfigDict
  layout: layout_lib.Layout
  optimizer: optax.GradientTransformation
  graphdef: Any
  state: TrainState
  shardings: TrainState
  step: Callable            # jitted (state, batch) -> (state, metrics); donates state (phased.py)


def build(cfg: ml_collections.ConfigDict, *, devices=None, log: Callable[[str], None] | None = None) -> Run:
  """Mesh and rules from cfg.parallel, the model initialised already sharded, the optimizer, its
  sharded state and the jitted step. Shapes the mesh does not divide fail here, before anything
  is compiled, naming the array, the dimension and the mesh axes."""
  layout = layout_lib.make_layout(cfg, devices)
  model = layout_lib.build_sharded_model(cfg, layout)
  params_like = nnx.state(model, nnx.Param)
  optimizer = make_optimizer(cfg, params_like)
  if log is not None and cfg.optim.optimizer == "muon":
    from k3train.optim import muon
    log("optimizer partition:\n" + muon.format_partition(muon.partition_summary(params_like)))
  graphdef, state, shardings = layout_lib.init_sharded_state(model, optimizer, layout)
  del model
  step = jit_train_step(cfg, graphdef, optimizer, layout, shardings)
  return Run(cfg, layout, optimizer, graphdef, state, shardings, step)


__all__ = ["AbstractState", "ModelSize", "Run", "abstract_state", "build", "jit_train_step",
           "model_size", "restore_target", "train_step_fn", "with_mtp_metrics"]
