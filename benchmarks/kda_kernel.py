"""KDA chunk kernels on one GPU: correctness vs the reference, then timings vs fla's chunk_kda.

  XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/kda_kernel.py [--shapes=2x8192x16,1x8192x96]
      [--variants=fused,split] [--check_variants=fused,split] [--skip=jax,fla_check]
      [--config=configs/k3_h200.py]

With --config and no --shapes the one shape timed is the config's KDA layer on one sequence,
1 × data.seq_len × model.kda.num_heads; the config's model.kda.head_dim and chunk_size must be the
K = V = 128 and chunk 64 timed here (as in kda_profile.py and kda_trace.py).

pallas_gpu variants (pallas_gpu.py): "fused" (the defaults: the forward state pass fused or split
by grid size) or "split" (the forward state pass split whatever the grid [split_fwd]), with
options joined by "-" (pallas_gpu.Settings fields in brackets):
  bv<N> (V-block of the fused state passes [bv]), w<N> (num_warps of the sequential state
  kernels [state_warps]), sst<N> / wst<N> (their num_stages at V-blocks <= 32 / above
  [state_stages, wide_stages]),
  sfwd / nosfwd (forward state pass split / fused whatever the grid [split_fwd]; default: by
  grid size), sbv<N> (V-block of that split forward [split_fwd_bv]),
  wbwd / nowbwd (backward state pass at wbv<N> / wbw<N> [wide_bwd_bv, wide_bwd_warps] or at
  bv / w whatever the grid [wide_bwd]; default: by grid size),
  sbk<N> / sw<N> / stst<N> (K-block, num_warps and num_stages of the strip score kernel
  [strip_bk, strip_warps, strip_stages]), xw<N> (num_warps of the WY inverse kernel
  [inverse_warps]), wubk<N> (column block of the W/U kernels [wu_bk]), ibk<N> / iw<N> / st<N>
  (K-block of the intra-chunk backward kernels, num_warps of those and of W/U, num_stages of the
  inverse, W/U and backward kernels [intra_bk, intra_warps, intra_stages]).
Each variant is compiled and timed inside `pallas_gpu.configured(...)`.

1. Checks (printed as max abs errors): pallas_gpu (each --check_variants) against the fp32 token
   recurrence ("reference")
   on a ragged T with mid-chunk segment resets and a non-zero initial state, in fp32 (IEEE dots)
   and in bf16 (reference run in fp32 on the same bf16-rounded inputs): outputs, final state and
   gradients wrt q, k, v, g, beta, initial_state. Also the "jax" backend, and fla's chunk_kda on
   the same bf16 inputs without segments, for scale.
2. Timings at each B×T×H (K = V = 128, bf16 q/k/v/beta, fp32 g from the lower-bound gate
   −5σ(·), unit-norm q/k, no initial state, no final state): forward and forward+backward
   (gradients wrt q, k, v, g, beta) for fla 0.6.0 chunk_kda (torch + triton) and our
   "pallas_gpu" (each --variants) and "jax" backends, all in this one process. Each timing:
   warm-up, then the median of 5 repeats of a 10-call loop (CUDA events for torch,
   block_until_ready for JAX). Each line also gives the wall seconds of that entry (compiles
   included), to plan the next run inside the device's 600 s per-call limit.
Prints the log and a markdown table (ms, and × fla) at the end; --json dumps the numbers.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import _flags  # noqa: E402
from pallas_kernels.kda import kda, pallas_gpu  # noqa: E402

PROG = "python benchmarks/kda_kernel.py"
K = V = 128
CHUNK = 64          # kda's default chunk_size, used by every call here

FLAGS = (
    _flags.Flag("shapes", "list", ["2x8192x16", "1x8192x96"],
                "B×T×H to time (K = V = 128); with --config and no --shapes, "
                "1 × data.seq_len × model.kda.num_heads"),
    _flags.Flag("variants", "list", ["fused", "split"],
                "pallas_gpu variants to time (see the module docstring)"),
    _flags.Flag("check_variants", "list", ["fused", "split"],
                "pallas_gpu variants to check against the reference"),
    _flags.Flag("skip", "list", [], "any of: check,fla_check,fla,pallas_gpu,jax"),
    _flags.Flag("json", "str", "", "write the timings to this JSON file"),
    _flags.Flag("compile_workers", "int", 8,
                "threads compiling the pallas_gpu variants of a shape before timing them"),
)


def shapes_of(args) -> list[str]:
  """--shapes, or with --config and no --shapes the config's KDA layer on one sequence. Raises
  ValueError when the config's head_dim or chunk_size is not the one these benchmarks time."""
  cfg = args.config
  if cfg is None:
    return list(args.flags.shapes)
  kda_cfg = cfg.model.kda
  if (kda_cfg.head_dim, kda_cfg.chunk_size) != (K, CHUNK):
    raise ValueError(f"model.kda.head_dim={kda_cfg.head_dim} chunk_size={kda_cfg.chunk_size}: "
                     f"these benchmarks time head_dim {K}, chunk {CHUNK}")
  if "shapes" in args.given:
    return list(args.flags.shapes)
  return [f"1x{cfg.data.seq_len}x{kda_cfg.num_heads}"]


