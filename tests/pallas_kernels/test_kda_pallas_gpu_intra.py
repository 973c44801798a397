"""Invariants of the GPU intra-chunk kernels' building blocks (pallas_kernels/kda/pallas_gpu_intra.py).

The whole-op tests (test_kda_pallas.py) check the kernels against the token recurrence; these pin
the pieces they rest on: the level masks split the strictly-lower pairs of a chunk exactly once,
each with a middle row between r and s (so no decay factor exceeds 1), block doubling inverts a
unit lower-triangular matrix, and the bf16 hi/lo dot keeps about fp32 accuracy.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import pallas_gpu_intra as lv


@pytest.mark.parametrize("c", [16, 32, 64])
def test_level_masks_partition_the_strictly_lower_pairs(c):
  masks = np.stack([np.asarray(lv.level_mask(c, half)) for half in lv.levels(c)])
  assert lv.levels(c) == tuple(2 ** i for i in range(int(np.log2(c))))
  np.testing.assert_array_equal(masks.sum(0), np.tril(np.ones((c, c), int), -1))
  for half, mask in zip(lv.levels(c), masks):
    r, s = np.nonzero(mask)
    mid = (r // (2 * half)) * 2 * half + half
    assert np.all((s < mid) & (mid <= r)), half      # e^{Γ_r−Γ_m}, e^{Γ_m−Γ_s} both ≤ 1


@pytest.mark.parametrize("mm_dtype", [jnp.float32, jnp.bfloat16])
def test_block_doubling_inverts_unit_lower_triangular(mm_dtype):
  # N like Diag(β) A_kk: strictly lower, entries of order one (unit-norm keys, β ∈ (0, 1)).
  rng = np.random.default_rng(0)
  c = 64
  n = np.tril(rng.uniform(-1, 1, (c, c)), -1) * rng.uniform(0, 1, (c, 1)) * 0.3
  want = np.linalg.inv(np.eye(c) + n)
  got = np.asarray(lv.wy_inverse(jnp.asarray(n, jnp.float32), mm_dtype), np.float64)
  # fp32 IEEE dots and the bf16 hi/lo split both stay near fp32 rounding of the result.
  assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))
  assert np.all(got[np.triu_indices(c, 1)] == 0.0)


def test_precise_bf16_dot_is_near_fp32():
  rng = np.random.default_rng(1)
  a = rng.standard_normal((64, 64))
  b = rng.standard_normal((64, 32))
  want = a @ b
  got = np.asarray(lv.mm_precise(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32),
                                 jnp.bfloat16), np.float64)
  plain = np.asarray(lv.mm(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32),
                           jnp.bfloat16), np.float64)
  err, err_plain = np.max(np.abs(got - want)), np.max(np.abs(plain - want))
  # ~2^-16 relative per product (the dropped lo·lo term), against ~2^-8 for plain bf16 dots.
  assert err <= 2e-5 * np.max(np.abs(want)) and err <= err_plain / 50


def test_precise_dot_with_an_exact_bf16_lhs():
  # The in-chunk reverse cumsum dg = tri_up @ dΓ: a 0/1 lhs needs only the rhs split (two dots).
  rng = np.random.default_rng(2)
  c = 64
  tri_up = np.triu(np.ones((c, c)))
  b = rng.standard_normal((c, 32)) * 100
  want = tri_up @ b
  got = np.asarray(lv.mm_precise(jnp.asarray(tri_up, jnp.float32), jnp.asarray(b, jnp.float32),
                                 jnp.bfloat16, a_exact=True), np.float64)
  assert np.max(np.abs(got - want)) <= 2e-5 * np.max(np.abs(want))
