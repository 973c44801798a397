"""The training loop: build or restore state, run jitted steps, log, checkpoint, stop cleanly.

The loop never waits on the step it just dispatched: metrics are read one step late. A NaN/Inf
loss stops the run (naming the step) before anything is checkpointed from it; SIGTERM saves a
checkpoint and exits; re-running with the same workdir resumes exactly where it stopped.

With train.use_stages the loop runs the curriculum's stages one after the other in this process
(k3train/train/curriculum.py): each stage is built, restored from the checkpoint its predecessor
ended with, trained to its end, evaluated and checkpointed. Progress lines and every
metrics.jsonl row name the stage. Evals (k3train/train/evals.py; every eval.every_steps steps and,
in a curriculum, at each stage's end) append one row each to eval_metrics.jsonl.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from k3train import config as config_lib
from k3train.data import pipeline
from k3train.parallel import mesh as mesh_lib
from k3train.train import builder
from k3train.train import curriculum
from k3train.train import evals
from k3train.train import metrics as metrics_lib
from k3train.train.checkpoint import Checkpointer, flatten_state
from k3train.train.step import NONFINITE_GROUPS


EVAL_METRICS = "eval_metrics.jsonl"   # one row per eval (metrics.jsonl: one row per step)


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
    for sig in (signal.SIGTERM, signal.SIGINT):
      try:
        self._previous[sig] = signal.signal(sig, self._handle)
      except ValueError:  # not the main thread: no handlers, no graceful stop
        pass
    return self

  def _handle(self, signum, frame):
    self.signum = signum

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
  """Raises on a non-finite loss, or on the step's "nonfinite" flags (k3train/train/step.py);
  `leaf_names()` gives the names of the state's leaves, to name the first offending one."""
  loss = host_metrics["loss"]
  if not math.isfinite(loss):
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
    raise NonFiniteStateError(
        f"non-finite {', '.join(groups)} at step {step} ({groups[0]} first{name}; loss {loss}, "
        f"grad_norm {host_metrics.get('grad_norm')}); stopping. Nothing from "
        "this step was checkpointed; lower optim.learning_rate or check the data, then resume "
        "from the last checkpoint in the workdir.")


def params_fingerprint(params) -> float:
  """Σ over parameters of Σ x² (fp32 on device): equal before a save and after any restore,
  whatever the mesh, up to reduction order."""
  return float(jax.jit(lambda p: sum(jnp.sum(jnp.square(x.astype(jnp.float32)))
                                     for x in jax.tree.leaves(p)))(params))


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
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), run_stages[0].cfg)
  result = RunResult(start_step=0, end_step=0)
  metrics_path = os.path.join(workdir, "metrics.jsonl")
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
    with open(metrics_path, "a") as fh:
      for stage in todo:
        step = _train_stage(stage, run_stages, step, end, ckpt, fh, stop, result,
                            staged=staged, resumed=(stage is todo[0] and start > 0),
                            first_built=stage is todo[0])
        if result.stopped_by_signal or step >= end:
          break
  result.end_step = step
  _log(f"done at step {step}; checkpoints in {ckpt.directory}; parameter fingerprint "
       f"{result.fingerprint:.9e}")
  return result


