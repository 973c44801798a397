"""The "pallas_tpu" gmm backend: Mosaic TPU `pallas_call` kernels behind a custom_vjp.

Two kernels, both driven by a row-tile schedule (`schedule.row_schedule` with align == tile_m, so
every tile starts at a whole block) that is scalar-prefetched into SMEM and read by the index maps:

* `gmm_tpu`  out[M, N] = lhs[M, K] · rhs[g] for the rows of group g (ragged_dot semantics).
  Grid (n_tiles, items, k_tiles), reduction innermost into a [tile_m, tile_n] fp32 VMEM
  accumulator. An item multiplies its whole row tile by its group's matrix and, at the last K
  step, writes only its group's rows into the output block by a select; the items that share one
  output tile (a tile straddling group boundaries) are consecutive, so that block stays resident
  in VMEM until all of them have written their rows. Tail items (rows past sum(group_sizes),
  group id G) skip the matmul and write zeros. `transpose_rhs=True` multiplies by rhs[g]ᵀ with
  rhs given as [G, N, K] (the dlhs of gmm, no transpose materialised).
* `tgmm_tpu` out[G, K, N] = Σ_{rows r of g} lhs[r]ᵀ · dout[r] (the drhs of gmm). Grid
  (k_tiles, n_tiles, items), the items innermost: the accumulator is zeroed at a group's first
  item and stored at its last; rows of an item outside its group are zeroed by a select in both
  operands (so inf/NaN in rows past sum(group_sizes) or in a neighbouring group cannot leak in).
  Every group, empty ones included, owns at least one item (empty groups get one that stores
  zeros), so every output block is written without an extra pass over [G, K, N].

Both grids have M/tile_m + G items (a static bound), so a row tile costs ~G·tile_m/M of extra
matmul work at group boundaries: with many local experts and few rows, a smaller tile_m pays.

M is zero-padded to a multiple of the row tile (and the result sliced), so no block reads past
the arrays. Block shapes follow the TPU (8, 128) rule: the row tile is a multiple of 8, the K and
N tiles multiples of 128 or the whole dimension, and they must divide K and N (checked, with an
error naming the dimension). On CPU the kernels run in Pallas' TPU interpret mode.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.moe.schedule import RowSchedule, row_schedule
from pallas_kernels.moe.vjp import differentiable_gmm


@dataclasses.dataclass(frozen=True)
class TpuGmmConfig:
  """Tile sizes (upper bounds: a tile larger than its dimension shrinks to the dimension).

  512³ bf16 tiles use ~4 MiB of VMEM with double buffering (fp32: ~7 MiB), inside the default
  16 MiB scoped-VMEM limit of v5p, and keep the 128-wide MXU busy with few grid steps.
  """
  tile_m: int = 512        # rows of one work item (gmm, tgmm)
  tile_k: int = 512        # contraction step of gmm / K rows of a tgmm output block
  tile_n: int = 512        # output columns of a gmm block / N columns of a tgmm output block

  def __post_init__(self):
    if self.tile_m <= 0 or self.tile_m % 8:
      raise ValueError(f"TpuGmmConfig: tile_m={self.tile_m} must be a positive multiple of 8 "
                       "(TPU sublane tiling)")
    for name in ("tile_k", "tile_n"):
      value = getattr(self, name)
      if value <= 0 or value % 128:
        raise ValueError(f"TpuGmmConfig: {name}={value} must be a positive multiple of 128 "
                         "(TPU lane tiling)")


DEFAULT_CONFIG = TpuGmmConfig()


def _lane_tile(dim_name: str, dim: int, tile_name: str, tile: int) -> int:
  """The tile used along a lane-mapped dimension: `tile`, or the whole dim when it is smaller."""
  eff = min(tile, dim)
  if dim % eff or (eff % 128 and eff != dim):
    raise ValueError(f"pallas_tpu gmm: {dim_name}={dim} must be a multiple of {tile_name}={tile} "
                     f"(or smaller than it); pick another tile or use backend 'ragged_dot'")
  return eff


def _row_tile(num_rows: int, dtype, tile_m: int) -> int:
  """tile_m, or fewer rows (a multiple of the dtype's sublane packing) when M is small."""
  packing = 8 * max(1, 4 // jnp.dtype(dtype).itemsize)
  return min(tile_m, -(-num_rows // packing) * packing)


def supports(lhs_shape, rhs_shape, dtype, config: TpuGmmConfig = DEFAULT_CONFIG) -> bool:
  """Whether the kernels tile these shapes in all three passes (fwd, dlhs, drhs) and this dtype.

  The dlhs pass swaps the roles of K and N (contraction N, output K), so each of K and N must
  tile with both tile_k and tile_n.
  """
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
    return False
  (m, k), (g, _, n) = lhs_shape, rhs_shape
  try:
    for dim_name, dim in (("K", k), ("N", n)):
      for tile_name in ("tile_k", "tile_n"):
        _lane_tile(dim_name, dim, tile_name, getattr(config, tile_name))
  except ValueError:
    return False
  return m > 0 and g > 0


def _pad_rows(x_mc: jax.Array, num_rows: int) -> jax.Array:
  return x_mc if x_mc.shape[0] == num_rows else jnp.pad(x_mc, ((0, num_rows - x_mc.shape[0]),
                                                               (0, 0)))


def _interpret_arg(interpret):
  """False (compile for TPU), or TPU interpret-mode params (True → default InterpretParams)."""
  if interpret is True:
    return pltpu.InterpretParams()
  return interpret


def _schedule_arrays(sched: RowSchedule, tile_m: int) -> tuple[jax.Array, ...]:
  """(group_id, row block, valid_start, valid_size), each int32 [items], for scalar prefetch."""
  return (sched.group_id, sched.tile_start // tile_m, sched.valid_start, sched.valid_size)


def _kept_rows(shape, valid_start, valid_size):
  """bool `shape`: rows [valid_start, valid_start + valid_size) of a tile."""
  rows = lax.broadcasted_iota(jnp.int32, shape, 0)
  return (rows >= valid_start) & (rows < valid_start + valid_size)


def _precision(dtype):
  # fp32 operands are multiplied in full fp32 precision (the fp32 path exists for exactness).
  return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


# ------------------------------------------------------------------------------------------ gmm

def _gmm_kernel(gid_ref, blk_ref, vstart_ref, vsize_ref, lhs_ref, rhs_ref, out_ref, acc_ref, *,
                num_groups: int, transpose_rhs: bool, k_tiles: int):
  """One grid step (n tile, item, k step): lhs_ref [tm, tk], rhs_ref [tk, tn] (or [tn, tk]),
  out_ref [tm, tn] (resident over the item's K steps and over items sharing the row tile).
  Grid extents come in as static arguments, not pl.num_programs: jax 0.11.0–0.11.2 reuse a
  kernel's traced jaxpr across grids, so num_programs can report an earlier call's grid
  (jax-ml/jax#40847)."""
  del blk_ref  # used by the index maps only
  item, k_step = pl.program_id(1), pl.program_id(2)
  is_group = gid_ref[item] < num_groups            # else a tail item: zeros, no matmul

  @pl.when(is_group)
  def _accumulate():
    @pl.when(k_step == 0)
    def _zero():
      acc_ref[...] = jnp.zeros_like(acc_ref)

    contract = ((1,), (1,)) if transpose_rhs else ((1,), (0,))
    acc_ref[...] += lax.dot_general(lhs_ref[...], rhs_ref[...], (contract, ((), ())),
                                    precision=_precision(lhs_ref.dtype),
                                    preferred_element_type=jnp.float32)

  def store_rows(value_mn):
    # Only the item's rows change; the rest of the resident block belongs to neighbouring items.
    keep_mn = _kept_rows(out_ref.shape, vstart_ref[item], vsize_ref[item])
    out_ref[...] = jnp.where(keep_mn, value_mn.astype(out_ref.dtype), out_ref[...])

  last_k = k_step == k_tiles - 1

  @pl.when(last_k & is_group)
  def _store_product():
    store_rows(acc_ref[...])

  @pl.when(last_k & jnp.logical_not(is_group))
  def _store_zeros():
    store_rows(jnp.zeros(out_ref.shape, jnp.float32))


def gmm_tpu(lhs_mk: jax.Array, rhs_gkn: jax.Array, group_sizes_g: jax.Array, *,
            transpose_rhs: bool = False, config: TpuGmmConfig = DEFAULT_CONFIG,
            interpret=False) -> jax.Array:
  """out [M, N] (lhs dtype) = ragged_dot(lhs, rhs) — or with rhs[g]ᵀ if transpose_rhs.

  rhs_gkn is [G, K, N], or [G, N, K] when transpose_rhs (the gmm's own weights, for dlhs).
  lhs and rhs must share a dtype. `interpret`: False on TPU; True or a pltpu.InterpretParams to
  run Pallas' TPU interpreter (CPU tests).
  """
  m, k = lhs_mk.shape
  num_groups = rhs_gkn.shape[0]
  n, k_rhs = rhs_gkn.shape[1:] if transpose_rhs else rhs_gkn.shape[:0:-1]
  if lhs_mk.dtype != rhs_gkn.dtype:
    raise ValueError(f"gmm_tpu: lhs and rhs dtypes differ ({lhs_mk.dtype}, {rhs_gkn.dtype})")
  if k != k_rhs or group_sizes_g.shape != (num_groups,):
    raise ValueError(f"gmm_tpu: shapes disagree: lhs {lhs_mk.shape}, rhs {rhs_gkn.shape} "
                     f"(transpose_rhs={transpose_rhs}), group_sizes {group_sizes_g.shape}")
  tk = _lane_tile("K (contraction)", k, "tile_k", config.tile_k)
  tn = _lane_tile("N (output columns)", n, "tile_n", config.tile_n)
  if m == 0 or num_groups == 0:
    return jnp.zeros((m, n), lhs_mk.dtype)
  tm = _row_tile(m, lhs_mk.dtype, config.tile_m)
  m_pad = -(-m // tm) * tm
  sched = row_schedule(group_sizes_g, m_pad, tm, align=tm)
  num_items = sched.group_id.shape[0]
  k_tiles = k // tk

  def k_of(i, kk, gid_ref):
    # Tail items do no matmul: hold their input blocks at the last K step (no refetch per step).
    return jnp.where(gid_ref[i] < num_groups, kk, k_tiles - 1)

  def lhs_map(j, i, kk, gid_ref, blk_ref, *_):
    return blk_ref[i], k_of(i, kk, gid_ref)

  def rhs_map(j, i, kk, gid_ref, *_):
    g = jnp.minimum(gid_ref[i], num_groups - 1)
    kb = k_of(i, kk, gid_ref)
    return (g, j, kb) if transpose_rhs else (g, kb, j)

  rhs_block = (pl.Squeezed(), tn, tk) if transpose_rhs else (pl.Squeezed(), tk, tn)
  itemsize = jnp.dtype(lhs_mk.dtype).itemsize
  call = pl.pallas_call(
      functools.partial(_gmm_kernel, num_groups=num_groups, transpose_rhs=transpose_rhs,
                        k_tiles=k_tiles),
      out_shape=jax.ShapeDtypeStruct((m_pad, n), lhs_mk.dtype),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=4,
          grid=(n // tn, num_items, k_tiles),
          in_specs=[pl.BlockSpec((tm, tk), lhs_map), pl.BlockSpec(rhs_block, rhs_map)],
          out_specs=pl.BlockSpec((tm, tn), lambda j, i, kk, gid_ref, blk_ref, *_: (blk_ref[i], j)),
          scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)]),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "arbitrary", "arbitrary")),
      cost_estimate=pl.CostEstimate(
          flops=2 * m_pad * k * n, transcendentals=0,
          bytes_accessed=itemsize * (m_pad * k * (n // tn) + num_groups * k * n + m_pad * n)),
      interpret=_interpret_arg(interpret),
  )
  out_mn = call(*_schedule_arrays(sched, tm), _pad_rows(lhs_mk, m_pad), rhs_gkn)
  return out_mn[:m]


# ----------------------------------------------------------------------------------------- tgmm

def tgmm_schedule(group_sizes_g: jax.Array, num_rows: int, tile: int) -> RowSchedule:
  """row_schedule(…, align=tile) plus one empty item (valid_size 0) per empty group, in order.

  Items stay sorted by group and every group g < G owns ≥ 1 item, so the tgmm kernel stores every
  output block (an empty group's is zeros). The static item count stays max_items(num_rows, G,
  tile, tile) = num_rows/tile + G: the S non-empty row ranges (groups and tail) touch at most
  num_rows/tile + S - 1 tiles, and the G + 1 - S empty ones add one item each except the tail.
  Only unused items (group G, no rows) fall past the end.
  """
  num_groups = group_sizes_g.shape[0]
  base = row_schedule(group_sizes_g, num_rows, tile, align=tile)
  base_items = num_items = base.group_id.shape[0]
  count_h = jnp.zeros((num_groups + 1,), jnp.int32).at[base.group_id].add(1)  # h: groups + tail
  base_start_h = jnp.cumsum(count_h) - count_h
  slots_h = count_h.at[:num_groups].max(1)
  slot_end_h = jnp.cumsum(slots_h)
  idx_i = jnp.arange(num_items, dtype=jnp.int32)
  gid_i = jnp.minimum(jnp.sum(slot_end_h[None, :] <= idx_i[:, None], axis=1), num_groups)
  src_i = base_start_h[gid_i] + idx_i - (slot_end_h - slots_h)[gid_i]   # item in `base`
  real_i = (src_i < base_items) & (idx_i - (slot_end_h - slots_h)[gid_i] < count_h[gid_i])
  src_i = jnp.clip(src_i, 0, base_items - 1)
  return RowSchedule(group_id=gid_i.astype(jnp.int32), tile_start=base.tile_start[src_i],
                     valid_start=jnp.where(real_i, base.valid_start[src_i], 0),
                     valid_size=jnp.where(real_i, base.valid_size[src_i], 0))


def _tgmm_kernel(gid_ref, blk_ref, vstart_ref, vsize_ref, lhs_ref, dout_ref, out_ref, acc_ref, *,
                 num_groups: int, num_items: int):
  """One grid step (k tile, n tile, item): lhs_ref [tm, tk], dout_ref [tm, tn] → out_ref [tk, tn]
  of the item's group (resident over the group's consecutive items). num_items: the grid's
  last extent, static (see _gmm_kernel)."""
  del blk_ref
  item = pl.program_id(2)
  gid = gid_ref[item]
  is_group = gid < num_groups                      # tail items add nothing and store nothing
  first = (item == 0) | (gid_ref[jnp.maximum(item - 1, 0)] != gid)
  last = (item == num_items - 1) | (gid_ref[jnp.minimum(item + 1, num_items - 1)] != gid)
  valid_start, valid_size = vstart_ref[item], vsize_ref[item]

  @pl.when(is_group & first)
  def _zero():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  @pl.when(is_group & (valid_size > 0))
  def _accumulate():
    # Rows outside the item's group are selected away in both operands (0·NaN would be NaN).
    lhs_mk = lhs_ref[...]
    dout_mn = dout_ref[...]
    lhs_mk = jnp.where(_kept_rows(lhs_mk.shape, valid_start, valid_size), lhs_mk, 0)
    dout_mn = jnp.where(_kept_rows(dout_mn.shape, valid_start, valid_size), dout_mn, 0)
    acc_ref[...] += lax.dot_general(lhs_mk, dout_mn, (((0,), (0,)), ((), ())),
                                    precision=_precision(lhs_mk.dtype),
                                    preferred_element_type=jnp.float32)

  @pl.when(is_group & last)
  def _store():
    out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def tgmm_tpu(lhs_mk: jax.Array, dout_mn: jax.Array, group_sizes_g: jax.Array, *,
             config: TpuGmmConfig = DEFAULT_CONFIG, interpret=False) -> jax.Array:
  """out [G, K, N] (lhs dtype) with out[g] = Σ_{rows r of g} lhs[r]ᵀ · dout[r] (fp32 sums).

  Rows at or past sum(group_sizes) contribute nothing, whatever they hold; empty groups give 0.
  """
  m, k = lhs_mk.shape
  n = dout_mn.shape[1]
  num_groups = group_sizes_g.shape[0]
  if lhs_mk.dtype != dout_mn.dtype:
    raise ValueError(f"tgmm_tpu: lhs and dout dtypes differ ({lhs_mk.dtype}, {dout_mn.dtype})")
  if dout_mn.shape[0] != m or group_sizes_g.ndim != 1:
    raise ValueError(f"tgmm_tpu: shapes disagree: lhs {lhs_mk.shape}, dout {dout_mn.shape}, "
                     f"group_sizes {group_sizes_g.shape}")
  tk = _lane_tile("K (drhs rows)", k, "tile_k", config.tile_k)
  tn = _lane_tile("N (drhs columns)", n, "tile_n", config.tile_n)
  if m == 0 or num_groups == 0:
    return jnp.zeros((num_groups, k, n), lhs_mk.dtype)
  tm = _row_tile(m, lhs_mk.dtype, config.tile_m)
  m_pad = -(-m // tm) * tm
  sched = tgmm_schedule(group_sizes_g, m_pad, tm)
  num_items = sched.group_id.shape[0]

  def out_map(kk, j, i, gid_ref, *_):
    # Tail items follow group G-1's items and keep its block resident (they store nothing).
    return jnp.minimum(gid_ref[i], num_groups - 1), kk, j

  itemsize = jnp.dtype(lhs_mk.dtype).itemsize
  call = pl.pallas_call(
      functools.partial(_tgmm_kernel, num_groups=num_groups, num_items=num_items),
      out_shape=jax.ShapeDtypeStruct((num_groups, k, n), lhs_mk.dtype),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=4,
          grid=(k // tk, n // tn, num_items),
          in_specs=[pl.BlockSpec((tm, tk), lambda kk, j, i, gid_ref, blk_ref, *_: (blk_ref[i], kk)),
                    pl.BlockSpec((tm, tn), lambda kk, j, i, gid_ref, blk_ref, *_: (blk_ref[i], j))],
          out_specs=pl.BlockSpec((pl.Squeezed(), tk, tn), out_map),
          scratch_shapes=[pltpu.VMEM((tk, tn), jnp.float32)]),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      cost_estimate=pl.CostEstimate(
          flops=2 * m_pad * k * n, transcendentals=0,
          bytes_accessed=itemsize * (m_pad * k * (n // tn) + m_pad * n * (k // tk)
                                     + num_groups * k * n)),
      interpret=_interpret_arg(interpret),
  )
  return call(*_schedule_arrays(sched, tm), _pad_rows(lhs_mk, m_pad), _pad_rows(dout_mn, m_pad))


# ------------------------------------------------------------------------------ custom_vjp wrapper

_gmm = differentiable_gmm(gmm_tpu, tgmm_tpu)


def gmm_pallas_tpu(lhs_mk: jax.Array, rhs_gkn: jax.Array, group_sizes_g: jax.Array, *,
                   config: TpuGmmConfig = DEFAULT_CONFIG, interpret=False) -> jax.Array:
  """ragged_dot(lhs, rhs, group_sizes) on the Mosaic TPU kernels, differentiable in lhs and rhs.

  Inputs are cast to their promoted dtype (the kernels take one dtype); the result has that dtype.
  """
  return _gmm(lhs_mk, rhs_gkn, group_sizes_g, config=config, interpret=interpret)