def _inputs(rng, b, t, h, dtype):
  """Model-like KDA inputs as numpy fp32 (q/k unit-norm, g = −5σ(·), β = σ(·))."""
  n = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  sig = lambda x: 1 / (1 + np.exp(-x))
  q = n(rng.standard_normal((b, t, h, K))).astype(np.float32)
  k = n(rng.standard_normal((b, t, h, K))).astype(np.float32)
  v = rng.standard_normal((b, t, h, V)).astype(np.float32)
  g = (-5 * sig(rng.standard_normal((b, t, h, K)) - 1.0)).astype(np.float32)
  beta = sig(rng.standard_normal((b, t, h))).astype(np.float32)
  if dtype == "bf16":  # round the bf16 tensors once so every path sees the same values
    rnd = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
    q, k, v, beta = map(rnd, (q, k, v, beta))
  return q, k, v, g, beta


# Variant options joined by "-": <prefix><N> integer settings and named flags (pallas_gpu.Settings).
_INT_OPTIONS = {"bv": "bv", "w": "state_warps", "sst": "state_stages", "wst": "wide_stages",
                "sbv": "split_fwd_bv", "wbv": "wide_bwd_bv", "wbw": "wide_bwd_warps",
                "sbk": "strip_bk", "sw": "strip_warps", "stst": "strip_stages",
                "xw": "inverse_warps", "wubk": "wu_bk", "ibk": "intra_bk", "iw": "intra_warps",
                "st": "intra_stages"}
_FLAG_OPTIONS = {"sfwd": ("split_fwd", True), "nosfwd": ("split_fwd", False),
                 "wbwd": ("wide_bwd", True), "nowbwd": ("wide_bwd", False)}


def parse_options(name, opts):
  """Options (see the module docstring) -> pallas_gpu.configured keywords, validated."""
  kw = {}
  for opt in opts:
    m = re.fullmatch(r"([a-z]+)(\d+)", opt)
    if m and m.group(1) in _INT_OPTIONS:
      kw[_INT_OPTIONS[m.group(1)]] = int(m.group(2))
    elif opt in _FLAG_OPTIONS:
      key, value = _FLAG_OPTIONS[opt]
      kw[key] = value
    else:
      known = [f"{p}<N>" for p in _INT_OPTIONS] + list(_FLAG_OPTIONS)
      raise ValueError(f"variant {name!r}: unknown option {opt!r} ({', '.join(known)})")
  with pallas_gpu.configured(**kw):   # bad values raise before any device time is spent
    pass
  return kw


def parse_variant(name):
  """'fused' | 'split', then '-'-joined options -> pallas_gpu.configured keywords."""
  head, *opts = name.split("-")
  if head not in ("fused", "split"):
    raise ValueError(f"variant {name!r}: must start with 'fused' or 'split'")
  kw = parse_options(name, opts)
  if head == "split":
    kw["split_fwd"] = True
  return kw


def _err(a, b):
  return float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32))))