def _train_stage(stage: config_lib.Stage, run_stages, start: int, end: int, ckpt: Checkpointer, fh,
                 stop: _StopFlag, result: RunResult, *, staged: bool, resumed: bool,
                 first_built: bool) -> int:
  """Builds `stage`, restores step `start` onto it (if > 0), trains it to its end (or `end`),
  evaluates and checkpoints; returns the step reached."""
  cfg = stage.cfg
  t = cfg.train
  process_count, process_index = jax.process_count(), jax.process_index()
  tag = f"stage {stage.name} ({stage.index + 1}/{len(run_stages)})" if staged else ""
  stage_end = min(stage.end_step, end)
  size = builder.model_size(cfg)
  flops_per_token = size.flops_per_token
  if first_built:
    _log(f"model: {size.total_params:,} parameters, {size.active_params:,} active per token; "
         f"{flops_per_token:.3g} training FLOPs per token")
  if staged:
    _log(f"{tag}: building for steps {stage.start_step:,}–{stage.end_step:,} at seq_len "
         f"{cfg.data.seq_len:,} ({flops_per_token:.3g} training FLOPs per token)")
  run = builder.build(cfg, log=_log if first_built else None)
  layout, state, train_step = run.layout, run.state, run.step
  _log(f"mesh: {mesh_lib.describe(dict(layout.mesh.shape))} over {jax.device_count()} devices "
       f"({process_count} processes); rules: {cfg.parallel.rules}")
  if t.microbatches > 1:
    _log(f"batch: {t.global_batch_size} × {cfg.data.seq_len} tokens per step in {t.microbatches} "
         f"micro-batches of {t.global_batch_size // t.microbatches} rows (gradient accumulation)")
  shell = dataclasses.replace(run, state=None)   # layout, shardings, graphdef: for the evals
  del run
  data = pipeline.make_text_iterator(cfg.data, batch_size=t.global_batch_size // process_count,
                                     seed=t.seed, process_index=process_index, process_count=process_count)
  ckpt.use_config(cfg)
  if start:
    state, data_state = ckpt.restore(start, state)
    _restore_data_state(data, data_state)
    if resumed:
      _log(f"resumed from {ckpt.directory} at step {start}" + (f" in {tag}" if staged else "")
           + f"; parameter fingerprint {params_fingerprint(state.params):.9e}")
    else:
      _log(f"{tag}: restored step {start} onto the new mesh")

  tokens_per_step = t.global_batch_size * cfg.data.seq_len
  last_saved = start
  evaluator = None
  window = {"start": time.perf_counter(), "steps": 0}
  extra_keys = {"stage": stage.name, "seq_len": cfg.data.seq_len} if staged else {}
  eval_path = os.path.join(os.path.dirname(fh.name), EVAL_METRICS)

  def record(step: int, device_metrics, pad_fraction: float, long_share: float) -> None:
    """Reads one finished step's metrics (one step late), checks them, appends and logs them."""
    host = {k: float(v) for k, v in jax.device_get(device_metrics).items()}
    host["padding_fraction"] = pad_fraction
    if staged:
      host["long_doc_share"] = long_share
    _check_finite(step, host, lambda: list(flatten_state(state)))
    result.losses[step] = host["loss"]
    if staged and step == stage.start_step + 1:
      result.stage_first_losses[stage.name] = host["loss"]
    if jax.process_index() == 0:
      fh.write(json.dumps({"step": step, **extra_keys, **host}) + "\n")
      fh.flush()
    if host.get("skipped_update", 0) > 0:
      _log(f"step {step}: loss {host['loss']:.4f} exceeded {cfg.optim.loss_spike_factor}x its running "
           "mean; the update was skipped (optim.loss_spike_factor)")
    if step % t.log_every and step != start + 1:
      return
    elapsed = time.perf_counter() - window["start"]
    tps = window["steps"] * tokens_per_step / elapsed if elapsed > 0 and window["steps"] else float("nan")
    left = curriculum.remaining_tokens(run_stages, step, end) if staged else (end - step) * tokens_per_step
    eta = left / tps if tps > 0 else float("nan")
    mfu = metrics_lib.mfu(tps, flops_per_token, t.peak_flops_per_device, jax.device_count())
    extra = "".join(f" | {k} {host[k]:.3g}" for k in ("moe_max_load", "mla_max_logit", "qk_clip_heads")
                    if k in host)
    where = f" | {tag} | long docs {100 * long_share:.0f}%" if staged else ""
    _log(f"step {step}/{end}{where} | loss {host['loss']:.4f} | grad_norm {host['grad_norm']:.3g} | "
         f"tok/s {tps:,.0f} | MFU {100 * mfu:.2f}% | ETA {metrics_lib.format_eta(eta)}{extra}")
    window["start"], window["steps"] = time.perf_counter(), 0

  def evaluate(step: int) -> None:
    nonlocal evaluator
    if evaluator is None:
      evaluator = evals.Evaluator(cfg, shell)
    t0 = time.perf_counter()
    host = evaluator(state)
    if jax.process_index() == 0:
      with open(eval_path, "a") as eval_fh:
        eval_fh.write(json.dumps({"step": step, **extra_keys, **host}) + "\n")
    result.evals[step] = host
    shown = " | ".join(f"{k.removeprefix('eval/')} {v:.3g}" for k, v in host.items()
                       if k == "eval/loss" or k.startswith("eval/loss_by_pos/")
                       or k.startswith("eval/retrieval/"))
    _log(f"eval at step {step}" + (f" ({tag}, seq_len {cfg.data.seq_len:,})" if staged else "")
         + f" in {time.perf_counter() - t0:.1f}s: {shown}")

  pending = None   # (step, device metrics, padding fraction, long share) of the step in flight
  step = start
  while step < stage_end:
    if stop.signum is not None:
      result.stopped_by_signal = True
      _log(f"received signal {stop.signum}: saving a checkpoint at step {step} and exiting")
      break
    host_batch = next(data)
    pad_fraction = pipeline.padding_fraction(host_batch)
    state, step_metrics = train_step(state, layout.global_batch(host_batch))
    if pending is not None:
      record(*pending)
    pending = (step + 1, step_metrics, pad_fraction, data.long_doc_share)
    window["steps"] += 1
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
        record(*pending)   # never checkpoint a non-finite state
        pending = None
      ckpt.save(step, state, _all_hosts_data_state(data))
      last_saved = step
  if pending is not None:
    record(*pending)
  if step != last_saved:
    ckpt.save(step, state, _all_hosts_data_state(data), force=True)
  if staged and step == stage.end_step and step < end and not result.stopped_by_signal:
    ckpt.wait()
    seen = stage.start_tokens + (step - stage.start_step) * tokens_per_step
    _log(f"{tag} done at step {step:,} ({curriculum.tokens_label(seen)} tokens seen); "
         f"checkpoint at step {step} saved: end of stage")
  if step >= end or result.stopped_by_signal or stage.index == len(run_stages) - 1:
    result.fingerprint = params_fingerprint(state.params)     # the run's last stage
  data.close()
  del state
  return step
