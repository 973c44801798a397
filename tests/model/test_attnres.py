"""Block Attention Residuals (docs/maths.md §3): `attn_res_mix` invariants (§3.5), the fast
`mix_stream` (values and gradients against fp64 references) and the K3 wiring.

Both functions compute in fp32 whatever the input dtype, so comparisons with the fp64 references
use rtol = atol = 2e-6 for values and 1e-5 for gradients (O(1) values, ≤ 9 sources). "Exact"
below means bitwise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3train.model import attnres
from pallas_kernels import attnres as attnres_ops

EPS = 1e-5
TOL = 2e-6

# num_valid is traced, so every source count of one shape shares a compilation.
_mix = jax.jit(attnres_ops.attn_res_mix, static_argnums=(4,))


def mix(sources, num_valid, query, gain, eps=EPS):
  return np.asarray(_mix(jnp.asarray(sources), jnp.int32(num_valid), jnp.asarray(query),
                         jnp.asarray(gain), eps))


def rand(shape, seed, scale=1.0):
  return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


def ref_probs(sources, num_valid, query, gain, eps=EPS):
  """fp64 reference of §3.1: π over the first num_valid sources, per token → [n, B, T]."""
  v = np.asarray(sources, np.float64)[:num_valid]
  keys = v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps)
  scores = keys @ (np.asarray(gain, np.float64) * np.asarray(query, np.float64))
  scores = scores - scores.max(axis=0, keepdims=True)
  p = np.exp(scores)
  return p / p.sum(axis=0, keepdims=True)


def ref_mix(sources, num_valid, query, gain, eps=EPS):
  p = ref_probs(sources, num_valid, query, gain, eps)
  return np.einsum("nbt,nbtd->btd", p, np.asarray(sources, np.float64)[:num_valid])


def recover_probs(sources_valid, out):
  """The mixing weights the function actually used: out[b,t] = Σ_i π_i V_i[b,t] with the V_i
  linearly independent (n ≤ d), solved by least squares in fp64. Returns [n, B, T]."""
  n, b, t, _ = sources_valid.shape
  pi = np.zeros((n, b, t))
  for bi in range(b):
    for ti in range(t):
      a = np.asarray(sources_valid[:, bi, ti], np.float64).T          # [d, n]
      pi[:, bi, ti] = np.linalg.lstsq(a, np.asarray(out[bi, ti], np.float64), rcond=None)[0]
  return pi


N_MAX, B, T, D = 5, 2, 3, 8
SRC = rand((N_MAX, B, T, D), seed=0)
QUERY = rand((D,), seed=1, scale=3.0 / np.sqrt(D))     # O(1) scores: a non-uniform softmax
GAIN = np.random.default_rng(2).uniform(0.5, 1.5, D).astype(np.float32)


@pytest.mark.parametrize("num_valid", [1, 2, 3, 5])
def test_matches_fp64_reference(num_valid):
  out = mix(SRC, num_valid, QUERY, GAIN)
  np.testing.assert_allclose(out, ref_mix(SRC, num_valid, QUERY, GAIN), rtol=TOL, atol=TOL)
  if num_valid > 1:   # and the softmax is far from uniform, so the query and gain matter
    assert np.abs(out - SRC[:num_valid].mean(0)).max() > 1e-2


@pytest.mark.parametrize("num_valid", [2, 3, 5])
def test_zero_query_gives_mean_of_valid_sources(num_valid):
  garbage = SRC.copy()
  garbage[num_valid:] = 1e6    # invalid slots must not enter the mean
  out = mix(garbage, num_valid, np.zeros(D, np.float32), GAIN)
  expected = np.asarray(SRC[:num_valid], np.float64).mean(0)
  np.testing.assert_allclose(out, expected, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_one_valid_source_is_exact_identity(dtype):
  src = SRC.copy()
  src[1:] = rand((N_MAX - 1, B, T, D), seed=3, scale=1e30)   # huge finite garbage
  src = jnp.asarray(src).astype(dtype)
  out = _mix(src, jnp.int32(1), jnp.asarray(QUERY), jnp.asarray(GAIN), EPS)
  assert out.dtype == src.dtype
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(src[0], np.float32))


def test_invalid_slots_have_no_effect():
  n = 3
  zeros_tail = SRC.copy()
  zeros_tail[n:] = 0.0
  garbage_tail = SRC.copy()
  garbage_tail[n:] = rand((N_MAX - n, B, T, D), seed=4, scale=1e30)
  garbage_tail[n:, 0, 0, :] = -3e38                                 # near fp32 max
  a = mix(zeros_tail, n, QUERY, GAIN)
  b = mix(garbage_tail, n, QUERY, GAIN)
  assert np.all(np.isfinite(b))
  np.testing.assert_array_equal(a, b)                              # same program, exact
  truncated = np.asarray(_mix(jnp.asarray(SRC[:n]), jnp.int32(n), jnp.asarray(QUERY),
                              jnp.asarray(GAIN), EPS))
  np.testing.assert_allclose(b, truncated, rtol=TOL, atol=TOL)    # other shape: summation order


def test_probabilities_invariant_to_positive_rescaling_output_not():
  n = 3
  src = SRC[:n].copy()
  out = mix(src, n, QUERY, GAIN)
  pi = recover_probs(src, out)
  np.testing.assert_allclose(pi, ref_probs(src, n, QUERY, GAIN), rtol=0, atol=1e-5)
  assert np.abs(pi - 1.0 / n).max() > 0.05                        # non-trivial weights
  for j, c in [(0, 7.0), (2, 0.25)]:
    scaled = src.copy()
    scaled[j] *= c
    out_s = mix(scaled, n, QUERY, GAIN)
    pi_s = recover_probs(scaled, out_s)
    # Keys are RMS-normalised: π changes only through ε (ε / mean(V²) ≲ 1e-4 here).
    np.testing.assert_allclose(pi_s, pi, rtol=0, atol=1e-4)
    # ... but the values are not normalised, so the output moves.
    assert np.abs(out_s - out).max() > 0.1


def test_permutation_equivariance_over_valid_sources():
  n = 4
  out = mix(SRC, n, QUERY, GAIN)
  rng = np.random.default_rng(5)
  for _ in range(3):
    perm = np.concatenate([rng.permutation(n), np.arange(n, N_MAX)])
    np.testing.assert_allclose(mix(SRC[perm], n, QUERY, GAIN), out, rtol=TOL, atol=TOL)
  # Moving a valid source into an invalid slot does change the result.
  swapped = SRC[[0, 1, 2, 4, 3]]
  assert np.abs(mix(swapped, n, QUERY, GAIN) - out).max() > 1e-2


_grad_query = jax.jit(jax.grad(
    lambda q, src, g, cot: jnp.sum(attnres_ops.attn_res_mix(src, 3, q, g, EPS) * cot)))


def test_gradient_wrt_query_at_zero_init():
  n = 3
  src = SRC[:n]
  cot = rand((B, T, D), seed=6)
  g = np.asarray(_grad_query(jnp.zeros(D), jnp.asarray(src), jnp.asarray(GAIN), jnp.asarray(cot)))
  # fp64 reference: π = 1/n, ∂L/∂w = γ ⊙ Σ_{b,t} Σ_i π_i (u_i − ū) k_i with u_i = cot · V_i.
  v = np.asarray(src, np.float64)
  keys = v / np.sqrt(np.mean(v * v, -1, keepdims=True) + EPS)
  u = np.einsum("btd,nbtd->nbt", cot, v)
  expected = GAIN * np.einsum("nbt,nbtd->d", (u - u.mean(0)) / n, keys)
  assert np.abs(expected).max() > 1e-2
  np.testing.assert_allclose(g, expected, rtol=1e-5, atol=1e-5)
  # Identical sources: every key is the same, the softmax gradient vanishes.
  same = np.broadcast_to(src[:1], src.shape).copy()
  g_same = np.asarray(_grad_query(jnp.zeros(D), jnp.asarray(same), jnp.asarray(GAIN),
                                  jnp.asarray(cot)))
  np.testing.assert_allclose(g_same, 0.0, atol=1e-5)


def test_mix_module_zero_init_and_matches_function():
  site = attnres.AttnResMix(D, eps=EPS, rngs=nnx.Rngs(params=jax.random.key(0, impl="rbg")))
  np.testing.assert_array_equal(np.asarray(site.query[...]), np.zeros(D))
  np.testing.assert_array_equal(np.asarray(site.norm_scale[...]), np.ones(D))
  stream = (jnp.asarray(SRC[:-1]), jnp.int32(3), jnp.asarray(SRC[3]))
  out, passed = site(stream)
  np.testing.assert_allclose(np.asarray(out), SRC[:4].astype(np.float64).mean(0), rtol=TOL, atol=TOL)
  # The site hands back the stream it read, unchanged.
  for got, want in zip(passed, stream):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# ----------------------------------------------------------------------------- mix_stream


BLOCKS, PARTIAL = SRC[:N_MAX - 1], SRC[N_MAX - 1]
COT = rand((B, T, D), seed=9)


def _mix64(blocks, num_blocks, p, query, gain, eps=EPS):
  """The maths of §3.1 in fp64 jnp (under jax.enable_x64), differentiated by autodiff."""
  sources = jnp.concatenate([blocks[:num_blocks], p[None]])
  keys = sources * jax.lax.rsqrt(jnp.mean(sources * sources, axis=-1, keepdims=True) + eps)
  probs = jax.nn.softmax(jnp.einsum("nbtd,d->nbt", keys, gain * query), axis=0)
  return jnp.einsum("nbt,nbtd->btd", probs, sources)


@pytest.mark.parametrize("num_blocks", [0, 1, 2, 4])
def test_mix_stream_value_and_gradients_match_fp64(num_blocks):
  args = (BLOCKS, PARTIAL, QUERY, GAIN)
  fast = jax.jit(jax.value_and_grad(
      lambda b, p, q, g: jnp.sum(attnres_ops.mix_stream(b, num_blocks, p, q, g, EPS) * COT),
      argnums=(0, 1, 2, 3)))
  value, grads = fast(*map(jnp.asarray, args))
  out = attnres_ops.mix_stream(*map(jnp.asarray, (BLOCKS, num_blocks, PARTIAL, QUERY, GAIN)), EPS)
  np.testing.assert_allclose(out, ref_mix(np.concatenate([BLOCKS[:num_blocks], PARTIAL[None]]),
                                          num_blocks + 1, QUERY, GAIN), rtol=TOL, atol=TOL)
  with jax.enable_x64():
    ref_value, ref_grads = jax.value_and_grad(
        lambda b, p, q, g: jnp.sum(_mix64(b, num_blocks, p, q, g) * COT), argnums=(0, 1, 2, 3))(
            *(jnp.asarray(a, jnp.float64) for a in args))
    ref_value, ref_grads = float(ref_value), [np.asarray(x) for x in ref_grads]
  np.testing.assert_allclose(float(value), ref_value, rtol=1e-5, atol=1e-5)
  for name, got, want in zip(("blocks", "partial", "query", "gain"), grads, ref_grads):
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5, err_msg=name)
  # Slots at or past num_blocks get no gradient; the valid ones and the pseudo-query do.
  np.testing.assert_array_equal(np.asarray(grads[0])[num_blocks:], 0.0)
  if num_blocks:
    assert np.abs(np.asarray(grads[0])[:num_blocks]).min(axis=-1).max() > 1e-3
    assert np.abs(np.asarray(grads[2])).max() > 1e-2


def test_mix_stream_equals_reference_path_in_bf16():
  """bf16 stream: same output dtype as the reference buffer path, same values and gradients
  (both compute in fp32; the gradients round to bf16 once, so they agree to a bf16 ulp)."""
  bf = lambda x: jnp.asarray(x).astype(jnp.bfloat16)
  blocks, p, q, g = bf(BLOCKS), bf(PARTIAL), jnp.asarray(QUERY), jnp.asarray(GAIN)

  def loss(fn):
    return jax.jit(jax.grad(lambda b, p, q, g: jnp.sum(fn(b, p, q, g).astype(jnp.float32) * COT),
                            argnums=(0, 1, 2, 3)))

  fast = loss(lambda b, p, q, g: attnres_ops.mix_stream(b, 3, p, q, g, EPS))
  ref = loss(lambda b, p, q, g: attnres_ops.attn_res_mix(attnres.with_partial(b, 3, p), 4, q, g, EPS))
  out = attnres_ops.mix_stream(blocks, 3, p, q, g, EPS)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(
      np.asarray(out, np.float32),
      np.asarray(attnres_ops.attn_res_mix(attnres.with_partial(blocks, 3, p), 4, q, g, EPS), np.float32),
      rtol=1e-2, atol=1e-2)
  for got, want in zip(fast(blocks, p, q, g), ref(blocks, p, q, g)):
    assert got.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=1e-2, atol=1e-2)


def test_selective_remat_keeps_the_statistics_not_the_sources():
  """Under the selective policy a mix's backward reads saved [N + 1, B, T] statistics: the
  residuals saved by jax.checkpoint are the three statistics, no source-sized array."""
  from jax._src.ad_checkpoint import saved_residuals
  from k3train.model import remat

  def site(blocks, p, q, g):
    return attnres_ops.mix_stream(blocks, 2, jnp.sin(p), q, g, EPS)

  fn = jax.checkpoint(site, policy=remat.policy("selective"))
  saved = saved_residuals(fn, *map(jnp.asarray, (BLOCKS, PARTIAL, QUERY, GAIN)))
  shapes = sorted(tuple(aval.shape) for aval, why in saved if "argument" not in why)
  assert shapes == [(N_MAX, B, T)] * 3, saved


# ----------------------------------------------------------------------------- K3 schedule


def test_max_sources():
  assert attnres.max_sources(93, 12) == 9     # 8 block starts (0, 12, …, 84) + partial sum
  assert attnres.max_sources(13, 4) == 5
  assert attnres.max_sources(12, 12) == 2
  assert attnres.max_sources(1, 12) == 2


@jax.jit
def _layer_step(stream, layer_index, attn_out, mlp_out):
  """The wiring order of DecoderLayer.__call__, with the sublayer outputs given."""
  blocks, num_blocks, p = stream
  attn_sources, attn_n = attnres.with_partial(blocks, num_blocks, p), num_blocks + 1
  attn_mix = attnres_ops.mix_stream(blocks, num_blocks, p, QUERY[:4], GAIN[:4], EPS)
  blocks, num_blocks, p = attnres.maybe_start_block(stream, layer_index, 12)
  p = p + attn_out
  mlp_sources, mlp_n = attnres.with_partial(blocks, num_blocks, p), num_blocks + 1
  p = p + mlp_out
  return (blocks, num_blocks, p), attn_sources, attn_n, mlp_sources, mlp_n, attn_mix


def test_k3_schedule_source_counts_and_contents():
  """93 layers, block size 12: the buffer wiring reproduces the list-based rule of §3.2."""
  num_layers, block, d = 93, 12, 4
  n_max = attnres.max_sources(num_layers, block)
  assert attnres.max_blocks(num_layers, block) == n_max - 1 == 8
  rng = np.random.default_rng(7)
  emb = rng.standard_normal((1, 1, d)).astype(np.float32)
  outs = rng.integers(-8, 8, (num_layers, 2, 1, 1, d)).astype(np.float32)  # exact sums in fp32
  stream = attnres.init_stream(jnp.asarray(emb), attnres.max_blocks(num_layers, block))
  ref_blocks, ref_p = [], emb.astype(np.float64)
  for layer in range(num_layers):
    stream, a_src, a_n, m_src, m_n, a_mix = _layer_step(stream, jnp.int32(layer), outs[layer, 0],
                                                        outs[layer, 1])
    # reference: h_attn over blocks + [p] (layer 0: p alone), then maybe a block start
    ref_attn = ref_blocks + [ref_p]
    if layer % block == 0:
      ref_blocks, ref_p = ref_blocks + [ref_p], np.zeros_like(ref_p)
    ref_p = ref_p + outs[layer, 0]
    ref_mlp = ref_blocks + [ref_p]
    ref_p = ref_p + outs[layer, 1]

    expected_attn = 1 if layer == 0 else (layer - 1) // block + 2
    assert int(a_n) == len(ref_attn) == expected_attn, layer
    assert int(m_n) == len(ref_mlp) == layer // block + 2, layer
    np.testing.assert_array_equal(np.asarray(a_src)[:int(a_n)], np.stack(ref_attn))
    np.testing.assert_array_equal(np.asarray(m_src)[:int(m_n)], np.stack(ref_mlp))
    # the stream's mix is the reference mix over the listed sources
    np.testing.assert_allclose(np.asarray(a_mix), ref_mix(np.stack(ref_attn), len(ref_attn),
                                                          QUERY[:4], GAIN[:4]), rtol=TOL, atol=TOL)
    if layer == 0:   # one source: the mix is the identity on the embedding
      h0 = mix(a_src, a_n, rand((d,), 8), np.ones(d, np.float32))
      np.testing.assert_array_equal(h0, emb)
  blocks, num_blocks, p = stream
  out_sources = attnres.with_partial(blocks, num_blocks, p)
  assert int(num_blocks) + 1 == len(ref_blocks) + 1 == 9 == n_max
  np.testing.assert_array_equal(np.asarray(out_sources), np.stack(ref_blocks + [ref_p]))
  # Block 0 is the embedding; block n >= 1 sums the sublayer outputs of layers [12(n-1), 12n).
  np.testing.assert_array_equal(np.asarray(out_sources[0]), emb)
  np.testing.assert_array_equal(np.asarray(out_sources[3]), outs[24:36].sum(axis=(0, 1)))
  np.testing.assert_array_equal(np.asarray(out_sources[8]), outs[84:93].sum(axis=(0, 1)))


@pytest.mark.parametrize("num_blocks,layer_index", [(0, 0), (0, 5), (2, 12), (2, 13), (3, 24)])
def test_closing_a_block_backward_equals_autodiff_of_the_update(num_blocks, layer_index):
  """maybe_start_block's explicit VJP (one slot read and rewritten) equals autodiff of the plain
  update (slot num_blocks ← p and p ← 0 at a block start, else unchanged), bitwise."""
  rng = np.random.default_rng(num_blocks + layer_index)
  blocks, p = rng.standard_normal((4, B, T, D)), rng.standard_normal((B, T, D))
  ct_blocks, ct_p = rng.standard_normal((4, B, T, D)), rng.standard_normal((B, T, D))
  blocks, p, ct_blocks, ct_p = (jnp.asarray(x, jnp.float32) for x in (blocks, p, ct_blocks, ct_p))

  def plain(blocks, p):
    start = (layer_index % 12) == 0
    slot = blocks[num_blocks]
    return blocks.at[num_blocks].set(jnp.where(start, p, slot)), jnp.where(start, 0.0 * p, p)

  def explicit(blocks, p):
    out = attnres.maybe_start_block((blocks, jnp.int32(num_blocks), p), jnp.int32(layer_index), 12)
    return out[0], out[2]

  def loss(fn):
    return lambda blocks, p: (lambda o: jnp.sum(o[0] * ct_blocks) + jnp.sum(o[1] * ct_p))(
        fn(blocks, p))

  for got, want in zip(explicit(blocks, p), plain(blocks, p)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  grads = jax.jit(jax.grad(loss(explicit), argnums=(0, 1)))(blocks, p)
  for got, want in zip(grads, jax.grad(loss(plain), argnums=(0, 1))(blocks, p)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  count = attnres.maybe_start_block((blocks, jnp.int32(num_blocks), p), jnp.int32(layer_index), 12)[1]
  assert int(count) == num_blocks + (layer_index % 12 == 0)


@pytest.mark.parametrize("num_blocks,layer_index", [(0, 0), (0, 5), (2, 12), (2, 13)])
def test_a_static_layer_index_closes_blocks_as_a_traced_one(num_blocks, layer_index):
  """A Python-int layer index (the unscanned layers) gives the traced index's stream and
  gradients; a layer that starts no block returns the stream's arrays themselves and traces no
  update of the buffer."""
  rng = np.random.default_rng(7 + layer_index)
  blocks = jnp.asarray(rng.standard_normal((4, B, T, D)), jnp.float32)
  p = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
  ct = jnp.asarray(rng.standard_normal((4, B, T, D)), jnp.float32)

  def run(index):
    def loss(blocks, p):
      out = attnres.maybe_start_block((blocks, jnp.int32(num_blocks), p), index, 12)
      return jnp.sum(out[0] * ct) + jnp.sum(out[2] * p * 0.5), out
    return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(blocks, p)

  (l_static, out_static), g_static = run(layer_index)
  (l_traced, out_traced), g_traced = run(jnp.int32(layer_index))
  for got, want in zip(jax.tree.leaves((l_static, out_static, g_static)),
                       jax.tree.leaves((l_traced, out_traced, g_traced))):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  stream = (blocks, jnp.int32(num_blocks), p)
  jaxpr = jax.make_jaxpr(lambda s: attnres.maybe_start_block(s, layer_index, 12))(stream)
  updates = [e for e in jaxpr.eqns if "dynamic_update_slice" in str(e.primitive)
             or "custom_vjp" in str(e.primitive)]
  if layer_index % 12:
    assert attnres.maybe_start_block(stream, layer_index, 12) is stream
    assert not updates
  else:
    assert updates
