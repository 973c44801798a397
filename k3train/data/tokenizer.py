"""The byte-level BPE tokenizer: a thin wrapper over HF `tokenizers`, plus its trainer and CLI.

Byte-level BPE encodes any Unicode string losslessly (every byte has a token), so the
shipped 4096-entry vocabulary round-trips arbitrary text. The repo ships
`assets/tokenizer.json`, trained by `train_default_tokenizer` on the Python stdlib corpus
(see `k3train/data/sources.py`); retrain it with

  python -m k3train.data.tokenizer --train --out k3train/data/assets/tokenizer.json

A tiktoken-format BPE file (Kimi's format) loads through `TiktokenTokenizer`, whose byte-pair
merge is our own (tiktoken_bpe.py). Special tokens hold the first ids, so <|pad|> is id 0. Text is always encoded literally:
a special token's spelling inside a document is tokenized as ordinary text, never as the
special id, so data cannot inject control tokens. The pipeline adds BOS/EOS ids itself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Iterable, Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
IMAGE_START, IMAGE_END, IMAGE_PAD = "<|image_start|>", "<|image_end|>", "<|image_pad|>"
VIDEO_START, VIDEO_END = "<|video_start|>", "<|video_end|>"
# Order fixes the ids: <|pad|> = 0, <|bos|> = 1, <|eos|> = 2, then the multimodal markers.
SPECIAL_TOKENS = (PAD, BOS, EOS, IMAGE_START, IMAGE_END, IMAGE_PAD, VIDEO_START, VIDEO_END)

DEFAULT_VOCAB_SIZE = 4096
DEFAULT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "tokenizer.json")
# Bound on the training text; the stdlib corpus (~12 MB without test suites) fits, so the
# bound only matters on unusual installations. Keeps training well under a minute.
DEFAULT_TRAIN_BYTES = 16 * 1024 * 1024


class Tokenizer:
  """A byte-level BPE tokenizer with fixed special ids.

  Attributes: `vocab_size` (including special tokens), `pad_id` (always 0), `bos_id`,
  `eos_id`, and `special_ids` mapping every special token string to its id.
  """

  def __init__(self, hf_tokenizer: tokenizers.Tokenizer, *, source: str = "<memory>"):
    self._tok = hf_tokenizer
    self._tok.encode_special_tokens = True  # Encode text literally (see module docstring).
    self.source = source
    self.vocab_size = hf_tokenizer.get_vocab_size(with_added_tokens=True)
    missing = [t for t in SPECIAL_TOKENS if hf_tokenizer.token_to_id(t) is None]
    if missing:
      raise ValueError(f"tokenizer {source} lacks special token(s) {missing}; "
                       f"expected all of {list(SPECIAL_TOKENS)}")
    self.special_ids = {t: hf_tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    self.pad_id = self.special_ids[PAD]
    self.bos_id = self.special_ids[BOS]
    self.eos_id = self.special_ids[EOS]
    if self.pad_id != 0:
      raise ValueError(f"tokenizer {source} has {PAD} at id {self.pad_id}; it must be id 0")

  def encode(self, text: str) -> list[int]:
    """Token ids of `text`, without BOS/EOS."""
    if not isinstance(text, str):
      raise TypeError(f"encode expects a str, got {type(text).__name__}")
    return self._tok.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text (runs in parallel inside `tokenizers`)."""
    return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

  def decode(self, ids: Iterable[int]) -> str:
    """The text of `ids`; special tokens are rendered as their spelling."""
    ids = [int(i) for i in ids]
    bad = [i for i in ids if not 0 <= i < self.vocab_size]
    if bad:
      raise ValueError(f"token id(s) {bad[:5]} out of range [0, {self.vocab_size})")
    return self._tok.decode(ids, skip_special_tokens=False)

  def id_to_token(self, token_id: int) -> str | None:
    return self._tok.id_to_token(int(token_id))

  def __getstate__(self):
    # Rebuild from JSON on unpickling (grain worker processes) so that settings that are not
    # part of the JSON, such as literal encoding of special tokens, survive.
    return {"json": self._tok.to_str(), "source": self.source}

  def __setstate__(self, state):
    self.__init__(tokenizers.Tokenizer.from_str(state["json"]), source=state["source"])

  def __repr__(self) -> str:
    return f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size})"


