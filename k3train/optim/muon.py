"""Muon with per-head and per-expert blocks for K3 (docs/maths.md §4), and the AdamW group beside it.

Every parameter leaf falls into exactly one group, decided from its path (`path_names`) and the
kernel layouts of `k3train/model` (heads and experts are real axes):

  muon_per_head    KDA q/k/v/g/f_b_proj [in, H, K] and MLA q_b/g_proj [in, H, ·]: one
                   [in, K] block per head; KDA and MLA o_proj [H, V, d]: one [V, d] block per
                   head; MLA kv_b_proj [kv_lora, H, nope + v]: two blocks per head, k^C
                   [kv_lora, nope] and v [kv_lora, v] (see "kv_b split" below).
  muon_per_expert  routed experts gate/up/down [E, in, out]: one [in, out] block per expert.
  muon_matrix      the other 2-D weights: MoE latent down/up, shared-expert and dense FFN
                   kernels, MLA q_a_proj / kv_a_proj, KDA f_a_proj and b_proj, the MTP
                   module's fusion projection.
  adamw            embedding, lm_head, RMSNorm gains, A_log, dt_bias, conv kernels, AttnRes
                   query / norm_scale, router weight.

A leading super-block axis (paths through "stack") is one more batch axis: each layer's blocks
are orthogonalised separately. `muon_dimension_numbers` expresses all of this as
`optax.contrib.MuonDimensionNumbers`: every axis that is neither the reduction nor the output
axis is a batch axis, and each index of the batch axes is one block.

kv_b split. Dimension numbers cannot cut one axis into two blocks, so `make_muon_optimizer`
wraps the Muon/AdamW partition in `split_last_axis`, which hands the inner optimizer kv_b's
last axis as separate arrays [..., kv_lora, H, nope] and [..., kv_lora, H, v] (a `Blocks` node)
and concatenates the updates again. Both blocks keep kv_b's rank and axis meaning, so the same
dimension numbers (reduction = kv_lora axis, output = last axis) describe the unsplit leaf and
each block, and nope ≠ v needs no special case. The sizes come from the layer's own o_proj
(v = o_proj's V axis, nope = the rest) and are cross-checked against q_b_proj and kv_a_proj. The
Muon momentum of kv_b is stored split, under `.block0` / `.block1` in the optimizer state.

Optimizer. An outer `optax.partition` sends the Muon leaves to `muon_matrices` and the rest to
`optax.adamw(b1, b2, eps, weight_decay, mask)`. The Muon chain is `scale_by_batched_muon`
(Nesterov momentum as an EMA with bias correction, then 5 quintic NS steps with
(3.4445, −4.7750, 2.0315) and `rms_scale`·sqrt(max(fan_in, fan_out)) per block), decoupled
weight decay, and the learning rate; its updates equal `optax.contrib.muon(..., nesterov=True,
consistent_rms=rms_scale)` when NS runs in float32. Newton–Schulz is batched by block shape:
every block of one (m, n) across all Muon leaves (heads, experts, stacked layers, different
parameters) is stacked into one [batch, m, n] array and orthogonalised by one chain of batched
matmuls (`k3train/optim/newton_schulz.py`), with bfloat16 operands and float32 accumulation by
default (`ns_dtype="float32"`: the fp32 iteration). One chain per shape instead of one small
matmul per block is what keeps the accelerator busy. The AdamW leaves do not use optax Muon's
built-in Adam, which decays every non-Muon leaf without a mask and turns Nesterov on (NAdam, not
Moonlight's AdamW). Weight decay: every Muon matrix; of the AdamW group only the matrices
embedding, lm_head and router weight (as the AdamW chain in `optimizer.py` does); never norm
gains, A_log, dt_bias, conv kernels or AttnRes vectors.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from optax.contrib import MuonDimensionNumbers

from k3train.optim import newton_schulz
from k3train.optim.newton_schulz import NS_COEFFS, NS_STEPS
from k3train.parallel import axes
from k3train.tree_paths import path_names

GROUPS = ("muon_per_head", "muon_per_expert", "muon_matrix", "adamw")

# Linear modules whose kernel is [in, H, head_dim]: reduction = in, output = head_dim, H batch.
PER_HEAD_IN_OUT = frozenset({"q_proj", "k_proj", "v_proj", "g_proj", "f_b_proj", "q_b_proj",
                             "kv_b_proj"})
# Linear modules whose kernel is [H, head_dim, d]: reduction = head_dim, output = d, H batch.
PER_HEAD_OUT_PROJ = frozenset({"o_proj"})
# Linear modules whose kernel is one [in, out] matrix ("proj": the MTP module's 2d → d fusion).
WHOLE_MATRIX = frozenset({"q_a_proj", "kv_a_proj", "f_a_proj", "b_proj",
                          "gate_proj", "up_proj", "down_proj", "proj"})
# RoutedExperts parameters [E, in, out].
EXPERT_WEIGHTS = frozenset({"gate", "up", "down"})
# Leaves never weight-decayed, by name (norm gains, gate biases / rates, conv kernels, AttnRes
# queries); the AdamW-only optimizer uses the same list.
ADAMW_NO_DECAY = frozenset({"scale", "A_log", "dt_bias", "q_conv", "k_conv", "v_conv",
                            "query", "norm_scale"})

_MUON, _ADAMW = "muon", "adamw"


@dataclasses.dataclass(frozen=True)
class LeafRule:
  group: str                               # one of GROUPS
  dims: MuonDimensionNumbers | None        # None: AdamW
  decay: bool                              # decoupled weight decay on this leaf
  fallback: bool = False                   # name not recognised; generic ndim rule used


def _strip_block(names: Sequence[str]) -> list[str]:
  """Path names of a leaf inside a `Blocks` node, without the trailing `blockN`."""
  names = list(names)
  if names and names[-1].startswith("block") and names[-1][5:].isdigit():
    names = names[:-1]
  return names


def _layout_error(names, ndim, expected):
  return ValueError(f"parameter {'/'.join(names)} has rank {ndim}; the Muon partition expects "
                    f"{expected} (k3train/optim/muon.py must learn the new layout)")


def leaf_rule(names: Sequence[str], ndim: int) -> LeafRule:
  """Group, Muon dimension numbers and weight-decay flag of one parameter from its path names."""
  names = _strip_block(names)
  lead = 1 if "stack" in names else 0      # scanned super-blocks: leading layer axis = batch
  core = ndim - lead
  leaf = names[-1] if names else ""
  owner = names[-2] if len(names) >= 2 else ""

  def mdn(reduction: int, output: int) -> MuonDimensionNumbers:
    return MuonDimensionNumbers(reduction_axis=lead + reduction, output_axis=lead + output)

  def expect(rank: int, what: str):
    if core != rank:
      raise _layout_error(names, ndim, f"{what} (rank {rank}{' + layer axis' if lead else ''})")

  if leaf == "kernel" and owner in PER_HEAD_IN_OUT:
    expect(3, "[in, heads, head_dim]")
    return LeafRule("muon_per_head", mdn(0, 2), True)
  if leaf == "kernel" and owner in PER_HEAD_OUT_PROJ:
    expect(3, "[heads, head_dim, d]")
    return LeafRule("muon_per_head", mdn(1, 2), True)
  if leaf == "kernel" and owner in WHOLE_MATRIX:
    expect(2, "[in, out]")
    return LeafRule("muon_matrix", mdn(0, 1), True)
  if owner == "experts" and leaf in EXPERT_WEIGHTS:
    expect(3, "[experts, in, out]")
    return LeafRule("muon_per_expert", mdn(1, 2), True)
  if leaf == "embedding" or (leaf == "kernel" and owner == "lm_head") or \
     (leaf == "weight" and owner == "router"):
    return LeafRule("adamw", None, True)
  if leaf in ADAMW_NO_DECAY:
    return LeafRule("adamw", None, False)
  # Unknown parameter: Moonlight's generic rule (2-D → whole-matrix Muon, else AdamW without decay).
  if core == 2:
    return LeafRule("muon_matrix", mdn(0, 1), True, fallback=True)
  return LeafRule("adamw", None, False, fallback=True)


def _rule_of(path, leaf) -> LeafRule:
  return leaf_rule(path_names(path), len(leaf.shape))


def muon_dimension_numbers(params) -> Any:
  """`MuonDimensionNumbers` for every Muon leaf, None for every AdamW leaf (structure of params).

  kv_b_proj gets (reduction = kv_lora axis, output = last axis); the optimizer applies it to the
  k^C and v blocks separately (module docstring).
  """
  return jax.tree_util.tree_map_with_path(lambda p, x: _rule_of(p, x).dims, params)


def _labels(tree):
  return jax.tree_util.tree_map_with_path(
      lambda p, x: _MUON if _rule_of(p, x).dims is not None else _ADAMW, tree)


def _decay_mask(tree):
  return jax.tree_util.tree_map_with_path(lambda p, x: _rule_of(p, x).decay, tree)


# ---------------------------------------------------------------------------------------------
# Partition summary


def partition_summary(params) -> dict[str, tuple[int, int]]:
  """{group: (number of leaves, number of parameters)} over GROUPS (kv_b counts as one leaf)."""
  summary = {g: [0, 0] for g in GROUPS}
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    entry = summary[_rule_of(path, leaf).group]
    entry[0] += 1
    entry[1] += math.prod(leaf.shape)
  return {g: (n, p) for g, (n, p) in summary.items()}


def fallback_paths(params) -> list[str]:
  """Paths whose names the partition did not recognise (they got the generic ndim rule)."""
  return ["/".join(path_names(p)) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
          if _rule_of(p, x).fallback]


def _human(n: int) -> str:
  for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
    if n >= div:
      return f"{n / div:.2f}{unit}"
  return str(n)


def format_partition(summary: dict[str, tuple[int, int]]) -> str:
  """A small table of `partition_summary` for the start-of-run log."""
  total_leaves = sum(n for n, _ in summary.values())
  total_params = sum(p for _, p in summary.values())
  lines = ["optimizer partition (Muon / AdamW):"]
  for group in GROUPS:
    n, p = summary.get(group, (0, 0))
    share = 100.0 * p / total_params if total_params else 0.0
    lines.append(f"  {group:<16} {n:>5} leaves {_human(p):>9} params ({p:,}; {share:5.1f}%)")
  lines.append(f"  {'total':<16} {total_leaves:>5} leaves {_human(total_params):>9} params "
               f"({total_params:,})")
  return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# kv_b split: k^C and v as separate Muon blocks


@jax.tree_util.register_pytree_with_keys_class
class Blocks:
  """One parameter's last axis cut into consecutive parts, each a separate pytree leaf."""

  def __init__(self, parts):
    self.parts = tuple(parts)

  def tree_flatten(self):
    return self.parts, None

  def tree_flatten_with_keys(self):
    return tuple((jax.tree_util.GetAttrKey(f"block{i}"), p) for i, p in enumerate(self.parts)), None

  @classmethod
  def tree_unflatten(cls, aux, children):
    del aux
    return cls(children)

  def __repr__(self):
    return f"Blocks({self.parts!r})"


