"""benchmarks/qb_bisection.py: kernel-setting rows parsed and checked before any timing, chained
calls timed per call with the bits of every setting equal."""

from __future__ import annotations

import numpy as np
import pytest

from tests.benchmarks.scripts import load


def test_kernel_settings_are_parsed_and_bad_ones_named():
  bench = load("qb_bisection")
  assert bench.kernel_settings("c1w16:column_digit_bits=1,column_warps=16") == (
      "c1w16", {"column_digit_bits": 1, "column_warps": 16})
  assert bench.kernel_settings("default") == ("default", {})
  with pytest.raises(TypeError, match="foo"):
    bench.kernel_settings("x:foo=2")
  with pytest.raises(ValueError, match="column_digit_bits must be one of"):
    bench.kernel_settings("x:column_digit_bits=3")
  assert bench.main(["prog", "--kernel_settings=x:digit_bits=3"]) == 2
  assert bench.main(["prog", "--calls_per_timing=0"]) == 2


def test_chained_calls_give_one_time_per_call_and_the_same_bits():
  bench = load("qb_bisection")
  one = bench.measure(256, 16, 2, (4, True), iters=2, calls=1)
  rows = [bench.measure(256, 16, 2, setting, iters=2, calls=3) for setting in ((4, True), (1, 1))]
  assert [r["calls_per_timing"] for r in rows] == [3, 3] and one["calls_per_timing"] == 1
  assert np.array_equal(rows[0]["bias"].view(np.uint32), rows[1]["bias"].view(np.uint32))
  # Three rounds move the bias further than one: the loop really chains the calls.
  assert not np.array_equal(rows[0]["bias"], one["bias"])
  assert all(r["median_us"] > 0 for r in rows + [one])
