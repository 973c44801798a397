"""Whole-model invariants of the tiny K3: logical axes everywhere, no cross-document leakage,
KDA layer document resets, scan = unrolled layers."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.configs import k3_tiny
from tests.jaxprs import primitive_counts
from k3train.parallel import axes as ax
from k3train.model.decoder import K3Model, build_model
from k3train.model.kda import KimiDeltaAttention, lower_bound_gate

KNOWN_AXES = {v for k, v in vars(ax).items() if k.isupper() and isinstance(v, str)}


def test_every_parameter_has_logical_axes_of_its_rank():
  model = nnx.eval_shape(lambda: K3Model(k3_tiny.get_config().model, rngs=nnx.Rngs(0)))
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    names = var.get_metadata("out_sharding", None)
    assert names is not None, path
    assert len(names) == len(var.shape), path
    assert set(names) <= KNOWN_AXES, (path, names)


@pytest.fixture(scope="module")
def tiny_model():
  cfg = k3_tiny.get_config()
  return K3Model(cfg.model, rngs=nnx.Rngs(params=jax.random.key(0, impl="rbg"))), cfg


def test_packed_documents_do_not_see_each_other(tiny_model):
  """Doc B after doc A in one row gives the same logits as doc B alone (KDA state + conv reset,
  MLA masking, per-token MoE/AttnRes): the model's masks match the packing."""
  model, cfg = tiny_model
  t, len_a = 128, 45
  rng = np.random.default_rng(0)
  doc_a = rng.integers(8, cfg.model.vocab_size, len_a)
  doc_b = rng.integers(8, cfg.model.vocab_size, t - len_a)
  packed = np.concatenate([doc_a, doc_b])[None]
  seg_packed = np.array([1] * len_a + [2] * (t - len_a))[None]
  alone = np.concatenate([doc_b, np.zeros(len_a, int)])[None]      # B, then tail padding
  seg_alone = np.array([1] * (t - len_a) + [0] * len_a)[None]
  tokens = jnp.asarray(np.concatenate([packed, alone]), jnp.int32)
  segs = jnp.asarray(np.concatenate([seg_packed, seg_alone]), jnp.int32)
  forward = nnx.jit(lambda m, x, s: m(x, s, (s > 0).astype(jnp.float32)))
  logits = np.asarray(forward(model, tokens, segs))
  np.testing.assert_allclose(logits[0, len_a:], logits[1, :t - len_a], atol=2e-5, rtol=2e-5)
  # Control: without segment ids doc B does see doc A.
  logits_nomask = np.asarray(forward(model, tokens, jnp.ones_like(segs)))
  assert np.abs(logits_nomask[0, len_a:] - logits[1, :t - len_a]).max() > 1e-3


def test_kda_layer_resets_conv_and_state_at_document_start():
  cfg = k3_tiny.get_config().model
  layer = KimiDeltaAttention(cfg.kda, d_model=16, init_std=0.5, norm_eps=1e-5, dtype=jnp.float32,
                             param_dtype=jnp.float32, rngs=nnx.Rngs(params=jax.random.key(1, impl="rbg")))
  x = jax.random.normal(jax.random.key(2), (1, 40, 16))
  seg = jnp.array([[1] * 17 + [2] * 23])
  run = nnx.jit(lambda m, x, s: m(x, s))
  packed = run(layer, x, seg)
  first = run(layer, x[:, :17], jnp.ones((1, 17), jnp.int32))
  second = run(layer, x[:, 17:], jnp.ones((1, 23), jnp.int32))
  np.testing.assert_allclose(packed[:, :17], first, atol=1e-5)
  np.testing.assert_allclose(packed[:, 17:], second, atol=1e-5)


def test_lower_bound_gate_range():
  z = jnp.array([-1e4, -50.0, -1.0, 0.0, 1.0, 50.0, 1e4])[:, None, None] * jnp.ones((1, 2, 4))
  g = lower_bound_gate(z, jnp.array([0.0, 1.0]), -5.0)
  assert bool(jnp.all(jnp.isfinite(g)))
  assert bool(jnp.all((g >= -5.0) & (g <= 0.0)))
  inner = g[2:5]  # moderate inputs: strictly inside (−5, 0) (fp32 σ saturates only for |z| ≳ 17)
  assert bool(jnp.all((inner > -5.0) & (inner < 0.0)))
  np.testing.assert_allclose(g[3, 0], -2.5, rtol=1e-7)  # −5·σ(exp(0)·0)


