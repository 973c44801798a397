"""The train step `k3train.main` runs, timed, with compile time, peak memory, MFU and a per-part
profile; one JSON line per config.

  python benchmarks/train_step.py --config=configs/k3_h200.py --steps=10 --profile_steps=2

The step is `k3train.train.builder.build(cfg).step` (forward, backward, optimizer update, QK-Clip,
QB bias update; state donated) on batches from the config's own data pipeline, as in training.
It is compiled once ahead of time (`step.lower(state, batch).compile()`, reported as compile_s:
tracing + compiling) and that executable runs every step: one untimed first execution, then
`--steps` steps timed each from the end of the previous one to the end of this one (the loss is
fetched, so the device has finished). As in the train loop (k3train/train/loop.py), the next
step's batch is prepared and the step dispatched before the current step's loss is read, so the
host's work overlaps the device's ("timing": "next step in flight"); `--sync_each_step` times
each step alone instead (batch, dispatch and run back to back), as every record up to and
including 2026-12-03 measured. MFU = tokens/s × the train loop's model FLOPs per token /
(device peak).

The step is two programs (k3train/train/phased.py): `trace_lower_s` is the gradient program's
tracing and lowering, `backend_compile_s` the time from there until both programs were compiled
(the update program traced, lowered and compiled on one thread while XLA compiles the gradient
program on another), `backend_compile_programs_s` each thread's own time. Kernel counts, work
and custom calls add up both programs; `xla_memory_gib` is the larger program's analysis, each
program's under "programs".

Memory, per device, in GiB: `xla_memory_gib` is XLA's memory analysis of that executable
(arguments, temporaries, outputs, aliased, code) with total = arguments + temporaries + outputs −
aliased (the donated state is both an argument and an output and is counted once);
`plan_memory_gib` is the memory plan (k3train/tools/plan, the start-up check of `k3train.main`)
of the same config, mesh and batch: its terms, its phases and total = its peak (the largest
phase); `plan_vs_xla` = plan total / XLA total. The plan's terms are not disjoint ("expert
buffers" is part of the "backward working set"), so they do not add up to its total.

With --profile_steps > 0 those steps run under `jax.profiler.trace` and every device op's time is
assigned to a model part by the `jax.named_scope` names in its HLO op_name (`PARTS`: KDA, MLA,
routed-expert matmuls, dispatch / combine, router, QB statistics, the MoE's latent down / up
projections and shared experts, the dense FFN, AttnRes, norms, head and loss, optimizer with the
gradient norms); a fusion without metadata takes that of the first located instruction it fuses.
Each part is also split by pass (`pass_ms_per_step`: forward, backward, and "recomputed", the
forward rematerialised inside the backward) and by what runs it (`kind_ms_per_step`: "gemm",
"kernel" for the hand-written Pallas / Mosaic GPU / cuDNN kernels, "fusion" for XLA's own
elementwise, reduction, gather and scatter fusions, "copy", "other").
The profile also reports when the device ran nothing (`idle_ms_per_step` beside
`busy_ms_per_step`, between the first op traced and the last): each gap is charged to the part
of the op that ends it (`idle_by_part_ms_per_step`, `longest_gaps`), which separates launch
latency and host waits from slow kernels. On the GPU the profiled steps run a second executable
of the same lowered step compiled without CUDA graphs (`xla_gpu_enable_command_buffer=""`), whose
replays would show as one opaque op; the timed steps keep the runtime's CUDA graphs, so timing
and profile no longer share an executable (`profile.executable` says which ran;
`--profile_timed_executable` profiles the timed one instead, with no second compile).
Ops in none of the scopes (embedding, elementwise glue, buffer initialisation, the step's
bookkeeping) are "other". `--variants='name:key=value,key=value;…'` runs the same measurement for
config variants in the same process (one JSON line each), so a baseline and a change are timed on
the same machine in the same run. `--moe_loads` adds the per-step worst-layer max/mean expert
load (Quantile Balancing's balance over the run).

Compile time is also split: `trace_lower_s` (tracing to a jaxpr and lowering to StableHLO),
`backend_compile_s` (XLA), and `jax_compile_events_s` (jax's own duration events: jaxpr trace,
MLIR lowering, backend compile). `kernels` counts the fusions and custom calls the compiled
step launches, `kernels_by_part` the same by part, and `kernels_distinct` those XLA generates
code for (it emits identical fusions once); `xla_rematerialized` the instructions XLA's own
rematerialisation added to fit its memory limit (0 unless the step was over it). `work_by_part` is what those kernels execute per
step (benchmarks/hlo_costs.py, from the compiled HLO alone, loops counted by their trip counts):
`gemm_tflop`, the GiB read and written by XLA's fusions (`fusion_gib`) and by the hand-written
kernels (`kernel_gib`), and `launches`. With a profile, `rates_by_part` divides it by the device
time: each part's GEMM `gemm_tflops` and its XLA fusions' `fusion_tbps`, which say whether a
part is slow for its work or has too much of it.
`custom_calls` counts the step's custom calls by target, those inside fusions included (a
Pallas or Mosaic GPU kernel that XLA copied into another fusion counts twice).
`--compile_profile` traces the host during the compile (Python tracer off) and reports
`compile_events`: the longest named host activities of XLA's compiler (passes, autotuning,
LLVM and PTX compilation), inclusive seconds and counts, so compile time can be taken apart.
`--compile_only` lowers and compiles the step for the state as shapes (with their shardings;
nothing initialised, no step run) and reports the same compile and memory fields: compile
experiments without the model's initialisation. Every run also prints "<variant>: compiled in …"
on stderr as soon as the step has compiled. A second compile in one process reuses XLA's
autotuning results, so compile times compare only as each process's first compile; and a
variant that changes XLA's autotuning (an `xla_gpu_autotune*` option) compiled after another
gets the earlier variant's tuned choices from memory, not what its option asks for: its row
carries a `caveat` (run such a variant as its process's base).
`--lower_profile` runs tracing and lowering under cProfile and reports `lower_profile`: the
functions with the most cumulative and the most own time (seconds, calls, file:line(name)).
`--lower_for=gpu` (or tpu) traces and lowers the step as that platform would build it, on any
machine (`pallas_kernels.platform.targeting`: every "auto" kernel choice, interpret flag and launch
grid as there; the state as shapes), and stops before compiling: the row has `trace_s`,
`lower_s`, the StableHLO's size (`stablehlo_mib` with debug info, `stablehlo_ops` and
`stablehlo_ops_by_part` by the profile's parts), `lowered_custom_calls` by
target, `lowered_dots`, the matmuls by operand and result types ("bf16,bf16->f32"), and
`lowered_kernels`, the hand-written kernels by name (each distinct lowering once: a
kernel jitted with the same shapes is one function the program calls). On a CPU-only machine this
shows the GPU program's kernels and its host-side compile cost (`trace_s + lower_s`, part of
`compile_s` on the GPU) without a GPU; with `--lower_profile` that cost is taken apart by function.
`--compile_for=h200` goes on to compile the lowered step with XLA's GPU compiler for that GPU, on
any machine (benchmarks/gpu_target.py: the CUDA plugin against a described device, compile-only
devices; needs `jax-cuda12-plugin[with-cuda]` at jax's version, no GPU): the row has the compile
fields, `kernels` and the memory fields of `--compile_only`, and `collectives` (the compiled
cross-device ops by kind); `--target_devices=N` compiles for N such GPUs on one host, the
config's mesh spread over them; `--memory_report` and `--compile_profile` work with it. Nothing can be timed there, so XLA skips autotuning: GEMM and
Triton fusions take its default configurations, and `backend_compile_s` lacks autotuning's share
(15–19 s of the k3_h200 step's compile on an H200 host) but is otherwise this host's compile.

`--memory_report` has XLA dump the compiled step (`--xla_dump_to`, into `--dump_dir` or a
temporary folder) and reads the buffers live at its memory peak from the dump's live-range file:
`xla_peak_by_part_gib` sums them by the same parts as the profile ("arguments" for the step's
inputs: state and batch; "loop carries" for values entering a loop body), and `xla_peak_top`
lists the largest with their shapes, so the plan's terms can be checked one by one against XLA.
"""

