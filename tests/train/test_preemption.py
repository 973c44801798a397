"""Preemption: a run killed at random moments and restarted each time ends bit-identical.

Six interruptions land at random moments of a 60-step run with a checkpoint every 5 steps: each
of SIGKILL and SIGTERM once while a checkpoint is being written and twice after a random delay
once the process is stepping, in a shuffled order (every signal meets every kind of moment).
After each one the same command runs again on the same workdir, until one run finishes. The
final checkpoint's arrays and every metrics row must equal those of an uninterrupted run. The
kill plan comes from a fixed seed.

The model is k3_tiny cut down to two layers (KDA with a dense FFN, then MLA with MoE), 32-token
rows and batch 2 (about 20 steps a second on 2 CPU cores), so a restart takes a few seconds: compiled programs come from the shared
persistent cache (--compilation_cache_dir). The uninterrupted run goes on meanwhile, in the
background, through the same command.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import orbax.checkpoint as ocp

from k3train import config as config_lib
from k3train.train.checkpoint import Checkpointer
from k3train.train.writers import last_step
from tests.configs import k3_tiny

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 60
EVERY = 5
INTERRUPTIONS = 6
DELAYED = 2             # per signal, besides its one interruption during a checkpoint write
SEED = 1234
OVERRIDES = {
    "model.num_layers": 2, "model.mla_layers": (2,), "model.num_dense_layers": 1,
    "model.attn_res.block_size": 1, "data.seq_len": 32, "train.global_batch_size": 2,
    "train.steps": STEPS, "checkpoint.every_steps": EVERY, "metrics.tensorboard": False,
    "metrics.vectors_every": 0,
}
# Row keys that measure time, not training: they differ between any two runs.
TIMING_KEYS = {"time", "step_time_s", "tokens_per_s", "mfu", "compile_s", "checkpoint_save_s"}
POLL_S = 0.01
START_TIMEOUT_S = 300      # a cold compilation cache makes the first start slow


def make_config():
  """The config `command` runs: k3_tiny with OVERRIDES (also a quick model for other tests)."""
  cfg = k3_tiny.get_config()
  for dotted, value in OVERRIDES.items():
    *parents, key = dotted.split(".")
    node = cfg
    for name in parents:
      node = node[name]
    node[key] = value
  return config_lib.validate(cfg)


def command(workdir, cache_dir):
  """The training command line (the same for every run on a workdir)."""
  return [sys.executable, "-m", "k3train.main", "--config=configs/k3_tiny.py",
          f"--workdir={workdir}", f"--compilation_cache_dir={cache_dir}",
          *(f"--config.{key}={value}" for key, value in OVERRIDES.items())]


def kill_plan(rng):
  """(signal, moment) per interruption: SIGKILL and SIGTERM each once at "save" (as soon as a
  checkpoint write is in flight) and DELAYED times at a delay in seconds after stepping
  starts, shuffled."""
  plan = [(sig, moment) for sig in (signal.SIGKILL, signal.SIGTERM)
          for moment in ["save"] + [round(rng.uniform(0.0, 0.3), 2) for _ in range(DELAYED)]]
  rng.shuffle(plan)
  assert len(plan) == INTERRUPTIONS
  return plan


def rows_written(workdir):
  """The step of metrics.jsonl's last complete row (0 before the first)."""
  return last_step(os.path.join(workdir, "metrics.jsonl")) or 0


def save_in_flight(workdir):
  directory = os.path.join(workdir, "checkpoints")
  return os.path.isdir(directory) and any(".orbax-checkpoint-tmp" in n for n in os.listdir(directory))


def finished(workdir):
  return os.path.isdir(os.path.join(workdir, "checkpoints", str(STEPS)))


def wait_for(condition, proc, timeout_s):
  """Polls `condition` while `proc` runs; True once it holds, False when proc ended first."""
  deadline = time.monotonic() + timeout_s
  while proc.poll() is None and time.monotonic() < deadline:
    if condition():
      return True
    time.sleep(POLL_S)
  return False


