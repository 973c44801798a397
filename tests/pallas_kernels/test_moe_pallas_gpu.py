"""pallas_gpu gmm backend (Mosaic GPU kernels) on CPU, in Pallas' GPU interpret mode.

The interpreter runs the same kernel code as the GPU (warp-specialised pipeline, TMA copies,
wgmma, the ragged TMA-store ladder, the tgmm boundary masking) with tiny tiles. jax 0.10.2's
interpreter lacks transposed wgmma operands; mgpu_interpret_shim adds them (test-only). The row
schedule shared with the kernels is checked separately for exact row coverage.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import moe as moe_ops
from pallas_kernels.moe import pallas_gpu
from pallas_kernels.moe.pallas_gpu import gmm_pallas_gpu
from pallas_kernels.moe.schedule import max_items, row_schedule
from tests.pallas_kernels.gmm_testing import loop_gmm, normal
from tests.pallas_kernels import mgpu_interpret_shim

mgpu_interpret_shim.install()

# Tiny tiles: a CTA covers [64 rows, 2·64 cols]; K steps of 32; 2 pipeline stages.
CFG = pallas_gpu.MgpuConfig(tile_m=64, tile_n=64, tile_k=32, stages=2, epi_n=64, grid_width=2)
K, N = 128, 128


@pytest.mark.parametrize("m,sizes,dtype,tol", [
    # M not a multiple of the tile (nor of 8), an empty group, rows past sum(group_sizes), bf16.
    (203, [50, 0, 70, 60], jnp.bfloat16, 2e-2),
    # one group holds every row, fp32 (the interpreter multiplies in fp32).
    (128, [0, 0, 128, 0], jnp.float32, 1e-5),
])
def test_pallas_gpu_forward_equals_reference(m, sizes, dtype, tol):
  lhs, rhs = normal((m, K), 0, dtype), normal((len(sizes), K, N), 1, dtype)
  gs = jnp.asarray(sizes, jnp.int32)
  out = gmm_pallas_gpu(lhs, rhs, gs, config=CFG, interpret=True)
  ref = moe_ops.gmm(lhs, rhs, gs, backend="reference")
  assert out.dtype == ref.dtype == dtype
  out32, ref32 = np.asarray(out, np.float32), np.asarray(ref, np.float32)
  np.testing.assert_allclose(out32, ref32, atol=tol * 10, rtol=tol)
  np.testing.assert_allclose(out32, loop_gmm(lhs, rhs, sizes), atol=tol * 10, rtol=tol)
  np.testing.assert_array_equal(out32[sum(sizes):], 0.0)       # rows in no group: zeros


def test_pallas_gpu_gradients_equal_reference():
  """dlhs (gmm with rhsᵀ) and drhs (tgmm; group starts not 8-aligned, an empty group)."""
  m, sizes = 203, [3, 0, 77, 60, 1]
  lhs, rhs = normal((m, K), 2, jnp.float32), normal((len(sizes), K, N), 3, jnp.float32)
  ct = normal((m, N), 4, jnp.float32)
  gs = jnp.asarray(sizes, jnp.int32)
  loss_p = lambda a, b: jnp.sum(gmm_pallas_gpu(a, b, gs, config=CFG, interpret=True) * ct)
  loss_r = lambda a, b: jnp.sum(moe_ops.gmm(a, b, gs, backend="reference") * ct)
  dl_p, dr_p = jax.grad(loss_p, argnums=(0, 1))(lhs, rhs)
  dl_r, dr_r = jax.jit(jax.grad(loss_r, argnums=(0, 1)))(lhs, rhs)
  np.testing.assert_allclose(dl_p, dl_r, atol=1e-4, rtol=1e-5)
  np.testing.assert_allclose(dr_p, dr_r, atol=1e-4, rtol=1e-5)
  np.testing.assert_array_equal(dl_p[sum(sizes):], 0.0)
  np.testing.assert_array_equal(dr_p[1], 0.0)                    # empty group: zero gradient


def test_pallas_gpu_weight_gradient_ignores_inf_and_nan_padding_rows():
  """Rows past sum(group_sizes) are padding: whatever they hold, drhs equals the clean case."""
  m, sizes = 96, [20, 0, 37]                     # the last group ends mid-block (tile_k = 32)
  lhs, rhs = normal((m, K), 5, jnp.float32), normal((len(sizes), K, N), 6, jnp.float32)
  ct, gs = normal((m, N), 7, jnp.float32), jnp.asarray(sizes, jnp.int32)
  dirty = lhs.at[sum(sizes):sum(sizes) + 3].set(jnp.asarray([jnp.nan, jnp.inf, -jnp.inf])[:, None])
  grad = jax.grad(lambda a, b: jnp.sum(gmm_pallas_gpu(a, b, gs, config=CFG, interpret=True) * ct),
                  argnums=(0, 1))
  dl_clean, dr_clean = grad(lhs, rhs)
  dl_dirty, dr_dirty = grad(dirty, rhs)
  assert np.all(np.isfinite(dr_dirty))
  np.testing.assert_array_equal(dr_dirty, dr_clean)
  np.testing.assert_array_equal(dl_dirty, dl_clean)


@pytest.mark.parametrize("tile,align", [(64, 8), (16, 16), (8, 8)])
def test_row_schedule_covers_every_row_once(tile, align):
  """Every row is kept by exactly one item, of its own group (tail rows: group G)."""
  rng = np.random.default_rng(tile)
  def sched_fn(sizes, m):
    s = row_schedule(sizes, m, tile, align=align)
    return s.group_id, s.tile_start, s.valid_start, s.valid_size
  for trial in range(6):
    m = int(rng.integers(tile, 300))
    g = int(rng.integers(1, 9))
    sizes = rng.multinomial(int(rng.integers(0, m + 1)), np.ones(g) / g)
    sizes[rng.random(g) < 0.3] = 0
    gid, ts, vs, vz = (np.asarray(a) for a in sched_fn(jnp.asarray(sizes, jnp.int32), m))
    assert len(gid) == max_items(m, g, tile, align)
    owner = np.full(m, -1)
    for i in np.nonzero(vz)[0]:
      assert 0 <= ts[i] <= m - tile                              # tile inside the rows
      assert ts[i] % align == 0 or ts[i] == m - tile             # aligned unless clamped
      assert 0 <= vs[i] and vs[i] + vz[i] <= tile
      rows = np.arange(ts[i] + vs[i], ts[i] + vs[i] + vz[i])
      assert np.all(owner[rows] == -1), "a row kept twice"
      owner[rows] = gid[i]
    want = np.concatenate([np.repeat(np.arange(g), sizes), np.full(m - sizes.sum(), g)])
    np.testing.assert_array_equal(owner, want)


def test_auto_backend_is_pallas_gpu_only_on_gpu():
  expected = "pallas_gpu" if jax.default_backend() == "gpu" else "ragged_dot"
  assert moe_ops.resolve_backend("auto", (256, 512), (4, 512, 512), jnp.bfloat16) == expected


def test_mgpu_rejects_untileable_shapes():
  lhs, rhs = normal((64, 48), 0, jnp.bfloat16), normal((2, 48, 128), 1, jnp.bfloat16)
  with pytest.raises(ValueError, match="tile_k"):
    pallas_gpu.gmm_mgpu(lhs, rhs, jnp.asarray([32, 32]), config=CFG, interpret=True)


def test_identical_kernel_calls_share_one_lowered_function():
  """The kernels are jitted, so two layers' identical expert GEMMs (forward, dlhs and tgmm of
  each) lower to one function per kernel and shape, called from every site, instead of one
  inlined copy per call: the program's lowering (slow for Mosaic GPU kernels) and the backend's
  kernel compilation see each kernel once."""
  import re
  lhs, w1, w2 = normal((128, K), 0, jnp.bfloat16), normal((2, K, N), 1, jnp.bfloat16), \
      normal((2, K, N), 2, jnp.bfloat16)
  gs = jnp.asarray([64, 64])

  def loss(a, b, c):
    h = gmm_pallas_gpu(a, b, gs, config=CFG, interpret=True)
    return jnp.sum(jnp.square(gmm_pallas_gpu(h, c, gs, config=CFG, interpret=True).astype(jnp.float32)))

  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(lhs, w1, w2).as_text()
  calls = re.findall(r"call @(t?gmm_mgpu\w*)\(", text)
  defined = re.findall(r"func\.func private @(t?gmm_mgpu\w*)\(", text)
  assert calls.count("tgmm_mgpu") == 2 and defined.count("tgmm_mgpu") == 1, (calls, defined)
  assert calls.count("gmm_mgpu") == 2 and defined.count("gmm_mgpu") == 1, (calls, defined)
  assert len(calls) == 6 and len(defined) == 3, (calls, defined)     # forward, dlhs, tgmm