from __future__ import annotations

import bisect
import collections
import glob
import json
import os
import re
import sys
import tempfile
import time

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import _record  # noqa: E402
from benchmarks import gpu_target  # noqa: E402
from benchmarks import hlo_costs  # noqa: E402
from k3train import cli  # noqa: E402

PROG = "python benchmarks/train_step.py"

# Model parts, found by the `jax.named_scope` names the model and the step give their code (the
# op_name of every HLO instruction carries them, backward and rematerialised ops included). The
# first name of this list that appears in an op's scope path decides: the expert matmuls before
# their dispatch / combine, a norm inside an attention layer counts as that layer, the shared
# experts (an `ffn` inside `moe_proj`) as the MoE's dense projections. "optimizer" holds the
# gradient norms and the update.
PARTS = ("optimizer", "moe_gmm", "router_qb", "router", "moe_dispatch_combine", "moe_proj", "kda",
         "mla", "ffn", "head_loss", "attnres", "norm")


def define(fv: flags.FlagValues) -> None:
  flags.DEFINE_integer("steps", 10, "timed steps", lower_bound=1, flag_values=fv)
  flags.DEFINE_bool("sync_each_step", False, "time each step alone: prepare its batch and "
                    "dispatch it only after the previous step's loss is read (the default keeps "
                    "the next step in flight, as the train loop does)", flag_values=fv)
  flags.DEFINE_integer("profile_steps", 2, "steps traced for the per-part profile (0: none)",
                       lower_bound=0, flag_values=fv)
  flags.DEFINE_bool("compile_only", False, "lower and compile the step for a state of shapes "
                    "only (nothing initialised, no step run) and report compile time, kernels "
                    "and memory; compile times compare only as each process's first compile "
                    "(XLA keeps autotuning results in memory)", flag_values=fv)
  flags.DEFINE_bool("profile_timed_executable", False, "profile the timed executable itself "
                    "instead of one compiled without CUDA graphs (no second compile; on the GPU "
                    "the kernels a graph replays then show as one op)", flag_values=fv)
  flags.DEFINE_string("variants", "", "extra config variants 'name:key=value,key=value;…' run "
                      "after the base config in the same process", flag_values=fv)
  flags.DEFINE_bool("moe_loads", False, "report the worst-layer max/mean expert load per step",
                    flag_values=fv)
  flags.DEFINE_string("trace_dir", "", "where profiler traces go (default: a temporary folder)",
                      flag_values=fv)
  flags.DEFINE_string("dump_dir", "", "with a profile: write <variant>_ops.json (every device op's "
                      "ms per step, part and source) and <variant>_hlo.txt.gz (the compiled step) "
                      "there", flag_values=fv)
  flags.DEFINE_bool("memory_report", False, "dump the compiled step and report the buffers live "
                    "at XLA's memory peak by part (xla_peak_by_part_gib)", flag_values=fv)
  flags.DEFINE_bool("lower_profile", False, "profile tracing and lowering with cProfile and report "
                    "the functions taking longest (lower_profile)", flag_values=fv)
  flags.DEFINE_enum("lower_for", "", ["", "gpu", "tpu"], "trace and lower the step as this "
                    "platform would build it (on any machine; nothing compiled or run) and report "
                    "trace and lower seconds, the program's size and its kernels by name",
                    flag_values=fv)
  flags.DEFINE_enum("compile_for", "", ["", *gpu_target.TARGETS], "lower and compile the step for this GPU "
                    "on this machine, which needs no GPU (benchmarks/gpu_target.py; no autotuning) "
                    "and report compile time, kernels and memory", flag_values=fv)
  flags.DEFINE_integer("target_devices", 1, "--compile_for: how many of those GPUs, on one "
                       "host (the config's mesh spans them)", lower_bound=1, flag_values=fv)
  flags.DEFINE_bool("compile_profile", False, "trace the host while the step compiles and report "
                    "XLA's compile phases (compile_events)", flag_values=fv)


# The profiled executable's extra XLA options, by backend. A CUDA graph (XLA's command buffer)
# replays its kernels as one opaque op, so on the GPU the profile traces a second executable of
# the same lowered step compiled without them; the timed executable keeps the runtime's defaults.
PROFILE_COMPILER_OPTIONS = {"gpu": {"xla_gpu_enable_command_buffer": ""}}


def abstract_run(cfg, devices=None):
  """`builder.build(cfg)`'s Run with the state as ShapeDtypeStructs carrying their shardings
  (`builder.restore_target`): enough to lower and compile the step, nothing initialised.
  devices: the mesh's devices (default: all of this machine's)."""
  from k3train.optim.optimizer import make_optimizer
  from k3train.train import builder
  from k3train.train import layout as layout_lib
  layout = layout_lib.make_layout(cfg, devices)
  graphdef, state_like, shardings = builder.restore_target(cfg, layout)
  optimizer = make_optimizer(cfg, state_like.params)
  step = builder.jit_train_step(cfg, graphdef, optimizer, layout, shardings)
  return builder.Run(cfg, layout, optimizer, graphdef, state_like, shardings, step)


def profile_executable(lowered, compiled, hlo_text: str, backend: str, use_timed: bool):
  """(executable to profile, its HLO text, which one it is): `compiled` itself with use_timed or
  where the backend needs no other options, else `lowered` compiled again with the backend's
  PROFILE_COMPILER_OPTIONS."""
  extra = PROFILE_COMPILER_OPTIONS.get(backend)
  if use_timed or not extra:
    return compiled, hlo_text, "the timed one"
  t0 = time.perf_counter()
  profiled = lowered.compile(compiler_options=extra)
  return (profiled, profiled.as_text() or "",
          f"compiled apart with {extra} in {time.perf_counter() - t0:.1f} s")


def shared_autotuning_caveat(position: int, pairs: dict) -> str | None:
  """Why the executable of the variant at `position` (0: base) may not be what its overrides ask
  for: XLA keeps autotuning results in memory for the process, so an autotuning option
  (`xla_gpu_autotune_level=0`, say) in a later variant is served the earlier variants' choices
  (seen on an H200: the same kernels and step time as base, while alone that option compiled
  ~180 more kernels and ran far slower). None when nothing is shared."""
  if position > 0 and "xla_gpu_autotune" in pairs.get("train.xla_options", ""):
    return ("compiled after other variants in this process: XLA served their autotuning "
            "results from memory, so this variant's autotuning options did not apply; run it "
            "as a process's base")
  return None


def parse_variants(text: str) -> list[tuple[str, dict]]:
  """'bf16:model.x=1,optim.y=adamw;f32:model.x=0' → [(name, {dotted key: value text})].

  A piece without "=" continues the previous value, so a value may hold commas:
  'cb:train.xla_options=xla_gpu_enable_command_buffer=FUSION,WHILE' sets one key."""
  out = []
  for item in filter(None, (v.strip() for v in text.split(";"))):
    name, _, body = item.partition(":")
    if not body:
      raise ValueError(f"--variants entry {item!r}: expected name:key=value[,key=value]")
    pairs, key = {}, None
    for kv in body.split(","):
      k, eq, value = kv.partition("=")
      if not eq:
        if key is None:
          raise ValueError(f"--variants entry {item!r}: {kv!r} is not key=value")
        pairs[key] += "," + kv.strip()
        continue
      key = k.strip()
      pairs[key] = value.strip()
    out.append((name.strip(), pairs))
  return out


