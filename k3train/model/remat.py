"""Remat policies: which forward values a rematerialised layer keeps for its backward pass.

`model.remat_policy` names one (k3train/config.py: REMAT_POLICIES):
  none       no rematerialisation: autodiff keeps every residual.
  full       keep nothing inside a layer; the backward pass recomputes the whole forward.
  dots_saveable, dots_with_no_batch_dims_saveable
             jax's policies of those names: keep matmul (dot_general) outputs.
  selective  keep the dot outputs without batch dimensions (every projection) and the values
             tagged with the names below, which are cheap to keep and costly to recompute:
               moe_routing     the top-k expert indices [N, k] int32: the router's top-k and
                               every Quantile Balancing round behind it are not recomputed;
                               and the dispatch's sort order [N·k] and group sizes [E]
                               int32: nor is its argsort;
               moe_expert_mlp  the gate and up grouped-matmul outputs [rows, F] and the
                               combined latent [N, ℓ]: no expert GEMM is recomputed (the
                               routing weights ride inside the experts, so the combine's
                               backward needs no expert outputs); and the shared experts'
                               output when their activation and down projection run as one
                               custom-VJP op (model/expert_tail.py), which the dots policy
                               does not see;
               kda_conv        the short-convolution outputs of q, k, v [B, T, H, K] before the
                               SiLU: the conv (shifted, document-masked sums) is not recomputed;
               attention_residuals
                               the attention kernel's output and log-sum-exp (saved by its
                               custom VJP): the attention forward kernel is not recomputed;
               attnres_stats   each AttnRes site's mixing weights, inverse RMS and scores
                               [N + 1, B, T] fp32 (saved by its VJP): the backward of a mix
                               needs no forward pass over the sources.
             Everything else (norms, gates, the AttnRes mix outputs, the KDA kernel's forward)
             is recomputed as under `full`. `k3train/tools/plan` plans the kept bytes per layer.
  selective_kda
             as `selective`, plus every output of the KDA Pallas kernels that the backward or the
             layer reads (`kda_residuals`, named by pallas_kernels/kda/vjp.py: the output, the
             chunk states and Δ, A_qk, W, U, the gated q and k, A_kk and its inverse, the chunk
             decays; 2,568 bytes per token and head at K = V = 128 in bf16, ten times the
             output's): the KDA forward kernels do not run again in the backward (only the
             in-chunk cumsum does). On the XLA KDA backend it keeps what `selective` keeps.
"""

from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name

from pallas_kernels.attention import vjp as attention_vjp
from pallas_kernels.attnres import vjp as attnres_vjp
from pallas_kernels.kda import vjp as kda_vjp

ROUTING = "moe_routing"
EXPERT_MLP = "moe_expert_mlp"
KDA_CONV = "kda_conv"
ATTENTION = attention_vjp.RESIDUAL_NAME
ATTNRES_STATS = attnres_vjp.STATS_NAME
SELECTIVE_NAMES = (ROUTING, EXPERT_MLP, KDA_CONV, ATTENTION, ATTNRES_STATS)
KDA_RESIDUALS = kda_vjp.RESIDUAL_NAME
# Named values kept by each policy of the selective family.
KEPT_NAMES = {"selective": SELECTIVE_NAMES, "selective_kda": SELECTIVE_NAMES + (KDA_RESIDUALS,)}


def tag(x: jax.Array, name: str) -> jax.Array:
  """x, tagged so that a remat policy can keep it by name (the identity otherwise)."""
  return checkpoint_name(x, name)


def policy(name: str):
  """The `jax.checkpoint` policy of a `model.remat_policy` other than "none" ("full": None)."""
  if name == "full":
    return None
  if name in KEPT_NAMES:
    return jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(*KEPT_NAMES[name]))
  if name in ("dots_saveable", "dots_with_no_batch_dims_saveable"):
    return getattr(jax.checkpoint_policies, name)
  raise ValueError(f"model.remat_policy: no jax.checkpoint policy for {name!r}")
