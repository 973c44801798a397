"""Projection matmuls: the GEMM writing bf16 directly against writing fp32 and converting.

  python benchmarks/linear_output.py [--tokens=8192] [--shapes=2048x2048,2048x8192,...] [--iters=50]

For each K×N projection (k3_h200's: KDA / MLA / shared-expert projections, the latent MoE's down
and up maps, the dense FFN) times `y = x · W` on bf16 x [tokens, K] and fp32 W [K, N], forward
and forward+backward (gradients of Σ y · cotangent for x and W), for two paths:
  convert  every GEMM asks for fp32 and a separate convert rounds y and dx to bf16 (how
           `layers.low_precision_matmul` wrote its results before);
  direct   `layers.low_precision_matmul` as the model runs it: y and dx are written in bf16 by
           the GEMM itself (fp32 accumulation, one rounding), dW in fp32.
Checks that both paths give the same y, dx and dW (largest difference over the largest
magnitude ≤ 1e-2: one bf16 rounding apart at most), then prints one JSON line per (shape, path)
and a table.
"""

from __future__ import annotations

import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import _flags, _record  # noqa: E402
from k3train.model import layers  # noqa: E402

PROG = "python benchmarks/linear_output.py"
AGREE = 1e-2
K3_H200_SHAPES = ["2048x2048", "2048x1024", "1024x2048", "2048x768", "768x2048", "2048x8192",
                  "8192x2048"]
FLAGS = (
    _flags.Flag("tokens", "int", 8192, "rows of x (one micro-batch of 2 × 4096)"),
    _flags.Flag("shapes", "list", K3_H200_SHAPES, "K×N of the weights"),
    _flags.Flag("iters", "int", 50, "timed calls per setting"),
)


def _dot(a, b, a_dims, b_dims, written):
  return jax.lax.dot_general(a, b, ((a_dims, b_dims), ((), ())), preferred_element_type=written)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def convert_matmul(x_mk, w_kn, dtype):
  """The baseline: every GEMM writes fp32 and a separate convert rounds y and dx (x is bf16 here,
  so dx is rounded to it); the operands are the same as `direct`'s."""
  return _convert_fwd(x_mk, w_kn, dtype)[0]


def _convert_fwd(x_mk, w_kn, dtype):
  xc, wc = x_mk.astype(dtype), w_kn.astype(dtype)
  return _dot(xc, wc, (1,), (0,), jnp.float32).astype(dtype), (xc, wc)


def _convert_bwd(dtype, residuals, g_mn):
  xc, wc = residuals
  g_mn = g_mn.astype(dtype)
  dx = _dot(g_mn, wc, (1,), (1,), jnp.float32).astype(xc.dtype)
  dw = _dot(xc, g_mn, (0,), (0,), jnp.float32)
  return dx, dw


convert_matmul.defvjp(_convert_fwd, _convert_bwd)


def _paths():
  return {"convert": lambda x, w: convert_matmul(x, w, jnp.bfloat16),
          "direct": lambda x, w: layers.low_precision_matmul(x, w, 1, jnp.bfloat16)}


def measure(tokens: int, k: int, n: int, iters: int) -> list[dict]:
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (tokens, k), jnp.float32).astype(jnp.bfloat16)
  w = jax.random.normal(keys[1], (k, n), jnp.float32) / np.sqrt(k)
  cot = jax.random.normal(keys[2], (tokens, n), jnp.float32).astype(jnp.bfloat16)
  flops = 2.0 * tokens * k * n
  rows, results = [], {}
  for name, fn in _paths().items():
    fwd = jax.jit(fn)
    grad = jax.jit(jax.value_and_grad(
        lambda x, w, fn=fn: jnp.sum((fn(x, w) * cot).astype(jnp.float32)), argnums=(0, 1)))
    fwd_s = _record.median_call_seconds(fwd, (x, w), iters)
    both_s = _record.median_call_seconds(grad, (x, w), iters)
    results[name] = (fwd(x, w), *grad(x, w)[1])
    rows.append({"shape": f"{tokens}x{k}x{n}", "path": name,
                 "fwd_ms": round(1e3 * fwd_s, 4), "fwd_bwd_ms": round(1e3 * both_s, 4),
                 "fwd_tflops": round(flops / fwd_s / 1e12, 1),
                 "fwd_bwd_tflops": round(3 * flops / both_s / 1e12, 1)})
  errors = _record.relative_errors(("y", "dx", "dw"), results["convert"], results["direct"])
  return _record.mark_agreement(rows, errors, AGREE)


def main(argv=None) -> int:
  args = _flags.parse(argv, PROG, FLAGS)
  if args.exit_code is not None:
    return args.exit_code
  f = args.flags
  rows = _record.over_shapes(f.shapes, lambda k, n: measure(f.tokens, k, n, f.iters))
  print(f"{'tokens×K×N':>16} {'path':>8} {'fwd ms':>8} {'fwd+bwd ms':>10} {'TFLOP/s':>8} agree")
  for r in rows:
    print(f"{r['shape']:>16} {r['path']:>8} {r['fwd_ms']:>8.3f} {r['fwd_bwd_ms']:>10.3f} "
          f"{r['fwd_bwd_tflops']:>8.1f} {r['agree']}")
  return 1 if not all(r["agree"] for r in rows) else 0


if __name__ == "__main__":
  sys.exit(main())
