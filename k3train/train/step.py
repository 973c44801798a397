"""Train state and the jitted train step: loss, gradients, optimizer update, QB bias update.

The model is split once into (graphdef, params, rest): `params` are the nnx.Param leaves the
optimizer trains; `rest` holds non-gradient state (router biases, QB proposals, expert loads,
MLA max logits) that the forward pass writes and the step carries.

Gradient accumulation (`train.microbatches` = N > 1): the global batch runs as N sequential
micro-batches (rows i, i+N, i+2N, … form micro-batch i, so every device keeps an equal share of
each) under one `lax.scan`, with one optimizer update per step. Each micro-batch's mean loss is
weighted by its share of the step's loss tokens, so the loss and the gradients equal the
one-batch step's (up to summation order). Forward-written state is combined over the
micro-batches: expert loads summed, MLA max logits maxed, QB proposals averaged (the one
approximation: the mean of per-micro-batch quantile proposals, not the quantile over the whole
batch), anything else taken from the last micro-batch.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from k3train.parallel import axes as ax
from k3train.parallel.rules import constrain
from k3train.parallel.state_sharding import VISION_BATCH_KEYS
from k3train.model import moe
from k3train.model import mtp as mtp_lib
from k3train.model.mla import MaxLogit
from k3train.optim.qk_clip import qk_clip
from k3train.train.head_loss import fused_head_cross_entropy
from k3train.tree_paths import path_names


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
  step: jax.Array          # int32 scalar: steps taken (updates applied or skipped)
  params: Any              # nnx.State of nnx.Param
  rest: Any                # nnx.State of all other model variables
  opt_state: Any
  loss_ema: jax.Array      # fp32 running mean of the loss, for the loss-spike guard (0 = unset)
  skipped: jax.Array       # int32 number of updates the loss-spike guard skipped


def init_state(model: nnx.Module, optimizer: optax.GradientTransformation):
  """(graphdef, TrainState) for a freshly initialised model."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  # Distinct buffers for every scalar: the jitted step donates the whole state.
  return graphdef, TrainState(jnp.zeros((), jnp.int32), params, rest, optimizer.init(params),
                              jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))


def cross_entropy(logits_btv: jax.Array, targets_bt: jax.Array, mask_bt: jax.Array):
  """Mean next-token cross-entropy over mask, in fp32; returns (loss, number of counted tokens)."""
  logits = logits_btv.astype(jnp.float32)
  logz = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, targets_bt[..., None], axis=-1)[..., 0]
  mask = mask_bt.astype(jnp.float32)
  n = jnp.sum(mask)
  return jnp.sum((logz - target_logit) * mask) / jnp.maximum(n, 1.0), n


def _collect(rest, variable_type):
  """All leaves of one variable type in `rest`, flattened to a list of arrays."""
  return jax.tree.leaves(rest.filter(variable_type))


def per_layer(rest, variable_type):
  """One variable type's per-layer values stacked in layer order: [layers holding it, ...]
  (prefix layers, then the scanned super-blocks' layers, then the suffix); None when absent."""
  rows = []
  for path, leaf in jax.tree_util.tree_leaves_with_path(rest.filter(variable_type)):
    names = path_names(path)
    if names[0] == "stack":
      rows += [((1, n, int(names[2])), leaf[n]) for n in range(leaf.shape[0])]
    elif names[0] in ("prefix", "suffix"):
      rows.append(((0 if names[0] == "prefix" else 2, int(names[1]), 0), leaf))
  return jnp.stack([x for _, x in sorted(rows, key=lambda r: r[0])]) if rows else None


# Parameter groups of the per-group gradient norms ("grad_norm/<group>"), decided from the
# parameter's path: the embedding table and output head; each layer's mixer (KDA or MLA, told
# apart by parameters only that kind has); in MoE layers the router, the routed experts with the
# latent down / up projections and latent norm only they use, and the shared experts; the FFN of
# dense layers; the vision tower and projector; everything else (norms, AttnRes queries).
GRAD_GROUPS = ("embeddings", "kda", "mla", "router", "moe_experts", "moe_shared", "dense_ffn",
               "vision", "other")
_KDA_ONLY = frozenset({"A_log", "dt_bias", "f_a_proj", "f_b_proj", "b_proj"})
_MLA_ONLY = frozenset({"q_a_proj", "q_b_proj", "kv_a_proj", "kv_b_proj"})


