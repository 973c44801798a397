"""KDA's short conv under a mesh equals the single-device op: the pallas_gpu backend (its backward
kernel in interpret mode) and the xla backend, in the conv's shard_map over batch, heads and
sequence.

Runs `conv_mesh.py` in a subprocess with 4 host-platform devices (this pytest process has one).
fp32; sharding changes only the order of the weight gradient's sums: every gradient within
1e-5 × the largest. No program may gather the activations (no all-gather: a kernel handed to the
SPMD partitioner gets its operands gathered onto every device); the weight gradient's per-device
sums are added by all-reduces, and a split sequence passes its halo by collective-permute.
"""

from __future__ import annotations

import os

import pytest

from tests.multidevice import run_json_lines

CASES = ("fsdp=4 pallas_gpu", "data=2,tensor=2 pallas_gpu", "data=2,sequence=2 pallas_gpu",
         "fsdp=4 xla")


@pytest.fixture(scope="module")
def results():
  script = os.path.join(os.path.dirname(__file__), "conv_mesh.py")
  proc, lines = run_json_lines(script, 4, CASES, timeout=900)
  assert proc.returncode == 0 and len(lines) == len(CASES), proc.stderr[-3000:]
  return {r["case"]: r for r in lines}


@pytest.mark.parametrize("case", CASES)
def test_gradients_match_one_device_without_gathering(results, case):
  r = results[case]
  assert r["grad_err"] <= 1e-5 * r["grad_scale"], r
  assert r["collectives"]["all-gather"] == 0, r
  assert r["collectives"]["all-reduce"] >= 1, r
  if "sequence" in case:
    assert r["collectives"]["collective-permute"] >= 1, r
