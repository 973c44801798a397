"""MX QAT of the routed experts in the Stable LatentMoE layer (k3train/model/moe.py,
docs/maths.md §7.5): the on/off switch, the fake-quant and MX-gemm paths, the once-per-step
weight hook, the straight-through gradient and the MXFP4 export.

Comparisons are bitwise: every path computes the same gmm on the same quantised values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from k3train import config as config_lib
from k3train.model import moe as moe_lib
from k3train.quant import mx
from tests.configs import k3_tiny

D_MODEL, LATENT, HIDDEN, EXPERTS = 16, 32, 64, 4
FAKE = moe_lib.ExpertQuant(gemm="fake_quant")
MX_GEMM = moe_lib.ExpertQuant(gemm="mx")


def make_moe(dtype=jnp.float32) -> moe_lib.StableLatentMoE:
  cfg = ml_collections.ConfigDict(dict(
      num_experts=EXPERTS, top_k=2, latent_dim=LATENT, expert_hidden=HIDDEN,
      num_shared_experts=1, shared_hidden=16, routed_scaling_factor=1.0, renormalize=True,
      latent_norm=True, quantile_balancing=True, backend="ragged_dot"))
  return moe_lib.StableLatentMoE(cfg, d_model=D_MODEL, init_std=0.3, norm_eps=1e-5,
                                 situ_beta=4.0, situ_linear_beta=25.0, dtype=dtype,
                                 rngs=nnx.Rngs(jax.random.key(0, impl="rbg")))


def tokens(seed=1):
  return jnp.asarray(np.random.default_rng(seed).standard_normal((2, 8, D_MODEL)), jnp.float32)


def loss_fn(graphdef, params, rest, x, settings, active, weights_quantized):
  """(Σ y², y) of the layer under an expert_quantization block (settings None: plain)."""
  model = nnx.merge(graphdef, params, rest, copy=True)
  with moe_lib.expert_quantization(settings, active, weights_quantized=weights_quantized):
    y = model(x)
  return jnp.sum(jnp.square(y.astype(jnp.float32))), y


_value_and_grad = jax.jit(jax.value_and_grad(loss_fn, argnums=1, has_aux=True),
                          static_argnums=(0, 4, 6))


def run(model, params, x, settings, active=True, weights_quantized=False):
  graphdef, _, rest = nnx.split(model, nnx.Param, ...)
  (_, y), grads = _value_and_grad(graphdef, params, rest, x, settings, active, weights_quantized)
  return y, grads


def assert_trees_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(x, y)


def test_switch_off_is_the_plain_layer_and_on_changes_it():
  """With active False the quantised layer is the plain one bit for bit (outputs and gradients);
  with active True the output differs (the experts really are quantised)."""
  model = make_moe()
  params = nnx.state(model, nnx.Param)
  x = tokens()
  y_plain, g_plain = run(model, params, x, None)
  y_off, g_off = run(model, params, x, FAKE, active=jnp.bool_(False))
  np.testing.assert_array_equal(y_off, y_plain)
  assert_trees_equal(g_off, g_plain)
  y_on, _ = run(model, params, x, FAKE, active=jnp.bool_(True))
  assert not np.array_equal(y_on, y_plain)
  # MXFP4 weights carry ~10 % relative RMS error per element; the layer output stays close.
  rel = np.linalg.norm(np.asarray(y_on) - np.asarray(y_plain)) / np.linalg.norm(np.asarray(y_plain))
  assert 0.0 < rel < 0.3, rel


def test_fake_quant_and_mx_gemm_paths_agree():
  """gemm="mx" (gmm_mx on MXFP8 codes and packed MXFP4 weights) equals gemm="fake_quant",
  forward and every parameter gradient, bit for bit."""
  model = make_moe()
  params = nnx.state(model, nnx.Param)
  x = tokens(2)
  y_fq, g_fq = run(model, params, x, FAKE)
  y_mx, g_mx = run(model, params, x, MX_GEMM)
  np.testing.assert_array_equal(y_mx, y_fq)
  assert_trees_equal(g_mx, g_fq)


def test_weight_hook_quantises_only_routed_experts_along_their_input_dim():
  """fake_quant_expert_weights: experts/{gate,up,down} become Q(W) along axis −2 (the input dim:
  ℓ for gate/up, F for down) in fp32; every other parameter (router, latent projections, shared
  expert, norm) is untouched; with active False nothing changes."""
  params = nnx.state(make_moe(), nnx.Param)
  quantised = moe_lib.fake_quant_expert_weights(params, FAKE, jnp.bool_(True))
  idle = moe_lib.fake_quant_expert_weights(params, FAKE, jnp.bool_(False))
  names = set()
  for (path, var), (_, q), (_, o) in zip(nnx.to_flat_state(params), nnx.to_flat_state(quantised),
                                         nnx.to_flat_state(idle), strict=True):
    w, wq = var.get_value(), q.get_value()
    np.testing.assert_array_equal(o.get_value(), w)
    assert wq.dtype == w.dtype == jnp.float32
    if moe_lib.is_routed_expert_weight(tuple(path)):
      names.add(path[-1])
      np.testing.assert_array_equal(wq, mx.quantize_dequantize(w, "mxfp4", axis=-2))
      assert not np.array_equal(wq, w)
    else:
      np.testing.assert_array_equal(wq, w)
  assert names == {"gate", "up", "down"}


def test_hook_gradient_is_the_straight_through_gradient():
  """The train step differentiates at the hook's Q(W) (weights_quantized=True); that equals the
  gradient of the layer that fake-quantises W itself with the STE, bit for bit."""
  model = make_moe()
  params = nnx.state(model, nnx.Param)
  x = tokens(3)
  y_ste, g_ste = run(model, params, x, FAKE, weights_quantized=False)
  y_hook, g_hook = run(model, moe_lib.fake_quant_expert_weights(params, FAKE), x, FAKE,
                       weights_quantized=True)
  np.testing.assert_array_equal(y_hook, y_ste)
  assert_trees_equal(g_hook, g_ste)


def test_exported_mxfp4_experts_reproduce_the_qat_forward_exactly():
  """Export: routed experts written as MXFP4 in the release layout ([E, out, in/2] packed bytes,
  [E, out, in/32] scale bytes) and decoded again give the QAT forward bit for bit (bf16 model)."""
  model = make_moe(jnp.bfloat16)
  params = nnx.state(model, nnx.Param)
  x = tokens(4)
  y_qat, _ = run(model, params, x, FAKE)
  exported = moe_lib.export_routed_experts(params)
  assert set(exported) == {"experts/gate", "experts/up", "experts/down"}
  shapes = {k: (v["weight_packed"].shape, v["weight_scale"].shape, v["weight_packed"].dtype)
            for k, v in exported.items()}
  assert shapes["experts/gate"] == ((EXPERTS, HIDDEN, LATENT // 2), (EXPERTS, HIDDEN, LATENT // 32),
                                    jnp.uint8)
  assert shapes["experts/down"] == ((EXPERTS, LATENT, HIDDEN // 2), (EXPERTS, LATENT, HIDDEN // 32),
                                    jnp.uint8)
  imported = moe_lib.import_routed_experts(params, exported)
  y_export, _ = run(model, imported, x, FAKE, weights_quantized=True)
  np.testing.assert_array_equal(y_export, y_qat)


def test_config_section_is_validated_and_resolved():
  """model.quant: off by default; bad values stop at start naming the key; "auto" resolves to
  the fake-quant GEMMs; enabling it needs MX-block-sized expert dims."""
  cfg = k3_tiny.get_config()
  assert cfg.model.quant.enabled is False
  assert moe_lib.expert_quant_from_config(cfg.model.quant) is None
  for key, value, match in [("weights", "mxfp6", "model.quant.weights"),
                            ("scale_rule", "ceil", "model.quant.scale_rule"),
                            ("gemm", "fast", "model.quant.gemm"),
                            ("start_step", -1, "model.quant.start_step")]:
    bad = k3_tiny.get_config()
    bad.model.quant[key] = value
    with pytest.raises(config_lib.ConfigError, match=match):
      config_lib.validate(bad)
  bad = k3_tiny.get_config()
  bad.model.quant.update(gemm="mx", activations="none")
  with pytest.raises(config_lib.ConfigError, match="MXFP4 weights and MXFP8 activations"):
    config_lib.validate(bad)
  bad = k3_tiny.get_config()
  bad.model.quant.enabled = True
  bad.model.moe.expert_hidden = 48
  with pytest.raises(config_lib.ConfigError, match="model.moe.expert_hidden"):
    config_lib.validate(bad)
  cfg.model.quant.update(enabled=True, start_step=7)
  q = moe_lib.expert_quant_from_config(config_lib.validate(cfg).model.quant)
  assert q == moe_lib.ExpertQuant(gemm="fake_quant", start_step=7)