def apply_overrides(cfg, pairs: dict):
  """A copy of cfg with dotted keys set from text, typed like the existing value."""
  import ast
  cfg = cfg.copy_and_resolve_references()
  for key, text in pairs.items():
    *parents, leaf = key.split(".")
    node = cfg
    for p in parents:
      node = node[p]
    old = node[leaf]
    if isinstance(old, str):
      node[leaf] = text
    elif isinstance(old, bool):
      node[leaf] = text.lower() in ("1", "true", "yes")
    else:
      node[leaf] = type(old)(ast.literal_eval(text)) if old is not None else ast.literal_eval(text)
  return cfg


# ----------------------------------------------------------------------------- profile parsing


# An HLO instruction's line: its name (the name the profiler reports for the op it launches).
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")


def op_locations(hlo_text: str) -> dict[str, str]:
  """HLO instruction name → "source_file:op_name" from the compiled module's metadata. A fusion
  (or call) with no metadata of its own takes the first located instruction of the computation
  it calls."""
  head = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(|\{)")

  def where(line):
    meta = re.search(r"metadata=\{([^}]*)\}", line)
    if not meta:
      return ""
    src = re.search(r'source_file="([^"]*)"', meta.group(1))
    name = re.search(r'op_name="([^"]*)"', meta.group(1))
    return (src.group(1) if src else "") + ":" + (name.group(1) if name else "")

  first_in: dict[str, str] = {}
  own: dict[str, str] = {}
  calls: dict[str, str] = {}
  current = None
  for line in hlo_text.splitlines():
    m = _INSTRUCTION.match(line)
    if m is None:
      h = head.match(line)
      if h and line.rstrip().endswith("{"):
        current = h.group(1)
      continue
    loc = where(line)
    own[m.group(1)] = loc
    called = re.search(r"calls=%?([\w.\-]+)", line)
    if called:
      calls[m.group(1)] = called.group(1)
    if loc and current is not None:
      first_in.setdefault(current, loc)
  return {name: loc or first_in.get(calls.get(name, ""), "") for name, loc in own.items()}


def op_kinds(hlo_text: str) -> dict[str, str]:
  """HLO instruction name → what runs it: "gemm" (cuBLAS calls and XLA's GEMM fusions), "kernel"
  (hand-written kernels: Pallas, Mosaic GPU, cuDNN, library sorts, and fusions wrapping them),
  "fusion" (XLA's own fusions: elementwise, reductions, gathers, scatters, slice updates),
  "copy", or "other"."""
  kinds = {}
  for line in hlo_text.splitlines():
    m = _INSTRUCTION.match(line)
    if m is None:
      continue
    rest = line[m.end():]
    if re.search(r"\scustom-call\(", rest):
      target = re.search(r'custom_call_target="([^"]+)"', rest)
      target = target.group(1) if target else ""
      kind = ("gemm" if target.startswith("__cublas") else
              "other" if target == "AllocateBuffer" else "kernel")
    elif re.search(r"\sfusion\(", rest):
      backend = re.search(r'"kind":"(__\w+)"', rest)
      backend = backend.group(1) if backend else ""
      kind = ("gemm" if "gemm" in backend else "kernel" if backend == "__custom_fusion" else
              "fusion")
    elif re.search(r"\scopy(?:-start)?\(", rest):
      kind = "copy"
    else:
      kind = "other"
    kinds[m.group(1)] = kind
  return kinds


def pass_of(location: str) -> str:
  """Which pass an op belongs to, from its op_name: "recomputed" (a rematerialised forward
  inside the backward), "backward", or "forward" (the optimizer's update counts as forward)."""
  name = location.partition(":")[2]
  if "rematted_computation" in name:
    return "recomputed"
  return "backward" if "transpose(" in name else "forward"


def part_breakdown(times: dict[str, float], where: dict[str, str], kinds: dict[str, str],
                   steps: int) -> dict:
  """Device ms per step of each part (`parts_ms_per_step`), and each part split by pass
  (`pass_of`) and by what runs it (`op_kinds`); parts ordered by their total."""
  by_pass: dict = collections.defaultdict(lambda: collections.defaultdict(float))
  by_kind: dict = collections.defaultdict(lambda: collections.defaultdict(float))
  for op, seconds in times.items():
    location = where.get(op, "")
    part = classify(location)
    by_pass[part][pass_of(location)] += seconds
    by_kind[part][kinds.get(op, "other")] += seconds
  order = sorted(by_pass, key=lambda part: -sum(by_pass[part].values()))
  ms = lambda split: {k: round(1e3 * v / steps, 2) for k, v in
                      sorted(split.items(), key=lambda kv: -kv[1])}
  totals = {part: sum(by_pass[part].values()) for part in order}
  return {"parts_ms_per_step": ms(totals),
          "pass_ms_per_step": {part: ms(by_pass[part]) for part in order},
          "kind_ms_per_step": {part: ms(by_kind[part]) for part in order}}


def classify(location: str) -> str:
  """The part (PARTS) of an op from its "source:op_name", "other" if none of the scopes is in it."""
  scopes = set(re.split(r"[/()]", location.partition(":")[2]))
  return next((part for part in PARTS if part in scopes), "other")


def peak_live_buffers(live_range_text: str) -> list[tuple[str, str, int]]:
  """[(HLO instruction name, shape index, bytes)] of the buffers live at the memory peak, from the
  "Live ranges at K (peak):" block of XLA's `*-live-range.txt` dump."""
  out, inside = [], False
  for line in live_range_text.splitlines():
    if re.match(r"\s*Live ranges at \d+ \(peak\):", line):
      inside = True
      continue
    if inside:
      m = re.match(r"\s+([\w.\-]+)\{([^}]*)\}: (\d+) bytes", line)
      if m is None:
        break
      out.append((m.group(1), m.group(2), int(m.group(3))))
  return out


def _tuple_elements(shape: str) -> list[str]:
  """'(f32[2]{0}, /*index=1*/s32[])' → ['f32[2]{0}', 's32[]']; a non-tuple shape → [shape]."""
  shape = re.sub(r"/\*.*?\*/", "", shape).strip()
  if not shape.startswith("("):
    return [shape]
  out, depth, current = [], 0, ""
  for ch in shape[1:-1]:
    depth += (ch in "([{") - (ch in ")]}")
    if ch == "," and depth == 0:
      out.append(current.strip())
      current = ""
    else:
      current += ch
  return out + ([current.strip()] if current.strip() else [])


def hlo_values(hlo_text: str) -> tuple[dict[str, str], set[str], set[str]]:
  """(instruction name → result shape text, the ENTRY computation's parameters, every other
  computation's parameters: loop carries and called-computation inputs)."""
  inst = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\(")
  shapes, entry, inner, in_entry = {}, set(), set(), False
  for line in hlo_text.splitlines():
    if not line.startswith(" "):
      in_entry = line.startswith("ENTRY")
      continue
    m = inst.match(line)
    if m:
      shapes[m.group(1)] = m.group(2)
      if m.group(3) == "parameter":
        (entry if in_entry else inner).add(m.group(1))
  return shapes, entry, inner


def peak_breakdown(live: list[tuple[str, str, int]], hlo_text: str, top: int = 12) -> dict:
  """Bytes live at the peak by part (PARTS, "other", "arguments" for the step's inputs, "loop
  carries" for values entering a loop body or called computation), largest first, and the `top`
  largest buffers with their shapes."""
  where = op_locations(hlo_text)
  shapes, entry, inner = hlo_values(hlo_text)

  def part(name):
    if name in entry:
      return "arguments"
    if name in inner:
      return "loop carries"
    return classify(where.get(name, ""))

  def shape(name, index):
    elements = _tuple_elements(shapes.get(name, ""))
    if index == "":
      return elements[0] if len(elements) == 1 else ""
    first = index.split(",")[0]
    return elements[int(first)] if first.isdigit() and int(first) < len(elements) else ""

  parts: dict[str, int] = collections.defaultdict(int)
  for name, _, size in live:
    parts[part(name)] += size
  largest = sorted(live, key=lambda v: -v[2])[:top]
  return {"by_part": dict(sorted(parts.items(), key=lambda kv: -kv[1])),
          "top": [{"buffer": f"{n}{{{i}}}", "gib": _gib(b), "part": part(n),
                   "shape": re.sub(r"\{[\d,]*\}$", "", shape(n, i))} for n, i, b in largest]}


def memory_report(dump_dir: str, hlo_text: str) -> dict:
  """The JSON keys of `--memory_report` from the newest live-range dump of the step."""
  # The gradient program holds the step's peak; a one-program step is "sharded_step" alone.
  files = sorted(glob.glob(os.path.join(dump_dir, "*sharded_step_gradients*live-range.txt")) or
                 glob.glob(os.path.join(dump_dir, "*sharded_step*live-range.txt")),
                 key=os.path.getmtime)
  if not files:
    return {"xla_peak_error": f"no live-range dump of the step in {dump_dir}"}
  with open(files[-1]) as f:
    live = peak_live_buffers(f.read())
  if not live:
    return {"xla_peak_error": f"no peak block in {files[-1]}"}
  found = peak_breakdown(live, next(iter(hlo_modules(hlo_text).values())))
  return {"xla_peak_live_gib": _gib(sum(b for *_, b in live)),
          "xla_peak_by_part_gib": {k: _gib(v) for k, v in found["by_part"].items()},
          "xla_peak_top": found["top"]}


def _newest_trace(trace_dir: str):
  """The newest xplane trace under trace_dir as jax.profiler.ProfileData, or None."""
  import jax
  paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True),
                 key=os.path.getmtime)
  return jax.profiler.ProfileData.from_file(paths[-1]) if paths else None


