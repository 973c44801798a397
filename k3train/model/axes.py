"""Logical axis names used by model code, and the activation-constraint helper.

Model modules name axes only by these logical names; `k3train/parallel` rule tables map them to
mesh axes (`data`, `fsdp`, `expert`, `tensor`, `sequence`). Without an active rule table the
constraint is a no-op, so model code runs unchanged on one device.
"""

from __future__ import annotations

import jax

# Activations
BATCH = "batch"
SEQ = "seq"
# Parameters and activations
EMBED = "embed"            # model width d
VOCAB = "vocab"
HEADS = "heads"            # attention / KDA heads
HEAD_DIM = "head_dim"      # per-head q/k/v width
MLP = "mlp"                # dense FFN / shared-expert hidden
NORM = "norm"              # norm gains (replicated)
Q_LORA = "q_lora"          # MLA query latent (1536)
KV_LORA = "kv_lora"        # MLA kv latent + shared key (576)
KDA_GATE_RANK = "gate_rank"  # KDA f_a low-rank width
CONV = "conv"              # short-conv taps
EXPERTS = "experts"        # routed experts
EXPERT_MLP = "expert_mlp"  # routed-expert hidden
LATENT = "latent"          # MoE latent width (3584)
LAYERS = "layers"          # stacked (scanned) layer axis
SOURCES = "sources"        # AttnRes sources axis


def names_of(var) -> tuple | None:
  """The logical axis names a model Variable was created with (its `out_sharding`), or None."""
  names = var.get_metadata().get("out_sharding")
  return tuple(names) if names else None


def constrain(x: jax.Array, *names: str | None) -> jax.Array:
  """Constrain an activation's sharding through logical axis names (no-op outside a mesh)."""
  if len(names) != x.ndim:
    raise ValueError(f"constrain: {len(names)} names {names} for an array of rank {x.ndim}")
  from k3train.parallel import rules  # local import: parallel imports these names
  return rules.constrain(x, names)
