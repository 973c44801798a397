"""Generation with caches: prefill a prompt, then decode one token per row at a time.

    decoder = Decoder(model, max_len=256)
    logits_btv, cache = decoder.prefill(tokens_bt, segment_ids_bt)     # the full forward's logits
    logits_bv, cache = decoder.step(next_tokens_b, cache)              # one token per row

Per layer the cache holds what docs/maths.md §10 lists for decoding:

* KDA layers: the recurrent state S [B, H, K, V] in fp32 and the last W−1 pre-convolution inputs
  of q, k and v (`KimiDeltaAttention.prefill` / `decode_step`, §1.5);
* MLA layers: the latent rows [c ; k^R] of every past token, [B, max_len, kv_lora_rank + rope]
  (576 values per token for K3, not per-head keys and values), attended with the absorbed
  weights (`GatedMLA.decode_step`, §2.3).

Block AttnRes (§3.2) mixes over depth, never over time, so each new token runs the same
per-layer wiring as `decoder.DecoderLayer` on its own [B, 1, d] stream: the completed block sums
and the partial sum of that token only. MoE and norms are per token as well.

Documents: `segment_ids` give every token a document id (as in training). A decode token whose
id differs from the previous token's starts a new document: KDA state and conv history restart
at zero, and MLA attends only to cached tokens with the same id. The cache also records each
slot's id, so a prompt of several packed documents continues exactly as the full forward would.

The scanned super-blocks stay scanned: their caches carry a leading [num_super_blocks] axis and
prefill and decode run `lax.scan` over them, so compile time does not grow with depth. The
decoder runs on one device without a parallel layout (tensor-parallel decoding is not built).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from k3train.model import attnres
from k3train.model.decoder import DecoderLayer, K3Model
from k3train.model.kda import KimiDeltaAttention


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeCache:
  """Everything decoding carries from token to token."""
  layers: Any              # {"prefix": [cache per layer], "stack": (cache per period position,
                           #  stacked over super-blocks), "suffix": [...]}
  segment_ids: jax.Array   # [B, max_len] int32: document id of every filled slot (0 = empty)
  length: jax.Array        # int32 scalar: slots filled (the next token's slot)
  last_segment: jax.Array  # [B] int32: document id of the last token
  max_len: int = dataclasses.field(metadata=dict(static=True), default=0)


# ----------------------------------------------------------------------------- one layer


def _layer(layer: DecoderLayer, stream, layer_index, mixer_fn, token_mask_bt):
  """DecoderLayer.__call__'s wiring with the mixer call replaced by `mixer_fn(x) -> (y, cache)`."""
  h, stream = layer.attn_res(stream)
  blocks, num_blocks, p = attnres.maybe_start_block(stream, layer_index, layer.block_size)
  y, cache = mixer_fn(layer.attn_norm(h))
  p = p + y
  h, (blocks, num_blocks, p) = layer.mlp_res((blocks, num_blocks, p))
  h = layer.mlp_norm(h)
  p = p + (layer.ffn(h) if layer.ffn_kind == "dense" else layer.ffn(h, token_mask_bt))
  return (blocks, num_blocks, p), cache


def _prefill_layer(layer, stream, layer_index, segment_ids_bt, token_mask_bt):
  mixer = layer.mixer

  def fn(x):
    y, cache = mixer.prefill(x, segment_ids_bt)
    return y, (cache if isinstance(mixer, KimiDeltaAttention) else {"latent": cache})

  return _layer(layer, stream, layer_index, fn, token_mask_bt)


def _decode_layer(layer, stream, layer_index, cache, ctx):
  mixer = layer.mixer
  if isinstance(mixer, KimiDeltaAttention):
    fn = lambda x: mixer.decode_step(x, cache, ctx["reset"])
  else:
    fn = lambda x: _mla_step(mixer, x, cache, ctx)
  return _layer(layer, stream, layer_index, fn, ctx["token_mask"])


def _mla_step(mixer, x, cache, ctx):
  out, latent = mixer.decode_step(x, cache["latent"], ctx["pos"], ctx["allowed"])
  return out, {"latent": latent}


