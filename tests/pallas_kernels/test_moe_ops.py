"""pallas_kernels.moe: gmm backends agree (values and gradients), dispatch/combine are exact."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import moe as moe_ops
from tests.pallas_kernels.gmm_testing import loop_gmm, normal

M, K, N = 12, 8, 6

# (group sizes, what the case covers)
GROUP_CASES = [
    ([3, 0, 5, 4], "mixed with an empty group"),
    ([0, 0, 12, 0], "one group holds every row"),
    ([2, 0, 3, 0], "rows past sum(group_sizes)"),
    ([0, 0, 0, 0], "all groups empty"),
    ([1, 1, 1, 9], "singletons then a big group"),
]


def _operands(dtype=jnp.float32, seed=0):
  return normal((M, K), seed).astype(dtype), normal((4, K, N), seed + 100).astype(dtype)


# Tests call the ops through jit: one compile per case instead of one per eager primitive.
gmm = jax.jit(moe_ops.gmm, static_argnames=("backend",))


@pytest.mark.parametrize("sizes,_why", GROUP_CASES)
def test_gmm_fp32_backends_agree(sizes, _why):
  lhs, rhs = _operands()
  gs = jnp.asarray(sizes, jnp.int32)
  ref = gmm(lhs, rhs, gs, backend="reference")
  rag = gmm(lhs, rhs, gs, backend="ragged_dot")
  tpu = gmm(lhs, rhs, gs, backend="pallas_tpu")   # TPU interpret mode off-TPU; K, N = full dims
  auto = moe_ops.gmm(lhs, rhs, gs)
  assert ref.dtype == rag.dtype == tpu.dtype == jnp.float32
  np.testing.assert_allclose(ref, rag, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(ref, tpu, atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(auto, rag)
  np.testing.assert_allclose(ref, loop_gmm(lhs, rhs, sizes), atol=1e-5, rtol=1e-5)
  # Rows at or past sum(group_sizes) are exactly zero in both backends.
  used = sum(sizes)
  np.testing.assert_array_equal(ref[used:], 0.0)
  np.testing.assert_array_equal(rag[used:], 0.0)
  np.testing.assert_array_equal(tpu[used:], 0.0)


@pytest.mark.parametrize("sizes,_why", GROUP_CASES)
def test_gmm_bf16_backends_agree(sizes, _why):
  """bf16 inputs, fp32 accumulation in both backends: they may differ by the final bf16 rounding
  only, so the stated tolerance is atol = rtol = 1e-2 (one bf16 ulp is 2^-8 relative)."""
  lhs, rhs = _operands(jnp.bfloat16)
  gs = jnp.asarray(sizes, jnp.int32)
  ref = gmm(lhs, rhs, gs, backend="reference")
  rag = gmm(lhs, rhs, gs, backend="ragged_dot")
  tpu = gmm(lhs, rhs, gs, backend="pallas_tpu")
  assert ref.dtype == rag.dtype == tpu.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(ref, np.float32), np.asarray(rag, np.float32),
                             atol=1e-2, rtol=1e-2)
  np.testing.assert_allclose(np.asarray(ref, np.float32), np.asarray(tpu, np.float32),
                             atol=1e-2, rtol=1e-2)
  np.testing.assert_array_equal(np.asarray(tpu[sum(sizes):], np.float32), 0.0)
  np.testing.assert_allclose(np.asarray(rag, np.float32), loop_gmm(lhs, rhs, sizes),
                             atol=3e-2, rtol=1e-2)
  np.testing.assert_array_equal(np.asarray(rag[sum(sizes):], np.float32), 0.0)


# d/d(lhs, rhs) of sum(gmm · ct); group sizes traced, so one compile per backend for all cases.
_gmm_grads = jax.jit(
    jax.grad(lambda a, b, gs, ct, backend: jnp.sum(moe_ops.gmm(a, b, gs, backend=backend) * ct),
             argnums=(0, 1)), static_argnames=("backend",))


@pytest.mark.parametrize("sizes,_why", GROUP_CASES)
def test_gmm_gradients_agree(sizes, _why):
  lhs, rhs = _operands(seed=1)
  gs = jnp.asarray(sizes, jnp.int32)
  ct_mn = normal((M, N), 7)

  def grads(backend):
    return _gmm_grads(lhs, rhs, gs, ct_mn, backend=backend)

  dl_ref, dr_ref = grads("reference")
  dl_rag, dr_rag = grads("ragged_dot")
  dl_tpu, dr_tpu = grads("pallas_tpu")
  np.testing.assert_allclose(dl_ref, dl_rag, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(dr_ref, dr_rag, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(dl_ref, dl_tpu, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(dr_ref, dr_tpu, atol=1e-5, rtol=1e-5)
  # Rows in no group get no gradient; empty groups' matrices get no gradient.
  np.testing.assert_array_equal(dl_rag[sum(sizes):], 0.0)
  np.testing.assert_array_equal(dl_tpu[sum(sizes):], 0.0)
  for g, size in enumerate(sizes):
    if size == 0:
      np.testing.assert_array_equal(dr_rag[g], 0.0)
      np.testing.assert_array_equal(dr_tpu[g], 0.0)


def test_gmm_jit_with_traced_group_sizes():
  lhs, rhs = _operands()
  f = jax.jit(lambda a, b, g: moe_ops.gmm(a, b, g, backend="ragged_dot"))
  for sizes, _ in GROUP_CASES:
    gs = jnp.asarray(sizes, jnp.int32)
    np.testing.assert_allclose(f(lhs, rhs, gs), loop_gmm(lhs, rhs, sizes), atol=1e-5)


def test_gmm_unknown_backend_names_allowed_ones():
  lhs, rhs = _operands()
  with pytest.raises(ValueError, match="reference.*ragged_dot"):
    moe_ops.gmm(lhs, rhs, jnp.asarray([3, 3, 3, 3]), backend="pallas_tpu_v9")


def test_gmm_shape_errors():
  lhs, rhs = _operands()
  with pytest.raises(ValueError):
    moe_ops.gmm(lhs, rhs[:, :4], jnp.asarray([3, 3, 3, 3]))
  with pytest.raises(ValueError):
    moe_ops.gmm(lhs, rhs, jnp.asarray([3, 3, 6]))


# ----------------------------------------------------------------------------- dispatch / combine

T, D, E, TOPK = 10, 5, 4, 2


def _routing(seed=0):
  rng = np.random.default_rng(seed)
  x_td = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
  idx_tk = np.argsort(rng.standard_normal((T, E)), axis=1)[:, :TOPK]     # k distinct experts
  w_tk = jnp.asarray(rng.uniform(0.1, 1.0, (T, TOPK)), jnp.float32)
  return x_td, jnp.asarray(idx_tk, jnp.int32), w_tk


def test_dispatch_layout():
  x, idx, _ = _routing()
  x_sorted, gs, perm = moe_ops.dispatch(x, idx, E)
  assert x_sorted.shape == (T * TOPK, D) and gs.dtype == jnp.int32 and perm.dtype == jnp.int32
  np.testing.assert_array_equal(gs, np.bincount(np.asarray(idx).ravel(), minlength=E))
  np.testing.assert_array_equal(np.sort(perm), np.arange(T * TOPK))        # a permutation
  expert_sorted = np.asarray(idx).ravel()[np.asarray(perm)]
  assert np.all(np.diff(expert_sorted) >= 0)                               # grouped by expert
  for e in range(E):                                                       # stable within expert
    assert np.all(np.diff(np.asarray(perm)[expert_sorted == e]) > 0)
  np.testing.assert_array_equal(x_sorted, np.asarray(x)[np.asarray(perm) // TOPK])


@pytest.mark.parametrize("shape, bins", [((4096, 8), 64), ((7, 3), 5), ((1,), 1)])
def test_count_ids_equals_bincount_and_drops_ids_out_of_range(shape, bins):
  ids = np.random.default_rng(sum(shape)).integers(-2, bins + 3, size=shape).astype(np.int32)
  counts = jax.jit(moe_ops.count_ids, static_argnums=1)(jnp.asarray(ids), bins)
  kept = ids[(ids >= 0) & (ids < bins)]
  assert counts.dtype == jnp.int32
  np.testing.assert_array_equal(counts, np.bincount(kept, minlength=bins))


def test_count_ids_compiles_to_a_reduction_not_a_scatter():
  """The point of count_ids: no scatter-add (serialised atomics on a GPU) in the compiled code."""
  ids = jnp.zeros((4096, 8), jnp.int32)
  hlo = jax.jit(moe_ops.count_ids, static_argnums=1).lower(ids, 64).compile().as_text()
  assert "scatter" not in hlo and "reduce" in hlo
  hlo_dispatch = jax.jit(moe_ops.dispatch, static_argnums=2).lower(
      jnp.zeros((512, 16)), jnp.zeros((512, 8), jnp.int32), 64).compile().as_text()
  assert not re.search(r"s32\[64\][^=]*scatter", hlo_dispatch)      # group sizes [64]: no scatter


def _sorted_expert_ids(group_sizes_e):
  return jnp.repeat(jnp.arange(E), group_sizes_e, total_repeat_length=T * TOPK)


def _sorted_moe(x, w, idx):
  """dispatch → expert e multiplies by (e + 1) → combine."""
  x_sorted, gs, perm = moe_ops.dispatch(x, idx, E)
  scale_p = (_sorted_expert_ids(gs) + 1).astype(x.dtype)
  return moe_ops.combine(x_sorted * scale_p[:, None], w, perm)


def _sorted_moe_scaled_rows(x, w, idx):
  """The same MoE with the weights applied to the sorted rows (sorted_pair_weights) and the
  unweighted combine_scaled."""
  x_sorted, gs, perm = moe_ops.dispatch(x, idx, E)
  scale_p = (_sorted_expert_ids(gs) + 1).astype(jnp.float32)
  w_p = moe_ops.sorted_pair_weights(w, perm)
  rows = (x_sorted.astype(jnp.float32) * (scale_p * w_p)[:, None]).astype(x.dtype)
  return moe_ops.combine_scaled(rows, perm, idx.shape[1])


def _dense_moe(x, w, idx):
  return jnp.sum(w[:, :, None] * (idx[:, :, None] + 1.0) * x[:, None, :], axis=1)


def test_dispatch_combine_identity_experts():
  x, idx, w = _routing()

  @jax.jit
  def identity_moe(x_td, w_tk, idx_tk):
    x_sorted, _, perm = moe_ops.dispatch(x_td, idx_tk, E)
    return moe_ops.combine(x_sorted, w_tk, perm)

  y = identity_moe(x, w, idx)
  np.testing.assert_allclose(y, jnp.sum(w, axis=1, keepdims=True) * x, atol=1e-6, rtol=1e-6)


def test_dispatch_combine_per_expert_op_matches_dense():
  x, idx, w = _routing(seed=3)
  np.testing.assert_allclose(jax.jit(_sorted_moe)(x, w, idx), _dense_moe(x, w, idx),
                             atol=1e-6, rtol=1e-6)
  # Also under jit and with duplicate experts per token (dispatch makes no top-k assumption).
  idx_dup = idx.at[:, 1].set(idx[:, 0])
  np.testing.assert_allclose(jax.jit(_sorted_moe)(x, w, idx_dup), _dense_moe(x, w, idx_dup),
                             atol=1e-6, rtol=1e-6)


def test_dispatch_combine_gradients():
  x, idx, w = _routing(seed=5)
  ct = normal((T, D), 9)
  g_sorted = jax.jit(jax.grad(lambda a, b: jnp.sum(_sorted_moe(a, b, idx) * ct),
                              argnums=(0, 1)))(x, w)
  g_dense = jax.jit(jax.grad(lambda a, b: jnp.sum(_dense_moe(a, b, idx) * ct),
                             argnums=(0, 1)))(x, w)
  for gs_, gd_ in zip(g_sorted, g_dense):
    np.testing.assert_allclose(gs_, gd_, atol=1e-5, rtol=1e-5)


def test_combine_weights_in_fp32_output_in_input_dtype():
  x, idx, w = _routing()
  x_sorted, _, perm = moe_ops.dispatch(x.astype(jnp.bfloat16), idx, E)
  y = moe_ops.combine(x_sorted, w, perm)
  assert y.dtype == jnp.bfloat16
  want = jnp.sum(w, axis=1, keepdims=True) * x.astype(jnp.bfloat16).astype(jnp.float32)
  np.testing.assert_allclose(np.asarray(y, np.float32), want, atol=2e-2, rtol=1e-2)


def _float_primitives(jaxpr) -> set[str]:
  """Names of the primitives with a floating-point output anywhere in a jaxpr, sub-jaxprs (jit,
  custom_vjp, scan bodies) included. (Integer scatter-adds, e.g. bincount, are not counted.)"""
  names = set()
  for eqn in jaxpr.eqns:
    if any(jnp.issubdtype(v.aval.dtype, jnp.floating) for v in eqn.outvars):
      names.add(str(eqn.primitive))
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else (param,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          names |= _float_primitives(inner)
  return names


def _numpy_moe_grads(x, w, idx, ct, scale_e):
  """Gradients of Σ ct ⊙ y, y[t] = Σ_j w[t,j]·scale[idx[t,j]]·x[t], in float64 numpy."""
  x, w, ct = (np.asarray(a, np.float64) for a in (x, w, ct))
  s_tk = np.asarray(scale_e, np.float64)[np.asarray(idx)]
  dx = np.sum(w * s_tk, axis=1)[:, None] * ct
  dw = s_tk * np.sum(x * ct, axis=1)[:, None]
  return dx, dw


@pytest.mark.parametrize("form", [_sorted_moe, _sorted_moe_scaled_rows])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 2e-2)])
def test_dispatch_combine_gradients_are_gathers_and_match_float64(dtype, tol, form):
  """The backward of dispatch → combine holds no scatter-add (permute.py writes both directions
  as gathers through the inverse permutation) and equals the float64 gradients; with duplicate
  experts per token too. Tolerance: fp32 1e-6, bf16 2e-2 (relative to the largest gradient).
  Both forms: weights applied by `combine`, or to the sorted rows (`sorted_pair_weights`,
  `combine_scaled`)."""
  x, idx, w = _routing(seed=7)
  ct = normal((T, D), 11)
  for idx_case in (idx, idx.at[:, 1].set(idx[:, 0])):
    loss = lambda a, b: jnp.sum(form(a.astype(dtype), b, idx_case).astype(jnp.float32) * ct)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    assert "scatter-add" not in _float_primitives(jax.make_jaxpr(grad)(x, w).jaxpr)
    want = _numpy_moe_grads(np.asarray(x.astype(dtype), np.float64), w, idx_case, ct, np.arange(E) + 1.0)
    for got, ref in zip(grad(x, w), want):
      np.testing.assert_allclose(np.asarray(got, np.float64), ref, atol=tol * np.abs(ref).max(),
                                 rtol=0)


# ----------------------------------------------------------------------------- row gather kernel


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("rows, cols, n, p, d", [(16, 1024, 64, 128, 256), (4, 16, 9, 24, 48),
                                                  (16, 64, 5, 7, 32)])
def test_row_gather_kernel_copies_the_rows_bit_for_bit(dtype, rows, cols, n, p, d):
  """pallas_gpu_rows.gather_rows (interpret mode) equals x[idx] exactly, whatever blocks the
  settings and the shapes leave (7 rows: one row per program; D 48: blocks of 16 columns)."""
  from pallas_kernels.moe import pallas_gpu_rows
  rng = np.random.default_rng(n + p)
  x = jnp.asarray(rng.standard_normal((n, d)), dtype)
  idx = jnp.asarray(rng.integers(0, n, size=p), jnp.int32)
  with pallas_gpu_rows.configured(rows=rows, cols=cols):
    got = jax.jit(lambda a, i: pallas_gpu_rows.gather_rows(a, i, interpret=True))(x, idx)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(x)[np.asarray(idx)])


def test_row_gather_kernel_refuses_what_it_cannot_copy_and_the_ops_fall_back():
  from pallas_kernels.moe import pallas_gpu_rows, permute
  idx = jnp.zeros((4,), jnp.int32)
  for x in (jnp.zeros((4, 24)), jnp.zeros((4,)), jnp.zeros((4, 32), jnp.int8)):
    assert not pallas_gpu_rows.supports(x, idx)
    with pytest.raises(ValueError, match="row gather pallas_gpu: needs x"):
      pallas_gpu_rows.gather_rows(x, idx, interpret=True)
  x = jnp.arange(12.0).reshape(4, 3)                     # 3 columns: XLA's gather instead
  np.testing.assert_array_equal(permute._rows(x, jnp.asarray([3, 0]), "pallas_gpu"), x[jnp.asarray([3, 0])])
  with pytest.raises(ValueError, match="unknown backend 'triton'"):
    moe_ops.dispatch(x, jnp.zeros((4, 1), jnp.int32), 2, gather="triton")
  with pytest.raises(ValueError, match="rows must be a power of two"):
    pallas_gpu_rows.Settings(rows=3)


def test_dispatch_and_combine_through_the_gather_kernel_equal_xla_bit_for_bit():
  """Values and gradients of dispatch → experts → combine_scaled with gather="pallas_gpu"
  (interpret mode: the forward row gather and the combine's gradient gather) and "xla"."""
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((T, 32)), jnp.bfloat16)
  idx = jnp.asarray(np.argsort(rng.standard_normal((T, E)), axis=1)[:, :TOPK], jnp.int32)
  ct = jnp.asarray(rng.standard_normal((T, 32)), jnp.float32)

  def loss(a, gather):
    x_sorted, gs, perm = moe_ops.dispatch(a, idx, E, gather=gather)
    rows = x_sorted * (_sorted_expert_ids(gs) + 1).astype(a.dtype)[:, None]
    return jnp.sum(moe_ops.combine_scaled(rows, perm, TOPK, gather=gather).astype(jnp.float32) * ct)

  run = lambda gather: jax.jit(jax.value_and_grad(lambda a: loss(a, gather)))(x)
  kernel_jaxpr = str(jax.make_jaxpr(jax.grad(lambda a: loss(a, "pallas_gpu")))(x))
  assert kernel_jaxpr.count("moe_gather_rows") == 2      # the forward rows and the gradient rows
  (l_k, g_k), (l_x, g_x) = run("pallas_gpu"), run("xla")
  assert float(l_k) == float(l_x)
  np.testing.assert_array_equal(np.asarray(g_k), np.asarray(g_x))


def test_scaled_rows_shape_errors():
  x, idx, w = _routing()
  _, _, perm = moe_ops.dispatch(x, idx, E)
  with pytest.raises(ValueError, match="sorted_pair_weights"):
    moe_ops.sorted_pair_weights(w[:, :1], perm)
  with pytest.raises(ValueError, match="combine_scaled"):
    moe_ops.combine_scaled(x, perm, TOPK)
