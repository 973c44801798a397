"""The platform the kernels are traced for.

Every "auto" backend choice, every interpret flag and every launch grid that depends on the
machine reads it from here. By default it is JAX's default backend. Inside `targeting(...)` it is
the platform named there, so that a machine without that accelerator traces and lowers a program
exactly as the accelerator would build it: on a CPU-only machine, the GPU step with its Mosaic GPU
and Triton kernels lowered for real (not in interpret mode), to inspect or test the program that
a GPU would compile. Such a program lowers (`jit(f).trace(...).lower(lowering_platforms=...)`)
but cannot compile or run where it was traced.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax

PLATFORMS = ("cpu", "gpu", "tpu")
# Streaming multiprocessors of an H100 / H200 SXM: the GPU launch grids' default off-GPU.
HOPPER_SM_COUNT = 132


@dataclasses.dataclass(frozen=True)
class Target:
  platform: str
  sm_count: int | None = None     # the GPU's multiprocessors (persistent kernels' grid size)


_TARGET: contextvars.ContextVar[Target | None] = contextvars.ContextVar("k3train_kernel_target",
                                                                        default=None)


def current() -> str:
  """The platform kernels are traced for: `targeting`'s, else JAX's default backend."""
  target = _TARGET.get()
  return target.platform if target is not None else jax.default_backend()


def is_targeted() -> bool:
  """Whether a `targeting` block names the platform (the program is lowered, not run, here)."""
  return _TARGET.get() is not None


def interpret(platform: str) -> bool:
  """Whether kernels written for `platform` ("gpu" or "tpu") run in Pallas' interpret mode: when
  the program is traced for any other platform."""
  return current() != platform


def gpu_sm_count() -> int | None:
  """The GPU's multiprocessor count for launch grids: `targeting`'s, else the first device's
  (None where the device does not say)."""
  target = _TARGET.get()
  if target is not None:
    return target.sm_count
  return getattr(jax.devices()[0], "core_count", None)


@contextlib.contextmanager
def targeting(platform: str, *, sm_count: int | None = HOPPER_SM_COUNT):
  """Trace for `platform` inside the block (see the module docstring).

  JAX's trace caches do not key on the target, so they are cleared on entry and on exit: trace
  and lower inside the block what should be built for the target.
  """
  if platform not in PLATFORMS:
    raise ValueError(f"unknown kernel target platform {platform!r}; use one of "
                     f"{', '.join(PLATFORMS)}")
  if sm_count is not None and sm_count < 1:
    raise ValueError(f"sm_count must be a positive number of multiprocessors, got {sm_count}")
  token = _TARGET.set(Target(platform, sm_count if platform == "gpu" else None))
  jax.clear_caches()
  try:
    yield
  finally:
    _TARGET.reset(token)
    jax.clear_caches()
