"""MX quantisation (k3train/quant/mx.py) against the invariants of docs/maths.md §7.6, numpy
float64 statements of the rules (§7.2, §7.4) and the documented edge cases.

Every comparison is exact (bitwise) unless a tolerance is stated: MX values are powers of two
times short integers, so there is nothing to round in the checks themselves.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3train.quant import mx

EMAX = {"mxfp4": 2, "mxfp8": 8}
MAX_NORMAL = {"mxfp4": 6.0, "mxfp8": 448.0}
# Grid magnitudes (the normal-and-subnormal values of each element format), from ml_dtypes.
GRID = {
    "mxfp4": np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]),
    "mxfp8": np.unique(np.abs(np.arange(256, dtype=np.uint8).view(jnp.float8_e4m3fn)
                              .astype(np.float64)))[:-1],      # drop NaN (sorted last)
}


def blocks_with_spread(shape, seed):
  """fp32 [.., 32·n] with each block scaled by its own power of two in [2^-40, 2^40]."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape)
  scale = np.exp2(rng.integers(-40, 41, size=shape[:-1] + (shape[-1] // 32, 1)))
  return (x.reshape(*shape[:-1], -1, 32) * scale).reshape(shape).astype(np.float32)


def np_bytes(scales):
  return np.asarray(mx.scale_bytes(scales))


@pytest.mark.parametrize("fmt", mx.FORMATS)
def test_floor_scale_byte_and_code_range(fmt):
  """§7.6.1: byte = floor(log2 amax) − emax + 127 in every block, and every |P| ≤ max normal."""
  x = blocks_with_spread((6, 128), seed=1)
  codes, scales = mx.quantize(jnp.asarray(x), fmt)
  amax = np.abs(x.astype(np.float64)).reshape(6, 4, 32).max(-1)
  np.testing.assert_array_equal(np_bytes(scales), np.floor(np.log2(amax)) - EMAX[fmt] + 127)
  assert np.max(np.abs(np.asarray(codes, np.float64))) <= MAX_NORMAL[fmt]
  assert codes.dtype == mx.ELEMENTS[fmt].dtype and scales.dtype == jnp.float8_e8m0fnu


@pytest.mark.parametrize("fmt", mx.FORMATS)
def test_rceil_scale_never_saturates(fmt):
  """rceil: byte = ceil(log2(amax / max_normal)) + 127, so amax / X ≤ max_normal (no clipping)."""
  x = blocks_with_spread((6, 128), seed=2)
  _, scales = mx.quantize(jnp.asarray(x), fmt, rule="rceil")
  amax = np.abs(x.astype(np.float64)).reshape(6, 4, 32).max(-1)
  want = np.ceil(np.log2(amax / MAX_NORMAL[fmt])) + 127
  np.testing.assert_array_equal(np_bytes(scales), want)
  assert np.all(amax / np.exp2(want - 127) <= MAX_NORMAL[fmt])


@pytest.mark.parametrize("rule", mx.SCALE_RULES)
@pytest.mark.parametrize("fmt", mx.FORMATS)
def test_idempotent(fmt, rule):
  """§7.6.2: Q(Q(x)) = Q(x), bit for bit (and with floor the codes and scales repeat too)."""
  x = jnp.asarray(blocks_with_spread((4, 96), seed=3))
  q = mx.quantize_dequantize(x, fmt, rule=rule)
  np.testing.assert_array_equal(mx.quantize_dequantize(q, fmt, rule=rule), q)
  if rule == "floor":
    (c1, s1), (c2, s2) = mx.quantize(x, fmt), mx.quantize(q, fmt)
    np.testing.assert_array_equal(np_bytes(s1), np_bytes(s2))
    np.testing.assert_array_equal(np.asarray(c1, np.float32), np.asarray(c2, np.float32))


@pytest.mark.parametrize("fmt", mx.FORMATS)
def test_tensor_on_the_grid_round_trips_exactly(fmt):
  """§7.6.3: blocks E·2^s with block max in [2^emax, max_normal]·2^s come back bit for bit,
  with the codes E and the scale byte s + 127."""
  rng = np.random.default_rng(4)
  grid = GRID[fmt]
  mags = rng.choice(grid, size=(3, 4, 32))
  top = grid[grid >= 2.0 ** EMAX[fmt]]
  mags[..., 5] = rng.choice(top, size=(3, 4))                  # the block max lies in the top binade
  signs = rng.choice([-1.0, 1.0], size=mags.shape)
  s = rng.integers(-60, 61, size=(3, 4))
  x = (signs * mags * np.exp2(s)[..., None]).reshape(3, 128).astype(np.float32)
  codes, scales = mx.quantize(jnp.asarray(x), fmt)
  np.testing.assert_array_equal(np_bytes(scales), s + 127)
  np.testing.assert_array_equal(np.asarray(codes, np.float64).reshape(mags.shape), signs * mags)
  np.testing.assert_array_equal(np.asarray(mx.dequantize(codes, scales, fmt)), x)


@pytest.mark.parametrize("rule", mx.SCALE_RULES)
@pytest.mark.parametrize("fmt", mx.FORMATS)
def test_error_at_most_half_an_ulp(fmt, rule):
  """§7.6.4: |x − Q(x)| ≤ ½ ulp of the element format at scale X for non-saturated elements;
  saturated ones (|x| > max_normal·X, floor only) land exactly on ±max_normal·X."""
  x = blocks_with_spread((8, 64), seed=5).astype(np.float64)
  q = np.asarray(mx.quantize_dequantize(jnp.asarray(x, jnp.float32), fmt, rule=rule), np.float64)
  _, scales = mx.quantize(jnp.asarray(x, jnp.float32), fmt, rule=rule)
  big_x = np.repeat(np.exp2(np_bytes(scales).astype(np.float64) - 127), 32, axis=-1)
  p = np.abs(x) / big_x
  elem = mx.ELEMENTS[fmt]
  binade = np.maximum(np.floor(np.log2(np.maximum(p, 1e-300))), elem.emin)
  half_ulp = 0.5 * np.exp2(binade - elem.mantissa_bits) * big_x
  sat = p > elem.max_normal
  assert np.all(np.abs(x - q)[~sat] <= half_ulp[~sat])
  np.testing.assert_array_equal(np.abs(q[sat]), (elem.max_normal * big_x)[sat])
  if rule == "rceil":
    assert not sat.any()


def test_round_to_nearest_even_ties():
  """§7.2: halves round to even (0.25→0, 0.75→1, 1.25→1, 2.5→2, 5→4; the block max 4 sets X=1)."""
  x = np.zeros(32, np.float32)
  x[:6] = [4.0, 0.25, 0.75, 1.25, 2.5, 5.0]
  q = np.asarray(mx.quantize_dequantize(jnp.asarray(x), "mxfp4"))
  np.testing.assert_array_equal(q[:6], [4.0, 0.0, 1.0, 1.0, 2.0, 4.0])


@pytest.mark.parametrize("fmt", mx.FORMATS)
def test_straight_through_gradient(fmt):
  """§7.6.5: ∂ Σ 2·fq(x) / ∂x = 2 everywhere (also under jit and in forward mode), and the
  forward of fake_quant is exactly Q(x) in x's dtype."""
  x = jnp.asarray(blocks_with_spread((2, 64), seed=6))
  grad = jax.jit(jax.grad(lambda v: jnp.sum(2.0 * mx.fake_quant(v, fmt))))(x)
  np.testing.assert_array_equal(grad, np.full(x.shape, 2.0, np.float32))
  out, tangent = jax.jvp(lambda v: mx.fake_quant(v, fmt, axis=0), (x.T,), (jnp.ones_like(x.T),))
  np.testing.assert_array_equal(tangent, np.ones(x.T.shape, np.float32))
  np.testing.assert_array_equal(out, mx.quantize_dequantize(x.T, fmt, axis=0))
  xb = x.astype(jnp.bfloat16)
  assert mx.fake_quant(xb, fmt).dtype == jnp.bfloat16


def test_pack_unpack_identity_and_nibble_order():
  """§7.6.6: pack → unpack is the identity on all 16 codes; element 2j sits in the low nibble."""
  rng = np.random.default_rng(7)
  nibbles = rng.integers(0, 16, size=(3, 64)).astype(np.uint8)
  codes = mx.e2m1_from_nibbles(jnp.asarray(nibbles))
  scale_bytes = rng.integers(0, 255, size=(3, 2)).astype(np.uint8)
  packed, sbytes = mx.pack_mxfp4(codes, mx.scales_from_bytes(jnp.asarray(scale_bytes)))
  assert packed.shape == (3, 32) and packed.dtype == jnp.uint8
  np.testing.assert_array_equal(np.asarray(packed), nibbles[:, 0::2] | (nibbles[:, 1::2] << 4))
  np.testing.assert_array_equal(np.asarray(sbytes), scale_bytes)
  codes2, scales2 = mx.unpack_mxfp4(packed, sbytes)
  np.testing.assert_array_equal(np.asarray(mx.e2m1_nibbles(codes2)), nibbles)
  np.testing.assert_array_equal(np_bytes(scales2), scale_bytes)
  # A concrete byte: codes (1.0, −6.0) are nibbles (0b0010, 0b1111) → 0xF2.
  one_byte, _ = mx.pack_mxfp4(jnp.asarray([1.0, -6.0], jnp.float4_e2m1fn),
                              jnp.ones((0,), jnp.float8_e8m0fnu))
  assert int(one_byte[0]) == 0xF2


def test_release_decoding_matches_the_published_rule():
  """§7.6.7, without PyTorch: import_mxfp4 equals a numpy statement of the K3 checkpoint decode
  (a 16-entry table indexed by the nibble, low nibble = even input index, ldexp by byte − 127),
  on every byte value. NEMO's code itself is not run here."""
  rng = np.random.default_rng(8)
  table = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])
  packed = rng.integers(0, 256, size=(2, 5, 32)).astype(np.uint8)      # [E, out, in/2]
  packed[0, 0, :] = np.arange(32) * 8 % 256
  scales = rng.integers(90, 165, size=(2, 5, 2)).astype(np.uint8)       # [E, out, in/32]
  values = np.empty((2, 5, 64))
  values[..., 0::2], values[..., 1::2] = table[packed & 15], table[packed >> 4]
  want = np.ldexp(values, np.repeat(scales.astype(np.int64) - 127, 32, axis=-1))
  got = mx.import_mxfp4(jnp.asarray(packed), jnp.asarray(scales), in_axis=1)   # [E, in, out]
  np.testing.assert_array_equal(np.asarray(got, np.float64), np.swapaxes(want, 1, 2))
  # export_mxfp4 is the inverse on weights already on the grid.
  p2, s2 = mx.export_mxfp4(got, in_axis=1)
  np.testing.assert_array_equal(mx.import_mxfp4(p2, s2, in_axis=1), got)


@pytest.mark.parametrize("fmt", mx.FORMATS)
def test_zero_subnormal_and_huge_blocks(fmt):
  """A zero block: zero codes and the byte 127 − emax (amax taken as 1). fp32 subnormals read as
  zero (a block of them is a zero block; next to normal values they quantise to 0). A block at
  the top of fp32 stays finite and saturates exactly as the rule says."""
  emax = EMAX[fmt]
  x = np.zeros((4, 32), np.float32)
  x[1, :] = 1e-40                                                   # all fp32 subnormals
  x[2, :3] = [1e-40, 1.0, -2.0 ** -126]                             # subnormal, normal, min normal
  x[3, :] = np.float32(3.0e38) * np.linspace(-1, 1, 32, dtype=np.float32)
  codes, scales = mx.quantize(jnp.asarray(x), fmt)
  b = np_bytes(scales)[:, 0]
  assert b[0] == b[1] == 127 - emax
  np.testing.assert_array_equal(np.asarray(codes[:2], np.float32), 0.0)
  q = np.asarray(mx.dequantize(codes, scales, fmt))
  np.testing.assert_array_equal(q[:2], 0.0)
  assert q[2, 0] == 0.0 and q[2, 1] == 1.0 and b[2] == 127 - emax
  assert b[3] == 127 + 127 - emax                                    # floor(log2 3e38) = 127
  assert np.all(np.isfinite(q[3]))
  top = MAX_NORMAL[fmt] * 2.0 ** (127 - emax)
  assert abs(q[3, 0]) == top and abs(q[3, -1]) == top               # 3e38 saturates to max·X


@pytest.mark.parametrize("fmt", mx.FORMATS)
def test_nan_and_inf_blocks_become_nan_blocks(fmt):
  """A block with NaN or ±Inf gets the NaN scale byte 255 and dequantises to NaN in all its 32
  elements (never to finite numbers: E2M1 alone would turn NaN into −0); other blocks are
  untouched, and fake_quant propagates the NaN forward while its gradient stays 1."""
  x = blocks_with_spread((3, 64), seed=9)
  x[0, 3], x[1, 40], x[2, 63] = np.nan, np.inf, -np.inf
  codes, scales = mx.quantize(jnp.asarray(x), fmt)
  b = np_bytes(scales)
  bad = np.array([[1, 0], [0, 1], [0, 1]], bool)
  np.testing.assert_array_equal(b == 255, bad)
  q = np.asarray(mx.dequantize(codes, scales, fmt)).reshape(3, 2, 32)
  assert np.all(np.isnan(q[bad])) and np.all(np.isfinite(q[~bad]))
  clean = np.asarray(mx.quantize_dequantize(jnp.asarray(np.nan_to_num(x)), fmt)).reshape(3, 2, 32)
  np.testing.assert_array_equal(q[~bad], clean[~bad])
  fq = np.asarray(mx.fake_quant(jnp.asarray(x), fmt)).reshape(3, 2, 32)
  assert np.all(np.isnan(fq[bad]))


def test_e4m3_saturates_instead_of_nan():
  """§7.3 pitfall: a bare cast sends 464 to NaN; quantize clips first (block max 500 → X = 1,
  500 saturates to 448, 460 too)."""
  x = np.zeros(32, np.float32)
  x[:3] = [500.0, 460.0, -470.0]
  q = np.asarray(mx.quantize_dequantize(jnp.asarray(x), "mxfp8"))
  np.testing.assert_array_equal(q[:3], [448.0, 448.0, -448.0])


def test_bad_arguments_fail_clearly():
  with pytest.raises(ValueError, match="multiple of 32"):
    mx.quantize(jnp.ones((2, 48)), "mxfp4")
  with pytest.raises(ValueError, match="unknown MX format"):
    mx.quantize(jnp.ones((2, 32)), "mxfp6")
  with pytest.raises(ValueError, match="unknown MX scale rule"):
    mx.fake_quant(jnp.ones((2, 32)), "mxfp4", rule="ceil")
  codes, scales = mx.quantize(jnp.ones((2, 64)), "mxfp4")
  with pytest.raises(ValueError, match="do not match"):
    mx.dequantize(codes, scales[:, :1], "mxfp4")
  with pytest.raises(ValueError, match="float8_e4m3fn"):
    mx.dequantize(codes, scales, "mxfp8")


def test_code_values_read_the_bits_and_agree_with_the_kernel_decoder():
  """`mx.code_values` (a table by bit pattern) equals the dtype's own convert for every code and
  the kernels' arithmetic E4M3 decoder: two independent decodings of all 256 + 16 codes. Under
  jit with a quantisation in the same program it still rounds (nothing to fold)."""
  import ml_dtypes
  from pallas_kernels.moe.mx_operands import decode_e4m3
  e4m3 = jnp.asarray(np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn))
  e2m1 = mx.e2m1_from_nibbles(jnp.arange(16, dtype=jnp.uint8))
  for codes in (e4m3, e2m1):
    got = np.asarray(mx.code_values(codes))
    want = np.asarray(codes.astype(jnp.float32))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
  np.testing.assert_array_equal(np.asarray(mx.code_values(e4m3)), np.asarray(decode_e4m3(e4m3)))
  x = jnp.linspace(-3.0, 3.0, 64).reshape(2, 32) + 0.01
  fq = jax.jit(lambda x: mx.fake_quant(x, "mxfp4"))(x)
  assert len(np.unique(np.abs(np.asarray(fq)))) <= 8 * 2          # on the E2M1 grid of 2 blocks
