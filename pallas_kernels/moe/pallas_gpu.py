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
  runs the two kernels above on the dequantised operands). It is tested in interpret mode and
  lowered to Mosaic GPU (layout inference included) on CPU; it has not run on a GPU.

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

from pallas_kernels.moe import mx_operands
from pallas_kernels.moe.schedule import group_bounds, row_schedule
from pallas_kernels.moe.vjp import differentiable_gmm

_NUM_COMPUTE_WGS = 2


@dataclasses.dataclass(frozen=True)
class MgpuConfig:
  """Tile sizes of the Mosaic GPU kernels (a CTA covers [tile_m, 2·tile_n] of the output)."""
  tile_m: int = 128        # rows of one work item (gmm) / K-rows of the output tile (tgmm)
  tile_n: int = 128        # output columns per consumer warpgroup
  tile_k: int = 64         # reduction step (K for gmm, rows for tgmm)
  stages: int = 3          # shared-memory pipeline depth (3 x 48 KiB + 64 KiB epilogue fits 227 KiB)
  epi_n: int = 64          # epilogue column chunk (shared-memory staging of the output)
  grid_minor: int = 0      # planar-snake minor dimension of the (m-item, n-tile) grid (0 = m)
  grid_width: int = 8      # planar-snake band width
  align: int = 8           # row alignment of gmm tile starts


