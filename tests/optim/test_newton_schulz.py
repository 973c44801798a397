"""Batched Newton–Schulz (k3train/optim/newton_schulz.py, docs/maths.md §4.1).

References are a float64 numpy loop over single blocks. The batched float32 path must equal it to
float32 round-off; the bfloat16 path is checked for what Muon needs (singular values in a band)
and for what makes it fast (bf16 operands, float32 accumulation, one matmul chain per block shape).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from optax.contrib import MuonDimensionNumbers as MDN

from k3train.optim import muon
from k3train.optim import newton_schulz as ns
from tests.jaxprs import primitive_counts

COEFFS = (3.4445, -4.7750, 2.0315)
EPS = 1e-8
# float32 against float64 after five steps: measured ≤ 1.2e-6 on entries of size ≤ ~1.
TOL = 1e-5


def ns_block_reference(g: np.ndarray, steps: int = 5) -> np.ndarray:
  """The quintic iteration on one 2-D block in float64 (transposed when taller than wide)."""
  x = np.asarray(g, np.float64)
  x = x / (np.linalg.norm(x) + EPS)
  tall = x.shape[0] > x.shape[1]
  x = x.T if tall else x
  a, b, c = COEFFS
  for _ in range(steps):
    gram = x @ x.T
    x = a * x + (b * gram + c * gram @ gram) @ x
  return x.T if tall else x


def gaussian(shape, seed):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


# ---------------------------------------------------------------------------------------------
# (a) the batched iteration


def test_batched_fp32_equals_per_block_float64_loop():
  for shape, seed in (((5, 16, 48), 0), ((3, 40, 24), 1), ((2, 32, 32), 2)):
    x = gaussian(shape, seed)
    got = np.asarray(ns.orthogonalize(x, COEFFS, 5, EPS, compute_dtype="float32"))
    assert got.shape == shape and got.dtype == np.float32
    for i in range(shape[0]):
      np.testing.assert_allclose(got[i], ns_block_reference(np.asarray(x[i])), atol=TOL, rtol=0,
                                 err_msg=f"{shape} block {i}")


def test_scale_invariance_and_zero_block():
  x = gaussian((2, 16, 32), 3)
  a = ns.orthogonalize(x, compute_dtype="float32")
  b = ns.orthogonalize(x * jnp.asarray([1e-3, 50.0])[:, None, None], compute_dtype="float32")
  np.testing.assert_allclose(a, b, atol=TOL, rtol=0)
  zero = ns.orthogonalize(jnp.zeros((1, 8, 16)))       # eps keeps a zero gradient finite
  np.testing.assert_array_equal(zero, 0.0)


# ---------------------------------------------------------------------------------------------
# (b) grouping leaves by block shape

LEAVES = {   # name: (shape, dims, how to index block j of the leaf as a 2-D [in, out] array)
    "per_head": ((32, 3, 16), MDN(0, 2), [lambda x, h=h: x[:, h, :] for h in range(3)]),
    "o_proj": ((3, 16, 32), MDN(1, 2), [lambda x, h=h: x[h] for h in range(3)]),
    "experts": ((4, 32, 16), MDN(1, 2), [lambda x, e=e: x[e] for e in range(4)]),
    "stacked": ((2, 32, 3, 16), MDN(1, 3),
                [lambda x, l=l, h=h: x[l, :, h, :] for l in range(2) for h in range(3)]),
    "matrix": ((24, 40), MDN(0, 1), [lambda x: x]),
    "tall": ((40, 24), MDN(0, 1), [lambda x: x]),
    "out_first": ((16, 32), MDN(1, 0), [lambda x: x.T]),    # [out, in] layout
}


def test_leaves_come_back_in_their_layouts_and_equal_per_block_ns():
  names = list(LEAVES)
  leaves = [gaussian(LEAVES[n][0], i) for i, n in enumerate(names)]
  dims = [LEAVES[n][1] for n in names]
  rms = 0.2
  out = ns.orthogonalize_leaves(leaves, dims, compute_dtype="float32", rms_scale=rms)
  for name, x, y in zip(names, leaves, out):
    shape, _, blocks = LEAVES[name]
    assert y.shape == shape and y.dtype == x.dtype, name
    x, y = np.asarray(x), np.asarray(y)
    for j, block in enumerate(blocks):
      g = block(x)
      want = rms * math.sqrt(max(g.shape)) * ns_block_reference(g)
      np.testing.assert_allclose(block(y), want, atol=TOL, rtol=0, err_msg=f"{name} block {j}")
  # Four oriented block shapes: 16×32 (per_head, o_proj, experts, stacked, out_first) and 24×40
  # (matrix, tall); the FLOP count follows the same grouping.
  assert ns.ns_flops_of_leaves([x.shape for x in leaves], dims) == 5 * (
      (3 + 3 + 4 + 6 + 1) * (4 * 16 * 16 * 32 + 2 * 16 ** 3) + 2 * (4 * 24 * 24 * 40 + 2 * 24 ** 3))


def test_leaf_dtype_is_kept():
  x = gaussian((4, 16, 32), 7).astype(jnp.bfloat16)
  (y,) = ns.orthogonalize_leaves([x], [MDN(1, 2)])
  assert y.dtype == jnp.bfloat16 and y.shape == x.shape


# ---------------------------------------------------------------------------------------------
# (c) bfloat16: still an orthogonalisation, computed with bf16 operands


def test_bf16_singular_values_in_band():
  for seed in range(3):
    g = gaussian((1, 256, 128), 20 + seed)
    x = np.asarray(ns.orthogonalize(g, compute_dtype="bfloat16"))[0]
    s = np.linalg.svd(x, compute_uv=False)
    # The quintic's fixed band is about [0.68, 1.14] (measured 0.677–1.139 in bf16).
    assert 0.6 <= s.min() and s.max() <= 1.25, (s.min(), s.max())


def test_bf16_matmuls_take_bf16_and_round_once():
  """bf16 operands, float32 accumulation; each GEMM's alpha·(L·R) + C is formed in float32 and
  rounded to bf16 once, the operand of the next GEMM."""
  jaxpr = jax.make_jaxpr(lambda x: ns.orthogonalize(x, compute_dtype="bfloat16"))(
      jnp.zeros((2, 16, 32)))
  dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
  assert len(dots) == 3 * 5
  for e in dots:
    assert all(v.aval.dtype == jnp.bfloat16 for v in e.invars), e
    assert e.outvars[0].aval.dtype == jnp.float32, e
  g = gaussian((1, 64, 32), 9)
  assert not np.array_equal(ns.orthogonalize(g, compute_dtype="bfloat16"),
                            ns.orthogonalize(g, compute_dtype="float32"))


def test_scaled_chain_equals_plain_steps_in_float32():
  """The bf16 path's rewriting (X = s·Y; Â = b·A; three alpha·(L·R) + C GEMMs) is the same
  iteration: run in float32 it equals the plain steps to float32 round-off."""
  for shape, seed in (((3, 16, 32), 30), ((2, 48, 48), 31)):
    g = gaussian(shape, seed)
    x = g / (jnp.linalg.norm(g, axis=(1, 2), keepdims=True) + EPS)
    y, scale = ns._scaled_chain(x, COEFFS, 5)
    plain = x
    for _ in range(5):
      plain = ns._quintic_step(plain, COEFFS, jnp.float32)
    assert math.isclose(scale, COEFFS[0] ** 5, rel_tol=1e-12)
    np.testing.assert_allclose(np.asarray(y) * scale, np.asarray(plain), atol=TOL, rtol=0)
    for j in range(shape[0]):
      np.testing.assert_allclose(np.asarray(y[j]) * scale, ns_block_reference(g[j]), atol=TOL,
                                 rtol=0)


def test_bf16_close_to_float64():
  """bf16 against the float64 loop: relative Frobenius error ≤ 2.5e-2 (measured 1.2–1.5e-2
  on CPU; the plain bf16 steps, rounding each product and combination apart, gave 1.6–2.0e-2)."""
  for shape, seed in (((4, 64, 96), 40), ((2, 128, 128), 41), ((2, 256, 64), 42)):
    g = gaussian(shape, seed)
    got = np.asarray(ns.orthogonalize(g, compute_dtype="bfloat16"))
    want = np.stack([ns_block_reference(np.asarray(g[j])) for j in range(shape[0])])
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < 2.5e-2, (shape, err)


def test_bf16_gpu_form_close_to_float64():
  """The form the GPU runs (bf16 GEMM outputs, bf16 scale and add: `epilogue_dtype("bfloat16",
  "gpu")`) is the same iteration. XLA:CPU rounds after each of its ops, the worst case: relative
  Frobenius error ≤ 7e-2 (measured 4.5–5.4e-2); fused in a GEMM epilogue it rounds once."""
  assert ns.epilogue_dtype("bfloat16", "gpu") == jnp.bfloat16
  assert ns.epilogue_dtype("bfloat16", "cpu") == jnp.float32
  assert ns.epilogue_dtype("bfloat16", "tpu") == jnp.float32
  for shape, seed in (((4, 64, 96), 40), ((2, 128, 128), 41)):
    g = gaussian(shape, seed)
    x = (g / (jnp.linalg.norm(g, axis=(1, 2), keepdims=True) + EPS)).astype(jnp.bfloat16)
    y, scale = ns._scaled_chain(x, COEFFS, 5, jnp.bfloat16)
    got = np.asarray(y.astype(jnp.float32)) * scale
    want = np.stack([ns_block_reference(np.asarray(g[j])) for j in range(shape[0])])
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < 7e-2, (shape, err)


def test_bf16_refuses_zero_coefficients():
  with np.testing.assert_raises_regex(ValueError, "must be nonzero"):
    ns.orthogonalize(gaussian((1, 8, 16), 3), coeffs=(3.4, 0.0, 2.0))


# ---------------------------------------------------------------------------------------------
# (d) one batched chain per block shape in the optimizer update


def test_muon_update_has_one_matmul_chain_per_block_shape():
  d, h, k, e, layers = 64, 4, 16, 8, 3
  params = {
      "prefix": {"0": {"mixer": {**{n: {"kernel": jnp.zeros((d, h, k))}
                                    for n in ("q_proj", "k_proj", "v_proj")},
                                 "o_proj": {"kernel": jnp.zeros((h, k, d))},
                                 "q_a_proj": {"kernel": jnp.zeros((d, 48))}},
                       "ffn": {"experts": {"gate": jnp.zeros((e, d, k)), "up": jnp.zeros((e, d, k)),
                                           "down": jnp.zeros((e, k, d))}}}},
      "stack": {"layers": {"0": {"mixer": {"q_proj": {"kernel": jnp.zeros((layers, d, h, k))},
                                           "o_proj": {"kernel": jnp.zeros((layers, h, k, d))}},
                                 "attn_norm": {"scale": jnp.zeros((layers, d))}}}},
      "embed": {"embedding": jnp.zeros((100, d))},
  }
  tx = muon.make_muon_optimizer(learning_rate=1e-3, params_like=params)
  counts = primitive_counts(tx.update, params, tx.init(params), params)
  # Every per-head and expert block is 64×16 or 16×64 (one oriented shape, 16×64), q_a_proj is
  # 64×48 (oriented 48×64): 2 shapes × 5 steps × 3 matmuls (X Xᵀ, A², (bA + cA²) X). AdamW has
  # no matmuls. One chain per leaf would be 10 leaves × 15 = 150, one per block 65 × 15.
  assert counts["dot_general"] == 2 * 5 * 3
