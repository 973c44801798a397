"""benchmarks/attnres.py --lowering_sites: the AttnRes backward kernel's launcher is jitted, so a
program with many sites carries one Triton kernel body, called from each site (lowered for CUDA
on this host; nothing runs)."""

from __future__ import annotations

from tests.benchmarks import scripts


def test_many_sites_lower_one_kernel_body():
  bench = scripts.load("attnres")
  rows = {r["launcher"]: r for r in bench.lowering(1, 64, 128, num_slots=4, sites=5)}
  assert rows["jitted"]["triton_bodies"] == 1
  assert rows["inlined"]["triton_bodies"] == 5
  assert rows["jitted"]["module_mchars"] < rows["inlined"]["module_mchars"]
