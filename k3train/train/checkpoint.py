"""Orbax checkpoints of everything a restart needs: train state, data-iterator state and config.

Each checkpoint holds three items: `state` (step, parameters, optimizer state, router biases and
other model variables, as a flat {path: array} dict), `data_iter` (the grain iterator state,
JSON) and `config` (the config that produced it, JSON). Orbax writes into a temporary folder and
renames it when complete, so an interrupted save never damages an earlier checkpoint; the train
loop's Checkpointer removes such unfinished folders when it opens the directory.

Damage from outside (a truncated or deleted file, unparsable metadata, an empty step folder) is
found before use: `latest_step()` checks the newest checkpoints' items and metadata, `restore()`
reads the arrays; a damaged checkpoint is moved aside to `<step>.damaged` with a one-line
reason and the next older intact one is used. When none is intact, `NoIntactCheckpointError`
lists what was tried. Folders that are not checkpoints are ignored with a warning.
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

import jax
import ml_collections
import orbax.checkpoint as ocp

from k3train import config as config_lib
from k3train.tree_paths import path_names

# Config sections (or single keys) that must match between a checkpoint and the run that restores
# it — the model, the data stream and the optimizer kind (which shapes the optimizer state) — and
# the keys inside them that may change between curriculum stages or runs.
MUST_MATCH = ("model", "data", "optim.optimizer")
MAY_CHANGE = tuple(f"data.{key}" for key in config_lib.DATA_STAGE_KEYS) + (
    "data.max_unusable_records", "data.max_unusable_seconds", "data.skip_warn_fraction",
    "model.moe.qb_rounds",            # training routing only: no state of its own
    "model.remat_policy")             # what the backward pass recomputes: same state, same values
ABSENT = "<absent>"


ITEMS = ("state", "data_iter", "config")
DAMAGED_SUFFIX = ".damaged"


class CheckpointMismatchError(ValueError):
  """The checkpoint in the workdir was written by an incompatible config or model."""


class NoIntactCheckpointError(RuntimeError):
  """Every checkpoint in the directory is damaged (each was moved aside)."""


class _Damaged(Exception):
  """A checkpoint that cannot be read; the message is the one-line reason."""


def _one_line(e: BaseException, limit: int = 200) -> str:
  text = " ".join(str(e).split())
  text = f"{type(e).__name__}: {text}" if text else type(e).__name__
  return text if len(text) <= limit else text[:limit - 3] + "..."


def summarise_keys(keys, limit: int = 4) -> str:
  """A few lines' worth of a long list of state keys: counts per two-part prefix."""
  groups: dict[str, int] = {}
  for k in keys:
    prefix = ".".join(k.split(".")[:2])
    groups[prefix] = groups.get(prefix, 0) + 1
  shown = [f"{p} ({n})" for p, n in sorted(groups.items())[:limit]]
  more = len(groups) - limit
  return ", ".join(shown) + (f", and {more} more groups" if more > 0 else "")


def flatten_state(tree) -> dict[str, Any]:
  """{'params.prefix.0.mixer.q_proj.kernel': array, ...}: a flat, stable view for orbax."""
  flat = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    flat[".".join(path_names(path)) or "root"] = leaf
  return flat


def check_keys(saved_keys, keys) -> None:
  """Refuses a checkpoint whose state entries differ from the run's (e.g. another optimizer)."""
  missing = [k for k in keys if k not in set(saved_keys)]
  extra = sorted(set(saved_keys) - set(keys))
  if missing or extra:
    raise CheckpointMismatchError(
        f"checkpoint does not match this run's state: {len(missing)} entries missing "
        f"[{summarise_keys(missing)}], {len(extra)} unexpected [{summarise_keys(extra)}]; was it "
        "written with another model or optimizer config (optim.optimizer)? Use a new --workdir.")


def unflatten_state(flat: dict[str, Any], like):
  """Inverse of `flatten_state` onto the structure of `like`."""
  leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(like)
  keys = [".".join(path_names(p)) or "root" for p, _ in leaves_with_path]
  check_keys(list(flat), keys)
  return jax.tree_util.tree_unflatten(treedef, [flat[k] for k in keys])


def _lookup(tree: dict, dotted: str):
  """The value at `dotted` ("optim.optimizer") in a JSON config, or ABSENT."""
  for part in dotted.split("."):
    if not isinstance(tree, dict) or part not in tree:
      return ABSENT
    tree = tree[part]
  return tree


def _plain(value):
  """Lists for tuples, so that a JSON round trip does not count as a change."""
  return list(value) if isinstance(value, (list, tuple)) else value


