"""gmm_mx: the grouped matmul on MX operands (MXFP8 activations, MXFP4 weights in the release
layout) against the fake-quant path gmm(Q(lhs), Q(rhs)), on every backend (pallas_gpu in the
Mosaic GPU interpreter, as in test_moe_pallas_gpu.py), and the Mosaic GPU MX kernels — MXFP4
weights decoded in the kernel (by selects or by bit construction, `MgpuConfig.e2m1_decode`),
activations read as bf16 (`gmm_mx_mgpu`) or as MXFP8 decoded in the kernel too
(`gmm_mx_mgpu_mxfp8`) — against the bf16 kernel and a float64 reference.

The MX operands are made by k3train.quant.mx, whose own tests check the quantisation rules;
here the kernels' decoding (mx_operands.py) must agree with it bit for bit.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3train.quant import mx
from pallas_kernels import moe as moe_ops
from pallas_kernels import platform
from pallas_kernels.moe import mx_operands, pallas_gpu
from tests.pallas_kernels import mgpu_interpret_shim
from tests.pallas_kernels.gmm_testing import loop_gmm, normal

mgpu_interpret_shim.install()

CFG_MX = pallas_gpu.MgpuConfig(tile_m=64, tile_n=64, tile_k=64, stages=2, epi_n=64, grid_width=2)
K, N = 128, 128
SIZES = [37, 0, 70, 60]                        # an empty group, rows past the groups (M = 203)
M = 203


def mx_operands_of(lhs, rhs, rule="floor"):
  """The encodings gmm_mx reads: MXFP8 lhs along K, MXFP4 rhs along K in the release layout."""
  codes, scales = mx.quantize(lhs, "mxfp8", axis=-1, rule=rule)
  packed, w_scales = mx.export_mxfp4(rhs, in_axis=1, rule=rule)
  return dict(lhs_codes=codes, lhs_scales=mx.scale_bytes(scales), rhs_packed=packed,
              rhs_scales=w_scales)


def fake_quant_gmm(lhs, rhs, gs, backend, rule="floor"):
  """The fake-quant path the model takes without gmm_mx."""
  lhs_q = mx.fake_quant(lhs, "mxfp8", axis=-1, rule=rule)
  rhs_q = mx.fake_quant(rhs, "mxfp4", axis=1, rule=rule)
  return moe_ops.gmm(lhs_q, rhs_q, gs, backend=backend)


def inputs(dtype=jnp.float32, seed=0):
  lhs, rhs = normal((M, K), seed, dtype), normal((len(SIZES), K, N), seed + 1, dtype)
  return lhs, rhs, jnp.asarray(SIZES, jnp.int32)


def test_kernel_decoding_equals_quant_dequantize():
  """mx_operands' integer decoding = mx.dequantize, on every nibble and a wide range of bytes
  (bit for bit, fp32), including the NaN scale byte."""
  rng = np.random.default_rng(0)
  nib = rng.integers(0, 16, size=(2, 3, 64)).astype(np.uint8)
  nib[0, 0, :16] = np.arange(16)
  scales = rng.integers(3, 255, size=(2, 3, 2)).astype(np.uint8)
  scales[1, 2, 1] = 255
  codes = mx.e2m1_from_nibbles(jnp.asarray(nib))
  packed, _ = mx.pack_mxfp4(codes, mx.scales_from_bytes(jnp.asarray(scales)))
  got = mx_operands.dequantize_rhs_nk(packed, jnp.asarray(scales), jnp.float32)
  want = mx.dequantize(codes, mx.scales_from_bytes(jnp.asarray(scales)), "mxfp4")
  np.testing.assert_array_equal(got, want)
  assert np.all(np.isnan(np.asarray(got)[1, 2, 32:]))
  lhs = jnp.asarray(np.random.default_rng(1).standard_normal((4, 64)) * 100, jnp.float32)
  c8, s8 = mx.quantize(lhs, "mxfp8")
  np.testing.assert_array_equal(mx_operands.dequantize_lhs(c8, mx.scale_bytes(s8), jnp.float32),
                                mx.dequantize(c8, s8, "mxfp8"))


@pytest.mark.parametrize("backend", ["ragged_dot", "reference"])
def test_gmm_mx_forward_and_gradients_equal_fake_quant(backend):
  """Forward equals gmm(Q(lhs), Q(rhs)); the gradients are the straight-through ones, equal to
  the fake-quant path's (bit for bit: the same gmm at the same dequantised operands)."""
  lhs, rhs, gs = inputs()
  ct = normal((M, N), 9)
  ops = mx_operands_of(lhs, rhs)
  loss_mx = lambda a, b: jnp.sum(moe_ops.gmm_mx(a, b, gs, backend=backend, **ops) * ct)
  loss_fq = lambda a, b: jnp.sum(fake_quant_gmm(a, b, gs, backend) * ct)
  out_mx = moe_ops.gmm_mx(lhs, rhs, gs, backend=backend, **ops)
  np.testing.assert_array_equal(out_mx, fake_quant_gmm(lhs, rhs, gs, backend))
  g_mx = jax.jit(jax.grad(loss_mx, argnums=(0, 1)))(lhs, rhs)
  g_fq = jax.jit(jax.grad(loss_fq, argnums=(0, 1)))(lhs, rhs)
  for a, b in zip(g_mx, g_fq):
    np.testing.assert_array_equal(a, b)
  # And against float64 ground truth on the dequantised operands (fp32 accumulation: 1e-5).
  lq = mx.quantize_dequantize(lhs, "mxfp8", axis=-1)
  rq = mx.quantize_dequantize(rhs, "mxfp4", axis=1)
  np.testing.assert_allclose(out_mx, loop_gmm(lq, rq, SIZES), rtol=1e-5, atol=1e-4)
  np.testing.assert_array_equal(np.asarray(out_mx)[sum(SIZES):], 0.0)