def test_scanned_and_unrolled_decoders_agree():
  """scan_layers=False runs the same layer list unrolled; with the same weights the outputs agree."""
  cfg = k3_tiny.get_config()
  scanned = nnx.eval_shape(lambda: K3Model(cfg.model, rngs=nnx.Rngs(0)))
  cfg_unrolled = k3_tiny.get_config()
  cfg_unrolled.model.scan_layers = False
  unrolled = nnx.eval_shape(lambda: K3Model(cfg_unrolled.model, rngs=nnx.Rngs(0)))
  assert len(unrolled.prefix) == cfg.model.num_layers and unrolled.stack is None
  # Copy the scanned weights into the unrolled layer list.
  rngs = nnx.Rngs(params=jax.random.key(3, impl="rbg"))
  src = K3Model(cfg.model, rngs=rngs)
  flat_src = dict(nnx.to_flat_state(nnx.state(src)))
  period = len(src.schedule.period)
  target = {}
  for path, var in nnx.to_flat_state(nnx.state(unrolled)):
    if path[0] == "prefix" and path[1] >= src.schedule.prefix and path[1] < src.schedule.suffix_start:
      j, i = divmod(path[1] - src.schedule.prefix, period)
      value = flat_src[("stack", "layers", i) + path[2:]][...][j]
    elif path[0] == "prefix" and path[1] >= src.schedule.suffix_start:
      value = flat_src[("suffix", path[1] - src.schedule.suffix_start) + path[2:]][...]
    else:
      value = flat_src[path][...]
    target[path] = value
  graphdef, state = nnx.split(unrolled)
  state = nnx.from_flat_state([(p, type(v)(target[p])) for p, v in nnx.to_flat_state(state)])
  model_unrolled = nnx.merge(graphdef, state)
  tokens = jax.random.randint(jax.random.key(4), (1, 64), 8, cfg.model.vocab_size)
  seg = jnp.ones((1, 64), jnp.int32)
  a = nnx.jit(lambda m, x: m(x, seg))(src, tokens)
  b = nnx.jit(lambda m, x: m(x, seg))(model_unrolled, tokens)
  np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5)
  # The loss and the gradients of the parameters both share (embedding, final norm, head),
  # through every layer.
  @nnx.jit
  def loss_and_shared_grads(model):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(jnp.square(m(tokens, seg))))(model)
    return loss, {name: grads[name] for name in ("embed", "final_norm", "lm_head")}
  _assert_same_loss_and_grads(loss_and_shared_grads(src), loss_and_shared_grads(model_unrolled))


def _three_layer_loss_and_grads(segment_lengths, **model_overrides):
  """jitted (loss, grads) of a 3-layer tiny model (prefix KDA+dense, MLA; one scanned MLA) on a
  fixed 2 × 64 batch whose rows hold documents of `segment_lengths` tokens."""
  from k3train.train.step import forward_loss
  cfg = k3_tiny.get_config()
  cfg.model.num_layers, cfg.model.mla_layers = 3, (2, 3)
  for key, value in model_overrides.items():
    section, _, name = key.rpartition(".")
    (cfg.model[section] if section else cfg.model)[name] = value
  model = build_model(cfg.model, seed=0)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  ids = np.repeat([np.arange(1, len(segment_lengths) + 1)], segment_lengths, axis=1)
  batch = {"tokens": jnp.arange(128, dtype=jnp.int32).reshape(2, 64) % 97 + 3,
           "targets": jnp.arange(128, dtype=jnp.int32).reshape(2, 64) % 89 + 5,
           "segment_ids": jnp.asarray(ids.repeat(2, axis=0), jnp.int32),
           "loss_mask": jnp.ones((2, 64), jnp.float32)}
  loss_fn = lambda p: forward_loss(graphdef, p, rest, batch)[0]
  return jax.jit(jax.value_and_grad(loss_fn))(params)


def _assert_same_loss_and_grads(a, b, tol=1e-5):
  (loss_a, grads_a), (loss_b, grads_b) = a, b
  assert abs(float(loss_a) - float(loss_b)) <= tol
  for x, y in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b), strict=True):
    assert float(jnp.max(jnp.abs(x - y))) <= tol


