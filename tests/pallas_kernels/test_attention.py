"""Attention op tests: every backend that runs on CPU against the dense reference.

Backends on CPU: "xla" (plain JAX), "pallas_gpu" (the Triton kernels in interpret mode, with
16-row blocks so T = 40 spans several query and key blocks), "pallas_tpu" (splash attention in
TPU interpret mode at T = 256; at other lengths its xla fallback) and "cudnn" (off-GPU the
pallas_gpu kernels; its document finder `segment_runs` is tested on its own). The reference runs
in fp64 under a local `jax.enable_x64(True)` context for fp32 inputs, in fp32 for bf16 inputs.

One packed layout carries most scenarios (see SEGMENTS): documents starting mid-block, one-token
documents, an id that comes back after another one, T not a multiple of any block, Dk ≠ Dv
(48 = 32 + 16 head-dim parts against 32). Each case checks out, max_logit and the gradients of
Σ w ⊙ out + Σ max_logit wrt q, k, v (max_logit must contribute nothing).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import attention, cudnn, pallas_gpu, pallas_tpu, xla
from pallas_kernels.attention.op import last_keys

B, T, H, DK, DV = 2, 40, 2, 48, 32
SCALE = 0.3
# Row 0: documents start at 5 (mid-block), 5 → 6 is a one-token document, then 6 and 24.
# Row 1: id 5 comes back after a one-token document of id 7 (same id = same document).
SEGMENTS = np.stack([np.repeat([0, 1, 2, 3], [5, 1, 18, 16]),
                     np.repeat([5, 7, 5, 9], [9, 1, 14, 16])]).astype(np.int32)
BLOCKS16 = dict(block_q=16, block_k=16, dkv_block_q=16, dkv_block_k=16, dq_block_q=16,
                dq_block_k=16)
BACKENDS = ("xla", "pallas_gpu")
NAMES = ("out", "max_logit", "dq", "dk", "dv")


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
  """16-row kernel blocks and 16-key xla steps, so the tiny shapes span several blocks."""
  monkeypatch.setattr(xla, "BLOCK_K", 16)
  with pallas_gpu.configured(**BLOCKS16):
    yield


def make_inputs(seed, *, b=B, t=T, h=H, dk=DK, dv=DV, tk=None):
  rng = np.random.default_rng(seed)
  tk = t if tk is None else tk
  return (rng.standard_normal((b, t, h, dk)), rng.standard_normal((b, tk, h, dk)),
          rng.standard_normal((b, tk, h, dv)), rng.standard_normal((b, t, h, dv)))


def run(q, k, v, w, segment_ids, backend, **kw):
  """(out, max_logit, dq, dk, dv) of loss = Σ w ⊙ out + Σ max_logit, as float64 numpy."""
  def loss(q, k, v):
    out, max_logit = attention(q, k, v, segment_ids, scale=SCALE, backend=backend, **kw)
    finite = jnp.where(jnp.isfinite(max_logit), max_logit, 0.0)
    return jnp.sum(out.astype(jnp.float32) * w) + jnp.sum(finite), (out, max_logit)

  (_, (out, max_logit)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(
      q, k, v)
  return [np.asarray(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x, np.float64)
          for x in (out, max_logit) + tuple(grads)]


def reference_fp64(q, k, v, w, segment_ids, **kw):
  with jax.enable_x64(True):
    seg = segment_ids if segment_ids is None else jax.tree.map(jnp.asarray, segment_ids)
    return run(*(jnp.asarray(x, jnp.float64) for x in (q, k, v, w)), seg, "reference", **kw)


def assert_close(got, want, *, rtol, what, names=NAMES):
  """|got − want| ≤ rtol · max(max|want|, 1) for each array; −inf entries must match."""
  for name, g, r in zip(names, got, want):
    assert g.shape == r.shape, (what, name, g.shape, r.shape)
    np.testing.assert_array_equal(np.isneginf(g), np.isneginf(r), err_msg=f"{what} {name}")
    g, r = np.where(np.isneginf(g), 0.0, g), np.where(np.isneginf(r), 0.0, r)
    err = float(np.max(np.abs(g - r)))
    size = max(float(np.max(np.abs(r))), 1.0)
    assert err <= rtol * size, f"{what}: {name} max error {err:.3g} > {rtol} × {size:.3g}"


@functools.lru_cache(maxsize=None)
def reference_case(causal: bool):
  q, k, v, w = make_inputs(0)
  return reference_fp64(q, k, v, w, SEGMENTS, causal=causal)


# fp32 against the fp64 reference: tolerance 2e-5 of the largest magnitude (fp32 rounding of
# sums over ≤ 48 terms and the online softmax's rescaling).
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("backend", BACKENDS)
def test_fp32_matches_reference(backend, causal):
  q, k, v, w = (jnp.asarray(x, jnp.float32) for x in make_inputs(0))
  got = run(q, k, v, w, jnp.asarray(SEGMENTS), backend, causal=causal)
  assert_close(got, reference_case(causal), rtol=2e-5, what=f"{backend} causal={causal}")


# bf16: the backends use bf16 dot operands (P and dS rounded to bf16) with fp32 accumulation;
# the reference computes in fp32 from the same bf16 inputs. Outputs and gradients within 2 % of
# the largest magnitude (a few bf16 ulps); max_logit, a plain fp32-accumulated dot of bf16
# values, within 1e-5.
@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_matches_reference(backend):
  q, k, v, w = (jnp.asarray(x, jnp.bfloat16) for x in make_inputs(1))
  w = w.astype(jnp.float32)
  seg = jnp.asarray(SEGMENTS)
  got = run(q, k, v, w, seg, backend)
  want = run(q, k, v, w, seg, "reference")
  assert got[1].shape == (B, H)
  assert_close(got[1:2], want[1:2], rtol=1e-5, what=f"{backend} bf16", names=("max_logit",))
  assert_close([got[0]] + got[2:], [want[0]] + want[2:], rtol=2e-2, what=f"{backend} bf16",
               names=("out", "dq", "dk", "dv"))


def test_output_dtypes():
  q, k, v, _ = (jnp.asarray(x, jnp.bfloat16) for x in make_inputs(2, b=1, t=8))
  out, max_logit = attention(q, k, v, scale=SCALE, backend="xla")
  assert out.dtype == jnp.bfloat16 and out.shape == (1, 8, H, DV)
  assert max_logit.dtype == jnp.float32 and max_logit.shape == (1, H)


@pytest.mark.parametrize("backend", BACKENDS)
def test_single_token(backend):
  """T = 1: out is v, max_logit is scale · q·k, dq = dk = 0 (softmax of one logit)."""
  q, k, v, w = (jnp.asarray(x, jnp.float32) for x in make_inputs(3, b=1, t=1))
  out, max_logit, dq, dk, dv = run(q, k, v, w, None, backend)
  np.testing.assert_allclose(out, np.asarray(v), rtol=1e-6)
  np.testing.assert_allclose(max_logit, SCALE * np.einsum("bthd,bthd->bh", q, k), rtol=1e-5)
  np.testing.assert_allclose(dq, 0.0, atol=1e-6)
  np.testing.assert_allclose(dk, 0.0, atol=1e-6)
  np.testing.assert_allclose(dv, np.asarray(w), rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_query_shards_match_unsharded(backend):
  """Sequence-parallel form: 4 query shards of 10, each against the full keys with its traced
  offset (10 r) and the pair (shard ids, all ids); concatenated outputs, the max over shards of
  max_logit and the summed gradients equal the unsharded reference (fp64). 10-row shards do
  not align with the 16-row blocks."""
  q, k, v, w = (jnp.asarray(x, jnp.float32) for x in make_inputs(0))
  seg = jnp.asarray(SEGMENTS)
  shard = T // 4

  @jax.jit
  def one_shard(q_s, w_s, seg_s, offset, k, v):
    def loss(q_s, k, v):
      out, max_logit = attention(q_s, k, v, (seg_s, seg), scale=SCALE, q_offset=offset,
                                 backend=backend)
      return jnp.sum(out * w_s), (out, max_logit)
    (_, aux), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q_s, k, v)
    return aux, grads

  outs, maxes, dqs = [], [], []
  dk, dv = np.zeros(k.shape), np.zeros(v.shape)
  for r in range(4):
    rows = slice(r * shard, (r + 1) * shard)
    (out, max_logit), (dq_s, dk_s, dv_s) = one_shard(
        q[:, rows], w[:, rows], seg[:, rows], jnp.int32(r * shard), k, v)
    outs.append(np.asarray(out))
    maxes.append(np.asarray(max_logit))
    dqs.append(np.asarray(dq_s))
    dk, dv = dk + np.asarray(dk_s), dv + np.asarray(dv_s)
  got = [np.concatenate(outs, axis=1), np.max(maxes, axis=0), np.concatenate(dqs, axis=1), dk, dv]
  assert_close(got, reference_case(True), rtol=2e-5, what=f"{backend} sharded")


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_without_keys(backend):
  """Cross-attention pair where some query ids have no key: those rows give out = 0, zero dq;
  a (b, h) with no allowed pair at all gives max_logit = −inf."""
  q, k, v, w = make_inputs(4, t=12, tk=20)
  q_seg = np.stack([np.repeat([0, 1, 9], [4, 4, 4]), np.full(12, 8)]).astype(np.int32)
  kv_seg = np.stack([np.repeat([0, 1], [10, 10]), np.full(20, 3)]).astype(np.int32)
  pair = (jnp.asarray(q_seg), jnp.asarray(kv_seg))
  q, k, v, w = (jnp.asarray(x, jnp.float32) for x in (q, k, v, w))
  got = run(q, k, v, w, pair, backend, causal=False, q_offset=0)
  want = reference_fp64(q, k, v, w, pair, causal=False)
  assert np.all(np.isneginf(got[1][1])) and np.all(np.isfinite(got[1][0]))
  assert np.all(got[0][0, 8:] == 0.0) and np.all(got[0][1] == 0.0)
  assert_close(got, want, rtol=2e-5, what=f"{backend} empty rows")


def test_pallas_tpu_splash_matches_reference():
  """Splash attention in TPU interpret mode (T = 256, 128-row blocks; documents starting
  mid-block and a one-token document), plus one query shard with a static offset."""
  t = 256
  seg = np.repeat([0, 1, 2, 3], [5, 1, 130, 120])[None].astype(np.int32)
  q, k, v, w = (jnp.asarray(x, jnp.float32) for x in make_inputs(5, b=1, t=t, dk=64, dv=32))
  old = pallas_tpu.CONFIG
  pallas_tpu.CONFIG = pallas_tpu.Config(block_q=128, block_kv=128, max_logit_block_k=64)
  try:
    assert pallas_tpu.splash_blocks(t, t, pallas_tpu.CONFIG) is not None
    got = run(q, k, v, w, jnp.asarray(seg), "pallas_tpu")
    pair = (jnp.asarray(seg[:, 128:]), jnp.asarray(seg))
    shard = run(q[:, 128:], k, v, w[:, 128:], pair, "pallas_tpu", q_offset=128)
  finally:
    pallas_tpu.CONFIG = old
  assert_close(got, reference_fp64(q, k, v, w, seg), rtol=2e-5, what="pallas_tpu")
  assert_close(shard, reference_fp64(q[:, 128:], k, v, w[:, 128:], pair, q_offset=128),
               rtol=2e-5, what="pallas_tpu shard")


def test_pallas_tpu_and_cudnn_route_on_cpu():
  """Off their platforms: pallas_tpu at a length splash cannot tile takes its xla fallback and
  cudnn the pallas_gpu kernels; both still equal the reference."""
  q, k, v, w = (jnp.asarray(x, jnp.float32) for x in make_inputs(0))
  assert pallas_tpu.splash_blocks(T, T, pallas_tpu.CONFIG) is None
  for backend in ("pallas_tpu", "cudnn"):
    got = run(q, k, v, w, jnp.asarray(SEGMENTS), backend)
    assert_close(got, reference_case(True), rtol=2e-5, what=backend)


def test_cudnn_segment_runs():
  """Documents as cuDNN's packed-layout arguments; a repeated id or too many runs is refused."""
  ok, lengths, offsets = cudnn.segment_runs(jnp.asarray(SEGMENTS[:1]), 4)
  assert bool(ok)
  np.testing.assert_array_equal(lengths, [[5, 1, 18, 16]])
  np.testing.assert_array_equal(offsets, [[0, 5, 6, 24, -1]])
  ok, lengths, offsets = cudnn.segment_runs(jnp.asarray(SEGMENTS[:1]), 6)
  np.testing.assert_array_equal(lengths, [[5, 1, 18, 16, -1, -1]])
  np.testing.assert_array_equal(offsets, [[0, 5, 6, 24, -1, -1, -1]])
  assert not bool(cudnn.segment_runs(jnp.asarray(SEGMENTS[:1]), 3)[0])     # 4 runs > 3
  assert not bool(cudnn.segment_runs(jnp.asarray(SEGMENTS), 8)[0])         # row 1: 5 … 5
  ok, lengths, _ = cudnn.segment_runs(jnp.zeros((1, 7), jnp.int32), 2)
  assert bool(ok) and lengths.tolist() == [[7, -1]]


