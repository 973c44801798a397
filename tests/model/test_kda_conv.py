"""The KDA layer's short convs: fp32 taps and weight gradients in bf16 training, through the
configured backend (pallas_kernels.short_conv, whose own tests check the numbers)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from k3train import config as config_lib
from k3train.model.kda import KimiDeltaAttention
from pallas_kernels.short_conv import pallas_gpu
from tests.configs import k3_tiny


def _layer(conv_backend: str, dtype=jnp.bfloat16):
  cfg = k3_tiny.get_config().model.kda
  cfg.conv_backend = conv_backend
  return KimiDeltaAttention(cfg, d_model=16, init_std=0.5, norm_eps=1e-5, dtype=dtype,
                            param_dtype=jnp.float32,
                            rngs=nnx.Rngs(params=jax.random.key(1, impl="rbg")))


def _conv_weight_grads(layer, x, seg):
  def loss(params):
    model = nnx.merge(graph, params)
    return jnp.sum(model(x, seg).astype(jnp.float32) ** 2)
  graph, params = nnx.split(layer)
  grads = nnx.jit(jax.grad(loss))(params)
  return grads, jax.make_jaxpr(jax.grad(loss))(params)


def test_bf16_layer_reduces_its_conv_weight_gradients_in_fp32():
  """In a bf16 KDA layer no reduction over tokens runs on a 16-bit array (the conv weight
  gradients were such sums before)."""
  layer = _layer("xla")
  x = jax.random.normal(jax.random.key(2), (2, 32, 16), jnp.float32)
  seg = jnp.ones((2, 32), jnp.int32)
  _, jaxpr = _conv_weight_grads(layer, x, seg)
  low = [e for e in jaxpr.eqns if e.primitive.name == "reduce_sum"
         and e.invars[0].aval.dtype in (jnp.bfloat16, jnp.float16)
         and e.invars[0].aval.ndim >= 3]
  assert not low


def test_layer_gradients_agree_between_conv_backends():
  """In an fp32 layer, the conv weight gradients through the Pallas-GPU kernels (interpret mode)
  equal those through the xla backend: the same fp32 sums, to fp32 rounding. (In a bf16 layer a
  one-ulp difference of a conv output, where the two sum in another order, moves the bf16
  roundings downstream.)"""
  x = jax.random.normal(jax.random.key(3), (2, 32, 16), jnp.float32)
  seg = jnp.concatenate([jnp.zeros((2, 11), jnp.int32), jnp.ones((2, 21), jnp.int32)], axis=1)
  grads = {}
  for backend in ("xla", "pallas_gpu"):
    with pallas_gpu.configured(rows=16, cols=16):
      grads[backend], _ = _conv_weight_grads(_layer(backend, jnp.float32), x, seg)
  for name in ("q_conv", "k_conv", "v_conv"):
    a, b = grads["xla"][name][...], grads["pallas_gpu"][name][...]
    assert float(jnp.max(jnp.abs(a - b))) <= 1e-4 * float(jnp.max(jnp.abs(a))), name


def test_config_rejects_an_unknown_conv_backend():
  cfg = k3_tiny.get_config()
  cfg.model.kda.conv_backend = "cuda"
  with pytest.raises(ValueError, match="model.kda.conv_backend"):
    config_lib.validate(cfg)
