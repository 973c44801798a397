"""benchmarks/short_conv.py on CPU at a tiny shape: its rows, and what its error check tells
apart (fp32 sums against the bf16 baseline's)."""

from __future__ import annotations

import json

from tests.benchmarks import scripts


def test_rows_and_the_error_check(capsys):
  bench = scripts.load("short_conv")
  assert bench.main([bench.PROG, "--shapes=2x128x2x16", "--iters=1", "--docs=3"]) == 0
  rows = {r["path"]: r for r in (json.loads(line) for line in capsys.readouterr().out.splitlines()
                                 if line.startswith("{"))}
  assert set(rows) == {"bf16_taps", "xla"}          # no GPU: no kernel paths
  for r in rows.values():
    assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["shape"] == "2x128x2x16"
    assert set(r["max_err_rel_to_max"]) == {f"{k}_{b}" for k in ("y", "dx", "dw") for b in "qkv"}
  fp32, bf16 = rows["xla"]["max_err_rel_to_max"], rows["bf16_taps"]["max_err_rel_to_max"]
  assert max(fp32[f"dw_{b}"] for b in "qkv") < 1e-6
  assert max(bf16[f"dw_{b}"] for b in "qkv") > 1e-3
  assert max(fp32[f"y_{b}"] for b in "qkv") <= 2.0 ** -8
