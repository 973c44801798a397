"""What a compiled module's kernels execute per run: launches, GEMM FLOPs and bytes moved.

Read from the optimised HLO text alone, so it works for a step compiled without its device
(`train_step.py --compile_for`) as well as beside a profile:

- Launches. A kernel (`_record.kernel_lines`: a fusion or custom call outside fused
  computations, buffer allocations aside) runs once per run of the computation that holds it.
  The entry computation runs once; a while loop's body and condition run its `known_trip_count`
  times (n + 1 for the condition) per run of the loop; a call's (and a command buffer's)
  computation once per call; a conditional's branches are counted as if each ran every time (an
  upper bound, reported apart).
- Kinds. "gemm": cuBLAS calls, XLA's GEMM fusions and fusions wrapping a cuBLAS call; "kernel":
  the other custom calls (Pallas, Mosaic GPU, cuDNN, library sorts) and fusions wrapping one;
  "fusion": XLA's own fusions.
- GEMM FLOPs per launch: 2 · (output elements) · (contracted elements) of the cuBLAS call's
  `dot_dimension_numbers`, or of the `dot` inside a GEMM fusion.
- Bytes per launch: what the kernel reads and writes in device memory, from the shapes: each
  operand and each result once, except where a fusion touches only part of a buffer. A fusion
  parameter read only through (dynamic-)slices or as a gather's operand counts the bytes those
  read; a result written by an in-place dynamic-update-slice or scatter counts the update, and
  the buffer it updates is not read. A cuBLAS call's workspace (its s8 result) counts nothing.

Divided by a profile's per-op device time (`train_step.py` `part_profile`), these give each
part's GEMM rate (TFLOP/s) and its XLA fusions' bandwidth (TB/s); without a device they say how
much GEMM work and memory traffic a change adds or removes.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import re

from benchmarks import _record

BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
         "f8e8m0fnu": 1, "f4e2m1fn": 0.5, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
         "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}

_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(\(.*?\)|\S+)\s+([\w\-]+)\((.*)$")
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([\d,]*)\]")
_OPERAND = re.compile(r"%([\w.\-]+)")
# Ops that only read part of an operand: (op, which operand index is the partly read buffer).
_PARTIAL_READS = {"dynamic-slice": 0, "slice": 0, "gather": 0}
_IN_PLACE = {"dynamic-update-slice": (0, 1), "scatter": (0, 2)}   # (buffer operand, update operand)
_PASS_THROUGH = ("bitcast", "reshape", "get-tuple-element", "copy")


@dataclasses.dataclass(frozen=True)
class Instruction:
  name: str
  shape: str             # the result type as printed, e.g. "bf16[8,16]{1,0}" or a tuple "(…)"
  op: str
  operands: tuple[str, ...]
  attributes: str
  root: bool


@dataclasses.dataclass
class KernelCost:
  """One launched kernel: runs per module run, and per run its GEMM FLOPs and bytes moved."""
  runs: float
  flops: float
  bytes: float
  kind: str              # "gemm", "kernel" or "fusion" (module docstring)


def shape_bytes(shape: str, skip_workspace: bool = False) -> float:
  """Bytes of a printed HLO type (a tuple's elements summed); skip_workspace drops s8 elements
  of a tuple (a cuBLAS call's scratch)."""
  tuple_shape = shape.startswith("(")
  total = 0.0
  for dtype, dims in _ARRAY.findall(shape):
    if dtype not in BYTES or (skip_workspace and tuple_shape and dtype == "s8"):
      continue
    total += BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
  return total


def _dims(shape: str) -> list[int]:
  m = _ARRAY.search(shape)
  return [int(d) for d in m.group(2).split(",") if d] if m else []


def parse(hlo_text: str) -> tuple[dict[str, list[Instruction]], dict[str, Instruction], str]:
  """(instructions by computation, instructions by name, the entry computation's name)."""
  by_comp: dict[str, list[Instruction]] = {}
  by_name: dict[str, Instruction] = {}
  entry, current = "", None
  for line in hlo_text.splitlines():
    head = _record.COMPUTATION_LINE.match(line)
    if head and not line.startswith(" "):
      current = head.group(1)
      by_comp[current] = []
      if line.startswith("ENTRY"):
        entry = current
      continue
    m = _INSTRUCTION.match(line)
    if m is None or current is None:
      continue
    rest = m.group(5)
    depth, end = 1, len(rest)
    for i, ch in enumerate(rest):            # the operand list ends at its closing parenthesis
      depth += (ch == "(") - (ch == ")")
      if depth == 0:
        end = i
        break
    ins = Instruction(m.group(2), m.group(3), m.group(4), tuple(_OPERAND.findall(rest[:end])),
                      rest[end + 1:], bool(m.group(1)))
    by_comp[current].append(ins)
    by_name[ins.name] = ins
  return by_comp, by_name, entry


def _trip_count(ins: Instruction) -> float:
  m = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)', ins.attributes)
  return float(m.group(1)) if m else 1.0


def computation_runs(by_comp, entry: str) -> tuple[dict[str, float], set[str]]:
  """Runs per module run of every computation that launches kernels, and the computations that
  sit under a conditional (counted as if every branch ran)."""
  runs: dict[str, float] = collections.defaultdict(float)
  branchy: set[str] = set()
  order = [(entry, 1.0, False)]
  while order:
    comp, n, in_branch = order.pop()
    runs[comp] += n
    if in_branch:
      branchy.add(comp)
    for ins in by_comp.get(comp, ()):
      attrs = ins.attributes
      if ins.op == "while":
        trips = _trip_count(ins)
        body = re.search(r"\bbody=%?([\w.\-]+)", attrs)
        cond = re.search(r"\bcondition=%?([\w.\-]+)", attrs)
        if body:
          order.append((body.group(1), n * trips, in_branch))
        if cond:
          order.append((cond.group(1), n * (trips + 1), in_branch))
      elif ins.op == "call":
        callee = re.search(r"\bto_apply=%?([\w.\-]+)", attrs)
        if callee:
          order.append((callee.group(1), n, in_branch))
      elif ins.op == "conditional":
        names = re.findall(r"(?:branch_computations=\{|true_computation=|false_computation=|, )"
                           r"%([\w.\-]+)", attrs)
        for callee in names:
          order.append((callee, n, True))
  return dict(runs), branchy


def _gemm_flops(ins: Instruction, by_name, by_comp) -> float:
  """2 · output elements · contracted elements of a cuBLAS call or of the dot in a GEMM fusion."""
  if ins.op == "custom-call":
    numbers = re.search(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]', ins.attributes)
    lhs = by_name.get(ins.operands[0]) if ins.operands else None
    if numbers is None or lhs is None:
      return 0.0
    contracted = [int(x.strip().strip('"')) for x in numbers.group(1).split(",") if x.strip()]
    out = _dims(ins.shape)
  else:
    inner = [x for x in _called(ins, by_comp) if _is_cublas(x)]
    if inner:
      return _gemm_flops(inner[0], by_name, by_comp)
    dots = [d for d in _called(ins, by_comp) if d.op == "dot"]
    if not dots:
      return 0.0
    dot = dots[0]
    numbers = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", dot.attributes)
    lhs = by_name.get(dot.operands[0])
    if numbers is None or lhs is None:
      return 0.0
    contracted = [int(x) for x in numbers.group(1).split(",") if x]
    out = _dims(dot.shape)
  lhs_dims = _dims(lhs.shape)
  return 2.0 * math.prod(out) * math.prod(lhs_dims[c] for c in contracted)


def _users(instructions) -> dict[str, list[Instruction]]:
  users = collections.defaultdict(list)
  for ins in instructions:
    for name in ins.operands:
      users[name].append(ins)
  return users


def _read_bytes(name: str, users, full: float, seen=None) -> float:
  """Bytes a fused computation reads of value `name`: all of it, unless every use reads part of
  it (a slice, a gather's rows) or is the buffer an in-place update writes into."""
  seen = seen or set()
  total = 0.0
  for user in users.get(name, ()):
    if user.name in seen:
      continue
    seen.add(user.name)
    position = user.operands.index(name)
    if user.op in _PARTIAL_READS and position == _PARTIAL_READS[user.op]:
      total += shape_bytes(user.shape)
    elif user.op in _IN_PLACE and position == _IN_PLACE[user.op][0]:
      continue
    elif user.op in _PASS_THROUGH:
      total += _read_bytes(user.name, users, full, seen)
    else:
      return full
  return min(total, full)


def _written_bytes(root: Instruction, by_name) -> float:
  """Bytes a fused computation writes: each root element, an in-place update counting its
  update only."""
  parts = [by_name[n] for n in root.operands] if root.op == "tuple" else [root]
  total = 0.0
  for part in parts:
    while part.op in ("bitcast", "reshape") and part.operands and part.operands[0] in by_name:
      part = by_name[part.operands[0]]
    if part.op in _IN_PLACE:
      update = by_name.get(part.operands[_IN_PLACE[part.op][1]])
      total += shape_bytes(update.shape) if update else shape_bytes(part.shape)
    else:
      total += shape_bytes(part.shape)
  return total


def _fusion_bytes(ins: Instruction, by_name, by_comp) -> float:
  callee = re.search(r"\bcalls=%?([\w.\-]+)", ins.attributes)
  body = by_comp.get(callee.group(1) if callee else "", [])
  if not body:
    return _plain_bytes(ins, by_name)
  users = _users(body)
  read = sum(_read_bytes(p.name, users, shape_bytes(p.shape)) for p in body if p.op == "parameter")
  root = next((x for x in body if x.root), body[-1])
  return read + _written_bytes(root, {x.name: x for x in body})


def _plain_bytes(ins: Instruction, by_name) -> float:
  read = sum(shape_bytes(by_name[n].shape) for n in ins.operands if n in by_name)
  return read + shape_bytes(ins.shape, skip_workspace=True)


def kernel_costs(hlo_text: str) -> tuple[dict[str, KernelCost], dict]:
  """{kernel name: KernelCost} for every kernel the module launches, and a note of what the
  counts rest on (kernels under conditionals, loops without a known trip count)."""
  by_comp, by_name, entry = parse(hlo_text)
  runs, branchy = computation_runs(by_comp, entry)
  home = {ins.name: comp for comp, body in by_comp.items() for ins in body}
  kinds = _gemm_kinds(by_name, by_comp)
  costs, under_conditional = {}, 0
  for name, _ in _record.kernel_lines(hlo_text):
    ins = by_name.get(name)
    comp = home.get(name)
    if ins is None or comp not in runs or 'custom_call_target="AllocateBuffer"' in ins.attributes:
      continue                     # an allocation for a loop's buffers: no code, no traffic
    flops = _gemm_flops(ins, by_name, by_comp) if name in kinds else 0.0
    moved = (_fusion_bytes(ins, by_name, by_comp) if ins.op == "fusion" and name not in kinds
             else _plain_bytes(ins, by_name))
    kind = ("gemm" if name in kinds else
            "kernel" if ins.op == "custom-call" or _wraps_custom_call(ins, by_comp) else "fusion")
    costs[name] = KernelCost(runs[comp], flops, moved, kind)
    under_conditional += comp in branchy
  unknown = sum(1 for body in by_comp.values() for ins in body
                if ins.op == "while" and "known_trip_count" not in ins.attributes)
  return costs, {"kernels_under_conditionals": under_conditional,
                 "loops_without_trip_count": unknown}


def _called(ins: Instruction, by_comp) -> list[Instruction]:
  callee = re.search(r"\bcalls=%?([\w.\-]+)", ins.attributes)
  return by_comp.get(callee.group(1), []) if callee else []


def _is_cublas(ins: Instruction) -> bool:
  return ins.op == "custom-call" and 'custom_call_target="__cublas' in ins.attributes


def _wraps_custom_call(ins: Instruction, by_comp) -> bool:
  """A fusion around a library or hand-written kernel (XLA's dynamic-slice fusions wrap cuBLAS,
  CUB and Mosaic GPU calls to address slices of their operands)."""
  return ins.op == "fusion" and any(x.op == "custom-call" for x in _called(ins, by_comp))


def _gemm_kinds(by_name, by_comp) -> set[str]:
  """Names of cuBLAS GEMM calls, XLA GEMM fusions (Triton or cuBLAS backed) and fusions that
  wrap a cuBLAS call."""
  out = set()
  for name, ins in by_name.items():
    if _is_cublas(ins):
      out.add(name)
    elif ins.op == "fusion" and (re.search(r'"kind"\s*:\s*"__\w*gemm\w*"', ins.attributes) or
                                 any(_is_cublas(x) for x in _called(ins, by_comp))):
      out.add(name)
  return out


def totals_by_part(costs: dict[str, KernelCost], part_of) -> dict:
  """Per part, per module run: GEMM TFLOP, GiB moved by XLA's fusions and by the other
  (hand-written) kernels, and kernel launches."""
  acc = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
  for name, c in costs.items():
    a = acc[part_of(name)]
    a[0] += c.runs * c.flops
    a[1] += c.runs * c.bytes if c.kind == "fusion" else 0.0
    a[2] += c.runs * c.bytes if c.kind == "kernel" else 0.0
    a[3] += c.runs
  order = sorted(acc, key=lambda p: -(acc[p][0] / 1e12 + (acc[p][1] + acc[p][2]) / 2**30))
  return {p: {"gemm_tflop": round(acc[p][0] / 1e12, 2), "fusion_gib": round(acc[p][1] / 2**30, 2),
              "kernel_gib": round(acc[p][2] / 2**30, 2), "launches": int(acc[p][3])}
          for p in order}


def rates_by_part(costs: dict[str, KernelCost], seconds: dict[str, float], part_of,
                  is_xla_fusion) -> dict:
  """Per part, from a profile's device seconds per op over the same number of module runs as
  `costs` counts: the GEMMs' TFLOP/s and the XLA fusions' TB/s (bytes from the HLO).
  is_xla_fusion(name) picks the ops whose bandwidth is reported (the profile's own kinds)."""
  acc = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
  for name, s in seconds.items():
    c = costs.get(name)
    if c is None:
      continue
    a = acc[part_of(name)]
    if c.kind == "gemm":
      a[0] += c.runs * c.flops
      a[1] += s
    elif c.kind != "kernel" and is_xla_fusion(name):
      a[2] += c.runs * c.bytes
      a[3] += s
  out = {}
  for p, (flops, gemm_s, moved, fusion_s) in sorted(acc.items()):
    row = {}
    if gemm_s:
      row["gemm_tflops"] = round(flops / gemm_s / 1e12, 1)
    if fusion_s:
      row["fusion_tbps"] = round(moved / fusion_s / 1e12, 2)
    if row:
      out[p] = row
  return out


def main(argv=None) -> int:
  """python -m benchmarks.hlo_costs HLO_TEXT[.gz] [OPS_JSON]: the work by part of a compiled
  module (parts as train_step.py assigns them) and, with the `--dump_dir` op list of a profile of
  that module (train_step.py `dump_ops`: ms per step and kind per op), the rates by part."""
  import gzip
  import sys
  from benchmarks import train_step
  args = sys.argv[1:] if argv is None else argv
  opener = gzip.open if args[0].endswith(".gz") else open
  with opener(args[0], "rt") as f:
    text = f.read()
  costs, note = kernel_costs(text)
  where = train_step.op_locations(text)
  part_of = lambda name: train_step.classify(where.get(name, ""))
  out = {"totals": totals_by_part(costs, part_of), **note}
  if len(args) > 1:
    with open(args[1]) as f:
      ops = json.load(f)
    kinds = {o["op"]: o["kind"] for o in ops}
    seconds = {o["op"]: o["ms_per_step"] * 1e-3 for o in ops}
    out["rates"] = rates_by_part(costs, seconds, part_of,
                                 lambda n: kinds.get(n) in ("fusion", "copy"))
  print(json.dumps(out))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
