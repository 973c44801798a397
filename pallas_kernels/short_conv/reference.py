"""The oracle: the depthwise causal conv as a plain sum over taps, differentiated by autodiff."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_conv(x_btc: jax.Array, w_wc: jax.Array, segment_ids_bt: jax.Array | None) -> jax.Array:
  """y[b, t] = Σ_j w[j] · x[b, t − W + 1 + j], a tap counted only when its token lies in the
  sequence and in the same document (segment id) as token t. Computed in the promoted dtype of
  x and w (float64 under x64: the tests' reference), returned in that dtype."""
  dtype = jnp.result_type(x_btc.dtype, w_wc.dtype)
  x, w = x_btc.astype(dtype), w_wc.astype(dtype)
  width, t = w.shape[0], x.shape[1]
  seg = jnp.zeros(x.shape[:2], jnp.int32) if segment_ids_bt is None else segment_ids_bt
  pos = jnp.arange(t)
  y = jnp.zeros_like(x)
  for j in range(width):
    shift = width - 1 - j
    src = pos - shift
    ok = (src >= 0)[None, :] & (jnp.take(seg, jnp.clip(src, 0, t - 1), axis=1) == seg)
    x_src = jnp.take(x, jnp.clip(src, 0, t - 1), axis=1)
    ok = ok.reshape(ok.shape + (1,) * (x.ndim - 2))
    y = y + jnp.where(ok, x_src, 0) * w[j]
  return y
