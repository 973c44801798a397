"""Stable LatentMoE, router and Quantile Balancing: the invariants of docs/maths.md §5.6."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from k3train.model import moe as moe_lib
from tests.jaxprs import primitive_counts
from k3train.model.layers import situ_glu as _situ_glu

D_MODEL = 16


def rngs(seed: int) -> nnx.Rngs:
  # rbg keys: their random-normal init compiles several times faster than threefry on CPU.
  return nnx.Rngs(jax.random.key(seed, impl="rbg"))


def normal(shape, seed, scale=1.0):
  """Test inputs from numpy (no XLA compile per shape)."""
  return jnp.asarray(scale * np.random.default_rng(seed).standard_normal(shape), jnp.float32)


# Jitted entry points shared by the tests: modules of one structure reuse one compilation.
_forward = nnx.jit(lambda m, x, mask: m(x, mask))
_dense = nnx.jit(moe_lib.moe_dense_reference)
_router = nnx.jit(lambda m, x: m.router(x))
_route = jax.jit(moe_lib.route, static_argnums=(2,),
                 static_argnames=("renormalize", "routed_scaling_factor"))
_qb = jax.jit(moe_lib.quantile_balancing_bias, static_argnums=(3,))
situ_glu = jax.jit(_situ_glu, static_argnums=(2, 3))


def moe_config(**overrides) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict(dict(
      num_experts=8, top_k=3, latent_dim=8, expert_hidden=12, num_shared_experts=1,
      shared_hidden=8, routed_scaling_factor=1.0, renormalize=True, latent_norm=True,
      quantile_balancing=True, backend="ragged_dot"))
  c.update(overrides)
  return c


def make_moe(d_model=D_MODEL, seed=0, init_std=0.3, **overrides) -> moe_lib.StableLatentMoE:
  # A large init_std gives O(1) router logits, so routing is far from ties and non-trivial.
  # Tests share parameter shapes where they can: each new shape costs an init compile.
  return moe_lib.StableLatentMoE(moe_config(**overrides), d_model=d_model, init_std=init_std,
                                 norm_eps=1e-5, situ_beta=4.0, situ_linear_beta=25.0,
                                 rngs=rngs(seed))


def tokens(b=2, t=16, d=D_MODEL, seed=1):
  return normal((b, t, d), seed)


def all_real(x_btd):
  return jnp.ones(x_btd.shape[:2], bool)


def _by_expert(weights_tk, idx_tk):
  """Sort each token's (idx, weight) pairs by expert id, to compare selections as sets."""
  order = jnp.argsort(idx_tk, axis=-1)
  return jnp.take_along_axis(idx_tk, order, -1), jnp.take_along_axis(weights_tk, order, -1)


# ----------------------------------------------------------------------------- §5.6.1 router


@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_router_weights_sum_to_scaling_factor(scale):
  scores = jax.nn.sigmoid(normal((32, 8), 0))
  bias = normal((8,), 1, 0.1)
  w, idx = _route(scores, bias, 3, renormalize=True, routed_scaling_factor=scale)
  assert w.dtype == jnp.float32 and idx.dtype == jnp.int32 and w.shape == idx.shape == (32, 3)
  np.testing.assert_allclose(jnp.sum(w, -1), scale, rtol=1e-6)
  # Without renormalisation the weights are the raw sigmoid scores times the scale.
  w_raw, idx_raw = _route(scores, bias, 3, renormalize=False, routed_scaling_factor=scale)
  np.testing.assert_allclose(w_raw, scale * jnp.take_along_axis(scores, idx_raw, -1), rtol=1e-6)


def test_router_weights_independent_of_bias_given_selection():
  scores = jax.nn.sigmoid(normal((16, 8), 2))
  w0, idx0 = _route(scores, jnp.zeros(8), 3, renormalize=True, routed_scaling_factor=1.0)
  for t in range(4):
    # A bias that pushes token t's own selected experts up and the others down keeps its set.
    chosen = jnp.zeros(8, bool).at[idx0[t]].set(True)
    bias = jnp.where(chosen, 0.3, -0.3) + 0.05 * jnp.arange(8)
    w1, idx1 = _route(scores[t:t + 1], bias, 3, renormalize=True,
                             routed_scaling_factor=1.0)
    i0, v0 = _by_expert(w0[t:t + 1], idx0[t:t + 1])
    i1, v1 = _by_expert(w1, idx1)
    np.testing.assert_array_equal(i0, i1)
    np.testing.assert_array_equal(v0, v1)


