"""Faults a run must survive or stop on cleanly: non-finite updates, damaged checkpoints, bad
data (a stop when nothing is usable, a warning when much is skipped) and a checkpoint of another
config (refused before the model is built). Random kills: tests/train/test_preemption.py.

End-to-end cases reuse the one shared tiny config of tests/train/test_train.py (one compiled
step); checkpoint damage is mostly tested on small Checkpointer states, which need no model.
"""

import dataclasses
import glob
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from tests.configs import k3_tiny
from tests.train.test_train import EVERY, make_config
from k3train.train import builder, loop
from k3train.train import step as step_lib
from k3train.train.checkpoint import (Checkpointer, CheckpointMismatchError,
                                      NoIntactCheckpointError)


# --- non-finite parameters, optimizer state, gradient norm ---------------------------------


def _small_state(params, opt):
  f32, i32 = jnp.float32, jnp.int32
  return step_lib.TrainState(jnp.zeros((), i32), params, {"bias": jnp.zeros((2,), f32)}, opt,
                             jnp.zeros((), f32), jnp.zeros((), i32))


def test_nonfinite_flags_name_the_group_and_the_first_leaf():
  ok = _small_state({"a": jnp.ones((3,)), "b": jnp.ones((2,))}, {"mu": jnp.ones((3,))})
  flags = step_lib.nonfinite_check(ok, jnp.float32(1.0), jnp.bool_(False))
  assert float(flags["nonfinite"]) == 0 and float(flags["nonfinite_leaf"]) == -1
  bad = _small_state({"a": jnp.ones((3,)), "b": jnp.array([1.0, jnp.nan])}, {"mu": jnp.ones((3,))})
  flags = step_lib.nonfinite_check(bad, jnp.float32(1.0), jnp.bool_(False))
  assert int(flags["nonfinite"]) == 2                        # params only
  names = [".".join(map(str, (getattr(k, "name", getattr(k, "key", k)) for k in p)))
           for p, _ in jax.tree_util.tree_flatten_with_path(bad)[0]]
  assert names[int(flags["nonfinite_leaf"])] == "params.b"
  # Bad leaves in three groups, some of one shape: every group's bit is set, and the first bad
  # leaf in tree order is named.
  two = step_lib.TrainState(bad.step, {"a": jnp.ones((3,)), "b": jnp.array([1.0, jnp.nan])},
                            {"bias": jnp.array([0.0, jnp.inf])}, {"mu": jnp.array([0, jnp.nan, 0])},
                            bad.loss_ema, bad.skipped)
  flags = step_lib.nonfinite_check(two, jnp.float32(1.0), jnp.bool_(False))
  assert int(flags["nonfinite"]) == 2 + 4 + 8
  assert names[int(flags["nonfinite_leaf"])] == "params.b"
  late = step_lib.TrainState(bad.step, {"a": jnp.ones((3,)), "b": jnp.ones((2,))},
                             {"bias": jnp.zeros((2,))}, {"mu": jnp.array([0, jnp.inf, 0])},
                             bad.loss_ema, bad.skipped)
  flags = step_lib.nonfinite_check(late, jnp.float32(jnp.nan), jnp.bool_(False))
  assert int(flags["nonfinite"]) == 1 + 4 and names[int(flags["nonfinite_leaf"])] == "opt_state.mu"
  # The step checks all but the parameters and the optimizer state (the loop checks those before
  # each checkpoint): NaN parameters pass, NaN model state does not, and leaf indices stay the
  # whole state's.
  step_only = lambda state: step_lib.nonfinite_check(state, jnp.float32(1.0), jnp.bool_(False),
                                                     fields=step_lib.STEP_CHECKED_FIELDS)
  assert float(step_only(bad)["nonfinite"]) == 0 and float(step_only(bad)["nonfinite_leaf"]) == -1
  flags = step_only(two)
  assert int(flags["nonfinite"]) == 8 and names[int(flags["nonfinite_leaf"])] == "rest.bias"
  assert int(step_lib.state_nonfinite(two)["nonfinite"]) == 2 + 4 + 8
  # An infinite gradient norm stops the run, unless the loss-spike guard skipped that update.
  assert int(step_lib.nonfinite_check(ok, jnp.float32(jnp.inf), jnp.bool_(False))["nonfinite"]) == 1
  assert int(step_lib.nonfinite_check(ok, jnp.float32(jnp.inf), jnp.bool_(True))["nonfinite"]) == 0