def test_gmm_mx_bf16_rceil_matches_fake_quant():
  """bf16 operands and the rceil rule: forward bit-equal to the fake-quant path (MX values are
  exact in bf16), gradients in bf16."""
  lhs, rhs, gs = inputs(jnp.bfloat16, seed=3)
  ops = mx_operands_of(lhs, rhs, rule="rceil")
  out = moe_ops.gmm_mx(lhs, rhs, gs, backend="ragged_dot", **ops)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_array_equal(out, fake_quant_gmm(lhs, rhs, gs, "ragged_dot", rule="rceil"))
  d_lhs = jax.grad(lambda a: jnp.sum(moe_ops.gmm_mx(a, rhs, gs, backend="ragged_dot", **ops)
                                     .astype(jnp.float32)))(lhs)
  assert d_lhs.dtype == jnp.bfloat16


def test_mx_kernel_equals_fake_quant_in_interpret_mode():
  """gmm_mx_mgpu (MXFP4 weights decoded in the kernel) equals the fake-quant path through the
  bf16 kernel with the same tiles (fp32 operands, which the interpreter multiplies in fp32;
  1e-5: the MX kernel sums each K-step as two wgmmas of 32). A NaN scale byte makes exactly its
  weight row's output column NaN in its group's rows."""
  lhs, rhs, gs = inputs(seed=5)
  ops = mx_operands_of(lhs, rhs)
  packed, scales = ops["rhs_packed"], ops["rhs_scales"].at[2, 17, 1].set(255)   # group 2, n=17
  lhs_q = mx.quantize_dequantize(lhs, "mxfp8", axis=-1)
  rhs_q = mx_operands.dequantize_rhs(packed, scales, jnp.float32)
  out = pallas_gpu.gmm_mx_mgpu(lhs_q, packed, scales, gs, config=CFG_MX, interpret=True)
  want = pallas_gpu.gmm_mgpu(lhs_q, rhs_q, gs, config=CFG_MX, interpret=True)
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
  out = np.asarray(out)
  rows2 = slice(sum(SIZES[:2]), sum(SIZES[:3]))
  assert np.all(np.isnan(out[rows2, 17]))
  assert np.isnan(out).sum() == SIZES[2]
  np.testing.assert_array_equal(out[sum(SIZES):], 0.0)


