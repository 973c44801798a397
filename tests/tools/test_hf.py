"""Hugging Face K3 import / export, logits and generate tools, on a tiny K3 in the release layout.

The release is written here by hand (names, transposes, dtypes, shards and the MXFP4 packing
spelled out independently of k3train/tools/hf_layout.py), from a tiny k3train model whose
parameters are moved off their initial values and rounded to what bf16 (and MXFP4 for the
packed variant) can hold. Then: import → logits equal k3train's own forward; the imported run
restores as k3train.main would; export reproduces every tensor bit for bit in the same shards;
malformed releases are refused naming the tensor or key, leaving no workdir behind.
"""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from tests.configs import CONFIG_DIR, k3_tiny
from tests.params import perturbed
from k3train import config as config_lib
from k3train.model import moe
from k3train.model.decoder import build_model
from k3train.model.mtp import MTPModule
from k3train.quant import mx
from k3train.tools import generate, hf, hf_layout, logits
from k3train.tree_paths import path_names

TINY = str(CONFIG_DIR / "k3_tiny.py")
F32_PARTS = ("A_log", "dt_bias", "e_score_correction_bias", "conv1d.weight", "self_attn.o_norm.weight")


# ----------------------------------------------------------------------------- the release, by hand


def reference_model(mxfp4: bool):
  """The tiny k3train model whose values the release holds (bf16-exact; experts MXFP4-exact)."""
  cfg = k3_tiny.get_config()
  model = build_model(cfg.model)
  rng = np.random.default_rng(7)

  def value(x):
    noisy = perturbed(x, rng, 0.3)
    return jax.device_put(noisy.astype(ml_dtypes.bfloat16).astype(x.dtype), x.sharding)

  params = jax.tree.map(value, nnx.state(model, nnx.Any(nnx.Param, moe.RouterBias)))
  if mxfp4:
    params = jax.jit(lambda p: moe.fake_quant_expert_weights(p, moe.ExpertQuant()))(params)
  nnx.update(model, params)
  return model, cfg


def flat_state(model):
  state = nnx.state(model)
  return {".".join(path_names(p)): np.asarray(v)
          for p, v in jax.tree_util.tree_flatten_with_path(state)[0]}


def hand_config(cfg):
  m = cfg.model
  return {
      "architectures": ["KimiK3ForCausalLM"], "model_type": "kimi_k3", "torch_dtype": "bfloat16",
      "transformers_version": "4.57.0", "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
      "vocab_size": m.vocab_size, "hidden_size": m.d_model, "num_hidden_layers": m.num_layers,
      "intermediate_size": m.dense_ffn_hidden, "first_k_dense_replace": m.num_dense_layers,
      "rms_norm_eps": m.norm_eps, "initializer_range": 0.02, "hidden_act": "situ",
      "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
      "attn_res_block_size": m.attn_res.block_size, "num_attention_heads": m.mla.num_heads,
      "num_key_value_heads": m.mla.num_heads, "q_lora_rank": m.mla.q_lora_rank,
      "kv_lora_rank": m.mla.kv_lora_rank, "qk_nope_head_dim": m.mla.qk_nope_head_dim,
      "qk_rope_head_dim": m.mla.qk_rope_head_dim, "v_head_dim": m.mla.v_head_dim,
      "mla_use_nope": True, "mla_use_output_gate": True, "num_experts": m.moe.num_experts,
      "num_experts_per_token": m.moe.top_k, "num_shared_experts": m.moe.num_shared_experts,
      "moe_intermediate_size": m.moe.expert_hidden, "routed_expert_hidden_size": m.moe.latent_dim,
      "routed_scaling_factor": 1.0, "moe_renormalize": True, "latent_moe_use_norm": True,
      "moe_router_activation_func": "sigmoid", "num_expert_group": 1, "topk_group": 1,
      "topk_method": "noaux_tc", "moe_layer_freq": 1, "use_grouped_topk": True,
      "max_position_embeddings": 1048576, "tie_word_embeddings": False,
      "num_nextn_predict_layers": 0,
      "linear_attn_config": {
          "head_dim": m.kda.head_dim, "num_heads": m.kda.num_heads, "short_conv_kernel_size": 4,
          "full_attn_layers": list(m.mla_layers),
          "kda_layers": [i for i in range(1, m.num_layers + 1) if i not in m.mla_layers],
          "use_full_rank_gate": True, "gate_lower_bound": -5.0}}