def check(lines, skip=frozenset(), variants=("fused",)):
  """Correctness on the GPU against the fp32 recurrence; appends report lines."""
  rng = np.random.default_rng(0)
  b, t, h = 2, 1000, 2
  seg = np.stack([np.repeat([0, 1, 2], [300, 21, 679]), np.repeat([4, 5], [777, 223])])
  s0 = rng.standard_normal((b, h, K, V)).astype(np.float32) * 0.5
  w_o = jnp.asarray(rng.standard_normal((b, t, h, V)), jnp.float32)
  w_s = jnp.asarray(rng.standard_normal((b, h, K, V)), jnp.float32)
  for dtype in ("fp32", "bf16"):
    q, k, v, g, beta = _inputs(rng, b, t, h, dtype)
    jdt = jnp.float32 if dtype == "fp32" else jnp.bfloat16

    def run_grads(backend, cast, variant=None):
      if variant is not None:
        with pallas_gpu.configured(**parse_variant(variant)):
          return run_grads(backend, cast)
      args = (jnp.asarray(q, cast), jnp.asarray(k, cast), jnp.asarray(v, cast), jnp.asarray(g),
              jnp.asarray(beta, cast), jnp.asarray(s0))

      def loss(q, k, v, g, beta, s0):
        o, s = kda(q, k, v, g, beta, initial_state=s0, segment_ids=seg, output_final_state=True,
                   backend=backend)
        return jnp.sum(o.astype(jnp.float32) * w_o) + jnp.sum(s * w_s), (o, s)

      (_, (o, s)), grads = jax.jit(jax.value_and_grad(loss, argnums=range(6), has_aux=True))(*args)
      return o, s, grads

    o_r, s_r, g_r = run_grads("reference", jnp.float32)
    entries = [("pallas_gpu", v) for v in variants] + [("jax", None)]
    for backend, variant in entries:
      if backend in skip:
        continue
      label = backend if variant is None else f"{backend}[{variant}]"
      try:
        o, s, gr = run_grads(backend, jdt, variant)
        errs = [_err(o, o_r), _err(s, s_r)] + [_err(x, y) for x, y in zip(gr, g_r)]
        scale = [_err(o_r, 0), _err(s_r, 0)] + [_err(y, 0) for y in g_r]
        lines.append(f"check {dtype:4s} {label:20s} max|err| o {errs[0]:.2e} S {errs[1]:.2e} "
                     + " ".join(f"d{n} {e:.2e}" for n, e in zip(
                         ("q", "k", "v", "g", "beta", "S0"), errs[2:]))
                     + "  (max|ref| " + " ".join(f"{x:.1f}" for x in scale) + ")")
      except Exception:  # keep measuring the rest; the failure is in the log
        lines.append(f"check {dtype} {label} FAILED: {traceback.format_exc()[-800:]}")
      print(lines[-1], flush=True)
    if dtype == "bf16" and "fla_check" not in skip:
      _check_fla(lines, q, k, v, g, beta, s0)


def _check_fla(lines, q, k, v, g, beta, s0):
  """fla's own bf16 error on the same inputs (no segments: fla packs those differently)."""
  try:
    import torch
    from fla.ops.kda import chunk_kda
    o_r, s_r = kda(*(jnp.asarray(x) for x in (q, k, v, g, beta)), initial_state=jnp.asarray(s0),
                   output_final_state=True, backend="reference")
    o, s = chunk_kda(_torch(q), _torch(k), _torch(v), _torch(g, torch.float32), _torch(beta),
                     initial_state=_torch(s0, torch.float32), output_final_state=True)
    lines.append(f"check bf16 fla        max|err| o {_err(o.float().cpu().numpy(), o_r):.2e} "
                 f"S {_err(s.float().cpu().numpy(), s_r):.2e} (no segments)")
  except Exception:
    lines.append(f"check fla FAILED: {traceback.format_exc()[-800:]}")
  print(lines[-1], flush=True)


def _torch(x, dtype=None):
  """A numpy array on the GPU as a torch tensor (bf16 unless `dtype`)."""
  import torch
  return torch.from_numpy(np.ascontiguousarray(x)).cuda().to(dtype or torch.bfloat16)


