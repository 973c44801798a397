"""Per-head / per-expert Muon (docs/maths.md §4): the parameter partition and the optimizer's updates.

Muon updates are compared against an explicit Newton–Schulz written here from docs/maths.md §4.1, run
in float64 on each head / expert / layer block separately; those comparisons run the optimizer's
Newton–Schulz in float32 (`ns_dtype="float32"`), and one test bounds the default bfloat16 path
against it. At the first step the bias-corrected Nesterov momentum is a positive multiple of the
gradient, mu_hat = (1 + β/(1+β))·G, which the reference applies before its Frobenius
normalisation so that the ε term matches too.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from tests.configs import k3_full, k3_tiny
from k3train.model.decoder import K3Model
from k3train.optim import muon
from k3train.tree_paths import path_names

COEFFS = (3.4445, -4.7750, 2.0315)
BETA = 0.95
RMS = 0.2
NS_EPS = 1e-8
TOL = 1e-5

# Names that must never be orthogonalised (docs/maths.md §4.5.4), plus the router (AdamW by K3 choice).
ADAMW_NAMES = {"embedding", "lm_head", "scale", "A_log", "dt_bias", "q_conv", "k_conv", "v_conv",
               "query", "norm_scale", "router"}
EXPECTED_GROUP = {
    **{n: "muon_per_head" for n in ("q_proj", "k_proj", "v_proj", "g_proj", "f_b_proj", "o_proj",
                                     "q_b_proj", "kv_b_proj")},
    **{n: "muon_matrix" for n in ("q_a_proj", "kv_a_proj", "f_a_proj", "b_proj", "gate_proj",
                                   "up_proj", "down_proj", "proj")},
}


def ns_reference(g: np.ndarray, steps: int = 5) -> np.ndarray:
  """Quintic Newton–Schulz of docs/maths.md §4.1 on one 2-D block, float64."""
  x = np.asarray(g, np.float64)
  x = x / (np.linalg.norm(x) + NS_EPS)
  transposed = x.shape[0] > x.shape[1]
  if transposed:
    x = x.T
  a, b, c = COEFFS
  for _ in range(steps):
    gram = x @ x.T
    x = a * x + (b * gram + c * gram @ gram) @ x
  return x.T if transposed else x


def muon_block_reference(g_block: np.ndarray) -> np.ndarray:
  """First-step Muon update direction (lr = 1, no decay) of one [m, n] block."""
  mu_hat = (1.0 + BETA / (1.0 + BETA)) * np.asarray(g_block, np.float64)
  m, n = g_block.shape
  return -RMS * math.sqrt(max(m, n)) * ns_reference(mu_hat)


def first_update(params, grads, *, lr=1.0, wd=0.0, **kw):
  kw.setdefault("ns_dtype", "float32")      # the float64 references need the fp32 iteration
  tx = muon.make_muon_optimizer(learning_rate=lr, params_like=params, weight_decay=wd,
                                momentum=BETA, rms_scale=RMS, **kw)
  state = tx.init(params)
  updates, _ = jax.jit(tx.update)(grads, state, params)
  return jax.tree.map(np.asarray, updates)


def gaussian_like(tree, seed):
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32), tree)


# ---------------------------------------------------------------------------------------------
# Partition


def _abstract_params(cfg_module):
  model = nnx.eval_shape(lambda: K3Model(cfg_module.get_config().model, rngs=nnx.Rngs(0)))
  return nnx.state(model, nnx.Param)


@pytest.mark.parametrize("cfg_module", [k3_tiny, k3_full], ids=["k3_tiny", "k3_full"])
def test_every_parameter_in_exactly_one_group(cfg_module):
  params = _abstract_params(cfg_module)
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  is_dim = lambda x: x is None or isinstance(x, optax.contrib.MuonDimensionNumbers)
  dims = jax.tree_util.tree_leaves(muon.muon_dimension_numbers(params), is_leaf=is_dim)
  assert len(dims) == len(flat)
  assert muon.fallback_paths(params) == []

  summary = muon.partition_summary(params)
  assert set(summary) == set(muon.GROUPS)
  assert sum(n for n, _ in summary.values()) == len(flat)
  assert sum(p for _, p in summary.values()) == sum(math.prod(x.shape) for _, x in flat)
  assert all(n > 0 for n, _ in summary.values())

  for (path, leaf), dim in zip(flat, dims):
    names = path_names(path)
    rule = muon.leaf_rule(names, leaf.ndim)
    assert (rule.group == "adamw") == (dim is None), names
    if ADAMW_NAMES & set(names[-2:]):
      assert rule.group == "adamw" and dim is None, names
      assert rule.decay == (names[-1] == "embedding" or names[-2] in ("lm_head", "router")), names
    elif names[-2] == "experts":
      assert rule.group == "muon_per_expert", names
      assert dim.reduction_axis == leaf.ndim - 2 and dim.output_axis == leaf.ndim - 1, names
    else:
      assert rule.group == EXPECTED_GROUP[names[-2]], names
      assert rule.decay, names
    if dim is not None:
      lead = 1 if names[0] == "stack" else 0
      batch = set(range(leaf.ndim)) - {dim.reduction_axis, dim.output_axis}
      assert len(batch) == leaf.ndim - 2 and (not lead or 0 in batch), names

  text = muon.format_partition(summary)
  assert all(g in text for g in muon.GROUPS)


@pytest.mark.parametrize("cfg_module,expected", [(k3_tiny, (32, 32)), (k3_full, (128, 128))],
                         ids=["k3_tiny", "k3_full"])
def test_kv_b_block_sizes(cfg_module, expected):
  m = cfg_module.get_config().model.mla
  assert expected == (m.qk_nope_head_dim, m.v_head_dim)
  sizes = muon.kv_b_block_sizes(_abstract_params(cfg_module))
  assert sizes and all(s == expected for s in sizes.values())
  assert any(k.startswith("stack/") for k in sizes)


# ---------------------------------------------------------------------------------------------
# Per-head, per-expert and kv_b blocks against an explicit loop


def test_per_head_update_equals_loop_over_heads():
  d, h, k, layers = 48, 3, 16, 2
  params = {
      "prefix": {"0": {"mixer": {"q_proj": {"kernel": jnp.zeros((d, h, k))},
                                 "o_proj": {"kernel": jnp.zeros((h, k, d))}}}},
      "stack": {"layers": {"0": {"mixer": {"q_proj": {"kernel": jnp.zeros((layers, d, h, k))}}}}},
  }
  grads = gaussian_like(params, 0)
  upd = first_update(params, grads)

  g = np.asarray(grads["prefix"]["0"]["mixer"]["q_proj"]["kernel"])
  u = upd["prefix"]["0"]["mixer"]["q_proj"]["kernel"]
  for i in range(h):
    np.testing.assert_allclose(u[:, i, :], muon_block_reference(g[:, i, :]), atol=TOL, rtol=0)

  g = np.asarray(grads["prefix"]["0"]["mixer"]["o_proj"]["kernel"])
  u = upd["prefix"]["0"]["mixer"]["o_proj"]["kernel"]
  for i in range(h):
    np.testing.assert_allclose(u[i], muon_block_reference(g[i]), atol=TOL, rtol=0)

  g = np.asarray(grads["stack"]["layers"]["0"]["mixer"]["q_proj"]["kernel"])
  u = upd["stack"]["layers"]["0"]["mixer"]["q_proj"]["kernel"]
  for layer in range(layers):
    for i in range(h):
      np.testing.assert_allclose(u[layer, :, i, :], muon_block_reference(g[layer, :, i, :]),
                                 atol=TOL, rtol=0)
  # Not whole-matrix Muon: that would differ from the per-head result.
  whole = muon_block_reference(np.asarray(grads["prefix"]["0"]["mixer"]["q_proj"]["kernel"]).reshape(d, h * k))
  assert np.abs(whole.reshape(d, h, k) - upd["prefix"]["0"]["mixer"]["q_proj"]["kernel"]).max() > 1e-2


def test_expert_update_equals_loop_over_experts():
  e, lat, hid, layers = 4, 24, 40, 2
  params = {
      "prefix": {"1": {"ffn": {"experts": {"gate": jnp.zeros((e, lat, hid)),
                                           "down": jnp.zeros((e, hid, lat))}}}},
      "stack": {"layers": {"0": {"ffn": {"experts": {"up": jnp.zeros((layers, e, lat, hid))}}}}},
  }
  grads = gaussian_like(params, 1)
  upd = first_update(params, grads)
  for name in ("gate", "down"):
    g = np.asarray(grads["prefix"]["1"]["ffn"]["experts"][name])
    u = upd["prefix"]["1"]["ffn"]["experts"][name]
    for j in range(e):
      np.testing.assert_allclose(u[j], muon_block_reference(g[j]), atol=TOL, rtol=0)
  g = np.asarray(grads["stack"]["layers"]["0"]["ffn"]["experts"]["up"])
  u = upd["stack"]["layers"]["0"]["ffn"]["experts"]["up"]
  for layer in range(layers):
    for j in range(e):
      np.testing.assert_allclose(u[layer, j], muon_block_reference(g[layer, j]), atol=TOL, rtol=0)


@pytest.mark.parametrize("nope,v", [(32, 32), (24, 16)])
def test_kv_b_k_and_v_are_separate_blocks(nope, v):
  kv_lora, h, d = 32, 2, 48
  params = {"mixer": {"kv_b_proj": {"kernel": jnp.zeros((kv_lora, h, nope + v))},
                      "o_proj": {"kernel": jnp.zeros((h, v, d))}}}
  assert muon.kv_b_block_sizes(params) == {"mixer/kv_b_proj/kernel": (nope, v)}
  grads = gaussian_like(params, 2)
  g = np.asarray(grads["mixer"]["kv_b_proj"]["kernel"])
  perturbed = g.copy()
  perturbed[..., nope:] = 5.0 * np.random.default_rng(3).standard_normal(perturbed[..., nope:].shape)
  grads2 = {"mixer": {"kv_b_proj": {"kernel": jnp.asarray(perturbed)},
                      "o_proj": grads["mixer"]["o_proj"]}}

  u1 = first_update(params, grads)["mixer"]["kv_b_proj"]["kernel"]
  u2 = first_update(params, grads2)["mixer"]["kv_b_proj"]["kernel"]
  np.testing.assert_allclose(u1[..., :nope], u2[..., :nope], atol=1e-7, rtol=0)
  assert np.abs(u1[..., nope:] - u2[..., nope:]).max() > 1e-2
  for i in range(h):
    np.testing.assert_allclose(u1[:, i, :nope], muon_block_reference(g[:, i, :nope]), atol=TOL, rtol=0)
    np.testing.assert_allclose(u1[:, i, nope:], muon_block_reference(g[:, i, nope:]), atol=TOL, rtol=0)


def test_update_rms_of_a_matrix_block():
  params = {"ffn": {"shared": {"up_proj": {"kernel": jnp.zeros((512, 256))}},
                    "down_proj": {"kernel": jnp.zeros((128, 384))}}}
  upd = first_update(params, gaussian_like(params, 4))
  for u in jax.tree.leaves(upd):
    rms = float(np.sqrt(np.mean(np.square(u))))
    assert 0.15 <= rms <= 0.21, rms


def test_bf16_newton_schulz_agrees_with_fp32():
  """The default bfloat16 Newton–Schulz stays within 4e-2 relative Frobenius error of the fp32 path.

  bfloat16 keeps 8 significant bits (unit round-off 2^-9 ≈ 2e-3), and each quintic step multiplies
  perturbations along small singular values by up to its slope at 0 (a = 3.4445), so five steps
  leave a few per cent in the update direction: measured 1.4–2.9e-2 on these blocks. Each block is
  still as orthogonal as the fp32 one (the update RMS is checked), which is what Muon needs.
  """
  params = {"mixer": {"q_proj": {"kernel": jnp.zeros((64, 4, 32))},
                      "o_proj": {"kernel": jnp.zeros((4, 32, 64))}},
            "ffn": {"experts": {"up": jnp.zeros((4, 48, 96))},
                    "shared": {"down_proj": {"kernel": jnp.zeros((256, 128))}}}}
  grads = gaussian_like(params, 11)
  fp32 = first_update(params, grads, ns_dtype="float32")
  bf16 = first_update(params, grads, ns_dtype="bfloat16")
  for (path, u16), u32 in zip(jax.tree_util.tree_flatten_with_path(bf16)[0], jax.tree.leaves(fp32)):
    assert u16.dtype == np.float32, path_names(path)
    err = np.linalg.norm(u16 - u32) / np.linalg.norm(u32)
    assert err <= 4e-2, (path_names(path), err)
    rms16, rms32 = (float(np.sqrt(np.mean(np.square(u)))) for u in (u16, u32))
    assert abs(rms16 - rms32) <= 1e-2 * rms32, (path_names(path), rms16, rms32)


def test_matches_optax_contrib_muon_over_steps():
  """With fp32 Newton–Schulz the Muon chain equals optax.contrib.muon (Nesterov, consistent RMS,
  masked decoupled decay, scheduled lr) over several steps, to float32 round-off."""
  shapes = {"mixer": {"q_proj": {"kernel": jnp.zeros((48, 3, 16))},
                      "q_a_proj": {"kernel": jnp.zeros((64, 24))}},
            "stack": {"l": {"ffn": {"experts": {"up": jnp.zeros((2, 4, 24, 40))}}}}}
  params = gaussian_like(shapes, 12)
  lr = optax.linear_schedule(1e-2, 1e-3, 10)
  ours = muon.muon_matrices(lr, weight_decay=0.1, momentum=BETA, rms_scale=RMS, ns_dtype="float32")
  ref = optax.contrib.muon(lr, beta=BETA, weight_decay=0.1, weight_decay_mask=muon._decay_mask,
                           nesterov=True, muon_weight_dimension_numbers=muon.muon_dimension_numbers,
                           consistent_rms=RMS)
  state, ref_state = ours.init(params), ref.init(params)
  for seed in range(13, 17):
    grads = gaussian_like(params, seed)
    upd, state = jax.jit(ours.update)(grads, state, params)
    want, ref_state = jax.jit(ref.update)(grads, ref_state, params)
    for u, w in zip(jax.tree.leaves(upd), jax.tree.leaves(want)):
      np.testing.assert_allclose(u, w, atol=1e-5 * float(np.max(np.abs(w))), rtol=0)


# ---------------------------------------------------------------------------------------------
# Weight decay and the whole tiny model


def test_weight_decay_only_on_matrices():
  lr, wd = 0.01, 0.1
  params = {
      "embed": {"embedding": jnp.zeros((32, 16))},
      "lm_head": {"kernel": jnp.zeros((16, 32))},
      "mixer": {"q_a_proj": {"kernel": jnp.zeros((16, 24))},
                "q_proj": {"kernel": jnp.zeros((16, 3, 4))},
                "kv_b_proj": {"kernel": jnp.zeros((8, 3, 8))},
                "o_proj": {"kernel": jnp.zeros((3, 4, 16))},
                "A_log": jnp.zeros((3,)), "dt_bias": jnp.zeros((3, 4)),
                "q_conv": jnp.zeros((4, 3, 4)), "o_norm": {"scale": jnp.zeros((4,))}},
      "ffn": {"router": {"weight": jnp.zeros((16, 8))},
              "experts": {"gate": jnp.zeros((8, 16, 4))}},
      "attn_norm": {"scale": jnp.zeros((16,))},
      "attn_res": {"query": jnp.zeros((16,)), "norm_scale": jnp.zeros((16,))},
  }
  params = gaussian_like(params, 5)
  zeros = jax.tree.map(jnp.zeros_like, params)
  upd = first_update(params, zeros, lr=lr, wd=wd)
  decayed = {"embedding", "lm_head", "q_a_proj", "q_proj", "kv_b_proj", "o_proj", "router", "experts"}
  for (path, u), w in zip(jax.tree_util.tree_flatten_with_path(upd)[0], jax.tree.leaves(params)):
    names = path_names(path)
    if decayed & set(names):
      np.testing.assert_allclose(u, -lr * wd * np.asarray(w), rtol=1e-6, atol=1e-9, err_msg=str(names))
    else:
      np.testing.assert_array_equal(u, 0.0, err_msg=str(names))


def test_adamw_group_is_plain_masked_adamw():
  """AdamW leaves follow optax.adamw(b1, b2, eps) without Nesterov, decayed only where masked."""
  lr, wd = 0.01, 0.1
  params = gaussian_like({"embed": {"embedding": jnp.zeros((32, 16))},
                          "attn_norm": {"scale": jnp.zeros((16,))},
                          "mixer": {"q_a_proj": {"kernel": jnp.zeros((16, 24))}}}, 8)
  tx = muon.make_muon_optimizer(learning_rate=lr, params_like=params, weight_decay=wd)
  ref = {"embedding": optax.adamw(lr, b1=0.9, b2=0.95, eps=1e-8, weight_decay=wd),
         "scale": optax.adamw(lr, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.0)}
  leaves = {"embedding": params["embed"]["embedding"], "scale": params["attn_norm"]["scale"]}
  state, ref_state = tx.init(params), {k: ref[k].init(leaves[k]) for k in ref}
  for seed in (9, 10):
    grads = gaussian_like(params, seed)
    upd, state = tx.update(grads, state, params)
    for k, g in (("embedding", grads["embed"]["embedding"]), ("scale", grads["attn_norm"]["scale"])):
      want, ref_state[k] = ref[k].update(g, ref_state[k], leaves[k])
      got = upd["embed"]["embedding"] if k == "embedding" else upd["attn_norm"]["scale"]
      np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9, err_msg=k)


def test_one_jitted_step_on_tiny_model_changes_every_leaf():
  params = _abstract_params(k3_tiny)
  rng = np.random.default_rng(6)
  params = jax.tree.map(lambda x: jnp.asarray(0.02 * rng.standard_normal(x.shape), x.dtype), params)
  grads = gaussian_like(params, 7)
  tx = muon.make_muon_optimizer(learning_rate=optax.linear_schedule(1e-2, 1e-3, 100),
                                params_like=params, grad_clip_norm=1.0)
  state = jax.jit(tx.init)(params)

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  # Compile fast rather than well (as decoder.build_model does): the optimizer is ~2k tiny dots.
  fast = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
  compiled = jax.jit(step).lower(params, state, grads).compile(compiler_options=fast)
  new_params, new_state = compiled(params, state, grads)

  assert jax.tree.structure(new_params) == jax.tree.structure(params)
  for (path, new), old in zip(jax.tree_util.tree_flatten_with_path(new_params)[0], jax.tree.leaves(params)):
    new = np.asarray(new)
    assert np.all(np.isfinite(new)), path_names(path)
    # Every leaf moves; single elements may round back (an update of ~1e-10 on a 0.02 weight).
    assert np.mean(new != np.asarray(old)) > 0.99, path_names(path)
  # kv_b's momentum lives in two blocks (k^C, v) in the optimizer state.
  mu_paths = [".".join(path_names(p)) for p, _ in jax.tree_util.tree_flatten_with_path(new_state)[0]]
  assert any(p.endswith("kv_b_proj.kernel.block0") for p in mu_paths)
  assert any(p.endswith("kv_b_proj.kernel.block1") for p in mu_paths)
