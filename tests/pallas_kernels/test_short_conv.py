"""pallas_kernels.short_conv: both backends against the float64 oracle, forward and gradients.

The Pallas-GPU kernels run in interpret mode on CPU, with small blocks so that programs cross
sequence and document boundaries and taps reach into the previous program's tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.short_conv import causal_conv, op, pallas_gpu, reference_causal_conv

F32 = jnp.float32


def _inputs(b=2, t=40, channels=(2, 16), width=4, dtype=jnp.bfloat16, seed=0):
  kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(kx, (b, t) + channels, F32).astype(dtype)
  w = jax.random.uniform(kw, (width,) + channels, F32, -0.5, 0.5)
  dy = jax.random.normal(kd, x.shape, F32).astype(dtype)
  # Row 0: documents starting at 0, 13 and 14 (a one-token document); row 1: one document.
  seg = jnp.stack([jnp.where(jnp.arange(t) < 13, 0, jnp.where(jnp.arange(t) < 14, 1, 2)),
                   jnp.zeros((t,), jnp.int32)] + [jnp.zeros((t,), jnp.int32)] * (b - 2))
  return x, w, dy, seg.astype(jnp.int32)


def _oracle(x, w, dy, seg):
  """(y, dx, dw) in float64 at the same inputs."""
  with jax.enable_x64(True):
    f = lambda a, b: reference_causal_conv(a, b, seg)
    y, pull = jax.vjp(f, jnp.asarray(np.asarray(x, np.float64)), jnp.asarray(np.asarray(w, np.float64)))
    dx, dw = pull(jnp.asarray(np.asarray(dy, np.float64)))
    return np.asarray(y), np.asarray(dx), np.asarray(dw)


def _run(backend, x, w, dy, seg):
  y, pull = jax.vjp(lambda a, b: causal_conv(a, b, seg, backend=backend), x, w)
  dx, dw = jax.jit(pull)(dy)
  return y, dx, dw


def _half_ulp(v, dtype):
  mant = jnp.finfo(dtype).nmant
  return np.exp2(np.floor(np.log2(np.maximum(np.abs(v), 1e-30))) - mant - 1)


def _abs_sums(x, w, dy, seg):
  """Σ|terms| of y and dx (the same conv of |x| with |w|, and of |dy| backwards) and dw."""
  ax, aw, ady = (np.abs(np.asarray(v, np.float64)) for v in (x, w, dy))
  with jax.enable_x64(True):
    y_abs = np.asarray(reference_causal_conv(jnp.asarray(ax), jnp.asarray(aw), seg))
    _, pull = jax.vjp(lambda a, b: reference_causal_conv(a, b, seg), jnp.asarray(ax), jnp.asarray(aw))
    dx_abs, dw_abs = (np.asarray(v) for v in pull(jnp.asarray(ady)))
  return y_abs, dx_abs, dw_abs


@pytest.mark.parametrize("backend,forward", [("xla", "xla"), ("pallas_gpu", "xla"),
                                             ("pallas_gpu", "kernel")])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_conv_and_gradients_equal_float64(backend, forward, dtype):
  """y and dx are the fp32 sums rounded once to x's dtype: within half an ulp of the float64
  value, plus 1e-6 of Σ|terms| for the fp32 sum itself; dw (fp32, a sum over all B·T tokens)
  within 1e-5 of Σ|terms|."""
  x, w, dy, seg = _inputs(dtype=dtype)
  with pallas_gpu.configured(rows=16, cols=16, forward=forward):
    y, dx, dw = _run(backend, x, w, dy, seg)
  assert y.dtype == dtype and dx.dtype == dtype and dw.dtype == F32
  want_y, want_dx, want_dw = _oracle(x, w, dy, seg)
  abs_y, abs_dx, abs_dw = _abs_sums(x, w, dy, seg)
  for got, want, scale in ((y, want_y, abs_y), (dx, want_dx, abs_dx)):
    err = np.abs(np.asarray(got, np.float64) - want)
    assert np.all(err <= _half_ulp(want, dtype) + 1e-6 * scale)
  assert np.all(np.abs(np.asarray(dw, np.float64) - want_dw) <= 1e-5 * abs_dw)


def test_kernels_equal_xla_without_segments_and_with_blocks_across_rows():
  """No segment ids, T not a multiple of the program's rows (programs span two sequences), a
  single tap, and channels as one axis: the kernels give the xla backend's values (fp32 sums of
  the same terms: within one rounding)."""
  for width, channels, t in ((4, (32,), 24), (1, (16,), 8), (3, (2, 16), 12)):
    x, w, dy, _ = _inputs(b=2, t=t, channels=channels, width=width, seed=width)
    with pallas_gpu.configured(rows=16, cols=16, forward="kernel"):
      got = _run("pallas_gpu", x, w, dy, None)
    want = _run("xla", x, w, dy, None)
    for g, h in zip(got, want):
      g, h = np.asarray(g, np.float64), np.asarray(h, np.float64)
      assert np.all(np.abs(g - h) <= 2 * _half_ulp(h, x.dtype) + 1e-6), (width, channels, t)


def test_kernel_backend_with_explicit_settings_equals_xla():
  """op.pallas_gpu_conv(settings) (what the benchmark times per launch setting) with either
  forward gives the xla backend's values and gradients (fp32 sums of the same terms in another
  order: within 1e-6 of each array's largest entry), whatever the module's SETTINGS are."""
  x, w, dy, seg = _inputs(dtype=F32)
  want = _run("xla", x, w, dy, seg)
  for forward in ("xla", "kernel"):
    conv = op.pallas_gpu_conv(pallas_gpu.Settings(rows=16, cols=16, forward=forward))
    y, pull = jax.vjp(lambda a, b: conv(a, b, seg, True), x, w)
    for g, h in zip((y, *pull(dy)), want):
      h = np.asarray(h)
      np.testing.assert_allclose(np.asarray(g), h, rtol=0, atol=1e-6 * np.abs(h).max())


def test_first_tokens_see_no_earlier_row():
  """A row's first W−1 tokens read nothing from the row before it in the flattened token axis."""
  x = jnp.ones((2, 8, 16), F32)
  w = jnp.ones((4, 16), F32)
  with pallas_gpu.configured(rows=8, cols=16, forward="kernel"):
    y = causal_conv(x, w, None, backend="pallas_gpu")
  np.testing.assert_array_equal(np.asarray(y[:, :4, 0]), [[1, 2, 3, 4]] * 2)


def test_bad_input_and_settings_raise():
  x, w, _, seg = _inputs()
  with pytest.raises(ValueError, match="unknown backend"):
    causal_conv(x, w, seg, backend="cuda")
  with pytest.raises(ValueError, match="w must be"):
    causal_conv(x, w[:, :1], seg)
  with pytest.raises(ValueError, match="segment_ids must be"):
    causal_conv(x, w, seg[:, :5])
  with pytest.raises(ValueError, match="do not tile"):
    causal_conv(x[:, :, :, :3], w[:, :, :3], seg, backend="pallas_gpu")
  with pytest.raises(ValueError, match="rows must be"):
    pallas_gpu.Settings(rows=12)
  with pytest.raises(ValueError, match="forward must be"):
    pallas_gpu.Settings(forward="triton")


def test_auto_takes_xla_off_gpu_and_kernels_where_they_tile():
  assert op.resolve_backend("auto", 80, 32) == ("pallas_gpu" if jax.default_backend() == "gpu"
                                                else "xla")
  assert pallas_gpu.tiles(16384, 2048) == (64, 128)
  assert pallas_gpu.tiles(80, 24) is None          # 24 channels: no power-of-two block of 16
