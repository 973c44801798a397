"""Quantile Balancing's bisection, unrolled or as a loop: device time of one QB call.

  python benchmarks/qb_bisection.py [--tokens=8192] [--experts=64,896] [--top_k=8,16] [--iters=200]

One QB call (`k3train.model.moe.quantile_balancing_bias`: the (k+1)-th largest biased score per
token, then the per-expert quantile of the margins by 32 bisection rounds) on random sigmoid
scores, jitted once per `bisection_unroll` setting: True (32 rounds unrolled, no loop), 8, 4, 1
(a loop of 4, 8 or 32 iterations). Prints one JSON line per (shape, setting) with the median of
`--iters` calls and the compile time, then a table. All settings return the same bits (checked).
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import _flags, _record  # noqa: E402
from k3train.model.moe import quantile_balancing_bias  # noqa: E402

PROG = "python benchmarks/qb_bisection.py"
SETTINGS = (True, 8, 4, 1)
FLAGS = (
    _flags.Flag("tokens", "int", 8192, "tokens of the score matrix"),
    _flags.Flag("experts", "list", ["64", "896"], "experts per case"),
    _flags.Flag("top_k", "list", ["8", "16"], "top-k per case (as many as --experts)"),
    _flags.Flag("iters", "int", 200, "timed calls per setting"),
)


def measure(tokens: int, experts: int, top_k: int, unroll, iters: int) -> dict:
  key = jax.random.key(0)
  scores = jax.nn.sigmoid(jax.random.normal(key, (tokens, experts), jnp.float32))
  bias = jnp.zeros((experts,), jnp.float32)
  mask = jnp.ones((tokens,), bool)
  fn = jax.jit(lambda s, b, m: quantile_balancing_bias(s, b, m, top_k, bisection_unroll=unroll))
  t0 = time.perf_counter()
  compiled = fn.lower(scores, bias, mask).compile()
  compile_s = time.perf_counter() - t0
  out = compiled(scores, bias, mask).block_until_ready()
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    compiled(scores, bias, mask).block_until_ready()
    times.append(time.perf_counter() - t0)
  return {"tokens": tokens, "experts": experts, "top_k": top_k, "unroll": unroll,
          "median_us": round(1e6 * float(np.median(times)), 1),
          "min_us": round(1e6 * float(np.min(times)), 1), "compile_s": round(compile_s, 2),
          "bias": np.asarray(out)}


def main(argv=None) -> int:
  args = _flags.parse(argv, PROG, FLAGS)
  if args.exit_code is not None:
    return args.exit_code
  f = args.flags
  tokens, iters = f.tokens, f.iters
  experts = [int(x) for x in f.experts]
  top_ks = [int(x) for x in f.top_k]
  if len(experts) != len(top_ks):
    print(f"{PROG}: --experts and --top_k need the same number of entries", file=sys.stderr)
    return _flags.USAGE_ERROR
  env = _record.environment()
  rows = []
  for e, k in zip(experts, top_ks):
    ref = None
    for unroll in SETTINGS:
      r = measure(tokens, e, k, unroll, iters)
      bias = r.pop("bias")
      ref = bias if ref is None else ref
      r["same_bits_as_unrolled"] = bool(np.array_equal(bias.view(np.uint32), ref.view(np.uint32)))
      r.update(env)
      rows.append(r)
      print(json.dumps(r), flush=True)
  print(f"{'tokens':>7} {'experts':>7} {'top_k':>5} {'unroll':>6} {'median us':>10} {'compile s':>9} same")
  for r in rows:
    print(f"{r['tokens']:>7} {r['experts']:>7} {r['top_k']:>5} {str(r['unroll']):>6} "
          f"{r['median_us']:>10.1f} {r['compile_s']:>9.2f} {r['same_bits_as_unrolled']}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
