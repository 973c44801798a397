"""An op's Pallas-Triton kernels compiled to machine code on a machine without a GPU: registers,
spills, shared memory, programs per SM, ptxas's performance notes, SASS instruction classes and
the instructions of each kernel's main loop.

    pip install "jax-cuda12-plugin[with-cuda]==$(python -c 'import jax; print(jax.__version__)')"
    pip install nvidia-cuda-nvdisasm              # the SASS disassembler (no GPU needed)
    python benchmarks/triton_sass.py --op=attention [--shape=4x4096x16x1] [--keep_dir=D] \
        [--settings=dkv_block_k=64,dkv_block_q=32,dkv_warps=8,dkv_keys_as_rows=true]
    python benchmarks/triton_sass.py --op=kda [--shape=4x4096x16] [--dtype=fp32] \
        [--settings=intra_warps=8]

How: the op's forward and backward are traced and lowered for the GPU
(`pallas_kernels.platform.targeting("gpu")`: real kernels, not interpret mode); each Triton
custom call's IR goes through jaxlib's Triton compiler (the CUDA handler jax's CUDA plugin
registers) to PTX for `--arch`, the plugin's ptxas makes the cubin and nvdisasm lists its SASS.
A kernel's main loop is the span of its longest backward branch; a forward branch inside the loop
that jumps over a block (the attention kernels' mask on the tiles that need it) is reported as
that block's size, so `loop` is an iteration that runs the block and `loop − skippable` one that
skips it.

These are static counts, not times: they show what a change does to the instructions of each
iteration and to the registers a kernel needs (a kernel that spills, or whose wgmma pipeline
ptxas serializes for lack of registers, can lose more than the instructions it saves). Time on a
GPU with benchmarks/attention.py or benchmarks/kda_kernel.py.
"""

from __future__ import annotations

import argparse
import collections
import glob
import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import gpu_target  # noqa: E402

TRITON_TARGET = "xla.gpu.triton"
# SASS instruction classes counted per kernel: tensor-core MMAs (wgmma HGMMA, mma.sync HMMA),
# barriers, shared stores / loads, MUFU (ex2 and the other special functions), local loads /
# stores (= spills), global loads / stores.
SASS_CLASSES = dict(mma=r"\bH?GMMA\.|\bHMMA\.", bar=r"\bBAR\.", sts=r"\bSTS\b", lds=r"\bLDS\b",
                    mufu=r"\bMUFU\.", ldl=r"\bLDL\b", stl=r"\bSTL\b", ldg=r"\bLDG\b",
                    stg=r"\bSTG\b")
_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", re.M)
_LABEL = re.compile(r"^(\.L_x_\d+):", re.M)


def cuda_tool(name: str) -> str:
  """Path of a CUDA command-line tool: on PATH, else in an installed nvidia-* wheel's bin/."""
  found = shutil.which(name)
  if found:
    return found
  spec = importlib.util.find_spec("nvidia")
  for root in (spec.submodule_search_locations if spec else []):
    hits = sorted(glob.glob(os.path.join(root, "**", "bin", name), recursive=True))
    if hits:
      return hits[-1]
  raise SystemExit(f"{name} not found: install it (pip install nvidia-cuda-nvdisasm for nvdisasm; "
                   "jax-cuda12-plugin[with-cuda] brings ptxas) or put it on PATH")


