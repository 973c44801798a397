"""pallas_kernels.qb: QB's order statistics by the Pallas-GPU kernels (interpret mode on CPU), the
XLA radix rounds and the sorting oracle agree bit for bit; backend choice and bad input."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from k3train.model import moe as moe_lib
from pallas_kernels import qb
from pallas_kernels.qb import pallas_gpu, reference, xla


def _case(rng, t, e, *, ties=False):
  scores = (rng.standard_normal((t, e)) * 10.0 ** rng.integers(-2, 2)).astype(np.float32)
  if ties:                                   # repeated values, ±0 and −inf among the scores
    scores = np.round(scores, 1)
    scores[rng.random((t, e)) < 0.1] = 0.0
    scores[rng.random((t, e)) < 0.05] = -0.0
    scores[rng.random((t, e)) < 0.02] = -np.inf
  bias = (rng.standard_normal(e) * 0.3).astype(np.float32)
  real = rng.random(t) < 0.85
  return jnp.asarray(scores), jnp.asarray(bias), jnp.asarray(real)


def _bits(x):
  return np.asarray(x, np.float32).view(np.uint32)


@pytest.mark.parametrize("t,e,top_k,ties", [(128, 64, 8, False), (96, 12, 3, True),
                                            (64, 40, 0, True), (32, 130, 16, False)])
def test_kernels_equal_the_xla_rounds_and_the_sorts(t, e, top_k, ties):
  rng = np.random.default_rng(t + e + top_k)
  scores, bias, real = _case(rng, t, e, ties=ties)
  m_real = int(real.sum())
  middle = (m_real * top_k) // e
  for q in (0, middle, m_real - 1):
    q = jnp.int32(q)
    want = reference.margin_quantile(scores, bias, real, top_k, q)
    got_xla = xla.margin_quantile(scores, bias, real, top_k, q)
    np.testing.assert_array_equal(np.asarray(got_xla), np.asarray(want))
    # The column in registers, and streamed in chunks of 32 tokens per round, at the default
    # bit per radix round in both kernels; at the middle quantile also 4 bits, and 2 bits in
    # one kernel with 4 in the other.
    tilings = [dict(rows=16), dict(rows=16, row_elements=256, resident=16, chunk=32)]
    if q == middle:
      tilings += [dict(rows=16, digit_bits=4, column_digit_bits=4),
                  dict(rows=16, digit_bits=2, column_digit_bits=4),
                  dict(rows=16, digit_bits=4, column_digit_bits=2, resident=16, chunk=32)]
    for tiling in tilings:
      with pallas_gpu.configured(**tiling):
        got = pallas_gpu.margin_quantile(scores, bias, real, top_k, q, interpret=True)
      np.testing.assert_array_equal(_bits(got), _bits(got_xla))


def test_all_padding_tokens_give_minus_infinity_on_both_paths():
  rng = np.random.default_rng(3)
  scores, bias, _ = _case(rng, 64, 16)
  real = jnp.zeros((64,), bool)
  got = pallas_gpu.margin_quantile(scores, bias, real, 4, jnp.int32(0), interpret=True)
  np.testing.assert_array_equal(_bits(got), _bits(xla.margin_quantile(scores, bias, real, 4,
                                                                      jnp.int32(0))))
  assert np.all(np.isneginf(np.asarray(got)))


def test_quantile_balancing_bias_is_the_same_on_every_backend():
  rng = np.random.default_rng(5)
  scores, bias, real = _case(rng, 256, 64)
  mask = real.astype(jnp.float32)
  outs = [moe_lib.quantile_balancing_bias(scores, bias, mask, 8, backend=b)
          for b in ("xla", "pallas_gpu", "auto")]
  for out in outs[1:]:
    np.testing.assert_array_equal(_bits(out), _bits(outs[0]))


def test_auto_takes_xla_off_a_gpu_and_names_unknown_backends():
  assert qb.resolve_backend("auto", 4096) == ("pallas_gpu" if jax.default_backend() == "gpu"
                                              and jax.device_count() == 1 else "xla")
  assert qb.resolve_backend("pallas_gpu") == "pallas_gpu"
  with pytest.raises(ValueError, match="unknown backend 'triton'"):
    qb.resolve_backend("triton")


def test_bad_input_is_named():
  scores, bias, real = jnp.zeros((32, 8)), jnp.zeros((8,)), jnp.ones((32,), bool)
  with pytest.raises(ValueError, match=r"must be \[T, E\], \[E\] and T elements"):
    qb.margin_quantile(scores, jnp.zeros((7,)), real, 2, jnp.int32(0))
  with pytest.raises(ValueError, match=r"top_k must lie in \[0, E = 8\)"):
    qb.margin_quantile(scores, bias, real, 8, jnp.int32(0))
  with pytest.raises(ValueError, match="no power-of-two divisor"):
    pallas_gpu.margin_quantile(jnp.zeros((24, 8)), bias, jnp.ones((24,), bool), 2, jnp.int32(0),
                               interpret=True)
  with pytest.raises(ValueError, match="rows must be a power of two"):
    pallas_gpu.Settings(rows=24)
  with pytest.raises(ValueError, match="chunk must be a power of two >= 16"):
    pallas_gpu.Settings(chunk=8)
  with pytest.raises(ValueError, match="row_elements and resident must be powers of two"):
    pallas_gpu.Settings(resident=1000)
  with pytest.raises(ValueError, match=r"column_digit_bits must be one of \(1, 2, 4, 8\), got 3"):
    pallas_gpu.Settings(column_digit_bits=3)
  with pytest.raises(ValueError, match="column_warps must be 1, 2, 4, 8 or 16, got 3"):
    pallas_gpu.Settings(column_warps=3)


def test_tiles_keep_a_program_within_its_element_budget():
  assert pallas_gpu.tiles(16384, 64) == (32, 16384)          # 32 rows × 64 experts; resident
  assert pallas_gpu.tiles(16384, 896) == (4, 16384)          # 4 rows × 1024 (896 padded)
  assert pallas_gpu.tiles(65536, 64) == (32, 1024)           # beyond `resident`: chunks
  assert pallas_gpu.tiles(96, 12) == (32, 32)                # not a power of two: chunks
  assert pallas_gpu.tiles(24, 8) is None
  assert pallas_gpu.keeps_column(16384) and not pallas_gpu.keeps_column(96)
  assert not pallas_gpu.keeps_column(65536)


def test_the_kernels_lower_to_two_triton_calls_for_the_gpu():
  """Both kernels pass Pallas' Triton lowering (what a GPU compiles; its blocks must be powers
  of two): power-of-two and padded expert counts, a resident column, and streamed columns of a
  long and of a non-power-of-two T."""
  fn = jax.jit(lambda s, b, r, q: pallas_gpu._launch(s, b, r, q, top_k=8, interpret=False,
                                                     settings=pallas_gpu.SETTINGS))
  for t, e in ((4096, 64), (4096, 896), (65536, 64), (24576, 12), (96, 12)):
    exported = export.export(
        fn, platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
            jax.ShapeDtypeStruct((t, e), jnp.float32), jax.ShapeDtypeStruct((e,), jnp.float32),
            jax.ShapeDtypeStruct((t,), jnp.bool_), jax.ShapeDtypeStruct((), jnp.int32))
    module = exported.mlir_module()
    assert module.count("xla.gpu.triton") == 2
    # Launch warps: the rows kernel 8 below 512 padded experts and 4 from there (896 → 1,024
    # padded), the columns kernel 16.
    rows_warps = 4 if e == 896 else 8
    assert re.findall(r"num_warps\s*=\s*(\d+)", module) == [str(rows_warps), "16"]
