"""benchmarks/train_step.py on the four-layer k3_tiny (one timed step, no profile): its JSON line carries XLA's
memory analysis of the compiled step and the memory plan of the same config, and the two agree
where they measure the same thing.

The config is the one end-to-end config of tests/train/test_train.py (k3_tiny with QUICK_MODEL,
30 steps, a checkpoint every 5), so the step program is the one that test compiles (persistent
cache).
"""

from __future__ import annotations

import json
import os

import pytest

from tests.benchmarks import scripts
from tests.configs import quick_flags

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARGV = ["train_step.py", f"--config={os.path.join(REPO, 'configs', 'k3_tiny.py')}",
        "--config.train.steps=30", "--config.checkpoint.every_steps=5",
        "--config.metrics.vectors_every=10", *quick_flags(), "--steps=1", "--profile_steps=0"]


def _load_script():
  return scripts.load("train_step")


def _run(argv):
  """(the JSON row, the table's last line) of one in-process run of the benchmark."""
  import contextlib
  import io
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    code = _load_script().main(argv)
  lines = buf.getvalue().splitlines()
  assert code == 0, lines
  rows = [json.loads(line) for line in lines if line.startswith("{")]
  assert len(rows) == 1, lines
  return rows[0], lines[-1]


@pytest.fixture(scope="module")
def output():
  return _run(ARGV)


@pytest.mark.slow
def test_xla_memory_analysis_is_reported(output):
  row, _ = output
  assert "error" not in row, row.get("error")
  xla = row["xla_memory_gib"]
  assert xla is not None, "XLA:CPU reports a memory analysis"
  for key in ("arguments", "temporaries", "outputs", "total"):
    assert xla[key] > 0, (key, xla)
  assert 0 <= xla["aliased"] <= min(xla["arguments"], xla["outputs"]), xla
  # total = arguments + temporaries + outputs − aliased; each term is rounded to 4 significant
  # digits, so the sum agrees to 1e-3 relative.
  assert xla["total"] == pytest.approx(
      xla["arguments"] + xla["temporaries"] + xla["outputs"] - xla["aliased"], rel=1e-3)


@pytest.mark.slow
def test_plan_estimate_is_reported(output):
  row, _ = output
  planned = row["plan_memory_gib"]
  assert "error" not in planned, planned
  for key in ("parameters", "optimizer_state", "gradients", "saved_activations", "total"):
    assert planned[key] > 0, (key, planned)
  assert set(planned["phases"]) == {"forward", "backward", "optimizer"}
  # The plan's total is its peak: the largest phase (4-significant-digit rounding).
  assert planned["total"] == pytest.approx(max(planned["phases"].values()), rel=1e-3)


@pytest.mark.slow
def test_plan_and_xla_agree(output):
  row, table_line = output
  xla, planned = row["xla_memory_gib"], row["plan_memory_gib"]
  # Two independent counts of the train state: the plan sums parameter / variable / optimizer
  # leaves from the abstract state and the rule table; XLA's aliased bytes are the donated state
  # buffers of the update program (the state plus a few scalars: step, loss EMA, skip count).
  # The gradient program takes the same state donated and hands it on (aliased), with gradients.
  state = planned["parameters"] + planned["model_variables"] + planned["optimizer_state"]
  gradients, update = xla["programs"]["gradients"], xla["programs"]["update"]
  assert update["aliased"] == pytest.approx(state, rel=0.02), (xla, planned)
  assert gradients["aliased"] == pytest.approx(state, rel=0.02), (xla, planned)
  assert gradients["arguments"] > state * 0.999, xla
  assert gradients["outputs"] - gradients["aliased"] >= planned["gradients"] * 0.999, (xla, planned)
  # The row is the program with the larger total: the gradient program (activations).
  assert xla["total"] == gradients["total"] > update["total"], xla
  # Totals: the plan models GPU fusion (elementwise intermediates fused away), XLA:CPU keeps more
  # of them in temporaries; this config measured plan / XLA = 0.73 on CPU. A band of 0.25–4 still
  # catches a unit or per-device-vs-global mistake (factors of 1024 or the device count).
  assert row["plan_vs_xla"] == pytest.approx(planned["total"] / xla["total"], rel=1e-2)
  assert 0.25 <= row["plan_vs_xla"] <= 4, row["plan_vs_xla"]
  # The table's row repeats both totals and the ratio, then busy / idle ("-" unprofiled).
  cells = table_line.split()
  assert cells[0] == "base"
  assert float(cells[-4]) == pytest.approx(xla["total"], rel=1e-3)
  assert float(cells[-3]) == pytest.approx(planned["total"], rel=1e-3)
  assert float(cells[-2]) == pytest.approx(row["plan_vs_xla"], abs=1e-3)
  assert cells[-1] == "-" or "busy_ms_per_step" in row["profile"]


@pytest.mark.slow
def test_compile_only_compiles_the_same_step(output):
  """--compile_only lowers the step for the state as shapes (nothing initialised, no step run):
  XLA's memory analysis of that executable equals the concrete run's, term by term, so it is
  the same program, and the row has compile fields but no timing."""
  row, _ = _run([*ARGV, "--compile_only"])
  assert "error" not in row, row.get("error")
  assert row["compile_only"] and "step_s" not in row and row["compile_s"] > 0
  concrete, _ = output
  assert row["xla_memory_gib"] == concrete["xla_memory_gib"]
  assert row["kernels"] == concrete["kernels"]
  assert row["plan_memory_gib"]["total"] == concrete["plan_memory_gib"]["total"]
