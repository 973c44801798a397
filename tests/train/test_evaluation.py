"""Held-out evaluation: training and eval documents are disjoint by document id, eval batches hold
exactly held-out documents' tokens, hosts split the rows, `evaluate` equals a float64
reference of the masked next-token loss, and the fused head's loss equals the logits path."""

import json
import math

import jax
import ml_collections
import numpy as np
import pytest
from flax import nnx

from k3train.data import sources as sources_lib
from k3train.data import tokenizer as tokenizer_lib
from k3train.train import evaluation

DOCS = 300
WORDS = "alpha beta gamma delta kernel tensor shard layer expert router token batch".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """A JSONL training source and a separate validation source with distinct texts."""
  root = tmp_path_factory.mktemp("corpus")
  rng = np.random.default_rng(0)
  for name, n in (("train", DOCS), ("valid", 40)):
    with open(root / f"{name}.jsonl", "w") as f:
      for i in range(n):
        words = " ".join(rng.choice(WORDS, size=int(rng.integers(5, 60))))
        f.write(json.dumps({"text": f"{name} document {i}: {words}"}) + "\n")
  return f"jsonl:{root / 'train.jsonl'}", f"jsonl:{root / 'valid.jsonl'}"


def make_cfg(train_spec, eval_sources=(), *, fraction=0.2, seq_len=32, batches=2, rows=4):
  return ml_collections.ConfigDict({
      "data": {"sources": (train_spec,), "weights": (1.0,), "heldout_fraction": fraction,
               "tokenizer": "default", "seq_len": seq_len},
      "eval": {"sources": tuple(eval_sources), "batches": batches, "seed": 3},
      "train": {"global_batch_size": rows}})


def pieces_of(batch):
  """The packed pieces of every row: a segment's inputs, plus its last target when that is still
  the segment's (a piece that ends the row)."""
  out = []
  for tokens, targets, seg, mask in zip(batch["tokens"], batch["targets"], batch["segment_ids"],
                                        batch["loss_mask"]):
    for k in range(1, int(seg.max()) + 1):
      idx = np.flatnonzero(seg == k)
      out.append([int(t) for t in tokens[idx]] + ([int(targets[idx[-1]])] if mask[idx[-1]] else []))
  return out


def contains(haystack, needle):
  n = len(needle)
  return any(haystack[i:i + n] == needle for i in range(len(haystack) - n + 1))


def test_train_and_eval_are_disjoint_by_document_id(corpus):
  spec, _ = corpus
  source = sources_lib.make_source(spec)
  train = evaluation.SplitSource(source, 0.2, "train")
  held = evaluation.SplitSource(source, 0.2, "eval")
  ids = evaluation.DocumentIds(source)
  train_ids = {ids(i) for i in range(len(source)) if train[i] is not None}
  eval_ids = {ids(i) for i in range(len(source)) if held[i] is not None}
  assert len({ids(i) for i in range(len(source))}) == DOCS       # ids name documents uniquely
  assert not train_ids & eval_ids and len(train_ids | eval_ids) == DOCS
  assert abs(len(eval_ids) - 0.2 * DOCS) < 5 * math.sqrt(DOCS * 0.2 * 0.8)   # binomial, 5 sigma

  data = evaluation.eval_set(make_cfg(spec))            # eval.sources empty: the training source
  assert data.heldout == {spec: True} and len(data.batches[spec]) == 2
  used = set(data.documents[spec])
  assert used and used <= eval_ids and not used & train_ids
  # Every packed piece comes from one of the held-out documents it names, nothing else.
  tok = tokenizer_lib.load_tokenizer("default")
  with open(source.paths[0]) as f:
    by_id = {ids(i): json.loads(line)["text"] for i, line in enumerate(f)}
  encoded = [tok.encode(by_id[d]) + [tok.eos_id] for d in data.documents[spec]]
  pieces = [p for b in data.batches[spec] for p in pieces_of(b)]
  assert pieces and all(any(contains(e, p) for e in encoded) for p in pieces)
  assert {tuple(b["tokens"].shape) for b in data.batches[spec]} == {(4, 32)}


def test_a_separate_validation_source_is_evaluated_whole(corpus):
  spec, valid = corpus
  data = evaluation.eval_set(make_cfg(spec, (valid,), batches=50))
  assert data.heldout == {valid: False}
  assert len(data.documents[valid]) == 40              # every document, none held back


