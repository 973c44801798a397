"""End-to-end training on CPU: the loss falls, resume is exact, SIGTERM checkpoints, NaN stops.

All runs share one config (so one compiled step, reused through the persistent cache):
k3_tiny cut to its four-layer form (tests/configs.py QUICK_MODEL: every layer kind and the
scan), 30 steps and a checkpoint every 5 steps.
"""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from tests.configs import k3_tiny, quick, quick_flags
from k3train.train import builder, loop
from k3train.train.checkpoint import Checkpointer, CheckpointMismatchError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 30
EVERY = 5


def make_config():
  cfg = quick(k3_tiny.get_config())
  cfg.train.steps = STEPS
  cfg.checkpoint.every_steps = EVERY
  cfg.metrics.vectors_every = 10      # per-layer expert loads at steps 10, 20, 30
  return cfg


def read_losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return {r["step"]: r["loss"] for r in rows}


def final_state(workdir, cfg):
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), cfg)
  step = ckpt.latest_step()
  restored = ckpt.manager.restore(step, args=__import__("orbax.checkpoint").checkpoint.args.Composite(
      state=__import__("orbax.checkpoint").checkpoint.args.StandardRestore()))["state"]
  ckpt.close()
  return step, {k: np.asarray(v) for k, v in restored.items()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  """One uninterrupted 30-step run; other tests compare against it."""
  workdir = str(tmp_path_factory.mktemp("full"))
  result = loop.train(make_config(), workdir)
  return workdir, result


def test_loss_falls_over_30_steps(uninterrupted):
  _, result = uninterrupted
  losses = result.losses
  assert sorted(losses) == list(range(1, STEPS + 1))
  assert all(np.isfinite(v) for v in losses.values())
  first = np.mean([losses[s] for s in range(1, 6)])
  last = np.mean([losses[s] for s in range(26, STEPS + 1)])
  # log(4096) = 8.32 at init (a model that learns nothing stays there); within 30 steps the
  # tiny model picks up token statistics and the loss falls by well over half a nat.
  assert first > 8.0
  assert last < first - 0.5, (first, last)
  assert losses[STEPS] < losses[1]


def test_checkpoints_hold_every_piece_of_state(uninterrupted):
  workdir, _ = uninterrupted
  step, state = final_state(workdir, make_config())
  assert step == STEPS
  assert int(state["step"]) == STEPS
  keys = set(state)
  assert any(k.startswith("params.") for k in keys)
  assert any(k.startswith("opt_state.") for k in keys)
  assert any(k.endswith("router.bias") for k in keys)          # QB biases survive a restart
  biases = [v for k, v in state.items() if k.endswith("router.bias")]
  assert any(np.abs(b).max() > 0 for b in biases)               # and QB has moved them


def test_interrupted_and_resumed_run_is_bit_identical(uninterrupted, tmp_path):
  full_dir, full = uninterrupted
  cfg = make_config()
  workdir = str(tmp_path)
  first = loop.train(cfg, workdir, stop_at_step=STEPS // 2)
  assert first.end_step == STEPS // 2
  second = loop.train(make_config(), workdir)
  assert second.start_step == STEPS // 2 and second.end_step == STEPS
  losses = read_losses(workdir)
  assert losses == full.losses                                  # bitwise: floats compare exactly
  _, state_a = final_state(full_dir, cfg)
  _, state_b = final_state(workdir, cfg)
  assert state_a.keys() == state_b.keys()
  for key in state_a:
    np.testing.assert_array_equal(state_a[key], state_b[key], err_msg=key)


def test_restore_refuses_a_different_model_config(uninterrupted, tmp_path):
  full_dir, _ = uninterrupted
  cfg = make_config()
  cfg.model.moe.top_k = 3
  with pytest.raises(CheckpointMismatchError, match="model.moe.top_k"):
    loop.train(cfg, full_dir)


def test_non_finite_loss_stops_with_the_step_and_saves_nothing_from_it(tmp_path, monkeypatch):
  real_compile = builder.jit_train_step
  bad_step = 7

  def poisoned(*args):
    step_fn = real_compile(*args)
    def wrapped(state, batch):
      new_state, metrics = step_fn(state, batch)
      if int(new_state.step) == bad_step:
        metrics = dict(metrics, loss=jax.numpy.float32(np.nan))
      return new_state, metrics
    return wrapped

  monkeypatch.setattr(builder, "jit_train_step", poisoned)
  with pytest.raises(loop.NonFiniteLossError, match=f"at step {bad_step}"):
    loop.train(make_config(), str(tmp_path))
  ckpt = Checkpointer(os.path.join(str(tmp_path), "checkpoints"), make_config())
  assert ckpt.latest_step() == EVERY                            # step 5 saved, nothing after the NaN
  ckpt.close()


def _main_command(workdir, cache_dir):
  return [sys.executable, "-m", "k3train.main", "--config=configs/k3_tiny.py", f"--workdir={workdir}",
          f"--config.train.steps={STEPS}", f"--config.checkpoint.every_steps={EVERY}",
          f"--compilation_cache_dir={cache_dir}", *quick_flags()]


def test_sigterm_saves_a_checkpoint_and_the_cli_resumes_exactly(uninterrupted, tmp_path,
                                                                 compilation_cache_dir):
  _, full = uninterrupted
  workdir = str(tmp_path)
  metrics = os.path.join(workdir, "metrics.jsonl")
  proc = subprocess.Popen(_main_command(workdir, compilation_cache_dir), cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  deadline = time.time() + 600
  while time.time() < deadline and proc.poll() is None:
    if os.path.exists(metrics) and len(open(metrics).readlines()) >= 2:
      break
    time.sleep(0.05)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=300)
  assert proc.returncode == 143, out   # stopped by signal after saving
  assert "received signal" in out, out
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), make_config())
  stopped_at = ckpt.latest_step()
  ckpt.close()
  assert stopped_at is not None and 2 <= stopped_at < STEPS, out

  resumed = subprocess.run(_main_command(workdir, compilation_cache_dir), cwd=REPO,
                           capture_output=True, text=True, timeout=900)
  assert resumed.returncode == 0, resumed.stdout + resumed.stderr
  assert f"resumed from" in resumed.stdout
  assert read_losses(workdir) == full.losses