def compile_events(trace_dir: str, top: int = 30) -> dict[str, list]:
  """{host activity name: [inclusive seconds, count]} of the newest trace's host planes, the
  `top` longest; Python frames ("$file:line …") and the profiler's own events are left out.
  Nested activities each count their whole span, so the numbers overlap and do not add up."""
  data = _newest_trace(trace_dir)
  if data is None:
    return {}
  total: dict[str, float] = collections.defaultdict(float)
  count: dict[str, int] = collections.defaultdict(int)
  for plane in data.planes:
    if not plane.name.startswith("/host:"):
      continue
    for line in plane.lines:
      for event in line.events:
        if event.name.startswith("$"):
          continue
        total[event.name] += event.duration_ns * 1e-9
        count[event.name] += 1
  longest = sorted(total, key=total.get, reverse=True)[:top]
  return {name[:160]: [round(total[name], 2), count[name]] for name in longest}


def python_profile(profiler, top: int = 50) -> dict[str, list]:
  """The `top` functions of a cProfile run by cumulative time and by own time:
  {"cumulative": [[seconds, calls, "file:line(name)"], …], "own": […]}."""
  import pstats
  stats = pstats.Stats(profiler).stats             # {(file, line, name): (cc, nc, tt, ct, callers)}

  def where(key):
    file, line, name = key
    return f"{'/'.join(file.split('/')[-3:])}:{line}({name})"

  def longest(index):
    keys = sorted(stats, key=lambda k: stats[k][index], reverse=True)[:top]
    return [[round(stats[k][index], 2), stats[k][1], where(k)] for k in keys]
  return {"cumulative": longest(3), "own": longest(2)}


def hlo_modules(hlo_text: str) -> dict[str, str]:
  """{module name: its text} of compiled HLO text that may hold several modules (the train
  step's gradient and update programs, k3train/train/phased.py, one after the other)."""
  starts = [m.start() for m in re.finditer(r"^HloModule ", hlo_text, re.M)]
  if len(starts) <= 1:
    m = re.match(r"HloModule ([\w.\-]+)", hlo_text)
    return {m.group(1) if m else "": hlo_text}
  bounds = starts[1:] + [len(hlo_text)]
  texts = [hlo_text[a:b] for a, b in zip(starts, bounds)]
  return {re.match(r"HloModule ([\w.\-]+)", t).group(1): t for t in texts}


def summed_over_modules(fn, hlo_text: str):
  """fn(module text) for each module of hlo_text, its numbers added key by key (nested dicts
  too; other values from the first module that has the key)."""
  def add(a, b):
    if isinstance(a, dict) and isinstance(b, dict):
      return {k: add(a[k], b[k]) if k in a and k in b else a.get(k, b.get(k)) for k in {**a, **b}}
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
      return a + b
    return a
  results = [fn(text) for text in hlo_modules(hlo_text).values()]
  total = results[0]
  for r in results[1:]:
    total = add(total, r)
  return total


def qualified(fn, hlo_text: str) -> dict:
  """fn(module text) → {name: value} merged over the modules of hlo_text, each name as
  "module::name" when there are several (instruction names repeat between modules)."""
  modules = hlo_modules(hlo_text)
  if len(modules) == 1:
    return fn(hlo_text)
  return {f"{module}::{k}": v for module, text in modules.items() for k, v in fn(text).items()}


def kernels_by_part(hlo_text: str) -> dict[str, int]:
  """Fusions and custom calls of a compiled module (the kernels the backend compiles, tunes and
  launches) counted by part, as the profile assigns them (`op_locations`, `classify`)."""
  where = op_locations(hlo_text)
  counts: dict[str, int] = collections.defaultdict(int)
  for name in _record.kernel_names(hlo_text):
    counts[classify(where.get(name, ""))] += 1
  return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def work_by_part(hlo_text: str) -> dict:
  """What the compiled step's kernels execute per step, by part (benchmarks/hlo_costs.py): GEMM
  TFLOP, GiB read and written by the other kernels, kernel launches (loops unrolled by their
  trip counts)."""
  where = op_locations(hlo_text)
  costs, note = hlo_costs.kernel_costs(hlo_text)
  out = hlo_costs.totals_by_part(costs, lambda name: classify(where.get(name, "")))
  if any(note.values()):
    out["counts_rest_on"] = note
  return out


# Cross-device ops of compiled HLO, by the name XLA prints (an async pair counts once, by its start).
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all",
               "collective-permute", "collective-broadcast")


def collectives_by_kind(hlo_text: str) -> dict[str, int]:
  """The compiled module's collectives counted by kind ("all-gather", …), those inside loops
  counted once: which exchanges a parallel layout compiles to."""
  kinds = "|".join(re.escape(k) for k in sorted(COLLECTIVES, key=len, reverse=True))
  found = re.findall(rf"=\s*(?:\(.*?\)|\S+)\s+({kinds})(?:-start)?\(", hlo_text)
  return dict(collections.Counter(found).most_common())


def xla_rematerialized(hlo_text: str) -> int:
  """How many instructions of the compiled module XLA's own rematerialisation pass made: the
  copies it recomputes to bring the program under its memory limit, named after the original
  with ".remat", ".remat2", … (later passes may add suffixes). Non-zero means the compiled step
  does work the model's remat policy did not ask for, and its compile held that pass's search."""
  return len(re.findall(r"^\s*(?:ROOT\s+)?%[\w.\-]*?\.remat\d*(?:\.[\w\-]+)*\s+=", hlo_text, re.M))


def distinct_kernels(hlo_text: str) -> int:
  """How many of the compiled module's kernels (`_record.kernel_lines`) differ: XLA emits the code
  of identical fusions once and marks the repeats with `deduplicated_name`, so this is the
  number of kernels the backend generates code for (custom calls count each)."""
  seen = set()
  for name, line in _record.kernel_lines(hlo_text):
    same = re.search(r'deduplicated_name="([^"]+)"', line)
    seen.add(same.group(1) if same else name)
  return len(seen)


