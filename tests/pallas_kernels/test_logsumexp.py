"""pallas_kernels.logsumexp: the one-pass Pallas-GPU kernel (interpret mode on CPU) and the XLA path
against the float64 oracle; −inf, +inf and out-of-range targets; the fused head loss with the
kernel against the XLA path; backend choice and bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3train import config as config_lib
from tests.configs import k3_tiny
from k3train.train.head_loss import chunked_token_stats, fused_head_cross_entropy
from pallas_kernels import logsumexp
from pallas_kernels.logsumexp import pallas_gpu, reference

BACKENDS = ("xla", "pallas_gpu")


def _case(rng, lead, v, scale):
  x = (rng.standard_normal((*lead, v)) * scale).astype(np.float32)
  t = rng.integers(0, v, lead).astype(np.int32)
  return x, t


def _check(got, want, tol):
  """lse and picked within tol of the float64 oracle, relative to max(1, |value|); ±inf equal."""
  for g, w in zip(got, want):
    g = np.asarray(g, np.float64)
    assert g.shape == w.shape
    np.testing.assert_allclose(g, w, rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lead,v,scale,settings", [
    ((2, 8), 1024, 7.0, dict(rows=4, block_v=256)),      # 4 column blocks, 2 rows per program
    ((6,), 640, 30.0, dict(rows=2, block_v=128)),         # V = 5 · 128: a non-power-of-two row
    ((3, 5), 384, 0.01, dict(rows=1, block_v=2048)),      # block_v capped by V's divisor (128)
])
def test_matches_the_float64_oracle(backend, lead, v, scale, settings):
  rng = np.random.default_rng(v + len(lead))
  x, t = _case(rng, lead, v, scale)
  x.reshape(-1, v)[0, v - 1] = 90.0                        # the maximum in the last block
  with pallas_gpu.configured(**settings):
    got = logsumexp.logsumexp_and_pick(jnp.asarray(x), jnp.asarray(t), backend=backend)
  # fp32 sums of V terms: a few ulps of lse's magnitude.
  _check(got, reference.logsumexp_and_pick(x, t), 2e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_infinities_and_targets_outside_the_vocabulary(backend):
  v = 256
  x = np.zeros((4, v), np.float32)
  x[0, :] = -np.inf                                  # a row of −inf: lse = −inf
  x[1, :200] = -np.inf                               # −inf in the first block only
  x[1, 230] = 3.0
  x[2, 17] = np.inf                                  # a +inf logit: lse = +inf
  x[3] = np.linspace(-5, 5, v)
  t = np.array([3, 230, 17, 999], np.int32)          # row 3: a target past V picks 0
  with pallas_gpu.configured(rows=2, block_v=128):
    lse, picked = logsumexp.logsumexp_and_pick(jnp.asarray(x), jnp.asarray(t), backend=backend)
  want_lse, want_picked = reference.logsumexp_and_pick(x, t)
  assert np.asarray(lse)[0] == -np.inf and np.asarray(lse)[2] == np.inf
  np.testing.assert_allclose(np.asarray(lse, np.float64), want_lse, rtol=2e-6)
  np.testing.assert_array_equal(np.asarray(picked, np.float64), want_picked)
  assert np.asarray(picked)[3] == 0.0


def test_fused_head_loss_with_the_kernel_equals_the_xla_path():
  rng = np.random.default_rng(3)
  b, t, d, v = 2, 16, 8, 384
  x = jnp.asarray(rng.standard_normal((b, t, d)), jnp.float32)
  w = jnp.asarray(0.7 * rng.standard_normal((d, v)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
  mask = jnp.asarray(rng.uniform(size=(b, t)) > 0.25, jnp.float32)

  def value_and_grads(backend):
    def loss(x, w):
      return fused_head_cross_entropy(x, w, targets, mask, chunk_tokens=4, dtype=jnp.float32,
                                      lse_backend=backend)[0]
    with pallas_gpu.configured(rows=4, block_v=128):
      return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)

  (l_x, (dx_x, dw_x)), (l_k, (dx_k, dw_k)) = value_and_grads("xla"), value_and_grads("pallas_gpu")
  np.testing.assert_allclose(float(l_k), float(l_x), rtol=1e-6)
  # The gradients read the log-normaliser through exp(logit − lse): equal to fp32 rounding.
  np.testing.assert_allclose(np.asarray(dx_k), np.asarray(dx_x), rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(np.asarray(dw_k), np.asarray(dw_x), rtol=1e-5, atol=1e-7)
  with pallas_gpu.configured(rows=4, block_v=128):
    nll_k, arg_k = chunked_token_stats(x, w, targets, chunk_tokens=8, dtype=jnp.float32,
                                       lse_backend="pallas_gpu")
  nll_x, arg_x = chunked_token_stats(x, w, targets, chunk_tokens=8, dtype=jnp.float32)
  np.testing.assert_allclose(np.asarray(nll_k), np.asarray(nll_x), rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(arg_k), np.asarray(arg_x))


def test_backend_choice_and_bad_input():
  assert logsumexp.resolve_backend("xla") == "xla"
  one_gpu = jax.default_backend() == "gpu" and jax.device_count() == 1
  assert logsumexp.resolve_backend("auto", 8, 1024) == ("pallas_gpu" if one_gpu else "xla")
  assert not pallas_gpu.supports(8, 1000, jnp.float32)          # 1000 = 8 · 125: no 128-block
  assert pallas_gpu.supports(8, 163_840, jnp.float32)
  with pytest.raises(ValueError, match="unknown backend 'triton'"):
    logsumexp.resolve_backend("triton")
  with pytest.raises(ValueError, match="share their leading shape"):
    logsumexp.logsumexp_and_pick(jnp.zeros((2, 3, 128)), jnp.zeros((3,), jnp.int32))
  with pytest.raises(ValueError, match="integer targets"):
    logsumexp.logsumexp_and_pick(jnp.zeros((2, 128)), jnp.zeros((2,), jnp.float32))
  with pytest.raises(ValueError, match="V a multiple of 128"):
    pallas_gpu.logsumexp_and_pick(jnp.zeros((2, 1000)), jnp.zeros((2,), jnp.int32))
  with pytest.raises(ValueError, match="block_v must be a power of two >= 128"):
    pallas_gpu.Settings(block_v=64)
  with pytest.raises(ValueError, match="unknown backend 'nope'"):
    fused_head_cross_entropy(jnp.zeros((1, 4, 2)), jnp.zeros((2, 128)),
                             jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 4)), chunk_tokens=2,
                             dtype=jnp.float32, lse_backend="nope")
  cfg = k3_tiny.get_config()
  cfg.model.head_lse_backend = "nope"
  with pytest.raises(config_lib.ConfigError, match="model.head_lse_backend"):
    config_lib.validate(cfg)
