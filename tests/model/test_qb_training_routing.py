"""Quantile Balancing under a moving router: the training routing of `moe.qb_training_routing`
(model.moe.qb_mean_correction, model.moe.qb_rounds) and the router learning-rate factor."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from k3train.model import moe
from k3train.optim.optimizer import scale_router_updates

E, K, D = 8, 2, 16


def _layer(correction: bool, rounds: int = 0) -> moe.StableLatentMoE:
  c = ml_collections.ConfigDict(dict(
      num_experts=E, top_k=K, latent_dim=8, expert_hidden=8, num_shared_experts=0, shared_hidden=8,
      routed_scaling_factor=1.0, renormalize=True, latent_norm=True, quantile_balancing=True,
      qb_mean_correction=correction, qb_rounds=rounds, backend="ragged_dot"))
  return moe.StableLatentMoE(c, d_model=D, init_std=0.5, norm_eps=1e-6, situ_beta=4.0,
                             situ_linear_beta=25.0, rngs=nnx.Rngs(params=0))


def _max_load(layer) -> float:
  load = np.asarray(layer.expert_load[...])
  return float(load.max() / load.mean())


def _batch(key, offset_d):
  """Tokens that share a large common component (as in a young model's deep layers) plus a
  small token-specific part; `offset_d` moves the common component between batches."""
  return offset_d + 0.05 * jax.random.normal(key, (4, 64, D))


def test_routing_uses_the_corrected_bias_only_inside_the_training_block():
  layer = _layer(True)
  x = _batch(jax.random.key(0), jnp.ones((D,)))
  layer.router.bias.set_value(jnp.linspace(-0.1, 0.1, E))
  layer.qb_mean_score.set_value(jnp.full((E,), 0.5))
  stored = np.asarray(layer.router.bias[...])
  layer(x)                                                   # outside: the stored bias, no record
  np.testing.assert_array_equal(layer.router.bias[...], stored)
  np.testing.assert_array_equal(layer.qb_mean_score[...], 0.5)
  with moe.qb_training_routing():
    layer(x)
  scores = jax.nn.sigmoid(x.reshape(-1, D) @ layer.router.weight[...])
  mean = np.asarray(jnp.mean(scores, axis=0))
  shift = mean - 0.5
  np.testing.assert_allclose(layer.router.bias[...], stored - (shift - shift.mean()), rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(layer.qb_mean_score[...], mean, rtol=1e-6)


def test_mean_correction_keeps_the_load_balanced_when_the_common_component_moves():
  """QB's proposal from one batch, then a batch whose common component moved: the plain proposal
  puts (almost) every token on the same experts; the corrected one stays near balance."""
  results = {}
  for correction in (False, True):
    layer = _layer(correction)
    keys = jax.random.split(jax.random.key(3), 8)
    loads = []
    with moe.qb_training_routing():
      for i in range(8):
        common = jnp.cos(jnp.arange(D) * (1.0 + 0.3 * i))     # moves from batch to batch
        layer(_batch(keys[i], common))
        loads.append(_max_load(layer))
        moe.apply_quantile_balancing(layer)
    results[correction] = max(loads[3:])
  assert results[False] > 2.5, results                       # the collapse the correction fixes
  assert results[True] < 2.0, results                        # 256 tokens: some sampling noise


def test_rounds_route_with_qb_applied_to_the_batch_itself():
  """qb_rounds=2: the bias the batch routes with is two QB rounds on its own scores from the
  stored bias (inside the training block only); the next proposal is one more round."""
  layer = _layer(False, rounds=2)
  x = _batch(jax.random.key(1), jnp.sin(jnp.arange(D)))
  stale = jnp.linspace(-0.2, 0.2, E)
  layer.router.bias.set_value(stale)
  layer(x)                                                   # outside: the stored bias
  np.testing.assert_array_equal(layer.router.bias[...], stale)
  with moe.qb_training_routing():
    layer(x)
  scores = jax.nn.sigmoid(x.reshape(-1, D) @ layer.router.weight[...])
  real = jnp.ones((scores.shape[0],), bool)
  b1 = moe.quantile_balancing_bias(scores, stale, real, K)
  b2 = moe.quantile_balancing_bias(scores, b1, real, K)
  np.testing.assert_allclose(layer.router.bias[...], b2, atol=2e-6)
  np.testing.assert_allclose(layer.qb_pending[...], moe.quantile_balancing_bias(scores, b2, real, K),
                             atol=2e-6)


def test_rounds_balance_a_batch_that_a_stale_bias_collapses():
  """A stored bias far from this batch's balance point: routed as stored, the tokens pile onto
  few experts; two QB rounds on the batch's own scores bring the load near balance."""
  loads = {}
  for rounds in (0, 2):
    layer = _layer(False, rounds=rounds)
    layer.router.bias.set_value(jnp.linspace(-0.3, 0.3, E))
    with moe.qb_training_routing():
      layer(_batch(jax.random.key(5), jnp.cos(jnp.arange(D) * 0.7)))
    loads[rounds] = _max_load(layer)
  assert loads[0] > 2.5, loads
  assert loads[2] < 1.5, loads


def test_router_learning_rate_factor_scales_only_the_router_update():
  params = {"layer": {"router": {"weight": jnp.ones((4, 3))}, "up": {"kernel": jnp.ones((4, 3))}}}
  opt = optax.chain(optax.sgd(1.0), scale_router_updates(0.1))
  updates, _ = opt.update(jax.tree.map(jnp.ones_like, params), opt.init(params), params)
  np.testing.assert_allclose(updates["layer"]["router"]["weight"], -0.1)
  np.testing.assert_allclose(updates["layer"]["up"]["kernel"], -1.0)
