"""The training loop: build or restore state, run jitted steps, log, checkpoint, stop cleanly.

The loop never waits on the step it just dispatched: metrics are read one step late. A NaN/Inf
loss, gradient norm or model state (checked in the step) stops the run (naming the step) before
anything is checkpointed from it, and so does a NaN/Inf parameter or optimizer-state leaf, which
`step.state_nonfinite` looks for before every checkpoint save; SIGTERM saves a
checkpoint and exits; re-running with the same workdir resumes exactly where it stopped.

With train.use_stages the loop runs the curriculum's stages one after the other in this process
(k3train/train/curriculum.py): each stage is built, restored from the checkpoint its predecessor
ended with, trained to its end, evaluated and checkpointed. Progress lines and every
metrics.jsonl row name the stage. Evals (k3train/train/evals.py; every eval.every_steps steps and,
in a curriculum, at each stage's end) write one row each to eval_metrics.jsonl.

Metrics go through k3train/train/writers.py (JSONL files, TensorBoard, W&B; process 0 only). Each
step's row holds the step's own scalars (loss, gradient norms, loss tokens, ...) and:

  step_time_s    from the end of the previous step to the end of this one: the time between two
                 consecutive reads of step metrics, less the time spent in between on compiling
                 the step, saving checkpoints and evaluating (a stage's first step counts from
                 when its first batch is ready)
  compile_s      (the stage's first step) the first dispatch: tracing and compiling the step
  checkpoint_save_s  (the step after a periodic checkpoint) time the save blocked the loop
  tokens_per_s   the step's loss tokens / step_time_s
  mfu            tokens_per_s × training FLOPs per token / (peak × devices); the peak is
                 train.peak_flops_per_device, or by device kind (metrics.PEAK_BF16_FLOPS); NaN if unknown
  lr             the learning rate the optimizer applied: the schedule it was built with (the
                 stage config's) at its update count (steps so far less skipped updates)
  data/skipped/<source>[/<reason>]  documents and media items the pipeline skipped, cumulative
                 (a source skipping more than data.skip_warn_fraction of its records also gets
                 a warning line on stderr: `SkipWarnings`)
  padding_fraction, long_doc_share (curriculum), stage and seq_len labels (curriculum)

and every metrics.vectors_every steps vectors.jsonl gets `moe_load` [MoE layers, experts] (rows
labelled with their 1-based layer numbers). Long waits (building, opening the data, restoring,
the first compile, checkpoint saves, the final wait for checkpoint writes) print progress lines.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from k3train import config as config_lib
from k3train.data import pipeline
from k3train.data import sources as sources_lib
from k3train.parallel import mesh as mesh_lib
from k3train.parallel import sync
from k3train.train import builder
from k3train.train import curriculum
from k3train.train.checkpoint import config_to_json
from k3train.train import evals
from k3train.train import metrics as metrics_lib
from k3train.train import writers as writers_lib
from k3train.optim.optimizer import learning_rate_schedule
from k3train.train.checkpoint import Checkpointer, flatten_state
from k3train.train.step import NONFINITE_GROUPS, state_nonfinite


EVAL_METRICS = writers_lib.STREAM_FILES["eval"]   # one row per eval (metrics.jsonl: one per step)


class NonFiniteError(FloatingPointError):
  """A step produced NaN or Inf (loss, gradient norm, parameters, optimizer or model state)."""


class NonFiniteLossError(NonFiniteError):
  """The loss became NaN or Inf."""


class NonFiniteStateError(NonFiniteError):
  """The gradient norm, the updated parameters, optimizer state or model state hold NaN or Inf."""


@dataclass
class RunResult:
  start_step: int
  end_step: int
  stopped_by_signal: bool = False
  losses: dict[int, float] = field(default_factory=dict)
  evals: dict[int, dict] = field(default_factory=dict)               # step → eval metrics
  stage_first_losses: dict[str, float] = field(default_factory=dict)  # stage → loss of its 1st step
  fingerprint: float = float("nan")                                   # params_fingerprint at the end


class _StopFlag:
  """Turns SIGTERM (and SIGINT) into a flag the loop checks between steps."""

  def __init__(self):
    self.signum = None
    self._previous = {}

  def __enter__(self):
    sources_lib.STOP_WAITING.clear()
    for sig in (signal.SIGTERM, signal.SIGINT):
      try:
        self._previous[sig] = signal.signal(sig, self._handle)
      except ValueError:  # not the main thread: no handlers, no graceful stop
        pass
    return self

  def _handle(self, signum, frame):
    self.signum = signum
    sources_lib.STOP_WAITING.set()   # a source waiting for a usable document gives up

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)


class _closing:
  """Waits for in-flight async checkpoint writes however the loop ends."""

  def __init__(self, ckpt: Checkpointer):
    self.ckpt = ckpt

  def __enter__(self):
    return self.ckpt

  def __exit__(self, *exc):
    self.ckpt.close()


def _log(msg: str) -> None:
  """Progress lines come from process 0 only (every process runs the same steps)."""
  if jax.process_index() == 0:
    print(msg, flush=True)


def _all_hosts_data_state(data) -> dict:
  """The data-iterator state to checkpoint: this host's state, or with several processes
  {"hosts": [state of process 0, 1, ...]} (gathered, so any host count can restore it)."""
  state = data.get_state()
  if jax.process_count() == 1:
    return state
  from jax.experimental import multihost_utils
  blob = np.frombuffer(json.dumps(state).encode(), np.uint8)
  lengths = multihost_utils.process_allgather(np.asarray([blob.size], np.int64))
  padded = np.zeros((int(np.max(lengths)),), np.uint8)
  padded[:blob.size] = blob
  blobs = multihost_utils.process_allgather(padded)
  return {"hosts": [json.loads(bytes(b[:int(n)]).decode())
                    for b, n in zip(np.asarray(blobs), np.asarray(lengths).reshape(-1))]}


def _restore_data_state(data, saved: dict) -> None:
  """Exact continuation when the host layout is unchanged; otherwise the pipeline reshards."""
  hosts = saved.get("hosts") if isinstance(saved, dict) else None
  if hosts is not None and len(hosts) == jax.process_count():
    data.set_state(hosts[jax.process_index()])
  elif hosts is None and jax.process_count() > 1:
    data.set_state({"hosts": [saved]})
  else:
    data.set_state(saved)


def _check_finite(step: int, host_metrics: dict, leaf_names=None) -> None:
  """Raises on a non-finite loss, or on the "nonfinite" flags (k3train/train/step.py) of the step
  or of the whole-state check; `leaf_names()` gives the names of the state's leaves, to name the
  first offending one. Metrics without a loss are a whole-state check alone."""
  loss = host_metrics.get("loss")
  if loss is not None and not math.isfinite(loss):
    raise NonFiniteLossError(
        f"loss is {loss} at step {step} (grad_norm {host_metrics.get('grad_norm')}); stopping. "
        "Nothing from this step was checkpointed; lower optim.learning_rate or check the data, "
        "then resume from the last checkpoint in the workdir.")
  code = int(host_metrics.pop("nonfinite", 0))
  leaf = int(host_metrics.pop("nonfinite_leaf", -1))
  if code:
    groups = [name for bit, name in NONFINITE_GROUPS if code & bit]
    name = ""
    if leaf >= 0 and leaf_names is not None:
      names = leaf_names()
      name = f"; first non-finite leaf {names[leaf]}" if leaf < len(names) else ""
    seen = "".join(f"; {k} {host_metrics[k]}" for k in ("loss", "grad_norm") if k in host_metrics)
    raise NonFiniteStateError(
        f"non-finite {', '.join(groups)} at step {step} ({groups[0]} first{name}{seen}); "
        "stopping. Nothing from this step was checkpointed; lower optim.learning_rate or check "
        "the data, then resume from the last checkpoint in the workdir.")


def _merge_state_flags(host_metrics: dict, flags: dict) -> None:
  """Adds the whole-state check's "nonfinite" bits and first leaf to a step's metrics."""
  code = int(host_metrics.get("nonfinite", 0)) | int(flags["nonfinite"])
  leaves = [int(x) for x in (host_metrics.get("nonfinite_leaf", -1), flags["nonfinite_leaf"])]
  host_metrics["nonfinite"] = float(code)
  host_metrics["nonfinite_leaf"] = float(min((i for i in leaves if i >= 0), default=-1))


def params_fingerprint(params) -> float:
  """Σ over parameters of Σ x² (fp32 on device): equal before a save and after any restore,
  whatever the mesh, up to reduction order."""
  return float(jax.jit(lambda p: sum(jnp.sum(jnp.square(x.astype(jnp.float32)))
                                     for x in jax.tree.leaves(p)))(params))


class _StepMeter:
  """Step times between consecutive reads of step metrics, less excluded work (module docstring)."""

  def __init__(self, clock=time.perf_counter):
    self._clock = clock
    self._last = None
    self._excluded = 0.0

  def start(self) -> None:
    """Starts the first step's clock (once)."""
    if self._last is None:
      self._last = self._clock()

  def exclude(self, seconds: float) -> None:
    """Time spent before the next read on something that is not a step."""
    self._excluded += seconds

  def lap(self) -> float:
    """Seconds since the previous read (or the start), less what was excluded; call on a read."""
    now = self._clock()
    seconds = math.nan if self._last is None else now - self._last - self._excluded
    self._last, self._excluded = now, 0.0
    return seconds


