"""benchmarks/linear_output.py: its fp32-then-convert baseline and the model's direct-bf16 path
give the same outputs and gradients (within one bf16 rounding), and the script exits 0."""

from __future__ import annotations

from tests.benchmarks import scripts


def _script():
  return scripts.load("linear_output")


def test_both_paths_agree_within_one_bf16_rounding():
  rows = _script().measure(tokens=64, k=96, n=48, iters=1)
  assert [r["path"] for r in rows] == ["convert", "direct"]
  errors = rows[0]["max_err_rel_to_max"]
  assert set(errors) == {"y", "dx", "dw"}
  assert all(0 <= e <= 2**-7 for e in errors.values()), errors     # one bf16 ulp is 2^-8 relative
  assert all(r["agree"] for r in rows)


def test_command_line_exits_zero_when_the_paths_agree():
  assert _script().main(["--tokens=32", "--shapes=64x32", "--iters=1"]) == 0