def hand_tensors(model, cfg, mxfp4: bool) -> dict:
  """Every release tensor, written out from the K3 naming and PyTorch layouts."""
  flat = flat_state(model)
  m = cfg.model
  sched = config_lib.layer_schedule(m)
  d = m.d_model

  def get(i, sub):
    if i < sched.prefix:
      return flat[f"prefix.{i}.{sub}"]
    if i >= sched.suffix_start:
      return flat[f"suffix.{i - sched.suffix_start}.{sub}"]
    s, j = divmod(i - sched.prefix, len(sched.period))
    return flat[f"stack.layers.{j}.{sub}"][s]

  def t(w2d):                    # [in, out] kernel → PyTorch [out, in]
    return np.ascontiguousarray(np.asarray(w2d).T)

  out = {"model.embed_tokens.weight": flat["embed.embedding"],
         "model.norm.weight": flat["final_norm.scale"],
         "model.output_attn_res_proj.weight": flat["out_res.query"][None],
         "model.output_attn_res_norm.weight": flat["out_res.norm_scale"],
         "lm_head.weight": t(flat["lm_head.kernel"])}
  for i in range(m.num_layers):
    p, mixer, ffn = f"model.layers.{i}.", *sched.kinds[i]
    out[p + "input_layernorm.weight"] = get(i, "attn_norm.scale")
    out[p + "post_attention_layernorm.weight"] = get(i, "mlp_norm.scale")
    out[p + "self_attention_res_proj.weight"] = get(i, "attn_res.query")[None]
    out[p + "self_attention_res_norm.weight"] = get(i, "attn_res.norm_scale")
    out[p + "mlp_res_proj.weight"] = get(i, "mlp_res.query")[None]
    out[p + "mlp_res_norm.weight"] = get(i, "mlp_res.norm_scale")
    a = p + "self_attn."
    if mixer == "kda":
      h, k, w = m.kda.num_heads, m.kda.head_dim, m.kda.conv_size
      for n in ("q", "k", "v", "g"):
        out[a + f"{n}_proj.weight"] = t(get(i, f"mixer.{n}_proj.kernel").reshape(d, h * k))
      for n in ("q", "k", "v"):
        out[a + f"{n}_conv1d.weight"] = t(get(i, f"mixer.{n}_conv").reshape(w, h * k))[:, None, :]
      out[a + "f_a_proj.weight"] = t(get(i, "mixer.f_a_proj.kernel"))
      out[a + "f_b_proj.weight"] = t(get(i, "mixer.f_b_proj.kernel").reshape(k, h * k))
      out[a + "b_proj.weight"] = t(get(i, "mixer.b_proj.kernel"))
      out[a + "o_proj.weight"] = t(get(i, "mixer.o_proj.kernel").reshape(h * k, d))
      out[a + "A_log"] = np.concatenate([get(i, "mixer.A_log"), np.zeros(128 - h, np.float32)])
      out[a + "dt_bias"] = get(i, "mixer.dt_bias").reshape(h * k)
      out[a + "o_norm.weight"] = get(i, "mixer.o_norm.scale")
    else:
      ml = m.mla
      h, q_head, kv_head = ml.num_heads, ml.qk_nope_head_dim + ml.qk_rope_head_dim, ml.qk_nope_head_dim + ml.v_head_dim
      out[a + "q_a_proj.weight"] = t(get(i, "mixer.q_a_proj.kernel"))
      out[a + "q_a_layernorm.weight"] = get(i, "mixer.q_a_norm.scale")
      out[a + "q_b_proj.weight"] = t(get(i, "mixer.q_b_proj.kernel").reshape(ml.q_lora_rank, h * q_head))
      out[a + "kv_a_proj_with_mqa.weight"] = t(get(i, "mixer.kv_a_proj.kernel"))
      out[a + "kv_a_layernorm.weight"] = get(i, "mixer.kv_a_norm.scale")
      out[a + "kv_b_proj.weight"] = t(get(i, "mixer.kv_b_proj.kernel").reshape(ml.kv_lora_rank, h * kv_head))
      out[a + "g_proj.weight"] = t(get(i, "mixer.g_proj.kernel").reshape(d, h * ml.v_head_dim))
      out[a + "o_proj.weight"] = t(get(i, "mixer.o_proj.kernel").reshape(h * ml.v_head_dim, d))
    if ffn == "dense":
      for n in ("gate_proj", "up_proj", "down_proj"):
        out[p + f"mlp.{n}.weight"] = t(get(i, f"ffn.{n}.kernel"))
      continue
    b = p + "block_sparse_moe."
    out[b + "gate.weight"] = t(get(i, "ffn.router.weight"))
    out[b + "gate.e_score_correction_bias"] = get(i, "ffn.router.bias")
    out[b + "routed_expert_down_proj.weight"] = t(get(i, "ffn.down_proj.kernel"))
    out[b + "routed_expert_up_proj.weight"] = t(get(i, "ffn.up_proj.kernel"))
    out[b + "routed_expert_norm.weight"] = get(i, "ffn.latent_norm.scale")
    for n in ("gate_proj", "up_proj", "down_proj"):
      out[b + f"shared_experts.{n}.weight"] = t(get(i, f"ffn.shared.{n}.kernel"))
    for src, dst in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
      stacked = get(i, f"ffn.experts.{src}")
      for e in range(m.moe.num_experts):
        w = t(stacked[e])                                    # [out, in]
        name = b + f"experts.{e}.{dst}.weight"
        if mxfp4:
          packed, scale = mx.export_mxfp4(jnp.asarray(w), in_axis=-1)
          out[name + "_packed"], out[name + "_scale"] = np.asarray(packed), np.asarray(scale)
        else:
          out[name] = w
  for name, value in out.items():
    if value.dtype == np.uint8:
      continue
    out[name] = value.astype(np.float32 if any(s in name for s in F32_PARTS) else ml_dtypes.bfloat16)
  return out


