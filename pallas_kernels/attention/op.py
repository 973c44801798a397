"""Public attention op: validates, canonicalises (segments, causal limit, dtype) and dispatches.

Backends: "reference" (dense, readable, fp64-capable: the oracle), "xla" (blockwise pure JAX, a
custom_vjp with a blockwise backward; runs anywhere), "pallas_gpu" (Pallas-Triton flash kernels,
pallas_gpu.py), "cudnn" (cuDNN's packed varlen attention plus the Pallas max-logit pass, for
self-attention; cudnn.py), "pallas_tpu" (splash attention plus a max-logit pass, pallas_tpu.py)
— the Pallas backends run in interpret mode when their platform is absent (tests), "cudnn" then
runs the pallas_gpu kernels — and "auto" (resolve_backend).

The maths is docs/maths.md §2.2 (NoPE MLA: q·k over the 128 nope + 64 unrotated rope dims,
scale 192^-1/2, causal, never across documents). Canonical form handed to the blockwise
backends: q_seg [B, Tq], kv_seg [B, Tk] int32 and q_last [Tq] int32, the last key index query i
may attend to (min(q_offset + i, Tk − 1) with `causal`, Tk − 1 without). Pair (i, j) is allowed
iff q_seg[i] == kv_seg[j] and j ≤ q_last[i].
"""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp

from pallas_kernels import platform
from pallas_kernels.attention import cudnn, pallas_gpu, pallas_tpu, xla
from pallas_kernels.attention.reference import attention_reference

BACKENDS = ("auto", "reference", "xla", "pallas_gpu", "cudnn", "pallas_tpu")
_FLOATS = tuple(jnp.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64))


def resolve_backend(backend: str, dk: int | None = None, dv: int | None = None,
                    dtype=None) -> str:
  """Map a backend name to a concrete one.

  "auto": "pallas_gpu" on a GPU for the head dims and dtypes its kernels take, "pallas_tpu" on a
  TPU, "xla" everywhere else. On an H200 at B1 H32 Dk192 Dv128 bf16 (benchmarks/attention.md)
  pallas_gpu has the fastest forward at T 8192 and 32768 (1.4–1.6× cudnn) and the fastest
  forward+backward at T 8192 with 4 documents (0.63 / 3.09 ms; cudnn 1.04 / 3.75); "cudnn"'s
  forward+backward is 3–6 % faster with single documents and at T 32768, so it stays opt-in.
  """
  if backend not in BACKENDS:
    raise ValueError(f"attention: unknown backend {backend!r}; allowed: {', '.join(BACKENDS)}")
  if backend != "auto":
    return backend
  target = platform.current()
  if target == "gpu" and (dk is None or pallas_gpu.supports(dk, dv, dtype)):
    return "pallas_gpu"
  if target == "tpu":
    return "pallas_tpu"
  return "xla"


def _check_array(name: str, x, ndim: int, layout: str):
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise ValueError(f"attention: {name} must be an array {layout}, got {type(x).__name__}")
  if x.ndim != ndim:
    raise ValueError(f"attention: {name} has {x.ndim} dims, expected {layout}")