def _key(path) -> str:
  return "/".join(path_names(path))


def kv_b_block_sizes(params) -> dict[str, tuple[int, int]]:
  """{kv_b_proj kernel path: (nope, v)}: the k^C and v widths of each MLA kv_b_proj.

  v is the V axis of the same layer's o_proj [.., H, V, d]; nope = kv_b's last axis − v, checked
  against q_b_proj (nope + rope) and kv_a_proj (kv_lora + rope) when those are present.
  """
  shapes = {_key(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
  sizes = {}
  for key, shape in shapes.items():
    names = key.split("/")
    if len(names) < 2 or names[-2:] != ["kv_b_proj", "kernel"]:
      continue
    prefix = "/".join(names[:-2])
    o_shape = shapes.get(f"{prefix}/o_proj/kernel")
    if o_shape is None:
      raise ValueError(f"{key}: no sibling o_proj kernel to read the value head width from")
    v = o_shape[-2]
    nope = shape[-1] - v
    if nope <= 0:
      raise ValueError(f"{key}: last axis {shape[-1]} is not nope + v with v = {v}")
    q_b, kv_a = shapes.get(f"{prefix}/q_b_proj/kernel"), shapes.get(f"{prefix}/kv_a_proj/kernel")
    if q_b is not None and kv_a is not None:
      rope = kv_a[-1] - shape[-3]
      if q_b[-1] - rope != nope:
        raise ValueError(f"{key}: nope = {nope} from o_proj, but q_b_proj/kv_a_proj give "
                         f"{q_b[-1] - rope}")
    sizes[key] = (nope, v)
  return sizes


def split_last_axis(inner: optax.GradientTransformation,
                    sizes_by_path: dict[str, Sequence[int]]) -> optax.GradientTransformationExtraArgs:
  """Runs `inner` on a tree whose listed leaves are cut along their last axis into `Blocks`.

  Updates come back in the original layout; `inner`'s state keeps the split layout.
  """
  sizes_by_path = {k: tuple(int(s) for s in v) for k, v in sizes_by_path.items()}

  def split(tree):
    if tree is None or not sizes_by_path:
      return tree

    def cut(path, x):
      sizes = sizes_by_path.get(_key(path))
      if sizes is None:
        return x
      if x.shape[-1] != sum(sizes):
        raise ValueError(f"{_key(path)}: last axis {x.shape[-1]} != sum of blocks {sizes}")
      return Blocks(jnp.split(x, np.cumsum(sizes)[:-1].tolist(), axis=-1))

    return jax.tree_util.tree_map_with_path(cut, tree)

  def merge(tree):
    return jax.tree.map(lambda x: jnp.concatenate(x.parts, axis=-1) if isinstance(x, Blocks) else x,
                        tree, is_leaf=lambda x: isinstance(x, Blocks))

  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    return inner.init(split(params))

  def update_fn(updates, state, params=None, **extra_args):
    new_updates, new_state = inner.update(split(updates), state, split(params), **extra_args)
    return merge(new_updates), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# ---------------------------------------------------------------------------------------------
# Sharding: Newton–Schulz on whole matrices


def logical_names_by_key(params_like) -> dict[str, tuple]:
  """{'prefix/0/mixer/q_proj/kernel': ('embed', 'heads', 'head_dim')} from nnx Variable metadata."""
  out = {}
  for path, var in jax.tree_util.tree_flatten_with_path(
      params_like, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]:
    names = axes.names_of(var) if isinstance(var, nnx.Variable) else None
    if names:
      out[_key(path)] = names
  return out


def gather_for_newton_schulz(inner: optax.GradientTransformation, params_like
                             ) -> optax.GradientTransformationExtraArgs:
  """Runs `inner` (Muon) with each matrix gathered across devices except along its batch axes.

  Newton–Schulz multiplies X Xᵀ five times; on a matrix split over `fsdp` the compiler would
  all-reduce a partial Gram matrix every iteration. Under an active layout
  (`k3train.parallel.rules.activate`) `inner` runs in a `shard_map` whose in/out specs are the
  parameter's sharding with Muon's reduction and output axes whole: one all-gather each of the
  gradient, momentum and parameter per matrix on the way in, local Newton–Schulz, and a local
  slice back to the parameter layout on the way out. Batch axes (heads, experts, stacked layers)
  keep their sharding, so per-expert matrices split over `expert` never move. Without a layout
  it is `inner` unchanged.
  """
  from k3train.parallel import rules as rules_lib   # local: the optimizer works without parallel
  logical = logical_names_by_key(params_like)
  inner = optax.with_extra_args_support(inner)

  def ns_specs(tree, mesh, rules):
    """Per leaf: the parameter's PartitionSpec with Muon's matrix axes whole (P() otherwise)."""
    def one(path, x):
      if not hasattr(x, "ndim") or x.ndim < 2:
        return PartitionSpec()
      names = _strip_block(path_names(path))
      for i in range(len(names)):
        key = "/".join(names[i:])
        if key in logical and len(logical[key]) == x.ndim:
          break
      else:
        return PartitionSpec()
      dims = leaf_rule(names[i:], x.ndim).dims
      spec = list(rules_lib.spec_for(logical[key], x.shape, rules, mesh, what=key))
      spec += [None] * (x.ndim - len(spec))
      if dims is not None:
        for axis in (*_as_tuple(dims.reduction_axis), *_as_tuple(dims.output_axis)):
          spec[axis] = None
      return PartitionSpec(*spec)
    return jax.tree_util.tree_map_with_path(one, tree)

  def init_fn(params):
    return inner.init(params)

  def update_fn(updates, state, params=None, **extra_args):
    layout = rules_lib.active()
    if layout is None or not logical:
      return inner.update(updates, state, params, **extra_args)
    mesh, rules = layout
    specs = (ns_specs(updates, mesh, rules), ns_specs(state, mesh, rules),
             ns_specs(params, mesh, rules) if params is not None else None)
    # Inside the shard_map every matrix is whole on each device (batch axes stay split), so
    # Newton–Schulz runs locally; outside, the results are sliced back to the parameter layout.
    local = lambda u, st, p: inner.update(u, st, p, **extra_args)
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=specs[:2],
                         check_vma=False)(updates, state, params)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _as_tuple(axis) -> tuple[int, ...]:
  return tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)


