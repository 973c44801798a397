"""The "pallas_gpu" gmm backend: grouped matmuls on Hopper with Pallas' Mosaic GPU backend
(wgmma, TMA, warp specialisation), behind the custom_vjp of vjp.py.

`gmm_pallas_gpu` runs `gmm_mgpu` forward; its backward (`vjp.differentiable_gmm`) computes dlhs by
`gmm_mgpu` with rhs[g]ᵀ and drhs by `tgmm_mgpu`, with the padding rows tgmm reads zeroed first.
Shapes the kernels cannot tile raise ValueError (`supports` says which tile); "auto" routes
those to ragged_dot.

Two kernels, both persistent (one CTA per SM looping over work items) and warp-specialised (one
producer warpgroup issuing TMA loads into a `stages`-deep shared-memory ring, two consumer
warpgroups issuing wgmma, each owning a [tile_m, tile_n] fp32 accumulator; a CTA tile is
[tile_m, 2·tile_n]):

* `gmm_mgpu`  out[M, N] = lhs[M, K] · rhs[g] for the rows of group g (ragged_dot semantics).
  Work items come from `schedule.row_schedule` (group, row tile, kept rows); every item loads a
  whole row tile (8-aligned start, so a tile may straddle a group boundary) and stores only its
  group's rows, through a ladder of power-of-two-row TMA stores (a TMA box has a static shape).
  Tail items (rows past sum(group_sizes)) skip the matmul and store zeros.
  `transpose_rhs=True` multiplies by rhs[g]ᵀ (rhs given as [G, N_out, K]): the dlhs of gmm.
* `tgmm_mgpu` out[G, K, N] = Σ_{rows r of g} lhs[r]ᵀ · dout[r]: the drhs of gmm. Items are
  (group, K-tile, N-tile); the reduction runs over the group's rows in blocks of tile_k rows that
  start exactly at the group's first row (TMA takes element offsets); in the last block the rows
  past the group are zeroed in shared memory in the consumer's own dout columns before its wgmma.
  Empty groups store zeros.
* `gmm_mx_mgpu` is `gmm_mgpu` with the rhs read as MXFP4 (packed codes + E8M0 scales) and
  dequantised in the consumer warpgroups before the wgmma (the forward of `gmm_mx`; its backward
  runs the two kernels above on the dequantised operands). `gmm_mx_mgpu_mxfp8` is the same
  kernel with the lhs read as MXFP8 (E4M3 codes + E8M0 scales) too, decoded in registers and
  fed to the wgmma as its register operand. Both are tested in interpret mode and lowered to
  Mosaic GPU (layout inference included) on CPU, and have run on an H200 (jax 0.11.2:
  benchmarks/moe_gmm_mx.py), where they are correct but bound by the in-register decode: about
  120–130 TFLOP/s at the k3_h200 expert shapes, against 560 for `gmm_mgpu`. The weight decode
  is a config choice (`MgpuConfig.e2m1_decode`): "select" (default) converts the E2M1 fields to
  fp32 and multiplies by the scale; "bits" builds the fp32 bit patterns, scale in the exponent,
  by integer ops only (equal values; not yet timed on hardware).

Constraints (checked, with a clear error): lhs and rhs of one dtype (bf16/f16; f32 runs as tf32);
K % tile_k == 0, N % (2·tile_n) == 0; rows M ≥ tile (smaller M is zero-padded by the caller).
Runs on CPU under Pallas' GPU interpret mode (`interpret=True`), which the CI tests use.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import platform
from pallas_kernels.moe import mx_operands
from pallas_kernels.moe.schedule import group_bounds, row_schedule
from pallas_kernels.moe.vjp import differentiable_gmm

_NUM_COMPUTE_WGS = 2
# MX kernels' in-register MXFP4 weight decodes (`MgpuConfig.e2m1_decode`): "select"
# (`_decode_e2m1_f32` times the scale) and "bits" (`_decode_e2m1_bits`).
E2M1_DECODES = ("select", "bits")


@dataclasses.dataclass(frozen=True)
class MgpuConfig:
  """Tile sizes of the Mosaic GPU kernels (a CTA covers [tile_m, 2·tile_n] of the output), and
  the MX kernels' MXFP4 weight decode (`E2M1_DECODES`)."""
  tile_m: int = 128        # rows of one work item (gmm) / K-rows of the output tile (tgmm)
  tile_n: int = 128        # output columns per consumer warpgroup
  tile_k: int = 64         # reduction step (K for gmm, rows for tgmm)
  stages: int = 3          # shared-memory pipeline depth (3 x 48 KiB + 64 KiB epilogue fits 227 KiB)
  epi_n: int = 64          # epilogue column chunk (shared-memory staging of the output)
  grid_minor: int = 0      # planar-snake minor dimension of the (m-item, n-tile) grid (0 = m)
  grid_width: int = 8      # planar-snake band width
  align: int = 8           # row alignment of gmm tile starts
  e2m1_decode: str = "select"   # MX kernels' E2M1 decode: "select" or "bits"

  def __post_init__(self):
    if self.e2m1_decode not in E2M1_DECODES:
      raise ValueError(f"MgpuConfig.e2m1_decode must be one of {', '.join(E2M1_DECODES)}, got "
                       f"{self.e2m1_decode!r}")


def _num_sms(interpret: bool) -> int:
  if interpret:
    return 2
  sms = platform.gpu_sm_count()
  if sms is None:
    raise ValueError("gmm pallas_gpu: the device does not report its multiprocessor count "
                     "(core_count), which sizes the persistent kernels' grid")
  return sms


def _swizzled(minor_elems: int, dtype, tiling_rows: int = 8) -> tuple:
  """Tiling + swizzle transforms for a shared-memory tile whose minor dim has minor_elems."""
  bits = minor_elems * jnp.dtype(dtype).itemsize * 8
  swizzle = plgpu.find_swizzle(bits)
  elems = swizzle // jnp.dtype(dtype).itemsize
  return (plgpu.TilingTransform((tiling_rows, elems)), plgpu.SwizzleTransform(swizzle))


def _interpret_params(interpret: bool):
  if not interpret:
    return None
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # CPU tests only
  return InterpretGPUParams()


def _check(cond: bool, msg: str) -> None:
  if not cond:
    raise ValueError(msg)


