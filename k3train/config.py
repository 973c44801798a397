"""Config schema checks and derived fields.

Every config derives from `k3train/defaults.py` (the released K3), whose key set and value types are the schema.
`validate` fails at start with a message naming the key and what is allowed; nothing here fills
in model-defining numbers silently.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import types
from typing import Any

import ml_collections

from k3train import defaults
from pallas_kernels import attention as attention_op
from pallas_kernels import kda as kda_op
from pallas_kernels import moe as moe_ops


class ConfigError(ValueError):
  """A config key is unknown, has the wrong type, or is inconsistent with another key."""


# "none", "full", or the name of a jax.checkpoint_policies policy.
REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")
DTYPES = ("float32", "bfloat16", "float16", "float64")
OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "wsd")
PARALLEL_RULES = ("default", "long_context", "full")   # k3train/parallel/rules.py RECIPES
EXPERT_EXCHANGES = ("auto", "all_to_all", "ragged")
KDA_BACKENDS = kda_op.BACKENDS
MOE_BACKENDS = moe_ops.BACKENDS
ATTENTION_BACKENDS = attention_op.BACKENDS
# `data` keys that may change between curriculum stages (and so between a checkpoint and the run
# restoring it): the data iterator re-plans them without losing its place in any source.
DATA_STAGE_KEYS = ("weights", "seq_len", "num_workers", "num_threads")


def _schema() -> ml_collections.ConfigDict:
  return defaults.k3_full()


def load_file(path: str | os.PathLike) -> ml_collections.ConfigDict:
  """`get_config()` of a config file given by path (what `--config=FILE` loads).

  Config files are plain Python files, not an installed package; a missing file or one without
  `get_config` raises ConfigError naming the path.
  """
  return load_module(path).get_config()


def load_module(path: str | os.PathLike) -> types.ModuleType:
  """The config file at `path` as a module (not registered in sys.modules)."""
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise ConfigError(f"config file {path!r} does not exist")
  name = "k3train_config_" + os.path.splitext(os.path.basename(path))[0]
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not callable(getattr(module, "get_config", None)):
    raise ConfigError(f"config file {path!r} defines no get_config()")
  return module


def _flatten(cfg: Any, prefix: str = "") -> dict[str, Any]:
  out = {}
  for key, value in cfg.items():
    path = f"{prefix}{key}"
    if isinstance(value, ml_collections.ConfigDict):
      out.update(_flatten(value, path + "."))
    else:
      out[path] = value
  return out


def _check_types(cfg: ml_collections.ConfigDict) -> None:
  schema = _flatten(_schema())
  given = _flatten(cfg)
  for key in given:
    if key not in schema:
      close = [k for k in schema if k.rsplit(".", 1)[-1] == key.rsplit(".", 1)[-1]]
      hint = f"; did you mean {close[0]!r}?" if close else ""
      raise ConfigError(f"unknown config key {key!r}{hint} (known sections: "
                        f"{sorted({k.split('.')[0] for k in schema})})")
  for key, ref in schema.items():
    if key not in given:
      raise ConfigError(f"config key {key!r} is missing; every config derives from k3train/defaults.py")
    value = given[key]
    if isinstance(ref, bool):
      ok = isinstance(value, bool)
    elif isinstance(ref, int):
      ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(ref, float):
      ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif isinstance(ref, tuple):
      ok = isinstance(value, (tuple, list))
    else:
      ok = isinstance(value, type(ref))
    if not ok:
      raise ConfigError(f"config key {key!r} must be {type(ref).__name__}, got {value!r} "
                        f"({type(value).__name__})")


def _require(cond: bool, key: str, message: str) -> None:
  if not cond:
    raise ConfigError(f"{key}: {message}")


def validate(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Checks keys, types and cross-field consistency; returns cfg unchanged."""
  _check_types(cfg)
  m = cfg.model
  for key in ("vocab_size", "d_model", "num_layers", "dense_ffn_hidden"):
    _require(m[key] > 0, f"model.{key}", f"must be positive, got {m[key]}")
  _require(m.dtype in DTYPES, "model.dtype", f"must be one of {DTYPES}, got {m.dtype!r}")
  _require(m.param_dtype in DTYPES, "model.param_dtype", f"must be one of {DTYPES}, got {m.param_dtype!r}")
  _require(m.remat_policy in REMAT_POLICIES, "model.remat_policy",
           f"must be one of {REMAT_POLICIES}, got {m.remat_policy!r}")
  _require(m.norm_eps > 0, "model.norm_eps", "must be > 0")

  layers = tuple(m.mla_layers)
  not_int = [i for i in layers if not isinstance(i, int) or isinstance(i, bool)]
  _require(not not_int, "model.mla_layers", f"entries must be integer layer numbers; got {not_int}")
  bad = [i for i in layers if not 1 <= i <= m.num_layers]
  _require(not bad, "model.mla_layers",
           f"1-indexed layer numbers must lie in [1, {m.num_layers}] (model.num_layers); got {bad}")
  _require(len(set(layers)) == len(layers), "model.mla_layers", f"contains duplicates: {layers}")
  _require(0 <= m.num_dense_layers <= m.num_layers, "model.num_dense_layers",
           f"must lie in [0, {m.num_layers}], got {m.num_dense_layers}")

  k = m.kda
  _require(k.num_heads > 0 and k.head_dim > 0, "model.kda", "num_heads and head_dim must be positive")
  _require(k.conv_size >= 1, "model.kda.conv_size", f"must be >= 1, got {k.conv_size}")
  _require(k.gate_lower_bound < 0, "model.kda.gate_lower_bound", f"must be < 0, got {k.gate_lower_bound}")
  _require(k.chunk_size in (16, 32, 64, 128), "model.kda.chunk_size",
           f"must be one of 16, 32, 64, 128, got {k.chunk_size}")
  _require(k.backend in KDA_BACKENDS, "model.kda.backend", f"must be one of {KDA_BACKENDS}, got {k.backend!r}")

  a = m.mla
  for key in ("num_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
    _require(a[key] > 0, f"model.mla.{key}", f"must be positive, got {a[key]}")
  _require(a.qk_rope_head_dim >= 0, "model.mla.qk_rope_head_dim", "must be >= 0")
  _require(a.backend in ATTENTION_BACKENDS, "model.mla.backend",
           f"must be one of {ATTENTION_BACKENDS}, got {a.backend!r}")

  e = m.moe
  _require(e.num_experts > 0, "model.moe.num_experts", f"must be positive, got {e.num_experts}")
  _require(1 <= e.top_k <= e.num_experts, "model.moe.top_k",
           f"must lie in [1, model.moe.num_experts={e.num_experts}], got {e.top_k}")
  _require(e.latent_dim > 0 and e.expert_hidden > 0, "model.moe",
           "latent_dim and expert_hidden must be positive")
  _require(e.num_shared_experts >= 0, "model.moe.num_shared_experts", "must be >= 0")
  _require(e.num_shared_experts == 0 or e.shared_hidden % e.num_shared_experts == 0,
           "model.moe.shared_hidden",
           f"{e.shared_hidden} must be divisible by num_shared_experts={e.num_shared_experts}")
  _require(e.backend in MOE_BACKENDS, "model.moe.backend", f"must be one of {MOE_BACKENDS}, got {e.backend!r}")

  _require(m.attn_res.block_size >= 1, "model.attn_res.block_size",
           f"must be >= 1 decoder layers, got {m.attn_res.block_size}")

  _validate_data(cfg.data)
  t = cfg.train
  _require(t.global_batch_size >= 1, "train.global_batch_size", f"must be >= 1, got {t.global_batch_size}")
  _require(t.steps >= 0, "train.steps", f"must be >= 0, got {t.steps}")
  _require(t.microbatches >= 1 and t.global_batch_size % t.microbatches == 0, "train.microbatches",
           f"must be >= 1 and divide train.global_batch_size={t.global_batch_size}, "
           f"got {t.microbatches}")
  o = cfg.optim
  _require(o.optimizer in OPTIMIZERS, "optim.optimizer", f"must be one of {OPTIMIZERS}, got {o.optimizer!r}")
  _require(o.schedule in SCHEDULES, "optim.schedule", f"must be one of {SCHEDULES}, got {o.schedule!r}")
  _require(o.learning_rate > 0, "optim.learning_rate", "must be > 0")
  _require(o.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
  _require(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", f"must lie in [0, 1], got {o.min_lr_ratio}")
  _require(0 < o.wsd_decay_fraction <= 1, "optim.wsd_decay_fraction",
           f"must lie in (0, 1], got {o.wsd_decay_fraction}")
  _require(o.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
  _require(o.grad_clip_norm >= 0, "optim.grad_clip_norm", "must be >= 0 (0 turns clipping off)")
  _require(0 <= o.adam_b1 < 1 and 0 <= o.adam_b2 < 1, "optim.adam_b1/adam_b2", "must lie in [0, 1)")
  _require(0 <= o.muon_momentum < 1, "optim.muon_momentum", "must lie in [0, 1)")
  _require(o.qk_clip_tau > 0, "optim.qk_clip_tau", "must be > 0")
  _require(o.loss_spike_factor == 0 or o.loss_spike_factor > 1, "optim.loss_spike_factor",
           f"must be 0 (off) or > 1, got {o.loss_spike_factor}")
  _require(0 < o.loss_spike_ema < 1, "optim.loss_spike_ema", "must lie in (0, 1)")
  _require(t.log_every >= 1, "train.log_every", "must be >= 1")
  par = cfg.parallel
  for axis in ("data", "fsdp", "expert", "sequence", "tensor"):
    _require(par[axis] == -1 or par[axis] >= 1, f"parallel.{axis}", f"must be >= 1 or -1 (fill), got {par[axis]}")
  fills = [a for a in ("data", "fsdp", "expert", "sequence", "tensor") if par[a] == -1]
  _require(len(fills) <= 1, "parallel", f"at most one mesh axis may be -1, got {fills}")
  _require(par.rules in PARALLEL_RULES, "parallel.rules", f"must be one of {PARALLEL_RULES}, got {par.rules!r}")
  _require(par.expert_exchange in EXPERT_EXCHANGES, "parallel.expert_exchange",
           f"must be one of {EXPERT_EXCHANGES}, got {par.expert_exchange!r}")
  _require(cfg.checkpoint.every_steps >= 1, "checkpoint.every_steps", "must be >= 1")
  _require(cfg.checkpoint.max_to_keep >= 1, "checkpoint.max_to_keep", "must be >= 1")
  layer_schedule(m)  # raises ConfigError when the layer pattern cannot be scanned
  return cfg


def _validate_data(d: ml_collections.ConfigDict) -> None:
  _require(d.seq_len >= 2, "data.seq_len", f"must be >= 2, got {d.seq_len}")
  _require(d.num_workers >= 0, "data.num_workers", "must be >= 0")
  _require(d.num_threads >= 0, "data.num_threads", "must be >= 0")
  sources = tuple(d.sources)
  _require(len(sources) >= 1 and all(isinstance(s, str) and s for s in sources), "data.sources",
           f"must be a non-empty tuple of source names, got {sources!r}")
  _require(len(set(sources)) == len(sources), "data.sources", f"has duplicates: {sources}")
  weights = tuple(d.weights)
  _require(len(weights) == len(sources), "data.weights",
           f"needs one weight per source ({len(sources)}), got {weights!r}")
  _require(all(isinstance(w, (int, float)) and not isinstance(w, bool) and w > 0 for w in weights),
           "data.weights", f"must be positive numbers, got {weights!r}")
  v = d.vision
  _require(v.max_patches >= 4, "data.vision.max_patches", f"must be >= 4, got {v.max_patches}")
  _require(v.max_side >= 28 and v.max_side % 28 == 0, "data.vision.max_side",
           f"must be a positive multiple of 28 px, got {v.max_side}")
  _require(1 <= v.frames_per_chunk <= 4, "data.vision.frames_per_chunk",
           f"must lie in [1, 4], got {v.frames_per_chunk}")
  _require(v.video_fps > 0 and v.max_video_frames >= 1 and v.max_video_frame_patches >= 4,
           "data.vision", "video_fps must be > 0, max_video_frames >= 1, max_video_frame_patches >= 4")
  _require(v.max_input_pixels >= 1, "data.vision.max_input_pixels", "must be >= 1")
  _require(v.max_patches_per_row >= 4 and v.max_grids_per_row >= 1, "data.vision",
           "max_patches_per_row must be >= 4 and max_grids_per_row >= 1")


@dataclasses.dataclass(frozen=True)
class LayerSchedule:
  """How the decoder's layers are grouped: an unscanned prefix, scanned super-blocks, a suffix.

  kinds[i] is ("kda" | "mla", "dense" | "moe") for 0-indexed layer i.
  """
  kinds: tuple[tuple[str, str], ...]
  prefix: int            # layers [0, prefix) run unscanned
  period: tuple[tuple[str, str], ...]  # one super-block, e.g. 3 x (kda, moe) + (mla, moe)
  num_super_blocks: int  # scanned repetitions of `period`
  suffix_start: int      # layers [suffix_start, num_layers) run unscanned

  @property
  def num_kda(self) -> int:
    return sum(k == "kda" for k, _ in self.kinds)

  @property
  def num_mla(self) -> int:
    return sum(k == "mla" for k, _ in self.kinds)


def layer_schedule(m: ml_collections.ConfigDict) -> LayerSchedule:
  """Derives the layer kinds and the scan grouping from `model.mla_layers` and friends.

  The scan starts after the first MLA layer that ends the dense region and repeats the
  period [KDA, KDA, KDA, MLA] (generally: the gap between the first two MLA layers) while the
  pattern holds; whatever remains is the unscanned suffix (K3: the extra final MLA layer).
  """
  mla = set(m.mla_layers)
  kinds = tuple(("mla" if (i + 1) in mla else "kda", "dense" if i < m.num_dense_layers else "moe")
                for i in range(m.num_layers))
  if not m.scan_layers:
    return LayerSchedule(kinds, m.num_layers, (), 0, m.num_layers)
  mla_sorted = sorted(i - 1 for i in mla)  # 0-indexed
  # prefix: up to and including the first MLA layer at or after the dense layers.
  firsts = [i for i in mla_sorted if i >= m.num_dense_layers]
  if len(firsts) < 2:
    return LayerSchedule(kinds, m.num_layers, (), 0, m.num_layers)
  prefix = firsts[0] + 1
  period_len = firsts[1] - firsts[0]
  period = kinds[prefix:prefix + period_len]
  n = 0
  while prefix + (n + 1) * period_len <= m.num_layers and \
      kinds[prefix + n * period_len: prefix + (n + 1) * period_len] == period:
    n += 1
  return LayerSchedule(kinds, prefix, period, n, prefix + n * period_len)
