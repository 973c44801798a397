"""The held-out split: which documents of a source training never reads.

Every document has an id that names it by what it is, not by where a shuffle put it
(`document_id`): the path of a standard-library file relative to the library (so all pieces of
one file share it), `<file>@<byte offset>` of a JSONL line, `<file>#<row>` of a Parquet row, the
path of a text file or image, `<kind>:<index>` of generated documents. With
    u(id) = (first 8 bytes of sha256("k3train-heldout/" + id)) / 2^64,
a document is held out when u(id) < data.heldout_fraction. The rule depends on nothing but the
id, so every process, every run and every curriculum stage agree on it, and the held-out part of
a source grows only when the fraction does.

    train = SplitSource(source, fraction, "train")    # what the pipeline reads for training
    held = SplitSource(source, fraction, "eval")      # what evaluation reads

A document of the other part reads as None; both views keep the source's length and indices.
The training pipeline (k3train/data/pipeline.py) reads every training source through the
"train" view when data.heldout_fraction > 0; evaluation (k3train/train/evaluation.py) packs its
batches from the "eval" view's documents.
"""

from __future__ import annotations

import bisect
import hashlib
import os
from typing import Sequence

from k3train.data import sources as sources_lib

_SALT = b"k3train-heldout/"


def _relative_paths(paths: Sequence[str]) -> list[str]:
  """Paths relative to their common directory, with "/" separators."""
  if not paths:
    return []
  base = os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in paths])
  return [os.path.relpath(os.path.abspath(p), base).replace(os.sep, "/") for p in paths]


class DocumentIds:
  """index → document id of one source (module docstring). Picklable.

  A source type not listed here may define `document_id(index) -> str`; otherwise its ids are
  `#<index>`, which is stable only as long as the source's order is.
  """

  def __init__(self, source):
    self.source = source
    self.kind = type(source).__name__
    self._rel: list[str] = []
    self._file_first_row: dict[int, int] = {}
    if isinstance(source, sources_lib.PythonStdlibSource):
      self._rel = [os.path.relpath(p, source.root).replace(os.sep, "/") for p in source.paths]
    elif hasattr(source, "paths") and not callable(getattr(source, "document_id", None)):
      self._rel = _relative_paths(list(source.paths))
    if isinstance(source, sources_lib.ParquetSource):
      for f, _, first in source.groups:
        self._file_first_row.setdefault(f, first)

  def __call__(self, index: int) -> str:
    s = self.source
    if isinstance(s, sources_lib.PythonStdlibSource):
      return self._rel[s.pieces[index][0]]                    # every piece of a file: one id
    if isinstance(s, sources_lib.JsonlSource):
      f, offset, _ = s.index[index]
      return f"{self._rel[f]}@{offset}"
    if isinstance(s, (sources_lib.TextFilesSource, sources_lib.ImageCaptionSource)):
      return self._rel[index]
    if isinstance(s, sources_lib.ParquetSource):
      k = bisect.bisect_right(s._starts, index) - 1
      f = s.groups[k][0]
      return f"{self._rel[f]}#{index - self._file_first_row[f]}"
    if isinstance(s, sources_lib.ArrayRecordSource):
      return f"record:{index}"
    if isinstance(s, sources_lib.SyntheticSource):
      return f"synthetic_{s.kind}:{index}"
    own = getattr(s, "document_id", None)
    if callable(own):
      return str(own(index))
    return f"#{index}"


def document_id(source, index: int) -> str:
  """The id of `source[index]` (see `DocumentIds`; build one `DocumentIds` for many lookups)."""
  return DocumentIds(source)(index)


def heldout_value(doc_id: str) -> float:
  """u(id) in [0, 1): the document's place on the split line (module docstring)."""
  digest = hashlib.sha256(_SALT + doc_id.encode("utf-8")).digest()
  return int.from_bytes(digest[:8], "big") / 2.0 ** 64


def is_heldout(doc_id: str, fraction: float) -> bool:
  return fraction > 0 and heldout_value(doc_id) < fraction


class SplitSource:
  """One part of a source: "train" (held-out documents read as None) or "eval" (the others read
  as None). Same length and indices as the source, so stream positions, checkpointed iterator
  states and host resharding are unchanged; a hidden document costs a hash, not a read."""

  def __init__(self, source, fraction: float, part: str = "train"):
    if part not in ("train", "eval"):
      raise ValueError(f"part must be 'train' or 'eval', got {part!r}")
    if not 0 <= fraction < 1:
      raise ValueError(f"held-out fraction must lie in [0, 1), got {fraction}")
    self.source, self.fraction, self.part = source, float(fraction), part
    self.ids = DocumentIds(source)

  def __len__(self) -> int:
    return len(self.source)

  def visible(self, index: int) -> bool:
    return is_heldout(self.ids(index), self.fraction) == (self.part == "eval")

  def __getitem__(self, index: int):
    return self.source[index] if self.visible(index) else None

  def __repr__(self) -> str:
    return f"SplitSource({self.source!r}, fraction={self.fraction}, part={self.part!r})"


__all__ = ["DocumentIds", "SplitSource", "document_id", "heldout_value", "is_heldout"]
