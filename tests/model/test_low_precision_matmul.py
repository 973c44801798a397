"""`layers.low_precision_matmul`: bf16 forward and backward matmuls with fp32 accumulation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3train.model import layers


def _inputs():
  k = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(k[0], (2, 5, 16), jnp.float32)
  w = jax.random.normal(k[1], (16, 3, 4), jnp.float32)       # a per-head [d, heads, head_dim] kernel
  g = jax.random.normal(k[2], (2, 5, 3, 4), jnp.float32)
  return x, w, g


def test_values_and_gradients_match_a_float64_reference_within_bf16_rounding():
  x, w, g = _inputs()
  y, vjp = jax.vjp(lambda x, w: layers.low_precision_matmul(x, w, 1, jnp.bfloat16), x, w)
  dx, dw = vjp(g.astype(jnp.bfloat16))
  assert (y.dtype, dx.dtype, dw.dtype) == (jnp.bfloat16, jnp.float32, jnp.float32)
  x64, w64, g64 = (np.asarray(a, np.float64) for a in (x, w, g))
  y_ref = np.einsum("btd,dhk->bthk", x64, w64)
  dx_ref = np.einsum("bthk,dhk->btd", g64, w64)
  dw_ref = np.einsum("btd,bthk->dhk", x64, g64)
  # Operands rounded to bf16 (relative 2^-8 each) and the bf16 output: a few 2^-8 of the scale.
  for got, ref in ((y, y_ref), (dx, dx_ref), (dw, dw_ref)):
    scale = np.sqrt(16 * 10) * 1.0                          # typical |value| of a sum of 16–10 terms
    np.testing.assert_allclose(np.asarray(got, np.float64), ref, atol=4 * 2**-8 * scale * 2)


@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16])
def test_backward_matmuls_take_bf16_operands_and_write_their_result_dtype(x_dtype):
  """No fp32 × fp32 matmul in the gradient program: all three dots read bf16. Each writes its
  result's dtype directly (y: bf16; dx: x's dtype; dW: fp32), so no GEMM writes fp32 only for a
  convert to round it to bf16 afterwards."""
  x, w, _ = _inputs()
  x = x.astype(x_dtype)

  def loss(x, w):
    return jnp.sum(layers.low_precision_matmul(x, w, 1, jnp.bfloat16).astype(jnp.float32) ** 2)

  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w)
  dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
  assert len(dots) == 3                                       # forward, input grad, weight grad
  for e in dots:
    assert all(v.aval.dtype == jnp.bfloat16 for v in e.invars), e
  written = [e.params["preferred_element_type"] for e in dots]
  assert written == [jnp.bfloat16, jnp.dtype(x_dtype), jnp.float32], written


def test_linear_below_fp32_equals_autodiff_of_the_rounded_computation():
  """Linear(dtype=bf16) gives the gradient of the same bf16 computation done in fp32 backward,
  up to the rounding of the cotangent to bf16 (a relative 2^-8)."""
  lin = layers.Linear((16,), (3, 4), ("embed", "heads", "kv"), dtype=jnp.bfloat16,
                      rngs=nnx.Rngs(params=0))
  x, _, _ = _inputs()
  w = lin.kernel[...]

  def ours(w):
    return jnp.sum(jnp.sin(layers.low_precision_matmul(x, w, 1, lin.dtype).astype(jnp.float32)))

  np.testing.assert_array_equal(lin(x), layers.low_precision_matmul(x, w, 1, jnp.bfloat16))

  def plain(w):
    y = jax.lax.dot_general(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), (((2,), (0,)), ((), ())),
                            preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    return jnp.sum(jnp.sin(y.astype(jnp.float32)))

  g_ours, g_plain = jax.grad(ours)(w), jax.grad(plain)(w)
  assert g_ours.dtype == jnp.float32
  np.testing.assert_allclose(g_ours, g_plain, rtol=0, atol=2**-7 * float(jnp.max(jnp.abs(g_plain))))