def _config_diff(saved, current, key: str) -> list[tuple[str, Any, Any]]:
  """(dotted key, checkpoint value, current value) of every leaf that differs under `key`."""
  if isinstance(saved, dict) or isinstance(current, dict):
    saved = saved if isinstance(saved, dict) else {}
    current = current if isinstance(current, dict) else {}
    return [d for k in sorted(set(saved) | set(current))
            for d in _config_diff(saved.get(k, ABSENT), current.get(k, ABSENT), f"{key}.{k}")]
  return [] if _plain(saved) == _plain(current) else [(key, saved, current)]


def config_diffs(saved: dict, current: dict) -> list[tuple[str, Any, Any]]:
  """The MUST_MATCH keys (outside MAY_CHANGE) whose values differ between two JSON configs."""
  return [d for key in MUST_MATCH
          for d in _config_diff(_lookup(saved, key), _lookup(current, key), key)
          if d[0] not in MAY_CHANGE]


def _short(value, limit: int = 40) -> str:
  text = value if value is ABSENT else repr(value)
  return text if len(text) <= limit else text[:limit - 3] + "..."


def mismatch_message(directory: str, step: int, diffs, shown: int = 4) -> str:
  """One line naming the first few differing keys with both values, and how many more."""
  listed = ", ".join(f"{key} (checkpoint {_short(a)}, now {_short(b)})" for key, a, b in diffs[:shown])
  more = f", and {len(diffs) - shown} more" if len(diffs) > shown else ""
  count = f"{len(diffs)} key{'s' if len(diffs) > 1 else ''} differ{'' if len(diffs) > 1 else 's'}"
  return (f"the checkpoint at {directory} (step {step}) was written with a different config "
          f"({count}): {listed}{more}. Use a new --workdir, or restore the original config values.")


def newest_saved_config(directory: str) -> tuple[int, dict] | None:
  """(step, config) of the newest checkpoint in `directory` whose config item reads, or None.

  Read-only and cheap (one small JSON file): nothing is created, moved aside or built, so a run
  can call it before it builds the model. Damage is left to `Checkpointer.latest_step`."""
  from etils import epath
  try:
    steps = sorted((int(n) for n in os.listdir(directory) if n.isdigit()), reverse=True)
  except OSError:
    return None
  for step in steps:
    try:
      return step, ocp.JsonCheckpointHandler().restore(epath.Path(directory) / str(step) / "config")
    except Exception:   # unreadable: the run moves it aside and uses an older one
      continue
  return None


def check_before_build(directory: str, config_at) -> None:
  """Refuses a run whose config differs from the one its newest checkpoint was written with
  (MUST_MATCH / MAY_CHANGE); `config_at(step)` is the run's config for resuming at `step` (a
  curriculum stage's). Reads one JSON file and writes nothing."""
  found = newest_saved_config(os.path.abspath(directory))
  if found is None:
    return
  step, saved = found
  diffs = config_diffs(saved, config_to_json(config_at(step)))
  if diffs:
    raise CheckpointMismatchError(mismatch_message(os.path.abspath(directory), step, diffs))


def config_to_json(cfg: ml_collections.ConfigDict) -> dict:
  return json.loads(cfg.to_json())