def test_spike_guard_skips_only_spikes_and_keeps_its_mean():
  from k3train.train.step import spike_guard
  f32 = jax.numpy.float32
  skip, ema = spike_guard(f32(5.0), f32(0.0), factor=2.0, decay=0.9)      # first step: never skip
  assert not bool(skip) and float(ema) == 5.0
  skip, ema2 = spike_guard(f32(6.0), ema, factor=2.0, decay=0.9)          # normal step: blend
  assert not bool(skip) and abs(float(ema2) - (0.9 * 5.0 + 0.1 * 6.0)) < 1e-6
  skip, ema3 = spike_guard(f32(11.0), ema2, factor=2.0, decay=0.9)        # > 2 × 5.1: skip
  assert bool(skip) and float(ema3) == float(ema2)
  skip, _ = spike_guard(f32(1e9), ema2, factor=0.0, decay=0.9)            # guard off
  assert not bool(skip)


def test_checkpoint_config_check_allows_curriculum_stage_keys_only(tmp_path):
  import jax.numpy as jnp
  from tests.configs import k3_tiny
  cfg = k3_tiny.get_config()
  cfg.checkpoint.async_save = False
  ckpt = Checkpointer(str(tmp_path), cfg)
  ckpt.save(1, {"w": jnp.ones((2,))}, {"batches": 1}, force=True)
  ckpt.close()
  stage = k3_tiny.get_config()
  stage.data.seq_len, stage.data.weights = 256, (1.0,)     # a new curriculum stage: accepted
  Checkpointer(str(tmp_path), stage).check_config(1)
  other = k3_tiny.get_config()
  other.data.sources = ("synthetic_text",)                 # another dataset: refused, named
  with pytest.raises(CheckpointMismatchError, match="data.sources"):
    Checkpointer(str(tmp_path), other).check_config(1)