def test_router_constant_bias_shift_changes_nothing():
  moe = make_moe()
  x_td = tokens().reshape(-1, D_MODEL)
  moe.router.bias.set_value(normal((8,), 3, 0.05))
  w0, idx0, s0 = _router(moe, x_td)
  moe.router.bias.set_value(moe.router.bias.get_value() + 0.5)
  w1, idx1, s1 = _router(moe, x_td)
  np.testing.assert_array_equal(s0, s1)
  i0, v0 = _by_expert(w0, idx0)
  i1, v1 = _by_expert(w1, idx1)
  np.testing.assert_array_equal(i0, i1)
  np.testing.assert_array_equal(v0, v1)


def test_router_bad_top_k():
  with pytest.raises(ValueError):
    moe_lib.Router(4, 8, 9, rngs=rngs(0))


# ----------------------------------------------------------------------------- §5.6.2 SiTU-GLU


def test_situ_glu_bounded_and_finite_for_huge_inputs():
  """|h| < β1·β2 = 100 holds exactly; in fp32 tanh and σ round to 1.0 for huge inputs, so the
  bound is reached (never exceeded) there: ≤ 100 for ±1e6, strictly < 100 for moderate inputs."""
  vals = jnp.array([-1e6, -1e3, -30.0, -1.0, 0.0, 1.0, 30.0, 1e3, 1e6], jnp.float32)
  g, u = jnp.meshgrid(vals, vals)
  h = situ_glu(g, u, 4.0, 25.0)
  assert h.dtype == jnp.float32
  assert bool(jnp.all(jnp.isfinite(h)))
  assert float(jnp.max(jnp.abs(h))) <= 100.0
  moderate = jnp.linspace(-8.0, 8.0, 33)
  g, u = jnp.meshgrid(moderate, moderate)
  assert float(jnp.max(jnp.abs(situ_glu(g, u, 4.0, 25.0)))) < 100.0


def test_situ_glu_matches_swiglu_near_zero():
  g, u = jnp.meshgrid(jnp.linspace(-0.5, 0.5, 41), jnp.linspace(-0.5, 0.5, 41))
  swiglu = jax.nn.silu(g) * u
  assert float(jnp.max(jnp.abs(situ_glu(g, u, 4.0, 25.0) - swiglu))) < 1e-3


def test_situ_glu_gradient_finite_everywhere():
  vals = jnp.array([-1e6, -50.0, -1.0, 0.0, 1e-3, 2.0, 50.0, 1e6], jnp.float32)
  g, u = jnp.meshgrid(vals, vals)
  dg, du = jax.grad(lambda a, b: jnp.sum(situ_glu(a, b, 4.0, 25.0)), argnums=(0, 1))(g, u)
  assert bool(jnp.all(jnp.isfinite(dg))) and bool(jnp.all(jnp.isfinite(du)))


@pytest.mark.parametrize("linear_beta", [25.0, None])
def test_situ_glu_gradient_equals_float64(linear_beta):
  """The gradient of situ_glu against autodiff of the formula in float64 at the same (rounded)
  inputs, over |g|, |u| up to ~60 and near 0. fp32 inputs: within 1e-6 of the largest gradient. bf16 inputs
  (bf16 gradients): within one bf16 rounding of each element (2⁻⁸ relative) + 1e-5 of the
  largest (∂SiTU/∂g crosses zero at one negative g, where no relative bound can hold)."""
  def formula(a, b):
    up = b if linear_beta is None else linear_beta * jnp.tanh(b / linear_beta)
    return 4.0 * jnp.tanh(a / 4.0) * jax.nn.sigmoid(a) * up
  g = jnp.concatenate([normal((64, 48), 21, scale=15.0), normal((8, 48), 24, scale=1e-3)])
  u = jnp.concatenate([normal((64, 48), 22, scale=20.0), normal((8, 48), 25, scale=1e-3)])
  for dtype in (jnp.float32, jnp.bfloat16):
    a, b = g.astype(dtype), u.astype(dtype)
    with jax.enable_x64(True):
      want = jax.grad(lambda x, y: jnp.sum(formula(x, y)), argnums=(0, 1))(
          a.astype(jnp.float64), b.astype(jnp.float64))
      want = [np.asarray(w) for w in want]
    got = jax.jit(jax.grad(lambda x, y: jnp.sum(situ_glu(x, y, 4.0, linear_beta).astype(jnp.float32)),
                           argnums=(0, 1)))(a, b)
    for d_got, d_want in zip(got, want):
      assert d_got.dtype == dtype
      top = np.abs(d_want).max()
      bound = 1e-6 * top if dtype == jnp.float32 else 2.0 ** -8 * np.abs(d_want) + 1e-5 * top
      assert np.all(np.abs(np.asarray(d_got, np.float64) - d_want) <= bound)


