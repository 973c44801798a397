"""Config schema checks and derived fields.

Every config derives from `k3train/defaults.py` (the released K3), whose key set and value types are the schema.
`validate` fails at start with a message naming the key and what is allowed; nothing here fills
in model-defining numbers silently.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import os
import types
from typing import Any

import ml_collections

from k3train import defaults
from pallas_kernels import attention as attention_op
from pallas_kernels import attnres as attnres_op
from pallas_kernels import kda as kda_op
from pallas_kernels import logsumexp as logsumexp_op
from pallas_kernels import moe as moe_ops
from pallas_kernels import qb as qb_op
from pallas_kernels import short_conv as short_conv_op
from pallas_kernels import situ_glu as situ_glu_op
from k3train.quant import mx


class ConfigError(ValueError):
  """A config key is unknown, has the wrong type, or is inconsistent with another key."""


# "none", "full", or the name of a jax.checkpoint_policies policy.
REMAT_POLICIES = ("none", "full", "selective", "selective_kda", "dots_saveable",
                  "dots_with_no_batch_dims_saveable")
DTYPES = ("float32", "bfloat16", "float16", "float64")
OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "wsd")
MUON_NS_DTYPES = ("bfloat16", "float32")
ADAM_MU_DTYPES = ("float32", "bfloat16")
PARALLEL_RULES = ("default", "long_context", "full")   # k3train/parallel/rules.py RECIPES
EXPERT_EXCHANGES = ("auto", "all_to_all", "ragged")
KDA_BACKENDS = kda_op.BACKENDS
SHORT_CONV_BACKENDS = short_conv_op.BACKENDS
MOE_BACKENDS = moe_ops.BACKENDS
ATTENTION_BACKENDS = attention_op.BACKENDS
ATTNRES_BACKENDS = attnres_op.BACKENDS
QB_BACKENDS = qb_op.BACKENDS
SITU_GLU_BACKENDS = situ_glu_op.BACKENDS
HEAD_LSE_BACKENDS = logsumexp_op.BACKENDS
MOE_GATHERS = moe_ops.GATHERS
QAT_GEMMS = ("auto", "fake_quant", "mx")     # model.quant.gemm (k3train/model/moe.py)
# `data` keys that may change between curriculum stages (and so between a checkpoint and the run
# restoring it): the data iterator re-plans them without losing its place in any source.
DATA_STAGE_KEYS = ("weights", "seq_len", "num_workers", "num_threads", "long_doc_weight")


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


def fill_missing_keys(cfg: ml_collections.ConfigDict) -> list[str]:
  """In place: every key of the schema (k3train/defaults.py) that `cfg` lacks is set to its
  default, so a config saved by an earlier k3train (a checkpoint's, an imported run's config
  file) still validates. Returns the dotted names filled."""
  filled = []

  def walk(ref: ml_collections.ConfigDict, node: ml_collections.ConfigDict, prefix: str) -> None:
    for key, value in ref.items():
      if key not in node:
        node[key] = copy.deepcopy(value)
        filled.append(prefix + key)
      elif isinstance(value, ml_collections.ConfigDict) and isinstance(node[key], ml_collections.ConfigDict):
        walk(value, node[key], prefix + key + ".")

  walk(_schema(), cfg, "")
  return filled


def _flatten(cfg: Any, prefix: str = "") -> dict[str, Any]:
  out = {}
  for key, value in cfg.items():
    path = f"{prefix}{key}"
    if isinstance(value, ml_collections.ConfigDict):
      out.update(_flatten(value, path + "."))
    else:
      out[path] = value
  return out


def _same_type(ref, value) -> bool:
  """Whether `value` may stand where the schema has `ref` (ints for floats, lists for tuples)."""
  if isinstance(ref, bool):
    return isinstance(value, bool)
  if isinstance(ref, int):
    return isinstance(value, int) and not isinstance(value, bool)
  if isinstance(ref, float):
    return isinstance(value, (int, float)) and not isinstance(value, bool)
  if isinstance(ref, tuple):
    return isinstance(value, (tuple, list))
  return isinstance(value, type(ref))


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
    if not _same_type(ref, value):
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
  _require(m.head_lse_backend in HEAD_LSE_BACKENDS, "model.head_lse_backend",
           f"must be one of {HEAD_LSE_BACKENDS}, got {m.head_lse_backend!r}")
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
  _require(k.conv_backend in SHORT_CONV_BACKENDS, "model.kda.conv_backend",
           f"must be one of {SHORT_CONV_BACKENDS}, got {k.conv_backend!r}")

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
  _require(0 <= e.qb_rounds <= 16, "model.moe.qb_rounds", f"must lie in [0, 16], got {e.qb_rounds}")
  _require(e.num_shared_experts == 0 or e.shared_hidden % e.num_shared_experts == 0,
           "model.moe.shared_hidden",
           f"{e.shared_hidden} must be divisible by num_shared_experts={e.num_shared_experts}")
  _require(e.backend in MOE_BACKENDS, "model.moe.backend", f"must be one of {MOE_BACKENDS}, got {e.backend!r}")
  _require(e.qb_backend in QB_BACKENDS, "model.moe.qb_backend",
           f"must be one of {QB_BACKENDS}, got {e.qb_backend!r}")
  _require(e.situ_backend in SITU_GLU_BACKENDS, "model.moe.situ_backend",
           f"must be one of {SITU_GLU_BACKENDS}, got {e.situ_backend!r}")
  _require(e.gather_backend in MOE_GATHERS, "model.moe.gather_backend",
           f"must be one of {MOE_GATHERS}, got {e.gather_backend!r}")
  _validate_quant(m)

  _require(m.mtp.loss_weight >= 0, "model.mtp.loss_weight", f"must be >= 0, got {m.mtp.loss_weight}")
  _require(m.attn_res.block_size >= 1, "model.attn_res.block_size",
           f"must be >= 1 decoder layers, got {m.attn_res.block_size}")
  _require(m.attn_res.backend in ATTNRES_BACKENDS, "model.attn_res.backend",
           f"must be one of {ATTNRES_BACKENDS}, got {m.attn_res.backend!r}")

  _validate_data(cfg.data)
  _validate_vision(m, cfg.data)
  t = cfg.train
  _require(t.global_batch_size >= 1, "train.global_batch_size", f"must be >= 1, got {t.global_batch_size}")
  _require(t.steps >= 0, "train.steps", f"must be >= 0, got {t.steps}")
  _require(t.peak_flops_per_device >= 0, "train.peak_flops_per_device",
           f"must be >= 0 (0: by device kind), got {t.peak_flops_per_device}")
  _require(0 <= t.memory_margin < 1, "train.memory_margin",
           f"must be in [0, 1) (a share of the device's memory limit), got {t.memory_margin}")
  _require(t.microbatches >= 1 and t.global_batch_size % t.microbatches == 0, "train.microbatches",
           f"must be >= 1 and divide train.global_batch_size={t.global_batch_size}, "
           f"got {t.microbatches}")
  _validate_loss_chunk(cfg)
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
  _require(o.adam_mu_dtype in ADAM_MU_DTYPES, "optim.adam_mu_dtype",
           f"must be one of {ADAM_MU_DTYPES}, got {o.adam_mu_dtype!r}")
  _require(0 <= o.muon_momentum < 1, "optim.muon_momentum", "must lie in [0, 1)")
  _require(o.muon_ns_dtype in MUON_NS_DTYPES, "optim.muon_ns_dtype",
           f"must be one of {MUON_NS_DTYPES}, got {o.muon_ns_dtype!r}")
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
  xla_options(t.xla_options)     # raises ConfigError on a malformed entry
  _validate_eval(cfg.eval)
  _validate_metrics(cfg)
  if t.use_stages:
    stages(cfg)       # raises ConfigError naming the stage and the key
  return cfg


def xla_options(text: str) -> dict:
  """train.xla_options 'name=value name=value' → {name: value} for jax.jit's compiler_options.

  Values "true" / "false" become bools, integer and float literals numbers, anything else stays
  text (e.g. an enum list such as "FUSION,CUBLAS"). Every name must start with "xla_"; whether
  the XLA build knows it is checked when the step compiles (XLA names an unknown option)."""
  options = {}
  for item in text.split():
    name, eq, value = item.partition("=")
    _require(bool(eq) and bool(name) and bool(value), "train.xla_options",
             f"entries must be name=value separated by spaces; got {item!r}")
    _require(name.startswith("xla_"), "train.xla_options",
             f"{name!r} is not an XLA option (names start with 'xla_')")
    _require(name not in options, "train.xla_options", f"{name!r} is given twice")
    options[name] = _typed_option(value)
  return options


def _typed_option(value: str):
  if value.lower() in ("true", "false"):
    return value.lower() == "true"
  for kind in (int, float):
    try:
      return kind(value)
    except ValueError:
      pass
  return value


def _validate_loss_chunk(cfg: ml_collections.ConfigDict) -> None:
  """train.loss_chunk_tokens (k3train/train/head_loss.py): 0, or a divisor of data.seq_len that
  the sequence shards divide (each chunk's positions are split over them). A staged run
  validates every stage's config, so every stage's seq_len is checked."""
  c, seq, shards = cfg.train.loss_chunk_tokens, cfg.data.seq_len, cfg.parallel.sequence
  shards = shards if shards > 1 else 1       # -1 (fill): the mesh checks the chunk at trace time
  allowed = f"0 (unfused head) or a divisor of data.seq_len={seq}"
  if shards > 1:
    allowed += f" that is a multiple of parallel.sequence={shards}"
  _require(c == 0 or (c > 0 and seq % c == 0 and c % shards == 0), "train.loss_chunk_tokens",
           f"must be {allowed}, got {c}")


def _validate_quant(m: ml_collections.ConfigDict) -> None:
  """model.quant: MX QAT of the routed experts (docs/maths.md §7.5)."""
  q = m.quant
  _require(q.weights in mx.FORMATS, "model.quant.weights", f"must be one of {mx.FORMATS}, got {q.weights!r}")
  _require(q.activations in mx.FORMATS + ("none",), "model.quant.activations",
           f"must be one of {mx.FORMATS + ('none',)}, got {q.activations!r}")
  _require(q.scale_rule in mx.SCALE_RULES, "model.quant.scale_rule",
           f"must be one of {mx.SCALE_RULES}, got {q.scale_rule!r}")
  _require(q.gemm in QAT_GEMMS, "model.quant.gemm", f"must be one of {QAT_GEMMS}, got {q.gemm!r}")
  _require(q.start_step >= 0, "model.quant.start_step", f"must be >= 0, got {q.start_step}")
  _require(q.gemm != "mx" or (q.weights, q.activations) == ("mxfp4", "mxfp8"), "model.quant.gemm",
           f"'mx' reads MXFP4 weights and MXFP8 activations; got weights={q.weights!r}, "
           f"activations={q.activations!r} (use fake_quant)")
  if q.enabled:
    for key in ("latent_dim", "expert_hidden"):
      _require(m.moe[key] % mx.BLOCK == 0, f"model.moe.{key}",
               f"must be a multiple of the MX block ({mx.BLOCK}) with model.quant.enabled, got {m.moe[key]}")


def _validate_metrics(cfg: ml_collections.ConfigDict) -> None:
  """metrics.* (k3train/train/writers.py) and the held-out split (k3train/data/split.py)."""
  s = cfg.metrics
  _require(s.vectors_every >= 0, "metrics.vectors_every", f"must be >= 0 (0: never), got {s.vectors_every}")
  _require(not s.wandb or bool(s.wandb_project.strip()), "metrics.wandb_project",
           "must name a W&B project when metrics.wandb is on")
  f = cfg.data.heldout_fraction
  _require(0 <= f < 1, "data.heldout_fraction", f"must lie in [0, 1), got {f}")
  training = [e for e in cfg.eval.sources if e in tuple(cfg.data.sources)]
  _require(f > 0 or not training, "data.heldout_fraction",
           f"is 0, but eval.sources names training sources {training}, which are evaluated on "
           "their held-out part: set data.heldout_fraction > 0 (e.g. 0.01) or evaluate a separate "
           "validation source")


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
  _require(all(isinstance(w, (int, float)) and not isinstance(w, bool) and w >= 0 for w in weights)
           and any(w > 0 for w in weights),
           "data.weights", f"must be numbers >= 0, at least one positive, got {weights!r}")
  _require(d.long_doc_weight >= 1, "data.long_doc_weight", f"must be >= 1, got {d.long_doc_weight}")
  _require(0 <= d.skip_warn_fraction <= 1, "data.skip_warn_fraction",
           f"must lie in [0, 1] (1: never warn), got {d.skip_warn_fraction}")
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


def _validate_vision(m: ml_collections.ConfigDict, d: ml_collections.ConfigDict) -> None:
  """model.vision (docs/maths.md §6.2) and its agreement with data.vision."""
  w = m.vision
  _require(w.enabled == d.vision.enabled, "model.vision.enabled",
           f"is {w.enabled} but data.vision.enabled is {d.vision.enabled}; they must agree (the "
           "tower reads the pipeline's vision_* batch keys, which only data.vision.enabled emits)")
  if not w.enabled:
    return
  for key in ("num_layers", "d_model", "num_heads", "head_dim", "mlp_hidden", "pos_height",
              "pos_width", "max_frames"):
    _require(w[key] > 0, f"model.vision.{key}", f"must be positive, got {w[key]}")
  _require(w.head_dim % 4 == 0, "model.vision.head_dim",
           f"must be divisible by 4 (2D RoPE rotates pairs by row and column), got {w.head_dim}")
  _require(w.d_model % 2 == 0, "model.vision.d_model",
           f"must be even (sin-cos time embedding), got {w.d_model}")
  _require(w.patch_size == 14, "model.vision.patch_size",
           f"must be 14: the pipeline cuts 14 × 14 px patches (588 values), got {w.patch_size}")
  _require(d.vision.frames_per_chunk <= w.max_frames, "data.vision.frames_per_chunk",
           f"{d.vision.frames_per_chunk} exceeds model.vision.max_frames={w.max_frames} (the "
           "length of the tower's time table)")
  _require(w.rope_theta > 0, "model.vision.rope_theta", "must be > 0")
  _require(w.norm_eps > 0 and w.projector_norm_eps > 0, "model.vision",
           "norm_eps and projector_norm_eps must be > 0")
  _require(0 <= w.placeholder_id < m.vocab_size, "model.vision.placeholder_id",
           f"must lie in [0, model.vocab_size={m.vocab_size}), got {w.placeholder_id}")
  _require(w.backend in ATTENTION_BACKENDS, "model.vision.backend",
           f"must be one of {ATTENTION_BACKENDS}, got {w.backend!r}")


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


# --- The staged context curriculum (train.stages; docs/maths.md §9) ----------------------------

STAGE_LR_SEGMENTS = ("stable", "decay", "low")
RETRIEVAL_TASKS = ("passkey", "multikey", "vartrack")   # k3train/data/retrieval.py
_MESH_AXES = ("data", "fsdp", "expert", "sequence", "tensor")


def _validate_eval(ev: ml_collections.ConfigDict) -> None:
  _require(ev.every_steps >= 0, "eval.every_steps", f"must be >= 0 (0: only at stage ends), got {ev.every_steps}")
  _require(ev.batches >= 0, "eval.batches", f"must be >= 0, got {ev.batches}")
  _require(ev.position_buckets >= 1, "eval.position_buckets", f"must be >= 1, got {ev.position_buckets}")
  _require(all(isinstance(s, str) and s for s in ev.sources), "eval.sources",
           f"must be source names, got {tuple(ev.sources)!r}")
  bad = [task for task in ev.retrieval if task not in RETRIEVAL_TASKS]
  _require(not bad, "eval.retrieval", f"unknown tasks {bad}; known: {RETRIEVAL_TASKS}")


@dataclasses.dataclass(frozen=True)
class Stage:
  """One stage of a run: steps [start_step, end_step), trained with the whole config `cfg`."""
  index: int
  name: str
  start_step: int
  end_step: int
  start_tokens: int              # tokens seen before the stage (global batch × seq_len per step)
  lr: str                        # learning-rate segment ("" when no stage names one)
  cfg: ml_collections.ConfigDict  # train.use_stages False; optim/train.steps carry the run's schedule

  @property
  def tokens_per_step(self) -> int:
    return self.cfg.train.global_batch_size * self.cfg.data.seq_len


def _stage_entry(i: int, entry) -> dict[str, Any]:
  """A train.stages entry → its flat keys, checked against `defaults.curriculum_stage()`."""
  if isinstance(entry, dict):
    entry = ml_collections.ConfigDict(entry)
  _require(isinstance(entry, ml_collections.ConfigDict), f"train.stages[{i}]",
           f"must be a ConfigDict from defaults.curriculum_stage(...), got {type(entry).__name__}")
  schema = _flatten(defaults.curriculum_stage())
  given = _flatten(entry)
  name = given.get("name", "")
  where = f"train.stages[{i}] ({name!r})"
  for key, value in given.items():
    _require(key in schema, f"{where}.{key}", f"unknown stage key; known: {sorted(schema)}")
    ref = schema[key]
    _require(_same_type(ref, value), f"{where}.{key}", f"must be {type(ref).__name__}, got {value!r}")
  out = {**schema, **given}
  _require(isinstance(name, str) and name, f"{where}.name", "every stage needs a name")
  for key in ("until_step", "until_tokens", "seq_len", "global_batch_size", "microbatches"):
    _require(out[key] >= 0, f"{where}.{key}", f"must be >= 0 (0: as the previous stage), got {out[key]}")
  _require(out["long_doc_weight"] == 0 or out["long_doc_weight"] >= 1, f"{where}.long_doc_weight",
           f"must be 0 (as the previous stage) or >= 1, got {out['long_doc_weight']}")
  _require(out["lr"] in ("",) + STAGE_LR_SEGMENTS, f"{where}.lr",
           f"must be one of {STAGE_LR_SEGMENTS} or '' (as the previous stage), got {out['lr']!r}")
  for axis in _MESH_AXES:
    size = out[f"parallel.{axis}"]
    _require(size >= -1, f"{where}.parallel.{axis}", f"must be >= 1, -1 (fill) or 0 (as before), got {size}")
  return out


def stages(cfg: ml_collections.ConfigDict) -> list[Stage]:
  """The run's stages with the config of each (README "Curriculum").

  Without train.use_stages: one stage, the config itself, to train.steps. Otherwise each entry of
  train.stages changes its keys on top of the previous stage's config, and every stage's config is
  validated; errors name the stage and the key. With learning-rate segments, every stage config
  carries the run's warmup-stable-decay schedule as optim.schedule = "wsd",
  optim.wsd_decay_fraction and train.steps = the step where the decay ends (its horizon).
  """
  t = cfg.train
  if not t.use_stages:
    return [Stage(0, "", 0, t.steps, 0, "", cfg)]
  table = tuple(t.stages)
  _require(len(table) >= 1, "train.stages", "is empty but train.use_stages is True")
  entries = [_stage_entry(i, e) for i, e in enumerate(table)]
  seen = {}
  for i, e in enumerate(entries):
    _require(e["name"] not in seen, f"train.stages[{i}] ({e['name']!r}).name",
             f"repeats the name of train.stages[{seen.get(e['name'])}]")
    seen[e["name"]] = i
  named_lr = any(e["lr"] for e in entries)
  records = []                   # (entry, where, cfg, start, end, start_tokens, lr)
  prev, start, tokens, lr = cfg, 0, 0, "stable"
  for i, e in enumerate(entries):
    where = f"train.stages[{i}] ({e['name']!r})"
    c = copy.deepcopy(prev)
    c.train.use_stages = False
    c.train.stages = ()
    seq = e["seq_len"] or prev.data.seq_len
    prev_tokens = prev.train.global_batch_size * prev.data.seq_len
    if e["global_batch_size"]:
      batch = e["global_batch_size"]
    else:
      _require(prev_tokens % seq == 0, f"{where}.global_batch_size",
               f"0 keeps the previous {prev_tokens:,} tokens per step, which seq_len={seq} does not "
               "divide; give global_batch_size")
      batch = prev_tokens // seq
    c.data.seq_len, c.train.global_batch_size = seq, batch
    c.train.microbatches = e["microbatches"] or prev.train.microbatches
    if e["weights"]:
      _require(len(e["weights"]) == len(c.data.sources), f"{where}.weights",
               f"needs one weight per data.sources entry {tuple(c.data.sources)}, got {tuple(e['weights'])}")
      c.data.weights = tuple(float(w) for w in e["weights"])
    if e["long_doc_weight"]:
      c.data.long_doc_weight = float(e["long_doc_weight"])
    for axis in _MESH_AXES:
      if e[f"parallel.{axis}"]:
        c.parallel[axis] = e[f"parallel.{axis}"]
    if e["parallel.rules"]:
      c.parallel.rules = e["parallel.rules"]
    if e["lr"]:
      _require(STAGE_LR_SEGMENTS.index(e["lr"]) >= STAGE_LR_SEGMENTS.index(lr), f"{where}.lr",
               f"{e['lr']!r} after {lr!r}: the segments run stable → decay → low")
      lr = e["lr"]
    step_end, token_end = e["until_step"], e["until_tokens"]
    _require(not (step_end and token_end), f"{where}.until_step",
             "give until_step or until_tokens, not both")
    per_step = batch * seq
    if step_end:
      end = step_end
    elif token_end:
      _require(token_end > tokens, f"{where}.until_tokens",
               f"{token_end:,} is not after the {tokens:,} tokens seen when the stage starts")
      end = start - (-(token_end - tokens) // per_step)
    else:
      _require(i == len(entries) - 1, f"{where}.until_step",
               "every stage but the last needs until_step or until_tokens")
      end = max(t.steps, start)   # the last stage runs to train.steps
    _require(end > start or not (step_end or token_end), f"{where}.until_step",
             f"the stage ends at step {end}, not after its start at step {start} (the previous "
             "stage's end): stage ends must increase")
    seq_shards = c.parallel.sequence
    _require(seq_shards < 1 or seq % seq_shards == 0, f"{where}.seq_len",
             f"{seq} is not divisible by parallel.sequence={seq_shards}")
    batch_axes = [c.parallel[a] for a in ("data", "fsdp", "expert")]
    shards = 1
    for size in batch_axes:
      shards *= size
    if -1 not in batch_axes:
      rows = batch // max(c.train.microbatches, 1)
      _require(batch % c.train.microbatches == 0 and rows % shards == 0, f"{where}.global_batch_size",
               f"{batch} rows in {c.train.microbatches} micro-batch(es) do not split over "
               f"data·fsdp·expert = {shards} batch shards")
    records.append((e, where, c, start, end, tokens, lr if named_lr else ""))
    tokens += (end - start) * per_step
    prev, start = c, end
  last_end = records[-1][4]
  if named_lr:
    lrs = [r[6] for r in records]
    if "decay" in lrs:
      first = lrs.index("decay")
      last = len(lrs) - 1 - lrs[::-1].index("decay")
      decay_start, horizon = records[first][3], records[last][4]
    elif "low" in lrs:
      first = lrs.index("low")
      _require(first > 0, f"{records[first][1]}.lr", "the first stage cannot be 'low' (it follows a stable or decay stage)")
      horizon = records[first][3] - 1   # peak through this step, low from the next
      decay_start = horizon
    else:
      decay_start = horizon = last_end
    warmup = min(cfg.optim.warmup_steps, horizon)
    _require(decay_start >= warmup, f"{records[first][1] if 'decay' in lrs else 'train.stages'}.lr",
             f"the decay starts at step {decay_start}, inside the warmup (optim.warmup_steps="
             f"{cfg.optim.warmup_steps}); start it later or shorten the warmup")
    decay = horizon - decay_start
    fraction = decay / horizon if decay else (0.25 / horizon if horizon else 1.0)
    for r in records:
      r[2].optim.schedule = "wsd"
      r[2].optim.wsd_decay_fraction = float(fraction)
      r[2].train.steps = int(horizon)
  else:
    for r in records:
      r[2].train.steps = int(last_end)
  out = []
  for i, (e, where, c, start, end, start_tokens, seg) in enumerate(records):
    try:
      validate(c)
    except ConfigError as err:
      raise ConfigError(f"{where}: {err}") from None
    out.append(Stage(i, e["name"], start, end, start_tokens, seg, c))
  return out


def run_end(cfg: ml_collections.ConfigDict, run_stages: list[Stage] | None = None) -> int:
  """The step the run ends at: the last stage's end or train.steps, whichever comes first."""
  run_stages = stages(cfg) if run_stages is None else run_stages
  return min(cfg.train.steps, run_stages[-1].end_step)


def stage_at(run_stages: list[Stage], step: int) -> int:
  """Index of the stage that trains step `step` + 1 (a stage's end step belongs to the next)."""
  for s in run_stages:
    if step < s.end_step:
      return s.index
  return run_stages[-1].index
