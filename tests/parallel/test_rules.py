"""Mesh sizing, rule tables and the golden PartitionSpec of every k3_full variable per recipe.

The golden files (tests/parallel/golden/partition_specs_<recipe>.txt) are diffed here, so any
change of parallel layout shows up in review. After an intended change, regenerate them with
`K3TRAIN_UPDATE_GOLDEN=1 python -m pytest -q tests/parallel/test_rules.py`.
"""

from __future__ import annotations

import difflib
import os

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from tests.configs import k3_full, k3_tiny
from k3train.parallel import axes as ax
from k3train.parallel.rules import constrain
from k3train.model.decoder import K3Model
from k3train.parallel import mesh as mesh_lib
from k3train.parallel import rules as rules_lib
from k3train.tree_paths import path_names

GOLDEN_DIR = os.path.join(os.path.dirname(__file__), "golden")


def fake_mesh(**sizes):
  """A Mesh object of the given axis sizes over one repeated CPU device (specs only, no arrays)."""
  resolved = {a: sizes.get(a, 1) for a in mesh_lib.MESH_AXES}
  return jax.sharding.AbstractMesh(tuple(resolved[a] for a in mesh_lib.MESH_AXES), mesh_lib.MESH_AXES)


def spec_table(recipe: str) -> str:
  abstract = nnx.eval_shape(lambda: K3Model(k3_full.get_config().model, rngs=nnx.Rngs(params=0)))
  rules = rules_lib.get_rules(recipe)
  lines = []
  for path, var in jax.tree_util.tree_flatten_with_path(
      nnx.state(abstract), is_leaf=lambda x: isinstance(x, nnx.Variable))[0]:
    names = var.get_metadata().get("out_sharding")
    spec = rules_lib.logical_to_spec(names, rules) if names else jax.sharding.PartitionSpec()
    lines.append(f"{'.'.join(path_names(path))}  {tuple(var.get_value().shape)}  {spec}")
  return "\n".join(lines) + "\n"


@pytest.mark.parametrize("recipe", sorted(rules_lib.RECIPES))
def test_partition_specs_match_golden_file(recipe):
  table = spec_table(recipe)
  path = os.path.join(GOLDEN_DIR, f"partition_specs_{recipe}.txt")
  if os.environ.get("K3TRAIN_UPDATE_GOLDEN"):
    os.makedirs(GOLDEN_DIR, exist_ok=True)
    with open(path, "w") as f:
      f.write(table)
  with open(path) as f:
    golden = f.read()
  diff = "".join(difflib.unified_diff(golden.splitlines(True), table.splitlines(True), path, "now"))
  assert not diff, f"PartitionSpecs changed (regenerate with K3TRAIN_UPDATE_GOLDEN=1):\n{diff[:4000]}"


def test_golden_covers_every_layer_kind():
  table = spec_table("full")
  # Routed experts: expert axis on E, latent over fsdp+sequence, hidden over tensor.
  assert "stack.layers.0.ffn.experts.gate  (22, 896, 3584, 3072)  P(None, 'expert', ('fsdp', 'sequence'), 'tensor')" in table
  assert "mixer.q_proj.kernel" in table and "mixer.kv_b_proj.kernel" in table


def test_resolve_axis_sizes_fills_minus_one():
  assert mesh_lib.resolve_axis_sizes({"fsdp": -1, "expert": 4}, 32) == dict(
      data=1, fsdp=8, expert=4, sequence=1, tensor=1)


@pytest.mark.parametrize("sizes, devices, message", [
    ({"fsdp": -1, "expert": 3}, 8, "does not divide the 8 devices"),
    ({"fsdp": 2, "expert": 2}, 8, "has 4 devices but 8 are available"),
    ({"fsdp": -1, "tensor": -1}, 8, "at most one mesh axis may be -1"),
    ({"pipeline": 2}, 8, "unknown mesh axes"),
])
def test_bad_mesh_sizes_are_named(sizes, devices, message):
  with pytest.raises(mesh_lib.MeshError, match=message):
    mesh_lib.resolve_axis_sizes(sizes, devices)


def test_non_dividing_mesh_names_the_dimension_and_axis():
  cfg = k3_tiny.get_config()   # KDA and MLA have 2 heads
  rules = rules_lib.get_rules("default")
  with pytest.raises(mesh_lib.MeshError, match=r"dimension 1 \('heads', size 2\) is not divisible "
                                              r"by mesh axis tensor=4"):
    rules_lib.spec_for((ax.EMBED, ax.HEADS, ax.HEAD_DIM), (64, cfg.model.kda.num_heads, 32), rules,
                       fake_mesh(tensor=4), what="parameter q_proj")


def test_activation_spec_skips_mesh_axes_already_used():
  rules = rules_lib.get_rules("long_context")
  mesh = fake_mesh(fsdp=2, sequence=4)
  # batch takes fsdp, seq takes sequence, so embed (fsdp, sequence) is left whole.
  assert rules_lib.spec_for((ax.BATCH, ax.SEQ, ax.EMBED), (8, 128, 64), rules, mesh) == \
      jax.sharding.PartitionSpec("fsdp", "sequence", None)
  # A parameter [embed, heads]: embed over both fsdp and sequence.
  assert rules_lib.spec_for((ax.EMBED, ax.HEADS), (64, 2), rules, mesh) == \
      jax.sharding.PartitionSpec(("fsdp", "sequence"), None)


def test_constrain_is_a_no_op_without_a_layout():
  x = np.ones((2, 3, 4), np.float32)
  assert constrain(x, ax.BATCH, ax.SEQ, ax.EMBED) is x
