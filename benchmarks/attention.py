"""Benchmark + GPU numerical check of the MLA attention op (pallas_kernels.attention).

One run measures on the same GPU, at B1 H32 Dk192 Dv128 bf16, T 8192 and 32768, with 4 equal
documents per row and with 1:
  ours      attention(..., backend="auto") (the Pallas GPU kernels): out and max_logit
  cudnn     jax.nn.dot_product_attention(implementation="cudnn"), causal, v padded to 192,
            no document masking (the unmasked lower bound)
  cudnn_varlen  cuDNN's packed layout (q/kv offsets + seqlens, one segment per document,
            Dv 128 natively), out only (no max logit)
  cudnn_varlen+rowmax  the same plus our Pallas max-logit pass (pallas_gpu.row_max_pallas_gpu)
  jax_mha   jax.experimental.pallas.ops.gpu.attention.mha with segment_ids (v padded)
  dense     masked XLA attention as in k3train/model/mla.py (T 8192 only: the logits of T 32768
            are 137 GB)
each forward and forward+backward (jax.vjp with a fixed random cotangent; ours returns
max_logit in both). Timing: jit, two warm-up calls, then 5 batches of n back-to-back calls
(n so a batch lasts ≥ 0.2 s), block_until_ready after each batch; the median per-call time.
Before that, a numerical check of the GPU path against the xla backend (fp32 and bf16) and
`--sweep` times kernel block configurations at T 8192, 4 documents.

Prints one JSON line per measurement and a table at the end:
  PYTHONPATH=$PWD python3 benchmarks/attention.py [--sweep] [--quick]
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

def ours_fwd(q, k, v, seg):
  return attention(q, k, v, seg, scale=SCALE, backend="auto")


def ours_fwdbwd(q, k, v, seg, do):
  (out, ml), vjp = jax.vjp(lambda q, k, v: attention(q, k, v, seg, scale=SCALE, backend="auto"),
                           q, k, v)
  return out, ml, vjp((do, jnp.zeros_like(ml)))


def pad_v(v):
  return jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, DK - DV)))


def cudnn_fwd(q, k, v, seg):
  del seg
  return jax.nn.dot_product_attention(q, k, pad_v(v), scale=SCALE, is_causal=True,
                                      implementation="cudnn")[..., :DV]


def cudnn_fwdbwd(q, k, v, seg, do):
  out, vjp = jax.vjp(lambda q, k, v: cudnn_fwd(q, k, v, seg), q, k, v)
  return out, vjp(do)


def varlen_args(t, docs):
  from jax._src.cudnn import fused_attention_stablehlo as fa
  length = t // docs
  seqlen = jnp.full((1, docs), length, jnp.int32)
  offsets = jnp.asarray([list(range(0, t, length)) + [-1]], jnp.int32)
  return fa, seqlen, offsets


def make_cudnn_varlen(t, docs):
  fa, seqlen, offsets = varlen_args(t, docs)

  def fwd(q, k, v, seg):
    del seg
    return fa.dot_product_attention(q, k, v, q_seqlen=seqlen, kv_seqlen=seqlen, q_offsets=offsets,
                                    kv_offsets=offsets, scale=SCALE,
                                    mask_type=fa.MaskType.CAUSAL)

  def fwdbwd(q, k, v, seg, do):
    out, vjp = jax.vjp(lambda q, k, v: fwd(q, k, v, seg), q, k, v)
    return out, vjp(do)

  return fwd, fwdbwd


def row_max(q, k, seg):
  from pallas_kernels.attention import op
  t = q.shape[1]
  seg = jnp.zeros((1, t), jnp.int32) if seg is None else seg
  return jnp.max(pallas_gpu.row_max_pallas_gpu(q, k, seg, seg, op.last_keys(0, t, t, True),
                                               scale=SCALE), axis=2)


def make_varlen_rowmax(t, docs):
  vf, vb = make_cudnn_varlen(t, docs)
  return (lambda q, k, v, seg: (vf(q, k, v, seg), row_max(q, k, seg)),
          lambda q, k, v, seg, do: (vb(q, k, v, seg, do), row_max(q, k, seg)))


def mha_fwd(q, k, v, seg):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from jax.experimental.pallas.ops.gpu import attention as jax_mha
  return jax_mha.mha(q, k, pad_v(v), seg, sm_scale=SCALE, causal=True)[..., :DV]


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

def numerical_check(quick: bool):
  """Our GPU path vs the xla backend (max abs error; out, max_logit, dq, dk, dv): B2 T1000 H4,
  uneven documents starting mid-block (row 1 includes a one-token document)."""
  t = 1000
  seg = np.stack([np.repeat([0, 1, 2, 3], [100, 333, 300, 267]),
                  np.repeat([5, 6, 7, 8], [1, 499, 250, 250])]).astype(np.int32)
  for dtype in (jnp.float32, jnp.bfloat16):
    q, k, v, do = inputs(t, dtype, seed=1, b=2, h=4)
    res = {}
    for backend in ("pallas_gpu", "xla"):
      def f(q, k, v, backend=backend):
        (out, ml), vjp = jax.vjp(
            lambda q, k, v: attention(q, k, v, seg, scale=SCALE, backend=backend), q, k, v)
        return (out, ml) + vjp((do, jnp.zeros_like(ml)))
      res[backend] = [np.asarray(x.astype(jnp.float32)) for x in jax.jit(f)(q, k, v)]
    errs = {name: float(np.max(np.abs(a - b)))
            for name, a, b in zip(("out", "max_logit", "dq", "dk", "dv"), res["pallas_gpu"],
                                  res["xla"])}
    scale = {name: float(np.max(np.abs(b)))
             for name, b in zip(("out", "max_logit", "dq", "dk", "dv"), res["xla"])}
    emit(part="check", dtype=jnp.dtype(dtype).name, vs="xla", max_abs_err=errs, max_abs_xla=scale)


SWEEP_FWD = [dict(block_q=128, block_k=64, fwd_warps=8, fwd_stages=3),
             dict(block_q=128, block_k=128, fwd_warps=8, fwd_stages=2),
             dict(block_q=128, block_k=64, fwd_warps=4, fwd_stages=3),
             dict(block_q=64, block_k=64, fwd_warps=4, fwd_stages=3),
             dict(block_q=128, block_k=32, fwd_warps=4, fwd_stages=4)]
SWEEP_BWD = [dict(dkv_block_q=64, dkv_block_k=64, dkv_warps=8, dkv_stages=2,
                  dq_block_q=64, dq_block_k=64, dq_warps=8, dq_stages=2),
             dict(dkv_block_q=32, dkv_block_k=64, dkv_warps=4, dkv_stages=3,
                  dq_block_q=64, dq_block_k=32, dq_warps=4, dq_stages=3),
             dict(dkv_block_q=64, dkv_block_k=128, dkv_warps=8, dkv_stages=2,
                  dq_block_q=128, dq_block_k=64, dq_warps=8, dq_stages=2),
             dict(dkv_block_q=32, dkv_block_k=128, dkv_warps=8, dkv_stages=2,
                  dq_block_q=128, dq_block_k=32, dq_warps=8, dq_stages=2)]


def sweep():
  t, docs = 8192, 4
  q, k, v, do = inputs(t)
  seg = jnp.asarray(doc_segments(t, docs))
  for cfg in SWEEP_FWD:
    try:
      with pallas_gpu.configured(**cfg):
        ms = 1e3 * bench(jax.jit(ours_fwd), q, k, v, seg)
      emit(part="sweep", what="fwd", t=t, docs=docs, config=cfg, ms=round(ms, 4))
    except Exception as e:  # noqa: BLE001
      emit(part="sweep", what="fwd", t=t, docs=docs, config=cfg, error=repr(e)[:300])
  for cfg in SWEEP_BWD:
    try:
      with pallas_gpu.configured(**cfg):
        ms = 1e3 * bench(jax.jit(ours_fwdbwd), q, k, v, seg, do)
      emit(part="sweep", what="fwd+bwd", t=t, docs=docs, config=cfg, ms=round(ms, 4))
    except Exception as e:  # noqa: BLE001
      emit(part="sweep", what="fwd+bwd", t=t, docs=docs, config=cfg, error=repr(e)[:300])


def measure(name, t, docs, fwd, fwdbwd, args_fwd, args_bwd):
  for what, f, args in (("fwd", fwd, args_fwd), ("fwd+bwd", fwdbwd, args_bwd)):
    try:
      ms = 1e3 * bench(jax.jit(f), *args)
      emit(part="time", impl=name, t=t, docs=docs, what=what, ms=round(ms, 4))
    except Exception as e:  # noqa: BLE001
      emit(part="time", impl=name, t=t, docs=docs, what=what, error=repr(e)[:300])


def main_table(lengths, quick: bool):
  for t in lengths:
    q, k, v, do = inputs(t)
    for docs in (4, 1):
      seg = jnp.asarray(doc_segments(t, docs))
      measure("ours", t, docs, ours_fwd, ours_fwdbwd, (q, k, v, seg), (q, k, v, seg, do))
      if quick:
        continue
      vf, vb = make_cudnn_varlen(t, docs)
      measure("cudnn_varlen", t, docs, vf, vb, (q, k, v, seg), (q, k, v, seg, do))
      vf, vb = make_varlen_rowmax(t, docs)
      measure("cudnn_varlen+rowmax", t, docs, vf, vb, (q, k, v, seg), (q, k, v, seg, do))
      if docs == 4:
        measure("jax_mha", t, docs, mha_fwd, mha_fwdbwd, (q, k, v, seg), (q, k, v, seg, do))
        if t <= 8192:
          measure("dense", t, docs, dense_fwd, dense_fwdbwd, (q, k, v, seg), (q, k, v, seg, do))
    if not quick:
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


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--sweep", action="store_true")
  ap.add_argument("--quick", action="store_true", help="ours only")
  ap.add_argument("--skip_check", action="store_true")
  ap.add_argument("--lengths", default="8192,32768")
  a = ap.parse_args()
  commit = os.environ.get("COMMIT") or subprocess.run(
      ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
  dev = jax.devices()[0]
  try:
    from jax._src.lib import cuda_versions
    cudnn = cuda_versions.cudnn_get_version() if cuda_versions else None
  except Exception:  # noqa: BLE001
    cudnn = None
  emit(part="env", commit=commit, date=time.strftime("%Y-%m-%d"), device=dev.device_kind,
       jax=jax.__version__, jaxlib=jaxlib.__version__,
       cudnn=cudnn, gpu_config=str(pallas_gpu.CONFIG))
  for name, fn in (("check", lambda: None if a.skip_check else numerical_check(a.quick)),
                   ("sweep", lambda: sweep() if a.sweep else None),
                   ("table", lambda: main_table([int(x) for x in a.lengths.split(",")], a.quick))):
    t0 = time.time()
    try:
      fn()
    except Exception:  # noqa: BLE001
      traceback.print_exc()
    print(f"# {name} took {time.time() - t0:.1f} s", flush=True)
  table()


if __name__ == "__main__":
  main()
