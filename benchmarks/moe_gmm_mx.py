"""Benchmark + GPU numerical check of the MX grouped matmul (QAT of the routed experts).

At the k3_h200 routed-expert GEMMs (64 experts, latent ℓ = 1024, expert hidden F = 768, top-8,
2 × 4096 tokens → M = 65536 rows; gate and up: K = ℓ, N = F; down: K = F, N = ℓ), on one GPU,
each case from what the MoE layer holds at the GEMM (bf16 activations a, bf16 expert weights w
that already hold Q(W), as in a QAT step; k3train/model/moe.py `_mx_gmm`):

  bf16        gmm(a, w) on the Mosaic GPU kernels: the model without QAT
  fake_quant  gmm(fake_quant(a, mxfp8), w): QAT with gemm="fake_quant"
  mx_xla      quantize(a) to MXFP8, export w to MXFP4, gmm_mx with the activations dequantised
              in XLA and the weights decoded in the kernel (`lhs_decode="xla"`)
  mx_kernel   the same with the MXFP8 activations decoded in the kernel (`lhs_decode="kernel"`,
              the default of gemm="mx")
  *_kernel_only / mx_kernel_s4 / mx_kernel_m64   the MX kernel alone on ready encodings
              (forward; mx_kernel_s4: 4 pipeline stages, mx_kernel_m64: tile_m = 64)
  mx_xla_bits / mx_kernel_bits   mx_xla_kernel_only / mx_kernel_kernel_only with the MXFP4
              weights decoded by integer bit construction (MgpuConfig.e2m1_decode="bits"; the
              others use the default "select")

Forward and forward+backward (gradients wrt a and w through the op's VJP; 3·2·M·K·N FLOPs).
Correctness per case at the benchmark shape: max abs error of the forward against the fp32
reference Σ deq(a)·deq(w) per group (ragged_dot at HIGHEST precision; for bf16 the reference
of a and w) and its bound 2^-8 · max|ref| (bf16 output rounding is at most half an ulp, 2^-9
relative, so the bound leaves a factor 2 for fp32 summation order); the same for the gradients
(straight-through: dlhs = ct·wᵀ, drhs = deq(a)ᵀ·ct per group, the VJP of that reference).
Before the cases, each shape logs how many elements of a jitted fake_quant(a) differ from
dequantize(quantize(a)) computed in two jits (XLA:GPU folds the float32 → float8 → float32
convert pair of a one-jit quantise-dequantise unless --xla_allow_excess_precision=false).

  python3 benchmarks/moe_gmm_mx.py                      # on the H200: one command, < 5 minutes
  python3 benchmarks/moe_gmm_mx.py --interpret          # CPU smoke test at tiny shapes
  python3 benchmarks/moe_gmm_mx.py --config=configs/k3_h200.py   # shapes from a config

First a numerical check of the two MX kernels on a small ragged problem (part "numerics": empty
group, rows past the groups, NaN scale bytes; numerics_mx_bits: the in-kernel activation decode
with the "bits" weight decode, whose output must equal numerics_mx_kernel's). Each part runs in
its own process (a GPU fault stays local); a failing case prints its error and the others go on;
no case starts after --max_seconds. One JSON line per case ("RESULT {...}") and a table last.
On an H200 the whole run took about 150 s before the two "bits" cases per shape were added
(each shape about 65 s, most of it compiles and the fp32 references).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax                                    # noqa: E402
import jax.numpy as jnp                       # noqa: E402

from benchmarks import _flags                 # noqa: E402
from benchmarks.moe_gmm import bench          # noqa: E402  (median seconds per call)
from k3train.quant import mx                  # noqa: E402
from pallas_kernels import moe as moe_ops     # noqa: E402
from pallas_kernels.moe import mx_operands, pallas_gpu     # noqa: E402

PROG = "python3 benchmarks/moe_gmm_mx.py"
T_START = time.time()

# k3_h200 (configs/k3_h200.py): model.moe.{num_experts, latent_dim, expert_hidden, top_k}, and
# 2 sequences of data.seq_len tokens. --config reads them from a config file instead.
K3_H200 = dict(experts=64, latent=1024, hidden=768, top_k=8, tokens=2 * 4096)
TINY = dict(experts=4, latent=256, hidden=256, top_k=2, tokens=100)    # --interpret

FLAGS = (
    _flags.Flag("interpret", "bool", False, "CPU smoke test: tiny shapes, Pallas interpret mode, "
                "one process, no timing loop"),
    _flags.Flag("max_seconds", "float", 240.0, "start no new case after this many seconds "
                "(with --interpret: no limit unless given)"),
    _flags.Flag("tokens", "int", 0, "tokens per step (0: 2 × 4096, or 2 × data.seq_len with "
                "--config)"),
    _flags.Flag("cases", "list", [], "run only these cases (default: all)"),
    _flags.Flag("part", "str", None, "numerics | gate | down (internal: one subprocess each)"),
)

CASES = ("bf16", "fake_quant", "mx_xla", "mx_kernel", "mx_xla_kernel_only", "mx_xla_bits",
         "mx_kernel_kernel_only", "mx_kernel_bits", "mx_kernel_s4", "mx_kernel_m64")


def log(*a):
  print(f"[{time.time() - T_START:6.1f}s]", *a, flush=True)


def shapes_of(cfg, tokens: int, interpret: bool):
  """(experts, M rows, {"gate": (K, N), "down": (K, N)})."""
  if interpret:
    d = dict(TINY)
  elif cfg is not None:
    e = cfg.model.moe
    d = dict(experts=e.num_experts, latent=e.latent_dim, hidden=e.expert_hidden, top_k=e.top_k,
             tokens=2 * cfg.data.seq_len)
  else:
    d = dict(K3_H200)
  if tokens:
    d["tokens"] = tokens
  m = d["tokens"] * d["top_k"]
  return d["experts"], m, {"gate": (d["latent"], d["hidden"]), "down": (d["hidden"], d["latent"])}


def uneven_sizes(m, g, seed=0):
  """gamma(2)-weighted multinomial group sizes summing to m, with group 1 empty."""
  rng = np.random.default_rng(seed)
  p = rng.gamma(2.0, size=g)
  p[1 % g] = 0.0
  return rng.multinomial(m, p / p.sum()).astype(np.int32)


def reference(a_f32, w_f32, gs):
  return jax.lax.ragged_dot(a_f32, w_f32, gs, precision=jax.lax.Precision.HIGHEST,
                            preferred_element_type=jnp.float32)


def run_part(part: str, g: int, m: int, k: int, n: int, f) -> list[dict]:
  """All cases of one shape; returns the result rows (also printed as RESULT lines)."""
  interp = bool(f.interpret)
  sizes = uneven_sizes(m, g)
  gs = jnp.asarray(sizes)
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(k * 7 + n), 3)
  a = jax.random.normal(k1, (m, k), jnp.float32).astype(jnp.bfloat16)
  w0 = jax.random.normal(k2, (g, k, n), jnp.float32) / np.sqrt(k)
  w = mx.fake_quant(w0, "mxfp4", axis=1).astype(jnp.bfloat16)       # holds Q(W), exactly
  ct = jax.random.normal(k3, (m, n), jnp.float32).astype(jnp.bfloat16)
  codes, sc = jax.jit(lambda x: mx.quantize(x, "mxfp8", axis=-1))(a)
  sbytes = mx.scale_bytes(sc)
  packed, wsc = jax.jit(lambda x: mx.export_mxfp4(x, in_axis=1))(w)
  a_q = mx.dequantize(codes, sc, "mxfp8", axis=-1)                   # fp32, exact
  fq_a = jax.jit(lambda x: mx.fake_quant(x, "mxfp8", axis=-1))(a).astype(jnp.float32)
  diff = np.abs(np.asarray(fq_a) - np.asarray(a_q))
  log(f"{part}: fake_quant(a) in one jit vs dequantize(quantize(a)) in two: "
      f"{int((diff > 0).sum())} of {diff.size} elements differ, max {float(diff.max()):.3g}")
  one_jit = jax.jit(lambda x: mx_operands.dequantize_lhs(
      *(lambda c, s: (c, mx.scale_bytes(s)))(*mx.quantize(x, "mxfp8", axis=-1)), jnp.float32))(a)
  diff = np.abs(np.asarray(one_jit) - np.asarray(a_q))
  log(f"{part}: mx_operands.dequantize_lhs(quantize(a)) in one jit vs two: "
      f"{int((diff > 0).sum())} elements differ, max {float(diff.max()):.3g}")
  def ref_with_grads(x, y):   # fp32 forward and its VJP at ct (dlhs = ct·yᵀ, drhs = xᵀ·ct)
    out, pull = jax.vjp(reference, x, y, gs)
    return (out, *pull(ct.astype(jnp.float32))[:2])
  ref_mx = [np.asarray(t) for t in jax.jit(ref_with_grads)(a_q, w.astype(jnp.float32))]
  ref_bf = [np.asarray(t) for t in jax.jit(ref_with_grads)(a.astype(jnp.float32),
                                                           w.astype(jnp.float32))]
  flops = 2.0 * m * k * n
  log(f"{part}: G={g} M={m} K={k} N={n} groups: min {sizes.min()} max {sizes.max()} "
      f"(group 1 empty)")

  def gmm_bf16(x, y):
    return moe_ops.gmm(x, y, gs, backend="pallas_gpu")

  def fake_quant(x, y):
    return moe_ops.gmm(mx.fake_quant(x, "mxfp8", axis=-1), y, gs, backend="pallas_gpu")

  def gmm_mx(lhs_decode):
    def fn(x, y):
      c, s = mx.quantize(x, "mxfp8", axis=-1)
      p, ws = mx.export_mxfp4(y, in_axis=1)
      return moe_ops.gmm_mx(x, y, gs, lhs_codes=c, lhs_scales=mx.scale_bytes(s), rhs_packed=p,
                            rhs_scales=ws, backend="pallas_gpu", lhs_decode=lhs_decode)
    return fn

  def kernel_only(lhs_decode, cfg=pallas_gpu.DEFAULT_CONFIG):
    def fn(c, s, p, ws):
      return pallas_gpu.gmm_mx_pallas_gpu_forward(c, s, p, ws, gs, jnp.bfloat16,
                                                  lhs_decode=lhs_decode, config=cfg,
                                                  interpret=interp)
    return fn

  ops = {"bf16": gmm_bf16, "fake_quant": fake_quant, "mx_xla": gmm_mx("xla"),
         "mx_kernel": gmm_mx("kernel")}
  only = {"mx_xla_kernel_only": kernel_only("xla"), "mx_kernel_kernel_only": kernel_only("kernel"),
          "mx_kernel_s4": kernel_only("kernel", pallas_gpu.MgpuConfig(stages=4)),
          "mx_kernel_m64": kernel_only("kernel", pallas_gpu.MgpuConfig(tile_m=64)),
          "mx_xla_bits": kernel_only("xla", pallas_gpu.MgpuConfig(e2m1_decode="bits")),
          "mx_kernel_bits": kernel_only("kernel", pallas_gpu.MgpuConfig(e2m1_decode="bits"))}
  wanted = [c for c in CASES if not f.cases or c in f.cases]
  rows = []
  for case in wanted:
    if time.time() - T_START > f.max_seconds:
      log(f"{part} {case}: skipped (past --max_seconds)")
      continue
    res = {"shape": part, "G": g, "M": m, "K": k, "N": n, "case": case}
    t0 = time.time()
    try:
      if case in ops:
        fwd = jax.jit(ops[case])
        fb = jax.jit(lambda x, y, c, fn=ops[case]: (lambda o, pull: (o, *pull(c)))(
            *jax.vjp(fn, x, y)))
        out = fwd(a, w)
        args = (a, w)
      else:
        fwd = jax.jit(only[case])
        fb = None
        args = (codes, sbytes, packed, wsc)
        out = fwd(*args)
      out = np.asarray(out.astype(jnp.float32))
      ref, ref_da, ref_dw = ref_bf if case == "bf16" else ref_mx
      err = float(np.max(np.abs(out - ref)))
      ref_max = float(np.max(np.abs(ref)))
      bound = 2.0 ** -8 * ref_max
      res.update(max_abs_err=err, ref_max_abs=ref_max, err_bound=bound, ok=bool(err <= bound),
                 tail_rows_zero=bool(np.all(out[int(sizes.sum()):] == 0)))
      if fb is not None:
        _, da, dw = fb(a, w, ct)
        da_err = float(np.max(np.abs(np.asarray(da, np.float32) - ref_da)))
        dw_err = float(np.max(np.abs(np.asarray(dw, np.float32) - ref_dw)))
        res.update(dlhs_err=da_err, dlhs_bound=2.0 ** -8 * float(np.max(np.abs(ref_da))),
                   drhs_err=dw_err, drhs_bound=2.0 ** -8 * float(np.max(np.abs(ref_dw))))
        res["grads_ok"] = bool(da_err <= res["dlhs_bound"] and dw_err <= res["drhs_bound"])
      if not interp:
        s = bench(fwd, *args)
        res.update(fwd_ms=s * 1e3, fwd_tflops=flops / s / 1e12)
        if fb is not None:
          s = bench(fb, a, w, ct)
          res.update(fwdbwd_ms=s * 1e3, fwdbwd_tflops=3 * flops / s / 1e12)
      res["wall_s"] = round(time.time() - t0, 1)
      log(f"{part} {case}: " + ", ".join(
          f"{key}={val:.4g}" if isinstance(val, float) else f"{key}={val}"
          for key, val in res.items() if key not in ("shape", "G", "M", "K", "N", "case")))
    except Exception as e:  # noqa: BLE001
      res["error"] = repr(e)[:1500]
      log(f"{part} {case} FAILED: {repr(e)[:1500]}")
      traceback.print_exc(limit=4)
    print("RESULT " + json.dumps(res), flush=True)
    rows.append(res)
  return rows


def run_numerics(f) -> list[dict]:
  """The MX kernels on a ragged problem: M = 1003 rows, groups [200, 0, 333, 7, 400] (an empty
  group, a group smaller than a tile, 63 rows past the groups), K = 256, N = 512, a NaN scale
  byte in the activations (row 300, block 3) and in the weights (group 4, column 17, block 5).
  Checks against the fp32 reference: max abs error off the NaN rows/columns, exactly the expected
  NaNs, zeros past the groups; the in-kernel activation decode against the XLA one, and the
  "bits" weight decode against the default one (bit for bit)."""
  interp = bool(f.interpret)
  m, k, n, sizes = 1003, 256, 512, [200, 0, 333, 7, 400]
  gs = jnp.asarray(sizes, jnp.int32)
  k1, k2 = jax.random.split(jax.random.PRNGKey(3))
  a = jax.random.normal(k1, (m, k), jnp.float32) * 4.0
  w = jax.random.normal(k2, (len(sizes), k, n), jnp.float32) / np.sqrt(k)
  codes, sc = mx.quantize(a, "mxfp8", axis=-1)
  sbytes = mx.scale_bytes(sc).at[300, 3].set(255)
  packed, wsc = mx.export_mxfp4(w, in_axis=1)
  wsc = wsc.at[4, 17, 5].set(255)
  a_q = mx.dequantize(codes, mx.scales_from_bytes(sbytes), "mxfp8", axis=-1)
  w_q = jnp.swapaxes(mx.import_mxfp4(packed, wsc, in_axis=2), 1, 2)       # [G, K, N] fp32
  a64, w64 = np.asarray(a_q, np.float64), np.asarray(w_q, np.float64)
  ref, row = np.zeros((m, n)), 0            # per group in numpy (NaN stays in its group)
  for gi, size in enumerate(sizes):
    ref[row:row + size] = a64[row:row + size] @ w64[gi]
    row += size
  used = int(sum(sizes))
  want_nan = np.zeros((m, n), bool)
  want_nan[300, :] = True
  g4 = slice(used - sizes[4], used)
  want_nan[g4, 17] = True
  rows = []
  outs = {}
  for case, lhs_decode, e2m1 in (("numerics_mx_kernel", "kernel", "select"),
                                 ("numerics_mx_xla", "xla", "select"),
                                 ("numerics_mx_bits", "kernel", "bits")):
    res = {"shape": "numerics", "G": len(sizes), "M": m, "K": k, "N": n, "case": case}
    try:
      cfg = pallas_gpu.MgpuConfig(e2m1_decode=e2m1)
      fn = jax.jit(lambda c, s_, p, ws, d=lhs_decode, cfg=cfg:
                   pallas_gpu.gmm_mx_pallas_gpu_forward(c, s_, p, ws, gs, jnp.bfloat16,
                                                        lhs_decode=d, config=cfg,
                                                        interpret=interp))
      out = np.asarray(fn(codes, sbytes, packed, wsc).astype(jnp.float32))
      outs[case] = out
      ok_mask = ~want_nan
      err = float(np.max(np.abs(out[ok_mask] - ref[ok_mask])))
      bound = 2.0 ** -8 * float(np.max(np.abs(ref[ok_mask])))
      res.update(max_abs_err=err, err_bound=bound, ok=bool(err <= bound),
                 nan_as_expected=bool(np.array_equal(np.isnan(out), want_nan)),
                 tail_rows_zero=bool(np.all(out[used:] == 0)))
      if e2m1 == "bits" and "numerics_mx_kernel" in outs:
        res["equals_select"] = bool(np.array_equal(out, outs["numerics_mx_kernel"],
                                                   equal_nan=True))
      log(f"numerics {case}: " + ", ".join(f"{key}={val}" for key, val in res.items()
                                          if key not in ("shape", "G", "M", "K", "N", "case")))
    except Exception as e:  # noqa: BLE001
      res["error"] = repr(e)[:1500]
      log(f"numerics {case} FAILED: {repr(e)[:1500]}")
      traceback.print_exc(limit=4)
    print("RESULT " + json.dumps(res), flush=True)
    rows.append(res)
  if "numerics_mx_kernel" in outs and "numerics_mx_xla" in outs:
    d = np.abs(np.nan_to_num(outs["numerics_mx_kernel"]) - np.nan_to_num(outs["numerics_mx_xla"]))
    log(f"numerics: in-kernel vs XLA activation decode, max abs difference {float(d.max()):.3g}")
  return rows


def print_header():
  import jaxlib
  dev = jax.devices()[0]
  log("device:", dev.platform, getattr(dev, "device_kind", "?"), "SMs:",
      getattr(dev, "core_count", "?"), "| jax", jax.__version__, "jaxlib",
      getattr(jaxlib, "__version__", "?"), "| python", platform.python_version())
  if dev.platform == "gpu":
    try:
      smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
      log("nvidia-smi:", smi.stdout.strip())
    except Exception as e:  # noqa: BLE001
      log("nvidia-smi unavailable:", repr(e)[:200])


def print_table(rows):
  print("\nms (TFLOP/s); fwd+bwd = forward and gradients wrt a and w; fwd err = max abs error "
        "vs the fp32 reference / its bound; grads: dlhs and drhs within their bounds", flush=True)
  print(f"| {'shape':8} | {'case':21} | {'fwd ms':>13} | {'fwd+bwd ms':>13} | "
        f"{'fwd err / bound':>17} | grads |")
  for r in rows:
    fwd = f"{r['fwd_ms']:.3f} ({r['fwd_tflops']:.0f})" if "fwd_ms" in r else "-"
    fb = f"{r['fwdbwd_ms']:.3f} ({r['fwdbwd_tflops']:.0f})" if "fwdbwd_ms" in r else "-"
    if "error" in r:
      err = "FAILED"
    elif "max_abs_err" in r:
      err = f"{r['max_abs_err']:.2g} / {r['err_bound']:.2g}" + ("" if r["ok"] else " !")
    else:
      err = "-"
    grads = {True: "ok", False: "BAD"}.get(r.get("grads_ok"), "-")
    print(f"| {r['shape']:8} | {r['case']:21} | {fwd:>13} | {fb:>13} | {err:>17} | {grads:>5} |",
          flush=True)


def drive(argv, f, parts):
  """Each shape in a child process with this command's flags, --part and the time left."""
  rows = []
  for part in parts:
    left = f.max_seconds - (time.time() - T_START)
    if left < 15:
      log("time limit reached; skipping", part)
      continue
    try:
      p = subprocess.run([sys.executable, os.path.abspath(__file__), *argv[1:], f"--part={part}",
                          f"--max_seconds={left}"], capture_output=True, text=True,
                         timeout=left + 60)
      out = p.stdout + p.stderr
      if p.returncode:
        out += f"\n{part}: child exited with {p.returncode}"
    except subprocess.TimeoutExpired as e:
      out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
      out += f"\n{part}: TIMEOUT"
    for line in out.splitlines():
      if line.startswith("RESULT "):
        rows.append(json.loads(line[7:]))
      print(line[:2000], flush=True)
  print_table(rows)


