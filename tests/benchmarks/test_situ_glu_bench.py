"""benchmarks/situ_glu.py on CPU at tiny shapes: its rows and its error check."""

from __future__ import annotations

import json

from tests.benchmarks import scripts


def test_rows_and_errors(capsys):
  bench = scripts.load("situ_glu")
  assert bench.main([bench.PROG, "--scaled_shapes=64x48", "--shapes=32x32", "--iters=1",
                     "--tail_shapes=64x32x16x4"]) == 0
  rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()
          if line.startswith("{")]
  assert [(r["shape"], r["row_scale"], r["path"]) for r in rows] == [
      ("64x48", True, "xla"), ("32x32", False, "xla"),
      ("64x32x16x4", True, "tail:xla")]                        # no GPU: no kernel paths
  tail = rows.pop()
  assert tail["fwd_ms"] > 0 and tail["train_ms"] > 0 and tail["grad_err_vs_tail_xla"] == {}
  for r in rows:
    assert r["fwd_ms"] > 0 and r["train_ms"] > 0
    errors = r["max_err_rel_to_max"]
    assert set(errors) == ({"h", "dg", "du", "dr"} if r["row_scale"] else {"h", "dg", "du"})
    assert max(v for k, v in errors.items() if k != "dr") <= 2.0 ** -8   # one bf16 rounding
    assert errors.get("dr", 0.0) < 1e-5                                  # an fp32 sum
