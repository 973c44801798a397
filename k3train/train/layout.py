"""The parallel layout of a run: mesh + rules → sharded model, train state, jitted step, batches.

Everything the train loop (and the multi-device tests) needs to place a run on a mesh:

    layout = make_layout(cfg)                       # mesh and rule table from cfg.parallel
    model = build_sharded_model(cfg, layout)        # parameters created already sharded
    graphdef, state, shardings = init_sharded_state(model, optimizer, layout)
    step = layout.jit_step(step_fn, shardings)      # explicit shardings, state donated
    batch = layout.global_batch(host_batch)          # this process's rows → global arrays

`k3train/train/builder.py` strings these together for a config; this module knows nothing of the
optimizer's settings.

Shapes that the mesh does not divide fail here, before anything is compiled, with a message
naming the array, the dimension and the mesh axes.

With model.vision on, the batch also holds vision_patches [B, P, 588], vision_grids [B, G, 3]
and vision_grid_ids [B, P], sharded by batch row only (a row's patches stay with its tokens'
batch shard); `make_layout` also checks that model.vision.placeholder_id is the <|image_pad|>
id of data.tokenizer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from k3train import config as config_lib
from k3train.data import tokenizer as tokenizer_lib
from k3train.model.decoder import K3Model, abstract_model, build_model
from k3train.model.vision import PATCH_VALUES
from k3train.parallel import mesh as mesh_lib
from k3train.parallel import rules as rules_lib
from k3train.parallel import state_sharding
from k3train.train import phased
from k3train.train.step import StepGradients, StepPhases, TrainState


@dataclasses.dataclass(frozen=True)
class Layout:
  mesh: Mesh
  rules: rules_lib.Rules
  batch: NamedSharding           # every [B, T] batch array
  options: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # parallel-op choices
  vision: Mapping[str, NamedSharding] = dataclasses.field(default_factory=dict)  # vision keys, if on

  def sharding_for(self, key: str) -> NamedSharding:
    """The sharding of batch array `key` (a [B, T] key or a vision key)."""
    return self.vision.get(key, self.batch)

  @property
  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, P())

  def global_batch(self, host_batch: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
    """This process's rows of the global batch → global arrays (`sharding_for` each key)."""
    return {k: jax.make_array_from_process_local_data(self.sharding_for(k), np.asarray(v))
            for k, v in host_batch.items()}

  def activate(self):
    """Context in which model code traces against this mesh and rule table."""
    return rules_lib.activate(self.mesh, self.rules, **self.options)

  def jit_step(self, step_fn, shardings, compiler_options: dict | None = None):
    """`step_fn(state, batch) -> (state, metrics)` jitted with explicit state / batch / metric
    shardings, the state donated. The model is traced inside `activate()`, so its logical
    constraints and the expert- and sequence-parallel ops see the mesh. compiler_options: XLA
    options for this executable only (`config.xla_options`).

    A `StepPhases` step_fn (the train step) becomes a `PhasedStep`: its gradient and update
    phases as two programs that compile side by side (k3train/train/phased.py); any other
    function, one program."""
    def in_mesh(fn, name):   # name: the program's name in XLA's dumps and profiles
      def traced(*args):
        with self.activate():
          return fn(*args)
      traced.__name__ = traced.__qualname__ = name
      return traced

    batch_sh = {**{k: self.batch for k in state_sharding.BATCH_KEYS_2D}, **self.vision}
    options = dict(compiler_options=compiler_options or None)
    if not isinstance(step_fn, StepPhases):
      return jax.jit(in_mesh(step_fn, "sharded_step"), in_shardings=(shardings, batch_sh),
                     out_shardings=(shardings, self.replicated), donate_argnums=0, **options)
    rep = self.replicated
    grads_sh = StepGradients(loss=rep, n_tokens=rep, rest=shardings.rest, grads=shardings.params)
    gradients = jax.jit(in_mesh(phased.passing_state(step_fn.gradients), "sharded_step_gradients"),
                        in_shardings=(shardings, batch_sh), out_shardings=(shardings, grads_sh),
                        donate_argnums=0, **options)
    update = jax.jit(in_mesh(step_fn.update, "sharded_step_update"), in_shardings=(shardings, grads_sh),
                     out_shardings=(shardings, rep), donate_argnums=0, **options)
    return phased.PhasedStep(gradients, update, (shardings, grads_sh))


