"""The one table between the released K3 layout (Hugging Face `KimiK3ForCausalLM`) and k3train.

Two halves, each used in both directions (import and export):

* config.json ↔ the `model` section of a k3train config (`config_from_hf`, `config_to_hf`).
  Every key of the release config is either mapped, checked against the only value k3train
  implements, or kept verbatim as information; any other key is refused by name.
* tensor names ↔ slices of the train state (`Table`). One `Entry` per release tensor: its name,
  the flat train-state key (`k3train.train.checkpoint.flatten_state` naming) and the leading
  indices into that array (super-block of a scanned layer, routed expert), and how the layout
  changes:

    linear  k3train kernel [in..., out...]  ↔  PyTorch weight [prod(out), prod(in)] (transposed;
            per-head axes flatten head-major, e.g. q_proj [d, H, K] ↔ [H·K, d])
    same    flattened (norm gains, dt_bias [H, K] ↔ [H·K], router bias)
    keep    unchanged (the embedding table [V, d])
    conv    short conv [W, H, K] ↔ Conv1d weight [H·K, 1, W] (tap W−1 is the current token)
    a_log   A_log [H] ↔ zero-padded to a multiple of 128 entries (the release's storage)
    row     AttnRes pseudo-query [d] ↔ Linear(d, 1) weight [1, d]

Routed-expert weights (`Entry.expert`) may be stored as MXFP4 (docs/maths.md §7.4): the release
then holds `<name>_packed` (uint8 [out, in/2]) and `<name>_scale` (uint8 [out, in/32]) instead of
`<name>` [out, in]. Release dtypes: fp32 for A_log, dt_bias, the conv weights, the KDA output
norm and the router bias, bf16 for everything else (`Entry.dtype`).

Release names (text model): `model.embed_tokens.weight`, `model.layers.{i}.` +
{`input_layernorm`, `post_attention_layernorm`, `self_attention_res_{proj,norm}`,
`mlp_res_{proj,norm}`, `self_attn.*` (KDA or MLA), `mlp.{gate,up,down}_proj` (dense layers),
`block_sparse_moe.{gate, gate.e_score_correction_bias, experts.{e}.w1/w2/w3,
routed_expert_{down,up}_proj, routed_expert_norm, shared_experts.*}`}, `model.norm.weight`,
`model.output_attn_res_{proj,norm}.weight`, `lm_head.weight`, and the MTP module under
`model.mtp.` (k3train/model/mtp.py; w1 = gate, w3 = up, w2 = down).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from typing import Any, Iterable

import ml_collections
import numpy as np

from k3train import config as config_lib

ConfigError = config_lib.ConfigError

ARCHITECTURE = "KimiK3ForCausalLM"
MODEL_TYPES = ("kimi_k3",)
A_LOG_PAD = 128

# ----------------------------------------------------------------------------- config.json

# release key → k3train key (model section), value taken as is (numbers and booleans).
_DIRECT = {
    "vocab_size": "vocab_size",
    "hidden_size": "d_model",
    "num_hidden_layers": "num_layers",
    "intermediate_size": "dense_ffn_hidden",
    "first_k_dense_replace": "num_dense_layers",
    "rms_norm_eps": "norm_eps",
    "activation_situ_beta": "situ_beta",
    "activation_situ_linear_beta": "situ_linear_beta",
    "attn_res_block_size": "attn_res.block_size",
    "num_attention_heads": "mla.num_heads",
    "q_lora_rank": "mla.q_lora_rank",
    "kv_lora_rank": "mla.kv_lora_rank",
    "qk_nope_head_dim": "mla.qk_nope_head_dim",
    "qk_rope_head_dim": "mla.qk_rope_head_dim",
    "v_head_dim": "mla.v_head_dim",
    "mla_use_output_gate": "mla.output_gate",
    "num_experts": "moe.num_experts",
    "num_experts_per_token": "moe.top_k",
    "num_shared_experts": "moe.num_shared_experts",
    "moe_intermediate_size": "moe.expert_hidden",
    "routed_expert_hidden_size": "moe.latent_dim",
    "routed_scaling_factor": "moe.routed_scaling_factor",
    "moe_renormalize": "moe.renormalize",
    "latent_moe_use_norm": "moe.latent_norm",
}
_DIRECT_OPTIONAL = {"initializer_range": "init_std"}
_LINEAR_ATTN = {  # linear_attn_config.<key> → model.kda.<key>
    "head_dim": "kda.head_dim",
    "num_heads": "kda.num_heads",
    "short_conv_kernel_size": "kda.conv_size",
    "gate_lower_bound": "kda.gate_lower_bound",
}
# Keys whose value k3train implements in one way only (key: the required value).
_FIXED = {
    "model_type": MODEL_TYPES,
    "hidden_act": ("situ",),
    "mla_use_nope": (True,),
    "moe_router_activation_func": ("sigmoid",),
    "num_expert_group": (1,),
    "topk_group": (1,),
    "topk_method": ("noaux_tc",),
    "moe_layer_freq": (1,),
    "tie_word_embeddings": (False,),
    "attention_dropout": (0, 0.0),
}
_LINEAR_ATTN_FIXED = {"use_full_rank_gate": (True,)}
# Informational keys: kept verbatim for export, no effect on the model (NoPE: no rope settings
# apply; max_position_embeddings is not a limit of the model).
_INFO = ("architectures", "auto_map", "torch_dtype", "dtype", "transformers_version", "bos_token_id",
         "eos_token_id", "pad_token_id", "use_cache", "max_position_embeddings", "rope_theta",
         "rope_scaling", "head_dim", "num_key_value_heads", "quantization_config",
         "num_nextn_predict_layers", "use_grouped_topk", "initializer_range")
_LINEAR_ATTN_INFO = ("kda_layers", "full_attn_layers")


def _set(m: ml_collections.ConfigDict, dotted: str, value) -> None:
  *sections, key = dotted.split(".")
  for s in sections:
    m = m[s]
  ref = m[key]
  if isinstance(ref, float) and isinstance(value, int) and not isinstance(value, bool):
    value = float(value)
  m[key] = value


def _get(m: ml_collections.ConfigDict, dotted: str):
  for part in dotted.split("."):
    m = m[part]
  return m


def config_from_hf(hf: dict, base: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A validated k3train config: `base` (the recipe: data, train, optim, parallel, and model
  settings the release does not define, e.g. dtypes and backends) with the model of `hf`.

  Raises ConfigError naming the release key for unknown keys, missing keys, values k3train
  does not implement, and for a result that fails k3train's own validation."""
  if not isinstance(hf, dict):
    raise ConfigError("config.json must hold a JSON object")
  if "text_config" in hf or "vision_config" in hf:
    raise ConfigError("config.json: keys 'text_config'/'vision_config' (the vision-language "
                      "wrapper) are not supported; import the text model's config.json "
                      f"(architectures [{ARCHITECTURE!r}])")
  known = set(_DIRECT) | set(_DIRECT_OPTIONAL) | set(_FIXED) | set(_INFO) | {"linear_attn_config"}
  for key in hf:
    if key not in known:
      raise ConfigError(f"config.json: unknown key {key!r}; k3train maps every K3 key "
                        "(k3train/tools/hf_layout.py) and refuses others")
  arch = hf.get("architectures")
  if arch is not None and list(arch) != [ARCHITECTURE]:
    raise ConfigError(f"config.json: architectures is {arch!r}, expected [{ARCHITECTURE!r}]")
  for key, allowed in _FIXED.items():
    if key == "model_type" and key not in hf:
      raise ConfigError("config.json: missing key 'model_type'")
    if key in hf and hf[key] not in allowed:
      raise ConfigError(f"config.json: {key} = {hf[key]!r} is not supported (k3train implements "
                        f"{' or '.join(repr(a) for a in allowed)})")
  heads, kv_heads = hf.get("num_attention_heads"), hf.get("num_key_value_heads")
  if kv_heads is not None and kv_heads != heads:
    raise ConfigError(f"config.json: num_key_value_heads = {kv_heads} differs from "
                      f"num_attention_heads = {heads}; K3's MLA has no grouped keys")
  cfg = copy.deepcopy(base)
  m = cfg.model
  for key, dotted in _DIRECT.items():
    if key not in hf:
      raise ConfigError(f"config.json: missing key {key!r} (model.{dotted})")
    if hf[key] is None:
      raise ConfigError(f"config.json: {key} is null; k3train needs a value (model.{dotted})")
    _set(m, dotted, hf[key])
  for key, dotted in _DIRECT_OPTIONAL.items():
    if hf.get(key) is not None:
      _set(m, dotted, hf[key])
  lin = hf.get("linear_attn_config")
  if not isinstance(lin, dict):
    raise ConfigError("config.json: missing key 'linear_attn_config' (an object)")
  for key in lin:
    if key not in _LINEAR_ATTN and key not in _LINEAR_ATTN_FIXED and key not in _LINEAR_ATTN_INFO:
      raise ConfigError(f"config.json: unknown key 'linear_attn_config.{key}'")
  for key, dotted in _LINEAR_ATTN.items():
    if lin.get(key) is None:
      raise ConfigError(f"config.json: missing key 'linear_attn_config.{key}' (model.{dotted})")
    _set(m, dotted, lin[key])
  for key, allowed in _LINEAR_ATTN_FIXED.items():
    if lin.get(key) not in allowed:
      raise ConfigError(f"config.json: linear_attn_config.{key} = {lin.get(key)!r} is not "
                        f"supported (k3train implements {allowed[0]!r})")
  n = hf["num_hidden_layers"]
  full = lin.get("full_attn_layers")
  if not isinstance(full, list):
    raise ConfigError("config.json: missing key 'linear_attn_config.full_attn_layers'")
  m.mla_layers = tuple(int(i) for i in full)
  kda = lin.get("kda_layers")
  if kda is not None and sorted(set(kda) | set(full)) != list(range(1, n + 1)) or \
      (kda is not None and set(kda) & set(full)):
    raise ConfigError("config.json: linear_attn_config.kda_layers and full_attn_layers must "
                      f"split layers 1..{n} between them")
  m.moe.shared_hidden = int(hf["moe_intermediate_size"]) * int(hf["num_shared_experts"])
  m.vision.enabled = False         # the text release has no vision tower
  cfg.data.vision.enabled = False
  try:
    return config_lib.validate(cfg)
  except ConfigError as e:
    raise ConfigError(f"config.json gives an invalid k3train config: {e}") from None


