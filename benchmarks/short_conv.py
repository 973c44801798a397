"""KDA's short conv: forward and forward+backward device time of the implementations.

  python benchmarks/short_conv.py [--shapes=4x4096x16x128] [--width=4] [--docs=4] [--iters=50]
                                  [--kernel_settings=rows:cols:num_warps[:forward],...]

For each B×T×H×K (bf16 x, fp32 weights [width, H, K], `docs` equal documents per row) it times
the three convs of a KDA layer (q, k and v; what the layer runs per site), each followed by the
SiLU the layer applies, forward alone and forward+backward (the gradient of Σ SiLU(y) ·
cotangent with respect to x and w):
  bf16_taps   the conv as the layer computed it before fp32 taps: products and sums in bf16,
              so XLA's weight gradient sums bf16 partials (kept as the baseline);
  xla         pallas_kernels.short_conv backend "xla" (fp32 taps, autodiff);
  pallas_gpu  the Pallas-Triton backward kernel behind XLA's fused forward, or both kernels,
              with the default settings (GPU only; what "auto" runs there);
  pallas_gpu[r:c:w:f]  other launch settings (--kernel_settings; f is the forward, "xla" or
              "kernel", "xla" when left out).
Every path's conv (without the SiLU) is compared with the float64 oracle at the same inputs and
cotangent: the largest difference over the largest magnitude of y, dx and dw, per branch. Prints one JSON line per (shape, path), then
a table.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import _flags, _record  # noqa: E402
from pallas_kernels import short_conv  # noqa: E402
from pallas_kernels.short_conv import op as short_conv_op, pallas_gpu  # noqa: E402

PROG = "python benchmarks/short_conv.py"
FLAGS = (
    _flags.Flag("shapes", "list", ["4x4096x16x128"], "B×T×H×K to time"),
    _flags.Flag("width", "int", 4, "conv taps"),
    _flags.Flag("docs", "int", 4, "equal documents per row"),
    _flags.Flag("iters", "int", 50, "timed calls per path"),
    _flags.Flag("kernel_settings", "list", [],
                "extra pallas_gpu launch settings to time, each rows:cols:num_warps[:forward]"),
)


def bf16_taps(x, w, seg):
  """The layer's conv before fp32 taps: every product and partial sum in x's dtype."""
  width, t = w.shape[0], x.shape[1]
  y = x * w[width - 1].astype(x.dtype)
  for shift in range(1, width):
    x_shift = jnp.pad(x, ((0, 0), (shift, 0), (0, 0), (0, 0)))[:, :t]
    seg_shift = jnp.pad(seg, ((0, 0), (shift, 0)), constant_values=-1)[:, :t]
    x_shift = jnp.where((seg_shift == seg)[:, :, None, None], x_shift, 0)
    y = y + x_shift * w[width - 1 - shift].astype(x.dtype)
  return y


def _paths(settings):
  paths = {"bf16_taps": bf16_taps,
           "xla": lambda x, w, s: short_conv.causal_conv(x, w, s, backend="xla")}
  if jax.default_backend() == "gpu":
    paths["pallas_gpu"] = lambda x, w, s: short_conv.causal_conv(x, w, s, backend="pallas_gpu")
    for text in settings:
      fields = text.split(":")
      rows, cols, warps = (int(v) for v in fields[:3])
      cfg = pallas_gpu.Settings(rows, cols, warps, *fields[3:])
      paths[f"pallas_gpu[{text}]"] = (
          lambda x, w, s, conv=short_conv_op.pallas_gpu_conv(cfg): conv(x, w, s, False))
  return paths


def _site(conv):
  """The three convs of a layer site with their SiLU: (x3, w3, seg) → 3 outputs."""
  def site(xs, ws, seg):
    return tuple(jax.nn.silu(conv(x, w, seg)) for x, w in zip(xs, ws))
  return site


def measure(b, t, h, k, width, docs, iters, settings):
  keys = jax.random.split(jax.random.key(0), 9)
  xs = tuple(jax.random.normal(keys[i], (b, t, h, k), jnp.float32).astype(jnp.bfloat16)
             for i in range(3))
  ws = tuple(jax.random.uniform(keys[3 + i], (width, h, k), jnp.float32, -0.5, 0.5)
             for i in range(3))
  cts = tuple(jax.random.normal(keys[6 + i], (b, t, h, k), jnp.float32).astype(jnp.bfloat16)
              for i in range(3))
  seg = jnp.broadcast_to((jnp.arange(t) * docs // t).astype(jnp.int32), (b, t))

  def grads(site):
    def loss(xs, ws):
      return sum(jnp.sum(o.astype(jnp.float32) * c.astype(jnp.float32))
                 for o, c in zip(site(xs, ws, seg), cts))
    return jax.jit(jax.grad(loss, argnums=(0, 1)))

  # Numbers: each conv alone (no SiLU, whose bf16 rounding would hide the sums' error) against
  # the float64 oracle at the same inputs and cotangent.
  def conv_vjp(conv, x, w, ct):
    y, pull = jax.vjp(lambda a, b: conv(a, b, seg), x, w)
    return (y,) + tuple(pull(ct))

  with jax.enable_x64(True):
    to64 = lambda v: jnp.asarray(np.asarray(v, np.float64))
    ref = [[np.asarray(v) for v in conv_vjp(short_conv.reference_causal_conv, to64(x), to64(w),
                                               to64(c))] for x, w, c in zip(xs, ws, cts)]
  rows = []
  for name, conv in _paths(settings).items():
    site = _site(conv)
    fwd = jax.jit(site)
    bwd = grads(site)
    one = jax.jit(lambda x, w, c, conv=conv: conv_vjp(conv, x, w, c))
    errors = {}
    for branch, x, w, c, want in zip("qkv", xs, ws, cts, ref):
      for kind, g, r in zip(("y", "dx", "dw"), one(x, w, c), want):
        g = np.asarray(g, np.float64)
        errors[f"{kind}_{branch}"] = float(f"{np.abs(g - r).max() / max(np.abs(r).max(), 1e-30):.3g}")
    rows.append({"shape": f"{b}x{t}x{h}x{k}", "width": width, "docs": docs, "path": name,
                 "fwd_ms": round(1e3 * _record.median_call_seconds(fwd, (xs, ws, seg), iters), 4),
                 "fwd_bwd_ms": round(1e3 * _record.median_call_seconds(bwd, (xs, ws), iters), 4),
                 "max_err_rel_to_max": errors})
  return rows


def main(argv=None) -> int:
  args = _flags.parse(argv, PROG, FLAGS)
  if args.exit_code is not None:
    return args.exit_code
  f = args.flags
  rows = _record.over_shapes(f.shapes, lambda b, t, h, k: measure(
      b, t, h, k, f.width, f.docs, f.iters, f.kernel_settings))
  print(f"{'shape':>16} {'path':>24} {'fwd ms':>8} {'fwd+bwd ms':>10} {'worst dw err':>12}")
  for r in rows:
    e = r["max_err_rel_to_max"]
    worst_dw = max(v for n, v in e.items() if n.startswith("dw"))
    print(f"{r['shape']:>16} {r['path']:>24} {r['fwd_ms']:>8.3f} {r['fwd_bwd_ms']:>10.3f} "
          f"{worst_dw:>12.2e}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
