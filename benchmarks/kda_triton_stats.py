"""Static sm_90 statistics of the pallas_gpu KDA kernels, compiled on a machine without a GPU.

  pip install --target /tmp/tri triton==3.6.0          # once; not a k3train dependency
  JAX_PLATFORMS=cpu python benchmarks/kda_triton_stats.py [--dtype=bf16|fp32] \
      [--set=strip_warps=4 --set=intra_warps=8 ...] [--triton=/tmp/tri] [--config=FILE]

Lowers the KDA forward + backward (B1 T256 H2, K = V = 128, chunk 64; with --config K = V =
model.kda.head_dim and the chunk model.kda.chunk_size) for CUDA on the CPU, keeps
the Triton IR of every pallas_call, compiles each with the `triton` package for sm_90 at the
kernel's num_warps and num_stages (as its launcher set them), and prints per kernel: registers,
spill bytes (ptxas -v), shared memory, how many of its programs one SM holds at once, and SASS
counts (all instructions, tensor-core MMAs, barriers, shared loads/stores, MUFU (exp), local
loads/stores = spills, global loads/stores).
Static counts, not timings: they show spills, occupancy and layout round-trips through shared
memory before a GPU run decides (benchmarks/kda_profile.py).
`--set` takes pallas_gpu.configured keywords (ints and bools parsed).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jax._src.pallas.triton import pallas_call_registration as registration  # noqa: E402

from benchmarks import _flags  # noqa: E402
from pallas_kernels.kda import pallas_gpu  # noqa: E402
from pallas_kernels.kda.vjp import kda_pallas  # noqa: E402

PROG = "python benchmarks/kda_triton_stats.py"

FLAGS = (
    _flags.Flag("dtype", "enum", "bf16", "q, k, v dtype", choices=("bf16", "fp32")),
    _flags.Flag("set", "multi", [], "pallas_gpu.configured key=value (repeat the flag)"),
    _flags.Flag("triton", "str", "/tmp/tri", "where `pip install --target` put triton"),
)

SASS_COUNTS = dict(sass=r"/\*[0-9a-f]{4,}\*/", mma=r"HMMA|HGMMA", bar=r"BAR", sts=r"STS",
                   lds=r"LDS", mufu=r"MUFU", ldl=r"LDL", stl=r"STL", ldg=r"LDG", stg=r"STG")


def _launch_params(frame) -> tuple[int, int]:
  """(num_warps, num_stages) the launcher passed, read from jax's Triton lowering rule that is
  calling the IR lowering (its locals), so this tool never keeps its own copy of the choices."""
  try:
    return frame.f_locals["num_warps"], frame.f_locals["num_stages"]
  except KeyError as e:
    raise RuntimeError(f"this jax's Triton lowering rule has no local {e}; kda_triton_stats.py "
                       "was written against jax 0.10.2") from None


def dump_ttir(dtype, out_dir: str, d: int = 128, chunk: int = 64) -> list[tuple[str, int, int]]:
  """Lower fwd + bwd (K = V = d) for CUDA and write each kernel's Triton IR; returns (path,
  num_warps, num_stages) per kernel."""
  lower = registration.lowering.lower_jaxpr_to_triton_module
  found = []

  def keep(jaxpr, *args, **kwargs):
    result = lower(jaxpr, *args, **kwargs)
    name = jaxpr.debug_info.func_name if jaxpr.debug_info else "kernel"
    path = os.path.join(out_dir, f"{len(found):02d}_{name}.ttir")
    with open(path, "w") as f:
      f.write(result.module.operation.get_asm(enable_debug_info=False))
    found.append((path, *_launch_params(sys._getframe(1))))
    return result

  b, t, h = 1, 256, 2
  x = jnp.ones((b, t, h, d), dtype)
  g = jnp.zeros((b, t, h, d), jnp.float32)
  beta = jnp.ones((b, t, h), jnp.float32)
  s0 = jnp.zeros((b, h, d, d), jnp.float32)
  cnt = jnp.zeros((b, t), jnp.float32)

  def loss(q, k, v, g, beta):
    return jnp.sum(kda_pallas(q, k, v, g, beta, s0, cnt, d ** -0.5, chunk, "gpu", False)[0])

  registration.lowering.lower_jaxpr_to_triton_module = keep
  try:
    jax.jit(jax.grad(loss, argnums=range(5))).trace(x, x, x, g, beta).lower(
        lowering_platforms=("cuda",))
  finally:
    registration.lowering.lower_jaxpr_to_triton_module = lower
  return found


def compile_stats(path: str, warps: int, stages: int, bin_dir: str) -> str:
  from triton.backends.compiler import GPUTarget
  from triton.compiler.compiler import compile as triton_compile
  kernel = triton_compile(path, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=stages))
  with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
    f.write(kernel.asm["cubin"])
  sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", f.name],
                        capture_output=True, text=True, check=True).stdout
  os.unlink(f.name)
  ptxas = subprocess.run([os.path.join(bin_dir, "ptxas"), "-v", "--gpu-name=sm_90a", "-o",
                          os.devnull, "-"], input=kernel.asm["ptx"], capture_output=True,
                         text=True).stderr
  regs = re.search(r"Used (\d+) registers", ptxas)
  spill = re.search(r"(\d+) bytes spill stores", ptxas)
  counts = " ".join(f"{k} {len(re.findall(p, sass))}" for k, p in SASS_COUNTS.items())
  resident = (programs_per_sm(int(regs.group(1)), kernel.metadata.shared, warps) if regs
              else None)
  return (f"{os.path.basename(path):28s} warps {warps} stages {stages} "
          f"regs {regs and regs.group(1)} spill {spill and spill.group(1)} B "
          f"smem {kernel.metadata.shared} B  per SM {resident}  {counts}"
          + "".join(f"\n    loop @{start:#x}: {body}" for start, body in loops(sass)))


def programs_per_sm(regs: int, smem: int, warps: int) -> int:
  """Programs (CTAs) one sm_90 SM holds at once: the least of 32 CTAs, 64 warps, 64 K registers
  (allocated per warp in units of 256) and 228 KB of shared memory (1 KB reserved per CTA).
  For these latency-bound kernels the resident warps are what hides each load's round trip."""
  regs_per_warp = -(-regs * 32 // 256) * 256
  by_smem = 233472 // (smem + 1024)
  return min(32, 64 // warps, 65536 // (regs_per_warp * warps), by_smem)


def loops(sass: str) -> list[tuple[int, str]]:
  """Loop bodies of a SASS listing (a backward branch to an earlier address), with their
  instruction counts: `trips × body` is the dynamic count a static total hides."""
  lines = re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)
  addr = [int(a, 16) for a, _ in lines]
  found = []
  for i, (a, text) in enumerate(lines):
    m = re.search(r"BRA\S*\s+(?:`\(\.L_x_\d+\)\s*)?(0x[0-9a-f]+)", text)
    if not m:
      continue
    target = int(m.group(1), 16)
    if target < addr[i]:
      body = [t for b, (_, t) in zip(addr, lines) if target <= b <= addr[i]]
      stats = " ".join(f"{k} {sum(bool(re.search(p, t)) for t in body)}"
                       for k, p in SASS_COUNTS.items() if k != "sass")
      found.append((target, f"{len(body)} instructions ({stats})"))
  return found


def _parse_set(items):
  kw = {}
  for item in items:
    key, _, value = item.partition("=")
    if value in ("True", "False"):
      kw[key] = value == "True"
    else:
      kw[key] = int(value) if value.isdigit() else value
  return kw


def main(argv=None) -> int:
  args = _flags.parse(argv, PROG, FLAGS)
  if args.exit_code is not None:
    return args.exit_code
  a = args.flags
  d, chunk, shape = 128, 64, ""
  if args.config is not None:
    d, chunk = args.config.model.kda.head_dim, args.config.model.kda.chunk_size
    shape = f" K=V={d} chunk {chunk}"
  sys.path.insert(0, a.triton)
  bin_dir = os.path.join(a.triton, "triton", "backends", "nvidia", "bin")
  dtype = jnp.bfloat16 if a.dtype == "bf16" else jnp.float32
  with tempfile.TemporaryDirectory() as out_dir, pallas_gpu.configured(**_parse_set(a.set)):
    kernels = dump_ttir(dtype, out_dir, d, chunk)
    print(f"{a.dtype}{shape} {' '.join(a.set) or 'defaults'}")
    for path, warps, stages in kernels:
      try:
        print(compile_stats(path, warps, stages, bin_dir), flush=True)
      except Exception as e:  # report and go on with the other kernels
        print(f"{os.path.basename(path)} FAILED: {str(e)[-400:]}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