def _validate(q, k, v, segment_ids, scale, causal, q_offset, backend):
  """Checks with messages that name the offending argument and the expected layout."""
  if backend not in BACKENDS:
    raise ValueError(f"attention: unknown backend {backend!r}; allowed: {', '.join(BACKENDS)}")
  _check_array("q", q, 4, "[B, Tq, H, Dk]")
  _check_array("k", k, 4, "[B, Tk, H, Dk]")
  _check_array("v", v, 4, "[B, Tk, H, Dv]")
  b, tq, h, dk = q.shape
  tk = k.shape[1]
  if tq < 1 or tk < 1:
    raise ValueError(f"attention: q and k need at least one token, got Tq={tq}, Tk={tk}")
  if (k.shape[0], k.shape[2], k.shape[3]) != (b, h, dk):
    raise ValueError(f"attention: k has shape {tuple(k.shape)}, expected [B, Tk, H, Dk] = "
                     f"[{b}, Tk, {h}, {dk}]")
  if tuple(v.shape[:3]) != (b, tk, h):
    raise ValueError(f"attention: v has shape {tuple(v.shape)}, expected [B, Tk, H, Dv] = "
                     f"[{b}, {tk}, {h}, Dv]")
  if jnp.dtype(q.dtype) not in _FLOATS:
    raise ValueError(f"attention: q has dtype {q.dtype}, expected one of "
                     f"{', '.join(str(d) for d in _FLOATS)}")
  for name, x in (("k", k), ("v", v)):
    if jnp.dtype(x.dtype) != jnp.dtype(q.dtype):
      raise ValueError(f"attention: {name} has dtype {x.dtype}, expected q's dtype {q.dtype}")
  if segment_ids is not None:
    if isinstance(segment_ids, (tuple, list)):
      if len(segment_ids) != 2:
        raise ValueError("attention: segment_ids must be one [B, T] array or a pair "
                         f"(q_segment_ids, kv_segment_ids), got {len(segment_ids)} items")
      pairs = (("q_segment_ids", segment_ids[0], tq, "Tq"),
               ("kv_segment_ids", segment_ids[1], tk, "Tk"))
    else:
      if tq != tk:
        raise ValueError(f"attention: one segment_ids array needs Tq == Tk (got {tq}, {tk}); "
                         "pass (q_segment_ids, kv_segment_ids)")
      pairs = (("segment_ids", segment_ids, tq, "T"),)
    for name, s, t, tname in pairs:
      _check_array(name, s, 2, f"[B, {tname}]")
      if tuple(s.shape) != (b, t):
        raise ValueError(f"attention: {name} has shape {tuple(s.shape)}, expected "
                         f"[B, {tname}] = [{b}, {t}]")
      if not jnp.issubdtype(s.dtype, jnp.integer):
        raise ValueError(f"attention: {name} has dtype {s.dtype}, expected an integer dtype")
  try:
    float(scale)
  except (TypeError, ValueError, jax.errors.ConcretizationTypeError):
    raise ValueError(f"attention: scale must be a Python number, got "
                     f"{type(scale).__name__}") from None
  if not isinstance(causal, bool):
    raise ValueError(f"attention: causal must be a bool, got {causal!r}")
  if isinstance(q_offset, bool) or not (
      isinstance(q_offset, numbers.Integral)
      or (hasattr(q_offset, "dtype") and q_offset.shape == ()
          and jnp.issubdtype(q_offset.dtype, jnp.integer))):
    raise ValueError(f"attention: q_offset must be an int or an integer scalar array, got "
                     f"{q_offset!r}")


def canonical_segments(segment_ids, b: int, tq: int, tk: int):
  """(q_seg [B, Tq], kv_seg [B, Tk]) int32 from None (one document), one array or a pair."""
  if segment_ids is None:
    return jnp.zeros((b, tq), jnp.int32), jnp.zeros((b, tk), jnp.int32)
  if isinstance(segment_ids, (tuple, list)):
    q_seg, kv_seg = segment_ids
  else:
    q_seg = kv_seg = segment_ids
  return jnp.asarray(q_seg).astype(jnp.int32), jnp.asarray(kv_seg).astype(jnp.int32)


def last_keys(q_offset, tq: int, tk: int, causal: bool) -> jax.Array:
  """q_last [Tq] int32: the last key index each query may see (see module doc)."""
  if not causal:
    return jnp.full((tq,), tk - 1, jnp.int32)
  pos_q = jnp.asarray(q_offset, jnp.int32) + jnp.arange(tq, dtype=jnp.int32)
  return jnp.minimum(pos_q, tk - 1)


