"""Collectives in the compiled Muon update of the four-layer k3_tiny sharded over fsdp=8 (run as
a script).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/optim/muon_sharding_hlo.py

Compiles `optimizer.update` with the train loop's parameter and optimizer-state shardings, with
and without `gather_for_newton_schulz`, and prints one JSON line per variant with the number of
each collective in the HLO and the number of Muon matrices, then the largest difference between
the two variants' updates on the same random gradients. Newton–Schulz runs in float32 here, so
the two variants agree to fp32 round-off (bf16 rounding would differ with the reduction order).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
from flax import nnx

from tests.configs import k3_tiny, quick
from k3train.optim import muon
from k3train.parallel import rules as rules_lib
from k3train.train import layout as layout_lib
from tests.parallel.mesh_equivalence import COLLECTIVES, FAST_COMPILE



def main():
  cfg = quick(k3_tiny.get_config())
  cfg.optim.optimizer = "muon"
  cfg.parallel.fsdp = 8
  cfg.train.global_batch_size = 8
  layout = layout_lib.make_layout(cfg)
  model = layout_lib.build_sharded_model(cfg, layout)
  params = nnx.state(model, nnx.Param)
  num_muon = sum(1 for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
                 if muon._rule_of(p, x).dims is not None)
  leaves, treedef = jax.tree_util.tree_flatten(params)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  grads = jax.tree_util.tree_unflatten(treedef, [
      jax.device_put(jax.random.normal(k, x.shape, x.dtype) * 1e-2, x.sharding)
      for k, x in zip(keys, leaves)])
  outputs = {}
  for gather in (True, False):
    opt = muon.make_muon_optimizer(learning_rate=1e-3, params_like=params, gather_matrices=gather,
                                  ns_dtype="float32")
    graphdef, state, sh = layout_lib.init_sharded_state(model, opt, layout)

    def update(grads, opt_state, params):
      with rules_lib.activate(layout.mesh, layout.rules):
        return opt.update(grads, opt_state, params)

    compiled = jax.jit(update, in_shardings=(sh.params, sh.opt_state, sh.params),
                       out_shardings=(sh.params, sh.opt_state)).lower(
        state.params, state.opt_state, state.params).compile(compiler_options=FAST_COMPILE)
    hlo = compiled.as_text()
    counts = {c: hlo.count(f" {c}(") + hlo.count(f" {c}-start(") for c in COLLECTIVES}
    outputs[gather] = jax.tree.leaves(compiled(grads, state.opt_state, state.params)[0])
    print(json.dumps({"gather": gather, "muon_matrices": num_muon, **counts}), flush=True)
  diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(outputs[True], outputs[False]))
  scale = max(float(jnp.max(jnp.abs(b))) for b in outputs[False])
  print(json.dumps({"update_max_abs_diff": diff, "update_scale": scale}), flush=True)


if __name__ == "__main__":
  main()
