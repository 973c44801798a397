"""Hugging Face export and import (`k3train.tools.hf`) of the config's model, timed, with bytes
read and written, and a check that the round trip gives back the parameters bit for bit.

  python benchmarks/hf_io.py --config=configs/k3_h200.py [--workdir_root=DIR] [--mxfp4_experts]

Phases, one JSON line each, then a table:

  create  the config's model initialised at random on the device(s), already sharded
          (`layout.build_sharded_model`), every parameter and router bias rounded to bf16 (and,
          with --mxfp4_experts, the routed experts to MXFP4 values, `moe.fake_quant_expert_weights`)
          so that the release holds them exactly; a fresh optimizer state
          (`layout.init_sharded_state`); saved as step 1 through `Checkpointer` (train state,
          data-iterator state, config), as `tools/hf import` writes a run.
  export  `hf.export_release`: restore the latest checkpoint, write the release layout (fresh
          layout, shards of --shard_size_mb; bf16, experts MXFP4-packed with --mxfp4_experts).
          The source run is deleted afterwards (unless --keep) to bound the disk space.
  import  `hf.import_release` of that release into a new run directory (parameters created
          sharded, fresh optimizer state, checkpoint written and closed).
  check   the imported run's arrays against the originals (kept on the device): a spread sample
          of --check_arrays arrays read alone from the checkpoint (orbax partial restore), or
          every released array with --check=all (the product's full `hf.restore_workdir`).

Each timed phase is the product function's wall time, compilation included (the export's
restore and the import's optimizer initialisation compile small programs). Bytes are the sizes
of the files on disk: export reads the whole checkpoint (optimizer state included) and writes
the release; import reads the release and writes the whole checkpoint. GB/s columns: release
bytes per second (what the tool's own log line reports) and all bytes moved per second. Files
just written are normally still in the page cache, so the reads are warm unless --evict_cache
(fsync, then posix_fadvise DONTNEED on every file before the timed read).

Everything lives under one folder (default: a new temporary folder under $TMPDIR; the JSON
lines name its file system) and is removed at the end unless --keep. The disk must hold the
checkpoint and the release together (k3_h200: 38.7 GB + 9.0 GB); the run stops before writing
anything when it does not.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from k3train import cli  # noqa: E402

PROG = "python benchmarks/hf_io.py"
STEP = 1
PHASES = ("create", "export", "import", "check")


def define(fv: flags.FlagValues) -> None:
  flags.DEFINE_string("workdir_root", "", "folder on local disk for the runs and the release "
                      "(default: a new temporary folder under $TMPDIR)", flag_values=fv)
  flags.DEFINE_bool("mxfp4_experts", False, "export the routed experts MXFP4-packed (their "
                    "values are made MXFP4-exact at creation, so the round trip stays exact)",
                    flag_values=fv)
  flags.DEFINE_integer("shard_size_mb", 5000, "release shard size (the export's fresh layout)",
                       lower_bound=1, flag_values=fv)
  flags.DEFINE_enum("check", "sample", ["sample", "all", "none"], "round-trip check: a sample "
                    "of arrays, every released array, or none", flag_values=fv)
  flags.DEFINE_integer("check_arrays", 24, "arrays in the sample of --check=sample",
                       lower_bound=1, flag_values=fv)
  flags.DEFINE_bool("evict_cache", False, "drop the files from the page cache before each timed "
                    "read (cold reads)", flag_values=fv)
  flags.DEFINE_bool("keep", False, "keep the runs and the release instead of removing them",
                    flag_values=fv)


# ----------------------------------------------------------------------------- files


def dir_bytes(path: str) -> int:
  total = 0
  for root, _, names in os.walk(path):
    for n in names:
      p = os.path.join(root, n)
      if not os.path.islink(p):
        total += os.path.getsize(p)
  return total


def file_system(path: str) -> str:
  """"<type> on <mount point> (<device>)" of the mount holding path, from /proc/mounts."""
  path = os.path.realpath(path)
  best = ("", "?", "?")
  try:
    with open("/proc/mounts") as f:
      for line in f:
        dev, mount, kind = line.split()[:3]
        inside = path == mount or path.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best[0]):
          best = (mount, kind, dev)
  except OSError:
    return "unknown"
  return f"{best[1]} on {best[0]} ({best[2]})"


def evict(path: str) -> None:
  """Writes every file under path to disk and drops it from the page cache."""
  for root, _, names in os.walk(path):
    for n in names:
      p = os.path.join(root, n)
      if os.path.islink(p):
        continue
      fd = os.open(p, os.O_RDONLY)
      try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
      finally:
        os.close(fd)


def gb(n: float) -> float:
  return round(n / 1e9, 3)


def rate(n: float, seconds: float):
  return round(n / 1e9 / seconds, 3) if seconds > 0 else None


def one_line(e: BaseException) -> str:
  text = " ".join(str(e).split())
  return f"{type(e).__name__}: {text}"[:300]


# ----------------------------------------------------------------------------- sizes


def planned_bytes(cfg, mxfp4: bool) -> dict:
  """Checkpoint and release sizes from the abstract state (nothing allocated)."""
  import jax
  import numpy as np
  from k3train.tools import hf, hf_files, hf_layout
  from k3train.train import builder
  a = builder.abstract_state(cfg)
  size = lambda tree: sum(np.dtype(x.dtype).itemsize * int(np.prod(x.shape))
                          for x in jax.tree.leaves(tree))
  names = hf_layout.release_names(hf.make_table(cfg).entries, packed=mxfp4)
  release = sum(hf_files.DTYPES[d].itemsize * int(np.prod(s)) for _, d, s in names)
  return {"params": size(a.params), "rest": size(a.rest), "optimizer": size(a.opt),
          "checkpoint": size(a.params) + size(a.rest) + size(a.opt), "release": release,
          "release_tensors": len(names)}


# ----------------------------------------------------------------------------- phases


def create(cfg, workdir: str, mxfp4: bool) -> tuple[dict, dict]:
  """Saves a random-initialised run at step STEP; returns (row, {released key: original array})."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from k3train.model import moe
  from k3train.optim.optimizer import make_optimizer
  from k3train.tools import hf
  from k3train.train import layout as layout_lib
  from k3train.train.checkpoint import Checkpointer, flatten_state

  t0 = time.perf_counter()
  layout = layout_lib.make_layout(cfg)
  model = layout_lib.build_sharded_model(cfg, layout)
  released = nnx.Any(nnx.Param, moe.RouterBias)

  def exact(values):
    values = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(x.dtype), values)
    if mxfp4:
      values = moe.fake_quant_expert_weights(values, moe.ExpertQuant())
    return values

  nnx.update(model, jax.jit(exact)(nnx.state(model, released)))
  optimizer = make_optimizer(cfg, nnx.state(model, nnx.Param))
  _, state, _ = layout_lib.init_sharded_state(model, optimizer, layout)
  del model
  jax.block_until_ready(state)
  init_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), cfg)
  ckpt.save(STEP, state, {"source": "benchmarks/hf_io.py"}, force=True)
  ckpt.close()
  save_s = time.perf_counter() - t0
  keys = hf.make_table(cfg).keys()
  flat = flatten_state(state)
  originals = {k: v for k, v in flat.items() if k in keys}
  del state, flat
  written = dir_bytes(workdir)
  row = {"seconds": round(init_s + save_s, 2), "init_s": round(init_s, 2),
         "save_s": round(save_s, 2), "bytes_written": written, "write_gb_s": rate(written, save_s),
         "arrays": len(originals),
         "released_elements": int(sum(v.size for v in originals.values()))}
  return row, originals


