"""Documents → token ids with vision spans → pieces that fit one packed row.

Encoding (`DocumentEncoder`, a grain Map, runs in reader threads / worker processes):
  text             → BPE ids
  image            → <|image_start|> + h·w/4 × <|image_pad|> + <|image_end|>     (one grid)
  video chunk      → <|video_start|> + h·w/4 × <|image_pad|> + <|video_end|>     (per ≤4-frame grid)
  end of document  → <|eos|>
  token ids        → as given (generated documents, `retrieval.TokenDocument`) + <|eos|>
A media item that fails (`vision.MediaError`) or that could never fit one row (placeholders
longer than the row, or more patches than `max_patches_per_row`) is left out and counted under
its reason; the rest of the document is kept. A document with no text and no usable media is
dropped (and its errors still counted).

Splitting (`split_piece`): a row holds seq_len + 1 tokens (inputs and shifted targets), so a
document longer than that is cut into pieces of at most seq_len + 1 tokens that overlap by one
token: the last token of a piece (a target only) is the first input of the next, so every
next-token transition of the document is trained exactly once. A cut never falls inside a
vision span (between <|..._start|> and <|..._end|>), and a piece carries exactly the patches
and grids of the spans it contains, within the row's patch and grid budgets.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import grain
import numpy as np

from k3train.data import retrieval
from k3train.data import sources as sources_lib
from k3train.data import tokenizer as tokenizer_lib
from k3train.data import vision

log = logging.getLogger(__name__)
NUM_REASONS = len(vision.REASONS)


@dataclasses.dataclass
class Encoded:
  """One encoded document. spans[k] = (start, end) token indices (inclusive) of grid k."""
  tokens: np.ndarray                 # int32 [n]
  spans: list[tuple[int, int]]
  grids: np.ndarray                  # int32 [g, 3]  (t, h, w)
  patch_offsets: np.ndarray          # int64 [g + 1] start of each grid's patches in `patches`
  patches: np.ndarray                # uint8 [Σ t·h·w, 588]
  errors: np.ndarray                 # int64 [NUM_REASONS] skipped items by reason
  global_index: int = -1             # position in the source's global stream (set by the reader)


@dataclasses.dataclass(frozen=True)
class RowBudget:
  """What one packed row can hold."""
  seq_len: int                       # T; a row holds T + 1 tokens
  max_patches: int                   # patches per row (vision)
  max_grids: int                     # grids per row (vision)


def empty_vision():
  return np.zeros((0, 3), np.int32), np.zeros((1,), np.int64), np.zeros((0, vision.PATCH_DIM), np.uint8)


class DocumentEncoder(grain.transforms.Map):
  """Source item → `Encoded` (never raises on bad data; see the module docstring)."""

  def __init__(self, tok, vision_cfg: vision.VisionConfig | None, budget: RowBudget):
    self.tok, self.vision_cfg, self.budget = tok, vision_cfg, budget
    ids = tok.special_ids
    self.image_start, self.image_end = ids[tokenizer_lib.IMAGE_START], ids[tokenizer_lib.IMAGE_END]
    self.video_start, self.video_end = ids[tokenizer_lib.VIDEO_START], ids[tokenizer_lib.VIDEO_END]
    self.pad = ids[tokenizer_lib.IMAGE_PAD]

  def _count(self, errors, reason, message):
    errors[vision.REASONS.index(reason)] += 1
    log.debug("skipped a media item (%s): %s", reason, message)

  def map(self, item: Any) -> Encoded:
    errors = np.zeros((NUM_REASONS,), np.int64)
    g0, off0, p0 = empty_vision()
    if isinstance(item, sources_lib.BadRecord):
      self._count(errors, item.reason if item.reason in vision.REASONS else "bad_record", item.message)
      return Encoded(np.zeros((0,), np.int32), [], g0, off0, p0, errors)
    if item is None or (isinstance(item, str) and not item.strip()):
      return Encoded(np.zeros((0,), np.int32), [], g0, off0, p0, errors)
    if isinstance(item, str):  # Fast path: plain text.
      ids = self.tok.encode(item)
      ids.append(self.tok.eos_id)
      return Encoded(np.asarray(ids, np.int32), [], g0, off0, p0, errors)
    if isinstance(item, retrieval.TokenDocument):  # generated, already token ids
      return Encoded(np.append(item.ids, np.int32(self.tok.eos_id)).astype(np.int32), [], g0, off0,
                     p0, errors)
    if not isinstance(item, dict) or "segments" not in item:
      self._count(errors, "bad_record", f"unexpected item type {type(item).__name__}")
      return Encoded(np.zeros((0,), np.int32), [], g0, off0, p0, errors)

    ids: list[int] = []
    spans, grids, patches = [], [], []
    has_text = False
    for seg in item["segments"]:
      (kind, value), = seg.items()
      if kind == "text":
        if value:
          ids += self.tok.encode(value)
          has_text = has_text or bool(value.strip())
        continue
      if self.vision_cfg is None:
        self._count(errors, "vision_disabled", f"{kind} segment with data.vision.enabled = False")
        continue
      try:
        visual = vision.load_media(kind, value, self.vision_cfg)
      except vision.MediaError as e:
        self._count(errors, e.reason, f"{kind} {value if isinstance(value, str) else '<bytes>'}: {e}")
        continue
      per_grid = [t * h * w for t, h, w in visual.grids]
      n_tok = max(visual.tokens_per_grid()) + 2
      if n_tok > self.budget.seq_len + 1 or max(per_grid) > self.budget.max_patches:
        self._count(errors, "too_long_for_row",
                    f"{kind} needs {n_tok} tokens / {max(per_grid)} patches per grid; a row holds "
                    f"{self.budget.seq_len + 1} tokens / {self.budget.max_patches} patches")
        continue
      start, end = ((self.image_start, self.image_end) if visual.kind == "image"
                    else (self.video_start, self.video_end))
      for grid, n in zip(visual.grids, visual.tokens_per_grid()):
        s = len(ids)
        ids += [start] + [self.pad] * n + [end]
        spans.append((s, len(ids) - 1))
        grids.append(grid)
      patches.append(visual.patches)
    if not has_text and not spans:
      return Encoded(np.zeros((0,), np.int32), [], g0, off0, p0, errors)
    ids.append(self.tok.eos_id)
    if spans:
      grid_arr = np.asarray(grids, np.int32).reshape(-1, 3)
      offsets = np.concatenate([[0], np.cumsum(np.prod(grid_arr, axis=1))]).astype(np.int64)
      return Encoded(np.asarray(ids, np.int32), spans, grid_arr, offsets, np.concatenate(patches), errors)
    return Encoded(np.asarray(ids, np.int32), [], g0, off0, p0, errors)


def split_piece(doc: Encoded, start: int, budget: RowBudget) -> tuple[int, int, int, int]:
  """The piece of `doc` that begins at token `start`: (end, first grid, grid stop, next start).

  The piece is tokens[start : end + 1] with grids [first, stop); `next start` is `end` (the
  one-token overlap) or -1 when the piece finishes the document. Requires a valid cut `start`.
  """
  n = len(doc.tokens)
  end = min(start + budget.seq_len, n - 1)
  spans = doc.spans
  # First span that starts at or after `start` (spans before it belong to earlier pieces).
  first = 0
  while first < len(spans) and spans[first][0] < start:
    first += 1
  stop = first
  patches = 0
  while stop < len(spans):
    s, e = spans[stop]
    if s >= end:                      # Starts at/after the piece's end: not in this piece.
      break
    grid_patches = int(doc.patch_offsets[stop + 1] - doc.patch_offsets[stop])
    if e > end or stop - first + 1 > budget.max_grids or patches + grid_patches > budget.max_patches:
      end = s                         # Cut at this span's start marker (a target-only token).
      break
    patches += grid_patches
    stop += 1
  if end <= start:
    raise AssertionError(f"no progress splitting a document at token {start} (spans {spans[first:first + 2]})")
  return end, first, stop, (end if end < n - 1 else -1)


def make_piece(doc: Encoded, start: int, end: int, first: int, stop: int, *, with_vision: bool):
  """The packing element of tokens[start:end+1] and grids [first, stop)."""
  piece = {"tokens": doc.tokens[start:end + 1]}
  if with_vision:
    piece["vision_grids"] = doc.grids[first:stop]
    piece["vision_patches"] = doc.patches[doc.patch_offsets[first]:doc.patch_offsets[stop]]
  return piece
