"""The MTP module (docs/maths.md §8) and its place in the model and the train step: causality
(§8 invariant 1), targets and masking across documents, the loss weight; the train loss as main CE
+ λ · MTP CE from the model's pieces, gradients into the module, gradient accumulation,
rematerialisation, counting / sharding / optimizer partition, the HF layout round trip, and a
short run through k3train.main."""

import json
import math
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from tests.conftest import CACHE_DIR
from tests.configs import CONFIG_DIR, k3_tiny, quick, quick_flags
from tests.model.test_decode import randomize
from k3train.model import counting
from k3train.model import mtp as mtp_lib
from k3train.model.decoder import K3Model, build_model
from k3train.optim import muon
from k3train.parallel import axes as ax
from k3train.parallel import rules as rules_lib
from k3train.train import step as step_lib
from k3train.tree_paths import path_names

TINY = str(CONFIG_DIR / "k3_tiny.py")


def mtp_config(**model):
  """k3_tiny with the MTP module on (and any other model.* values given)."""
  cfg = k3_tiny.get_config()
  cfg.model.mtp.enabled = True
  for key, value in model.items():
    cfg.model[key] = value
  return cfg


@pytest.fixture(scope="module")
def models():
  """The four-layer k3_tiny (tests/configs.py QUICK_MODEL) with an MTP module, every parameter
  moved off its initial value."""
  cfg = quick(mtp_config())
  model = randomize(build_model(cfg.model), seed=3)
  return model, model.mtp, cfg


def packed_batch(vocab: int, seed: int = 0) -> dict:
  """4 rows × 32 tokens of packed documents: boundaries at different places, padding at the end
  of rows 1 and 3 (so the two micro-batches of rows {0, 2} and {1, 3} count different numbers
  of main and MTP tokens)."""
  rng = np.random.default_rng(seed)
  full = rng.integers(8, vocab, (4, 33)).astype(np.int32)
  seg = np.ones((4, 33), np.int32)
  seg[0, 7:], seg[0, 20:] = 2, 3
  seg[1, 12:], seg[1, 25:] = 2, 0
  seg[2, 3:] = 2
  seg[3, 5:], seg[3, 9:], seg[3, 14:] = 2, 3, 0
  full[seg == 0] = 0
  return {"tokens": full[:, :-1], "targets": full[:, 1:], "segment_ids": seg[:, :-1],
          "loss_mask": ((seg[:, :-1] > 0) & (seg[:, :-1] == seg[:, 1:])).astype(np.float32)}


def ce_rows(logits_btv, targets_bt) -> np.ndarray:
  """Per-position cross-entropy in float64."""
  z = np.asarray(logits_btv, np.float64)
  m = z.max(-1, keepdims=True)
  logz = (m + np.log(np.exp(z - m).sum(-1, keepdims=True)))[..., 0]
  return logz - np.take_along_axis(z, np.asarray(targets_bt)[..., None], -1)[..., 0]


def test_mtp_logits_at_i_do_not_depend_on_tokens_after_i_plus_1(models):
  model, mtp, cfg = models
  t, i = 24, 10
  rng = np.random.default_rng(0)
  row = rng.integers(8, cfg.model.vocab_size, t + 1)
  other = row.copy()
  other[i + 2:] = rng.integers(8, cfg.model.vocab_size, t + 1 - (i + 2))   # tokens > i + 1
  batch = np.stack([row, other]).astype(np.int32)
  tokens, targets = jnp.asarray(batch[:, :-1]), jnp.asarray(batch[:, 1:])
  seg = jnp.ones_like(tokens)
  fn = nnx.jit(lambda m, p, x, y, s: mtp_lib.mtp_logits(m, p, x, y, s, (s > 0).astype(jnp.float32)))
  logits = np.asarray(fn(model, mtp, tokens, targets, seg))
  assert logits.shape == (2, t, cfg.model.vocab_size)
  np.testing.assert_array_equal(logits[0, :i + 1], logits[1, :i + 1])      # bit-identical
  # Control: position i + 1 reads t_{i+2}, which changed.
  assert np.abs(logits[0, i + 1] - logits[1, i + 1]).max() > 1e-4


