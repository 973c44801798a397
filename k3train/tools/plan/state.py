"""Per-device bytes of the train state on a mesh: parameters, other model variables and
optimizer state. Nothing is allocated.

The shapes are the run's own: `builder.abstract_state(cfg)` (the real model and optimizer under
`eval_shape`). The layout of every leaf, i.e. which mesh axes split each of its dimensions, is
read once from the rule table:

  parameters, model variables   their logical axis names through `rules.logical_to_spec`, the
                                mesh-independent form of the spec a run's `spec_for` gives (the
                                axes of size 1 that `spec_for` leaves out divide nothing);
  optimizer leaves              `state_sharding.mirror_shardings`, the run's own matching of an
                                optimizer leaf to the parameter it mirrors (a leaf that mirrors
                                none is replicated).

On a mesh each leaf then takes shard shape × itemsize bytes on every device (all devices hold
equal shards), so one layout sizes the thousands of meshes of a search quickly. A dimension the
mesh does not divide fails through the run's own `spec_for`, with the MeshError a run gives
(naming the array, the dimension and the mesh axis). tests/tools/test_plan.py checks the bytes
against the NamedShardings a run builds (`nnx_state_shardings`, `mirror_shardings`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh

from k3train.model import moe
from k3train.parallel import axes as axes_lib
from k3train.parallel import rules as rules_lib
from k3train.parallel import state_sharding
from k3train.parallel.mesh import MESH_AXES, MeshError
from k3train.tree_paths import path_names

# Mesh axes that stay split inside a layer's computation; the weights are gathered over the rest.
KEPT_IN_COMPUTE = ("tensor", "expert")


def abstract_mesh(sizes: Mapping[str, int]) -> AbstractMesh:
  """A device-less mesh with the axes of k3train/parallel/mesh.py (resolved sizes)."""
  return AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES)


def unit_of(names: Sequence[str]) -> str:
  """The layer a parameter belongs to (weights are gathered layer by layer)."""
  if names[0] == "stack":
    return f"scanned layer {names[2]}"     # stack.layers.<i>: layer i of every super-block
  if names[0] in ("prefix", "suffix"):
    return f"{names[0]} layer {names[1]}"
  return names[0]


@dataclasses.dataclass(frozen=True)
class Leaf:
  """One state leaf and the mesh axes of each of its dimensions (independent of mesh sizes)."""
  group: str                          # "params" | "rest" | "opt"
  name: str                           # dotted path
  shape: tuple[int, ...]
  itemsize: int
  axes: tuple[tuple[str, ...], ...]   # mesh axes splitting each dimension
  logical: tuple | None = None        # params, rest: the Variable's logical axis names
  unit: str = ""                      # params: the layer it is gathered with
  mirrored: bool = True               # opt: mirrors a parameter (otherwise replicated)


@dataclasses.dataclass(frozen=True)
class StateLayout:
  """Every leaf of the train state under one rule recipe."""
  rules_name: str
  leaves: tuple[Leaf, ...]


@dataclasses.dataclass
class StateBytes:
  """Per-device bytes of the train state on one mesh."""
  params: int
  rest: int
  opt: int
  largest_opt_leaf: int                  # local bytes of the largest optimizer leaf
  replicated_opt: list[tuple[str, int]]  # optimizer leaves (≥ 2-D) that mirror no parameter
  units: dict[str, int]                  # parameters per layer on one device once gathered over
                                         # fsdp / sequence / data (tensor and expert stay split)
  expert_params: int = 0                 # local parameters of the routed-expert weights
  stack_params: int = 0                  # local bytes of the scanned stack's parameters
  stack_expert_params: int = 0           # local routed-expert parameters inside the stack


def _axes_of(spec) -> tuple[tuple[str, ...], ...]:
  return tuple((e,) if isinstance(e, str) else tuple(e or ()) for e in spec)


def state_layout(state, rules_name: str) -> StateLayout:
  """The layout of `state` (a `builder.AbstractState`) under the rule recipe `rules_name`."""
  rules = rules_lib.get_rules(rules_name)
  leaves, param_axes = [], []
  for group, tree in (("params", state.params), ("rest", state.rest)):
    for path, var in jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]:
      names = path_names(path)
      value = var.get_value()
      logical = axes_lib.names_of(var)
      axes = _axes_of(rules_lib.logical_to_spec(logical, rules)) if logical else \
          ((),) * len(value.shape)
      leaves.append(Leaf(group, ".".join(names), tuple(value.shape),
                         np.dtype(value.dtype).itemsize, axes, logical, unit_of(names)))
      if group == "params":
        param_axes.append(axes)
  # Which parameter each optimizer leaf mirrors: the run's matching, with parameter indices in
  # place of shardings (a leaf that matches none comes back as the replicated sharding).
  treedef = jax.tree_util.tree_structure(state.params)
  index_tree = jax.tree_util.tree_unflatten(treedef, list(range(treedef.num_leaves)))
  matched = jax.tree_util.tree_leaves(state_sharding.mirror_shardings(
      state.opt, state.params, index_tree, abstract_mesh({a: 1 for a in MESH_AXES})))
  for (path, x), hit in zip(jax.tree_util.tree_flatten_with_path(state.opt)[0], matched):
    mirrored = isinstance(hit, int)
    axes = param_axes[hit] if mirrored else ((),) * len(x.shape)
    leaves.append(Leaf("opt", ".".join(path_names(path)), tuple(x.shape),
                       np.dtype(x.dtype).itemsize, axes, mirrored=mirrored))
  return StateLayout(rules_name, tuple(leaves))


def _not_divisible(layout: StateLayout, leaf: Leaf, sizes: Mapping[str, int],
                   dim: int) -> MeshError:
  """The run's error for a leaf the mesh does not divide (from its own `spec_for`)."""
  if leaf.logical is not None:
    try:
      rules_lib.spec_for(leaf.logical, leaf.shape, rules_lib.get_rules(layout.rules_name),
                         abstract_mesh(sizes), what=f"parameter {leaf.name}")
    except MeshError as e:
      return e
  axes = leaf.axes[dim]
  return MeshError(f"{leaf.group} {leaf.name}: dimension {dim} (size {leaf.shape[dim]}) is not "
                   f"divisible by mesh axis " + " × ".join(f"{a}={sizes[a]}" for a in axes))


