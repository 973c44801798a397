"""The input pipeline: weighted sources → documents → pieces → packed rows → batches.

Built from grain pieces, so it is deterministic and checkpointable:

  per source s:  MapDataset.source(docs).shuffle(seed_s).repeat()      the global stream of s
                 [F + q :: n][j:]                                       this host's positions
                 .map(DocumentEncoder)  (decode, resize, patchify, tokenize; ReadOptions threads,
                 .to_iter_dataset()      optionally mp_prefetch worker processes)
                 → SourceReader          cuts documents into row-sized pieces, tracks position
  IterDataset.mix(readers, weights)                                     weighted mixture
  → FirstFitPackIterDataset(num_packing_bins = per-host batch)          rows of seq_len + 1
  → batch → finalize (shift, loss mask, vision grid ids)

Batch format (numpy; B = per-host batch, T = seq_len; P, G = vision.max_patches_per_row,
max_grids_per_row):
  tokens       [B, T] int32    input ids (padding: 0)
  targets      [B, T] int32    the next token of each input
  segment_ids  [B, T] int32    1, 2, ... per document piece within a row; 0 = padding
  positions    [B, T] int32    position within the piece (restarts at 0 for every piece)
  loss_mask    [B, T] float32  1 where `targets` is the real next token of the same piece and
                               not a vision placeholder or vision end marker; 0 on padding
  with data.vision.enabled only:
  vision_patches  [B, P, 588] uint8  patches of the row's grids, in order (vision.py layout)
  vision_grids    [B, G, 3]   int32  (t, h, w) per grid in token order; zero rows = padding
  vision_grid_ids [B, P]      int32  1-based grid of each patch; 0 = padding
Every row holds exactly Σ h·w/4 <|image_pad|> input tokens over its grids (placeholders are
never cut off a row); documents are split across rows only outside vision spans
(documents.py). Padding is only at the tail of a row (first-fit packing never interleaves).

Held-out documents
------------------
With data.heldout_fraction = f > 0 every training source except the generated retrieval sources
is read through `split.SplitSource(source, f, "train")` (k3train/data/split.py): a document
whose id hashes below f is held out for evaluation and never reaches a batch. A held-out document
keeps its stream position (it is read as an empty document, which no piece comes from), so
positions, iterator states and resharding are those of the whole source; it is not counted as
skipped. The fraction defines the split, so it may not change on restore.

Iterator state (`get_state()`, plain JSON) holds the grain state, the configuration it belongs
to and cumulative per-source error counters (`metrics()`).

Mixture weights, seq_len, long_doc_weight and batch size may change between curriculum stages:
restoring a state saved under other values keeps every source's exact position (document and
token offset inside it) and restarts only the mixing pattern and the packer (which is empty at
batch boundaries, so nothing is lost or repeated). A weight may be 0 (at least one is positive):
that source sits the stage out and its position is carried in the state ("idle") until a later
stage weights it again.

Long documents (curriculum stages)
----------------------------------
Packing cuts a document only where it must: a document of L tokens (with its end token) becomes
ceil((L - 1) / T) pieces of at most T + 1 tokens, and first-fit packing never cuts a piece.
`data.long_doc_weight` = w ≥ 1 samples by length: a document of at most T / 2 tokens is kept with
probability 1 / w (a deterministic coin of the source's seed and the document's stream position,
so resumption is exact) and skipped otherwise; longer documents are always kept. Their share of
the batch's tokens is `long_doc_share` in `metrics()` (tokens of pieces whose document is longer
than T / 2, over all packed tokens). Generated retrieval sources (`synthetic_passkey`,
`synthetic_multikey`, `synthetic_vartrack`, k3train/data/retrieval.py) size their documents for
the current seq_len.

Hosts and resharding
--------------------
Each source has one global stream (epoch e = a fresh permutation seeded by (seed, e)). A host
layout (F, n, q, H) gives host q of n the stream positions F + q, F + q + n, ... except the
positions in the finite "holes" map H (already consumed before a reshard; a partially consumed
document resumes at its token offset). Hosts therefore read disjoint documents, and together
every position ≥ F exactly once.

Restoring on a different host count: pass the list of all hosts' states (`{"hosts": [...]}`,
e.g. all-gathered at save time) to `set_state` on every new host. `reshard` computes, per
source, the frontier F' = the smallest next position over the old hosts (everything before it
was consumed) and the holes H' = positions ≥ F' already consumed (wholly, or up to a token
offset), and gives the new hosts the layout (F', n', q', H'). Guarantee: within each source's
stream, no document (or part of a document) is repeated or skipped across the change, for any
old and new host counts (tested 2 → 1 and 1 → 2). The rows after the change differ from an
uninterrupted run on the old layout (other hosts, other packing), which is unavoidable.
"""

from __future__ import annotations

import copy
import json
import time
from typing import Any, Mapping, Sequence

