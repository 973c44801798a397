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

from k3train.parallel import axes as ax
from k3train.parallel import rules as rules_lib
from k3train.parallel import sequence as seq_parallel
from pallas_kernels import short_conv
from pallas_kernels.short_conv import pallas_gpu
from tests.parallel.mesh_cases import (collective_counts, gradient_error, host_mesh,
                                       normal_arrays)

B, T, H, K, W = 4, 32, 2, 16, 4

CASES = {
    # name: (mesh sizes in mesh_cases.MESH_AXES order, rules, backend)
    "fsdp=4 pallas_gpu": ((1, 4, 1, 1, 1), "default", "pallas_gpu"),
    "data=2,tensor=2 pallas_gpu": ((2, 1, 1, 1, 2), "default", "pallas_gpu"),
    "data=2,sequence=2 pallas_gpu": ((2, 1, 1, 2, 1), "long_context", "pallas_gpu"),
    "fsdp=4 xla": ((1, 4, 1, 1, 1), "default", "xla"),
}


def operands():
  normal = normal_arrays(0)
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
    with rules_lib.activate(host_mesh(sizes), rules_lib.get_rules(rules)), \
        pallas_gpu.configured(rows=8, cols=16):
      got, hlo = grads(backend)
    print(json.dumps({"case": name, **gradient_error(got, reference),
                      "collectives": collective_counts(hlo, ("all-gather", "all-reduce",
                                                             "collective-permute"))}), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:] or list(CASES)))