def make_layout(cfg: ml_collections.ConfigDict, devices=None) -> Layout:
  """Mesh from cfg.parallel over `devices` (default all), the rule table, the batch sharding."""
  sizes = mesh_lib.sizes_from_config(cfg.parallel)
  mesh = mesh_lib.make_mesh(sizes, devices)
  rules = rules_lib.get_rules(cfg.parallel.rules)
  t = cfg.train
  batch = state_sharding.batch_sharding(mesh, rules, t.global_batch_size, cfg.data.seq_len)
  if t.microbatches > 1:   # each micro-batch must still spread over the data axes
    state_sharding.batch_sharding(mesh, rules, t.global_batch_size // t.microbatches,
                                  cfg.data.seq_len,
                                  what="micro-batch [train.global_batch_size / train.microbatches, "
                                       "data.seq_len]")
  vision = {}
  if cfg.model.vision.enabled:
    check_placeholder_id(cfg)
    v = cfg.data.vision
    vision = state_sharding.vision_batch_shardings(mesh, rules, t.global_batch_size,
                                                   v.max_patches_per_row, v.max_grids_per_row,
                                                   PATCH_VALUES)
  return Layout(mesh, rules, batch, {"expert_exchange": cfg.parallel.expert_exchange}, vision)


def check_placeholder_id(cfg: ml_collections.ConfigDict) -> None:
  """model.vision.placeholder_id must be data.tokenizer's <|image_pad|> id (ConfigError if not)."""
  tok = tokenizer_lib.load_tokenizer(cfg.data.tokenizer)
  pad = tok.special_ids[tokenizer_lib.IMAGE_PAD]
  if pad != cfg.model.vision.placeholder_id:
    raise config_lib.ConfigError(
        f"model.vision.placeholder_id: is {cfg.model.vision.placeholder_id} but data.tokenizer "
        f"{cfg.data.tokenizer!r} has {tokenizer_lib.IMAGE_PAD} at id {pad}; set "
        f"--config.model.vision.placeholder_id={pad}")


def model_shardings(cfg: ml_collections.ConfigDict, layout: Layout) -> nnx.State:
  """Shardings of every model variable (from an abstract model: nothing is allocated)."""
  abstract = abstract_model(cfg.model)
  return state_sharding.nnx_state_shardings(nnx.state(abstract), layout.rules, layout.mesh)


def build_sharded_model(cfg: ml_collections.ConfigDict, layout: Layout) -> K3Model:
  return build_model(cfg.model, seed=cfg.train.seed, out_shardings=model_shardings(cfg, layout))


def init_sharded_state(model: nnx.Module, optimizer: optax.GradientTransformation, layout: Layout):
  """(graphdef, TrainState, TrainState of shardings); optimizer state is created sharded."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  param_sh = state_sharding.nnx_state_shardings(params, layout.rules, layout.mesh)
  rest_sh = state_sharding.nnx_state_shardings(rest, layout.rules, layout.mesh)
  opt_abstract = jax.eval_shape(optimizer.init, params)
  opt_sh = state_sharding.mirror_shardings(opt_abstract, params, param_sh, layout.mesh)
  opt_state = jax.jit(optimizer.init, out_shardings=opt_sh)(params)
  rep = layout.replicated
  # Distinct buffers for every scalar: the jitted step donates the whole state.
  scalar = lambda dtype: jax.device_put(jnp.zeros((), dtype), rep)
  state = TrainState(scalar(jnp.int32), params, rest, opt_state, scalar(jnp.float32), scalar(jnp.int32))
  shardings = TrainState(rep, param_sh, rest_sh, opt_sh, rep, rep)
  return graphdef, state, shardings


__all__ = ["Layout", "build_sharded_model", "check_placeholder_id", "init_sharded_state",
           "make_layout", "model_shardings"]