def _num_sms(interpret: bool) -> int:
  if interpret:
    return 2
  return jax.devices()[0].core_count


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
        mi, ni = plgpu.planar_snake(lin, (num_items, n_iters), cfg.grid_minor, cfg.grid_width)
        gid = gid_ref[mi]
        tstart = pl.multiple_of(tstart_ref[mi], min(cfg.align, 8))
        vstart = vstart_ref[mi]
        vsize = vsize_ref[mi]
        is_tail = gid >= g
        col0 = ni * cta_n + wg * tile_n

        def store(acc_mn):  # acc_mn: [tile_m, tile_n] in dtype, or None for zeros
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          for c in range(tile_n // epi_n):
            slot = c % 2
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            if acc_mn is None:
              out_smem[wg, slot] = jnp.zeros((tile_m, epi_n), dtype)
            else:
              out_smem[wg, slot] = acc_mn[:, c * epi_n:(c + 1) * epi_n]
            plgpu.commit_smem()
            _ragged_store(out_smem.at[wg, slot], out_ref, tstart, vstart, vsize, tile_m,
                          pl.ds(col0 + c * epi_n, epi_n))

        def context(run_pipeline):
          @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
          def _(acc_ref):
            run_pipeline(acc_ref)
            store(acc_ref[...].astype(dtype))

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
_MX_ROW_BYTES = 48   # per weight row and K-step of 64: 32 code bytes, 2 scale bytes, 14 zero bytes


def _kernel_rhs(rhs_packed_gnh: jax.Array, rhs_scales_gnb: jax.Array) -> jax.Array:
  """Release MXFP4 (codes [G, N, K/2], scale bytes [G, N, K/32]) → the kernel's operand, uint8
  [G, N, K/64 · 48]: for every weight row and K-step of 64 elements, 32 code bytes in which byte
  j holds element j (low nibble) and element 32 + j (high nibble), so the two nibbles decode to
  the step's two MX blocks without an interleave, then the two blocks' scale bytes, then zeros
  (a TMA row is a multiple of 16 bytes). 6 bits per weight element in all, against 16 for bf16;
  one XLA pass over the packed bytes."""
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


def gmm_mx_mgpu(lhs_mk: jax.Array, rhs_packed_gnh: jax.Array, rhs_scales_gnb: jax.Array,
                group_sizes_g: jax.Array, *, config: MgpuConfig = MgpuConfig(),
                interpret: bool = False) -> jax.Array:
  """out [M, N] (lhs dtype) = ragged_dot(lhs, deq(rhs)), rhs MXFP4 dequantised in the kernel.

  rhs: packed uint8 [G, N, K/2] and E8M0 bytes [G, N, K/32] in the release layout
  (mx_operands.py). The launcher rearranges them into one uint8 operand (`_kernel_rhs`: per
  weight row and K-step of tile_k = 64, 32 code bytes whose low nibbles are MX block 2kk and
  high nibbles block 2kk + 1, then the two scale bytes). Per pipeline step the producer loads a
  [2·tile_n, 48]-byte tile by TMA; a consumer warpgroup reads its [tile_n, 48] rows into
  registers, decodes the nibbles to fp32 E2M1 values, takes each row's two scale bytes (a masked
  row sum), multiplies by 2^(byte − 127) as two exact power-of-two factors (NaN for byte 255),
  writes the two [tile_n, 32] halves of the weight tile to shared memory in the lhs dtype and
  issues one wgmma per half against the matching half of the lhs tile (two [tile_m, 32] TMA
  tiles). Row schedule, ragged TMA-store epilogue and tail zeros are gmm_mgpu's.
  """
  cfg = config
  m, k = lhs_mk.shape
  g, n, k_half = rhs_packed_gnh.shape
  cta_n = _NUM_COMPUTE_WGS * cfg.tile_n
  half = cfg.tile_k // 2
  dtype = lhs_mk.dtype
  _check(cfg.tile_k == 2 * MX_BLOCK, f"gmm_mx_mgpu: tile_k must be {2 * MX_BLOCK} (two MX blocks "
         f"per step), got {cfg.tile_k}")
  _check(k_half * 2 == k and rhs_scales_gnb.shape == (g, n, k // MX_BLOCK),
         f"gmm_mx_mgpu: lhs {lhs_mk.shape}, rhs_packed {rhs_packed_gnh.shape} and rhs_scales "
         f"{rhs_scales_gnb.shape} disagree")
  _check(k % cfg.tile_k == 0, f"gmm_mx_mgpu: K={k} must be a multiple of tile_k={cfg.tile_k}")
  _check(n % cta_n == 0, f"gmm_mx_mgpu: N={n} must be a multiple of 2*tile_n={cta_n}")
  _check(cfg.tile_n % cfg.epi_n == 0, "gmm_mx_mgpu: tile_n must be a multiple of epi_n")
  _check(cfg.epi_n * jnp.dtype(dtype).itemsize % 128 == 0,
         "gmm_mx_mgpu: epi_n rows must be 128-byte multiples (TMA stores start at any row)")
  rhs_k = _kernel_rhs(rhs_packed_gnh, rhs_scales_gnb)
  pad = max(cfg.tile_m, -(-m // 8) * 8) - m
  if pad:
    lhs_mk = jnp.pad(lhs_mk, ((0, pad), (0, 0)))
  m_p = m + pad
  sched = row_schedule(group_sizes_g, m_p, cfg.tile_m, align=cfg.align)
  num_items = sched.group_id.shape[0]
  n_iters, k_iters = n // cta_n, k // cfg.tile_k
  a_tf = _swizzled(half, dtype)
  w_tf = _swizzled(half, dtype)
  out_tf = _swizzled(cfg.epi_n, dtype, tiling_rows=1)
  tile_m, tile_n, epi_n = cfg.tile_m, cfg.tile_n, cfg.epi_n

  def pipeline(body, context):
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(k_iters,), memory_registers=40,
        in_specs=[
            plgpu.BlockSpec((tile_m, half), lambda kk: (0, 2 * kk), transforms=a_tf,
                            memory_space=plgpu.SMEM),
            plgpu.BlockSpec((tile_m, half), lambda kk: (0, 2 * kk + 1), transforms=a_tf,
                            memory_space=plgpu.SMEM),
            plgpu.BlockSpec((cta_n, _MX_ROW_BYTES), lambda kk: (0, kk),
                            memory_space=plgpu.SMEM)],
        wg_axis="wg", num_compute_wgs=_NUM_COMPUTE_WGS, max_concurrent_steps=cfg.stages,
        compute_context=context)

  def kernel(gid_ref, tstart_ref, vstart_ref, vsize_ref, lhs_ref, rhs_ref, out_ref):
    ignore = lambda *_, **__: None
    lhs_view0 = lhs_ref.at[pl.ds(0, tile_m), :]

    @functools.partial(
        pl.run_scoped,
        allocs=pipeline(ignore, ignore).get_allocations(
            lhs_view0, lhs_view0, rhs_ref.at[0, pl.ds(0, cta_n), :]),
        out_smem=plgpu.SMEM((_NUM_COMPUTE_WGS, 2, tile_m, epi_n), dtype, transforms=out_tf),
        w_smem=plgpu.SMEM((_NUM_COMPUTE_WGS, 2, tile_n, half), dtype, transforms=w_tf),
        collective_axes="wg")
    def scope(allocs, out_smem, w_smem):
      wg = lax.axis_index("wg")

      @plgpu.nd_loop((num_items * n_iters,), collective_axes="sm")
      def item_loop(info):
        (lin,) = info.index
        mi, ni = plgpu.planar_snake(lin, (num_items, n_iters), cfg.grid_minor, cfg.grid_width)
        gid = gid_ref[mi]
        tstart = pl.multiple_of(tstart_ref[mi], min(cfg.align, 8))
        vstart = vstart_ref[mi]
        vsize = vsize_ref[mi]
        is_tail = gid >= g
        col0 = ni * cta_n + wg * tile_n

        def store(acc_mn):  # acc_mn: [tile_m, tile_n] in dtype, or None for zeros
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          for c in range(tile_n // epi_n):
            slot = c % 2
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            if acc_mn is None:
              out_smem[wg, slot] = jnp.zeros((tile_m, epi_n), dtype)
            else:
              out_smem[wg, slot] = acc_mn[:, c * epi_n:(c + 1) * epi_n]
            plgpu.commit_smem()
            _ragged_store(out_smem.at[wg, slot], out_ref, tstart, vstart, vsize, tile_m,
                          pl.ds(col0 + c * epi_n, epi_n))

        def context(run_pipeline):
          @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
          def _(acc_ref):
            run_pipeline(acc_ref)
            store(acc_ref[...].astype(dtype))

        def mma(_, a_lo, a_hi, r_smem, acc_ref):
          own = pl.ds(wg * tile_n, tile_n)
          codes_ref, scale_ref = r_smem.at[own, pl.ds(0, half)], r_smem.at[own, pl.ds(half, 16)]
          if interpret:
            codes_nh, bytes_n16 = codes_ref[...], scale_ref[...]
            col = lax.broadcasted_iota(jnp.int32, (tile_n, 16), 1)
          else:            # decode in the wgmma register layout; row values broadcast along K
            codes_nh = plgpu.load(codes_ref, (), layout=plgpu.Layout.WGMMA, optimized=False)
            bytes_n16 = plgpu.load(scale_ref, (), layout=plgpu.Layout.WGMMA, optimized=False)
            col = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (tile_n, 16), 1),
                                    plgpu.Layout.WGMMA)
          codes_nh = codes_nh.astype(jnp.int32)     # Mosaic GPU: 8-bit types only bitwise
          bytes_n16 = bytes_n16.astype(jnp.int32)
          row = lambda v: lax.broadcast_in_dim(v, (tile_n, half), [0])
          for h, nib in enumerate((codes_nh & 15, (codes_nh >> 4) & 15)):  # blocks 2kk, 2kk+1
            byte_n = jnp.sum(jnp.where(col == h, bytes_n16, 0), axis=1)     # [tile_n] int32
            f1, f2 = _pow2_factors(byte_n)
            w_nh = _decode_e2m1_f32(nib) * row(f1) * row(f2)
            w_nh = jnp.where(row(byte_n) == 255, jnp.nan, w_nh)
            w_smem[wg, h] = w_nh.astype(dtype)
          plgpu.commit_smem()
          for h, a_smem in enumerate((a_lo, a_hi)):
            plgpu.wgmma(acc_ref, a_smem, plgpu.transpose_ref(w_smem.at[wg, h], (1, 0)))
          plgpu.wgmma_wait(0)       # w_smem is rewritten by the next step
          return acc_ref

        @pl.when((vsize > 0) & jnp.logical_not(is_tail))
        def _():
          gid_c = jnp.minimum(gid, g - 1)
          lhs_view = lhs_ref.at[pl.ds(tstart, tile_m), :]
          rhs_view = rhs_ref.at[gid_c, pl.ds(ni * cta_n, cta_n), :]
          pipeline(mma, context)(lhs_view, lhs_view, rhs_view, allocations=allocs)

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
  )(sched.group_id, sched.tile_start, sched.valid_start, sched.valid_size, lhs_mk, rhs_k)
  return out[:m] if pad else out


def gmm_mx_pallas_gpu_forward(lhs_codes, lhs_scales, rhs_packed, rhs_scales, group_sizes_g,
                              dtype, *, config: MgpuConfig = DEFAULT_CONFIG,
                              interpret: bool = False) -> jax.Array:
  """Forward of `gmm_mx` on Mosaic GPU (operand layout: mx_operands.py): the MXFP8 activations
  are dequantised in XLA (an elementwise pass that fuses with their quantisation) and the MXFP4
  weights in the kernel (`gmm_mx_mgpu`)."""
  lhs = mx_operands.dequantize_lhs(lhs_codes, lhs_scales, dtype)
  return gmm_mx_mgpu(lhs, rhs_packed, rhs_scales, group_sizes_g, config=config,
                     interpret=interpret)