@dataclasses.dataclass(frozen=True)
class _WorkItem:
  """One (M-tile, N-block) of the persistent grid: its group, its rows and its first column."""
  ni: jax.Array
  gid: jax.Array
  tstart: jax.Array       # first row of the tile
  vstart: jax.Array       # first row of the tile that belongs to the group
  vsize: jax.Array        # number of the tile's rows that belong to the group
  is_tail: jax.Array      # the tile lies past the last group (its rows are written as zeros)
  col0: jax.Array         # first output column of this consumer warpgroup


def _work_item(lin, grid, cfg, schedule_refs, num_groups: int, cta_n: int, tile_n: int, wg):
  """The work item of linear index `lin` (snake order over `grid`) from the tile schedule."""
  gid_ref, tstart_ref, vstart_ref, vsize_ref = schedule_refs
  mi, ni = plgpu.planar_snake(lin, grid, cfg.grid_minor, cfg.grid_width)
  gid = gid_ref[mi]
  return _WorkItem(ni, gid, pl.multiple_of(tstart_ref[mi], min(cfg.align, 8)),
                   vstart_ref[mi], vsize_ref[mi], gid >= num_groups, ni * cta_n + wg * tile_n)


def _epilogue(out_smem, out_ref, wg, item: _WorkItem, tile_m: int, tile_n: int, epi_n: int,
              dtype):
  """store(acc_mn): a [tile_m, tile_n] result in dtype (None: zeros) → the item's valid rows of
  out_ref, through two shared-memory slots of epi_n columns."""
  def store(acc_mn):
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    for c in range(tile_n // epi_n):
      slot = c % 2
      plgpu.wait_smem_to_gmem(1, wait_read_only=True)
      if acc_mn is None:
        out_smem[wg, slot] = jnp.zeros((tile_m, epi_n), dtype)
      else:
        out_smem[wg, slot] = acc_mn[:, c * epi_n:(c + 1) * epi_n]
      plgpu.commit_smem()
      _ragged_store(out_smem.at[wg, slot], out_ref, item.tstart, item.vstart, item.vsize, tile_m,
                    pl.ds(item.col0 + c * epi_n, epi_n))
  return store


def _accumulate_then_store(tile_m: int, tile_n: int, dtype, store):
  """The pipeline context: an fp32 accumulator for the pipeline, then `store` of its value."""
  def context(run_pipeline):
    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
    def _(acc_ref):
      run_pipeline(acc_ref)
      store(acc_ref[...].astype(dtype))
  return context


def _ragged_store(src_smem, dst_gmem, row0, valid_start, valid_size, max_rows: int, cols):
  """TMA-store rows [valid_start, valid_start + valid_size) of src_smem to dst rows row0 + same.

  A TMA box has a static shape, so the dynamic row count is split into its binary digits: one
  conditional store of 2^j rows per set bit (at most log2(max_rows) + 1 stores). All copies go
  into one commit group.
  """
  offset = valid_start
  size = 1 << (max_rows.bit_length() - 1)
  while size > 0:
    @pl.when((valid_size & size) != 0)
    def _(offset=offset, size=size):
      plgpu.copy_smem_to_gmem(src_smem.at[pl.ds(offset, size)],
                              dst_gmem.at[pl.ds(row0 + offset, size), cols], commit_group=False)
    offset = offset + (valid_size & size)
    size //= 2
  plgpu.commit_smem_to_gmem_group()


# ------------------------------------------------------------------------------------------ gmm

# The kernels are jitted (shapes, dtypes and settings static): every call with the same ones
# traces to the same jaxpr, which jax lowers once per program and calls from each site. A step
# holds dozens of identical expert GEMMs (layers, forward, recompute, backward), and lowering a
# Mosaic GPU kernel takes ~0.7 s on the host, so without this the program's lowering is mostly
# the same few kernels lowered again (benchmarks/train_step.md).
@functools.partial(jax.jit, static_argnames=("transpose_rhs", "config", "interpret"))
def gmm_mgpu(lhs_mk: jax.Array, rhs_gkn: jax.Array, group_sizes_g: jax.Array, *,
             transpose_rhs: bool = False, config: MgpuConfig = MgpuConfig(),
             interpret: bool = False) -> jax.Array:
  """out [M, N] (lhs dtype) = ragged_dot(lhs, rhs) — or with rhs[g]ᵀ if transpose_rhs.

  rhs_gkn is [G, K, N], or [G, N, K] when transpose_rhs (the gmm's own weights, for dlhs).
  """
  cfg = config
  m, k = lhs_mk.shape
  g = rhs_gkn.shape[0]
  n = rhs_gkn.shape[1] if transpose_rhs else rhs_gkn.shape[2]
  k_rhs = rhs_gkn.shape[2] if transpose_rhs else rhs_gkn.shape[1]
  cta_n = _NUM_COMPUTE_WGS * cfg.tile_n
  _check(lhs_mk.dtype == rhs_gkn.dtype, f"gmm_mgpu: dtypes differ {lhs_mk.dtype}/{rhs_gkn.dtype}")
  _check(k == k_rhs, f"gmm_mgpu: contraction sizes differ, lhs {lhs_mk.shape} rhs {rhs_gkn.shape}")
  _check(k % cfg.tile_k == 0, f"gmm_mgpu: K={k} must be a multiple of tile_k={cfg.tile_k}")
  _check(n % cta_n == 0, f"gmm_mgpu: N={n} must be a multiple of 2*tile_n={cta_n}")
  _check(cfg.tile_n % cfg.epi_n == 0, "gmm_mgpu: tile_n must be a multiple of epi_n")
  _check(cfg.epi_n * jnp.dtype(lhs_mk.dtype).itemsize % 128 == 0,
         "gmm_mgpu: epi_n rows must be 128-byte multiples (TMA stores start at any row)")
  # Pad rows to a multiple of 8 (clamped tile starts stay 8-aligned for TMA) and to ≥ tile_m;
  # padded rows are tail rows (zeros), sliced off at the end. No copy when M % 8 == 0 ≥ tile_m.
  pad = max(cfg.tile_m, -(-m // 8) * 8) - m
  if pad:
    lhs_mk = jnp.pad(lhs_mk, ((0, pad), (0, 0)))
  m_p = m + pad
  sched = row_schedule(group_sizes_g, m_p, cfg.tile_m, align=cfg.align)
  num_items = sched.group_id.shape[0]
  n_iters, k_iters = n // cta_n, k // cfg.tile_k
  dtype = lhs_mk.dtype
  in_tf = _swizzled(cfg.tile_k, dtype)
  b_tf = in_tf if transpose_rhs else _swizzled(cta_n, dtype)
  out_tf = _swizzled(cfg.epi_n, dtype, tiling_rows=1)     # 1-row tiling: any row offset slices
  tile_m, tile_n, epi_n = cfg.tile_m, cfg.tile_n, cfg.epi_n

  def pipeline(body, context):
    if transpose_rhs:
      b_spec = plgpu.BlockSpec((cta_n, cfg.tile_k), lambda kk: (0, kk), transforms=b_tf,
                               memory_space=plgpu.SMEM)
    else:
      b_spec = plgpu.BlockSpec((cfg.tile_k, cta_n), lambda kk: (kk, 0), transforms=b_tf,
                               memory_space=plgpu.SMEM)
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(k_iters,), memory_registers=40,
        in_specs=[plgpu.BlockSpec((tile_m, cfg.tile_k), lambda kk: (0, kk), transforms=in_tf,
                                  memory_space=plgpu.SMEM), b_spec],
        wg_axis="wg", num_compute_wgs=_NUM_COMPUTE_WGS, max_concurrent_steps=cfg.stages,
        compute_context=context)

  def kernel(gid_ref, tstart_ref, vstart_ref, vsize_ref, lhs_ref, rhs_ref, out_ref):
    ignore = lambda *_, **__: None
    b_view0 = (rhs_ref.at[0, pl.ds(0, cta_n), :] if transpose_rhs
               else rhs_ref.at[0, :, pl.ds(0, cta_n)])

    @functools.partial(
        pl.run_scoped,
        allocs=pipeline(ignore, ignore).get_allocations(lhs_ref.at[pl.ds(0, tile_m), :], b_view0),
        out_smem=plgpu.SMEM((_NUM_COMPUTE_WGS, 2, tile_m, epi_n), dtype, transforms=out_tf),
        collective_axes="wg")
    def scope(allocs, out_smem):
      wg = lax.axis_index("wg")

      @plgpu.nd_loop((num_items * n_iters,), collective_axes="sm")
      def item_loop(info):
        (lin,) = info.index
        item = _work_item(lin, (num_items, n_iters), cfg, (gid_ref, tstart_ref, vstart_ref,
                                                           vsize_ref), g, cta_n, tile_n, wg)
        ni, gid, tstart, vsize, is_tail = item.ni, item.gid, item.tstart, item.vsize, item.is_tail
        store = _epilogue(out_smem, out_ref, wg, item, tile_m, tile_n, epi_n, dtype)
        context = _accumulate_then_store(tile_m, tile_n, dtype, store)

        def mma(_, a_smem, b_smem, acc_ref):
          if transpose_rhs:
            b_op = plgpu.transpose_ref(b_smem.at[pl.ds(wg * tile_n, tile_n), :], (1, 0))
          else:
            b_op = b_smem.at[:, pl.ds(wg * tile_n, tile_n)]
          plgpu.wgmma(acc_ref, a_smem, b_op)
          plgpu.wgmma_wait(0)
          return acc_ref

        @pl.when((vsize > 0) & jnp.logical_not(is_tail))
        def _():
          gid_c = jnp.minimum(gid, g - 1)
          b_view = (rhs_ref.at[gid_c, pl.ds(ni * cta_n, cta_n), :] if transpose_rhs
                    else rhs_ref.at[gid_c, :, pl.ds(ni * cta_n, cta_n)])
          pipeline(mma, context)(lhs_ref.at[pl.ds(tstart, tile_m), :], b_view,
                                 allocations=allocs)

        @pl.when((vsize > 0) & is_tail & (wg < _NUM_COMPUTE_WGS))
        def _():
          store(None)

      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  out = plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct((m_p, n), dtype),
      grid=(_num_sms(interpret),), grid_names=("sm",), num_threads=_NUM_COMPUTE_WGS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=_interpret_params(interpret),
  )(sched.group_id, sched.tile_start, sched.valid_start, sched.valid_size, lhs_mk, rhs_gkn)
  return out[:m] if pad else out


# ----------------------------------------------------------------------------------------- tgmm

@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def tgmm_mgpu(lhs_mk: jax.Array, dout_mn: jax.Array, group_sizes_g: jax.Array, *,
              config: MgpuConfig = MgpuConfig(), interpret: bool = False) -> jax.Array:
  """out [G, K, N] (lhs dtype): out[g] = Σ_{r in group g} lhs[r]ᵀ dout[r]; empty groups → 0."""
  cfg = config
  m, k = lhs_mk.shape
  n = dout_mn.shape[1]
  g = group_sizes_g.shape[0]
  cta_n = _NUM_COMPUTE_WGS * cfg.tile_n
  br = cfg.tile_k                              # rows reduced per pipeline step
  _check(lhs_mk.dtype == dout_mn.dtype, f"tgmm_mgpu: dtypes differ {lhs_mk.dtype}/{dout_mn.dtype}")
  _check(dout_mn.shape[0] == m, f"tgmm_mgpu: rows differ {lhs_mk.shape} vs {dout_mn.shape}")
  _check(k % cfg.tile_m == 0, f"tgmm_mgpu: K={k} must be a multiple of tile_m={cfg.tile_m}")
  _check(n % cta_n == 0, f"tgmm_mgpu: N={n} must be a multiple of 2*tile_n={cta_n}")
  _check(cfg.tile_n % cfg.epi_n == 0, "tgmm_mgpu: tile_n must be a multiple of epi_n")
  pad = max(br, -(-m // 8) * 8) - m          # 8-aligned row count (no copy when M % 8 == 0)
  if pad:
    lhs_mk = jnp.pad(lhs_mk, ((0, pad), (0, 0)))
    dout_mn = jnp.pad(dout_mn, ((0, pad), (0, 0)))
  m_p = m + pad
  starts_g, ends_g = group_bounds(group_sizes_g, m)
  dtype = lhs_mk.dtype
  k_tiles, n_tiles = k // cfg.tile_m, n // cta_n
  per_group = k_tiles * n_tiles
  tile_m, tile_n, epi_n = cfg.tile_m, cfg.tile_n, cfg.epi_n
  a_tf = _swizzled(tile_m, dtype)
  b_tf = _swizzled(cta_n, dtype)
  out_tf = _swizzled(epi_n, dtype)

  def pipeline(body, context, nblk, row_of_block):
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(nblk,), memory_registers=40,
        in_specs=[
            plgpu.BlockSpec((pl.Element(br), tile_m), lambda j: (row_of_block(j), 0),
                            transforms=a_tf, memory_space=plgpu.SMEM),
            plgpu.BlockSpec((pl.Element(br), cta_n), lambda j: (row_of_block(j), 0),
                            transforms=b_tf, memory_space=plgpu.SMEM)],
        wg_axis="wg", num_compute_wgs=_NUM_COMPUTE_WGS, max_concurrent_steps=cfg.stages,
        compute_context=context)

  def kernel(starts_ref, ends_ref, lhs_ref, dout_ref, out_ref):
    ignore = lambda *_, **__: None
    a_view0 = lhs_ref.at[:, pl.ds(0, tile_m)]
    b_view0 = dout_ref.at[:, pl.ds(0, cta_n)]

    @functools.partial(
        pl.run_scoped,
        allocs=pipeline(ignore, ignore, cfg.stages, lambda j: j * br).get_allocations(a_view0, b_view0),
        out_smem=plgpu.SMEM((_NUM_COMPUTE_WGS, 2, tile_m, epi_n), dtype, transforms=out_tf),
        collective_axes="wg")
    def scope(allocs, out_smem):
      wg = lax.axis_index("wg")

      @plgpu.nd_loop((g * per_group,), collective_axes="sm")
      def item_loop(info):
        (lin,) = info.index
        gi = lin // per_group
        ki, ni = plgpu.planar_snake(lin % per_group, (k_tiles, n_tiles), cfg.grid_minor,
                                    cfg.grid_width)
        start = starts_ref[gi]
        end = ends_ref[gi]
        base = (start // 8) * 8                  # TMA row offsets must be multiples of 8
        nblk = jnp.where(end > start, (end - base + br - 1) // br, 0)
        col0 = ni * cta_n + wg * tile_n

        def row_of_block(j):     # first row of block j, clamped so the block stays in bounds
          return pl.multiple_of(jnp.minimum(base + j * br, m_p - br), 8)

        def store(acc_kn):
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          for c in range(tile_n // epi_n):
            slot = c % 2
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            if acc_kn is None:
              out_smem[wg, slot] = jnp.zeros((tile_m, epi_n), dtype)
            else:
              out_smem[wg, slot] = acc_kn[:, c * epi_n:(c + 1) * epi_n]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(
                out_smem.at[wg, slot],
                out_ref.at[gi, pl.ds(ki * tile_m, tile_m), pl.ds(col0 + c * epi_n, epi_n)])

        def context(run_pipeline):
          @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
          def _(acc_ref):
            run_pipeline(acc_ref)
            store(acc_ref[...].astype(dtype))

        def mma(idx, a_smem, b_smem, acc_ref):
          (j,) = idx
          b_own = b_smem.at[:, pl.ds(wg * tile_n, tile_n)]

          @pl.when((j == 0) | (j == nblk - 1))
          def _():
            # First/last block: keep rows max(nominal, start)..end-1 (the first block starts at
            # the 8-aligned row below the group; the last may run past the group's end, or start
            # earlier when clamped to the array end).
            first = row_of_block(j)
            rows = lax.broadcasted_iota(jnp.int32, (br, tile_n), 0) + first
            if not interpret:   # the CPU interpreter has no layout_cast (a no-op on values)
              rows = plgpu.layout_cast(rows, plgpu.Layout.WGMMA)
            keep = (rows >= jnp.maximum(base + j * br, start)) & (rows < end)
            b_own[...] = b_own[...] * keep.astype(dtype)
            plgpu.commit_smem()

          a_op = plgpu.transpose_ref(a_smem, (1, 0))         # lhs rowsᵀ: [tile_m(K), br]
          plgpu.wgmma(acc_ref, a_op, b_own)
          plgpu.wgmma_wait(0)
          return acc_ref

        @pl.when(nblk > 0)
        def _():
          pipeline(mma, context, nblk, row_of_block)(
              lhs_ref.at[:, pl.ds(ki * tile_m, tile_m)],
              dout_ref.at[:, pl.ds(ni * cta_n, cta_n)], allocations=allocs)

        @pl.when((nblk == 0) & (wg < _NUM_COMPUTE_WGS))
        def _():
          store(None)

      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  return plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct((g, k, n), dtype),
      grid=(_num_sms(interpret),), grid_names=("sm",), num_threads=_NUM_COMPUTE_WGS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=_interpret_params(interpret),
  )(starts_g, ends_g, lhs_mk, dout_mn)


# ------------------------------------------------------------------------------------------ backend

DEFAULT_CONFIG = MgpuConfig()


def supports(lhs_shape, rhs_shape, dtype, config: MgpuConfig = DEFAULT_CONFIG) -> bool:
  """Whether the kernels tile these shapes (fwd, dlhs and drhs) and this dtype."""
  _, k = lhs_shape
  _, _, n = rhs_shape
  cta_n = 2 * config.tile_n
  return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
          and k % config.tile_k == 0 and n % config.tile_k == 0
          and n % cta_n == 0 and k % cta_n == 0 and k % config.tile_m == 0)


def _zero_rows_after_groups(lhs_mk, group_sizes_g, config: MgpuConfig):
  """lhs with the tile_k rows after sum(group_sizes) zeroed (no full pass over lhs).

  tgmm reduces each group in blocks of tile_k rows from the group's first row, and zeroes the
  cotangent past the group's end; a padding row holding inf/NaN would still give 0 · inf = NaN
  in the last group's weight gradient. Those are the only padding rows it reads, so zeroing this
  window keeps drhs finite whatever the padding holds.
  """
  m = lhs_mk.shape[0]
  window = min(config.tile_k, m)
  total = jnp.minimum(jnp.sum(jnp.maximum(group_sizes_g, 0)), m)
  start = jnp.clip(total, 0, m - window)
  block = jax.lax.dynamic_slice_in_dim(lhs_mk, start, window, axis=0)
  past = (start + jnp.arange(window)) >= total
  block = jnp.where(past[:, None], jnp.zeros((), block.dtype), block)
  return jax.lax.dynamic_update_slice_in_dim(lhs_mk, block, start, axis=0)


_gmm = differentiable_gmm(gmm_mgpu, tgmm_mgpu, prepare_tgmm_lhs=_zero_rows_after_groups)


def gmm_pallas_gpu(lhs_mk: jax.Array, rhs_gkn: jax.Array, group_sizes_g: jax.Array, *,
                   config: MgpuConfig = DEFAULT_CONFIG, interpret: bool = False) -> jax.Array:
  """ragged_dot(lhs, rhs, group_sizes) on the Mosaic GPU kernels, differentiable in lhs and rhs."""
  return _gmm(lhs_mk, rhs_gkn, group_sizes_g, config=config, interpret=interpret)


# ------------------------------------------------------------------------------------------ MX

MX_BLOCK = mx_operands.BLOCK
# Bytes per row and K-step of 64 of the kernel's uint8 operands. Mosaic GPU (jax 0.11) tiles a
# shared-memory slice that a consumer loads into registers by (rows, slice width), so a row must
# be a multiple of the 32-byte code slice: weights 32 code bytes + 2 scale bytes + 30 zeros.
# Activation scales: 2 bytes + 30 zeros (16 would do for TMA, but Pallas' GPU interpreter in
# jax 0.10.2 deadlocks on a 16-byte-wide pipelined tile next to the others).
_MX_ROW_BYTES = 64
_MX_SCALE_ROW_BYTES = 32


def _kernel_rhs(rhs_packed_gnh: jax.Array, rhs_scales_gnb: jax.Array) -> jax.Array:
  """Release MXFP4 (codes [G, N, K/2], scale bytes [G, N, K/32]) → the kernel's operand, uint8
  [G, N, K/64 · 64]: for every weight row and K-step of 64 elements, 32 code bytes in which byte
  j holds element j (low nibble) and element 32 + j (high nibble), so the two nibbles decode to
  the step's two MX blocks without an interleave, then the two blocks' scale bytes, then 30
  zeros (`_MX_ROW_BYTES`). 8 bits per weight element in all, against 16 for bf16; one XLA pass
  over the packed bytes."""
  nib = mx_operands.unpack_nibbles(rhs_packed_gnh)                       # [G, N, K]
  g, n, k = nib.shape
  halves = nib.reshape(g, n, k // 64, 2, 32)                             # K-steps of 2 blocks
  codes = halves[..., 0, :] | (halves[..., 1, :] << 4)                   # [G, N, K/64, 32]
  scales = rhs_scales_gnb.reshape(g, n, k // 64, 2)
  pad = jnp.zeros((g, n, k // 64, _MX_ROW_BYTES - 34), jnp.uint8)
  return jnp.concatenate([codes, scales, pad], axis=-1).reshape(g, n, (k // 64) * _MX_ROW_BYTES)


def _pow2_factors(byte: jax.Array) -> tuple[jax.Array, jax.Array]:
  """E8M0 byte (int32) → two fp32 powers of two whose product is 2^(byte − 127), each normal
  (so byte 0 needs no subnormal), from the exponent bits."""
  e = byte - 127
  half = e >> 1
  f1 = lax.bitcast_convert_type((half + 127) << 23, jnp.float32)
  f2 = lax.bitcast_convert_type((e - half + 127) << 23, jnp.float32)
  return f1, f2


def _decode_e2m1_f32(nib: jax.Array) -> jax.Array:
  """Nibbles (integers, low 4 bits) → fp32 E2M1 values with elementwise selects only (kernel body
  arithmetic; no table, no variable shifts): magnitude index 2e + m → m/2 (e = 0), else
  2^(e−1)·(1 + m/2); bit 3 is the sign."""
  n = nib.astype(jnp.int32)
  e = ((n >> 1) & 3).astype(jnp.float32)
  m = (n & 1).astype(jnp.float32)
  power = jnp.where(e == 3.0, 4.0, jnp.where(e == 2.0, 2.0, 1.0))
  mag = jnp.where(e == 0.0, 0.5 * m, power * (1.0 + 0.5 * m))
  return jnp.where((n & 8) != 0, -mag, mag)


def _kernel_lhs_scales(scales_mb: jax.Array) -> jax.Array:
  """MXFP8 scale bytes [M, K/32] → the kernel's operand, uint8 [M, K/64 · 32]: per row and K-step
  of 64 the two blocks' bytes, then 30 zeros (`_MX_SCALE_ROW_BYTES`; a TMA box row is a multiple
  of 16 bytes, and the row stride K/32 bytes need not be). One small XLA pass over the scales."""
  m, nb = scales_mb.shape
  pairs = scales_mb.reshape(m, nb // 2, 2)
  pad = jnp.zeros((m, nb // 2, _MX_SCALE_ROW_BYTES - 2), jnp.uint8)
  return jnp.concatenate([pairs, pad], axis=-1).reshape(m, (nb // 2) * _MX_SCALE_ROW_BYTES)


def _row_byte(bytes_x16: jax.Array, col: jax.Array, h: int) -> jax.Array:
  """Scale bytes [rows, 16] (int32; byte h of a row is its block-h scale) → byte h, int32 [rows]
  (a masked row sum)."""
  return jnp.sum(jnp.where(col == h, bytes_x16, 0), axis=1)


def _row_factors(bytes_x16: jax.Array, col: jax.Array, h: int):
  """Scale bytes [rows, 16] (int32; byte h of a row is its block-h scale) → (f1, f2) fp32 [rows]
  with f1 · f2 = 2^(byte − 127), f1 NaN where the byte is 255 (so the block decodes to NaN
  through the product, without a select per element)."""
  byte = _row_byte(bytes_x16, col, h)
  f1, f2 = _pow2_factors(byte)
  return jnp.where(byte == 255, jnp.nan, f1), f2


_F32_INF_BITS = 0x7F800000
_F32_NAN_BITS = 0x7FC00000


def _e2m1_bits_rows(byte: jax.Array) -> tuple[jax.Array, ...]:
  """E8M0 bytes s, int32 [rows] → (base, low, thr, lim), uint32 [rows]: the per-row operands of
  `_decode_e2m1_bits`, computed once per row and block instead of once per element.

  base = (s − 1) << 23, the bits of code i ≥ thr being (i << 22) + base (modulo 2^32: for s = 0
  base wraps and codes 4–7 are still right); low = the bits of code 1, 0.5 · 2^(s − 127), or 0
  where that is subnormal (s ≤ 1); thr = 2, or 4 for s = 0 (codes 2–3 are then subnormal too);
  lim = +inf's bits. Subnormal values are flushed to ±0, as `mx.dequantize` gives them (XLA
  flushes its subnormal products; mx.py and mx_operands.py allow values below 2^-126 to flush).
  Byte 255 (NaN): base = lim = NaN's bits and thr = 0, so every code of the block decodes to
  NaN."""
  nan = byte == 255
  exp = (byte - 1) << 23
  base = jnp.where(nan, _F32_NAN_BITS, exp)
  low = jnp.where(byte >= 2, exp, 0)
  thr = jnp.where(nan, 0, jnp.where(byte == 0, 4, 2))
  lim = jnp.where(nan, _F32_NAN_BITS, _F32_INF_BITS)
  return tuple(x.astype(jnp.uint32) for x in (base, low, thr, lim))


def _decode_e2m1_bits(nib: jax.Array, base: jax.Array, low: jax.Array, thr: jax.Array,
                      lim: jax.Array) -> jax.Array:
  """Nibbles (integers, low 4 bits) and their rows' `_e2m1_bits_rows` (broadcast to the nibbles'
  shape) → fp32 E2M1 · 2^(s − 127), the bit pattern built by integer ops (no int → float convert,
  no float multiply: 10 integer ops per element in the lowered Mosaic GPU IR, against 20 for the
  select decode, two of them int → float converts).

  With magnitude index i = 2e + m, a normal value 2^(e−1)·(1 + m/2)·2^(s−127) (e ≥ 1) has the
  fp32 exponent field e − 1 + s and the top mantissa bit m: bits (e << 23) + (m << 22) +
  ((s − 1) << 23) = (i << 22) + base. Code 1 (2^-1 · 2^(s−127)) has the bits (s − 1) << 23 =
  low, code 0 the bits 0 = 0 · low: below thr the bits are i · low. The unsigned min with lim
  turns exponent fields past 254 (s ≥ 253) into +inf, as fp32 rounds those values; bit 3 of the
  nibble is the sign, bit 31."""
  n = nib.astype(jnp.uint32)
  i = n & 7
  mag = jnp.minimum(jnp.where(i >= thr, (i << 22) + base, i * low), lim)
  return lax.bitcast_convert_type(mag | ((n & 8) << 28), jnp.float32)


def _check_mx_config(cfg: MgpuConfig, k: int, n: int, dtype, name: str) -> None:
  _check(cfg.tile_k == 2 * MX_BLOCK, f"{name}: tile_k must be {2 * MX_BLOCK} (two MX blocks per "
         f"step), got {cfg.tile_k}")
  _check(k % cfg.tile_k == 0, f"{name}: K={k} must be a multiple of tile_k={cfg.tile_k}")
  _check(n % (_NUM_COMPUTE_WGS * cfg.tile_n) == 0,
         f"{name}: N={n} must be a multiple of 2*tile_n={_NUM_COMPUTE_WGS * cfg.tile_n}")
  _check(cfg.tile_n % cfg.epi_n == 0, f"{name}: tile_n must be a multiple of epi_n")
  _check(cfg.epi_n * jnp.dtype(dtype).itemsize % 128 == 0,
         f"{name}: epi_n rows must be 128-byte multiples (TMA stores start at any row)")


def _gmm_mx_call(lhs_ops, rhs_k, group_sizes_g, *, num_groups: int, n: int, dtype,
                 config: MgpuConfig, interpret: bool) -> jax.Array:
  """The MX grouped-matmul kernel. lhs_ops is (lhs [M, K] in dtype,) — activations read as they
  are — or (E4M3 code bytes [M, K], `_kernel_lhs_scales` operand) — activations decoded in the
  kernel; rhs_k is `_kernel_rhs`'s weight operand. Output [M, N] in dtype."""
  cfg = config
  mx_lhs = len(lhs_ops) == 2
  m, k = lhs_ops[0].shape
  g = num_groups
  cta_n = _NUM_COMPUTE_WGS * cfg.tile_n
  half = cfg.tile_k // 2
  # Rows padded to a multiple of 8 and to ≥ tile_m (padding rows are tail rows, sliced off).
  pad = max(cfg.tile_m, -(-m // 8) * 8) - m
  if pad:
    lhs_ops = tuple(jnp.pad(x, ((0, pad), (0, 0))) for x in lhs_ops)
  m_p = m + pad
  sched = row_schedule(group_sizes_g, m_p, cfg.tile_m, align=cfg.align)
  num_items = sched.group_id.shape[0]
  n_iters, k_iters = n // cta_n, k // cfg.tile_k
  a_tf = _swizzled(half, lhs_ops[0].dtype)      # E4M3 halves: 32-byte rows; bf16: 64-byte rows
  w_tf = _swizzled(half, dtype)
  out_tf = _swizzled(cfg.epi_n, dtype, tiling_rows=1)
  tile_m, tile_n, epi_n = cfg.tile_m, cfg.tile_n, cfg.epi_n

  def pipeline(body, context):
    lhs_specs = [
        plgpu.BlockSpec((tile_m, half), lambda kk: (0, 2 * kk), transforms=a_tf,
                        memory_space=plgpu.SMEM),
        plgpu.BlockSpec((tile_m, half), lambda kk: (0, 2 * kk + 1), transforms=a_tf,
                        memory_space=plgpu.SMEM)]
    if mx_lhs:
      lhs_specs.append(plgpu.BlockSpec((tile_m, _MX_SCALE_ROW_BYTES), lambda kk: (0, kk),
                                       memory_space=plgpu.SMEM))
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(k_iters,), memory_registers=40,
        in_specs=[*lhs_specs,
                  plgpu.BlockSpec((cta_n, _MX_ROW_BYTES), lambda kk: (0, kk),
                                  memory_space=plgpu.SMEM)],
        wg_axis="wg", num_compute_wgs=_NUM_COMPUTE_WGS, max_concurrent_steps=cfg.stages,
        compute_context=context)

  def load(ref):
    """A shared-memory tile into registers: in the wgmma register layout on hardware (row values
    then broadcast along K without data movement), plainly in the interpreter."""
    if interpret:
      return ref[...]
    return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA, optimized=False)

  def col_iota(rows):
    col = lax.broadcasted_iota(jnp.int32, (rows, 16), 1)
    return col if interpret else plgpu.layout_cast(col, plgpu.Layout.WGMMA)

  def kernel(gid_ref, tstart_ref, vstart_ref, vsize_ref, *refs):
    *lhs_refs, rhs_ref, out_ref = refs
    ignore = lambda *_, **__: None

    def lhs_views(row0):   # the row tile of the lhs operands, one per lhs in_spec
      views = [x.at[pl.ds(row0, tile_m), :] for x in lhs_refs]
      return [views[0], *views]       # (lo half, hi half[, scales]) read the same rows
    lhs_views0 = lhs_views(0)

    @functools.partial(
        pl.run_scoped,
        allocs=pipeline(ignore, ignore).get_allocations(
            *lhs_views0, rhs_ref.at[0, pl.ds(0, cta_n), :]),
        out_smem=plgpu.SMEM((_NUM_COMPUTE_WGS, 2, tile_m, epi_n), dtype, transforms=out_tf),
        w_smem=plgpu.SMEM((_NUM_COMPUTE_WGS, 2, tile_n, half), dtype, transforms=w_tf),
        collective_axes="wg")
    def scope(allocs, out_smem, w_smem):
      wg = lax.axis_index("wg")

      @plgpu.nd_loop((num_items * n_iters,), collective_axes="sm")
      def item_loop(info):
        (lin,) = info.index
        item = _work_item(lin, (num_items, n_iters), cfg, (gid_ref, tstart_ref, vstart_ref,
                                                           vsize_ref), g, cta_n, tile_n, wg)
        ni, gid, tstart, vsize, is_tail = item.ni, item.gid, item.tstart, item.vsize, item.is_tail
        store = _epilogue(out_smem, out_ref, wg, item, tile_m, tile_n, epi_n, dtype)
        context = _accumulate_then_store(tile_m, tile_n, dtype, store)

        def mma(_, *step_refs):
          *a_refs, r_smem, acc_ref = step_refs
          own = pl.ds(wg * tile_n, tile_n)
          row = lambda v, rows: lax.broadcast_in_dim(v, (rows, half), [0])
          # MXFP4 weights: nibbles → E2M1 values, times the row's scale, into shared memory.
          codes_nh = load(r_smem.at[own, pl.ds(0, half)]).astype(jnp.int32)
          wbytes_n16 = load(r_smem.at[own, pl.ds(half, 16)]).astype(jnp.int32)
          col_n16 = col_iota(tile_n)
          for h, nib in enumerate((codes_nh & 15, (codes_nh >> 4) & 15)):  # blocks 2kk, 2kk+1
            if cfg.e2m1_decode == "bits":
              bits_rows = _e2m1_bits_rows(_row_byte(wbytes_n16, col_n16, h))
              w_nh = _decode_e2m1_bits(nib, *(row(x, tile_n) for x in bits_rows))
            else:
              f1, f2 = _row_factors(wbytes_n16, col_n16, h)
              w_nh = _decode_e2m1_f32(nib) * row(f1, tile_n) * row(f2, tile_n)
            w_smem[wg, h] = w_nh.astype(dtype)
          if mx_lhs:
            # MXFP8 activations: E4M3 code bytes → fp32 (exact), times the row's scale, rounded
            # to dtype in registers, where the wgmma reads them (its register A operand). The
            # bytes travel as uint8 and are bit-cast here (Pallas' GPU interpreter hangs on
            # float8 shared-memory tiles).
            a_lo, a_hi, a_scales = a_refs
            abytes_m16 = load(a_scales.at[:, pl.ds(0, 16)]).astype(jnp.int32)
            a_ops = []
            for h, a_ref in enumerate((a_lo, a_hi)):
              f1, f2 = _row_factors(abytes_m16, col_iota(tile_m), h)
              codes_mh = (a_ref[...] if interpret
                          else plgpu.load(a_ref, (), layout=plgpu.Layout.WGMMA))
              e4m3_mh = lax.bitcast_convert_type(codes_mh, jnp.float8_e4m3fn)
              a_ops.append((e4m3_mh.astype(jnp.float32) * row(f1, tile_m) * row(f2, tile_m)
                            ).astype(dtype))
          else:
            a_ops = a_refs
          plgpu.commit_smem()
          for h in range(2):
            plgpu.wgmma(acc_ref, a_ops[h], plgpu.transpose_ref(w_smem.at[wg, h], (1, 0)))
          plgpu.wgmma_wait(0)       # w_smem is rewritten by the next step
          return acc_ref

        @pl.when((vsize > 0) & jnp.logical_not(is_tail))
        def _():
          gid_c = jnp.minimum(gid, g - 1)
          rhs_view = rhs_ref.at[gid_c, pl.ds(ni * cta_n, cta_n), :]
          pipeline(mma, context)(*lhs_views(tstart), rhs_view, allocations=allocs)

        @pl.when((vsize > 0) & is_tail & (wg < _NUM_COMPUTE_WGS))
        def _():
          store(None)

      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  out = plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct((m_p, n), dtype),
      grid=(_num_sms(interpret),), grid_names=("sm",), num_threads=_NUM_COMPUTE_WGS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=_interpret_params(interpret),
  )(sched.group_id, sched.tile_start, sched.valid_start, sched.valid_size, *lhs_ops, rhs_k)
  return out[:m] if pad else out


def gmm_mx_mgpu(lhs_mk: jax.Array, rhs_packed_gnh: jax.Array, rhs_scales_gnb: jax.Array,
                group_sizes_g: jax.Array, *, config: MgpuConfig = MgpuConfig(),
                interpret: bool = False) -> jax.Array:
  """out [M, N] (lhs dtype) = ragged_dot(lhs, deq(rhs)), rhs MXFP4 dequantised in the kernel.

  rhs: packed uint8 [G, N, K/2] and E8M0 bytes [G, N, K/32] in the release layout
  (mx_operands.py). The launcher rearranges them into one uint8 operand (`_kernel_rhs`: per
  weight row and K-step of tile_k = 64, 32 code bytes whose low nibbles are MX block 2kk and
  high nibbles block 2kk + 1, then the two scale bytes). Per pipeline step the producer loads a
  [2·tile_n, 64]-byte tile by TMA; a consumer warpgroup reads its [tile_n, 32] code bytes and
  [tile_n, 16] scale bytes into registers, takes each row's two scale bytes (a masked row sum),
  decodes the nibbles to fp32 E2M1 · 2^(byte − 127) (NaN for byte 255), writes the two
  [tile_n, 32] halves of the weight tile to shared memory in the lhs dtype and issues one wgmma
  per half against the matching half of the lhs tile (two [tile_m, 32] TMA tiles). The decode
  is `config.e2m1_decode`: "select" converts the E2M1 fields to fp32 and multiplies by two exact
  power-of-two factors; "bits" builds the fp32 bits by integer ops (`_decode_e2m1_bits`), the
  same values, values below 2^-126 flushed to ±0 as `mx.dequantize` gives them. Row schedule,
  ragged TMA-store epilogue and tail zeros are gmm_mgpu's. `gmm_mx_mgpu_mxfp8` is the same
  kernel reading the activations as MXFP8.
  """
  m, k = lhs_mk.shape
  g, n, k_half = rhs_packed_gnh.shape
  _check(k_half * 2 == k and rhs_scales_gnb.shape == (g, n, k // MX_BLOCK),
         f"gmm_mx_mgpu: lhs {lhs_mk.shape}, rhs_packed {rhs_packed_gnh.shape} and rhs_scales "
         f"{rhs_scales_gnb.shape} disagree")
  _check_mx_config(config, k, n, lhs_mk.dtype, "gmm_mx_mgpu")
  return _gmm_mx_call((lhs_mk,), _kernel_rhs(rhs_packed_gnh, rhs_scales_gnb), group_sizes_g,
                      num_groups=g, n=n, dtype=lhs_mk.dtype, config=config, interpret=interpret)


def gmm_mx_mgpu_mxfp8(lhs_codes_mk: jax.Array, lhs_scales_mb: jax.Array,
                      rhs_packed_gnh: jax.Array, rhs_scales_gnb: jax.Array,
                      group_sizes_g: jax.Array, *, dtype=jnp.bfloat16,
                      config: MgpuConfig = MgpuConfig(), interpret: bool = False) -> jax.Array:
  """out [M, N] (dtype) = ragged_dot(deq(lhs), deq(rhs)), both operands decoded in the kernel.

  lhs: MXFP8, E4M3 codes [M, K] (float8_e4m3fn, or their uint8 bit patterns) and E8M0 bytes
  [M, K/32]; rhs: MXFP4 in the release layout, as for `gmm_mx_mgpu`. The codes are read by TMA
  as they are, as two [tile_m, 32]-byte tiles per K-step of 64 (one MX block each, 32-byte
  swizzle), 1 byte per element against bf16's 2; the scale bytes travel as a third small
  operand (`_kernel_lhs_scales`: 32 bytes per row and K-step, 2 of them used), so 1.5 bytes
  per activation element in all.

  Decoding, per consumer warpgroup and K-step half h (= MX block 2kk + h): the [tile_m, 32]
  codes are loaded into registers in the wgmma layout and converted E4M3 → fp32 (on hardware
  the cvt E4M3x2 → f16x2 conversion, exact for every code, subnormals included, then f16 →
  fp32, exact), multiplied by the row's 2^(byte − 127) as two normal power-of-two factors, and
  rounded to dtype; the wgmma then takes them as its register A operand. The factors and their
  order are mx_operands.dequantize_lhs's, so both give the same values. For bf16 (and fp32)
  the decoded value is exact whenever it is zero or a normal number (2^-126 ≤ |v| < 2^128):
  an E4M3 value has at most 4 significant bits, a power-of-two scale keeps them, and bf16 has
  8 and the exponent range of fp32; the two factors are each normal for every byte 0–254, so
  no intermediate product leaves that range when the result does not. Values below 2^-126
  (only with scale bytes below 10) are subnormal and may round or flush to zero. Scale byte
  255 decodes its block to NaN (f1 is NaN for that row and block). dtype f16 is allowed but
  its range is much narrower than an MXFP8 tensor's.

  Shared memory with the default tiles (tile_m = tile_n = 128, tile_k = 64, 3 stages): per
  stage 8 KiB codes + 4 KiB activation scales + 16 KiB weights, plus 64 KiB epilogue staging
  and 32 KiB decoded weight halves: 180 KiB (4 stages: 208 KiB) of the H100/H200's 227 KiB.
  """
  m, k = lhs_codes_mk.shape
  g, n, k_half = rhs_packed_gnh.shape
  dtype = jnp.dtype(dtype)
  _check(lhs_codes_mk.dtype in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.uint8)),
         f"gmm_mx_mgpu_mxfp8: lhs codes must be float8_e4m3fn or uint8, got {lhs_codes_mk.dtype}")
  _check(lhs_scales_mb.shape == (m, k // MX_BLOCK) and lhs_scales_mb.dtype == jnp.uint8,
         f"gmm_mx_mgpu_mxfp8: lhs scales must be uint8 [{m}, {k // MX_BLOCK}], got "
         f"{lhs_scales_mb.dtype}{list(lhs_scales_mb.shape)}")
  _check(k_half * 2 == k and rhs_scales_gnb.shape == (g, n, k // MX_BLOCK),
         f"gmm_mx_mgpu_mxfp8: lhs {lhs_codes_mk.shape}, rhs_packed {rhs_packed_gnh.shape} and "
         f"rhs_scales {rhs_scales_gnb.shape} disagree")
  _check(dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)),
         f"gmm_mx_mgpu_mxfp8: dtype must be bf16, f16 or f32, got {dtype}")
  _check_mx_config(config, k, n, dtype, "gmm_mx_mgpu_mxfp8")
  codes = lax.bitcast_convert_type(lhs_codes_mk, jnp.uint8)   # the bit patterns; no copy
  return _gmm_mx_call((codes, _kernel_lhs_scales(lhs_scales_mb)),
                      _kernel_rhs(rhs_packed_gnh, rhs_scales_gnb), group_sizes_g, num_groups=g,
                      n=n, dtype=dtype, config=config, interpret=interpret)


def gmm_mx_pallas_gpu_forward(lhs_codes, lhs_scales, rhs_packed, rhs_scales, group_sizes_g,
                              dtype, *, lhs_decode: str = "kernel",
                              config: MgpuConfig = DEFAULT_CONFIG,
                              interpret: bool = False) -> jax.Array:
  """Forward of `gmm_mx` on Mosaic GPU (operand layout: mx_operands.py). The MXFP4 weights are
  always decoded in the kernel; the MXFP8 activations by the kernel too (lhs_decode="kernel",
  `gmm_mx_mgpu_mxfp8`: 1 byte per activation element read) or dequantised in XLA first
  (lhs_decode="xla", `gmm_mx_mgpu` on bf16 activations; an elementwise pass that can fuse with
  their quantisation)."""
  if lhs_decode == "kernel":
    return gmm_mx_mgpu_mxfp8(lhs_codes, lhs_scales, rhs_packed, rhs_scales, group_sizes_g,
                             dtype=dtype, config=config, interpret=interpret)
  if lhs_decode != "xla":
    raise ValueError(f"lhs_decode must be 'kernel' or 'xla', got {lhs_decode!r}")
  lhs = mx_operands.dequantize_lhs(lhs_codes, lhs_scales, dtype)
  return gmm_mx_mgpu(lhs, rhs_packed, rhs_scales, group_sizes_g, config=config,
                     interpret=interpret)
