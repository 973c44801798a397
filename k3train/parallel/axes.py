"""Logical axis names: the vocabulary between model code and the mesh rule tables.

Model modules name axes only by these logical names; the rule tables in `rules.py` map them to
mesh axes (`data`, `fsdp`, `expert`, `tensor`, `sequence`), and `rules.constrain` applies them to
activations (a no-op without an active layout, so model code runs unchanged on one device).
This module imports nothing of k3train.
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
# Vision tower (MoonViT-V2, docs/maths.md §6) and its batch keys
PATCHES = "patches"        # packed patches (and merged vision tokens) of one row
PATCH_DIM = "patch_dim"    # 14·14·3 pixel values of one patch
POS_GRID = "pos_grid"      # rows / columns of the learnable position table
VIT_EMBED = "vit_embed"    # tower width
VIT_HEADS = "vit_heads"    # tower attention heads
VIT_MLP = "vit_mlp"        # tower MLP hidden and projector hidden
VIT_MERGED = "vit_merged"  # 2×2-merged token width (4 × tower width), projector input
GRIDS = "grids"            # grids (images, video chunks) of one row
GRID_FIELDS = "grid_fields"  # (t, h, w) of one grid


def names_of(var) -> tuple | None:
  """The logical axis names a model Variable was created with (its `out_sharding`), or None."""
  names = var.get_metadata().get("out_sharding")
  return tuple(names) if names else None