def fla_calls(np_inputs):
  """fla's chunk_kda on these inputs (bf16; g fp32) as two closures: forward (no grad) and
  forward + backward (gradients wrt q, k, v, g, beta, then cleared)."""
  import torch
  from fla.ops.kda import chunk_kda
  q, k, v, g, beta = np_inputs
  xs = [_torch(x).requires_grad_() for x in (q, k, v)]
  xs = xs + [_torch(g, torch.float32).requires_grad_(), _torch(beta).requires_grad_()]
  do = torch.ones_like(xs[2])

  def fwd():
    with torch.no_grad():
      return chunk_kda(*xs)[0]

  def fwd_bwd():
    chunk_kda(*xs)[0].backward(do)
    for x in xs:
      x.grad = None

  return fwd, fwd_bwd


def jax_calls(backend, v_shape):
  """Our op with `backend`, jitted: forward (o) and forward + backward (Σ o·1 and its gradients
  wrt q, k, v, g, beta), for inputs whose v has shape `v_shape`. The fwd+bwd returns the loss
  too, as a training step uses o: with gradients alone XLA may drop a kernel that only makes o
  (the split forward's output kernel), which fla's fwd+bwd (o.backward) cannot."""
  do = jnp.ones(v_shape, jnp.float32)
  fwd = jax.jit(lambda q, k, v, g, beta: kda(q, k, v, g, beta, backend=backend)[0])

  def loss(q, k, v, g, beta):
    return jnp.sum(kda(q, k, v, g, beta, backend=backend)[0].astype(jnp.float32) * do)

  return fwd, jax.jit(jax.value_and_grad(loss, argnums=range(5)))


def compile_parallel(jobs, workers=8):
  """{key: compiled} for jobs (key, pallas_gpu.configured keywords, jitted fn, args): each is
  lowered here under its settings (tracing reads the global settings), then all are compiled in
  `workers` threads at once (XLA compiles outside the GIL; one unrolled-kernel variant takes
  ~25 s to compile, so a run of many variants is bound by compiles done one by one)."""
  lowered = {}
  for key, kw, fn, args in jobs:
    with pallas_gpu.configured(**kw):
      lowered[key] = fn.lower(*args)
  with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
    futures = {key: pool.submit(low.compile) for key, low in lowered.items()}
    out = {}
    for key, fut in futures.items():
      try:
        out[key] = fut.result()
      except Exception:  # this key fails when it is used; the others still run
        print(f"compile {key} FAILED: {traceback.format_exc()[-1500:]}", flush=True)
  return out


def _median_ms(run_loop, reps=5):
  return statistics.median(run_loop() for _ in range(reps))


def time_jax(backend, arrays, reps=10, fns=None):
  """(fwd ms, fwd+bwd ms) of our op with `backend` (or of the given compiled `fns`)."""
  fns = fns or jax_calls(backend, arrays[2].shape)
  return [median_call_ms(fn, *arrays, reps=reps) for fn in fns]


def median_call_ms(fn, *args, reps=10):
  """ms per call of a jitted fn: warm-up, then the median of 5 repeats of a `reps`-call loop."""
  jax.block_until_ready(fn(*args))

  def loop():
    start = time.perf_counter()
    for _ in range(reps):
      r = fn(*args)
    jax.block_until_ready(r)
    return (time.perf_counter() - start) / reps * 1e3

  loop()
  return _median_ms(loop)


def time_fla(np_inputs, reps=10):
  import torch
  out = []
  for fn in fla_calls(np_inputs):
    for _ in range(3):
      fn()
    torch.cuda.synchronize()

    def loop():
      s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
      s.record()
      for _ in range(reps):
        fn()
      e.record()
      torch.cuda.synchronize()
      return s.elapsed_time(e) / reps

    out.append(_median_ms(loop))
  return out