def custom_calls_by_target(hlo_text: str) -> dict[str, int]:
  """Custom calls of a compiled module by target, those inside fused computations included: the
  kernels (Pallas, Mosaic GPU, cuBLAS, ...) as the executable runs them, so a kernel XLA copied
  (e.g. into a dynamic-slice fusion) counts twice."""
  targets = re.findall(r'\bcustom-call\([^\n]*?custom_call_target="([^"]+)"', hlo_text)
  return dict(collections.Counter(targets).most_common())


# Seconds per jax duration event ("/jax/core/compile/…"), summed since the listener was added.
_JAX_EVENTS: dict[str, float] = collections.defaultdict(float)


def _jax_event_seconds() -> dict[str, float]:
  """A copy of the running sums of jax's duration events (the listener is added once)."""
  import jax
  if not getattr(_jax_event_seconds, "listening", False):
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **_: _JAX_EVENTS.__setitem__(event, _JAX_EVENTS[event] + seconds))
    _jax_event_seconds.listening = True
  return dict(_JAX_EVENTS)


def device_op_times(trace_dir: str) -> tuple[dict[str, float], list[str], list[tuple]]:
  """{HLO op name: total device seconds} from the newest xplane trace, the line names seen, and
  every device op as (start ns, end ns, op name), for the idle accounting (`idle_profile`)."""
  data = _newest_trace(trace_dir)
  if data is None:
    return {}, [], []
  times: dict[str, float] = collections.defaultdict(float)
  lines_seen = []
  intervals = []
  for plane in data.planes:
    if not plane.name.startswith("/device:"):
      continue
    lines = list(plane.lines)
    lines_seen += [f"{plane.name}|{line.name}" for line in lines]
    # One line per HLO op where the profiler makes it; otherwise the compute streams' kernels,
    # each named by its "hlo_op" stat when it has one.
    ops = [line for line in lines if line.name == "XLA Ops"]
    for line in ops or [l for l in lines if l.name.startswith("Stream") and "Compute" in l.name]:
      for event in line.events:
        stats = dict(_stats(event))
        op = str(stats.get("hlo_op") or event.name)
        if stats.get("hlo_module"):      # instruction names repeat between programs
          op = f"{stats['hlo_module']}::{op}"
        times[op] += event.duration_ns * 1e-9
        intervals.append((float(event.start_ns), float(event.start_ns + event.duration_ns), op))
  return dict(times), lines_seen, intervals


def idle_profile(intervals, part_of, steps: int, top: int = 8) -> dict:
  """When the device ran no op, between the first op traced and the last.

  intervals: (start ns, end ns, op) of every device op (overlapping ops on several streams count
  once); part_of(op) -> its part. Each gap is charged to the part of the op that ends it (the op
  the device waited for: launch latency, a host sync, the next step's dispatch). Returns the
  busy and idle milliseconds per step, idle by part, and the longest gaps."""
  if not intervals:
    return {}
  spans = sorted(intervals)
  busy_ns = idle_ns = 0.0
  by_part: dict[str, float] = collections.defaultdict(float)
  gaps = []
  start, end = spans[0][0], spans[0][1]
  for s, e, op in spans[1:]:
    if s > end:
      busy_ns += end - start
      idle_ns += s - end
      by_part[part_of(op)] += s - end
      gaps.append((s - end, op))
      start, end = s, e
    else:
      end = max(end, e)
  busy_ns += end - start
  per_step = lambda ns: round(ns * 1e-6 / steps, 2)
  return {"busy_ms_per_step": per_step(busy_ns), "idle_ms_per_step": per_step(idle_ns),
          "gaps_per_step": round(len(gaps) / steps, 1),
          "idle_by_part_ms_per_step": {k: per_step(v) for k, v in
                                       sorted(by_part.items(), key=lambda kv: -kv[1])},
          "longest_gaps": [{"ms": round(ns * 1e-6, 3), "before": op, "part": part_of(op)}
                           for ns, op in sorted(gaps, reverse=True)[:top]]}


def _stats(event):
  try:
    return [(str(k), v) for k, v in event.stats]
  except Exception:                                          # noqa: BLE001
    return []


def traced_op_name(modules: list[str], where: dict[str, str]):
  """traced op name → the key of `where` (`qualified`): "module::op" from the trace's own module
  stat where it names one of `modules`, else the one module holding that op; unqualified where
  there is a single module."""
  def name(traced: str) -> str:
    module, sep, op = traced.rpartition("::")
    op = op if sep else traced
    if len(modules) == 1:
      return op
    held = [m for m in modules if f"{m}::{op}" in where]
    named = [m for m in held if sep and (m == module or m.endswith(module) or module.endswith(m))]
    pick = named or (held if len(held) == 1 else [])
    return f"{pick[0]}::{op}" if pick else traced
  return name


def part_profile(trace_dir: str, hlo_text: str, steps: int, dump_prefix: str = "") -> dict:
  """Per-part device milliseconds per step, and the fifteen most expensive ops. With dump_prefix,
  every op also goes to <dump_prefix>_ops.json and the compiled HLO to <dump_prefix>_hlo.txt.gz
  (`dump_ops`)."""
  times, lines_seen, intervals = device_op_times(trace_dir)
  if not times:
    return {"error": "no device ops in the trace", "lines": lines_seen[:20]}
  where = qualified(op_locations, hlo_text)
  name = traced_op_name(list(hlo_modules(hlo_text)), where)
  merged: dict[str, float] = collections.defaultdict(float)
  for op, seconds in times.items():
    merged[name(op)] += seconds
  times = dict(merged)
  intervals = [(a, b, name(op)) for a, b, op in intervals]
  kinds = qualified(op_kinds, hlo_text)
  total = sum(times.values())
  top = sorted(times.items(), key=lambda kv: -kv[1])[:15]
  costs = qualified(lambda text: hlo_costs.kernel_costs(text)[0], hlo_text)
  part_of = lambda op: classify(where.get(op, ""))
  out = {"device_ms_per_step": round(1e3 * total / steps, 2),
         **part_breakdown(times, where, kinds, steps),
         "rates_by_part": hlo_costs.rates_by_part(
             costs, {op: s / steps for op, s in times.items()}, part_of,
             lambda op: kinds.get(op) in ("fusion", "copy")),
         "top_ops": [{"op": op, "ms_per_step": round(1e3 * s / steps, 2),
                      "where": where.get(op, "")[-120:]} for op, s in top],
         **idle_profile(intervals, lambda op: classify(where.get(op, "")), steps)}
  if dump_prefix:
    try:
      dump_ops(dump_prefix, times, where, kinds, hlo_text, steps, costs)
    except OSError as e:
      out["dump_error"] = str(e)[:200]
  return out


def dump_ops(prefix: str, times: dict[str, float], where: dict[str, str], kinds: dict[str, str],
             hlo_text: str, steps: int, costs: dict | None = None) -> None:
  """<prefix>_ops.json: every device op, most expensive first, with its ms per step, part, pass,
  kind, source location and, where the HLO says (benchmarks/hlo_costs.py), its launches, GEMM
  GFLOP and MiB moved per step; <prefix>_hlo.txt.gz: the compiled step's HLO, to read an op in
  full."""
  import gzip
  costs = costs or {}

  def work(op):
    c = costs.get(op)
    if c is None:
      return {}
    return {"launches": c.runs, "gflop": round(c.runs * c.flops / 1e9, 3),
            "mib": round(c.runs * c.bytes / 2**20, 3)}

  ops = [{"op": op, "ms_per_step": round(1e3 * s / steps, 4), "part": classify(where.get(op, "")),
          "pass": pass_of(where.get(op, "")), "kind": kinds.get(op, "other"),
          "where": where.get(op, ""), **work(op)}
         for op, s in sorted(times.items(), key=lambda kv: -kv[1])]
  with open(prefix + "_ops.json", "w") as f:
    json.dump(ops, f, indent=0)
  with gzip.open(prefix + "_hlo.txt.gz", "wt") as f:
    f.write(hlo_text)