from absl import flags as absl_flags
import grain
from grain.experimental import FirstFitPackIterDataset
import numpy as np

from k3train import config as config_lib
from k3train.data import documents
from k3train.data import sources as sources_lib
from k3train.data import split as split_lib
from k3train.data import tokenizer as tokenizer_lib
from k3train.data import vision as vision_lib

TOKENS = "tokens"
BATCH_KEYS = ("tokens", "targets", "segment_ids", "positions", "loss_mask")
VISION_KEYS = ("vision_patches", "vision_grids", "vision_grid_ids")
_STATS = "stats"
# Reader threads decode and tokenize ahead of the packer; order stays deterministic.
_PREFETCH = 16
REASONS = vision_lib.REASONS


# --- small helpers ------------------------------------------------------------------------


def _get(cfg, name: str, default=None):
  """Reads `cfg.name` from a ConfigDict / dict / object, with a default."""
  if isinstance(cfg, Mapping):
    return cfg.get(name, default)
  return getattr(cfg, name, default)


def _to_json_types(x: Any) -> Any:
  """Recursively turns tuples (and numpy scalars) into JSON-native lists / ints / floats."""
  if isinstance(x, Mapping):
    return {str(k): _to_json_types(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_to_json_types(v) for v in x]
  if isinstance(x, np.generic):
    return x.item()
  return x


def state_to_json(state: Mapping[str, Any]) -> str:
  """Serialises an iterator state to a JSON string."""
  return json.dumps(_to_json_types(state), sort_keys=True)


def state_from_json(text: str) -> dict[str, Any]:
  """Parses a JSON string from `state_to_json` into a state for `set_state`."""
  return json.loads(text)


def _seed(*parts) -> int:
  return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0])


def _spec_seed(spec: str) -> int:
  return int.from_bytes(spec.encode("utf-8")[:8].ljust(8, b"\0"), "little") % (2 ** 31)


# --- batch post-processing ----------------------------------------------------------------


def shift_packed(packed: Mapping[str, np.ndarray], no_loss_ids: Sequence[int] = ()) -> dict[str, np.ndarray]:
  """Turns packed rows of T + 1 tokens into T-long training examples (module docstring).

  `packed` holds "tokens", "tokens_segment_ids" and "tokens_positions" of equal shape
  [..., T + 1] (segment id 0 marks padding); `no_loss_ids` are target ids never trained on
  (vision placeholders and end markers). Works on one row or a batch of rows.
  """
  tokens = np.asarray(packed[TOKENS], dtype=np.int32)
  seg = np.asarray(packed[f"{TOKENS}_segment_ids"], dtype=np.int32)
  pos = np.asarray(packed[f"{TOKENS}_positions"], dtype=np.int32)
  if (tokens.ndim < 1 or tokens.shape[-1] < 2 or tokens.shape != seg.shape
      or tokens.shape != pos.shape):
    raise ValueError(f"packed features must share a shape [..., T + 1] with T >= 1, got "
                     f"{tokens.shape}, {seg.shape}, {pos.shape}")
  same_doc = (seg[..., :-1] != 0) & (seg[..., :-1] == seg[..., 1:])
  if len(no_loss_ids):
    same_doc &= ~np.isin(tokens[..., 1:], np.asarray(no_loss_ids, np.int32))
  return {
      "tokens": tokens[..., :-1],
      "targets": tokens[..., 1:],
      "segment_ids": seg[..., :-1],
      "positions": pos[..., :-1],
      "loss_mask": same_doc.astype(np.float32),
  }


def grid_ids(grids_bg3: np.ndarray, num_patches: int) -> np.ndarray:
  """[B, G, 3] grids → [B, num_patches] 1-based grid index of each patch (0 = padding)."""
  sizes = np.prod(grids_bg3, axis=-1)                       # [B, G]
  out = np.zeros((grids_bg3.shape[0], num_patches), np.int32)
  for b in range(grids_bg3.shape[0]):
    ids = np.repeat(np.arange(1, sizes.shape[1] + 1, dtype=np.int32), sizes[b])
    out[b, :len(ids)] = ids
  return out


def padding_fraction(batch: Mapping[str, np.ndarray]) -> float:
  """Fraction of batch positions that are padding (segment id 0)."""
  seg = np.asarray(batch["segment_ids"])
  return float(np.mean(seg == 0)) if seg.size else 0.0


# Per-piece stats vector: error counts per (source slot, reason), then record counts per (source
# slot, RECORD_COUNTS), then tokens of the piece that come from a long document (longer than
# seq_len / 2), then all tokens of the piece.
_LENGTH_STATS = 2
# Per source: records read, and records the pipeline skipped wholly or in part (one or more
# skipped items): the skip rate's denominator and numerator.
RECORD_COUNTS = ("read", "skipped")


def _stats_width(num_slots: int) -> int:
  return num_slots * (len(REASONS) + len(RECORD_COUNTS)) + _LENGTH_STATS


