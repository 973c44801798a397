"""The text input pipeline: documents → shuffled epochs → tokens → packed rows → batches.

Built from grain datasets, so the iterator is deterministic and checkpointable:

  MapDataset(source)[host shard] → shuffle(seed, reshuffled each epoch) → repeat forever
    → tokenize one document per element (+ EOS), lazily → IterDataset
    → concat-then-split packing into rows of seq_len + 1 tokens (long documents continue
      in the next row) → batch → shift into inputs/targets (vectorised over the batch).

Batch format (all numpy, B = batch_size, T = seq_len):
  tokens       [B, T] int32    input ids
  targets      [B, T] int32    the next token of each input
  segment_ids  [B, T] int32    1, 2, ... per document piece within a row; 0 = padding
  positions    [B, T] int32    position within the document piece; restarts at 0 for each
                               new segment (a document continued from the previous row
                               restarts too: attention never crosses rows, so only relative
                               positions inside the row matter)
  loss_mask    [B, T] float32  1 where `targets` is the real next token of the same
                               document; 0 on padding and at each document's last row token
                               whose next token starts another document.

Rows hold seq_len + 1 packed tokens so each row's targets are its own inputs shifted by one;
the row's final token is therefore a target only. Concat-then-split packing leaves no
padding on an endless stream, so the padding fraction is ~0; it is reported anyway.

The iterator's state (`get_state()`) is plain JSON (dicts, lists, ints, strings), so the
trainer can store it next to the model in the checkpoint; `set_state` restores exactly.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from absl import flags as absl_flags
import grain
from grain.experimental import ConcatThenSplitIterDataset
import numpy as np

from k3train.data import sources
from k3train.data import tokenizer as tokenizer_lib

TOKENS = "tokens"
BATCH_KEYS = ("tokens", "targets", "segment_ids", "positions", "loss_mask")
# One background thread tokenizes the next documents while the trainer computes; a small
# buffer keeps the first batch fast and memory flat. Order stays deterministic.
_READ_OPTIONS = grain.ReadOptions(num_threads=1, prefetch_buffer_size=8)


class TokenizeDocument(grain.transforms.Map):
  """text → {"tokens": int32[n + 1]} (the document's ids then EOS); None for blank text."""

  def __init__(self, tok: tokenizer_lib.Tokenizer):
    self.tok = tok

  def map(self, text):
    if text is None or not text.strip():
      return None  # Dropped by to_iter_dataset: unreadable files and empty __init__.py.
    ids = self.tok.encode(text)
    ids.append(self.tok.eos_id)
    return {TOKENS: np.asarray(ids, dtype=np.int32)}


def shift_packed(packed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Turns packed rows of T + 1 tokens into T-long training examples (module docstring).

  `packed` holds "tokens", "tokens_segment_ids" and "tokens_positions" of equal shape
  [..., T + 1] as produced by grain's packing (segment id 0 marks padding); works on one row
  or a batch of rows.
  """
  tokens = np.asarray(packed[TOKENS], dtype=np.int32)
  seg = np.asarray(packed[f"{TOKENS}_segment_ids"], dtype=np.int32)
  pos = np.asarray(packed[f"{TOKENS}_positions"], dtype=np.int32)
  if (tokens.ndim < 1 or tokens.shape[-1] < 2 or tokens.shape != seg.shape
      or tokens.shape != pos.shape):
    raise ValueError(f"packed features must share a shape [..., T + 1] with T >= 1, got "
                     f"{tokens.shape}, {seg.shape}, {pos.shape}")
  same_doc = (seg[..., :-1] != 0) & (seg[..., :-1] == seg[..., 1:])
  return {
      "tokens": tokens[..., :-1],
      "targets": tokens[..., 1:],
      "segment_ids": seg[..., :-1],
      "positions": pos[..., :-1],
      "loss_mask": same_doc.astype(np.float32),
  }


def padding_fraction(batch: Mapping[str, np.ndarray]) -> float:
  """Fraction of batch positions that are padding (segment id 0)."""
  seg = np.asarray(batch["segment_ids"])
  return float(np.mean(seg == 0)) if seg.size else 0.0


def _to_json_types(x: Any) -> Any:
  """Recursively turns tuples (and numpy scalars) into JSON-native lists / ints / floats."""
  if isinstance(x, Mapping):
    return {str(k): _to_json_types(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_to_json_types(v) for v in x]
  if isinstance(x, np.generic):
    return x.item()
  return x


def _from_json_types(x: Any) -> Any:
  """Inverse of `_to_json_types` for grain states: lists become tuples.

  grain's states hold no lists, only tuples (e.g. the packer's (start, stop) slices, which it
  compares against a tuple sentinel), so every JSON list is restored as a tuple.
  """
  if isinstance(x, Mapping):
    return {k: _from_json_types(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return tuple(_from_json_types(v) for v in x)
  return x


def state_to_json(state: Mapping[str, Any]) -> str:
  """Serialises an iterator state to a JSON string."""
  return json.dumps(_to_json_types(state), sort_keys=True)


def state_from_json(text: str) -> dict[str, Any]:
  """Parses a JSON string from `state_to_json` into a state for `set_state`."""
  return json.loads(text)


class TextIterator(grain.DatasetIterator):
  """The batch iterator; a grain DatasetIterator whose state is JSON-native.

  grain's own state holds tuples that JSON turns into lists; this wrapper hands out the
  JSON form and converts back on `set_state`, so `json.loads(json.dumps(it.get_state()))`
  restores exactly (also through grain's / orbax's JSON checkpointing).
  """

  def __init__(self, parent: grain.DatasetIterator, *, config: Mapping[str, Any]):
    super().__init__(parent)
    self._config = dict(config)

  def __next__(self) -> dict[str, np.ndarray]:
    return next(self._parent)

  def get_state(self) -> dict[str, Any]:
    return {"config": self._config, "grain": _to_json_types(self._parent.get_state())}

  def set_state(self, state: Mapping[str, Any]) -> None:
    if not isinstance(state, Mapping) or "grain" not in state:
      keys = list(state)[:5] if isinstance(state, Mapping) else None
      raise ValueError("iterator state must be a dict from TextIterator.get_state(), got "
                       f"{type(state).__name__} with keys {keys}")
    saved = _to_json_types(state.get("config", {}))
    if saved != self._config:
      raise ValueError(f"iterator state was saved by a pipeline with config {saved}, but this "
                       f"pipeline has {self._config}; restoring it would not resume exactly")
    self._parent.set_state(_from_json_types(state["grain"]))

  def __str__(self) -> str:
    return f"TextIterator({self._config})"


def _get(cfg, name: str, default=None):
  """Reads `cfg.name` from a ConfigDict / dict / object, with a default."""
  if isinstance(cfg, Mapping):
    return cfg.get(name, default)
  return getattr(cfg, name, default)


def _shuffle_seed(data_seed: int, seed: int) -> int:
  """Mixes the data config's shuffle seed and the run seed into one 32-bit seed."""
  return int(np.random.SeedSequence([int(data_seed), int(seed)]).generate_state(1)[0])


def document_dataset(source, *, seed: int, process_index: int = 0,
                     process_count: int = 1) -> grain.MapDataset:
  """This host's endless stream of documents: its shard, reshuffled every epoch.

  Host `p` of `n` owns documents p, p + n, p + 2n, ... of `source` (any random-access
  sequence), so hosts are disjoint and together cover the corpus; the shard is fixed before
  shuffling so it does not depend on the seed.
  """
  if not 0 <= process_index < process_count:
    raise ValueError(f"need 0 <= process_index < process_count, got {process_index}, "
                     f"{process_count}")
  if len(source) < process_count:
    raise ValueError(f"the source has {len(source)} documents, fewer than "
                     f"process_count={process_count}")
  ds = grain.MapDataset.source(source)
  ds = ds[process_index::process_count]
  ds = ds.shuffle(seed=seed)
  return ds.repeat(None)  # Epoch e uses permutation seed + e (grain reseeds per epoch).


def make_text_dataset(data_cfg, *, batch_size: int, seed: int, process_index: int = 0,
                      process_count: int = 1) -> grain.IterDataset:
  """The grain IterDataset of batches described in the module docstring."""
  source_name = _get(data_cfg, "source", "python_stdlib")
  seq_len = _get(data_cfg, "seq_len")
  num_workers = int(_get(data_cfg, "num_workers", 0) or 0)
  if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 2:
    raise ValueError(f"data.seq_len must be an int >= 2, got {seq_len!r}")
  if (isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer))
      or batch_size < 1):
    raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
  seq_len, batch_size = int(seq_len), int(batch_size)
  if not 0 <= process_index < process_count:
    raise ValueError(f"need 0 <= process_index < process_count, got {process_index}, "
                     f"{process_count}")
  if num_workers < 0:
    raise ValueError(f"data.num_workers must be >= 0, got {num_workers}")

  source = sources.make_source(source_name)  # ValueError lists allowed names.
  tok = tokenizer_lib.load_tokenizer(_get(data_cfg, "tokenizer", "default"))

  ds = document_dataset(source, seed=_shuffle_seed(_get(data_cfg, "shuffle_seed", 0), seed),
                        process_index=process_index, process_count=process_count)
  ds = ds.map(TokenizeDocument(tok))
  it_ds = ds.to_iter_dataset(_READ_OPTIONS)
  it_ds = ConcatThenSplitIterDataset(it_ds, length_struct={TOKENS: seq_len + 1})
  it_ds = it_ds.batch(batch_size, drop_remainder=True)
  it_ds = it_ds.map(shift_packed)  # Vectorised over the batch.
  if num_workers > 0:
    # grain's worker processes read absl flags; outside an absl app they are unparsed.
    if not absl_flags.FLAGS.is_parsed():
      absl_flags.FLAGS.mark_as_parsed()
    # Each worker packs its own slice of documents; batches are interleaved round-robin.
    # Deterministic for a fixed num_workers, but a different stream than num_workers=0.
    it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=num_workers))
  return it_ds


def make_text_iterator(data_cfg, *, batch_size: int, seed: int, process_index: int = 0,
                       process_count: int = 1) -> TextIterator:
  """A checkpointable iterator over this host's batches (format in the module docstring).

  `data_cfg` has fields source, tokenizer, seq_len, shuffle_seed, num_workers (see
  configs/k3_full.py). `batch_size` is the per-host batch. Iterators built with the same
  arguments yield identical batches; hosts with different `process_index` read disjoint
  document shards.
  """
  ds = make_text_dataset(data_cfg, batch_size=batch_size, seed=seed,
                         process_index=process_index, process_count=process_count)
  config = {
      "source": _get(data_cfg, "source", "python_stdlib"),
      "tokenizer": _get(data_cfg, "tokenizer", "default"),
      "seq_len": _get(data_cfg, "seq_len"),
      "shuffle_seed": _get(data_cfg, "shuffle_seed", 0),
      "num_workers": int(_get(data_cfg, "num_workers", 0) or 0),
      "batch_size": batch_size,
      "seed": seed,
      "process_index": process_index,
      "process_count": process_count,
  }
  return TextIterator(iter(ds), config=config)
