"""pallas_kernels.attnres: the mix's backends against a float64 autodiff reference, with the
stream passed through (nonzero cotangents arriving on blocks and p), and the kernel's contract.

The pallas_gpu backward runs in Pallas interpret mode here. Tolerances: fp32 values and
gradients within 1e-5 of float64 (relative to the largest magnitude; the maths is fp32
throughout, ≤ 9 sources); bf16 sources within 2e-2 (one bf16 rounding of inputs and outputs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import attnres as attnres_ops
from pallas_kernels.attnres import op as attnres_op
from pallas_kernels.attnres import pallas_gpu

N, B, T, D = 4, 2, 16, 64
EPS = 1e-6


def _operands(seed=0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  normal = lambda *shape, scale=1.0: (scale * rng.standard_normal(shape)).astype(np.float32)
  blocks, p = normal(N, B, T, D), normal(B, T, D)
  query, gain = normal(D, scale=0.3), 1.0 + normal(D, scale=0.1)
  cot, ct_blocks, ct_p = normal(B, T, D), normal(N, B, T, D), normal(B, T, D)
  cast = lambda x: jnp.asarray(x).astype(dtype)
  return (cast(blocks), cast(p), jnp.asarray(query), jnp.asarray(gain)), (cot, ct_blocks, ct_p)


def _loss(mix_fn, num_blocks, cotangents):
  """Σ out·cot + Σ blocks'·ct_blocks + Σ p'·ct_p: the site's output and the stream it passes on
  each receive a cotangent, as inside the decoder."""
  cot, ct_blocks, ct_p = cotangents

  def loss(blocks, p, query, gain):
    out, blocks_out, p_out = mix_fn(blocks, num_blocks, p, query, gain)
    return (jnp.sum(out.astype(jnp.float32) * cot)
            + jnp.sum(blocks_out.astype(jnp.float32) * ct_blocks)
            + jnp.sum(p_out.astype(jnp.float32) * ct_p))
  return loss


def _float64_reference(args, num_blocks, cotangents):
  """(value, gradients) of `_loss` with the oracle over blocks[:num_blocks] + [p], in float64."""
  with jax.enable_x64():
    args64 = tuple(jnp.asarray(np.asarray(a, np.float32), jnp.float64) for a in args)
    cots64 = tuple(jnp.asarray(c, jnp.float64) for c in cotangents)

    def mix_fn(blocks, n, p, query, gain):
      sources = jnp.concatenate([blocks[:n], p[None]])
      return attnres_ops.attn_res_mix(sources, n + 1, query, gain, EPS), blocks, p

    value, grads = jax.value_and_grad(_loss(mix_fn, num_blocks, cots64), argnums=(0, 1, 2, 3))(
        *args64)
    return float(value), [np.asarray(g) for g in grads]


def _backend_fn(backend):
  return lambda blocks, n, p, q, g: attnres_ops.mix_pass(blocks, n, p, q, g, EPS, backend)


@pytest.mark.parametrize("backend", ["xla", "pallas_gpu"])
@pytest.mark.parametrize("num_blocks", [0, 1, 3, 4])
def test_backends_match_float64_with_stream_cotangents(backend, num_blocks):
  args, cots = _operands(seed=num_blocks)
  grad_fn = jax.jit(jax.value_and_grad(_loss(_backend_fn(backend), num_blocks, cots),
                                       argnums=(0, 1, 2, 3)))
  value, grads = grad_fn(*args)
  ref_value, ref_grads = _float64_reference(args, num_blocks, cots)
  assert abs(float(value) - ref_value) <= 1e-5 * abs(ref_value)
  for name, got, want in zip(("blocks", "p", "query", "gain"), grads, ref_grads):
    scale = max(np.abs(want).max(), 1e-30)
    err = np.abs(np.asarray(got, np.float64) - want).max() / scale
    assert err <= 1e-5, (name, err)


@pytest.mark.parametrize("num_blocks", [0, 2])
def test_empty_slots_keep_their_incoming_cotangent_bitwise(num_blocks):
  """Slots at or past num_blocks get nothing added: their cotangent leaves as it arrived
  (the kernel neither reads nor writes those rows)."""
  args, cots = _operands(seed=5)
  for backend in ("xla", "pallas_gpu"):
    d_blocks = jax.jit(jax.grad(_loss(_backend_fn(backend), num_blocks, cots)))(*args)
    np.testing.assert_array_equal(np.asarray(d_blocks)[num_blocks:], cots[1][num_blocks:])
    assert np.abs(np.asarray(d_blocks)[:num_blocks] - cots[1][:num_blocks]).max(initial=1.0) > 0


def test_pallas_backward_equals_xla_in_bf16():
  """bf16 sources and cotangents: both backends compute in fp32 and round once, so they agree
  to a bf16 ulp and sit within 2e-2 of the float64 reference."""
  args, cots = _operands(seed=11, dtype=jnp.bfloat16)
  cots = tuple(np.asarray(jnp.asarray(c).astype(jnp.bfloat16).astype(jnp.float32)) for c in cots)
  results = {}
  for backend in ("xla", "pallas_gpu"):
    results[backend] = jax.jit(jax.grad(_loss(_backend_fn(backend), 3, cots),
                                        argnums=(0, 1, 2, 3)))(*args)
  _, ref = _float64_reference(args, 3, cots)
  for name, x, k, want in zip(("blocks", "p", "query", "gain"), results["xla"],
                              results["pallas_gpu"], ref):
    assert x.dtype == k.dtype
    scale = np.abs(want).max()
    x, k = np.asarray(x, np.float64), np.asarray(k, np.float64)
    assert np.abs(x - k).max() <= 2 ** -7 * scale, name
    assert np.abs(k - want).max() <= 2e-2 * scale, name


def test_kernel_tiles_several_programs_and_d_chunks():
  """Rows over several programs and d over several chunks give the xla backward exactly enough:
  same contract, fp32 (1e-6 of the largest value)."""
  args, cots = _operands(seed=3)
  blocks, p, query, gain = args
  w = gain * query
  from pallas_kernels.attnres import xla
  _, stats = xla.mix_forward(blocks, 3, p, w, EPS)
  g = jnp.asarray(cots[0])
  want = xla.mix_backward(blocks, p, w, stats, g, jnp.asarray(cots[1]), jnp.asarray(cots[2]))
  settings = pallas_gpu.Settings(rows=8, chunk=16, num_warps=4)     # 4 programs × 4 chunks
  got = pallas_gpu.mix_backward(blocks, p, w, stats, g, jnp.asarray(cots[1]),
                                jnp.asarray(cots[2]), interpret=True, settings=settings)
  for x, y in zip(got, want):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6,
                               atol=1e-6 * float(np.abs(np.asarray(y)).max()))


def test_backend_choice_and_errors():
  assert attnres_ops.resolve_backend("auto", B * T, D) == (
      "pallas_gpu" if jax.default_backend() == "gpu" else "xla")
  assert attnres_ops.resolve_backend("xla") == "xla"
  with pytest.raises(ValueError, match="unknown backend 'triton'"):
    attnres_ops.resolve_backend("triton")
  assert pallas_gpu.chunk_for(7168) == 256                 # K3's width: 28 chunks
  assert pallas_gpu.chunk_for(40) is None                  # no power-of-two chunk ≥ 16 divides 40
  assert not pallas_gpu.supports(B * T + 1, D)
  args, _ = _operands()
  blocks, p, query, gain = args
  with pytest.raises(ValueError, match="does not tile B·T = 31 rows"):
    attnres_ops.mix_pass(jnp.zeros((N, 1, 31, D)), 1, jnp.zeros((1, 31, D)), query, gain, EPS,
                         "pallas_gpu")
  with pytest.raises(ValueError, match=r"blocks \(4, 2, 16, 64\) and partial sum \(2, 16, 32\)"):
    attnres_ops.mix_pass(blocks, 1, p[..., :32], query, gain, EPS, "xla")
  with pytest.raises(ValueError, match="query"):
    attnres_ops.mix_pass(blocks, 1, p, query[:8], gain, EPS, "xla")
  with pytest.raises(ValueError, match="rows must be a power of two"):
    pallas_gpu.Settings(rows=12)
  with pytest.raises(ValueError, match="chunk must be a power of two >= 16"):
    pallas_gpu.Settings(chunk=8)
  with pytest.raises(ValueError, match="not a resolved backend"):
    attnres_op.backward_fn("auto")


def test_configured_swaps_settings_for_a_block():
  before = pallas_gpu.SETTINGS
  with pallas_gpu.configured(rows=8) as s:
    assert pallas_gpu.SETTINGS is s and s.rows == 8 and s.chunk == before.chunk
  assert pallas_gpu.SETTINGS is before
  with pytest.raises(ValueError):
    with pallas_gpu.configured(num_warps=3):
      pass
  assert pallas_gpu.SETTINGS is before