class _SumStats(grain.transforms.Map):
  """Row: the list of per-piece stats vectors → their sum (a fixed-shape vector)."""

  def __init__(self, width: int):
    self.width = width

  def map(self, row):
    stats = row.pop(_STATS)
    row[_STATS] = (np.sum(np.stack(stats), axis=0) if len(stats) else
                   np.zeros((self.width,), np.int64)).astype(np.int64)
    return row


class _Finalize(grain.transforms.Map):
  """Batch of packed rows → the batch format of the module docstring (+ "stats")."""

  def __init__(self, no_loss_ids: Sequence[int], with_vision: bool):
    self.no_loss_ids, self.with_vision = tuple(no_loss_ids), with_vision

  def map(self, rows):
    out = shift_packed(rows, self.no_loss_ids)
    if self.with_vision:
      out["vision_patches"] = rows["vision_patches"]
      out["vision_grids"] = rows["vision_grids"]
      out["vision_grid_ids"] = grid_ids(rows["vision_grids"], rows["vision_patches"].shape[1])
    out[_STATS] = rows[_STATS]
    return out


# --- per-source reader --------------------------------------------------------------------


class _KeepPositions:
  """A source whose hidden documents (None, e.g. held out by a `split.SplitSource`) read as an
  empty document instead: grain drops None elements from an iterator, which would shift every
  later stream position a reader counts, so the position bookkeeping needs one element per index."""

  def __init__(self, source):
    self.source = source

  def __len__(self) -> int:
    return len(self.source)

  def __getitem__(self, index):
    item = self.source[index]
    return "" if item is None else item

  def __repr__(self) -> str:
    return f"_KeepPositions({self.source!r})"


def source_stream(source, seed: int) -> grain.MapDataset:
  """The endless global stream of one source: a fresh permutation every epoch."""
  return grain.MapDataset.source(source).shuffle(seed=seed).repeat(None)


def initial_layout(process_index: int, process_count: int) -> dict:
  return {"frontier": 0, "count": process_count, "index": process_index, "holes": []}


def initial_reader_state(process_index: int, process_count: int) -> dict:
  return {"k3_reader": 1, "layout": initial_layout(process_index, process_count), "doc": 0,
          "offset": 0, "pending": [0] * len(REASONS), "records": [0] * len(RECORD_COUNTS)}


_MASK64 = (1 << 64) - 1


def unit_coin(seed: int, position: int) -> float:
  """A uniform number in [0, 1) from (seed, position) alone (splitmix64 of their mix)."""
  z = (int(seed) * 0x9E3779B97F4A7C15 + int(position) + 1) & _MASK64
  z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
  z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
  return ((z ^ (z >> 31)) >> 11) / float(1 << 53)


