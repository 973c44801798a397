"""QK-Clip on the real decoder structure (docs/maths.md §4.4–4.5).

A small K3Model (unscanned prefix, a 2-layer scanned stack, unscanned suffix; MLA in each part;
structure from eval_shape, MLA weights from eagerly built GatedMLAs, see `build_model`) is split
into (params, rest) exactly as TrainState does. Each MLA layer runs its own forward on
a random packed batch to fill `max_logit` ([H], or [L, H] in the stack); chosen heads are scaled
up first so that their logits exceed τ. The clipped logits are recomputed with a naive numpy fp64
formula from the fp32 weights.

Tolerances: logits after the clip equal γ_h × the old logits to 1e-5 relative (fp32 weights, fp64
arithmetic: only the rounding of the scaled fp32 weights enters); the new per-head max equals τ to
1e-5 relative. Unclipped heads, v columns, kv_a_proj (shared k^R), g_proj, o_proj and every
non-MLA parameter are compared bit-for-bit. Idempotence: fed the clipped maxima γ_h·S_h (= τ up
to one fp32 rounding), a second clip moves every weight by at most 1 ulp; fed a fresh forward's
maxima, heads whose fresh max is ≤ τ are bitwise unchanged and the others move by at most the
forward's own fp32 rounding (relative ≤ 1e-5).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from tests.configs import k3_tiny
from k3train.model import mla as mla_lib
from k3train.model.decoder import K3Model
from k3train.optim import qk_clip as qk
from k3train.tree_paths import path_names

TAU = 1.0
B, T, D = 2, 8, 16
H, NOPE, ROPE, V, KV_LORA = 3, 8, 4, 8, 8
SEG = np.array([[1] * 5 + [2] * 3, [1] * 8], np.int32)
LOGIT_RTOL = 1e-5

# (owner path, scanned-layer count or None) of every MLA layer in the config below.
OWNERS = {("prefix", "1", "mixer"): None, ("stack", "layers", "1", "mixer"): 2,
          ("suffix", "0", "mixer"): None}
# Per (owner, scan index): multiplier on each head's q_b_proj columns. Init logits are ~0.3 < τ;
# ×6 pushes a head's max over τ = 1. The suffix layer has no boosted head.
BOOST = {
    (("prefix", "1", "mixer"), None): (6.0, 1.0, 6.0),
    (("stack", "layers", "1", "mixer"), 0): (1.0, 6.0, 1.0),
    (("stack", "layers", "1", "mixer"), 1): (6.0, 6.0, 1.0),
    (("suffix", "0", "mixer"), None): (1.0, 1.0, 1.0),
}
UNITS = list(BOOST)


def small_config() -> ml_collections.ConfigDict:
  cfg = k3_tiny.get_config()
  m = cfg.model
  m.vocab_size, m.d_model, m.num_layers, m.mla_layers = 64, D, 7, (2, 4, 6, 7)
  m.num_dense_layers, m.dense_ffn_hidden, m.init_std = 1, 32, 0.1
  m.mla = ml_collections.ConfigDict(dict(
      num_heads=H, q_lora_rank=16, kv_lora_rank=KV_LORA, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
      v_head_dim=V, latent_norm_eps=1e-6, output_gate=True, backend="auto"))
  m.kda.num_heads, m.kda.head_dim = 1, 8
  m.moe.num_experts, m.moe.top_k, m.moe.latent_dim, m.moe.expert_hidden = 4, 2, 8, 8
  m.moe.num_shared_experts, m.moe.shared_hidden = 2, 16
  m.attn_res.block_size = 4
  return cfg


def make_mla(cfg, seed) -> mla_lib.GatedMLA:
  m = mla_lib.GatedMLA(cfg.model.mla, d_model=D, init_std=cfg.model.init_std, dtype=jnp.float32,
                       param_dtype=jnp.float32, rngs=nnx.Rngs(params=jax.random.key(seed, impl="rbg")))
  rng = np.random.default_rng(100 + seed)   # non-unit latent norm gains, so the reference checks them
  for norm in (m.q_a_norm, m.kv_a_norm):
    norm.scale[...] = jnp.asarray(rng.uniform(0.5, 1.5, norm.scale.shape), jnp.float32)
  return m


def build_model(cfg) -> K3Model:
  """The real K3Model structure (paths, scanned stack, Variable types and metadata) from
  eval_shape, without compiling its initialiser (≈10 s on CPU): every variable is filled with
  numpy noise, then each MLA layer (each scan slice) gets the weights of a GatedMLA built eagerly
  with nnx.Rngs(params=jax.random.key(seed, impl="rbg"))."""
  model = nnx.eval_shape(lambda: K3Model(cfg.model, rngs=nnx.Rngs(0)))
  rng = np.random.default_rng(0)
  for _, var in nnx.to_flat_state(nnx.state(model)):
    var.set_value(jnp.asarray(rng.normal(0.0, 0.1, var.shape), var.dtype))
  seed = 0
  for owner, n in OWNERS.items():
    mlas = [make_mla(cfg, seed + l) for l in range(n or 1)]
    seed += n or 1
    target = dict(nnx.to_flat_state(nnx.state(module_at(model, owner))))
    sources = [dict(nnx.to_flat_state(nnx.state(m))) for m in mlas]
    assert set(target) == set(sources[0])
    for path, var in target.items():
      values = [src[path][...] for src in sources]
      var.set_value(values[0] if n is None else jnp.stack(values))
  return model


def module_at(model, owner):
  node = model
  for n in owner:
    node = node[int(n)] if n.isdigit() else getattr(node, n)
  return node


@functools.partial(jax.jit, static_argnums=0)
def _max_logit(graphdef, state, x, seg):
  m = nnx.merge(graphdef, state)
  m(x, seg)
  return m.max_logit[...]


def forward_max_logit(model, owner, index, x):
  """The GatedMLA's own forward (scan slice `index` for stacked layers) → max_logit [H]."""
  graphdef, state = nnx.split(module_at(model, owner))
  if index is not None:
    state = jax.tree.map(lambda a: a[index], state)
  return _max_logit(graphdef, state, x, jnp.asarray(SEG))