def _table(shapes, names, results):
  """Markdown table: one row per entry, fwd / fwd+bwd ms per shape and the ratio to fla."""
  head = "| entry | " + " | ".join(f"{s} fwd | {s} fwd+bwd" for s in shapes) + " |"
  rows = [head, "|" + "---|" * (1 + 2 * len(shapes))]
  for name in names:
    cells = []
    for shape in shapes:
      res, base = results.get((shape, name)), results.get((shape, "fla"))
      for i in range(2):
        if res is None:
          cells.append("—")
        elif base is None or name == "fla":
          cells.append(f"{res[i]:.3f} ms")
        else:
          cells.append(f"{res[i]:.3f} ms ({res[i] / base[i]:.2f}× fla)")
    rows.append(f"| {name} | " + " | ".join(cells) + " |")
  return "\n".join(rows)


def main(argv=None) -> int:
  args = _flags.parse(argv, PROG, FLAGS)
  if args.exit_code is not None:
    return args.exit_code
  f = args.flags
  try:
    shapes = shapes_of(args)
    variants = [v for v in f.variants if v]
    check_variants = [v for v in f.check_variants if v]
    for v in variants + check_variants:
      parse_variant(v)                  # bad names fail before any device time is spent
  except ValueError as e:
    _flags.error(PROG, str(e))
    return _flags.USAGE_ERROR
  skip = set(filter(None, f.skip))
  lines = [f"jax {jax.__version__} devices {jax.devices()}"]
  try:
    import torch
    import triton
    lines.append(f"torch {torch.__version__} triton {triton.__version__} "
                 f"gpu {torch.cuda.get_device_name()}")
  except Exception as e:  # torch is only needed for the fla baseline
    lines.append(f"torch unavailable: {e}")
  print("\n".join(lines), flush=True)
  if "check" not in skip:
    start = time.perf_counter()
    check(lines, skip, check_variants)
    lines.append(f"check took {time.perf_counter() - start:.0f} s")
    print(lines[-1], flush=True)
  results = {}
  # Ours first, fla last in each shape: fla's autotuning takes minutes, so a run that hits the
  # device's time limit still has our numbers.
  entries = [(f"pallas_gpu[{v}]", v) for v in variants] + [("jax", None), ("fla", None)]
  entries = [(n, v) for n, v in entries if n.split("[")[0] not in skip]
  rng = np.random.default_rng(1)
  for shape in shapes:
    b, t, h = map(int, shape.split("x"))
    np_in = _inputs(rng, b, t, h, "bf16")
    arrays = tuple(jnp.asarray(x, jnp.float32 if i == 3 else jnp.bfloat16)
                   for i, x in enumerate(np_in))
    start = time.perf_counter()
    compiled = compile_parallel(
        [((variant, i), parse_variant(variant), fn, arrays) for name, variant in entries
         if variant is not None
         for i, fn in enumerate(jax_calls("pallas_gpu", arrays[2].shape))], f.compile_workers)
    lines.append(f"compile {shape}: {len(compiled)} executables in "
                 f"{time.perf_counter() - start:.0f} s ({f.compile_workers} threads)")
    print(lines[-1], flush=True)
    for name, variant in entries:
      start = time.perf_counter()
      try:
        if name == "fla":
          res = time_fla(np_in)
        elif variant is not None:
          fns = [compiled.get((variant, i)) for i in range(2)]
          if None in fns:
            raise RuntimeError(f"{variant} did not compile (see the compile line above)")
          res = time_jax("pallas_gpu", arrays, fns=fns)
        else:
          res = time_jax(name, arrays)
        results[(shape, name)] = res
        line = (f"time {shape:12s} {name:26s} fwd {res[0]:8.3f} ms  fwd+bwd {res[1]:8.3f} ms"
                f"  ({time.perf_counter() - start:.0f} s)")
      except Exception:
        line = f"time {shape} {name} FAILED: {traceback.format_exc()[-1500:]}"
      lines.append(line)
      print(line, flush=True)
  print("\n==== summary ====\n" + "\n".join(lines))
  print("\n" + _table(shapes, [n for n, _ in entries], results))
  if f.json:
    with open(f.json, "w") as out:
      json.dump({f"{s}/{n}": r for (s, n), r in results.items()}, out, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
