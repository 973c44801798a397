"""Evals at the training length: held-out loss by position and synthetic retrieval accuracy.

    evaluator = evals.Evaluator(stage_cfg, run)     # one compiled forward for the stage's [B, T]
    metrics = evaluator(state)                      # {"eval/loss": ..., "eval/retrieval/passkey": ...}
    held_out = evaluator.held_out(state)            # the loss part only (python -m k3train.tools.eval)

Every eval reads the same rows, so evals of one stage compare across steps:

  held-out loss   the eval batches of k3train/train/evaluation.py (`eval.batches` batches per
                  eval source: the held-out part of a training source, or all of a separate
                  validation source), packed at the stage's seq_len T and batch. The mean
                  next-token loss ("eval/loss", "eval/tokens", per source "eval/loss/<source>",
                  "eval/tokens/<source>", as `evaluation.evaluate` names them) and the loss by
                  position inside the packed piece (the context the model sees), in buckets with
                  edges 0, T/2^(n-1), …, T/4, T/2, T (n = eval.position_buckets):
                  "eval/loss_by_pos/<lo>_<hi>" and "eval/tokens_by_pos/<lo>_<hi>". With a model
                  that uses its context, the loss falls from bucket to bucket.
  retrieval       for each task of `eval.retrieval`, train.global_batch_size generated documents
                  of exactly T tokens (k3train/data/retrieval.py, seeded by eval.seed, so never a
                  training document); a row is correct when the argmax prediction of every answer
                  token is right (teacher forcing): "eval/retrieval/<task>" = share of correct
                  rows, and their mean "eval/retrieval/mean".

The forward is the training forward (text only: vision inputs are not fed; the next-token head
only, never the MTP module) on the stage's mesh; nothing of the state changes. With
train.loss_chunk_tokens > 0 the head runs chunked as in the train step (no [B, T, V] logits).
The loop calls the evaluator every eval.every_steps steps; `python -m k3train.tools.eval` calls
`held_out` on a restored checkpoint.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from k3train.data import retrieval
from k3train.data import tokenizer as tokenizer_lib
from k3train.parallel import sync
from k3train.train import evaluation
from k3train.train import head_loss

EVAL_KEYS = ("tokens", "targets", "segment_ids", "positions", "loss_mask", "answer_mask")


def position_edges(seq_len: int, buckets: int) -> list[int]:
  """Bucket edges 0, T/2^(n-1), …, T/2, T (duplicates dropped for short T)."""
  edges = [0] + [max(1, seq_len >> (buckets - 1 - k)) for k in range(buckets)]
  return sorted(set(edges))


def make_eval_step(run, edges, loss_chunk_tokens: int = 0):
  """Jitted (params, rest, batch) → per-bucket loss sums and counts, per-row answer correctness.

  loss_chunk_tokens (`train.loss_chunk_tokens`) > 0: each position's nll and argmax come from the
  chunked head (`head_loss.chunked_token_stats`: fp32 logits of a head-dtype GEMM, c positions
  of every row at a time), so no [B, T, V] logits exist, as in the train step. 0: the model's
  logits. Both resolve argmax ties to the lowest token id.
  """
  layout, graphdef = run.layout, run.graphdef
  inner = jnp.asarray(edges[1:-1], jnp.int32)
  buckets = len(edges) - 1

  def step(params, rest, batch):
    with layout.activate():
      model = nnx.merge(graphdef, params, rest, copy=True)
      token_mask = (batch["segment_ids"] > 0).astype(jnp.float32)
      if loss_chunk_tokens > 0:
        h_btd = model.hidden_states(batch["tokens"], batch["segment_ids"], token_mask)
        head = model.lm_head
        nll, argmax_bt = head_loss.chunked_token_stats(
            model.final_norm(h_btd), head.kernel[...], batch["targets"],
            chunk_tokens=loss_chunk_tokens, dtype=head.dtype,
            lse_backend=getattr(model, "head_lse_backend", "xla"))
      else:
        logits = model(batch["tokens"], batch["segment_ids"], token_mask).astype(jnp.float32)
    if loss_chunk_tokens <= 0:
      nll = jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(
          logits, batch["targets"][..., None], axis=-1)[..., 0]                   # [B, T]
      argmax_bt = jnp.argmax(logits, axis=-1)
    bucket = jnp.searchsorted(inner, batch["positions"], side="right")            # [B, T]
    weight = jax.nn.one_hot(bucket, buckets) * batch["loss_mask"][..., None]     # [B, T, n]
    wrong = (argmax_bt != batch["targets"]).astype(jnp.float32)
    answer = batch["answer_mask"]
    return {"loss_sum": jnp.sum(weight * nll[..., None], axis=(0, 1)),
            "count": jnp.sum(weight, axis=(0, 1)),
            "correct": (jnp.sum(wrong * answer, axis=1) == 0) & (jnp.sum(answer, axis=1) > 0),
            "has_answer": jnp.sum(answer, axis=1) > 0}

  batch_sh = {k: layout.batch for k in EVAL_KEYS}
  return jax.jit(step, in_shardings=(run.shardings.params, run.shardings.rest, batch_sh),
                 out_shardings=layout.replicated)


class Evaluator:
  """Evals of one stage (its config and its built run: mesh, shardings, graphdef)."""

  def __init__(self, cfg: ml_collections.ConfigDict, run):
    self.cfg, self.run = cfg, run
    ev = cfg.eval
    self.seq_len = cfg.data.seq_len
    self.process_count, self.process_index = jax.process_count(), jax.process_index()
    self.rows = cfg.train.global_batch_size // self.process_count
    self.edges = position_edges(self.seq_len, ev.position_buckets)
    self.step = sync.CompiledTogether(
        make_eval_step(run, self.edges, cfg.train.loss_chunk_tokens), "eval step")
    self.tok = tokenizer_lib.load_tokenizer(cfg.data.tokenizer)
    self._held_out = None

  def held_out_batches(self) -> dict[str, list[dict[str, np.ndarray]]]:
    """{eval source: this host's rows of its eval batches}, built once per stage."""
    if self._held_out is None:
      self._held_out = {}
      if self.cfg.eval.batches:
        sets = evaluation.eval_set(self.cfg, process_index=self.process_index,
                                   process_count=self.process_count)
        zeros = np.zeros((self.rows, self.seq_len), np.float32)
        self._held_out = {spec: [dict(b, answer_mask=zeros) for b in batches]
                          for spec, batches in sets.batches.items()}
    return self._held_out

  def retrieval_batch(self, task: str) -> dict[str, np.ndarray]:
    return retrieval.eval_rows(self.tok, task, seed=self.cfg.eval.seed, seq_len=self.seq_len,
                               first=self.process_index * self.rows, rows=self.rows)

  def _run(self, state, host_batch):
    batch = self.run.layout.global_batch({k: host_batch[k] for k in EVAL_KEYS})
    return jax.device_get(self.step(state.params, state.rest, batch))

  def __call__(self, state) -> dict[str, float]:
    """Every eval of the stage: `held_out` and `retrieval`."""
    return {**self.held_out(state), **self.retrieval(state)}

  def held_out(self, state) -> dict[str, float]:
    """The held-out loss (overall, per source, by position) and the tokens it counts."""
    out = {}
    total_sum = total_count = 0.0
    for spec, batches in self.held_out_batches().items():
      loss_sum = count = 0.0
      for batch in batches:
        r = self._run(state, batch)
        loss_sum, count = loss_sum + r["loss_sum"], count + r["count"]
      out[f"eval/tokens/{spec}"] = float(np.sum(count))
      if np.sum(count) > 0:
        out[f"eval/loss/{spec}"] = float(np.sum(loss_sum) / np.sum(count))
      total_sum, total_count = total_sum + loss_sum, total_count + count
    if np.sum(total_count) > 0:
      out["eval/tokens"] = float(np.sum(total_count))
      out["eval/loss"] = float(np.sum(total_sum) / np.sum(total_count))
      for k, (lo, hi) in enumerate(zip(self.edges[:-1], self.edges[1:])):
        out[f"eval/tokens_by_pos/{lo}_{hi}"] = float(total_count[k])
        if total_count[k] > 0:
          out[f"eval/loss_by_pos/{lo}_{hi}"] = float(total_sum[k] / total_count[k])
    return out

  def retrieval(self, state) -> dict[str, float]:
    """The retrieval accuracy of every task of eval.retrieval that fits the stage's length."""
    out = {}
    scores = []
    for task in self.cfg.eval.retrieval:
      try:
        batch = self.retrieval_batch(task)
      except ValueError:          # the stage's length is shorter than the task's fixed parts
        continue
      r = self._run(state, batch)
      acc = float(np.sum(r["correct"]) / max(np.sum(r["has_answer"]), 1))
      out[f"eval/retrieval/{task}"] = acc
      scores.append(acc)
    if scores:
      out["eval/retrieval/mean"] = float(np.mean(scores))
    return out


__all__ = ["EVAL_KEYS", "Evaluator", "make_eval_step", "position_edges"]
