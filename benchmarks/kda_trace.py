"""Per-kernel GPU times of the whole pallas_gpu KDA forward + backward, from one profiler trace.

  XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/kda_trace.py [--shapes=2x8192x16]
      [--variants=fused,fused-sw4] [--calls=5] [--fla] [--config=FILE]

For each shape and variant (kda_kernel.py's spelling) jits forward+backward (Σo and its
gradients wrt q, k, v, g, beta; bf16, K = V = 128, chunk 64; all variants of a shape compiled at
once in `--compile_workers` threads), warms up, records `--calls` calls under
`jax.profiler.trace(create_perfetto_trace=True)` and sums the device-side duration of every
kernel by name (XLA fusions and the Pallas kernels alike), per call. Unlike kda_profile.py, which
times each launcher alone, this sees the op as the training step runs it, glue included. With
--fla, fla's chunk_kda goes through torch.profiler the same way (its autotuning takes minutes).
--config picks the shape as in kda_kernel.py.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import sys
import tempfile
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import _flags  # noqa: E402
from benchmarks.kda_kernel import (_inputs, compile_parallel, fla_calls, jax_calls,  # noqa: E402
                                   parse_variant, shapes_of)

PROG = "python benchmarks/kda_trace.py"

FLAGS = (
    _flags.Flag("shapes", "list", ["2x8192x16"],
                "B×T×H to trace (K = V = 128); with --config and no --shapes, "
                "1 × data.seq_len × model.kda.num_heads"),
    _flags.Flag("variants", "list", ["fused"], "kda_kernel.py variant names"),
    _flags.Flag("calls", "int", 5, "forward + backward calls recorded in the trace"),
    _flags.Flag("fla", "bool", False, "also trace fla's chunk_kda"),
    _flags.Flag("marker", "str", "GPU", "process-name marker of device events"),
    _flags.Flag("backend", "str", "pallas_gpu", "kda backend traced"),
    _flags.Flag("compile_workers", "int", 8, "threads compiling the variants of a shape"),
)


def device_kernel_us(trace_path: str, device_marker: str) -> dict[str, float]:
  """Summed duration (µs) per "[thread] event name" over the trace's processes whose name holds
  `device_marker` (e.g. "GPU"), from a Chrome/Perfetto JSON trace (optionally gzipped). A GPU
  has several lines (streams, XLA ops, modules): `report` totals each line separately."""
  opener = gzip.open if trace_path.endswith(".gz") else open
  with opener(trace_path, "rt") as f:
    events = json.load(f)
  events = events["traceEvents"] if isinstance(events, dict) else events
  meta = lambda kind: {(e["pid"], e.get("tid")) if kind == "thread_name" else e["pid"]:
                       e.get("args", {}).get("name", "")
                       for e in events if e.get("ph") == "M" and e.get("name") == kind}
  procs, threads = meta("process_name"), meta("thread_name")
  totals = collections.defaultdict(float)
  for e in events:
    if e.get("ph") == "X" and device_marker in procs.get(e.get("pid"), ""):
      thread = threads.get((e["pid"], e.get("tid")), str(e.get("tid")))
      totals[f"[{thread}] {e['name']}"] += float(e.get("dur", 0.0))
  return dict(totals)


def trace_jax(fn, args, calls, marker):
  jax.block_until_ready(fn(*args))
  jax.block_until_ready(fn(*args))
  with tempfile.TemporaryDirectory() as log_dir:
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
      for _ in range(calls):
        out = fn(*args)
      jax.block_until_ready(out)
    paths = glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:
      raise RuntimeError(f"no perfetto_trace.json.gz under {log_dir}")
    return device_kernel_us(paths[0], marker)


def trace_fla(np_in, calls):
  import torch
  step = fla_calls(np_in)[1]
  for _ in range(3):
    step()
  torch.cuda.synchronize()
  totals = collections.defaultdict(float)
  with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    for _ in range(calls):
      step()
    torch.cuda.synchronize()
  for e in prof.events():
    if e.device_type == torch.autograd.DeviceType.CUDA:
      totals[e.name] += e.device_time
  return dict(totals)


def report(label, totals, calls, lines, top=30):
  rows = sorted(totals.items(), key=lambda kv: -kv[1])
  first = len(lines)
  per_line = collections.defaultdict(float)
  for name, us in rows:
    per_line[name.split("]")[0] + "]"] += us
  lines.append(f"== {label}, ms per fwd+bwd call: " + ", ".join(
      f"{k} {us / calls / 1e3:.3f}" for k, us in per_line.items()) + " ==")
  for name, us in rows[:top]:
    lines.append(f"  {us / calls / 1e3:8.3f} ms  {name[:100]}")
  if len(rows) > top:
    rest = sum(us for _, us in rows[top:]) / calls / 1e3
    lines.append(f"  {rest:8.3f} ms  ({len(rows) - top} more kernels)")
  print("\n".join(lines[first:]), flush=True)


def main(argv=None) -> int:
  args = _flags.parse(argv, PROG, FLAGS)
  if args.exit_code is not None:
    return args.exit_code
  a = args.flags
  try:
    shapes = shapes_of(args)
    variants = [v for v in a.variants if v]
    for v in variants:
      parse_variant(v)
  except ValueError as e:
    _flags.error(PROG, str(e))
    return _flags.USAGE_ERROR
  lines = [f"jax {jax.__version__} {jax.devices()}"]
  rng = np.random.default_rng(1)
  for shape in shapes:
    b, t, h = map(int, shape.split("x"))
    np_in = _inputs(rng, b, t, h, "bf16")
    arrays = tuple(jnp.asarray(x, jnp.float32 if i == 3 else jnp.bfloat16)
                   for i, x in enumerate(np_in))
    compiled = compile_parallel(   # a fresh jit per variant: each traces under its settings
        [(v, parse_variant(v), jax_calls(a.backend, arrays[2].shape)[1], arrays)
         for v in variants], a.compile_workers)
    for v in variants:
      try:
        if v not in compiled:
          raise RuntimeError(f"{v} did not compile (see the compile line above)")
        totals = trace_jax(compiled[v], arrays, a.calls, a.marker)
        report(f"{shape} {a.backend}[{v}]", totals, a.calls, lines)
      except Exception:
        lines.append(f"{shape} {v} FAILED: {traceback.format_exc()[-1500:]}")
        print(lines[-1], flush=True)
    if a.fla:
      try:
        report(f"{shape} fla chunk_kda", trace_fla(np_in, a.calls), a.calls, lines)
      except Exception:
        lines.append(f"{shape} fla FAILED: {traceback.format_exc()[-1500:]}")
        print(lines[-1], flush=True)
  print("\n==== summary ====\n" + "\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main())
