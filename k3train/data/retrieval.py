"""Synthetic long-range retrieval documents: passkey, multi-key needle, variable tracking.

Every document is generated from (seed, task, index, length) alone, at the token level, so it
has exactly the requested number of tokens under the run's tokenizer and the answer's token span
is known. The same generator makes training documents (`RetrievalSource`, sources
`synthetic_passkey`, `synthetic_multikey`, `synthetic_vartrack`) and evaluation rows
(`eval_rows`): the evals use their own seed, so they never repeat a training document.

  passkey    filler with one needle "The pass key is 48213. Remember it. ..." at a random depth;
             the document ends "What is the pass key? The pass key is" + answer " 48213".
  multikey   up to four needles "One of the special magic numbers for <word> is: 4829173." with
             distinct words at random depths; one word is asked for; answer " 4829173".
  vartrack   a chain "VAR QZKRW = 51822." → "VAR PLOMD = VAR QZKRW." → … (up to four names)
             spread over the filler in order; the question asks which names hold the value;
             answer " QZKRW PLOMD …" (in chain order).

Filler is drawn from a fixed set of plain sentences (tokenized once per tokenizer); needles sit
on sentence boundaries. A document shorter than its fixed parts (needles, question, answer)
cannot be made; `min_length` says how short a task can go (about 40–70 tokens with the shipped
tokenizer).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

TASKS = ("passkey", "multikey", "vartrack")

_FILLER = (
    "The grass is green and the sky is blue.",
    "A river runs through the valley and on to the sea.",
    "The old mill by the bridge has not turned for many years.",
    "Every morning the baker opens the shop before the sun is up.",
    "Clouds gathered over the hills, but no rain came that day.",
    "The library keeps its maps in long drawers near the window.",
    "A small boat waited at the end of the wooden pier.",
    "The road climbs slowly past the farms and into the forest.",
    "Children played in the square while the clock struck noon.",
    "The lamp on the desk was left on through the night.",
    "Snow covered the roofs and the streets were quiet.",
    "The train to the coast leaves twice a day from the north station.",
)
_KEY_WORDS = ("apple", "harbor", "violet", "copper", "meadow", "lantern", "falcon", "orchard",
              "pepper", "glacier", "saddle", "thimble", "walnut", "comet", "ember", "quartz")
_LETTERS = np.array(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ"))


@dataclasses.dataclass(frozen=True)
class Example:
  """One generated document: `ids` (int32 [length], no end-of-document token) and the answer's
  token span [answer_start, answer_end) inside it."""
  ids: np.ndarray
  answer_start: int
  answer_end: int
  task: str


class _Pieces:
  """Token ids of the fixed phrases of every task under one tokenizer (encoded once)."""

  def __init__(self, tok):
    self.tok = tok
    self.filler = [np.asarray(tok.encode(s + " "), np.int32) for s in _FILLER]

  def enc(self, text: str) -> np.ndarray:
    return np.asarray(self.tok.encode(text), np.int32)


@functools.lru_cache(maxsize=8)
def _pieces(tok) -> _Pieces:
  return _Pieces(tok)


def _rng(seed: int, task: str, index: int, length: int) -> np.random.Generator:
  return np.random.default_rng([int(seed) & 0xFFFFFFFF, TASKS.index(task), int(index), int(length)])


def _parts(p: _Pieces, task: str, rng: np.random.Generator, budget: int):
  """(needles in document order, question, answer, tail) for one example."""
  if task == "passkey":
    key = str(int(rng.integers(10_000, 100_000)))
    needles = [p.enc(f"The pass key is {key}. Remember it. {key} is the pass key. ")]
    question = p.enc("What is the pass key? The pass key is")
    return needles, question, p.enc(f" {key}"), p.enc(".")
  if task == "multikey":
    words = rng.choice(len(_KEY_WORDS), size=4, replace=False)
    numbers = rng.integers(1_000_000, 10_000_000, size=4)
    needles = [p.enc(f"One of the special magic numbers for {_KEY_WORDS[w]} is: {n}. ")
               for w, n in zip(words, numbers)]
    q = int(rng.integers(0, 4))
    word = _KEY_WORDS[words[q]]
    question = p.enc(f"What is the special magic number for {word}? The special magic number "
                     f"for {word} is")
    answer, tail = p.enc(f" {numbers[q]}"), p.enc(".")
    while len(needles) > 1 and sum(map(len, needles)) + len(question) + len(answer) + len(tail) > budget:
      drop = len(needles) - 1 if len(needles) - 1 != q else len(needles) - 2
      needles.pop(drop)
      q -= int(drop < q)
    return needles, question, answer, tail
  if task == "vartrack":
    value = str(int(rng.integers(10_000, 100_000)))
    names = ["".join(rng.choice(_LETTERS, size=5)) for _ in range(4)]
    needles = [p.enc(f"VAR {names[0]} = {value}. ")]
    needles += [p.enc(f"VAR {names[i]} = VAR {names[i - 1]}. ") for i in range(1, 4)]
    question, tail = p.enc(f"Which variables hold the value {value}? They are:"), p.enc(".")
    answer = p.enc(" " + " ".join(names))
    while len(needles) > 1 and sum(map(len, needles)) + len(question) + len(answer) + len(tail) > budget:
      needles.pop()
      answer = p.enc(" " + " ".join(names[:len(needles)]))
    return needles, question, answer, tail
  raise ValueError(f"unknown retrieval task {task!r}; known: {TASKS}")


def generate(tok, task: str, seed: int, index: int, length: int) -> Example:
  """The example (seed, task, index) with exactly `length` tokens (raises ValueError if the task's
  fixed parts do not fit)."""
  p = _pieces(tok)
  rng = _rng(seed, task, index, length)
  needles, question, answer, tail = _parts(p, task, rng, length)
  fixed = sum(map(len, needles)) + len(question) + len(answer) + len(tail)
  fill = length - fixed
  if fill < 0:
    raise ValueError(f"a {task} document needs at least {fixed} tokens; asked for {length}")
  sentences, total = [], 0
  while total < fill:
    s = p.filler[int(rng.integers(0, len(p.filler)))]
    sentences.append(s[:fill - total])
    total += len(sentences[-1])
  # Needles go on sentence boundaries, in order, at uniformly drawn depths.
  slots = np.sort(rng.integers(0, len(sentences) + 1, size=len(needles)))
  out, k = [], 0
  for i in range(len(sentences) + 1):
    while k < len(needles) and slots[k] == i:
      out.append(needles[k])
      k += 1
    if i < len(sentences):
      out.append(sentences[i])
  out.append(question)
  start = sum(map(len, out))
  out += [answer, tail]
  ids = np.concatenate(out).astype(np.int32)
  assert len(ids) == length, (len(ids), length)
  return Example(ids, start, start + len(answer), task)


def min_length(tok, task: str) -> int:
  """Fewest tokens a `task` document can have (over a few seeds; with fewer needles)."""
  p = _pieces(tok)
  need = 0
  for i in range(16):
    needles, question, answer, tail = _parts(p, task, _rng(0, task, i, 0), 0)
    need = max(need, sum(map(len, needles)) + len(question) + len(answer) + len(tail))
  return need


class TokenDocument:
  """A source item that is already token ids (the encoder appends the end-of-document token)."""

  __slots__ = ("ids",)

  def __init__(self, ids: np.ndarray):
    self.ids = np.asarray(ids, np.int32)

  def __reduce__(self):
    return (TokenDocument, (self.ids,))


class RetrievalSource:
  """A grain RandomAccessDataSource of generated training documents of one task.

  Item i has a length drawn uniformly from [seq_len / 4, seq_len] tokens (at least the task's
  minimum), so with its end-of-document token it always fits one packed row of seq_len + 1:
  a needle is never cut away from its question. `size` items; deterministic in (seed, i,
  seq_len), so a stage with another seq_len reads documents sized for it.
  """

  def __init__(self, task: str, *, tokenizer, seq_len: int, seed: int, size: int = 1_000_000):
    if task not in TASKS:
      raise ValueError(f"unknown retrieval task {task!r}; known: {TASKS}")
    self.task, self.tok, self.seq_len, self.seed, self.size = task, tokenizer, int(seq_len), int(seed), size
    self.shortest = min_length(tokenizer, task)
    if self.shortest > self.seq_len:
      raise ValueError(f"synthetic_{task} documents need at least {self.shortest} tokens; "
                       f"data.seq_len is {self.seq_len}")

  def __len__(self) -> int:
    return self.size

  def __getitem__(self, i: int):
    if not 0 <= i < self.size:
      raise IndexError(i)
    rng = np.random.default_rng([self.seed & 0xFFFFFFFF, TASKS.index(self.task), int(i), self.seq_len, 1])
    low = max(self.shortest, self.seq_len // 4)
    length = int(rng.integers(low, self.seq_len + 1))
    return TokenDocument(generate(self.tok, self.task, self.seed, i, length).ids)

  def __repr__(self) -> str:
    return f"RetrievalSource({self.task!r}, seq_len={self.seq_len}, seed={self.seed}, size={self.size})"


def eval_rows(tok, task: str, *, seed: int, seq_len: int, first: int, rows: int) -> dict[str, np.ndarray]:
  """Evaluation rows in the pipeline's batch format (one full-length document per row: seq_len
  tokens and the end-of-document token) plus `answer_mask` [rows, seq_len]: 1 where the target is
  an answer token. Row r holds example `first + r`."""
  tokens = np.zeros((rows, seq_len + 1), np.int32)
  answer = np.zeros((rows, seq_len), np.float32)
  for r in range(rows):
    ex = generate(tok, task, seed, first + r, seq_len)
    tokens[r, :seq_len] = ex.ids
    tokens[r, seq_len] = tok.eos_id
    answer[r, ex.answer_start - 1:ex.answer_end - 1] = 1.0   # input j predicts token j + 1
  ones = np.ones((rows, seq_len), np.int32)
  return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": ones,
          "positions": np.broadcast_to(np.arange(seq_len, dtype=np.int32), (rows, seq_len)).copy(),
          "loss_mask": ones.astype(np.float32), "answer_mask": answer}
