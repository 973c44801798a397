"""The 5-axis device mesh (data, fsdp, expert, sequence, tensor) built from the `parallel` config.

Axis order is outermost → innermost: `tensor` is innermost so that its devices are neighbours
(NVLink / ICI ring), `data` outermost so that pure data parallelism can cross the slowest links.
A size of -1 fills the devices left over by the others (at most one axis may say -1).
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

MESH_AXES = ("data", "fsdp", "expert", "sequence", "tensor")


class MeshError(ValueError):
  """The requested mesh does not fit the devices or the model."""


def resolve_axis_sizes(sizes: Mapping[str, int], num_devices: int) -> dict[str, int]:
  """{axis: size} with the single -1 filled in; errors name the axis and the device count."""
  unknown = sorted(set(sizes) - set(MESH_AXES))
  if unknown:
    raise MeshError(f"unknown mesh axes {unknown}; the axes are {MESH_AXES}")
  out = {a: int(sizes.get(a, 1)) for a in MESH_AXES}
  fill = [a for a, s in out.items() if s == -1]
  bad = [a for a, s in out.items() if s == 0 or s < -1]
  if bad:
    raise MeshError(f"mesh axis sizes must be positive or -1, got " + ", ".join(f"{a}={out[a]}" for a in bad))
  if len(fill) > 1:
    raise MeshError(f"at most one mesh axis may be -1 (fill the rest); got {fill}")
  fixed = math.prod(s for s in out.values() if s != -1)
  if fill:
    if num_devices % fixed:
      raise MeshError(f"cannot fill mesh axis {fill[0]!r}: the other axes use {fixed} devices, "
                      f"which does not divide the {num_devices} devices")
    out[fill[0]] = num_devices // fixed
  total = math.prod(out.values())
  if total != num_devices:
    raise MeshError(f"mesh {describe(out)} has {total} devices but {num_devices} are available; "
                    "set one axis to -1 to fill the rest")
  return out


def describe(sizes: Mapping[str, int]) -> str:
  """'data=1 fsdp=8 expert=1 sequence=1 tensor=1'."""
  return " ".join(f"{a}={sizes[a]}" for a in MESH_AXES if a in sizes)


def sizes_from_config(parallel_cfg) -> dict[str, int]:
  return {a: int(parallel_cfg[a]) for a in MESH_AXES}


def make_mesh(sizes: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A mesh over `devices` (default: all devices of all processes) with the axes in MESH_AXES.

  On accelerators `jax.make_mesh` orders devices so that inner axes are physical neighbours; on
  CPU (and when `devices` is given) devices keep their order.
  """
  devices = list(jax.devices() if devices is None else devices)
  resolved = resolve_axis_sizes(sizes, len(devices))
  shape = tuple(resolved[a] for a in MESH_AXES)
  axis_types = (AxisType.Auto,) * len(MESH_AXES)
  if devices == list(jax.devices()) and jax.default_backend() != "cpu":
    return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types)
  return Mesh(np.asarray(devices, dtype=object).reshape(shape), MESH_AXES, axis_types=axis_types)


def axis_size(mesh: Mesh, axes: str | Sequence[str] | None) -> int:
  """Product of the sizes of `axes` in `mesh` (1 for None or ())."""
  if axes is None:
    return 1
  if isinstance(axes, str):
    axes = (axes,)
  return math.prod(mesh.shape[a] for a in axes)