def test_tensorboard_equals_the_metrics_rows_and_the_report_renders(uninterrupted, tmp_path):
  """The uninterrupted run's TensorBoard scalars equal its JSONL rows (the float32 rounding of
  each value, the row's wall time to the microsecond); every step row carries the loop's meter,
  the optimizer's learning rate and per-group gradient norms that split the global norm; the
  expert-load vectors have one row per MoE layer; and the report draws its panels from the run."""
  from k3train.optim.optimizer import learning_rate_schedule
  from k3train.tools import report
  from k3train.train import writers
  from tests.train.test_writers import jsonl_scalars, tb_scalars, tensorboard_events
  workdir, result = uninterrupted
  logdir = os.path.join(workdir, writers.TENSORBOARD_DIR)
  expected, got = jsonl_scalars(workdir), tb_scalars(logdir)
  assert set(got) == set(expected)
  for key, (value, t) in expected.items():
    assert got[key][0] == np.float32(value), key
    assert abs(got[key][1] - t) < 1e-6, key

  cfg = make_config()
  rows = writers.read_rows(os.path.join(workdir, "metrics.jsonl"))
  assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
  assert {r["step"]: r["loss"] for r in rows} == result.losses
  schedule = learning_rate_schedule(cfg.optim, cfg.train.steps)
  flops = builder.model_size(cfg).flops_per_token
  for r in rows:
    assert r["step_time_s"] > 0
    assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["step_time_s"], rel=1e-12)
    assert r["mfu"] == pytest.approx(r["tokens_per_s"] * flops / cfg.train.peak_flops_per_device,
                                     rel=1e-12)
    assert r["lr"] == pytest.approx(float(schedule(r["step"] - 1)), rel=1e-6)   # fp32 schedule
    squares = sum(v ** 2 for k, v in r.items() if k.startswith("grad_norm/"))
    assert squares == pytest.approx(r["grad_norm"] ** 2, rel=1e-4)              # fp32 sums
    assert r["data/skipped/python_stdlib"] == 0 and 0 <= r["padding_fraction"] < 1
    assert r["router_bias_spread"] >= 0
  # Compile and checkpoint-save time are reported apart, never inside a step's time.
  assert [r["step"] for r in rows if "compile_s" in r] == [1]
  assert rows[0]["compile_s"] > rows[0]["step_time_s"]
  assert [r["step"] for r in rows if "checkpoint_save_s" in r] == [6, 11, 16, 21, 26]

  vectors = writers.read_vectors(os.path.join(workdir, writers.STREAM_FILES["vectors"]))
  assert [v["step"] for v in vectors] == [10, 20, 30]
  for v in vectors:
    assert v["rows"]["moe_load"] == loop.moe_layer_numbers(cfg.model)
    assert v["moe_load"].shape == (len(v["rows"]["moe_load"]), cfg.model.moe.num_experts)
    np.testing.assert_allclose(v["moe_load"].sum(axis=1), 1.0, rtol=1e-4)  # 6 significant digits
  tags = {v.tag for e in tensorboard_events(logdir) for v in e.summary.value}
  assert loop.moe_layer_numbers(cfg.model) == [2, 3, 4]          # layer 1 has the dense FFN
  assert {"moe_load/2", "moe_load/4", "moe_load/heatmap"} <= tags

  out = str(tmp_path / "report")
  assert report.main(["report", f"--workdir={workdir}", f"--out={out}"]) == 0
  drawn = {name[:-len(".png")] for name in os.listdir(out) if name.endswith(".png")}
  assert drawn == {pid for pid, _ in report.PANELS} - {"eval_details"}   # no evals in this run
  assert os.path.getsize(os.path.join(out, "index.html")) > 0