def interrupt(proc, workdir, sig, moment):
  """Sends `sig` at `moment` once the process writes a new metrics row (it is stepping and its
  SIGTERM handler is installed); False when the run ended before that."""
  seen = rows_written(workdir)
  if not wait_for(lambda: rows_written(workdir) > seen, proc, START_TIMEOUT_S):
    return False
  if moment == "save":
    if not wait_for(lambda: save_in_flight(workdir), proc, 60):
      return False
  else:
    time.sleep(moment)
  if proc.poll() is not None or finished(workdir):
    return False
  proc.send_signal(sig)
  return True


def landed(sig, returncode, workdir, log):
  """Whether the signal ended the run before it finished; fails on any other ending."""
  if returncode == 0 or finished(workdir):
    assert returncode in (0, -sig, 143), log
    return False
  expected = -signal.SIGKILL if sig == signal.SIGKILL else 143    # 143: stopped after saving
  assert returncode == expected, f"{sig.name} gave exit code {returncode}\n{log}"
  if sig == signal.SIGTERM:
    assert f"received signal {int(signal.SIGTERM)}" in log, log
  return True


def final_arrays(workdir):
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), make_config())
  step = ckpt.latest_step()
  state = ckpt.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
  ckpt.close()
  return step, {k: np.asarray(v) for k, v in state.items()}


def training_rows(workdir):
  """{step: row without its timing keys}; a step written twice fails."""
  rows = {}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      row = json.loads(line)
      assert row["step"] not in rows, f"step {row['step']} written twice"
      rows[row["step"]] = {k: v for k, v in row.items() if k not in TIMING_KEYS}
  return rows


def run_once(cmd, workdir, sig, moment, log_path):
  """One run of `cmd`, interrupted by `sig` at `moment`; True when that landed mid-run."""
  with open(log_path, "w") as log:
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
      sent = interrupt(proc, workdir, sig, moment)
      returncode = proc.wait(timeout=120)
    finally:
      if proc.poll() is None:
        proc.kill()
  text = log_path.read_text()
  if not sent:                                   # the run ended before the signal: cleanly
    assert returncode == 0, text
    return False
  return landed(sig, returncode, workdir, text)


def test_six_random_interruptions_end_bit_identical(tmp_path, compilation_cache_dir):
  reference = str(tmp_path / "uninterrupted")
  workdir = str(tmp_path / "interrupted")
  cmd = command(workdir, compilation_cache_dir)
  with open(tmp_path / "uninterrupted.log", "w") as log:   # runs meanwhile, same command
    uninterrupted = subprocess.Popen(command(reference, compilation_cache_dir), cwd=REPO,
                                     stdout=log, stderr=subprocess.STDOUT)
  try:
    hits = [run_once(cmd, workdir, sig, moment, tmp_path / f"run{i}.log")
            for i, (sig, moment) in enumerate(kill_plan(random.Random(SEED)))]
    last = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert uninterrupted.wait(timeout=300) == 0, (tmp_path / "uninterrupted.log").read_text()
  finally:
    if uninterrupted.poll() is None:
      uninterrupted.kill()
  assert sum(hits) >= INTERRUPTIONS - 1, \
      f"only {sum(hits)} of {INTERRUPTIONS} interruptions landed mid-run: {hits}"
  assert last.returncode == 0, last.stdout[-3000:] + last.stderr[-3000:]
  assert "resumed from" in last.stdout
  assert not any(".orbax-checkpoint-tmp" in n for n in os.listdir(os.path.join(workdir, "checkpoints")))

  step_a, arrays_a = final_arrays(reference)
  step_b, arrays_b = final_arrays(workdir)
  assert step_a == step_b == STEPS
  assert arrays_a.keys() == arrays_b.keys()
  assert any(k.startswith("params.") for k in arrays_b)
  different = [k for k in arrays_a if not np.array_equal(arrays_a[k], arrays_b[k])]
  assert not different, f"{len(different)} arrays differ, e.g. {different[:5]}"
  # Every row, those of the interrupted runs and those after the last interruption alike.
  rows_a, rows_b = training_rows(reference), training_rows(workdir)
  assert sorted(rows_b) == list(range(1, STEPS + 1))
  assert rows_b == rows_a
