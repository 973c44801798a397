"""Held-out evaluation: a split of every training source that training never reads, fixed eval
batches built from it, and `evaluate(model_or_fn, batches)`.

    eval_data = evaluation.eval_set(cfg, process_index=q, process_count=n)   # once per run/stage
    loss_step = evaluation.make_loss_step(run.graphdef, run.layout,
                                          loss_chunk_tokens=cfg.train.loss_chunk_tokens)
    metrics = evaluation.evaluate(
        lambda b: loss_step(state.params, state.rest, run.layout.global_batch(b)), eval_data.batches)
    # {"eval/loss": …, "eval/loss/<source>": …, "eval/tokens/<source>": …}

The split (k3train/data/split.py): a document is held out when a hash of its id (what it is:
a file's path, a JSONL line's file and offset, ...) falls below data.heldout_fraction; the
training pipeline reads every training source through `SplitSource(source, fraction, "train")`,
so training never reads a held-out document, and the eval batches below are packed from them.
`DocumentIds`, `document_id`, `heldout_value`, `is_heldout` and `SplitSource` are re-exported
here.

Eval sources. `eval.sources` names source specs as in `data.sources`; a spec that is also a
training source is evaluated on its held-out part only, any other spec (a dedicated validation
set) on all of it. `eval.batches` batches of train.global_batch_size rows × data.seq_len tokens
are packed per source, first-fit like the training pipeline (documents cut into pieces of at most
seq_len + 1 tokens that overlap by one token; positions restart in every piece; text only, media
segments are left out), in a fixed order spread over the source (`scan_order`, seeded by
eval.seed), so every evaluation of a run reads the same rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from k3train.data import sources as sources_lib
from k3train.data.split import (DocumentIds, SplitSource, document_id, heldout_value,
                                is_heldout)


# --- the order eval documents are taken in ---------------------------------------------------


def scan_order(n: int, seed: int = 0) -> Iterator[int]:
  """All of range(n) once, in a fixed order that jumps across the source (a stride near n/φ,
  coprime with n, from a seed-chosen start): the first documents taken are spread over it."""
  if n <= 0:
    return
  stride = max(1, int(n * 0.6180339887498949))
  while math.gcd(stride, n) != 1:
    stride += 1
  start = int.from_bytes(hashlib.sha256(f"scan/{seed}".encode()).digest()[:8], "big") % n
  for k in range(n):
    yield (start + k * stride) % n


# --- eval batches ---------------------------------------------------------------------------


@dataclasses.dataclass
class EvalSet:
  """Fixed eval batches per eval source (this process's rows) and the ids of the documents packed
  into them (all processes' rows)."""
  batches: dict[str, list[dict[str, np.ndarray]]]
  documents: dict[str, list[str]]
  heldout: dict[str, bool]                     # True: the held-out part of a training source

  @property
  def num_tokens(self) -> dict[str, int]:
    return {k: int(sum(float(np.sum(b["loss_mask"])) for b in v)) for k, v in self.batches.items()}


def _pieces(tokens: np.ndarray, seq_len: int) -> Iterator[np.ndarray]:
  """A document's pieces of at most seq_len + 1 tokens, overlapping by one token, so every
  next-token transition is scored once (the rule of k3train/data/documents.py for text)."""
  start, n = 0, len(tokens)
  while n - start >= 2:
    end = min(start + seq_len, n - 1)
    yield tokens[start:end + 1]
    start = end


def pack_documents(documents: Iterable[tuple[str, np.ndarray]], *, seq_len: int, rows: int,
                   max_batches: int) -> tuple[list[dict[str, np.ndarray]], list[str]]:
  """(id, token ids) documents → up to `max_batches` packed batches of `rows` × (seq_len + 1)
  tokens (first-fit over the batch's rows, as the pipeline packs) and the ids that made it in.

  Returns rows as the packer's fields "tokens", "tokens_segment_ids", "tokens_positions"; a
  final batch that is not full is kept (its free rows are padding)."""
  width = seq_len + 1
  batches, used, used_set = [], [], set()

  def new_batch():
    return {"tokens": np.zeros((rows, width), np.int32),
            "tokens_segment_ids": np.zeros((rows, width), np.int32),
            "tokens_positions": np.zeros((rows, width), np.int32)}, [0] * rows, [0] * rows

  batch, fill, segments = new_batch()
  started = False
  for doc_id, tokens in documents:
    for piece in _pieces(np.asarray(tokens, np.int32), seq_len):
      row = next((r for r in range(rows) if width - fill[r] >= len(piece)), None)
      if row is None:
        batches.append(batch)
        if len(batches) == max_batches:
          return batches, used
        batch, fill, segments = new_batch()
        row = 0
      a, b = fill[row], fill[row] + len(piece)
      segments[row] += 1
      batch["tokens"][row, a:b] = piece
      batch["tokens_segment_ids"][row, a:b] = segments[row]
      batch["tokens_positions"][row, a:b] = np.arange(len(piece), dtype=np.int32)
      fill[row] = b
      started = True
      if doc_id not in used_set:
        used_set.add(doc_id)
        used.append(doc_id)
  if started and any(fill) and len(batches) < max_batches:
    batches.append(batch)
  return batches, used


def _encoded_documents(source, indices: Iterable[int], ids: DocumentIds,
                       tok) -> Iterator[tuple[str, np.ndarray]]:
  """(id, token ids + eos) of the given documents; text only, empty and bad records skipped."""
  from k3train.data import documents as documents_lib
  encoder = documents_lib.DocumentEncoder(tok, None, documents_lib.RowBudget(2, 0, 0))
  for i in indices:
    item = source[i]
    if item is None or isinstance(item, sources_lib.BadRecord):
      continue
    encoded = encoder.map(item)
    if len(encoded.tokens) >= 2:
      yield ids(i), encoded.tokens


def _shift(packed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
  from k3train.data import pipeline
  return pipeline.shift_packed(packed)


def eval_sources(cfg) -> list[str]:
  """The eval source specs: eval.sources, or (empty) every training source with a positive weight
  except generated retrieval data (scored by eval.retrieval)."""
  specs = [str(s) for s in cfg.eval.sources]
  if not specs:
    generated = getattr(sources_lib, "RETRIEVAL_SOURCES", ())
    specs = [str(s) for s, w in zip(cfg.data.sources, cfg.data.weights)
             if w > 0 and str(s) not in generated]
  return specs


def eval_set(cfg, *, rows: int | None = None, process_index: int = 0, process_count: int = 1,
             log: Callable[[str], None] | None = None) -> EvalSet:
  """The eval batches of a validated config (module docstring): `rows` global rows per batch
  (default train.global_batch_size), of which process q of n keeps rows [q·r, (q+1)·r)."""
  from k3train.data import tokenizer as tokenizer_lib
  rows = int(rows or cfg.train.global_batch_size)
  if rows % process_count:
    raise ValueError(f"{rows} eval rows do not split over {process_count} processes")
  per_host = rows // process_count
  fraction = float(cfg.data.heldout_fraction)
  seed = int(cfg.eval.get("seed", 0))
  tok = tokenizer_lib.load_tokenizer(cfg.data.tokenizer)
  training = set(str(s) for s in cfg.data.sources)
  out = EvalSet({}, {}, {})
  for spec in eval_sources(cfg):
    if spec in getattr(sources_lib, "RETRIEVAL_SOURCES", ()):
      raise ValueError(f"eval source {spec!r} is generated retrieval data; score it with "
                       "eval.retrieval instead of eval.sources")
    heldout = spec in training
    if heldout and fraction <= 0:
      raise ValueError(f"eval source {spec!r} is a training source, so it is evaluated on its "
                       "held-out part, but data.heldout_fraction is 0: set it > 0 (e.g. 0.01) "
                       "or name a separate validation source in eval.sources")
    source = sources_lib.make_source(spec)
    ids = DocumentIds(source)
    order = scan_order(len(source), seed)
    if heldout:
      order = (i for i in order if is_heldout(ids(i), fraction))
    packed, used = pack_documents(_encoded_documents(source, order, ids, tok), seq_len=cfg.data.seq_len,
                                  rows=rows, max_batches=cfg.eval.batches)
    if not packed:
      raise ValueError(f"eval source {spec!r} has no documents to evaluate"
                       + (f" in its held-out part (data.heldout_fraction={fraction}); raise it"
                          if heldout else ""))
    if log is not None and len(packed) < cfg.eval.batches:
      log(f"eval source {spec}: only {len(packed)} of eval.batches={cfg.eval.batches} batches "
          "of documents available")
    lo = process_index * per_host
    out.batches[spec] = [_shift({k: v[lo:lo + per_host] for k, v in b.items()}) for b in packed]
    out.documents[spec] = used
    out.heldout[spec] = heldout
  return out


# --- evaluation -----------------------------------------------------------------------------


def make_loss_step(graphdef, layout=None, *, loss_chunk_tokens: int = 0):
  """Jitted (params, rest, batch) → (mean next-token loss, loss tokens): the next-token part of
  the training loss (k3train/train/step.py; never an MTP term) of any model called as K3Model,
  without gradients; nothing of the state changes. With a `layout` the model traces on its mesh
  and rules and the two scalars come back replicated.

  loss_chunk_tokens (`train.loss_chunk_tokens`) > 0: the head runs fused and chunked, as in
  training (`step.head_loss`, k3train/train/head_loss.py: loss only, chunk by chunk, no
  [B, T, V] logits), so evaluation needs no more memory than the train step; the model needs
  `hidden_states`, `final_norm` and `lm_head` as K3Model has them. 0: the model's logits.
  """
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from k3train.train import step as step_lib

  def loss_step(params, rest, batch):
    scope = layout.activate() if layout is not None else contextlib.nullcontext()
    with scope:
      model = nnx.merge(graphdef, params, rest, copy=True)
      token_mask = (batch["segment_ids"] > 0).astype(jnp.float32)
      mask = step_lib.loss_mask_of(batch, getattr(model, "placeholder_id", None))
      if loss_chunk_tokens > 0:
        h_btd = model.hidden_states(batch["tokens"], batch["segment_ids"], token_mask)
        return step_lib.head_loss(model, model.final_norm(h_btd), batch["targets"], mask,
                                  loss_chunk_tokens)
      logits = model(batch["tokens"], batch["segment_ids"], token_mask)
      return step_lib.cross_entropy(logits, batch["targets"], mask)

  return jax.jit(loss_step, out_shardings=layout.replicated if layout is not None else None)


def _as_loss_fn(model_or_fn, loss_chunk_tokens: int = 0
                ) -> Callable[[Mapping[str, Any]], tuple[float, float]]:
  """An nnx model (evaluated with the training loss; `make_loss_step`'s loss_chunk_tokens) or a
  callable batch → (loss, tokens) or → {"loss": …, "tokens": …}."""
  from flax import nnx
  if isinstance(model_or_fn, nnx.Module):
    graphdef, params, rest = nnx.split(model_or_fn, nnx.Param, ...)
    step = make_loss_step(graphdef, loss_chunk_tokens=loss_chunk_tokens)
    return lambda batch: step(params, rest, dict(batch))
  if not callable(model_or_fn):
    raise TypeError(f"evaluate needs an nnx model or a callable, got {type(model_or_fn).__name__}")

  def fn(batch):
    out = model_or_fn(batch)
    if isinstance(out, Mapping):
      return out["loss"], out["tokens"]
    return out
  return fn


def evaluate(model_or_fn, batches: Mapping[str, Sequence[Mapping[str, Any]]] | Sequence[Mapping[str, Any]],
             *, loss_chunk_tokens: int = 0) -> dict[str, float]:
  """Held-out loss of every named batch list, token-weighted over its batches:
  "eval/loss/<name>", "eval/tokens/<name>", and over all of them "eval/loss", "eval/tokens".
  A bare list of batches is named "heldout". Every batch is dispatched before any result is read,
  so device work overlaps the host's. loss_chunk_tokens: an nnx model's head (`make_loss_step`)."""
  if not isinstance(batches, Mapping):
    batches = {"heldout": batches}
  fn = _as_loss_fn(model_or_fn, loss_chunk_tokens)
  results = {name: [fn(b) for b in bs] for name, bs in batches.items()}
  out: dict[str, float] = {}
  total_sum = total_tokens = 0.0
  for name, rs in results.items():
    loss_sum = tokens = 0.0
    for loss, n in rs:
      n = float(n)
      loss_sum += float(loss) * n
      tokens += n
    out[f"eval/tokens/{name}"] = tokens
    if tokens > 0:
      out[f"eval/loss/{name}"] = loss_sum / tokens
    total_sum, total_tokens = total_sum + loss_sum, total_tokens + tokens
  out["eval/tokens"] = total_tokens
  if total_tokens > 0:
    out["eval/loss"] = total_sum / total_tokens
  return out


__all__ = ["DocumentIds", "EvalSet", "SplitSource", "document_id", "eval_set", "eval_sources",
           "evaluate", "heldout_value", "is_heldout", "make_loss_step", "pack_documents",
           "scan_order"]