def test_nan_optimizer_state_stops_the_run_before_its_checkpoint(tmp_path, monkeypatch):
  """NaN enters the AdamW moments before step 10's update: step 10's loss is still finite (it
  was computed from step 9's parameters), so only the in-step check can catch it, and step 10
  (a checkpoint step) must not be saved."""
  real_compile = builder.jit_train_step
  bad_step = 2 * EVERY

  def poisoned(*args):
    step_fn = real_compile(*args)
    def wrapped(state, batch):
      if int(state.step) == bad_step - 1:
        leaves, treedef = jax.tree.flatten(state.opt_state)
        i = next(i for i, x in enumerate(leaves) if x.ndim >= 1 and jnp.issubdtype(x.dtype, jnp.floating))
        leaves[i] = leaves[i].at[(0,) * leaves[i].ndim].set(jnp.nan)
        state = dataclasses.replace(state, opt_state=jax.tree.unflatten(treedef, leaves))
      return step_fn(state, batch)
    return wrapped

  monkeypatch.setattr(builder, "jit_train_step", poisoned)
  workdir = str(tmp_path)
  # The NaN moment makes its parameter NaN in the same update: both groups are named.
  with pytest.raises(loop.NonFiniteStateError, match=f"non-finite params, opt_state at step {bad_step} "):
    loop.train(make_config(), workdir)
  rows = open(os.path.join(workdir, "metrics.jsonl")).read().splitlines()
  assert len(rows) == bad_step - 1                               # step 10 was never recorded
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), make_config())
  assert ckpt.latest_step() == EVERY
  saved = ckpt.manager.restore(EVERY, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
  ckpt.close()
  for key, value in saved.items():                               # no checkpoint holds NaN
    assert np.all(np.isfinite(np.asarray(value, np.float64))), key


# --- damaged checkpoints -------------------------------------------------------------------


def _checkpoints(directory, steps=(5, 10)):
  """Checkpoints of a small state at `steps`: w = step everywhere."""
  cfg = k3_tiny.get_config()
  cfg.checkpoint.async_save = False
  cfg.checkpoint.max_to_keep = 5
  ckpt = Checkpointer(directory, cfg)
  for s in steps:
    ckpt.save(s, {"w": jnp.full((4096,), float(s)), "v": jnp.arange(7.0)}, {"batches": s}, force=True)
  ckpt.close()
  return cfg


def _like():
  return {"w": jnp.zeros((4096,)), "v": jnp.zeros((7,))}


def _largest_array_file(directory, step):
  files = [f for f in glob.glob(os.path.join(directory, str(step), "state", "**", "d", "*"), recursive=True)]
  return max(files, key=os.path.getsize)


@pytest.mark.parametrize("damage", ["truncated_array", "deleted_array", "deleted_metadata"])
def test_restore_moves_a_damaged_checkpoint_aside_and_uses_the_older_one(tmp_path, capsys, damage):
  directory = str(tmp_path)
  cfg = _checkpoints(directory)
  if damage == "truncated_array":
    path = _largest_array_file(directory, 10)
    with open(path, "r+b") as f:
      f.truncate(os.path.getsize(path) // 2)
  elif damage == "deleted_array":
    os.remove(_largest_array_file(directory, 10))
  else:
    os.remove(os.path.join(directory, "10", "state", "_METADATA"))
  ckpt = Checkpointer(directory, cfg)
  state, data_state = ckpt.restore(ckpt.latest_step(), _like())
  ckpt.close()
  assert ckpt.restored_step == 5 and data_state == {"batches": 5}
  np.testing.assert_array_equal(np.asarray(state["w"]), np.full((4096,), 5.0))
  assert os.path.isdir(os.path.join(directory, "10.damaged"))
  assert not os.path.exists(os.path.join(directory, "10"))
  lines = [l for l in capsys.readouterr().err.splitlines() if "step 10 is damaged" in l]
  assert len(lines) == 1 and "10.damaged" in lines[0], lines


@pytest.mark.parametrize("damage", ["truncated_data_iter", "empty_folder"])
def test_latest_step_skips_damaged_metadata_and_empty_step_folders(tmp_path, capsys, damage):
  directory = str(tmp_path)
  cfg = _checkpoints(directory)
  if damage == "truncated_data_iter":
    path = os.path.join(directory, "10", "data_iter", "metadata")
    text = open(path).read()
    open(path, "w").write(text[:len(text) // 2])
    damaged = 10
  else:
    os.makedirs(os.path.join(directory, "15"))
    damaged = 15
  os.makedirs(os.path.join(directory, "notes"))                   # a stray folder: warned, ignored
  ckpt = Checkpointer(directory, cfg)
  newest = ckpt.latest_step()
  expected = 5 if damage == "truncated_data_iter" else 10
  assert newest == expected
  state, _ = ckpt.restore(newest, _like())
  ckpt.close()
  assert float(state["w"][0]) == expected
  assert os.path.isdir(os.path.join(directory, f"{damaged}.damaged"))
  err = capsys.readouterr().err
  assert f"checkpoint at step {damaged} is damaged" in err
  assert "ignoring" in err and "notes" in err


def test_no_intact_checkpoint_stops_and_lists_what_was_tried(tmp_path):
  directory = str(tmp_path)
  cfg = _checkpoints(directory)
  for s in (5, 10):
    os.remove(os.path.join(directory, str(s), "config", "metadata"))
  ckpt = Checkpointer(directory, cfg)
  with pytest.raises(NoIntactCheckpointError, match="tried: step 10: .*; step 5: "):
    ckpt.latest_step()
  ckpt.close()
  ckpt = Checkpointer(directory, cfg)           # a rerun does not silently start over either
  with pytest.raises(NoIntactCheckpointError, match="moved them aside"):
    ckpt.latest_step()
  ckpt.close()


def test_a_different_state_tree_is_refused_with_a_short_summary(tmp_path):
  directory = str(tmp_path)
  cfg = _checkpoints(directory, steps=(5,))
  like = dict(_like(), **{f"opt_state.1.mu.layer{i}": jnp.zeros((2,)) for i in range(300)})
  ckpt = Checkpointer(directory, cfg)
  with pytest.raises(CheckpointMismatchError) as err:
    ckpt.restore(5, like)
  ckpt.close()
  message = str(err.value)
  assert "300 entries missing" in message and "opt_state.1 (300)" in message
  assert len(message) < 600 and "\n" not in message
  assert os.path.isdir(os.path.join(directory, "5"))             # a mismatch is not damage


def test_a_run_resumes_past_a_truncated_latest_checkpoint(tmp_path):
  workdir = str(tmp_path)
  loop.train(make_config(), workdir, stop_at_step=2 * EVERY)
  directory = os.path.join(workdir, "checkpoints")
  path = _largest_array_file(directory, 2 * EVERY)
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)
  result = loop.train(make_config(), workdir, stop_at_step=2 * EVERY + 2)
  assert result.start_step == EVERY and result.end_step == 2 * EVERY + 2
  assert os.path.isdir(os.path.join(directory, f"{2 * EVERY}.damaged"))


# --- a source with no usable documents -----------------------------------------------------


def _all_bad_jsonl(tmp_path, lines=400):
  """Malformed JSON, empty text, a list, an object without "text": nothing to train on."""
  kinds = ['{not json', '{"text": ""}', '[1, 2]', '{"other": 1}']
  path = tmp_path / "bad.jsonl"
  path.write_text("".join(kinds[i % 4] + "\n" for i in range(lines)))
  return str(path)


def test_a_source_without_usable_documents_fails_naming_it_and_its_skips(tmp_path):
  from k3train.data import pipeline, sources
  cfg = k3_tiny.get_config()
  spec = f"jsonl:{_all_bad_jsonl(tmp_path)}"
  cfg.data.sources, cfg.data.weights, cfg.data.heldout_fraction = (spec,), (1.0,), 0.0
  cfg.data.max_unusable_records = 300
  data = pipeline.make_iterator(cfg.data, batch_size=2, seed=0)
  t0 = __import__("time").monotonic()
  with pytest.raises(sources.NoUsableDocumentsError) as err:
    next(data)
  data.close()
  message = str(err.value)
  assert message.startswith(f"data source {spec!r} gave no usable document in 300 records")
  assert "bad_record " in message and "empty_or_too_short " in message
  assert "data.max_unusable_records=300" in message
  assert __import__("time").monotonic() - t0 < 60


def test_a_stop_signal_ends_the_wait_for_a_usable_document(tmp_path):
  from k3train.data import pipeline, sources
  cfg = k3_tiny.get_config()
  spec = f"jsonl:{_all_bad_jsonl(tmp_path)}"
  cfg.data.sources, cfg.data.weights, cfg.data.heldout_fraction = (spec,), (1.0,), 0.0
  cfg.data.max_unusable_records = 10 ** 9
  data = pipeline.make_iterator(cfg.data, batch_size=2, seed=0)
  sources.STOP_WAITING.set()                  # what the train loop's SIGTERM handler does
  try:
    with pytest.raises(sources.NoUsableDocumentsError, match="stopped by a signal"):
      next(data)
  finally:
    sources.STOP_WAITING.clear()
    data.close()


# --- start-up errors: one line, exit code 2, nothing written -------------------------------


def _main(tmp_path, *args):
  import subprocess
  import sys
  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  return subprocess.run([sys.executable, "-m", "k3train.main", "--config=configs/k3_tiny.py",
                         "--compilation_cache_dir=", *args], cwd=repo, capture_output=True,
                        text=True, timeout=300)


def test_a_file_given_as_workdir_is_refused_in_one_line(tmp_path):
  path = tmp_path / "afile"
  path.write_text("x")
  out = _main(tmp_path, f"--workdir={path}")
  assert out.returncode == 2, out.stderr
  assert out.stderr.splitlines() == [
      f"python -m k3train.main: error: --workdir={path} is a file; give a directory (new or from "
      "an earlier run)"]


def test_an_unknown_data_source_is_refused_before_anything_is_written(tmp_path):
  workdir = tmp_path / "run"
  out = _main(tmp_path, f"--workdir={workdir}", "--config.data.sources=('nosuch',)",
              "--config.data.weights=(1.0,)")
  assert out.returncode == 2, out.stderr
  lines = out.stderr.splitlines()
  assert len(lines) == 1, lines
  assert lines[0].startswith("python -m k3train.main: error: ") and "unknown data source 'nosuch'" in lines[0]
  assert not workdir.exists()


# --- a source that skips much of what it reads: a warning, not a stop -------------------------


def _counters(counters_by_spec):
  """DataIterator.metrics()-style counters from {spec: (read, skipped, bad_record)}."""
  out = {}
  for spec, (read, skipped, bad) in counters_by_spec.items():
    out.update({f"records/{spec}/read": float(read), f"records/{spec}/skipped": float(skipped),
                f"errors/{spec}/bad_record": float(bad)})
  return out


def test_skip_warnings_come_once_over_the_threshold_and_again_only_on_a_rise():
  warn = loop.SkipWarnings(0.1)
  specs = ("jsonl:/data/bad.jsonl", "python_stdlib")
  assert warn(_counters({specs[0]: (40, 30, 30)}), specs) == []          # too few records to judge
  first = warn(_counters({specs[0]: (100, 62, 62), specs[1]: (500, 0, 0)}), specs)
  assert first == ["warning: data source jsonl:/data/bad.jsonl skipped 62% of records (62 of 100 "
                   "read; bad_record 62) — over data.skip_warn_fraction=0.1"]
  assert warn(_counters({specs[0]: (200, 124, 124)}), specs) == []       # the same rate: quiet
  assert warn(_counters({specs[0]: (300, 210, 210)}), specs) == []       # 70%: less than 10 points up
  assert len(warn(_counters({specs[0]: (400, 290, 290)}), specs)) == 1   # 72.5%: 10 points up
  assert loop.SkipWarnings(1.0)(_counters({specs[0]: (100, 100, 100)}), specs) == []   # 1: never


def _mostly_bad_jsonl(path, records=1200):
  """Three malformed lines for every short, valid document."""
  path.write_text("".join(f'{{"text": "x = {i} + {i} * 2"}}\n' if i % 4 == 0 else "{not json\n"
                          for i in range(records)))
  return str(path)


def test_a_source_that_skips_most_records_gets_a_warning_naming_it(tmp_path, capsys):
  from tests.train.test_preemption import make_config as small_config
  bad = f"jsonl:{_mostly_bad_jsonl(tmp_path / 'bad.jsonl')}"
  clean = tmp_path / "clean.jsonl"
  clean.write_text("".join(f'{{"text": "y = {i} - 1"}}\n' for i in range(400)))
  cfg = small_config()
  cfg.data.sources, cfg.data.weights = (bad, f"jsonl:{clean}"), (0.5, 0.5)
  cfg.data.heldout_fraction = 0.0
  workdir = str(tmp_path / "run")
  loop.train(cfg, workdir, stop_at_step=12)
  err = capsys.readouterr().err
  lines = [l for l in err.splitlines() if "skip_warn_fraction" in l]
  assert lines and all(l.startswith(f"warning: data source {bad} skipped ") for l in lines), err
  pattern = re.compile(r"skipped (\d+)% of records \((\d+) of (\d+) read; bad_record (\d+)\) — "
                       r"over data.skip_warn_fraction=0.1$")
  pct, skipped, read, bad_records = map(int, pattern.search(lines[0]).groups())
  assert skipped == bad_records and read >= loop.SkipWarnings.MIN_RECORDS
  assert pct == round(100 * skipped / read) and pct > 50
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  assert any(r.get(f"data/skipped/{bad}/bad_record") == bad_records for r in rows)
  assert all(r.get(f"data/skipped/jsonl:{clean}") == 0 for r in rows)


# --- a checkpoint written with another config: refused before anything is built ------------


def _files(directory):
  return {os.path.join(root, name): os.stat(os.path.join(root, name)).st_mtime_ns
          for root, _, names in os.walk(directory) for name in names}


def test_a_checkpoint_of_another_config_is_refused_before_the_model_is_built(tmp_path, capsys,
                                                                            monkeypatch):
  from k3train import main as main_lib
  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  workdir = tmp_path / "run"
  cfg = k3_tiny.get_config()                    # what --config=configs/k3_tiny.py loads
  cfg.checkpoint.async_save = False
  ckpt = Checkpointer(str(workdir / "checkpoints"), cfg)
  ckpt.save(10, {"w": jnp.ones((2,))}, {"batches": 10}, force=True)
  ckpt.close()
  before = _files(workdir)

  def no_build(*args, **kwargs):
    raise AssertionError("the model was built")

  monkeypatch.setattr(builder, "build", no_build)
  code = main_lib.main(["k3train.main", f"--config={repo}/configs/k3_tiny.py", f"--workdir={workdir}",
                        "--compilation_cache_dir=", "--config.optim.optimizer=muon",
                        "--config.model.moe.top_k=3"])
  err = capsys.readouterr().err.splitlines()
  assert code == 2
  assert err[0] == (
      f"python -m k3train.main: error: the checkpoint at {workdir}/checkpoints (step 10) was "
      "written with a different config (2 keys differ): model.moe.top_k (checkpoint 2, now 3), "
      "optim.optimizer (checkpoint 'adamw', now 'muon'). Use a new --workdir, or restore the "
      "original config values.")
  assert len(err) == 1
  assert _files(workdir) == before                # nothing written, moved or removed


def test_resume_allows_settings_without_state_and_refuses_model_changes():
  # A workdir's saved config against the current one: the remat policy and the QB rounds change
  # what is computed, not the state, so a resume may change them; a model shape may not.
  from k3train.train import checkpoint
  saved = {"model": {"remat_policy": "full", "moe": {"qb_rounds": 4, "top_k": 2}},
           "optim": {"optimizer": "adamw"}}
  current = {"model": {"remat_policy": "selective", "moe": {"qb_rounds": 2, "top_k": 2}},
             "optim": {"optimizer": "adamw"}}
  assert checkpoint.config_diffs(saved, current) == []
  current["model"]["moe"]["top_k"] = 3
  assert checkpoint.config_diffs(saved, current) == [("model.moe.top_k", 2, 3)]