# ---------------------------------------------------------------------------------------------
# The optimizer


class BatchedMuonState(NamedTuple):
  """Muon's momentum (an EMA of the gradients, in the parameters' dtype) and its step count."""
  count: jax.Array      # int32 scalar: updates applied so far
  mu: Any               # the momentum tree (Muon leaves only)


def _nesterov_momentum(grads, mu, count, beta: float, nesterov: bool):
  """(new EMA momentum, bias-corrected Nesterov direction) at step `count` (1-based).

  mu_t = β mu_{t−1} + (1 − β) g_t; the direction is β·mu_t/(1 − β^{t+1}) + (1 − β)·g_t/(1 − β^t),
  or mu_t/(1 − β^t) without Nesterov.
  """
  mu = jax.tree.map(lambda g, m: (1 - beta) * g + beta * m, grads, mu)
  correct_now = 1 - beta ** count
  if not nesterov:
    return mu, jax.tree.map(lambda m: m / correct_now.astype(m.dtype), mu)
  correct_next = 1 - beta ** optax.safe_increment(count)
  nesterov_fn = lambda m, g: (beta * (m / correct_next.astype(m.dtype))
                              + (1 - beta) * (g / correct_now.astype(g.dtype)))
  direction = jax.tree.map(nesterov_fn, mu, grads)
  return mu, direction


