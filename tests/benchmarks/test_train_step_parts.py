"""benchmarks/train_step.py's per-part profile: the model's named scopes reach the compiled HLO,
and `classify` puts ops of nested scopes into the part the PARTS order promises."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
from flax import nnx

from tests.benchmarks import scripts
from tests.model.test_moe import make_moe, tokens



def _script():
  return scripts.load("train_step")


def test_nested_scopes_go_to_the_outer_part():
  classify = _script().classify
  assert classify("x.py:jit(step)/while/body/moe_proj/ffn/dot_general") == "moe_proj"
  assert classify("x.py:jit(step)/transpose(jvp(ffn))/dot_general") == "ffn"
  assert classify("x.py:jit(step)/kda/norm/reduce_sum") == "kda"
  assert classify("x.py:jit(step)/checkpoint/attnres/reduce_sum") == "attnres"
  assert classify("x.py:jit(step)/optimizer/reduce_and") == "optimizer"
  assert classify("x.py:jit(step)/dynamic_update_slice") == "other"


def test_moe_projections_and_shared_experts_carry_their_scope():
  """Forward and backward of a MoE layer with a shared expert: every matmul's location (the
  op_name XLA keeps in the compiled HLO) names a part; the latent down / up projections and the
  shared expert's matmuls are `moe_proj`, not "other". Read from the lowered program (the
  persistent compilation cache would return a compiled text keyed without op names)."""
  moe = make_moe()
  x = tokens()

  def loss(moe, x):
    return jnp.sum(moe(x).astype(jnp.float32) ** 2)

  graphdef, state = nnx.split(moe)
  fn = jax.jit(lambda state, x: jax.grad(lambda s: loss(nnx.merge(graphdef, s), x))(state))
  text = fn.lower(state, x).as_text(debug_info=True)
  names = set(re.findall(r'loc\("([^"]*dot_general)"', text))
  classify = _script().classify
  parts = {name: classify(":" + name) for name in names}
  assert "other" not in parts.values(), parts
  shared = [n for n in names if "/ffn/" in n]
  assert shared and all(parts[n] == "moe_proj" for n in shared), parts
  assert {"moe_proj", "moe_gmm", "router"} <= set(parts.values()), parts
