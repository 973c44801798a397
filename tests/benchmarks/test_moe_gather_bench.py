"""benchmarks/moe_gather.py on CPU at a tiny shape: its rows and its bit-for-bit check."""

from __future__ import annotations

import json

from tests.benchmarks import scripts


def test_rows_and_the_kernel_equal_to_xla(capsys):
  bench = scripts.load("moe_gather")
  assert bench.main([bench.PROG, "--shapes=64x32x4", "--iters=1",
                     "--kernel_settings=4:16:1"]) == 0
  rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()
          if line.startswith("{")]
  assert [(r["shape"], r["path"]) for r in rows] == [
      ("64x32x4", "xla"), ("64x32x4", "pallas_gpu"), ("64x32x4", "pallas_gpu[4:16:1]")]
  for r in rows:
    assert r["gather_ms"] > 0 and r["train_ms"] > 0 and r["same_as_xla"] is True