class TiktokenTokenizer:
  """A tiktoken-format BPE file (see tiktoken_bpe.py) with the same interface as `Tokenizer`.

  Special tokens take the ids after the largest rank, in SPECIAL_TOKENS order, so `pad_id` is
  not 0 here (padding is masked by segment id 0 anyway).
  """

  def __init__(self, path: str, *, pattern: str | None = None):
    from k3train.data import tiktoken_bpe
    ranks = tiktoken_bpe.load_ranks(path)
    kw = {} if pattern is None else {"pattern": pattern}
    self._bpe = tiktoken_bpe.TiktokenBPE(ranks, SPECIAL_TOKENS, source=path, **kw)
    self.source = path
    self.vocab_size = self._bpe.vocab_size
    self.special_ids = dict(self._bpe.special_ids)
    self.pad_id, self.bos_id, self.eos_id = (self.special_ids[t] for t in (PAD, BOS, EOS))

  def encode(self, text: str) -> list[int]:
    if not isinstance(text, str):
      raise TypeError(f"encode expects a str, got {type(text).__name__}")
    return self._bpe.encode(text)

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [self.encode(t) for t in texts]

  def decode(self, ids: Iterable[int]) -> str:
    ids = [int(i) for i in ids]
    bad = [i for i in ids if not 0 <= i < self.vocab_size]
    if bad:
      raise ValueError(f"token id(s) {bad[:5]} out of range [0, {self.vocab_size})")
    return self._bpe.decode(ids)

  def __repr__(self) -> str:
    return f"TiktokenTokenizer(source={self.source!r}, vocab_size={self.vocab_size})"


def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's reversible byte → printable character map used by byte-level BPE vocabularies."""
  keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
  out, extra = {}, 0
  for b in range(256):
    if b in keep:
      out[b] = chr(b)
    else:
      out[b] = chr(256 + extra)
      extra += 1
  return out


def export_tiktoken(tok: Tokenizer, path: str) -> None:
  """Writes the BPE part of a byte-level `tokenizers` tokenizer as a tiktoken file.

  Ranks are the token ids (for a trained BPE, merge order = id order), specials left out.
  """
  from k3train.data import tiktoken_bpe
  char_to_byte = {c: b for b, c in _bytes_to_unicode().items()}
  ranks = {}
  for token, i in tok._tok.get_vocab(with_added_tokens=False).items():
    if token in SPECIAL_TOKENS:
      continue
    ranks[bytes(char_to_byte[c] for c in token)] = i
  tiktoken_bpe.write_ranks(ranks, path)


def load_tokenizer(name_or_path: str = "default"):
  """Loads `"default"` (the shipped tokenizer), a `tokenizers` JSON file, or a tiktoken BPE file
  (`<base64> <rank>` lines, as Kimi models ship; also chosen by a `tiktoken:` prefix)."""
  if isinstance(name_or_path, str) and name_or_path.startswith("tiktoken:"):
    path = name_or_path[len("tiktoken:"):]
    if not os.path.isfile(path):
      raise ValueError(f"tiktoken file {path!r} does not exist")
    return TiktokenTokenizer(path)
  if isinstance(name_or_path, str) and os.path.isfile(name_or_path):
    with open(name_or_path, "rb") as f:
      head = f.read(64).lstrip()
    if not head.startswith(b"{"):
      return TiktokenTokenizer(name_or_path)
  if name_or_path == "default":
    path = DEFAULT_PATH
    if not os.path.isfile(path):
      raise FileNotFoundError(
          f"the shipped default tokenizer {path} is missing; recreate it with "
          f"`python -m k3train.data.tokenizer --train --out {path}`")
  elif isinstance(name_or_path, str) and os.path.isfile(name_or_path):
    path = name_or_path
  else:
    raise ValueError(f"unknown tokenizer {name_or_path!r}; allowed values: 'default' or the "
                     "path of an existing tokenizers JSON file")
  try:
    hf = tokenizers.Tokenizer.from_file(path)
  except Exception as e:  # tokenizers raises a bare Exception on malformed JSON.
    raise ValueError(f"could not load tokenizer JSON {path}: {e}") from e
  return Tokenizer(hf, source=path)