class SourceReader(grain.DatasetIterator):
  """Reads this host's positions of one source stream and cuts documents into pieces.

  State (JSON): layout {frontier F, count n, index q, holes [[position, token offset or -1]]},
  `doc` = host-stream index of the document being cut (or the next one), `offset` = token where
  its next piece starts (0: not started), `pending` = error counts and `records` = record counts
  (RECORD_COUNTS) not yet attached to a piece.
  The grain sub-pipeline below (threads / worker processes) is rebuilt from `doc` on restore,
  so the state does not depend on num_workers.
  """

  def __init__(self, *, slot: int, num_slots: int, stream: grain.MapDataset, encoder,
               budget: documents.RowBudget, with_vision: bool, read_options, mp_workers: int,
               state: dict, long_doc_weight: float = 1.0, coin_seed: int = 0, spec: str = "?",
               max_unusable_records: int = sources_lib.MAX_UNUSABLE_RECORDS,
               max_unusable_seconds: float = sources_lib.MAX_UNUSABLE_SECONDS):
    super().__init__()
    self.slot, self.num_slots = slot, num_slots
    self.spec, self.max_unusable = spec, (int(max_unusable_records), float(max_unusable_seconds))
    self.long_doc_weight, self.coin_seed = float(long_doc_weight), int(coin_seed)
    self.stream, self.encoder, self.budget = stream, encoder, budget
    self.with_vision, self.read_options, self.mp_workers = with_vision, read_options, mp_workers
    self._set(state)

  def _set(self, state: dict):
    layout = state["layout"]
    self.layout = {"frontier": int(layout["frontier"]), "count": int(layout["count"]),
                   "index": int(layout["index"]), "holes": [[int(g), int(o)] for g, o in layout["holes"]]}
    self.holes = {g: o for g, o in self.layout["holes"]}
    self.next_doc = int(state["doc"])           # host-stream index of the next document to fetch
    self.resume_offset = int(state["offset"])   # applies to document `next_doc` when fetched
    self.pending = np.asarray(state["pending"], np.int64).reshape(len(REASONS))
    self.records = np.asarray(state.get("records", [0] * len(RECORD_COUNTS)),   # older states: none
                              np.int64).reshape(len(RECORD_COUNTS))
    self.cur = None                            # (Encoded, host index, next piece start)
    self._close_parent()
    self._parent_iter = None

  def _close_parent(self):
    it = getattr(self, "_parent_iter", None)
    if it is not None and hasattr(it, "close"):
      it.close()

  def _global_position(self, j: int) -> int:
    return self.layout["frontier"] + self.layout["index"] + self.layout["count"] * j

  def _parent(self):
    if self._parent_iter is None:
      first = self._global_position(self.next_doc)
      ds = self.stream[first::self.layout["count"]].map(self.encoder)
      ds = ds.to_iter_dataset(self.read_options)
      if self.mp_workers > 0:
        if not absl_flags.FLAGS.is_parsed():  # grain workers read absl flags
          absl_flags.FLAGS.mark_as_parsed()
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=self.mp_workers))
      self._parent_iter = iter(ds)
    return self._parent_iter

  def __next__(self):
    dry, empty, t0 = 0, 0, time.monotonic()       # records read without a usable document
    while self.cur is None:
      if dry:
        self._check_dry(dry, empty, time.monotonic() - t0)
      dry += 1
      j = self.next_doc
      doc = next(self._parent())
      empty += int(not np.any(doc.errors))
      g = self._global_position(j)
      self.next_doc = j + 1
      offset = self.holes.get(g, 0)
      counted = g in self.holes                    # its errors were counted before a reshard
      if self.resume_offset:                       # first document after a restore, part-read
        offset, self.resume_offset, counted = self.resume_offset, 0, True
      if offset < 0:
        continue                                   # consumed by another host before a reshard
      if not counted:
        self.pending += doc.errors
        self.records += (1, int(np.any(doc.errors)))
      if len(doc.tokens) - offset >= 2:
        if offset == 0 and not counted and not self._keep(g, len(doc.tokens)):
          continue                                 # a short document the stage samples away
        self.cur = (doc, j, offset)
    doc, j, start = self.cur
    end, first, stop, nxt = documents.split_piece(doc, start, self.budget)
    piece = documents.make_piece(doc, start, end, first, stop, with_vision=self.with_vision)
    self.cur = None if nxt < 0 else (doc, j, nxt)
    stats = np.zeros((_stats_width(self.num_slots),), np.int64)
    stats[self.slot * len(REASONS):(self.slot + 1) * len(REASONS)] = self.pending
    first_count = self.num_slots * len(REASONS) + self.slot * len(RECORD_COUNTS)
    stats[first_count:first_count + len(RECORD_COUNTS)] = self.records
    stats[-1] = end + 1 - start
    stats[-2] = stats[-1] if 2 * len(doc.tokens) > self.budget.seq_len else 0
    self.pending = np.zeros_like(self.pending)
    self.records = np.zeros_like(self.records)
    piece[_STATS] = stats
    return piece

  def _check_dry(self, dry: int, empty: int, seconds: float) -> None:
    """Fails when this source has read too many records in a row without a usable document (or
    a stop signal came while it waits), naming the source and what it skipped."""
    records, limit_s = self.max_unusable
    interrupted = sources_lib.STOP_WAITING.is_set() and seconds > 1.0
    if dry < records and seconds < limit_s and not interrupted:
      return
    counts = {r: int(n) for r, n in zip(REASONS, self.pending)}
    counts["empty_or_too_short"] = empty
    why = "stopped by a signal while waiting" if interrupted else "giving up"
    raise sources_lib.NoUsableDocumentsError(
        f"data source {self.spec!r} gave no usable document in {dry:,} records read in a row "
        f"({seconds:.0f} s; {why}); skipped: {sources_lib.skip_summary(counts)}. Bounds: "
        f"data.max_unusable_records={records}, data.max_unusable_seconds={limit_s:g}")

  def _keep(self, position: int, length: int) -> bool:
    """Length-aware sampling: long documents always, short ones with probability 1 / weight."""
    if self.long_doc_weight <= 1.0 or 2 * length > self.budget.seq_len:
      return True
    return unit_coin(self.coin_seed, position) * self.long_doc_weight < 1.0

  def get_state(self):
    if self.cur is not None:
      doc_index, offset = self.cur[1], self.cur[2]
    else:
      doc_index, offset = self.next_doc, self.resume_offset
    return {"k3_reader": 1, "layout": copy.deepcopy(self.layout), "doc": doc_index,
            "offset": offset, "pending": [int(x) for x in self.pending],
            "records": [int(x) for x in self.records]}

  def set_state(self, state):
    self._set(state)

  def close(self):
    self._close_parent()
    self._parent_iter = None


class _ReaderDataset(grain.IterDataset):
  def __init__(self, **kwargs):
    super().__init__()
    self.kwargs = kwargs

  def __iter__(self):
    return SourceReader(**self.kwargs)


