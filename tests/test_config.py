"""Config schema, validation errors and the K3 layer schedule (docs/maths.md §0.2, §10)."""

from __future__ import annotations

import copy

import ml_collections
import pytest

from tests.configs import k3_full, k3_tiny
from k3train import config as config_lib


def full():
  return k3_full.get_config()


def rebuilt(cfg: ml_collections.ConfigDict, section: str, key: str, value):
  """A fresh ConfigDict built from a dict, so ConfigDict's own assignment type checks are
  bypassed and `validate` is the only line of defence."""
  d = cfg.to_dict()
  node = d
  for part in section.split("."):
    node = node[part]
  node[key] = value
  return ml_collections.ConfigDict(d)


def expect_error(cfg, *fragments):
  with pytest.raises(config_lib.ConfigError) as info:
    config_lib.validate(cfg)
  msg = str(info.value)
  for frag in fragments:
    assert frag in msg, f"{frag!r} not in error message {msg!r}"
  return msg


# ----------------------------------------------------------------------------- valid configs


@pytest.mark.parametrize("make", [k3_full.get_config, k3_tiny.get_config])
def test_shipped_configs_validate(make):
  cfg = make()
  assert config_lib.validate(cfg) is cfg


def test_k3_full_numbers_match_the_released_model():
  """docs/maths.md §0.2, field by field."""
  m = full().model
  assert m.vocab_size == 163_840
  assert m.d_model == 7168
  assert m.num_layers == 93
  assert m.num_dense_layers == 1 and m.dense_ffn_hidden == 33_792
  assert m.norm_eps == 1e-5
  assert m.situ_beta == 4.0 and m.situ_linear_beta == 25.0
  k = m.kda
  assert (k.num_heads, k.head_dim, k.conv_size, k.gate_lower_bound) == (96, 128, 4, -5.0)
  a = m.mla
  assert a.num_heads == 96
  assert (a.q_lora_rank, a.kv_lora_rank) == (1536, 512)
  assert (a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim) == (128, 64, 128)
  assert a.latent_norm_eps == 1e-6
  assert a.output_gate is True
  e = m.moe
  assert (e.num_experts, e.top_k) == (896, 16)
  assert (e.latent_dim, e.expert_hidden) == (3584, 3072)
  assert (e.num_shared_experts, e.shared_hidden) == (2, 6144)
  assert e.routed_scaling_factor == 1.0 and e.renormalize is True and e.latent_norm is True
  assert m.attn_res.block_size == 12
  # 1-indexed MLA layers {4, 8, …, 92, 93}
  assert tuple(m.mla_layers) == tuple(range(4, 93, 4)) + (93,)


# ----------------------------------------------------------------------------- layer schedule


def test_k3_full_layer_schedule():
  s = config_lib.layer_schedule(full().model)
  assert len(s.kinds) == 93
  assert s.num_kda == 69 and s.num_mla == 24
  mla_idx = [i for i, (mixer, _) in enumerate(s.kinds) if mixer == "mla"]
  assert mla_idx == list(range(3, 92, 4)) + [92]       # 0-indexed 3, 7, …, 91 and 92
  assert s.kinds[0][1] == "dense"
  assert all(ffn == "moe" for _, ffn in s.kinds[1:])
  assert s.prefix == 4
  assert s.period == (("kda", "moe"),) * 3 + (("mla", "moe"),)
  assert s.num_super_blocks == 22
  assert s.suffix_start == 92
  # prefix + scanned + suffix tile the layers exactly and reproduce `kinds`
  assert s.prefix + s.num_super_blocks * len(s.period) == s.suffix_start
  assert s.kinds[s.prefix:s.suffix_start] == s.period * s.num_super_blocks
  assert s.kinds[:4] == (("kda", "dense"), ("kda", "moe"), ("kda", "moe"), ("mla", "moe"))
  assert s.kinds[92:] == (("mla", "moe"),)


def test_k3_full_schedule_unscanned():
  m = full().model
  m.scan_layers = False
  s = config_lib.layer_schedule(m)
  assert s.num_super_blocks == 0 and s.prefix == 93 and s.suffix_start == 93
  assert s.kinds == config_lib.layer_schedule(full().model).kinds


def test_k3_tiny_covers_every_kind():
  m = k3_tiny.get_config().model
  s = config_lib.layer_schedule(m)
  kinds = set(s.kinds)
  assert {("kda", "dense"), ("kda", "moe"), ("mla", "moe")} <= kinds
  assert {mixer for mixer, _ in s.kinds} == {"kda", "mla"}
  assert {ffn for _, ffn in s.kinds} == {"dense", "moe"}
  assert s.num_super_blocks >= 2
  assert s.suffix_start < m.num_layers          # a non-empty unscanned suffix, like K3
  assert s.prefix + s.num_super_blocks * len(s.period) == s.suffix_start
  assert m.num_layers / m.attn_res.block_size >= 2   # at least two AttnRes blocks


