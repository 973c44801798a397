"""A tiktoken-format byte-level BPE (the format Kimi models ship), with our own merge loop.

File format: one token per line, `<base64 of the token's bytes> <rank>`; ranks are the token
ids and the merge priorities (lower merges first). Special tokens are not in the file: they get
the ids after the largest rank, in `tokenizer.SPECIAL_TOKENS` order (or the ids given).

Encoding: text is split into pre-tokens by a regex, each pre-token's UTF-8 bytes start as single
bytes, and the adjacent pair whose concatenation has the lowest rank is merged until no pair is
in the vocabulary (tiktoken's rule). Python's `re` has no \\p{L} classes, so the default split
pattern approximates cl100k's with Unicode-aware \\w classes; pass the exact pattern of a
model (and install `regex`) for bit-exact ids. Any split is lossless: decoding concatenates
the tokens' bytes.
"""

from __future__ import annotations

import base64
import functools
import re
from typing import Iterable, Mapping, Sequence

# cl100k-style split: contractions, letter runs (with one leading non-letter), 1–3 digits,
# punctuation runs, newlines, other whitespace.
DEFAULT_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|(?:[^\r\n\w]|_)?[^\W\d_]+|\d{1,3}|"""
                   r""" ?(?:[^\s\w]|_)+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

# GPT-2's split (used by byte-level `tokenizers` models such as the shipped default), in `re`.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+"""


def load_ranks(path: str) -> dict[bytes, int]:
  """Reads a tiktoken BPE file; raises ValueError naming the bad line."""
  ranks: dict[bytes, int] = {}
  with open(path, "rb") as f:
    for n, line in enumerate(f, 1):
      line = line.strip()
      if not line:
        continue
      try:
        token_b64, rank = line.split()
        token, rank = base64.b64decode(token_b64, validate=True), int(rank)
      except ValueError as e:
        raise ValueError(f"{path}:{n}: expected '<base64 token> <rank>', got {line[:60]!r}") from e
      if token in ranks:
        raise ValueError(f"{path}:{n}: token {token!r} appears twice")
      ranks[token] = rank
  missing = [b for b in range(256) if bytes([b]) not in ranks]
  if missing:
    raise ValueError(f"{path}: a byte-level BPE needs all 256 single bytes; {len(missing)} missing "
                     f"(e.g. {missing[:5]})")
  if len(set(ranks.values())) != len(ranks):
    raise ValueError(f"{path}: ranks are not unique")
  return ranks


def bpe_merge(piece: bytes, ranks: Mapping[bytes, int]) -> list[int]:
  """Token ids of one pre-token by repeatedly merging the lowest-ranked adjacent pair."""
  if piece in ranks:
    return [ranks[piece]]
  parts = [piece[i:i + 1] for i in range(len(piece))]
  while len(parts) > 1:
    best, best_rank = -1, None
    for i in range(len(parts) - 1):
      r = ranks.get(parts[i] + parts[i + 1])
      if r is not None and (best_rank is None or r < best_rank):
        best, best_rank = i, r
    if best < 0:
      break
    parts[best:best + 2] = [parts[best] + parts[best + 1]]
  return [ranks[p] for p in parts]


class TiktokenBPE:
  """encode / decode over a ranks table, with special tokens after the ranks."""

  def __init__(self, ranks: Mapping[bytes, int], special_tokens: Sequence[str] | Mapping[str, int],
               *, pattern: str = DEFAULT_PATTERN, source: str = "<memory>"):
    self.ranks = dict(ranks)
    self.source = source
    self.pattern = pattern
    self._split = _compile(pattern)
    first = max(self.ranks.values()) + 1
    if isinstance(special_tokens, Mapping):
      self.special_ids = dict(special_tokens)
    else:
      self.special_ids = {t: first + i for i, t in enumerate(special_tokens)}
    clash = set(self.special_ids.values()) & set(self.ranks.values())
    if clash:
      raise ValueError(f"special token ids {sorted(clash)[:5]} collide with BPE ranks")
    self.vocab_size = max(max(self.ranks.values()), max(self.special_ids.values(), default=0)) + 1
    self._bytes = {r: t for t, r in self.ranks.items()}
    self._bytes.update({i: t.encode("utf-8") for t, i in self.special_ids.items()})
    self._cache = functools.lru_cache(maxsize=1 << 16)(self._encode_piece)

  def _encode_piece(self, piece: str) -> tuple[int, ...]:
    return tuple(bpe_merge(piece.encode("utf-8"), self.ranks))

  def encode(self, text: str) -> list[int]:
    """Token ids of `text`; special-token spellings are encoded as ordinary text."""
    out: list[int] = []
    for m in self._split.finditer(text):
      out += self._cache(m.group())
    return out

  def decode_bytes(self, ids: Iterable[int]) -> bytes:
    try:
      return b"".join(self._bytes[int(i)] for i in ids)
    except KeyError as e:
      raise ValueError(f"token id {e.args[0]} is not in the vocabulary [0, {self.vocab_size})") from e

  def decode(self, ids: Iterable[int]) -> str:
    return self.decode_bytes(ids).decode("utf-8", errors="replace")

  def __getstate__(self):
    return {"ranks": self.ranks, "special": self.special_ids, "pattern": self.pattern,
            "source": self.source}

  def __setstate__(self, state):
    self.__init__(state["ranks"], state["special"], pattern=state["pattern"], source=state["source"])


def _compile(pattern: str):
  try:
    import regex  # Exact \p{..} classes when the optional `regex` package is installed.
    return regex.compile(pattern)
  except ImportError:
    return re.compile(pattern)


def write_ranks(ranks: Mapping[bytes, int], path: str) -> None:
  """Writes a tiktoken BPE file (sorted by rank)."""
  with open(path, "wb") as f:
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
      f.write(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")