# --- resharding ---------------------------------------------------------------------------


def reshard_source(states: Sequence[dict], new_count: int) -> list[dict]:
  """Reader states of all old hosts of one source → states for `new_count` hosts (docstring)."""
  if new_count < 1:
    raise ValueError(f"new host count must be >= 1, got {new_count}")
  old = [s["layout"] for s in states]
  n = old[0]["count"]
  if len(states) != n or sorted(l["index"] for l in old) != list(range(n)) or any(
      (l["frontier"], l["count"], l["holes"]) != (old[0]["frontier"], n, old[0]["holes"]) for l in old):
    raise ValueError(f"resharding needs the states of all {n} hosts of one layout, got "
                     f"{len(states)} with indices {[l['index'] for l in old]}")
  f = old[0]["frontier"]
  nxt = {s["layout"]["index"]: f + s["layout"]["index"] + n * s["doc"] for s in states}
  frontier = min(nxt.values())
  holes = {g: o for g, o in old[0]["holes"] if g >= frontier}
  for s in states:
    q = s["layout"]["index"]
    for i in range(s["doc"]):
      g = f + q + n * i
      if g >= frontier:
        holes[g] = -1
    if s["offset"] > 0:
      holes[nxt[q]] = s["offset"]
  pending = np.sum([s["pending"] for s in states], axis=0).astype(np.int64)
  records = np.sum([s.get("records", [0] * len(RECORD_COUNTS)) for s in states], axis=0).astype(np.int64)
  out = []
  for q in range(new_count):
    out.append({"k3_reader": 1, "doc": 0, "offset": 0,
                "layout": {"frontier": frontier, "count": new_count, "index": q,
                           "holes": [[g, o] for g, o in sorted(holes.items())]},
                "pending": [int(x) for x in (pending if q == 0 else np.zeros_like(pending))],
                "records": [int(x) for x in (records if q == 0 else np.zeros_like(records))]})
  return out


def _find_mix_state(state):
  """The mixture's state (a dict with "parents") inside a grain pipeline state."""
  if isinstance(state, Mapping):
    if "parents" in state and isinstance(state["parents"], Mapping):
      return state
    for v in state.values():
      found = _find_mix_state(v)
      if found is not None:
        return found
  return None


def reader_states(state: Mapping[str, Any]) -> dict[str, dict]:
  """{source spec: reader state} at the batch boundary stored in an iterator state."""
  grain_state = state["grain"]
  if grain_state.get("next_row", 0) != 0:
    raise ValueError("the packer was saved mid-group; states saved between batches never are")
  mix = _find_mix_state(grain_state)
  if mix is None:
    raise ValueError("iterator state holds no source states")
  return {**state.get("idle", {}), **{k: v for k, v in mix["parents"].items()}}


# --- building -----------------------------------------------------------------------------

# Iterator settings that may differ between a saved state and the pipeline restoring it: the
# curriculum's data keys plus the batch and host layout (the mesh may change between stages).
STAGE_KEYS = config_lib.DATA_STAGE_KEYS + ("batch_size", "process_index", "process_count",
                                           "max_unusable_records", "max_unusable_seconds")
# Values of stage keys that states saved before the key existed stand for.
_STAGE_KEY_DEFAULTS = {"long_doc_weight": 1.0,
                       "max_unusable_records": sources_lib.MAX_UNUSABLE_RECORDS,
                       "max_unusable_seconds": sources_lib.MAX_UNUSABLE_SECONDS}
# The same for keys that must match on restore: states saved before the held-out split existed
# were read without one.
_FIXED_KEY_DEFAULTS = {"heldout_fraction": 0.0}


def _saved_config(state: Mapping[str, Any]) -> dict:
  """The pipeline config stored in an iterator state, with defaults for keys it predates."""
  return {**_FIXED_KEY_DEFAULTS, **_to_json_types(state.get("config", {}))}


def _vision_cfg(v) -> tuple[vision_lib.VisionConfig, bool, int, int]:
  """The `data.vision` section (dict or ConfigDict, or None) → (config, enabled, P, G)."""
  if v is None:
    return vision_lib.VisionConfig(), False, 0, 0
  cfg = vision_lib.VisionConfig(
      max_patches=int(_get(v, "max_patches")), max_side=int(_get(v, "max_side")),
      max_input_pixels=int(_get(v, "max_input_pixels")), video_fps=float(_get(v, "video_fps")),
      max_video_frames=int(_get(v, "max_video_frames")),
      max_video_frame_patches=int(_get(v, "max_video_frame_patches")),
      frames_per_chunk=int(_get(v, "frames_per_chunk")))
  return (cfg, bool(_get(v, "enabled")), int(_get(v, "max_patches_per_row")),
          int(_get(v, "max_grids_per_row")))


