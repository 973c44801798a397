"""Gated NoPE MLA (docs/maths.md §2): a naive fp64 reference and the invariants of §2.5.

The module runs in fp32; every comparison against the numpy fp64 reference uses
rtol = 2e-5, atol = 2e-5 (fp32 rounding of O(1) activations through five matmuls, two RMSNorms
and a softmax). Invariance tests between two forwards of the module use a tighter tolerance
(1e-6) or exact equality where the computation is bitwise the same program on the same values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from tests.configs import k3_full
from k3train.model import mla as mla_lib

D_MODEL = 16
T = 8
RTOL = ATOL = 2e-5   # fp32 module vs fp64 reference


def mla_config(**overrides) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict(dict(
      num_heads=2, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4,
      v_head_dim=8, latent_norm_eps=1e-6, output_gate=True, backend="auto"))
  c.update(overrides)
  return c


def make_mla(seed=0, init_std=0.4, randomise_norms=True, **overrides) -> mla_lib.GatedMLA:
  # A large init_std gives O(1) logits, so the softmax is far from uniform and errors show.
  m = mla_lib.GatedMLA(mla_config(**overrides), d_model=D_MODEL, init_std=init_std,
                       dtype=jnp.float32, param_dtype=jnp.float32,
                       rngs=nnx.Rngs(params=jax.random.key(seed, impl="rbg")))
  if randomise_norms:  # non-unit gains, so the reference checks that they are applied
    rng = np.random.default_rng(100 + seed)
    for norm in (m.q_a_norm, m.kv_a_norm):
      norm.scale.set_value(jnp.asarray(rng.uniform(0.5, 1.5, norm.scale.shape), jnp.float32))
  return m


def normal(shape, seed, scale=1.0):
  return jnp.asarray(scale * np.random.default_rng(seed).standard_normal(shape), jnp.float32)


# One jitted entry point: modules of one structure and inputs of one shape share a compilation.
@nnx.jit
def _forward(m, x, seg):
  return m(x, seg), m.max_logit[...]


@nnx.jit
def _forward_noseg(m, x):
  return m(x), m.max_logit[...]


def forward(m, x, seg=None):
  out, ml = _forward_noseg(m, x) if seg is None else _forward(m, x, seg)
  return np.asarray(out), np.asarray(ml)


# ----------------------------------------------------------------------------- naive fp64 reference


def _np(v) -> np.ndarray:
  return np.asarray(v[...], dtype=np.float64)


def _rms(x, gain, eps):
  return gain * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def naive_mla(m: mla_lib.GatedMLA, cfg, x, seg=None, gate_override=None):
  """Per-head loop in fp64 straight from docs/maths.md §2.2. Returns (out [B,T,d], pre_o [B,T,H,dv],
  max masked logit per head [H], max unmasked logit per head over all (t, u) pairs [H]).

  Weights are read from the module and flattened to the §2.1 matrix layout (d × H·(dn+dr) etc.)
  so the per-head slicing below is done independently of the module's [.., H, dh] kernels.
  """
  x = np.asarray(x, np.float64)
  b, t, d = x.shape
  h, dn, dr, dv = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
  dc, eps = cfg.kv_lora_rank, cfg.latent_norm_eps
  w_qa = _np(m.q_a_proj.kernel)                                   # d × d_cq
  w_qb = _np(m.q_b_proj.kernel).reshape(cfg.q_lora_rank, h * (dn + dr))
  w_kva = _np(m.kv_a_proj.kernel)                                 # d × (dc + dr)
  w_kvb = _np(m.kv_b_proj.kernel).reshape(dc, h * (dn + dv))
  w_o = _np(m.o_proj.kernel).reshape(h * dv, d)
  g_qa, g_kva = _np(m.q_a_norm.scale), _np(m.kv_a_norm.scale)
  scale = 1.0 / np.sqrt(dn + dr)

  out = np.zeros((b, t, d))
  pre_o = np.zeros((b, t, h, dv))
  max_logit = np.full((h,), -np.inf)
  max_unmasked = np.full((h,), -np.inf)
  for bi in range(b):
    c_q = _rms(x[bi] @ w_qa, g_qa, eps)                           # [T, d_cq]
    q_all = c_q @ w_qb                                            # [T, H·(dn+dr)]
    kv_a = x[bi] @ w_kva
    c = _rms(kv_a[:, :dc], g_kva, eps)
    k_r = kv_a[:, dc:]                                            # shared by all heads
    kv_all = c @ w_kvb                                            # [T, H·(dn+dv)]
    if gate_override is not None:
      gate = gate_override
    elif cfg.output_gate:
      w_g = _np(m.g_proj.kernel).reshape(d, h * dv)
      gate = 1.0 / (1.0 + np.exp(-(x[bi] @ w_g)))
    else:
      gate = np.ones((t, h * dv))
    concat = np.zeros((t, h * dv))
    for hi in range(h):
      q_h = q_all[:, hi * (dn + dr):(hi + 1) * (dn + dr)]
      q_c, q_r = q_h[:, :dn], q_h[:, dn:]
      kv_h = kv_all[:, hi * (dn + dv):(hi + 1) * (dn + dv)]
      k_c, v = kv_h[:, :dn], kv_h[:, dn:]
      for ti in range(t):
        allowed = [u for u in range(ti + 1) if seg is None or seg[bi][u] == seg[bi][ti]]
        s = np.array([(q_c[ti] @ k_c[u] + q_r[ti] @ k_r[u]) * scale for u in allowed])
        max_logit[hi] = max(max_logit[hi], s.max())
        s_all = (q_c[ti] @ k_c.T + q_r[ti] @ k_r.T) * scale
        max_unmasked[hi] = max(max_unmasked[hi], s_all.max())
        p = np.exp(s - s.max())
        p /= p.sum()
        a = sum(pu * v[u] for pu, u in zip(p, allowed))
        concat[ti, hi * dv:(hi + 1) * dv] = a
    pre_o[bi] = concat.reshape(t, h, dv)
    out[bi] = (gate * concat) @ w_o
  return out, pre_o, max_logit, max_unmasked


# ----------------------------------------------------------------------------- shared fixtures


@pytest.fixture(scope="module")
def module():
  return make_mla(seed=0)


SEG = np.array([[0, 0, 0, 1, 1, 1, 1, 1],
                [5, 5, 5, 5, 5, 2, 2, 2]], np.int32)   # two documents per row, ids not sorted


# ----------------------------------------------------------------------------- (a) naive reference


def test_matches_naive_fp64_reference_causal(module):
  cfg = mla_config()
  x = normal((2, T, D_MODEL), seed=1)
  out, _ = forward(module, x)
  ref, *_ = naive_mla(module, cfg, np.asarray(x))
  np.testing.assert_allclose(out, ref, rtol=RTOL, atol=ATOL)
  # The test is not vacuous: outputs are O(1) and differ across positions.
  assert np.abs(ref).max() > 0.1


def test_matches_naive_fp64_reference_packed(module):
  cfg = mla_config()
  x = normal((2, T, D_MODEL), seed=2)
  out, _ = forward(module, x, jnp.asarray(SEG))
  ref, *_ = naive_mla(module, cfg, np.asarray(x), seg=SEG)
  np.testing.assert_allclose(out, ref, rtol=RTOL, atol=ATOL)


def test_project_qkv_shapes_kr_shared_across_heads(module):
  q_c, q_r, k_c, k_r, v = module.project_qkv(normal((1, 3, D_MODEL), seed=3))
  assert q_c.shape == (1, 3, 2, 8) and q_r.shape == (1, 3, 2, 4)
  assert k_c.shape == (1, 3, 2, 8) and v.shape == (1, 3, 2, 8)
  assert k_r.shape == (1, 3, 4)   # one shared 4-dim key per token, no head axis (MQA-style)


# ----------------------------------------------------------------------------- (b) softmax scale


def test_softmax_scale_is_exactly_192_for_k3():
  a = k3_full.get_config().model.mla
  assert a.qk_nope_head_dim + a.qk_rope_head_dim == 192
  assert mla_lib.softmax_scale(a) == 192 ** -0.5
  assert make_mla().scale == 12 ** -0.5   # small config: 8 + 4, rope slot counted


# ----------------------------------------------------------------------------- (c) zero gate = 0.5 ×


def _copy_weights(dst: mla_lib.GatedMLA, src: mla_lib.GatedMLA):
  for name in ("q_a_proj", "q_b_proj", "kv_a_proj", "kv_b_proj", "o_proj"):
    getattr(dst, name).kernel.set_value(getattr(src, name).kernel.get_value())
  for name in ("q_a_norm", "kv_a_norm"):
    getattr(dst, name).scale.set_value(getattr(src, name).scale.get_value())


def test_zero_gate_halves_the_output():
  gated = make_mla(seed=0)
  gated.g_proj.kernel.set_value(jnp.zeros_like(gated.g_proj.kernel.get_value()))
  ungated = make_mla(seed=7, output_gate=False)
  _copy_weights(ungated, gated)
  x = normal((2, T, D_MODEL), seed=4)
  out_g, _ = forward(gated, x)
  out_u, _ = forward(ungated, x)
  # o_proj is linear without bias and σ(0) = 0.5 exactly: 0.5 × is exact in binary fp.
  np.testing.assert_allclose(out_g, 0.5 * out_u, rtol=1e-6, atol=1e-7)
  assert np.abs(out_u).max() > 0.1


def test_zero_gate_pre_o_proj_is_half_of_ungated_attention():
  """With o_proj = identity ([H, dv] → d, H·dv = d = 16) the module output is the pre-o_proj
  activation; with W_g = 0 it must be 0.5 × the ungated naive attention output."""
  m = make_mla(seed=0)
  m.g_proj.kernel.set_value(jnp.zeros_like(m.g_proj.kernel.get_value()))
  m.o_proj.kernel.set_value(jnp.eye(D_MODEL, dtype=jnp.float32).reshape(2, 8, D_MODEL))
  x = normal((2, T, D_MODEL), seed=5)
  out, _ = forward(m, x)
  _, pre_o, *_ = naive_mla(m, mla_config(), np.asarray(x), gate_override=1.0)
  np.testing.assert_allclose(out, 0.5 * pre_o.reshape(2, T, D_MODEL), rtol=RTOL, atol=ATOL)


# ----------------------------------------------------------------------------- (d) document masking


def test_packed_documents_equal_separate_forwards(module):
  a = normal((1, 3, D_MODEL), seed=6)
  b = normal((1, 5, D_MODEL), seed=7)
  packed = jnp.concatenate([a, b], axis=1)
  seg = jnp.asarray([[0, 0, 0, 1, 1, 1, 1, 1]], jnp.int32)
  out_packed, _ = forward(module, packed, seg)
  out_a, _ = forward(module, a)
  out_b, _ = forward(module, b)
  np.testing.assert_allclose(out_packed[:, :3], out_a, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(out_packed[:, 3:], out_b, rtol=1e-6, atol=1e-6)
  # Without segment ids, doc B would attend to doc A: the mask matters.
  out_unmasked, _ = forward(module, packed)
  assert np.abs(out_unmasked[:, 3:] - out_b).max() > 1e-3


# ----------------------------------------------------------------------------- (e) NoPE translation


def test_nope_translation_invariance(module):
  """Doc B's outputs do not depend on where it starts or on what other documents precede it."""
  b = normal((1, 5, D_MODEL), seed=8)
  out_b, _ = forward(module, b)
  c3 = normal((1, 3, D_MODEL), seed=9)
  c1, e2 = normal((1, 1, D_MODEL), seed=10), normal((1, 2, D_MODEL), seed=11)
  x1 = jnp.concatenate([c3, b], axis=1)                 # B at offset 3
  x2 = jnp.concatenate([c1, b, e2], axis=1)             # B at offset 1, another doc after it
  seg1 = jnp.asarray([[4, 4, 4, 9, 9, 9, 9, 9]], jnp.int32)
  seg2 = jnp.asarray([[1, 2, 2, 2, 2, 2, 3, 3]], jnp.int32)
  o1, _ = forward(module, x1, seg1)
  o2, _ = forward(module, x2, seg2)
  np.testing.assert_allclose(o1[:, 3:], out_b, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(o2[:, 1:6], out_b, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(o1[:, 3:], o2[:, 1:6], rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- (f) max_logit


def test_max_logit_matches_reference(module):
  cfg = mla_config()
  x = np.array(normal((2, T, D_MODEL), seed=12))
  # Scale the last token of each row's first document: its shared key k^R (not normalised)
  # grows, so the logits of the next document's queries against it (masked: other document)
  # would dominate an unmasked max.
  x[0, 2] *= 20.0
  x[1, 4] *= 20.0
  x = jnp.asarray(x)
  _, ml_packed = forward(module, x, jnp.asarray(SEG))
  _, _, ref_packed, ref_unmasked = naive_mla(module, cfg, np.asarray(x), seg=SEG)
  assert ml_packed.shape == (2,)
  np.testing.assert_allclose(ml_packed, ref_packed, rtol=RTOL, atol=ATOL)
  _, ml_causal = forward(module, x)
  _, _, ref_causal, _ = naive_mla(module, cfg, np.asarray(x))
  np.testing.assert_allclose(ml_causal, ref_causal, rtol=RTOL, atol=ATOL)
  # causal ∧ same-document ⊆ causal ⊆ all pairs; the document mask matters for this input.
  assert np.all(ref_packed <= ref_causal + 1e-12) and np.all(ref_causal <= ref_unmasked + 1e-12)
  assert np.any(ref_causal > ref_packed + 0.1)


def test_max_logit_excludes_masked_future_logits(module):
  """Make one future key dominate every query's logits: the unmasked max grows, the masked one
  (what QK-Clip must see) is computed only over u <= t."""
  cfg = mla_config()
  x = np.array(normal((1, T, D_MODEL), seed=13))
  x[0, -1] *= 20.0   # token T-1 is a key only for itself; for t < T-1 it is masked
  _, ml = forward(module, jnp.asarray(x))
  _, _, ref, ref_unmasked = naive_mla(module, cfg, x)
  np.testing.assert_allclose(ml, ref, rtol=RTOL, atol=ATOL)
  # The masked entries do matter for this input, so an unmasked max would fail the check above.
  assert np.any(ref_unmasked > ref + 0.1)


# ----------------------------------------------------------------------------- (g) causality


@pytest.mark.parametrize("t_cut", [0, 3, 6])
def test_causality(module, t_cut):
  x = np.asarray(normal((2, T, D_MODEL), seed=14))
  x2 = x.copy()
  x2[:, t_cut + 1:] = np.asarray(normal((2, T - t_cut - 1, D_MODEL), seed=15 + t_cut, scale=3.0))
  out, _ = forward(module, jnp.asarray(x))
  out2, _ = forward(module, jnp.asarray(x2))
  # Masked probabilities are exactly 0, so outputs ≤ t are bitwise unchanged (tolerance 0).
  np.testing.assert_array_equal(out[:, :t_cut + 1], out2[:, :t_cut + 1])
  assert np.abs(out[:, t_cut + 1:] - out2[:, t_cut + 1:]).max() > 1e-3
