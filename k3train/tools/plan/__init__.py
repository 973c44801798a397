"""Per-device memory plan of a training run on a mesh: does it fit? Nothing is allocated.

  python -m k3train.tools.plan --config=configs/k3_full.py --devices=1024 --device_memory=139 \\
      --mesh=data=1,fsdp=-1,expert=2,sequence=1,tensor=8 --rules=full --seq_len=4096 \\
      --batch_per_device=1 --remat=full
  python -m k3train.tools.plan --config=configs/k3_full.py --devices=4096 --device_memory=139 \\
      --seq_len=131072 --search            # the meshes that fit, most tokens per device first

The pieces:

  state.py         per-device bytes of parameters, model variables and optimizer state, from the
                   run's own shapes (`builder.abstract_state`) and rule table (exact)
  activations.py   the activation estimate and its assumptions (analytic)
  budget.py        gradients, gathered weights, optimizer transient; the peak per phase
  search.py        the meshes of a device count that fit
  stages.py        one plan per curriculum stage (train.use_stages), and the run's start check
  __main__.py      the command line

From Python:

    state = builder.abstract_state(cfg)
    p = plan.make_plan(cfg, state, sizes, rules_name="full", seq_len=4096, batch_per_device=1,
                       remat="full", device_memory_gib=139)
    print(plan.format_plan(p)); p.fits
"""

from __future__ import annotations

from k3train.parallel.mesh import MESH_AXES, MeshError
from k3train.tools.plan.activations import (Activations, Cost, Dims, activation_dims, estimate,
                                            expert_rows, layer_cost, layer_costs)
from k3train.tools.plan.budget import GiB, Plan, format_plan, make_plan, plan_json
from k3train.tools.plan.search import search
from k3train.tools.plan.stages import (format_stage_line, preflight, stage_json, stage_plans)
from k3train.tools.plan.state import (StateBytes, StateLayout, abstract_mesh, state_bytes,
                                      state_layout)


def parse_mesh(text: str) -> dict[str, int]:
  """'data=1,fsdp=-1,tensor=8' → {'data': 1, 'fsdp': -1, 'tensor': 8} (axes not named: 1)."""
  sizes = {}
  for part in filter(None, (p.strip() for p in text.split(","))):
    name, eq, value = part.partition("=")
    if not eq or name not in MESH_AXES:
      raise MeshError(f"--mesh entry {part!r}: expected AXIS=SIZE with AXIS in {MESH_AXES}")
    try:
      sizes[name] = int(value)
    except ValueError:
      raise MeshError(f"--mesh entry {part!r}: size must be an integer") from None
  return sizes


__all__ = ["Activations", "Cost", "Dims", "GiB", "Plan", "StateBytes", "StateLayout",
           "abstract_mesh", "activation_dims", "estimate", "expert_rows", "format_plan",
           "format_stage_line", "layer_cost", "layer_costs", "make_plan", "parse_mesh",
           "plan_json", "preflight", "search", "stage_json", "stage_plans", "state_bytes",
           "state_layout"]
