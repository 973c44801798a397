"""Logical-axis rule tables (one per recipe) and the active (mesh, rules) layout.

A rule table maps each logical axis name used by model code (`k3train/parallel/axes.py`) to a tuple
of mesh axes. A PartitionSpec is made dimension by dimension; a mesh axis already used by an
earlier dimension of the same array is skipped, so one table serves parameters ([embed, heads]:
embed→fsdp) and activations ([batch, seq, embed]: batch takes fsdp first, embed stays whole).

Recipes:
  default       data + FSDP over `fsdp`, experts over `expert` (tokens also split over `expert`,
                so the all-to-all group is the expert axis), heads / FFN hidden / vocab over
                `tensor`, sequence over `sequence`.
  long_context  as default, but parameters are also sharded over `sequence` (with long contexts
                the sequence axis replaces data parallelism, and its devices should not each hold
                a full copy of the weights).
  full          long_context plus the routed experts' latent dim over `fsdp` and `sequence`
                (the 2.8T model: expert weights are ~98% of the parameters).
The vision tower (names `vit_*`, `patches`, …) is laid out the same way in every recipe: its
parameters over `fsdp` (widths) and `tensor` (MLP hidden); its activations by batch row.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Mapping, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from k3train.parallel import axes as ax
from k3train.parallel.mesh import MESH_AXES, MeshError, axis_size  # noqa: F401 (re-exported)

Rules = Mapping[str, tuple[str, ...]]

_BASE: dict[str, tuple[str, ...]] = {
    ax.BATCH: ("data", "fsdp", "expert"),
    ax.SEQ: ("sequence",),
    ax.EMBED: ("fsdp",),
    ax.VOCAB: ("tensor",),
    ax.HEADS: ("tensor",),
    ax.MLP: ("tensor",),
    ax.EXPERT_MLP: ("tensor",),
    ax.EXPERTS: ("expert",),
    # Replicated: small or contracted-per-device dims.
    ax.HEAD_DIM: (), ax.NORM: (), ax.Q_LORA: (), ax.KV_LORA: (), ax.KDA_GATE_RANK: (),
    ax.CONV: (), ax.LATENT: (), ax.LAYERS: (), ax.SOURCES: (),
    # Vision tower: widths over fsdp and the MLP hidden over tensor, like the text layers. Its 12
    # heads stay whole (12 does not divide tensor = 8). Patches stay with their row (batch
    # shard); under sequence parallelism every sequence rank runs its rows' tower.
    ax.VIT_EMBED: ("fsdp",), ax.VIT_MERGED: ("fsdp",), ax.VIT_MLP: ("tensor",),
    ax.VIT_HEADS: (), ax.PATCHES: (), ax.PATCH_DIM: (), ax.POS_GRID: (), ax.GRIDS: (),
    ax.GRID_FIELDS: (),
}

RECIPES: dict[str, dict[str, tuple[str, ...]]] = {
    "default": dict(_BASE),
    "long_context": {**_BASE, ax.EMBED: ("fsdp", "sequence")},
    "full": {**_BASE, ax.EMBED: ("fsdp", "sequence"), ax.LATENT: ("fsdp", "sequence")},
}


def get_rules(name: str) -> Rules:
  if name not in RECIPES:
    raise MeshError(f"unknown parallel.rules recipe {name!r}; known: {sorted(RECIPES)}")
  return RECIPES[name]


def mesh_axes_for(rules: Rules, name: str | None) -> tuple[str, ...]:
  """The mesh axes a logical name maps to (() for None / replicated)."""
  if name is None:
    return ()
  if name not in rules:
    raise MeshError(f"logical axis {name!r} has no rule; add it to every table in k3train/parallel/rules.py")
  return tuple(rules[name])


def logical_to_spec(names: Sequence[str | None], rules: Rules) -> P:
  """PartitionSpec for logical names, independent of mesh sizes (used for golden files)."""
  used: set[str] = set()
  parts = []
  for name in names:
    axes = tuple(a for a in mesh_axes_for(rules, name) if a not in used)
    used.update(axes)
    parts.append(axes[0] if len(axes) == 1 else (axes or None))
  return P(*parts)


def _axes_per_dim(names: Sequence[str | None], rules: Rules, mesh: Mesh) -> list[tuple[str, ...]]:
  """Mesh axes of each dimension: the rule's axes of size > 1, each mesh axis used once."""
  used: set[str] = set()
  out = []
  for name in names:
    axes = tuple(a for a in mesh_axes_for(rules, name) if a not in used and mesh.shape[a] > 1)
    used.update(axes)
    out.append(axes)
  return out


