"""The custom VJP of a site, with the stream passed through.

`mix_pass(blocks, num_blocks, p, …)` returns (out, blocks, p): the site's output and its own
inputs unchanged. Callers thread the returned blocks and p on, so the backward receives the
cotangents that later sites and layers sent to the stream and returns them with this site's
source gradients added. That lets the Pallas backward add into the block cotangent in place and
leave empty slots untouched, instead of writing a full-size gradient that XLA then adds.

The forward saves three [N + 1, B, T] fp32 statistics, tagged STATS_NAME for remat policies,
and no fp32 copy of the sources. The backward is a function with xla.mix_backward's contract,
given by the caller (op.backward_fn, or that function in a shard_map under a mesh).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from pallas_kernels.attnres import xla

STATS_NAME = "attnres_stats"


def _w(query_d, gain_d):
  return gain_d.astype(jnp.float32) * query_d.astype(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def mix_pass(blocks_nbtd, num_blocks, p_btd, query_d, gain_d, eps: float, backward):
  """(mix output [B, T, d] in p's dtype, blocks, p); `backward(blocks, p, w, stats, g,
  ct_blocks, ct_p) -> (ct_blocks', ct_p', ∂L/∂w)` computes the VJP."""
  out, _ = xla.mix_forward(blocks_nbtd, num_blocks, p_btd, _w(query_d, gain_d), eps)
  return out, blocks_nbtd, p_btd


def _fwd(blocks_nbtd, num_blocks, p_btd, query_d, gain_d, eps, backward):
  out, stats = xla.mix_forward(blocks_nbtd, num_blocks, p_btd, _w(query_d, gain_d), eps)
  stats = tuple(checkpoint_name(x, STATS_NAME) for x in stats)
  return (out, blocks_nbtd, p_btd), (blocks_nbtd, p_btd, query_d, gain_d, stats)


def _bwd(eps, backward, residuals, cotangents):
  del eps
  blocks_nbtd, p_btd, query_d, gain_d, stats = residuals
  g_btd, ct_blocks, ct_p = cotangents
  ct_blocks, ct_p, dw = backward(blocks_nbtd, p_btd, _w(query_d, gain_d), stats, g_btd,
                                 ct_blocks, ct_p)
  d_query = (dw * gain_d.astype(jnp.float32)).astype(query_d.dtype)
  d_gain = (dw * query_d.astype(jnp.float32)).astype(gain_d.dtype)
  return ct_blocks, None, ct_p, d_query, d_gain


mix_pass.defvjp(_fwd, _bwd)