# ----------------------------------------------------------------------------- errors


def test_unknown_key():
  cfg = full()
  with cfg.model.unlocked():
    cfg.model.num_heads = 4          # not a model-level key (heads live in kda/mla)
  expect_error(cfg, "model.num_heads")
  cfg = full()
  with cfg.unlocked():
    cfg.model.moe.frobnicate = True
  expect_error(cfg, "model.moe.frobnicate")


def test_missing_key():
  d = full().to_dict()
  del d["model"]["moe"]["top_k"]
  expect_error(ml_collections.ConfigDict(d), "model.moe.top_k")


def test_a_config_saved_without_newer_keys_gets_their_defaults():
  """A checkpoint's config JSON from an earlier k3train lacks keys added since: reading it back
  fills them from the defaults (and only them), so it validates."""
  from k3train.tools.hf import config_from_json
  from k3train.train.checkpoint import config_to_json
  saved = config_to_json(k3_tiny.get_config())
  del saved["model"]["moe"]["qb_rounds"], saved["train"]["loss_chunk_tokens"]
  saved["model"]["moe"]["top_k"] = 3
  cfg = config_lib.validate(config_from_json(saved))
  assert cfg.model.moe.qb_rounds == config_lib.defaults.k3_full().model.moe.qb_rounds
  assert cfg.train.loss_chunk_tokens == 0
  assert cfg.model.moe.top_k == 3                       # given keys are kept
  bare = ml_collections.ConfigDict({"model": {"moe": {"top_k": 3}}})
  filled = config_lib.fill_missing_keys(bare)
  assert "model.moe.qb_rounds" in filled and "model.moe.top_k" not in filled and "train" in filled


def test_configdict_rejects_str_for_int_itself():
  # ConfigDict's own type safety stops this before validate ever runs.
  cfg = full()
  with pytest.raises(TypeError):
    cfg.model.d_model = "big"


@pytest.mark.parametrize("section,key,value", [
    ("model", "d_model", "big"),          # only reachable by building the ConfigDict
    ("model", "d_model", 7168.0),         # float where an int is required
    ("model.kda", "num_heads", True),     # bool is an int subclass: must still be rejected
    ("model.mla", "output_gate", 1),      # int where a bool is required
    ("model", "norm_eps", "1e-5"),
    ("model", "mla_layers", 4),           # a scalar where a sequence is required
])
def test_wrong_type_built_from_dict(section, key, value):
  expect_error(rebuilt(full(), section, key, value), f"{section}.{key}")


def test_bool_for_int_slips_through_configdict_but_not_validate():
  cfg = full()
  cfg.model.d_model = True           # ConfigDict accepts this (bool is an int)
  assert cfg.model.d_model is True
  expect_error(cfg, "model.d_model")


def test_top_k_above_num_experts():
  cfg = full()
  cfg.model.moe.top_k = 897
  expect_error(cfg, "model.moe.top_k")
  cfg.model.moe.top_k = 0
  expect_error(cfg, "model.moe.top_k")


@pytest.mark.parametrize("layers", [(0, 4, 8), (4, 8, 94), (-1,)])
def test_mla_layer_index_out_of_range(layers):
  cfg = full()
  cfg.model.mla_layers = layers
  expect_error(cfg, "model.mla_layers")


@pytest.mark.parametrize("layers", [(4.0, 8, 12), (4, 8, "12"), (True, 8)])
def test_mla_layer_entries_must_be_ints(layers):
  """Layer numbers are ints; validate must say so naming the key, not crash elsewhere with a
  TypeError (float, str) or silently accept a bool as layer 1 (it rejects bool for scalar ints)."""
  cfg = full()
  cfg.model.mla_layers = layers
  expect_error(cfg, "model.mla_layers")


def test_mla_layer_at_bounds_is_valid():
  cfg = full()
  cfg.model.mla_layers = (1, 93)
  config_lib.validate(cfg)


def test_attn_res_block_size_zero():
  cfg = full()
  cfg.model.attn_res.block_size = 0
  expect_error(cfg, "model.attn_res.block_size")


def test_unknown_kda_backend():
  cfg = full()
  cfg.model.kda.backend = "cuda_magic"
  expect_error(cfg, "model.kda.backend", "cuda_magic")


def test_unknown_situ_backend():
  cfg = full()
  cfg.model.moe.situ_backend = "triton"
  expect_error(cfg, "model.moe.situ_backend", "triton")


def test_unknown_gather_backend():
  cfg = full()
  cfg.model.moe.gather_backend = "triton"
  expect_error(cfg, "model.moe.gather_backend", "triton")