def _e2m1_decodes_f32():
  """Both in-kernel E2M1 weight decodes on every nibble (columns) × scale byte s (rows) →
  (select, bits), fp32 [256, 16]: the select decode times the row's two power-of-two factors,
  and the bit construction."""
  nib_s16 = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (256, 16))
  bytes_s16 = jnp.broadcast_to(jnp.arange(256, dtype=jnp.int32)[:, None], (256, 16))
  rows = lambda v: jnp.broadcast_to(v[:, None], (256, 16))
  f1, f2 = pallas_gpu._row_factors(bytes_s16, nib_s16, 0)     # column 0 holds each row's byte
  select = pallas_gpu._decode_e2m1_f32(nib_s16) * rows(f1) * rows(f2)
  bits_rows = pallas_gpu._e2m1_bits_rows(bytes_s16[:, 0])
  bits = pallas_gpu._decode_e2m1_bits(nib_s16, *(rows(x) for x in bits_rows))
  return select, bits


def test_e2m1_bits_decode_on_every_code_and_scale_byte():
  """The "bits" weight decode on all 16 codes × 256 scale bytes s against the float64 value
  E2M1 · 2^(s − 127): exact wherever that is a normal fp32 number; ±0 where it is subnormal
  (s ≤ 1: flushed, as mx.dequantize gives it); ±inf past fp32's range (s ≥ 253, fp32's rounding
  of those values); NaN for every code at s = 255. Bit for bit mx.dequantize (signs of zeros
  included), and the select decode rounded to bf16, f16 and fp32."""
  select, bits = (np.asarray(x) for x in jax.jit(_e2m1_decodes_f32)())
  mag = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
  code = np.arange(16)
  exact = np.where(code >= 8, -1.0, 1.0) * mag[code % 8] * 2.0 ** (np.arange(256)[:, None] - 127)
  want = np.where(np.abs(exact) < 2.0 ** -126, np.copysign(0.0, exact), exact)
  want = np.where(np.abs(exact) > np.finfo(np.float32).max, np.copysign(np.inf, exact), want)
  want = want.astype(np.float32)
  want[255] = np.nan
  assert 0 < np.sum((exact != 0) & (want == 0)) and 0 < np.sum(np.isinf(want))   # both edges hit
  np.testing.assert_array_equal(bits, want)
  np.testing.assert_array_equal(np.signbit(bits[:255]), np.signbit(want[:255]))

  nibbles = jnp.broadcast_to(jnp.arange(32, dtype=jnp.uint8) % 16, (256, 32))
  scales = mx.scales_from_bytes(jnp.arange(256, dtype=jnp.uint8)[:, None])
  ref = np.asarray(mx.dequantize(mx.e2m1_from_nibbles(nibbles), scales, "mxfp4"))[:, :16]
  np.testing.assert_array_equal(bits[:255].view(np.uint32), ref[:255].view(np.uint32))
  assert np.all(np.isnan(ref[255]))

  for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
    as_bits = lambda x: np.asarray(jnp.asarray(x).astype(dtype)).view(
        f"u{jnp.dtype(dtype).itemsize}")
    np.testing.assert_array_equal(as_bits(bits[:255]), as_bits(select[:255]))
  assert np.all(np.isnan(select[255]))


