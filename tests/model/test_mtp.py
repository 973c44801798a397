"""The MTP module (docs/maths.md §8): causality (§8 invariant 1), targets and masking across
documents, the loss weight."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.configs import k3_tiny
from k3train.model import mtp as mtp_lib
from k3train.model.decoder import build_model


@pytest.fixture(scope="module")
def models():
  cfg = k3_tiny.get_config()
  model = build_model(cfg.model)
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: mtp_lib.MTPModule(cfg.model, rngs=nnx.Rngs(0))))
  state = jax.jit(lambda: nnx.state(mtp_lib.MTPModule(
      cfg.model, rngs=nnx.Rngs(params=jax.random.key(1, impl="rbg")))))()
  return model, nnx.merge(graphdef, state), cfg


def test_mtp_logits_at_i_do_not_depend_on_tokens_after_i_plus_1(models):
  model, mtp, cfg = models
  t, i = 24, 10
  rng = np.random.default_rng(0)
  row = rng.integers(8, cfg.model.vocab_size, t + 1)
  other = row.copy()
  other[i + 2:] = rng.integers(8, cfg.model.vocab_size, t + 1 - (i + 2))   # tokens > i + 1
  batch = np.stack([row, other]).astype(np.int32)
  tokens, targets = jnp.asarray(batch[:, :-1]), jnp.asarray(batch[:, 1:])
  seg = jnp.ones_like(tokens)
  fn = nnx.jit(lambda m, p, x, y, s: mtp_lib.mtp_logits(m, p, x, y, s, (s > 0).astype(jnp.float32)))
  logits = np.asarray(fn(model, mtp, tokens, targets, seg))
  assert logits.shape == (2, t, cfg.model.vocab_size)
  np.testing.assert_array_equal(logits[0, :i + 1], logits[1, :i + 1])      # bit-identical
  # Control: position i + 1 reads t_{i+2}, which changed.
  assert np.abs(logits[0, i + 1] - logits[1, i + 1]).max() > 1e-4


def test_mtp_targets_are_masked_across_documents():
  # One row of T + 1 = 9 tokens: doc 1 = tokens 0..3, doc 2 = tokens 4..6, padding 7..8.
  tokens = np.array([10, 11, 12, 13, 20, 21, 22, 0, 0])
  seg_full = np.array([1, 1, 1, 1, 2, 2, 2, 0, 0])
  targets, seg = tokens[1:][None], seg_full[:-1][None]
  loss_mask = ((seg_full[:-1] != 0) & (seg_full[:-1] == seg_full[1:])).astype(np.float32)[None]
  tgt, mask = mtp_lib.mtp_targets(jnp.asarray(targets), jnp.asarray(loss_mask), jnp.asarray(seg))
  # Position i predicts t_{i+2}: valid iff t_i, t_{i+1}, t_{i+2} share a document.
  np.testing.assert_array_equal(np.asarray(tgt)[0, :6], tokens[2:8])
  np.testing.assert_array_equal(np.asarray(mask)[0], [1, 1, 0, 0, 1, 0, 0, 0])


def test_mtp_loss_is_the_weighted_mean_over_unmasked_positions():
  rng = np.random.default_rng(1)
  logits = jnp.asarray(rng.normal(size=(1, 8, 16)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 16, (1, 8)), jnp.int32)
  seg = jnp.asarray([[1, 1, 1, 1, 2, 2, 2, 2]])
  loss_mask = jnp.asarray([[1, 1, 1, 0, 1, 1, 1, 0]], jnp.float32)
  loss, n = mtp_lib.mtp_loss(logits, targets, loss_mask, seg, loss_weight=0.1)
  tgt, mask = mtp_lib.mtp_targets(targets, loss_mask, seg)
  logp = jax.nn.log_softmax(logits[0], axis=-1)
  keep = np.flatnonzero(np.asarray(mask[0]))
  want = -np.mean([float(logp[i, int(tgt[0, i])]) for i in keep])
  assert int(n) == len(keep) == 4
  np.testing.assert_allclose(float(loss), 0.1 * want, rtol=1e-6)
  # Logits at masked positions (document boundaries, the row end) do not enter the loss.
  masked = np.flatnonzero(np.asarray(mask[0]) == 0)
  noisy = logits.at[0, masked].add(100.0)
  np.testing.assert_allclose(float(mtp_lib.mtp_loss(noisy, targets, loss_mask, seg,
                                                    loss_weight=0.1)[0]), float(loss), rtol=1e-6)
  assert float(mtp_lib.mtp_loss(logits, targets, loss_mask, seg, loss_weight=0.0)[0]) == 0.0
