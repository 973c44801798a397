"""Public KDA op: validates, canonicalises (scale, dtype, padding, resets) and dispatches to a backend.

Backends (BACKENDS): "reference" (token recurrence, reference.py, the oracle), "jax" (chunked WY
form in jnp, xla.py, runs anywhere), "pallas_gpu" (Pallas-Triton kernels, pallas_gpu.py),
"pallas_tpu" (Pallas-Mosaic kernels, pallas_tpu.py) — both Pallas backends through the chunked
custom_vjp of vjp.py, and run in interpret mode when their platform is absent (CI) — and "auto"
(pallas_gpu on GPU, pallas_tpu on TPU, jax elsewhere).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import platform
from pallas_kernels.kda.intra import reset_counts
from pallas_kernels.kda.reference import kda_recurrent, recurrent_step
from pallas_kernels.kda.vjp import kda_pallas
from pallas_kernels.kda.xla import kda_xla

BACKENDS = ("auto", "reference", "jax", "pallas_gpu", "pallas_tpu")
_PALLAS_PLATFORM = {"pallas_gpu": "gpu", "pallas_tpu": "tpu"}


def resolve_backend(backend: str) -> str:
  """"auto" -> the fastest backend for the platform traced for (`pallas_kernels.platform`); others
  pass through."""
  if backend != "auto":
    return backend
  return {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}.get(platform.current(), "jax")


def _compute_dtype(*xs) -> jnp.dtype:
  """fp64 if any input is fp64 and x64 is enabled (oracle runs), otherwise fp32."""
  if any(x is not None and jax.dtypes.canonicalize_dtype(x.dtype) == jnp.float64 for x in xs):
    return jnp.dtype(jnp.float64)
  return jnp.dtype(jnp.float32)


def _check_shape(op: str, name: str, x, expected: tuple, layout: str) -> None:
  if tuple(x.shape) != tuple(expected):
    raise ValueError(f"{op}: {name} must have shape {layout} = {tuple(expected)}, "
                     f"got {tuple(x.shape)}")


def _validate(q, k, v, g, beta, initial_state, segment_ids, chunk_size, backend) -> None:
  """Shape/argument checks with messages that name the argument and the expected layout."""
  if backend not in BACKENDS:
    raise ValueError(f"kda: unknown backend {backend!r}; allowed: {', '.join(BACKENDS)}")
  if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
    raise ValueError(f"kda: chunk_size must be a positive int, got {chunk_size!r}")
  if q.ndim != 4:
    raise ValueError(f"kda: q must have shape [B, T, H, K], got {tuple(q.shape)}")
  b, t, h, dk = q.shape
  if t < 1:
    raise ValueError(f"kda: sequence length T must be >= 1, got q shape {tuple(q.shape)}")
  if v.ndim != 4 or tuple(v.shape[:3]) != (b, t, h):
    raise ValueError(f"kda: v must have shape [B, T, H, V] = ({b}, {t}, {h}, V), "
                     f"got {tuple(v.shape)}")
  dv = v.shape[3]
  _check_shape("kda", "k", k, (b, t, h, dk), "[B, T, H, K]")
  _check_shape("kda", "g", g, (b, t, h, dk), "[B, T, H, K]")
  _check_shape("kda", "beta", beta, (b, t, h), "[B, T, H]")
  if initial_state is not None:
    _check_shape("kda", "initial_state", initial_state, (b, h, dk, dv), "[B, H, K, V]")
  if segment_ids is not None:
    _check_shape("kda", "segment_ids", segment_ids, (b, t), "[B, T]")
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
      raise ValueError(f"kda: segment_ids must be integer, got dtype {segment_ids.dtype}")
  if resolve_backend(backend) in _PALLAS_PLATFORM:
    _validate_pallas(q, v, chunk_size, backend)


def _validate_pallas(q, v, chunk_size, backend) -> None:
  """The Pallas kernels tile by powers of two and compute in fp32 with bf16/fp32 operands."""
  dk, dv = q.shape[3], v.shape[3]
  pow2 = lambda n: n >= 16 and n & (n - 1) == 0
  if chunk_size not in (16, 32, 64):
    raise ValueError(f"kda[{backend}]: chunk_size must be 16, 32 or 64, got {chunk_size}")
  if not (pow2(dk) and pow2(dv)):
    raise ValueError(f"kda[{backend}]: K and V must be powers of two >= 16, got K={dk}, V={dv}")
  if jax.dtypes.canonicalize_dtype(q.dtype) == jnp.float64:
    raise ValueError(f"kda[{backend}]: fp64 inputs are not supported (use 'reference' or 'jax')")


def _resets(segment_ids, b: int, t: int) -> jax.Array:
  """[B, T] bool: True where the segment id differs from the previous token's (never at t = 0)."""
  if segment_ids is None:
    return jnp.zeros((b, t), bool)
  changed_bt = segment_ids[:, 1:] != segment_ids[:, :-1]
  return jnp.concatenate([jnp.zeros((b, 1), bool), changed_bt], axis=1)


def _pad_time(x_bt_, pad: int) -> jax.Array:
  """Append `pad` zero tokens on axis 1 (with β = 0, g = 0 they are exact no-ops on the state)."""
  widths = [(0, 0)] * x_bt_.ndim
  widths[1] = (0, pad)
  return jnp.pad(x_bt_, widths)


