"""Multi-token prediction: one module that predicts token t+2 (docs/maths.md §8).

For position i, with h_i the main model's output-AttnRes mixture before the final norm
(`K3Model.hidden_states`) and t_{i+1} the next token (the batch's targets[i]):

    h'_i  = M [RMSNorm(h_i) ; RMSNorm(Emb(t_{i+1}))]          M: 2d → d   (`proj`)
    h''   = h' + GatedMLA(RMSNorm(h'))                         causal, document-masked
    h'''  = h'' + StableLatentMoE(RMSNorm(h''))
    logits_i = lm_head(RMSNorm(h'''_i))                         predicts t_{i+2}

The embedding and the head are the main model's (shared, so they receive gradients from both
losses); this module owns everything else. The block is MLA + MoE (no recurrent state to carry).
The loss is λ · CE over positions whose MTP target t_{i+2} lies in the same document as t_i and
t_{i+1}: targets that cross a document boundary (or fall off the end of the row) are masked.
λ = model.mtp.loss_weight (0.1).

MTP logits at position i depend on tokens ≤ i + 1 only: h_i on tokens ≤ i, the embedding on
t_{i+1}, and the causal MLA on positions ≤ i.

Release names (`k3train/tools/hf_layout.py`): the module's parameters are written under
`model.mtp.` (hnorm, enorm, eh_proj, input_layernorm, self_attn.*, post_attention_layernorm,
block_sparse_moe.*, norm).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from k3train.model import layers
from k3train.model.mla import GatedMLA
from k3train.model.moe import StableLatentMoE
from k3train.parallel import axes as ax
from k3train.parallel.rules import constrain


class MTPModule(nnx.Module):
  """The t+2 predictor. `__call__` returns the normalised hidden state [B, T, d] that the shared
  `lm_head` turns into MTP logits."""

  def __init__(self, m: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
    dtype, param_dtype = layers.dtype_from_name(m.dtype), layers.dtype_from_name(m.param_dtype)
    d = m.d_model
    norm = dict(eps=m.norm_eps, param_dtype=param_dtype, rngs=rngs)
    self.hidden_norm = layers.RMSNorm(d, **norm)
    self.embed_norm = layers.RMSNorm(d, **norm)
    # [RMSNorm(h) ; RMSNorm(e)] (2d wide) → d; the 2d input axis is a hidden axis like an FFN's.
    self.proj = layers.Linear((2 * d,), (d,), (ax.MLP, ax.EMBED), std=m.init_std, dtype=dtype,
                              param_dtype=param_dtype, rngs=rngs)
    self.attn_norm = layers.RMSNorm(d, **norm)
    self.mixer = GatedMLA(m.mla, d_model=d, init_std=m.init_std, dtype=dtype,
                          param_dtype=param_dtype, rngs=rngs)
    self.mlp_norm = layers.RMSNorm(d, **norm)
    self.ffn = StableLatentMoE(m.moe, d_model=d, init_std=m.init_std, norm_eps=m.norm_eps,
                               situ_beta=m.situ_beta, situ_linear_beta=m.situ_linear_beta,
                               dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.final_norm = layers.RMSNorm(d, **norm)

  def __call__(self, hidden_btd: jax.Array, next_embed_btd: jax.Array,
               segment_ids_bt: jax.Array | None = None,
               token_mask_bt: jax.Array | None = None) -> jax.Array:
    """hidden_btd: the main model's h [B, T, d]; next_embed_btd: Emb(t_{i+1}) [B, T, d]."""
    x = jnp.concatenate([self.hidden_norm(hidden_btd),
                         self.embed_norm(next_embed_btd).astype(hidden_btd.dtype)], axis=-1)
    x = constrain(self.proj(x), ax.BATCH, ax.SEQ, ax.EMBED)
    x = x + self.mixer(self.attn_norm(x), segment_ids_bt)
    x = x + self.ffn(self.mlp_norm(x), token_mask_bt)
    return self.final_norm(constrain(x, ax.BATCH, ax.SEQ, ax.EMBED))


def mtp_logits(model, mtp: MTPModule, tokens_bt: jax.Array, targets_bt: jax.Array,
               segment_ids_bt: jax.Array | None = None, token_mask_bt: jax.Array | None = None,
               hidden_btd: jax.Array | None = None) -> jax.Array:
  """MTP logits [B, T, V] of a `K3Model` (its embedding and head) at every position i
  (predicting t_{i+2}). `hidden_btd` reuses the main forward's `hidden_states` when given."""
  if hidden_btd is None:
    hidden_btd = model.hidden_states(tokens_bt, segment_ids_bt, token_mask_bt)
  h = mtp(hidden_btd, model.embed(targets_bt), segment_ids_bt, token_mask_bt)
  return constrain(model.lm_head(h), ax.BATCH, ax.SEQ, ax.VOCAB)


def mtp_targets(targets_bt: jax.Array, loss_mask_bt: jax.Array,
                segment_ids_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(MTP targets t_{i+2} [B, T], mask [B, T] fp32) from a batch's next-token targets and mask.

  Position i trains on targets[i + 1] when loss_mask[i + 1] (t_{i+1}, t_{i+2} in one document and
  t_{i+2} trainable) and t_i, t_{i+1} are in one document too (equal, non-zero segment ids); the
  last position has no t_{i+2} in the row."""
  nxt = jnp.concatenate([targets_bt[:, 1:], jnp.zeros_like(targets_bt[:, :1])], axis=1)
  next_mask = jnp.concatenate([loss_mask_bt[:, 1:], jnp.zeros_like(loss_mask_bt[:, :1])], axis=1)
  same = (segment_ids_bt[:, :-1] == segment_ids_bt[:, 1:]) & (segment_ids_bt[:, :-1] > 0)
  same = jnp.concatenate([same, jnp.zeros_like(same[:, :1])], axis=1)
  return nxt, next_mask.astype(jnp.float32) * same.astype(jnp.float32)


def mtp_loss(mtp_logits_btv: jax.Array, targets_bt: jax.Array, loss_mask_bt: jax.Array,
             segment_ids_bt: jax.Array, *, loss_weight: float) -> tuple[jax.Array, jax.Array]:
  """(λ · mean CE of the MTP predictions over the masked positions, number of positions), fp32.
  Add it to the main loss; λ = 0 leaves the main gradients unchanged."""
  tgt, mask = mtp_targets(targets_bt, loss_mask_bt, segment_ids_bt)
  logits = mtp_logits_btv.astype(jnp.float32)
  ce = jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, tgt[..., None], axis=-1)[..., 0]
  n = jnp.sum(mask)
  return loss_weight * jnp.sum(ce * mask) / jnp.maximum(n, 1.0), n
