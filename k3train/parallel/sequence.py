"""KDA under a mesh: local chunk scans in `shard_map`, with state passing over the `sequence` axis.

Without an active layout these are the single-device ops. Under one, the KDA recurrence runs in a
`shard_map` (batch over the data axes, heads over `tensor`, time over `sequence`), so XLA never
partitions the chunk scan itself. With the sequence axis of size P > 1 (docs/maths.md §1.6):

  1. each rank folds its chunks into one affine map of the entering state, S_out = M S_in + B,
     with the op itself: M is the final state from S₀ = I with zero values, B from S₀ = 0 (a
     document start inside the rank makes M = 0 and B the state since that start);
  2. the (M, B) pairs and the first/last segment ids of every rank are all-gathered;
  3. rank r folds ranks j < r in order (a state crosses from j to j+1 only if the document
     continues) and runs the op again from that entering state for its outputs.

The short conv runs in a `shard_map` under every layout (its kernel backend must not reach the SPMD
partitioner); with a sequence axis it gets the previous rank's last W−1 pre-conv inputs (and their
segment ids) by `ppermute`, so the conv history also resets at document starts that fall on a
rank boundary.
Gradients flow through the op's own VJP and the transposed collectives.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from k3train.parallel import axes as ax
from k3train.parallel import rules as rules_lib
from pallas_kernels.kda import kda as kda_op


def _layout_specs():
  """(mesh, batch axes, seq axes, head axes) under the active layout, or None."""
  layout = rules_lib.active()
  if layout is None:
    return None
  b_axes, t_axes, h_axes = rules_lib.mesh_axes_of((ax.BATCH, ax.SEQ, ax.HEADS))
  return layout[0], b_axes, t_axes, h_axes


def _previous_rank(x, axis: tuple[str, ...], size: int):
  """x of rank r − 1 on rank r (zeros on rank 0), by one ppermute over `axis`."""
  return jax.lax.ppermute(x, axis, perm=[(i, i + 1) for i in range(size - 1)])


def causal_conv(x_bthk: jax.Array, w_whk: jax.Array, segment_ids_bt: jax.Array | None,
                conv_fn) -> jax.Array:
  """`conv_fn(x, w, segment_ids)` (the layer's depthwise causal conv) under the active layout.

  x [B, T, …, H, K] and w [W, …, H, K]: heads second to last; leading channel dims (e.g. KDA's
  three branches, [B, T, 3, H, K]) stay whole on every device.

  Under a layout the conv runs in a `shard_map` on each device's tokens and heads, so a kernel
  backend is never handed to the SPMD partitioner (which would gather x onto every device); the
  weight gradient's per-device sums are added by the map's transpose. With a `sequence` axis each
  rank first takes the previous rank's last inputs (at least W − 1) as a halo."""
  spec = _layout_specs()
  if spec is None:
    return conv_fn(x_bthk, w_whk, segment_ids_bt)
  mesh, b_axes, t_axes, h_axes = spec
  width = w_whk.shape[0]
  size = rules_lib.axis_size(mesh, t_axes)
  t_local = x_bthk.shape[1] // size
  if size > 1 and t_local < width - 1:
    raise ValueError(f"sequence parallelism: {t_local} tokens per `sequence` shard is fewer than "
                     f"the conv halo ({width - 1}); use a longer data.seq_len or fewer shards")
  if segment_ids_bt is None:
    segment_ids_bt = jnp.ones(x_bthk.shape[:2], jnp.int32)

  # The halo: the W − 1 tokens the conv reads, rounded up to 8 where the shard is that long, so
  # that a kernel's power-of-two token blocks still tile the shard plus its halo (the extra
  # tokens' outputs are dropped).
  halo = min(t_local, -(-(width - 1) // 8) * 8)

  def local(x, w, seg):
    if size == 1:
      return conv_fn(x, w, seg)
    r = jax.lax.axis_index(t_axes)
    halo_x = _previous_rank(x[:, -halo:], t_axes, size)
    halo_seg = jnp.where(r == 0, -1, _previous_rank(seg[:, -halo:], t_axes, size))
    y = conv_fn(jnp.concatenate([halo_x, x], axis=1), w, jnp.concatenate([halo_seg, seg], axis=1))
    return y[:, halo:]

  whole = ((),) * (x_bthk.ndim - 4)
  x_spec = rules_lib.spec_from_axes(b_axes, t_axes, *whole, h_axes, ())
  w_spec = rules_lib.spec_from_axes((), *whole, h_axes, ())
  seg_spec = rules_lib.spec_from_axes(b_axes, t_axes)
  return jax.shard_map(local, mesh=mesh, in_specs=(x_spec, w_spec, seg_spec), out_specs=x_spec,
                       check_vma=False)(x_bthk, w_whk, segment_ids_bt)


def _entering_states(m_bhkk, b_bhkv, seg_first_b, seg_last_b, axis, size: int):
  """State entering this rank: fold (M_j, B_j) of ranks j < r, resetting at document starts."""
  r = jax.lax.axis_index(axis)
  ms = jax.lax.all_gather(m_bhkk, axis)            # [P, B, H, K, K]
  bs = jax.lax.all_gather(b_bhkv, axis)            # [P, B, H, K, V]
  firsts = jax.lax.all_gather(seg_first_b, axis)   # [P, B]
  lasts = jax.lax.all_gather(seg_last_b, axis)
  s = jnp.zeros_like(b_bhkv)
  entering = jnp.zeros_like(b_bhkv)
  for j in range(size - 1):                         # state entering rank j + 1
    s = jnp.einsum("bhkl,bhlv->bhkv", ms[j], s, precision=jax.lax.Precision.HIGHEST) + bs[j]
    continues = (firsts[j + 1] == lasts[j])[:, None, None, None]
    s = jnp.where(continues, s, 0.0)
    entering = jnp.where(r == j + 1, s, entering)
  return entering


def kda(q, k, v, g, beta, segment_ids_bt, *, chunk_size: int, backend: str) -> jax.Array:
  """Outputs [B, T, H, V] of `pallas_kernels.kda.kda` (zero initial state) under the active layout."""
  spec = _layout_specs()
  op = functools.partial(kda_op, chunk_size=chunk_size, backend=backend)
  if spec is None:
    return op(q, k, v, g, beta, segment_ids=segment_ids_bt)[0]
  mesh, b_axes, t_axes, h_axes = spec
  if segment_ids_bt is None:
    segment_ids_bt = jnp.ones(q.shape[:2], jnp.int32)
  size = rules_lib.axis_size(mesh, t_axes)

  def local(q, k, v, g, beta, seg):
    if size == 1:
      return op(q, k, v, g, beta, segment_ids=seg)[0]
    b, _, h, dk = q.shape
    # The rank's affine map S_out = M S_in + B: M from initial state I with zero values, B from
    # a zero initial state (two passes keep V = K and V as the kernels' head sizes).
    eye = jnp.broadcast_to(jnp.eye(dk, dtype=jnp.float32), (b, h, dk, dk))
    _, m = op(q, k, jnp.zeros_like(k, dtype=v.dtype), g, beta, initial_state=eye, segment_ids=seg,
              output_final_state=True)
    _, b_state = op(q, k, v, g, beta, segment_ids=seg, output_final_state=True)
    s_in = _entering_states(m, b_state, seg[:, 0], seg[:, -1], t_axes, size)
    return op(q, k, v, g, beta, initial_state=s_in, segment_ids=seg)[0]

  x_spec = rules_lib.spec_from_axes(b_axes, t_axes, h_axes, ())
  return jax.shard_map(
      local, mesh=mesh,
      in_specs=(x_spec, x_spec, x_spec, x_spec, rules_lib.spec_from_axes(b_axes, t_axes, h_axes), rules_lib.spec_from_axes(b_axes, t_axes)),
      out_specs=x_spec, check_vma=False)(q, k, v, g, beta, segment_ids_bt)
