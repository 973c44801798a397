"""AttnRes mixing under a mesh: the backward kernel in a `shard_map` over batch and sequence.

A site is per-token except for the gradient of its pseudo-query and gain (a sum over tokens).
Without an active layout, or on the "xla" backend (which XLA partitions itself), this is the op.
A Pallas kernel must not be handed to the SPMD partitioner, which would gather its operands, so
under a layout the forward stays plain JAX (partitioned by XLA) and the backward kernel runs in
a `shard_map` on each device's tokens; each device returns its partial ∂L/∂w, summed after the
map. A model width split over devices (an `embed` rule that survives on activations) has no
kernel form: "auto" then uses "xla".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from k3train.parallel import axes as ax
from k3train.parallel import rules as rules_lib
from pallas_kernels import attnres as attnres_ops
from pallas_kernels.attnres import op as attnres_op
from pallas_kernels.attnres import vjp as attnres_vjp


@jax.named_scope("attnres")
def mix_pass(blocks_nbtd, num_blocks, p_btd, query_d, gain_d, *, eps: float, backend: str):
  """`pallas_kernels.attnres.mix_pass` under the active layout: (out, blocks, p)."""
  layout = rules_lib.active()
  if layout is None:
    return attnres_ops.mix_pass(blocks_nbtd, num_blocks, p_btd, query_d, gain_d, eps, backend)
  attnres_op.validate(blocks_nbtd, p_btd, query_d, gain_d)
  mesh = layout[0]
  b_axes, t_axes, e_axes = rules_lib.mesh_axes_of((ax.BATCH, ax.SEQ, ax.EMBED))
  b, t, d = p_btd.shape
  shards = rules_lib.axis_size(mesh, b_axes + t_axes)
  resolved = attnres_ops.resolve_backend(backend, (b * t) // shards, d)
  if e_axes and resolved != "xla":
    if backend != "auto":
      raise ValueError(f"attnres: backend {backend!r} needs the model width whole on each "
                       f"device, but the layout splits `embed` over {e_axes}; use 'xla'")
    resolved = "xla"
  if resolved == "xla":
    return attnres_ops.mix_pass(blocks_nbtd, num_blocks, p_btd, query_d, gain_d, eps, "xla")
  x_spec = rules_lib.spec_from_axes(b_axes, t_axes, ())
  blocks_spec = rules_lib.spec_from_axes((), b_axes, t_axes, ())
  stats_spec = rules_lib.spec_from_axes((), b_axes, t_axes)
  parts_spec = rules_lib.spec_from_axes(b_axes + t_axes, ())
  local_backward = attnres_op.backward_fn(resolved)

  def local(blocks, p, w, stats, g, ct_blocks, ct_p):
    ct_blocks, ct_p, dw = local_backward(blocks, p, w, stats, g, ct_blocks, ct_p)
    return ct_blocks, ct_p, dw[None]

  sharded = jax.shard_map(
      local, mesh=mesh, check_vma=False,
      in_specs=(blocks_spec, x_spec, P(), (stats_spec,) * 3, x_spec, blocks_spec, x_spec),
      out_specs=(blocks_spec, x_spec, parts_spec))

  def backward(*args):
    ct_blocks, ct_p, dw_parts = sharded(*args)
    return ct_blocks, ct_p, jnp.sum(dw_parts, axis=0)

  return attnres_vjp.mix_pass(blocks_nbtd, jnp.asarray(num_blocks, jnp.int32), p_btd, query_d,
                              gain_d, float(eps), backward)