def attention(q, k, v, segment_ids=None, *, scale, causal: bool = True, q_offset=0,
              backend: str = "auto"):
  """Softmax attention that never crosses documents, with the exact per-head max logit.

  q [B, Tq, H, Dk], k [B, Tk, H, Dk], v [B, Tk, H, Dv] (Dk ≠ Dv allowed; one float dtype).
  segment_ids: None (one document), one [B, T] int array (self-attention, Tq == Tk) or a pair
  (q_segment_ids [B, Tq], kv_segment_ids [B, Tk]). Query i sits at position q_offset + i
  (q_offset: int or traced int scalar; a query shard against the full keys, as in sequence
  parallelism) and attends to key j iff their segment ids are equal and, with `causal`,
  j ≤ q_offset + i. Probabilities are softmax(scale · q·k) over the allowed keys.

  Returns (out [B, Tq, H, Dv] in q's dtype, max_logit [B, H] float32 — float64 for float64
  inputs): out rows with no allowed key are 0; max_logit[b, h] is the exact maximum of
  scale · q·k over every allowed (query, key) pair of batch row b and head h (rows with no
  allowed key do not take part), −inf when there is no allowed pair at all. max_logit has no
  gradient; out is differentiable in q, k and v.
  """
  _validate(q, k, v, segment_ids, scale, causal, q_offset, backend)
  b, tq, h, dk = q.shape
  tk, dv = k.shape[1], v.shape[3]
  backend = resolve_backend(backend, dk, dv, q.dtype)
  q_seg, kv_seg = canonical_segments(segment_ids, b, tq, tk)
  scale = float(scale)
  if backend == "reference":
    return _reference_core(q, k, v, q_seg, kv_seg, jnp.asarray(q_offset, jnp.int32),
                           scale=scale, causal=causal)
  if backend in ("pallas_gpu", "cudnn"):
    pallas_gpu.check_supported(dk, dv, q.dtype)
  if backend == "cudnn" and platform.interpret("gpu"):
    backend = "pallas_gpu"          # no cuDNN off-GPU: the kernels in interpret mode
  if backend == "cudnn":
    same_segments = not isinstance(segment_ids, (tuple, list))
    offset0 = 0 if isinstance(q_offset, numbers.Integral) and int(q_offset) == 0 else None
    if not cudnn.supports_static(tq, tk, dk, dv, q.dtype, same_segments, offset0):
      backend = "pallas_gpu"
  # Splash (pallas_tpu) needs the causal offset at trace time (None sends it to its fallback);
  # the other backends take it traced, so other offsets reuse their compilation.
  static_offset = None
  if backend == "pallas_tpu":
    static_offset = 0 if not causal else (
        int(q_offset) if isinstance(q_offset, numbers.Integral) else None)
  return _blockwise_core(q, k, v, q_seg, kv_seg, jnp.asarray(q_offset, jnp.int32), scale=scale,
                         causal=causal, backend=backend, static_offset=static_offset,
                         gpu_config=pallas_gpu.config_for(q.dtype), tpu_config=pallas_tpu.CONFIG,
                         cudnn_config=cudnn.CONFIG, xla_block_k=xla.BLOCK_K)


@functools.partial(jax.jit, static_argnames=("scale", "causal"))
def _reference_core(q, k, v, q_seg, kv_seg, q_offset, *, scale, causal):
  out, max_logit = attention_reference(q, k, v, q_seg, kv_seg, scale=scale, causal=causal,
                                       q_offset=q_offset)
  return out, max_logit


@functools.partial(jax.jit, static_argnames=("scale", "causal", "backend", "static_offset",
                                             "gpu_config", "tpu_config", "cudnn_config",
                                             "xla_block_k"))
def _blockwise_core(q, k, v, q_seg, kv_seg, q_offset, *, scale, causal, backend, static_offset,
                    gpu_config, tpu_config, cudnn_config, xla_block_k):
  """One blockwise backend on the canonical form; max_logit = max of the row maxima."""
  tq, tk = q.shape[1], k.shape[1]
  q_last = last_keys(q_offset, tq, tk, causal)
  if backend == "xla":
    out, row_max_bhq = xla.attention_xla(q, k, v, q_seg, kv_seg, q_last, scale=scale,
                                         block_k=xla_block_k)
  elif backend == "pallas_gpu":
    out, row_max_bhq = pallas_gpu.attention_pallas_gpu(
        q, k, v, q_seg, kv_seg, q_last, scale=scale, config=gpu_config,
        interpret=platform.interpret("gpu"))
  elif backend == "cudnn":
    out, row_max_bhq = cudnn.attention_cudnn(q, k, v, q_seg, q_last, scale=scale, causal=causal,
                                             config=cudnn_config, gpu_config=gpu_config)
  else:
    out, row_max_bhq = pallas_tpu.attention_pallas_tpu(
        q, k, v, q_seg, kv_seg, q_last, scale=scale, causal=causal, q_offset=static_offset,
        config=tpu_config, interpret=platform.interpret("tpu"))
  max_logit_bh = jax.lax.stop_gradient(jnp.max(row_max_bhq, axis=2))
  if max_logit_bh.dtype != jnp.float64:
    max_logit_bh = max_logit_bh.astype(jnp.float32)
  return out, max_logit_bh
