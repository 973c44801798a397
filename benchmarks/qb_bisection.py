"""Quantile Balancing's order statistic: device time of one QB call per selection setting.

  python benchmarks/qb_bisection.py [--tokens=8192] [--experts=64,896] [--top_k=8,16] [--iters=200]

One QB call (`k3train.model.moe.quantile_balancing_bias`: the (k+1)-th largest biased score per
token, then the per-expert quantile of the margins by radix selection over the float bits) on
random sigmoid scores, jitted once per (digit_bits, bisection_unroll) setting: 1 bit per round
(32 rounds) unrolled or as a loop, 2 bits (16 rounds) unrolled, 4 bits (8 rounds) unrolled or
as a loop (8 bits per round compares every element with 255 candidates: far slower), and the
two Pallas-GPU kernels of `pallas_kernels.qb` ("pallas_gpu", on a GPU only). A row "cutoff
only" times the XLA path's per-token top-k alone, the part every XLA setting shares. Prints one JSON
line per (shape, setting) with the median of `--iters` calls, the compile time and the number of
kernels (fusions and custom calls) in the compiled call, then a table. All settings return the
bits of the first (checked).
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
SETTINGS = ((1, True), (1, 1), (2, True), (4, True), (4, 1))   # XLA: (digit_bits, unroll)
FLAGS = (
    _flags.Flag("tokens", "int", 8192, "tokens of the score matrix"),
    _flags.Flag("experts", "list", ["64", "896"], "experts per case"),
    _flags.Flag("top_k", "list", ["8", "16"], "top-k per case (as many as --experts)"),
    _flags.Flag("iters", "int", 200, "timed calls per setting"),
)


def measure(tokens: int, experts: int, top_k: int, setting, iters: int) -> dict:
  """setting: (digit_bits, unroll) of the XLA rounds, "pallas_gpu", or "cutoff" for the XLA
  path's per-token top-k alone."""
  key = jax.random.key(0)
  scores = jax.nn.sigmoid(jax.random.normal(key, (tokens, experts), jnp.float32))
  bias = jnp.zeros((experts,), jnp.float32)
  mask = jnp.ones((tokens,), bool)
  if setting == "cutoff":
    fn = jax.jit(lambda s, b, m: jax.lax.top_k(s + b, top_k + 1)[0][:, top_k])
  elif setting == "pallas_gpu":
    fn = jax.jit(lambda s, b, m: quantile_balancing_bias(s, b, m, top_k, backend="pallas_gpu"))
  else:
    bits, unroll = setting
    fn = jax.jit(lambda s, b, m: quantile_balancing_bias(s, b, m, top_k, bisection_unroll=unroll,
                                                         digit_bits=bits, backend="xla"))
  t0 = time.perf_counter()
  compiled = fn.lower(scores, bias, mask).compile()
  compile_s = time.perf_counter() - t0
  out = compiled(scores, bias, mask).block_until_ready()
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    compiled(scores, bias, mask).block_until_ready()
    times.append(time.perf_counter() - t0)
  return {"tokens": tokens, "experts": experts, "top_k": top_k,
          "setting": setting if isinstance(setting, str) else f"{setting[0]} bit, unroll {setting[1]}",
          "kernels": len(_record.kernel_names(compiled.as_text())),
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
    gpu = ("pallas_gpu",) if jax.default_backend() == "gpu" else ()
    for setting in SETTINGS + gpu + ("cutoff",):
      r = measure(tokens, e, k, setting, iters)
      bias = r.pop("bias")
      if setting != "cutoff":
        ref = bias if ref is None else ref
        r["same_bits_as_first"] = bool(np.array_equal(bias.view(np.uint32), ref.view(np.uint32)))
      r.update(env)
      rows.append(r)
      print(json.dumps(r), flush=True)
  print(f"{'tokens':>7} {'experts':>7} {'top_k':>5} {'setting':>20} {'kernels':>7} {'median us':>10} "
        f"{'compile s':>9} same")
  for r in rows:
    print(f"{r['tokens']:>7} {r['experts']:>7} {r['top_k']:>5} {r['setting']:>20} {r['kernels']:>7} "
          f"{r['median_us']:>10.1f} {r['compile_s']:>9.2f} {r.get('same_bits_as_first', '-')}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