def main(argv=None) -> int:
  argv = list(sys.argv if argv is None else argv)
  args = _flags.parse(argv, PROG, FLAGS)
  if args.exit_code is not None:
    return args.exit_code
  f = args.flags
  unknown = [c for c in f.cases if c not in CASES]
  if unknown:
    _flags.error(PROG, f"unknown --cases {unknown}; allowed: {', '.join(CASES)}")
    return _flags.USAGE_ERROR
  if f.interpret and "max_seconds" not in args.given:
    f.max_seconds = float("inf")        # the smoke test runs every case, however slowly
  g, m, shapes = shapes_of(args.config, f.tokens, f.interpret)
  parts = ["numerics", *shapes]
  if f.part is not None and f.part not in parts:
    _flags.error(PROG, f"--part must be one of {', '.join(parts)}, got {f.part!r}")
    return _flags.USAGE_ERROR
  if f.interpret:
    from tests.pallas_kernels import mgpu_interpret_shim    # the interpreter's wgmma gaps
    mgpu_interpret_shim.install()
  elif f.part is None:
    drive(argv, f, parts)
    return 0
  print_header()
  rows = []
  for part in ([f.part] if f.part else parts):
    if part == "numerics":
      rows += run_numerics(f)
    else:
      k, n = shapes[part]
      rows += run_part(part, g, m, k, n, f)
  if f.part is None:
    print_table(rows)
  return 0


if __name__ == "__main__":
  sys.exit(main())