def test_shared_hidden_not_divisible():
  cfg = full()
  cfg.model.moe.shared_hidden = 6145
  expect_error(cfg, "model.moe.shared_hidden")
  cfg.model.moe.num_shared_experts = 1          # now divisible: valid
  config_lib.validate(cfg)


@pytest.mark.parametrize("chunk", [0, 48, 256, -64])
def test_invalid_kda_chunk_size(chunk):
  cfg = full()
  cfg.model.kda.chunk_size = chunk
  expect_error(cfg, "model.kda.chunk_size")


def test_errors_are_value_errors_and_copies_unaffected():
  cfg = full()
  bad = copy.deepcopy(cfg)
  bad.model.kda.chunk_size = 7
  with pytest.raises(ValueError):
    config_lib.validate(bad)
  config_lib.validate(cfg)   # the original is still valid


def test_h200_proxy_validates_and_fits_one_h200():
  """k3_h200 keeps K3's per-head shapes, and its fp32 weights and gradients with AdamW's moments
  (at most 16 bytes per parameter; its first moment is bf16) leave at least 40 GB of a 141 GB
  H200 for activations."""
  from tests.configs import k3_h200
  from k3train.model.counting import count
  cfg = config_lib.validate(k3_h200.get_config())
  m = cfg.model
  assert m.kda.head_dim == 128 and m.mla.qk_nope_head_dim == 128 and m.mla.v_head_dim == 128
  assert m.moe.latent_dim < m.d_model and m.moe.top_k > 1
  assert count(cfg)["total_params"] * 16 < 100e9
  assert m.remat_policy == "selective_kda" and cfg.optim.adam_mu_dtype == "bfloat16"
  # Its 21 layers run unrolled (faster on one GPU), but they keep K3's pattern: scanned, they
  # would form super-blocks of [KDA, KDA, KDA, MLA] between an unscanned prefix and suffix.
  assert not m.scan_layers
  assert config_lib.layer_schedule(m).num_super_blocks == 0
  m.scan_layers = True
  sched = config_lib.layer_schedule(m)
  assert sched.num_super_blocks >= 2 and sched.num_kda and sched.num_mla


@pytest.mark.parametrize("key,value,fragment", [
    ("optimizer", "sgd", "optim.optimizer"),
    ("schedule", "linear", "optim.schedule"),
    ("min_lr_ratio", 1.5, "optim.min_lr_ratio"),
    ("loss_spike_factor", 0.5, "optim.loss_spike_factor"),
])
def test_optim_section_errors_name_the_key(key, value, fragment):
  cfg = k3_tiny.get_config()
  cfg.optim[key] = value
  with pytest.raises(config_lib.ConfigError, match=fragment):
    config_lib.validate(cfg)


def test_attn_res_backend_must_be_known():
  cfg = k3_tiny.get_config()
  cfg.model.attn_res.backend = "triton"
  with pytest.raises(config_lib.ConfigError, match="model.attn_res.backend"):
    config_lib.validate(cfg)


# ----------------------------------------------------------------------------- train.xla_options


def test_xla_options_are_typed_name_value_pairs():
  got = config_lib.xla_options("xla_gpu_enable_dynamic_slice_fusion=true xla_gpu_autotune_level=2 "
                               "xla_gpu_enable_command_buffer=FUSION,WHILE xla_x=0.5")
  assert got == {"xla_gpu_enable_dynamic_slice_fusion": True, "xla_gpu_autotune_level": 2,
                 "xla_gpu_enable_command_buffer": "FUSION,WHILE", "xla_x": 0.5}
  assert config_lib.xla_options("") == {}


@pytest.mark.parametrize("text, fragment", [
    ("xla_gpu_autotune_level", "name=value"),
    ("=1", "name=value"),
    ("gpu_autotune_level=1", "not an XLA option"),
    ("xla_a=1 xla_a=2", "given twice"),
])
def test_malformed_xla_options_are_named(text, fragment):
  expect_error(rebuilt(k3_tiny.get_config(), "train", "xla_options", text),
               "train.xla_options", fragment)


def test_performance_guide_names_config_keys_that_exist():
  """Every `model.…`, `train.…`, `optim.…` key docs/performance.md names resolves in the config,
  so the guide's settings stay the ones a run can set."""
  import pathlib
  import re
  from tests.configs import k3_h200
  text = (pathlib.Path(__file__).parents[1] / "docs" / "performance.md").read_text()
  keys = set(re.findall(r"`((?:model|train|optim|data)\.[a-z_.]+[a-z_])(?:=[^`]*)?`", text))
  assert len(keys) >= 10, keys
  cfg = k3_h200.get_config()
  for key in sorted(keys):
    node = cfg
    for part in key.split("."):
      assert part in node, f"docs/performance.md names {key}, which the config does not have"
      node = node[part]
