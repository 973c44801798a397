"""pallas_tpu gmm backend (Mosaic TPU kernels) on CPU, in Pallas' TPU interpret mode.

The interpreter (pltpu.InterpretParams) simulates TPU semantics: scalar prefetch into SMEM, VMEM
blocks that stay resident while their block index repeats, pipeline buffers that are reused
between blocks, and fresh memory filled with NaN — so a row no work item writes comes out as NaN
or as another block's stale values, and fails the comparison with the float64 loop. Tiny tiles
(16 rows, 128 lanes) make row tiles straddle group boundaries and K, N span two tiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import moe as moe_ops
from pallas_kernels.moe import pallas_tpu
from pallas_kernels.moe.pallas_tpu import TpuGmmConfig, gmm_pallas_tpu, tgmm_schedule, tgmm_tpu
from tests.pallas_kernels.gmm_testing import loop_gmm, normal

CFG = TpuGmmConfig(tile_m=16, tile_k=128, tile_n=128)
INTERPRET = pltpu.InterpretParams(uninitialized_memory="nan")
K, N = 256, 256


def _gmm(lhs, rhs, gs):
  return gmm_pallas_tpu(lhs, rhs, gs, config=CFG, interpret=INTERPRET)


@pytest.mark.parametrize("m,sizes,dtype,rtol,atol", [
    # M not a multiple of the tile, an empty group, group boundaries inside tiles, 12 tail rows.
    (75, [20, 0, 33, 10], jnp.float32, 1e-5, 1e-4),
    # one group holds every row; bf16 inputs, fp32 accumulation, one final bf16 rounding (2^-8).
    (64, [0, 0, 64, 0], jnp.bfloat16, 1e-2, 5e-2),
    # every group empty: all rows are tail rows (zeros, no matmul).
    (40, [0, 0, 0, 0], jnp.float32, 1e-5, 1e-4),
])
def test_forward_equals_float64_loop(m, sizes, dtype, rtol, atol):
  lhs, rhs = normal((m, K), 0, dtype), normal((len(sizes), K, N), 1, dtype)
  out = _gmm(lhs, rhs, jnp.asarray(sizes, jnp.int32))
  assert out.dtype == dtype and out.shape == (m, N)
  out32 = np.asarray(out, np.float32)
  assert np.all(np.isfinite(out32)), "a row no work item wrote (fresh VMEM is NaN)"
  np.testing.assert_allclose(out32, loop_gmm(lhs, rhs, sizes), rtol=rtol, atol=atol)
  np.testing.assert_array_equal(out32[sum(sizes):], 0.0)       # rows in no group: zeros


def test_grids_of_different_sizes_in_one_process():
  """Back-to-back calls whose grids differ (1, 3 and 2 K steps; different item counts) each get
  their own extents: jax 0.11.0–0.11.2 reuse a kernel jaxpr traced for an earlier grid, so
  pl.num_programs could report that grid (jax-ml/jax#40847); the kernels take them statically."""
  for seed, (m, k, sizes) in enumerate(((40, 128, [10, 30]), (90, 384, [50, 0, 40]),
                                        (40, 256, [5, 35]))):
    lhs, rhs = normal((m, k), 10 + seed), normal((len(sizes), k, N), 20 + seed)
    gs = jnp.asarray(sizes, jnp.int32)
    np.testing.assert_allclose(np.asarray(_gmm(lhs, rhs, gs)), loop_gmm(lhs, rhs, sizes),
                               rtol=1e-5, atol=1e-4)
    dout = normal((m, N), 30 + seed)
    got = tgmm_tpu(lhs, dout, gs, config=CFG, interpret=INTERPRET)
    ends = np.cumsum(sizes)
    want = [np.asarray(lhs, np.float64)[e - n:e].T @ np.asarray(dout, np.float64)[e - n:e]
            for n, e in zip(sizes, ends)]
    np.testing.assert_allclose(np.asarray(got), np.stack(want), rtol=1e-5, atol=1e-4)


def test_gradients_equal_reference_backend():
  """dlhs (gmm with rhsᵀ, no transpose materialised) and drhs (tgmm) vs the dense reference."""
  m, sizes = 75, [3, 0, 40, 17, 1]                              # 14 tail rows
  lhs, rhs = normal((m, K), 2), normal((len(sizes), K, N), 3)
  ct = normal((m, N), 4)
  gs = jnp.asarray(sizes, jnp.int32)
  loss_p = lambda a, b: jnp.sum(_gmm(a, b, gs) * ct)
  loss_r = lambda a, b: jnp.sum(moe_ops.gmm(a, b, gs, backend="reference") * ct)
  dl_p, dr_p = jax.grad(loss_p, argnums=(0, 1))(lhs, rhs)
  dl_r, dr_r = jax.jit(jax.grad(loss_r, argnums=(0, 1)))(lhs, rhs)
  np.testing.assert_allclose(dl_p, dl_r, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(dr_p, dr_r, rtol=1e-5, atol=1e-4)
  np.testing.assert_array_equal(dl_p[sum(sizes):], 0.0)        # tail rows get no gradient
  np.testing.assert_array_equal(dr_p[1], 0.0)                  # empty group: zero gradient


def test_non_finite_rows_do_not_leak():
  """inf in one group's rows and NaN in the rows past sum(group_sizes) (lhs and cotangent) leave
  every other output row and every other group's drhs bitwise equal to the clean case."""
  m, sizes = 61, [9, 20, 0, 14]                                 # 18 tail rows; tiles straddle
  lhs, rhs, ct = normal((m, K), 5), normal((len(sizes), K, N), 6), normal((m, N), 7)
  gs = jnp.asarray(sizes, jnp.int32)
  used, g1 = sum(sizes), slice(9, 29)
  lhs_bad = lhs.at[used:].set(jnp.nan).at[g1].set(jnp.inf)
  ct_bad = ct.at[used:].set(jnp.nan)

  out, out_bad = _gmm(lhs, rhs, gs), _gmm(lhs_bad, rhs, gs)
  keep = np.r_[0:9, 29:m]                                       # all rows but group 1's
  np.testing.assert_array_equal(np.asarray(out_bad)[keep], np.asarray(out)[keep])
  np.testing.assert_array_equal(out_bad[used:], 0.0)

  tg = lambda a, d: tgmm_tpu(a, d, gs, config=CFG, interpret=INTERPRET)
  drhs, drhs_bad = tg(lhs, ct), tg(lhs_bad, ct_bad)
  assert np.all(np.isinf(np.asarray(drhs_bad[1])) | np.isnan(np.asarray(drhs_bad[1])))
  for g in (0, 2, 3):
    np.testing.assert_array_equal(drhs_bad[g], drhs[g])
  np.testing.assert_array_equal(drhs[2], 0.0)

  # Through the custom_vjp: NaN only in the tail rows of lhs → drhs finite and equal to the clean
  # case (which is tgmm(lhs, ct): the cotangent of sum(out · ct) is ct).
  lhs_nan = lhs.at[used:].set(jnp.nan)
  dr_nan = jax.grad(lambda b: jnp.sum(_gmm(lhs_nan, b, gs) * ct))(rhs)
  assert np.all(np.isfinite(np.asarray(dr_nan)))
  np.testing.assert_array_equal(dr_nan, drhs)


def test_tgmm_schedule_gives_every_group_an_item():
  """Items sorted by group, ≥ 1 per group (empty groups: valid_size 0), rows kept exactly once."""
  rng = np.random.default_rng(0)
  m, g = 160, 6

  @jax.jit                                                         # one compile for all trials
  def schedule(sizes):
    s = tgmm_schedule(sizes, m, 16)
    return s.group_id, s.tile_start, s.valid_start, s.valid_size

  designed = [[0] * g, [0, 0, m, 0, 0, 0], [16, 0, 32, 0, 48, 64], [0, 16, 0, 32, 0, 0],
              [1, 0, 0, 0, 0, 159]]                # all empty; one full; aligned; tail; ragged
  drawn = []
  for trial in range(6):
    sizes = rng.multinomial(int(rng.integers(0, m + 1)), np.ones(g) / g)
    sizes[rng.random(g) < 0.4] = 0
    drawn.append(sizes)
  for sizes in designed + drawn:
    sizes = np.asarray(sizes)
    gid, ts, vs, vz = (np.asarray(a) for a in schedule(jnp.asarray(sizes, jnp.int32)))
    assert np.all(np.diff(gid) >= 0)
    assert set(range(g)) <= set(gid.tolist())
    assert np.all(ts % 16 == 0) and np.all((0 <= ts) & (ts <= m - 16))
    owner = np.full(m, -1)
    for i in np.nonzero(vz)[0]:
      rows = np.arange(ts[i] + vs[i], ts[i] + vs[i] + vz[i])
      assert np.all(owner[rows] == -1), "a row kept twice"
      owner[rows] = gid[i]
    np.testing.assert_array_equal(owner, np.concatenate([np.repeat(np.arange(g), sizes),
                                                         np.full(m - sizes.sum(), g)]))


def test_public_gmm_uses_the_tpu_kernel(monkeypatch):
  calls = []
  real = pallas_tpu.gmm_pallas_tpu
  monkeypatch.setattr(pallas_tpu, "gmm_pallas_tpu", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
  sizes = [5, 0, 11]
  lhs, rhs = normal((19, 128), 8), normal((3, 128, 128), 9)
  out = moe_ops.gmm(lhs, rhs, jnp.asarray(sizes, jnp.int32), backend="pallas_tpu")
  assert len(calls) == 1 and calls[0]["interpret"] == (jax.default_backend() != "tpu")
  np.testing.assert_allclose(out, loop_gmm(lhs, rhs, sizes), rtol=1e-5, atol=1e-4)


def test_shapes_that_do_not_tile_are_rejected():
  with pytest.raises(ValueError, match="tile_k"):
    TpuGmmConfig(tile_k=100)
  with pytest.raises(ValueError, match="tile_m"):
    TpuGmmConfig(tile_m=12)
  lhs, rhs = normal((32, 384), 0), normal((2, 384, 128), 1)   # K=384 is not a multiple of 256
  cfg = TpuGmmConfig(tile_m=16, tile_k=256, tile_n=128)
  with pytest.raises(ValueError, match="K .*tile_k=256"):
    gmm_pallas_tpu(lhs, rhs, jnp.asarray([16, 16]), config=cfg, interpret=INTERPRET)
  assert not pallas_tpu.supports((32, 384), (2, 384, 128), jnp.bfloat16, cfg)
  assert pallas_tpu.supports((32, 512), (2, 512, 256), jnp.bfloat16, cfg)
  assert not pallas_tpu.supports((32, 512), (2, 512, 256), jnp.float16, cfg)
  # "auto" never takes the TPU kernel until it has run on TPU hardware.
  want = "pallas_gpu" if jax.default_backend() == "gpu" else "ragged_dot"
  assert moe_ops.resolve_backend("auto", (256, 512), (4, 512, 512), jnp.bfloat16) == want


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_kernels_lower_to_mosaic_tpu(dtype):
  """The forward, dlhs and drhs kernels at the default 512³ tiles lower through Pallas' Mosaic TPU
  rules (abstract shapes, no TPU needed; Mosaic's own compile passes run only on a TPU host)."""
  m, k, n, g = 2048, 1024, 1536, 8
  lhs = jax.ShapeDtypeStruct((m, k), dtype)
  rhs = jax.ShapeDtypeStruct((g, k, n), dtype)
  gs = jax.ShapeDtypeStruct((g,), jnp.int32)
  loss = lambda a, b, s: jnp.sum(gmm_pallas_tpu(a, b, s).astype(jnp.float32))
  lowered = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(lhs, rhs, gs).lower(
      lowering_platforms=("tpu",))
  assert lowered.as_text().count("tpu_custom_call") == 3
