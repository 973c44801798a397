"""The staged context curriculum at run time: checks of every stage before anything is built,
and the lines that describe the stages.

The stages themselves (what each one changes, where it ends, its learning-rate segment) come
from the config: `k3train.config.stages(cfg)`. The train loop (k3train/train/loop.py) runs them
in one process: at a stage's end it evaluates, checkpoints and waits for the write, frees the
stage, builds the next one through `builder.build(stage.cfg)` (mesh, sharded state, optimizer,
jitted step), restores the checkpoint onto the new mesh, rebuilds the data iterator at the new
length and batch from the saved iterator state, and goes on. A rerun of the same command finds
the latest checkpoint, takes the stage that contains its step (a stage's end step belongs to the
next stage) and resumes there, so an interrupted curriculum continues exactly as an
uninterrupted one.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax

from k3train import config as config_lib
from k3train.parallel import mesh as mesh_lib
from k3train.train import layout as layout_lib

Stage = config_lib.Stage


def where(stage: Stage) -> str:
  return f"train.stages[{stage.index}] ({stage.name!r})"


def check_layouts(stages: Sequence[Stage], devices=None) -> None:
  """Every stage's mesh, batch and parameter shardings on this run's devices (nothing is
  allocated or compiled); ConfigError naming the stage and the key on the first that fails."""
  devices = list(jax.devices() if devices is None else devices)
  processes = jax.process_count()
  for stage in stages:
    c = stage.cfg
    if c.train.global_batch_size % processes:
      raise config_lib.ConfigError(
          f"{where(stage)}.global_batch_size: {c.train.global_batch_size} rows do not split over "
          f"the {processes} processes")
    try:
      layout = layout_lib.make_layout(c, devices)
      layout_lib.model_shardings(c, layout)
    except (mesh_lib.MeshError, config_lib.ConfigError, ValueError) as e:
      raise config_lib.ConfigError(f"{where(stage)}: {e} (the stage's parallel.*, seq_len and "
                                   "global_batch_size must fit the "
                                   f"{len(devices)} devices)") from None


def describe(stage: Stage, count: int) -> str:
  """One line: the stage, its steps and everything it trains with."""
  c = stage.cfg
  sizes = {a: int(c.parallel[a]) for a in mesh_lib.MESH_AXES}
  try:
    sizes = mesh_lib.resolve_axis_sizes(sizes, jax.device_count())
  except mesh_lib.MeshError:
    pass
  weights = ", ".join(f"{s}={w:g}" for s, w in zip(c.data.sources, c.data.weights) if w > 0)
  lr = f", lr {stage.lr}" if stage.lr else ""
  return (f"stage {stage.index + 1}/{count} {stage.name!r}: steps {stage.start_step:,}–"
          f"{stage.end_step:,}, seq_len {c.data.seq_len:,} × batch {c.train.global_batch_size:,} "
          f"({stage.tokens_per_step:,} tokens/step), micro-batches {c.train.microbatches}, mesh "
          f"{mesh_lib.describe(sizes)}, rules {c.parallel.rules}{lr}; data {weights}"
          + (f", long_doc_weight {c.data.long_doc_weight:g}" if c.data.long_doc_weight != 1 else ""))


def remaining_tokens(stages: Sequence[Stage], step: int, end: int) -> int:
  """Tokens left from `step` to `end` over the stages."""
  return sum(max(0, min(s.end_step, end) - max(s.start_step, step)) * s.tokens_per_step
             for s in stages)


def eval_due(cfg, stage: Stage, step: int, staged: bool) -> bool:
  """Evals run every eval.every_steps steps and, in a curriculum, at every stage's end."""
  every = cfg.eval.every_steps
  return bool((every and step % every == 0) or (staged and step == stage.end_step))


Preflight = Callable[[Sequence[Stage]], None]


def tokens_label(n: int) -> str:
  if n <= 0:
    return "0"
  units = ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K"))
  for scale, unit in units:
    if n >= scale:
      return f"{n / scale:.3g} {unit}"
  return str(n)


__all__ = ["Preflight", "Stage", "check_layouts", "describe", "eval_due", "remaining_tokens",
           "tokens_label", "where"]