def test_mtp_targets_are_masked_across_documents():
  # One row of T + 1 = 9 tokens: doc 1 = tokens 0..3, doc 2 = tokens 4..6, padding 7..8.
  tokens = np.array([10, 11, 12, 13, 20, 21, 22, 0, 0])
  seg_full = np.array([1, 1, 1, 1, 2, 2, 2, 0, 0])
  targets, seg = tokens[1:][None], seg_full[:-1][None]
  loss_mask = ((seg_full[:-1] != 0) & (seg_full[:-1] == seg_full[1:])).astype(np.float32)[None]
  tgt, mask = mtp_lib.mtp_targets(jnp.asarray(targets), jnp.asarray(loss_mask), jnp.asarray(seg))
  # Position i predicts t_{i+2}: valid iff t_i, t_{i+1}, t_{i+2} share a document.
  np.testing.assert_array_equal(np.asarray(tgt)[0, :6], tokens[2:8])
  np.testing.assert_array_equal(np.asarray(mask)[0], [1, 1, 0, 0, 1, 0, 0, 0])


def test_mtp_loss_is_the_weighted_sum_over_unmasked_positions_per_main_token():
  rng = np.random.default_rng(1)
  logits = jnp.asarray(rng.normal(size=(1, 8, 16)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 16, (1, 8)), jnp.int32)
  seg = jnp.asarray([[1, 1, 1, 1, 2, 2, 2, 2]])
  loss_mask = jnp.asarray([[1, 1, 1, 0, 1, 1, 1, 0]], jnp.float32)
  loss, n = mtp_lib.mtp_loss(logits, targets, loss_mask, seg, loss_weight=0.1)
  tgt, mask = mtp_lib.mtp_targets(targets, loss_mask, seg)
  logp = jax.nn.log_softmax(logits[0], axis=-1)
  keep = np.flatnonzero(np.asarray(mask[0]))
  # DeepSeek-V3's 1/T: the CE summed over the 4 MTP positions, divided by the 6 main loss tokens.
  want = -np.sum([float(logp[i, int(tgt[0, i])]) for i in keep]) / 6
  assert int(n) == len(keep) == 4
  np.testing.assert_allclose(float(loss), 0.1 * want, rtol=1e-6)
  # Logits at masked positions (document boundaries, the row end) do not enter the loss.
  masked = np.flatnonzero(np.asarray(mask[0]) == 0)
  noisy = logits.at[0, masked].add(100.0)
  np.testing.assert_allclose(float(mtp_lib.mtp_loss(noisy, targets, loss_mask, seg,
                                                    loss_weight=0.1)[0]), float(loss), rtol=1e-6)
  assert float(mtp_lib.mtp_loss(logits, targets, loss_mask, seg, loss_weight=0.0)[0]) == 0.0


# ----------------------------------------------------------------------------- in the train step


def test_train_loss_is_main_ce_plus_weighted_mtp_ce(models):
  """forward_loss = main CE + λ · Σ MTP CE / main loss tokens, against the model's full forward
  and `mtp_logits` scored here in float64 (fp32 model: 1e-5 relative); the MTP metrics are the
  per-position mean and the count of MTP positions."""
  model, _, cfg = models
  batch = packed_batch(cfg.model.vocab_size)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  loss, (new_rest, n_tokens) = jax.jit(
      lambda p, r, b: step_lib.forward_loss(graphdef, p, r, b))(params, rest, batch)
  metrics = step_lib.mtp_metrics(new_rest)

  def pieces(m, b):
    mask = (b["segment_ids"] > 0).astype(jnp.float32)
    return (m(b["tokens"], b["segment_ids"], mask),
            mtp_lib.mtp_logits(m, m.mtp, b["tokens"], b["targets"], b["segment_ids"], mask))

  main_logits, mtp_logits = nnx.jit(pieces)(model, batch)
  lm, seg, targets = batch["loss_mask"], batch["segment_ids"], batch["targets"]
  main = np.sum(ce_rows(main_logits, targets) * lm) / np.sum(lm)
  # Position i trains on t_{i+2} when t_i, t_{i+1}, t_{i+2} lie in one document.
  valid = np.zeros_like(lm)
  valid[:, :-1] = lm[:, 1:] * (seg[:, :-1] == seg[:, 1:]) * (seg[:, :-1] > 0)
  tgt = np.zeros_like(targets)
  tgt[:, :-1] = targets[:, 1:]
  mtp_sum = np.sum(ce_rows(mtp_logits, tgt) * valid)
  assert 0 < np.sum(valid) < np.sum(lm)          # the two normalisations differ here
  assert float(n_tokens) == np.sum(lm)
  np.testing.assert_allclose(float(loss), main + cfg.model.mtp.loss_weight * mtp_sum / np.sum(lm),
                             rtol=1e-5)
  np.testing.assert_allclose(float(metrics["mtp_loss"]), mtp_sum / np.sum(valid), rtol=1e-5)
  assert float(metrics["mtp_tokens"]) == np.sum(valid)