def test_tile_schedule_full_tiles_need_no_mask():
  """With 4 equal documents of 64 and 16-row blocks, query block i loops over exactly the key
  blocks of its own document up to the diagonal, and key block j over its document's queries;
  the full tiles are those strictly below the diagonal inside a document."""
  from pallas_kernels.attention import tiles
  seg = jnp.asarray(np.repeat(np.arange(4), 64)[None].astype(np.int32))
  last = last_keys(0, 256, 256, True)
  i = np.arange(16)
  lo, full_lo, full_hi, hi = (np.asarray(x[0]) for x in
                              tiles.key_block_schedule(seg, seg, last, 16, 16))
  first_of_doc = i % 4 == 0                  # its only kept tile is the diagonal
  np.testing.assert_array_equal(lo, (i // 4) * 4)
  np.testing.assert_array_equal(hi, i + 1)
  np.testing.assert_array_equal(full_lo, np.where(first_of_doc, i + 1, (i // 4) * 4))
  np.testing.assert_array_equal(full_hi, np.where(first_of_doc, i + 1, i))
  lo, full_lo, full_hi, hi = (np.asarray(x[0]) for x in
                              tiles.query_block_schedule(seg, seg, last, 16, 16))
  last_of_doc = i % 4 == 3
  np.testing.assert_array_equal(lo, i)
  np.testing.assert_array_equal(hi, (i // 4) * 4 + 4)
  np.testing.assert_array_equal(full_lo, np.where(last_of_doc, hi, i + 1))
  np.testing.assert_array_equal(full_hi, hi)


@pytest.mark.parametrize("seed", range(6))
def test_tile_schedule_against_dense_mask(seed):
  """Random packed layouts (ids that come back, documents of any length, query shards, padding
  rows): every allowed pair lies in a kept tile, every pair of a tile in a block's full run is
  allowed, and the run starts at the block's first full tile; lo ≤ full_lo ≤ full_hi ≤ hi."""
  from pallas_kernels.attention import tiles
  rng = np.random.default_rng(seed)
  bq, bk, tq, tk = (16, 8, 48, 64) if seed % 2 else (8, 16, 64, 64)
  lengths = rng.integers(1, 30, size=12)
  seg_k = np.repeat(rng.integers(0, 3 if seed > 2 else 12, size=12), lengths)[:tk]
  seg_k = np.pad(seg_k, (0, tk - len(seg_k)), mode="edge")[None].astype(np.int32)
  offset = tk - tq
  seg_q = seg_k[:, offset:]
  last = np.array(last_keys(offset, tq, tk, seed % 3 != 0))
  if seed == 4:
    last[-5:] = -1                                            # padding rows see nothing
  allowed = (seg_q[0][:, None] == seg_k[0][None, :]) & (np.arange(tk)[None, :] <= last[:, None])
  tile_ok = allowed.reshape(tq // bq, bq, tk // bk, bk)
  any_ij, all_ij = tile_ok.any(axis=(1, 3)), tile_ok.all(axis=(1, 3))
  args = (jnp.asarray(seg_q), jnp.asarray(seg_k), jnp.asarray(last, jnp.int32), bq, bk)
  for ranges, any_xy, all_xy in ((tiles.key_block_schedule(*args), any_ij, all_ij),
                                 (tiles.query_block_schedule(*args), any_ij.T, all_ij.T)):
    lo, full_lo, full_hi, hi = (np.asarray(x[0]) for x in ranges)
    assert np.all((lo <= full_lo) & (full_lo <= full_hi) & (full_hi <= hi))
    for x in range(len(lo)):
      needed = np.flatnonzero(any_xy[x])
      assert np.all((needed >= lo[x]) & (needed < hi[x])), (x, needed, lo[x], hi[x])
      assert np.all(all_xy[x, full_lo[x]:full_hi[x]]), (x, full_lo[x], full_hi[x])
      full = np.flatnonzero(all_xy[x])
      if len(full):                          # the run starts at the block's first full tile
        assert full_lo[x] == full[0] and full_hi[x] > full_lo[x], (x, full, full_lo[x])


@pytest.mark.parametrize("causal", [True, False])
def test_pallas_gpu_dkv_queries_as_rows_matches_reference(causal):
  """The dK/dV kernel's queries-as-rows form (S = Q Kᵀ tiles; FP32_CONFIG's) against the fp64
  reference, on the packed layout of the other tests (16-row blocks, so masked and full tiles
  both occur). Every other test here runs the default keys-as-rows form."""
  q, k, v, w = (jnp.asarray(x, jnp.float32) for x in make_inputs(0))
  with pallas_gpu.configured(**BLOCKS16, dkv_keys_as_rows=False):
    got = run(q, k, v, w, jnp.asarray(SEGMENTS), "pallas_gpu", causal=causal)
  assert_close(got, reference_case(causal), rtol=2e-5, what=f"queries as rows causal={causal}")
  seg = np.repeat([3, 1, 4], [37, 91, 16])[None].astype(np.int32)
  q, k, v, w = make_inputs(7, b=1, t=144)
  with pallas_gpu.configured(**BLOCKS16, dkv_keys_as_rows=False):
    got = run(*(jnp.asarray(x, jnp.float32) for x in (q, k, v, w)), jnp.asarray(seg),
              "pallas_gpu", causal=causal)
  assert_close(got, reference_fp64(q, k, v, w, seg, causal=causal), rtol=2e-5,
               what=f"queries as rows, full tiles, causal={causal}")


@pytest.mark.parametrize("causal", [True, False])
def test_pallas_gpu_full_tiles_match_reference(causal):
  """Two long documents (37 and 91 tokens) and a third id: most tiles of the 16-row blocks are
  full, so the kernels' unmasked loops carry most of the work; fp32 against the fp64 reference
  (2e-5), and bf16 against the fp32 reference (as test_bf16_matches_reference)."""
  seg = np.repeat([3, 1, 4], [37, 91, 16])[None].repeat(2, axis=0).astype(np.int32)
  seg[1] = np.repeat([0, 2], [80, 64])
  q, k, v, w = make_inputs(7, t=144)
  got = run(*(jnp.asarray(x, jnp.float32) for x in (q, k, v, w)), jnp.asarray(seg),
            "pallas_gpu", causal=causal)
  assert_close(got, reference_fp64(q, k, v, w, seg, causal=causal), rtol=2e-5,
               what=f"full tiles causal={causal}")
  qb, kb, vb = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
  wf = jnp.asarray(w, jnp.float32)
  got = run(qb, kb, vb, wf, jnp.asarray(seg), "pallas_gpu", causal=causal)
  want = run(qb, kb, vb, wf, jnp.asarray(seg), "reference", causal=causal)
  assert_close(got[1:2], want[1:2], rtol=1e-5, what="full tiles bf16", names=("max_logit",))
  assert_close([got[0]] + got[2:], [want[0]] + want[2:], rtol=2e-2, what="full tiles bf16",
               names=("out", "dq", "dk", "dv"))
  # The max-logit pass (cudnn's companion kernel) gives the forward kernel's row max, bit for bit.
  last = last_keys(0, 144, 144, causal)
  args = (qb, kb, jnp.asarray(seg), jnp.asarray(seg), last)
  _, row_max = pallas_gpu.attention_pallas_gpu(qb, kb, vb, *args[2:], scale=SCALE, interpret=True)
  np.testing.assert_array_equal(
      pallas_gpu.row_max_pallas_gpu(*args, scale=SCALE, interpret=True), row_max)


def test_pallas_gpu_lowers_for_cuda():
  """The three kernels (and the max-logit pass) at the K3 head dims lower to Triton for CUDA
  (no GPU needed: this catches Pallas-Triton lowering errors, e.g. non-power-of-two blocks)."""
  t = 256
  q = jnp.zeros((1, t, 2, 192), jnp.bfloat16)
  v = jnp.zeros((1, t, 2, 128), jnp.bfloat16)
  seg = jnp.zeros((1, t), jnp.int32)
  config = pallas_gpu.Config()

  def f(q, k, v, seg):
    last = last_keys(0, t, t, True)

    def loss(q, k, v):
      out, row_max = pallas_gpu.attention_pallas_gpu(q, k, v, seg, seg, last, scale=0.1,
                                                     config=config)
      return jnp.sum(out.astype(jnp.float32)), row_max
    grads = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return grads, pallas_gpu.row_max_pallas_gpu(q, k, seg, seg, last, scale=0.1, config=config)

  text = jax.jit(f).trace(q, q, v, seg).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("xla.gpu.triton") == 4


@pytest.mark.parametrize("call, message", [
    (lambda q, k, v, s: attention(q[0], k, v, scale=1.0), "q has 3 dims, expected [B, Tq, H, Dk]"),
    (lambda q, k, v, s: attention(q, k[..., :16], v, scale=1.0), "k has shape"),
    (lambda q, k, v, s: attention(q, k, v[:, :3], scale=1.0), "v has shape"),
    (lambda q, k, v, s: attention(q, k.astype(jnp.bfloat16), v, scale=1.0), "k has dtype"),
    (lambda q, k, v, s: attention(q.astype(jnp.int32), k, v, scale=1.0), "q has dtype"),
    (lambda q, k, v, s: attention(q, k, v, s[:, :5], scale=1.0), "segment_ids has shape"),
    (lambda q, k, v, s: attention(q, k, v, s.astype(jnp.float32), scale=1.0),
     "segment_ids has dtype"),
    (lambda q, k, v, s: attention(q, k, v, (s, s[:, :3]), scale=1.0), "kv_segment_ids has shape"),
    (lambda q, k, v, s: attention(q[:, :4], k, v, s, scale=1.0), "needs Tq == Tk"),
    (lambda q, k, v, s: attention(q, k, v, scale=1.0, backend="cuda"), "unknown backend"),
    (lambda q, k, v, s: attention(q, k, v, scale=1.0, q_offset=1.5), "q_offset"),
    (lambda q, k, v, s: attention(q, k, v, scale="x"), "scale"),
    (lambda q, k, v, s: attention(q[..., :40], k[..., :40], v, scale=1.0, backend="pallas_gpu"),
     "Dk must be a multiple of 16"),
    (lambda q, k, v, s: pallas_gpu.Config(dkv_keys_as_rows=1), "dkv_keys_as_rows must be a bool"),
])
def test_bad_arguments_name_the_argument(call, message):
  q, k, v, _ = (jnp.asarray(x, jnp.float32) for x in make_inputs(6, b=1, t=8))
  seg = jnp.zeros((1, 8), jnp.int32)
  with pytest.raises(ValueError, match=re.escape(message)):
    call(q, k, v, seg)
