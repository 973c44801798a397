"""pallas_kernels/launch.py: the block-size helpers the Triton launchers share, and settings swapped
for a block."""

from __future__ import annotations

import pytest

from pallas_kernels import launch
from pallas_kernels.short_conv import pallas_gpu


def test_powers_of_two_and_largest_divisor():
  assert [n for n in range(-2, 70) if launch.is_pow2(n)] == [1, 2, 4, 8, 16, 32, 64]
  # by brute force: the largest power of two <= cap dividing n
  for n in range(1, 300):
    for cap in (1, 8, 64):
      want = max(p for p in (1, 2, 4, 8, 16, 32, 64) if p <= cap and n % p == 0)
      assert launch.largest_pow2_divisor(n, cap) == want, (n, cap)


def test_block_2d_takes_the_largest_dividing_powers_of_two_or_none():
  assert launch.block_2d(131072, 768, 64, 256) == (64, 256)
  assert launch.block_2d(96, 48, 64, 256) == (32, 16)
  assert launch.block_2d(100, 48, 64, 256) is None          # 100 rows: largest divisor 4 < 8
  assert launch.block_2d(64, 24, 64, 256) is None           # 24 columns: largest divisor 8 < 16


def test_swapped_restores_settings_and_rejects_bad_values_first():
  before = pallas_gpu.SETTINGS
  with pallas_gpu.configured(rows=16, forward="kernel") as inside:
    assert pallas_gpu.SETTINGS is inside
    assert (inside.rows, inside.cols, inside.forward) == (16, before.cols, "kernel")
  assert pallas_gpu.SETTINGS is before
  with pytest.raises(ValueError, match="rows must be"):
    with pallas_gpu.configured(rows=24):
      pass
  assert pallas_gpu.SETTINGS is before


def test_settings_checks_name_the_owner_the_setting_and_the_bound():
  launch.require_pow2("k", "rows", 16)
  launch.require_warps("k", "num_warps", 8)
  with pytest.raises(ValueError, match=r"^k: rows must be a power of two, got 12$"):
    launch.require_pow2("k", "rows", 12)
  with pytest.raises(ValueError, match=r"^k: cols must be a power of two >= 16, got 8$"):
    launch.require_pow2("k", "cols", 8, 16)
  with pytest.raises(ValueError, match=r"^k: wide_warps must be 1, 2, 4, 8 or 16, got 3$"):
    launch.require_warps("k", "wide_warps", 3)
