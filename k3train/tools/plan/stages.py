"""The memory plan of every curriculum stage (train.use_stages): one plan, and one line, per stage.

Each stage is planned with its own config (`k3train.config.stages`): its mesh (`parallel.*`,
-1 filled from the device count), rule recipe, seq_len, micro-batches and global batch, whose
rows per batch shard and micro-batch are the plan's batch per device. The train state's layout
is made once per rule recipe (the model and optimizer shapes are the same in every stage).

    rows = stage_plans(cfg, devices=4096, device_memory_gib=139)   # [(stage, Plan | error), ...]
    for stage, p in rows: print(format_stage_line(stage, p, len(rows)))

`preflight(...)` turns this into the check a train run makes at start (`loop.train(...,
preflight=plan.preflight())`): a stage that does not fit, or that the mesh does not divide, is
refused before anything is built.
"""

from __future__ import annotations

from typing import Sequence

from k3train import config as config_lib
from k3train.parallel import mesh as mesh_lib
from k3train.tools.plan import budget
from k3train.tools.plan import state as state_lib

GiB = budget.GiB


def _batch_per_device(stage: config_lib.Stage, sizes) -> int:
  c = stage.cfg
  shards = sizes["data"] * sizes["fsdp"] * sizes["expert"]
  rows, mb = c.train.global_batch_size, c.train.microbatches
  if rows % (shards * mb):
    raise mesh_lib.MeshError(
        f"train.stages[{stage.index}] ({stage.name!r}).global_batch_size: {rows} rows in {mb} "
        f"micro-batch(es) do not split over data·fsdp·expert = {shards} batch shards")
  return rows // (shards * mb)


def stage_plans(cfg, devices: int, *, device_memory_gib: float, margin: float = 0.10,
                attention: str = "flash", expert_capacity: float | None = None,
                stages: Sequence[config_lib.Stage] | None = None, abstract_state=None):
  """[(stage, Plan or the error string)] for every stage of `cfg` (or the given `stages`)."""
  from k3train.train import builder
  stages = list(config_lib.stages(cfg) if stages is None else stages)
  shapes = abstract_state if abstract_state is not None else builder.abstract_state(stages[0].cfg)
  layouts = {}
  out = []
  for stage in stages:
    c = stage.cfg
    try:
      sizes = mesh_lib.resolve_axis_sizes(mesh_lib.sizes_from_config(c.parallel), devices)
      b = _batch_per_device(stage, sizes)
      rules = c.parallel.rules
      if rules not in layouts:
        layouts[rules] = state_lib.state_layout(shapes, rules)
      p = budget.make_plan(c, layouts[rules], sizes, rules_name=rules, seq_len=c.data.seq_len,
                           batch_per_device=b, remat=c.model.remat_policy, attention=attention,
                           device_memory_gib=device_memory_gib, margin=margin,
                           expert_capacity=expert_capacity, microbatches=c.train.microbatches)
      out.append((stage, p))
    except (mesh_lib.MeshError, config_lib.ConfigError, ValueError) as e:
      out.append((stage, f"train.stages[{stage.index}] ({stage.name!r}): {e}"
                  if not str(e).startswith("train.stages[") else str(e)))
  return out


def format_stage_line(stage: config_lib.Stage, p, count: int) -> str:
  """One line: the stage, its shape, mesh, batch per device, peak against the budget, verdict."""
  c = stage.cfg
  head = (f"stage {stage.index + 1}/{count} {stage.name!r}: seq_len {c.data.seq_len:,} × "
          f"{c.train.global_batch_size:,} ({stage.tokens_per_step:,} tokens/step)")
  if isinstance(p, str):
    return f"{head}: ERROR {p}"
  verdict = "FITS" if p.fits else "DOES NOT FIT"
  mb = f" × {p.microbatches} micro-batches" if p.microbatches > 1 else ""
  return (f"{head}, mesh {mesh_lib.describe(p.sizes)}, rules={p.rules}, b={p.dims.b}{mb}, "
          f"{p.dims.n:,} tokens/device: peak {p.peak / GiB:.2f} of {p.budget / GiB:.2f} GiB {verdict}")


def stage_json(stage: config_lib.Stage, p) -> dict:
  base = {"stage": stage.name, "index": stage.index, "start_step": stage.start_step,
          "end_step": stage.end_step}
  if isinstance(p, str):
    return {**base, "error": p, "fits": False}
  return {**base, **budget.plan_json(p)}


def device_memory_gib() -> float | None:
  """Usable memory of this process's first device in GiB, when the runtime reports it."""
  import jax
  try:
    stats = jax.local_devices()[0].memory_stats() or {}
  except Exception:  # backends without memory statistics (CPU)
    return None
  limit = stats.get("bytes_limit")
  return float(limit) / GiB if limit else None


def preflight(device_memory: float | None = None, *, margin: float | None = None, log=print):
  """A `loop.train(preflight=...)` check: plans the run's remaining stages on this run's devices
  and raises ConfigError naming every stage that does not fit. Without a known device memory
  (`device_memory` in GiB, or the runtime's limit; CPU has none) it only logs that it skipped.
  margin: the share of that memory kept free; None: the run's `train.memory_margin`."""

  def check(stages: Sequence[config_lib.Stage]) -> None:
    import jax
    memory = device_memory if device_memory is not None else device_memory_gib()
    if memory is None:
      log("memory plan of the stages skipped: the device reports no memory limit")
      return
    keep = stages[0].cfg.train.memory_margin if margin is None else margin
    rows = stage_plans(stages[0].cfg, jax.device_count(), device_memory_gib=memory, margin=keep,
                       stages=stages)
    bad = []
    for stage, p in rows:
      log("plan " + format_stage_line(stage, p, len(rows)))
      if isinstance(p, str) or not p.fits:
        bad.append(p if isinstance(p, str) else
                   f"train.stages[{stage.index}] ({stage.name!r}): peak {p.peak / GiB:.1f} GiB "
                   f"> {p.budget / GiB:.1f} GiB usable per device ({keep:.0%} of "
                   f"{memory:.1f} GiB kept free)")
    if bad:
      raise config_lib.ConfigError("the memory plan refuses the curriculum: " + "; ".join(bad)
                                   + " (python -m k3train.tools.plan shows each stage's terms; "
                                   "train.memory_margin sets the share kept free)")

  return check


__all__ = ["device_memory_gib", "format_stage_line", "preflight", "stage_json", "stage_plans"]