@pytest.mark.parametrize("linear_beta", [25.0, None])
def test_situ_glu_row_scale_gradients_equal_float64(linear_beta):
  """With a per-row scale (the routed experts' routing weight): the gradients in g, u and the
  scale against autodiff of the formula in float64 at the same inputs. fp32 inputs: within 1e-6
  of the largest gradient; bf16 g and u (fp32 scale): one bf16 rounding of each g, u element and
  2⁻¹⁶ relative for the scale's (an fp32 sum over the row of fp32 products)."""
  def formula(a, b, r):
    up = b if linear_beta is None else linear_beta * jnp.tanh(b / linear_beta)
    return 4.0 * jnp.tanh(a / 4.0) * jax.nn.sigmoid(a) * up * r[:, None]
  g = normal((40, 24), 31, scale=10.0)
  u = normal((40, 24), 32, scale=12.0)
  r = jax.nn.sigmoid(normal((40,), 33, scale=2.0))
  cot = normal((40, 24), 34)
  for dtype in (jnp.float32, jnp.bfloat16):
    a, b = g.astype(dtype), u.astype(dtype)
    c = cot.astype(dtype)
    with jax.enable_x64(True):
      _, pull = jax.vjp(formula, a.astype(jnp.float64), b.astype(jnp.float64),
                        r.astype(jnp.float64))
      want = [np.asarray(w) for w in pull(c.astype(jnp.float64))]
    _, pull = jax.vjp(lambda x, y, z: situ_glu(x, y, 4.0, linear_beta, z), a, b, r)
    got = jax.jit(pull)(c)
    for i, (d_got, d_want) in enumerate(zip(got, want)):
      assert d_got.dtype == (jnp.float32 if i == 2 else dtype)
      top = np.abs(d_want).max()
      if dtype == jnp.float32:
        bound = 1e-6 * top
      elif i == 2:
        bound = 2.0 ** -16 * np.abs(d_want) + 1e-6 * top
      else:
        bound = 2.0 ** -8 * np.abs(d_want) + 1e-5 * top
      assert np.all(np.abs(np.asarray(d_got, np.float64) - d_want) <= bound), i


# ----------------------------------------------------------------------------- §5.6.3-4 layer


def _plain_moe(moe, x_btd):
  """An ordinary (non-latent) MoE written independently: y = Σ_{i∈idx} w_i E_i(x), experts on x."""
  x_nd = x_btd.reshape(-1, x_btd.shape[-1])
  w_nk, idx_nk, _ = moe.router(x_nd)
  gate = moe.experts.gate.get_value()[idx_nk]     # [N, k, d, F]
  up = moe.experts.up.get_value()[idx_nk]
  down = moe.experts.down.get_value()[idx_nk]     # [N, k, F, d]
  hp = jax.lax.Precision.HIGHEST
  h = situ_glu(jnp.einsum("nd,nkdf->nkf", x_nd, gate, precision=hp),
               jnp.einsum("nd,nkdf->nkf", x_nd, up, precision=hp), 4.0, 25.0)
  y_nkd = jnp.einsum("nkf,nkfd->nkd", h, down, precision=hp)
  return jnp.einsum("nk,nkd->nd", w_nk, y_nkd, precision=hp).reshape(x_btd.shape)


def test_latent_identity_projections_reduce_to_plain_moe():
  d = 8
  moe = make_moe(d_model=d, latent_dim=d, latent_norm=False, num_shared_experts=0)
  assert moe.latent_norm is None and moe.shared is None
  moe.down_proj.kernel.set_value(jnp.eye(d))
  moe.up_proj.kernel.set_value(jnp.eye(d))
  x = tokens(d=d)
  np.testing.assert_allclose(_forward(moe, x, all_real(x)), nnx.jit(_plain_moe)(moe, x),
                             atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["ragged_dot", "reference"])