class Checkpointer:
  """Saves (asynchronously by default) and restores train state + data state + config."""

  def __init__(self, directory: str, cfg: ml_collections.ConfigDict, *,
               remove_unfinished: bool = False):
    """`remove_unfinished` deletes the half-written saves a killed run left behind; only the run
    that owns the directory may ask for it (any other reader would delete a live run's save)."""
    self.directory = os.path.abspath(directory)
    self.cfg = cfg
    options = ocp.CheckpointManagerOptions(
        max_to_keep=cfg.checkpoint.max_to_keep,
        enable_async_checkpointing=cfg.checkpoint.async_save,
        create=True, cleanup_tmp_directories=remove_unfinished)
    self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)
    self.tried: list[str] = []          # "step N: reason" of every checkpoint moved aside
    self.restored_step: int | None = None
    self._checked: set[int] = set()
    self._warned: set[str] = set()

  def _say(self, msg: str) -> None:
    if jax.process_index() == 0:
      print(msg, file=sys.stderr, flush=True)

  def _warn_strays(self) -> None:
    """Warns once about each folder that is neither a step nor a moved-aside or in-flight one."""
    try:
      names = os.listdir(self.directory)
    except OSError:
      return
    for name in sorted(names):
      if (name.isdigit() or name.endswith(DAMAGED_SUFFIX) or ".orbax-checkpoint-tmp" in name
          or name in self._warned or not os.path.isdir(os.path.join(self.directory, name))):
        continue
      self._warned.add(name)
      self._say(f"warning: ignoring {os.path.join(self.directory, name)}: not a checkpoint "
                "(checkpoint folders are named by their step)")

  def _move_aside(self, step: int, reason: str) -> None:
    src = os.path.join(self.directory, str(step))
    dst = src + DAMAGED_SUFFIX
    n = 1
    while os.path.exists(dst):
      n += 1
      dst = f"{src}{DAMAGED_SUFFIX}.{n}"
    if jax.process_index() == 0:
      os.rename(src, dst)
    self.tried.append(f"step {step}: {reason}")
    self._say(f"warning: checkpoint at step {step} is damaged ({reason}); moved to {dst}")
    self.manager.reload()

  def check_intact(self, step: int) -> None:
    """Raises _Damaged unless every item is present and the metadata and JSON items parse (the
    arrays themselves are read by `restore`)."""
    path = os.path.join(self.directory, str(step))
    for item in ITEMS:
      if not os.path.isdir(os.path.join(path, item)):
        raise _Damaged(f"item {item!r} is missing")
    for item in ("config", "data_iter"):
      try:
        self.manager.restore(step, args=ocp.args.Composite(**{item: ocp.args.JsonRestore()}))
      except Exception as e:   # orbax raises many kinds for one unreadable file
        raise _Damaged(f"{item}/metadata is unreadable ({_one_line(e)})") from None
    if not self.state_keys(step):
      raise _Damaged("state holds no arrays")

  def state_keys(self, step: int) -> list[str]:
    """The names of the arrays saved in `step`'s state (read from its metadata)."""
    from etils import epath
    try:
      meta = ocp.StandardCheckpointHandler().metadata(epath.Path(self.directory) / str(step) / "state")
      return list(meta.keys())
    except Exception as e:
      raise _Damaged(f"state metadata is unreadable ({_one_line(e)})") from None

  def latest_step(self) -> int | None:
    """The newest step whose items and metadata are intact; damaged newer ones are moved aside.
    Raises NoIntactCheckpointError when checkpoints (or moved-aside ones) exist but none is
    intact, rather than silently starting over."""
    self._warn_strays()
    while True:
      step = self.manager.latest_step()
      if step is None:
        break
      if step in self._checked:
        return step
      try:
        self.check_intact(step)
      except _Damaged as e:
        self._move_aside(step, str(e))
        continue
      self._checked.add(step)
      return step
    if self.tried or any(n.endswith(DAMAGED_SUFFIX) or re.search(r"\.damaged\.\d+$", n)
                         for n in os.listdir(self.directory)):
      self._no_intact()
    return None

  def _no_intact(self):
    tried = "; ".join(self.tried) if self.tried else "earlier runs moved them aside"
    raise NoIntactCheckpointError(
        f"no intact checkpoint in {self.directory} (tried: {tried}); the damaged ones are kept as "
        f"<step>{DAMAGED_SUFFIX}. Remove them to start over, or use a new --workdir.")

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
    """Refuses restoring `step` under a config that differs in a MUST_MATCH key. `main` checks
    the newest checkpoint before building (`check_before_build`); this guards every restore,
    including an older checkpoint used in place of a damaged one and `loop.train` callers."""
    saved = self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
    diffs = config_diffs(saved, config_to_json(self.cfg))
    if diffs:
      raise CheckpointMismatchError(mismatch_message(self.directory, step, diffs))

  def restore(self, step: int, like_state, *, earliest: int = 0):
    """(state, data_state) at `step`; `like_state` gives the structure, shapes and shardings.

    When `step` turns out damaged it is moved aside and the next older intact checkpoint (not
    older than `earliest`) is restored instead; `restored_step` says which one was."""
    while True:
      try:
        self.check_intact(step)
        self.check_config(step)
        flat_like = flatten_state(like_state)
        check_keys(self.state_keys(step), list(flat_like))
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, flat_like)
        try:
          restored = self.manager.restore(step, args=ocp.args.Composite(
              state=ocp.args.StandardRestore(abstract), data_iter=ocp.args.JsonRestore()))
        except Exception as e:   # a truncated, corrupted or deleted array file
          raise _Damaged(f"arrays are unreadable ({_one_line(e)})") from None
      except _Damaged as e:
        self._move_aside(step, str(e))
        older = self.latest_step()
        if older is None:
          self._no_intact()
        if older < earliest:
          raise NoIntactCheckpointError(
              f"checkpoint at step {step} is damaged and the newest intact one (step {older}) "
              f"belongs to an earlier curriculum stage; run again to continue from step {older}")
        step = older
        continue
      self.restored_step = step
      return unflatten_state(dict(restored["state"]), like_state), restored["data_iter"]

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()
