"""MX block quantisation (OCP MX v1.0): MXFP4 (E2M1) and MXFP8 (E4M3) with E8M0 block scales.

The maths is docs/maths.md §7. A block is 32 consecutive elements along `axis` (the contraction
axis of the GEMM the tensor feeds). For a block V₁..V₃₂ with amax = max |Vᵢ|:

    scale rule "floor" (the spec's reference, default):  e = floor(log2 amax) − emax_elem
    scale rule "rceil" (cuBLAS / Blackwell):             e = ceil(log2(amax / max_normal))
    e clamped to [−127, 127];  X = 2^e, stored as the E8M0 byte e + 127
    Pᵢ = RNE(Vᵢ / X) saturated to ±max_normal;  dequantised value = Pᵢ · X

    format   element  emax  max_normal   bits/element (with the scale)
    mxfp4    E2M1     2     6            4.25
    mxfp8    E4M3     8     448          8.25

`quantize` returns codes (jnp.float4_e2m1fn / jnp.float8_e4m3fn, the shape of x) and scales
(jnp.float8_e8m0fnu, x's shape with `axis` divided by 32); `dequantize` inverts it; `fake_quant`
is Q(x) = dequantize(quantize(x)) forward with an identity (straight-through) gradient.
`pack_mxfp4` / `unpack_mxfp4` convert to and from the release byte layout (§7.4): two codes per
uint8 along `axis` (element 2j in the low nibble, 2j+1 in the high one) and one scale byte per 32.

Numerics (the jnp casts of §7.3 are avoided where they bite):

* Exponents and scales are built from integer bit fields, never by casting to float8_e8m0fnu
  (that cast rounds: 1.5 → 2). Division by X is a multiplication by two exact powers of two.
* E4M3 is clipped to ±448 before the cast (the cast does not saturate: 464 → NaN).
* Elements round to nearest, ties to even (`astype`), once, from the exact value Vᵢ / X.

Documented edge cases (all tested in tests/quant/test_mx.py):

* An all-zero block takes amax = 1 (microxcaling's convention): floor gives the byte 127 − emax,
  rceil 127 + ceil(log2(1 / max_normal)); its codes are zeros.
* fp32 subnormal inputs (|x| < 2^-126) are read as zero, so a block of them is a zero block.
  XLA flushes subnormals on CPU and GPU anyway; doing it explicitly makes every backend agree.
  Likewise a dequantised value below 2^-126 (possible only with scale bytes 0–2) may flush to 0.
* A block holding NaN or ±Inf gets the NaN scale byte 255 and zero codes, and dequantises to NaN
  in all 32 elements: non-finite input never turns into finite numbers (E2M1 alone would turn
  NaN into −0). `fake_quant` therefore propagates NaN to the block, and a NaN loss follows.
* Finite fp32 inputs never need a scale above 2^127 (amax < 2^128), so the clamp at 127 is
  never hit from above; the clamp at −127 keeps tiny blocks representable.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

BLOCK = 32
FORMATS = ("mxfp4", "mxfp8")
SCALE_RULES = ("floor", "rceil")
SCALE_BIAS = 127
NAN_SCALE_BYTE = 255
_F32_MIN_NORMAL = 2.0 ** -126


@dataclasses.dataclass(frozen=True)
class ElementFormat:
  """One MX element format: its jnp dtype, emax, largest normal, mantissa bits, smallest
  normal exponent (emin) and the significand above which `rceil` needs the next power of two."""
  name: str
  dtype: jnp.dtype
  emax: int
  max_normal: float
  mantissa_bits: int
  emin: int

  @property
  def rceil_significand(self) -> int:
    """max_normal / 2^emax as a 24-bit fp32 significand (1.5 → 0xC00000 for E2M1)."""
    return int(self.max_normal / 2.0 ** self.emax * (1 << 23))


ELEMENTS = {
    "mxfp4": ElementFormat("e2m1", jnp.dtype(jnp.float4_e2m1fn), emax=2, max_normal=6.0,
                           mantissa_bits=1, emin=0),
    "mxfp8": ElementFormat("e4m3", jnp.dtype(jnp.float8_e4m3fn), emax=8, max_normal=448.0,
                           mantissa_bits=3, emin=-6),
}


def element_format(fmt: str) -> ElementFormat:
  if fmt not in ELEMENTS:
    raise ValueError(f"unknown MX format {fmt!r}; allowed: {', '.join(FORMATS)}")
  return ELEMENTS[fmt]


def _check_rule(rule: str) -> None:
  if rule not in SCALE_RULES:
    raise ValueError(f"unknown MX scale rule {rule!r}; allowed: {', '.join(SCALE_RULES)}")


def _to_blocks(x: jax.Array, axis: int) -> tuple[jax.Array, int]:
  """x with `axis` moved last and split into [..., n_blocks, 32]; returns (blocks, axis)."""
  axis = axis % x.ndim
  size = x.shape[axis]
  if size % BLOCK:
    raise ValueError(f"MX blocks need the block axis (axis {axis} of shape {x.shape}) to be a "
                     f"multiple of {BLOCK}, got {size}")
  moved = jnp.moveaxis(x, axis, -1)
  return moved.reshape(*moved.shape[:-1], size // BLOCK, BLOCK), axis


def _from_blocks(blocks: jax.Array, axis: int) -> jax.Array:
  moved = blocks.reshape(*blocks.shape[:-2], blocks.shape[-2] * blocks.shape[-1])
  return jnp.moveaxis(moved, -1, axis)


def pow2(e: jax.Array) -> jax.Array:
  """2^e in fp32, exact, for integer e in [−126, 127] (built from the exponent bits)."""
  bits = (e.astype(jnp.int32) + SCALE_BIAS) << 23
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _scale_by_pow2(x: jax.Array, e: jax.Array) -> jax.Array:
  """x · 2^e for e in [−254, 254] as two exact power-of-two multiplications (no 2^±127 operand
  is ever formed, so no operand is subnormal or infinite)."""
  half = e // 2
  return x * pow2(half) * pow2(e - half)


def shared_exponents(x: jax.Array, fmt: str, axis: int = -1, *,
                     rule: str = "floor") -> jax.Array:
  """int32 block exponents e (X = 2^e) along `axis`: x's shape with that axis divided by 32.

  NaN/Inf blocks get e = 128 (the NaN byte 255 after the bias)."""
  elem = element_format(fmt)
  _check_rule(rule)
  blocks, _ = _to_blocks(x.astype(jnp.float32), axis)
  return jnp.moveaxis(_block_exponents(blocks, elem, rule), -1, axis % x.ndim)


def _block_exponents(blocks: jax.Array, elem: ElementFormat, rule: str) -> jax.Array:
  """[..., n, 32] fp32 → int32 [..., n]: the clamped shared exponent, 128 for non-finite."""
  finite = jnp.all(jnp.isfinite(blocks), axis=-1)
  mag = jnp.abs(blocks)
  mag = jnp.where(mag < _F32_MIN_NORMAL, 0.0, mag)
  amax = jnp.max(jnp.where(jnp.isfinite(mag), mag, 0.0), axis=-1)
  amax = jnp.where(amax == 0.0, 1.0, amax)           # zero block: any scale; take amax = 1
  bits = jax.lax.bitcast_convert_type(amax, jnp.int32)
  floor_log2 = ((bits >> 23) & 0xFF) - SCALE_BIAS    # amax is a normal fp32 number
  e = floor_log2 - elem.emax
  if rule == "rceil":
    # amax / 2^e = 2^emax · significand; rceil needs the next power when that exceeds max_normal.
    significand = (bits & 0x7FFFFF) | 0x800000
    e = e + (significand > elem.rceil_significand).astype(jnp.int32)
  e = jnp.clip(e, -SCALE_BIAS, SCALE_BIAS)
  return jnp.where(finite, e, NAN_SCALE_BYTE - SCALE_BIAS)


def quantize(x: jax.Array, fmt: str, axis: int = -1, *,
             rule: str = "floor") -> tuple[jax.Array, jax.Array]:
  """x (any float dtype) → (codes, scales) in MX format `fmt` with blocks of 32 along `axis`.

  codes: x's shape, dtype float4_e2m1fn (mxfp4) or float8_e4m3fn (mxfp8).
  scales: x's shape with `axis` divided by 32, dtype float8_e8m0fnu (byte = e + 127).
  rule: "floor" (OCP reference, default) or "rceil". See the module docstring for zero,
  subnormal and non-finite blocks.
  """
  elem = element_format(fmt)
  _check_rule(rule)
  blocks, axis = _to_blocks(x.astype(jnp.float32), axis)
  e = _block_exponents(blocks, elem, rule)                       # [..., n]
  finite = e <= SCALE_BIAS
  flushed = jnp.where(jnp.abs(blocks) < _F32_MIN_NORMAL, 0.0, blocks)
  scaled = _scale_by_pow2(jnp.where(finite[..., None], flushed, 0.0),
                          -jnp.where(finite, e, 0)[..., None])
  scaled = jnp.clip(scaled, -elem.max_normal, elem.max_normal)   # saturate before the cast
  codes = scaled.astype(elem.dtype)                              # one RNE rounding
  scales = jax.lax.bitcast_convert_type((e + SCALE_BIAS).astype(jnp.uint8), jnp.float8_e8m0fnu)
  return _from_blocks(codes, axis), jnp.moveaxis(scales, -1, axis)


def dequantize(codes: jax.Array, scales: jax.Array, fmt: str, axis: int = -1, *,
               dtype=jnp.float32) -> jax.Array:
  """codes · 2^(scale byte − 127), blockwise along `axis`; NaN scale → NaN block. Returns dtype.

  scales may be float8_e8m0fnu or their uint8 bytes."""
  elem = element_format(fmt)
  if codes.dtype != elem.dtype:
    raise ValueError(f"{fmt} codes must be {elem.dtype}, got {codes.dtype}")
  axis = axis % codes.ndim
  expected = codes.shape[:axis] + (codes.shape[axis] // BLOCK,) + codes.shape[axis + 1:]
  if scales.shape != expected:
    raise ValueError(f"scales {scales.shape} do not match codes {codes.shape} with blocks of "
                     f"{BLOCK} along axis {axis} (expected {expected})")
  blocks, _ = _to_blocks(code_values(codes), axis)
  e = scale_bytes(scales).astype(jnp.int32) - SCALE_BIAS          # [..., n] along axis
  e = jnp.moveaxis(e, axis, -1)
  values = _scale_by_pow2(blocks, jnp.minimum(e, SCALE_BIAS)[..., None])
  values = jnp.where((e > SCALE_BIAS)[..., None], jnp.nan, values)
  return _from_blocks(values, axis).astype(dtype)


def quantize_dequantize(x: jax.Array, fmt: str, axis: int = -1, *,
                        rule: str = "floor") -> jax.Array:
  """Q(x) = dequantize(quantize(x)) in x's dtype (no gradient rule; see `fake_quant`)."""
  codes, scales = quantize(x, fmt, axis, rule=rule)
  return dequantize(codes, scales, fmt, axis, dtype=x.dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3))
