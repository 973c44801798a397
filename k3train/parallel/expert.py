"""Routed experts under a mesh: dropless expert parallelism over the `expert` axis.

Without an active layout (or with an expert axis of size 1) the routed experts run locally: sort
the (token, expert) pairs by expert, one grouped matmul per expert matrix, un-sort and combine.
Each row carries its pair's routing weight into the expert, which scales the SiTU-GLU output
before the down GEMM; the combine then only sums (`moe_ops.combine_scaled`), and its backward
needs no copy of the expert outputs (docs/maths.md §5.1).

Under a layout, everything runs in one `shard_map` over the whole mesh. Each device holds E/P of
the experts (P = size of the expert axes) and its own tokens. It

  1. sorts its pairs by global expert id, so the pairs bound for device d are one contiguous run;
  2. exchanges per-(destination, local expert) counts with an `all_to_all` of a [P, E/P] table;
  3. sends the *latent* rows (width ℓ, not d) and their routing weights to their owners:
     `ragged_all_to_all` with exact
     counts ("ragged", GPU/TPU), or a dense `all_to_all` of [P, n·k, ℓ] slots ("all_to_all",
     runs everywhere incl. XLA:CPU). Both land rows in the same layout: source s's rows at
     [s·n·k, s·n·k + count), so everything after is shared. The slot size n·k is the worst case
     (every pair to one device), which is what makes the exchange dropless;
  4. regroups the received rows by local expert, runs the expert MLP as grouped matmuls, and
     sends the results back along the reverse route;
  5. sums each token's k (already weighted) results; when the expert hidden dim is split over
     `tensor`, the partial down-projections are summed with one psum.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from k3train.parallel import axes as ax
from k3train.parallel import rules as rules_lib
from pallas_kernels import moe as moe_ops
from pallas_kernels import platform

EXCHANGES = ("auto", "all_to_all", "ragged")

# expert_fn(x_sorted_ml, group_sizes_e, gate_elf, up_elf, down_efl, row_weights_m) → y_sorted_ml,
# each row scaled by its routing weight (RoutedExperts.apply)
ExpertFn = Callable[..., jax.Array]


def resolve_exchange(exchange: str) -> str:
  if exchange not in EXCHANGES:
    raise ValueError(f"unknown expert exchange {exchange!r}; allowed: {EXCHANGES}")
  if exchange == "auto":  # ragged_all_to_all has no XLA:CPU implementation
    return "all_to_all" if platform.current() == "cpu" else "ragged"
  return exchange


def local_routed_experts(x_nl, weights_nk, idx_nk, num_experts: int, expert_fn: ExpertFn,
                         expert_weights, gather: str = "xla",
                         order_name: str | None = None) -> jax.Array:
  """Single-device dropless path: dispatch → grouped expert MLP (rows weighted inside) → sum.
  Returns [n, ℓ]. gather, order_name: `moe_ops.dispatch`'s."""
  x_sorted, group_sizes, perm = moe_ops.dispatch(x_nl, idx_nk, num_experts, gather=gather,
                                                 order_name=order_name)
  w_sorted = moe_ops.sorted_pair_weights(weights_nk, perm)
  y_sorted = expert_fn(x_sorted, group_sizes, *expert_weights, w_sorted)
  return moe_ops.combine_scaled(y_sorted, perm, idx_nk.shape[1], gather=gather)


def _exclusive_cumsum(x):
  return jnp.cumsum(x) - x


def _segment_of(sizes_s, count: int):
  """For positions 0..count-1 laid out as consecutive runs of sizes_s: (run index, index in run).
  Positions past the total get run index len(sizes_s)."""
  ends = jnp.cumsum(sizes_s)
  pos = jnp.arange(count, dtype=jnp.int32)
  run = jnp.searchsorted(ends, pos, side="right").astype(jnp.int32)
  start = jnp.where(run < sizes_s.shape[0], (ends - sizes_s)[jnp.minimum(run, sizes_s.shape[0] - 1)], 0)
  return run, pos - start


