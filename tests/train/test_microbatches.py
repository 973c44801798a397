"""Gradient accumulation: N micro-batches give the one-batch loss and gradients.

k3_tiny cut to 2 layers (KDA + dense FFN, then MLA + MoE: every kind of forward-written state),
batch 4 × 64 with uneven loss tokens per row, so the token weighting matters.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh

from tests.configs import k3_tiny
from k3train import config as config_lib
from k3train.model import moe
from k3train.model.decoder import build_model
from k3train.model.mla import MaxLogit
from k3train.parallel import rules as rules_lib
from k3train.parallel import state_sharding
from k3train.parallel.mesh import MESH_AXES
from k3train.train.step import forward_loss, loss_and_grads

B, T = 4, 64


def small_config():
  cfg = k3_tiny.get_config()
  cfg.model.num_layers = 2
  cfg.model.mla_layers = (2,)
  cfg.train.global_batch_size = B
  cfg.data.seq_len = T
  return cfg


@pytest.fixture(scope="module")
def setup():
  cfg = small_config()
  model = build_model(cfg.model, seed=0)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  rng = np.random.default_rng(0)
  loss_mask = np.ones((B, T), np.float32)
  loss_mask[1, 20:] = 0.0                   # rows carry 64, 20, 64 and 5 loss tokens
  loss_mask[3, 5:] = 0.0
  segment_ids = np.ones((B, T), np.int32)
  segment_ids[2, 40:] = 2                   # a second document in row 2
  batch = {"tokens": jnp.asarray(rng.integers(8, cfg.model.vocab_size, (B, T)), jnp.int32),
           "targets": jnp.asarray(rng.integers(8, cfg.model.vocab_size, (B, T)), jnp.int32),
           "segment_ids": jnp.asarray(segment_ids), "loss_mask": jnp.asarray(loss_mask)}
  run = jax.jit(loss_and_grads, static_argnums=(0, 4))
  return graphdef, params, rest, batch, run


def _by_kind(rest, kind):
  return jax.tree.leaves(rest.filter(kind))


@pytest.mark.parametrize("microbatches", [2])
def test_loss_and_gradients_equal_the_one_batch_step(setup, microbatches):
  graphdef, params, rest, batch, run = setup
  (loss1, (rest1, n1)), g1 = run(graphdef, params, rest, batch, 1)
  (loss_n, (rest_n, n_n)), g_n = run(graphdef, params, rest, batch, microbatches)
  assert float(n_n) == float(n1) == 64 + 20 + 64 + 5
  np.testing.assert_allclose(float(loss_n), float(loss1), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g_n)):
    scale = max(float(jnp.max(jnp.abs(a))), 1e-12)
    assert float(jnp.max(jnp.abs(a - b))) <= 1e-5 * scale
  # Expert loads are counts: the micro-batch sum is the whole batch's count, exactly.
  for a, b in zip(_by_kind(rest1, moe.ExpertLoad), _by_kind(rest_n, moe.ExpertLoad)):
    np.testing.assert_array_equal(a, b)
  # Max logits: the max over micro-batches is the whole batch's max (rows are independent).
  for a, b in zip(_by_kind(rest1, MaxLogit), _by_kind(rest_n, MaxLogit)):
    np.testing.assert_allclose(a, b, rtol=1e-5)
  # Router biases are not written by the forward pass: unchanged.
  for a, b in zip(_by_kind(rest, moe.RouterBias), _by_kind(rest_n, moe.RouterBias)):
    np.testing.assert_array_equal(a, b)


def test_qb_proposal_is_the_mean_of_the_micro_batch_proposals(setup):
  graphdef, params, rest, batch, run = setup
  (_, (rest_2, _)), _ = run(graphdef, params, rest, batch, 2)
  fwd = jax.jit(forward_loss, static_argnums=0)
  proposals = []
  for i in range(2):                       # micro-batch i = rows i, i + 2
    micro = {k: v[i::2] for k, v in batch.items()}
    _, (rest_i, _) = fwd(graphdef, params, rest, micro)
    proposals.append(_by_kind(rest_i, moe.QBPending))
  for got, a, b in zip(_by_kind(rest_2, moe.QBPending), *proposals):
    np.testing.assert_allclose(got, (np.asarray(a) + np.asarray(b)) / 2, rtol=1e-6, atol=1e-7)


def test_microbatches_must_divide_the_batch_and_the_mesh():
  cfg = small_config()
  cfg.train.microbatches = 3
  with pytest.raises(ValueError, match="train.microbatches.*divide train.global_batch_size=4"):
    config_lib.validate(cfg)
  # A 1-row micro-batch cannot spread over data=2 (the check make_layout runs for microbatches > 1).
  mesh = AbstractMesh((2, 1, 1, 1, 1), MESH_AXES)
  with pytest.raises(ValueError, match="micro-batch"):
    state_sharding.batch_sharding(mesh, rules_lib.get_rules("default"), 1, T, what="micro-batch")


@pytest.mark.parametrize("microbatches", [1, 2])
def test_expert_weights_cast_once_give_the_same_gradients(microbatches):
  """bf16 compute: casting the routed-expert weights once per step (`moe.cast_expert_weights`)
  instead of inside every grouped matmul leaves loss and gradients unchanged bit for bit, and the
  gradients still come back in the fp32 master dtype."""
  cfg = small_config()
  cfg.model.dtype = "bfloat16"
  model = build_model(cfg.model, seed=0)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  rng = np.random.default_rng(1)
  batch = {"tokens": jnp.asarray(rng.integers(8, cfg.model.vocab_size, (B, T)), jnp.int32),
           "targets": jnp.asarray(rng.integers(8, cfg.model.vocab_size, (B, T)), jnp.int32),
           "segment_ids": jnp.ones((B, T), jnp.int32), "loss_mask": jnp.ones((B, T), jnp.float32)}
  cast = lambda p: moe.cast_expert_weights(p, jnp.bfloat16)
  cast_paths = [path for path, v in nnx.to_flat_state(cast(params)) if v.get_value().dtype == jnp.bfloat16]
  assert cast_paths and all(moe.is_routed_expert_weight(tuple(p)) for p in cast_paths)
  assert len(cast_paths) == 3 * len(_by_kind(rest, moe.RouterBias))   # gate, up, down per MoE
  run = jax.jit(loss_and_grads, static_argnums=(0, 4, 5, 6))
  (loss_a, _), g_a = run(graphdef, params, rest, batch, microbatches, 0, None)
  (loss_b, _), g_b = run(graphdef, params, rest, batch, microbatches, 0, cast)
  assert float(loss_a) == float(loss_b)
  flat_a, flat_b = nnx.to_flat_state(g_a), nnx.to_flat_state(g_b)
  for (path, a), (_, b) in zip(flat_a, flat_b):
    a, b = a.get_value(), b.get_value()
    assert a.dtype == b.dtype == jnp.float32, path
    np.testing.assert_array_equal(a, b, err_msg=str(path))   # measured: identical on XLA:CPU


def _mtp_config():
  cfg = small_config()
  cfg.model.mtp.enabled = True
  return cfg


def test_embedding_gradient_by_rows_equals_the_table_gradient():
  """The embedding table's gradient scattered row by row into the accumulator equals the
  gradient of the table itself (fp32 summation order aside), with repeated token ids and the MTP
  module's second lookup; every other leaf is unchanged."""
  cfg = _mtp_config()
  graphdef, params, rest = nnx.split(build_model(cfg.model, seed=0), nnx.Param, ...)
  rng = np.random.default_rng(1)
  tokens = rng.integers(8, 20, (B, T))               # 12 distinct ids: each repeats ~20 times
  batch = {"tokens": jnp.asarray(tokens, jnp.int32),
           "targets": jnp.asarray(np.roll(tokens, -1, axis=1), jnp.int32),
           "segment_ids": jnp.ones((B, T), jnp.int32), "loss_mask": jnp.ones((B, T), jnp.float32)}
  run = jax.jit(loss_and_grads, static_argnums=(0, 4), static_argnames=("embedding_by_rows",))
  (loss_rows, _), g_rows = run(graphdef, params, rest, batch, 2, embedding_by_rows=True)
  (loss_table, _), g_table = run(graphdef, params, rest, batch, 2, embedding_by_rows=False)
  assert float(loss_rows) == float(loss_table)
  table = params["embed"]["embedding"][...]
  for path, a, b in zip([p for p, _ in jax.tree_util.tree_leaves_with_path(g_rows)],
                        jax.tree.leaves(g_rows), jax.tree.leaves(g_table)):
    scale = max(float(jnp.max(jnp.abs(b))), 1e-12)
    assert float(jnp.max(jnp.abs(a - b))) <= 1e-6 * scale, jax.tree_util.keystr(path)
  g_embed = np.asarray(g_rows["embed"]["embedding"][...])
  touched = np.unique(np.concatenate([tokens.ravel(), np.roll(tokens, -1, axis=1).ravel()]))
  assert g_embed.shape == table.shape
  assert np.all(np.any(g_embed[touched] != 0, axis=1))        # every looked-up row has a gradient
  untouched = np.setdiff1d(np.arange(table.shape[0]), touched)
  assert not np.any(g_embed[untouched])                       # and no other row


def test_embedding_gradient_by_rows_needs_no_table_sized_temporary():
  """With the rows path the micro-batch loop creates no zero-filled [vocab, d] buffer (the table
  gradient's scatter target); the table path does."""
  cfg = small_config()
  graphdef, params, rest = nnx.split(build_model(cfg.model, seed=0), nnx.Param, ...)
  batch = {"tokens": jnp.zeros((B, T), jnp.int32), "targets": jnp.zeros((B, T), jnp.int32),
           "segment_ids": jnp.ones((B, T), jnp.int32), "loss_mask": jnp.ones((B, T), jnp.float32)}
  v, d = params["embed"]["embedding"][...].shape
  def table_fills(by_rows):
    text = jax.jit(lambda p: loss_and_grads(graphdef, p, rest, batch, 2, embedding_by_rows=by_rows)
                   ).lower(params).as_text()
    return sum(1 for line in text.splitlines()
               if "broadcast_in_dim" in line and line.rstrip().endswith(f"tensor<{v}x{d}xf32>"))
  assert table_fills(True) < table_fills(False)