def write_release(directory, model, cfg, *, mxfp4: bool):
  os.makedirs(directory)
  tensors = hand_tensors(model, cfg, mxfp4)
  first = {k: v for k, v in tensors.items()
           if k.startswith("model.embed") or (k.startswith("model.layers.") and int(k.split(".")[2]) < 6)}
  second = {k: v for k, v in tensors.items() if k not in first}
  files = {"model-00001-of-00002.safetensors": first, "model-00002-of-00002.safetensors": second}
  for name, part in files.items():
    save_file(part, os.path.join(directory, name), metadata={"format": "pt"})
  index = {"metadata": {"total_size": sum(v.nbytes for v in tensors.values())},
           "weight_map": {k: f for f, part in files.items() for k in part}}
  with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
    json.dump(index, f)
  config = hand_config(cfg)
  if mxfp4:
    config["quantization_config"] = {"quant_method": "compressed-tensors",
                                     "format": "mxfp4-pack-quantized", "group_size": 32}
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(config, f)
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump({"model_max_length": 1048576}, f)
  return tensors


def read_dir(directory):
  """{file: {name: (dtype, shape, bytes)}} of every shard in a release directory."""
  out = {}
  for name in sorted(os.listdir(directory)):
    if name.endswith(".safetensors"):
      with safe_open(os.path.join(directory, name), framework="np") as f:
        out[name] = {k: f.get_tensor(k) for k in f.keys()}
  return out


