"""Projections that read the same input run as one GEMM over their kernels side by side (KDA's
q, k, v with one short conv over the three branches; MLA's two down-projections). The layer
must compute what it computes one projection and one conv at a time, and so must its
gradients.

Both sides run in fp32 with the same backends; the one-GEMM side sums x's gradient of the
branches inside one matmul instead of adding three, so the comparisons allow fp32 rounding:
rtol 1e-5 on outputs, 1e-4 of each gradient's largest entry.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3train.model import kda as kda_lib
from k3train.model import mla as mla_lib
from pallas_kernels.kda import kda as kda_op
from pallas_kernels.short_conv import reference as conv_reference
from tests.configs import k3_tiny
from tests.model.test_mla import D_MODEL, make_mla

HIGHEST = jax.lax.Precision.HIGHEST


def _kda_layer():
  cfg = k3_tiny.get_config().model.kda
  cfg.conv_backend = "xla"
  return kda_lib.KimiDeltaAttention(cfg, d_model=16, init_std=0.5, norm_eps=1e-5,
                                    dtype=jnp.float32, param_dtype=jnp.float32,
                                    rngs=nnx.Rngs(params=jax.random.key(4, impl="rbg")))


def _kda_one_at_a_time(m: kda_lib.KimiDeltaAttention, x_btd, seg_bt):
  """The KDA layer (docs/maths.md §1) from its parameters, each projection and conv on its own."""
  def proj(linear, x):
    n_in = len(linear.in_shape)
    return jnp.tensordot(x, linear.kernel[...], axes=n_in, precision=HIGHEST)

  def branch(linear, conv):
    return jax.nn.silu(conv_reference.causal_conv(proj(linear, x_btd), conv[...], seg_bt))

  q = kda_lib.l2_normalize(branch(m.q_proj, m.q_conv))
  k = kda_lib.l2_normalize(branch(m.k_proj, m.k_conv))
  v = branch(m.v_proj, m.v_conv)
  beta = jax.nn.sigmoid(proj(m.b_proj, x_btd))
  z = proj(m.f_b_proj, proj(m.f_a_proj, x_btd)) + m.dt_bias[...]
  g = kda_lib.lower_bound_gate(z, m.A_log[...], m.lower_bound)
  o = kda_op(q, k, v, g, beta, segment_ids=seg_bt, chunk_size=m.chunk_size, backend=m.backend)[0]
  o = m.o_norm(o) * jax.nn.sigmoid(proj(m.g_proj, x_btd))
  return proj(m.o_proj, o)


def _outputs_and_grads(fn, module, x, seg):
  graph, params, rest = nnx.split(module, nnx.Param, ...)

  def loss(params, x, rest):
    y = fn(nnx.merge(graph, params, rest, copy=True), x, seg)
    return jnp.sum(y * jnp.cos(y)), y            # a loss whose gradient differs per output

  (_, y), (g_params, g_x) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x, rest)
  return y, dict(nnx.to_flat_state(g_params)), g_x


def _assert_same(a, b, what):
  assert set(a) == set(b), what
  for key in a:
    x, y = np.asarray(a[key].get_value()), np.asarray(b[key].get_value())
    scale = float(np.max(np.abs(y)))
    assert scale > 0, (what, key)
    np.testing.assert_allclose(x, y, rtol=0, atol=1e-4 * scale, err_msg=f"{what} {key}")


def test_kda_one_gemm_and_one_conv_match_the_layer_one_branch_at_a_time():
  m = _kda_layer()
  x = jax.random.normal(jax.random.key(5), (2, 32, 16), jnp.float32)
  seg = jnp.concatenate([jnp.zeros((2, 13), jnp.int32), jnp.ones((2, 19), jnp.int32)], axis=1)
  y, g_params, g_x = _outputs_and_grads(lambda mod, x, s: mod(x, s), m, x, seg)
  y_ref, g_params_ref, g_x_ref = _outputs_and_grads(_kda_one_at_a_time, m, x, seg)
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(y_ref))))
  np.testing.assert_allclose(g_x, g_x_ref, rtol=0, atol=1e-4 * float(jnp.max(jnp.abs(g_x_ref))))
  _assert_same(g_params, g_params_ref, "KDA parameter gradients")
  for name in ("q_proj", "k_proj", "v_proj", "q_conv", "k_conv", "v_conv"):
    assert any(name in key for key in g_params), name


def test_kda_branch_inputs_are_each_projection_alone():
  """The decode cache's pre-conv rows: column for column the three projections."""
  m = _kda_layer()
  x = jax.random.normal(jax.random.key(6), (2, 5, 16), jnp.float32)
  pre = m._project_qkv(x)
  for got, linear in zip((pre[:, :, 0], pre[:, :, 1], pre[:, :, 2]), (m.q_proj, m.k_proj, m.v_proj)):
    np.testing.assert_allclose(got, linear(x), rtol=1e-6, atol=1e-6)


def _mla_one_at_a_time(m: mla_lib.GatedMLA, x_btd, seg_bt):
  """The MLA layer with each down-projection on its own (the rest as the module runs it)."""
  q_a = m.q_a_proj(x_btd)
  kv_a = m.kv_a_proj(x_btd)
  original = m._down_projections
  m._down_projections = lambda x: (q_a, kv_a)
  try:
    return m(x_btd, seg_bt)
  finally:
    m._down_projections = original


def test_mla_one_down_gemm_matches_the_two_projections():
  m = make_mla(seed=3, backend="xla")
  x = jax.random.normal(jax.random.key(7), (2, 8, D_MODEL), jnp.float32)
  seg = jnp.array([[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0, 0]], jnp.int32)
  y, g_params, g_x = _outputs_and_grads(lambda mod, x, s: mod(x, s), m, x, seg)
  y_ref, g_params_ref, g_x_ref = _outputs_and_grads(_mla_one_at_a_time, m, x, seg)
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(y_ref))))
  np.testing.assert_allclose(g_x, g_x_ref, rtol=0, atol=1e-4 * float(jnp.max(jnp.abs(g_x_ref))))
  _assert_same(g_params, g_params_ref, "MLA parameter gradients")