class _LearningRates:
  """An optax schedule at integer update counts, evaluated on the host a block of counts at a time
  (one small computation per block instead of one per step)."""

  BLOCK = 1024

  def __init__(self, schedule):
    self.schedule = schedule
    self._first = None
    self._values = None

  def __call__(self, count: int) -> float:
    first = count - count % self.BLOCK
    if first != self._first:
      counts = np.arange(first, first + self.BLOCK, dtype=np.int32)
      self._values = np.asarray(jax.device_get(self.schedule(counts)), np.float64)
      self._first = first
    return float(self._values[count - first])


def _data_scalars(data, host_batch, data_cfg, staged: bool) -> dict:
  """The data pipeline's scalars for the step that trains on `host_batch` (taken right after it
  was read): padding share, long-document share (curriculum), and per source with a positive
  weight (or anything skipped) the cumulative skip count, per reason once one occurs."""
  row = {"padding_fraction": pipeline.padding_fraction(host_batch)}
  if staged:
    row["long_doc_share"] = data.long_doc_share
  counters = data.metrics()
  for spec, weight in zip(data_cfg.sources, data_cfg.weights):
    counts = {r: counters.get(f"errors/{spec}/{r}", 0.0) for r in pipeline.REASONS}
    total = float(sum(counts.values()))
    if weight > 0 or total:
      row[f"data/skipped/{spec}"] = total
      row.update({f"data/skipped/{spec}/{r}": n for r, n in counts.items() if n})
  return row


