"""AttnRes mixing sites: forward and forward+backward device time of the implementations.

  python benchmarks/attnres.py [--shapes=2x4096x2048] [--blocks=4] [--iters=50]
                               [--kernel_settings=rows:chunk:num_warps,...]
  python benchmarks/attnres.py --lowering_sites=30 [--shapes=4x4096x2048]   # any host

For each B×T×d and every valid block count 0 … N (N = --blocks slots in the stream's buffer),
times one mixing site and the RMSNorm after it, in bfloat16 with fp32 statistics:
  reference  `attn_res_mix(with_partial(blocks, num_blocks, p), num_blocks + 1, …)`, the
             sources buffer built per site and differentiated by autodiff;
  xla        `mix_pass(blocks, num_blocks, p, …, backend="xla")`, the buffer read in place with
             the explicit VJP in pure JAX;
  pallas_gpu the same with the backward kernel (GPU only; what the model runs there).
forward+backward is the gradient of Σ out · cotangent + Σ blocks' · ct_blocks + Σ p' · ct_p with
respect to blocks, p, query and gain, where (blocks', p') is the stream the site passes on: the
cotangents that later sites send back, which the mix's backward adds its gradients into.
With --lowering_sites=S it runs nothing: it lowers the gradient of S chained sites for CUDA
(possible on any host) twice, with the backward kernel's launcher jitted (what the op does: one
kernel body, called from every site) and with its body inlined at every site, and prints the
lowering seconds and the number of Triton kernel bodies in each module.

Otherwise it checks that all paths give the same output and gradients (each output's largest
difference over its largest magnitude ≤ 2e-2: bf16 rounding, and on GPUs the reference's fp32
einsums run at the default matmul precision), then prints one JSON line per (shape, path) with
the median over block counts of the per-call medians, and a table.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import _flags, _record  # noqa: E402
from k3train.model import attnres, layers  # noqa: E402
from pallas_kernels import attnres as attnres_ops  # noqa: E402
from pallas_kernels.attnres import pallas_gpu as attnres_pallas_gpu  # noqa: E402

PROG = "python benchmarks/attnres.py"
EPS = 1e-6
AGREE = 2e-2   # largest |reference − stream| over the largest |reference|, per output: bf16 level
FLAGS = (
    _flags.Flag("shapes", "list", ["2x4096x2048"], "B×T×d to time"),
    _flags.Flag("blocks", "int", 4, "block slots of the stream (N_max − 1)"),
    _flags.Flag("iters", "int", 50, "timed calls per setting"),
    _flags.Flag("lowering_sites", "int", 0, "only lower S chained sites for CUDA (see above)"),
    _flags.Flag("kernel_settings", "list", [],
                "extra pallas_gpu launch settings to time, each rows:chunk:num_warps"),
)


def _paths(settings=()):
  """Each site as the model runs it: the mix, then the RMSNorm that consumes it (XLA fuses the
  two, so their cost is measured together); each returns (normed output, blocks', p')."""
  def reference(blocks, n, p, q, g):
    mix = attnres_ops.attn_res_mix(attnres.with_partial(blocks, n, p), n + 1, q, g, EPS)
    return layers.rms_norm(mix, g, EPS), blocks, p

  def stream(backend):
    def run(blocks, n, p, q, g):
      mix, blocks, p = attnres_ops.mix_pass(blocks, n, p, q, g, EPS, backend)
      return layers.rms_norm(mix, g, EPS), blocks, p
    return run

  paths = {"reference": (reference, None), "xla": (stream("xla"), None)}
  if jax.default_backend() == "gpu":
    paths["pallas_gpu"] = (stream("pallas_gpu"), None)
    for text in settings:
      rows, chunk, warps = (int(x) for x in text.split(":"))
      paths[f"pallas_gpu[{text}]"] = (stream("pallas_gpu"),
                                      dict(rows=rows, chunk=chunk, num_warps=warps))
  return paths


def measure(b: int, t: int, d: int, num_slots: int, iters: int, settings=()) -> list[dict]:
  keys = jax.random.split(jax.random.key(0), 7)
  blocks = jax.random.normal(keys[0], (num_slots, b, t, d), jnp.float32).astype(jnp.bfloat16)
  p = jax.random.normal(keys[1], (b, t, d), jnp.float32).astype(jnp.bfloat16)
  q = 0.05 * jax.random.normal(keys[2], (d,), jnp.float32)
  g = 1.0 + 0.1 * jax.random.normal(keys[3], (d,), jnp.float32)
  cot = jax.random.normal(keys[4], (b, t, d), jnp.float32).astype(jnp.bfloat16)
  ct_blocks = jax.random.normal(keys[5], blocks.shape, jnp.float32).astype(jnp.bfloat16)
  ct_p = jax.random.normal(keys[6], p.shape, jnp.float32).astype(jnp.bfloat16)

  def loss(fn, bl, n, p, q, g):
    out, bl_out, p_out = fn(bl, n, p, q, g)
    return sum(jnp.sum((x * c).astype(jnp.float32))
               for x, c in ((out, cot), (bl_out, ct_blocks), (p_out, ct_p)))

  rows, results = [], {}
  for name, (fn, overrides) in _paths(settings).items():
    with attnres_pallas_gpu.configured(**(overrides or {})):
      fwd = jax.jit(lambda *a, fn=fn: fn(*a)[0])
      grad = jax.jit(jax.grad(lambda *a, fn=fn: loss(fn, *a), argnums=(0, 2, 3, 4)))
      fwd_s, bwd_s = [], []
      for n in range(num_slots + 1):
        args = (blocks, jnp.int32(n), p, q, g)
        fwd_s.append(_record.median_call_seconds(fwd, args, iters))
        bwd_s.append(_record.median_call_seconds(grad, args, iters))
      results[name] = (fwd(blocks, jnp.int32(2), p, q, g), grad(blocks, jnp.int32(2), p, q, g))
    rows.append({"shape": f"{b}x{t}x{d}", "slots": num_slots, "path": name,
                 "fwd_ms": round(1e3 * float(np.median(fwd_s)), 4),
                 "fwd_bwd_ms": round(1e3 * float(np.median(bwd_s)), 4),
                 "fwd_ms_by_count": [round(1e3 * x, 4) for x in fwd_s],
                 "fwd_bwd_ms_by_count": [round(1e3 * x, 4) for x in bwd_s]})
  out_r, grads_r = results["reference"]
  errors = {}
  for name in results:
    if name != "reference":
      out_s, grads_s = results[name]
      errors.update({f"{name}:{k}": v for k, v in _record.relative_errors(
          ("out", "d_blocks", "d_p", "d_query", "d_gain"), (out_r, *grads_r),
          (out_s, *grads_s)).items()})
  return _record.mark_agreement(rows, errors, AGREE, key="agree_bf16")


def lowering(b: int, t: int, d: int, num_slots: int, sites: int) -> list[dict]:
  """Lowering seconds of the gradient of `sites` chained sites for CUDA, launcher jitted or not."""
  import time
  from pallas_kernels.attnres import vjp as attnres_vjp
  blocks = jax.ShapeDtypeStruct((num_slots, b, t, d), jnp.bfloat16)
  p = jax.ShapeDtypeStruct((b, t, d), jnp.bfloat16)
  vec = jax.ShapeDtypeStruct((d,), jnp.float32)
  launchers = {
      "jitted": lambda *a: attnres_pallas_gpu.mix_backward(*a, interpret=False),
      "inlined": lambda *a: attnres_pallas_gpu._launch.__wrapped__(
          *a, interpret=False, settings=attnres_pallas_gpu.SETTINGS)}
  rows = []
  for name, backward in launchers.items():
    def loss(blocks, p, q, g, backward=backward):
      for _ in range(sites):
        out, blocks, p = attnres_vjp.mix_pass(blocks, jnp.int32(num_slots // 2), p, q, g, EPS,
                                              backward)
        p = p + out
      return jnp.sum(p.astype(jnp.float32))
    start = time.perf_counter()
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(blocks, p, vec, vec).lower(
        lowering_platforms=("cuda",)).as_text()
    rows.append({"shape": f"{b}x{t}x{d}", "slots": num_slots, "sites": sites, "launcher": name,
                 "lower_s": round(time.perf_counter() - start, 2),
                 "triton_bodies": text.count("__gpu$xla.gpu.triton"),
                 "module_mchars": round(len(text) / 1e6, 2)})
  return rows


def main(argv=None) -> int:
  args = _flags.parse(argv, PROG, FLAGS)
  if args.exit_code is not None:
    return args.exit_code
  f = args.flags
  if f.lowering_sites:
    _record.over_shapes(f.shapes, lambda b, t, d: lowering(b, t, d, f.blocks, f.lowering_sites))
    return 0
  rows = _record.over_shapes(f.shapes, lambda b, t, d: measure(b, t, d, f.blocks, f.iters,
                                                                    f.kernel_settings))
  print(f"{'shape':>14} {'path':>22} {'fwd ms':>8} {'fwd+bwd ms':>10} agree")
  for r in rows:
    print(f"{r['shape']:>14} {r['path']:>22} {r['fwd_ms']:>8.3f} {r['fwd_bwd_ms']:>10.3f} "
          f"{r['agree_bf16']}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
