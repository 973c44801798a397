"""KDA op tests: the chunked "jax" backend against the token recurrence (docs/maths.md §1.7 invariants).

fp64 checks run under a local `jax.enable_x64(True)` context (never globally). Inputs come from
numpy and most tests share the SMALL / LARGE shapes, so the jitted op compiles once per
configuration and the file stays fast on a 2-core CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import kda, kda_decode_step
from pallas_kernels.kda.xla import solve_unit_lower

SMALL = dict(b=2, t=100, h=2, dk=16, dv=8)       # fp64; T is not a multiple of any chunk size
LARGE = dict(b=1, t=256, h=2, dk=128, dv=128)    # fp32 at the K3 head size
# Row 0: resets at 23 (mid-chunk), 64 (a chunk start for C = 16, 32, 64) and 65 (1-token doc).
# Row 1: ids may come back (5 → 7 → 5): any change of id is a reset.
SEGMENTS = np.stack([
    np.repeat([0, 1, 2, 3], [23, 41, 1, 35]),
    np.repeat([5, 7, 5, 9], [10, 20, 40, 30]),
])
NO_SEGMENTS = np.zeros((SMALL["b"], SMALL["t"]), np.int32)


def l2norm(x):
  return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True))


def sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def make_inputs(seed, *, b, t, h, dk, dv, dtype=jnp.float64):
  """Model-like inputs: unit-norm q/k, lower-bounded gates g = −5σ(·), β = σ(·), random S₀."""
  rng = np.random.default_rng(seed)
  q = l2norm(rng.standard_normal((b, t, h, dk)))
  k = l2norm(rng.standard_normal((b, t, h, dk)))
  v = rng.standard_normal((b, t, h, dv))
  g = -5.0 * sigmoid(rng.standard_normal((b, t, h, dk)))
  beta = sigmoid(rng.standard_normal((b, t, h)))
  s0 = rng.standard_normal((b, h, dk, dv))
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v, g, beta, s0))


def run(inputs, backend, **kw):
  q, k, v, g, beta, s0 = inputs
  return kda(q, k, v, g, beta, initial_state=s0, output_final_state=True, backend=backend, **kw)


def max_err(a, b):
  return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def doc_spans(seg_row):
  """[(start, end)] of the runs of equal ids in one row."""
  starts = [0] + [i for i in range(1, len(seg_row)) if seg_row[i] != seg_row[i - 1]]
  return list(zip(starts, starts[1:] + [len(seg_row)]))


# ----------------------------------------------------------------------------------------------
# Chunked == recurrent


@pytest.mark.parametrize("chunk", [16, 32, 64])
def test_chunked_matches_recurrent_fp64(chunk):
  with jax.enable_x64(True):
    inputs = make_inputs(0, **SMALL)
    o_ref, s_ref = run(inputs, "reference")
    o, s = run(inputs, "jax", chunk_size=chunk)
    assert o.dtype == jnp.float64 and s.dtype == jnp.float64
    assert max_err(o, o_ref) <= 1e-10
    assert max_err(s, s_ref) <= 1e-10


def test_chunk_size_independence_fp64():
  with jax.enable_x64(True):
    inputs = make_inputs(0, **SMALL)
    outs = {c: run(inputs, "jax", chunk_size=c, segment_ids=SEGMENTS) for c in (16, 32, 64)}
    for c in (16, 32):
      assert max_err(outs[c][0], outs[64][0]) <= 1e-10
      assert max_err(outs[c][1], outs[64][1]) <= 1e-10


def test_chunked_matches_recurrent_fp32_k128():
  inputs = make_inputs(1, dtype=jnp.float32, **LARGE)
  o_ref, s_ref = run(inputs, "reference")
  o, s = run(inputs, "jax", chunk_size=64)
  assert o.dtype == jnp.float32 and s.dtype == jnp.float32
  assert max_err(o, o_ref) <= 1e-4
  assert max_err(s, s_ref) <= 1e-4
  o_auto, s_auto = run(inputs, "auto")
  np.testing.assert_array_equal(o_auto, o)
  np.testing.assert_array_equal(s_auto, s)


def test_gamma_minus_320_inside_a_chunk_is_finite():
  # All g = −5 for 64 tokens: Γ reaches −320 inside one chunk; e^{+320} must never be formed,
  # neither in the forward nor in the backward pass.
  q, k, v, _, beta, s0 = make_inputs(2, dtype=jnp.float32, **LARGE)
  g = jnp.full_like(q, -5.0)
  inputs = (q, k, v, g, beta, s0)
  o_ref, s_ref = run(inputs, "reference")
  o, s = run(inputs, "jax", chunk_size=64)
  assert bool(jnp.all(jnp.isfinite(o))) and bool(jnp.all(jnp.isfinite(s)))
  assert max_err(o, o_ref) <= 1e-4
  assert max_err(s, s_ref) <= 1e-4
  loss = lambda *a: jnp.sum(run(a, "jax", chunk_size=64)[0])
  grads = jax.jit(jax.grad(loss, argnums=tuple(range(6))))(*inputs)
  for gr in grads:
    assert bool(jnp.all(jnp.isfinite(gr)))


@pytest.mark.parametrize("t", [1, 10, 99])
def test_short_and_ragged_lengths(t):
  # T = 1, T < chunk, T not a multiple of the chunk.
  with jax.enable_x64(True):
    inputs = make_inputs(3, **{**SMALL, "t": t})
    o_ref, s_ref = run(inputs, "reference")
    o, s = run(inputs, "jax", chunk_size=32)
    assert o.shape == o_ref.shape == (SMALL["b"], t, SMALL["h"], SMALL["dv"])
    assert max_err(o, o_ref) <= 1e-10
    assert max_err(s, s_ref) <= 1e-10


def test_defaults_zero_state_and_no_final_state():
  with jax.enable_x64(True):
    q, k, v, g, beta, s0 = make_inputs(4, **SMALL)
    o_none, s_none = kda(q, k, v, g, beta, output_final_state=True, chunk_size=32)
    o_zero, s_zero = run((q, k, v, g, beta, jnp.zeros_like(s0)), "jax", chunk_size=32)
    assert max_err(o_none, o_zero) == 0.0 and max_err(s_none, s_zero) == 0.0
    _, s_off = kda(q, k, v, g, beta, chunk_size=32)
    assert s_off is None


def test_output_dtypes_follow_q_and_state_is_fp32():
  q, k, v, g, beta, s0 = make_inputs(5, dtype=jnp.float32, **SMALL)
  bf = lambda x: x.astype(jnp.bfloat16)
  for backend in ("reference", "jax"):
    o, s = jax.eval_shape(
        lambda q, k, v, beta, backend=backend: kda(q, k, v, g, beta, initial_state=s0,
                                                   output_final_state=True, backend=backend),
        bf(q), bf(k), bf(v), bf(beta))
    assert o.dtype == jnp.bfloat16 and o.shape == (2, 100, 2, 8)
    assert s.dtype == jnp.float32 and s.shape == (2, 2, 16, 8)


@pytest.mark.parametrize("c, block", [(64, 16), (48, 16), (24, 24)])
def test_blocked_unit_lower_solve(c, block):
  with jax.enable_x64(True):
    rng = np.random.default_rng(c)
    n = np.tril(rng.standard_normal((2, c, c)) * 0.3, -1)
    rhs = rng.standard_normal((2, c, 5))
    x = solve_unit_lower(jnp.asarray(n), jnp.asarray(rhs), block)
    assert max_err(x, np.linalg.solve(np.eye(c) + n, rhs)) <= 1e-10


# ----------------------------------------------------------------------------------------------
# Gradients


def test_gradients_match_recurrent_fp64():
  with jax.enable_x64(True):
    shape = dict(b=2, t=40, h=2, dk=8, dv=6)
    inputs = make_inputs(6, **shape)
    seg = np.stack([np.repeat([0, 1], [13, 27]), np.zeros(40, int)])  # a reset mid-chunk in row 0
    rng = np.random.default_rng(7)
    w_o = jnp.asarray(rng.standard_normal((2, 40, 2, 6)))
    w_s = jnp.asarray(rng.standard_normal((2, 2, 8, 6)))

    def grads(backend):
      def loss(*args):
        o, s = run(args, backend, segment_ids=seg, chunk_size=16)
        return jnp.sum(o * w_o) + jnp.sum(s * w_s)
      return jax.jit(jax.grad(loss, argnums=tuple(range(6))))(*inputs)

    for name, g_ref, g_chunk in zip(("q", "k", "v", "g", "beta", "initial_state"),
                                    grads("reference"), grads("jax")):
      assert bool(jnp.all(jnp.isfinite(g_chunk))), name
      assert max_err(g_chunk, g_ref) <= 1e-9, name


@pytest.mark.parametrize("b, t, h", [(1, 64, 2), (2, 64, 1), (2, 16, 2)])
def test_gradients_with_unit_batch_head_or_chunk_count_fp32(b, t, h):
  # Shapes where some but not all of (B, H, T/chunk) are 1 (one sequence shard's worth of a
  # sharded batch): the op pads them on XLA:CPU, which otherwise crashes; values must not change.
  inputs = tuple(jnp.asarray(x, jnp.float32) for x in make_inputs(11, b=b, t=t, h=h, dk=8, dv=8))
  rng = np.random.default_rng(3)
  w_o = jnp.asarray(rng.standard_normal((b, t, h, 8)), jnp.float32)

  def grads(backend):
    def loss(*args):
      o, s = run(args, backend, chunk_size=16)
      return jnp.sum(o * w_o) + jnp.sum(s)
    return jax.jit(jax.grad(loss, argnums=tuple(range(6))))(*inputs)

  for name, g_ref, g_chunk in zip(("q", "k", "v", "g", "beta", "initial_state"),
                                  grads("reference"), grads("jax")):
    assert g_chunk.shape == g_ref.shape, name
    assert max_err(g_chunk, g_ref) <= 1e-4, name


# ----------------------------------------------------------------------------------------------
# Delta rule, no-op tokens, segments, decode


def test_delta_rule_recall():
  # g = 0, β = 1, unit key k: writing (k, v) into any S gives S_newᵀ k = v.
  with jax.enable_x64(True):
    q, k, v, _, _, state = make_inputs(8, **{**SMALL, "t": 1})
    zeros_g, ones_b = jnp.zeros_like(k), jnp.ones(k.shape[:3], k.dtype)
    # Reading with q = k and scale 1 returns S_newᵀ k.
    o, s_new = kda_decode_step(k[:, 0], k[:, 0], v[:, 0], zeros_g[:, 0], ones_b[:, 0], state,
                               scale=1.0)
    assert max_err(o, v[:, 0]) <= 1e-12
    assert max_err(jnp.einsum("bhkv,bhk->bhv", s_new, k[:, 0]), v[:, 0]) <= 1e-12
    # Same through the chunked path with a one-token sequence.
    o_seq, _ = kda(k, k, v, zeros_g, ones_b, initial_state=state, scale=1.0, chunk_size=32,
                   segment_ids=NO_SEGMENTS[:, :1], backend="jax")
    assert max_err(o_seq, v) <= 1e-12


def test_noop_tokens_leave_state_unchanged():
  with jax.enable_x64(True):
    q, k, v, g, beta, s0 = make_inputs(9, **SMALL)
    noop_t = np.zeros(SMALL["t"], bool)
    noop_t[30:70] = True  # crosses chunk boundaries
    g_n = jnp.where(noop_t[None, :, None, None], 0.0, g)
    beta_n = jnp.where(noop_t[None, :, None], 0.0, beta)
    o, s = run((q, k, v, g_n, beta_n, s0), "jax", chunk_size=32)
    keep = np.flatnonzero(~noop_t)
    o_ref, s_ref = run(tuple(x[:, keep] for x in (q, k, v, g, beta)) + (s0,), "reference")
    assert max_err(s, s_ref) <= 1e-10
    assert max_err(o[:, keep], o_ref) <= 1e-10
    # An all-no-op sequence hands S₀ back bit for bit on both paths.
    zero_g, zero_b = jnp.zeros_like(g), jnp.zeros_like(beta)
    for backend in ("reference", "jax"):
      _, s_same = run((q, k, v, zero_g, zero_b, s0), backend, chunk_size=32)
      assert max_err(s_same, s0) == 0.0, backend


@pytest.mark.parametrize("chunk", [16, 32, 64])
def test_segment_resets_match_reference(chunk):
  with jax.enable_x64(True):
    inputs = make_inputs(10, **SMALL)
    o_ref, s_ref = run(inputs, "reference", segment_ids=SEGMENTS)
    o, s = run(inputs, "jax", segment_ids=SEGMENTS, chunk_size=chunk)
    assert max_err(o, o_ref) <= 1e-10
    assert max_err(s, s_ref) <= 1e-10


def test_segment_resets_equal_separate_documents():
  # Each document run on its own (first document of a row from that row's S₀, the others from
  # zero), padded at the end with no-op tokens so all runs share one batch.
  with jax.enable_x64(True):
    inputs = make_inputs(10, **SMALL)
    o_packed, s_packed = map(np.asarray, run(inputs, "jax", segment_ids=SEGMENTS, chunk_size=32))
    inputs = tuple(map(np.asarray, inputs))  # numpy slicing: no per-slice compilations
    docs = [(row, start, end) for row in range(SMALL["b"]) for start, end in doc_spans(SEGMENTS[row])]
    separate = [np.zeros((len(docs),) + x.shape[1:]) for x in inputs]
    for i, (row, start, end) in enumerate(docs):
      for x_sep, x in zip(separate[:5], inputs[:5]):
        x_sep[i, :end - start] = x[row, start:end]
      if start == 0:
        separate[5][i] = inputs[5][row]
    o_sep, s_sep = map(np.asarray, run(tuple(jnp.asarray(x) for x in separate), "reference"))
    for i, (row, start, end) in enumerate(docs):
      assert max_err(o_packed[row, start:end], o_sep[i, :end - start]) <= 1e-10, (row, start)
      if end == SMALL["t"]:
        assert max_err(s_packed[row], s_sep[i]) <= 1e-10, row


def test_batch_rows_are_independent():
  with jax.enable_x64(True):
    inputs = make_inputs(10, **SMALL)
    o, s = run(inputs, "jax", segment_ids=SEGMENTS, chunk_size=32)
    for row in range(SMALL["b"]):
      one = tuple(x[row:row + 1] for x in inputs)
      o_row, s_row = run(one, "reference", segment_ids=SEGMENTS[row:row + 1])
      assert max_err(o_row, o[row:row + 1]) <= 1e-10 and max_err(s_row, s[row:row + 1]) <= 1e-10


def test_prefill_then_decode_equals_full_forward():
  with jax.enable_x64(True):
    q, k, v, g, beta, s0 = make_inputs(12, **SMALL)
    t = SMALL["t"] - 1
    o_full, s_full = run((q, k, v, g, beta, s0), "jax", chunk_size=32)
    _, s_pre = run((q[:, :t], k[:, :t], v[:, :t], g[:, :t], beta[:, :t], s0), "jax", chunk_size=32)
    o_dec, s_dec = kda_decode_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], s_pre)
    assert max_err(o_dec, o_full[:, t]) <= 1e-10
    assert max_err(s_dec, s_full) <= 1e-10


# ----------------------------------------------------------------------------------------------
# Errors


def test_bad_backend_raises():
  q, k, v, g, beta, _ = make_inputs(14, dtype=jnp.float32, **SMALL)
  with pytest.raises(ValueError, match="auto, reference, jax"):
    kda(q, k, v, g, beta, backend="triton")


@pytest.mark.parametrize("arg, bad, match", [
    ("q", lambda x: x[0], "q must have shape"),
    ("k", lambda x: x[:, :-1], "k must have shape"),
    ("v", lambda x: x[:, :, :1], "v must have shape"),
    ("g", lambda x: x[..., :-1], "g must have shape"),
    ("beta", lambda x: x[..., None], "beta must have shape"),
    ("initial_state", lambda x: x[..., :-1], "initial_state must have shape"),
    ("segment_ids", lambda x: x[:, :-1], "segment_ids must have shape"),
    ("segment_ids", lambda x: x.astype(np.float32), "segment_ids must be integer"),
    ("chunk_size", lambda x: 0, "chunk_size must be a positive int"),
])
def test_bad_arguments_raise(arg, bad, match):
  q, k, v, g, beta, s0 = make_inputs(15, dtype=jnp.float32, **SMALL)
  args = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=s0, segment_ids=NO_SEGMENTS,
              chunk_size=32)
  args[arg] = bad(args[arg])
  with pytest.raises(ValueError, match=match):
    kda(**args)


def test_decode_step_bad_shapes_raise():
  b, h, dk, dv = 2, 2, 16, 8
  q = jnp.zeros((b, h, dk))
  v = jnp.zeros((b, h, dv))
  beta = jnp.zeros((b, h))
  state = jnp.zeros((b, h, dk, dv))
  with pytest.raises(ValueError, match="state must have shape"):
    kda_decode_step(q, q, v, q, beta, state[..., :-1])
  with pytest.raises(ValueError, match="beta must have shape"):
    kda_decode_step(q, q, v, q, beta[:, :1], state)
  with pytest.raises(ValueError, match="q must have shape"):
    kda_decode_step(q[None], q, v, q, beta, state)
