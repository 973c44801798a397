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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def block_min_max(seg_bt: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
  """Per-block min and max of seg [B, T] (T a multiple of block) → two [B, T / block] arrays."""
  b, t = seg_bt.shape
  seg_bnc = seg_bt.reshape(b, t // block, block)
  return jnp.min(seg_bnc, axis=2), jnp.max(seg_bnc, axis=2)


def tile_mask(q_seg, kv_seg, q_last, block_q: int, block_k: int) -> jax.Array:
  """keep_bij [B, Tq / block_q, Tk / block_k] bool (both lengths multiples of their block)."""
  qmin_bi, qmax_bi = block_min_max(q_seg, block_q)
  kmin_bj, kmax_bj = block_min_max(kv_seg, block_k)
  last_i = jnp.max(q_last.reshape(-1, block_q), axis=1)
  first_key_j = jnp.arange(kv_seg.shape[1] // block_k, dtype=jnp.int32) * block_k
  meets_bij = ((qmin_bi[:, :, None] <= kmax_bj[:, None, :])
               & (kmin_bj[:, None, :] <= qmax_bi[:, :, None]))
  return meets_bij & (first_key_j[None, None, :] <= last_i[None, :, None])


def _first_last(keep_bxn: jax.Array) -> tuple[jax.Array, jax.Array]:
  """For each row of keep [..., N]: (first kept index, one past the last), (0, 0) if none kept."""
  n = keep_bxn.shape[-1]
  any_bx = jnp.any(keep_bxn, axis=-1)
  first = jnp.argmax(keep_bxn, axis=-1).astype(jnp.int32)
  end = (n - jnp.argmax(keep_bxn[..., ::-1], axis=-1)).astype(jnp.int32)
  return jnp.where(any_bx, first, 0), jnp.where(any_bx, end, 0)


def key_block_ranges(q_seg, kv_seg, q_last, block_q: int, block_k: int):
  """(lo, hi) [B, Tq / block_q] int32: query block i loops over key blocks lo ≤ j < hi."""
  return _first_last(tile_mask(q_seg, kv_seg, q_last, block_q, block_k))


def query_block_ranges(q_seg, kv_seg, q_last, block_q: int, block_k: int):
  """(lo, hi) [B, Tk / block_k] int32: key block j loops over query blocks lo ≤ i < hi."""
  keep_bji = jnp.swapaxes(tile_mask(q_seg, kv_seg, q_last, block_q, block_k), 1, 2)
  return _first_last(keep_bji)


def key_block_span(q_seg, kv_seg, q_last, block_k: int):
  """(lo, hi) int32 scalars: the key blocks any query of any row can need (all queries as one
  block; used by the pure-JAX path, which processes every query at once)."""
  tq = q_seg.shape[1]
  keep_j = jnp.any(tile_mask(q_seg, kv_seg, q_last, tq, block_k), axis=(0, 1))
  return _first_last(keep_j)