def _fake_quant(x, fmt, axis, rule):
  return quantize_dequantize(x, fmt, axis, rule=rule)


@_fake_quant.defjvp
def _fake_quant_jvp(fmt, axis, rule, primals, tangents):
  (x,), (t,) = primals, tangents
  return _fake_quant(x, fmt, axis, rule), t


def fake_quant(x: jax.Array, fmt: str, axis: int = -1, *, rule: str = "floor") -> jax.Array:
  """Forward Q(x) exactly (bit for bit the dequantised codes, in x's dtype); derivative identity
  (the straight-through estimator, docs/maths.md §7.5). Works with jvp, vjp and jit."""
  element_format(fmt)
  _check_rule(rule)
  return _fake_quant(x, fmt, axis, rule)


# ----------------------------------------------------------------------------- bytes and packing


def scale_bytes(scales: jax.Array) -> jax.Array:
  """E8M0 scales (float8_e8m0fnu, or already uint8) → their uint8 bytes."""
  if scales.dtype == jnp.uint8:
    return scales
  if scales.dtype != jnp.float8_e8m0fnu:
    raise ValueError(f"MX scales must be float8_e8m0fnu or uint8 bytes, got {scales.dtype}")
  return jax.lax.bitcast_convert_type(scales, jnp.uint8)