def spec_from_axes(*axes_per_dim: tuple[str, ...]) -> P:
  """PartitionSpec from per-dimension mesh-axis tuples (() → None, one axis → its name)."""
  return P(*[(a[0] if len(a) == 1 else a) if a else None for a in axes_per_dim])


def spec_for(names: Sequence[str | None], shape: Sequence[int], rules: Rules, mesh: Mesh,
             what: str = "array") -> P:
  """PartitionSpec on `mesh`; axes of size 1 are left out; a dim the mesh does not divide fails
  with a message naming the array, the dimension and the mesh axes."""
  if len(names) != len(shape):
    raise MeshError(f"{what}: {len(names)} logical names {tuple(names)} for shape {tuple(shape)}")
  per_dim = _axes_per_dim(names, rules, mesh)
  for dim, (name, size, axes) in enumerate(zip(names, shape, per_dim)):
    n = axis_size(mesh, axes)
    if size % n:
      detail = " × ".join(f"{a}={mesh.shape[a]}" for a in axes)
      raise MeshError(f"{what}: dimension {dim} ({name!r}, size {size}) is not divisible by mesh "
                      f"axis {detail} ({n} devices); change the mesh (parallel.*) or the model size")
  return spec_from_axes(*per_dim)


# ----------------------------------------------------------------------------- the active layout

_ACTIVE: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar(
    "k3train_parallel_layout", default=None)
_OPTIONS: contextvars.ContextVar[dict] = contextvars.ContextVar("k3train_parallel_options", default={})


@contextlib.contextmanager
def activate(mesh: Mesh, rules: Rules, **options):
  """Within this block (at trace time) `constrain` and the parallel ops use `mesh` and `rules`.

  options: layout choices for the parallel ops, e.g. expert_exchange="ragged".
  """
  token, opt_token = _ACTIVE.set((mesh, rules)), _OPTIONS.set(dict(options))
  try:
    yield
  finally:
    _ACTIVE.reset(token)
    _OPTIONS.reset(opt_token)


def option(name: str, default):
  """A layout option given to the enclosing `activate` block."""
  return _OPTIONS.get().get(name, default)


def active() -> tuple[Mesh, Rules] | None:
  """(mesh, rules) of the enclosing `activate` block, or None on a single device."""
  layout = _ACTIVE.get()
  if layout is None or layout[0].size == 1:
    return None
  return layout


def active_mesh_size() -> int | None:
  """Devices of the enclosing `activate` block's mesh (1 included); None outside any block."""
  layout = _ACTIVE.get()
  return None if layout is None else int(layout[0].size)


def constrain(x: jax.Array, *names: str | None) -> jax.Array:
  """with_sharding_constraint through logical names under the active layout (no-op without one).

  One name (or None) per dimension of x, e.g. `constrain(x_btd, ax.BATCH, ax.SEQ, ax.EMBED)`.
  """
  if len(names) != x.ndim:
    raise ValueError(f"constrain: {len(names)} names {names} for an array of rank {x.ndim}")
  layout = active()
  if layout is None:
    return x
  mesh, rules = layout
  spec = spec_for(names, x.shape, rules, mesh, what=f"activation {tuple(names)}")
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def mesh_axes_of(names: Sequence[str | None]) -> tuple[tuple[str, ...], ...] | None:
  """Per-dimension mesh axes (size > 1, deduplicated) under the active layout; None without one."""
  layout = active()
  if layout is None:
    return None
  mesh, rules = layout
  return tuple(_axes_per_dim(names, rules, mesh))


__all__ = ["MESH_AXES", "RECIPES", "activate", "active", "constrain", "get_rules",
           "logical_to_spec", "mesh_axes_of", "spec_for", "spec_from_axes"]