def layer_weights(flat, owner, index):
  def get(*names):
    a = np.asarray(flat[owner + names], np.float64)
    return a if index is None else a[index]
  return dict(q_a=get("q_a_proj", "kernel"), q_a_norm=get("q_a_norm", "scale"),
              q_b=get("q_b_proj", "kernel"), kv_a=get("kv_a_proj", "kernel"),
              kv_a_norm=get("kv_a_norm", "scale"), kv_b=get("kv_b_proj", "kernel"))


def naive_logits(w, x):
  """fp64 scaled pre-softmax logits [B, H, T, S] (docs/maths.md §2.2) and the causal+document mask."""
  def rms(v, g):
    return v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + 1e-6) * g
  x = np.asarray(x, np.float64)
  q = np.einsum("btr,rhc->bthc", rms(x @ w["q_a"], w["q_a_norm"]), w["q_b"])
  kv_a = x @ w["kv_a"]
  k_r = kv_a[..., KV_LORA:]
  k_c = np.einsum("btr,rhc->bthc", rms(kv_a[..., :KV_LORA], w["kv_a_norm"]), w["kv_b"])[..., :NOPE]
  s = np.einsum("bthd,bshd->bhts", q[..., :NOPE], k_c) + np.einsum("bthd,bsd->bhts", q[..., NOPE:], k_r)
  mask = np.tril(np.ones((T, T), bool))[None] & (SEG[:, :, None] == SEG[:, None, :])
  return s / np.sqrt(NOPE + ROPE), mask[:, None]


def masked_max(s, mask):
  return np.where(mask, s, -np.inf).max(axis=(0, 2, 3))


def flat_params(params):
  return {tuple(path_names(p)): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}


def inputs(i):
  return jnp.asarray(np.random.default_rng(10 + i).standard_normal((B, T, D)), jnp.float32)


def fill_max_logits(model):
  """Runs every MLA layer's forward and stores its max_logit in the model; returns {unit: [H]}."""
  out = {u: forward_max_logit(model, *u, inputs(i)) for i, u in enumerate(UNITS)}
  for owner, n in OWNERS.items():
    value = out[(owner, None)] if n is None else jnp.stack([out[(owner, l)] for l in range(n)])
    module_at(model, owner).max_logit[...] = value
  return {u: np.asarray(v) for u, v in out.items()}