def test_remat_changes_neither_loss_nor_gradients():
  # Rematerialisation (scanned stack and the unscanned prefix/suffix layers) recomputes the same
  # forward in the backward pass: same loss, same gradients (fp32; fusion may reorder sums). The
  # selective policy keeps some values instead of recomputing them: the same numbers again.
  reference = _three_layer_loss_and_grads((40, 24), remat_policy="none")
  _assert_same_loss_and_grads(reference, _three_layer_loss_and_grads((40, 24), remat_policy="full"))
  _assert_same_loss_and_grads(reference,
                              _three_layer_loss_and_grads((40, 24), remat_policy="selective"))


def _primitive_counts(remat_policy: str) -> collections.Counter:
  """Primitives in the jaxpr of the 3-layer tiny model's value_and_grad, sub-jaxprs included."""
  from k3train.train.step import forward_loss
  cfg = k3_tiny.get_config()
  cfg.model.num_layers, cfg.model.mla_layers = 3, (2, 3)
  cfg.model.remat_policy = remat_policy
  model = build_model(cfg.model, seed=0)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tokens = jnp.arange(128, dtype=jnp.int32).reshape(2, 64) % 97 + 3
  batch = {"tokens": tokens, "targets": tokens, "segment_ids": jnp.ones((2, 64), jnp.int32),
           "loss_mask": jnp.ones((2, 64), jnp.float32)}
  grad_fn = jax.value_and_grad(lambda p: forward_loss(graphdef, p, rest, batch)[0])
  return primitive_counts(grad_fn, params)


def test_selective_remat_keeps_routing_and_attention_instead_of_recomputing():
  # Under "full" the backward pass runs the router's top-k (after the QB rounds), the dispatch's
  # argsort and the blockwise attention forward loop again; "selective" keeps the top-k indices,
  # the sort order and the attention residuals (model/remat.py), so its gradient program has as
  # many of each as the one without remat, and
  # fewer dot_generals than "full" (it keeps the projections too).
  none, full, selective = (_primitive_counts(p) for p in ("none", "full", "selective"))
  assert full["top_k"] > none["top_k"] > 0
  assert selective["top_k"] == none["top_k"]
  assert full["sort"] > none["sort"] > 0                  # the dispatch's argsort
  assert selective["sort"] == none["sort"]
  assert full["while"] > none["while"] > 0
  assert selective["while"] == none["while"]
  assert none["dot_general"] < selective["dot_general"] < full["dot_general"]


def test_flash_attention_path_matches_the_dense_path():
  # The MLA layers through the blockwise attention op ("xla", O(T·block) memory) and through the
  # dense reference give the same loss and gradients on the tiny model (fp32, three documents per
  # row; block edges and mid-block document starts are covered by the op's own tests).
  _assert_same_loss_and_grads(_three_layer_loss_and_grads((21, 30, 13), **{"mla.backend": "reference"}),
                              _three_layer_loss_and_grads((21, 30, 13), **{"mla.backend": "xla"}))


def test_attnres_kernel_backward_matches_xla_in_the_model():
  # The AttnRes sites with the pallas_gpu backward (interpret mode: the stream's cotangents added
  # in place, empty slots skipped) and with the xla backward give the same loss and gradients on
  # the tiny model, scanned and unscanned layers alike.
  _assert_same_loss_and_grads(_three_layer_loss_and_grads((21, 30, 13), **{"attn_res.backend": "xla"}),
                              _three_layer_loss_and_grads((21, 30, 13),
                                                          **{"attn_res.backend": "pallas_gpu"}))


def test_row_gather_kernel_matches_xla_in_the_model():
  # The dispatch's row copies (forward rows, combine gradient rows) through the pallas_gpu
  # kernel (interpret mode) and through XLA's gather: the same loss and gradients.
  _assert_same_loss_and_grads(_three_layer_loss_and_grads((21, 30, 13), **{"moe.gather_backend": "xla"}),
                              _three_layer_loss_and_grads((21, 30, 13),
                                                          **{"moe.gather_backend": "pallas_gpu"}),
                              tol=0.0)


def test_situ_glu_kernels_match_xla_in_the_model():
  # The routed experts' SiTU-GLU (their routing weights as row scales) through the pallas_gpu
  # kernels (interpret mode) and through the xla backend: the same loss and gradients, in fp32.
  from pallas_kernels.situ_glu import pallas_gpu as situ_pallas_gpu
  with situ_pallas_gpu.configured(rows=16, cols=16):
    kernels = _three_layer_loss_and_grads((21, 30, 13), **{"moe.situ_backend": "pallas_gpu"})
  _assert_same_loss_and_grads(_three_layer_loss_and_grads((21, 30, 13), **{"moe.situ_backend": "xla"}),
                              kernels)