def grad_groups(tree) -> list[str]:
  """The group (GRAD_GROUPS) of every leaf of a parameter-shaped tree, in `jax.tree.leaves` order."""
  paths = [tuple(path_names(p)) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]

  def owner(names, module):
    return names[:names.index(module) + 1]

  mixer_kind, moe_ffns = {}, set()
  for names in paths:
    if "mixer" in names:
      inside = set(names[names.index("mixer") + 1:])
      if inside & _MLA_ONLY:
        mixer_kind[owner(names, "mixer")] = "mla"
      elif inside & _KDA_ONLY:
        mixer_kind.setdefault(owner(names, "mixer"), "kda")
    if "ffn" in names and {"experts", "router"} & set(names[names.index("ffn") + 1:]):
      moe_ffns.add(owner(names, "ffn"))

  def group(names):
    if names[0] == "vision":
      return "vision"
    if names[0] in ("embed", "lm_head"):
      return "embeddings"
    if "mixer" in names:
      return mixer_kind.get(owner(names, "mixer"), "other")
    if "ffn" in names:
      if owner(names, "ffn") not in moe_ffns:
        return "dense_ffn"
      part = names[names.index("ffn") + 1]
      return {"router": "router", "shared": "moe_shared"}.get(part, "moe_experts")
    return "other"

  return [group(names) for names in paths]


def _group_squares(grads) -> dict[str, jax.Array]:
  """{group: Σ of its gradients' squares (fp32)} for every group that has parameters."""
  squares = {}
  for name, leaf in zip(grad_groups(grads), jax.tree.leaves(grads)):
    sq = jnp.sum(jnp.square(leaf.astype(jnp.float32)))
    squares[name] = squares[name] + sq if name in squares else sq
  return squares


def grad_norms(grads) -> tuple[jax.Array, dict[str, jax.Array]]:
  """(the global L2 norm of the gradients, {"grad_norm/<group>": L2 norm of the group's
  gradients} for every group that has parameters), fp32, from one sum of squares per leaf: the
  groups' squares sum to the global norm's square."""
  squares = _group_squares(grads)
  total = functools.reduce(jnp.add, squares.values()) if squares else jnp.zeros((), jnp.float32)
  return jnp.sqrt(total), {f"grad_norm/{g}": jnp.sqrt(squares[g]) for g in GRAD_GROUPS
                           if g in squares}


def loss_mask_of(batch: dict, placeholder_id: int | None) -> jax.Array:
  """The batch's loss mask, never on a vision placeholder target (the pipeline's mask already
  leaves them out; this keeps any other batch source honest)."""
  if placeholder_id is None:
    return batch["loss_mask"]
  return batch["loss_mask"] * (batch["targets"] != placeholder_id).astype(batch["loss_mask"].dtype)


def head_loss(model, x_btd: jax.Array, targets_bt: jax.Array, mask_bt: jax.Array,
              loss_chunk_tokens: int = 0):
  """(mean cross-entropy over mask, number of counted tokens) of the shared output head on
  normalised final hidden states x [B, T, d]; the main and the MTP loss both come through here.

  loss_chunk_tokens (`train.loss_chunk_tokens`) > 0: the fused, chunked head of
  k3train/train/head_loss.py (no [B, T, V] logits; gradients computed in the forward pass);
  0: the head's logits [B, T, V], then `cross_entropy`.
  """
  with jax.named_scope("head_loss"):
    if loss_chunk_tokens > 0:
      head = model.lm_head
      return fused_head_cross_entropy(x_btd, head.kernel[...], targets_bt, mask_bt,
                                      chunk_tokens=loss_chunk_tokens, dtype=head.dtype,
                                      lse_backend=getattr(model, "head_lse_backend", "xla"))
    logits_btv = constrain(model.lm_head(x_btd), ax.BATCH, ax.SEQ, ax.VOCAB)
    return cross_entropy(logits_btv, targets_bt, mask_bt)


