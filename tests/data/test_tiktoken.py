"""The tiktoken-format BPE loader and our byte-pair merge, checked against the `tokenizers` BPE."""

from __future__ import annotations

import os

import pytest

from k3train.data import sources, tiktoken_bpe
from k3train.data import tokenizer as tokenizer_lib

TEXTS = [
    "",
    "hello world",
    "déjà vu — naïve café; Ελληνικά; русский; 日本語のテキスト; 한국어; עברית; العربية",
    "emoji 🚀👩‍👩‍👧‍👦🏳️‍🌈, combining e\u0301, zero-width \u200b\u200d, BOM \ufeff, x² ½",
    "control \x00\x01\x7f chars,\ttabs,\r\nCRLF,\n\n\n  trailing spaces   ",
    "def f(x: int) -> int:\n    \"\"\"Doc.\"\"\"\n    return {'a': [x ** 2 for _ in range(3)]}\n",
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
  hf = tokenizer_lib.load_tokenizer()
  path = str(tmp_path_factory.mktemp("tk") / "default.tiktoken")
  tokenizer_lib.export_tiktoken(hf, path)
  return hf, path


def test_ids_match_the_tokenizers_bpe_with_its_split(pair):
  hf, path = pair
  tk = tokenizer_lib.TiktokenTokenizer(path, pattern=tiktoken_bpe.GPT2_PATTERN)
  code = sources.read_text_file(os.path.join(sources.stdlib_root(), "inspect.py"), None)[:60_000]
  for text in TEXTS + [code]:
    assert tk.encode(text) == hf.encode(text)     # two independent BPE implementations agree
    assert tk.decode(tk.encode(text)) == text


def test_default_split_round_trips_long_and_unicode(pair):
  _, path = pair
  tk = tokenizer_lib.load_tokenizer(path)            # sniffed as tiktoken (not JSON)
  assert isinstance(tk, tokenizer_lib.TiktokenTokenizer)
  long = "".join(TEXTS) * 200
  for text in TEXTS + [long]:
    ids = tk.encode(text)
    assert all(0 <= i < tk.vocab_size for i in ids)
    assert tk.decode(ids) == text
  assert len(tk.encode(long)) < 0.8 * len(long.encode("utf-8"))  # merges happen
  # Special tokens sit after the ranks, in SPECIAL_TOKENS order; their spellings are plain text.
  first = max(tk._bpe.ranks.values()) + 1
  assert [tk.special_ids[t] for t in tokenizer_lib.SPECIAL_TOKENS] == list(range(first, first + 8))
  assert not set(tk.encode("<|eos|><|image_pad|>")) & set(tk.special_ids.values())
  assert tk.decode([tk.bos_id, tk.eos_id]) == "<|bos|><|eos|>"


def test_bpe_merge_follows_ranks():
  ranks = {bytes([b]): b for b in range(256)}
  ranks.update({b"ab": 256, b"bc": 257, b"cd": 259})
  assert tiktoken_bpe.bpe_merge(b"abcd", ranks) == [256, 259]             # ab, then cd
  ranks.update({b"ab": 257, b"bc": 256})
  assert tiktoken_bpe.bpe_merge(b"abcd", ranks) == [ord("a"), 256, ord("d")]  # bc wins
  ranks[b"abcd"] = 300
  assert tiktoken_bpe.bpe_merge(b"abcd", ranks) == [300]                  # whole-piece hit


def test_bad_tiktoken_files(tmp_path):
  bad = tmp_path / "bad.tiktoken"
  bad.write_text("not-base64!! 3\n")
  with pytest.raises(ValueError, match="bad.tiktoken:1"):
    tiktoken_bpe.load_ranks(str(bad))
  short = tmp_path / "short.tiktoken"
  tiktoken_bpe.write_ranks({b"a": 0, b"b": 1}, str(short))
  with pytest.raises(ValueError, match="256 single bytes"):
    tiktoken_bpe.load_ranks(str(short))