class SkipWarnings:
  """Warns (stderr, process 0) when a source skips too much of what it reads.

  A source's skip rate is the share of the records it has read (cumulative, this process's
  share of the stream) that the pipeline skipped wholly or in part. Once MIN_RECORDS were read,
  the first rate over `threshold` (data.skip_warn_fraction) warns; after that only a rate at
  least RISE above the last warned one does, so a steadily bad source warns once per process
  and a worsening one at most about ten times."""

  MIN_RECORDS = 50     # fewer records read say little about the rate
  RISE = 0.1           # a further warning once the rate has climbed 10 more points

  def __init__(self, threshold: float):
    self.threshold = float(threshold)
    self._warned: dict[str, float] = {}

  def __call__(self, counters: dict, specs) -> list[str]:
    """The warning lines due for `counters` (DataIterator.metrics())."""
    lines = []
    for spec in specs:
      read = counters.get(f"records/{spec}/read", 0.0)
      skipped = counters.get(f"records/{spec}/skipped", 0.0)
      if read < self.MIN_RECORDS:
        continue
      rate, last = skipped / read, self._warned.get(spec)
      if rate <= self.threshold or (last is not None and rate < last + self.RISE):
        continue
      self._warned[spec] = rate
      reasons = {r: int(counters.get(f"errors/{spec}/{r}", 0.0)) for r in pipeline.REASONS}
      lines.append(skip_warning(spec, rate, int(skipped), int(read), reasons, self.threshold))
    return lines