def export(cfg, workdir: str, out: str, fv) -> dict:
  from k3train.tools import hf, hf_files
  logged = []
  read = dir_bytes(workdir)
  if fv.evict_cache:
    evict(workdir)
  t0 = time.perf_counter()
  hf.export_release(workdir, out, cfg, mxfp4_experts=fv.mxfp4_experts or None,
                    shard_bytes=fv.shard_size_mb * 1_000_000, log=logged.append)
  seconds = time.perf_counter() - t0
  written = dir_bytes(out)
  release = hf_files.Release(out)
  return {"seconds": round(seconds, 2), "bytes_read": read, "bytes_written": written,
          "release_gb_s": rate(written, seconds), "io_gb_s": rate(read + written, seconds),
          "tensors": len(release.tensors), "shards": len(release.shards),
          "packed_tensors": sum(n.endswith("_packed") for n in release.tensors),
          "cache": "evicted" if fv.evict_cache else "warm", "tool_log": logged}


def import_(cfg, release_dir: str, workdir: str, fv) -> dict:
  from k3train.tools import hf
  logged = []
  read = dir_bytes(release_dir)
  if fv.evict_cache:
    evict(release_dir)
  t0 = time.perf_counter()
  hf.import_release(release_dir, workdir, cfg, log=logged.append)
  seconds = time.perf_counter() - t0
  written = dir_bytes(workdir)
  return {"seconds": round(seconds, 2), "bytes_read": read, "bytes_written": written,
          "release_gb_s": rate(read, seconds), "io_gb_s": rate(read + written, seconds),
          "cache": "evicted" if fv.evict_cache else "warm", "tool_log": logged}