@pytest.fixture(scope="module")
def release(tmp_path_factory):
  """The float release, imported into a workdir."""
  root = tmp_path_factory.mktemp("hf")
  model, cfg = reference_model(mxfp4=False)
  src = str(root / "release")
  tensors = write_release(src, model, cfg, mxfp4=False)
  work = str(root / "run")
  assert hf.main(["hf", "import", f"--hf_checkpoint={src}", f"--workdir={work}",
                  f"--config={TINY}"]) == 0
  return model, cfg, src, work, tensors, root


# ----------------------------------------------------------------------------- tests


def test_table_maps_every_tensor_both_ways(release):
  model, cfg, src, _, tensors, _ = release
  table = hf.make_table(cfg)
  assert {e.name for e in table.entries} == set(tensors)       # the hand-written release, exactly
  rng = np.random.default_rng(0)
  for e in table.entries:
    core = rng.normal(size=e.core_shape).astype(np.float32)
    back = hf_layout.from_hf(e, hf_layout.to_hf(e, core))
    np.testing.assert_array_equal(back, core, err_msg=e.name)
    assert hf_layout.to_hf(e, core).shape == tensors[e.name].shape, e.name
  flat = flat_state(model)
  for e in table.entries[:40]:          # and agrees with the hand-written layout, value for value
    key = e.key.split(".", 1)[1]
    want = tensors[e.name].astype(np.float32)
    np.testing.assert_array_equal(hf_layout.to_hf(e, flat[key][e.index]), want, err_msg=e.name)


def test_config_maps_both_ways(release):
  _, cfg, src, _, _, _ = release
  with open(os.path.join(src, "config.json")) as f:
    original = json.load(f)
  imported = hf_layout.config_from_hf(original, k3_tiny.get_config())
  assert imported.model.to_dict() == cfg.model.to_dict()
  assert hf_layout.config_to_hf(imported, original) == original
  fresh = hf_layout.config_to_hf(imported)
  assert hf_layout.config_from_hf(fresh, k3_tiny.get_config()).model.to_dict() == cfg.model.to_dict()


def test_imported_logits_equal_k3train_forward(release, tmp_path):
  model, cfg, src, work, _, _ = release
  tokens = np.random.default_rng(1).integers(0, cfg.model.vocab_size, (2, 24)).astype(np.int32)
  want = np.asarray(logits.logits(model, tokens))
  np.save(tmp_path / "t.npy", tokens)
  for source in (f"--workdir={work}", f"--hf_checkpoint={src}"):
    out = tmp_path / "l.npy"
    assert logits.main(["logits", source, f"--tokens={tmp_path / 't.npy'}", f"--out={out}",
                        f"--config={TINY}"]) == 0
    got = np.load(out)
    assert got.dtype == np.float32 and got.shape == (2, 24, cfg.model.vocab_size)
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0, err_msg=source)


def test_imported_run_resumes_like_k3train_main(release):
  """What k3train.main does on start: W/config.py validates, the latest step is > 0 (so the loop
  restores it), and the checkpoint restores into the builder's state with the release's values."""
  from k3train.train import builder
  from k3train.train.checkpoint import Checkpointer
  model, _, _, work, _, _ = release
  cfg = config_lib.validate(config_lib.load_file(os.path.join(work, "config.py")))
  run = builder.build(cfg)
  ckpt = Checkpointer(os.path.join(work, "checkpoints"), cfg)
  step = ckpt.latest_step()
  assert step == hf.IMPORT_STEP > 0
  state, _ = ckpt.restore(step, run.state)
  ckpt.close()
  want = nnx.state(model, nnx.Param)
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(state.params)[0], jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))
  biases = [np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(state.rest)[0]
            if path_names(p)[-1] == "bias"]
  assert biases and all(np.abs(b).max() > 0 for b in biases)     # router biases came along


def test_export_reproduces_the_release_bit_for_bit(release):
  _, _, src, work, _, root = release
  out = str(root / "exported")
  assert hf.main(["hf", "export", f"--workdir={work}", f"--out={out}"]) == 0
  assert_same_release(src, out)


