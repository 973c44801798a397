"""python -m k3train.tools.eval on a tiny run's workdir: its held-out loss equals the loop's eval
at the same step (same sources, same batches, the same evaluation code), a source can be chosen
from the command line, and bad workdirs, sources and models are one-line errors (exit 2)."""

import json
import math

import pytest

from tests.configs import CONFIG_DIR, quick_flags
from tests.model.test_mtp import RUN_STEPS, tiny_mtp_run_argv
from k3train.tools import eval as eval_tool

TINY = str(CONFIG_DIR / "k3_tiny.py")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A 16-step run of the four-layer k3_tiny (MTP on) whose loop evaluated at its last step."""
  from k3train import main as main_lib
  workdir = tmp_path_factory.mktemp("run")
  assert main_lib.main(tiny_mtp_run_argv(workdir)) == 0
  with open(workdir / "eval_metrics.jsonl") as f:
    rows = [json.loads(line) for line in f]
  assert rows[-1]["step"] == RUN_STEPS
  return workdir, rows[-1]


def run_tool(capsys, *argv):
  code = eval_tool.main(["eval", *argv])
  captured = capsys.readouterr()
  lines = captured.out.strip().splitlines()
  return code, (json.loads(lines[-1]) if code == 0 else None), captured.err


def test_eval_equals_the_loops_held_out_eval(run, capsys):
  workdir, row = run
  code, out, _ = run_tool(capsys, f"--workdir={workdir}")      # the checkpoint's own config
  assert code == 0
  assert out["step"] == RUN_STEPS
  # The same batches through the same compiled forward: equal up to fp32 summation (1e-6).
  assert math.isclose(out["loss"], row["eval/loss"], rel_tol=1e-6), (out["loss"], row["eval/loss"])
  assert out["tokens"] == row["eval/tokens"] > 0
  assert math.isclose(out["perplexity"], math.exp(out["loss"]), rel_tol=1e-12)
  source = out["sources"]["python_stdlib"]
  assert math.isclose(source["loss"], row["eval/loss/python_stdlib"], rel_tol=1e-6)
  assert source["tokens"] == row["eval/tokens/python_stdlib"]
  for bucket, loss in out["loss_by_pos"].items():
    assert math.isclose(loss, row[f"eval/loss_by_pos/{bucket}"], rel_tol=1e-6), bucket
  # The run's config given on the command line evaluates the same rows.
  code, again, _ = run_tool(capsys, f"--workdir={workdir}", f"--config={TINY}", *quick_flags(),
                            "--config.model.mtp.enabled=true")
  assert code == 0 and math.isclose(again["loss"], out["loss"], rel_tol=1e-6)


def test_eval_reads_the_source_and_batches_given(run, capsys):
  workdir, row = run
  code, out, _ = run_tool(capsys, f"--workdir={workdir}", f"--config={TINY}", *quick_flags(),
                          "--config.model.mtp.enabled=true", "--config.eval.sources=synthetic_text",
                          "--batches=2")
  assert code == 0
  assert list(out["sources"]) == ["synthetic_text"]
  assert out["tokens"] > row["eval/tokens"]        # two full batches of another source
  assert math.isfinite(out["loss"]) and out["loss"] != row["eval/loss"]


@pytest.mark.parametrize("case", ["missing", "empty", "source", "model"])
def test_errors_are_one_line(run, case, capsys, tmp_path):
  workdir, _ = run
  argv, message = {
      "missing": ([f"--workdir={tmp_path / 'nowhere'}"], "does not exist"),
      "empty": ([f"--workdir={tmp_path}"], "has no checkpoint"),
      "source": ([f"--workdir={workdir}", f"--config={TINY}", *quick_flags(),
                  "--config.model.mtp.enabled=true",
                  "--config.eval.sources=nosuch_source"], "unknown data source 'nosuch_source'"),
      "model": ([f"--workdir={workdir}", f"--config={TINY}", *quick_flags()], "model.mtp.enabled"),
  }[case]
  code, _, err = run_tool(capsys, *argv)
  assert code == 2
  lines = err.strip().splitlines()
  assert len(lines) == 1 and message in lines[0], err
  assert lines[0].startswith("python -m k3train.tools.eval: error: ")
