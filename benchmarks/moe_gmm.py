"""Benchmark + GPU numerical check of the latent-MoE grouped matmul (pallas_kernels.moe).

One run measures, on the same GPU: a dense bf16 matmul of equal FLOPs, jax.lax.ragged_dot,
tokamax.ragged_dot (if importable) and our Mosaic GPU kernels (pallas_gpu backend): forward, and
backward (dlhs + drhs) through jax.vjp. Shapes: latent-MoE gate+up (K=3584, N=6144) and down
(K=3072, N=3584), M=32768 rows, G=8 and G=32 local experts, uneven group sizes (gamma(2)-weighted
multinomial, seed 0). bf16 in, fp32 accumulation, bf16 out. First a numerical check of pallas_gpu
against ragged_dot (relative Frobenius error; poisoned outputs would show as NaN/huge).

Run on the device (tokamax and its missing deps as wheels in .whl; an empty `xprof` stand-in):
  python3 benchmarks/moe_gmm.py [--quick] [--max_seconds=420] [--config=configs/k3_h200.py]
With --config the two cases are that config's experts instead: G = model.moe.num_experts (all of
them on the one GPU), gate+up (K = latent_dim, N = 2·expert_hidden) and down (K = expert_hidden,
N = latent_dim), M = data.seq_len × model.moe.top_k rows (one sequence's routed tokens).
Each part (the numerical check, then each case) runs in its own process, so a GPU fault stays
local; no new part starts after --max_seconds.
Prints a table; results are recorded by hand in benchmarks/moe_gmm.md.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax                                    # noqa: E402
import jax.numpy as jnp                       # noqa: E402

from benchmarks import _flags                 # noqa: E402
from pallas_kernels.moe import pallas_gpu     # noqa: E402
from pallas_kernels.moe.pallas_gpu import gmm_pallas_gpu   # noqa: E402

PROG = "python3 benchmarks/moe_gmm.py"
T_START = time.time()
M_ROWS = 32768

FLAGS = (
    _flags.Flag("quick", "bool", False, "the first case only (G=8 gate+up; with --config gate+up)"),
    _flags.Flag("max_seconds", "float", 420.0, "start no new part or case after this many seconds"),
    _flags.Flag("part", "str", None, "numerics | case index (internal: one subprocess)"),
)


def log(*a):
  print(f"[{time.time() - T_START:6.1f}s]", *a, flush=True)


def import_tokamax():
  """tokamax 0.0.17 imports xprof (benchmarking only): give it an empty stand-in."""
  stub = tempfile.mkdtemp()
  os.makedirs(os.path.join(stub, "xprof", "cli"))
  for f in ("xprof/__init__.py", "xprof/cli/__init__.py"):
    open(os.path.join(stub, f), "w").close()
  with open(os.path.join(stub, "xprof/cli/tools.py"), "w") as fh:
    fh.write("get_kernel_stats_tool = None\n")
  sys.path.append(stub)
  import tokamax  # noqa: F401
  return tokamax


def uneven_sizes(m, g, seed=0):
  rng = np.random.default_rng(seed)
  p = rng.gamma(2.0, size=g)
  return rng.multinomial(m, p / p.sum()).astype(np.int32)


def bench(f, *args, min_rep_s=0.15, reps=5):
  """Median seconds per call of jitted f(*args) (compile + warm-up excluded)."""
  out = f(*args)
  jax.block_until_ready(out)
  t = time.perf_counter()
  jax.block_until_ready(f(*args))
  one = max(time.perf_counter() - t, 1e-5)
  n = max(1, int(min_rep_s / one))
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    for _ in range(n):
      out = f(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t) / n)
  return float(np.median(times))


def rel(a, b):
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def ragged_dot(lhs, rhs, gs):
  return jax.lax.ragged_dot(lhs, rhs, gs, preferred_element_type=jnp.float32).astype(lhs.dtype)


def numerics(key, m, k, n, sizes, dtype, cfg):
  """pallas_gpu vs ragged_dot: forward, dlhs, drhs (relative Frobenius errors)."""
  g = len(sizes)
  k1, k2, k3 = jax.random.split(key, 3)
  lhs = jax.random.normal(k1, (m, k), jnp.float32).astype(dtype)
  rhs = (jax.random.normal(k2, (g, k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
  ct = jax.random.normal(k3, (m, n), jnp.float32).astype(dtype)
  gs = jnp.asarray(sizes, jnp.int32)
  ours = jax.jit(lambda a, b, c: jax.vjp(lambda x, y: gmm_pallas_gpu(x, y, gs, config=cfg), a, b))
  ref = jax.jit(lambda a, b, c: jax.vjp(lambda x, y: ragged_dot(x, y, gs), a, b))
  o, vjp_o = ours(lhs, rhs, ct)
  r, vjp_r = ref(lhs, rhs, ct)
  do, dr = vjp_o(ct), vjp_r(ct)
  used = int(np.sum(sizes))
  tail_zero = bool(np.all(np.asarray(o[used:], np.float32) == 0)) and bool(
      np.all(np.asarray(do[0][used:], np.float32) == 0))
  empty_zero = all(bool(np.all(np.asarray(do[1][i], np.float32) == 0))
                   for i, s in enumerate(sizes) if s == 0)
  return dict(fwd=rel(o, r), dlhs=rel(do[0], dr[0]), drhs=rel(do[1], dr[1]),
              finite=bool(np.isfinite(np.asarray(o, np.float32)).all()),
              tail_zero=tail_zero, empty_zero=empty_zero)


def main(argv=None) -> int:
  argv = list(sys.argv if argv is None else argv)
  args = _flags.parse(argv, PROG, FLAGS)
  if args.exit_code is not None:
    return args.exit_code
  f = args.flags
  m, cases = cases_of(args.config)
  if f.part is None:         # driver: each part in its own process, so a GPU fault stays local
    drive(argv, f, m, cases)
    return 0
  if f.part != "numerics" and not (f.part.isdigit() and int(f.part) < len(cases)):
    _flags.error(PROG, f"--part must be numerics or a case index below {len(cases)}, "
                 f"got {f.part!r}")
    return _flags.USAGE_ERROR
  dev = jax.devices()[0]
  log("device:", dev.device_kind, "SMs:", getattr(dev, "core_count", "?"), "jax", jax.__version__)
  try:
    tokamax = import_tokamax()
    log("tokamax", getattr(tokamax, "__version__", "?"))
  except Exception as e:  # noqa: BLE001
    tokamax = None
    log("tokamax import failed:", repr(e)[:300])

  cfg = pallas_gpu.MgpuConfig()
  if f.part != "numerics":
    run_case(f, tokamax, m, cases[int(f.part)])
    return 0
  # ---- numerics: uneven groups, an empty group, rows past sum(group_sizes), M % 128 != 0.
  key = jax.random.PRNGKey(0)
  for dtype, (m, k, n), sizes in [
      (jnp.bfloat16, (4173, 512, 1024), [700, 0, 1500, 33, 900, 1, 640, 300]),
      (jnp.bfloat16, (2048, 256, 512), [0, 2048, 0, 0]),
      (jnp.float16, (1000, 256, 512), [100, 0, 500, 300]),
  ]:
    try:
      res = numerics(key, m, k, n, sizes, dtype, cfg)
      log("numerics", jnp.dtype(dtype).name, (m, k, n), sizes, res)
    except Exception as e:  # noqa: BLE001
      log("numerics FAILED", jnp.dtype(dtype).name, (m, k, n), repr(e)[:2000])
      traceback.print_exc()
  return 0



CASES = [(8, 3584, 6144, "gate+up"), (32, 3584, 6144, "gate+up"), (8, 3072, 3584, "down"),
         (32, 3072, 3584, "down")]


def cases_of(cfg):
  """(M rows, [(G, K, N, what)]): CASES at M_ROWS, or a config's experts (module docstring)."""
  if cfg is None:
    return M_ROWS, CASES
  e = cfg.model.moe
  return cfg.data.seq_len * e.top_k, [
      (e.num_experts, e.latent_dim, 2 * e.expert_hidden, "gate+up"),
      (e.num_experts, e.expert_hidden, e.latent_dim, "down")]