@pytest.fixture(scope="module")
def setup():
  cfg = small_config()
  model = build_model(cfg)
  for (owner, index), boost in BOOST.items():
    kernel = module_at(model, owner).q_b_proj.kernel
    factor = jnp.asarray(boost, jnp.float32)[:, None]                       # [H, 1] on [.., in, H, C]
    if index is None:
      kernel[...] = kernel[...] * factor
    else:
      kernel[...] = kernel[...].at[index].multiply(factor)
  s_old = fill_max_logits(model)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  clip = jax.jit(functools.partial(qk.qk_clip, tau=TAU, config=cfg))
  new_params, stats = clip(params, rest)
  return dict(cfg=cfg, graphdef=graphdef, params=params, rest=rest, s_old=s_old,
              new_params=new_params, stats=stats, clip=clip)


def gammas(s):
  return np.where(s > TAU, TAU / s, 1.0)


def test_setup_has_clipped_and_unclipped_heads(setup):
  clipped = {u: s > TAU for u, s in setup["s_old"].items()}
  for u, boost in BOOST.items():  # exactly the boosted heads exceed τ
    np.testing.assert_array_equal(clipped[u], np.asarray(boost) > 1, err_msg=str(u))
  # the module's max_logit is the naive formula's masked max
  flat = flat_params(setup["params"])
  for i, (owner, index) in enumerate(UNITS):
    s, mask = naive_logits(layer_weights(flat, owner, index), inputs(i))
    np.testing.assert_allclose(setup["s_old"][(owner, index)], masked_max(s, mask), rtol=2e-5)


def test_stats(setup):
  stats, s_old = setup["stats"], setup["s_old"]
  expected = {"mla_max_logit/prefix.1": s_old[UNITS[0]].max(),
              "mla_max_logit/stack.layers.1[0]": s_old[UNITS[1]].max(),
              "mla_max_logit/stack.layers.1[1]": s_old[UNITS[2]].max(),
              "mla_max_logit/suffix.0": s_old[UNITS[3]].max()}
  assert set(stats) == set(expected) | {"qk_clip_heads"}
  for k, v in expected.items():
    assert stats[k].shape == () and float(stats[k]) == v, k
  assert int(stats["qk_clip_heads"]) == sum(int((s > TAU).sum()) for s in s_old.values()) == 5


def test_logits_scale_by_gamma_and_max_becomes_tau(setup):
  old, new = flat_params(setup["params"]), flat_params(setup["new_params"])
  for i, (owner, index) in enumerate(UNITS):
    x = inputs(i)
    s_old, mask = naive_logits(layer_weights(old, owner, index), x)
    s_new, _ = naive_logits(layer_weights(new, owner, index), x)
    g = gammas(setup["s_old"][(owner, index)])
    expect = g[None, :, None, None] * s_old
    scale = np.abs(expect).max(axis=(0, 2, 3), keepdims=True)
    assert np.all(np.abs(s_new - expect) <= LOGIT_RTOL * scale), (owner, index)
    new_max = masked_max(s_new, mask)
    clipped = setup["s_old"][(owner, index)] > TAU
    np.testing.assert_allclose(new_max[clipped], TAU, rtol=LOGIT_RTOL)
    np.testing.assert_array_equal(s_new[:, ~clipped], s_old[:, ~clipped])  # same fp64 program, same weights


def test_weights_untouched_outside_clipped_qk_columns(setup):
  old, new = flat_params(setup["params"]), flat_params(setup["new_params"])
  owners = set(OWNERS)
  edited = {o + (k, "kernel") for o in owners for k in ("q_b_proj", "kv_b_proj")}
  assert set(old) == set(new)
  for path in old:
    assert new[path].dtype == old[path].dtype and new[path].shape == old[path].shape, path
    if path not in edited:   # kv_a_proj (shared k^R), g_proj, o_proj, norms, KDA, MoE, embeddings …
      np.testing.assert_array_equal(np.asarray(new[path]), np.asarray(old[path]), err_msg=str(path))
  for owner, index in UNITS:
    pick = (lambda a: np.asarray(a)) if index is None else (lambda a: np.asarray(a)[index])
    q_old, q_new = pick(old[owner + ("q_b_proj", "kernel")]), pick(new[owner + ("q_b_proj", "kernel")])
    kv_old, kv_new = pick(old[owner + ("kv_b_proj", "kernel")]), pick(new[owner + ("kv_b_proj", "kernel")])
    s = setup["s_old"][(owner, index)]
    np.testing.assert_array_equal(kv_new[..., NOPE:], kv_old[..., NOPE:])   # v columns, every head
    for h in range(H):
      if s[h] <= TAU:
        np.testing.assert_array_equal(q_new[:, h], q_old[:, h])
        np.testing.assert_array_equal(kv_new[:, h], kv_old[:, h])
      else:
        g = np.float32(TAU) / np.float32(s[h])
        np.testing.assert_allclose(q_new[:, h, :NOPE], q_old[:, h, :NOPE] * np.sqrt(g), rtol=1e-6)
        np.testing.assert_allclose(q_new[:, h, NOPE:], q_old[:, h, NOPE:] * g, rtol=1e-6)
        np.testing.assert_allclose(kv_new[:, h, :NOPE], kv_old[:, h, :NOPE] * np.sqrt(g), rtol=1e-6)
        assert not np.array_equal(q_new[:, h], q_old[:, h])


