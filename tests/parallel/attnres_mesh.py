"""AttnRes sites under a mesh (run by test_attnres_mesh.py with 4 host-platform devices):

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/parallel/attnres_mesh.py

For each case, the loss and gradients of one site (`k3train.parallel.attnres.mix_pass`, stream
cotangents included) under the mesh against the single-device xla backend; prints one JSON line
per case with the largest gradient error over the largest gradient and the compiled program's
collective counts.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp

from k3train.parallel import attnres as parallel_attnres
from k3train.parallel import axes as ax
from k3train.parallel import rules as rules_lib
from tests.parallel.mesh_cases import (collective_counts, gradient_error, host_mesh,
                                       normal_arrays)

N, B, T, D = 4, 4, 32, 64
EPS = 1e-6

CASES = {
    # name: (mesh sizes in mesh_cases.MESH_AXES order, rules, backend)
    "data=2,sequence=2 pallas_gpu": ((2, 1, 1, 2, 1), "long_context", "pallas_gpu"),
    "fsdp=4 pallas_gpu": ((1, 4, 1, 1, 1), "default", "pallas_gpu"),
    "data=2,sequence=2 xla": ((2, 1, 1, 2, 1), "long_context", "xla"),
}


def operands():
  normal = normal_arrays(0)
  return (normal(N, B, T, D), normal(B, T, D), 0.3 * normal(D), 1.0 + 0.1 * normal(D),
          normal(B, T, D), normal(N, B, T, D), normal(B, T, D))


def grads(backend):
  blocks, p, query, gain, cot, ct_blocks, ct_p = operands()

  def loss(blocks, p, query, gain):
    # The stream sharded as the decoder shards it (no-ops without a layout).
    blocks = rules_lib.constrain(blocks, ax.SOURCES, ax.BATCH, ax.SEQ, ax.EMBED)
    p = rules_lib.constrain(p, ax.BATCH, ax.SEQ, ax.EMBED)
    out, blocks_out, p_out = parallel_attnres.mix_pass(blocks, jnp.int32(3), p, query, gain,
                                                       eps=EPS, backend=backend)
    return jnp.sum(out * cot) + jnp.sum(blocks_out * ct_blocks) + jnp.sum(p_out * ct_p)

  fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
  args = (blocks, p, query, gain)
  return fn(*args), fn.lower(*args).compile().as_text()


def main(names) -> int:
  reference, _ = grads("xla")
  for name in names:
    sizes, rules, backend = CASES[name]
    with rules_lib.activate(host_mesh(sizes), rules_lib.get_rules(rules)):
      got, hlo = grads(backend)
    print(json.dumps({"case": name, **gradient_error(got, reference),
                      "collectives": collective_counts(hlo, ("all-gather", "all-reduce",
                                                             "all-to-all"))}), flush=True)
  # A layout that splits the model width: "auto" falls back to xla, the kernel by name refuses.
  with rules_lib.activate(host_mesh((2, 1, 1, 1, 2)), {**rules_lib.get_rules("default"), ax.EMBED: ("tensor",)}):
    got, _ = grads("auto")
    try:
      grads("pallas_gpu")
      error = None
    except ValueError as e:
      error = str(e)
  err = gradient_error(got, reference)["grad_err"]
  print(json.dumps({"case": "embed split", "auto_grad_err": err, "pallas_gpu_error": error}),
        flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:] or list(CASES)))
