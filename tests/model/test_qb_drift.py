"""Quantile Balancing's router-drift correction (`moe.mean_score_sensitivity`, `qb_bias_update`
with the parameters from before and after the step) and the router learning-rate factor."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from k3train.model import moe
from k3train.optim.optimizer import scale_router_updates


def test_sensitivity_predicts_the_change_of_each_experts_mean_score():
  k = jax.random.split(jax.random.key(1), 3)
  x_td = jax.random.normal(k[0], (512, 32), jnp.float32)
  w_de = 0.2 * jax.random.normal(k[1], (32, 8), jnp.float32)
  dw_de = 1e-3 * jax.random.normal(k[2], (32, 8), jnp.float32)
  real_t = jnp.arange(512) < 400                               # the last 112 tokens are padding

  def mean_scores(w):
    s = jax.nn.sigmoid(x_td @ w)
    return jnp.sum(s * real_t[:, None], axis=0) / jnp.sum(real_t)

  g_de = moe.mean_score_sensitivity(x_td, jax.nn.sigmoid(x_td @ w_de), real_t)
  predicted = jnp.sum(g_de * dw_de, axis=0)
  actual = mean_scores(w_de + dw_de) - mean_scores(w_de)
  # First order in ΔW: the error is second order, ~1e-3 of the change itself here.
  np.testing.assert_allclose(predicted, actual, rtol=2e-2, atol=1e-7)
  assert float(jnp.max(jnp.abs(actual))) > 1e-4                 # the check is not vacuous


class _Layer(nnx.Module):
  def __init__(self):
    self.router = moe.Router(4, 3, 1, rngs=nnx.Rngs(params=0))
    self.qb_pending = moe.QBPending(jnp.array([0.3, -0.1, -0.2]))
    self.qb_drift = moe.QBSensitivity(jnp.arange(12, dtype=jnp.float32).reshape(4, 3) / 10)


def test_bias_update_moves_the_proposal_with_the_router():
  layer = _Layer()
  _, params, rest = nnx.split(layer, nnx.Param, ...)
  after = jax.tree.map(lambda p: p + 0.01, params)
  new = moe.qb_bias_update(rest, params, after)
  shift = np.sum(np.arange(12).reshape(4, 3) / 10 * 0.01, axis=0)
  expected = np.array([0.3, -0.1, -0.2]) - (shift - shift.mean())
  np.testing.assert_allclose(new["router"]["bias"][...], expected, rtol=1e-6)
  # Without the parameters the proposal is copied as is.
  np.testing.assert_allclose(moe.qb_bias_update(rest)["router"]["bias"][...], [0.3, -0.1, -0.2])


def test_router_learning_rate_factor_scales_only_the_router_update():
  params = {"layer": {"router": {"weight": jnp.ones((4, 3))}, "up": {"kernel": jnp.ones((4, 3))}}}
  opt = optax.chain(optax.sgd(1.0), scale_router_updates(0.1))
  updates, _ = opt.update(jax.tree.map(jnp.ones_like, params), opt.init(params), params)
  np.testing.assert_allclose(updates["layer"]["router"]["weight"], -0.1)
  np.testing.assert_allclose(updates["layer"]["up"]["kernel"], -1.0)
