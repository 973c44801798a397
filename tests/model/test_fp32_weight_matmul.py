"""`layers.fp32_weight_matmul`: a bf16 input times an fp32 weight, as exact as an fp32 matmul,
from bf16 GEMMs (the MoE router's logits)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3train.model import layers
from k3train.model.moe import Router
from pallas_kernels import platform


def _inputs(t=96, d=256, e=24, batch=(2,)):
  k = jax.random.split(jax.random.key(1), 3)
  x = jax.random.normal(k[0], (*batch, t, d), jnp.float32).astype(jnp.bfloat16)
  w = 0.05 * jax.random.normal(k[1], (d, e), jnp.float32)
  g = jax.random.normal(k[2], (*batch, t, e), jnp.float32)
  return x, w, g


def test_pieces_sum_to_the_fp32_value_exactly():
  a = jax.random.normal(jax.random.key(0), (4096,), jnp.float32) * jnp.logspace(-30, 30, 4096)
  p = layers._bf16_pieces(a, 3)
  assert p.dtype == jnp.bfloat16
  total = (p[0].astype(jnp.float32) + p[1].astype(jnp.float32)) + p[2].astype(jnp.float32)
  np.testing.assert_array_equal(np.asarray(total), np.asarray(a))


@pytest.mark.parametrize("batch", [(2,), ()])
def test_forward_and_gradients_match_float64(batch):
  """Forward and ∂w: exact products, fp32 accumulation (relative ~1e-6 of Σ|x||w|). ∂x: within
  the bf16 rounding of its result (2⁻⁸ relative)."""
  x, w, g = _inputs(batch=batch)
  y, vjp = jax.jit(lambda x, w: jax.vjp(layers.fp32_weight_matmul, x, w))(x, w)
  dx, dw = vjp(g)
  assert (y.dtype, dx.dtype, dw.dtype) == (jnp.float32, jnp.bfloat16, jnp.float32)
  x64, w64, g64 = (np.asarray(a, np.float64) for a in (x, w, g))
  np.testing.assert_allclose(np.asarray(y), x64 @ w64,
                             atol=2e-6 * float(np.max(np.abs(x64) @ np.abs(w64))), rtol=0)
  flat = lambda a: a.reshape(-1, a.shape[-1])
  dw_ref = flat(x64).T @ flat(g64)
  np.testing.assert_allclose(np.asarray(dw), dw_ref,
                             atol=2e-6 * float(np.max(np.abs(flat(x64)).T @ np.abs(flat(g64)))),
                             rtol=0)
  dx_ref = g64 @ w64.T
  np.testing.assert_allclose(np.asarray(dx, np.float64), dx_ref,
                             atol=2**-8 * float(np.max(np.abs(dx_ref))), rtol=0)
  # ∂x carries no more than its own bf16 rounding: ≥ 99 % of entries round to the reference's bf16.
  same = np.asarray(dx) == np.asarray(jnp.asarray(dx_ref, jnp.float32).astype(jnp.bfloat16))
  assert same.mean() > 0.99, same.mean()


def test_agrees_with_the_full_precision_fp32_matmul():
  """Both sum exact products in fp32, in orders that differ with the CPU's vector width: the
  forward within 2e-6 of Σ|x||w| (as against float64 above)."""
  x, w, g = _inputs()
  full = lambda x, w: jax.lax.dot_general(x.astype(jnp.float32), w, (((2,), (0,)), ((), ())),
                                          precision=jax.lax.Precision.HIGHEST)
  y_ref, vjp_ref = jax.vjp(full, x, w)
  y, vjp = jax.vjp(layers.fp32_weight_matmul, x, w)
  bound = float(np.max(np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64))))
  np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=0, atol=2e-6 * bound)
  (dx_ref, dw_ref), (dx, dw) = vjp_ref(g), vjp(g)
  np.testing.assert_allclose(np.asarray(dw), np.asarray(dw_ref), rtol=0,
                             atol=1e-6 * float(jnp.max(jnp.abs(dw_ref))))
  np.testing.assert_allclose(np.asarray(dx, np.float32), np.asarray(dx_ref), rtol=0,
                             atol=2**-8 * float(jnp.max(jnp.abs(dx_ref))))


def test_only_bf16_matmuls_in_forward_and_backward():
  """Three dots with bf16 operands, as lowered for GPUs and TPUs (XLA:CPU gets fp32 copies of
  the same bf16 values)."""
  x, w, g = _inputs(t=8, d=32, e=8)
  f = lambda x, w: jnp.sum(layers.fp32_weight_matmul(x, w) * g)
  with platform.targeting("gpu"):
    hlo = jax.jit(jax.value_and_grad(f, argnums=(0, 1))).lower(x, w).as_text()
  dots = [line for line in hlo.splitlines() if "dot_general" in line and "stablehlo" in line]
  assert len(dots) == 3, dots
  for line in dots:
    operands = line.split(":")[-1].split("->")[0]
    assert "f32>" not in operands.replace("tensor<", "<"), line


def test_refuses_a_non_bf16_input():
  x, w, _ = _inputs()
  with pytest.raises(ValueError, match="bfloat16"):
    layers.fp32_weight_matmul(x.astype(jnp.float32), w)


def test_router_scores_take_the_split_path_for_bf16_and_agree_with_fp32():
  from flax import nnx
  router = Router(64, 16, 4, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(3), (40, 64), jnp.float32).astype(jnp.bfloat16)
  s_bf16 = router.scores(x)
  s_fp32 = router.scores(x.astype(jnp.float32))
  np.testing.assert_allclose(np.asarray(s_bf16), np.asarray(s_fp32), rtol=0, atol=1e-6)
  w_b, i_b, _ = router(x)
  w_f, i_f, _ = router(x.astype(jnp.float32))
  np.testing.assert_array_equal(np.asarray(i_b), np.asarray(i_f))
