"""Muon's Newton–Schulz on a config's blocks: batched bf16 and fp32 against optax's per-leaf path.

  python benchmarks/newton_schulz.py --config=configs/k3_h200.py [--iters=10] [--dense=0]
  python benchmarks/newton_schulz.py --config=configs/k3_tiny.py --iters=3      # CPU smoke run
  python benchmarks/newton_schulz.py --config=configs/k3_h200.py --per_shape=3 --variants=bf16_batched

Takes the config's abstract parameters (`builder.abstract_state`), the Muon leaves with their
dimension numbers (kv_b_proj cut into its k^C and v blocks, as the optimizer does), and random
float32 arrays of those shapes, then times, after a warm-up call each (median of `--iters`
calls, `block_until_ready`):

  bf16_batched   `newton_schulz.orthogonalize_leaves`, bf16 operands, fp32 accumulation: one
                 batched matmul chain per block shape (the optimizer's default)
  fp32_batched   the same in float32
  optax          optax 0.2.8's `orthogonalize_via_newton_schulz` leaf by leaf (vmap over each
                 leaf's blocks, fp32), as `optax.contrib.muon` runs it
  dense          8 bf16 [N, N] × [N, N] matmuls in one call (fp32 accumulation, bf16 output),
                 the rate reference (N from --dense, or 0: 2N³ close to the NS FLOPs, N in
                 [256, 8192])

With --per_shape=N, also times three ways of writing the bf16 step (`step_forms`: the plain
steps, the epilogue chain in fp32, the epilogue chain in bf16) on each of the N largest block
shapes alone (0: all) and prints one JSON line per shape (ms, TFLOP/s, ratio to the dense rate,
relative difference to the fp32 iteration; GEMM calls and fusions of the largest shape's
optimized HLO). --variants picks which of the three whole-update variants run (the error columns
need both sides).

NS FLOPs are counted analytically per block (m ≤ n, per step 2m²n for A = X Xᵀ, 2m³ for A²,
2m²n for (bA + cA²)X). Prints one JSON line: each variant's time, TFLOP/s and ratio to the
dense rate, and the relative Frobenius differences fp32_batched vs optax and bf16 vs fp32.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import _flags  # noqa: E402

PROG = "python benchmarks/newton_schulz.py"
FLAGS = (
    _flags.Flag("iters", "int", 10, "timed calls per variant"),
    _flags.Flag("dense", "int", 0, "N of the dense bf16 reference matmul (0: from the NS FLOPs)"),
    _flags.Flag("seed", "int", 0, "seed of the random gradients"),
    _flags.Flag("per_shape", "int", -1, "also time the step forms on each block shape alone: the N "
                "largest shapes by FLOPs (0: all; -1: skip)"),
    _flags.Flag("variants", "list", ["bf16_batched", "fp32_batched", "optax"],
                "variants to time: bf16_batched, fp32_batched, optax"),
)


def muon_leaf_shapes(cfg) -> tuple[list[tuple[int, ...]], list]:
  """(shapes, dimension numbers) of the Muon leaves the optimizer sees (kv_b split in two)."""
  from k3train.optim import muon
  from k3train.train import builder
  from k3train.tree_paths import path_names
  params = builder.abstract_state(cfg).params
  sizes = muon.kv_b_block_sizes(params)
  shapes, dims = [], []
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    names = path_names(path)
    rule = muon.leaf_rule(names, x.ndim)
    if rule.dims is None:
      continue
    for width in sizes.get("/".join(names), (x.shape[-1],)):
      shapes.append(tuple(x.shape[:-1]) + (width,))
      dims.append(rule.dims)
  return shapes, dims


def random_leaves(shapes, seed: int) -> list[jax.Array]:
  keys = jax.random.split(jax.random.key(seed), len(shapes))
  make = jax.jit(lambda k, shape: jax.random.normal(k, shape, jnp.float32), static_argnums=1)
  return [make(k, s) for k, s in zip(keys, shapes)]


def variants(dims) -> dict:
  """name → function of the list of leaves, returning the orthogonalised leaves."""
  import optax.contrib._muon as optax_muon
  from k3train.optim import newton_schulz as ns
  coeffs = jnp.asarray(ns.NS_COEFFS, jnp.float32)

  def batched(dtype):
    return lambda leaves: ns.orthogonalize_leaves(leaves, dims, compute_dtype=dtype)

  def optax_per_leaf(leaves):
    return [optax_muon.orthogonalize_via_newton_schulz(x, coeffs, ns.NS_STEPS, "frobenius",
                                                       ns.NS_EPS, d) for x, d in zip(leaves, dims)]

  return {"bf16_batched": batched("bfloat16"), "fp32_batched": batched("float32"),
          "optax": optax_per_leaf}


def timed(fn, args, iters: int) -> tuple[float, float, object]:
  """(median seconds per call, compile seconds, the last output) of jit(fn)(*args)."""
  t0 = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  compile_s = time.perf_counter() - t0
  out = jax.block_until_ready(compiled(*args))          # warm-up
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    out = jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - t0)
  return float(np.median(times)), compile_s, out


def rel_frobenius(a, b) -> float:
  """‖a − b‖_F / ‖b‖_F over all leaves together."""
  num = sum(float(jnp.sum(jnp.square(x.astype(jnp.float32) - y))) for x, y in zip(a, b))
  den = sum(float(jnp.sum(jnp.square(y))) for y in b)
  return float(np.sqrt(num / den))


# The rate reference multiplies DENSE_BATCH [N, N] matrices by one [N, N] in one call (bf16
# output, fp32 accumulation), so one call's launch and host overhead do not dent the rate.
DENSE_BATCH = 8


def step_forms() -> dict:
  """name → function [batch, m, n] fp32 → NS result (m ≤ n), three ways of writing the bf16 step:

    plain        X, A, A², bA + cA² and aX + (bA + cA²)X each rounded to bf16 apart (the form
                 before the epilogue rewrite)
    scaled_fp32  the chain of alpha·(L·R) + C GEMMs written in fp32, rounded once per GEMM
                 (what every backend but GPU runs)
    scaled_bf16  the same chain with bf16 GEMM outputs and a bf16 scale and add (what the GPU runs)
  """
  from k3train.optim import newton_schulz as ns
  bf16, f32 = jnp.bfloat16, jnp.float32

  def normalized(x):
    return (x / (jnp.sqrt(jnp.sum(x * x, axis=(1, 2), keepdims=True)) + ns.NS_EPS)).astype(bf16)

  def plain(x):
    y = normalized(x)
    for _ in range(ns.NS_STEPS):
      y = ns._quintic_step(y, ns.NS_COEFFS, bf16)
    return y.astype(f32)

  def scaled(epilogue):
    def run(x):
      y, scale = ns._scaled_chain(normalized(x), ns.NS_COEFFS, ns.NS_STEPS, epilogue)
      return y.astype(f32) * scale
    return run

  return {"plain": plain, "scaled_fp32": scaled(f32), "scaled_bf16": scaled(bf16)}


def _hlo_counts(fn, x) -> dict:
  """cuBLAS / custom-call targets and fusion kinds in the optimized HLO of jit(fn)(x)."""
  import collections
  import re
  text = jax.jit(fn).lower(x).compile().as_text()
  counts = collections.Counter(re.findall(r'custom_call_target="([^"]+)"', text))
  counts.update(re.findall(r"kind=(k\w+)", text))
  return dict(counts)


def per_shape(layouts, iters: int, dense_rate: float, seed: int, limit: int) -> None:
  """One JSON line per block shape (the `limit` largest by FLOPs; 0: all): each step form of
  `step_forms` timed alone on that shape's blocks, its rate, its relative Frobenius difference
  to the fp32 iteration and, for the largest shape, its optimized HLO's GEMM calls and fusions."""
  from k3train.optim import newton_schulz as ns
  batches = {}
  for layout in layouts:
    batches[layout.block_shape] = batches.get(layout.block_shape, 0) + layout.batch
  shapes = sorted(batches.items(), key=lambda kv: -kv[1] * ns.ns_flops(*kv[0]))
  forms = step_forms()
  for rank, ((m, n), batch) in enumerate(shapes[:limit or None]):
    x = jax.random.normal(jax.random.key(seed), (batch, m, n), jnp.float32)
    ref = jax.jit(lambda x: ns.orthogonalize(x, compute_dtype="float32"))(x)
    row = {"block": f"{m}x{n}", "batch": batch}
    for name, fn in forms.items():
      seconds, _, out = timed(fn, (x,), iters)
      rate = batch * ns.ns_flops(m, n) / seconds
      err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
      row.update({f"{name}_ms": round(1e3 * seconds, 3), f"{name}_tflops": round(rate / 1e12, 1),
                  f"{name}_vs_dense": round(rate / dense_rate, 3), f"{name}_err": float(f"{err:.3g}")})
      if rank == 0:
        row[f"{name}_hlo"] = _hlo_counts(fn, x)
    print(json.dumps(row), flush=True)
    del x, ref