def test_gradients_reach_the_mtp_module_and_accumulate_exactly(models):
  """Every MTP parameter gets a finite gradient (the module's is not zero), and two micro-batches
  give the one-batch loss, gradients and MTP statistics (fp32 summation order: loss 1e-6
  relative, gradients 1e-5 × the largest one)."""
  model, _, cfg = models
  batch = {k: jnp.asarray(v) for k, v in packed_batch(cfg.model.vocab_size, seed=1).items()}
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def run(microbatches):
    fn = jax.jit(lambda p, r, b: step_lib.loss_and_grads(graphdef, p, r, b, microbatches))
    (loss, (new_rest, _)), grads = fn(params, rest, batch)
    return float(loss), step_lib.mtp_metrics(new_rest), grads

  loss1, stats1, grads1 = run(1)
  loss2, stats2, grads2 = run(2)
  flat = {".".join(path_names(p)): np.asarray(g)
          for p, g in jax.tree_util.tree_flatten_with_path(grads1)[0]}
  mtp_grads = {k: g for k, g in flat.items() if k.startswith("mtp.")}
  assert mtp_grads and all(np.isfinite(g).all() for g in mtp_grads.values())
  for key in ("mtp.proj.kernel", "mtp.mixer.kv_b_proj.kernel", "mtp.ffn.router.weight",
              "mtp.ffn.shared.down_proj.kernel", "mtp.final_norm.scale", "mtp.hidden_norm.scale"):
    assert np.abs(mtp_grads[key]).max() > 0, key
  np.testing.assert_allclose(loss2, loss1, rtol=1e-6)
  ones, twos = jax.tree.leaves(grads1), jax.tree.leaves(grads2)
  scale = max(float(np.abs(np.asarray(g)).max()) for g in ones)
  err = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(ones, twos))
  assert err <= 1e-5 * scale, (err, scale)
  np.testing.assert_allclose(float(stats2["mtp_loss"]), float(stats1["mtp_loss"]), rtol=1e-5)
  assert float(stats2["mtp_tokens"]) == float(stats1["mtp_tokens"]) > 0


def top_level_checkpoints(cfg) -> int:
  """Rematerialised calls (jax.checkpoint) at the top level of the traced train loss."""
  abstract = nnx.eval_shape(lambda: K3Model(cfg.model, rngs=nnx.Rngs(params=0)))
  graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
  batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in packed_batch(64).items()}
  jaxpr = jax.make_jaxpr(lambda p, r, b: step_lib.forward_loss(graphdef, p, r, b))(params, rest, batch)
  return sum(e.primitive.name in ("checkpoint", "remat", "remat2") for e in jaxpr.eqns)


def test_mtp_block_is_rematerialised_like_a_layer():
  without = k3_tiny.get_config()
  without.model.remat_policy = "full"
  assert top_level_checkpoints(mtp_config(remat_policy="full")) == top_level_checkpoints(without) + 1
  assert top_level_checkpoints(mtp_config(remat_policy="none")) == 0


