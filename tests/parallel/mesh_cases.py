"""What the op-under-a-mesh scripts (attnres_mesh.py, conv_mesh.py) share: the 5-axis mesh over
this process's host devices, seeded operands, the error of a case's gradients against the
one-device ones, and the compiled program's collective counts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

MESH_AXES = ("data", "fsdp", "expert", "sequence", "tensor")


def host_mesh(sizes: tuple[int, ...]) -> Mesh:
  """The mesh of all local devices with `sizes` in MESH_AXES order."""
  return Mesh(np.array(jax.devices()).reshape(sizes), MESH_AXES)


def normal_arrays(seed: int = 0):
  """normal(*shape): fp32 standard-normal arrays from one seeded generator, in call order."""
  rng = np.random.default_rng(seed)
  return lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)


def gradient_error(got, reference) -> dict:
  """{"grad_err": largest |got − reference| over the leaves, "grad_scale": largest |reference|}."""
  return {"grad_err": max(float(jnp.abs(g - r).max()) for g, r in zip(got, reference)),
          "grad_scale": max(float(jnp.abs(r).max()) for r in reference)}


def collective_counts(hlo: str, names) -> dict:
  """How often each collective appears as an instruction in the compiled program's text."""
  return {c: hlo.count(f" {c}(") for c in names}