def scale_by_batched_muon(weight_dimension_numbers, *, beta: float = 0.95,
                          ns_coeffs: Sequence[float] = NS_COEFFS, ns_steps: int = NS_STEPS,
                          eps: float = newton_schulz.NS_EPS, rms_scale: float = 0.2,
                          ns_dtype: str = "bfloat16", nesterov: bool = True
                          ) -> optax.GradientTransformation:
  """Nesterov momentum, then Newton–Schulz of every block, scaled to RMS ≈ `rms_scale`.

  `weight_dimension_numbers(updates)` gives a `MuonDimensionNumbers` per leaf (as
  `muon_dimension_numbers` does). All blocks of one shape, across every leaf, are orthogonalised
  by one batched matmul chain (`newton_schulz.orthogonalize_leaves`), with `ns_dtype` operands
  and float32 accumulation. Each block is multiplied by rms_scale · sqrt(max(fan_in, fan_out)).
  """
  compute_dtype = newton_schulz.compute_dtype_of(ns_dtype)
  is_dims = lambda x: isinstance(x, MuonDimensionNumbers)

  def init_fn(params):
    return BatchedMuonState(count=jnp.zeros([], jnp.int32), mu=jax.tree.map(jnp.zeros_like, params))

  def update_fn(updates, state, params=None):
    del params
    count = optax.safe_increment(state.count)
    mu, direction = _nesterov_momentum(updates, state.mu, count, beta, nesterov)
    leaves, treedef = jax.tree.flatten(direction)
    dims = jax.tree.leaves(weight_dimension_numbers(updates), is_leaf=is_dims)
    if len(dims) != len(leaves) or not all(is_dims(d) for d in dims):
      raise ValueError("every Muon leaf needs MuonDimensionNumbers")
    out = newton_schulz.orthogonalize_leaves(
        leaves, dims, coeffs=ns_coeffs, steps=ns_steps, eps=eps, compute_dtype=compute_dtype,
        rms_scale=rms_scale)
    mu = jax.tree.map(lambda new, old: new.astype(old.dtype), mu, state.mu)
    return jax.tree.unflatten(treedef, out), BatchedMuonState(count=count, mu=mu)

  return optax.GradientTransformation(init_fn, update_fn)