def kda(q, k, v, g, beta, *, scale=None, initial_state=None, segment_ids=None, chunk_size=64,
        output_final_state=False, backend="auto"):
  """Kimi Delta Attention over a [B, T] batch of (packed) sequences.

  q, k: [B, T, H, K], already L2-normalised; v: [B, T, H, V]; g: [B, T, H, K] log-decay (≤ 0);
  beta: [B, T, H] write strength; scale (default K**-0.5) multiplies q; initial_state [B, H, K, V]
  (None = zeros); segment_ids [B, T] int: the state resets to zero wherever the id changes from the
  previous token (the first token continues from initial_state).
  Returns (o [B, T, H, V] in q's dtype, final state [B, H, K, V] in fp32 — fp64 when the inputs
  are fp64 — or None unless output_final_state).
  """
  _validate(q, k, v, g, beta, initial_state, segment_ids, chunk_size, backend)
  backend = resolve_backend(backend)
  b, t, h, dk = q.shape
  dv = v.shape[3]
  dtype = _compute_dtype(q, k, v, g, beta, initial_state)
  scale = dk ** -0.5 if scale is None else scale
  # Defaults are materialised and T is padded here, outside the jitted core, so calls with and
  # without them (and ragged lengths that pad alike) share one compilation.
  s0_bhkv = jnp.zeros((b, h, dk, dv), dtype) if initial_state is None else initial_state
  reset_bt = _resets(segment_ids, b, t)
  pad = -t % chunk_size if backend != "reference" else 0
  if pad:
    q, k, v, g, beta, reset_bt = (_pad_time(x, pad) for x in (q, k, v, g, beta, reset_bt))
  if backend in _PALLAS_PLATFORM:
    o_bthv, s_bhkv = _kda_pallas_core(q, k, v, g, beta, s0_bhkv, reset_bt, scale=float(scale),
                                      chunk_size=chunk_size, backend=backend)
  else:
    o_bthv, s_bhkv = _kda_core(q, k, v, g, beta, scale, s0_bhkv, reset_bt, dtype=dtype,
                               chunk_size=chunk_size, backend=backend)
  if pad:
    o_bthv = o_bthv[:, :t]
  return o_bthv, (s_bhkv if output_final_state else None)


@functools.partial(jax.jit, static_argnames=("dtype", "chunk_size", "backend"))
def _kda_core(q, k, v, g, beta, scale, s0, reset_bt, *, dtype, chunk_size, backend):
  """Cast to the compute dtype, scale q, run one backend; o comes back in q's dtype."""
  q_bthk = q.astype(dtype) * jnp.asarray(scale, dtype)
  k_bthk, v_bthv, g_bthk, beta_bth, s0_bhkv = (x.astype(dtype) for x in (k, v, g, beta, s0))
  if backend == "reference":
    o_bthv, s_bhkv = kda_recurrent(q_bthk, k_bthk, v_bthv, g_bthk, beta_bth, s0_bhkv, reset_bt)
  else:
    o_bthv, s_bhkv = kda_xla(q_bthk, k_bthk, v_bthv, g_bthk, beta_bth, s0_bhkv, reset_bt,
                             chunk_size)
  return o_bthv.astype(q.dtype), s_bhkv


@functools.partial(jax.jit, static_argnames=("scale", "chunk_size", "backend"))
def _kda_pallas_core(q, k, v, g, beta, s0, reset_bt, *, scale, chunk_size, backend):
  """Pallas backends: q, k, v keep their dtype (bf16 stays bf16: the kernels' dot operand dtype,
  fp32 accumulation); g, β, S₀ in fp32; scale is static (a kernel constant)."""
  kernel_platform = _PALLAS_PLATFORM[backend]
  interpret = platform.interpret(kernel_platform)
  mm = q.dtype if q.dtype in (jnp.bfloat16, jnp.float32) else jnp.float32
  o_bthv, s_bhkv = kda_pallas(q.astype(mm), k.astype(mm), v.astype(mm), g.astype(jnp.float32),
                              beta.astype(jnp.float32), s0.astype(jnp.float32),
                              reset_counts(reset_bt, chunk_size), scale, chunk_size,
                              kernel_platform, interpret)
  return o_bthv.astype(q.dtype), s_bhkv


def kda_decode_step(q, k, v, g, beta, state, *, scale=None):
  """One KDA token for generation (a prefill's final state continues exactly).

  q, k, g: [B, H, K]; v: [B, H, V]; beta: [B, H]; state: [B, H, K, V]; scale as in `kda`.
  Returns (o [B, H, V] in q's dtype, new state [B, H, K, V] in fp32, or fp64 for fp64 inputs).
  """
  op = "kda_decode_step"
  if q.ndim != 3:
    raise ValueError(f"{op}: q must have shape [B, H, K], got {tuple(q.shape)}")
  b, h, dk = q.shape
  if v.ndim != 3 or tuple(v.shape[:2]) != (b, h):
    raise ValueError(f"{op}: v must have shape [B, H, V] = ({b}, {h}, V), got {tuple(v.shape)}")
  dv = v.shape[2]
  _check_shape(op, "k", k, (b, h, dk), "[B, H, K]")
  _check_shape(op, "g", g, (b, h, dk), "[B, H, K]")
  _check_shape(op, "beta", beta, (b, h), "[B, H]")
  _check_shape(op, "state", state, (b, h, dk, dv), "[B, H, K, V]")
  dtype = _compute_dtype(q, k, v, g, beta, state)
  scale = dk ** -0.5 if scale is None else scale
  return _decode_core(q, k, v, g, beta, state, scale, dtype=dtype)


@functools.partial(jax.jit, static_argnames=("dtype",))
def _decode_core(q, k, v, g, beta, state, scale, *, dtype):
  """Cast, scale q, apply one recurrence step; o comes back in q's dtype."""
  q_bhk = q.astype(dtype) * jnp.asarray(scale, dtype)
  o_bhv, s_bhkv = recurrent_step(state.astype(dtype), q_bhk, k.astype(dtype), v.astype(dtype),
                                 g.astype(dtype), beta.astype(dtype))
  return o_bhv.astype(q.dtype), s_bhkv