@pytest.mark.filterwarnings("ignore:.*encountered in matmul:RuntimeWarning")   # the inf blocks
@pytest.mark.parametrize("lhs_format", ["bf16", "mxfp8"])
def test_mx_kernels_bits_decode_equals_select_in_interpret_mode(lhs_format):
  """e2m1_decode="bits" gives the default select decode's output bit for bit in both MX kernels,
  on the ragged problem (an empty group, 43 rows past the groups) with weight scale bytes at the
  ends of the range: 255 (a NaN block), 0 and 1 (subnormal values, flushed), 253 and 254
  (values past fp32: inf)."""
  lhs, rhs, gs = inputs(seed=13)
  ops = mx_operands_of(lhs, rhs)
  wbytes = ops["rhs_scales"]
  for (gi, col, blk), byte in (((2, 17, 1), 255), ((0, 3, 0), 0), ((0, 5, 3), 1),
                               ((2, 40, 2), 253), ((3, 9, 0), 254)):
    wbytes = wbytes.at[gi, col, blk].set(byte)
  bits_cfg = dataclasses.replace(CFG_MX, e2m1_decode="bits")
  if lhs_format == "bf16":
    lhs_q = mx.quantize_dequantize(lhs, "mxfp8", axis=-1)
    run = lambda cfg: pallas_gpu.gmm_mx_mgpu(lhs_q, ops["rhs_packed"], wbytes, gs, config=cfg,
                                             interpret=True)
  else:
    run = lambda cfg: pallas_gpu.gmm_mx_mgpu_mxfp8(ops["lhs_codes"], ops["lhs_scales"],
                                                   ops["rhs_packed"], wbytes, gs, config=cfg,
                                                   interpret=True)
  select, bits = (np.asarray(run(cfg)) for cfg in (CFG_MX, bits_cfg))
  itemsize = select.dtype.itemsize
  np.testing.assert_array_equal(bits.view(f"u{itemsize}"), select.view(f"u{itemsize}"))
  assert np.isnan(select[sum(SIZES[:2]), 17]) and not np.isfinite(select[sum(SIZES[:3]), 9])
  np.testing.assert_array_equal(bits[sum(SIZES):], 0.0)


def test_mgpu_config_rejects_unknown_e2m1_decode():
  with pytest.raises(ValueError, match="e2m1_decode must be one of select, bits"):
    pallas_gpu.MgpuConfig(e2m1_decode="table")


