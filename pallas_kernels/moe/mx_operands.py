"""MX operands of the grouped matmul: the byte layouts `gmm_mx` reads and their decoding.

A gmm_mx computes ragged_dot(lhs, rhs) from block-quantised operands, blocks of 32 along the
contraction dimension K (docs/maths.md §7.1, §7.4):

    lhs (activations, MXFP8):  codes  [M, K]      float8_e4m3fn
                               scales [M, K/32]   uint8 E8M0 bytes (value 2^(byte − 127))
    rhs (weights, MXFP4):      packed [G, N, K/2] uint8, the release layout: per group the
                                                  PyTorch [out, in] weight with element 2j of
                                                  `in` in the low nibble, 2j+1 in the high one
                               scales [G, N, K/32] uint8 E8M0 bytes

A nibble is a sign bit (bit 3) and a magnitude index (bits 0–2) into {0, ½, 1, 1½, 2, 3, 4, 6};
the byte 255 is the NaN scale (its whole block decodes to NaN). Decoding is written with integer
bit operations and exact power-of-two products only, so the same functions serve XLA and the
kernel bodies. Values whose magnitude falls below 2^-126 (scale bytes 0–2) may flush to zero on
backends that flush subnormals.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BLOCK = 32
_BIAS = 127


def _pow2(e: jax.Array) -> jax.Array:
  """2^e in fp32 for integer e in [−126, 127], from the exponent bits."""
  return jax.lax.bitcast_convert_type((e.astype(jnp.int32) + _BIAS) << 23, jnp.float32)


def scale_values(scale_bytes: jax.Array, x: jax.Array) -> jax.Array:
  """x · 2^(byte − 127) in fp32 (x and the bytes broadcast), NaN where the byte is 255.

  The power of two is applied as two normal factors, so byte 0 (2^-127) needs no subnormal."""
  e = scale_bytes.astype(jnp.int32) - _BIAS
  e = jnp.minimum(e, _BIAS)
  half = e // 2
  out = x.astype(jnp.float32) * _pow2(half) * _pow2(e - half)
  return jnp.where(scale_bytes.astype(jnp.int32) == 255, jnp.nan, out)


def decode_e2m1(nibbles: jax.Array) -> jax.Array:
  """uint8 nibbles (low 4 bits used) → fp32 E2M1 values, by integer arithmetic (no table).

  magnitude index i = 2·e + m:  e == 0 → m/2;  else (2 + m) · 2^(e−1) / 2."""
  n = nibbles.astype(jnp.int32)
  e, m = (n >> 1) & 3, n & 1
  twice = jnp.where(e == 0, m, (2 + m) << jnp.maximum(e - 1, 0))     # 2·|value|, an integer
  value = twice.astype(jnp.float32) * 0.5
  return jnp.where((n & 8) != 0, -value, value)


def unpack_nibbles(packed: jax.Array) -> jax.Array:
  """uint8 [..., K/2] → uint8 nibbles [..., K] (low nibble first: element 2j, then 2j+1)."""
  pairs = jnp.stack([packed & 0xF, packed >> 4], axis=-1)
  return pairs.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _blockwise(values_xk: jax.Array, scales_xb: jax.Array) -> jax.Array:
  """values [..., K] fp32 scaled by their block's byte from scales [..., K/32]."""
  *lead, k = values_xk.shape
  blocks = values_xk.reshape(*lead, k // BLOCK, BLOCK)
  return scale_values(scales_xb[..., None], blocks).reshape(*lead, k)


def dequantize_lhs(codes_mk: jax.Array, scales_mb: jax.Array, dtype) -> jax.Array:
  """MXFP8 activations → [M, K] in dtype (exact for values in dtype's normal range)."""
  return _blockwise(codes_mk.astype(jnp.float32), scales_mb).astype(dtype)


def dequantize_rhs_nk(packed_gnh: jax.Array, scales_gnb: jax.Array, dtype) -> jax.Array:
  """MXFP4 weights in the release layout → [G, N, K] in dtype (each group's [out, in])."""
  return _blockwise(decode_e2m1(unpack_nibbles(packed_gnh)), scales_gnb).astype(dtype)


def dequantize_rhs(packed_gnh: jax.Array, scales_gnb: jax.Array, dtype) -> jax.Array:
  """MXFP4 weights in the release layout → [G, K, N] in dtype (ragged_dot's rhs)."""
  return jnp.swapaxes(dequantize_rhs_nk(packed_gnh, scales_gnb, dtype), 1, 2)


def check_operands(lhs_shape, rhs_shape, lhs_codes, lhs_scales, rhs_packed, rhs_scales) -> None:
  """ValueError naming the operand when the MX operands do not describe lhs [M, K], rhs [G, K, N]."""
  m, k = lhs_shape
  g, k_rhs, n = rhs_shape
  want = {
      "lhs_codes": (lhs_codes, (m, k), jnp.float8_e4m3fn),
      "lhs_scales": (lhs_scales, (m, k // BLOCK), jnp.uint8),
      "rhs_packed": (rhs_packed, (g, n, k // 2), jnp.uint8),
      "rhs_scales": (rhs_scales, (g, n, k // BLOCK), jnp.uint8),
  }
  if k % BLOCK or k != k_rhs:
    raise ValueError(f"gmm_mx needs one contraction size K divisible by {BLOCK}; got lhs "
                     f"{tuple(lhs_shape)}, rhs {tuple(rhs_shape)}")
  for name, (arr, shape, dtype) in want.items():
    if tuple(arr.shape) != shape or arr.dtype != jnp.dtype(dtype):
      raise ValueError(f"gmm_mx: {name} must be {jnp.dtype(dtype).name}{list(shape)} for lhs "
                       f"{tuple(lhs_shape)}, rhs {tuple(rhs_shape)}; got "
                       f"{arr.dtype.name}{list(arr.shape)}")
