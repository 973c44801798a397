"""Row-tile work schedule for grouped matmuls, computed from group_sizes (pure jnp, jit-safe).

A grouped matmul over rows sorted by group runs as a list of work items; item i multiplies the row
tile [tile_start[i], tile_start[i] + tile) by the matrix of group group_id[i] and keeps (stores)
only the rows [tile_start[i] + valid_start[i], … + valid_size[i]) that belong to that group. Every
row of [0, num_rows) is kept by exactly one item: rows of group g by g's items, and rows at or past
sum(group_sizes) by items of a virtual "tail" group with id G, whose kernels write zeros there
(ragged_dot semantics). Tiles of one group start at the group's first row rounded down to `align`
(a multiple of 8 keeps TMA/sublane-friendly offsets) and are clamped to end inside [0, num_rows),
so no tile reads out of bounds; the overlap a clamp causes is masked by valid_start/valid_size.

The schedule is shared by the Mosaic GPU kernels (pallas_gpu.py) and the Mosaic TPU kernels
(pallas_tpu.py, with align == tile so every tile is a whole block), so the CPU interpret-mode
tests check the same schedule logic the hardware kernels use.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class RowSchedule:
  """Per-item int32 arrays, each of shape [num_items] (see module docstring)."""
  group_id: jax.Array      # in [0, G]; G means the tail (rows in no group → zeros)
  tile_start: jax.Array    # first row of the item's tile, in [0, num_rows - tile]
  valid_start: jax.Array   # first kept row, relative to tile_start
  valid_size: jax.Array    # kept rows (0 for an unused item)


def max_items(num_rows: int, num_groups: int, tile: int, align: int) -> int:
  """A static upper bound on the items a schedule needs (groups incl. the tail = G + 1).

  Group g needs cdiv(size_g + misalign_g, tile) ≤ (size_g + align)/tile + 1 items, so the total is
  at most (num_rows + (G+1)·align)/tile + G + 1. With align == tile a group's tiles are the tiles
  its rows touch, at most cdiv(num_rows, tile) + G in all.
  """
  groups = num_groups + 1
  if align == tile:
    return -(-num_rows // tile) + groups - 1
  return -(-(num_rows + groups * align) // tile) + groups


def row_schedule(group_sizes_g: jax.Array, num_rows: int, tile: int, *, align: int = 8,
                 num_items: int | None = None) -> RowSchedule:
  """Build the work items for rows grouped by group_sizes_g [G] (int); needs num_rows ≥ tile.

  Negative sizes count as 0; groups are clipped to [0, num_rows) (rows past num_rows don't exist).
  """
  if num_rows < tile:
    raise ValueError(f"row_schedule needs num_rows >= tile, got {num_rows} < {tile}")
  if tile % align:
    raise ValueError(f"tile {tile} must be a multiple of align {align}")
  num_groups = group_sizes_g.shape[0]
  if num_items is None:
    num_items = max_items(num_rows, num_groups, tile, align)
  sizes_g = jnp.maximum(group_sizes_g.astype(jnp.int32), 0)
  ends_g = jnp.minimum(jnp.cumsum(sizes_g), num_rows)
  starts_g = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends_g[:-1]])
  # Append the tail group [sum, num_rows).
  starts_h = jnp.concatenate([starts_g, ends_g[-1:]])                       # h = G + 1 groups
  ends_h = jnp.concatenate([ends_g, jnp.full((1,), num_rows, jnp.int32)])
  aligned_h = (starts_h // align) * align
  nblk_h = jnp.where(ends_h > starts_h, -(-(ends_h - aligned_h) // tile), 0)
  item_end_h = jnp.cumsum(nblk_h)
  item_start_h = item_end_h - nblk_h
  idx_i = jnp.arange(num_items, dtype=jnp.int32)
  # Group of item i = number of groups whose items all come before i (items past the last: G+1).
  gid_i = jnp.sum(item_end_h[None, :] <= idx_i[:, None], axis=1).astype(jnp.int32)
  used_i = gid_i <= num_groups
  gid_c = jnp.minimum(gid_i, num_groups)
  nominal_i = aligned_h[gid_c] + tile * (idx_i - item_start_h[gid_c])
  lo_i = jnp.maximum(nominal_i, starts_h[gid_c])
  hi_i = jnp.minimum(nominal_i + tile, ends_h[gid_c])
  size_i = jnp.where(used_i, jnp.maximum(hi_i - lo_i, 0), 0)
  tile_start_i = jnp.clip(nominal_i, 0, num_rows - tile)
  valid_start_i = jnp.where(size_i > 0, lo_i - tile_start_i, 0)
  return RowSchedule(group_id=gid_c, tile_start=tile_start_i.astype(jnp.int32),
                     valid_start=valid_start_i.astype(jnp.int32),
                     valid_size=size_i.astype(jnp.int32))


def group_bounds(group_sizes_g: jax.Array, num_rows: int) -> tuple[jax.Array, jax.Array]:
  """(starts_g, ends_g) int32 [G]: contiguous row ranges of the groups, clipped to num_rows."""
  sizes_g = jnp.maximum(group_sizes_g.astype(jnp.int32), 0)
  ends_g = jnp.minimum(jnp.cumsum(sizes_g), num_rows)
  starts_g = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends_g[:-1]])
  return starts_g, ends_g
