"""The staged context curriculum (train.stages): stage configs, the learning-rate segments, bad
stage lists refused naming the stage and the key, the per-stage memory plan, and the acceptance
run: k3_tiny through 128 → 256 → 512 tokens on 4 CPU devices (sequence 1 → 2 → 4), killed right
after a boundary checkpoint and rerun, equals an uninterrupted run bit for bit."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys

import ml_collections
import numpy as np
import pytest

from k3train import cli
from k3train import config as config_lib
from k3train import defaults
from k3train.optim.optimizer import learning_rate_schedule
from tests.conftest import CACHE_DIR, xla_flags
from tests.configs import k3_full, k3_tiny

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(REPO, "configs", "k3_tiny.py")
FULL = os.path.join(REPO, "configs", "k3_full.py")


def tiny_stages_config():
  cfg = k3_tiny.get_config()
  cfg.train.use_stages = True
  return cfg


# --- stage configs -------------------------------------------------------------------------


def test_tiny_curriculum_keeps_tokens_per_step_and_chains_the_stages():
  cfg = config_lib.validate(tiny_stages_config())
  stages = config_lib.stages(cfg)
  assert [s.name for s in stages] == ["short_128", "mid_256", "long_512"]
  assert [(s.start_step, s.end_step) for s in stages] == [(0, 120), (120, 170), (170, 200)]
  assert [s.cfg.data.seq_len for s in stages] == [128, 256, 512]
  assert [s.cfg.train.global_batch_size for s in stages] == [4, 2, 1]          # batch halves
  assert {s.tokens_per_step for s in stages} == {512}
  assert [s.start_tokens for s in stages] == [0, 120 * 512, 170 * 512]
  assert stages[1].cfg.data.long_doc_weight == 4.0 and stages[2].cfg.data.long_doc_weight == 4.0
  assert stages[2].cfg.data.weights == (0.7, 0.1, 0.1, 0.1)
  assert stages[0].cfg.data.weights == (1.0, 0.0, 0.0, 0.0)                   # inherited
  assert not any(s.cfg.train.use_stages for s in stages)
  assert config_lib.run_end(cfg, stages) == 200
  assert [config_lib.stage_at(stages, k) for k in (0, 119, 120, 169, 170, 199, 200)] == \
      [0, 0, 1, 1, 2, 2, 2]
  # Off (the default): one stage, the config itself.
  plain = k3_tiny.get_config()
  (only,) = config_lib.stages(plain)
  assert only.cfg is plain and (only.start_step, only.end_step) == (0, plain.train.steps)


def test_lr_segments_are_one_warmup_stable_decay_schedule():
  """stable → decay → low: peak after the warmup through the decay start (step 120), linear to
  min_lr_ratio × peak at the decay end (170), then constant (fp32 schedule: 1e-6 relative)."""
  cfg = config_lib.validate(tiny_stages_config())
  o = cfg.optim
  peak, low, warmup = o.learning_rate, o.learning_rate * o.min_lr_ratio, o.warmup_steps

  def expected(s):
    if s < warmup:
      return peak * s / warmup
    if s <= 120:
      return peak
    if s <= 170:
      return peak - (peak - low) * (s - 120) / 50
    return low

  for stage in config_lib.stages(cfg):
    schedule = learning_rate_schedule(stage.cfg.optim, stage.cfg.train.steps)
    for s in range(stage.start_step, stage.end_step + 1):   # every stage builds the same schedule
      assert float(schedule(s)) == pytest.approx(expected(s), rel=1e-6, abs=1e-12), s


def test_k3_plan_is_the_maths_doc_plan():
  cfg = config_lib.validate(k3_full.get_config())
  stages = config_lib.stages(cfg)
  assert [s.cfg.data.seq_len for s in stages] == [4096, 32_768, 131_072, 524_288, 1_048_576]
  assert [s.cfg.train.global_batch_size for s in stages] == [2048, 256, 64, 16, 8]
  assert {s.tokens_per_step for s in stages} == {2048 * 4096}
  assert [s.cfg.parallel.sequence for s in stages] == [1, 4, 16, 64, 128]
  assert [s.lr for s in stages] == ["stable", "decay", "low", "low", "low"]
  assert stages[0].cfg.data.weights[1:] == (0.0, 0.0, 0.0)            # no synthetic data at 4K
  assert all(w > 0 for w in stages[2].cfg.data.weights)                # retrieval from 128K on
  assert stages[1].cfg.data.long_doc_weight > 1                         # long documents upsampled
  for a, b in zip(stages, stages[1:]):                                  # ends in tokens → steps
    assert a.end_step == b.start_step
    assert b.start_tokens == a.start_tokens + (a.end_step - a.start_step) * a.tokens_per_step
  assert stages[0].end_step == math.ceil(7_000_000_000_000 / (2048 * 4096))
  assert stages[-1].end_step == cfg.train.steps


# --- refusals ------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, where, key", [
    (["--config.train.stages[1].seq_len=300"], "train.stages[1] ('mid_256')", "global_batch_size"),
    (["--config.train.stages[1].until_step=100"], "train.stages[1] ('mid_256')", "until_step"),
    (["--config.train.stages[1].until_tokens=70000"], "train.stages[1] ('mid_256')", "until_step"),
    (["--config.train.stages[0].until_step=0"], "train.stages[0] ('short_128')", "until_step"),
    (["--config.train.stages[2].parallel.sequence=3"], "train.stages[2] ('long_512')", "seq_len"),
    (["--config.train.stages[1].microbatches=3"], "train.stages[1] ('mid_256')",
     "train.microbatches"),
    (["--config.train.stages[1].parallel.fsdp=4"], "train.stages[1] ('mid_256')",
     "global_batch_size"),
    (["--config.train.stages[2].weights=(1.0,)"], "train.stages[2] ('long_512')", "weights"),
    (["--config.train.stages[0].lr=low"], "train.stages[1] ('mid_256')", "lr"),
    (["--config.train.stages[1].lr=fast"], "train.stages[1] ('mid_256')", "lr"),
    (["--config.train.stages[2].name=mid_256"], "train.stages[2] ('mid_256')", "name"),
    (["--config.train.stages[1].long_doc_weight=0.5"], "train.stages[1] ('mid_256')",
     "long_doc_weight"),
    (["--config.optim.warmup_steps=150"], "train.stages[1] ('mid_256')", "lr"),
])
def test_bad_stage_lists_are_refused_at_start_naming_stage_and_key(overrides, where, key, capsys):
  args = cli.parse(["prog", f"--config={TINY}", "--config.train.use_stages=true", *overrides], "prog")
  err = capsys.readouterr().err
  assert args.exit_code == cli.USAGE_ERROR, err
  assert where in err and key in err, err
  assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_stage_overrides_from_the_command_line_reach_the_stage():
  args = cli.parse(["prog", f"--config={TINY}", "--config.train.use_stages=true",
                    "--config.train.stages[2].seq_len=1024", "--config.train.stages[2].until_step=190",
                    "--config.train.stages[2].global_batch_size=1"], "prog")
  assert args.exit_code is None
  last = config_lib.stages(args.config)[-1]
  assert (last.cfg.data.seq_len, last.cfg.train.global_batch_size) == (1024, 1)
  assert (last.start_step, last.end_step) == (170, 190)


def test_unknown_and_conflicting_stage_keys_are_refused():
  with pytest.raises(ValueError, match="colour"):
    defaults.curriculum_stage(name="a", colour=1)
  cfg = tiny_stages_config()
  extra = ml_collections.ConfigDict(dict(defaults.curriculum_stage(name="odd", until_step=5)))
  extra.colour = "red"
  cfg.train.stages = (extra,) + tuple(cfg.train.stages[1:])
  with pytest.raises(config_lib.ConfigError, match=r"train.stages\[0\] \('odd'\).colour"):
    config_lib.validate(cfg)
  cfg = tiny_stages_config()
  cfg.train.stages[0].until_tokens = 1000
  with pytest.raises(config_lib.ConfigError, match=r"\('short_128'\).until_step: give until_step or until_tokens"):
    config_lib.validate(cfg)


def test_a_stage_the_devices_cannot_hold_is_refused_before_anything_is_built(tmp_path):
  from k3train.train import loop
  cfg = config_lib.validate(tiny_stages_config())
  cfg.train.stages[2].parallel.sequence = 2                 # this process has one device
  with pytest.raises(config_lib.ConfigError, match=r"train.stages\[2\] \('long_512'\): cannot fill"):
    loop.train(cfg, str(tmp_path))
  assert not os.path.exists(tmp_path / "metrics.jsonl") or not open(tmp_path / "metrics.jsonl").read()


# --- the memory plan, stage by stage --------------------------------------------------------


def test_plan_prints_one_line_per_stage(capsys):
  from k3train.tools.plan import __main__ as plan_cli
  code = plan_cli.main(["plan", f"--config={TINY}", "--config.train.use_stages=true",
                        "--devices=1", "--device_memory=1"])
  out = capsys.readouterr().out.splitlines()
  assert code == 0
  lines = [l for l in out if l.startswith("stage ")]
  assert [l.split()[2] for l in lines] == ["'short_128':", "'mid_256':", "'long_512':"]
  assert all("FITS" in l for l in lines)
  code = plan_cli.main(["plan", f"--config={TINY}", "--config.train.use_stages=true",
                        "--devices=1", "--device_memory=1", "--json"])
  rows = [json.loads(l) for l in capsys.readouterr().out.splitlines()]
  assert [(r["stage"], r["seq_len"], r["global_batch"]) for r in rows] == \
      [("short_128", 128, 4), ("mid_256", 256, 2), ("long_512", 512, 1)]
  # A device too small: every stage's line says so and the exit code is 1.
  small = min(r["peak"] for r in rows) / 2 ** 30 * 0.5
  code = plan_cli.main(["plan", f"--config={TINY}", "--config.train.use_stages=true",
                        "--devices=1", f"--device_memory={small}"])
  lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("stage ")]
  assert code == 1 and len(lines) == 3 and all("DOES NOT FIT" in l for l in lines)


def test_k3_plan_fits_4096_h200s_stage_by_stage():
  r = subprocess.run([sys.executable, "-m", "k3train.tools.plan", f"--config={FULL}",
                      "--devices=4096", "--device_memory=139", "--json"],
                     capture_output=True, text=True, cwd=REPO, timeout=300)
  assert r.returncode == 0, r.stdout + r.stderr
  rows = [json.loads(l) for l in r.stdout.splitlines()]
  assert [row["seq_len"] for row in rows] == [4096, 32_768, 131_072, 524_288, 1_048_576]
  assert all(row["fits"] for row in rows)
  assert {row["global_batch"] * row["seq_len"] for row in rows} == {2048 * 4096}


def test_preflight_refuses_stages_that_do_not_fit():
  from k3train.tools import plan
  stages = config_lib.stages(config_lib.validate(tiny_stages_config()))
  logged = []
  with pytest.raises(config_lib.ConfigError, match=r"train.stages\[0\] \('short_128'\): peak"):
    plan.preflight(0.001, log=logged.append)(stages)
  assert len([l for l in logged if l.startswith("plan stage")]) == 3
  plan.preflight(1.0, log=logged.append)(stages)            # 1 GiB holds the tiny model
  skipped = []
  plan.preflight(None, log=skipped.append)(stages)          # CPU reports no memory limit
  assert skipped and "skipped" in skipped[0]


def test_preflight_keeps_the_configs_memory_margin_free():
  # The largest stage's planned peak fits in 95 % of the device's memory: refused with 10 % kept
  # free (the default train.memory_margin), run with 2 %; an explicit margin overrides the config.
  from k3train.tools import plan
  cfg = tiny_stages_config()
  peak = max(p.peak for _, p in plan.stage_plans(config_lib.validate(cfg), 1,
                                                  device_memory_gib=1.0, margin=0.0))
  memory = peak / 0.95 / plan.GiB
  with pytest.raises(config_lib.ConfigError, match=r"10% of [0-9.]+ GiB kept free.*"
                                                   r"train.memory_margin sets the share"):
    plan.preflight(memory, log=lambda _: None)(config_lib.stages(config_lib.validate(cfg)))
  cfg.train.memory_margin = 0.02
  stages = config_lib.stages(config_lib.validate(cfg))
  plan.preflight(memory, log=lambda _: None)(stages)
  with pytest.raises(config_lib.ConfigError, match="kept free"):
    plan.preflight(memory, margin=0.10, log=lambda _: None)(stages)
  cfg.train.memory_margin = 1.0
  with pytest.raises(config_lib.ConfigError, match=r"train.memory_margin.*\[0, 1\)"):
    config_lib.validate(cfg)


# --- acceptance: three stages on 4 devices, killed after a boundary, rerun -----------------


def _env():
  return dict(os.environ, XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=4"),
              K3TRAIN_TEST_COMPILATION_CACHE=CACHE_DIR, PYTHONPATH=REPO)


SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "curriculum_run.py")


def _result(stdout: str) -> dict:
  lines = [l for l in stdout.splitlines() if l.startswith('{"result"')]
  assert lines, stdout[-3000:]
  return json.loads(lines[-1])["result"]


def _rows(path):
  with open(path) as f:
    return [json.loads(l) for l in f]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("curriculum_full"))
  r = subprocess.run([sys.executable, SCRIPT, workdir], capture_output=True, text=True, env=_env(),
                     cwd=REPO, timeout=1200)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  return workdir, r.stdout, _result(r.stdout)


def test_three_stages_run_in_one_process_and_name_the_stage(uninterrupted):
  workdir, out, result = uninterrupted
  assert result["end_step"] == 6 and sorted(map(int, result["losses"])) == [1, 2, 3, 4, 5, 6]
  # The first step of every stage is finite (read at once, logged), and the changes are logged.
  assert set(result["first"]) == {"short_128", "mid_256", "long_512"}
  assert all(math.isfinite(v) for v in result["first"].values())
  for name, step in (("short_128", 1), ("mid_256", 3), ("long_512", 5)):
    assert f"stage {name}" in out and f"first step {step} loss" in out
  assert "short_128 (1/3) done at step 2" in out and "mid_256 (2/3) done at step 4" in out
  assert "mid_256 (2/3): restored step 2 onto the new mesh" in out
  meshes = [l for l in out.splitlines() if l.startswith("mesh: ")]
  assert [m.split()[2:6] for m in meshes] == [["fsdp=4", "expert=1", "sequence=1", "tensor=1"],
                                              ["fsdp=2", "expert=1", "sequence=2", "tensor=1"],
                                              ["fsdp=1", "expert=1", "sequence=4", "tensor=1"]]
  rows = _rows(os.path.join(workdir, "metrics.jsonl"))
  assert [(r["step"], r["stage"], r["seq_len"]) for r in rows] == [
      (1, "short_128", 128), (2, "short_128", 128), (3, "mid_256", 256), (4, "mid_256", 256),
      (5, "long_512", 512), (6, "long_512", 512)]
  assert all(0 <= r["long_doc_share"] <= 1 for r in rows)
  # Evals at each stage's end, at the stage's length: loss by position and retrieval accuracy.
  evals = _rows(os.path.join(workdir, "eval_metrics.jsonl"))
  assert [(e["step"], e["seq_len"]) for e in evals] == [(2, 128), (4, 256), (6, 512)]
  for e in evals:
    t = e["seq_len"]
    assert math.isfinite(e["eval/loss"]) and e["eval/loss"] < 9.0      # near log(4096) = 8.3
    assert f"eval/loss_by_pos/{t // 2}_{t}" in e and f"eval/tokens_by_pos/0_{t // 8}" in e
    assert sum(v for k, v in e.items() if k.startswith("eval/tokens_by_pos/")) == e["eval/tokens"]
    for task in ("passkey", "multikey", "vartrack"):
      assert 0.0 <= e[f"eval/retrieval/{task}"] <= 1.0


def test_killed_after_a_boundary_checkpoint_and_rerun_equals_the_uninterrupted_run(
    uninterrupted, tmp_path):
  full_dir, _, full = uninterrupted
  workdir = str(tmp_path)
  proc = subprocess.Popen([sys.executable, SCRIPT, workdir], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=_env(), cwd=REPO)
  seen = []
  for line in proc.stdout:
    seen.append(line)
    if "checkpoint at step 2 saved: end of stage" in line:
      proc.send_signal(signal.SIGKILL)                    # a crash right after the boundary
      break
  proc.wait(timeout=120)
  assert proc.returncode == -signal.SIGKILL, "".join(seen)[-3000:]
  r = subprocess.run([sys.executable, SCRIPT, workdir], capture_output=True, text=True, env=_env(),
                     cwd=REPO, timeout=1200)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  resumed = _result(r.stdout)
  assert resumed["start_step"] == 2 and "resumed from" in r.stdout and "at step 2 in stage mid_256" in r.stdout
  # The rerun starts in the second stage with its mesh, batch and data position: every loss,
  # every eval and every array of the final checkpoint equal the uninterrupted run's exactly.
  losses = {r["step"]: r["loss"] for r in _rows(os.path.join(workdir, "metrics.jsonl"))}
  assert losses == {int(k): v for k, v in full["losses"].items()}
  untimed = lambda rows: [{k: v for k, v in row.items() if k != "time"} for row in rows]  # wall clock
  assert untimed(_rows(os.path.join(workdir, "eval_metrics.jsonl"))) == \
      untimed(_rows(os.path.join(full_dir, "eval_metrics.jsonl")))
  assert resumed["checkpoint_step"] == full["checkpoint_step"] == 6
  assert resumed["digests"] == full["digests"]
  assert resumed["fingerprint"] == full["fingerprint"]
