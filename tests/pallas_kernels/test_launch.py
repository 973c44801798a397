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
