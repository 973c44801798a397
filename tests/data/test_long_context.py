"""Long-context data: generated retrieval documents, length-aware sampling, minimal splitting,
idle (weight 0) sources across stage changes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from k3train import config as config_lib
from k3train.data import pipeline, retrieval
from k3train.data import tokenizer as tokenizer_lib


@pytest.fixture(scope="module")
def tok():
  return tokenizer_lib.load_tokenizer("default")


def take(it, n):
  return [next(it) for _ in range(n)]


def data_cfg(sources, weights, seq_len, **extra):
  return {"sources": tuple(sources), "weights": tuple(weights), "tokenizer": "default",
          "seq_len": seq_len, "shuffle_seed": 0, "num_workers": 0, "num_threads": 1, **extra}


def write_docs(path, lengths, tok):
  """JSONL documents whose texts tokenize to about `lengths` tokens; returns their token counts."""
  counts = []
  with open(path, "w") as f:
    for i, n in enumerate(lengths):
      text = f"doc{i:05d} " + " ".join(f"w{(i * 7 + k) % 97}" for k in range(n))
      counts.append(len(tok.encode(text)) + 1)        # + end-of-document token
      f.write(json.dumps({"text": text}) + "\n")
  return counts


# --- generated retrieval documents ---------------------------------------------------------


def test_task_names_agree_with_the_config():
  assert retrieval.TASKS == config_lib.RETRIEVAL_TASKS


@pytest.mark.parametrize("task", retrieval.TASKS)
@pytest.mark.parametrize("length", [96, 300, 2048])
def test_examples_have_the_exact_length_and_a_recoverable_answer(tok, task, length):
  ex = retrieval.generate(tok, task, seed=3, index=11, length=length)
  assert ex.ids.shape == (length,) and ex.ids.dtype == np.int32
  again = retrieval.generate(tok, task, seed=3, index=11, length=length)
  np.testing.assert_array_equal(ex.ids, again.ids)                           # deterministic
  other = retrieval.generate(tok, task, seed=3, index=12, length=length)
  assert not np.array_equal(ex.ids, other.ids)
  text = tok.decode(ex.ids[:ex.answer_start])
  answer = tok.decode(ex.ids[ex.answer_start:ex.answer_end]).split()
  assert answer and ex.answer_end <= length
  if task == "passkey":        # the answer is the key stated earlier in the document
    assert f"The pass key is {answer[0]}." in text
  elif task == "multikey":     # the asked word's number, among the needles
    word = text.rsplit("What is the special magic number for ", 1)[1].split("?")[0]
    assert f"magic numbers for {word} is: {answer[0]}." in text
  else:                        # the names of the chain, in order, starting from the value
    value = text.rsplit("hold the value ", 1)[1].split("?")[0]
    assert f"VAR {answer[0]} = {value}." in text
    for a, b in zip(answer, answer[1:]):
      assert f"VAR {b} = VAR {a}." in text


def test_too_short_documents_are_refused(tok):
  need = retrieval.min_length(tok, "multikey")
  retrieval.generate(tok, "multikey", seed=0, index=0, length=need)
  with pytest.raises(ValueError, match="at least"):
    retrieval.generate(tok, "passkey", seed=0, index=0, length=8)


def test_eval_rows_mark_exactly_the_answer_targets(tok):
  rows = retrieval.eval_rows(tok, "passkey", seed=5, seq_len=160, first=7, rows=3)
  assert rows["tokens"].shape == rows["answer_mask"].shape == (3, 160)
  for r in range(3):
    ex = retrieval.generate(tok, "passkey", seed=5, index=7 + r, length=160)
    marked = rows["targets"][r][rows["answer_mask"][r] > 0]
    np.testing.assert_array_equal(marked, ex.ids[ex.answer_start:ex.answer_end])
    assert rows["targets"][r, -1] == tok.eos_id
    np.testing.assert_array_equal(rows["tokens"][r, 1:], rows["targets"][r, :-1])


def test_retrieval_sources_fit_one_row_and_never_split(tok):
  seq_len = 256
  cfg = data_cfg(["synthetic_passkey", "synthetic_vartrack"], [1.0, 1.0], seq_len)
  it = pipeline.make_iterator(cfg, batch_size=2, seed=0)
  for batch in take(it, 6):
    for row_tokens, seg, pos in zip(batch["tokens"], batch["segment_ids"], batch["positions"]):
      for s in np.unique(seg[seg > 0]):
        assert pos[seg == s][0] == 0        # every document starts in its row: never continued
  src = retrieval.RetrievalSource("passkey", tokenizer=tok, seq_len=seq_len, seed=1, size=50)
  lengths = [len(src[i].ids) for i in range(50)]
  assert min(lengths) >= seq_len // 4 and max(lengths) <= seq_len
  assert len(set(lengths)) > 10


# --- packing and length-aware sampling -------------------------------------------------------


def test_documents_are_split_only_where_they_must_be(tmp_path, tok):
  """A document of L tokens (with its end token) becomes ceil((L - 1) / T) pieces, and one that
  fits a row is packed whole."""
  from k3train.data import documents
  seq_len = 32
  budget = documents.RowBudget(seq_len, 0, 0)
  for n in [2, 3, 32, 33, 34, 64, 65, 66, 100, 1000]:
    doc = documents.Encoded(np.arange(n, dtype=np.int32), [], *documents.empty_vision(),
                            np.zeros((len(documents.vision.REASONS),), np.int64))
    start, k, covered = 0, 0, 0
    while start >= 0:
      end, _, _, nxt = documents.split_piece(doc, start, budget)
      assert end - start + 1 <= seq_len + 1
      covered += end - start            # next-token transitions in this piece
      k, start = k + 1, nxt
    assert k == max(1, -(-(n - 1) // seq_len)), (n, k)
    assert covered == n - 1             # every transition once
  path = str(tmp_path / "docs.jsonl")
  counts = write_docs(path, [3, 10, 25, 5, 12, 18, 2, 7] * 5, tok)
  it = pipeline.make_iterator(data_cfg([f"jsonl:{path}"], [1.0], seq_len), batch_size=2, seed=0)
  whole = 0
  for batch in take(it, 15):
    for row, seg in zip(batch["tokens"], batch["segment_ids"]):
      for s in np.unique(seg[seg > 0]):
        text = tok.decode(row[seg == s])
        if text.startswith("doc") and text[3:8].isdigit():
          n = counts[int(text[3:8])]
          if n <= seq_len + 1:          # fits a row: packed whole (the last token may be the
            assert np.sum(seg == s) in (n, n - 1), (text, n)   # row's final target only)
            whole += 1
  assert whole >= 15


def test_long_doc_weight_raises_the_share_of_long_documents(tmp_path, tok):
  """Short documents (≤ T/2 tokens) kept with probability 1/w: the long share of the tokens moves
  from L / (L + S) to L / (L + S / w) (L, S: tokens of long and short documents in the corpus);
  measured over 2 epochs, within 0.06."""
  seq_len = 128
  path = str(tmp_path / "mixed.jsonl")
  rng = np.random.default_rng(0)
  counts = np.asarray(write_docs(path, [int(x) for x in rng.choice([2, 5, 9, 40, 70], size=300, p=[0.3, 0.3, 0.3, 0.05, 0.05])], tok))
  long = counts[2 * counts > seq_len].sum()
  short = counts[2 * counts <= seq_len].sum()
  for weight in (1.0, 4.0):
    cfg = data_cfg([f"jsonl:{path}"], [1.0], seq_len, long_doc_weight=weight)
    it = pipeline.make_iterator(cfg, batch_size=4, seed=0)
    expected = long / (long + short / weight)
    batches = int(2 * (long + short / weight) / (4 * (seq_len + 1)))
    got, tokens = 0.0, 0
    for _ in range(batches):
      batch = next(it)
      n = int(np.sum(batch["segment_ids"] > 0))
      got, tokens = got + it.long_doc_share * n, tokens + n
    assert it.metrics()["long_doc_share"] == it.long_doc_share
    assert abs(got / tokens - expected) < 0.06, (weight, got / tokens, expected)
  assert long / (long + short / 4.0) > long / (long + short) + 0.15     # the test can tell them apart


def test_length_sampling_resumes_exactly(tmp_path, tok):
  path = str(tmp_path / "mixed.jsonl")
  write_docs(path, [4, 8, 70, 6, 100, 9, 5, 80] * 30, tok)
  cfg = data_cfg([f"jsonl:{path}"], [1.0], 48, long_doc_weight=3.0)
  reference = take(pipeline.make_iterator(cfg, batch_size=2, seed=0), 12)
  it = pipeline.make_iterator(cfg, batch_size=2, seed=0)
  take(it, 5)
  state = json.loads(json.dumps(it.get_state()))
  fresh = pipeline.make_iterator(cfg, batch_size=2, seed=0)
  fresh.set_state(state)
  for a, b in zip(take(fresh, 7), reference[5:]):
    for k in a:
      np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_idle_source_keeps_its_position_across_stages(tmp_path, tok):
  """Source B sits stage 2 out (weight 0) and continues in stage 3 where stage 1 left it."""
  a, b = str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")
  write_docs(a, [12] * 300, tok)
  with open(b, "w") as f:
    for i in range(300):
      f.write(json.dumps({"text": f"other{i:04d} " + "zz " * 10}) + "\n")
  specs = [f"jsonl:{a}", f"jsonl:{b}"]
  stage1 = pipeline.make_iterator(data_cfg(specs, [1.0, 1.0], 64), batch_size=2, seed=0)
  take(stage1, 4)
  s1 = json.loads(json.dumps(stage1.get_state()))
  b_pos = pipeline.reader_states(s1)[specs[1]]
  stage2 = pipeline.make_iterator(data_cfg(specs, [1.0, 0.0], 32), batch_size=2, seed=0)
  stage2.set_state(s1)
  batches = take(stage2, 5)
  assert not any("other" in tok.decode(r) for bb in batches for r in bb["tokens"])
  s2 = json.loads(json.dumps(stage2.get_state()))
  assert pipeline.reader_states(s2)[specs[1]] == b_pos                        # carried, untouched
  # Exact continuation of stage 2 itself (same weights) keeps the idle state too.
  again = pipeline.make_iterator(data_cfg(specs, [1.0, 0.0], 32), batch_size=2, seed=0)
  again.set_state(s2)
  assert pipeline.reader_states(again.get_state())[specs[1]] == b_pos
  stage3 = pipeline.make_iterator(data_cfg(specs, [0.0, 1.0], 32), batch_size=2, seed=0)
  stage3.set_state(s2)
  first_b = lambda batches: next(int(t[:4]) for bb in batches for r in bb["tokens"]
                                 for t in tok.decode(r).split("other")[1:] if t[:4].isdigit())
  # Stage 1 continued without a change reads the same next document of B as stage 3 does.
  uninterrupted = pipeline.make_iterator(data_cfg(specs, [1.0, 1.0], 64), batch_size=2, seed=0)
  uninterrupted.set_state(s1)
  assert first_b(take(stage3, 2)) == first_b(take(uninterrupted, 4))


def test_zero_weights_need_one_positive_source():
  with pytest.raises(ValueError, match="at least one"):
    pipeline.make_iterator(data_cfg(["python_stdlib"], [0.0], 32), batch_size=1, seed=0)
  with pytest.raises(ValueError, match="long_doc_weight"):
    pipeline.make_iterator(data_cfg(["python_stdlib"], [1.0], 32, long_doc_weight=0.5), batch_size=1,
                           seed=0)