def pipeline_config(data_cfg, *, batch_size: int, seed: int, process_index: int,
                    process_count: int) -> dict:
  """The JSON description of a pipeline, stored in its state."""
  specs = _get(data_cfg, "sources", None)
  if specs is None:  # Older configs: one `source` string.
    specs = (_get(data_cfg, "source", "python_stdlib"),)
  specs = [str(s) for s in specs]
  weights = _get(data_cfg, "weights", None)
  weights = [1.0] * len(specs) if weights is None or not len(weights) else [float(w) for w in weights]
  v = _get(data_cfg, "vision", None)
  return {
      "sources": specs,
      "weights": weights,
      "tokenizer": _get(data_cfg, "tokenizer", "default"),
      "seq_len": _get(data_cfg, "seq_len"),
      "shuffle_seed": _get(data_cfg, "shuffle_seed", 0),
      "num_workers": int(_get(data_cfg, "num_workers", 0) or 0),
      "num_threads": int(_get(data_cfg, "num_threads", 1) or 0),
      "long_doc_weight": float(_get(data_cfg, "long_doc_weight", 1.0)),
      "heldout_fraction": float(_get(data_cfg, "heldout_fraction", 0.0) or 0.0),
      "max_unusable_records": int(_get(data_cfg, "max_unusable_records",
                                       sources_lib.MAX_UNUSABLE_RECORDS)),
      "max_unusable_seconds": float(_get(data_cfg, "max_unusable_seconds",
                                         sources_lib.MAX_UNUSABLE_SECONDS)),
      "vision": _to_json_types(dict(v)) if v is not None else None,
      "batch_size": batch_size,
      "seed": seed,
      "process_index": process_index,
      "process_count": process_count,
  }


def _check(config: dict) -> None:
  seq_len, batch_size = config["seq_len"], config["batch_size"]
  if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 2:
    raise ValueError(f"data.seq_len must be an int >= 2, got {seq_len!r}")
  if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
    raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
  if not 0 <= config["process_index"] < config["process_count"]:
    raise ValueError(f"need 0 <= process_index < process_count, got {config['process_index']}, "
                     f"{config['process_count']}")
  if config["num_workers"] < 0 or config["num_threads"] < 0:
    raise ValueError("data.num_workers and data.num_threads must be >= 0")
  specs, weights = config["sources"], config["weights"]
  if not specs:
    raise ValueError("data.sources must name at least one source")
  if len(set(specs)) != len(specs):
    raise ValueError(f"data.sources has duplicates: {specs}")
  for spec in specs:
    if spec.partition(":")[0] not in sources_lib.SOURCES:
      sources_lib.make_source(spec)                    # raises, listing the allowed names
  if len(weights) != len(specs) or any(not w >= 0 for w in weights) or not any(w > 0 for w in weights):
    raise ValueError(f"data.weights must be {len(specs)} numbers >= 0 (one per source), at least one "
                     f"positive, got {weights}")
  if not config.get("long_doc_weight", 1.0) >= 1.0:
    raise ValueError(f"data.long_doc_weight must be >= 1, got {config['long_doc_weight']}")
  if not 0 <= config.get("heldout_fraction", 0.0) < 1:
    raise ValueError(f"data.heldout_fraction must lie in [0, 1), got {config['heldout_fraction']}")


