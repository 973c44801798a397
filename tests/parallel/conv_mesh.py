"""KDA's short conv under a mesh (run by test_conv_mesh.py with 4 host-platform devices):

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/parallel/conv_mesh.py

For each case, the gradients of Σ conv(x, w) · cotangent with respect to x and w through
`k3train.parallel.sequence.causal_conv` under the mesh, against the single-device xla backend;
prints one JSON line per case with the largest gradient error over the largest gradient and the
compiled program's collective counts.
"""

from __future__ import annotations

import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from k3train.parallel import axes as ax
from k3train.parallel import rules as rules_lib
from k3train.parallel import sequence as seq_parallel
from pallas_kernels import short_conv
from pallas_kernels.short_conv import pallas_gpu

B, T, H, K, W = 4, 32, 2, 16, 4
MESH_AXES = ("data", "fsdp", "expert", "sequence", "tensor")

CASES = {
    # name: (mesh sizes in MESH_AXES order, rules, backend)
    "fsdp=4 pallas_gpu": ((1, 4, 1, 1, 1), "default", "pallas_gpu"),
    "data=2,tensor=2 pallas_gpu": ((2, 1, 1, 1, 2), "default", "pallas_gpu"),
    "data=2,sequence=2 pallas_gpu": ((2, 1, 1, 2, 1), "long_context", "pallas_gpu"),
    "fsdp=4 xla": ((1, 4, 1, 1, 1), "default", "xla"),
}


def operands():
  rng = np.random.default_rng(0)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  # Documents of 5, 20 and 7 tokens in every row: starts inside and across shard boundaries.
  seg = jnp.asarray(np.repeat(np.arange(3), (5, 20, 7))[None].repeat(B, 0), jnp.int32)
  return normal(B, T, H, K), 0.5 * normal(W, H, K), seg, normal(B, T, H, K)


def grads(backend):
  x, w, seg, cot = operands()
  conv = functools.partial(short_conv.causal_conv, backend=backend)

  def loss(x, w):
    x = rules_lib.constrain(x, ax.BATCH, ax.SEQ, ax.HEADS, ax.HEAD_DIM)   # as the layer's input
    return jnp.sum(seq_parallel.causal_conv(x, w, seg, conv) * cot)

  fn = jax.jit(jax.grad(loss, argnums=(0, 1)))
  return fn(x, w), fn.lower(x, w).compile().as_text()


def main(names) -> int:
  reference, _ = grads("xla")
  for name in names:
    sizes, rules, backend = CASES[name]
    mesh = Mesh(np.array(jax.devices()).reshape(sizes), MESH_AXES)
    with rules_lib.activate(mesh, rules_lib.get_rules(rules)), \
        pallas_gpu.configured(rows=8, cols=16):
      got, hlo = grads(backend)
    scale = max(float(jnp.abs(r).max()) for r in reference)
    err = max(float(jnp.abs(g - r).max()) for g, r in zip(got, reference))
    collectives = {c: hlo.count(f" {c}(") for c in ("all-gather", "all-reduce",
                                                      "collective-permute")}
    print(json.dumps({"case": name, "grad_err": err, "grad_scale": scale,
                      "collectives": collectives}), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:] or list(CASES)))