def state_bytes(layout: StateLayout, sizes: Mapping[str, int]) -> StateBytes:
  """Per-device bytes of the state on a mesh of resolved `sizes`; MeshError where the mesh does
  not divide a dimension."""
  totals = {"params": 0, "rest": 0, "opt": 0}
  largest, replicated, units, experts = 0, [], {}, 0
  stack, stack_experts = 0, 0
  for leaf in layout.leaves:
    local, kept = [], 1
    for dim, (size, axes) in enumerate(zip(leaf.shape, leaf.axes)):
      div = math.prod(sizes[a] for a in axes)
      if size % div:
        raise _not_divisible(layout, leaf, sizes, dim)
      local.append(size // div)
      kept *= math.prod(sizes[a] for a in axes if a in KEPT_IN_COMPUTE)
    b = math.prod(local) * leaf.itemsize
    totals[leaf.group] += b
    if leaf.group == "opt":
      largest = max(largest, b)
      if not leaf.mirrored and len(leaf.shape) >= 2:
        replicated.append((leaf.name, b))
    elif leaf.group == "params":
      count = math.prod(leaf.shape) // kept
      if leaf.unit.startswith("scanned"):
        count //= leaf.shape[0]                        # one scan iteration at a time
      units[leaf.unit] = units.get(leaf.unit, 0) + count
      in_stack = leaf.name.startswith("stack.")
      stack += b if in_stack else 0
      if moe.is_routed_expert_weight(tuple(leaf.name.split("."))):
        experts += math.prod(local)
        stack_experts += math.prod(local) if in_stack else 0
  return StateBytes(totals["params"], totals["rest"], totals["opt"], largest, replicated, units,
                    experts, stack, stack_experts)


__all__ = ["KEPT_IN_COMPUTE", "Leaf", "StateBytes", "StateLayout", "abstract_mesh", "state_bytes",
           "state_layout", "unit_of"]