def dense_size(ns_flops: int) -> int:
  n = round((ns_flops / 2) ** (1 / 3) / 256) * 256
  return int(min(max(n, 256), 8192))


def main(argv=None) -> int:
  args = _flags.parse(argv, PROG, FLAGS)
  if args.exit_code is not None:
    return args.exit_code
  if args.config is None:
    _flags.error(PROG, "--config=FILE is required (e.g. --config=configs/k3_h200.py)")
    return _flags.USAGE_ERROR
  from k3train.optim import newton_schulz as ns
  f, cfg = args.flags, args.config
  shapes, dims = muon_leaf_shapes(cfg)
  layouts = [ns.BlockLayout(s, d) for s, d in zip(shapes, dims)]
  flops = ns.ns_flops_of_leaves(shapes, dims)
  leaves = random_leaves(shapes, f.seed)
  row = {"config": os.path.basename(f["config"].config_filename), "muon_leaves": len(shapes),
         "blocks": sum(l.batch for l in layouts),
         "block_shapes": len({l.block_shape for l in layouts}),
         "muon_params": int(sum(np.prod(s) for s in shapes)), "ns_tflop": flops / 1e12}

  n = f.dense or dense_size(flops)
  key_a, key_b = jax.random.split(jax.random.key(f.seed + 1))
  a = jax.random.normal(key_a, (DENSE_BATCH, n, n), jnp.bfloat16)
  b = jax.random.normal(key_b, (n, n), jnp.bfloat16)
  matmul = lambda a, b: jnp.einsum("rij,jk->rik", a, b, preferred_element_type=jnp.bfloat16)
  dense_s, _, _ = timed(matmul, (a, b), f.iters)
  dense_rate = DENSE_BATCH * 2 * n ** 3 / dense_s
  row.update(dense_n=n, dense_ms=1e3 * dense_s, dense_tflops=dense_rate / 1e12)
  del a, b

  if f.per_shape >= 0:
    per_shape(layouts, f.iters, dense_rate, f.seed, f.per_shape)
  fns = variants(dims)
  unknown = sorted(set(f.variants) - set(fns))
  if unknown:
    _flags.error(PROG, f"--variants: unknown {unknown}; known: {sorted(fns)}")
    return _flags.USAGE_ERROR

  def run(name):
    seconds, compile_s, out = timed(fns[name], (leaves,), f.iters)
    rate = flops / seconds
    row.update({f"{name}_ms": 1e3 * seconds, f"{name}_tflops": rate / 1e12,
                f"{name}_vs_dense": rate / dense_rate, f"{name}_compile_s": compile_s})
    return out

  outs = {}
  for name in ("bf16_batched", "fp32_batched", "optax"):
    if name in f.variants:
      outs[name] = run(name)
  if "bf16_batched" in outs and "fp32_batched" in outs:
    row["bf16_vs_fp32_rel_err"] = rel_frobenius(outs["bf16_batched"], outs["fp32_batched"])
  if "fp32_batched" in outs and "optax" in outs:
    row["fp32_batched_vs_optax_rel_err"] = rel_frobenius(outs["fp32_batched"], outs["optax"])
  row = {k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in row.items()}
  row.update(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
             python=platform.python_version(), date=time.strftime("%Y-%m-%d"))
  print(json.dumps(row), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