def test_metadata_and_structure_preserved(setup):
  params, new = setup["params"], setup["new_params"]
  assert type(new) is type(params)
  assert jax.tree.structure(new) == jax.tree.structure(params)
  old_vars, new_vars = dict(nnx.to_flat_state(params)), dict(nnx.to_flat_state(new))
  for path, var in old_vars.items():
    assert type(new_vars[path]) is type(var)
    assert new_vars[path].get_metadata("out_sharding", None) == var.get_metadata("out_sharding", None)


def test_module_forward_after_clip(setup):
  """The layer's own fp32 forward on the clipped weights: max = τ for clipped heads, else unchanged."""
  model = nnx.merge(setup["graphdef"], setup["new_params"], setup["rest"], copy=True)
  for i, u in enumerate(UNITS):
    s_new = np.asarray(forward_max_logit(model, *u, inputs(i)))
    s_old = setup["s_old"][u]
    np.testing.assert_allclose(s_new, np.where(s_old > TAU, TAU, s_old), rtol=LOGIT_RTOL)


def test_second_clip_is_a_no_op(setup):
  clip, new = setup["clip"], setup["new_params"]
  # (a) fed the clipped maxima γ·S (τ up to one fp32 rounding): every weight moves by ≤ 1 ulp.
  rest_a = _replace_max_logits(setup["rest"], lambda s: jnp.where(s > TAU, (TAU / s) * s, s))
  twice, stats = clip(new, rest_a)
  for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(twice)):
    a, b = np.asarray(a), np.asarray(b)
    assert np.all(np.abs(b - a) <= np.spacing(np.abs(a))), "more than 1 ulp"
  # (b) fed a fresh forward's maxima: heads with fresh max ≤ τ are bitwise unchanged, others move
  # by the forward's rounding only (≤ 1e-5 relative).
  model = nnx.merge(setup["graphdef"], new, setup["rest"], copy=True)
  fresh = fill_max_logits(model)
  _, _, rest_b = nnx.split(model, nnx.Param, ...)
  twice, _ = clip(new, rest_b)
  n_bitwise = 0
  old, again = flat_params(new), flat_params(twice)
  for owner, index in UNITS:
    for name in ("q_b_proj", "kv_b_proj"):
      a = np.asarray(old[owner + (name, "kernel")])
      b = np.asarray(again[owner + (name, "kernel")])
      if index is not None:
        a, b = a[index], b[index]
      for h in range(H):
        if fresh[(owner, index)][h] <= TAU:
          np.testing.assert_array_equal(b[:, h], a[:, h])
          n_bitwise += 1
        else:
          np.testing.assert_allclose(b[:, h], a[:, h], rtol=LOGIT_RTOL)
  assert n_bitwise >= 2 * 7  # at least the 7 never-clipped heads (q_b and kv_b each)


def _replace_max_logits(rest, fn):
  def edit(path, leaf):
    return fn(leaf) if path_names(path)[-1] == "max_logit" else leaf
  return jax.tree_util.tree_map_with_path(edit, rest)


def test_eager_equals_jit(setup):
  eager, stats = qk.qk_clip(setup["params"], setup["rest"], tau=TAU, config=setup["cfg"])
  for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(setup["new_params"])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-7, atol=0)
  assert int(stats["qk_clip_heads"]) == int(setup["stats"]["qk_clip_heads"])