def _ep_local(x_btl, weights_btk, idx_btk, *expert_weights, num_experts: int, e_axes, f_axes,
              ep: int, exchange: str, expert_fn: ExpertFn, gather: str, order_name: str | None):
  """Per-device body of the expert-parallel shard_map (see the module docstring)."""
  b, t, latent = x_btl.shape
  k = idx_btk.shape[-1]
  n = b * t
  cap = n * k                                     # worst-case rows per (source, destination)
  e_local = num_experts // ep
  me = jax.lax.axis_index(e_axes)
  x_nl = x_btl.reshape(n, latent)

  x_sorted, group_sizes_e, perm = moe_ops.dispatch(x_nl, idx_btk.reshape(n, k), num_experts,
                                                   gather=gather, order_name=order_name)
  w_sorted = moe_ops.sorted_pair_weights(weights_btk.reshape(n, k), perm)
  sizes_de = group_sizes_e.reshape(ep, e_local)                   # my pairs per (dest, its expert)
  send_d = jnp.sum(sizes_de, axis=1)
  send_off_d = _exclusive_cumsum(send_d)
  recv_se = jax.lax.all_to_all(sizes_de, e_axes, 0, 0, tiled=True)  # [P, E/P] from each source
  recv_s = jnp.sum(recv_se, axis=1)
  dest_i, slot_i = _segment_of(send_d, cap)                       # sorted row i → (dest, slot)

  def to_owners(rows_p):
    """My sorted rows [n·k, ...] → the receive buffer [P·cap, ...] (source s at s·cap)."""
    tail = rows_p.shape[1:]
    if exchange == "ragged":
      # Where my rows start in each receiver's buffer: my own block, me·cap.
      my_block = jnp.full((ep,), me * cap, jnp.int32)
      return jax.lax.ragged_all_to_all(
          rows_p, jnp.zeros((ep * cap,) + tail, rows_p.dtype), send_off_d.astype(jnp.int32),
          send_d.astype(jnp.int32), my_block, recv_s.astype(jnp.int32), axis_name=e_axes)
    slots = jnp.where(dest_i < ep, dest_i * cap + slot_i, ep * cap)  # past-the-end rows dropped
    send_buf = jnp.zeros((ep * cap,) + tail, rows_p.dtype).at[slots].set(rows_p, mode="drop")
    return jax.lax.all_to_all(send_buf.reshape((ep, cap) + tail), e_axes, 0, 0,
                              tiled=True).reshape((ep * cap,) + tail)

  recv_buf = to_owners(x_sorted)
  recv_w = to_owners(w_sorted[:, None])[:, 0]                   # 0 in unused slots

  # Regroup received rows by local expert (invalid slots last), run the experts, un-group.
  src_j = jnp.arange(ep * cap, dtype=jnp.int32) // cap
  pos_j = jnp.arange(ep * cap, dtype=jnp.int32) % cap
  ends_se = jnp.cumsum(recv_se, axis=1)                          # [P, E/P]
  local_e_j = jnp.sum(pos_j[:, None] >= ends_se[src_j], axis=1).astype(jnp.int32)
  valid_j = pos_j < recv_s[src_j]
  order = jnp.argsort(jnp.where(valid_j, local_e_j, e_local), stable=True).astype(jnp.int32)
  y_grouped = expert_fn(jnp.take(recv_buf, order, axis=0), jnp.sum(recv_se, axis=0),
                        *expert_weights, jnp.take(recv_w, order, axis=0))
  y_recv = jnp.zeros_like(y_grouped).at[order].set(y_grouped, unique_indices=True)
  y_recv = jnp.where(valid_j[:, None], y_recv, 0)

  if exchange == "ragged":
    # Back to the senders: source s's rows sit at s·cap; they land where s took them from.
    send_off_back = jax.lax.all_to_all(send_off_d.reshape(ep, 1), e_axes, 0, 0, tiled=True)[:, 0]
    y_sorted = jax.lax.ragged_all_to_all(
        y_recv, jnp.zeros((cap, latent), y_recv.dtype), (jnp.arange(ep) * cap).astype(jnp.int32),
        recv_s.astype(jnp.int32), send_off_back.astype(jnp.int32), send_d.astype(jnp.int32),
        axis_name=e_axes)
  else:
    back = jax.lax.all_to_all(y_recv.reshape(ep, cap, latent), e_axes, 0, 0, tiled=True)
    back = back.reshape(ep * cap, latent)
    rows = jnp.where(dest_i < ep, dest_i * cap + slot_i, 0)
    y_sorted = jnp.where((dest_i < ep)[:, None], jnp.take(back, rows, axis=0), 0)

  r_nl = moe_ops.combine_scaled(y_sorted, perm, k, gather=gather)
  if f_axes:
    r_nl = jax.lax.psum(r_nl, f_axes)
  return r_nl.reshape(b, t, latent)