def _build(config: dict, reader_init: Mapping[str, dict] | None) -> tuple[grain.IterDataset, dict]:
  """The dataset and the states of the idle (weight 0) sources."""
  _check(config)
  specs, weights = config["sources"], config["weights"]
  seq_len, batch_size = int(config["seq_len"]), int(config["batch_size"])
  vcfg, with_vision, max_patches_row, max_grids_row = _vision_cfg(config["vision"])
  if with_vision and (max_patches_row < 4 or max_grids_row < 1):
    raise ValueError("data.vision.max_patches_per_row must be >= 4 and max_grids_per_row >= 1")
  budget = documents.RowBudget(seq_len, max_patches_row if with_vision else 0,
                               max_grids_row if with_vision else 0)
  tok = tokenizer_lib.load_tokenizer(config["tokenizer"])
  encoder = documents.DocumentEncoder(tok, vcfg if with_vision else None, budget)
  read_options = grain.ReadOptions(num_threads=config["num_threads"], prefetch_buffer_size=_PREFETCH)
  heldout = float(config.get("heldout_fraction", 0.0))
  readers, idle = {}, {}
  for slot, spec in enumerate(specs):
    state = (reader_init or {}).get(spec) or initial_reader_state(config["process_index"],
                                                                  config["process_count"])
    if not weights[slot] > 0:
      idle[spec] = copy.deepcopy(state)
      continue
    stream_seed = _seed(config["shuffle_seed"], config["seed"], _spec_seed(spec))
    kwargs = {}
    if spec in sources_lib.RETRIEVAL_SOURCES:
      kwargs = dict(tokenizer=tok, seq_len=seq_len, seed=stream_seed)
    source = sources_lib.make_source(spec, **kwargs)  # ValueError lists allowed names.
    if len(source) < config["process_count"]:
      raise ValueError(f"source {spec!r} has {len(source)} documents, fewer than "
                       f"process_count={config['process_count']}")
    if heldout > 0 and spec not in sources_lib.RETRIEVAL_SOURCES:
      source = _KeepPositions(split_lib.SplitSource(source, heldout, "train"))
    stream = source_stream(source, stream_seed)
    readers[spec] = _ReaderDataset(slot=slot, num_slots=len(specs), stream=stream, encoder=encoder,
                                   budget=budget, with_vision=with_vision, read_options=read_options,
                                   mp_workers=config["num_workers"], state=state,
                                   long_doc_weight=config.get("long_doc_weight", 1.0), spec=spec,
                                   max_unusable_records=config.get("max_unusable_records",
                                                                   sources_lib.MAX_UNUSABLE_RECORDS),
                                   max_unusable_seconds=config.get("max_unusable_seconds",
                                                                   sources_lib.MAX_UNUSABLE_SECONDS),
                                   coin_seed=_seed(stream_seed, 1))
  mixed = grain.IterDataset.mix(readers, {s: w for s, w in zip(specs, weights) if w > 0})  # also for one source:
  # the state layout (mix → {spec: reader}) is then the same for every pipeline.
  length_struct = {TOKENS: seq_len + 1}
  if with_vision:
    length_struct.update(vision_patches=max_patches_row, vision_grids=max_grids_row)
  packed = FirstFitPackIterDataset(mixed, length_struct=length_struct, num_packing_bins=batch_size,
                                   shuffle_bins=False, meta_features=(_STATS,))
  packed = packed.map(_SumStats(_stats_width(len(specs))))
  ids = tok.special_ids
  no_loss = [ids[tokenizer_lib.IMAGE_PAD], ids[tokenizer_lib.IMAGE_END], ids[tokenizer_lib.VIDEO_END]]
  ds = packed.batch(batch_size, drop_remainder=True).map(_Finalize(no_loss, with_vision))
  return ds, idle


