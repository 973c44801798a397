"""Launch settings of the Pallas backends: each backend module holds a frozen dataclass SETTINGS
(validated on construction) that its launchers read at trace time; `swapped` replaces it for a
block of code (benchmarks, tests)."""

from __future__ import annotations

import contextlib
import dataclasses

import jax


@contextlib.contextmanager
def swapped(module, overrides: dict):
  """Inside the block, `module.SETTINGS` with `overrides` applied (a None value leaves its field
  unchanged); bad values raise before anything changes.

  Jitted callers cache their traces without the settings in the key, so JAX's caches are cleared
  on entry and on exit: compile and run what should use the settings inside the block.
  """
  saved = module.SETTINGS
  new = dataclasses.replace(saved, **{k: v for k, v in overrides.items() if v is not None})
  jax.clear_caches()
  try:
    module.SETTINGS = new
    yield new
  finally:
    module.SETTINGS = saved
    jax.clear_caches()


def is_pow2(n: int) -> bool:
  """Whether n is a positive power of two (Triton block sizes must be)."""
  return n >= 1 and n & (n - 1) == 0


WARPS = (1, 2, 4, 8, 16)          # the num_warps a Triton kernel takes


def require_pow2(owner: str, name: str, value, minimum: int = 1) -> None:
  """Refuses a launch setting that is not a power of two >= minimum, naming `owner` and it."""
  if not (is_pow2(value) and value >= minimum):
    at_least = f" >= {minimum}" if minimum > 1 else ""
    raise ValueError(f"{owner}: {name} must be a power of two{at_least}, got {value!r}")


def require_warps(owner: str, name: str, value) -> None:
  """Refuses a num_warps setting outside WARPS, naming `owner` and it."""
  if value not in WARPS:
    raise ValueError(f"{owner}: {name} must be 1, 2, 4, 8 or 16, got {value!r}")


def largest_pow2_divisor(n: int, cap: int) -> int:
  """The largest power of two <= cap (itself a power of two) dividing n."""
  p = cap
  while p > 1 and n % p:
    p //= 2
  return p


# The smallest blocks the 2D elementwise Triton kernels (short_conv, situ_glu) are launched with.
MIN_BLOCK_ROWS, MIN_BLOCK_COLS = 8, 16


def block_2d(num_rows: int, num_cols: int, row_cap: int, col_cap: int) -> tuple[int, int] | None:
  """(rows, cols) of one program over an [num_rows, num_cols] array: the largest powers of two
  up to the caps that divide each, or None when either is below MIN_BLOCK_ROWS / MIN_BLOCK_COLS
  (Triton blocks are powers of two)."""
  rows = largest_pow2_divisor(num_rows, row_cap)
  cols = largest_pow2_divisor(num_cols, col_cap)
  if rows < MIN_BLOCK_ROWS or cols < MIN_BLOCK_COLS:
    return None
  return rows, cols
