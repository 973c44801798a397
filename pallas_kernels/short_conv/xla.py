"""The depthwise causal conv in pure JAX: taps summed in fp32, differentiated by autodiff.

Runs anywhere. XLA fuses the forward into one elementwise pass; its backward is a column
reduction per tap for the weight gradient (fp32 partial sums, since the products are fp32) and
an elementwise pass for the input gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32


def causal_conv(x_btc: jax.Array, w_wc: jax.Array, segment_ids_bt: jax.Array | None) -> jax.Array:
  """x [B, T, C…], w [W, C…] → y [B, T, C…] in x's dtype (see op.causal_conv)."""
  width = w_wc.shape[0]
  t = x_btc.shape[1]
  x32, w32 = x_btc.astype(F32), w_wc.astype(F32)
  channel_axes = (0,) * (x_btc.ndim - 2)
  y = x32 * w32[width - 1]
  for shift in range(1, min(width, t)):
    pad = ((0, 0), (shift, 0)) + tuple((0, 0) for _ in channel_axes)
    x_shift = jnp.pad(x32, pad)[:, :t]
    if segment_ids_bt is not None:
      seg_shift = jnp.pad(segment_ids_bt, ((0, 0), (shift, 0)), constant_values=-1)[:, :t]
      same = (seg_shift == segment_ids_bt).reshape(segment_ids_bt.shape + (1,) * len(channel_axes))
      x_shift = jnp.where(same, x_shift, 0)
    y = y + x_shift * w32[width - 1 - shift]
  return y.astype(x_btc.dtype)
