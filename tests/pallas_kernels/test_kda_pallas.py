"""Pallas KDA backends ("pallas_gpu" Triton kernels, "pallas_tpu" Mosaic kernels) against the token
recurrence, in interpret mode on CPU (the kernels' own bodies run; only the lowering differs).

Every case checks outputs, final state and the gradients wrt q, k, v, g, beta, initial_state (the
chunked custom_vjp backward) at K = V = 128. Few, packed cases keep the interpret-mode cost low:
one multi-row fp32 case carries most scenarios (see `packed_case`), plus T = 1 and bf16.
pallas_gpu runs with the state passes the grid rule picks in interpret mode (fused forward, narrow
backward: the default) and with those it picks on a GPU at many heads (split forward, wide
backward; see pallas_gpu.py). Results are computed once per variant and shared by the reference
and the fused-vs-split comparisons.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import kda, pallas_gpu, vjp
from pallas_kernels.kda import intra as intra_lib
from tests.pallas_kernels.test_kda import make_inputs, max_err

PALLAS = ("pallas_gpu", "pallas_gpu_split_fwd_wide_bwd", "pallas_tpu")
# variant name -> (kda backend, pallas_gpu.configured overrides or None for the module defaults)
VARIANTS = {
    "pallas_gpu": ("pallas_gpu", None),
    # The forward / backward state-pass choices the grid rule makes on a GPU at many heads.
    "pallas_gpu_split_fwd_wide_bwd": ("pallas_gpu", dict(split_fwd=True, wide_bwd=True,
                                                         wu_bk=32)),
    "pallas_tpu": ("pallas_tpu", None),
    "reference": ("reference", None),
}
GRAD_NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def packed_case(dtype):
  """B = 3, T = 100 (not a multiple of the chunk 64), K = V = 128, non-zero S₀:
  row 0: resets mid-chunk (23), at a chunk start (64) and a 1-token document (64..65);
  row 1: another layout (ids 5 → 7 → 5 → 9) and β = 0, g = 0 no-op tokens over 30..69;
  row 2: no resets, g = −5 on the first 64 tokens (Γ reaches −320 inside chunk 0)."""
  q, k, v, g, beta, s0 = (np.array(x) for x in make_inputs(
      20, b=3, t=100, h=1, dk=128, dv=128, dtype=jnp.float32))
  g[1, 30:70] = 0.0
  beta[1, 30:70] = 0.0
  g[2, :64] = -5.0
  seg = np.stack([np.repeat([0, 1, 2, 3], [23, 41, 1, 35]),
                  np.repeat([5, 7, 5, 9], [10, 20, 40, 30]),
                  np.zeros(100, int)])
  inputs = tuple(jnp.asarray(x, dtype) for x in (q, k, v)) + (
      jnp.asarray(g), jnp.asarray(beta, dtype), jnp.asarray(s0))
  return inputs, seg


def outputs_and_grads(inputs, seg, variant):
  """(o, S_final, grads) of a loss that weights o and S by fixed random tensors, with one of
  VARIANTS (a kda backend, pallas_gpu's state-pass variant set for the whole call)."""
  backend, overrides = VARIANTS[variant]
  if overrides is None:
    return _outputs_and_grads(inputs, seg, backend)
  with pallas_gpu.configured(**overrides):
    return _outputs_and_grads(inputs, seg, backend)


def _outputs_and_grads(inputs, seg, backend):
  rng = np.random.default_rng(1)
  w_o = jnp.asarray(rng.standard_normal(inputs[2].shape), jnp.float32)
  w_s = jnp.asarray(rng.standard_normal(inputs[5].shape), jnp.float32)

  def loss(q, k, v, g, beta, s0):
    o, s = kda(q, k, v, g, beta, initial_state=s0, segment_ids=seg, output_final_state=True,
               backend=backend)
    return jnp.sum(o.astype(jnp.float32) * w_o) + jnp.sum(s * w_s), (o, s)

  fn = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True))
  (_, (o, s)), grads = fn(*inputs)
  return o, s, grads


@functools.lru_cache(maxsize=None)
def packed_results(variant, dtype_name):
  """outputs_and_grads on packed_case, once per (variant, dtype) for the whole module."""
  inputs, seg = packed_case(jnp.dtype(dtype_name))
  return outputs_and_grads(inputs, seg, variant)


