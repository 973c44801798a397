"""The MoE dispatch's row gathers: XLA's gather against the row-copy kernel.

  python benchmarks/moe_gather.py [--shapes=16384x1024x8] [--iters=50]
                                  [--kernel_settings=rows:cols:num_warps,...]

Each shape is T tokens × D columns (bf16) × k experts per token, as one MoE layer of a micro-
batch dispatches them (the k3_h200 step: 16,384 × 1,024 × 8). Two timings per path:
  gather_ms   x_sorted = x[perm // k]: the rows in expert order (`permute.sort_rows`);
  train_ms    dispatch → rows scaled per expert → combine_scaled, value and gradient with
              respect to x: the forward gather, the combine, and the combine's gradient gather.
Paths: "xla", "pallas_gpu" (pallas_kernels/moe/pallas_gpu_rows.py at its default settings; what
"auto" runs on a GPU; interpreted, and slow, off a GPU) and pallas_gpu[rows:cols:warps] (other
launch settings). Each path's
outputs must equal xla's bit for bit (`same_as_xla`). `gather_gb_per_s` is what the gather must
read and write at least (T·k rows read, T·k rows written) over its measured time. One JSON line
per (shape, path), then a table.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import _flags, _record  # noqa: E402
from pallas_kernels import moe as moe_ops  # noqa: E402
from pallas_kernels.moe import pallas_gpu_rows, permute  # noqa: E402

PROG = "python benchmarks/moe_gather.py"
FLAGS = (
    _flags.Flag("shapes", "list", ["16384x1024x8"], "T×D×k: tokens, columns, experts per token"),
    _flags.Flag("iters", "int", 50, "timed calls per path"),
    _flags.Flag("kernel_settings", "list", [],
                "extra pallas_gpu launch settings to time, each rows:cols:num_warps"),
)
NUM_EXPERTS = 64



def measure(t, d, k, iters, settings_texts):
  kx, ki, kc = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (t, d), jnp.float32).astype(jnp.bfloat16)
  idx = jnp.argsort(jax.random.uniform(ki, (t, NUM_EXPERTS)), axis=1)[:, :k].astype(jnp.int32)
  ct = jax.random.normal(kc, (t, d), jnp.float32)
  perm = jnp.argsort(idx.reshape(-1), stable=True).astype(jnp.int32)
  rows, want = [], None
  paths = _flags.kernel_paths(settings_texts, pallas_gpu_rows.Settings)
  for name, (gather, settings) in paths.items():
    with pallas_gpu_rows.configured(**(vars(settings) if settings else {})):
      sort = jax.jit(lambda a: permute.sort_rows(a, perm, k, gather))

      def loss(a):
        x_sorted, sizes, p = moe_ops.dispatch(a, idx, NUM_EXPERTS, gather=gather)
        scale = (jnp.repeat(jnp.arange(NUM_EXPERTS), sizes, total_repeat_length=t * k) + 1)
        y = moe_ops.combine_scaled(x_sorted * scale.astype(a.dtype)[:, None], p, k, gather=gather)
        return jnp.sum(y.astype(jnp.float32) * ct)

      train = jax.jit(jax.value_and_grad(loss))
      got = (sort(x), *train(x))
      gather_s = _record.median_call_seconds(sort, (x,), iters)
      train_s = _record.median_call_seconds(train, (x,), iters)
    if want is None:
      want = got
    same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(got, want))
    rows.append({"shape": f"{t}x{d}x{k}", "path": name, "gather_ms": round(1e3 * gather_s, 4),
                 "train_ms": round(1e3 * train_s, 4),
                 "gather_gb_per_s": round(2 * t * k * d * x.dtype.itemsize / gather_s / 1e9, 1),
                 "same_as_xla": same})
  return rows


def main(argv=None) -> int:
  args = _flags.parse(argv, PROG, FLAGS)
  if args.exit_code is not None:
    return args.exit_code
  fl = args.flags
  env = _record.environment()
  rows = []
  for shape in fl.shapes:
    rows += _record.emit(measure(*_record.dims(shape), fl.iters, fl.kernel_settings), env)
  print(f"{'shape':>16} {'path':>26} {'gather ms':>10} {'GB/s':>7} {'train ms':>9} {'same':>5}")
  for r in rows:
    print(f"{r['shape']:>16} {r['path']:>26} {r['gather_ms']:>10.4f} {r['gather_gb_per_s']:>7.0f} "
          f"{r['train_ms']:>9.4f} {str(r['same_as_xla']):>5}")
  return 0 if all(r["same_as_xla"] for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