def muon_matrices(learning_rate: float | optax.Schedule, *, weight_decay: float, momentum: float,
                  rms_scale: float, ns_dtype: str = "bfloat16") -> optax.GradientTransformation:
  """The Muon leaves' chain: batched Muon, decoupled weight decay (masked), −learning rate."""
  return optax.chain(
      scale_by_batched_muon(muon_dimension_numbers, beta=momentum, rms_scale=rms_scale,
                            ns_dtype=ns_dtype),
      optax.add_decayed_weights(weight_decay, _decay_mask),
      optax.scale_by_learning_rate(learning_rate),
  )


def make_muon_optimizer(*, learning_rate: float | optax.Schedule, params_like, weight_decay: float = 0.1,
                        momentum: float = 0.95, rms_scale: float = 0.2, adam_b1: float = 0.9,
                        adam_b2: float = 0.95, adam_eps: float = 1e-8,
                        adam_mu_dtype: str = "float32",
                        grad_clip_norm: float | None = None,
                        gather_matrices: bool = True,
                        ns_dtype: str = "bfloat16") -> optax.GradientTransformation:
  """Optional global-norm clipping, then Muon (per-head / per-expert / matrix) + AdamW.

  `params_like` is the parameter tree (arrays or ShapeDtypeStructs, e.g. from nnx.eval_shape);
  it fixes the kv_b block sizes and is checked for parameters the partition does not know. The
  groups themselves are recomputed from paths on every call, so the optimizer works on any tree
  with the same paths (nnx.State of nnx.Param or plain dicts). `grad_clip_norm` None or 0: off.
  `ns_dtype` is the Newton–Schulz matmul operand dtype ("bfloat16" | "float32"; float32
  accumulation either way). `adam_mu_dtype` stores the AdamW leaves' first moment ("float32" |
  "bfloat16").
  """
  unknown = fallback_paths(params_like)
  if unknown:
    warnings.warn(f"Muon partition: {len(unknown)} parameters with unrecognised names got the generic "
                  f"rule (2-D → whole-matrix Muon, otherwise AdamW without decay): {unknown[:8]}")
  muon = muon_matrices(learning_rate, weight_decay=weight_decay, momentum=momentum,
                       rms_scale=rms_scale, ns_dtype=ns_dtype)
  if gather_matrices:
    muon = gather_for_newton_schulz(muon, params_like)
  adamw = optax.adamw(learning_rate, b1=adam_b1, b2=adam_b2, eps=adam_eps,
                      mu_dtype=jnp.dtype(adam_mu_dtype), weight_decay=weight_decay,
                      mask=_decay_mask)
  partitioned = optax.partition({_MUON: muon, _ADAMW: adamw}, _labels)
  tx = split_last_axis(partitioned, kv_b_block_sizes(params_like))
  if grad_clip_norm:
    return optax.chain(optax.clip_by_global_norm(grad_clip_norm), tx)
  return tx