def test_decode_e4m3_matches_float8_on_every_code():
  """mx_operands.decode_e4m3 (bits → fp32 by integer ops) equals the float8_e4m3fn → fp32
  conversion on all 256 codes, signs of zeros and the two NaNs included."""
  b = jnp.arange(256, dtype=jnp.uint8)
  got = np.asarray(mx_operands.decode_e4m3(b))
  want = np.asarray(jax.lax.bitcast_convert_type(b, jnp.float8_e4m3fn).astype(jnp.float32))
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
  np.testing.assert_array_equal(mx_operands.decode_e4m3(jax.lax.bitcast_convert_type(
      b, jnp.float8_e4m3fn)), got)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_mxfp8_kernel_equals_bf16_kernel_and_reference_in_interpret_mode(dtype):
  """gmm_mx_mgpu_mxfp8 (MXFP8 activations and MXFP4 weights both decoded in the kernel) on a
  ragged problem (an empty group, groups smaller than and straddling the 64-row tile, 43 rows
  past the groups, NaN scale bytes in both operands):

  (a) equals the bf16-activation MX kernel on dequantised activations bit for bit (the same
      wgmma split), and the plain kernel gmm_mgpu on dequantised activations and weights to
      fp32 summation order (fp32: 1e-5; bf16: the same bf16 output, tolerance one rounding,
      2^-8 relative);
  (b) equals the float64 reference Σ deq(a)·deq(w) per group off the NaN rows and columns
      within the output rounding: fp32 1e-5 relative, bf16 2^-8 relative (half an ulp of an
      8-bit significand is at most 2^-8 of the value), plus 1e-4 absolute for fp32 summation;
  and puts NaN exactly in the rows of the NaN activation block and the column of the NaN weight
  block within its group, zeros past the groups."""
  lhs, rhs, gs = inputs(seed=11)
  ops = mx_operands_of(lhs, rhs)
  codes, packed = ops["lhs_codes"], ops["rhs_packed"]
  sbytes = ops["lhs_scales"].at[150, 2].set(255)            # row 150 (group 3), block 2
  wbytes = ops["rhs_scales"].at[2, 17, 1].set(255)          # group 2, column 17, block 1
  out = pallas_gpu.gmm_mx_mgpu_mxfp8(codes, sbytes, packed, wbytes, gs, dtype=dtype,
                                     config=CFG_MX, interpret=True)
  assert out.dtype == dtype and out.shape == (M, N)
  lhs_q = mx_operands.dequantize_lhs(codes, sbytes, dtype)
  rhs_q = mx_operands.dequantize_rhs(packed, wbytes, dtype)
  same_split = pallas_gpu.gmm_mx_mgpu(lhs_q, packed, wbytes, gs, config=CFG_MX, interpret=True)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(same_split, np.float32))
  plain = pallas_gpu.gmm_mgpu(lhs_q, rhs_q, gs, config=CFG_MX, interpret=True)
  tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2.0 ** -8, atol=1e-4)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(plain, np.float32), **tol)

  out = np.asarray(out, np.float32)
  ref = loop_gmm(mx_operands.dequantize_lhs(codes, sbytes, jnp.float32),
                 mx_operands.dequantize_rhs(packed, wbytes, jnp.float32), SIZES)
  want_nan = np.zeros((M, N), bool)
  want_nan[150, :] = True
  want_nan[sum(SIZES[:2]):sum(SIZES[:3]), 17] = True
  np.testing.assert_array_equal(np.isnan(out), want_nan)
  tol = dict(rtol=1e-5, atol=1e-4) if dtype == jnp.float32 else dict(rtol=2.0 ** -8, atol=1e-4)
  np.testing.assert_allclose(out[~want_nan], ref[~want_nan], **tol)
  np.testing.assert_array_equal(out[sum(SIZES):], 0.0)


def test_mxfp8_kernel_accepts_uint8_codes_and_rejects_bad_operands():
  lhs, rhs, gs = inputs(seed=12)
  ops = mx_operands_of(lhs, rhs)
  args = (ops["lhs_scales"], ops["rhs_packed"], ops["rhs_scales"], gs)
  f8 = pallas_gpu.gmm_mx_mgpu_mxfp8(ops["lhs_codes"], *args, config=CFG_MX, interpret=True)
  u8 = pallas_gpu.gmm_mx_mgpu_mxfp8(jax.lax.bitcast_convert_type(ops["lhs_codes"], jnp.uint8),
                                    *args, config=CFG_MX, interpret=True)
  np.testing.assert_array_equal(f8, u8)
  with pytest.raises(ValueError, match="lhs codes"):
    pallas_gpu.gmm_mx_mgpu_mxfp8(lhs, *args, config=CFG_MX, interpret=True)
  with pytest.raises(ValueError, match="lhs scales"):
    pallas_gpu.gmm_mx_mgpu_mxfp8(ops["lhs_codes"], ops["lhs_scales"][:, :-1], *args[1:],
                                 config=CFG_MX, interpret=True)
  with pytest.raises(ValueError, match="tile_k"):
    pallas_gpu.gmm_mx_mgpu_mxfp8(ops["lhs_codes"], *args, interpret=True,
                                 config=pallas_gpu.MgpuConfig(tile_k=128))


