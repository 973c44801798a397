"""Multi-token prediction: one module that predicts token t+2 (docs/maths.md §8).

For position i, with h_i the main model's output-AttnRes mixture before the final norm
(`K3Model.hidden_states`) and t_{i+1} the next token (the batch's targets[i]):

    h'_i  = M [RMSNorm(h_i) ; RMSNorm(Emb(t_{i+1}))]          M: 2d → d   (`proj`)
    h''   = h' + GatedMLA(RMSNorm(h'))                         causal, document-masked
    h'''  = h'' + StableLatentMoE(RMSNorm(h''))
    logits_i = lm_head(RMSNorm(h'''_i))                         predicts t_{i+2}

The embedding and the head are the main model's (shared, so they receive gradients from both
losses); this module owns everything else. The block is MLA + MoE (no recurrent state to carry).
The loss counts positions whose MTP target t_{i+2} lies in the same document as t_i and t_{i+1}
(targets that cross a document boundary or fall off the end of the row are masked) and, as
DeepSeek-V3's 1/T, divides their CE sum by the batch's main loss tokens:

    L = main CE + λ · Σ_{MTP positions} CE_i / (main loss tokens)      λ = model.mtp.loss_weight (0.1)

Dividing by the main tokens keeps gradient accumulation exact: the train step weights each
micro-batch's loss by its share of main loss tokens (k3train/train/step.py).

MTP logits at position i depend on tokens ≤ i + 1 only: h_i on tokens ≤ i, the embedding on
t_{i+1}, and the causal MLA on positions ≤ i.

Release names (`k3train/tools/hf_layout.py`): the module's parameters are written under
`model.mtp.` (hnorm, enorm, eh_proj, input_layernorm, self_attn.*, post_attention_layernorm,
block_sparse_moe.*, norm).

In training (`model.mtp.enabled`) `K3Model` owns the module and the train step adds λ · the MTP
loss to the main loss (k3train/train/step.py). For generation the module drafts one token ahead
(self-speculative decoding, k3train/tools/generate.py): `draft_prefill` and `draft_step` run it
one position at a time with an MLA latent cache of its own (`MTPCache`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from k3train.model import layers
from k3train.model.mla import GatedMLA
from k3train.model.moe import StableLatentMoE
from k3train.parallel import axes as ax
from k3train.parallel.rules import constrain


class MTPStats(nnx.Variable):
  """[2] fp32 that the train step's forward writes: the MTP cross-entropy summed over the batch's
  MTP positions and their number (the step's "mtp_loss" and "mtp_tokens" metrics)."""


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
    self.stats = MTPStats(jnp.zeros((2,), jnp.float32))

  def _fuse(self, hidden_btd: jax.Array, next_embed_btd: jax.Array) -> jax.Array:
    """h' = M [RMSNorm(h) ; RMSNorm(e)], [B, T, d]."""
    x = jnp.concatenate([self.hidden_norm(hidden_btd),
                         self.embed_norm(next_embed_btd).astype(hidden_btd.dtype)], axis=-1)
    return constrain(self.proj(x), ax.BATCH, ax.SEQ, ax.EMBED)

  def _finish(self, x_btd: jax.Array, token_mask_bt: jax.Array | None) -> jax.Array:
    """The MoE sublayer and the output norm."""
    x = x_btd + self.ffn(self.mlp_norm(x_btd), token_mask_bt)
    return self.final_norm(constrain(x, ax.BATCH, ax.SEQ, ax.EMBED))

  def __call__(self, hidden_btd: jax.Array, next_embed_btd: jax.Array,
               segment_ids_bt: jax.Array | None = None,
               token_mask_bt: jax.Array | None = None) -> jax.Array:
    """hidden_btd: the main model's h [B, T, d]; next_embed_btd: Emb(t_{i+1}) [B, T, d]."""
    x = self._fuse(hidden_btd, next_embed_btd)
    x = x + self.mixer(self.attn_norm(x), segment_ids_bt)
    return self._finish(x, token_mask_bt)

  # ------------------------------------------------------------------ generation

  def latent_rows(self, hidden_btd: jax.Array, next_embed_btd: jax.Array) -> jax.Array:
    """The MLA latent rows [B, T, kv_lora_rank + rope] of positions (what `MTPCache` holds)."""
    return self.mixer.latent(self.attn_norm(self._fuse(hidden_btd, next_embed_btd)))

  def decode_step(self, hidden_b1d: jax.Array, next_embed_b1d: jax.Array, latent_bsc: jax.Array,
                  pos: jax.Array, allowed_bs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One position per row over the latent cache: (`__call__`'s output [B, 1, d], the cache
    with this position's row at slot `pos`); allowed_bs [B, S] as `GatedMLA.decode_step`."""
    x = self._fuse(hidden_b1d, next_embed_b1d)
    y, latent_bsc = self.mixer.decode_step(self.attn_norm(x), latent_bsc, pos, allowed_bs)
    return self._finish(x + y, None), latent_bsc


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
  """(λ · the MTP CE summed over the MTP positions / the main loss tokens Σ loss_mask, number of
  MTP positions), fp32: the term the train step adds to the main loss (module docstring).
  λ = 0 leaves the main gradients unchanged."""
  tgt, mask = mtp_targets(targets_bt, loss_mask_bt, segment_ids_bt)
  logits = mtp_logits_btv.astype(jnp.float32)
  ce = jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, tgt[..., None], axis=-1)[..., 0]
  main_tokens = jnp.sum(loss_mask_bt.astype(jnp.float32))
  return loss_weight * jnp.sum(ce * mask) / jnp.maximum(main_tokens, 1.0), jnp.sum(mask)


# ----------------------------------------------------------------------------- drafting


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MTPCache:
  """The MTP module's decode state: its MLA latent row of every position so far. Position j's
  row reads (h_j, Emb(t_{j+1})), so after a prompt of T tokens the last position T−1 waits for
  the first generated token."""
  latent: jax.Array        # [B, max_len, kv_lora_rank + rope]
  segment_ids: jax.Array   # [B, max_len] int32: document id of every filled slot (0 = empty)
  length: jax.Array        # int32 scalar: slots filled (the next position's slot)


def draft_prefill(model, hidden_btd: jax.Array, tokens_bt: jax.Array, segment_ids_bt: jax.Array,
                  *, max_len: int) -> MTPCache:
  """The MTP cache of a prompt (tokens [B, T], the main model's h [B, T, d]): rows for
  positions 0..T−2, room for max_len."""
  b, t = tokens_bt.shape
  rows = model.mtp.latent_rows(hidden_btd[:, :t - 1], model.embed(tokens_bt[:, 1:]))  # [B, T-1, C]
  latent = jnp.zeros((b, max_len, rows.shape[-1]), rows.dtype).at[:, :t - 1].set(rows)
  seg = jnp.zeros((b, max_len), jnp.int32).at[:, :t - 1].set(segment_ids_bt[:, :t - 1])
  return MTPCache(latent, seg, jnp.int32(t - 1))


def draft_step(model, hidden_b1d: jax.Array, next_tokens_b: jax.Array, segment_ids_b: jax.Array,
               cache: MTPCache) -> tuple[jax.Array, MTPCache]:
  """MTP logits [B, V] fp32 at the next position j = cache.length (from h_j [B, 1, d] and
  t_{j+1}; they predict t_{j+2}) and the cache one row longer."""
  pos = cache.length
  seg_b = segment_ids_b.astype(jnp.int32)
  seg = jax.lax.dynamic_update_slice_in_dim(cache.segment_ids, seg_b[:, None], pos, axis=1)
  slots = jnp.arange(seg.shape[1], dtype=jnp.int32)
  allowed = (slots[None, :] <= pos) & (seg == seg_b[:, None])
  x, latent = model.mtp.decode_step(hidden_b1d, model.embed(next_tokens_b[:, None]),
                                    cache.latent, pos, allowed)
  logits = model.lm_head(x)[:, 0].astype(jnp.float32)
  return logits, MTPCache(latent, seg, pos + 1)