@pytest.mark.parametrize("backend", PALLAS)
def test_packed_fp32_matches_reference(backend):
  o_ref, s_ref, g_ref = packed_results("reference", "float32")
  o, s, grads = packed_results(backend, "float32")
  assert o.dtype == jnp.float32 and s.dtype == jnp.float32
  assert max_err(o, o_ref) <= 1e-4
  assert max_err(s, s_ref) <= 1e-4
  for name, gr, gr_ref in zip(GRAD_NAMES, grads, g_ref):
    assert bool(jnp.all(jnp.isfinite(gr))), name
    assert max_err(gr, gr_ref) <= 1e-4, name
  # Row 1 ends in a document that starts at 70, after the no-op span; row 2's Γ = −320 chunk
  # must not leak non-finite values anywhere.
  assert bool(jnp.all(jnp.isfinite(o)))


@pytest.mark.parametrize("backend", PALLAS)
def test_single_token_fp32(backend):
  # T = 1 < chunk: one real token, 63 padding no-ops.
  inputs = make_inputs(21, b=1, t=1, h=2, dk=128, dv=128, dtype=jnp.float32)
  o_ref, s_ref, g_ref = outputs_and_grads(inputs, None, "reference")
  o, s, grads = outputs_and_grads(inputs, None, backend)
  assert o.shape == (1, 1, 2, 128)
  assert max_err(o, o_ref) <= 1e-4 and max_err(s, s_ref) <= 1e-4
  for name, gr, gr_ref in zip(GRAD_NAMES, grads, g_ref):
    assert max_err(gr, gr_ref) <= 1e-4, name


@pytest.mark.parametrize("backend", PALLAS)
def test_packed_bf16_within_tolerance(backend):
  # bf16 q, k, v, beta (dots in bf16, fp32 accumulation; W, U, S snapshots stored in bf16) vs the
  # fp32 recurrence on the same bf16-rounded values. Stated tolerance: max abs error ≤ 2e-2 × the
  # reference's max magnitude for o, S and every gradient (the H200 run measured ≤ 3e-3 ×).
  inputs, seg = packed_case(jnp.bfloat16)
  o, s, grads = packed_results(backend, "bfloat16")
  assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
  ref_inputs = tuple(x.astype(jnp.float32) for x in inputs)
  o_ref, s_ref, g_ref = outputs_and_grads(ref_inputs, seg, "reference")
  for name, x, ref in zip(("o", "S") + GRAD_NAMES, (o, s) + tuple(grads), (o_ref, s_ref) + g_ref):
    assert bool(jnp.all(jnp.isfinite(x.astype(jnp.float32)))), name
    assert max_err(x, ref) <= 2e-2 * max_err(ref, 0.0), name


@pytest.mark.parametrize("split", ["pallas_gpu_split_fwd_wide_bwd"])
def test_split_equals_fused_fp32(split):
  # The split forward and the wide backward do the same sums in the same order as the fused,
  # narrow ones (only the XLA:CPU dot blocking may differ with the V-block), so fp32 results agree
  # to rounding: ≤ 2e-6 × the fused result's max magnitude, far below the 1e-4 reference
  # tolerance.
  fused = packed_results("pallas_gpu", "float32")
  got = packed_results(split, "float32")
  names = ("o", "S") + GRAD_NAMES
  for name, x, ref in zip(names, got[:2] + tuple(got[2]), fused[:2] + tuple(fused[2])):
    assert max_err(x, ref) <= 2e-6 * max(max_err(ref, 0.0), 1e-3), name


def _pallas_calls(fn, *args):
  return str(jax.make_jaxpr(fn)(*args)).count("pallas_call")


def test_variant_switch_reaches_the_kernels():
  # The state-pass form is read at trace time: the default forward has 5 kernels (cumsum, strip
  # scores, WY inverse, W and U, fused state); fwd+bwd adds state_bwd, chunk_bwd, WY backward and
  # score backward: 9; the split forward +1 (output).
  # `configured` clears JAX's caches, so switching back and forth inside one process retraces.
  q, k, v, g, beta, _ = make_inputs(24, b=1, t=64, h=1, dk=16, dv=16, dtype=jnp.float32)
  fwd = lambda *a: kda(*a, backend="pallas_gpu")[0]
  grad = jax.grad(lambda *a: jnp.sum(fwd(*a)), argnums=range(5))
  counts = lambda: (_pallas_calls(fwd, q, k, v, g, beta), _pallas_calls(grad, q, k, v, g, beta))
  assert counts() == (5, 9)
  with pallas_gpu.configured(split_fwd=True, split_fwd_bv=16):
    assert counts() == (6, 10)
  assert counts() == (5, 9)
  assert pallas_gpu.SETTINGS == pallas_gpu.Settings()


