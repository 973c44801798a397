"""The per-device memory plan of one mesh: state, gradients, gathered weights, activations and
the optimizer's transient, by phase, against the device's memory.

Terms besides the state (k3train/tools/plan/state.py) and the activations
(k3train/tools/plan/activations.py):

  gradients             in model.param_dtype, sharded like the parameters;
  gradient accumulator  with train.microbatches > 1, one more gradient-sized running sum, live
                        in forward and backward; the scanned stack's backward adds its
                        gradients into it layer by layer, so the backward phase holds no
                        gradient of the stack's parameters beside it;
  gathered weights      the largest layer (or the embedding / head) gathered over
                        fsdp / sequence / data in model.dtype, twice (the next layer's gather
                        overlaps this layer's compute), plus in backward its gradient in
                        model.param_dtype before the reduce-scatter (only `tensor` and `expert`
                        stay split inside a layer);
  optimizer transient   3 × the largest local optimizer leaf during the update;
  expert weights cast   the routed-expert weights in model.dtype, made once per step before the
                        micro-batches and live through forward and backward (when model.dtype
                        is narrower than model.param_dtype and QAT is off); the backward then
                        writes the expert gradients in model.dtype, so the gradients term of
                        the backward phase is smaller by the same difference of widths.

With model.mtp on, the MTP module's share of the saved activations is listed on its own line
(`activations.mtp_costs`).

The peak is the largest of the forward, backward and optimizer phases; the plan fits if it is
at most device memory × (1 − margin).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import numpy as np

from k3train import config as config_lib
from k3train.parallel import rules as rules_lib
from k3train.parallel.mesh import describe
from k3train.tools.plan import activations as act_lib
from k3train.tools.plan import state as state_lib

GiB = act_lib.GiB


@dataclasses.dataclass
class Plan:
  sizes: dict
  rules: str
  remat: str
  attention: str
  dims: act_lib.Dims
  device_memory: int
  margin: float
  state: state_lib.StateBytes
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


def make_plan(cfg, state, sizes: Mapping[str, int], *, rules_name: str, seq_len: int,
              batch_per_device: int, remat: str, attention: str = "flash",
              device_memory_gib: float, margin: float = 0.10,
              expert_capacity: float | None = None, microbatches: int = 1) -> Plan:
  """The plan for resolved mesh `sizes`; raises MeshError when the mesh does not divide.

  state: the run's shapes (`builder.abstract_state(cfg)`), or their `state.state_layout` under
  `rules_name` (made once when planning many meshes). batch_per_device is per micro-batch.
  """
  if remat not in config_lib.REMAT_POLICIES:
    raise ValueError(f"remat must be one of {config_lib.REMAT_POLICIES}, got {remat!r}")
  if attention not in ("flash", "naive"):
    raise ValueError(f"attention must be flash or naive, got {attention!r}")
  if batch_per_device < 1:
    raise ValueError(f"batch_per_device must be >= 1, got {batch_per_device}")
  if microbatches < 1:
    raise ValueError(f"microbatches must be >= 1, got {microbatches}")
  layout = state if isinstance(state, state_lib.StateLayout) else \
      state_lib.state_layout(state, rules_name)
  if layout.rules_name != rules_name:
    raise ValueError(f"the state layout is for rules={layout.rules_name!r}, not {rules_name!r}")
  rules = rules_lib.get_rules(rules_name)
  sb = state_lib.state_bytes(layout, sizes)
  acts = act_lib.estimate(cfg, rules, state_lib.abstract_mesh(sizes), seq_len=seq_len,
                          batch_per_device=batch_per_device, remat=remat, attention=attention,
                          expert_capacity=expert_capacity)
  A = np.dtype(cfg.model.dtype).itemsize
  P = np.dtype(cfg.model.param_dtype).itemsize

  unit_name, unit_params = max(sb.units.items(), key=lambda kv: kv[1])
  gathered_fwd = 2 * unit_params * A
  gathered_bwd = gathered_fwd + unit_params * P
  grads = sb.params
  accumulator = grads if microbatches > 1 else 0
  opt_transient = 3 * sb.largest_opt_leaf
  cast_once = A < P and not cfg.model.quant.enabled
  expert_cast = sb.expert_params * A if cast_once else 0
  # With micro-batches the scanned stack's backward adds its gradients straight into the
  # accumulator, one layer at a time (k3train/model/layer_scan.py): no stack-sized gradient.
  in_stack = microbatches > 1 and sb.stack_params > 0
  grads_bwd = grads - (sb.stack_params if in_stack else 0)
  experts_bwd = sb.expert_params - (sb.stack_expert_params if in_stack else 0)
  grads_bwd -= experts_bwd * (P - A) if cast_once else 0
  static = sb.params + sb.rest + sb.opt
  phases = {
      "forward": static + accumulator + expert_cast + gathered_fwd + acts.saved + acts.forward,
      "backward": static + accumulator + expert_cast + grads_bwd + gathered_bwd + acts.saved
                  + acts.working,
      "optimizer": static + grads + opt_transient,
  }
  dtype_note = f"{cfg.model.param_dtype}"
  repl = sum(b for _, b in sb.replicated_opt)
  lines = [
      ("parameters", sb.params, f"{dtype_note} master weights"),
      ("model variables", sb.rest, "router bias, QB, loads, max logits"),
      ("optimizer state", sb.opt, f"{cfg.optim.optimizer}: mirrors the parameter shardings"
       + (f"; {len(sb.replicated_opt)} leaves replicated ({repl / GiB:.2f} GiB)" if repl else "")),
      ("gradients", grads, f"{dtype_note}, sharded like the parameters"
       + (f" (routed experts' in {cfg.model.dtype} during backward)" if cast_once else "")
       + (f"; the scanned stack's ({sb.stack_params / GiB:.2f} GiB) go straight into the "
          "accumulator during backward" if in_stack else "")),
      ("gradient accumulator", accumulator,
       f"{microbatches} micro-batches: running sum, like the gradients" if microbatches > 1
       else "none (train.microbatches = 1)"),
      ("expert weights cast", expert_cast,
       f"routed-expert weights in {cfg.model.dtype}, cast once per step" if expert_cast
       else "none (the grouped matmuls cast in place)"),
      ("gathered weights", gathered_bwd, f"largest layer ({unit_name}) in {cfg.model.dtype} ×2 "
       f"+ its {dtype_note} gradient"),
      ("saved activations", acts.saved, acts.saved_note),
      ("backward working set", acts.working, acts.working_note),
      ("  of which expert buffers", acts.expert_buffers,
       f"3 × [{acts.rows:,} rows, ℓ] exchange buffers ("
       + ("ep·n·k: dropless worst case)" if expert_capacity is None
          else f"capacity {expert_capacity:g}·n·k: hypothetical, not in k3train)")),
      ("forward QB margins", acts.qb,
       "this device's n tokens × E experts, fp32 + uint32 keys (radix selection; forward only)"),
      ("optimizer transient", opt_transient, "3 × the largest local optimizer leaf"),
  ]
  if "mtp" in acts.detail:
    redo = f"{acts.mtp_working / GiB:.2f} GiB recomputed in backward"
    block = {"none": "all residuals", "full": redo}.get(remat, f"dot outputs ({redo})")
    head = "dx + fp32 dW residuals" if acts.dims.loss_chunk else "input, logits + fp32 loss"
    at = [label for label, _, _ in lines].index("saved activations") + 1
    lines.insert(at, ("  of which MTP", acts.mtp_saved,
                      f"inputs h, Emb(t+1); block: {block}; shared head again: {head}"))
  if acts.dims.loss_chunk:
    d = acts.dims
    lines.insert(-1, ("fused head chunk loop", acts.head_chunk,
                      f"forward only (train.loss_chunk_tokens = {d.loss_chunk * d.seq_shards}): "
                      f"[{d.b * d.loss_chunk:,} tokens, {d.vocab:,} vocab] logits, softmax, "
                      f"d_logits, GEMM outputs; inputs in chunk layout"))
  return Plan(dict(sizes), rules_name, remat, attention, acts.dims, int(device_memory_gib * GiB),
              margin, sb, lines, phases, acts.detail, microbatches)


def format_plan(plan: Plan, config_name: str = "", verbose: bool = False) -> str:
  """The plan as a table, one term per line; `verbose` adds every activation term."""
  d = plan.dims
  mb = plan.microbatches
  tokens = d.global_batch * d.T * mb
  micro = f" × {mb} micro-batches" if mb > 1 else ""
  out = [f"plan {config_name}: {math.prod(plan.sizes.values())} devices, "
         f"mesh {describe(plan.sizes)}, "
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
  """The plan as one JSON-able dict (bytes, not GiB)."""
  return {"mesh": plan.sizes, "rules": plan.rules, "remat": plan.remat, "attention": plan.attention,
          "batch_per_device": plan.dims.b, "microbatches": plan.microbatches,
          "global_batch": plan.dims.global_batch * plan.microbatches,
          "seq_len": plan.dims.T, "tokens_per_device": plan.dims.n,
          "bytes": {label.strip(): b for label, b, _ in plan.lines},
          "phases": plan.phases, "peak": plan.peak, "budget": plan.budget, "fits": plan.fits}


__all__ = ["Plan", "format_plan", "make_plan", "plan_json"]
