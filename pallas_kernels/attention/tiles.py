"""Which (query block, key block) tiles can hold an allowed pair: the block-skipping schedule.

Canonical form shared by the blockwise backends (see op.py): q_seg [B, Tq], kv_seg [B, Tk] int32
and q_last [Tq] int32, the last key index row i may see (min(q_offset + i, Tk − 1) with
`causal`, Tk − 1 without; −1 for padding rows). Pair (i, j) is allowed iff
q_seg[i] == kv_seg[j] and j ≤ q_last[i].

A tile is kept when its rows' segment-id range [min, max] meets its keys' range and its first key
is ≤ the largest q_last of its rows. That is a superset of the tiles with an allowed pair for any
ids; with ids that do not decrease along T (packed documents) the kept tiles of a query block are
one contiguous run of key blocks and almost all of them hold allowed pairs, so a kernel that
loops from the first to the last kept tile skips all cross-document and above-diagonal work.

A kept tile is *full* when every pair in it is allowed: its rows and keys all carry one id and
its last key is ≤ the smallest q_last of its rows. A kernel needs no mask there (no per-pair id
and index comparison, no select); with packed documents only the tiles on a document's edges and
on the diagonal are not full. The schedules below give each block its first run of full tiles
inside its kept range; a kernel applies the mask only outside that run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def block_min_max(seg_bt: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
  """Per-block min and max of seg [B, T] (T a multiple of block) → two [B, T / block] arrays."""
  b, t = seg_bt.shape
  seg_bnc = seg_bt.reshape(b, t // block, block)
  return jnp.min(seg_bnc, axis=2), jnp.max(seg_bnc, axis=2)


def tile_kinds(q_seg, kv_seg, q_last, block_q: int, block_k: int):
  """(keep_bij, full_bij) [B, Tq / block_q, Tk / block_k] bool (both lengths multiples of their
  block): the tiles kept, and those whose every pair is allowed, from one set of block
  statistics."""
  qmin_bi, qmax_bi = block_min_max(q_seg, block_q)
  kmin_bj, kmax_bj = block_min_max(kv_seg, block_k)
  last_rows_i = q_last.reshape(-1, block_q)
  first_key_j = jnp.arange(kv_seg.shape[1] // block_k, dtype=jnp.int32) * block_k
  meets_bij = ((qmin_bi[:, :, None] <= kmax_bj[:, None, :])
               & (kmin_bj[:, None, :] <= qmax_bi[:, :, None]))
  keep = meets_bij & (first_key_j[None, None, :] <= jnp.max(last_rows_i, axis=1)[None, :, None])
  one_id_bij = ((qmin_bi == qmax_bi)[:, :, None] & (kmin_bj == kmax_bj)[:, None, :]
                & (qmin_bi[:, :, None] == kmin_bj[:, None, :]))
  last_key_j = first_key_j + block_k - 1
  full = one_id_bij & (last_key_j[None, None, :] <= jnp.min(last_rows_i, axis=1)[None, :, None])
  return keep, full


def _first_last(keep_bxn: jax.Array) -> tuple[jax.Array, jax.Array]:
  """For each row of keep [..., N]: (first kept index, one past the last), (0, 0) if none kept."""
  n = keep_bxn.shape[-1]
  any_bx = jnp.any(keep_bxn, axis=-1)
  first = jnp.argmax(keep_bxn, axis=-1).astype(jnp.int32)
  end = (n - jnp.argmax(keep_bxn[..., ::-1], axis=-1)).astype(jnp.int32)
  return jnp.where(any_bx, first, 0), jnp.where(any_bx, end, 0)


def _first_full_run(full_bxn: jax.Array, hi_bx: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(start, end) of each row's first run of consecutive full tiles; (hi, hi) if it has none."""
  n = full_bxn.shape[-1]
  idx_n = jnp.arange(n, dtype=jnp.int32)
  start = jnp.argmax(full_bxn, axis=-1).astype(jnp.int32)
  after_run = jnp.where(~full_bxn & (idx_n >= start[..., None]), idx_n, n)
  end = jnp.min(after_run, axis=-1).astype(jnp.int32)
  any_bx = jnp.any(full_bxn, axis=-1)
  return jnp.where(any_bx, start, hi_bx), jnp.where(any_bx, end, hi_bx)


def _schedule(keep_bxn, full_bxn):
  lo, hi = _first_last(keep_bxn)
  full_lo, full_hi = _first_full_run(full_bxn, hi)
  return lo, full_lo, full_hi, hi


def key_block_schedule(q_seg, kv_seg, q_last, block_q: int, block_k: int):
  """(lo, full_lo, full_hi, hi) [B, Tq / block_q] int32, lo ≤ full_lo ≤ full_hi ≤ hi: query
  block i loops over key blocks lo ≤ j < hi, of which full_lo ≤ j < full_hi are full."""
  return _schedule(*tile_kinds(q_seg, kv_seg, q_last, block_q, block_k))


def query_block_schedule(q_seg, kv_seg, q_last, block_q: int, block_k: int):
  """(lo, full_lo, full_hi, hi) [B, Tk / block_k] int32: key block j loops over query blocks
  lo ≤ i < hi, of which full_lo ≤ i < full_hi are full."""
  keep_bij, full_bij = tile_kinds(q_seg, kv_seg, q_last, block_q, block_k)
  return _schedule(jnp.swapaxes(keep_bij, 1, 2), jnp.swapaxes(full_bij, 1, 2))


def key_block_span(q_seg, kv_seg, q_last, block_k: int):
  """(lo, hi) int32 scalars: the key blocks any query of any row can need (all queries as one
  block; used by the pure-JAX path, which processes every query at once)."""
  tq = q_seg.shape[1]
  keep_j = jnp.any(tile_kinds(q_seg, kv_seg, q_last, tq, block_k)[0], axis=(0, 1))
  return _first_last(keep_j)