def test_stdlib_pieces_of_one_file_share_one_id():
  source = sources_lib.PythonStdlibSource()
  ids = evaluation.DocumentIds(source)
  by_file = {}
  for i, (file_index, _, _) in enumerate(source.pieces):
    by_file.setdefault(file_index, set()).add(ids(i))
  assert all(len(v) == 1 for v in by_file.values())
  assert len({next(iter(v)) for v in by_file.values()}) == len(source.paths)


def test_scan_order_visits_every_document_once():
  for n in (1, 2, 7, 100, 1164):
    assert sorted(evaluation.scan_order(n, seed=5)) == list(range(n))


def test_hosts_split_the_rows(corpus):
  spec, _ = corpus
  cfg = make_cfg(spec)
  whole = evaluation.eval_set(cfg)
  halves = [evaluation.eval_set(cfg, process_index=q, process_count=2) for q in (0, 1)]
  for b, h0, h1 in zip(whole.batches[spec], halves[0].batches[spec], halves[1].batches[spec]):
    for key in b:
      np.testing.assert_array_equal(b[key], np.concatenate([h0[key], h1[key]]))


def test_no_heldout_part_is_an_error(corpus):
  spec, _ = corpus
  with pytest.raises(ValueError, match="data.heldout_fraction"):
    evaluation.eval_set(make_cfg(spec, fraction=0.0))


class TinyLM(nnx.Module):
  def __init__(self, vocab, rngs):
    self.embed = nnx.Embed(vocab, 8, rngs=rngs)
    self.out = nnx.Linear(8, vocab, rngs=rngs)

  def __call__(self, tokens, segment_ids=None, token_mask=None, vision=None):
    return self.out(self.embed(tokens))


def test_evaluate_equals_reference_loss(corpus):
  spec, valid = corpus
  data = evaluation.eval_set(make_cfg(spec, (spec, valid), batches=2))
  model = TinyLM(4096, nnx.Rngs(params=jax.random.key(0, impl="rbg")))
  out = evaluation.evaluate(model, data.batches)

  def reference(batches):            # float64 masked cross-entropy summed over the batches
    total = count = 0.0
    for b in batches:
      logits = np.asarray(model(b["tokens"]), np.float64)
      logz = np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1)) + logits.max(-1)
      nll = logz - np.take_along_axis(logits, b["targets"][..., None], -1)[..., 0]
      total += float(np.sum(nll * b["loss_mask"]))
      count += float(np.sum(b["loss_mask"]))
    return total, count

  sums = {name: reference(bs) for name, bs in data.batches.items()}
  for name, (total, count) in sums.items():
    assert out[f"eval/tokens/{name}"] == count
    assert out[f"eval/loss/{name}"] == pytest.approx(total / count, rel=1e-5)   # fp32 forward
  all_total, all_count = map(sum, zip(*sums.values()))
  assert out["eval/loss"] == pytest.approx(all_total / all_count, rel=1e-5)
  # A plain callable gives the same numbers.
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  step = evaluation.make_loss_step(graphdef)
  same = evaluation.evaluate(lambda b: step(params, rest, b), data.batches)
  assert same == pytest.approx(out, rel=1e-6)


def test_fused_head_loss_equals_the_logits_loss(corpus):
  """train.loss_chunk_tokens > 0: the held-out loss through the fused, chunked head (loss only,
  no [B, T, V] logits) equals the logits path on a one-layer k3_tiny (fp32 compute), per source
  and overall, to 1e-6 relative (the two sum the same fp32 terms in another order)."""
  from k3train import config as config_lib
  from k3train.model import decoder
  from tests.configs import one_layer_tiny
  spec, valid = corpus
  cfg = one_layer_tiny(seq_len=32, global_batch_size=4)
  cfg.train.loss_chunk_tokens = 8              # 4 chunks of 8 positions per row
  cfg = config_lib.validate(cfg)
  assert cfg.model.dtype == "float32"
  data = evaluation.eval_set(make_cfg(spec, (spec, valid), seq_len=32, batches=2, rows=4))
  model = decoder.build_model(cfg.model)
  unfused = evaluation.evaluate(model, data.batches)
  fused = evaluation.evaluate(model, data.batches, loss_chunk_tokens=cfg.train.loss_chunk_tokens)
  assert fused.keys() == unfused.keys() and "eval/loss" in fused
  for key, value in unfused.items():
    if key.startswith("eval/tokens"):
      assert fused[key] == value > 0
    else:
      assert fused[key] == pytest.approx(value, rel=1e-6), key
  # The fused program's largest [B, ·, V] value is one chunk's [4, 8, V], not the [4, 32, V] logits.
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  batch = data.batches[spec][0]
  rows = {}
  for chunk in (0, cfg.train.loss_chunk_tokens):
    step = evaluation.make_loss_step(graphdef, loss_chunk_tokens=chunk)
    rows[chunk] = _largest_tokens_by_vocab(jax.make_jaxpr(step)(params, rest, batch).jaxpr,
                                           cfg.model.vocab_size)
  assert rows == {0: 4 * 32, cfg.train.loss_chunk_tokens: 4 * 8}