def sample_keys(keys: list[str], sizes: dict, n: int) -> list[str]:
  """n keys spread over the sorted list, with the largest array and a routed-expert array."""
  keys = sorted(keys)
  if n >= len(keys):
    return keys
  chosen = {keys[round(i * (len(keys) - 1) / max(1, n - 1))] for i in range(n)}
  chosen.add(max(keys, key=lambda k: sizes[k]))
  chosen.update([k for k in keys if ".experts." in k][:1])
  return sorted(chosen)


def read_partial(workdir: str, keys: list[str], like: dict) -> dict:
  """{key: array} of some arrays of a run's latest checkpoint, each placed like `like[key]`."""
  import jax
  import orbax.checkpoint as ocp
  from etils import epath
  from k3train.tools import hf
  from k3train.train.checkpoint import Checkpointer
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), hf.run_config(workdir))
  step = ckpt.latest_step()
  ckpt.close()
  item = {k: jax.ShapeDtypeStruct(like[k].shape, like[k].dtype, sharding=like[k].sharding)
          for k in keys}
  restore_args = ocp.checkpoint_utils.construct_restore_args(item)
  args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
  path = epath.Path(os.path.abspath(workdir)) / "checkpoints" / str(step) / "state"
  with ocp.PyTreeCheckpointer() as reader:
    return dict(reader.restore(path, args=args))


def read_full(workdir: str, keys: list[str]) -> dict:
  from k3train.tools import hf
  from k3train.train.checkpoint import flatten_state
  _, state, _ = hf.restore_workdir(workdir)
  flat = flatten_state(state)
  return {k: flat[k] for k in keys}


def check(originals: dict, workdir: str, fv) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np
  sizes = {k: int(v.size) for k, v in originals.items()}
  keys = sorted(originals) if fv.check == "all" else sample_keys(list(originals), sizes,
                                                                   fv.check_arrays)
  t0 = time.perf_counter()
  method, note = "full restore", None
  if fv.check == "sample":
    try:
      got = read_partial(workdir, keys, originals)
      method = "partial restore"
    except Exception as e:                                    # noqa: BLE001
      note = f"partial restore failed ({one_line(e)[:150]}); used the full restore"
      got = read_full(workdir, keys)
  else:
    got = read_full(workdir, keys)
  read_s = time.perf_counter() - t0

  unsigned = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}

  def bits(x):
    if jnp.issubdtype(x.dtype, jnp.floating):
      return jax.lax.bitcast_convert_type(x, unsigned[x.dtype.itemsize])
    return x

  def compare(a, b):
    # Per array: elements whose bits differ, elements whose values differ, max |difference|.
    return {k: (jnp.sum(bits(a[k]) != bits(b[k])), jnp.sum(a[k] != b[k]),
                jnp.max(jnp.abs(a[k].astype(jnp.float32) - b[k].astype(jnp.float32)), initial=0.0))
            for k in a}

  want = {k: originals[k] for k in keys}
  result = {k: tuple(np.asarray(x).item() for x in v)
            for k, v in jax.device_get(jax.jit(compare)(want, got)).items()}
  bit_diff = [k for k in keys if result[k][0]]
  value_diff = [k for k in keys if result[k][1]]
  row = {"seconds": round(time.perf_counter() - t0, 2), "read_s": round(read_s, 2),
         "method": method, "arrays_checked": len(keys), "arrays_released": len(originals),
         "elements_checked": sum(sizes[k] for k in keys),
         "elements_released": sum(sizes.values()),
         "arrays_bit_equal": len(keys) - len(bit_diff),
         "arrays_value_equal": len(keys) - len(value_diff),
         "elements_bits_differ": int(sum(result[k][0] for k in keys)),
         "elements_values_differ": int(sum(result[k][1] for k in keys)),
         "max_abs_diff": float(max(result[k][2] for k in keys)),
         "ok": not value_diff, "bits_differ_in": bit_diff[:6], "values_differ_in": value_diff[:6]}
  if bit_diff and not value_diff:
    row["note"] = ("equal values; the differing bits are signed zeros (-0.0 against 0.0)" +
                   (f"; {row['note']}" if "note" in row else ""))
  if note:
    row["note"] = f"{row['note']}; {note}" if "note" in row else note
  return row


# ----------------------------------------------------------------------------- main