# ----------------------------------------------------------------------------- the stack


def _run(model: K3Model, stream, layer_fn, caches=None):
  """Prefix, scanned stack and suffix with `layer_fn(layer, stream, index, cache) -> (stream,
  cache)`; returns (stream, caches in the DecodeCache.layers layout)."""
  sched = model.schedule
  caches = caches or {"prefix": [None] * len(model.prefix), "stack": None,
                      "suffix": [None] * len(model.suffix)}
  out = {"prefix": [], "stack": None, "suffix": []}
  for i, layer in enumerate(model.prefix):
    stream, c = layer_fn(layer, stream, jnp.int32(i), caches["prefix"][i])
    out["prefix"].append(c)
  if model.stack is not None:
    graphdef, params, rest = nnx.split(model.stack, nnx.Param, ...)
    period = len(sched.period)

    def body(stream, xs):
      block_params, block_rest, index, block_caches = xs
      block = nnx.merge(graphdef, block_params, block_rest)
      first = sched.prefix + index * period
      new = []
      for j, layer in enumerate(block.layers):
        stream, c = layer_fn(layer, stream, first + j,
                             None if block_caches is None else block_caches[j])
        new.append(c)
      return stream, tuple(new)

    indices = jnp.arange(sched.num_super_blocks, dtype=jnp.int32)
    stream, out["stack"] = jax.lax.scan(body, stream, (params, rest, indices, caches["stack"]))
  for i, layer in enumerate(model.suffix):
    stream, c = layer_fn(layer, stream, jnp.int32(sched.suffix_start + i), caches["suffix"][i])
    out["suffix"].append(c)
  return stream, out


def _head(model: K3Model, stream) -> jax.Array:
  h = model.out_res(stream)[0]
  return model.lm_head(model.final_norm(h)).astype(jnp.float32)


def _pad_mla(cache, t: int, max_len: int):
  """Prefill caches → decode caches: MLA latent rows [.., B, T, C] padded to max_len slots."""
  if "latent" not in cache:
    return cache
  latent = cache["latent"]
  widths = [(0, 0)] * latent.ndim
  widths[-2] = (0, max_len - t)
  return {"latent": jnp.pad(latent, widths)}


def prefill(model: K3Model, tokens_bt: jax.Array, segment_ids_bt: jax.Array | None = None, *,
            max_len: int) -> tuple[jax.Array, DecodeCache]:
  """(logits [B, T, V] fp32 = the full forward's, cache with room for max_len tokens)."""
  b, t = tokens_bt.shape
  if t > max_len:
    raise ValueError(f"prompt of {t} tokens does not fit a cache of max_len={max_len}")
  if segment_ids_bt is None:
    segment_ids_bt = jnp.ones((b, t), jnp.int32)
  segment_ids_bt = segment_ids_bt.astype(jnp.int32)
  token_mask_bt = (segment_ids_bt > 0).astype(jnp.float32)
  stream = attnres.init_stream(model.embed(tokens_bt), model.max_blocks)
  stream, caches = _run(model, stream, lambda layer, s, i, _: _prefill_layer(
      layer, s, i, segment_ids_bt, token_mask_bt))
  caches = jax.tree.map(lambda c: _pad_mla(c, t, max_len), caches,
                        is_leaf=lambda c: isinstance(c, dict) and ("latent" in c or "state" in c))
  seg = jnp.zeros((b, max_len), jnp.int32).at[:, :t].set(segment_ids_bt)
  cache = DecodeCache(caches, seg, jnp.int32(t), segment_ids_bt[:, -1], max_len)
  return _head(model, stream), cache


