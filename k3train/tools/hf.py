"""Hugging Face K3 checkpoints in and out: the released layout ↔ a k3train run directory.

  python -m k3train.tools.hf import --hf_checkpoint=DIR --workdir=W [--config=FILE ...]
  python -m k3train.tools.hf export --workdir=W --out=DIR [--mxfp4_experts] [--shard_size_mb=N]

import reads config.json into a k3train config (every K3 key mapped; unknown keys refused by
name; `--config` supplies the recipe: data, train, optim, parallel and the model settings a
release does not define) and writes W as a run that `k3train.main` resumes from:

  W/config.py          the run's config (`python -m k3train.main --config=W/config.py --workdir=W`)
  W/checkpoints/1/     the train state: imported parameters and router biases, a fresh optimizer
                       state, a fresh data-iterator state. It is saved as step 1 because
                       k3train.main resumes from the latest step only when that step is > 0.
  W/hf_release/        what export needs to write the same layout back: release.json (the
                       original config.json, every shard's tensor names, dtypes and order),
                       the release's other files (tokenizer, …) and, when the model has no MTP
                       module, the release's `model.mtp.*` tensors unchanged.

The whole release is checked before anything is written (config, shard headers, every tensor's
presence, shape and dtype, truncated shards), and W is assembled in a sibling folder and renamed
at the end: a refused or failed import leaves no W behind. Parameters are created already
sharded over the run's mesh (`k3train.train.layout`): each process reads only the tensors (and
experts) that its devices hold, one release tensor at a time.

export restores the latest checkpoint of W (`Checkpointer`, read-only) and writes the release
layout into DIR (assembled in a sibling folder, renamed when complete), shard by shard and
tensor by tensor: the same tensor names, dtypes and shards as the imported release (recorded in
W/hf_release), or a fresh layout in shards of --shard_size_mb. Routed experts are MXFP4-packed
(docs/maths.md §7.4) where the source had them packed, or everywhere with --mxfp4_experts.
Export runs in one process (multi-process export is not built).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import shutil
import sys
import time

from absl import flags

from k3train import cli

PROG = "python -m k3train.tools.hf"
COMMANDS = ("import", "export")
IMPORT_STEP = 1
RELEASE_DIR = "hf_release"
RELEASE_JSON = "release.json"
PASSTHROUGH = "passthrough.safetensors"
MXFP4_QUANTIZATION = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
                      "weights": {"num_bits": 4, "type": "float", "group_size": 32,
                                  "scale_dtype": "e8m0"},
                      "targets": ["block_sparse_moe.experts"]}


class HFError(ValueError):
  """A run directory or target that cannot be imported into / exported from (names what)."""


def _define(fv: flags.FlagValues) -> None:
  flags.DEFINE_string("hf_checkpoint", None, "release directory (config.json + *.safetensors)",
                      flag_values=fv)
  flags.DEFINE_string("workdir", None, "k3train run directory", flag_values=fv)
  flags.DEFINE_string("out", None, "export: the release directory to write", flag_values=fv)
  flags.DEFINE_boolean("mxfp4_experts", None, "export: pack every routed expert as MXFP4 "
                       "(default: as the imported release had them)", flag_values=fv)
  flags.DEFINE_integer("shard_size_mb", 5000, "export without an imported layout: shard size",
                       flag_values=fv)


# ----------------------------------------------------------------------------- shared helpers


def base_config(cfg=None):
  """The recipe a release is imported into: `cfg` or the released K3 defaults."""
  from k3train import defaults
  return cfg if cfg is not None else defaults.k3_full()


def run_config(workdir: str, cfg=None):
  """The config of a run directory: `cfg` if given, else W/config.py, else the config saved in
  its latest checkpoint."""
  from k3train import config as config_lib
  if cfg is not None:
    return cfg
  path = os.path.join(workdir, "config.py")
  if os.path.isfile(path):
    return config_lib.validate(config_lib.load_file(path))
  import orbax.checkpoint as ocp
  directory = os.path.join(os.path.abspath(workdir), "checkpoints")
  if not os.path.isdir(directory):
    raise HFError(f"{workdir!r} has no checkpoints/ (and no config.py)")
  manager = ocp.CheckpointManager(directory, item_names=("state", "data_iter", "config"))
  step = manager.latest_step()
  if step is None:
    raise HFError(f"{workdir!r} has no checkpoint")
  saved = manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
  manager.close()
  return config_lib.validate(config_from_json(saved))


def _split_model(cfg):
  """(graphdef, params, rest) of the abstract model (ShapeDtypeStructs, nothing allocated)."""
  from flax import nnx
  from k3train.model.decoder import abstract_model
  return nnx.split(abstract_model(cfg.model), nnx.Param, ...)


def _flat_shapes(tree, prefix: str) -> dict:
  import jax
  from k3train.tree_paths import path_names
  return {prefix + ".".join(path_names(p)): tuple(leaf.shape)
          for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def make_table(cfg):
  from k3train.tools import hf_layout
  _, params, rest = _split_model(cfg)
  shapes = {**_flat_shapes(params, "params."), **_flat_shapes(rest, "rest.")}
  return hf_layout.Table(cfg, shapes)


@dataclasses.dataclass
class ImportPlan:
  packed: dict            # entry name → True when the release holds it MXFP4-packed
  passthrough: list       # release tensors kept verbatim (model.mtp.* without an MTP module)


def plan_import(release, table) -> ImportPlan:
  """Checks every release tensor against the table; raises naming the first problem."""
  from k3train.tools import hf_files
  floats = ("BF16", "F16", "F32", "F64")
  present = release.tensors
  used, packed, problems = set(), {}, []
  for e in table.entries:
    pname, sname = e.packed_names()
    if e.expert and e.name not in present and (pname in present or sname in present):
      for name, shape in zip((pname, sname), e.packed_shapes()):
        info = present.get(name)
        if info is None:
          problems.append(f"missing tensor {name!r}")
        elif info.shape != shape or info.dtype != "U8":
          problems.append(f"tensor {name!r} is {info.dtype} {list(info.shape)}, expected U8 "
                          f"{list(shape)}")
        used.add(name)
      packed[e.name] = True
      continue
    info = present.get(e.name)
    if info is None:
      problems.append(f"missing tensor {e.name!r}")
      continue
    used.add(e.name)
    if info.shape != e.hf_shape:
      problems.append(f"tensor {e.name!r} has shape {list(info.shape)}, expected "
                      f"{list(e.hf_shape)}")
    elif info.dtype not in floats:
      problems.append(f"tensor {e.name!r} has dtype {info.dtype}, expected a float type")
  has_mtp = any(e.name.startswith("model.mtp.") for e in table.entries)
  passthrough = [] if has_mtp else sorted(n for n in present if n.startswith("model.mtp."))
  unknown = sorted(set(present) - used - set(passthrough))
  problems += [f"unknown tensor {n!r} in {present[n].file}" for n in unknown]
  if problems:
    more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
    raise hf_files.ReleaseError(problems[0] + more)
  return ImportPlan(packed, passthrough)


class _Reader:
  """Release tensor → k3train slice (fp32), one tensor cached (the callbacks of one array's
  device shards usually ask for the same tensor in turn)."""

  def __init__(self, release, plan: ImportPlan):
    self.release, self.plan = release, plan
    self._last = (None, None)
    self.requantize_mismatches = 0

  def core(self, entry, dtype):
    import numpy as np
    from k3train.tools import hf_layout
    if self._last[0] == entry.name:
      return self._last[1]
    if self.plan.packed.get(entry.name):
      from k3train.quant import mx
      pname, sname = entry.packed_names()
      packed, scale = self.release.read(pname), self.release.read(sname)
      w = np.asarray(mx.import_mxfp4(packed, scale, in_axis=-1))
      again, again_scale = mx.export_mxfp4(w, in_axis=-1)
      if not (np.array_equal(np.asarray(again), packed) and np.array_equal(np.asarray(again_scale), scale)):
        self.requantize_mismatches += 1
    else:
      w = self.release.read(entry.name)
    core = hf_layout.from_hf(entry, np.asarray(w).astype(np.float32)).astype(dtype)
    self._last = (entry.name, core)
    return core


def _array_filler(table, reader: _Reader):
  """fill(key, shape, dtype) → callback(index) giving that block of the k3train array."""
  import numpy as np
  by_key = {}
  for e in table.entries:
    by_key.setdefault(e.key, {})[e.index] = e

  def fill(key, shape, dtype):
    entries = by_key.get(key)

    def callback(index):
      index = tuple(index) + (slice(None),) * (len(shape) - len(index))
      ranges = [range(*index[d].indices(shape[d])) for d in range(len(shape))]
      if entries is None:                       # forward-written state: starts at zero
        return np.zeros(tuple(len(r) for r in ranges), dtype)
      lead = len(next(iter(entries)))
      starts = [r.start for r in ranges[:lead]]
      out = np.empty(tuple(len(r) for r in ranges), dtype)
      for combo in itertools.product(*ranges[:lead]):
        core = reader.core(entries[combo], dtype)
        out[tuple(c - s for c, s in zip(combo, starts))] = core[index[lead:]]
      return out

    return callback

  return fill


def build_model_state(cfg, release, table, plan, *, layout=None):
  """(graphdef, params, rest) holding the release's values: sharded over `layout`'s mesh (each
  process reads only its devices' blocks), or whole arrays on the default device."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx
  from k3train.parallel import state_sharding
  from k3train.tree_paths import path_names
  graphdef, params, rest = _split_model(cfg)
  reader = _Reader(release, plan)
  fill = _array_filler(table, reader)
  is_var = lambda x: isinstance(x, nnx.Variable)

  def build(tree, prefix):
    shardings = (state_sharding.nnx_state_shardings(tree, layout.rules, layout.mesh)
                 if layout is not None else None)

    def one(path, var, sh=None):
      key = prefix + ".".join(path_names(path))
      shape, dtype = tuple(var.shape), np.dtype(var.dtype)
      cb = fill(key, shape, dtype)
      if sh is None:
        value = jnp.asarray(cb(tuple(slice(None) for _ in shape)))
      else:
        value = jax.make_array_from_callback(shape, sh.get_value(), cb)
      return var.replace(value)

    if shardings is None:
      return jax.tree_util.tree_map_with_path(one, tree, is_leaf=is_var)
    return jax.tree_util.tree_map_with_path(one, tree, shardings, is_leaf=is_var)

  params, rest = build(params, "params."), build(rest, "rest.")
  if reader.requantize_mismatches:
    print(f"note: {reader.requantize_mismatches} MXFP4 expert tensors do not re-encode to the "
          "same bytes with k3train's scale rule; their export will differ in bytes (the values "
          "are identical)", file=sys.stderr)
  return graphdef, params, rest


def load_release_model(hf_dir: str, cfg=None):
  """(model, cfg) with the weights of a release directory, on the default device."""
  from flax import nnx
  from k3train.tools import hf_files, hf_layout
  release = hf_files.Release(hf_dir)
  cfg = hf_layout.config_from_hf(release.config, base_config(cfg))
  table = make_table(cfg)
  plan = plan_import(release, table)
  graphdef, params, rest = build_model_state(cfg, release, table, plan)
  return nnx.merge(graphdef, params, rest), cfg


def _abstract_train_state(cfg, layout):
  """The run's TrainState as ShapeDtypeStructs carrying the layout's shardings."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from k3train.optim.optimizer import make_optimizer
  from k3train.parallel import state_sharding
  from k3train.train.step import TrainState
  _, params, rest = _split_model(cfg)
  optimizer = make_optimizer(cfg, params)
  opt = jax.eval_shape(optimizer.init, params)
  p_sh = state_sharding.nnx_state_shardings(params, layout.rules, layout.mesh)
  r_sh = state_sharding.nnx_state_shardings(rest, layout.rules, layout.mesh)
  o_sh = state_sharding.mirror_shardings(opt, params, p_sh, layout.mesh)
  sds = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
  rep = layout.replicated
  scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype, sharding=rep)
  return TrainState(scalar(jnp.int32), jax.tree.map(sds, params, p_sh),
                    jax.tree.map(sds, rest, r_sh), jax.tree.map(sds, opt, o_sh),
                    scalar(jnp.float32), scalar(jnp.int32))


def restore_workdir(workdir: str, cfg=None):
  """(cfg, TrainState of the latest checkpoint, step) of a run directory (read-only)."""
  from k3train.train import layout as layout_lib
  from k3train.train.checkpoint import Checkpointer
  cfg = run_config(workdir, cfg)
  directory = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(directory):
    raise HFError(f"{workdir!r} has no checkpoints/")
  layout = layout_lib.make_layout(cfg)
  ckpt = Checkpointer(directory, cfg)
  step = ckpt.latest_step()
  if step is None:
    ckpt.close()
    raise HFError(f"{workdir!r} has no checkpoint")
  state, _ = ckpt.restore(step, _abstract_train_state(cfg, layout))
  ckpt.close()
  return cfg, state, step


def load_workdir_model(workdir: str, cfg=None):
  """(model, cfg) of a run directory's latest checkpoint."""
  from flax import nnx
  cfg, state, _ = restore_workdir(workdir, cfg)
  graphdef, _, _ = _split_model(cfg)
  return nnx.merge(graphdef, state.params, state.rest), cfg


# ----------------------------------------------------------------------------- import


def _staging(target: str) -> str:
  target = os.path.abspath(target.rstrip(os.sep))
  if os.path.exists(target) and (not os.path.isdir(target) or os.listdir(target)):
    raise HFError(f"{target!r} already exists and is not empty; choose a new directory")
  parent = os.path.dirname(target)
  os.makedirs(parent, exist_ok=True)
  return os.path.join(parent, f".{os.path.basename(target)}.partial-{os.getpid()}")


def _finish(staging: str, target: str) -> None:
  target = os.path.abspath(target.rstrip(os.sep))
  if os.path.isdir(target):
    os.rmdir(target)                 # empty (checked by _staging)
  os.replace(staging, target)


def config_from_json(values: dict):
  """A ConfigDict from a config's JSON form (lists → tuples, objects → ConfigDicts); keys that
  an earlier k3train did not write take their defaults (`config.fill_missing_keys`)."""
  import ml_collections
  from k3train import config as config_lib

  def value(v):
    if isinstance(v, dict):
      return ml_collections.ConfigDict({k: value(x) for k, x in v.items()})
    if isinstance(v, list):
      return tuple(value(x) for x in v)
    return v

  cfg = value(values)
  config_lib.fill_missing_keys(cfg)
  return cfg


def config_file_text(cfg) -> str:
  """A config file whose get_config() rebuilds cfg (its JSON form, written as Python)."""
  import pprint
  from k3train.train.checkpoint import config_to_json
  values = pprint.pformat(config_to_json(cfg), indent=1, width=100, sort_dicts=False)
  return (
      '"""The config of a run imported from a Hugging Face K3 release (k3train.tools.hf import).\n\n'
      'Every key, as the run\'s checkpoints record it; edit the recipe keys (data, train, optim, ...)\n'
      'freely, the model section must stay as imported.\n"""\n\n'
      "from k3train.tools.hf import config_from_json\n\n"
      f"VALUES = {values}\n\n\n"
      "def get_config():\n"
      "  return config_from_json(VALUES)\n")


def import_release(hf_dir: str, workdir: str, cfg=None, log=print) -> None:
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from k3train.data import pipeline
  from k3train.optim.optimizer import make_optimizer
  from k3train.tools import hf_files, hf_layout
  from k3train.train import layout as layout_lib
  from k3train.train.checkpoint import Checkpointer
  t0 = time.perf_counter()
  release = hf_files.Release(hf_dir)
  cfg = hf_layout.config_from_hf(release.config, base_config(cfg))
  table = make_table(cfg)
  plan = plan_import(release, table)
  layout = layout_lib.make_layout(cfg)
  staging = _staging(workdir)
  try:
    os.makedirs(os.path.join(staging, RELEASE_DIR, "files"))
    graphdef, params, rest = build_model_state(cfg, release, table, plan, layout=layout)
    model = nnx.merge(graphdef, params, rest)
    optimizer = make_optimizer(cfg, nnx.state(model, nnx.Param))
    _, state, _ = layout_lib.init_sharded_state(model, optimizer, layout)
    state = dataclasses.replace(state, step=jax.device_put(jnp.int32(IMPORT_STEP), layout.replicated))
    data = pipeline.make_text_iterator(cfg.data, batch_size=cfg.train.global_batch_size,
                                       seed=cfg.train.seed, process_index=0, process_count=1)
    ckpt = Checkpointer(os.path.join(staging, "checkpoints"), cfg)
    ckpt.save(IMPORT_STEP, state, data.get_state(), force=True)
    ckpt.close()
    with open(os.path.join(staging, "config.py"), "w") as f:
      f.write(config_file_text(cfg))
    _record_release(release, plan, os.path.join(staging, RELEASE_DIR))
    _finish(staging, workdir)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise
  size = sum(os.path.getsize(os.path.join(release.directory, s[0])) for s in release.shards)
  dt = time.perf_counter() - t0
  log(f"imported {len(release.tensors)} tensors ({size / 1e9:.3f} GB) from {release.directory} "
      f"into {os.path.abspath(workdir)} in {dt:.1f} s ({size / 1e9 / dt:.3f} GB/s); resume with "
      f"python -m k3train.main --config={os.path.join(workdir, 'config.py')} --workdir={workdir}")


def _record_release(release, plan: ImportPlan, out: str) -> None:
  from k3train.tools import hf_files
  record = {"config": release.config,
            "index_metadata": None if release.index is None else release.index.get("metadata", {}),
            "shards": [{"file": name, "metadata": meta,
                        "tensors": [[t.name, t.dtype, list(t.shape)] for t in tensors]}
                       for name, meta, tensors in release.shards],
            "passthrough": plan.passthrough}
  with open(os.path.join(out, RELEASE_JSON), "w") as f:
    json.dump(record, f, indent=1)
  for rel in release.other_files():
    dst = os.path.join(out, "files", rel)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    shutil.copy2(os.path.join(release.directory, rel), dst)
  if plan.passthrough:
    infos = [release.tensors[n] for n in plan.passthrough]
    hf_files.write_shard(os.path.join(out, PASSTHROUGH), [(i.name, i.dtype, i.shape) for i in infos],
                         release.read)


# ----------------------------------------------------------------------------- export


def _export_plan(table, record, mxfp4_experts, shard_bytes):
  """[(file, metadata, [(name, dtype, shape)])], index metadata (None: no index file)."""
  from k3train.tools import hf_files, hf_layout
  if record is None:
    names = hf_layout.release_names(table.entries, packed=bool(mxfp4_experts))
    shards, cur, size = [], [], 0
    for t in names:
      n = hf_files.DTYPES[t[1]].itemsize * max(1, _prod(t[2]))
      if cur and size + n > shard_bytes:
        shards.append(cur)
        cur, size = [], 0
      cur.append(t)
      size += n
    shards.append(cur)
    if len(shards) == 1:
      return [("model.safetensors", {"format": "pt"}, shards[0])], None
    total = len(shards)
    return [(f"model-{i + 1:05d}-of-{total:05d}.safetensors", {"format": "pt"}, s)
            for i, s in enumerate(shards)], {}
  out = []
  for shard in record["shards"]:
    tensors = []
    for name, dtype, shape in shard["tensors"]:
      base = name[:-len("_packed")] if name.endswith("_packed") else (
          name[:-len("_scale")] if name.endswith("_scale") else name)
      e = table.by_name.get(base)
      if e is not None and e.expert and mxfp4_experts is not None:
        if name.endswith("_scale"):
          continue                          # emitted with its _packed partner
        tensors += hf_layout.release_names([e], packed=mxfp4_experts)
      else:
        tensors.append((name, dtype, tuple(shape)))
    out.append((shard["file"], shard["metadata"], tensors))
  placed = {t[0] for _, _, ts in out for t in ts}
  for e in table.entries:
    if e.name not in placed and e.packed_names()[0] not in placed:
      raise HFError(f"k3train tensor {e.name!r} has no place in the recorded release layout "
                         f"(export with a fresh layout: remove {RELEASE_DIR}/{RELEASE_JSON})")
  return out, record["index_metadata"]


def _prod(shape):
  n = 1
  for s in shape:
    n *= s
  return n


def export_release(workdir: str, out_dir: str, cfg=None, *, mxfp4_experts=None,
                   shard_bytes: int = 5_000_000_000, log=print) -> None:
  import numpy as np
  from k3train.quant import mx
  from k3train.tools import hf_files, hf_layout
  from k3train.train.checkpoint import flatten_state
  t0 = time.perf_counter()
  cfg, state, step = restore_workdir(workdir, cfg)
  table = make_table(cfg)
  rec_dir = os.path.join(workdir, RELEASE_DIR)
  record = None
  if os.path.isfile(os.path.join(rec_dir, RELEASE_JSON)):
    with open(os.path.join(rec_dir, RELEASE_JSON)) as f:
      record = json.load(f)
  shards, index_meta = _export_plan(table, record, mxfp4_experts, shard_bytes)
  flat = flatten_state(state)
  passthrough = None
  if record and record.get("passthrough"):
    from safetensors import safe_open
    passthrough = safe_open(os.path.join(rec_dir, PASSTHROUGH), framework="np")
  cache = {}

  def core_of(entry):
    arr = flat[entry.key]
    if entry.key not in cache and arr.size * arr.dtype.itemsize <= 256 * 2 ** 20:
      cache.clear()
      cache[entry.key] = np.asarray(arr)
    whole = cache.get(entry.key)
    return whole[entry.index] if whole is not None else np.asarray(arr[entry.index])

  packed_cache = {}

  def produce(name):
    if passthrough is not None and name in record["passthrough"]:
      return passthrough.get_tensor(name)
    for part in ("_packed", "_scale"):
      if name.endswith(part) and name[:-len(part)] in table.by_name:
        e = table.by_name[name[:-len(part)]]
        if e.name not in packed_cache:
          packed_cache.clear()
          w = hf_layout.to_hf(e, core_of(e).astype(np.float32))
          packed_cache[e.name] = tuple(np.asarray(a) for a in mx.export_mxfp4(w, in_axis=-1))
        return packed_cache[e.name][0 if part == "_packed" else 1]
    e = table.by_name[name]
    return hf_layout.to_hf(e, core_of(e))

  staging = _staging(out_dir)
  try:
    os.makedirs(staging)
    weight_map, total, any_packed = {}, 0, False
    for file, meta, tensors in shards:
      dtypes = {n: d for n, d, _ in tensors}
      any_packed |= any(n.endswith("_packed") for n, _, _ in tensors)
      total += hf_files.write_shard(
          os.path.join(staging, file), tensors,
          lambda n: np.asarray(produce(n)).astype(hf_files.DTYPES[dtypes[n]]), meta)
      weight_map.update({n: file for n, _, _ in tensors})
    if index_meta is not None:
      hf_files.write_index(staging, weight_map, total, index_meta)
    hf_cfg = hf_layout.config_to_hf(cfg, record["config"] if record else None)
    if record is None or mxfp4_experts is not None:   # packing chosen here, not recorded
      if any_packed and "quantization_config" not in hf_cfg:
        hf_cfg["quantization_config"] = MXFP4_QUANTIZATION
      if not any_packed:
        hf_cfg.pop("quantization_config", None)
    with open(os.path.join(staging, hf_files.CONFIG), "w") as f:
      json.dump(hf_cfg, f, indent=2)
      f.write("\n")
    files = os.path.join(rec_dir, "files")
    if os.path.isdir(files):
      shutil.copytree(files, staging, dirs_exist_ok=True)
    _finish(staging, out_dir)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise
  dt = time.perf_counter() - t0
  log(f"exported step {step} of {os.path.abspath(workdir)}: {len(weight_map)} tensors "
      f"({total / 1e9:.3f} GB) in {len(shards)} shards to {os.path.abspath(out_dir)} in {dt:.1f} s "
      f"({total / 1e9 / dt:.3f} GB/s)")


# ----------------------------------------------------------------------------- command line


def main(argv=None) -> int:
  argv = list(sys.argv if argv is None else argv)
  if len(argv) < 2 or argv[1] not in COMMANDS:
    if any(a in ("--help", "-h") for a in argv[1:]):
      print(f"usage: {PROG} import|export [flags]\n{__doc__}")
      return 0
    cli.error(PROG, f"the first argument must be one of {COMMANDS} (e.g. {PROG} import "
              "--hf_checkpoint=DIR --workdir=W)")
    return cli.USAGE_ERROR
  command = argv[1]
  prog = f"{PROG} {command}"
  args = cli.parse([prog] + argv[2:], prog, define=_define, config_required=False)
  if args.exit_code is not None:
    return args.exit_code
  fv = args.flags
  required = ("hf_checkpoint", "workdir") if command == "import" else ("workdir", "out")
  for name in required:
    if not fv[name].value:
      cli.error(prog, f"--{name} is required")
      return cli.USAGE_ERROR
  from k3train.config import ConfigError
  from k3train.tools.hf_files import ReleaseError
  try:
    if command == "import":
      import_release(fv.hf_checkpoint, fv.workdir, args.config)
    else:
      export_release(fv.workdir, fv.out, args.config, mxfp4_experts=fv.mxfp4_experts,
                     shard_bytes=fv.shard_size_mb * 1_000_000)
  except (ConfigError, ReleaseError, HFError) as e:
    cli.error(prog, str(e))
    return cli.USAGE_ERROR
  return 0


if __name__ == "__main__":
  sys.exit(main())