# ----------------------------------------------------------------------------- measurement


def _gib(b: float) -> float:
  """Bytes → GiB, 4 significant digits (tiny CPU configs are a few MiB)."""
  return float(f"{b / 2**30:.4g}")


def _memory_totals(m) -> dict:
  out = {"arguments": int(m.argument_size_in_bytes), "temporaries": int(m.temp_size_in_bytes),
         "outputs": int(m.output_size_in_bytes), "aliased": int(m.alias_size_in_bytes),
         "code": int(getattr(m, "generated_code_size_in_bytes", 0) or 0)}
  out["total"] = out["arguments"] + out["temporaries"] + out["outputs"] - out["aliased"]
  return out


def xla_memory(compiled) -> dict | None:
  """Per-device bytes of XLA's memory analysis of the compiled step, or None when the backend
  reports none. total = arguments + temporaries + outputs − aliased (the donated state's buffers
  are both an argument and an output, counted once). The train step's two programs
  (k3train/train/phased.py) run one after the other: the row is the larger one's, with each
  program's own analysis under "programs" ("gradients", "update")."""
  from k3train.train.phased import CompiledPhases
  try:
    m = compiled.memory_analysis()
  except Exception:                                          # noqa: BLE001
    return None
  if isinstance(compiled, CompiledPhases):
    if any(x is None for x in m):
      return None
    grads, update = _memory_totals(m[0]), _memory_totals(m[1])
    out = dict(max((grads, update), key=lambda t: t["total"]))
    out["programs"] = {"gradients": grads, "update": update}
    return out
  if isinstance(m, (list, tuple)):
    m = m[0] if m else None
  if m is None:
    return None
  return _memory_totals(m)


def plan_memory(cfg, device_count: int) -> dict:
  """Per-device bytes of the memory plan (k3train/tools/plan) of the step `measure` compiles: the
  config as given (its mesh on `device_count` devices, batch, seq_len, micro-batches, remat), the
  same call as the start-up check of `k3train.main`. Its terms, its phases, and total = the
  largest phase (the plan's peak). Raises ValueError with the plan's message when it has none."""
  from k3train import config as config_lib
  from k3train.tools.plan import stages as stages_lib
  stage = config_lib.Stage(0, "", 0, cfg.train.steps, 0, "", cfg)
  memory = stages_lib.device_memory_gib() or 0.0           # only the plan's verdict uses it
  ((_, p),) = stages_lib.stage_plans(cfg, device_count, device_memory_gib=memory, stages=[stage])
  if isinstance(p, str):
    raise ValueError(p)
  out = {label.strip().removeprefix("of which ").replace(" ", "_").lower(): int(b)
         for label, b, _ in p.lines}
  out["phases"] = {k: int(v) for k, v in p.phases.items()}
  out["total"] = int(p.peak)
  return out