def run(cfg, fv, env: dict) -> list[dict]:
  rows = []

  def emit(name, fn):
    t0 = time.perf_counter()
    try:
      row, extra = fn()
    except Exception as e:                                    # noqa: BLE001
      row, extra = {"error": one_line(e), "seconds": round(time.perf_counter() - t0, 2)}, None
    row = {"name": name, **row, **env}
    rows.append(row)
    print(json.dumps(row, default=str), flush=True)
    return extra if "error" not in row else None

  def skipped(names, why):
    for name in names:
      row = {"name": name, "error": f"skipped: {why}", **env}
      rows.append(row)
      print(json.dumps(row), flush=True)

  root = fv.workdir_root or tempfile.mkdtemp(prefix="k3_hf_io_")
  os.makedirs(root, exist_ok=True)
  root = tempfile.mkdtemp(prefix="run_", dir=root) if fv.workdir_root else root
  env["root"], env["file_system"] = root, file_system(root)
  src, release, dst = (os.path.join(root, n) for n in ("source_run", "release", "imported_run"))
  try:
    plan = planned_bytes(cfg, fv.mxfp4_experts)
    need = plan["checkpoint"] + plan["release"] + (plan["checkpoint"] if fv.keep else 0)
    free = shutil.disk_usage(root).free
    if free < 1.05 * need:
      skipped(PHASES, f"{root} has {gb(free)} GB free, the run needs about {gb(need)} GB "
              "(choose another --workdir_root)")
      return rows
    originals = emit("create", lambda: _with(create(cfg, src, fv.mxfp4_experts), planned=plan,
                                             disk_free=free))
    if originals is None:
      skipped(PHASES[1:], "create failed")
      return rows
    if emit("export", lambda: (export(cfg, src, release, fv), True)) is None:
      skipped(PHASES[2:], "export failed")
      return rows
    if not fv.keep:
      shutil.rmtree(src, ignore_errors=True)
    if emit("import", lambda: (import_(cfg, release, dst, fv), True)) is None:
      skipped(PHASES[3:], "import failed")
      return rows
    if fv.check != "none":
      emit("check", lambda: (check(originals, dst, fv), True))
    return rows
  finally:
    if not fv.keep:
      shutil.rmtree(root, ignore_errors=True)


def _with(result, **extra):
  row, value = result
  return {**row, **extra}, value


def summary(rows: list[dict]) -> None:
  print(f"{'phase':<8} {'s':>8} {'GB read':>8} {'GB written':>10} {'release GB/s':>12} "
        f"{'all GB/s':>8}  note")
  for r in rows:
    if "error" in r:
      print(f"{r['name']:<8} error: {r['error'][:100]}")
      continue
    if r["name"] == "create":
      note = f"{r['released_elements']:,} values in {r['arrays']} arrays, init {r['init_s']} s"
      print(f"{'create':<8} {r['seconds']:>8.2f} {'':>8} {gb(r['bytes_written']):>10.3f} "
            f"{'':>12} {r['write_gb_s'] or 0:>8.3f}  {note}")
    elif r["name"] in ("export", "import"):
      note = (f"{r['tensors']} tensors in {r['shards']} shards" if r["name"] == "export" else "")
      print(f"{r['name']:<8} {r['seconds']:>8.2f} {gb(r['bytes_read']):>8.3f} "
            f"{gb(r['bytes_written']):>10.3f} {r['release_gb_s'] or 0:>12.3f} "
            f"{r['io_gb_s'] or 0:>8.3f}  {note}{', ' if note else ''}{r['cache']} cache")
    else:
      n = r["arrays_checked"]
      verdict = ("bit for bit" if r["arrays_bit_equal"] == n else
                 f"equal values ({n - r['arrays_bit_equal']} arrays with signed-zero bits)"
                 if r["ok"] else f"{n - r['arrays_value_equal']} arrays differ in value")
      print(f"{'check':<8} {r['seconds']:>8.2f} {'':>8} {'':>10} {'':>12} {'':>8}  "
            f"{r['arrays_checked']}/{r['arrays_released']} arrays ({r['method']}): {verdict}, "
            f"max |diff| {r['max_abs_diff']:.3g}")


def main(argv=None) -> int:
  args = cli.parse(argv, PROG, define=define, config_required=True)
  if args.exit_code is not None:
    return args.exit_code
  import jax
  import orbax.checkpoint as ocp
  fv = args.flags
  env = {"device": jax.devices()[0].device_kind, "devices": jax.device_count(),
         "jax": jax.__version__, "orbax": getattr(ocp, "__version__", "?"),
         "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"),
         "format": "mxfp4_experts" if fv.mxfp4_experts else "bf16"}
  # A stopped run (timeout's SIGTERM) still removes its files: the handler unwinds to run's finally.
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
  rows = run(args.config, fv, env)
  summary(rows)
  return 0 if rows and all("error" not in r and r.get("ok", True) for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