def test_sorted_dispatch_matches_dense_reference(backend):
  moe = make_moe(backend=backend)
  moe.router.bias.set_value(normal((8,), 4, 0.1))
  x = tokens()
  y = _forward(moe, x, all_real(x))
  assert y.shape == x.shape and y.dtype == jnp.float32
  np.testing.assert_allclose(y, _dense(moe, x), atol=1e-5, rtol=1e-5)


def test_forward_and_grad_bf16():
  """bf16 activations (fp32 params): close to the fp32 layer with the same parameters, finite
  gradients through the bf16 grouped matmuls."""
  moe = moe_lib.StableLatentMoE(
      moe_config(), d_model=D_MODEL, init_std=0.3, norm_eps=1e-5, situ_beta=4.0,
      situ_linear_beta=25.0, dtype=jnp.bfloat16, rngs=rngs(0))
  x = tokens()
  loss = lambda m: jnp.sum(m(x.astype(jnp.bfloat16)).astype(jnp.float32) ** 2)
  value, grads = nnx.jit(nnx.value_and_grad(loss))(moe)
  y32 = _forward(make_moe(seed=0), x, all_real(x))        # same parameters, fp32 activations
  np.testing.assert_allclose(float(value), float(jnp.sum(y32 ** 2)), rtol=5e-2)
  leaves = jax.tree.leaves(grads)
  assert leaves and all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)


def test_routing_weight_rides_in_the_expert_so_selective_remat_reruns_no_gmm():
  """Rows carry their routing weight into the expert (scaled before the down GEMM), so the
  combine's backward needs no expert outputs: under the selective policy the gradient runs
  exactly the grouped matmuls of the gradient without remat (3 forward, 6 backward), none twice.
  The layer equals the dense reference, which weights after the experts, and so do the weight
  gradients of the router and experts (fp32)."""
  from k3train.model import remat
  moe = make_moe()
  graphdef, params, rest = nnx.split(moe, nnx.Param, ...)
  x = tokens()
  ct = normal(x.shape, 21)

  def loss(p, forward):
    m = nnx.merge(graphdef, p, rest, copy=True)
    return jnp.sum(forward(m, x) * ct)

  layer = lambda m, x: m(x, all_real(x))
  plain = jax.grad(lambda p: loss(p, layer))
  selective = jax.grad(jax.checkpoint(lambda p: loss(p, layer), policy=remat.policy("selective")))
  gmms = lambda fn: primitive_counts(fn, params)["ragged_dot_general"]
  assert gmms(plain) == gmms(selective) == 9
  dense = jax.jit(jax.grad(lambda p: loss(p, moe_lib.moe_dense_reference)))(params)
  got = jax.jit(selective)(params)
  for (path, g), (_, want) in zip(nnx.to_flat_state(got), nnx.to_flat_state(dense)):
    g, want = np.asarray(g[...]), np.asarray(want[...])
    np.testing.assert_allclose(g, want, atol=1e-5 * max(np.abs(want).max(), 1.0), rtol=0,
                               err_msg=str(path))


def test_bad_backend_fails_at_construction():
  with pytest.raises(ValueError, match="allowed"):
    make_moe(backend="nope")


# ----------------------------------------------------------------------------- §5.6.5 QB


def _skewed_scores(m=4096, n=64, seed=0):
  """Sigmoid scores with a linear per-expert offset: expert n-1 is strongly preferred."""
  z = normal((m, n), seed) + jnp.linspace(-2.0, 2.0, n)[None, :]
  return jax.nn.sigmoid(z)


def _max_over_mean_load(scores, bias, k):
  _, idx = _route(scores, bias, k, renormalize=True, routed_scaling_factor=1.0)
  load = moe_lib.count_expert_load(idx, jnp.ones(scores.shape[0], bool), scores.shape[1])
  return float(jnp.max(load) / jnp.mean(load))


def test_qb_balances_skewed_batch_within_5_updates():
  k = 8
  scores = _skewed_scores()
  mask = jnp.ones(scores.shape[0], bool)
  qb = _qb
  bias = jnp.zeros(scores.shape[1])
  ratios = [_max_over_mean_load(scores, bias, k)]
  for _ in range(5):
    bias = qb(scores, bias, mask, k)
    ratios.append(_max_over_mean_load(scores, bias, k))
    np.testing.assert_allclose(jnp.mean(bias), 0.0, atol=1e-6)       # re-centred
  assert ratios[0] > 3.0, ratios                                       # really skewed at start
  assert min(ratios[1:]) <= 1.1, ratios
  assert ratios[-1] <= 1.1, ratios


