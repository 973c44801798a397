"""The fused, chunked head loss (k3train/train/head_loss.py, `train.loss_chunk_tokens`).

Against float64 autodiff of the unfused head (`cross_entropy(x · W)`), in fp32 and bf16 compute;
its primal against its VJP forward; no [B, T, V] value in its gradient program; the per-position
nll and argmax of `chunked_token_stats` against the dense head; a whole k3_tiny train step against
the unfused step; the MTP head fused too (traced); the config checks.
"""

import functools

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.configs import k3_tiny, one_layer_tiny
from k3train import config as config_lib
from k3train import defaults
from k3train.model import decoder
from k3train.train import builder
from k3train.train import step as step_lib
from k3train.train.head_loss import chunked_token_stats, fused_head_cross_entropy
from k3train.train.step import cross_entropy

B, T, D, V = 2, 24, 16, 96
CHUNKS = (24, 8, 3)            # positions per chunk: 1, 3 and 8 chunks


def _inputs():
  rng = np.random.default_rng(0)
  x_btd = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
  w_dv = jnp.asarray(0.5 * rng.standard_normal((D, V)), jnp.float32)
  targets_bt = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
  mask_bt = (rng.uniform(size=(B, T)) > 0.3).astype(np.float32)
  mask_bt[1, T // 2:] = 0.0                     # a masked tail (padding) in row 1
  return x_btd, w_dv, targets_bt, jnp.asarray(mask_bt)


def _unfused_loss(x_btd, w_dv, targets_bt, mask_bt):
  return cross_entropy(jnp.einsum("btd,dv->btv", x_btd, w_dv), targets_bt, mask_bt)


_unfused_value_and_grad = jax.jit(jax.value_and_grad(_unfused_loss, argnums=(0, 1), has_aux=True))


def _reference(x_btd, w_dv, targets_bt, mask_bt):
  """(loss, n, dx, dW) by float64 autodiff of the unfused head: cross_entropy(x · W)."""
  with jax.enable_x64(True):
    x64, w64, mask64 = (jnp.asarray(np.asarray(a, np.float64)) for a in (x_btd, w_dv, mask_bt))
    (ce, n), (dx, dw) = _unfused_value_and_grad(x64, w64, jnp.asarray(np.asarray(targets_bt)), mask64)
    return tuple(np.asarray(a, np.float64) for a in (ce, n, dx, dw))


def _fused_value_and_grad(chunk_tokens, dtype):
  def loss(x, w, targets, mask):
    return fused_head_cross_entropy(x, w, targets, mask, chunk_tokens=chunk_tokens, dtype=dtype)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def _assert_close(got, ref, rel, what):
  """|got − ref| ≤ rel · max|ref| elementwise (gradients: a relative error of the scale)."""
  got = np.asarray(got, np.float64)
  err = np.max(np.abs(got - ref))
  assert err <= rel * np.max(np.abs(ref)), (what, err, np.max(np.abs(ref)))


@pytest.mark.parametrize("chunk_tokens", CHUNKS)
def test_fp32_loss_and_gradients_match_float64_unfused(chunk_tokens):
  x, w, targets, mask = _inputs()
  (loss, n), (dx, dw) = _fused_value_and_grad(chunk_tokens, jnp.float32)(x, w, targets, mask)
  ref_loss, ref_n, ref_dx, ref_dw = _reference(x, w, targets, mask)
  assert float(n) == ref_n == float(jnp.sum(mask))
  assert (dx.dtype, dw.dtype) == (jnp.float32, jnp.float32)
  # fp32 throughout: summation-order rounding only, well inside 1e-5 relative.
  np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
  _assert_close(dx, ref_dx, 1e-5, "dx")
  _assert_close(dw, ref_dw, 1e-5, "dW")
  # Masked positions get no gradient.
  assert float(jnp.max(jnp.abs(dx[1, T // 2:]))) == 0.0


@pytest.mark.parametrize("chunk_tokens", CHUNKS)
def test_bf16_compute_matches_float64_on_the_rounded_inputs(chunk_tokens):
  """bf16 hidden states, fp32 weight, bf16 GEMMs with fp32 accumulation. The reference takes
  the same bf16-rounded x and W, so the loss (fp32 logits of exact bf16 products) agrees to
  fp32 rounding (1e-5 relative); the gradients go through a bf16 d_logits (relative 2^-9) and dx
  comes back in bf16 (another 2^-9): within 2^-7 of their scale."""
  x, w, targets, mask = _inputs()
  x16 = x.astype(jnp.bfloat16)
  (loss, _), (dx, dw) = _fused_value_and_grad(chunk_tokens, jnp.bfloat16)(x16, w, targets, mask)
  assert (dx.dtype, dw.dtype) == (jnp.bfloat16, jnp.float32)
  ref_loss, _, ref_dx, ref_dw = _reference(x16.astype(jnp.float32), w.astype(jnp.bfloat16).astype(jnp.float32),
                                           targets, mask)
  np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
  _assert_close(dx.astype(jnp.float32), ref_dx, 2**-7, "dx")
  _assert_close(dw, ref_dw, 2**-7, "dW")


def test_primal_equals_the_vjp_forward_and_does_no_gradient_work():
  x, w, targets, mask = _inputs()
  f = lambda x, w: fused_head_cross_entropy(x, w, targets, mask, chunk_tokens=8, dtype=jnp.float32)[0]
  primal = jax.jit(f)(x, w)
  forward, _ = jax.jit(lambda x, w: jax.vjp(f, x, w))(x, w)
  np.testing.assert_allclose(float(primal), float(forward), rtol=1e-6)   # same chunk sums
  # The primal runs one GEMM per chunk (the logits); the VJP forward three (logits, dx, dW).
  assert _count(jax.make_jaxpr(f)(x, w).jaxpr, "dot_general") == 1
  assert _count(jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(x, w).jaxpr, "dot_general") == 3


def _walk(jaxpr):
  """Every equation of a jaxpr and of the jaxprs in its equations' parameters (scan bodies, …)."""
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jex.jaxprs_in_params(eqn.params):
      yield from _walk(sub)


def _count(jaxpr, primitive):
  return sum(eqn.primitive.name == primitive for eqn in _walk(jaxpr))


def _largest_vocab_rows(jaxpr, vocab=V) -> int:
  """The most tokens (elements / vocab) of any value with a vocab-sized dimension in the program."""
  rows = 0
  for eqn in _walk(jaxpr):
    for var in (*eqn.invars, *eqn.outvars):
      shape = getattr(getattr(var, "aval", None), "shape", ())
      if vocab in shape:
        rows = max(rows, int(np.prod(shape)) // vocab)
  return rows


def test_gradient_program_holds_no_tokens_by_vocab_value():
  x, w, targets, mask = _inputs()

  def fused(x, w):
    return fused_head_cross_entropy(x, w, targets, mask, chunk_tokens=8, dtype=jnp.float32)[0]

  def unfused(x, w):
    return _unfused_loss(x, w, targets, mask)[0]

  grad_jaxpr = lambda f: jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(x, w).jaxpr
  assert _largest_vocab_rows(grad_jaxpr(unfused)) == B * T        # the walk sees [B, T, V]
  assert _largest_vocab_rows(grad_jaxpr(fused)) == B * 8          # one chunk [B, c, V] at most


def test_chunk_must_divide_the_sequence():
  x, w, targets, mask = _inputs()
  with pytest.raises(ValueError, match=r"train.loss_chunk_tokens=5 must be a positive divisor .* T=24"):
    fused_head_cross_entropy(x, w, targets, mask, chunk_tokens=5, dtype=jnp.float32)


# --- per-position statistics (evals) ------------------------------------------------------------


@jax.jit
def _dense_token_stats(x_btd, w_dv, targets_bt):
  """(nll [B, T], argmax [B, T], fp32 logits [B, T, V]), as evals.make_eval_step computes them."""
  logits_btv = jnp.einsum("btd,dv->btv", x_btd, w_dv)
  nll_bt = jax.nn.logsumexp(logits_btv, axis=-1) - jnp.take_along_axis(
      logits_btv, targets_bt[..., None], axis=-1)[..., 0]
  return nll_bt, jnp.argmax(logits_btv, axis=-1), logits_btv


def _token_stats(chunk_tokens):
  fn = functools.partial(chunked_token_stats, chunk_tokens=chunk_tokens, dtype=jnp.float32)
  return jax.jit(fn)


@pytest.mark.parametrize("chunk_tokens", CHUNKS)
def test_token_stats_equal_the_dense_head(chunk_tokens):
  """fp32: the same per-position logsumexp − target logit, 1e-6 relative; the argmax exactly
  (the data has no near ties: the top two logits of every position are ≥ 1e-4 apart)."""
  x, w, targets, _ = _inputs()
  ref_nll, ref_argmax, logits = _dense_token_stats(x, w, targets)
  top2 = np.sort(np.asarray(logits), axis=-1)[..., -2:]
  assert np.min(top2[..., 1] - top2[..., 0]) > 1e-4
  nll, argmax = _token_stats(chunk_tokens)(x, w, targets)
  assert (nll.shape, argmax.shape) == ((B, T), (B, T))
  assert (nll.dtype, argmax.dtype) == (jnp.float32, jnp.int32)
  np.testing.assert_allclose(np.asarray(nll), np.asarray(ref_nll), rtol=1e-6, atol=0)
  np.testing.assert_array_equal(np.asarray(argmax), np.asarray(ref_argmax))


@pytest.mark.parametrize("chunk_tokens", CHUNKS)
def test_token_stats_argmax_ties_go_to_the_first_index(chunk_tokens):
  """Every column of W twice (columns 2k and 2k + 1 equal): every maximum is tied, and both
  paths pick the even (first) index, as jnp.argmax does."""
  x, w, targets, _ = _inputs()
  w_tied = jnp.repeat(w[:, :V // 2], 2, axis=1)
  _, ref_argmax, logits = _dense_token_stats(x, w_tied, targets)
  logits = np.asarray(logits)
  assert np.array_equal(logits[..., 0::2], logits[..., 1::2])          # exact ties
  _, argmax = _token_stats(chunk_tokens)(x, w_tied, targets)
  assert np.all(np.asarray(ref_argmax) % 2 == 0)
  np.testing.assert_array_equal(np.asarray(argmax), np.asarray(ref_argmax))


def test_token_stats_program_holds_no_tokens_by_vocab_value():
  x, w, targets, _ = _inputs()
  jaxpr = jax.make_jaxpr(functools.partial(chunked_token_stats, chunk_tokens=8, dtype=jnp.float32))
  assert _largest_vocab_rows(jaxpr(x, w, targets).jaxpr) == B * 8    # one chunk [B, c, V] at most
  with pytest.raises(ValueError, match=r"loss_chunk_tokens=5 must be a positive divisor .* T=24"):
    chunked_token_stats(x, w, targets, chunk_tokens=5, dtype=jnp.float32)


# --- the whole train step ----------------------------------------------------------------------

BT, TT, CHUNK = 4, 64, 16        # 4 chunks of 16 positions
# The test programs compile as model initialisation does (k3train/model/decoder.py): at a low
# optimisation level, twice as fast on CPU; both steps compile alike.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _tiny_config(loss_chunk_tokens, mtp=False):
  """k3_tiny cut to one layer (MLA + dense FFN), batch 4 × 64. AdamW's first update is
  lr · g / (|g| + ε): with the default ε = 1e-8 it turns the fp32 rounding of gradients of size
  ≲ ε into update differences of ~1e-4 of the learning rate; ε = 1e-2 (above every gradient
  here) makes the update a smooth function of the gradient, |δ update| ≤ lr · |δg| / ε, so the
  parameters compare the two heads' gradients."""
  cfg = one_layer_tiny(seq_len=TT, global_batch_size=BT)
  cfg.model.mtp.enabled = mtp
  cfg.optim.warmup_steps = 0          # the full learning rate on the first step
  cfg.optim.adam_eps = 1e-2
  cfg.train.loss_chunk_tokens = loss_chunk_tokens
  return config_lib.validate(cfg)


def _tiny_batch(vocab):
  rng = np.random.default_rng(0)
  loss_mask = np.ones((BT, TT), np.float32)
  loss_mask[1, 20:] = 0.0
  segment_ids = np.ones((BT, TT), np.int32)
  segment_ids[2, 40:] = 2
  return {"tokens": jnp.asarray(rng.integers(8, vocab, (BT, TT)), jnp.int32),
          "targets": jnp.asarray(rng.integers(8, vocab, (BT, TT)), jnp.int32),
          "segment_ids": jnp.asarray(segment_ids), "loss_mask": jnp.asarray(loss_mask)}


def test_train_step_equals_the_unfused_step():
  """k3_tiny computes in fp32: the loss and the gradient norms agree to 1e-5 relative; the
  parameters after one AdamW step (updates up to 2e-3) to 2e-8 absolute: the gradients differ
  by ≲ 1e-8 (summation order), i.e. ≤ 3e-9 in the update, plus a few ulp of |p| ≈ 0.05."""
  unfused_cfg, fused_cfg = _tiny_config(0), _tiny_config(CHUNK)
  run = builder.build(unfused_cfg)
  batch = _tiny_batch(unfused_cfg.model.vocab_size)
  results = []
  for cfg in (unfused_cfg, fused_cfg):
    step = jax.jit(builder.train_step_fn(cfg, run.graphdef, run.optimizer))
    results.append(step.lower(run.state, batch).compile(FAST_COMPILE)(run.state, batch))
  (state_a, metrics_a), (state_b, metrics_b) = results
  assert float(metrics_a["tokens"]) == float(metrics_b["tokens"]) == 3 * TT + 20
  assert float(metrics_a["skipped_update"]) == float(metrics_b["skipped_update"]) == 0.0
  for key in [k for k in metrics_a if k == "loss" or k.startswith("grad_norm")]:
    np.testing.assert_allclose(float(metrics_b[key]), float(metrics_a[key]), rtol=1e-5, err_msg=key)
  moved = 0.0
  for p, a, b in zip(*(jax.tree.leaves(s.params) for s in (run.state, state_a, state_b))):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=2e-8)
    moved = max(moved, float(np.max(np.abs(np.asarray(a) - np.asarray(p)))))
  assert moved > 1e-3                                   # the step did update the parameters


def test_mtp_head_runs_fused_too():
  """With model.mtp on, the gradient program of the whole loss (main + MTP head) holds no
  [B, T, V] value at all: both heads run in chunks (traced only, nothing compiled)."""
  rows = {}
  for chunk in (0, CHUNK):
    cfg = _tiny_config(chunk, mtp=True)
    model = decoder.abstract_model(cfg.model)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    fn = functools.partial(step_lib.loss_and_grads, graphdef, loss_chunk_tokens=chunk)
    jaxpr = jax.make_jaxpr(fn)(params, rest, _tiny_batch(cfg.model.vocab_size))
    rows[chunk] = _largest_vocab_rows(jaxpr.jaxpr, cfg.model.vocab_size)
  assert rows == {0: BT * TT, CHUNK: BT * CHUNK}


# --- config ------------------------------------------------------------------------------------


def test_config_rejects_a_chunk_that_does_not_divide_the_sequence():
  cfg = k3_tiny.get_config()                            # seq_len 128
  cfg.train.loss_chunk_tokens = 48
  with pytest.raises(config_lib.ConfigError,
                     match=r"train.loss_chunk_tokens: must be 0 \(unfused head\) or a divisor of "
                           r"data.seq_len=128, got 48"):
    config_lib.validate(cfg)
  cfg.train.loss_chunk_tokens = -1
  with pytest.raises(config_lib.ConfigError, match="train.loss_chunk_tokens"):
    config_lib.validate(cfg)
  cfg.train.loss_chunk_tokens = 32
  config_lib.validate(cfg)
  cfg.parallel.sequence = 64                            # chunks of 32 cannot split over 64 shards
  with pytest.raises(config_lib.ConfigError, match="multiple of parallel.sequence=64"):
    config_lib.validate(cfg)


def test_config_checks_the_chunk_against_every_stage():
  cfg = k3_tiny.get_config()                            # stages of 128, 256 and 512 positions
  cfg.train.use_stages = True
  cfg.train.loss_chunk_tokens = 128
  config_lib.validate(cfg)
  cfg.train.loss_chunk_tokens = 64
  cfg.train.stages = (defaults.curriculum_stage(name="short_128", until_step=10),
                      defaults.curriculum_stage(name="odd_96", seq_len=96, global_batch_size=4))
  with pytest.raises(config_lib.ConfigError,
                     match=r"train.stages\[1\] \('odd_96'\): train.loss_chunk_tokens: .*"
                           r"data.seq_len=96, got 64"):
    config_lib.validate(cfg)