def skip_warning(spec: str, rate: float, skipped: int, read: int, reasons: dict,
                 threshold: float) -> str:
  """The one-line warning about a source's skip rate, with its counts by reason."""
  return (f"warning: data source {spec} skipped {100 * rate:.0f}% of records ({skipped:,} of "
          f"{read:,} read; {sources_lib.skip_summary(reasons)}) — over "
          f"data.skip_warn_fraction={threshold:g}")


def _warn(msg: str) -> None:
  """Warning lines go to stderr, from process 0 only (like progress lines)."""
  if jax.process_index() == 0:
    print(msg, file=sys.stderr, flush=True)


def moe_layer_numbers(model_cfg) -> list[int]:
  """The 1-based numbers of the MoE layers, in layer order: the rows of the `moe_load` metric."""
  return [i + 1 for i, (_, ffn) in enumerate(config_lib.layer_schedule(model_cfg).kinds)
          if ffn == "moe"]


def train(cfg: ml_collections.ConfigDict, workdir: str, *, stop_at_step: int | None = None,
          preflight: curriculum.Preflight | None = None) -> RunResult:
  """Trains to `cfg.train.steps` (or `stop_at_step`, to simulate an interruption).

  With train.use_stages the run goes through the curriculum's stages (k3train/train/curriculum.py)
  and ends at the last stage's end or train.steps, whichever comes first. Before anything is built
  every remaining stage is checked on this run's devices, and `preflight(stages)` (e.g. the memory
  plan of k3train.tools.plan) may refuse them.

  `cfg` must be validated (`k3train.config.validate`; `k3train.main` does it at start).
  """
  os.makedirs(workdir, exist_ok=True)
  process_count = jax.process_count()
  staged = bool(cfg.train.use_stages)
  run_stages = config_lib.stages(cfg)
  end = config_lib.run_end(cfg, run_stages)
  if stop_at_step is not None:
    end = min(end, stop_at_step)
  if not staged and cfg.train.global_batch_size % process_count:
    raise config_lib.ConfigError(
        f"train.global_batch_size={cfg.train.global_batch_size} must be divisible by the "
        f"{process_count} processes")
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), run_stages[0].cfg, remove_unfinished=True)
  result = RunResult(start_step=0, end_step=0)
  skip_warnings = SkipWarnings(cfg.data.skip_warn_fraction)
  with _StopFlag() as stop, _closing(ckpt):
    start = ckpt.latest_step() or 0
    result.start_step = result.end_step = start
    first = config_lib.stage_at(run_stages, start)
    todo = [s for s in run_stages[first:] if s.index == first or s.start_step < end]
    if staged:
      capped = end < run_stages[-1].end_step
      _log(f"curriculum: {len(run_stages)} stages; this run trains steps {start:,}–{end:,}"
           + (f" (stopping inside stage {run_stages[config_lib.stage_at(run_stages, end - 1)].name!r})"
              if capped else ""))
      for s in run_stages:
        _log("  " + curriculum.describe(s, len(run_stages)))
      curriculum.check_layouts(todo)
      if preflight is not None:
        preflight(todo)
    step = start
    wandb_config = config_to_json(cfg) if cfg.metrics.wandb else None
    with writers_lib.open_writers(workdir, cfg.metrics, process_index=jax.process_index(),
                                  config=wandb_config) as fh:
      for stage in todo:
        step = _train_stage(stage, run_stages, step, end, ckpt, fh, stop, result, skip_warnings,
                            staged=staged, resumed=(stage is todo[0] and start > 0),
                            first_built=stage is todo[0])
        if result.stopped_by_signal or step >= end:
          break
      with writers_lib.progress("waiting for the checkpoint writes to finish", _log):
        ckpt.wait()
  result.end_step = step
  _log(f"done at step {step}; checkpoints in {ckpt.directory}; parameter fingerprint "
       f"{result.fingerprint:.9e}")
  return result