def assert_same_release(src, out):
  a, b = read_dir(src), read_dir(out)
  assert list(a) == list(b)                                        # the same shard files
  for file in a:
    assert sorted(a[file]) == sorted(b[file]), file               # the same tensors in each
    for name, x in a[file].items():
      y = b[file][name]
      assert x.dtype == y.dtype and x.shape == y.shape, name
      assert x.tobytes() == y.tobytes(), name                     # bit for bit
  for name in ("config.json", "model.safetensors.index.json", "tokenizer_config.json"):
    with open(os.path.join(src, name)) as f, open(os.path.join(out, name)) as g:
      if name == "model.safetensors.index.json":
        assert json.load(f)["weight_map"] == json.load(g)["weight_map"]
      else:
        assert json.load(f) == json.load(g), name


def test_mxfp4_release_round_trips_bit_for_bit(tmp_path):
  model, cfg = reference_model(mxfp4=True)
  src, work, out = str(tmp_path / "release"), str(tmp_path / "run"), str(tmp_path / "out")
  tensors = write_release(src, model, cfg, mxfp4=True)
  assert any(k.endswith("w1.weight_packed") for k in tensors)
  assert hf.main(["hf", "import", f"--hf_checkpoint={src}", f"--workdir={work}",
                  f"--config={TINY}"]) == 0
  assert hf.main(["hf", "export", f"--workdir={work}", f"--out={out}"]) == 0
  assert_same_release(src, out)
  # The imported experts hold the dequantised MXFP4 values of the release.
  imported, _ = hf.load_workdir_model(work)
  want = flat_state(model)
  for key, value in flat_state(imported).items():
    if key.endswith("experts.gate"):
      np.testing.assert_array_equal(value, want[key], err_msg=key)


def _malformed(src, root, name, edit):
  bad = str(root / name)
  shutil.copytree(src, bad)
  edit(bad)
  return bad


def _rewrite(directory, file, change):
  path = os.path.join(directory, file)
  with safe_open(path, framework="np") as f:
    tensors = {k: f.get_tensor(k) for k in f.keys()}
  change(tensors)
  save_file(tensors, path, metadata={"format": "pt"})


def _without_index(directory):
  os.remove(os.path.join(directory, "model.safetensors.index.json"))


LAYER5 = "model.layers.5.self_attn.q_proj.weight"
SHARD1 = "model-00001-of-00002.safetensors"

MALFORMED = {
    "missing_tensor": (lambda d: (_without_index(d), _rewrite(d, SHARD1, lambda t: t.pop(LAYER5))),
                       f"missing tensor '{LAYER5}'"),
    "wrong_shape": (lambda d: _rewrite(d, SHARD1, lambda t: t.update(
        {LAYER5: np.zeros((3, 3), ml_dtypes.bfloat16)})), f"tensor '{LAYER5}' has shape [3, 3]"),
    "unknown_tensor": (lambda d: (_without_index(d), _rewrite(d, SHARD1, lambda t: t.update(
        {"model.layers.5.self_attn.extra.weight": np.zeros(4, np.float32)}))),
                       "unknown tensor 'model.layers.5.self_attn.extra.weight'"),
    "unknown_key": (lambda d: _edit_config(d, {"rope_type_extra": 1}), "unknown key 'rope_type_extra'"),
    "truncated_shard": (lambda d: _truncate(os.path.join(d, "model-00002-of-00002.safetensors")),
                        "model-00002-of-00002.safetensors is truncated: tensor"),
}


def _edit_config(directory, extra):
  path = os.path.join(directory, "config.json")
  with open(path) as f:
    c = json.load(f)
  c.update(extra)
  with open(path, "w") as f:
    json.dump(c, f)


