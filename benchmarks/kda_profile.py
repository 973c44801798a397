"""Per-kernel timings of the pallas_gpu KDA op on one GPU, to see where the time goes.

  XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/kda_profile.py [--shapes=2x8192x16]
      [--variants=fused,split] [--intra_variants=default,sw4-ibk16-iw8] [--config=FILE]
  JAX_PLATFORMS=cpu python benchmarks/kda_profile.py --interpret --shapes=1x128x1 \
      --variants=fused                                             # CPU check of the script

For each B×T×H (K = V = 128, bf16, chunk 64) times every launcher of pallas_gpu.py on its own
(intra, the state passes for each --variants — with a split forward also its sequential and
output parts —, chunk_bwd, intra_bwd) and the XLA glue (chunk cumsum, state decay), each as the
median of 5 repeats of a 10-call loop after warm-up. The per-kernel sum against the whole op shows
what the glue costs. --config picks the shape as in kda_kernel.py.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import _flags  # noqa: E402
from benchmarks.kda_kernel import (CHUNK, _inputs, median_call_ms, parse_options,  # noqa: E402
                                   parse_variant, shapes_of)
from pallas_kernels.kda import intra as intra_lib  # noqa: E402
from pallas_kernels.kda import pallas_gpu as pg  # noqa: E402

PROG = "python benchmarks/kda_profile.py"
C = CHUNK
F32 = jnp.float32

FLAGS = (
    _flags.Flag("shapes", "list", ["2x8192x16"],
                "B×T×H to profile (K = V = 128); with --config and no --shapes, "
                "1 × data.seq_len × model.kda.num_heads"),
    _flags.Flag("variants", "list", ["fused", "split"], "kda_kernel.py variant names"),
    _flags.Flag("intra_variants", "list", ["default"],
                "'default' or '-'-joined options of kda_kernel.py's variants (e.g. sw4-ibk16-iw8)"),
    _flags.Flag("interpret", "bool", False, "CPU smoke test of this script"),
)


def profile(b, t, h, lines, variants, intra_variants, interpret=False):
  rng = np.random.default_rng(0)
  kk = vv = 128
  q, k, v, g, beta = _inputs(rng, b, t, h, "bf16")
  q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
  g, beta = jnp.asarray(g), jnp.asarray(beta)
  cnt = jnp.zeros((b, t), F32)
  s0 = jnp.zeros((b, h, kk, vv), F32)
  scale = kk ** -0.5
  kw = dict(chunk=C, interpret=interpret)

  def rec(name, fn, *args):
    try:
      ms = median_call_ms(jax.jit(fn), *args)
      lines.append(f"{b}x{t}x{h} {name:34s} {ms:8.3f} ms")
    except Exception:
      lines.append(f"{b}x{t}x{h} {name} FAILED: {traceback.format_exc()[-1200:]}")
    print(lines[-1], flush=True)

  gam = jax.jit(intra_lib.chunk_cumsum, static_argnums=1)(g, C)
  d = jax.jit(intra_lib.state_decay, static_argnums=2)(gam, cnt, C)
  rec("glue: chunk_cumsum+state_decay",
      lambda g: intra_lib.state_decay(intra_lib.chunk_cumsum(g, C), cnt, C), g)
  intra_fn = lambda q, k, v, gam, beta: pg.intra(q, k, v, gam, beta, cnt, scale=scale, **kw)
  rec("intra (save)", intra_fn, q, k, v, gam, beta)
  rec("intra (no save)", lambda *a: pg.intra(*a, cnt, scale=scale, save=False, **kw)[:5],
      q, k, v, gam, beta)
  aqk, w, u, qg, kt, akk, inv = jax.jit(intra_fn)(q, k, v, gam, beta)
  do = jnp.asarray(rng.standard_normal((b, t, h, vv)), F32)
  dsf = jnp.zeros((b, h, kk, vv), F32)
  saved = {}
  for name, opts in variants:
    with pg.configured(**opts):
      rec(f"state_fwd[{name}] (save)",
          lambda *a: pg.state_fwd(*a, save=True, **kw), qg, kt, w, u, aqk, d, s0)
      if opts.get("split_fwd"):
        rec(f"  split seq part [{name}]",
            lambda kt, w, u, d, s0: pg._state_fwd_seq(
                kt, w, u, d, s0, chunk=C, interpret=interpret,
                bv=pg.block_v(vv, pg.SETTINGS.split_fwd_bv), warps=pg.SETTINGS.state_warps),
            kt, w, u, d, s0)
      o, sf, hs, delta = jax.jit(lambda *a: pg.state_fwd(*a, save=True, **kw))(
          qg, kt, w, u, aqk, d, s0)
      saved = dict(hs=hs, delta=delta)
      if opts.get("split_fwd"):
        rec("  split output part", lambda *a: pg.output(*a, **kw), qg, hs, aqk, delta)
      rec(f"state_bwd[{name}]", lambda *a: pg.state_bwd(*a, **kw), do, dsf, qg, kt, w, aqk, d)
  hs, delta = saved["hs"], saved["delta"]
  ds0, dhs, ddelta = jax.jit(lambda *a: pg.state_bwd(*a, **kw))(do, dsf, qg, kt, w, aqk, d)
  rec("chunk_bwd", lambda *a: pg.chunk_bwd(*a, **kw), hs, dhs, delta, ddelta, do)
  dqg, dw, dkt, daqk, dd = jax.jit(lambda *a: pg.chunk_bwd(*a, **kw))(hs, dhs, delta, ddelta, do)
  for name, opts in intra_variants:
    with pg.configured(**opts):
      if opts:
        rec(f"intra (save) [{name}]", intra_fn, q, k, v, gam, beta)
      rec(f"intra_bwd [{name}]", lambda *a: pg.intra_bwd(*a, scale=scale, **kw),
          q, k, v, gam, beta, cnt, akk, inv, w, u, daqk, dw, ddelta, dqg, dkt, dd, d)


def main(argv=None) -> int:
  args = _flags.parse(argv, PROG, FLAGS)
  if args.exit_code is not None:
    return args.exit_code
  f = args.flags
  try:
    shapes = shapes_of(args)
    variants = [(v, parse_variant(v)) for v in f.variants]
    intra_variants = [(v, {} if v == "default" else parse_options(v, v.split("-")))
                      for v in f.intra_variants]
  except ValueError as e:
    _flags.error(PROG, str(e))
    return _flags.USAGE_ERROR
  lines = [f"jax {jax.__version__} {jax.devices()}"]
  for shape in shapes:
    b, t, h = map(int, shape.split("x"))
    start = time.perf_counter()
    profile(b, t, h, lines, variants, intra_variants, f.interpret)
    lines.append(f"{shape} took {time.perf_counter() - start:.0f} s")
  print("\n==== summary ====\n" + "\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main())
