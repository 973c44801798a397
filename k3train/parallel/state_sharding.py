"""Explicit shardings for the train state (parameters, model variables, optimizer state) and batches.

Every nnx Variable carries logical axis names (`out_sharding` metadata); the active rule table turns
them into NamedShardings on the mesh. Optimizer-state leaves mirror parameters (momentum, Adam
moments): each takes the sharding of the parameter whose path is a suffix of its own path and
whose shape matches; scalars (step counts) are replicated.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from k3train.parallel import axes as ax
from k3train.parallel.rules import Rules, spec_for
from k3train.tree_paths import path_names

BATCH_KEYS_2D = ("tokens", "targets", "segment_ids", "positions", "loss_mask")
# Vision batch keys (data.vision.enabled) → logical names of their dims: a row's patches and
# grids stay on the devices of the row's batch shard (never split over `sequence`).
VISION_BATCH_KEYS = {
    "vision_patches": (ax.BATCH, ax.PATCHES, ax.PATCH_DIM),      # [B, P, 588] uint8
    "vision_grids": (ax.BATCH, ax.GRIDS, ax.GRID_FIELDS),         # [B, G, 3] int32
    "vision_grid_ids": (ax.BATCH, ax.PATCHES),                    # [B, P] int32
}


def variable_spec(path, var: nnx.Variable, rules: Rules, mesh: Mesh) -> P:
  """PartitionSpec of one Variable from its logical names (replicated when it has none)."""
  names = ax.names_of(var)
  shape = var.get_value().shape
  if names is None:
    return P()
  return spec_for(names, shape, rules, mesh, what=f"parameter {'.'.join(path_names(path))}")


def nnx_state_shardings(state: nnx.State, rules: Rules, mesh: Mesh) -> nnx.State:
  """An nnx.State of the same structure whose Variables hold NamedShardings (for jit/device_put)."""
  def one(path, var):
    return var.replace(NamedSharding(mesh, variable_spec(path, var, rules, mesh)))
  return jax.tree_util.tree_map_with_path(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def nnx_state_specs(state: nnx.State, rules: Rules, mesh: Mesh) -> dict[str, P]:
  """{'prefix.0.mixer.q_proj.kernel': PartitionSpec}: the readable table (golden files, plans)."""
  out = {}
  for path, var in jax.tree_util.tree_flatten_with_path(
      state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]:
    out[".".join(path_names(path))] = variable_spec(path, var, rules, mesh)
  return out


def mirror_shardings(tree: Any, params: nnx.State, param_shardings: nnx.State, mesh: Mesh) -> Any:
  """Shardings for a pytree whose array leaves mirror parameters (optimizer state).

  A leaf gets the sharding of the parameter whose path is the longest suffix of the leaf's path
  and whose shape equals the leaf's; any other leaf (counts, scalars) is replicated.
  """
  by_path: dict[tuple[str, ...], tuple[tuple[int, ...], Any]] = {}
  shard_leaves = jax.tree_util.tree_leaves(param_shardings)
  for (path, leaf), sharding in zip(jax.tree_util.tree_flatten_with_path(params)[0], shard_leaves):
    by_path[tuple(path_names(path))] = (tuple(leaf.shape), sharding)
  replicated = NamedSharding(mesh, P())

  def one(path, leaf):
    names = tuple(path_names(path))
    shape = tuple(getattr(leaf, "shape", ()))
    for i in range(len(names)):
      hit = by_path.get(names[i:])
      if hit is not None and hit[0] == shape:
        return hit[1]
    return replicated
  return jax.tree_util.tree_map_with_path(one, tree)


def batch_sharding(mesh: Mesh, rules: Rules, batch_size: int, seq_len: int,
                   what: str = "batch [train.global_batch_size, data.seq_len]") -> NamedSharding:
  """Sharding of every [B, T] batch array: batch over the data axes, sequence over `sequence`."""
  spec = spec_for((ax.BATCH, ax.SEQ), (batch_size, seq_len), rules, mesh, what=what)
  return NamedSharding(mesh, spec)


def vision_batch_shardings(mesh: Mesh, rules: Rules, batch_size: int, max_patches: int,
                           max_grids: int, patch_dim: int) -> dict[str, NamedSharding]:
  """Shardings of the vision batch keys ([B, P, 588], [B, G, 3], [B, P]): by batch row only."""
  shapes = {"vision_patches": (batch_size, max_patches, patch_dim),
            "vision_grids": (batch_size, max_grids, 3),
            "vision_grid_ids": (batch_size, max_patches)}
  return {k: NamedSharding(mesh, spec_for(names, shapes[k], rules, mesh,
                                          what=f"batch {k} {list(shapes[k])}"))
          for k, names in VISION_BATCH_KEYS.items()}
