"""MLA attention under a mesh: the attention op in a `shard_map`, keys and values gathered over
the `sequence` axis.

Without an active layout this is the single-device op. Under one, batch is split over the data
axes, heads over `tensor` and queries over `sequence`. Each sequence rank keeps its query shard,
all-gathers K, V and their segment ids over the sequence axis (the backward reduce-scatters their
gradients), and runs the op with its query offset r · T/P, so causality and document masking are
those of the whole sequence and no [T, S] array is built. The per-head max logit is the maximum
over the ranks (a `pmax` over `sequence`).

K/V memory per device grows with the whole sequence (B · T · H_local · (Dk + Dv)); a ring pass
would bound it by one shard, at the cost of P sequential steps.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from k3train.parallel import axes as ax
from k3train.parallel import rules as rules_lib
from pallas_kernels.attention import attention as attention_op


def attention(q_bthk, k_bthk, v_bthv, segment_ids_bt, *, scale: float, backend: str,
              causal: bool = True, names: tuple[str, str, str] = (ax.BATCH, ax.SEQ, ax.HEADS)):
  """(out [B, T, H, Dv], max_logit [B, H] fp32) of document-masked attention (causal by default).

  `names`: the logical axes of (batch, time, heads); a time axis that the rules leave whole
  (e.g. the vision tower's patches) runs the op on the local batch and heads only.
  """
  op = functools.partial(attention_op, scale=scale, causal=causal, backend=backend)
  layout = rules_lib.active()
  if layout is None:
    return op(q_bthk, k_bthk, v_bthv, segment_ids_bt)
  mesh = layout[0]
  b_axes, t_axes, h_axes = rules_lib.mesh_axes_of(names)
  if segment_ids_bt is None:
    segment_ids_bt = jnp.ones(q_bthk.shape[:2], jnp.int32)
  size = rules_lib.axis_size(mesh, t_axes)

  def local(q, k, v, seg):
    if size == 1:
      return op(q, k, v, seg)
    offset = jax.lax.axis_index(t_axes) * q.shape[1]
    k_all = jax.lax.all_gather(k, t_axes, axis=1, tiled=True)
    v_all = jax.lax.all_gather(v, t_axes, axis=1, tiled=True)
    seg_all = jax.lax.all_gather(seg, t_axes, axis=1, tiled=True)
    out, max_logit = op(q, k_all, v_all, (seg, seg_all), q_offset=offset)
    return out, jax.lax.pmax(jax.lax.stop_gradient(max_logit), t_axes)

  x_spec = rules_lib.spec_from_axes(b_axes, t_axes, h_axes, ())
  seg_spec = rules_lib.spec_from_axes(b_axes, t_axes)
  return jax.shard_map(local, mesh=mesh, in_specs=(x_spec, x_spec, x_spec, seg_spec),
                       out_specs=(x_spec, rules_lib.spec_from_axes(b_axes, h_axes)),
                       check_vma=False)(q_bthk, k_bthk, v_bthv, segment_ids_bt)
