"""Evals at the training length (k3train/train/evals.py) with the chunked head.

train.loss_chunk_tokens > 0: every metric of `Evaluator` (held-out loss overall, per source and by
position, token counts, retrieval accuracy) equals the logits path on a one-layer k3_tiny (fp32
compute); answer correctness follows the argmax token for token; the eval program holds no value
with a vocabulary-sized last dimension over more than B·c tokens.
"""

import json

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.train.test_head_loss import BT, TT, _tiny_config
from k3train import config as config_lib
from k3train.train import builder
from k3train.train import evals

B, T, CHUNK = BT, TT, 16          # 4 chunks of 16 positions per row
TASKS = ("passkey", "multikey", "vartrack")      # all fit in 64 tokens with the default tokenizer
WORDS = "alpha beta gamma delta kernel tensor shard layer expert router token batch".split()


def _config(eval_source: str, loss_chunk_tokens: int):
  """The one-layer k3_tiny of the train step test of tests/train/test_head_loss.py (batch 4 × 64),
  so model initialisation reuses its compiled programs, evaluating one held-out source."""
  cfg = _tiny_config(loss_chunk_tokens)
  cfg.eval.sources = (eval_source,)           # a separate validation source: evaluated whole
  cfg.eval.batches = 2
  cfg.eval.position_buckets = 4
  cfg.eval.retrieval = TASKS
  return config_lib.validate(cfg)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  """(the built run, {loss_chunk_tokens: Evaluator}) for 0 (logits) and CHUNK."""
  path = tmp_path_factory.mktemp("evals") / "valid.jsonl"
  rng = np.random.default_rng(0)
  with open(path, "w") as f:
    for i in range(60):
      words = " ".join(rng.choice(WORDS, size=int(rng.integers(5, 60))))
      f.write(json.dumps({"text": f"valid document {i}: {words}"}) + "\n")
  cfgs = {c: _config(f"jsonl:{path}", c) for c in (0, CHUNK)}
  run = builder.build(cfgs[0])                # the chunk size does not change the model
  assert cfgs[0].model.dtype == "float32"
  return run, {c: evals.Evaluator(cfg, run) for c, cfg in cfgs.items()}


def test_chunked_head_metrics_equal_the_logits_metrics(setup):
  """Token counts and retrieval accuracies exactly; losses to 1e-6 relative (the same fp32
  per-position nll up to the rounding of the [B, c, V] against the [B, T, V] head GEMM)."""
  run, evaluators = setup
  dense, chunked = (evaluators[c](run.state) for c in (0, CHUNK))
  assert chunked.keys() == dense.keys()
  assert {"eval/loss", "eval/tokens", "eval/retrieval/mean"} <= dense.keys()
  assert sum(k.startswith("eval/loss_by_pos/") for k in dense) == 4
  assert all(f"eval/retrieval/{task}" in dense for task in TASKS)
  for key, value in dense.items():
    if key.startswith(("eval/tokens", "eval/retrieval/")):
      assert chunked[key] == value, key
    else:
      assert chunked[key] == pytest.approx(value, rel=1e-6, abs=0), key
  assert dense["eval/tokens"] > 0


def _global(run, batch):
  return run.layout.global_batch({k: batch[k] for k in evals.EVAL_KEYS})


def test_answer_correctness_follows_the_argmax(setup):
  """A retrieval batch whose answer targets are the model's argmax predictions (rows 0 and 1),
  the predictions with one answer token changed (row 2), or the real answers (row 3): both
  heads mark rows 0 and 1 correct, row 2 wrong, and agree on every output."""
  run, evaluators = setup
  batch = dict(evaluators[0].retrieval_batch("passkey"))

  def forward(params, rest, tokens, segment_ids):
    with run.layout.activate():
      model = nnx.merge(run.graphdef, params, rest, copy=True)
      return jnp.argmax(model(tokens, segment_ids, (segment_ids > 0).astype(jnp.float32)), -1)

  g = _global(run, batch)
  pred = np.asarray(jax.jit(forward)(run.state.params, run.state.rest, g["tokens"], g["segment_ids"]))
  answer = batch["answer_mask"] > 0
  assert np.all(answer.sum(axis=1) > 0)
  targets = np.array(batch["targets"])
  targets[:3][answer[:3]] = pred[:3][answer[:3]]
  first = np.argmax(answer[2])
  targets[2, first] = (pred[2, first] + 1) % run.cfg.model.vocab_size
  batch["targets"] = targets
  outs = {c: jax.device_get(ev.step(run.state.params, run.state.rest, _global(run, batch)))
          for c, ev in evaluators.items()}
  assert list(outs[0]["correct"][:3]) == [True, True, False]
  for key in ("correct", "has_answer", "count"):
    np.testing.assert_array_equal(outs[CHUNK][key], outs[0][key], err_msg=key)
  np.testing.assert_allclose(outs[CHUNK]["loss_sum"], outs[0]["loss_sum"], rtol=1e-6, atol=0)


def _largest_vocab_rows(jaxpr, vocab: int) -> int:
  """The most tokens (elements / V) of any value whose last dimension is V, in a program and the
  programs in its equations (jit, scan bodies, …)."""
  rows = 0
  for eqn in jaxpr.eqns:
    for var in (*eqn.invars, *eqn.outvars):
      shape = getattr(getattr(var, "aval", None), "shape", ())
      if shape and shape[-1] == vocab:
        rows = max(rows, int(np.prod(shape[:-1])))
    for sub in jex.jaxprs_in_params(eqn.params):
      rows = max(rows, _largest_vocab_rows(sub, vocab))
  return rows


def test_chunked_eval_program_holds_no_tokens_by_vocab_value(setup):
  """The logits path holds [B, T, V]; the chunked one one chunk [B, c, V] at most (the head
  kernel [d, V] has d = 64 = B·c rows here)."""
  run, evaluators = setup
  batch = _global(run, evaluators[0].retrieval_batch("passkey"))
  vocab = run.cfg.model.vocab_size
  rows = {c: _largest_vocab_rows(jax.make_jaxpr(ev.step)(run.state.params, run.state.rest,
                                                         batch).jaxpr, vocab)
          for c, ev in evaluators.items()}
  assert rows == {0: B * T, CHUNK: B * CHUNK}
