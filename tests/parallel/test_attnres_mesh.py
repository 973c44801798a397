"""AttnRes sites under a mesh equal the single-device op: the pallas_gpu backward (interpret
mode) in its shard_map over batch and sequence, and the xla backend partitioned by XLA.

Runs `attnres_mesh.py` in a subprocess with 4 host-platform devices (this pytest process has
one). fp32; sharding changes only the order of the ∂L/∂w sums: every gradient within 1e-5 × the
largest. Neither program may gather the sources (no all-gather); the per-device ∂L/∂w partials are
summed by all-reduces.
"""

from __future__ import annotations

import os

import pytest

from tests.multidevice import run_json_lines

CASES = ("data=2,sequence=2 pallas_gpu", "fsdp=4 pallas_gpu", "data=2,sequence=2 xla")


@pytest.fixture(scope="module")
def results():
  script = os.path.join(os.path.dirname(__file__), "attnres_mesh.py")
  proc, lines = run_json_lines(script, 4, CASES, timeout=900)
  assert proc.returncode == 0 and len(lines) == len(CASES) + 1, proc.stderr[-3000:]
  return {r["case"]: r for r in lines}


@pytest.mark.parametrize("case", CASES)
def test_gradients_match_one_device(results, case):
  r = results[case]
  assert r["grad_err"] <= 1e-5 * r["grad_scale"], r
  assert r["collectives"]["all-gather"] == 0, r
  assert r["collectives"]["all-reduce"] >= 1, r


def test_a_split_model_width_runs_xla_or_refuses_the_kernel(results):
  r = results["embed split"]
  assert r["auto_grad_err"] <= 1e-5 * results[CASES[0]]["grad_scale"], r
  assert "splits `embed` over ('tensor',)" in r["pallas_gpu_error"], r