def scales_from_bytes(data: jax.Array) -> jax.Array:
  """uint8 bytes → float8_e8m0fnu scales (a bit cast; byte 255 is NaN)."""
  return jax.lax.bitcast_convert_type(data.astype(jnp.uint8), jnp.float8_e8m0fnu)


# fp32 value of every element code, by bit pattern: E2M1 nibbles (sign in bit 3) and E4M3 bytes
# (sign in bit 7; 0x7F / 0xFF are NaN).
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_TABLE = np.array(_E2M1_MAGNITUDES + tuple(-v for v in _E2M1_MAGNITUDES), np.float32)
_E4M3_TABLE = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def code_values(codes: jax.Array) -> jax.Array:
  """E2M1 / E4M3 codes → their exact fp32 values, read from the codes' bits through a table.

  A plain `codes.astype(float32)` after `x.astype(code dtype)` is a round trip that XLA:GPU may
  fold into the identity (it allows excess precision by default), which would silently skip the
  quantisation; a bit-level lookup cannot be folded away."""
  if codes.dtype == jnp.float4_e2m1fn:
    bits, table = e2m1_nibbles(codes), _E2M1_TABLE
  elif codes.dtype == jnp.float8_e4m3fn:
    bits, table = jax.lax.bitcast_convert_type(codes, jnp.uint8), _E4M3_TABLE
  else:
    raise ValueError(f"MX element codes must be float4_e2m1fn or float8_e4m3fn, got {codes.dtype}")
  return jnp.take(jnp.asarray(table), bits.astype(jnp.int32), axis=0)