def attention_program(shape: str, dtype: str = "bf16"):
  """(function, argument shapes): the MLA attention's forward and backward (Dk 192, Dv 128,
  causal) at B x T x H x documents. `--settings` are pallas_gpu.Config fields."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from pallas_kernels.attention import attention
  b, t, h, docs = (int(x) for x in shape.split("x"))
  seg = jnp.asarray(np.repeat(np.arange(docs), -(-t // docs))[:t][None].repeat(b, 0), jnp.int32)

  def fwd_bwd(q, k, v, do):
    (out, ml), vjp = jax.vjp(
        lambda q, k, v: attention(q, k, v, seg, scale=192 ** -0.5, backend="pallas_gpu"), q, k, v)
    return (out, ml) + vjp((do, jnp.zeros_like(ml)))

  x = {"bf16": jnp.bfloat16, "fp32": jnp.float32}[dtype]
  return fwd_bwd, [((b, t, h, 192), x), ((b, t, h, 192), x), ((b, t, h, 128), x),
                   ((b, t, h, 128), x)]


def kda_program(shape: str, dtype: str = "bf16"):
  """(function, argument shapes): KDA's forward and backward (q, k, v, beta in `dtype`, g fp32,
  K = V = 128, one sequence per row) at B x T x H, the loss Σ o as in benchmarks/kda_kernel.py."""
  import jax
  import jax.numpy as jnp
  from pallas_kernels.kda.op import kda
  b, t, h = (int(x) for x in shape.split("x"))

  def fwd_bwd(q, k, v, g, beta):
    def loss(q, k, v, g, beta):
      return jnp.sum(kda(q, k, v, g, beta, backend="pallas_gpu")[0].astype(jnp.float32))
    return jax.value_and_grad(loss, argnums=range(5))(q, k, v, g, beta)

  x, f32 = {"bf16": jnp.bfloat16, "fp32": jnp.float32}[dtype], jnp.float32
  return fwd_bwd, [((b, t, h, 128), x), ((b, t, h, 128), x), ((b, t, h, 128), x),
                   ((b, t, h, 128), f32), ((b, t, h), x)]


# op: (program builder, default shape, the module whose `configured(**settings)` applies them)
OPS = {"attention": (attention_program, "4x4096x16x1", "pallas_kernels.attention.pallas_gpu"),
       "kda": (kda_program, "4x4096x16", "pallas_kernels.kda.pallas_gpu")}


def parse_settings(text: str) -> dict:
  """"a=1,b=true" → {"a": 1, "b": True} (ints, true / false, else the string)."""
  out = {}
  for item in filter(None, text.split(",")):
    name, _, value = item.partition("=")
    low = value.strip().lower()
    out[name.strip()] = (int(low) if low.lstrip("-").isdigit() else
                         {"true": True, "false": False}.get(low, value.strip()))
  return out


def triton_calls(module_text_op):
  """[(name, ir bytes, num_warps, num_stages)] of the Triton custom calls in a lowered module."""
  from jax._src.lib.mlir import ir
  calls = []

  def walk(op):
    for region in op.regions:
      for block in region.blocks:
        for child in block.operations:
          child = child.operation
          if (child.name == "stablehlo.custom_call"
              and TRITON_TARGET in str(child.attributes["call_target_name"])):
            cfg = {a.name: a.attr for a in child.attributes["mhlo.backend_config"]}
            calls.append((ir.StringAttr(cfg["name"]).value,
                          ir.StringAttr(cfg["ir"]).value_bytes,
                          ir.IntegerAttr(cfg["num_warps"]).value,
                          ir.IntegerAttr(cfg["num_stages"]).value))
          walk(child)

  walk(module_text_op)
  return calls


def programs_per_sm(registers: int, smem_bytes: int, warps: int) -> int:
  """Programs (CTAs) one sm_90 SM holds at once: the least of 32 CTAs, 64 warps, 64 K registers
  (allocated per warp in units of 256) and 228 KB of shared memory (1 KB reserved per CTA).
  The resident warps are what hides a latency-bound kernel's loads."""
  regs_per_warp = -(-registers * 32 // 256) * 256
  return min(32, 64 // warps, 65536 // (regs_per_warp * warps), 233472 // (smem_bytes + 1024))


def class_counts(instructions) -> dict:
  return {name: sum(bool(re.search(p, i)) for i in instructions)
          for name, p in SASS_CLASSES.items()}


def main_loop(sass: str) -> dict:
  """Instructions of the longest backward-branch span (and their classes), and the largest block
  a forward branch inside it jumps over."""
  lines = sass.splitlines()
  labels = {m.group(1): i for i, line in enumerate(lines) for m in [_LABEL.match(line)] if m}
  counts = [0]
  for line in lines:
    counts.append(counts[-1] + bool(_INSTRUCTION.match(line)))

  def between(a, b):                 # instructions on lines a..b inclusive
    return counts[b + 1] - counts[a]

  best, skip = None, 0
  branches = [(i, re.search(r"`\((\.L_x_\d+)\)", line)) for i, line in enumerate(lines)
              if re.search(r"\bBRA\b", line)]
  for i, m in branches:
    if m and m.group(1) in labels and labels[m.group(1)] < i:
      span = (labels[m.group(1)], i)
      if between(*span) > 1 and (best is None or between(*span) > between(*best)):
        best = span                  # (a branch to itself is the end-of-kernel trap, no loop)
  if best is None:
    return {"loop": 0, "skippable": 0, "loop_classes": class_counts([])}
  for i, m in branches:
    if m and m.group(1) in labels and best[0] < i < labels[m.group(1)] <= best[1]:
      skip = max(skip, between(i + 1, labels[m.group(1)] - 1))
  body = [m.group(1) for line in lines[best[0]:best[1] + 1] for m in [_INSTRUCTION.match(line)]
          if m]
  return {"loop": between(*best), "skippable": skip, "loop_classes": class_counts(body)}


def analyse(name, ir_bytes, warps, stages, arch, work_dir, ptxas, nvdisasm):
  from jax._src.lib import triton
  result = triton.compile("CUDA", ir_bytes, arch, num_warps=warps, num_ctas=1, num_stages=stages)
  base = os.path.join(work_dir, name)
  with open(base + ".ptx", "w") as f:
    f.write(result.asm)
  sm = "sm_" + arch.replace(".", "")
  notes = subprocess.run([ptxas, f"-arch={sm}", "-v", base + ".ptx", "-o", base + ".cubin"],
                         capture_output=True, text=True, check=True).stderr
  sass = subprocess.run([nvdisasm, "-c", base + ".cubin"], capture_output=True, text=True,
                        check=True).stdout
  with open(base + ".sass", "w") as f:
    f.write(sass)
  regs = re.search(r"Used (\d+) registers", notes)
  spills = re.findall(r"(\d+) bytes spill (?:stores|loads)", notes)
  perf = sorted({m.group(1) for m in re.finditer(r"Potential Performance Loss: (.*?) in the "
                                                  r"function", notes)})
  registers = int(regs.group(1)) if regs else None
  instructions = _INSTRUCTION.findall(sass)
  return dict(kernel=name, warps=warps, stages=stages, smem_bytes=result.smem_bytes,
              registers=registers, spill_bytes=max((int(s) for s in spills), default=0),
              programs_per_sm=(programs_per_sm(registers, result.smem_bytes, warps)
                               if registers else None),
              instructions=len(instructions), classes=class_counts(instructions),
              **main_loop(sass),
              tensor_core_instructions=dict(sorted(collections.Counter(
                  re.findall(r"\b(H?GMMA\.\S+|HMMA\.\S+)", sass)).items())),
              ptxas_performance_notes=perf)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--op", default="attention", choices=sorted(OPS))
  ap.add_argument("--shape", default=None,
                  help="the op's shape (attention: B x T x H x documents; kda: B x T x H)")
  ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"),
                  help="the op's input dtype (the kernels' dot operands)")
  ap.add_argument("--arch", default="9.0a", help="compute capability (9.0a: H100 / H200)")
  ap.add_argument("--keep_dir", default=None, help="keep each kernel's PTX, cubin and SASS here")
  ap.add_argument("--settings", default="", help="kernel settings, name=value,... (the op's "
                  "Config fields)")
  a = ap.parse_args()
  os.environ.update(gpu_target.environment())
  missing = gpu_target.missing_plugin()
  if missing:
    raise SystemExit(missing)
  ptxas, nvdisasm = cuda_tool("ptxas"), cuda_tool("nvdisasm")
  import jax
  from jax.sharding import SingleDeviceSharding
  from pallas_kernels import platform
  device = gpu_target.devices(gpu_target.load("h200"))[0]   # registers the CUDA Triton handler
  build, default_shape, settings_module = OPS[a.op]
  settings = parse_settings(a.settings)
  fn, shapes = build(a.shape or default_shape, a.dtype)
  args = [jax.ShapeDtypeStruct(s, d, sharding=SingleDeviceSharding(device)) for s, d in shapes]
  configured = importlib.import_module(settings_module).configured
  with platform.targeting("gpu"), configured(**settings):
    module = jax.jit(fn).trace(*args).lower().compiler_ir()
  work_dir = a.keep_dir or tempfile.mkdtemp()
  os.makedirs(work_dir, exist_ok=True)
  rows = [analyse(*call, a.arch, work_dir, ptxas, nvdisasm)
          for call in triton_calls(module.operation)]
  for row in rows:
    print(json.dumps(dict(op=a.op, shape=a.shape or default_shape, dtype=a.dtype, arch=a.arch,
                          settings=settings, **row)))
  print("\n| kernel | warps, stages | registers | spill B | smem KiB | programs per SM "
        "| instructions | loop | loop without the skippable block | tensor-core instructions |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    mma = ", ".join(f"{n} {k}" for k, n in r["tensor_core_instructions"].items())
    print(f"| {r['kernel']} | {r['warps']}, {r['stages']} | {r['registers']} | "
          f"{r['spill_bytes']} | {r['smem_bytes'] / 1024:.0f} | {r['programs_per_sm']} | "
          f"{r['instructions']} | "
          f"{r['loop']} | {r['loop'] - r['skippable']} | {mma} |")
  if not a.keep_dir:
    shutil.rmtree(work_dir, ignore_errors=True)


if __name__ == "__main__":
  main()