def forward_loss(graphdef, params, rest, batch, loss_chunk_tokens: int = 0, stack_grad_acc=None,
                 embed_rows=None):
  """Loss and the updated non-parameter state for one batch (vision keys go to the tower).

  The loss is the mean next-token cross-entropy over the loss tokens; with an MTP module
  (model.mtp) plus λ · the MTP cross-entropy summed over its positions / the loss tokens
  (k3train/model/mtp.py), so micro-batches weighted by their loss tokens stay exact. Both heads
  run as `head_loss` with `loss_chunk_tokens` (`train.loss_chunk_tokens`).

  stack_grad_acc: (accumulator shaped like params["stack"], weight) to accumulate the scanned
  stack's gradient in its own backward pass (`K3Model._run_stack`; used by `loss_and_grads`).
  embed_rows: the embeddings of the batch's "tokens" (and, with an MTP module, "targets") as
  `embedding_rows` looks them up, used in place of the model's own lookups, so that the gradient
  with respect to them is the table's gradient row by row (used by `loss_and_grads`)."""
  model = nnx.merge(graphdef, params, rest, copy=True)  # fresh Variables at this trace level
  token_mask = (batch["segment_ids"] > 0).astype(jnp.float32)
  vision = {k: batch[k] for k in VISION_BATCH_KEYS if k in batch} or None
  mask = loss_mask_of(batch, getattr(model, "placeholder_id", None))
  rows = embed_rows or {}
  h = model.hidden_states(batch["tokens"], batch["segment_ids"], token_mask, vision,
                          stack_grad_acc=stack_grad_acc, embed_btd=rows.get("tokens"))
  loss, n_tokens = head_loss(model, model.final_norm(h), batch["targets"], mask, loss_chunk_tokens)
  if getattr(model, "mtp", None) is not None:
    mtp_sum = mtp_ce_sum(model, h, batch, mask, token_mask, loss_chunk_tokens,
                         next_embed_btd=rows.get("targets"))
    loss = loss + model.mtp_loss_weight * mtp_sum / jnp.maximum(n_tokens, 1.0)
  _, _, new_rest = nnx.split(model, nnx.Param, ...)
  return loss, (new_rest, n_tokens)


def mtp_ce_sum(model, h_btd: jax.Array, batch: dict, mask_bt: jax.Array, token_mask_bt: jax.Array,
               loss_chunk_tokens: int = 0, next_embed_btd=None):
  """The MTP cross-entropy (fp32) summed over the batch's MTP positions, from the main hidden
  states h [B, T, d]; the sum and the positions' number go to the module's MTPStats.
  next_embed_btd: the targets' embeddings, when looked up by the caller."""
  targets, mtp_mask = mtp_lib.mtp_targets(batch["targets"], mask_bt, batch["segment_ids"])
  x = model.mtp_hidden(h_btd, batch["targets"], batch["segment_ids"], token_mask_bt,
                       next_embed_btd=next_embed_btd)
  ce, n = head_loss(model, x, targets, mtp_mask, loss_chunk_tokens)
  ce_sum = ce * n
  model.mtp.stats[...] = jax.lax.stop_gradient(jnp.stack([ce_sum, n]))
  return ce_sum


def mtp_metrics(rest) -> dict:
  """{"mtp_loss": MTP cross-entropy per MTP position, "mtp_tokens": MTP positions} of the last
  forward, from the MTPStats in `rest`; {} for a model without an MTP module."""
  stats = _collect(rest, mtp_lib.MTPStats)
  if not stats:
    return {}
  ce_sum, n = stats[0][0], stats[0][1]
  return {"mtp_loss": ce_sum / jnp.maximum(n, 1.0), "mtp_tokens": n}