def e2m1_nibbles(codes: jax.Array) -> jax.Array:
  """float4_e2m1fn codes → uint8 in [0, 16): sign bit 3, magnitude index bits 0–2."""
  if codes.dtype != jnp.float4_e2m1fn:
    raise ValueError(f"E2M1 codes must be float4_e2m1fn, got {codes.dtype}")
  return jax.lax.bitcast_convert_type(codes, jnp.uint4).astype(jnp.uint8)


def e2m1_from_nibbles(nibbles: jax.Array) -> jax.Array:
  """uint8 in [0, 16) → float4_e2m1fn codes (higher bits are ignored)."""
  return jax.lax.bitcast_convert_type((nibbles & 0xF).astype(jnp.uint4), jnp.float4_e2m1fn)


def pack_mxfp4(codes: jax.Array, scales: jax.Array, axis: int = -1
               ) -> tuple[jax.Array, jax.Array]:
  """MXFP4 (codes, scales) → release bytes (packed uint8, scale uint8) along `axis`.

  packed has `axis` halved: byte j holds element 2j in its low nibble and 2j+1 in its high
  nibble. The scale bytes keep the scales' shape (one per 32 elements along `axis`). For a
  PyTorch-layout weight [out, in] with blocks along `in` (axis=-1) this is `weight_packed`
  [out, in/2] and `weight_scale` [out, in/32] (docs/maths.md §7.4).
  """
  axis = axis % codes.ndim
  if codes.shape[axis] % 2:
    raise ValueError(f"pack_mxfp4 needs an even size along axis {axis}, got {codes.shape}")
  nib = jnp.moveaxis(e2m1_nibbles(codes), axis, -1)
  pairs = nib.reshape(*nib.shape[:-1], nib.shape[-1] // 2, 2)
  packed = pairs[..., 0] | (pairs[..., 1] << 4)
  return jnp.moveaxis(packed, -1, axis), scale_bytes(scales)


def unpack_mxfp4(packed: jax.Array, scale_data: jax.Array, axis: int = -1
                 ) -> tuple[jax.Array, jax.Array]:
  """Inverse of `pack_mxfp4`: release bytes → (float4_e2m1fn codes, float8_e8m0fnu scales)."""
  if packed.dtype != jnp.uint8:
    raise ValueError(f"packed MXFP4 data must be uint8, got {packed.dtype}")
  axis = axis % packed.ndim
  moved = jnp.moveaxis(packed, axis, -1)
  nib = jnp.stack([moved & 0xF, moved >> 4], axis=-1)
  nib = nib.reshape(*moved.shape[:-1], moved.shape[-1] * 2)
  return jnp.moveaxis(e2m1_from_nibbles(nib), -1, axis), scales_from_bytes(scale_data)


def export_mxfp4(w: jax.Array, in_axis: int, *, rule: str = "floor"
                 ) -> tuple[jax.Array, jax.Array]:
  """A weight with its input (contraction) dimension at `in_axis` → release bytes with `in`
  moved last: (weight_packed [..., in/2], weight_scale [..., in/32]) uint8.

  For routed experts stored [E, in, out] (in_axis=1) that is [E, out, in/2] and [E, out, in/32],
  PyTorch's per-expert [out, in] layout."""
  codes, scales = quantize(w, "mxfp4", in_axis, rule=rule)
  codes, scales = jnp.moveaxis(codes, in_axis, -1), jnp.moveaxis(scales, in_axis, -1)
  return pack_mxfp4(codes, scales, axis=-1)


def import_mxfp4(weight_packed: jax.Array, weight_scale: jax.Array, in_axis: int, *,
                 dtype=jnp.float32) -> jax.Array:
  """Inverse of `export_mxfp4`: release bytes → the dequantised weight with `in` at `in_axis`."""
  codes, scales = unpack_mxfp4(weight_packed, weight_scale, axis=-1)
  w = dequantize(codes, scales, "mxfp4", axis=-1, dtype=dtype)
  return jnp.moveaxis(w, -1, in_axis)