def memory_row(compiled, cfg, device_count: int) -> dict:
  """The JSON keys comparing XLA's memory analysis with the plan (both per device, in GiB)."""
  row = {}
  xla = xla_memory(compiled)
  if xla is None:
    row["xla_memory_gib"] = None
  else:
    gib = lambda v: {k: gib(x) for k, x in v.items()} if isinstance(v, dict) else _gib(v)
    row["xla_memory_gib"] = gib(xla)
  try:
    planned = plan_memory(cfg, device_count)
  except Exception as e:                                     # noqa: BLE001
    row["plan_memory_gib"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    planned = None
  else:
    row["plan_memory_gib"] = {k: ({kk: _gib(vv) for kk, vv in v.items()} if isinstance(v, dict)
                                  else _gib(v)) for k, v in planned.items()}
  row["plan_vs_xla"] = (round(planned["total"] / xla["total"], 3)
                        if planned and xla and xla["total"] > 0 else None)
  return row


# jax's lowering platform for each `--lower_for` target.
LOWERING_PLATFORMS = {"gpu": "cuda", "tpu": "tpu"}
# Custom-call targets of hand-written kernels in a lowered (StableHLO) module.
KERNEL_CALL_TARGETS = ("__gpu$xla.gpu.triton", "mosaic_gpu_v2", "mosaic_gpu", "tpu_custom_call")


def lowered_kernels(stablehlo_text: str) -> dict[str, int]:
  """The hand-written kernels of a lowered module by name, most frequent first: a Triton or
  Mosaic TPU call's own name, else the name of the function that holds the call (the Mosaic GPU
  kernels are jitted functions; a `_<n>` suffix that tells apart specialisations of one name is
  dropped)."""
  funcs = [(m.start(), m.group(1)) for m in
           re.finditer(r'func\.func (?:private |public )?@([\w.$-]+)', stablehlo_text)]
  starts = [start for start, _ in funcs]
  names = []
  for m in re.finditer(r'custom_call @([\w.$-]+)\(', stablehlo_text):
    if m.group(1) not in KERNEL_CALL_TARGETS:
      continue
    line = stablehlo_text[m.start():stablehlo_text.find("\n", m.start())]
    own = re.search(r'\b(?:kernel_)?name = "([^"]+)"', line)
    if own:
      names.append(own.group(1))
    else:
      i = bisect.bisect(starts, m.start()) - 1
      names.append(re.sub(r"_\d+$", "", funcs[i][1]) if i >= 0 else "?")
  return dict(collections.Counter(names).most_common())


def stablehlo_ops_by_part(stablehlo_text: str) -> dict[str, int]:
  """The ops of a lowered module printed with debug info, by part (`classify` of the op names in
  each op's location chain; "other" for ops without one): where the program's volume is, which
  XLA's passes and kernel generation then work through."""
  locations = {m.group(1): m.group(2)
               for m in re.finditer(r"^#(loc\d*) = loc\((.*)\)$", stablehlo_text, re.M)}
  paths: dict[str, str] = {}

  def path(loc: str, depth: int = 0) -> str:
    if loc not in paths:
      body = locations.get(loc, "")
      names = [n for n in re.findall(r'"([^"]*)"', body) if not n.endswith(".py")]
      if depth < 16:
        names += [path(ref, depth + 1) for ref in re.findall(r"#(loc\d+)", body)]
      paths[loc] = "/".join(n for n in names if n)
    return paths[loc]

  counts: dict[str, int] = collections.defaultdict(int)
  for line in stablehlo_text.splitlines():
    if not re.match(r'\s*(?:%[^=\n]+= )?"?(?:stablehlo|chlo|mhlo)\.[a-z_]+', line):
      continue
    loc = re.search(r"loc\(#(loc\d+)\)\s*$", line)
    counts[classify("lowered:" + path(loc.group(1))) if loc else "other"] += 1
  return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def dots_by_dtypes(stablehlo_text: str) -> dict[str, int]:
  """The lowered module's matmuls (`dot_general`) counted by "lhs,rhs->out" element types, e.g.
  "bf16,bf16->f32": which GEMMs run on float32 operands (TF32 or slower on a GPU)."""
  tensor = r"tensor<(?:[\d?]+x)*(\w+)>"
  kinds = re.findall(rf"stablehlo\.dot_general.*?:\s*\({tensor}, {tensor}\) -> {tensor}",
                     stablehlo_text)
  return dict(collections.Counter(f"{a},{b}->{o}" for a, b, o in kinds).most_common())


def text_batches(cfg):
  """The config's own text pipeline, one process's view, batches of train.global_batch_size."""
  from k3train.data import pipeline
  t = cfg.train
  return pipeline.make_text_iterator(cfg.data, batch_size=t.global_batch_size, seed=t.seed,
                                     process_index=0, process_count=1)


def lowered_row(cfg, name: str, target: str, profile: bool = False) -> dict:
  """`--lower_for`: the step traced and lowered for `target` on this machine, not compiled; with
  `profile` (`--lower_profile`) under cProfile, reported as `lower_profile`."""
  from pallas_kernels import platform
  t = cfg.train
  data = text_batches(cfg)
  with platform.targeting(target):
    run = abstract_run(cfg)
    batch = run.layout.global_batch(next(data))
    profiler = None
    if profile:
      import cProfile
      profiler = cProfile.Profile()
      profiler.enable()
    t0 = time.perf_counter()
    traced = run.step.trace(run.state, batch)
    t1 = time.perf_counter()
    lowered = traced.lower(lowering_platforms=(LOWERING_PLATFORMS[target],))
    t2 = time.perf_counter()
    if profiler is not None:
      profiler.disable()
  text = lowered.as_text(debug_info=True)
  calls = collections.Counter(re.findall(r'custom_call @([\w.$-]+)\(', text))
  # One module per program (the train step's two, k3train/train/phased.py): location aliases
  # (#loc…) are per module.
  starts = [m.start() for m in re.finditer(r"^module @", text, re.M)] or [0]
  by_part = collections.Counter()
  for a, b in zip(starts, starts[1:] + [len(text)]):
    by_part.update(stablehlo_ops_by_part(text[a:b]))
  by_part = dict(by_part.most_common())
  return {"name": name, "lowered_for": target,
          "tokens_per_step": t.global_batch_size * cfg.data.seq_len,
          "trace_s": round(t1 - t0, 1), "lower_s": round(t2 - t1, 1),
          "stablehlo_mib": round(len(text.encode()) / 2**20, 2),
          "stablehlo_ops": sum(by_part.values()), "stablehlo_ops_by_part": by_part,
          "lowered_custom_calls": dict(calls.most_common()),
          "lowered_dots": dots_by_dtypes(text),
          "lowered_kernels": lowered_kernels(text),
          **({"lower_profile": python_profile(profiler, top=150)} if profiler else {})}


def compile_step(run, batch, fv, name: str):
  """(lowered, compiled, its HLO text, compile seconds, the row's compile fields) of `run.step` on
  `batch`
  (arrays or ShapeDtypeStructs with shardings); "<name>: compiled in …" goes to stderr at once,
  so a run stopped later still says how long it compiled."""
  import jax
  from k3train.train.phased import CompiledPhases
  events_before = _jax_event_seconds()
  compile_trace = tempfile.mkdtemp(prefix="k3_compile_trace_") if fv.compile_profile else ""
  if compile_trace:
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    options.host_tracer_level = 2
    jax.profiler.start_trace(compile_trace, profiler_options=options)
  profiler = None
  if fv.lower_profile:
    import cProfile
    profiler = cProfile.Profile()
    profiler.enable()
  t0 = time.perf_counter()
  lowered = run.step.lower(run.state, batch)
  t1 = time.perf_counter()
  if profiler is not None:
    profiler.disable()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  if compile_trace:
    jax.profiler.stop_trace()
  compile_s = t2 - t0
  hlo_text = compiled.as_text() or ""
  compile_row = {"trace_lower_s": round(t1 - t0, 1), "backend_compile_s": round(t2 - t1, 1),
                 **({"backend_compile_programs_s": {k: round(v, 1) for k, v in compiled.seconds.items()
                                                    if k != "wall"}}
                    if isinstance(compiled, CompiledPhases) else {}),
                 "jax_compile_events_s": {
                     k.rsplit("/", 1)[-1]: round(v - events_before.get(k, 0.0), 1)
                     for k, v in _jax_event_seconds().items() if k.startswith("/jax/core/compile/")},
                 "kernels_by_part": summed_over_modules(kernels_by_part, hlo_text),
                 "custom_calls": summed_over_modules(custom_calls_by_target, hlo_text),
                 "collectives": summed_over_modules(collectives_by_kind, hlo_text)}
  compile_row["kernels"] = sum(compile_row["kernels_by_part"].values())
  compile_row["kernels_distinct"] = summed_over_modules(distinct_kernels, hlo_text)
  compile_row["xla_rematerialized"] = summed_over_modules(xla_rematerialized, hlo_text)
  compile_row["work_by_part"] = summed_over_modules(work_by_part, hlo_text)
  if compile_trace:
    compile_row["compile_events"] = compile_events(compile_trace)
  if profiler is not None:
    compile_row["lower_profile"] = python_profile(profiler)
  print(f"{name}: compiled in {compile_s:.1f} s (trace + lower {compile_row['trace_lower_s']} s, "
        f"XLA {compile_row['backend_compile_s']} s), {compile_row['kernels']} kernels",
        file=sys.stderr, flush=True)
  if compile_row["xla_rematerialized"]:
    print(f"{name}: XLA rematerialised {compile_row['xla_rematerialized']} instructions to fit its "
          "memory limit: the step recomputes work the remat policy did not ask for",
          file=sys.stderr, flush=True)
  return lowered, compiled, hlo_text, compile_s, compile_row


def compiled_row(cfg, name: str, compiled, hlo_text: str, compile_s: float, compile_row: dict,
                 device_count: int, xla_dump: str = "", **head) -> dict:
  """The row of a step compiled and not run (`--compile_only`, `--compile_for`): `head`, then
  the compile fields, the memory fields and, with `xla_dump`, the buffers at XLA's peak."""
  t = cfg.train
  row = {"name": name, **head, "tokens_per_step": t.global_batch_size * cfg.data.seq_len,
         "compile_s": round(compile_s, 1), **compile_row,
         **memory_row(compiled, cfg, device_count)}
  if xla_dump:
    row.update(memory_report(xla_dump, hlo_text))
  return row


def compiled_for_row(cfg, fv, name: str, xla_dump: str = "") -> dict:
  """`--compile_for`: the step lowered and compiled for the target GPU on this machine
  (benchmarks/gpu_target.py), the state and batch as shapes; the compile and memory fields."""
  import jax
  import numpy as np
  from pallas_kernels import platform
  target = gpu_target.load(fv.compile_for)
  devices = gpu_target.devices(target, fv.target_devices)
  with platform.targeting("gpu", sm_count=target.sm_count):
    run = abstract_run(cfg, devices)
    batch = {k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype,
                                     sharding=run.layout.sharding_for(k))
             for k, v in next(text_batches(cfg)).items()}
    _, compiled, hlo_text, compile_s, compile_row = compile_step(run, batch, fv, name)
  return compiled_row(cfg, name, compiled, hlo_text, compile_s, compile_row, len(devices),
                      xla_dump, compiled_for=f"{target.name} ({target.description}), no autotuning",
                      target_devices=len(devices), mesh=dict(run.layout.mesh.shape))