def test_mtp_parameters_are_counted_sharded_and_partitioned():
  """The model owns the module: the counter reports its parameters apart (the text model's totals
  unchanged), the rule tables shard its MLA and MoE like the last decoder layer's (the same
  logical names), Muon knows every leaf."""
  cfg = mtp_config()
  abstract = nnx.eval_shape(lambda: K3Model(cfg.model, rngs=nnx.Rngs(params=0)))
  params = nnx.state(abstract, nnx.Param)
  variables = {".".join(path_names(p)): v for p, v in jax.tree_util.tree_flatten_with_path(
      params, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]}
  mtp_vars = {k: v for k, v in variables.items() if k.startswith("mtp.")}
  n_mtp = sum(math.prod(v.shape) for v in mtp_vars.values())
  assert n_mtp > 0
  counts = counting.count(cfg)
  assert counts["total_params"] == counting.count(k3_tiny.get_config())["total_params"]
  assert counts["mtp"]["total_params"] == n_mtp
  rules = rules_lib.get_rules("full")
  spec = lambda var: rules_lib.logical_to_spec(ax.names_of(var), rules)
  assert all(ax.names_of(v) for v in mtp_vars.values())
  twins = 0
  for key, var in mtp_vars.items():
    twin = variables.get("suffix.0." + key[len("mtp."):])          # the final MLA + MoE layer
    if twin is not None:
      assert spec(var) == spec(twin), key
      twins += 1
  assert twins >= 20
  assert muon.fallback_paths(params) == []
  assert muon.leaf_rule(["mtp", "proj", "kernel"], 2).group == "muon_matrix"
  assert "mtp/mixer/kv_b_proj/kernel" in muon.kv_b_block_sizes(params)


# ----------------------------------------------------------------------------- release layout


def hand_mtp_tensors(model, cfg) -> dict:
  """The release's model.mtp.* tensors, written out from the K3 naming and PyTorch layouts
  (independently of k3train/tools/hf_layout.py): the decoder layers' MLA and MoE sub-names."""
  from tests.tools.test_hf import flat_state
  flat = flat_state(model)
  get = lambda sub: flat[f"mtp.{sub}"]
  t = lambda w2d: np.ascontiguousarray(np.asarray(w2d).T)     # [in, out] → PyTorch [out, in]
  m, d = cfg.model, cfg.model.d_model
  ml, h = m.mla, m.mla.num_heads
  p = "model.mtp."
  out = {p + "hnorm.weight": get("hidden_norm.scale"), p + "enorm.weight": get("embed_norm.scale"),
         p + "eh_proj.weight": t(get("proj.kernel")),
         p + "input_layernorm.weight": get("attn_norm.scale"),
         p + "post_attention_layernorm.weight": get("mlp_norm.scale"),
         p + "norm.weight": get("final_norm.scale")}
  a = p + "self_attn."
  q_head, kv_head = ml.qk_nope_head_dim + ml.qk_rope_head_dim, ml.qk_nope_head_dim + ml.v_head_dim
  out[a + "q_a_proj.weight"] = t(get("mixer.q_a_proj.kernel"))
  out[a + "q_a_layernorm.weight"] = get("mixer.q_a_norm.scale")
  out[a + "q_b_proj.weight"] = t(get("mixer.q_b_proj.kernel").reshape(ml.q_lora_rank, h * q_head))
  out[a + "kv_a_proj_with_mqa.weight"] = t(get("mixer.kv_a_proj.kernel"))
  out[a + "kv_a_layernorm.weight"] = get("mixer.kv_a_norm.scale")
  out[a + "kv_b_proj.weight"] = t(get("mixer.kv_b_proj.kernel").reshape(ml.kv_lora_rank, h * kv_head))
  out[a + "g_proj.weight"] = t(get("mixer.g_proj.kernel").reshape(d, h * ml.v_head_dim))
  out[a + "o_proj.weight"] = t(get("mixer.o_proj.kernel").reshape(h * ml.v_head_dim, d))
  b = p + "block_sparse_moe."
  out[b + "gate.weight"] = t(get("ffn.router.weight"))
  out[b + "gate.e_score_correction_bias"] = get("ffn.router.bias")
  out[b + "routed_expert_down_proj.weight"] = t(get("ffn.down_proj.kernel"))
  out[b + "routed_expert_up_proj.weight"] = t(get("ffn.up_proj.kernel"))
  out[b + "routed_expert_norm.weight"] = get("ffn.latent_norm.scale")
  for n in ("gate_proj", "up_proj", "down_proj"):
    out[b + f"shared_experts.{n}.weight"] = t(get(f"ffn.shared.{n}.kernel"))
  for src, dst in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
    for e in range(m.moe.num_experts):
      out[b + f"experts.{e}.{dst}.weight"] = t(get(f"ffn.experts.{src}")[e])
  return {k: v.astype(np.float32 if k.endswith("e_score_correction_bias") else ml_dtypes.bfloat16)
          for k, v in out.items()}