def test_w_and_u_kernels_by_shape():
  # K = V: W and U in one kernel per column block (the 5 / 9 above); K ≠ V: a W and a U kernel.
  q, k, v, g, beta, _ = make_inputs(24, b=1, t=64, h=1, dk=16, dv=32, dtype=jnp.float32)
  fwd = lambda *a: kda(*a, backend="pallas_gpu")[0]
  grad = jax.grad(lambda *a: jnp.sum(fwd(*a)), argnums=range(5))
  assert _pallas_calls(fwd, q, k, v, g, beta) == 6
  assert _pallas_calls(grad, q, k, v, g, beta) == 10


@pytest.mark.parametrize("backend", ["pallas_gpu", "pallas_gpu_split_fwd_wide_bwd"])
@pytest.mark.parametrize("dk, dv", [(16, 32), (32, 16)])
def test_k_unequal_v_fp32(backend, dk, dv):
  # K ≠ V (separate W and U kernels, V-blocks unlike the K-blocks), a mid-chunk reset, S₀ ≠ 0.
  inputs = make_inputs(25, b=1, t=100, h=2, dk=dk, dv=dv, dtype=jnp.float32)
  seg = np.repeat([0, 1], [37, 63])[None]
  o_ref, s_ref, g_ref = outputs_and_grads(inputs, seg, "reference")
  o, s, grads = outputs_and_grads(inputs, seg, backend)
  assert max_err(o, o_ref) <= 1e-4 and max_err(s, s_ref) <= 1e-4
  for name, gr, gr_ref in zip(GRAD_NAMES, grads, g_ref):
    assert max_err(gr, gr_ref) <= 1e-4, name


def test_state_pass_variants_by_grid_size():
  # Default (split_fwd None): the forward state pass runs split only when the fused kernel's
  # B·H·V/bv programs exceed the SMs (H200: 132; bv 32): 2×16 heads = 128 programs stay fused,
  # 1×96 heads = 384 split; never in interpret mode (no SM count). split_fwd overrides.
  assert not pallas_gpu.split_forward(2, 16, 128, 132)
  assert pallas_gpu.split_forward(1, 96, 128, 132)
  assert not pallas_gpu.split_forward(1, 96, 128, None)
  with pallas_gpu.configured(split_fwd=False):
    assert not pallas_gpu.split_forward(1, 96, 128, 132)
  with pallas_gpu.configured(split_fwd=True):
    assert pallas_gpu.split_forward(2, 16, 128, 132)
  # The fused backward widens (V-block 64, 8 warps) by the same rule.
  assert not pallas_gpu.wide_backward(2, 16, 128, 132)
  assert pallas_gpu.wide_backward(1, 96, 128, 132)
  assert not pallas_gpu.wide_backward(1, 96, 128, None)
  with pallas_gpu.configured(wide_bwd=True):
    assert pallas_gpu.wide_backward(2, 16, 128, None)


@pytest.mark.parametrize("kw, match", [(dict(bv=48), "bv must be a power of two"),
                                       (dict(state_warps=3), "state_warps must be"),
                                       (dict(intra_stages=0), "intra_stages must be"),
                                       (dict(strip_stages=5), "strip_stages must be"),
                                       (dict(split_fwd_bv=96), "split_fwd_bv must be"),
                                       (dict(wu_bk=48), "wu_bk must be"),
                                       (dict(wide_stages=5), "wide_stages must be"),
                                       (dict(warps=8), "unexpected keyword")])
def test_variant_bad_settings_raise(kw, match):
  with pytest.raises((ValueError, TypeError), match=match):
    with pallas_gpu.configured(**kw):
      pass
  assert pallas_gpu.SETTINGS == pallas_gpu.Settings()


