"""SiTU-GLU: forward and training-pass device time of the backends.

  python benchmarks/situ_glu.py [--scaled_shapes=131072x768] [--shapes=16384x2048,16384x8192]
                                [--iters=50] [--kernel_settings=rows:cols:num_warps,...]
                                [--tail_shapes=131072x768x1024x64]

Each shape is N rows × F hidden units of bf16 g and u (`scaled_shapes` with an fp32 row scale,
as the routed experts call it; `shapes` without, as the shared experts and the dense FFN). Two
timings per path:
  fwd_ms    h = SiTU-GLU(g, u[, r]) alone;
  train_ms  the forward, then under `jax.checkpoint` (nothing saved, as the train step's
            rematerialised layers) the gradient of Σ c·h² with respect to g, u (and r): the
            forward again to rebuild h (the down projection's weight gradient reads h) and the
            backward. It is what one call site costs the train step.
Paths: "xla" (autodiff of the jnp formula), "pallas_gpu" (the kernels at their default
settings; what "auto" runs on a GPU) and pallas_gpu[rows:cols:warps] (other launch settings).
Every path's h and gradients are compared with the float64 oracle at the same inputs: the
largest difference over the largest magnitude. One JSON line per (shape, path), then a table;
`fwd_gb_per_s` is what one forward must read and write at least over its measured time.

`tail_shapes` (M×F×ℓ×E) time the routed experts' activation with their down projection, as a
layer runs them: y = gmm(SiTU-GLU(g, u)·r, W_down [E, F, ℓ]) over M rows in E equal groups, the
training pass as above (forward, then the rematerialised gradient of Σ c·y² with respect to g, u,
r and W_down), for "tail:xla" (the two ops under autodiff, the default) and "tail:pallas_gpu"
(`k3train.model.expert_tail`: the kernels, the backward writing h, no second forward), whose
gradients are compared with the composed path's (`grad_err_vs_tail_xla`). The grouped matmul
is `pallas_kernels.moe.gmm` with backend "auto".
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import _flags, _record  # noqa: E402
from k3train.model import expert_tail  # noqa: E402
from pallas_kernels import moe as moe_ops  # noqa: E402
from pallas_kernels import situ_glu  # noqa: E402
from pallas_kernels.situ_glu import pallas_gpu, reference, vjp  # noqa: E402

PROG = "python benchmarks/situ_glu.py"
FLAGS = (
    _flags.Flag("scaled_shapes", "list", ["131072x768"], "N×F with a row scale (routed experts)"),
    _flags.Flag("shapes", "list", ["16384x2048", "16384x8192"], "N×F without (shared, dense)"),
    _flags.Flag("iters", "int", 50, "timed calls per path"),
    _flags.Flag("kernel_settings", "list", [],
                "extra pallas_gpu launch settings to time, each rows:cols:num_warps"),
    _flags.Flag("tail_shapes", "list", ["131072x768x1024x64"],
                "M×F×ℓ×E of the activation with the experts' down projection"),
)
BETA, LINEAR_BETA = 4.0, 25.0


def _paths(settings_texts):
  paths = {"xla": lambda g, u, r: situ_glu.situ_glu(g, u, BETA, LINEAR_BETA, r, backend="xla")}
  if jax.default_backend() == "gpu":
    paths["pallas_gpu"] = lambda g, u, r: situ_glu.situ_glu(g, u, BETA, LINEAR_BETA, r,
                                                            backend="pallas_gpu")
    for text in settings_texts:
      rows, cols, warps = (int(v) for v in text.split(":"))
      cfg = pallas_gpu.Settings(rows, cols, warps)
      fn = vjp.differentiable_situ_glu(
          lambda g, u, r, cfg=cfg, **kw: pallas_gpu.forward(g, u, r, settings=cfg, **kw),
          lambda g, u, dh, r, cfg=cfg, **kw: pallas_gpu.backward(g, u, dh, r, settings=cfg, **kw))
      paths[f"pallas_gpu[{text}]"] = (
          lambda g, u, r, fn=fn: fn(g, u, r, BETA, LINEAR_BETA, False))
  return paths


def measure(n, f, scaled, iters, settings_texts):
  kg, ku, kc, kr, kd = jax.random.split(jax.random.key(0), 5)
  g = (jax.random.normal(kg, (n, f), jnp.float32) * 3).astype(jnp.bfloat16)
  u = (jax.random.normal(ku, (n, f), jnp.float32) * 3).astype(jnp.bfloat16)
  c = jax.random.normal(kc, (n, f), jnp.float32).astype(jnp.bfloat16)
  dh = jax.random.normal(kd, (n, f), jnp.float32).astype(jnp.bfloat16)
  r = jax.random.uniform(kr, (n,), jnp.float32) if scaled else None

  with jax.enable_x64(True):
    to64 = lambda v: None if v is None else jnp.asarray(np.asarray(v, np.float64))
    want = (reference.situ_glu(to64(g), to64(u), BETA, LINEAR_BETA, to64(r)),
            *reference.situ_glu_grads(to64(g), to64(u), to64(dh), BETA, LINEAR_BETA, to64(r)))
    want = [None if v is None else np.asarray(v) for v in want]

  # Bytes a forward must move: read g and u, write h (the row scale is negligible).
  fwd_bytes = 3 * 2 * n * f
  rows = []
  for name, fn in _paths(settings_texts).items():
    fwd = jax.jit(fn)

    def loss(g, u, r, fn=fn):
      h = jax.checkpoint(fn, policy=jax.checkpoint_policies.nothing_saveable)(g, u, r)
      return jnp.sum(c.astype(jnp.float32) * jnp.square(h.astype(jnp.float32)))

    train = jax.jit(jax.grad(loss, argnums=(0, 1, 2) if scaled else (0, 1)))

    def vjp_once(g, u, r, dh, fn=fn):
      h, pull = jax.vjp(lambda a, b, s: fn(a, b, s), g, u, r)
      return (h, *pull(dh))

    got = jax.jit(vjp_once)(g, u, r, dh)
    errors = {}
    for kind, a, w in zip(("h", "dg", "du", "dr"), got, want):
      if w is None:
        continue
      a = np.asarray(a, np.float64)
      errors[kind] = float(f"{np.abs(a - w).max() / max(np.abs(w).max(), 1e-30):.3g}")
    fwd_s = _record.median_call_seconds(fwd, (g, u, r), iters)
    train_s = _record.median_call_seconds(train, (g, u, r), iters)
    rows.append({"shape": f"{n}x{f}", "row_scale": scaled, "path": name,
                 "fwd_ms": round(1e3 * fwd_s, 4), "train_ms": round(1e3 * train_s, 4),
                 "fwd_gb_per_s": round(fwd_bytes / fwd_s / 1e9, 1),
                 "max_err_rel_to_max": errors})
  return rows


def measure_tail(m, f, latent, experts, iters):
  """The activation with the down projection, composed (xla) and as one op (kernels)."""
  kg, ku, kc, kr, kw = jax.random.split(jax.random.key(1), 5)
  g = (jax.random.normal(kg, (m, f), jnp.float32) * 3).astype(jnp.bfloat16)
  u = (jax.random.normal(ku, (m, f), jnp.float32) * 3).astype(jnp.bfloat16)
  r = jax.random.uniform(kr, (m,), jnp.float32)
  w = (jax.random.normal(kw, (experts, f, latent), jnp.float32) * f ** -0.5).astype(jnp.bfloat16)
  c = jax.random.normal(kc, (m, latent), jnp.float32).astype(jnp.bfloat16)
  group_sizes = jnp.full((experts,), m // experts, jnp.int32)
  gmm = lambda a, b, gs: moe_ops.gmm(a, b, gs, backend="auto")
  paths = {"tail:xla": lambda g, u, r, w: gmm(situ_glu.situ_glu(g, u, BETA, LINEAR_BETA, r,
                                                                backend="xla"), w, group_sizes)}
  if jax.default_backend() == "gpu":
    paths["tail:pallas_gpu"] = lambda g, u, r, w: expert_tail.situ_glu_down(
        g, u, r, w, (group_sizes,), down=gmm, beta=BETA, linear_beta=LINEAR_BETA,
        situ_backend="pallas_gpu")
  rows, want = [], None
  for name, fn in paths.items():
    def loss(g, u, r, w, fn=fn):
      y = jax.checkpoint(fn, policy=jax.checkpoint_policies.nothing_saveable)(g, u, r, w)
      return jnp.sum(c.astype(jnp.float32) * jnp.square(y.astype(jnp.float32)))
    train = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    grads = train(g, u, r, w)
    errors = {}
    if want is None:
      want = grads
    else:
      errors = _record.relative_errors(("dg", "du", "dr", "dw"), want, grads)
    rows.append({"shape": f"{m}x{f}x{latent}x{experts}", "row_scale": True, "path": name,
                 "fwd_ms": round(1e3 * _record.median_call_seconds(jax.jit(fn), (g, u, r, w),
                                                                   iters), 4),
                 "train_ms": round(1e3 * _record.median_call_seconds(train, (g, u, r, w), iters),
                                   4),
                 "grad_err_vs_tail_xla": errors})
  return rows


def main(argv=None) -> int:
  args = _flags.parse(argv, PROG, FLAGS)
  if args.exit_code is not None:
    return args.exit_code
  fl = args.flags
  env = _record.environment()
  rows = []
  for shapes, scaled in ((fl.scaled_shapes, True), (fl.shapes, False)):
    for shape in shapes:
      n, f = _record.dims(shape)
      rows += _record.emit(measure(n, f, scaled, fl.iters, fl.kernel_settings), env)
  for shape in fl.tail_shapes:
    rows += _record.emit(measure_tail(*_record.dims(shape), fl.iters), env)
  print(f"{'shape':>18} {'scale':>5} {'path':>22} {'fwd ms':>8} {'fwd GB/s':>8} {'train ms':>9} "
        f"{'worst err':>9}")
  for r in rows:
    errors = r.get("max_err_rel_to_max") or r.get("grad_err_vs_tail_xla") or {}
    worst = f"{max(errors.values()):>9.2e}" if errors else f"{'-':>9}"
    gbps = f"{r['fwd_gb_per_s']:>8.0f}" if "fwd_gb_per_s" in r else f"{'-':>8}"
    print(f"{r['shape']:>18} {str(r['row_scale']):>5} {r['path']:>22} {r['fwd_ms']:>8.3f} "
          f"{gbps} {r['train_ms']:>9.3f} {worst}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