def config_to_hf(cfg: ml_collections.ConfigDict, original: dict | None = None) -> dict:
  """The release config.json of cfg.model; `original` (an imported config.json) supplies the
  informational keys, and its values are kept where they equal k3train's."""
  m = cfg.model
  if m.vision.enabled:
    raise ConfigError("model.vision.enabled: the text release layout has no vision tower")
  if m.moe.shared_hidden != m.moe.expert_hidden * m.moe.num_shared_experts:
    raise ConfigError(f"model.moe.shared_hidden = {m.moe.shared_hidden} is not "
                      "expert_hidden × num_shared_experts, which the release layout assumes")
  out = dict(original) if original else {
      "architectures": [ARCHITECTURE], "model_type": MODEL_TYPES[0], "torch_dtype": "bfloat16",
      "hidden_act": "situ", "mla_use_nope": True, "moe_router_activation_func": "sigmoid",
      "num_expert_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "moe_layer_freq": 1,
      "tie_word_embeddings": False, "num_key_value_heads": m.mla.num_heads,
      "num_nextn_predict_layers": 0}
  def put(d, key, value):
    if not (key in d and d[key] == value and type(d[key]) is not bool):
      d[key] = value
  for key, dotted in {**_DIRECT, **_DIRECT_OPTIONAL}.items():
    put(out, key, _get(m, dotted))
  lin = dict(out.get("linear_attn_config") or {})
  for key, dotted in _LINEAR_ATTN.items():
    put(lin, key, _get(m, dotted))
  lin["use_full_rank_gate"] = True
  full = sorted(int(i) for i in m.mla_layers)
  lin["full_attn_layers"] = full
  lin["kda_layers"] = [i for i in range(1, m.num_layers + 1) if i not in set(full)]
  out["linear_attn_config"] = lin
  return out