@pytest.mark.parametrize("chunk", [32, 64])
def test_intra_kernel_matches_jnp_definition(chunk):
  # Kernel-level: the forward intra-chunk kernels' tensors equal intra.intra_all (same masks and
  # maths), here with a reset inside the second 16-row strip of a chunk (and chunk 64: four
  # strips, so strip 3 pairs with three earlier blocks).
  q, k, v, g, beta, _ = make_inputs(22, b=1, t=128, h=1, dk=16, dv=16, dtype=jnp.float32)
  reset = jnp.zeros((1, 128), bool).at[0, 23].set(True).at[0, 100].set(True)
  cnt = intra_lib.reset_counts(reset, chunk)
  want = intra_lib.intra_all(q, k, v, g, beta, cnt, scale=0.25, chunk=chunk)
  got = pallas_gpu.intra(q, k, v, intra_lib.chunk_cumsum(g, chunk), beta, cnt, scale=0.25,
                         chunk=chunk, interpret=True)
  for name, x, y in zip(("aqk", "w", "u", "qg", "kt"), got, want):
    assert max_err(x, y) <= 1e-5, name


@pytest.mark.parametrize("kw, match", [
    (dict(chunk_size=48), "chunk_size must be 16, 32 or 64"),
    (dict(dk=24), "K and V must be powers of two"),
])
def test_pallas_bad_arguments_raise(kw, match):
  q, k, v, g, beta, _ = make_inputs(23, b=1, t=8, h=1, dk=kw.get("dk", 16), dv=16,
                                    dtype=jnp.float32)
  with pytest.raises(ValueError, match=match):
    kda(q, k, v, g, beta, chunk_size=kw.get("chunk_size", 64), backend="pallas_gpu")


def test_auto_is_jax_on_cpu():
  from pallas_kernels.kda.op import resolve_backend
  expected = {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}.get(jax.default_backend(), "jax")
  assert resolve_backend("auto") == expected


def test_cumsum_kernel_matches_xla_cumsum():
  # The Pallas in-chunk cumsum against intra.chunk_cumsum, with a chunk whose Γ falls below −150
  # (float32 sums: the same values up to summation order).
  g = -jnp.abs(jax.random.normal(jax.random.PRNGKey(3), (2, 128, 3, 16))) * 5.0
  want = intra_lib.chunk_cumsum(g, 64)
  got = pallas_gpu.chunk_cumsum(g, 64, interpret=True)
  assert float(jnp.min(want)) < -150.0
  assert max_err(got, want) <= 1e-5 * float(jnp.max(jnp.abs(want)))


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_remat_selective_kda_keeps_the_kernel_residuals(platform):
  """Under remat `selective_kda` the chunk kernels' outputs are saved by name and XLA's backward
  runs none of the forward kernels again (fewer kernel loops than under `selective`, where the
  forward reruns), with the gradients of the un-rematerialised op (fp32, exact up to 1e-6)."""
  from jax._src.ad_checkpoint import saved_residuals
  from k3train.model import remat
  B, T, H, K = 1, 128, 2, 32
  keys = jax.random.split(jax.random.PRNGKey(3), 4)
  q, k, v = (0.3 * jax.random.normal(key, (B, T, H, K)) for key in keys[:3])
  g = -jax.nn.sigmoid(jax.random.normal(keys[3], (B, T, H, K)))
  beta = jax.nn.sigmoid(q[..., 0])
  s0 = jnp.zeros((B, H, K, K))
  cnt = intra_lib.reset_counts(jnp.zeros((B, T), bool), 64)

  def loss(q, k, v, g, beta):
    o, _ = vjp.kda_pallas(jnp.sin(q), k, v, g, beta, s0, cnt, 0.1, 64, platform, True)
    return jnp.sum(o * o)            # the backward needs o, as a layer's output norm does

  args = (q, k, v, g, beta)
  want = jax.grad(loss, argnums=range(5))(*args)
  loops = {}
  for name in ("selective", "selective_kda"):
    fn = jax.checkpoint(loss, policy=remat.policy(name))
    named = [r for r in saved_residuals(fn, *args) if vjp.RESIDUAL_NAME in r[1]]
    # o, A_qk, W, U, gated q and k, A_kk, its inverse, the decays, the states and Δ: 11 values.
    assert len(named) == (11 if name == "selective_kda" else 0), (name, named)
    y, backward = jax.vjp(fn, *args)
    got = backward(jnp.ones_like(y))
    for w, gv in zip(want, got):
      np.testing.assert_allclose(gv, w, rtol=1e-6, atol=1e-6 * float(jnp.max(jnp.abs(w))))
    loops[name] = jax.jit(backward).lower(jnp.ones_like(y)).compile().as_text().count(" while(")
  assert loops["selective_kda"] < loops["selective"], loops
