"""Compiling for a GPU this machine does not have: XLA's GPU compiler run against a described
device (a "target config"), with compile-only devices in place of real ones.

    env = gpu_target.environment()        # before jax is imported: CPU runtime, CUDA compiler
    devices = gpu_target.devices("h200")   # jax devices to place and compile for, never to run on

What this gives on a CPU-only machine: the compiled GPU program itself (its fusions, kernels and
custom calls), XLA's memory analysis of it, and the time XLA takes to compile it on this host.
What it leaves out: autotuning (nothing can be timed, so GEMM and Triton fusions take XLA's
default configurations, and sorts take the fallback algorithm), so the program can differ from the
one a GPU machine compiles in those choices, and its compile time lacks the autotuning share.

It needs jax's CUDA plugin with its CUDA libraries (the compiler, ptxas and libdevice come from
them) at jax's own version; no GPU or driver. The targets are text GpuTargetConfigProto files in
benchmarks/gpu_targets/.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re

TARGET_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_targets")
TARGETS = ("h200",)
PLUGIN_MODULE = "jax_plugins.xla_cuda12"


@dataclasses.dataclass(frozen=True)
class Target:
  name: str
  description: str        # the device's name, as its driver reports it
  sm_count: int           # multiprocessors: what the persistent kernels size their grids by
  config_text: str        # the GpuTargetConfigProto, text format


def load(name: str) -> Target:
  """The target `name` (one of TARGETS) read from its file; ValueError for an unknown name or a
  file without the fields the kernels need."""
  if name not in TARGETS:
    raise ValueError(f"unknown GPU target {name!r}; known: {', '.join(TARGETS)}")
  path = os.path.join(TARGET_DIR, f"{name}.txtpb")
  with open(path) as f:
    text = f.read()
  cores = re.search(r"^\s*core_count:\s*(\d+)", text, re.M)
  described = re.search(r'^device_description_str:\s*"([^"]+)"', text, re.M)
  if not cores or not described:
    raise ValueError(f"{path}: needs gpu_device_info.core_count and device_description_str")
  return Target(name, described.group(1), int(cores.group(1)), text)


def environment() -> dict[str, str]:
  """The variables to set before jax is imported: the CPU is the runtime backend (nothing runs on
  the target), and the CUDA plugin loads without a GPU or driver to check its versions against."""
  return {"JAX_PLATFORMS": "cpu", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}


def missing_plugin() -> str | None:
  """None when jax's CUDA plugin can be imported, else what to install (at jax's version)."""
  try:
    found = importlib.util.find_spec(PLUGIN_MODULE) is not None
  except (ImportError, ValueError):
    found = False
  if found:
    return None
  from importlib import metadata
  try:
    version = metadata.version("jax")
  except metadata.PackageNotFoundError:
    version = "<jax's version>"
  return (f"compiling for a GPU target needs jax's CUDA plugin and its CUDA libraries at jax's "
          f"version: pip install \"jax-cuda12-plugin[with-cuda]=={version}\"")


def devices(target: Target, count: int = 1) -> list:
  """Compile-only jax devices of `count` `target` GPUs on one host (arrays cannot live on them;
  jit lowers and compiles for them, collectives included). Call with `environment()` in effect
  before jax was imported."""
  if count < 1:
    raise ValueError(f"a GPU target needs at least one device, got {count}")
  from jax.experimental import topologies
  topology = topologies.get_topology_desc(platform="cuda", topology=f"1x1x{count}",
                                          target_config=target.config_text)
  return list(topology.devices)
