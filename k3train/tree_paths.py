"""Readable names for pytree paths, shared by checkpointing, the optimizer partition and QK-Clip."""

from __future__ import annotations

import jax


def path_names(path) -> list[str]:
  """Module/attribute names of a pytree path, without nnx.Variable's trailing `.value`."""
  names = []
  for p in path:
    if isinstance(p, jax.tree_util.GetAttrKey) and p.name == "value":
      continue
    names.append(str(getattr(p, "key", getattr(p, "name", getattr(p, "idx", p)))))
  return names
