"""Orbax checkpoints of everything a restart needs: train state, data-iterator state and config.

Each checkpoint holds three items: `state` (step, parameters, optimizer state, router biases and
other model variables, as a flat {path: array} dict), `data_iter` (the grain iterator state,
JSON) and `config` (the config that produced it, JSON). Orbax writes into a temporary folder and
renames it when complete, so an interrupted save never damages an earlier checkpoint.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import ml_collections
import orbax.checkpoint as ocp

from k3train import config as config_lib
from k3train.tree_paths import path_names

# Config sections that must match between a checkpoint and the run that restores it, and the
# keys inside them that may change between curriculum stages.
MUST_MATCH = ("model", "data")
MAY_CHANGE = tuple(f"data.{key}" for key in config_lib.DATA_STAGE_KEYS)


class CheckpointMismatchError(ValueError):
  """The checkpoint in the workdir was written by an incompatible config or model."""


def flatten_state(tree) -> dict[str, Any]:
  """{'params.prefix.0.mixer.q_proj.kernel': array, ...}: a flat, stable view for orbax."""
  flat = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    flat[".".join(path_names(path)) or "root"] = leaf
  return flat


def unflatten_state(flat: dict[str, Any], like):
  """Inverse of `flatten_state` onto the structure of `like`."""
  leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(like)
  keys = [".".join(path_names(p)) or "root" for p, _ in leaves_with_path]
  missing = [k for k in keys if k not in flat]
  extra = sorted(set(flat) - set(keys))
  if missing or extra:
    raise CheckpointMismatchError(
        f"checkpoint does not match the model: {len(missing)} missing entries (e.g. {missing[:3]}), "
        f"{len(extra)} unexpected (e.g. {extra[:3]}); was it written with another model config?")
  return jax.tree_util.tree_unflatten(treedef, [flat[k] for k in keys])


def _config_diff(saved: dict, current: dict, prefix: str = "") -> list[str]:
  diffs = []
  for key in sorted(set(saved) | set(current)):
    a, b = saved.get(key, "<absent>"), current.get(key, "<absent>")
    if isinstance(a, dict) and isinstance(b, dict):
      diffs += _config_diff(a, b, f"{prefix}{key}.")
    elif (list(a) if isinstance(a, (list, tuple)) else a) != (list(b) if isinstance(b, (list, tuple)) else b):
      diffs.append(f"{prefix}{key}: checkpoint {a!r} vs now {b!r}")
  return diffs


def config_to_json(cfg: ml_collections.ConfigDict) -> dict:
  return json.loads(cfg.to_json())


class Checkpointer:
  """Saves (asynchronously by default) and restores train state + data state + config."""

  def __init__(self, directory: str, cfg: ml_collections.ConfigDict):
    self.directory = os.path.abspath(directory)
    self.cfg = cfg
    options = ocp.CheckpointManagerOptions(
        max_to_keep=cfg.checkpoint.max_to_keep,
        enable_async_checkpointing=cfg.checkpoint.async_save,
        create=True)
    self.manager = ocp.CheckpointManager(self.directory, options=options,
                                         item_names=("state", "data_iter", "config"))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def use_config(self, cfg: ml_collections.ConfigDict) -> None:
    """The config saved with later checkpoints and checked on restore (a curriculum stage's)."""
    self.cfg = cfg

  def save(self, step: int, state, data_state: dict, *, force: bool = False) -> bool:
    args = ocp.args.Composite(
        state=ocp.args.StandardSave(flatten_state(state)),
        data_iter=ocp.args.JsonSave(data_state),
        config=ocp.args.JsonSave(config_to_json(self.cfg)))
    return self.manager.save(step, args=args, force=force)

  def check_config(self, step: int) -> None:
    saved = self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
    current = config_to_json(self.cfg)
    diffs = [d for section in MUST_MATCH
             for d in _config_diff(saved.get(section, {}), current.get(section, {}), section + ".")
             if d.split(":", 1)[0] not in MAY_CHANGE]
    if diffs:
      raise CheckpointMismatchError(
          f"the checkpoint at {self.directory} (step {step}) was written with a different config:\n  "
          + "\n  ".join(diffs) + "\nUse a new --workdir, or restore the original config values.")

  def restore(self, step: int, like_state):
    """(state, data_state) at `step`; `like_state` gives the structure, shapes and shardings."""
    self.check_config(step)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, flatten_state(like_state))
    restored = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), data_iter=ocp.args.JsonRestore()))
    return unflatten_state(dict(restored["state"]), like_state), restored["data_iter"]

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()
