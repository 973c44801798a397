"""Benchmark + GPU numerical check of the MLA attention op (pallas_kernels.attention).

One run measures on the same GPU, at B1 H32 Dk192 Dv128 bf16, T 8192 and 32768, with 4 equal
documents per row and with 1:
  ours[auto], ours[pallas_gpu], ours[cudnn]   attention(..., backend=...): out and max_logit
  cudnn_nomask  jax.nn.dot_product_attention(implementation="cudnn"), causal, v padded to 192,
            no document masking (the unmasked reference point)
  jax_mha   jax.experimental.pallas.ops.gpu.attention.mha with segment_ids (v padded; 64 × 64
            forward blocks, its default 32 × 32 backward blocks: its 128 × 128 default does not
            fit the H200's shared memory at head dim 192)
  dense     masked XLA attention as in k3train/model/mla.py (T 8192 only: the logits of T 32768
            are 137 GB)
each forward and forward+backward (jax.vjp with a fixed random cotangent; ours returns
max_logit in both). Timing: jit, two warm-up calls, then 5 batches of n back-to-back calls
(n so a batch lasts ≥ 0.2 s), block_until_ready after each batch; the median per-call time.
Before that: a numerical check of the GPU backends against the xla backend (B2 T1000 H4,
uneven documents; fp32 and bf16), of the cudnn backend against pallas_gpu at the benchmark
shape (uneven documents, v native or padded, a repeated id that takes the fallback), and the
settings sweeps: the dK/dV blocks in both tile forms and the forward tiles at each
`--sweep_shapes` (B x T x H x documents; default 1x8192x32x4), the backward's combined settings
at B1 H32 shapes, and the cudnn settings at T 8192, 4 documents.

Prints one JSON line per measurement and a table at the end:
  PYTHONPATH=$PWD python3 benchmarks/attention.py [--parts check,sweep,table] [--impls ...]
A crash on the GPU poisons the process; run the cudnn parts in a process of their own.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax                                                 # noqa: E402
import jaxlib                                              # noqa: E402
import jax.numpy as jnp                                    # noqa: E402

from pallas_kernels.attention import attention, pallas_gpu  # noqa: E402

H, DK, DV = 32, 192, 128
SCALE = DK ** -0.5
ROWS = []


def emit(**rec):
  ROWS.append(rec)
  print(json.dumps(rec), flush=True)


def bench(f, *args, min_batch_s=0.2, batches=5):
  """Median seconds per call (see module doc)."""
  jax.block_until_ready(f(*args))
  t0 = time.perf_counter()
  jax.block_until_ready(f(*args))
  once = time.perf_counter() - t0
  n = max(1, min(200, int(min_batch_s / max(once, 1e-6))))
  per_call = []
  for _ in range(batches):
    t0 = time.perf_counter()
    for _ in range(n):
      r = f(*args)
    jax.block_until_ready(r)
    per_call.append((time.perf_counter() - t0) / n)
  return float(np.median(per_call))


def doc_segments(t: int, docs: int) -> np.ndarray:
  return np.repeat(np.arange(docs, dtype=np.int32), t // docs)[None]


def inputs(t, dtype=jnp.bfloat16, seed=0, b=1, h=H):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (b, t, h, DK), dtype)
  k = jax.random.normal(ks[1], (b, t, h, DK), dtype)
  v = jax.random.normal(ks[2], (b, t, h, DV), dtype)
  do = jax.random.normal(ks[3], (b, t, h, DV), dtype)
  return q, k, v, do


# ----------------------------------------------------------------------------- implementations

def make_ours(backend):
  """Fresh functions (so jax.jit traces them anew under each configuration)."""
  def fwd(q, k, v, seg):
    return attention(q, k, v, seg, scale=SCALE, backend=backend)

  def fwdbwd(q, k, v, seg, do):
    (out, ml), vjp = jax.vjp(lambda q, k, v: attention(q, k, v, seg, scale=SCALE,
                                                         backend=backend), q, k, v)
    return out, ml, vjp((do, jnp.zeros_like(ml)))

  return fwd, fwdbwd


def pad_v(v):
  return jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, DK - DV)))


def cudnn_fwd(q, k, v, seg):
  del seg
  return jax.nn.dot_product_attention(q, k, pad_v(v), scale=SCALE, is_causal=True,
                                      implementation="cudnn")[..., :DV]


def cudnn_fwdbwd(q, k, v, seg, do):
  out, vjp = jax.vjp(lambda q, k, v: cudnn_fwd(q, k, v, seg), q, k, v)
  return out, vjp(do)


MHA_BLOCKS = dict(block_q=64, block_k=64, block_q_dkv=32, block_kv_dkv=32, block_q_dq=32,
                  block_kv_dq=32)


def mha_fwd(q, k, v, seg):
  # Its default 128 × 128 blocks at head dim 192 (padded to 256) ask for more shared memory than
  # the H200 has; 64 × 64 forward blocks, its default 32 × 32 backward blocks.
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from jax.experimental.pallas.ops.gpu import attention as jax_mha
  return jax_mha.mha(q, k, pad_v(v), seg, sm_scale=SCALE, causal=True,
                     block_sizes=jax_mha.BlockSizes(**MHA_BLOCKS), num_stages=2)[..., :DV]


def mha_fwdbwd(q, k, v, seg, do):
  out, vjp = jax.vjp(lambda q, k, v: mha_fwd(q, k, v, seg), q, k, v)
  return out, vjp(do)


def dense_fwd(q, k, v, seg):
  f32 = jnp.float32
  t = q.shape[1]
  logits = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=f32) * SCALE
  mask = (jnp.tril(jnp.ones((t, t), bool))[None] & (seg[:, :, None] == seg[:, None, :]))[:, None]
  max_logit = jax.lax.stop_gradient(jnp.max(jnp.where(mask, logits, -jnp.inf), axis=(0, 2, 3)))
  probs = jax.nn.softmax(jnp.where(mask, logits, jnp.finfo(f32).min), axis=-1)
  out = jnp.einsum("bhts,bshd->bthd", probs.astype(q.dtype), v, preferred_element_type=f32)
  return out.astype(q.dtype), max_logit


def dense_fwdbwd(q, k, v, seg, do):
  (out, ml), vjp = jax.vjp(lambda q, k, v: dense_fwd(q, k, v, seg), q, k, v)
  return out, ml, vjp((do, jnp.zeros_like(ml)))


# ----------------------------------------------------------------------------- parts of the run

def numerical_check(gpu_backends):
  """Our GPU path vs the xla backend (max abs error; out, max_logit, dq, dk, dv): B2 T1000 H4,
  uneven documents starting mid-block (row 1 includes a one-token document)."""
  t = 1000
  seg = np.stack([np.repeat([0, 1, 2, 3], [100, 333, 300, 267]),
                  np.repeat([5, 6, 7, 8], [1, 499, 250, 250])]).astype(np.int32)
  for dtype in (jnp.float32, jnp.bfloat16):
    q, k, v, do = inputs(t, dtype, seed=1, b=2, h=4)
    res = {}
    backends = tuple(b for b in gpu_backends if b != "cudnn" or dtype == jnp.bfloat16) + ("xla",)
    for backend in backends:
      def f(q, k, v, backend=backend):
        (out, ml), vjp = jax.vjp(
            lambda q, k, v: attention(q, k, v, seg, scale=SCALE, backend=backend), q, k, v)
        return (out, ml) + vjp((do, jnp.zeros_like(ml)))
      res[backend] = [np.asarray(x.astype(jnp.float32)) for x in jax.jit(f)(q, k, v)]
    names = ("out", "max_logit", "dq", "dk", "dv")
    for backend in backends[:-1]:
      errs = {n: float(np.max(np.abs(a - b))) for n, a, b in zip(names, res[backend], res["xla"])}
      emit(part="check", backend=backend, dtype=jnp.dtype(dtype).name, t=t, vs="xla",
           max_abs_err=errs)
    emit(part="check", backend="xla", dtype=jnp.dtype(dtype).name, t=t,
         max_abs=({n: float(np.max(np.abs(b))) for n, b in zip(names, res["xla"])}))


def cudnn_check():
  """The cudnn backend against pallas_gpu at the benchmark shape (bf16, T 8192, H 32): uneven
  documents, and a row with a repeated id (the pallas fallback)."""
  from pallas_kernels.attention import cudnn
  t = 8192
  q, k, v, do = inputs(t, seed=2)
  cases = {"uneven": np.repeat([0, 1, 2, 3], [1000, 3000, 192, 4000]),
           "equal4": doc_segments(t, 4)[0],
           "repeated_id": np.repeat([0, 1, 0, 2], [1000, 3000, 192, 4000])}
  names = ("out", "max_logit", "dq", "dk", "dv")
  for case, seg in cases.items():
    seg = jnp.asarray(seg[None].astype(np.int32))
    res = {}
    for label in ("pallas_gpu", "cudnn"):
      try:
        _, fb = make_ours(label)
        out, ml, grads = jax.jit(fb)(q, k, v, seg, do)
        res[label] = [np.asarray(x.astype(jnp.float32)) for x in (out, ml) + tuple(grads)]
      except Exception as e:  # noqa: BLE001
        emit(part="cudnn_check", case=case, impl=label, error=repr(e)[:300])
    for label in res:
      if label != "pallas_gpu" and "pallas_gpu" in res:
        errs = {n: float(np.max(np.abs(a - b))) for n, a, b in zip(names, res[label],
                                                                    res["pallas_gpu"])}
        emit(part="cudnn_check", case=case, impl=label, vs="pallas_gpu", max_abs_err=errs)


SWEEP_FWD = [dict(block_q=128, block_k=64, fwd_warps=8, fwd_stages=3),
             dict(block_q=128, block_k=128, fwd_warps=8, fwd_stages=2),
             dict(block_q=64, block_k=64, fwd_warps=4, fwd_stages=3),
             dict(block_q=128, block_k=128, fwd_warps=8, fwd_stages=3),
             dict(block_q=128, block_k=64, fwd_warps=8, fwd_stages=2)]
SWEEP_BWD = [dict(dkv_block_q=32, dkv_block_k=64, dkv_warps=4, dkv_stages=3,
                  dq_block_q=64, dq_block_k=32, dq_warps=4, dq_stages=3),
             dict(dkv_block_q=32, dkv_block_k=64, dkv_warps=4, dkv_stages=2,
                  dq_block_q=64, dq_block_k=32, dq_warps=4, dq_stages=2),
             dict(dkv_block_q=32, dkv_block_k=64, dkv_warps=8, dkv_stages=3,
                  dq_block_q=64, dq_block_k=32, dq_warps=8, dq_stages=3),
             dict(dkv_block_q=64, dkv_block_k=64, dkv_warps=4, dkv_stages=3,
                  dq_block_q=64, dq_block_k=64, dq_warps=4, dq_stages=3),
             dict(dkv_block_q=64, dkv_block_k=64, dkv_warps=8, dkv_stages=2,
                  dq_block_q=64, dq_block_k=64, dq_warps=8, dq_stages=2)]


# dK/dV blocks alone (the rest at the defaults): keys per program × query rows per loop step,
# in both forms (Config.dkv_keys_as_rows). wgmma needs 64 rows per warpgroup in the keys-as-rows
# form, so its keys per program go with the warps.
SWEEP_DKV = [dict(dkv_block_q=q, dkv_block_k=k, dkv_keys_as_rows=False, **extra)
             for q, k, extra in ((32, 64, {}), (64, 32, {}), (128, 32, {}),
                                 (64, 32, dict(dkv_stages=2)), (64, 16, {}))]
SWEEP_DKV += [dict(dkv_block_q=q, dkv_block_k=k, dkv_warps=w, dkv_stages=s, dkv_keys_as_rows=True)
              for q, k, w, s in ((32, 64, 4, 3), (32, 64, 4, 2), (32, 64, 4, 4), (16, 64, 4, 3),
                                 (64, 64, 4, 3), (64, 64, 4, 2), (32, 128, 8, 3), (16, 128, 8, 3),
                                 (64, 128, 8, 2), (32, 64, 8, 3))]


def sweep(shapes):
  for b, t, h, docs in shapes:
    sweep_shape(b, t, h, docs)


def sweep_shape(b, t, h, docs):
  """The settings sweeps at one shape; the full backward-settings sweep only at B1 H32."""
  q, k, v, do = inputs(t, b=b, h=h)
  seg = jnp.asarray(doc_segments(t, docs).repeat(b, 0))
  for cfg in SWEEP_DKV:
    try:
      with pallas_gpu.configured(**cfg):
        fw, fb = make_ours("pallas_gpu")
        ms_f = 1e3 * bench(jax.jit(fw), q, k, v, seg)
        ms_b = 1e3 * bench(jax.jit(fb), q, k, v, seg, do)
      emit(part="sweep", what="dkv", b=b, t=t, h=h, docs=docs, config=cfg, fwd_ms=round(ms_f, 4),
           fwdbwd_ms=round(ms_b, 4))
    except Exception as e:  # noqa: BLE001
      emit(part="sweep", what="dkv", b=b, t=t, h=h, docs=docs, config=cfg, error=repr(e)[:300])
  for cfg in SWEEP_FWD:
    try:
      with pallas_gpu.configured(**cfg):
        ms = 1e3 * bench(jax.jit(make_ours("pallas_gpu")[0]), q, k, v, seg)
      emit(part="sweep", what="fwd", b=b, t=t, h=h, docs=docs, config=cfg, ms=round(ms, 4))
    except Exception as e:  # noqa: BLE001
      emit(part="sweep", what="fwd", b=b, t=t, h=h, docs=docs, config=cfg, error=repr(e)[:300])
  if (b, h) != (1, H):
    return
  for cfg in SWEEP_BWD:
    try:
      with pallas_gpu.configured(**cfg):
        ms = 1e3 * bench(jax.jit(make_ours("pallas_gpu")[1]), q, k, v, seg, do)
      emit(part="sweep", what="fwd+bwd", t=t, docs=docs, config=cfg, ms=round(ms, 4))
    except Exception as e:  # noqa: BLE001
      emit(part="sweep", what="fwd+bwd", t=t, docs=docs, config=cfg, error=repr(e)[:300])


def cudnn_sweep():
  from pallas_kernels.attention import cudnn
  t, docs = 8192, 4
  q, k, v, do = inputs(t)
  seg = jnp.asarray(doc_segments(t, docs))
  for cfg in (dict(max_segments=4), dict(max_segments=16), dict(max_segments=64)):
    saved = cudnn.CONFIG
    cudnn.CONFIG = cudnn.Config(**cfg)
    try:
      fw, fb = make_ours("cudnn")
      ms_f = 1e3 * bench(jax.jit(fw), q, k, v, seg)
      ms_b = 1e3 * bench(jax.jit(fb), q, k, v, seg, do)
      emit(part="sweep", what="cudnn", t=t, docs=docs, config=cfg, fwd_ms=round(ms_f, 4),
           fwdbwd_ms=round(ms_b, 4))
    except Exception as e:  # noqa: BLE001
      emit(part="sweep", what="cudnn", t=t, docs=docs, config=cfg, error=repr(e)[:300])
    finally:
      cudnn.CONFIG = saved


def measure(name, t, docs, fwd, fwdbwd, args_fwd, args_bwd):
  for what, f, args in (("fwd", fwd, args_fwd), ("fwd+bwd", fwdbwd, args_bwd)):
    try:
      ms = 1e3 * bench(jax.jit(f), *args)
      emit(part="time", impl=name, t=t, docs=docs, what=what, ms=round(ms, 4))
    except Exception as e:  # noqa: BLE001
      emit(part="time", impl=name, t=t, docs=docs, what=what, error=repr(e)[:300])


def main_table(lengths, impls):
  ours = [i for i in impls if i in ("auto", "pallas_gpu", "cudnn")]
  for t in lengths:
    q, k, v, do = inputs(t)
    for docs in (4, 1):
      seg = jnp.asarray(doc_segments(t, docs))
      for backend in ours:
        measure(f"ours[{backend}]", t, docs, *make_ours(backend), (q, k, v, seg),
                (q, k, v, seg, do))
      if docs == 4 and "jax_mha" in impls:
        measure("jax_mha", t, docs, mha_fwd, mha_fwdbwd, (q, k, v, seg), (q, k, v, seg, do))
      if docs == 4 and "dense" in impls and t <= 8192:
        measure("dense", t, docs, dense_fwd, dense_fwdbwd, (q, k, v, seg), (q, k, v, seg, do))
    if "cudnn_nomask" in impls:
      measure("cudnn_nomask", t, 1, cudnn_fwd, cudnn_fwdbwd, (q, k, v, None),
              (q, k, v, None, do))
    del q, k, v, do


def table():
  print("\n| impl | T | docs | fwd ms | fwd+bwd ms |")
  print("|---|---|---|---|---|")
  cells = {}
  for r in ROWS:
    if r.get("part") == "time":
      cells.setdefault((r["impl"], r["t"], r["docs"]), {})[r["what"]] = r.get("ms", "err")
  for (impl, t, docs), c in cells.items():
    print(f"| {impl} | {t} | {docs} | {c.get('fwd', '-')} | {c.get('fwd+bwd', '-')} |")


PARTS = ("check", "cudnn_check", "sweep", "cudnn_sweep", "table")
IMPLS = ("auto", "pallas_gpu", "cudnn", "cudnn_nomask", "jax_mha", "dense")


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--parts", default=",".join(PARTS))
  ap.add_argument("--impls", default=",".join(IMPLS))
  ap.add_argument("--lengths", default="8192,32768")
  ap.add_argument("--sweep_shapes", default="1x8192x32x4",
                  help="B x T x H x documents per row for the settings sweep, comma-separated")
  a = ap.parse_args()
  parts, impls = a.parts.split(","), a.impls.split(",")
  commit = os.environ.get("COMMIT") or subprocess.run(
      ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
  dev = jax.devices()[0]
  try:
    from jax._src.lib import cuda_versions
    cudnn = cuda_versions.cudnn_get_version() if cuda_versions else None
  except Exception:  # noqa: BLE001
    cudnn = None
  emit(part="env", commit=commit, date=time.strftime("%Y-%m-%d"), device=dev.device_kind,
       jax=jax.__version__, jaxlib=jaxlib.__version__, cudnn=cudnn,
       gpu_config=str(pallas_gpu.CONFIG))
  gpu_backends = [b for b in ("pallas_gpu", "cudnn") if b in impls]
  steps = {"check": lambda: numerical_check(gpu_backends), "cudnn_check": cudnn_check,
           "sweep": lambda: sweep([tuple(int(n) for n in x.split("x"))
                                   for x in a.sweep_shapes.split(",")]),
           "cudnn_sweep": cudnn_sweep,
           "table": lambda: main_table([int(x) for x in a.lengths.split(",")], impls)}
  for name in parts:
    t0 = time.time()
    try:
      steps[name]()
    except Exception:  # noqa: BLE001
      traceback.print_exc()
    print(f"# {name} took {time.time() - t0:.1f} s", flush=True)
  table()


if __name__ == "__main__":
  main()
