"""Per-device memory plan of a training run on a mesh: does it fit? Nothing is allocated.

  python -m k3train.tools.plan --config=configs/k3_full.py --devices=1024 --device-memory=139 \\
      --mesh data=1,fsdp=-1,expert=64,sequence=1,tensor=8 --rules full --seq-len 4096 \\
      --batch-per-device 1 --remat full
  python -m k3train.tools.plan --config=configs/k3_full.py --devices=4096 --device-memory=139 \\
      --seq-len 131072 --search            # list meshes that fit, most tokens per device first

State (exact, from the real code paths): the model is built with `nnx.eval_shape`, the optimizer
state with `jax.eval_shape(make_optimizer(cfg, params).init, params)`; shardings come from
`state_sharding.nnx_state_shardings` / `mirror_shardings` on a `jax.sharding.AbstractMesh` of the
requested sizes, so a dimension the mesh does not divide fails with the same MeshError a real run
gives. Per-device bytes = shard shape × itemsize (every device holds an equal shard).

Activations (an analytic estimate; every term is listed with `--verbose`). Tokens per device:
n = b · T / sequence, where b = sequences per batch shard (--batch-per-device) and the batch is
split over the mesh axes of the `batch` rule (data, fsdp, expert); the `tensor` axis holds the
same tokens. Per decoder layer the "all" residuals are what autodiff keeps without remat; the
"dot" residuals are the matmul (dot_general) outputs, the only ones `dots_saveable` keeps
(`ragged_dot`, i.e. the expert grouped matmuls, is not a dot_general and is recomputed):

  AttnRes mix (×2 per layer)  the N_max = ceil(L/12) + 1 source slots (a new buffer per site,
                              model.dtype) and per-source fp32 statistics; the fp32 copy and
                              the normalised keys (2 · N_max · d · 4 bytes per token) are
                              assumed fused into their consumers, so they count as transient
  RMSNorm (×2)                fp32 input + low-precision output
  KDA                         q/k/v/g/f/b projections, conv and SiLU outputs, fp32 L2-normed
                              q/k, gates, chunk states [H, K, V] fp32 per 64-token chunk,
                              W/U per token, fp32 output, norm and gate
  MLA                         latent and head projections, fp32 latent norms and gate; the
                              attention itself is assumed to be a flash / cuDNN kernel (GPU) or
                              splash kernel (TPU): it saves its output and log-sum-exp only,
                              O(T·H·d) memory. NOTE: k3train/model/mla.py today materialises
                              [B, H, T, S] fp32 logits; --attention=naive plans that.
                              With sequence parallelism K/V of the whole sequence are gathered.
  MoE                         router (fp32 input, logits, scores), latent down/up, shared
                              experts, and the dropless expert-parallel buffers: each device
                              receives up to ep · n · k rows of width ℓ (worst case, every pair
                              routed to one device; k3train/parallel/expert.py), and keeps the
                              gmm input, gate/up/hidden outputs for backward; the exchange
                              itself needs ~3 such [ep·n·k, ℓ] buffers at once (send, receive,
                              regrouped). Quantile Balancing compares each device's own
                              [n, E] fp32 margins (bisection over counts; forward only).

Remat policies (k3train/model/decoder.py: the scan body, one super-block of 4 layers, is what
`jax.checkpoint` wraps; each unscanned prefix/suffix layer is wrapped on its own):
  full            saved: the scan carry per super-block — the AttnRes source buffer
                  [N_max, n, d] plus the partial sum — and the same input stream per unscanned
                  layer; backward working set: one super-block's residuals (4 layers) or one
                  unscanned layer's, whichever is larger, + its buffers.
  dots_saveable   as full, plus every dot output of every super-block; the working set is the
                  non-dot residuals of one super-block (dots_with_no_batch_dims_saveable is
                  planned the same way: K3's projections have no batch dims).
  none            every layer's residuals.

Other terms: gradients (fp32, sharded like the parameters); the weights of the largest layer
(or the embedding / head) gathered over fsdp/sequence/data in model.dtype, twice (the next
layer's gather overlaps this layer's compute), plus its fp32 gradient before the reduce-scatter
(only `tensor` and `expert` stay split inside a layer); the optimizer
update's transient (3 × the largest local optimizer leaf). The peak is the largest of the
forward, backward and optimizer phases; it fits if it is at most device memory × (1 − margin).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import itertools
import json
import math
import sys
from typing import Mapping, Sequence

GiB = 1024 ** 3


# ----------------------------------------------------------------------------- config and state


def load_config(path: str):
  """`get_config()` of a config file (configs/*.py), validated."""
  from k3train import config as config_lib
  spec = importlib.util.spec_from_file_location("k3train_plan_config", path)
  if spec is None or spec.loader is None:
    raise FileNotFoundError(f"config file {path!r} not found")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return config_lib.validate(module.get_config())


@dataclasses.dataclass
class AbstractState:
  """Shapes of parameters, other model variables and optimizer state (no arrays)."""
  params: object          # nnx.State of ShapeDtypeStructs
  rest: object            # nnx.State (router bias, QB, loads, max logits)
  opt: object             # optax state pytree of ShapeDtypeStructs


def abstract_state(cfg) -> AbstractState:
  import jax
  from flax import nnx
  from k3train.model.decoder import K3Model
  from k3train.optim.optimizer import make_optimizer
  model = nnx.eval_shape(lambda: K3Model(cfg.model, rngs=nnx.Rngs(params=0)))
  _, params, rest = nnx.split(model, nnx.Param, ...)
  optimizer = make_optimizer(cfg, params)
  return AbstractState(params, rest, jax.eval_shape(optimizer.init, params))


def abstract_mesh(sizes: Mapping[str, int]):
  """A device-less mesh with the axes of k3train/parallel/mesh.py (resolved sizes)."""
  from jax.sharding import AbstractMesh
  from k3train.parallel.mesh import MESH_AXES
  return AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES)


def _leaf_bytes(shape, dtype, sharding=None) -> int:
  import numpy as np
  local = sharding.shard_shape(tuple(shape)) if sharding is not None else tuple(shape)
  return math.prod(local) * np.dtype(dtype).itemsize


@dataclasses.dataclass
class StateBytes:
  params: int
  rest: int
  opt: int
  largest_opt_leaf: int                 # local bytes of the largest optimizer leaf
  replicated_opt: list[tuple[str, int]]  # optimizer leaves that mirror no parameter (bytes)
  units: dict[str, int]                 # per-unit parameter counts per device after gathering
                                        # over fsdp/sequence/data (tensor, expert stay split)


def state_bytes(state: AbstractState, rules, mesh) -> StateBytes:
  """Per-device bytes of the train state on `mesh` through the real sharding code."""
  import jax
  from k3train.parallel import state_sharding
  from k3train.tree_paths import path_names
  param_sh = state_sharding.nnx_state_shardings(state.params, rules, mesh)
  rest_sh = state_sharding.nnx_state_shardings(state.rest, rules, mesh)
  opt_sh = state_sharding.mirror_shardings(state.opt, state.params, param_sh, mesh)

  def total(tree, shardings):
    leaves = jax.tree_util.tree_leaves(tree)
    shs = jax.tree_util.tree_leaves(shardings)
    return sum(_leaf_bytes(x.shape, x.dtype, s) for x, s in zip(leaves, shs))

  # Which optimizer leaves mirror no parameter: run the same matching with parameter indices in
  # place of shardings; unmatched leaves come back as the replicated NamedSharding.
  treedef = jax.tree_util.tree_structure(param_sh)
  index_tree = jax.tree_util.tree_unflatten(treedef, list(range(treedef.num_leaves)))
  matched = jax.tree_util.tree_leaves(
      state_sharding.mirror_shardings(state.opt, state.params, index_tree, mesh))
  opt_leaves = jax.tree_util.tree_flatten_with_path(state.opt)[0]
  opt_shs = jax.tree_util.tree_leaves(opt_sh)
  largest, replicated = 0, []
  for (path, x), s, hit in zip(opt_leaves, opt_shs, matched):
    b = _leaf_bytes(x.shape, x.dtype, s)
    largest = max(largest, b)
    if not isinstance(hit, int) and len(x.shape) >= 2:
      replicated.append((".".join(path_names(path)), b))

  # Gathered compute copies: only `tensor` and `expert` stay split inside a layer.
  units: dict[str, int] = {}
  for (path, x), s in zip(jax.tree_util.tree_flatten_with_path(state.params)[0],
                          jax.tree_util.tree_leaves(param_sh)):
    names = path_names(path)
    kept = 1
    for dim_axes in s.spec:
      axes = (dim_axes,) if isinstance(dim_axes, str) else (dim_axes or ())
      kept *= math.prod(mesh.shape[a] for a in axes if a in ("tensor", "expert"))
    count = math.prod(x.shape) // kept
    unit = _unit_of(names)
    if names[0] == "stack":
      count //= x.shape[0]                             # one scan iteration at a time
    units[unit] = units.get(unit, 0) + count
  return StateBytes(total(state.params, param_sh), total(state.rest, rest_sh),
                    total(state.opt, opt_sh), largest, replicated, units)


@dataclasses.dataclass(frozen=True)
class LeafLayout:
  """One state leaf, independent of mesh sizes: its mesh axes per dimension."""
  group: str                        # "params" | "rest" | "opt"
  name: str
  shape: tuple[int, ...]
  itemsize: int
  axes: tuple[tuple[str, ...], ...]  # mesh axes per dimension (logical_to_spec)
  unit: str = ""                    # params: the compute unit it is gathered with
  mirrored: bool = True             # opt: mirrors a parameter


def _unit_of(names: Sequence[str]) -> str:
  """The layer a parameter belongs to (weights are gathered layer by layer)."""
  if names[0] == "stack":
    return f"scanned layer {names[2]}"     # stack.layers.<i>: layer i of every super-block
  if names[0] in ("prefix", "suffix"):
    return f"{names[0]} layer {names[1]}"
  return names[0]


def leaf_layouts(state: AbstractState, rules) -> list[LeafLayout]:
  """Mesh-independent layout of every state leaf, for fast per-mesh sizing (`--search`).

  Same rules as the real path: parameters and model variables from their logical names
  (`logical_to_spec`), optimizer leaves from `mirror_shardings` (run once with parameter
  indices in place of shardings).
  """
  import jax
  import numpy as np
  from flax import nnx
  from k3train.parallel import axes as axes_lib
  from k3train.parallel import rules as rules_lib
  from k3train.parallel import state_sharding
  from k3train.parallel.mesh import MESH_AXES
  from k3train.tree_paths import path_names

  def axes_of(spec) -> tuple[tuple[str, ...], ...]:
    return tuple((e,) if isinstance(e, str) else tuple(e or ()) for e in spec)

  out, param_axes = [], []
  for group, tree in (("params", state.params), ("rest", state.rest)):
    for path, var in jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]:
      names = path_names(path)
      value = var.get_value()
      logical = axes_lib.names_of(var)
      axes = axes_of(rules_lib.logical_to_spec(logical, rules)) if logical else \
          ((),) * len(value.shape)
      leaf = LeafLayout(group, ".".join(names), tuple(value.shape), np.dtype(value.dtype).itemsize,
                        axes, _unit_of(names))
      out.append(leaf)
      if group == "params":
        param_axes.append(axes)
  treedef = jax.tree_util.tree_structure(state.params)
  index_tree = jax.tree_util.tree_unflatten(treedef, list(range(treedef.num_leaves)))
  one = abstract_mesh({a: 1 for a in MESH_AXES})
  matched = jax.tree_util.tree_leaves(
      state_sharding.mirror_shardings(state.opt, state.params, index_tree, one))
  for (path, x), hit in zip(jax.tree_util.tree_flatten_with_path(state.opt)[0], matched):
    mirrored = isinstance(hit, int)
    axes = param_axes[hit] if mirrored else ((),) * len(x.shape)
    out.append(LeafLayout("opt", ".".join(path_names(path)), tuple(x.shape),
                          np.dtype(x.dtype).itemsize, axes, mirrored=mirrored))
  return out


def state_bytes_fast(layouts: Sequence[LeafLayout], sizes: Mapping[str, int]) -> StateBytes:
  """`state_bytes` from precomputed layouts: the same numbers (tested), ~100× faster."""
  from k3train.parallel.mesh import MeshError
  totals = {"params": 0, "rest": 0, "opt": 0}
  largest, replicated, units = 0, [], {}
  for leaf in layouts:
    local, kept = [], 1
    for dim, (size, axes) in enumerate(zip(leaf.shape, leaf.axes)):
      div = math.prod(sizes[a] for a in axes)
      if size % div:
        raise MeshError(f"{leaf.group} {leaf.name}: dimension {dim} (size {size}) is not divisible "
                        f"by mesh axes {axes} ({div} devices)")
      local.append(size // div)
      kept *= math.prod(sizes[a] for a in axes if a in ("tensor", "expert"))
    b = math.prod(local) * leaf.itemsize
    totals[leaf.group] += b
    if leaf.group == "opt":
      largest = max(largest, b)
      if not leaf.mirrored and len(leaf.shape) >= 2:
        replicated.append((leaf.name, b))
    if leaf.group == "params":
      count = math.prod(leaf.shape) // kept
      if leaf.unit.startswith("scanned"):
        count //= leaf.shape[0]
      units[leaf.unit] = units.get(leaf.unit, 0) + count
  return StateBytes(totals["params"], totals["rest"], totals["opt"], largest, replicated, units)


# ----------------------------------------------------------------------------- activations


@dataclasses.dataclass
class Dims:
  """Per-device sizes of the activations (from the rule table on the mesh)."""
  b: int            # sequences per batch shard
  batch_shards: int
  global_batch: int
  T: int            # sequence length
  t_local: int      # tokens of one sequence on this device
  n: int            # tokens per device
  seq_shards: int
  d: int            # stream width per device
  kda_heads: int
  mla_heads: int
  dense_hidden: int
  shared_hidden: int
  expert_hidden: int
  vocab: int
  ep: int           # devices the experts are split over


def activation_dims(cfg, rules, mesh, seq_len: int, batch_per_device: int) -> Dims:
  from k3train.parallel import axes as ax
  from k3train.parallel import rules as rules_lib
  m = cfg.model

  def axes_of(names):
    used, out = set(), []
    for name in names:
      axes = tuple(a for a in rules_lib.mesh_axes_for(rules, name) if a not in used and mesh.shape[a] > 1)
      used.update(axes)
      out.append(math.prod(mesh.shape[a] for a in axes))
    return out

  batch_shards, seq_shards = axes_of((ax.BATCH, ax.SEQ))
  B = batch_per_device * batch_shards
  # The real batch sharding check (same message as a run): seq_len must divide over `sequence`.
  rules_lib.spec_for((ax.BATCH, ax.SEQ), (B, seq_len), rules, mesh,
                     what="batch [global batch, seq_len]")

  def local(names, shape):
    """Per-device size of the last dimension (spec_for raises the run's error if it does not divide)."""
    rules_lib.spec_for(names, shape, rules, mesh, what=f"activation {tuple(names)}")
    return shape[-1] // axes_of(names)[-1]

  act = (ax.BATCH, ax.SEQ)
  e = m.moe
  return Dims(
      b=batch_per_device, batch_shards=batch_shards, global_batch=B, T=seq_len,
      t_local=seq_len // seq_shards, n=batch_per_device * seq_len // seq_shards,
      seq_shards=seq_shards,
      d=local(act + (ax.EMBED,), (B, seq_len, m.d_model)),
      kda_heads=local(act + (ax.HEADS,), (B, seq_len, m.kda.num_heads)),
      mla_heads=local(act + (ax.HEADS,), (B, seq_len, m.mla.num_heads)),
      dense_hidden=local(act + (ax.MLP,), (B, seq_len, m.dense_ffn_hidden)),
      shared_hidden=local(act + (ax.MLP,), (B, seq_len, e.shared_hidden)),
      expert_hidden=local((ax.EXPERTS, ax.LATENT, ax.EXPERT_MLP),
                          (e.num_experts, e.latent_dim, e.expert_hidden)),
      vocab=local(act + (ax.VOCAB,), (B, seq_len, m.vocab_size)),
      ep=axes_of((ax.EXPERTS,))[0])


@dataclasses.dataclass
class Cost:
  """Bytes of one layer (or piece): residuals saved for backward, the dot-output part of them,
  and the transient peak of its buffers in forward / backward."""
  saved: int = 0
  dots: int = 0
  transient: int = 0
  terms: dict = dataclasses.field(default_factory=dict)

  def add(self, name: str, saved: int = 0, dots: int = 0, transient: int = 0) -> "Cost":
    self.saved += saved + dots
    self.dots += dots
    self.transient = max(self.transient, transient)
    self.terms[name] = self.terms.get(name, 0) + saved + dots + transient
    return self

  def __add__(self, other: "Cost") -> "Cost":
    out = Cost(self.saved + other.saved, self.dots + other.dots,
               max(self.transient, other.transient), dict(self.terms))
    for k, v in other.terms.items():
      out.terms[k] = out.terms.get(k, 0) + v
    return out


def layer_costs(cfg, dims: Dims, attention: str, expert_capacity: float | None = None) -> dict[str, Cost]:
  """Costs of the pieces of a decoder layer on one device (bytes), keyed by kind.

  expert_capacity: None plans today's dropless exchange (ep · n · k receive rows); a factor c
  plans a capacity-bounded one (min(ep, c) · n · k rows; not implemented in k3train today).
  """
  import numpy as np
  m = cfg.model
  A = np.dtype(m.dtype).itemsize          # activation bytes
  F = 4                                   # fp32
  n, d = dims.n, dims.d
  ns = -(-m.num_layers // m.attn_res.block_size) + 1
  out = {}

  # The sources buffer (blocks + partial sum) is a new array per site; its fp32 copy and the
  # normalised keys are elementwise and assumed fused into their consumers (transient only).
  out["attn_res"] = Cost().add("attn_res: sources [N_max, n, d] + fp32 stats",
                               saved=n * ns * d * A + 2 * n * ns * F,
                               dots=n * d * F + n * ns * F, transient=2 * n * ns * d * F)
  out["norm"] = Cost().add("rmsnorm: fp32 input + output", saved=n * d * (F + A))

  k = m.kda
  h, K, V = dims.kda_heads, k.head_dim, k.head_dim
  c = Cost()
  c.add("kda: projections q,k,v,g,f,b,o", dots=n * (5 * h * K * A + K * A + h * A + d * A))
  c.add("kda: conv + silu outputs, fp32 l2-normed q/k, gates",
        saved=n * h * K * (6 * A + 4 * F) + n * h * F)
  c.add("kda: chunk states [H,K,V] fp32 per chunk + W/U",
        saved=n * h * K * V * F // k.chunk_size + n * h * (K + V) * F,
        transient=n * h * k.chunk_size * F * 2
        + (2 * dims.seq_shards * dims.b * h * K * (K + V) * F if dims.seq_shards > 1 else 0))
  c.add("kda: fp32 output, norm, gate", saved=n * h * V * (3 * F + A))
  out["kda"] = c

  a = m.mla
  h = dims.mla_heads
  qk = a.qk_nope_head_dim + a.qk_rope_head_dim
  c = Cost()
  c.add("mla: projections q_a,q_b,kv_a,kv_b,g,o",
        dots=n * (a.q_lora_rank * A + h * qk * A + (a.kv_lora_rank + a.qk_rope_head_dim) * A
                  + h * (a.qk_nope_head_dim + a.v_head_dim) * A + h * a.v_head_dim * A + d * A))
  c.add("mla: fp32 latent norms, gate, output", saved=n * (a.q_lora_rank * F + a.kv_lora_rank * F
                                                           + h * a.v_head_dim * (2 * F + A) + h * F))
  kv_gathered = 0
  if dims.seq_shards > 1:   # K/V of the other sequence shards, and their cotangents in backward
    kv_gathered = 2 * dims.b * (dims.T - dims.t_local) * (
        h * (a.qk_nope_head_dim + a.v_head_dim) + a.qk_rope_head_dim) * A
  if attention == "naive":
    scores = dims.b * h * dims.t_local * dims.T
    c.add("mla: [B,H,T,S] probabilities (naive attention)",
          saved=scores * (F + A) + dims.b * dims.t_local * dims.T,
          transient=2 * scores * F + kv_gathered)
  else:
    c.add("mla: gathered K/V over sequence (flash attention)", transient=kv_gathered)
  out["mla"] = c

  hf = dims.dense_hidden
  out["dense"] = Cost().add("dense ffn", dots=n * (2 * hf * A + d * A), saved=n * hf * (A + F))

  e = m.moe
  E, topk, lat, fl, sh = e.num_experts, e.top_k, e.latent_dim, dims.expert_hidden, dims.shared_hidden
  rows = expert_rows(dims, topk, expert_capacity)
  c = Cost()
  c.add("moe: router fp32 input, logits, scores", dots=n * E * F, saved=n * (d * F + E * F + topk * 8))
  c.add("moe: latent down/up, latent norm", dots=n * (lat * A + d * A), saved=n * lat * (F + A))
  c.add("moe: shared experts", dots=n * (2 * sh * A + d * A), saved=n * sh * (A + F))
  c.add(f"moe: expert rows (ep·n·k = {rows:,}) gmm input, gate/up/hidden, combine",
        saved=rows * (lat + 3 * fl) * A + n * topk * lat * A,
        transient=3 * rows * lat * A)
  out["moe"] = c
  # QB finds its quantile by bisection over per-expert counts: each device compares only its own
  # n tokens' [n, E] fp32 margins (and their uint32 keys) and all-reduces [E] counts.
  out["qb_sort"] = Cost().add("moe: Quantile Balancing margins + keys [n, E] (forward)",
                              transient=2 * n * E * F)

  c = Cost()
  c.add("embedding output", saved=n * d * A)
  c.add("final norm + head logits + fp32 loss", dots=n * dims.vocab * A,
        saved=n * d * (F + A) + n * dims.vocab * F, transient=n * dims.vocab * F * 2)
  out["head"] = c + out["attn_res"]
  out["carry"] = Cost().add("scan carry: AttnRes source buffer + partial sum", saved=(ns + 1) * n * d * A)
  return out


def expert_rows(dims: Dims, top_k: int, expert_capacity: float | None) -> int:
  """Rows of the expert exchange's receive buffer per device (k3train/parallel/expert.py)."""
  factor = dims.ep if expert_capacity is None else min(dims.ep, expert_capacity)
  return int(math.ceil(factor * dims.n * top_k))


def layer_cost(costs: Mapping[str, Cost], kind: tuple[str, str]) -> Cost:
  mixer, ffn = kind
  return costs["attn_res"] + costs["attn_res"] + costs["norm"] + costs["norm"] + costs[mixer] + costs[ffn]


# ----------------------------------------------------------------------------- the plan


@dataclasses.dataclass
class Plan:
  sizes: dict
  rules: str
  remat: str
  attention: str
  dims: Dims
  device_memory: int
  margin: float
  state: StateBytes
  lines: list            # (label, bytes, note)
  phases: dict           # phase → peak bytes
  detail: dict           # per-piece terms
  microbatches: int = 1  # gradient accumulation: the batch line is per micro-batch

  @property
  def peak(self) -> int:
    return max(self.phases.values())

  @property
  def budget(self) -> int:
    return int(self.device_memory * (1 - self.margin))

  @property
  def fits(self) -> bool:
    return self.peak <= self.budget


def make_plan(cfg, state: AbstractState, sizes: Mapping[str, int], *, rules_name: str,
              seq_len: int, batch_per_device: int, remat: str, attention: str = "flash",
              device_memory_gib: float, margin: float = 0.10,
              expert_capacity: float | None = None, layouts=None, microbatches: int = 1) -> Plan:
  """The plan for resolved mesh `sizes`; raises MeshError when the mesh does not divide.

  batch_per_device is per micro-batch; with microbatches > 1 the fp32 gradient accumulator (one
  more gradient-sized buffer) is live in the backward phase next to the micro-batch's gradient.
  """
  import numpy as np
  from k3train import config as config_lib
  from k3train.parallel import rules as rules_lib
  if remat not in config_lib.REMAT_POLICIES:
    raise ValueError(f"--remat must be one of {config_lib.REMAT_POLICIES}, got {remat!r}")
  if attention not in ("flash", "naive"):
    raise ValueError(f"--attention must be flash or naive, got {attention!r}")
  if batch_per_device < 1:
    raise ValueError(f"--batch-per-device must be >= 1, got {batch_per_device}")
  if microbatches < 1:
    raise ValueError(f"--microbatches must be >= 1, got {microbatches}")
  rules = rules_lib.get_rules(rules_name)
  mesh = abstract_mesh(sizes)
  sb = state_bytes(state, rules, mesh) if layouts is None else state_bytes_fast(layouts, sizes)
  dims = activation_dims(cfg, rules, mesh, seq_len, batch_per_device)
  costs = layer_costs(cfg, dims, attention, expert_capacity)
  rows = expert_rows(dims, cfg.model.moe.top_k, expert_capacity)
  sched = config_lib.layer_schedule(cfg.model)
  A = np.dtype(cfg.model.dtype).itemsize
  P = np.dtype(cfg.model.param_dtype).itemsize

  period = Cost()
  for kind in sched.period:
    period = period + layer_cost(costs, kind)
  unscanned = [sched.kinds[i] for i in range(sched.prefix)] + \
              [sched.kinds[i] for i in range(sched.suffix_start, cfg.model.num_layers)]
  unscanned_cost = Cost()
  for kind in unscanned:
    unscanned_cost = unscanned_cost + layer_cost(costs, kind)
  head, carry = costs["head"], costs["carry"].saved
  nsb = sched.num_super_blocks
  grad_carry = 2 * carry                       # cotangents of a super-block's carry in and out
  transient = max(period.transient, unscanned_cost.transient, head.transient)

  if remat == "none":
    saved = nsb * period.saved + unscanned_cost.saved + head.saved
    working = transient + grad_carry
    saved_note = f"all {cfg.model.num_layers} layers' residuals"
  elif remat == "full":
    # The unscanned layers are rematerialised too: each keeps its input stream (one carry).
    unscanned_max = max((layer_cost(costs, kind).saved for kind in unscanned), default=0)
    saved = (nsb + len(unscanned)) * carry + head.saved
    working = max(period.saved, unscanned_max) + transient + grad_carry
    saved_note = (f"{nsb} scan carries + {len(unscanned)} unscanned-layer inputs "
                  f"({carry / GiB:.2f} GiB each) + head")
  else:   # dots_saveable, dots_with_no_batch_dims_saveable (planned alike)
    unscanned_max = max((layer_cost(costs, kind).saved - layer_cost(costs, kind).dots
                         for kind in unscanned), default=0)
    saved = nsb * (carry + period.dots) + len(unscanned) * carry + unscanned_cost.dots + head.saved
    working = max(period.saved - period.dots, unscanned_max) + transient + grad_carry
    saved_note = (f"{nsb} × (carry + dot outputs {period.dots / GiB:.2f} GiB) + "
                  f"{len(unscanned)} unscanned layers + head")
  # One layer's intermediates are live in the forward pass (freed as it goes under remat).
  fwd_layer = max(layer_cost(costs, kind).saved for kind in set(sched.kinds))
  qb = costs["qb_sort"].transient if cfg.model.moe.quantile_balancing else 0

  unit_name, unit_params = max(sb.units.items(), key=lambda kv: kv[1])
  gathered_fwd = 2 * unit_params * A
  gathered_bwd = gathered_fwd + unit_params * P
  grads = sb.params
  accumulator = grads if microbatches > 1 else 0
  opt_transient = 3 * sb.largest_opt_leaf
  static = sb.params + sb.rest + sb.opt
  phases = {
      "forward": static + accumulator + gathered_fwd + saved + max(fwd_layer + transient, qb),
      "backward": static + accumulator + grads + gathered_bwd + saved + working,
      "optimizer": static + grads + opt_transient,
  }
  dtype_note = f"{cfg.model.param_dtype}"
  repl = sum(b for _, b in sb.replicated_opt)
  lines = [
      ("parameters", sb.params, f"{dtype_note} master weights"),
      ("model variables", sb.rest, "router bias, QB, loads, max logits"),
      ("optimizer state", sb.opt, f"{cfg.optim.optimizer}: mirrors the parameter shardings"
       + (f"; {len(sb.replicated_opt)} leaves replicated ({repl / GiB:.2f} GiB)" if repl else "")),
      ("gradients", grads, f"{dtype_note}, sharded like the parameters"),
      ("gradient accumulator", accumulator,
       f"{microbatches} micro-batches: running sum, like the gradients" if microbatches > 1
       else "none (train.microbatches = 1)"),
      ("gathered weights", gathered_bwd, f"largest layer ({unit_name}) in {cfg.model.dtype} ×2 "
       f"+ its {dtype_note} gradient"),
      ("saved activations", saved, f"remat={remat}: {saved_note}"),
      ("backward working set", working, "one super-block's residuals + buffers" if remat == "full"
       else "non-dot residuals of one super-block + buffers" if remat.startswith("dots")
       else "largest layer's buffers + carry cotangents"),
      ("  of which expert buffers", 3 * rows * cfg.model.moe.latent_dim * A,
       f"3 × [{rows:,} rows, ℓ] exchange buffers ("
       + ("ep·n·k: dropless worst case)" if expert_capacity is None
          else f"capacity {expert_capacity:g}·n·k: hypothetical, not in k3train)")),
      ("forward QB margins", qb, "this device's n tokens × E experts, fp32 + uint32 keys (bisection; forward only)"),
      ("optimizer transient", opt_transient, "3 × the largest local optimizer leaf"),
  ]
  detail = {"super-block": period.terms, "unscanned": unscanned_cost.terms, "head": head.terms,
            "carry": carry}
  return Plan(dict(sizes), rules_name, remat, attention, dims, int(device_memory_gib * GiB),
              margin, sb, lines, phases, detail, microbatches)


def format_plan(plan: Plan, config_name: str = "", verbose: bool = False) -> str:
  from k3train.parallel.mesh import describe
  d = plan.dims
  mb = plan.microbatches
  tokens = d.global_batch * d.T * mb
  micro = f" × {mb} micro-batches" if mb > 1 else ""
  out = [f"plan {config_name}: {math.prod(plan.sizes.values())} devices, mesh {describe(plan.sizes)}, "
         f"rules={plan.rules}, remat={plan.remat}, attention={plan.attention}",
         f"  batch: {d.b} × {d.T:,}-token sequence(s) per batch shard × {d.batch_shards} shards"
         f"{micro} = global batch {d.global_batch * mb} ({tokens / 1e6:.2f} M tokens/step); "
         f"{d.n:,} tokens per device ({d.seq_shards} sequence shards)"]
  for label, b, note in plan.lines:
    out.append(f"  {label:<26}{b / GiB:9.2f} GiB  {note}")
  for phase, b in plan.phases.items():
    out.append(f"  peak in {phase:<18}{b / GiB:9.2f} GiB")
  verdict = "FITS" if plan.fits else "DOES NOT FIT"
  over = plan.peak - plan.budget
  out.append(f"  peak {plan.peak / GiB:.2f} GiB of {plan.budget / GiB:.2f} GiB usable "
             f"({plan.device_memory / GiB:.0f} GiB − {plan.margin:.0%} margin): {verdict}"
             + (f" (over by {over / GiB:.2f} GiB)" if over > 0 else
                f" ({-over / GiB:.2f} GiB spare)"))
  if verbose:
    for part, terms in plan.detail.items():
      if isinstance(terms, dict):
        out.append(f"  [{part}]")
        out.extend(f"    {k:<60}{v / GiB:9.3f} GiB" for k, v in terms.items())
    for name, b in plan.state.replicated_opt:
      out.append(f"  [replicated optimizer leaf] {name} {b / GiB:.3f} GiB")
  return "\n".join(out)


def plan_json(plan: Plan) -> dict:
  return {"mesh": plan.sizes, "rules": plan.rules, "remat": plan.remat, "attention": plan.attention,
          "batch_per_device": plan.dims.b, "microbatches": plan.microbatches,
          "global_batch": plan.dims.global_batch * plan.microbatches,
          "seq_len": plan.dims.T, "tokens_per_device": plan.dims.n,
          "bytes": {label.strip(): b for label, b, _ in plan.lines},
          "phases": plan.phases, "peak": plan.peak, "budget": plan.budget, "fits": plan.fits}


# ----------------------------------------------------------------------------- mesh search


def _divisors(n: int) -> list[int]:
  return [k for k in range(1, n + 1) if n % k == 0]


def search(cfg, state: AbstractState, num_devices: int, *, rules_name: str, seq_len: int,
           remat: str, attention: str, device_memory_gib: float, margin: float,
           expert_capacity: float | None = None, max_tensor: int = 8,
           max_batch_per_device: int = 64, top: int = 10) -> list[Plan]:
  """Fitting plans over all meshes (data, fsdp, expert, sequence, tensor ≤ max_tensor) of
  `num_devices`, each with the largest power-of-two batch per device that fits: most tokens per
  device first, then fewest replicas (data), then least memory. Meshes the model does not
  divide are skipped."""
  from k3train.parallel import rules as rules_lib
  from k3train.parallel.mesh import MeshError
  layouts = leaf_layouts(state, rules_lib.get_rules(rules_name))
  found = []
  for tensor in [t for t in _divisors(num_devices) if t <= max_tensor]:
    for sequence in _divisors(num_devices // tensor):
      if seq_len % sequence:
        continue
      for expert in _divisors(num_devices // (tensor * sequence)):
        for data in _divisors(num_devices // (tensor * sequence * expert)):
          fsdp = num_devices // (tensor * sequence * expert * data)
          sizes = dict(data=data, fsdp=fsdp, expert=expert, sequence=sequence, tensor=tensor)
          best, b = None, 1
          while b <= max_batch_per_device:
            try:
              p = make_plan(cfg, state, sizes, rules_name=rules_name, seq_len=seq_len,
                            batch_per_device=b, remat=remat, attention=attention,
                            device_memory_gib=device_memory_gib, margin=margin,
                            expert_capacity=expert_capacity, layouts=layouts)
            except MeshError:
              break
            if not p.fits:
              break
            best, b = p, b * 2
          if best is not None:
            found.append(best)
  found.sort(key=lambda p: (-p.dims.n, p.sizes["data"], p.sizes["sequence"], p.peak))
  return found[:top]


# ----------------------------------------------------------------------------- CLI


def parse_mesh(text: str) -> dict[str, int]:
  from k3train.parallel.mesh import MESH_AXES, MeshError
  sizes = {}
  for part in filter(None, (p.strip() for p in text.split(","))):
    name, eq, value = part.partition("=")
    if not eq or name not in MESH_AXES:
      raise MeshError(f"--mesh entry {part!r}: expected AXIS=SIZE with AXIS in {MESH_AXES}")
    try:
      sizes[name] = int(value)
    except ValueError:
      raise MeshError(f"--mesh entry {part!r}: size must be an integer") from None
  return sizes


def _gb_or_gib(text: str) -> float:
  return float(text.lower().removesuffix("gib").removesuffix("gb"))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m k3train.tools.plan",
                                   description="Per-device memory plan (see the module docstring).")
  parser.add_argument("--config", required=True, help="config file, e.g. configs/k3_full.py")
  parser.add_argument("--devices", type=int, required=True, help="number of devices")
  parser.add_argument("--device-memory", type=_gb_or_gib, required=True,
                      help="usable memory per device in GiB (H200: 139, TPU v5p: 95)")
  parser.add_argument("--mesh", default=None,
                      help="e.g. data=1,fsdp=-1,expert=64,sequence=1,tensor=8 (axes not named "
                           "are 1); default: the config's parallel section")
  parser.add_argument("--rules", default=None, help="rule recipe (default: parallel.rules)")
  parser.add_argument("--seq-len", type=int, default=None, help="default: data.seq_len")
  parser.add_argument("--batch-per-device", type=int, default=1,
                      help="sequences per batch shard and micro-batch "
                           "(global batch = this × data·fsdp·expert × microbatches)")
  parser.add_argument("--microbatches", type=int, default=1,
                      help="gradient accumulation steps (train.microbatches); adds the accumulator")
  parser.add_argument("--remat", default=None, help="none | full | dots_saveable (default: model.remat_policy)")
  parser.add_argument("--attention", default="flash", choices=("flash", "naive"),
                      help="MLA attention memory model (naive = today's [B,H,T,S] logits)")
  parser.add_argument("--margin", type=float, default=0.10, help="share kept free for XLA/runtime")
  parser.add_argument("--expert-capacity", type=float, default=None,
                      help="plan a capacity-bounded expert exchange of c·n·k rows instead of "
                           "today's dropless ep·n·k (hypothetical: not implemented in k3train)")
  parser.add_argument("--search", action="store_true", help="list the meshes that fit")
  parser.add_argument("--max-tensor", type=int, default=8, help="--search: largest tensor axis")
  parser.add_argument("--top", type=int, default=10, help="--search: how many to print")
  parser.add_argument("--json", action="store_true", help="print one JSON line instead of the table")
  parser.add_argument("--verbose", action="store_true", help="list every activation term")
  args = parser.parse_args(argv)

  from k3train import config as config_lib
  from k3train.parallel import mesh as mesh_lib
  try:
    cfg = load_config(args.config)
    rules_name = args.rules or cfg.parallel.rules
    seq_len = args.seq_len or cfg.data.seq_len
    remat = args.remat or cfg.model.remat_policy
    state = abstract_state(cfg)
    common = dict(rules_name=rules_name, seq_len=seq_len, remat=remat, attention=args.attention,
                  device_memory_gib=args.device_memory, margin=args.margin,
                  expert_capacity=args.expert_capacity)
    if args.search:
      plans = search(cfg, state, args.devices, max_tensor=args.max_tensor, top=args.top, **common)
      if not plans:
        print(f"no mesh with tensor <= {args.max_tensor} fits {args.config} at seq_len "
              f"{seq_len} on {args.devices} devices of {args.device_memory:g} GiB "
              f"(remat={remat}, attention={args.attention})")
        return 1
      for p in plans:
        print(json.dumps(plan_json(p)) if args.json else format_plan(p, args.config))
      return 0
    requested = parse_mesh(args.mesh) if args.mesh else mesh_lib.sizes_from_config(cfg.parallel)
    sizes = mesh_lib.resolve_axis_sizes(requested, args.devices)
    plan = make_plan(cfg, state, sizes, batch_per_device=args.batch_per_device,
                     microbatches=args.microbatches, **common)
  except (mesh_lib.MeshError, config_lib.ConfigError, ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(json.dumps(plan_json(plan)) if args.json else format_plan(plan, args.config, args.verbose))
  return 0 if plan.fits else 1


if __name__ == "__main__":
  sys.exit(main())
