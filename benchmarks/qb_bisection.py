"""Quantile Balancing's order statistic: device time of one QB call per selection setting.

  python benchmarks/qb_bisection.py [--tokens=8192] [--experts=64,896] [--top_k=8,16] [--iters=200]
      [--calls_per_timing=1] [--kernel_settings=d2:digit_bits=2 --kernel_settings=...]

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

`--calls_per_timing=N` times N dependent calls inside one jitted loop (each call's bias is the
last one's result, as QB's rounds chain them) and reports the time per call: the device time
without the host's dispatch, which dominates single calls at 64 experts. Each
`--kernel_settings=NAME:field=value,...` adds a row "pallas_gpu NAME" with those fields of
`pallas_kernels.qb.pallas_gpu.Settings` (e.g. `d2w16:column_digit_bits=2,column_warps=16`).
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
from pallas_kernels.qb import pallas_gpu  # noqa: E402

PROG = "python benchmarks/qb_bisection.py"
SETTINGS = ((1, True), (1, 1), (2, True), (4, True), (4, 1))   # XLA: (digit_bits, unroll)
FLAGS = (
    _flags.Flag("tokens", "int", 8192, "tokens of the score matrix"),
    _flags.Flag("experts", "list", ["64", "896"], "experts per case"),
    _flags.Flag("top_k", "list", ["8", "16"], "top-k per case (as many as --experts)"),
    _flags.Flag("iters", "int", 200, "timed calls per setting"),
    _flags.Flag("calls_per_timing", "int", 1, "dependent QB calls per timed (jitted) call"),
    _flags.Flag("kernel_settings", "multi", [],
                "NAME:field=value,... : a pallas_gpu row with those Settings fields"),
)


def kernel_settings(text: str) -> tuple[str, dict]:
  """'d2w16:column_digit_bits=2,column_warps=16' → ('d2w16', {...}); values are ints."""
  name, _, fields = text.partition(":")
  overrides = {}
  for item in filter(None, fields.split(",")):
    key, _, value = item.partition("=")
    overrides[key.strip()] = int(value)
  pallas_gpu.Settings(**overrides)          # a bad field or value fails here, before any timing
  return name, overrides


def measure(tokens: int, experts: int, top_k: int, setting, iters: int, calls: int = 1) -> dict:
  """setting: (digit_bits, unroll) of the XLA rounds, "pallas_gpu", ("pallas_gpu", name,
  Settings overrides), or "cutoff" for the XLA path's per-token top-k alone. calls: dependent
  calls per timed call (see the module docstring)."""
  key = jax.random.key(0)
  scores = jax.nn.sigmoid(jax.random.normal(key, (tokens, experts), jnp.float32))
  bias = jnp.zeros((experts,), jnp.float32)
  mask = jnp.ones((tokens,), bool)
  overrides = {}
  if setting == "cutoff":
    one = lambda s, b, m: jax.lax.top_k(s + b, top_k + 1)[0][:, top_k]
  elif setting == "pallas_gpu" or isinstance(setting, tuple) and setting[0] == "pallas_gpu":
    overrides = setting[2] if isinstance(setting, tuple) else {}
    one = lambda s, b, m: quantile_balancing_bias(s, b, m, top_k, backend="pallas_gpu")
  else:
    bits, unroll = setting
    one = lambda s, b, m: quantile_balancing_bias(s, b, m, top_k, bisection_unroll=unroll,
                                                  digit_bits=bits, backend="xla")
  if calls == 1 or setting == "cutoff":
    fn = jax.jit(one)
  else:
    fn = jax.jit(lambda s, b, m: jax.lax.fori_loop(0, calls, lambda _, x: one(s, x, m), b))
  t0 = time.perf_counter()
  with pallas_gpu.configured(**overrides):
    compiled = fn.lower(scores, bias, mask).compile()
  compile_s = time.perf_counter() - t0
  per_call = 1 if setting == "cutoff" else calls
  out = compiled(scores, bias, mask).block_until_ready()
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    compiled(scores, bias, mask).block_until_ready()
    times.append(time.perf_counter() - t0)
  if isinstance(setting, str):
    label = setting
  elif setting[0] == "pallas_gpu":
    label = f"pallas_gpu {setting[1]}"
  else:
    label = f"{setting[0]} bit, unroll {setting[1]}"
  return {"tokens": tokens, "experts": experts, "top_k": top_k, "setting": label,
          "settings": overrides, "calls_per_timing": per_call,
          "kernels": len(_record.kernel_names(compiled.as_text())),
          "median_us": round(1e6 * float(np.median(times)) / per_call, 1),
          "min_us": round(1e6 * float(np.min(times)) / per_call, 1),
          "compile_s": round(compile_s, 2), "bias": np.asarray(out)}


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
  if f.calls_per_timing < 1:
    print(f"{PROG}: --calls_per_timing must be >= 1, got {f.calls_per_timing}", file=sys.stderr)
    return _flags.USAGE_ERROR
  try:
    variants = tuple(("pallas_gpu",) + kernel_settings(text) for text in f.kernel_settings)
  except (TypeError, ValueError) as err:
    print(f"{PROG}: --kernel_settings: {err}", file=sys.stderr)
    return _flags.USAGE_ERROR
  env = _record.environment()
  rows = []
  for e, k in zip(experts, top_ks):
    ref = None
    gpu = ("pallas_gpu",) + variants if jax.default_backend() == "gpu" else ()
    for setting in SETTINGS + gpu + ("cutoff",):
      r = measure(tokens, e, k, setting, iters, f.calls_per_timing)
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
