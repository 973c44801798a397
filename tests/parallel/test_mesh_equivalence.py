"""The four-layer k3_tiny's loss and gradients (tests/configs.py QUICK_MODEL: every layer kind and
the scan) on seven 8-device CPU meshes equal the single-device values (one with gradient
accumulation over 2 micro-batches around expert and sequence parallelism, one with the AttnRes
backward kernel in interpret mode).

Runs `mesh_equivalence.py` in a subprocess with 8 host-platform devices (this pytest process has
one). Tolerances (fp32; sharding changes only reduction order): loss within 1e-6 relative, every
gradient within 1e-4 × the largest reference gradient (measured: ≤ 3e-6 ×). The compiled HLO must
show the intended communication: all-to-all where experts are split, collective-permute (conv
halo) and all-gather (KDA chunk-transition states) where the sequence is split.
"""

from __future__ import annotations

import os

import pytest

from tests.multidevice import run_json_lines

MESHES = {
    "fsdp=8": {},
    "fsdp=2,expert=4": {"all-to-all"},
    "data=2,tensor=2,expert=2": {"all-to-all"},
    "rules=long_context,fsdp=2,sequence=4": {"collective-permute", "all-gather"},
    "rules=long_context,sequence=8": {"collective-permute", "all-gather"},
    # Gradient accumulation (2 micro-batches in a scan) around expert and sequence parallelism.
    "rules=long_context,fsdp=2,expert=2,sequence=2,microbatches=2":
        {"all-to-all", "collective-permute", "all-gather"},
    # The AttnRes backward kernel (interpret mode) in its shard_map, inside the scan and remat.
    "rules=long_context,fsdp=2,sequence=4,attnres=pallas_gpu": {"collective-permute", "all-gather"},
}


@pytest.fixture(scope="module")
def results():
  script = os.path.join(os.path.dirname(__file__), "mesh_equivalence.py")
  proc, lines = run_json_lines(script, 8, MESHES, timeout=1800)
  assert proc.returncode == 0 and len(lines) == len(MESHES), proc.stderr[-3000:]
  return {r["mesh"]: r for r in lines}


@pytest.mark.parametrize("mesh", list(MESHES))
def test_loss_and_grads_match_one_device(results, mesh):
  r = results[mesh]
  assert abs(r["loss"] - r["loss_ref"]) <= 1e-6 * abs(r["loss_ref"]), r
  assert r["grad_err"] <= 1e-4 * r["grad_scale"], r
  for collective in MESHES[mesh]:
    assert r["collectives"][collective] > 0, (collective, r["collectives"])
