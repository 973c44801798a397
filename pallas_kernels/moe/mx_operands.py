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
an E4M3 code is s·eeee·mmm (bias 7, subnormals at e = 0, NaN at 0x7F/0xFF); the byte 255 is the
NaN scale (its whole block decodes to NaN). Decoding is written with integer bit operations and
exact power-of-two products only (no float8 → float convert, which XLA may fold together with
the quantising convert; see `decode_e4m3`), so the same functions serve XLA and the kernel
bodies. Values whose magnitude falls below 2^-126 (MXFP4: scale bytes 0–1; MXFP8: scale bytes
below 10) may flush to zero on backends that flush subnormals.
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


def decode_e4m3(codes: jax.Array) -> jax.Array:
  """float8_e4m3fn codes (or their uint8 bit patterns) → fp32 values, from the bits.

  byte = s·eeee·mmm: e == 0 → m · 2^-9 (subnormal); else (8 + m) · 2^(e − 10); bits 0x7F and
  0xFF (e = 15, m = 7) are NaN. Integer arithmetic and one exact power-of-two product: no
  float8 → float convert. Inside one jit XLA:GPU may fold a float32 → float8 → float32 convert
  pair into the identity (seen on an H200 with jax 0.11.2: a jitted quantize-then-dequantize
  returned the unquantised values), which would silently undo an MXFP8 quantisation made in the
  same computation; a bitcast and integer ops keep the rounding."""
  b = jax.lax.bitcast_convert_type(codes, jnp.uint8).astype(jnp.int32)
  e, m = (b >> 3) & 15, b & 7
  sig = jnp.where(e == 0, m, 8 + m).astype(jnp.float32)                # exact integers 0..15
  mag = sig * _pow2(jnp.where(e == 0, -9, e - 10))
  mag = jnp.where((b & 0x7F) == 0x7F, jnp.nan, mag)
  return jnp.where((b & 0x80) != 0, -mag, mag)


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
  """MXFP8 activations → [M, K] in dtype (exact for values in dtype's normal range). The codes
  are decoded from their bits (`decode_e4m3`), so a quantisation earlier in the same jit is
  never folded away."""
  return _blockwise(decode_e4m3(codes_mk), scales_mb).astype(dtype)


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