@pytest.mark.parametrize("how", ["nope", "full_config", "model_config", "mla_config", "inferred"])
def test_nope_sources_agree(setup, how):
  cfg = setup["cfg"]
  kwargs = dict(nope=dict(nope=NOPE), full_config=dict(config=cfg), model_config=dict(config=cfg.model),
                mla_config=dict(config=cfg.model.mla), inferred={})[how]
  out, _ = qk.qk_clip(setup["params"], setup["rest"], tau=TAU, **kwargs)
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(setup["new_params"])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-7, atol=0)


def test_errors(setup):
  params, rest = setup["params"], setup["rest"]
  with pytest.raises(ValueError, match="disagrees"):
    qk.qk_clip(params, rest, tau=TAU, nope=NOPE + 1)
  with pytest.raises(ValueError, match="tau"):
    qk.qk_clip(params, rest, tau=0.0)
  no_kv_b = nnx.State({"prefix": {1: {"mixer": {"q_b_proj": {"kernel": jnp.zeros((16, H, NOPE + ROPE))}}}}})
  ml = nnx.State({"prefix": {1: {"mixer": {"max_logit": jnp.zeros((H,))}}}})
  with pytest.raises(ValueError, match="no matching"):
    qk.qk_clip(no_kv_b, ml, tau=TAU, nope=NOPE)


def test_clip_factors_edge_cases():
  s = jnp.array([-3.0, 0.0, 0.5, 1.0, 2.0, 4.0, jnp.nan, jnp.inf, -jnp.inf])
  gamma, sqrt_gamma, clipped = qk.clip_factors(s, 1.0)
  np.testing.assert_array_equal(gamma, [1, 1, 1, 1, 0.5, 0.25, 1, 1, 1])
  np.testing.assert_array_equal(sqrt_gamma, np.sqrt(np.asarray(gamma)))
  np.testing.assert_array_equal(clipped, [0, 0, 0, 0, 1, 1, 0, 0, 0])


def test_bfloat16_and_plain_dict_params():
  """Plain nested dicts work; a bf16 kernel's unclipped heads (and subnormals) stay bit-for-bit."""
  rng = np.random.default_rng(0)
  q_b = rng.standard_normal((4, H, NOPE + ROPE)).astype(np.float32)
  q_b[0, 1, 0] = 1e-40                                                     # a subnormal, head 1
  kv_b = rng.standard_normal((4, H, NOPE + V))
  params = {"mixer": {"q_b_proj": {"kernel": jnp.asarray(q_b, jnp.bfloat16)},
                      "kv_b_proj": {"kernel": jnp.asarray(kv_b, jnp.bfloat16)}}}
  assert 0 < float(params["mixer"]["q_b_proj"]["kernel"][0, 1, 0]) < np.finfo(np.float32).tiny
  rest = {"mixer": {"max_logit": jnp.array([4.0, 0.5, 1.0])}}
  out, stats = jax.jit(functools.partial(qk.qk_clip, tau=1.0, nope=NOPE))(params, rest)
  assert set(stats) == {"mla_max_logit/mixer", "qk_clip_heads"}
  assert float(stats["mla_max_logit/mixer"]) == 4.0
  assert int(stats["qk_clip_heads"]) == 1
  for name in ("q_b_proj", "kv_b_proj"):
    a, b = params["mixer"][name]["kernel"], out["mixer"][name]["kernel"]
    assert b.dtype == jnp.bfloat16
    bits = lambda x: np.asarray(x).view(np.uint16)  # noqa: E731
    np.testing.assert_array_equal(bits(b[:, 1:]), bits(a[:, 1:]))
  q_old, q_new = params["mixer"]["q_b_proj"]["kernel"], out["mixer"]["q_b_proj"]["kernel"]
  scaled = lambda x, f: (x.astype(jnp.float32) * f).astype(jnp.bfloat16)  # noqa: E731
  np.testing.assert_array_equal(q_new[:, 0, :NOPE], scaled(q_old[:, 0, :NOPE], 0.5))   # sqrt(γ) = 0.5
  np.testing.assert_array_equal(q_new[:, 0, NOPE:], scaled(q_old[:, 0, NOPE:], 0.25))  # γ = 0.25