def measure(cfg, fv, name: str, xla_dump: str = "") -> dict:
  """One JSON row for config `cfg`; xla_dump: where XLA dumps the step (`--memory_report`)."""
  if fv.lower_for:
    return lowered_row(cfg, name, fv.lower_for, profile=fv.lower_profile)
  if fv.compile_for:
    return compiled_for_row(cfg, fv, name, xla_dump)
  import jax
  import numpy as np
  from k3train.train import builder
  from k3train.train import metrics as metrics_lib

  t = cfg.train
  data = text_batches(cfg)
  if fv.compile_only:
    # The state as shapes with their shardings: nothing initialised, nothing allocated but the
    # batch; the step lowers and compiles exactly as for the concrete state.
    run = abstract_run(cfg)
  else:
    run = builder.build(cfg)
  size = builder.model_size(cfg)
  state = run.state
  loads = []

  # Compiled once, ahead of time, on the first batch: the executable is the one timed, profiled
  # and whose memory analysis is read (it keeps the jitted step's shardings and state donation).
  batch = run.layout.global_batch(next(data))
  lowered, compiled, hlo_text, compile_s, compile_row = compile_step(run, batch, fv, name)
  if fv.compile_only:
    row = compiled_row(cfg, name, compiled, hlo_text, compile_s, compile_row, jax.device_count(),
                       xla_dump, compile_only=True)
    del compiled, lowered, run
    return row

  def dispatch(state, batch=None):
    if batch is None:
      batch = run.layout.global_batch(next(data))
    return compiled(state, batch)

  def read(m):
    """The step's loss on the host (waits for the step), and its expert load with --moe_loads."""
    loss = float(np.asarray(m["loss"]))
    if fv.moe_loads and "moe_max_load" in m:
      loads.append(round(float(np.asarray(m["moe_max_load"])), 3))
    return loss

  def one_step(state, batch=None):
    state, m = dispatch(state, batch)
    return state, read(m)

  state, loss = one_step(state, batch)                       # first execution, not timed
  times = []
  if fv.sync_each_step:
    for _ in range(fv.steps):
      t0 = time.perf_counter()
      state, loss = one_step(state)
      times.append(time.perf_counter() - t0)
  else:
    # As the train loop: the next step is dispatched (its batch prepared, its launch queued)
    # before the current step's loss is read, so host work overlaps the device's.
    state, m = dispatch(state)
    t0 = None
    for _ in range(fv.steps + 1):
      state, m_next = dispatch(state)
      loss = read(m)
      now = time.perf_counter()
      if t0 is not None:
        times.append(now - t0)
      t0, m = now, m_next
    loss = read(m)                                           # drain the step in flight
  step_s = float(np.median(times))
  tokens = t.global_batch_size * cfg.data.seq_len
  tps = tokens / step_s
  device = jax.devices()[0]
  peak_flops = metrics_lib.peak_flops_per_device(t.peak_flops_per_device, device.device_kind)
  peak = {}
  stats = device.memory_stats() or {}
  if stats:
    peak = {"peak_gib": round(stats.get("peak_bytes_in_use", 0) / 2**30, 2),
            "limit_gib": round(stats.get("bytes_limit", 0) / 2**30, 2)}
  row = {"name": name, "step_s": round(step_s, 4), "step_s_min": round(min(times), 4),
         "timing": "each step alone" if fv.sync_each_step else "next step in flight",
         "tokens_per_step": tokens, "tokens_per_s": round(tps, 1),
         "mfu": round(metrics_lib.mfu(tps, size.flops_per_token, peak_flops, 1), 4),
         "peak_flops_per_device": peak_flops,
         "flops_per_token": size.flops_per_token, "compile_s": round(compile_s, 1), **compile_row,
         "loss_last": round(loss, 4), **peak, **memory_row(compiled, cfg, jax.device_count())}
  if xla_dump:
    row.update(memory_report(xla_dump, hlo_text))
  if fv.profile_steps:
    trace_dir = fv.trace_dir or tempfile.mkdtemp(prefix="k3_trace_")
    trace_dir = os.path.join(trace_dir, name)
    profiled, profiled_hlo, executable = profile_executable(
        lowered, compiled, hlo_text, jax.default_backend(), fv.profile_timed_executable)
    if not profiled_hlo:
      row["hlo_error"] = "the compiled step has no HLO text"
    with jax.profiler.trace(trace_dir):
      for _ in range(fv.profile_steps):
        state, m = profiled(state, run.layout.global_batch(next(data)))
        loss = read(m)
    try:
      dump_prefix = ""
      if fv.dump_dir:
        os.makedirs(fv.dump_dir, exist_ok=True)
        dump_prefix = os.path.join(fv.dump_dir, name)
      row["profile"] = part_profile(trace_dir, profiled_hlo, fv.profile_steps, dump_prefix)
    except Exception as e:                                   # noqa: BLE001
      row["profile"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    row["profile"]["executable"] = executable
    del profiled
  if loads:
    row["moe_max_load"] = {"all": loads, "max_after_10": max(loads[10:], default=None),
                           "mean": round(float(np.mean(loads)), 3)}
  del state, run, compiled
  return row


def _busy_idle(row: dict) -> str:
  """"busy/idle" device ms per step of a profiled row, "-" without a profile."""
  p = row.get("profile") or {}
  if "busy_ms_per_step" not in p:
    return "-"
  return f"{p['busy_ms_per_step']:.1f}/{p['idle_ms_per_step']:.1f}"


def main(argv=None) -> int:
  args = cli.parse(argv, PROG, define=define, config_required=True)
  if args.exit_code is not None:
    return args.exit_code
  xla_dump = ""
  if args.flags.memory_report:
    # XLA reads its flags once, when the backend starts: set before jax is imported.
    xla_dump = os.path.join(args.flags.dump_dir, "xla") if args.flags.dump_dir else \
        tempfile.mkdtemp(prefix="k3_xla_dump_")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={xla_dump}"
                               " --xla_dump_hlo_module_re=sharded_step").strip()
  fv = args.flags
  if fv.compile_for:
    problem = gpu_target.missing_plugin()
    if fv.lower_for:
      problem = "--compile_for and --lower_for exclude each other (--compile_for also lowers)"
  elif fv.target_devices != 1:
    problem = "--target_devices is the number of --compile_for GPUs; give --compile_for too"
  else:
    problem = None
  if problem:
    cli.error(PROG, problem)
    return cli.USAGE_ERROR
  if fv.compile_for:
    os.environ.update(gpu_target.environment())
    import jax
    jax.config.update("jax_platforms", "cpu")   # the runtime: nothing runs on the target
  import jax
  try:
    variants = [("base", {})] + parse_variants(fv.variants)
  except ValueError as e:
    cli.error(PROG, str(e))
    return cli.USAGE_ERROR
  # Step times compare only under the same runtime settings: record them with every row.
  env = _record.environment(xla_flags=os.environ.get("XLA_FLAGS", ""),
                            mem_fraction=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", ""))
  if fv.compile_for:   # compiled for that device on this machine's host, never run on it
    env["device"] = gpu_target.load(fv.compile_for).description
  rows = []
  for position, (name, pairs) in enumerate(variants):
    cfg = apply_overrides(args.config, pairs)
    try:
      row = measure(cfg, fv, name, xla_dump)
    except Exception as e:                                   # noqa: BLE001
      row = {"name": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    row.update(env, overrides=pairs)
    caveat = shared_autotuning_caveat(position, pairs)
    if caveat:
      row["caveat"] = caveat
      print(f"{name}: {caveat}", file=sys.stderr, flush=True)
    rows.append(row)
    print(json.dumps(row), flush=True)
  print(f"{'variant':<12} {'step ms':>9} {'tok/s':>9} {'MFU':>6} {'compile s':>9} {'peak GiB':>8} "
        f"{'XLA GiB':>9} {'plan GiB':>9} {'plan/XLA':>8} {'busy/idle ms':>14}")
  for r in rows:
    if "error" in r:
      print(f"{r['name']:<12} error: {r['error'][:80]}")
      continue
    if "lowered_for" in r:
      print(f"{r['name']:<12} lowered for {r['lowered_for']}: trace {r['trace_s']} s, lower "
            f"{r['lower_s']} s, {r['stablehlo_ops']} ops, {sum(r['lowered_kernels'].values())} "
            f"kernels")
      continue
    xla = (r.get("xla_memory_gib") or {}).get("total")
    planned = (r.get("plan_memory_gib") or {}).get("total")
    ratio = r.get("plan_vs_xla")
    timed = (f"{1e3 * r['step_s']:>9.1f} {r['tokens_per_s']:>9.0f} {r['mfu']:>6.3f}"
             if "step_s" in r else f"{'-':>9} {'-':>9} {'-':>6}")
    print(f"{r['name']:<12} {timed} "
          f"{r['compile_s']:>9.1f} {r.get('peak_gib', 0):>8.1f} "
          f"{'-' if xla is None else format(xla, '.4g'):>9} "
          f"{'-' if planned is None else format(planned, '.4g'):>9} "
          f"{'-' if ratio is None else format(ratio, '.3f'):>8} {_busy_idle(r):>14}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