def _largest_tokens_by_vocab(jaxpr, vocab: int) -> int:
  """The most tokens of any [B, T, V]-like value (rank 3, vocab last) in a program and the
  programs in its equations (jit, scan bodies, …)."""
  import jax.extend.core as jex
  rows = 0
  for eqn in jaxpr.eqns:
    for var in (*eqn.invars, *eqn.outvars):
      shape = getattr(getattr(var, "aval", None), "shape", ())
      if len(shape) == 3 and shape[-1] == vocab:
        rows = max(rows, shape[0] * shape[1])
    for sub in jex.jaxprs_in_params(eqn.params):
      rows = max(rows, _largest_tokens_by_vocab(sub, vocab))
  return rows


# --- training never reads the held-out part ---------------------------------------------------


def _pipeline_cfg(spec, fraction):
  return ml_collections.ConfigDict({
      "sources": (spec,), "weights": (1.0,), "tokenizer": "default", "seq_len": 64,
      "shuffle_seed": 0, "num_workers": 0, "num_threads": 1, "long_doc_weight": 1.0,
      "heldout_fraction": fraction, "vision": None})


def _documents_read(batches, tok):
  """The numbers of the corpus documents whose first piece (it starts "train document <i>:")
  is in the batches."""
  import re
  seen = set()
  for batch in batches:
    for tokens, seg in zip(batch["tokens"], batch["segment_ids"]):
      for k in range(1, int(seg.max()) + 1):
        text = tok.decode([int(t) for t in tokens[seg == k]])
        seen.update(int(m) for m in re.findall(r"train document (\d+):", text))
  return seen


def test_training_batches_never_hold_a_heldout_document(corpus):
  from k3train.data import pipeline
  from k3train.data import split
  spec, _ = corpus
  fraction, n_batches = 0.2, 60
  source = sources_lib.make_source(spec)
  ids = split.DocumentIds(source)
  heldout = {i for i in range(DOCS) if split.is_heldout(ids(i), fraction)}
  assert 0 < len(heldout) < DOCS
  tok = tokenizer_lib.load_tokenizer("default")

  it = pipeline.make_iterator(_pipeline_cfg(spec, fraction), batch_size=8, seed=0)
  batches = [next(it) for _ in range(n_batches)]
  seen = _documents_read(batches, tok)
  # More than an epoch of the training part: every training document, no held-out one, and the
  # held-out documents are not counted as skipped.
  assert seen == set(range(DOCS)) - heldout
  assert all(v == 0 for k, v in it.metrics().items() if k.startswith("errors/"))
  # The same stream without the split reads held-out documents (the check above can fail).
  plain = pipeline.make_iterator(_pipeline_cfg(spec, 0.0), batch_size=8, seed=0)
  assert _documents_read([next(plain) for _ in range(n_batches)], tok) & heldout

  # Stream positions count the held-out documents: a state saved mid-stream restores exactly.
  again = pipeline.make_iterator(_pipeline_cfg(spec, fraction), batch_size=8, seed=0)
  for _ in range(9):
    next(again)
  state = json.loads(json.dumps(again.get_state()))
  resumed = pipeline.make_iterator(_pipeline_cfg(spec, fraction), batch_size=8, seed=0)
  resumed.set_state(state)
  for reference in batches[9:30]:
    got = next(resumed)
    for key in reference:
      np.testing.assert_array_equal(got[key], reference[key], err_msg=key)
  # The fraction defines the split: a state from another fraction is refused.
  other = pipeline.make_iterator(_pipeline_cfg(spec, 0.1), batch_size=8, seed=0)
  with pytest.raises(ValueError, match="heldout_fraction"):
    other.set_state(state)
  # A state saved before the split existed stands for fraction 0.
  older = plain.get_state()
  del older["config"]["heldout_fraction"]
  pipeline.make_iterator(_pipeline_cfg(spec, 0.0), batch_size=8, seed=0).set_state(older)