def _truncate(path):
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) - 1000)


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_release_is_refused_and_nothing_is_written(release, case, capsys):
  _, _, src, _, _, root = release
  edit, message = MALFORMED[case]
  bad = _malformed(src, root, f"bad_{case}", edit)
  work = root / f"run_{case}"
  assert hf.main(["hf", "import", f"--hf_checkpoint={bad}", f"--workdir={work}",
                  f"--config={TINY}"]) == 2
  err = capsys.readouterr().err
  assert message in err, err
  assert not work.exists()
  assert not [p for p in os.listdir(root) if ".partial-" in p]    # no half-written staging


def test_mtp_parameters_have_release_names():
  cfg = k3_tiny.get_config()
  mtp = nnx.eval_shape(lambda: MTPModule(cfg.model, rngs=nnx.Rngs(0)))
  shapes = {".".join(path_names(p)): v.shape
            for p, v in jax.tree_util.tree_flatten_with_path(nnx.state(mtp, nnx.Param))[0]}
  names = hf_layout.mtp_names(shapes, cfg)
  assert all(n.startswith("model.mtp.") for n in names.values())
  assert len(set(names.values())) == len(names)
  for want in ("model.mtp.eh_proj.weight", "model.mtp.hnorm.weight", "model.mtp.enorm.weight",
               "model.mtp.self_attn.kv_b_proj.weight", "model.mtp.norm.weight",
               "model.mtp.block_sparse_moe.experts.7.w2.weight"):
    assert want in names.values(), want


def test_generate_prints_text_and_throughput(release, capsys):
  _, _, _, work, _, _ = release
  argv = ["generate", f"--workdir={work}", "--prompt=def main():", "--max_new_tokens=4",
          "--batch=2"]
  assert generate.main(argv) == 0
  lines = capsys.readouterr().out.strip().splitlines()
  assert lines[0].startswith("def main():") and lines[1].startswith("def main():")
  assert lines[-2].startswith("prefill: ") and "tokens/s" in lines[-2]
  assert lines[-1].startswith("decode: 4 tokens") and "tokens/s" in lines[-1]


def test_fresh_layout_export_imports_back_to_the_same_parameters(release):
  """Export without a recorded release layout (a run trained from scratch): a fresh config.json
  and shards of --shard_size_mb; importing that gives back the parameters (bf16-exact here)."""
  model, _, _, work, tensors, root = release
  scratch = str(root / "scratch_run")
  shutil.copytree(work, scratch, ignore=shutil.ignore_patterns(hf.RELEASE_DIR))
  out = str(root / "fresh")
  assert hf.main(["hf", "export", f"--workdir={scratch}", f"--out={out}", "--shard_size_mb=1"]) == 0
  shards = read_dir(out)
  assert len(shards) > 1 and sorted(k for s in shards.values() for k in s) == sorted(tensors)
  imported, _ = hf.load_release_model(out, k3_tiny.get_config())
  want = flat_state(model)
  for key, value in flat_state(imported).items():
    if not key.endswith(("expert_load", "qb_pending", "max_logit")):
      np.testing.assert_array_equal(value, want[key], err_msg=key)


def test_mtp_tensors_of_a_release_pass_through_unchanged(release):
  """A release's model.mtp.* tensors, with no MTP module in the k3train model, come back out of
  export bit for bit and in their shard."""
  _, _, src, _, _, root = release
  extra = np.arange(12, dtype=np.float32).reshape(3, 4).astype(ml_dtypes.bfloat16)
  bad = _malformed(src, root, "with_mtp", lambda d: (_without_index(d), _rewrite(
      d, SHARD1, lambda t: t.update({"model.mtp.eh_proj.weight": extra}))))
  work, out = str(root / "run_mtp"), str(root / "out_mtp")
  assert hf.main(["hf", "import", f"--hf_checkpoint={bad}", f"--workdir={work}", f"--config={TINY}"]) == 0
  assert hf.main(["hf", "export", f"--workdir={work}", f"--out={out}"]) == 0
  got = read_dir(out)[SHARD1]["model.mtp.eh_proj.weight"]
  assert got.dtype == extra.dtype and got.tobytes() == extra.tobytes()