def _micro_batches(batch: dict, microbatches: int) -> dict:
  """[B, T] arrays → [N, B/N, T]; micro-batch i holds rows i, i + N, i + 2N, …"""
  def split(x):
    b = x.shape[0]
    return jnp.swapaxes(x.reshape(b // microbatches, microbatches, *x.shape[1:]), 0, 1)
  return {k: split(v) for k, v in batch.items()}


def _combine_rest(rest_stacked):
  """Reduce forward-written state stacked over micro-batches (leading axis N), by variable kind."""
  def reduce(v):
    if isinstance(v, (moe.ExpertLoad, mtp_lib.MTPStats)):
      return v.replace(jnp.sum(v[...], axis=0))
    if isinstance(v, MaxLogit):
      return v.replace(jnp.max(v[...], axis=0))
    if isinstance(v, (moe.QBPending, moe.QBMeanScore)):
      return v.replace(jnp.mean(v[...], axis=0))
    return v.replace(v[...][-1])
  return jax.tree.map(reduce, rest_stacked, is_leaf=lambda x: isinstance(x, nnx.Variable))


def loss_and_grads(graphdef, params, rest, batch: dict, microbatches: int = 1,
                   loss_chunk_tokens: int = 0, forward_params=None, accumulate_in_stack: bool = True,
                   embedding_by_rows: bool = True):
  """(loss, (new rest, loss tokens), grads) for one step's batch, accumulated over micro-batches.

  microbatches == 1 is the plain value_and_grad of `forward_loss`. Otherwise the batch size must
  divide by it; gradients accumulate in fp32 inside a scan (one micro-batch's activations live at
  a time): acc ← acc + weight · g per micro-batch. loss_chunk_tokens: see `head_loss`.

  accumulate_in_stack (with a scanned stack of layers): the stack's share of that sum happens
  inside the stack's backward scan, one layer's slice at a time, into the accumulator itself
  (k3train/model/layer_scan.py) — the same arithmetic without a zero-filled, stack-sized gradient
  buffer per micro-batch beside the accumulator. False: every leaf is summed after the backward.

  embedding_by_rows (micro-batches > 1): the forward takes the token embeddings looked up outside
  the differentiated function (`embedding_rows`), and their gradient [B, T, d] is scattered into
  the embedding table's accumulator, row by row in place: acc[id] += weight · ∂L/∂row. The table's
  own gradient would be a [vocab, d] fp32 scatter into zeros, then added to the accumulator:
  three passes over the table per micro-batch for a few thousand rows. False: that path.

  forward_params: a function params → the parameters the forward runs with (a once-per-step cast
  of the routed-expert weights, `moe.cast_expert_weights`), applied before the micro-batches;
  the gradients are taken with respect to its result. Gradients come back in the dtypes of
  `params` either way.
  """
  loss_fn = functools.partial(forward_loss, loss_chunk_tokens=loss_chunk_tokens)
  grad_fn = jax.value_and_grad(loss_fn, argnums=1, has_aux=True)
  run_params = params if forward_params is None else forward_params(params)
  like_params = lambda grads: jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
  if microbatches == 1:
    out, grads = grad_fn(graphdef, run_params, rest, batch)
    return out, like_params(grads)
  size = batch["tokens"].shape[0]
  if size % microbatches:
    raise ValueError(f"batch of {size} rows does not split into train.microbatches={microbatches}")
  micro = _micro_batches(batch, microbatches)
  placeholder_id = getattr(nnx.merge(graphdef, params, rest, copy=True), "placeholder_id", None)
  tokens_n = jnp.sum(loss_mask_of(micro, placeholder_id).astype(jnp.float32), axis=(1, 2))  # [N]
  weight_n = tokens_n / jnp.maximum(jnp.sum(tokens_n), 1.0)

  in_stack = accumulate_in_stack and "stack" in params
  by_rows = embedding_by_rows and EMBED_TABLE in _leaf_paths(params)

  def loss_with_accumulators(graphdef, params, rest, batch, stack_acc, weight, rows):
    return forward_loss(graphdef, params, rest, batch, loss_chunk_tokens,
                        stack_grad_acc=(stack_acc, weight) if in_stack else None, embed_rows=rows)
  acc_grad_fn = jax.value_and_grad(loss_with_accumulators, argnums=(1, 4, 6), has_aux=True)

  def body(acc, xs):
    mb, weight = xs
    mb = {k: constrain(v, *VISION_BATCH_KEYS[k]) if k in VISION_BATCH_KEYS else
          constrain(v, ax.BATCH, ax.SEQ) if v.ndim == 2 else v for k, v in mb.items()}
    grads_acc, loss_acc = acc
    add = lambda a, g: a + weight * g.astype(jnp.float32)
    rows = embedding_rows(graphdef, run_params, rest, mb) if by_rows else None
    stack_acc = grads_acc["stack"] if in_stack else None
    (loss, (new_rest, _)), (grads, stack_acc, d_rows) = acc_grad_fn(
        graphdef, run_params, rest, mb, stack_acc, weight, rows)
    table_acc = _scatter_rows(_leaf(grads_acc, EMBED_TABLE), mb, d_rows, weight) if by_rows else None
    grads_acc = _accumulate(add, grads_acc, grads, stack_acc, table_acc)
    return (grads_acc, loss_acc + weight * loss), new_rest

  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  (grads, loss), rest_n = jax.lax.scan(body, (zeros, jnp.zeros((), jnp.float32)), (micro, weight_n))
  return (loss, (_combine_rest(rest_n), jnp.sum(tokens_n))), like_params(grads)


# The token embedding table's path in the parameter tree.
EMBED_TABLE = ("embed", "embedding")


def embedding_rows(graphdef, params, rest, batch: dict) -> dict:
  """The embeddings the forward looks up, by batch key: "tokens" (the input) and, for a model
  with an MTP module, "targets" (its next tokens); [B, T, d] each, as the model computes them."""
  model = nnx.merge(graphdef, params, rest, copy=True)
  keys = ("tokens", "targets") if getattr(model, "mtp", None) is not None else ("tokens",)
  return {k: model.embed(batch[k]) for k in keys}


def _leaf_paths(tree) -> set:
  return {tuple(path_names(p)) for p, _ in jax.tree_util.tree_leaves_with_path(tree)}


def _leaf(tree, names):
  """The leaf of `tree` at the path `names`."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    if tuple(path_names(path)) == names:
      return leaf
  raise KeyError(f"no leaf at {'/'.join(names)}")


def _scatter_rows(table_acc_vd, batch: dict, d_rows: dict, weight):
  """table_acc[id] += weight · ∂L/∂row for every looked-up row (ids from `batch` by the keys of
  `d_rows`), in fp32; a token id appearing several times adds each of its rows."""
  for key, d_btd in d_rows.items():
    update = weight * d_btd.astype(jnp.float32)
    table_acc_vd = table_acc_vd.at[batch[key]].add(update)
  return table_acc_vd


def _accumulate(add, acc, grads, stack_acc=None, table_acc=None):
  """add(a, g) leaf by leaf, except the leaves accumulated elsewhere: under "stack" those of
  `stack_acc` (by the stack's backward pass), and the embedding table's from `table_acc` (by
  `_scatter_rows`); `grads` holds unused zeros there."""
  stack_leaves = iter(jax.tree.leaves(stack_acc) if stack_acc is not None else ())
  def one(path, a, g):
    names = tuple(path_names(path))
    if stack_acc is not None and names[0] == "stack":
      return next(stack_leaves)
    if table_acc is not None and names == EMBED_TABLE:
      return table_acc
    return add(a, g)
  out = jax.tree_util.tree_map_with_path(one, acc, grads)
  if next(stack_leaves, None) is not None:
    raise ValueError("the stack's accumulated gradients do not match the parameters' stack")
  return out


def spike_guard(loss, loss_ema, *, factor: float, decay: float):
  """(skip, new_ema): skip when loss > factor × running mean (never on the first step, never when
  factor is 0); the mean only absorbs losses of updates that were applied."""
  first = loss_ema == 0
  skip = jnp.logical_and(jnp.logical_not(first), loss > factor * loss_ema) if factor > 0 else jnp.bool_(False)
  blended = jnp.where(first, loss, decay * loss_ema + (1 - decay) * loss)
  return skip, jnp.where(skip, loss_ema, blended)


# Bits of the "nonfinite" metric: which part of a step's result holds a NaN or Inf.
NONFINITE_GROUPS = ((1, "grad_norm"), (2, "params"), (4, "opt_state"), (8, "model state (rest)"))
# The state fields the step itself checks: everything but the parameters and the optimizer state.
# Those two are ~750 leaves at k3_h200; a check of each in the step is a reduction kernel per leaf
# fused into the update, which cost ~675 of the compiled step's ~4,100 kernels and ~14 s of its
# compile for the GPU (benchmarks/train_step.md). The train loop checks them in full with `state_nonfinite`
# before every checkpoint save; between saves a non-finite parameter shows in the next loss.
STEP_CHECKED_FIELDS = ("step", "rest", "loss_ema", "skipped")


def nonfinite_check(new_state: TrainState, grad_norm, skip, fields=None) -> dict:
  """Two scalars for the loop: "nonfinite" (0 when every float leaf of the checked fields of the
  new state and the gradient norm are finite, else the sum of the NONFINITE_GROUPS bits that are
  not) and "nonfinite_leaf" (index of the first non-finite leaf in `jax.tree.leaves(new_state)`,
  -1 if none). A gradient norm that is not finite is allowed when the spike guard skipped the
  update. fields: the TrainState fields checked (None: all)."""
  # One flag per leaf, by field in the state's leaf order (an unchecked field's leaves count as
  # finite, so leaf indices stay those of the whole state); the groups reuse the leaves' flags.
  finite = lambda x: (jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact)
                      else jnp.bool_(True))
  checked = {f.name for f in dataclasses.fields(new_state)} if fields is None else set(fields)
  by_field = {f.name: [finite(x) if f.name in checked else jnp.bool_(True)
                       for x in jax.tree.leaves(getattr(new_state, f.name))]
              for f in dataclasses.fields(new_state)}
  ok_all = jnp.stack([flag for flags in by_field.values() for flag in flags])
  def group_ok(name):
    return jnp.all(jnp.stack(by_field[name])) if by_field[name] else jnp.bool_(True)
  bad = {"grad_norm": jnp.logical_not(jnp.logical_or(jnp.isfinite(grad_norm), skip)),
         "params": jnp.logical_not(group_ok("params")),
         "opt_state": jnp.logical_not(group_ok("opt_state")),
         "model state (rest)": jnp.logical_not(group_ok("rest"))}
  code = sum(bit * bad[name].astype(jnp.float32) for bit, name in NONFINITE_GROUPS)
  first = jnp.where(jnp.all(ok_all), -1, jnp.argmin(ok_all.astype(jnp.int32)))
  return {"nonfinite": code, "nonfinite_leaf": first.astype(jnp.float32)}


def state_nonfinite(state: TrainState) -> dict:
  """`nonfinite_check` of every field of a train state (no gradient norm): what the loop runs,
  jitted, before it saves a checkpoint."""
  return nonfinite_check(state, jnp.float32(0.0), jnp.bool_(False))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepGradients:
  """What a step's gradient phase hands to its update phase."""
  loss: jax.Array          # fp32 scalar: the step's loss (the micro-batches' token-weighted mean)
  n_tokens: jax.Array      # scalar: the step's loss tokens
  rest: Any                # the model variables the forward wrote, combined over micro-batches
  grads: Any               # the gradients, the tree and dtypes of `params`


@dataclasses.dataclass(frozen=True)
class StepPhases:
  """A train step in its two phases: `gradients(state, batch) -> StepGradients` (the forward
  and backward of every micro-batch) and `update(state, gradients) -> (state, metrics)` (the
  optimizer, QK-Clip, the router-bias update, the guards and the metrics).

  Called, it is the whole step as one function, `train_step(state, batch) -> (state, metrics)`.
  `layout.jit_step` jits the phases as two programs that compile side by side
  (k3train/train/phased.py)."""
  gradients: Callable[[TrainState, dict], StepGradients]
  update: Callable[[TrainState, StepGradients], tuple[TrainState, dict]]

  def __call__(self, state: TrainState, batch: dict):
    return self.update(state, self.gradients(state, batch))

  @property
  def whole(self) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
    """The whole step as a plain function (`layout.jit_step` jits it as one program)."""
    def train_step(state: TrainState, batch: dict):
      return self(state, batch)
    return train_step

  def with_update(self, wrap: Callable) -> "StepPhases":
    """The same phases with the update phase replaced by `wrap(update)`."""
    return StepPhases(self.gradients, wrap(self.update))


def make_train_step(graphdef, optimizer: optax.GradientTransformation, *, loss_spike_factor: float = 0.0,
                    loss_spike_ema: float = 0.99, qk_clip_tau: float | None = None,
                    mla_nope_dim: int | None = None, microbatches: int = 1, quant=None,
                    loss_chunk_tokens: int = 0, compute_dtype=None) -> StepPhases:
  """The train step as `StepPhases`; called, `train_step(state, batch) -> (state, metrics)`. Jit
  it with explicit shardings at the call site (`layout.jit_step`).

  compute_dtype (`model.dtype`): when given and QAT is off, the routed-expert weights are cast to
  it once per step, before the micro-batches (`moe.cast_expert_weights`: the same gradients, bit
  for bit, without a cast in every micro-batch's forward, recompute and backward).

  quant: the `model.quant` config section (None or enabled=False: no QAT). From step
  quant.start_step on (a traced test of state.step, so resume is exact) the routed-expert weights
  are fake-quantised once per step, before the micro-batches, and the expert GEMMs quantise
  their activations (k3train/model/moe.py, docs/maths.md §7.5); the update of the fp32 master
  weights uses the straight-through gradients.

  With microbatches > 1 the gradients are accumulated over that many micro-batches of the batch
  (see `loss_and_grads`) before the one optimizer update. loss_chunk_tokens
  (`train.loss_chunk_tokens`) > 0 runs the main and MTP heads fused and chunked (`head_loss`).

  After the optimizer update: QK-Clip on MLA heads whose max logit of this batch exceeded
  `qk_clip_tau` (None: off), the Quantile-Balancing router-bias update, and the loss-spike guard.
  """

  qat = moe.expert_quant_from_config(quant) if quant is not None else None
  forward_params = None
  if qat is None and compute_dtype is not None:   # QAT paths re-quantise the fp32 weights
    forward_params = functools.partial(moe.cast_expert_weights, dtype=compute_dtype)

  def qat_active(state: TrainState):
    return None if qat is None else state.step >= qat.start_step

  def gradients(state: TrainState, batch: dict) -> StepGradients:
    params_fwd, qat_on = state.params, qat_active(state)
    if qat is not None:   # MX QAT: quantise the expert weights once per step
      params_fwd = moe.fake_quant_expert_weights(state.params, qat, qat_on)
    with moe.expert_quantization(qat, qat_on, weights_quantized=True), moe.qb_training_routing():
      (loss, (rest, n_tokens)), grads = loss_and_grads(graphdef, params_fwd, state.rest, batch,
                                                       microbatches, loss_chunk_tokens=loss_chunk_tokens,
                                                       forward_params=forward_params)
    return StepGradients(loss, n_tokens, rest, grads)

  def update(state: TrainState, g: StepGradients):
    loss, rest, n_tokens, grads = g.loss, g.rest, g.n_tokens, g.grads
    with jax.named_scope("optimizer"):
      updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
      params = optax.apply_updates(state.params, updates)
    clip_stats = {}
    if qk_clip_tau is not None:
      params, clip_stats = qk_clip(params, rest, tau=qk_clip_tau, nope=mla_nope_dim)
    rest = moe.qb_bias_update(rest)
    skip, loss_ema = spike_guard(loss, state.loss_ema, factor=loss_spike_factor, decay=loss_spike_ema)
    if loss_spike_factor > 0:  # a skipped step keeps parameters, optimizer state and router biases
      keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(skip, o, n), new, old)
      params, opt_state, rest = keep(params, state.params), keep(opt_state, state.opt_state), keep(rest, state.rest)
    grad_norm, group_norms = grad_norms(grads)
    metrics = {"loss": loss, "grad_norm": grad_norm, "tokens": n_tokens,
               "skipped_update": skip.astype(jnp.float32), **clip_stats, **group_norms}
    if qat is not None:
      metrics["qat_active"] = qat_active(state).astype(jnp.float32)
    loads = _collect(rest, moe.ExpertLoad)
    if loads:
      load_le = jnp.concatenate([l.reshape(-1, l.shape[-1]) for l in loads])  # [MoE layers, E]
      mean = jnp.maximum(jnp.mean(load_le, axis=-1, keepdims=True), 1e-9)
      metrics["moe_max_load"] = jnp.max(load_le / mean)  # worst layer's max/mean expert load
      load_layers = per_layer(rest, moe.ExpertLoad)                  # [MoE layers, E], layer order
      if load_layers is not None:       # None when the only MoE layer is the MTP module's
        metrics["moe_load"] = load_layers / jnp.maximum(jnp.sum(load_layers, axis=-1, keepdims=True), 1e-9)
        bias_layers = per_layer(rest, moe.RouterBias)                # [MoE layers, E]
        metrics["router_bias_spread"] = jnp.max(jnp.max(bias_layers, axis=-1) - jnp.min(bias_layers, axis=-1))
    logits_max = _collect(rest, MaxLogit)
    if logits_max:
      metrics["mla_max_logit"] = jnp.max(jnp.concatenate([x.reshape(-1) for x in logits_max]))
    skipped = state.skipped + skip.astype(jnp.int32)
    new_state = TrainState(state.step + 1, params, rest, opt_state, loss_ema, skipped)
    metrics.update(nonfinite_check(new_state, metrics["grad_norm"], skip,
                                   fields=STEP_CHECKED_FIELDS))
    return new_state, metrics

  return StepPhases(gradients, update)
