"""The K3 decoder: layer schedule, AttnRes wiring, scanned super-blocks, final norm and untied head.

Layout (docs/maths.md §10, docs/design.md principle 2): an unscanned prefix (the dense first layer up to the
first MLA layer), `lax.scan` over identical super-blocks [KDA, KDA, KDA, MLA] (each with MoE),
and an unscanned suffix (K3: the final extra MLA layer). Each sublayer input is an AttnRes mix
over completed block sums and the running partial sum (docs/maths.md §3.2). With model.vision on,
the vision tower's tokens replace the placeholder embeddings before the first layer
(k3train/model/vision.py, docs/maths.md §6). With model.mtp on, the model also owns the
multi-token-prediction module (k3train/model/mtp.py, docs/maths.md §8), created after everything
else and run by the train step from `hidden_states` (`mtp_hidden`).
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from k3train import config as config_lib
from k3train.model import attnres
from k3train.parallel import axes as ax
from k3train.parallel.rules import constrain
from k3train.model import layer_scan
from k3train.model import layers
from k3train.model import remat
from k3train.model.kda import KimiDeltaAttention
from k3train.model.mla import GatedMLA
from k3train.model.moe import StableLatentMoE
from k3train.model.mtp import MTPModule
from k3train.model import vision as vision_lib


class DecoderLayer(nnx.Module):
  """One decoder layer: AttnRes mix → RMSNorm → mixer, then AttnRes mix → RMSNorm → FFN."""

  def __init__(self, m: ml_collections.ConfigDict, mixer: str, ffn: str, *, rngs: nnx.Rngs):
    dtype, param_dtype = layers.dtype_from_name(m.dtype), layers.dtype_from_name(m.param_dtype)
    d = m.d_model
    self.block_size = m.attn_res.block_size
    self.attn_res = attnres.AttnResMix(d, eps=m.norm_eps, backend=m.attn_res.backend,
                                       param_dtype=param_dtype, rngs=rngs)
    self.attn_norm = layers.RMSNorm(d, eps=m.norm_eps, param_dtype=param_dtype, rngs=rngs)
    if mixer == "kda":
      self.mixer = KimiDeltaAttention(m.kda, d_model=d, init_std=m.init_std, norm_eps=m.norm_eps,
                                      dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    else:
      self.mixer = GatedMLA(m.mla, d_model=d, init_std=m.init_std, dtype=dtype,
                            param_dtype=param_dtype, rngs=rngs)
    self.mlp_res = attnres.AttnResMix(d, eps=m.norm_eps, backend=m.attn_res.backend,
                                      param_dtype=param_dtype, rngs=rngs)
    self.mlp_norm = layers.RMSNorm(d, eps=m.norm_eps, param_dtype=param_dtype, rngs=rngs)
    if ffn == "dense":
      self.ffn = layers.GluMLP(d, m.dense_ffn_hidden, beta=m.situ_beta, linear_beta=m.situ_linear_beta,
                               std=m.init_std, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    else:
      self.ffn = StableLatentMoE(m.moe, d_model=d, init_std=m.init_std, norm_eps=m.norm_eps,
                                 situ_beta=m.situ_beta, situ_linear_beta=m.situ_linear_beta,
                                 dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.ffn_kind = ffn

  def __call__(self, stream, layer_index, segment_ids_bt, token_mask_bt):
    h, stream = self.attn_res(stream)
    blocks, num_blocks, p = attnres.maybe_start_block(stream, layer_index, self.block_size)
    p = p + self.mixer(self.attn_norm(h), segment_ids_bt)
    h, (blocks, num_blocks, p) = self.mlp_res((blocks, num_blocks, p))
    h = self.mlp_norm(h)
    p = p + (self.ffn(h) if self.ffn_kind == "dense" else self.ffn(h, token_mask_bt))
    p = constrain(p, ax.BATCH, ax.SEQ, ax.EMBED)
    return blocks, num_blocks, p


class SuperBlock(nnx.Module):
  """One period of the layer schedule (K3: 3 × KDA+MoE, then MLA+MoE)."""

  def __init__(self, m: ml_collections.ConfigDict, period, *, rngs: nnx.Rngs):
    self.layers = nnx.List([DecoderLayer(m, mixer, ffn, rngs=rngs) for mixer, ffn in period])

  def __call__(self, stream, first_layer_index, segment_ids_bt, token_mask_bt):
    for i, layer in enumerate(self.layers):
      stream = layer(stream, first_layer_index + i, segment_ids_bt, token_mask_bt)
    return stream


# model.remat_policy → jax.checkpoint policy (model/remat.py; "none" does not rematerialise).
REMAT_POLICIES = {name: remat.policy(name) for name in config_lib.REMAT_POLICIES if name != "none"}


class K3Model(nnx.Module):
  """tokens [B, T] → logits [B, T, vocab]."""

  def __init__(self, m: ml_collections.ConfigDict, *, rngs: nnx.Rngs):
    self.schedule = sched = config_lib.layer_schedule(m)
    self.num_layers = m.num_layers
    self.remat_policy = m.remat_policy
    self.max_blocks = attnres.max_blocks(m.num_layers, m.attn_res.block_size)
    dtype, param_dtype = layers.dtype_from_name(m.dtype), layers.dtype_from_name(m.param_dtype)
    self.embed = layers.Embed(m.vocab_size, m.d_model, std=m.init_std, dtype=dtype,
                              param_dtype=param_dtype, rngs=rngs)
    self.prefix = nnx.List([DecoderLayer(m, *sched.kinds[i], rngs=rngs) for i in range(sched.prefix)])
    stack = None
    if sched.num_super_blocks:
      @nnx.split_rngs(splits=sched.num_super_blocks)
      @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: ax.LAYERS})
      def make_stack(rngs):
        return SuperBlock(m, sched.period, rngs=rngs)
      stack = make_stack(rngs)
    self.stack = nnx.data(stack)
    self.suffix = nnx.List([DecoderLayer(m, *sched.kinds[i], rngs=rngs)
                            for i in range(sched.suffix_start, m.num_layers)])
    self.out_res = attnres.AttnResMix(m.d_model, eps=m.norm_eps, backend=m.attn_res.backend,
                                      param_dtype=param_dtype, rngs=rngs)
    self.final_norm = layers.RMSNorm(m.d_model, eps=m.norm_eps, param_dtype=param_dtype, rngs=rngs)
    self.lm_head = layers.Linear((m.d_model,), (m.vocab_size,), (ax.EMBED, ax.VOCAB), std=m.init_std,
                                 dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    # Who computes the fused head loss's per-row log-normaliser (k3train/train/head_loss.py).
    self.head_lse_backend = m.get("head_lse_backend", "xla")
    # The vision tower is created last, so the text parameters initialise the same with or without it.
    w = m.get("vision")
    self.placeholder_id = w.placeholder_id if w is not None and w.enabled else None
    self.vision = nnx.data(vision_lib.VisionTower(w, d_model=m.d_model, remat_policy=m.remat_policy,
                                                  dtype=dtype, param_dtype=param_dtype, rngs=rngs)
                           if self.placeholder_id is not None else None)
    # The MTP module comes after the tower, so neither changes the other parameters' initial values.
    t = m.get("mtp")
    self.mtp_loss_weight = float(t.loss_weight) if t is not None and t.enabled else 0.0
    self.mtp = nnx.data(MTPModule(m, rngs=rngs) if t is not None and t.enabled else None)

  def _run_stack(self, stream, segment_ids_bt, token_mask_bt, grad_acc=None):
    """The scan over super-blocks. grad_acc = (accumulator shaped like the stack's parameters,
    weight): differentiate with respect to the accumulator, which receives accumulator +
    weight · the stack's parameter gradient, added in place layer by layer
    (k3train/model/layer_scan.py); the parameters themselves then get no gradient."""
    sched = self.schedule
    graphdef, params, rest = nnx.split(self.stack, nnx.Param, ...)

    def body(stream, block_params, xs, consts):
      block_rest, index = xs
      block = nnx.merge(graphdef, block_params, block_rest)
      first = sched.prefix + index * len(sched.period)
      stream = block(stream, first, *consts)
      return stream, nnx.state(block, nnx.Not(nnx.Param))

    if self.remat_policy != "none":
      body = jax.checkpoint(body, policy=REMAT_POLICIES[self.remat_policy], prevent_cse=False)
    indices = jnp.arange(sched.num_super_blocks, dtype=jnp.int32)
    consts = (segment_ids_bt, token_mask_bt)
    if grad_acc is None:
      stream, new_rest = jax.lax.scan(lambda c, x: body(c, x[0], x[1], consts), stream,
                                      (params, (rest, indices)))
    else:
      acc, weight = grad_acc
      stream, new_rest = layer_scan.accumulating_scan(body, stream, params, (rest, indices), consts,
                                                      acc, weight)
    nnx.update(self.stack, new_rest)
    return stream

  def _run_layer(self, layer, stream, index: int, segment_ids_bt, token_mask_bt):
    """One unscanned layer, rematerialised under the same policy as the scanned stack. Its index
    stays a Python int, so whether it starts an AttnRes block is decided when tracing."""
    def call(layer, stream, segment_ids_bt, token_mask_bt):
      return layer(stream, index, segment_ids_bt, token_mask_bt)
    return self._remat(layer, call, stream, segment_ids_bt, token_mask_bt)

  def _remat(self, module, fn, *args):
    """fn(module, *args) rematerialised under model.remat_policy (an unscanned layer, the MTP
    block); the variables the forward writes are carried out of the checkpointed function."""
    if self.remat_policy == "none":
      return fn(module, *args)
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)

    def run(params, rest, *args):
      inner = nnx.merge(graphdef, params, rest)
      out = fn(inner, *args)
      return out, nnx.state(inner, nnx.Not(nnx.Param))

    run = jax.checkpoint(run, policy=REMAT_POLICIES[self.remat_policy], prevent_cse=True)
    out, new_rest = run(params, rest, *args)
    nnx.update(module, new_rest)
    return out

  def hidden_states(self, tokens_bt, segment_ids_bt=None, token_mask_bt=None, vision=None,
                    stack_grad_acc=None, embed_btd=None) -> jax.Array:
    """The final AttnRes mix before the norm, [B, T, d] (also the MTP input).

    `vision`: the batch's vision_patches / vision_grids / vision_grid_ids (a mapping) when the
    tower is on; its tokens replace the placeholder embeddings (vision.splice).
    `stack_grad_acc`: (gradient accumulator of the scanned stack's parameters, weight), for
    gradient accumulation in the stack's backward pass (see `_run_stack`).
    `embed_btd`: the tokens' embeddings [B, T, d] looked up by the caller (`self.embed(tokens)`,
    the default); the train step passes them to take their gradient per row
    (k3train/train/step.py, `loss_and_grads`).
    """
    if token_mask_bt is None:
      token_mask_bt = jnp.ones(tokens_bt.shape, jnp.float32)
    x = self.embed(tokens_bt) if embed_btd is None else embed_btd
    x = constrain(x, ax.BATCH, ax.SEQ, ax.EMBED)
    if vision is not None and self.vision is not None:
      tokens_bnd = self.vision(vision["vision_patches"], vision["vision_grids"], vision["vision_grid_ids"])
      x = constrain(vision_lib.splice(x, tokens_bt, tokens_bnd, self.placeholder_id),
                    ax.BATCH, ax.SEQ, ax.EMBED)
    stream = attnres.init_stream(x, self.max_blocks)
    for i, layer in enumerate(self.prefix):
      stream = self._run_layer(layer, stream, i, segment_ids_bt, token_mask_bt)
    if self.stack is not None:
      stream = self._run_stack(stream, segment_ids_bt, token_mask_bt, stack_grad_acc)
    elif stack_grad_acc is not None:
      raise ValueError("stack_grad_acc given, but the model has no scanned stack")
    for i, layer in enumerate(self.suffix):
      stream = self._run_layer(layer, stream, self.schedule.suffix_start + i, segment_ids_bt,
                               token_mask_bt)
    return self.out_res(stream)[0]

  def mtp_hidden(self, h_btd, next_tokens_bt, segment_ids_bt=None, token_mask_bt=None,
                 next_embed_btd=None) -> jax.Array:
    """The MTP module's normalised output [B, T, d] at every position i (its `lm_head` logits
    predict t_{i+2}) from `hidden_states` h and the next tokens t_{i+1} (the batch's targets);
    rematerialised like a layer. Needs model.mtp on. `next_embed_btd`: the next tokens'
    embeddings when the caller looked them up (as `hidden_states`' `embed_btd`)."""
    if self.mtp is None:
      raise ValueError("the model has no MTP module (model.mtp.enabled is false)")
    if token_mask_bt is None:
      token_mask_bt = jnp.ones(next_tokens_bt.shape, jnp.float32)
    next_embed = self.embed(next_tokens_bt) if next_embed_btd is None else next_embed_btd
    next_embed = constrain(next_embed, ax.BATCH, ax.SEQ, ax.EMBED)
    return self._remat(self.mtp, lambda mtp, *args: mtp(*args), h_btd, next_embed, segment_ids_bt,
                       token_mask_bt)

  def __call__(self, tokens_bt, segment_ids_bt=None, token_mask_bt=None, vision=None) -> jax.Array:
    h = self.hidden_states(tokens_bt, segment_ids_bt, token_mask_bt, vision)
    logits = self.lm_head(self.final_norm(h))
    return constrain(logits, ax.BATCH, ax.SEQ, ax.VOCAB)


log = logging.getLogger(__name__)

# Initialisation runs once, so compile it fast rather than well (3-4x quicker to compile on CPU).
# On GPU also skip autotuning; a backend that rejects an option compiles with its defaults.
_INIT_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
_INIT_COMPILER_OPTIONS_BY_BACKEND = {"cpu": _INIT_COMPILER_OPTIONS,
                                     "gpu": dict(_INIT_COMPILER_OPTIONS, xla_gpu_autotune_level=0)}


def _compile_fast(lowered):
  options = _INIT_COMPILER_OPTIONS_BY_BACKEND.get(jax.default_backend())
  if options:
    try:
      return lowered.compile(compiler_options=options)
    except Exception as e:                 # an XLA build that does not know one of the options
      log.warning("fast-compile options for model init rejected (%s); compiling with "
                      "defaults", str(e).splitlines()[0][:200])
  return lowered.compile()


def abstract_model(m: ml_collections.ConfigDict, seed: int = 0) -> K3Model:
  """The model with ShapeDtypeStructs for arrays (nothing allocated): shapes, names, structure."""
  return nnx.eval_shape(lambda: K3Model(m, rngs=nnx.Rngs(params=seed)))


def build_model(m: ml_collections.ConfigDict, seed: int = 0, out_shardings=None) -> K3Model:
  """Initialises the model inside one jit (eager init would dispatch thousands of tiny ops)."""
  graphdef = nnx.graphdef(abstract_model(m, seed))
  init = jax.jit(lambda: nnx.state(K3Model(m, rngs=nnx.Rngs(params=seed))), out_shardings=out_shardings)
  state = _compile_fast(init.lower())()
  return nnx.merge(graphdef, state)