def decode_step(model: K3Model, tokens_b: jax.Array, cache: DecodeCache,
                segment_ids_b: jax.Array | None = None) -> tuple[jax.Array, DecodeCache]:
  """One token per row → (logits [B, V] fp32, the cache one slot longer).

  segment_ids_b [B]: the tokens' document ids (default: the previous token's, i.e. continue).
  The caller keeps cache.length < cache.max_len (`Decoder.step` checks it).
  """
  seg_b = cache.last_segment if segment_ids_b is None else segment_ids_b.astype(jnp.int32)
  pos = cache.length
  seg = jax.lax.dynamic_update_slice_in_dim(cache.segment_ids, seg_b[:, None], pos, axis=1)
  slots = jnp.arange(cache.max_len, dtype=jnp.int32)
  ctx = {"reset": seg_b != cache.last_segment, "pos": pos,
         "allowed": (slots[None, :] <= pos) & (seg == seg_b[:, None]),
         "token_mask": (seg_b > 0).astype(jnp.float32)[:, None]}
  stream = attnres.init_stream(model.embed(tokens_b[:, None]), model.max_blocks)
  stream, layers = _run(model, stream,
                        lambda layer, s, i, c: _decode_layer(layer, s, i, c, ctx), cache.layers)
  new = DecodeCache(layers, seg, pos + 1, seg_b, cache.max_len)
  return _head(model, stream)[:, 0], new


# ----------------------------------------------------------------------------- sampling


def sample(logits_bv: jax.Array, key: jax.Array, *, temperature: float, top_p: float = 1.0
           ) -> jax.Array:
  """Next tokens [B] int32: argmax at temperature 0, else nucleus sampling of softmax(logits/T)
  over the smallest set of tokens whose probability reaches top_p (the top token always kept)."""
  if temperature <= 0:
    return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
  logits = logits_bv.astype(jnp.float32) / temperature
  if top_p < 1.0:
    sorted_bv = jnp.sort(logits, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(sorted_bv, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs           # mass of the strictly better tokens
    keep = before < top_p
    cutoff = jnp.min(jnp.where(keep, sorted_bv, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits >= cutoff, logits, -jnp.inf)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


# ----------------------------------------------------------------------------- jitted wrapper


def prompt_arrays(tokens_bt, segment_ids_bt, max_len: int):
  """(tokens, segment ids) of a prompt as int32 [B, T] (one document when no ids are given);
  a prompt longer than the cache is refused."""
  tokens_bt = jnp.asarray(tokens_bt, jnp.int32)
  if tokens_bt.shape[1] > max_len:
    raise ValueError(f"prompt of {tokens_bt.shape[1]} tokens does not fit max_len={max_len}")
  if segment_ids_bt is None:
    segment_ids_bt = jnp.ones(tokens_bt.shape, jnp.int32)
  return tokens_bt, jnp.asarray(segment_ids_bt, jnp.int32)


class Decoder:
  """`prefill` and `step` of one model, jitted once per shape (the model's state is an argument,
  so its forward-written variables are left untouched)."""

  def __init__(self, model: K3Model, *, max_len: int):
    self.max_len = int(max_len)
    self.graphdef, self.state = nnx.split(model)
    self._prefill = jax.jit(functools.partial(_prefill_fn, self.graphdef, max_len=self.max_len))
    self._step = jax.jit(functools.partial(_step_fn, self.graphdef))

  def prefill(self, tokens_bt, segment_ids_bt=None):
    return self._prefill(self.state, *prompt_arrays(tokens_bt, segment_ids_bt, self.max_len))

  def step(self, tokens_b, cache: DecodeCache, segment_ids_b=None):
    if int(cache.length) >= cache.max_len:
      raise ValueError(f"the decode cache is full ({cache.max_len} tokens); use a larger max_len")
    tokens_b = jnp.asarray(tokens_b, jnp.int32)
    seg = cache.last_segment if segment_ids_b is None else jnp.asarray(segment_ids_b, jnp.int32)
    return self._step(self.state, tokens_b, cache, seg)


def _prefill_fn(graphdef, state, tokens_bt, segment_ids_bt, *, max_len):
  return prefill(nnx.merge(graphdef, state), tokens_bt, segment_ids_bt, max_len=max_len)


def _step_fn(graphdef, state, tokens_b, cache, segment_ids_b):
  return decode_step(nnx.merge(graphdef, state), tokens_b, cache, segment_ids_b)