def test_release_with_mtp_round_trips_bit_for_bit(tmp_path):
  """A release holding model.mtp.* imports into a model with the MTP module (its parameters
  are the release's) and exports back bit for bit, in the same shards."""
  from safetensors.numpy import save_file
  from k3train.model import moe
  from k3train.tools import hf
  from tests.tools import test_hf as hf_test
  cfg = mtp_config()
  model = build_model(cfg.model)
  values = nnx.state(model, nnx.Any(nnx.Param, moe.RouterBias))
  nnx.update(model, jax.jit(lambda s: jax.tree.map(   # bf16-exact values, off their initial ones
      lambda x: (x + 0.05 * jnp.sin(jnp.arange(x.size, dtype=x.dtype).reshape(x.shape)))
      .astype(jnp.bfloat16).astype(x.dtype), s))(values))
  tensors = {**hf_test.hand_tensors(model, cfg, mxfp4=False), **hand_mtp_tensors(model, cfg)}
  src, work, out = (str(tmp_path / n) for n in ("release", "run", "out"))
  os.makedirs(src)
  mtp_names = sorted(k for k in tensors if k.startswith("model.mtp."))
  shards = {"model-00001-of-00002.safetensors": {k: v for k, v in tensors.items() if k not in mtp_names},
            "model-00002-of-00002.safetensors": {k: tensors[k] for k in mtp_names}}
  for name, part in shards.items():
    save_file(part, os.path.join(src, name), metadata={"format": "pt"})
  with open(os.path.join(src, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": sum(v.nbytes for v in tensors.values())},
               "weight_map": {k: f for f, part in shards.items() for k in part}}, f)
  with open(os.path.join(src, "config.json"), "w") as f:
    json.dump(hf_test.hand_config(cfg), f)
  with open(os.path.join(src, "tokenizer_config.json"), "w") as f:
    json.dump({}, f)
  mtp_on = "--config.model.mtp.enabled=true"
  assert hf.main(["hf", "import", f"--hf_checkpoint={src}", f"--workdir={work}",
                  f"--config={TINY}", mtp_on]) == 0
  imported, _ = hf.load_workdir_model(work)
  want, got = hf_test.flat_state(model), hf_test.flat_state(imported)
  mtp_keys = [k for k in want if k.startswith("mtp.") and k != "mtp.stats"
              and not k.endswith(("expert_load", "qb_pending", "max_logit"))]
  assert len(mtp_keys) > 20
  for key in mtp_keys:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)
  assert hf.main(["hf", "export", f"--workdir={work}", f"--out={out}"]) == 0
  hf_test.assert_same_release(src, out)


# ----------------------------------------------------------------------------- a short run

RUN_STEPS = 16


def tiny_mtp_run_argv(workdir) -> list[str]:
  """k3train.main on the four-layer k3_tiny with the MTP module, an eval at the last step
  (tests/tools/test_eval.py runs the same command, so the compiled step comes from the
  persistent cache)."""
  return ["k3train.main", f"--config={TINY}", f"--workdir={workdir}",
          f"--compilation_cache_dir={CACHE_DIR}", "--config.model.mtp.enabled=true", *quick_flags(),
          f"--config.train.steps={RUN_STEPS}", f"--config.eval.every_steps={RUN_STEPS}",
          "--config.train.log_every=4"]


def test_tiny_run_with_mtp_trains_through_main(tmp_path):
  from k3train import main as main_lib
  assert main_lib.main(tiny_mtp_run_argv(tmp_path)) == 0
  with open(tmp_path / "metrics.jsonl") as f:
    rows = [json.loads(line) for line in f]
  assert [r["step"] for r in rows] == list(range(1, RUN_STEPS + 1))
  for key in ("loss", "mtp_loss", "mtp_tokens"):
    assert all(math.isfinite(r[key]) for r in rows), key
  assert all(r["mtp_tokens"] > 0 for r in rows)
  first = lambda k: np.mean([r[k] for r in rows[:4]])
  last = lambda k: np.mean([r[k] for r in rows[-4:]])
  # log(4096) = 8.3 at init; the tiny model picks up token statistics within a few steps.
  assert last("loss") < first("loss") - 0.3, (first("loss"), last("loss"))
  assert last("mtp_loss") < first("mtp_loss") - 0.1, (first("mtp_loss"), last("mtp_loss"))
