"""The mesh search: every mesh of a device count, each with the largest batch that fits.

A mesh is (data, fsdp, expert, sequence, tensor) with tensor ≤ max_tensor and the product equal
to the device count; sequence must divide the sequence length. For each mesh the batch per
device doubles from 1 while the plan fits. Meshes the model does not divide are skipped. The
state layout is made once and sized per mesh (k3train/tools/plan/state.py).
"""

from __future__ import annotations

from k3train.parallel.mesh import MeshError
from k3train.tools.plan import budget
from k3train.tools.plan import state as state_lib


def divisors(n: int) -> list[int]:
  return [k for k in range(1, n + 1) if n % k == 0]


def meshes(num_devices: int, *, seq_len: int, max_tensor: int = 8):
  """Every mesh of `num_devices` with tensor ≤ max_tensor and sequence dividing seq_len."""
  for tensor in [t for t in divisors(num_devices) if t <= max_tensor]:
    for sequence in divisors(num_devices // tensor):
      if seq_len % sequence:
        continue
      for expert in divisors(num_devices // (tensor * sequence)):
        for data in divisors(num_devices // (tensor * sequence * expert)):
          fsdp = num_devices // (tensor * sequence * expert * data)
          yield dict(data=data, fsdp=fsdp, expert=expert, sequence=sequence, tensor=tensor)


def search(cfg, state, num_devices: int, *, rules_name: str, seq_len: int, remat: str,
           attention: str, device_memory_gib: float, margin: float,
           expert_capacity: float | None = None, max_tensor: int = 8,
           max_batch_per_device: int = 64, top: int = 10) -> list[budget.Plan]:
  """Fitting plans over all meshes of `num_devices`, each with the largest power-of-two batch
  per device that fits: most tokens per device first, then fewest replicas (data), then fewest
  sequence shards, then least memory. `state` is `builder.abstract_state(cfg)`."""
  layout = state if isinstance(state, state_lib.StateLayout) else \
      state_lib.state_layout(state, rules_name)
  found = []
  for sizes in meshes(num_devices, seq_len=seq_len, max_tensor=max_tensor):
    best, b = None, 1
    while b <= max_batch_per_device:
      try:
        p = budget.make_plan(cfg, layout, sizes, rules_name=rules_name, seq_len=seq_len,
                             batch_per_device=b, remat=remat, attention=attention,
                             device_memory_gib=device_memory_gib, margin=margin,
                             expert_capacity=expert_capacity)
      except MeshError:
        break
      if not p.fits:
        break
      best, b = p, b * 2
    if best is not None:
      found.append(best)
  found.sort(key=lambda p: (-p.dims.n, p.sizes["data"], p.sizes["sequence"], p.peak))
  return found[:top]


__all__ = ["divisors", "meshes", "search"]
