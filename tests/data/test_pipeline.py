"""Tests for the default tokenizer, the stdlib corpus source and the packed text pipeline."""

from __future__ import annotations

import json
import logging
import os
import pickle
import time

import ml_collections
import numpy as np
import pytest

from k3train.data import documents, pipeline, sources
from k3train.data import tokenizer as tokenizer_lib


def make_encoder(seq_len=128):
  return documents.DocumentEncoder(tokenizer_lib.load_tokenizer(), None,
                                   documents.RowBudget(seq_len, 0, 0))

SEQ_LEN = 128
BATCH = 4


def data_cfg(**overrides):
  from tests.configs import k3_tiny
  cfg = k3_tiny.get_config().data
  cfg.seq_len = SEQ_LEN
  cfg.update(overrides)
  return cfg


def take(it, n):
  return [next(it) for _ in range(n)]


def assert_batches_equal(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k], err_msg=k)


@pytest.fixture(scope="module")
def tok():
  return tokenizer_lib.load_tokenizer("default")


# --- tokenizer ---------------------------------------------------------------------------


def test_default_tokenizer_vocab_and_special_ids(tok):
  assert tok.vocab_size == 4096
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
  assert list(tok.special_ids) == list(tokenizer_lib.SPECIAL_TOKENS)
  assert sorted(tok.special_ids.values()) == list(range(len(tokenizer_lib.SPECIAL_TOKENS)))
  assert tok.decode([tok.bos_id, tok.eos_id]) == "<|bos|><|eos|>"
  assert os.path.getsize(tokenizer_lib.DEFAULT_PATH) < 1024 * 1024


@pytest.mark.parametrize("text", [
    "",
    "hello world",
    "déjà vu — naïve café; Ελληνικά; русский; 日本語のテキスト; "
    "한국어; עברית; العربية",
    "emoji 🚀👩‍👩‍👧‍👦🏳️‍🌈, combining e\u0301, "
    "zero-width \u200b\u200d, BOM \ufeff",
    "control \x00\x01\x7f chars,\ttabs,\r\nCRLF,\n\n\n  trailing spaces   ",
    "def f(x: int) -> int:\n    \"\"\"Doc.\"\"\"\n    return {'a': [x ** 2 for _ in range(3)]}\n",
])
def test_tokenizer_round_trip(tok, text):
  ids = tok.encode(text)
  assert all(0 <= i < tok.vocab_size for i in ids)
  assert tok.decode(ids) == text


def test_tokenizer_round_trip_long_code(tok):
  text = sources.read_text_file(os.path.join(sources.stdlib_root(), "inspect.py"), None)
  text = (text * 3)[:300_000]
  ids = tok.encode(text)
  assert tok.decode(ids) == text
  assert len(ids) < len(text.encode("utf-8")) / 2.5  # The BPE actually compresses code.


def test_special_token_spellings_are_encoded_literally(tok):
  text = "a <|eos|> b <|pad|><|image_start|>"
  ids = tok.encode(text)
  assert not set(ids) & set(tok.special_ids.values())
  assert tok.decode(ids) == text
  restored = pickle.loads(pickle.dumps(tok))  # As in grain worker processes.
  assert restored.encode(text) == ids


def test_tokenizer_bad_input(tok):
  with pytest.raises(ValueError, match="out of range"):
    tok.decode([tok.vocab_size])
  with pytest.raises(TypeError):
    tok.encode(b"bytes")
  with pytest.raises(ValueError, match="'default'"):
    tokenizer_lib.load_tokenizer("no_such_tokenizer")


def test_train_tokenizer_is_deterministic(tmp_path):
  docs = sources.python_stdlib_documents(max_total_bytes=300_000)
  a = tokenizer_lib.train_tokenizer(docs, vocab_size=512)
  b = tokenizer_lib.train_tokenizer(docs, vocab_size=512)
  assert a.vocab_size == 512 and a.pad_id == 0
  assert a._tok.to_str() == b._tok.to_str()
  with pytest.raises(ValueError, match="vocab_size"):
    tokenizer_lib.train_tokenizer(docs, vocab_size=100)