# ----------------------------------------------------------------------------- tensor table


@dataclasses.dataclass(frozen=True)
class Entry:
  name: str                  # release name (an expert's unpacked name when it is packable)
  key: str                   # flat train-state key, e.g. "params.prefix.0.mixer.q_proj.kernel"
  index: tuple[int, ...]     # leading indices into that array (super-block, expert)
  kind: str                  # linear | same | keep | conv | a_log | row
  n_in: int                  # linear: input dims of the k3train slice
  core_shape: tuple[int, ...]
  hf_shape: tuple[int, ...]
  dtype: str                 # release dtype when not MXFP4-packed: "BF16" or "F32"
  expert: bool = False       # routed-expert weight: may be MXFP4-packed

  def packed_names(self) -> tuple[str, str]:
    return self.name + "_packed", self.name + "_scale"

  def packed_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
    out, inp = self.hf_shape
    return (out, inp // 2), (out, inp // 32)


_F32_SUFFIXES = ("A_log", "dt_bias", "e_score_correction_bias", "q_conv1d.weight",
                 "k_conv1d.weight", "v_conv1d.weight", "o_norm.weight")

# Sub-paths inside one decoder layer (or the MTP module): k3train → (release, kind, n_in).
_LAYER = {
    "attn_res.query": ("self_attention_res_proj.weight", "row", 0),
    "attn_res.norm_scale": ("self_attention_res_norm.weight", "same", 0),
    "mlp_res.query": ("mlp_res_proj.weight", "row", 0),
    "mlp_res.norm_scale": ("mlp_res_norm.weight", "same", 0),
    "attn_norm.scale": ("input_layernorm.weight", "same", 0),
    "mlp_norm.scale": ("post_attention_layernorm.weight", "same", 0),
}
_KDA = {
    "q_proj.kernel": ("q_proj.weight", "linear", 1), "k_proj.kernel": ("k_proj.weight", "linear", 1),
    "v_proj.kernel": ("v_proj.weight", "linear", 1), "g_proj.kernel": ("g_proj.weight", "linear", 1),
    "f_a_proj.kernel": ("f_a_proj.weight", "linear", 1),
    "f_b_proj.kernel": ("f_b_proj.weight", "linear", 1),
    "b_proj.kernel": ("b_proj.weight", "linear", 1), "o_proj.kernel": ("o_proj.weight", "linear", 2),
    "q_conv": ("q_conv1d.weight", "conv", 0), "k_conv": ("k_conv1d.weight", "conv", 0),
    "v_conv": ("v_conv1d.weight", "conv", 0), "A_log": ("A_log", "a_log", 0),
    "dt_bias": ("dt_bias", "same", 0), "o_norm.scale": ("o_norm.weight", "same", 0),
}
_MLA = {
    "q_a_proj.kernel": ("q_a_proj.weight", "linear", 1),
    "q_a_norm.scale": ("q_a_layernorm.weight", "same", 0),
    "q_b_proj.kernel": ("q_b_proj.weight", "linear", 1),
    "kv_a_proj.kernel": ("kv_a_proj_with_mqa.weight", "linear", 1),
    "kv_a_norm.scale": ("kv_a_layernorm.weight", "same", 0),
    "kv_b_proj.kernel": ("kv_b_proj.weight", "linear", 1),
    "g_proj.kernel": ("g_proj.weight", "linear", 1), "o_proj.kernel": ("o_proj.weight", "linear", 2),
}
_DENSE = {f"{p}.kernel": (f"mlp.{p}.weight", "linear", 1) for p in ("gate_proj", "up_proj", "down_proj")}
_MOE = {
    "router.weight": ("block_sparse_moe.gate.weight", "linear", 1),
    "router.bias": ("block_sparse_moe.gate.e_score_correction_bias", "same", 0),
    "down_proj.kernel": ("block_sparse_moe.routed_expert_down_proj.weight", "linear", 1),
    "up_proj.kernel": ("block_sparse_moe.routed_expert_up_proj.weight", "linear", 1),
    "latent_norm.scale": ("block_sparse_moe.routed_expert_norm.weight", "same", 0),
    **{f"shared.{p}.kernel": (f"block_sparse_moe.shared_experts.{p}.weight", "linear", 1)
       for p in ("gate_proj", "up_proj", "down_proj")},
}
_EXPERTS = {"experts.gate": "w1", "experts.up": "w3", "experts.down": "w2"}
_TOP = {
    "embed.embedding": ("model.embed_tokens.weight", "keep", 0),
    "final_norm.scale": ("model.norm.weight", "same", 0),
    "out_res.query": ("model.output_attn_res_proj.weight", "row", 0),
    "out_res.norm_scale": ("model.output_attn_res_norm.weight", "same", 0),
    "lm_head.kernel": ("lm_head.weight", "linear", 1),
}
_MTP = {
    "hidden_norm.scale": ("hnorm.weight", "same", 0),
    "embed_norm.scale": ("enorm.weight", "same", 0),
    "proj.kernel": ("eh_proj.weight", "linear", 1),
    "attn_norm.scale": ("input_layernorm.weight", "same", 0),
    "mlp_norm.scale": ("post_attention_layernorm.weight", "same", 0),
    "final_norm.scale": ("norm.weight", "same", 0),
}
# Forward-written state that is not part of the release (recreated at zero on import).
_NOT_RELEASED = re.compile(r"\.(expert_load|qb_pending|qb_mean_score|max_logit)$|\.mtp\.stats$")


def hf_shape(kind: str, n_in: int, core: tuple[int, ...]) -> tuple[int, ...]:
  if kind == "linear":
    return (math.prod(core[n_in:]), math.prod(core[:n_in]))
  if kind == "conv":
    return (core[1] * core[2], 1, core[0])
  if kind == "a_log":
    return (-(-core[0] // A_LOG_PAD) * A_LOG_PAD,)
  if kind == "row":
    return (1, core[0])
  if kind == "keep":
    return tuple(core)
  return (math.prod(core),)


def to_hf(entry: Entry, core: np.ndarray) -> np.ndarray:
  """k3train slice → release tensor (same dtype)."""
  if core.shape != entry.core_shape:
    raise ValueError(f"{entry.key}{list(entry.index)}: shape {core.shape}, expected {entry.core_shape}")
  if entry.kind == "linear":
    n_in = math.prod(core.shape[:entry.n_in])
    return np.ascontiguousarray(core.reshape(n_in, -1).T)
  if entry.kind == "conv":
    w, h, k = core.shape
    return np.ascontiguousarray(core.transpose(1, 2, 0).reshape(h * k, 1, w))
  if entry.kind == "a_log":
    return np.concatenate([core, np.zeros(entry.hf_shape[0] - core.shape[0], core.dtype)])
  return np.ascontiguousarray(core.reshape(entry.hf_shape))


def from_hf(entry: Entry, hf: np.ndarray) -> np.ndarray:
  """Release tensor → k3train slice (same dtype); inverse of `to_hf` (A_log's padding dropped)."""
  if tuple(hf.shape) != entry.hf_shape:
    raise ValueError(f"tensor {entry.name!r} has shape {tuple(hf.shape)}, expected {entry.hf_shape}")
  core = entry.core_shape
  if entry.kind == "linear":
    return np.ascontiguousarray(hf.T.reshape(core))
  if entry.kind == "conv":
    w, h, k = core
    return np.ascontiguousarray(hf.reshape(h, k, w).transpose(2, 0, 1))
  if entry.kind == "a_log":
    return hf[:core[0]].copy()
  return hf.reshape(core).copy()


class Table:
  """Every release tensor of a model, from the flat train-state shapes of its params and rest.

  `shapes`: {flat key: shape} with keys "params.…" and "rest.…" as `flatten_state` of a
  TrainState names them (only params and rest are read)."""

  def __init__(self, cfg: ml_collections.ConfigDict, shapes: dict[str, tuple[int, ...]]):
    self.cfg = cfg
    sched = config_lib.layer_schedule(cfg.model)
    self.entries: list[Entry] = []
    self.unmapped: list[str] = []
    period = len(sched.period)
    for key, shape in shapes.items():
      if not key.startswith(("params.", "rest.")):
        continue
      if _NOT_RELEASED.search(key):
        continue
      path = key.split(".", 1)[1]
      made = self._entries_for(key, path, tuple(shape), sched, period)
      if made is None:
        self.unmapped.append(key)
      else:
        self.entries.extend(made)
    if self.unmapped:
      raise ConfigError(f"no release name for k3train state {self.unmapped[:3]} "
                        f"({len(self.unmapped)} in all); the release layout covers the text model")
    order = {e.name: i for i, e in enumerate(sorted(self.entries, key=_release_order))}
    self.entries.sort(key=lambda e: order[e.name])
    self.by_name = {e.name: e for e in self.entries}
    if len(self.by_name) != len(self.entries):
      raise AssertionError("two k3train slices map to one release name")

  def _entries_for(self, key, path, shape, sched, period):
    for sub, (name, kind, n_in) in _TOP.items():
      if path == sub:
        return [self._entry(name, key, (), kind, n_in, shape)]
    m = re.fullmatch(r"prefix\.(\d+)\.(.+)", path)
    if m:
      return self._layer(key, int(m.group(1)), m.group(2), shape, (), sched.kinds)
    m = re.fullmatch(r"suffix\.(\d+)\.(.+)", path)
    if m:
      return self._layer(key, sched.suffix_start + int(m.group(1)), m.group(2), shape, (), sched.kinds)
    m = re.fullmatch(r"stack\.layers\.(\d+)\.(.+)", path)
    if m:
      out = []
      for s in range(shape[0]):
        layer = sched.prefix + s * period + int(m.group(1))
        made = self._layer(key, layer, m.group(2), shape[1:], (s,), sched.kinds)
        if made is None:
          return None
        out.extend(made)
      return out
    m = re.fullmatch(r"mtp\.(.+)", path)
    if m:
      return self._block(key, "model.mtp.", m.group(1), shape, (), "mla", "moe", _MTP)
    return None

  def _layer(self, key, layer, sub, shape, index, kinds):
    mixer, ffn = kinds[layer]
    return self._block(key, f"model.layers.{layer}.", sub, shape, index, mixer, ffn, _LAYER)

  def _block(self, key, prefix, sub, shape, index, mixer, ffn, own):
    if sub in own:
      name, kind, n_in = own[sub]
      return [self._entry(prefix + name, key, index, kind, n_in, shape)]
    if sub.startswith("mixer."):
      table = _KDA if mixer == "kda" else _MLA
      found = table.get(sub[len("mixer."):])
      if found:
        name, kind, n_in = found
        return [self._entry(prefix + "self_attn." + name, key, index, kind, n_in, shape)]
      return None
    if sub.startswith("ffn."):
      rest = sub[len("ffn."):]
      found = (_DENSE if ffn == "dense" else _MOE).get(rest)
      if found:
        name, kind, n_in = found
        return [self._entry(prefix + name, key, index, kind, n_in, shape)]
      if ffn == "moe" and rest in _EXPERTS:
        w = _EXPERTS[rest]
        return [self._entry(f"{prefix}block_sparse_moe.experts.{e}.{w}.weight", key, index + (e,),
                            "linear", 1, shape[1:], expert=True) for e in range(shape[0])]
    return None

  def _entry(self, name, key, index, kind, n_in, core, expert=False):
    dtype = "F32" if name.endswith(_F32_SUFFIXES) else "BF16"
    return Entry(name, key, tuple(index), kind, n_in, tuple(core), hf_shape(kind, n_in, core),
                 dtype, expert)

  def keys(self) -> set[str]:
    return {e.key for e in self.entries}

  def for_key(self, key: str) -> list[Entry]:
    return [e for e in self.entries if e.key == key]


def _release_order(e: Entry):
  """Embedding, layers in order, final norm / output mix / head, then the MTP module."""
  m = re.match(r"model\.layers\.(\d+)\.", e.name)
  if e.name.startswith("model.embed_tokens"):
    return (0, 0, e.name)
  if m:
    return (1, int(m.group(1)), _expert_sort(e.name))
  if e.name.startswith("model.mtp."):
    return (3, 0, _expert_sort(e.name))
  return (2, 0, e.name)


def _expert_sort(name: str):
  m = re.search(r"\.experts\.(\d+)\.", name)
  return (name[:m.start()], int(m.group(1)), name[m.end():]) if m else (name, -1, "")


def release_names(entries: Iterable[Entry], packed: bool) -> list[tuple[str, str, tuple]]:
  """(name, dtype, shape) of every release tensor of `entries`, experts packed or not."""
  out = []
  for e in entries:
    if e.expert and packed:
      (pn, sn), (ps, ss) = e.packed_names(), e.packed_shapes()
      out += [(pn, "U8", ps), (sn, "U8", ss)]
    else:
      out.append((e.name, e.dtype, e.hf_shape))
  return out


def mtp_names(prefix_free_shapes: dict[str, tuple[int, ...]], cfg) -> dict[str, str]:
  """{MTP parameter path (e.g. "mixer.q_a_proj.kernel"): release name} for a standalone
  `MTPModule`'s flat shapes (experts expand to one name per expert: "<path>[e]")."""
  table = Table.__new__(Table)
  out = {}
  for path, shape in prefix_free_shapes.items():
    made = Table._block(table, "params.mtp." + path, "model.mtp.", path, tuple(shape), (),
                        "mla", "moe", _MTP)
    if made is None:
      raise ConfigError(f"no release name for MTP parameter {path!r}")
    for e in made:
      out[path + (f"[{e.index[-1]}]" if e.expert else "")] = e.name
  return out


__all__ = ["ARCHITECTURE", "Entry", "Table", "config_from_hf", "config_to_hf", "from_hf",
           "hf_shape", "mtp_names", "release_names", "to_hf"]