def test_qb_invariant_to_constant_shift_of_scores_and_bias():
  k = 8
  scores = _skewed_scores(m=512, seed=1)
  mask = jnp.ones(512, bool)
  bias = normal((64,), 2, 0.05)
  b0 = _qb(scores, bias, mask, k)
  np.testing.assert_allclose(_qb(scores + 0.25, bias, mask, k), b0,
                             atol=1e-5)
  np.testing.assert_allclose(_qb(scores, bias + 0.5, mask, k), b0,
                             atol=1e-5)


def test_qb_edge_cases():
  scores = _skewed_scores(m=64, n=8)
  bias = jnp.arange(8.0)
  # No real tokens: the bias is kept.
  np.testing.assert_array_equal(
      _qb(scores, bias, jnp.zeros(64, bool), 2), bias)
  # top_k == E: nothing to balance.
  np.testing.assert_array_equal(
      _qb(scores, bias, jnp.ones(64, bool), 8), jnp.zeros(8))
  # One real token: finite result.
  one = jnp.zeros(64, bool).at[5].set(True)
  assert bool(jnp.all(jnp.isfinite(_qb(scores, bias, one, 2))))


def test_bias_never_receives_gradients():
  moe = make_moe()
  moe.router.bias.set_value(normal((8,), 5, 0.1))
  x = tokens()
  loss = lambda m: jnp.sum(m(x) ** 2)
  # nnx.grad differentiates nnx.Param only: the bias (and QB state) are not in its result
  # (checked on abstract values: tracing, no compile).
  grads_shape = nnx.eval_shape(nnx.grad(loss), moe)
  assert {type(v) for _, v in nnx.to_flat_state(grads_shape)} == {nnx.Param}
  # Differentiating wrt the non-Param state explicitly: the bias gradient is exactly zero,
  graphdef, params, rest = nnx.split(moe, nnx.Param, ...)
  d_params, d_rest = jax.jit(jax.grad(lambda p, r: loss(nnx.merge(graphdef, p, r)),
                                      argnums=(0, 1)))(params, rest)
  np.testing.assert_array_equal(d_rest["router"]["bias"].get_value(), 0.0)
  # while the router weight does get a gradient through the routing weights.
  assert float(jnp.max(jnp.abs(d_params["router"]["weight"].get_value()))) > 0.0


# ----------------------------------------------------------------------------- §5.6.6 padding


def test_stats_exclude_padding_tokens():
  moe = make_moe()
  x = tokens()
  mask = jnp.arange(16)[None, :] < jnp.array([[11], [6]])      # 17 real tokens of 32
  _forward(moe, x, mask)
  pending, load = moe.qb_pending.get_value(), moe.expert_load.get_value()
  assert float(jnp.sum(load)) == 17 * 3
  # Arbitrary (even huge) padding content changes neither statistic.
  junk = normal(x.shape, 8, 100.0)
  _forward(moe, jnp.where(mask[:, :, None], x, junk), mask)
  np.testing.assert_array_equal(moe.qb_pending.get_value(), pending)
  np.testing.assert_array_equal(moe.expert_load.get_value(), load)
  # They equal the statistics of the real tokens alone.
  x_real = x[mask]
  _, idx, scores = _router(moe, x_real)
  np.testing.assert_array_equal(load, moe_lib.count_expert_load(idx, jnp.ones(17, bool), 8))
  np.testing.assert_allclose(
      pending, _qb(scores, moe.router.bias.get_value(), jnp.ones(17, bool), 3), atol=1e-6)
  # (A missing mask means every token is real: exercised by test_qb_update_nested_and_stacked.)


# ----------------------------------------------------------------------------- applying QB


def test_qb_disabled_pending_is_current_bias():
  moe = make_moe(quantile_balancing=False)
  bias = 0.1 * jnp.arange(8.0)
  moe.router.bias.set_value(bias)
  x = tokens()
  _forward(moe, x, all_real(x))
  np.testing.assert_array_equal(moe.qb_pending.get_value(), bias)
  moe_lib.apply_quantile_balancing(moe)
  np.testing.assert_array_equal(moe.router.bias.get_value(), bias)