def drive(argv, f, m, cases):
  """Runs each part in a child process with this command's flags plus --part and the time left."""
  import json
  import subprocess
  parts = ["numerics"] + [str(i) for i in range(1 if f.quick else len(cases))]
  rows = []
  for part in parts:
    left = f.max_seconds - (time.time() - T_START)
    if left < 20:
      log("time limit reached; skipping part", part)
      continue
    try:
      p = subprocess.run([sys.executable, os.path.abspath(__file__), *argv[1:], f"--part={part}",
                          f"--max_seconds={left}"], capture_output=True, text=True,
                         timeout=left + 30)
      out = p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
      out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
      out += "\nTIMEOUT"
    for line in out.splitlines():
      if line.startswith("RESULT "):
        rows.append(json.loads(line[7:]))
      elif line.startswith("[") or "FAILED" in line or "Error" in line[:200]:
        print(line[:600], flush=True)
  print_table(rows, m)


def run_case(f, tokamax, m, case):
  import json
  rows = []
  cases = [case]
  fwd_cfgs = {"m8": pallas_gpu.MgpuConfig(),
              "m16": pallas_gpu.MgpuConfig(grid_width=16),
              "n4": pallas_gpu.MgpuConfig(grid_minor=1, grid_width=4)}
  for g, k, n, what in cases:
    if time.time() - T_START > f.max_seconds:
      log("time limit reached; skipping", g, k, n)
      continue
    sizes = uneven_sizes(m, g)
    flops = 2.0 * m * k * n
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(g + k), 3)
    lhs = jax.random.normal(k1, (m, k), jnp.bfloat16)
    rhs = (jax.random.normal(k2, (g, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    ct = jax.random.normal(k3, (m, n), jnp.bfloat16)
    gs = jnp.asarray(sizes)
    w_dense = rhs[0]
    res = {"G": g, "K": k, "N": n, "what": what}

    def run(name, f, *a, flop=flops):
      if time.time() - T_START > f.max_seconds + 60:
        return
      try:
        s = bench(jax.jit(f), *a)
        res[name] = flop / s / 1e12
        log(f"G={g} K={k} N={n} {name}: {s * 1e3:.3f} ms  {res[name]:.0f} TFLOP/s")
      except Exception as e:  # noqa: BLE001
        log(f"G={g} K={k} N={n} {name} FAILED: {repr(e)[:1500]}")

    def bwd_of(f):
      return lambda a, b, c: jax.vjp(f, a, b)[1](c)

    run("dense", lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype),
        lhs, w_dense)
    for name, c in fwd_cfgs.items():
      run(f"ours_fwd[{name}]", lambda a, b, c=c: pallas_gpu.gmm_mgpu(a, b, gs, config=c), lhs, rhs)
    fwd_best = max(fwd_cfgs, key=lambda nm: res.get(f"ours_fwd[{nm}]", 0))
    res["ours_fwd"] = res.get(f"ours_fwd[{fwd_best}]", float("nan"))
    bcfg = fwd_cfgs[fwd_best]
    run("ours_dlhs", lambda c, b: pallas_gpu.gmm_mgpu(c, b, gs, transpose_rhs=True, config=bcfg),
        ct, rhs)
    run("ours_drhs", lambda a, c: pallas_gpu.tgmm_mgpu(a, c, gs, config=bcfg), lhs, ct)
    run("ours_bwd", bwd_of(lambda a, b: gmm_pallas_gpu(a, b, gs, config=bcfg)), lhs, rhs, ct,
        flop=2 * flops)
    try:   # numerical spot check at the benchmark shape (forward)
      o = jax.jit(lambda a, b: pallas_gpu.gmm_mgpu(a, b, gs, config=bcfg))(lhs, rhs)
      r = jax.jit(lambda a, b: ragged_dot(a, b, gs))(lhs, rhs)
      res["fwd_rel_err"] = rel(o, r)
      log(f"G={g} K={k} N={n} fwd rel err vs ragged_dot: {res['fwd_rel_err']:.2e}")
    except Exception as e:  # noqa: BLE001
      log(f"G={g} K={k} N={n} fwd check FAILED: {repr(e)[:800]}")
    run("ragged_dot_fwd", lambda a, b: ragged_dot(a, b, gs), lhs, rhs)
    run("ragged_dot_bwd", bwd_of(lambda a, b: ragged_dot(a, b, gs)), lhs, rhs, ct, flop=2 * flops)
    if tokamax is not None:
      tk = lambda a, b: tokamax.ragged_dot(a, b, gs, preferred_element_type=jnp.bfloat16,
                                           implementation="mosaic")
      run("tokamax_fwd", tk, lhs, rhs)
      run("tokamax_bwd", bwd_of(tk), lhs, rhs, ct, flop=2 * flops)
    run("dense_again", lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32
                                            ).astype(a.dtype), lhs, w_dense)
    res["fwd_cfg"] = fwd_best
    rows.append(res)
    del lhs, rhs, ct

  for r in rows:
    print("RESULT " + json.dumps(r), flush=True)


def print_table(rows, m=M_ROWS):
  cols = ["dense", "dense_again", "ours_fwd", "ours_dlhs", "ours_drhs", "ours_bwd", "ragged_dot_fwd",
          "ragged_dot_bwd", "tokamax_fwd", "tokamax_bwd"]
  print(f"\nTFLOP/s (bf16, M={m}; bwd = dlhs+drhs, 4·M·K·N FLOPs)")
  print("| G | K | N | " + " | ".join(cols) + " | ours fwd/dense | ours bwd/dense | fwd cfg |")
  for r in rows:
    vals = " | ".join(f"{r.get(c, float('nan')):.0f}" for c in cols)
    fr = r.get("ours_fwd", float("nan")) / r.get("dense", float("nan"))
    br = r.get("ours_bwd", float("nan")) / r.get("dense", float("nan"))
    print(f"| {r['G']} | {r['K']} | {r['N']} | {vals} | {fr:.0%} | {br:.0%} | {r['fwd_cfg']} |")


if __name__ == "__main__":
  sys.exit(main())
