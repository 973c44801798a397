"""gmm_mx: the grouped matmul on MX operands (MXFP8 activations, MXFP4 weights in the release
layout) against the fake-quant path gmm(Q(lhs), Q(rhs)), on every backend (pallas_gpu in the
Mosaic GPU interpreter, as in test_moe_pallas_gpu.py).

The MX operands are made by k3train.quant.mx, whose own tests check the quantisation rules;
here the kernels' decoding (mx_operands.py) must agree with it bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3train.quant import mx
from pallas_kernels import moe as moe_ops
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


def test_gmm_mx_pallas_gpu_backend_bf16_in_interpret_mode():
  """The op-level pallas_gpu backend (default tiles; MXFP8 dequantised in XLA, MXFP4 in the
  kernel) on bf16 operands equals the fake-quant path on ragged_dot to bf16 rounding (2e-2)."""
  m, k, n, sizes = 136, 256, 256, [40, 0, 90]
  lhs, rhs = normal((m, k), 7, jnp.bfloat16), normal((3, k, n), 8, jnp.bfloat16)
  gs = jnp.asarray(sizes, jnp.int32)
  ops = mx_operands_of(lhs, rhs)
  out = moe_ops.gmm_mx(lhs, rhs, gs, backend="pallas_gpu", **ops)
  assert out.dtype == jnp.bfloat16
  want = fake_quant_gmm(lhs, rhs, gs, "ragged_dot")
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                             rtol=2e-2, atol=2e-1)


def test_mx_kernel_lowers_to_mosaic_gpu(monkeypatch):
  """The hardware branches of gmm_mx_mgpu (layout-annotated loads, the register decode, the
  wgmma operands) pass Mosaic GPU's layout inference and lowering for an H100/H200 (sm_90) with
  the default tiles; nothing runs (no GPU here)."""
  monkeypatch.setattr(pallas_gpu, "_num_sms", lambda interpret: 132)
  m, k, n, g = 512, 512, 512, 4
  f = jax.jit(lambda a, p, s, gs: pallas_gpu.gmm_mx_mgpu(a, p, s, gs, interpret=False))
  lowered = f.trace(jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
                    jax.ShapeDtypeStruct((g, n, k // 2), jnp.uint8),
                    jax.ShapeDtypeStruct((g, n, k // 32), jnp.uint8),
                    jax.ShapeDtypeStruct((g,), jnp.int32)).lower(lowering_platforms=("cuda",))
  assert "mosaic_gpu" in lowered.as_text()


def test_gmm_mx_rejects_mismatched_operands():
  lhs, rhs, gs = inputs()
  ops = mx_operands_of(lhs, rhs)
  with pytest.raises(ValueError, match="rhs_packed"):
    moe_ops.gmm_mx(lhs, rhs, gs, **dict(ops, rhs_packed=ops["rhs_packed"][:, :, :-1]))
  with pytest.raises(ValueError, match="lhs_codes"):
    moe_ops.gmm_mx(lhs, rhs, gs, **dict(ops, lhs_codes=ops["lhs_codes"].astype(jnp.float32)))
