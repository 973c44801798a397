"""Activation memory of one training step per device: an analytic estimate.

Every term is listed by `--verbose`. Tokens per device: n = b · T / sequence, where b = sequences
per batch shard (`--batch_per_device`) and the batch is split over the mesh axes of the `batch`
rule (data, fsdp, expert); the `tensor` axis holds the same tokens. Per decoder layer the "all"
residuals are what autodiff keeps without remat; the "dot" residuals are the matmul
(dot_general) outputs, the only ones `dots_saveable` keeps (`ragged_dot`, i.e. the expert
grouped matmuls, is not a dot_general and is recomputed). Assumptions, piece by piece:

  AttnRes mix (×2 per layer)  pallas_kernels/attnres `mix_pass`: the sources are the
                              stream's block buffer [N_max − 1, n, d] (model.dtype; a new
                              version per layer, half of it counted per site) and the partial
                              sum; the VJP keeps three [N_max, n] fp32 statistics (remat
                              `selective` keeps them by name). The fp32 source copies of the
                              backward (2 · N_max · d · 4 bytes per token) are transient
  RMSNorm (×2)                fp32 input + low-precision output
  KDA                         q/k/v/g/f/b projections, conv and SiLU outputs, fp32 L2-normed
                              q/k, gates, the chunk kernels' residuals (entering states
                              [H, K, V] per 64-token chunk, Δ, A_qk, A_kk and its inverse, W,
                              U, gated q/k, chunk decays), output, fp32 norm and gate
  MLA                         latent and head projections, fp32 latent norms and gate; the
                              attention op (pallas_kernels/attention, as mla.py calls it)
                              takes q and k 192 wide per head (k^R broadcast to every head)
                              and v, and saves its output and fp32 log-sum-exp: O(T·H·d)
                              memory. `--attention=naive` plans dense [B, H, T, S] fp32 logits
                              instead (the `reference` backend). With sequence parallelism
                              K and V of the whole sequence are all-gathered (parallel/attention.py).
  MoE                         router (fp32 input, logits, scores), latent down/up, shared
                              experts, and the dropless expert-parallel buffers: each device
                              receives up to ep · n · k rows of width ℓ (worst case, every pair
                              routed to one device; k3train/parallel/expert.py), and keeps the
                              gmm input, gate/up/hidden outputs for backward; the exchange
                              itself needs ~3 such [ep·n·k, ℓ] buffers at once (send, receive,
                              regrouped). Quantile Balancing compares each device's own
                              [n, E] fp32 margins (radix selection over counts; forward only).
  head                        embedding output, final norm, logits and their fp32 copy; the
                              backward writes the logits gradient over those two buffers.
  fused head                  (train.loss_chunk_tokens = c > 0, k3train/train/head_loss.py) no
                              [n, V] array: saved until backward the dx residual [n, d] in
                              model.dtype and the fp32 dW residual [d, V] laid out as the head
                              kernel; in forward only, one chunk of b · c / sequence tokens at a
                              time (its logits, softmax, d_logits and GEMM outputs: see
                              `fused_head_chunk_bytes`). Its backward only scales dx and dW.
  MTP                         (model.mtp.enabled, k3train/model/mtp.py) one more block on the
                              n tokens, rematerialised like an unscanned layer
                              (`K3Model.mtp_hidden`): its inputs h and Emb(t_{i+1}) [n, d]
                              (saved under every policy), and as residuals five RMSNorms
                              (hidden, embedding, attention, MLP, output), the proj output
                              [n, d] (a dot) and one MLA mixer and one MoE, as in a layer (no
                              AttnRes mix). Its output goes through the shared head a second
                              time: unfused, the head input [n, d], logits [n, V] and their
                              fp32 copy again (their gradient written over them, as the main
                              head's); fused, a second dx [n, d] and fp32 dW [d, V]
                              residual (the chunk loop runs again, after the main one, so its
                              forward buffers do not add).

Remat policies (k3train/model/decoder.py: the scan body, one super-block of 4 layers, is what
`jax.checkpoint` wraps; each unscanned prefix/suffix layer is wrapped on its own):

  full            saved: the scan carry per super-block (the AttnRes block buffer
                  [N_max − 1, n, d] plus the partial sum) and the same input stream per unscanned
                  layer; backward working set: one super-block's residuals (4 layers) or one
                  unscanned layer's, whichever is larger, + its buffers.
  dots_saveable   as full, plus every dot output of every super-block; the working set is the
                  non-dot residuals of one super-block (dots_with_no_batch_dims_saveable is
                  planned the same way: K3's projections have no batch dims).
  selective       as dots_saveable, plus the values k3train/model/remat.py keeps by name: the
                  top-k expert indices (int32), the expert gate/up gmm outputs and the combined
                  latent, the KDA conv
                  outputs of q, k, v, the attention output with its fp32 log-sum-exp and the
                  AttnRes statistics.
  selective_kda   as selective, plus the KDA chunk kernels' residuals and output.
  none            every layer's residuals.

The MTP block is planned like one more unscanned layer under each policy: full recomputes its
residuals in backward (a working-set candidate), dots_saveable keeps its dot outputs, none keeps
all of them; its head terms are saved like the main head's.

In the forward pass one layer's intermediates are live at a time (freed as it goes).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import numpy as np

from k3train import config as config_lib
from k3train.model import remat as remat_lib
from k3train.parallel import axes as ax
from k3train.parallel import rules as rules_lib
from k3train.train import head_loss

GiB = 1024 ** 3
FP32 = 4


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
  loss_chunk: int = 0   # positions of one fused-head chunk per sequence on this device
                        # (train.loss_chunk_tokens / sequence shards); 0: the unfused head
  head_d: int = 0       # per-device [d, V] of the head kernel (embed, vocab): the layout of the
  head_vocab: int = 0   # fused head's fp32 dW residual


def activation_dims(cfg, rules, mesh, seq_len: int, batch_per_device: int) -> Dims:
  """Per-device activation sizes; a dimension the mesh does not divide fails with the run's
  MeshError (from `spec_for`, as the batch sharding of a run does)."""
  m = cfg.model

  def axes_of(names):
    used, out = set(), []
    for name in names:
      axes = tuple(a for a in rules_lib.mesh_axes_for(rules, name)
                   if a not in used and mesh.shape[a] > 1)
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
  chunk = int(cfg.train.loss_chunk_tokens)
  if chunk:
    if chunk < 0 or seq_len % chunk:
      raise ValueError(f"{head_loss.CONFIG_KEY}={chunk} must be a positive divisor of the "
                       f"sequence length T={seq_len} (or 0 for the unfused head)")
    # A chunk's positions split over the sequence shards: the run's error when they do not divide.
    local(act + (ax.EMBED,), (B, chunk, m.d_model))
  head_shards = axes_of((ax.EMBED, ax.VOCAB))
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
      ep=axes_of((ax.EXPERTS,))[0],
      loss_chunk=chunk // seq_shards, head_d=m.d_model // head_shards[0],
      head_vocab=m.vocab_size // head_shards[1])


@dataclasses.dataclass
class Cost:
  """Bytes of one layer (or piece): residuals saved for backward, the dot-output part of them,
  the part of the non-dot residuals the `selective` policy keeps by name (`kept`, included in
  `saved`), the part `selective_kda` keeps besides (`kda`, the KDA kernels' residuals), and the
  transient peak of its buffers in forward / backward."""
  saved: int = 0
  dots: int = 0
  transient: int = 0
  terms: dict = dataclasses.field(default_factory=dict)
  kept: int = 0
  kda: int = 0

  def add(self, name: str, saved: int = 0, dots: int = 0, transient: int = 0,
          kept: int = 0, kda: int = 0) -> "Cost":
    """kept, kda: bytes of `saved` that the selective policy, and selective_kda besides it,
    keep (each at most saved)."""
    self.saved += saved + dots
    self.dots += dots
    self.kept += min(kept, saved)
    self.kda += min(kda, saved)
    self.transient = max(self.transient, transient)
    self.terms[name] = self.terms.get(name, 0) + saved + dots + transient
    return self

  def __add__(self, other: "Cost") -> "Cost":
    out = Cost(self.saved + other.saved, self.dots + other.dots,
               max(self.transient, other.transient), dict(self.terms), self.kept + other.kept,
               self.kda + other.kda)
    for k, v in other.terms.items():
      out.terms[k] = out.terms.get(k, 0) + v
    return out


def expert_rows(dims: Dims, top_k: int, expert_capacity: float | None) -> int:
  """Rows of the expert exchange's receive buffer per device (k3train/parallel/expert.py)."""
  factor = dims.ep if expert_capacity is None else min(dims.ep, expert_capacity)
  return int(math.ceil(factor * dims.n * top_k))


def layer_costs(cfg, dims: Dims, attention: str, expert_capacity: float | None = None) -> dict[str, Cost]:
  """Costs of the pieces of a decoder layer on one device (bytes), keyed by kind.

  expert_capacity: None plans today's dropless exchange (ep · n · k receive rows); a factor c
  plans a capacity-bounded one (min(ep, c) · n · k rows; not implemented in k3train today).
  """
  m = cfg.model
  A = np.dtype(m.dtype).itemsize          # activation bytes
  F = FP32
  n, d = dims.n, dims.d
  ns = -(-m.num_layers // m.attn_res.block_size) + 1
  out = {}

  # mix_pass reads the block buffer in place (one new version per layer: half per site) and
  # keeps three [N_max, n] fp32 statistics; its fp32 source copies exist only in the backward.
  out["attn_res"] = Cost().add("attn_res: block buffer version + fp32 stats [3, N_max, n]",
                               saved=n * (ns - 1) * d * A // 2 + 3 * n * ns * F,
                               kept=3 * n * ns * F, transient=2 * n * ns * d * F)
  out["norm"] = Cost().add("rmsnorm: fp32 input + output", saved=n * d * (F + A))

  k = m.kda
  h, K, V = dims.kda_heads, k.head_dim, k.head_dim
  c = Cost()
  c.add("kda: projections q,k,v,g,f,b,o", dots=n * (5 * h * K * A + K * A + h * A + d * A))
  c.add("kda: conv + silu outputs, fp32 l2-normed q/k, gates",
        saved=n * h * K * (6 * A + 4 * F) + n * h * F, kept=3 * n * h * K * A)
  C = k.chunk_size
  # The chunk kernels' residuals (pallas_kernels/kda/vjp.py) in the activation dtype but A_kk
  # (fp32): entering states [K, V] per chunk, Δ, A_qk and its A_kk and inverse [C] per token,
  # W, U, gated q and k, and the chunk decays [K] fp32 per chunk.
  kernel = n * h * (K * V * A // C + V * A + C * (2 * A + F) + (3 * K + V) * A + K * F // C)
  c.add("kda: chunk kernels' residuals (states per chunk, Δ, A_qk, A_kk, W, U, gated q/k)",
        saved=kernel, kda=kernel,
        transient=n * h * C * F * 2
        + (2 * dims.seq_shards * dims.b * h * K * (K + V) * F if dims.seq_shards > 1 else 0))
  c.add("kda: output, fp32 norm, gate", saved=n * h * V * (3 * F + A), kda=n * h * V * A)
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
  c.add("mla: attention op inputs q, k [n, H, dqk], output and log-sum-exp",
        saved=n * h * (2 * qk * A + a.v_head_dim * A + F), kept=n * h * (a.v_head_dim * A + F))
  kv_gathered = 0
  if dims.seq_shards > 1:   # K/V of the other sequence shards, and their cotangents in backward
    kv_gathered = 2 * dims.b * (dims.T - dims.t_local) * h * (qk + a.v_head_dim) * A
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
  c.add("moe: router fp32 input, logits, scores", dots=n * E * F, saved=n * (d * F + E * F + topk * 8),
        kept=2 * n * topk * 4 + E * 4)          # top-k ids, the dispatch's sort order and counts
  c.add("moe: latent down/up, latent norm", dots=n * (lat * A + d * A), saved=n * lat * (F + A),
        kept=n * lat * A)                       # the combined latent (the norm's input)
  c.add("moe: shared experts", dots=n * (2 * sh * A + d * A), saved=n * sh * (A + F))
  c.add(f"moe: expert rows (ep·n·k = {rows:,}) gmm input, gate/up/hidden, combine",
        saved=rows * (lat + 3 * fl) * A + n * topk * lat * A,
        transient=3 * rows * lat * A, kept=2 * rows * fl * A)
  out["moe"] = c
  # QB finds its quantile by radix selection over per-expert counts: each device compares only
  # its own n tokens' [n, E] fp32 margins (and their uint32 keys) with a few candidates per
  # expert inside a reduction and all-reduces [E, candidates] counts.
  out["qb_sort"] = Cost().add("moe: Quantile Balancing margins + keys [n, E] (forward)",
                              transient=2 * n * E * F)

  c = Cost()
  c.add("embedding output", saved=n * d * A)
  if dims.loss_chunk:
    c.add("final norm: fp32 input + output", saved=n * d * (F + A))
    c.add("fused head: dx residual [n, d]", saved=n * d * A)
    c.add("fused head: fp32 dW residual [d, V] (head kernel layout)",
          saved=dims.head_d * dims.head_vocab * F)
    out["head_chunk"] = Cost().add("fused head: chunk layout + one chunk's buffers (forward)",
                                   transient=fused_head_chunk_bytes(dims, A))
  else:
    # Backward needs no [n, V] buffer beyond the two saved ones: XLA writes the fp32 logits
    # gradient over the fp32 copy and its model-dtype cast over the logits (the H200 buffer report
    # of k3_h200: one fp32 and one bf16 [n, V] allocation, each shared by two values).
    c.add("final norm + head logits + fp32 loss", dots=n * dims.vocab * A,
          saved=n * d * (F + A) + n * dims.vocab * F)
  out["head"] = c + out["attn_res"]
  out["carry"] = Cost().add("scan carry: AttnRes block buffer + partial sum", saved=ns * n * d * A)
  if mtp_enabled(cfg):
    out.update(mtp_costs(dims, out, A))
  return out


def mtp_enabled(cfg) -> bool:
  """Whether the model has the MTP module (model.mtp.enabled; a config without the section: no)."""
  t = cfg.model.get("mtp")
  return t is not None and bool(t.enabled)


def mtp_costs(dims: Dims, costs: Mapping[str, Cost], A: int) -> dict[str, Cost]:
  """The MTP module's costs (k3train/model/mtp.py): "mtp" the rematerialised block, "mtp_head"
  what is saved outside it (its inputs and its pass through the shared head)."""
  F = FP32
  n, d, v = dims.n, dims.d, dims.vocab
  # The two input norms' outputs are concatenated into the proj input [n, 2d]: counted as the
  # norms' low-precision outputs, not again.
  block = Cost().add("mtp: proj output M [RMSNorm(h); RMSNorm(e)] [n, d]", dots=n * d * A)
  for _ in range(5):        # hidden, embedding, attention, MLP and output norms
    block = block + costs["norm"]
  block = block + costs["mla"] + costs["moe"]
  head = Cost().add("mtp: block inputs h, Emb(t_{i+1}) [n, d]", saved=2 * n * d * A)
  if dims.loss_chunk:
    head.add("mtp fused head: dx residual [n, d]", saved=n * d * A)
    head.add("mtp fused head: fp32 dW residual [d, V] (head kernel layout)",
             saved=dims.head_d * dims.head_vocab * F)
  else:
    head.add("mtp head: input [n, d], logits + fp32 loss", dots=n * v * A,
             saved=n * d * A + n * v * F)   # gradient over the saved buffers, as the main head
  return {"mtp": block, "mtp_head": head}


def fused_head_chunk_bytes(dims: Dims, A: int) -> int:
  """Forward-only bytes of the fused head's chunk loop (k3train/train/head_loss.py) besides its
  residuals, with m = b · c / sequence tokens of one chunk on this device:

    x [n, d] (model.dtype), targets and mask [n] (int32, fp32) in the strided chunk
      layout: the scan's inputs, a transposed copy of the final-norm output    n · (d·A + 8)
    chunk logits [m, V] fp32 (a model.dtype GEMM with fp32 accumulation)       m · V · 4
    softmax exp(z − logsumexp z) [m, V] fp32 (counted although XLA may fuse it
      into d_logits)                                                          m · V · 4
    d_logits = (softmax − onehot) · mask / N [m, V] in model.dtype (the GEMM
      input of dx and dW)                                                     m · V · A
    dx chunk [m, d] fp32 GEMM output before its cast to x's dtype              m · d · 4
    dW chunk [d, V] fp32 GEMM output, summed over the batch and sequence
      shards before it is added to the dW residual                            d · V · 4

  V and d are per device as the activations lay them out (vocab over `tensor`). After the loop
  dx goes back from chunk layout to [n, d] (n · d · A, less than the above).
  """
  F = FP32
  m, d, v = dims.b * dims.loss_chunk, dims.d, dims.vocab
  return dims.n * (d * A + 8) + m * v * (2 * F + A) + m * d * F + d * v * F


def layer_cost(costs: Mapping[str, Cost], kind: tuple[str, str]) -> Cost:
  """One decoder layer of `kind` = (mixer, ffn): two AttnRes mixes, two norms, mixer, FFN."""
  mixer, ffn = kind
  return costs["attn_res"] + costs["attn_res"] + costs["norm"] + costs["norm"] + costs[mixer] + costs[ffn]


@dataclasses.dataclass
class Activations:
  """The activation terms of one step on one device (bytes)."""
  dims: Dims
  saved: int              # residuals kept for backward over the whole step
  saved_note: str
  working: int            # backward working set: recomputed residuals, buffers, carry cotangents
  working_note: str
  forward: int            # live in forward besides the saved residuals: one layer + buffers,
                          # or the QB margins, whichever is larger
  qb: int                 # forward QB margins
  rows: int               # rows of the expert exchange's receive buffer
  expert_buffers: int     # 3 × [rows, ℓ] exchange buffers (part of the working set)
  detail: dict            # per-piece terms ("super-block", "unscanned", "head", "mtp"; "carry" bytes)
  head_chunk: int = 0     # forward: the fused head's chunk loop (`fused_head_chunk_bytes`)
  mtp_saved: int = 0      # the MTP module's part of `saved` (0 without model.mtp)
  mtp_working: int = 0    # its block's residuals recomputed in backward (a working-set candidate)


def estimate(cfg, rules, mesh, *, seq_len: int, batch_per_device: int, remat: str,
             attention: str = "flash", expert_capacity: float | None = None) -> Activations:
  """The activation terms on `mesh` under the remat policy (see the module docstring)."""
  dims = activation_dims(cfg, rules, mesh, seq_len, batch_per_device)
  costs = layer_costs(cfg, dims, attention, expert_capacity)
  rows = expert_rows(dims, cfg.model.moe.top_k, expert_capacity)
  sched = config_lib.layer_schedule(cfg.model)
  A = np.dtype(cfg.model.dtype).itemsize

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
  # MTP (absent: zero costs): the block is rematerialised like an unscanned layer, its inputs and
  # head terms are saved under every policy.
  mtp_block = costs.get("mtp", Cost())
  mtp_saved = costs.get("mtp_head", Cost()).saved
  transient = max(transient, mtp_block.transient, costs.get("mtp_head", Cost()).transient)

  if remat == "none":
    mtp_saved += mtp_block.saved
    mtp_working = 0
    saved = nsb * period.saved + unscanned_cost.saved + head.saved
    working = transient + grad_carry
    saved_note = f"all {cfg.model.num_layers} layers' residuals"
    working_note = "largest layer's buffers + carry cotangents"
  elif remat == "full":
    # The unscanned layers are rematerialised too: each keeps its input stream (one carry).
    mtp_working = mtp_block.saved
    unscanned_max = max((layer_cost(costs, kind).saved for kind in unscanned), default=0)
    saved = (nsb + len(unscanned)) * carry + head.saved
    working = max(period.saved, unscanned_max, mtp_working) + transient + grad_carry
    saved_note = (f"{nsb} scan carries + {len(unscanned)} unscanned-layer inputs "
                  f"({carry / GiB:.2f} GiB each) + head")
    working_note = ("one super-block's residuals + buffers"
                    if mtp_working <= max(period.saved, unscanned_max)
                    else "the MTP block's residuals + buffers")
  else:   # dots_saveable, dots_with_no_batch_dims_saveable (planned alike); selective(_kda)
    names = remat_lib.KEPT_NAMES.get(remat, ())      # the values the policy keeps by name
    selective = bool(names)
    keeps_kda = remat_lib.KDA_RESIDUALS in names
    keeps = lambda c: c.dots + (c.kept if selective else 0) + (c.kda if keeps_kda else 0)
    what = "dot outputs + named values" if selective else "dot outputs"
    mtp_saved += keeps(mtp_block)
    mtp_working = mtp_block.saved - keeps(mtp_block)
    unscanned_max = max((layer_cost(costs, kind).saved - keeps(layer_cost(costs, kind))
                         for kind in unscanned), default=0)
    saved = nsb * (carry + keeps(period)) + len(unscanned) * carry + keeps(unscanned_cost) + head.saved
    working = max(period.saved - keeps(period), unscanned_max, mtp_working) + transient + grad_carry
    saved_note = (f"{nsb} × (carry + {what} {keeps(period) / GiB:.2f} GiB) + "
                  f"{len(unscanned)} unscanned layers + head")
    rest = "unkept" if selective else "non-dot"
    working_note = (f"{rest} residuals of one super-block + buffers"
                    if mtp_working <= max(period.saved - keeps(period), unscanned_max)
                    else f"{rest} residuals of the MTP block + buffers")
  if "mtp" in costs:
    saved += mtp_saved
    saved_note += " + MTP"
  fwd_layer = max([layer_cost(costs, kind).saved for kind in set(sched.kinds)] + [mtp_block.saved])
  qb = costs["qb_sort"].transient if cfg.model.moe.quantile_balancing else 0
  # The fused head's chunk loop runs after the last layer, in forward only (its backward only
  # scales the residuals), so it is not part of the backward working set.
  head_chunk = costs["head_chunk"] if "head_chunk" in costs else Cost()
  detail = {"super-block": period.terms, "unscanned": unscanned_cost.terms,
            "head": {**head.terms, **head_chunk.terms}, "carry": carry}
  if "mtp" in costs:
    detail["mtp"] = {**costs["mtp_head"].terms, **mtp_block.terms}
  return Activations(dims, saved, f"remat={remat}: {saved_note}", working, working_note,
                     max(fwd_layer + transient, qb, head_chunk.transient), qb, rows,
                     3 * rows * cfg.model.moe.latent_dim * A, detail, head_chunk.transient,
                     mtp_saved, mtp_working)


__all__ = ["Activations", "Cost", "Dims", "activation_dims", "estimate", "expert_rows",
           "fused_head_chunk_bytes", "layer_cost", "layer_costs", "mtp_costs", "mtp_enabled"]
