"""pallas_kernels.situ_glu: both backends against the float64 oracle, forward and gradients.

The Pallas-GPU kernels run in interpret mode on CPU, with small blocks so that the grid has
several programs along both axes (the row-scale gradient is summed over column programs)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.situ_glu import op, pallas_gpu, reference_situ_glu, situ_glu
from pallas_kernels.situ_glu.reference import situ_glu_grads

F32 = jnp.float32
BETA, LINEAR_BETA = 4.0, 25.0


def _inputs(shape=(3, 16, 96), dtype=jnp.bfloat16, seed=0):
  """g, u spread over the activation's whole range (|g| up to ~25, |u| up to ~100: both tanh
  caps saturate somewhere), dh, and a row scale in (0, 1)."""
  kg, ku, kd, kr = jax.random.split(jax.random.key(seed), 4)
  g = (jax.random.normal(kg, shape, F32) * 6).astype(dtype)
  u = (jax.random.normal(ku, shape, F32) * 30).astype(dtype)
  dh = jax.random.normal(kd, shape, F32).astype(dtype)
  r = jax.random.uniform(kr, shape[:-1], F32, 0.05, 1.0)
  return g, u, dh, r


def _run(backend, g, u, dh, r, linear_beta):
  if r is None:
    h, pull = jax.vjp(lambda a, b: situ_glu(a, b, BETA, linear_beta, backend=backend), g, u)
    return (h, *jax.jit(pull)(dh), None)
  h, pull = jax.vjp(lambda a, b, c: situ_glu(a, b, BETA, linear_beta, c, backend=backend), g, u, r)
  return (h, *jax.jit(pull)(dh))


def _oracle(g, u, dh, r, linear_beta):
  """(h, dg, du, dr) in float64 at the same (rounded) inputs."""
  with jax.enable_x64(True):
    f64 = lambda v: None if v is None else jnp.asarray(np.asarray(v, np.float64))
    g64, u64, dh64, r64 = f64(g), f64(u), f64(dh), f64(r)
    h = reference_situ_glu(g64, u64, BETA, linear_beta, r64)
    grads = situ_glu_grads(g64, u64, dh64, BETA, linear_beta, r64)
    return tuple(None if v is None else np.asarray(v) for v in (h, *grads))


def _gradient_sizes(g, u, dh, r, linear_beta):
  """The sizes the fp32 errors of dg and du scale with, in float64. Both hold 1 − tanh², which
  fp32 computes from a rounded tanh (an error of ~1e-7 of 1, not of 1 − tanh²), and dg(g)
  crosses zero where its two terms cancel: |dh·r·up|·((1 + t²)·σ + β·|t|·σ·(1 − σ)) and
  |dh·r·gate|·(1 + tanh²(u/β₂))."""
  g, u, dh = (np.asarray(v, np.float64) for v in (g, u, dh))
  t, sig = np.tanh(g / BETA), 1 / (1 + np.exp(-g))
  tu = 0.0 if linear_beta is None else np.tanh(u / linear_beta)
  up = u if linear_beta is None else linear_beta * tu
  scale = 1.0 if r is None else np.asarray(r, np.float64)[..., None]
  gate = BETA * t * sig
  return (np.abs(dh * scale * up) * ((1 + t * t) * sig + BETA * np.abs(t) * sig * (1 - sig)),
          np.abs(dh * scale * gate) * (1 + tu * tu))


def _half_ulp(v, dtype):
  mant = jnp.finfo(dtype).nmant
  return np.exp2(np.floor(np.log2(np.maximum(np.abs(v), 1e-30))) - mant - 1)


def _assert_equal_float64(got, g, u, dh, r, linear_beta):
  """h, dg and du are fp32 values rounded once to the inputs' dtype: within half an ulp of the
  float64 value plus 2e-6 of their size for the fp32 arithmetic (transcendentals of a few ulp
  each; `_gradient_sizes` for the gradients); the row-scale gradient (an fp32 sum over F) within
  1e-5 of Σ|terms|."""
  want = _oracle(g, u, dh, r, linear_beta)
  sizes = (np.abs(want[0]), *_gradient_sizes(g, u, dh, r, linear_beta))
  for name, a, w, size in zip(("h", "dg", "du"), got[:3], want[:3], sizes):
    assert a.dtype == g.dtype, name
    a = np.asarray(a, np.float64)
    bound = _half_ulp(w, g.dtype) + 2e-6 * size
    assert np.all(np.abs(a - w) <= bound), (name, float(np.max(np.abs(a - w) - bound)))
  if r is None:
    assert got[3] is None
    return
  assert got[3].dtype == F32
  with jax.enable_x64(True):
    f64 = lambda v: jnp.asarray(np.asarray(v, np.float64))
    terms = np.abs(np.asarray(dh, np.float64)) * np.abs(
        np.asarray(reference_situ_glu(f64(g), f64(u), BETA, linear_beta)))
  np.testing.assert_array_less(np.abs(np.asarray(got[3], np.float64) - want[3]),
                               1e-5 * terms.sum(-1) + 1e-30)


@pytest.mark.parametrize("backend", ["xla", "pallas_gpu"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("linear_beta", [LINEAR_BETA, None])
@pytest.mark.parametrize("scaled", [True, False])
def test_values_and_gradients_equal_float64(backend, dtype, linear_beta, scaled):
  """Both backends, both dtypes, with and without the up cap and the row scale
  (`_assert_equal_float64`)."""
  g, u, dh, r = _inputs(dtype=dtype)
  r = r if scaled else None
  with pallas_gpu.configured(rows=16, cols=32):
    got = _run(backend, g, u, dh, r, linear_beta)
  _assert_equal_float64(got, g, u, dh, r, linear_beta)


def test_kernels_at_other_blocks_and_leading_axes():
  """Other program shapes (8 rows × 64 units over F = 192: three column programs feed each
  row-scale sum) and rows from two leading axes: the same float64 agreement."""
  g, u, dh, r = _inputs(shape=(2, 24, 192), seed=3)
  with pallas_gpu.configured(rows=8, cols=64):
    got = _run("pallas_gpu", g, u, dh, r, LINEAR_BETA)
  _assert_equal_float64(got, g, u, dh, r, LINEAR_BETA)


def test_saturated_inputs_stay_bounded_and_finite():
  """|g|, |u| far past both caps: h stays within β₁·β₂ and every gradient is finite."""
  g = jnp.array([[-1e4, -50.0, 0.0, 50.0, 1e4] * 16], jnp.bfloat16)
  u = jnp.array([[1e4, -1e4, 3.0, 1e4, -60.0] * 16], jnp.bfloat16)
  dh = jnp.ones_like(g)
  with pallas_gpu.configured(rows=8, cols=16):
    h, dg, du, _ = _run("pallas_gpu", jnp.tile(g, (8, 1)), jnp.tile(u, (8, 1)),
                        jnp.tile(dh, (8, 1)), None, LINEAR_BETA)
  assert float(jnp.max(jnp.abs(h.astype(F32)))) <= BETA * LINEAR_BETA
  assert all(bool(jnp.all(jnp.isfinite(v.astype(F32)))) for v in (h, dg, du))


def test_bad_input_and_settings_raise():
  g, u, _, r = _inputs()
  with pytest.raises(ValueError, match="unknown backend"):
    situ_glu(g, u, BETA, LINEAR_BETA, backend="cuda")
  with pytest.raises(ValueError, match="one shape"):
    situ_glu(g, u[..., :32], BETA, LINEAR_BETA)
  with pytest.raises(ValueError, match="row_scale must have"):
    situ_glu(g, u, BETA, LINEAR_BETA, r[:, :3])
  with pytest.raises(ValueError, match="do not tile"):
    situ_glu(g[..., :12], u[..., :12], BETA, LINEAR_BETA, backend="pallas_gpu")
  with pytest.raises(ValueError, match="float16 or float32"):
    pallas_gpu.checked_tiles(jax.ShapeDtypeStruct((16, 32), jnp.float64))
  with pytest.raises(ValueError, match="rows must be"):
    pallas_gpu.Settings(rows=12)
  with pytest.raises(ValueError, match="num_warps"):
    pallas_gpu.Settings(num_warps=3)


def test_auto_takes_xla_off_gpu_and_kernels_where_they_tile():
  assert op.resolve_backend("auto", 131072, 768, jnp.bfloat16) == (
      "pallas_gpu" if jax.default_backend() == "gpu" else "xla")
  assert pallas_gpu.tiles(131072, 768) == (64, 256)
  assert pallas_gpu.tiles(16384, 2048) == (64, 256)
  assert pallas_gpu.tiles(100, 24) is None          # 24 units: no power-of-two block of 16
  assert not pallas_gpu.supports(128, 256, jnp.float64)


@pytest.mark.parametrize("backend", ["xla", "pallas_gpu"])
@pytest.mark.parametrize("scaled", [True, False])
def test_value_and_grads_equal_forward_and_vjp(backend, scaled):
  """value_and_grads (one pass: h beside the gradients) gives the forward's h and the VJP's
  gradients of the same backend: the same fp32 terms, rounded once each (within one rounding
  plus the fp32 error bound of `_assert_equal_float64`: another compiled program may contract
  the fp32 terms differently)."""
  g, u, dh, r = _inputs(seed=5)
  r = r if scaled else None
  with pallas_gpu.configured(rows=16, cols=32):
    h, dg, du, dr = op.value_and_grads(g, u, dh, BETA, LINEAR_BETA, r, backend=backend)
    want = _run(backend, g, u, dh, r, LINEAR_BETA)
  sizes = (np.abs(np.asarray(want[0], np.float64)), *_gradient_sizes(g, u, dh, r, LINEAR_BETA))
  for a, b, size in zip((h, dg, du), want[:3], sizes):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.abs(a - b) <= 2 * _half_ulp(b, g.dtype) + 4e-6 * size)
  if scaled:
    np.testing.assert_allclose(np.asarray(dr), np.asarray(want[3]), rtol=1e-6, atol=1e-6)
  else:
    assert dr is None
  with pytest.raises(ValueError, match="dh must have"):
    op.value_and_grads(g, u, dh[..., :32], BETA, LINEAR_BETA, backend=backend)