class _TwoLayerModel(nnx.Module):
  """A single MoE plus a stack of 3 (as nnx.vmap / scan would build them)."""

  def __init__(self, rngs: nnx.Rngs):
    self.first = make_moe(seed=1)

    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=0, out_axes=0)
    def stacked(r):
      return moe_lib.StableLatentMoE(moe_config(), d_model=D_MODEL, init_std=0.3, norm_eps=1e-5,
                                     situ_beta=4.0, situ_linear_beta=25.0, rngs=r)

    self.blocks = stacked(rngs)

  def __call__(self, x_btd):
    x_btd = x_btd + self.first(x_btd)

    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def body(layer, h):
      return h + layer(h)

    return body(self.blocks, x_btd)


def test_qb_update_nested_and_stacked():
  model = _TwoLayerModel(rngs(0))
  assert model.blocks.qb_pending.get_value().shape == (3, 8)
  x = tokens()
  nnx.jit(lambda m, a: m(a))(model, x)                 # token_mask None: all tokens real
  assert float(jnp.sum(model.first.expert_load.get_value())) == x.shape[0] * x.shape[1] * 3
  pending_first = model.first.qb_pending.get_value()
  pending_blocks = model.blocks.qb_pending.get_value()
  assert float(jnp.max(jnp.abs(pending_blocks))) > 0.0

  # State level, as the train step uses it: a pure function of the split non-Param state.
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  new_rest = jax.jit(moe_lib.qb_bias_update)(rest)
  flat_rest = dict(nnx.to_flat_state(rest))
  n_bias = 0
  for (path, old), (path2, new) in zip(nnx.to_flat_state(rest), nnx.to_flat_state(new_rest)):
    assert path == path2 and type(old) is type(new)
    if isinstance(new, moe_lib.RouterBias):         # .../router/bias := .../qb_pending
      np.testing.assert_array_equal(new.get_value(),
                                    flat_rest[path[:-2] + ("qb_pending",)].get_value())
      n_bias += 1
    else:                                            # everything else passes through
      np.testing.assert_array_equal(new.get_value(), old.get_value())
  assert n_bias == 2
  np.testing.assert_array_equal(rest["first"]["router"]["bias"].get_value(), 0.0)  # input intact
  merged = nnx.merge(graphdef, params, new_rest)
  np.testing.assert_array_equal(merged.blocks.router.bias.get_value(), pending_blocks)

  # Module level, in place.
  moe_lib.apply_quantile_balancing(model)
  np.testing.assert_array_equal(model.first.router.bias.get_value(), pending_first)
  np.testing.assert_array_equal(model.blocks.router.bias.get_value(), pending_blocks)


def test_qb_bias_update_requires_the_bias():
  moe = make_moe()
  with pytest.raises(KeyError):
    moe_lib.qb_bias_update(nnx.state(moe, moe_lib.QBPending))


@pytest.mark.parametrize("unroll, digit_bits", [(True, 1), (4, 1), (1, 1), (True, 2), (1, 4),
                                                 (True, 4), (2, 8)])
def test_kth_largest_per_column_equals_a_sort(unroll, digit_bits):
  # QB's exact order statistic by radix selection over counts (no [T, E] sort or gather):
  # the same element a descending sort puts at index k, including ±0 ties, −inf padding and
  # values across six decades; 1, 2, 4 or 8 bits per round, unrolled or as a loop.
  from pallas_kernels.qb.xla import kth_largest_per_column
  # Jitted (as in the train step): one program per setting serves the 20 draws (k is traced).
  select = jax.jit(kth_largest_per_column, static_argnames=("unroll", "digit_bits"))
  rng = np.random.default_rng(0)
  for _ in range(20):
    x = (rng.standard_normal((50, 7)) * 10.0 ** rng.integers(-3, 3)).astype(np.float32)
    x[rng.random((50, 7)) < 0.2] = -np.inf
    x[rng.random((50, 7)) < 0.1] = 0.0
    x[:3] = -0.0
    k = int(rng.integers(0, 50))
    got = np.asarray(select(jnp.asarray(x), jnp.int32(k), unroll=unroll, digit_bits=digit_bits))
    np.testing.assert_array_equal(got, -np.sort(-x, axis=0)[k])
    one_bit = np.asarray(select(jnp.asarray(x), jnp.int32(k), digit_bits=1))
    np.testing.assert_array_equal(got.view(np.uint32), one_bit.view(np.uint32))   # ±0 too


def test_kth_largest_per_column_rejects_digit_widths_that_do_not_divide_32():
  from pallas_kernels.qb.xla import kth_largest_per_column
  with pytest.raises(ValueError, match="digit_bits must be 1, 2, 4 or 8"):
    kth_largest_per_column(jnp.zeros((4, 3)), jnp.int32(0), digit_bits=3)