def _train_stage(stage: config_lib.Stage, run_stages, start: int, end: int, ckpt: Checkpointer, fh,
                 stop: _StopFlag, result: RunResult, skip_warnings: SkipWarnings, *, staged: bool,
                 resumed: bool, first_built: bool) -> int:
  """Builds `stage`, restores step `start` onto it (if > 0), trains it to its end (or `end`),
  evaluates and checkpoints; returns the step reached."""
  cfg = stage.cfg
  t = cfg.train
  process_count, process_index = jax.process_count(), jax.process_index()
  tag = f"stage {stage.name} ({stage.index + 1}/{len(run_stages)})" if staged else ""
  stage_end = min(stage.end_step, end)
  size = builder.model_size(cfg)
  flops_per_token = size.flops_per_token
  device_kind = jax.devices()[0].device_kind
  peak_flops = metrics_lib.peak_flops_per_device(t.peak_flops_per_device, device_kind)
  if first_built:
    _log(f"model: {size.total_params:,} parameters, {size.active_params:,} active per token; "
         f"{flops_per_token:.3g} training FLOPs per token")
    _log(metrics_lib.describe_peak(t.peak_flops_per_device, device_kind))
  if staged:
    _log(f"{tag}: building for steps {stage.start_step:,}–{stage.end_step:,} at seq_len "
         f"{cfg.data.seq_len:,} ({flops_per_token:.3g} training FLOPs per token)")
  with writers_lib.progress("building the model, optimizer state and train step"
                            + (f" of {tag}" if staged else ""), _log):
    run = builder.build(cfg, log=_log if first_built else None)
  layout, state = run.layout, run.state
  train_step = sync.CompiledTogether(run.step, "train step")   # no process starts before all compiled
  _log(f"mesh: {mesh_lib.describe(dict(layout.mesh.shape))} over {jax.device_count()} devices "
       f"({process_count} processes); rules: {cfg.parallel.rules}")
  if t.microbatches > 1:
    _log(f"batch: {t.global_batch_size} × {cfg.data.seq_len} tokens per step in {t.microbatches} "
         f"micro-batches of {t.global_batch_size // t.microbatches} rows (gradient accumulation)")
  shell = dataclasses.replace(run, state=None)   # layout, shardings, graphdef: for the evals
  del run
  with writers_lib.progress("opening the data pipeline", _log):
    data = pipeline.make_text_iterator(cfg.data, batch_size=t.global_batch_size // process_count,
                                       seed=t.seed, process_index=process_index,
                                       process_count=process_count)
  ckpt.use_config(cfg)
  if start:
    with writers_lib.progress(f"restoring the checkpoint at step {start}", _log):
      state, data_state = ckpt.restore(start, state, earliest=stage.start_step if staged else 0)
    if ckpt.restored_step != start:   # `start` was damaged (moved aside): an older one was used
      start = ckpt.restored_step
      result.start_step = min(result.start_step, start)
    _restore_data_state(data, data_state)
    if resumed:
      _log(f"resumed from {ckpt.directory} at step {start}" + (f" in {tag}" if staged else "")
           + f"; parameter fingerprint {params_fingerprint(state.params):.9e}")
    else:
      _log(f"{tag}: restored step {start} onto the new mesh")

  tokens_per_step = t.global_batch_size * cfg.data.seq_len
  last_saved = start
  evaluator = None
  extra_keys = {"stage": stage.name, "seq_len": cfg.data.seq_len} if staged else {}
  # The learning rate of update k is the schedule the optimizer was built with (from this stage's
  # config, as builder.build made it) at k; a skipped update does not advance the count.
  learning_rate = _LearningRates(learning_rate_schedule(cfg.optim, t.steps))
  updates_skipped = int(np.asarray(state.skipped.addressable_data(0))) if start else 0
  moe_rows = moe_layer_numbers(cfg.model)
  meter = _StepMeter()
  window = {"steps": 0, "seconds": 0.0, "tokens": 0.0}   # since the last progress line
  carried = {}    # timings of work between two steps, reported in the next step's row

  def leaf_names() -> list[str]:
    """The state's leaf names, in `jax.tree.leaves` order (for naming a non-finite leaf)."""
    return list(flatten_state(state))

  def record(step: int, device_metrics, moe_load, data_row: dict, timings: dict,
             check_state: bool = False) -> None:
    """Reads one finished step's metrics (one step late), checks them, writes and logs them.
    check_state (before a checkpoint of this step's state): also checks every leaf of the state
    (`step.state_nonfinite`; the step itself checks all but the parameters and optimizer state)."""
    nonlocal updates_skipped
    host = {k: float(v) for k, v in jax.device_get(device_metrics).items()}
    seconds = meter.lap()
    if check_state:
      _merge_state_flags(host, check_whole_state())
    _check_finite(step, host, leaf_names)
    host.update(data_row)
    host["lr"] = learning_rate(step - 1 - updates_skipped)
    updates_skipped += int(host.get("skipped_update", 0) > 0)
    host["step_time_s"] = seconds
    host["tokens_per_s"] = host["tokens"] / seconds if seconds > 0 else math.nan
    host["mfu"] = metrics_lib.mfu(host["tokens_per_s"], flops_per_token, peak_flops,
                                  jax.device_count())
    host.update(timings)
    result.losses[step] = host["loss"]
    if staged and step == stage.start_step + 1:
      result.stage_first_losses[stage.name] = host["loss"]
    fh.scalars(step, {**extra_keys, **host})
    if moe_load is not None and fh.wants_vectors(step):
      load = np.asarray(jax.device_get(moe_load), np.float64)
      fh.vectors(step, {"moe_load": load},
                 rows={"moe_load": moe_rows} if len(moe_rows) == load.shape[0] else None)
    if math.isfinite(seconds) and seconds > 0:
      window["steps"] += 1
      window["seconds"] += seconds
      window["tokens"] += host["tokens"]
    if host.get("skipped_update", 0) > 0:
      _log(f"step {step}: loss {host['loss']:.4f} exceeded {cfg.optim.loss_spike_factor}x its running "
           "mean; the update was skipped (optim.loss_spike_factor)")
    if step % t.log_every and step != start + 1:
      return
    elapsed = window["seconds"]
    tps = window["tokens"] / elapsed if elapsed > 0 else math.nan            # loss tokens
    steps_per_s = window["steps"] / elapsed if elapsed > 0 else math.nan
    left = curriculum.remaining_tokens(run_stages, step, end) if staged else (end - step) * tokens_per_step
    eta = left / (steps_per_s * tokens_per_step) if steps_per_s > 0 else math.nan
    mfu = metrics_lib.mfu(tps, flops_per_token, peak_flops, jax.device_count())
    mfu_text = "n/a" if math.isnan(mfu) else f"{100 * mfu:.2f}%"
    extra = "".join(f" | {k} {host[k]:.3g}" for k in ("moe_max_load", "mla_max_logit", "qk_clip_heads")
                    if k in host)
    where = f" | {tag} | long docs {100 * host['long_doc_share']:.0f}%" if staged else ""
    _log(f"step {step}/{end}{where} | loss {host['loss']:.4f} | grad_norm {host['grad_norm']:.3g} | "
         f"lr {host['lr']:.3g} | tok/s {tps:,.0f} | MFU {mfu_text} | "
         f"ETA {metrics_lib.format_eta(eta)}{extra}")
    window.update(steps=0, seconds=0.0, tokens=0.0)

  def evaluate(step: int) -> None:
    nonlocal evaluator
    t0 = time.perf_counter()
    if evaluator is None:
      evaluator = evals.Evaluator(cfg, shell)
    host = evaluator(state)
    seconds = time.perf_counter() - t0
    meter.exclude(seconds)
    fh.scalars(step, {**extra_keys, **host}, stream="eval")
    result.evals[step] = host
    shown = " | ".join(f"{k.removeprefix('eval/')} {v:.3g}" for k, v in host.items()
                       if k == "eval/loss" or k.startswith("eval/loss_by_pos/")
                       or k.startswith("eval/retrieval/"))
    _log(f"eval at step {step}" + (f" ({tag}, seq_len {cfg.data.seq_len:,})" if staged else "")
         + f" in {seconds:.1f}s: {shown}")

  def save(step: int, *, force: bool = False) -> float:
    """Saves a checkpoint (the write goes on in the background); returns the seconds it blocked."""
    fh.flush()
    t0 = time.perf_counter()
    with writers_lib.progress(f"saving the checkpoint at step {step}", _log):
      ckpt.save(step, state, _all_hosts_data_state(data), force=force)
    return time.perf_counter() - t0

  whole_state_check = []   # the jitted `state_nonfinite`, compiled at the first checkpoint

  def check_whole_state() -> dict:
    """`state_nonfinite` of the current state on the host; its time (the first call compiles it)
    goes to the next step's "checkpoint_save_s", not to a step's time."""
    t0 = time.perf_counter()
    if not whole_state_check:
      whole_state_check.append(jax.jit(state_nonfinite))
    flags = {k: float(v) for k, v in jax.device_get(whole_state_check[0](state)).items()}
    seconds = time.perf_counter() - t0
    meter.exclude(seconds)
    carried["checkpoint_save_s"] = carried.get("checkpoint_save_s", 0.0) + seconds
    return flags

  pending = None   # (step, device metrics, moe load, data scalars, timings) of the step in flight
  compiled = False
  step = start
  while step < stage_end:
    if stop.signum is not None:
      result.stopped_by_signal = True
      _log(f"received signal {stop.signum}: saving a checkpoint at step {step} and exiting")
      break
    host_batch = next(data)
    data_row = _data_scalars(data, host_batch, cfg.data, staged)
    for line in skip_warnings(data.metrics(), cfg.data.sources):
      _warn(line)
    meter.start()
    batch = layout.global_batch(host_batch)
    timings, carried = carried, {}
    if compiled:
      state, step_metrics = train_step(state, batch)
    else:
      t0 = time.perf_counter()
      with writers_lib.progress("compiling the train step" + (f" of {tag}" if staged else ""), _log):
        state, step_metrics = train_step(state, batch)
      timings["compile_s"] = time.perf_counter() - t0
      meter.exclude(timings["compile_s"])
      compiled = True
    step_metrics = dict(step_metrics)
    moe_load = step_metrics.pop("moe_load", None)        # [MoE layers, E]: a vector, not a scalar
    if pending is not None:
      record(*pending)
    pending = (step + 1, step_metrics, moe_load, data_row, timings)
    step += 1
    if staged and step == stage.start_step + 1:
      record(*pending)     # the stage's first step, read at once: finite?
      pending = None
      _log(f"{tag}: first step {step} loss {result.losses[step]:.4f}")
    if curriculum.eval_due(cfg, stage, step, staged):
      if pending is not None:
        record(*pending)
        pending = None
      evaluate(step)
    if step % cfg.checkpoint.every_steps == 0 and step < stage_end:
      if pending is not None:
        record(*pending, check_state=True)   # never checkpoint a non-finite state
        pending = None
      else:
        _check_finite(step, check_whole_state(), leaf_names)
      seconds = save(step)
      carried["checkpoint_save_s"] = carried.get("checkpoint_save_s", 0.0) + seconds
      meter.exclude(seconds)
      last_saved = step
  if pending is not None:
    record(*pending, check_state=step != last_saved)
  elif step != last_saved:
    _check_finite(step, check_whole_state(), leaf_names)
  if step != last_saved:
    save(step, force=True)
  fh.flush()
  if staged and step == stage.end_step and step < end and not result.stopped_by_signal:
    with writers_lib.progress(f"waiting for the checkpoint at step {step} to be written", _log):
      ckpt.wait()
    seen = stage.start_tokens + (step - stage.start_step) * tokens_per_step
    _log(f"{tag} done at step {step:,} ({curriculum.tokens_label(seen)} tokens seen); "
         f"checkpoint at step {step} saved: end of stage")
  if step >= end or result.stopped_by_signal or stage.index == len(run_stages) - 1:
    result.fingerprint = params_fingerprint(state.params)     # the run's last stage
  data.close()
  del state
  return step