def routed_experts(x_btl: jax.Array, weights_btk: jax.Array, idx_btk: jax.Array, *,
                   num_experts: int, expert_fn: ExpertFn, expert_weights: tuple,
                   exchange: str | None = None, gather: str = "xla",
                   order_name: str | None = None) -> jax.Array:
  """r [B, T, ℓ] = Σ_j w_j E_{idx_j}(x) over each token's k experts, dropless, on any layout.

  expert_weights: (gate [E, ℓ, F], up [E, ℓ, F], down [E, F, ℓ]) as arrays; expert_fn runs the
  expert MLP on expert-sorted rows with (local) weights. exchange: see `EXCHANGES`; None takes
  the layout's `expert_exchange` option (default "auto"). gather: who copies the dispatch's rows
  (moe_ops.GATHERS); order_name: the checkpoint name of its sort order (`moe_ops.dispatch`).
  """
  exchange = rules_lib.option("expert_exchange", "auto") if exchange is None else exchange
  b, t, latent = x_btl.shape
  layout = rules_lib.active()
  if layout is not None:
    mesh = layout[0]
    b_axes, t_axes = rules_lib.mesh_axes_of((ax.BATCH, ax.SEQ))
    (e_axes,) = rules_lib.mesh_axes_of((ax.EXPERTS,))
    (f_axes,) = rules_lib.mesh_axes_of((ax.EXPERT_MLP,))
    ep = rules_lib.axis_size(mesh, e_axes)
  if layout is None or (ep == 1 and not f_axes and not b_axes and not t_axes):
    r = local_routed_experts(x_btl.reshape(b * t, latent), weights_btk.reshape(b * t, -1),
                             idx_btk.reshape(b * t, -1), num_experts, expert_fn, expert_weights,
                             gather, order_name)
    return r.reshape(b, t, latent)
  if num_experts % ep:
    raise ValueError(f"model.moe.num_experts={num_experts} is not divisible by the {ep} devices "
                     f"of mesh axes {e_axes}")

  sp = rules_lib.spec_from_axes
  tok = sp(b_axes, t_axes, ())
  w_in, w_out = sp(e_axes, (), f_axes), sp(e_axes, f_axes, ())
  if ep > 1:
    body = functools.partial(_ep_local, num_experts=num_experts, e_axes=e_axes, f_axes=f_axes,
                             ep=ep, exchange=resolve_exchange(exchange), expert_fn=expert_fn,
                             gather=gather, order_name=order_name)
  else:   # no exchange: local experts; only a tensor-split hidden dim needs its psum
    def body(x, w, i, *ew):
      r = local_routed_experts(x.reshape(-1, latent), w.reshape(-1, w.shape[-1]),
                               i.reshape(-1, i.shape[-1]), num_experts, expert_fn, ew, gather,
                               order_name)
      return (jax.lax.psum(r, f_axes) if f_axes else r).reshape(x.shape)
  return jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, w_in, w_in, w_out),
                       out_specs=tok, check_vma=False)(x_btl, weights_btk, idx_btk, *expert_weights)