def test_gmm_mx_pallas_gpu_backend_bf16_in_interpret_mode():
  """The op-level pallas_gpu backend (default tiles) on bf16 operands: the in-kernel MXFP8
  decode (lhs_decode="kernel", the default) and the XLA one give the same output, equal to the
  fake-quant path on ragged_dot to bf16 rounding (2e-2); the straight-through gradients (the
  plain Mosaic GPU gmm / tgmm at the dequantised operands) equal the ragged_dot backend's to
  bf16 rounding."""
  m, k, n, sizes = 136, 256, 256, [40, 0, 90]
  lhs, rhs = normal((m, k), 7, jnp.bfloat16), normal((3, k, n), 8, jnp.bfloat16)
  gs = jnp.asarray(sizes, jnp.int32)
  ops = mx_operands_of(lhs, rhs)
  out = moe_ops.gmm_mx(lhs, rhs, gs, backend="pallas_gpu", **ops)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_array_equal(
      out, moe_ops.gmm_mx(lhs, rhs, gs, backend="pallas_gpu", lhs_decode="xla", **ops))
  want = fake_quant_gmm(lhs, rhs, gs, "ragged_dot")
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                             rtol=2e-2, atol=2e-1)
  ct = normal((m, n), 9, jnp.bfloat16)
  grads = lambda backend: jax.grad(lambda a, b: jnp.sum(
      (moe_ops.gmm_mx(a, b, gs, backend=backend, **ops) * ct).astype(jnp.float32)),
      argnums=(0, 1))(lhs, rhs)
  for got, ref in zip(grads("pallas_gpu"), grads("ragged_dot")):
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32),
                               rtol=2e-2, atol=2e-1)
  with pytest.raises(ValueError, match="lhs_decode"):
    moe_ops.gmm_mx(lhs, rhs, gs, backend="pallas_gpu", lhs_decode="registers", **ops)


@pytest.mark.parametrize("e2m1_decode", pallas_gpu.E2M1_DECODES)
@pytest.mark.parametrize("lhs_format", ["bf16", "mxfp8"])
def test_mx_kernel_lowers_to_mosaic_gpu(lhs_format, e2m1_decode):
  """The hardware branches of gmm_mx_mgpu and gmm_mx_mgpu_mxfp8 (layout-annotated loads, the
  register decodes, with each weight decode, the wgmma operands — the activations as the
  register operand for mxfp8) pass Mosaic GPU's layout inference and lowering for an H100/H200
  (sm_90) with the default tiles, and with 4 stages and tile_m = 64; nothing runs (no GPU
  here)."""
  m, k, n, g = 1000, 512, 512, 4
  s = jax.ShapeDtypeStruct
  rhs = (s((g, n, k // 2), jnp.uint8), s((g, n, k // 32), jnp.uint8), s((g,), jnp.int32))
  for cfg in (pallas_gpu.MgpuConfig(e2m1_decode=e2m1_decode),
              pallas_gpu.MgpuConfig(stages=4, e2m1_decode=e2m1_decode),
              pallas_gpu.MgpuConfig(tile_m=64, e2m1_decode=e2m1_decode)):
    if lhs_format == "bf16":
      f = jax.jit(lambda a, p, w, gs: pallas_gpu.gmm_mx_mgpu(a, p, w, gs, config=cfg))
      lhs = (s((m, k), jnp.bfloat16),)
    else:
      f = jax.jit(lambda c, sc, p, w, gs: pallas_gpu.gmm_mx_mgpu_mxfp8(c, sc, p, w, gs,
                                                                       config=cfg))
      lhs = (s((m, k), jnp.float8_e4m3fn), s((m, k // 32), jnp.uint8))
    with platform.targeting("gpu"):           # the grid of an H100/H200's 132 SMs
      lowered = f.trace(*lhs, *rhs).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


def test_gmm_mx_rejects_mismatched_operands():
  lhs, rhs, gs = inputs()
  ops = mx_operands_of(lhs, rhs)
  with pytest.raises(ValueError, match="rhs_packed"):
    moe_ops.gmm_mx(lhs, rhs, gs, **dict(ops, rhs_packed=ops["rhs_packed"][:, :, :-1]))
  with pytest.raises(ValueError, match="lhs_codes"):
    moe_ops.gmm_mx(lhs, rhs, gs, **dict(ops, lhs_codes=ops["lhs_codes"].astype(jnp.float32)))