def build_untrained(vocab_size: int = DEFAULT_VOCAB_SIZE) -> tuple[tokenizers.Tokenizer,
                                                                    trainers.BpeTrainer]:
  """An empty byte-level BPE tokenizer and the trainer that fills it to `vocab_size`."""
  min_size = len(SPECIAL_TOKENS) + 256
  if vocab_size <= min_size:
    raise ValueError(f"vocab_size must exceed {min_size} (special tokens + 256 bytes), "
                     f"got {vocab_size}")
  tok = tokenizers.Tokenizer(models.BPE())
  # No normalizer: the text is kept byte-exact. The GPT-2 regex split keeps runs of
  # indentation together, which suits code.
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size,
      min_frequency=2,
      special_tokens=list(SPECIAL_TOKENS),
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False,
  )
  return tok, trainer


def train_tokenizer(texts: Sequence[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
  """Trains a byte-level BPE on `texts` (deterministic for a fixed list of texts)."""
  if not texts:
    raise ValueError("cannot train a tokenizer on an empty corpus")
  tok, trainer = build_untrained(vocab_size)
  tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
  got = tok.get_vocab_size(with_added_tokens=True)
  if got != vocab_size:
    raise ValueError(f"training reached a vocabulary of {got} < {vocab_size}; the corpus is too "
                     "small for this vocab_size")
  return Tokenizer(tok)


def train_default_tokenizer(out_path: str = DEFAULT_PATH, vocab_size: int = DEFAULT_VOCAB_SIZE,
                            *, max_train_bytes: int = DEFAULT_TRAIN_BYTES) -> Tokenizer:
  """Trains the default tokenizer on the stdlib corpus and writes its JSON to `out_path`."""
  from k3train.data import sources  # Local import: loading a tokenizer needs no corpus.
  docs = sources.python_stdlib_documents(max_total_bytes=max_train_bytes)
  tok = train_tokenizer(docs, vocab_size)
  out_dir = os.path.dirname(os.path.abspath(out_path))
  os.makedirs(out_dir, exist_ok=True)
  # Compact JSON keeps the shipped asset small; sorted dump is the library's own format.
  data = json.loads(tok._tok.to_str())
  tmp = out_path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(data, f, ensure_ascii=False, separators=(",", ":"))
  os.replace(tmp, out_path)
  return load_tokenizer(out_path)


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m k3train.data.tokenizer",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--train", action="store_true",
                      help="train the default tokenizer on the Python stdlib corpus")
  parser.add_argument("--out", default=DEFAULT_PATH, help="output JSON path (with --train)")
  parser.add_argument("--vocab_size", type=int, default=DEFAULT_VOCAB_SIZE)
  parser.add_argument("--encode", metavar="TEXT", help="print the ids of TEXT")
  args = parser.parse_args(argv)
  if args.train:
    start = time.time()
    tok = train_default_tokenizer(args.out, args.vocab_size)
    print(f"wrote {args.out}: vocab_size={tok.vocab_size}, "
          f"{os.path.getsize(args.out) / 1024:.0f} KiB, {time.time() - start:.1f}s")
  if args.encode is not None:
    tok = load_tokenizer(args.out if args.train else "default")
    print(tok.encode(args.encode))
  if not args.train and args.encode is None:
    parser.print_help()
  return 0


if __name__ == "__main__":
  sys.exit(main())