# --- sources -----------------------------------------------------------------------------


def test_stdlib_source_lists_sorted_library_files():
  src = sources.PythonStdlibSource()
  rel = [os.path.relpath(p, src.root).replace(os.sep, "/") for p in src.paths]
  assert rel == sorted(rel) and len(rel) > 100
  assert "os.py" in rel
  assert not any(set(r.split("/")[:-1]) & sources.EXCLUDED_DIRS for r in rel)
  first_piece = next(i for i, (f, p, _) in enumerate(src.pieces) if f == rel.index("os.py") and p == 0)
  assert "import" in src[first_piece]


def test_pieces_split_a_file_at_lines_and_cover_it_exactly(tmp_path):
  text = "".join(f"line {i} ü {'x' * (i % 37)}\n" for i in range(2000))
  (tmp_path / "a.py").write_text(text, encoding="utf-8")
  (tmp_path / "b.py").write_text("short = 1\n", encoding="utf-8")
  src = sources.PythonStdlibSource(root=str(tmp_path), piece_bytes=1000)
  pieces_a = [src[i] for i, (f, _, _) in enumerate(src.pieces) if f == 0]
  assert len(pieces_a) == -(-len(text.encode()) // 1000) > 10
  assert "".join(p for p in pieces_a if p) == text
  assert all(p.endswith("\n") for p in pieces_a if p)
  assert src[len(src) - 1] == "short = 1\n"


def test_bad_files_are_skipped_with_counted_warning(tmp_path, caplog):
  (tmp_path / "a.py").write_text("x = 1\n" * 10, encoding="utf-8")
  (tmp_path / "b.py").write_bytes(b"s = '\xff\xfe latin-1 \xe9'\n")
  (tmp_path / "c.py").write_text("", encoding="utf-8")
  (tmp_path / "d.py").mkdir()  # A directory named *.py: unreadable as a file.
  (tmp_path / "test").mkdir()
  (tmp_path / "test" / "e.py").write_text("excluded = True\n", encoding="utf-8")
  with caplog.at_level(logging.WARNING):
    docs = sources.python_stdlib_documents(root=str(tmp_path))
  assert docs == ["x = 1\n" * 10]
  assert "skipped 1 of" in caplog.text  # b.py; d.py is not a file so it is never listed.
  src = sources.PythonStdlibSource(root=str(tmp_path))
  assert [os.path.basename(p) for p in src.paths] == ["a.py", "b.py", "c.py"]
  assert len(src) == 3   # small files are one piece each
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    assert src[1] is None and src[1] is None
  assert src.num_skipped == 1 and caplog.text.count("skipping corpus file") == 1
  assert len(make_encoder().map(src[1]).tokens) == 0


def test_max_bytes_per_file_cuts_at_a_newline(tmp_path):
  (tmp_path / "a.py").write_text("line ü\n" * 100, encoding="utf-8")
  text = sources.PythonStdlibSource(root=str(tmp_path), max_bytes_per_file=50)[0]
  assert text == "line ü\n" * 6  # 8 bytes per line.


def test_unknown_source_and_tokenizer_names():
  with pytest.raises(ValueError, match="python_stdlib"):
    pipeline.make_text_iterator(data_cfg(sources=("c4",)), batch_size=BATCH, seed=0)
  with pytest.raises(ValueError, match="'default'"):
    pipeline.make_text_iterator(data_cfg(tokenizer="gpt9"), batch_size=BATCH, seed=0)
  with pytest.raises(ValueError, match="seq_len"):
    pipeline.make_text_iterator(data_cfg(seq_len=1), batch_size=BATCH, seed=0)
  with pytest.raises(ValueError, match="process_index"):
    pipeline.make_text_iterator(data_cfg(), batch_size=BATCH, seed=0, process_index=2,
                                process_count=2)


# --- packed batches ----------------------------------------------------------------------


def check_batch(batch, eos_id, batch_size=BATCH, seq_len=SEQ_LEN):
  """Asserts every documented invariant of one batch."""
  assert set(batch) == set(pipeline.BATCH_KEYS)
  for k in pipeline.BATCH_KEYS:
    assert batch[k].shape == (batch_size, seq_len), k
    assert batch[k].dtype == (np.float32 if k == "loss_mask" else np.int32), k
  tokens, targets = batch["tokens"], batch["targets"]
  seg, pos, mask = batch["segment_ids"], batch["positions"], batch["loss_mask"]
  # The targets are the inputs shifted by one.
  np.testing.assert_array_equal(targets[:, :-1], tokens[:, 1:])
  for b in range(batch_size):
    s, p, m = seg[b], pos[b], mask[b]
    real = s != 0
    assert s[0] == 1 or not real.any()
    assert np.all(np.diff(s[real]) >= 0) and np.all(np.diff(s[real]) <= 1)
    new = np.concatenate([[True], s[1:] != s[:-1]])
    assert np.all(p[new & real] == 0)                           # Restart at each segment.
    assert np.all(p[1:][~new[1:] & real[1:]] == p[:-1][~new[1:] & real[1:]] + 1)
    assert np.all(m[~real] == 0)                                # No loss on padding.
    ends = np.nonzero(real[:-1] & (s[1:] != s[:-1]))[0]          # Last token of a segment.
    assert np.all(m[ends] == 0)
    followed = ends[real[ends + 1]]                               # ... followed by another.
    assert np.all(tokens[b, followed] == eos_id)                # Documents end in EOS.
    # Inside a document the mask is on; EOS is predicted but never an input with loss.
    inside = real[:-1] & (s[1:] == s[:-1])
    assert np.all(m[:-1][inside] == 1)
    assert np.all(m[tokens[b] == eos_id] == 0)


def test_batches_have_documented_format(tok):
  it = pipeline.make_text_iterator(data_cfg(), batch_size=BATCH, seed=0)
  batches = take(it, 30)
  for batch in batches:
    check_batch(batch, tok.eos_id)
  seg = np.stack([b["segment_ids"] for b in batches])
  assert seg.max() >= 2  # Some rows hold several documents.
  pad = np.mean([pipeline.padding_fraction(b) for b in batches])
  assert 0.0 <= pad < 0.05, pad   # First-fit packing of row-sized pieces: little padding.
  for b in batches:  # Padding only at the tail of a row.
    for row in b["segment_ids"]:
      real = np.nonzero(row)[0]
      assert real.size == 0 or np.all(row[:real[-1] + 1] != 0)
  # Decoded rows are real library text.
  text = tok.decode(batches[0]["tokens"][0])
  assert any(w in text for w in ("def ", "import ", "class ", "return", "self", " = "))


def test_shift_packed_on_padded_rows():
  packed = {  # Two documents (the second cut off by the row end) then padding.
      "tokens": np.array([[5, 6, 2, 7, 8, 9, 0, 0, 0]]),
      "tokens_segment_ids": np.array([[1, 1, 1, 2, 2, 2, 0, 0, 0]]),
      "tokens_positions": np.array([[0, 1, 2, 0, 1, 2, 0, 0, 0]]),
  }
  out = pipeline.shift_packed(packed)
  np.testing.assert_array_equal(out["tokens"], [[5, 6, 2, 7, 8, 9, 0, 0]])
  np.testing.assert_array_equal(out["targets"], [[6, 2, 7, 8, 9, 0, 0, 0]])
  np.testing.assert_array_equal(out["loss_mask"], [[1, 1, 0, 1, 1, 0, 0, 0]])
  np.testing.assert_array_equal(out["segment_ids"], [[1, 1, 1, 2, 2, 2, 0, 0]])
  assert out["loss_mask"].dtype == np.float32
  check_batch(out, eos_id=2, batch_size=1, seq_len=8)
  assert pipeline.padding_fraction(out) == pytest.approx(2 / 8)
  with pytest.raises(ValueError, match="shape"):
    pipeline.shift_packed({**packed, "tokens_positions": np.zeros((1, 4))})


def test_first_batch_is_fast():
  start = time.perf_counter()
  it = pipeline.make_text_iterator(data_cfg(), batch_size=8, seed=0)
  next(it)
  # Whole-corpus tokenization up front would take ~10 s; per-document lazy maps ~0.1 s.
  assert time.perf_counter() - start < 5.0


# --- determinism, resume, sharding -------------------------------------------------------


def test_same_seed_same_batches_other_seed_differs():
  a = take(pipeline.make_text_iterator(data_cfg(), batch_size=BATCH, seed=3), 12)
  b = take(pipeline.make_text_iterator(data_cfg(), batch_size=BATCH, seed=3), 12)
  assert_batches_equal(a, b)
  c = take(pipeline.make_text_iterator(data_cfg(), batch_size=BATCH, seed=4), 1)
  d = take(pipeline.make_text_iterator(data_cfg(shuffle_seed=1), batch_size=BATCH, seed=3), 1)
  assert not np.array_equal(a[0]["tokens"], c[0]["tokens"])
  assert not np.array_equal(a[0]["tokens"], d[0]["tokens"])


@pytest.mark.parametrize("n", [0, 1, 7, 40])
def test_exact_resume_through_json(n):
  m = 10
  reference = take(pipeline.make_text_iterator(data_cfg(), batch_size=BATCH, seed=1), n + m)
  it = pipeline.make_text_iterator(data_cfg(), batch_size=BATCH, seed=1)
  take(it, n)
  state = it.get_state()
  saved = json.dumps(state)  # Plain JSON, as stored in the checkpoint.
  assert pipeline.state_from_json(pipeline.state_to_json(state)) == json.loads(saved)
  take(it, 3)  # Advancing the old iterator must not affect the saved state.
  fresh = pipeline.make_text_iterator(data_cfg(), batch_size=BATCH, seed=1)
  fresh.set_state(json.loads(saved))
  assert_batches_equal(take(fresh, m), reference[n:])


def test_set_state_rejects_other_pipelines_and_garbage():
  it = pipeline.make_text_iterator(data_cfg(), batch_size=BATCH, seed=1)
  state = it.get_state()
  other = pipeline.make_text_iterator(data_cfg(shuffle_seed=5), batch_size=BATCH, seed=1)
  with pytest.raises(ValueError, match="shuffle_seed"):
    other.set_state(state)
  two_hosts = pipeline.make_text_iterator(data_cfg(), batch_size=BATCH, seed=1, process_index=1,
                                          process_count=2)
  with pytest.raises(ValueError, match="all hosts"):
    two_hosts.set_state(state)
  with pytest.raises(ValueError, match="get_state"):
    it.set_state({"next_index": 3})


def test_hosts_read_disjoint_shards(tok):
  hosts = [take(pipeline.make_text_iterator(data_cfg(), batch_size=BATCH, seed=0,
                                            process_index=p, process_count=2), 5)
           for p in range(2)]
  for batch in hosts[0] + hosts[1]:
    check_batch(batch, tok.eos_id)
  rows = [{r.tobytes() for b in h for r in b["tokens"]} for h in hosts]
  assert rows[0].isdisjoint(rows[1])


@pytest.mark.slow
def test_multiprocess_workers_are_deterministic_and_resumable():
  cfg = data_cfg(num_workers=2)
  it = pipeline.make_text_iterator(cfg, batch_size=BATCH, seed=0)
  try:
    reference = take(it, 6)
    state = json.loads(json.dumps(it.get_state()))
    reference += take(it, 4)
  finally:
    it.close()
  fresh = pipeline.make_text_iterator(cfg, batch_size=BATCH, seed=0)
  try:
    fresh.set_state(state)
    assert_batches_equal(take(fresh, 4), reference[6:])
  finally:
    fresh.close()
