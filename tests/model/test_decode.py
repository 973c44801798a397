"""Prefill + decode with the KDA state / conv cache and the MLA latent cache against the full
forward (docs/maths.md §1.7.8, §2.5.2), with documents that start in the prompt and during
decoding; greedy generation is deterministic; nucleus sampling keeps the right tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.configs import k3_tiny, quick
from tests.params import perturbed
from k3train.model import decode
from k3train.model.decoder import build_model
from k3train.model.mla import GatedMLA

T_PROMPT, T_TOTAL = 21, 36


def randomize(model, seed=0, scale=0.3):
  """Every parameter and router bias moved off its initial value (zero AttnRes queries, unit
  gains and zero biases would hide wiring mistakes), by `tests.params.perturbed` (one seeded
  generator, leaves in tree order)."""
  rng = np.random.default_rng(seed)

  def noisy(x):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      return x
    return jax.device_put(perturbed(x, rng, scale).astype(x.dtype), x.sharding)

  nnx.update(model, jax.tree.map(noisy, nnx.state(model)))
  return model


@pytest.fixture(scope="module")
def tiny():
  """The four-layer k3_tiny (every layer kind, a scanned super-block), parameters randomized."""
  cfg = quick(k3_tiny.get_config())
  return randomize(build_model(cfg.model)), cfg


def tokens_and_segments(vocab):
  rng = np.random.default_rng(0)
  tokens = rng.integers(8, vocab, (2, T_TOTAL)).astype(np.int32)
  seg = np.ones((2, T_TOTAL), np.int32)
  seg[0, 9:] = 2            # row 0: a document starts inside the prompt ...
  seg[0, 27:] = 3           # ... and another while decoding
  seg[1, T_PROMPT:] = 2     # row 1: a document starts with the first decoded token
  return tokens, seg


def test_prefill_then_decode_equals_full_forward(tiny):
  model, cfg = tiny
  tokens, seg = tokens_and_segments(cfg.model.vocab_size)
  full = np.asarray(jax.jit(lambda s, x, g: nnx.merge(nnx.graphdef(model), s)(
      x, g, (g > 0).astype(jnp.float32)))(nnx.state(model), tokens, seg), np.float32)
  dec = decode.Decoder(model, max_len=40)
  logits, cache = dec.prefill(tokens[:, :T_PROMPT], seg[:, :T_PROMPT])
  got = [np.asarray(logits)]
  for t in range(T_PROMPT, T_TOTAL):
    step_logits, cache = dec.step(tokens[:, t], cache, seg[:, t])
    got.append(np.asarray(step_logits)[:, None])
  got = np.concatenate(got, axis=1)
  assert got.shape == full.shape == (2, T_TOTAL, cfg.model.vocab_size)
  # fp32 ≤ 1e-5: chunked KDA vs one recurrence step and naive vs absorbed MLA differ by rounding.
  np.testing.assert_allclose(got, full, atol=1e-5, rtol=0)
  assert np.abs(full).max() > 0.1   # the comparison is not between near-zero logits
  assert int(cache.length) == T_TOTAL
  # The MLA cache holds 576-style latent rows (kv_lora_rank + rope) per token, not per head.
  mla = cfg.model.mla
  latent = cache.layers["prefix"][1]["latent"]                  # layer 2: the first MLA layer
  assert latent.shape == (2, 40, mla.kv_lora_rank + mla.qk_rope_head_dim)


def test_decode_without_document_ids_sees_the_whole_row(tiny):
  """Control for the test above: a reset is not a no-op (dropping the ids changes the logits)."""
  model, cfg = tiny
  tokens, seg = tokens_and_segments(cfg.model.vocab_size)
  dec = decode.Decoder(model, max_len=40)
  _, cache_a = dec.prefill(tokens[:, :T_PROMPT], seg[:, :T_PROMPT])
  _, cache_b = dec.prefill(tokens[:, :T_PROMPT], np.ones_like(seg[:, :T_PROMPT]))
  a, _ = dec.step(tokens[:, T_PROMPT], cache_a, seg[:, T_PROMPT])
  b, _ = dec.step(tokens[:, T_PROMPT], cache_b, np.ones(2, np.int32))
  assert np.abs(np.asarray(a) - np.asarray(b)).max() > 1e-3


def test_absorbed_mla_step_equals_naive_attention():
  """§2.5.1 for one layer: the absorbed decode step over a cache equals the training path's
  last position (fp32, 1e-5 relative)."""
  cfg = k3_tiny.get_config().model
  layer = GatedMLA(cfg.mla, d_model=16, init_std=0.3, dtype=jnp.float32, param_dtype=jnp.float32,
                   rngs=nnx.Rngs(params=jax.random.key(3, impl="rbg")))
  x = jax.random.normal(jax.random.key(4), (2, 9, 16))
  want = layer(x)[:, -1]
  latent = jnp.zeros((2, 12, cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim))
  latent = latent.at[:, :8].set(layer.latent(x[:, :8]))
  allowed = jnp.broadcast_to(jnp.arange(12) <= 8, (2, 12))
  got, latent = layer.decode_step(x[:, 8:9], latent, jnp.int32(8), allowed)
  np.testing.assert_allclose(np.asarray(got[:, 0]), np.asarray(want), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(latent[:, 8]), np.asarray(layer.latent(x)[:, 8]), atol=1e-6)


def test_greedy_generation_is_deterministic_and_follows_the_full_forward(tiny):
  model, cfg = tiny
  tokens, _ = tokens_and_segments(cfg.model.vocab_size)
  dec = decode.Decoder(model, max_len=40)

  def generate():
    logits, cache = dec.prefill(tokens[:, :T_PROMPT])
    out = []
    for _ in range(6):
      nxt = decode.sample(logits[:, -1] if logits.ndim == 3 else logits, jax.random.key(0),
                          temperature=0.0)
      out.append(np.asarray(nxt))
      logits, cache = dec.step(nxt, cache)
    return np.stack(out, axis=1)

  first, second = generate(), generate()
  np.testing.assert_array_equal(first, second)
  # Greedy choice = argmax of the full forward over prompt + generated tokens, at every step.
  seq = np.concatenate([tokens[:, :T_PROMPT], first], axis=1)
  full = np.asarray(nnx.jit(lambda m, x: m(x))(model, jnp.asarray(seq)))
  np.testing.assert_array_equal(np.argmax(full[:, T_PROMPT - 1:-1], axis=-1), first)


def test_nucleus_sampling_keeps_the_smallest_set_reaching_top_p():
  probs = jnp.array([[0.5, 0.3, 0.15, 0.05]])
  logits = jnp.log(probs)
  keys = jax.random.split(jax.random.key(0), 2000)
  draws = np.asarray(jax.vmap(lambda k: decode.sample(logits, k, temperature=1.0, top_p=0.8))(keys))
  assert set(np.unique(draws)) == {0, 1}                # 0.5 + 0.3 reaches 0.8
  assert abs(np.mean(draws == 0) - 0.5 / 0.8) < 0.05    # renormalised over the kept set
  assert int(decode.sample(logits, keys[0], temperature=0.0)[0]) == 0