class DataIterator(grain.DatasetIterator):
  """The batch iterator: a grain DatasetIterator with a JSON-native, restorable state.

  `metrics()` gives cumulative per-source skip counters ("errors/<source>/<reason>"), record
  counters ("records/<source>/read", ".../skipped": records read, and those skipped wholly or in
  part), batches, and of the last batch the padding fraction and the share of tokens from
  documents longer than seq_len / 2 (`long_doc_share`); the counters are part of the state.
  """

  def __init__(self, config: dict, reader_init: Mapping[str, dict] | None = None):
    self._config = config
    self._closed = True  # Until built: a failed build must not break grain's __del__/close.
    ds, self._idle = _build(config, reader_init)
    super().__init__()
    self._it = iter(ds)
    self._errors = np.zeros((len(config["sources"]), len(REASONS)), np.int64)
    self._records = np.zeros((len(config["sources"]), len(RECORD_COUNTS)), np.int64)
    self._batches = 0
    self._last_padding = 0.0
    self._last_long_share = 0.0

  def __next__(self) -> dict[str, np.ndarray]:
    batch = dict(next(self._it))
    n_src = len(self._config["sources"])
    n_err, n_rec = n_src * len(REASONS), n_src * len(RECORD_COUNTS)
    stats = np.asarray(batch.pop(_STATS)).reshape(-1, _stats_width(n_src)).sum(axis=0)
    self._errors += stats[:n_err].reshape(self._errors.shape)
    self._records += stats[n_err:n_err + n_rec].reshape(self._records.shape)
    long_tokens, tokens = stats[n_err + n_rec:]
    self._last_long_share = float(long_tokens / tokens) if tokens else 0.0
    self._batches += 1
    self._last_padding = padding_fraction(batch)
    return batch

  @property
  def long_doc_share(self) -> float:
    """Share of the last batch's tokens from documents longer than seq_len / 2."""
    return self._last_long_share

  def metrics(self) -> dict[str, float]:
    out = {"batches": float(self._batches), "padding_fraction": self._last_padding,
           "long_doc_share": self._last_long_share}
    for s, spec in enumerate(self._config["sources"]):
      for r, reason in enumerate(REASONS):
        out[f"errors/{spec}/{reason}"] = float(self._errors[s, r])
      for c, count in enumerate(RECORD_COUNTS):
        out[f"records/{spec}/{count}"] = float(self._records[s, c])
    return out

  def get_state(self) -> dict[str, Any]:
    state = {"config": copy.deepcopy(self._config), "grain": _to_json_types(self._it.get_state()),
             "errors": self._errors.tolist(), "records": self._records.tolist(),
             "batches": self._batches}
    if self._idle:
      state["idle"] = copy.deepcopy(self._idle)
    return state

  def set_state(self, state: Mapping[str, Any]) -> None:
    if isinstance(state, Mapping) and "hosts" in state:
      return self._set_from_hosts(state["hosts"])
    if not isinstance(state, Mapping) or "grain" not in state:
      keys = list(state)[:5] if isinstance(state, Mapping) else None
      raise ValueError("iterator state must be a dict from DataIterator.get_state() (or "
                       f"{{'hosts': [...]}}), got {type(state).__name__} with keys {keys}")
    saved = _saved_config(state)
    fixed = {k: v for k, v in saved.items() if k not in STAGE_KEYS}
    mine = {k: v for k, v in self._config.items() if k not in STAGE_KEYS}
    if fixed != mine:
      diff = sorted(k for k in set(fixed) | set(mine) if fixed.get(k) != mine.get(k))
      raise ValueError(f"iterator state was saved by a pipeline that differs in {diff} "
                       f"(saved {[fixed.get(k) for k in diff]}, now {[mine.get(k) for k in diff]}); "
                       f"only {STAGE_KEYS} may change on restore")
    same_layout = all(saved.get(k) == self._config[k] for k in ("process_index", "process_count"))
    if not same_layout:
      if saved.get("process_count") != 1 or self._config["process_count"] != 1:
        raise ValueError(f"this state belongs to host {saved.get('process_index')} of "
                         f"{saved.get('process_count')}; restoring on host {self._config['process_index']} "
                         f"of {self._config['process_count']} needs all hosts' states: "
                         "set_state({'hosts': [state of host 0, ...]})")
    if all(saved.get(k, _STAGE_KEY_DEFAULTS.get(k)) == self._config[k]
           for k in STAGE_KEYS if k not in ("num_workers", "num_threads", "max_unusable_records",
                                            "max_unusable_seconds")):
      self._it.set_state(copy.deepcopy(state["grain"]))   # Exact continuation.
      self._idle = copy.deepcopy(dict(state.get("idle", {})))
    else:
      self._restart(reader_states(state))
    self._errors = np.asarray(state.get("errors", np.zeros_like(self._errors)), np.int64).reshape(self._errors.shape)
    self._records = np.asarray(state.get("records", np.zeros_like(self._records)),   # older states: none
                               np.int64).reshape(self._records.shape)
    self._batches = int(state.get("batches", 0))

  def _set_from_hosts(self, host_states: Sequence[Mapping[str, Any]]) -> None:
    """Restores from all old hosts' states onto this host (any host count)."""
    host_states = sorted(host_states, key=lambda s: s["config"]["process_index"])
    if len(host_states) == 1 and self._config["process_count"] == 1:
      return self.set_state(host_states[0])
    n_new, q = self._config["process_count"], self._config["process_index"]
    per_source = [reader_states(s) for s in host_states]
    for s in host_states:  # Check compatibility (and anything but the layout) once per host.
      probe = dict(_saved_config(s), process_index=0, process_count=1)
      saved = {k: v for k, v in probe.items() if k not in STAGE_KEYS}
      mine = {k: v for k, v in self._config.items() if k not in STAGE_KEYS}
      if saved != mine:
        raise ValueError("host states were saved by a different pipeline; cannot reshard")
    init = {}
    for spec in self._config["sources"]:
      init[spec] = reshard_source([p[spec] for p in per_source], n_new)[q]
    self._restart(init)
    errors = np.sum([np.asarray(s.get("errors", 0), np.int64) for s in host_states], axis=0)
    self._errors = (errors if q == 0 else np.zeros_like(errors)).reshape(self._errors.shape)
    records = np.sum([np.asarray(s.get("records", np.zeros_like(self._records)), np.int64)
                      for s in host_states], axis=0).reshape(self._records.shape)
    self._records = records if q == 0 else np.zeros_like(records)
    self._batches = int(max(s.get("batches", 0) for s in host_states))

  def _restart(self, init: Mapping[str, dict]) -> None:
    self._it.close()
    ds, self._idle = _build(self._config, init)
    self._it = iter(ds)

  def close(self) -> None:
    if getattr(self, "_it", None) is not None:
      self._it.close()
    super().close()

  def __str__(self) -> str:
    return f"DataIterator({self._config})"


TextIterator = DataIterator  # Older name, used by the training loop.


def make_iterator(data_cfg, *, batch_size: int, seed: int, process_index: int = 0,
                  process_count: int = 1) -> DataIterator:
  """A checkpointable iterator over this host's batches (format in the module docstring).

  `data_cfg` is the `data` config section (configs/k3_full.py); `batch_size` the per-host
  batch. Iterators built with the same arguments yield identical batches; hosts with different
  `process_index` read disjoint documents.
  """
  config = pipeline_config(data_cfg, batch_size=batch_size, seed=seed, process_index=process_index,
                           process_count=process_count)
  return DataIterator(config)


make_text_iterator = make_iterator
