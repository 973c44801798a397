"""The head loss's per-row log-normaliser and target logit: XLA's reductions against the kernel.

  python benchmarks/logsumexp.py [--shapes=4096x163840] [--iters=30]
                                 [--kernel_settings=rows:block_v:num_warps:num_stages,...]

Each shape is N rows × V columns of fp32 logits, as one chunk of the fused head loss holds them
(the k3_h200 step: 4 rows × 1,024 positions = 4,096 rows of V = 163,840). Paths: "xla"
(pallas_kernels/logsumexp/xla.py), "pallas_gpu" (the one-pass kernel at its default settings;
interpreted, and slow, off a GPU) and pallas_gpu[rows:block_v:warps:stages] (other settings).
`ms` is the median call time of (lse, picked); `gb_per_s` the logits' bytes over it (what one
read costs); `max_err` the largest difference from the float64 oracle over the first 64 rows,
relative to max(1, |lse|). One JSON line per (shape, path), then a table.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import _flags, _record  # noqa: E402
from pallas_kernels import logsumexp  # noqa: E402
from pallas_kernels.logsumexp import pallas_gpu, reference  # noqa: E402

PROG = "python benchmarks/logsumexp.py"
FLAGS = (
    _flags.Flag("shapes", "list", ["4096x163840"], "N×V: rows and columns of fp32 logits"),
    _flags.Flag("iters", "int", 30, "timed calls per path"),
    _flags.Flag("kernel_settings", "list", [],
                "extra pallas_gpu launch settings to time, each rows:block_v:num_warps:num_stages"),
)
CHECKED_ROWS = 64



def measure(n, v, iters, settings_texts):
  kx, kt = jax.random.split(jax.random.key(0))
  x = 4.0 * jax.random.normal(kx, (n, v), jnp.float32)
  t = jax.random.randint(kt, (n,), 0, v, jnp.int32)
  want = reference.logsumexp_and_pick(np.asarray(x[:CHECKED_ROWS]), np.asarray(t[:CHECKED_ROWS]))
  rows = []
  paths = _flags.kernel_paths(settings_texts, pallas_gpu.Settings)
  for name, (backend, settings) in paths.items():
    with pallas_gpu.configured(**(vars(settings) if settings else {})):
      fn = jax.jit(lambda a, b, be=backend: logsumexp.logsumexp_and_pick(a, b, backend=be))
      got = fn(x, t)
      seconds = _record.median_call_seconds(fn, (x, t), iters)
    scale = np.maximum(1.0, np.abs(want[0]))
    err = max(float(np.max(np.abs(np.asarray(g[:CHECKED_ROWS], np.float64) - w) / scale))
              for g, w in zip(got, want))
    rows.append({"shape": f"{n}x{v}", "path": name, "ms": round(1e3 * seconds, 4),
                 "gb_per_s": round(n * v * 4 / seconds / 1e9, 3), "max_err": err})
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
  print(f"{'shape':>14} {'path':>30} {'ms':>9} {'GB/s':>7} {'max err':>9}")
  for r in rows:
    print(f"{r['shape']:>14} {r['path']:>30} {r['ms']:>9.4f} {r['gb_per_s']:>7.0f} "
          f"{r['max_err']:>9.1e}")
  return 0 if all(r["max_err"] < 1e-5 for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
