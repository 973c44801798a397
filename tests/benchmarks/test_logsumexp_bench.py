"""benchmarks/logsumexp.py on CPU at a tiny shape: its rows and their agreement with float64."""

from __future__ import annotations

import json

from tests.benchmarks import scripts


def test_rows_and_errors(capsys):
  bench = scripts.load("logsumexp")
  assert bench.main([bench.PROG, "--shapes=16x512", "--iters=1",
                     "--kernel_settings=2:128:4:2"]) == 0
  rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()
          if line.startswith("{")]
  assert [(r["shape"], r["path"]) for r in rows] == [
      ("16x512", "xla"), ("16x512", "pallas_gpu"), ("16x512", "pallas_gpu[2:128:4:2]")]
  for r in rows:
    assert r["ms"] > 0 and r["max_err"] < 1e-5
    # the logits' bytes over the time (both rounded in the record)
    assert abs(r["gb_per_s"] - 16 * 512 * 4 / (r["ms"] * 1e-3) / 1e9) <= 1e-3 + 1e-2 * r["gb_per_s"]
