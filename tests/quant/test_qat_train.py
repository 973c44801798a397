"""k3_tiny training with MX QAT of the routed experts switched on at step 10 (docs/maths.md §7.5):
it keeps training, it resumes bit-identically across the switch, master weights and optimizer
state stay fp32, and the expert weights are quantised once per step, not per micro-batch.

One config (the four-layer k3_tiny of tests/configs.py, 20 steps, checkpoints every 5, QAT from
step 10), so one compiled step.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from k3train import config as config_lib
from k3train.model import decoder, moe
from k3train.optim.optimizer import make_optimizer
from k3train.quant import mx
from k3train.train import loop
from k3train.train import step as step_lib
from k3train.train.checkpoint import Checkpointer
from tests.configs import k3_tiny, quick

STEPS, SWITCH, EVERY = 20, 10, 5


def make_config():
  cfg = quick(k3_tiny.get_config())
  cfg.train.steps = STEPS
  cfg.checkpoint.every_steps = EVERY
  cfg.model.quant.enabled = True
  cfg.model.quant.start_step = SWITCH
  return config_lib.validate(cfg)


def read_metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return {r["step"]: r for r in map(json.loads, f)}


def final_state(workdir):
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), make_config())
  step = ckpt.latest_step()
  restored = ckpt.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
  ckpt.close()
  return {k: np.asarray(v) for k, v in restored["state"].items()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("qat_full"))
  loop.train(make_config(), workdir)
  return workdir


def test_qat_switches_on_at_step_10_and_training_continues(uninterrupted):
  rows = read_metrics(uninterrupted)
  assert sorted(rows) == list(range(1, STEPS + 1))
  # Metrics step s ran with state.step = s − 1: quantised from s = SWITCH + 1 on.
  assert [rows[s]["qat_active"] for s in rows] == [float(s > SWITCH) for s in rows]
  losses = np.array([rows[s]["loss"] for s in sorted(rows)])
  assert np.all(np.isfinite(losses))
  before, after = losses[SWITCH - 5:SWITCH].mean(), losses[-5:].mean()
  # The tiny model's loss keeps falling through the switch (by > 0.1 nat over 10 steps).
  assert after < before - 0.1, (before, after)
  assert losses[-5:].mean() < losses[:5].mean() - 0.3


def test_resume_across_the_switch_is_bit_identical(uninterrupted, tmp_path):
  """Stop at step 10 (the last bf16 step done, the next one quantised), restore, finish: the
  losses and every checkpointed array equal the uninterrupted run's bit for bit."""
  workdir = str(tmp_path)
  first = loop.train(make_config(), workdir, stop_at_step=SWITCH)
  assert first.end_step == SWITCH
  second = loop.train(make_config(), workdir)
  assert second.start_step == SWITCH and second.end_step == STEPS
  full, resumed = read_metrics(uninterrupted), read_metrics(workdir)
  assert {s: r["loss"] for s, r in resumed.items()} == {s: r["loss"] for s, r in full.items()}
  state_a, state_b = final_state(uninterrupted), final_state(workdir)
  assert state_a.keys() == state_b.keys()
  for key in state_a:
    np.testing.assert_array_equal(state_a[key], state_b[key], err_msg=key)


def test_master_weights_and_optimizer_state_stay_fp32(uninterrupted):
  """After QAT steps the checkpointed parameters and optimizer moments are fp32, and the routed
  experts' master weights are not on the MXFP4 grid (only the forward sees Q(W))."""
  state = final_state(uninterrupted)
  floats = {k: v for k, v in state.items() if k.startswith(("params.", "opt_state."))
            and np.issubdtype(v.dtype, np.floating)}
  assert floats and all(v.dtype == np.float32 for v in floats.values())
  gate = [v for k, v in state.items() if k.startswith("params.") and k.endswith("experts.gate")]
  assert gate
  for w in gate:
    assert not np.array_equal(w, np.asarray(mx.quantize_dequantize(jnp.asarray(w), "mxfp4", -2)))


def test_expert_weights_are_quantised_once_per_step_not_per_micro_batch(monkeypatch):
  """Traced with 2 micro-batches: each routed-expert weight is quantised once, before
  `loss_and_grads` (which holds the micro-batch scan), and never inside it, where no expert GEMM
  fake-quantises a weight again; the activations are quantised inside the experts (MXFP8).
  Tracing only, nothing compiled."""
  cfg = make_config()
  cfg.train.microbatches = 2
  model = decoder.abstract_model(cfg.model)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  optimizer = make_optimizer(cfg, params)
  state = step_lib.TrainState(jax.ShapeDtypeStruct((), jnp.int32), params, rest,
                              jax.eval_shape(optimizer.init, params),
                              jax.ShapeDtypeStruct((), jnp.float32),
                              jax.ShapeDtypeStruct((), jnp.int32))
  b, t = cfg.train.global_batch_size, cfg.data.seq_len
  batch = {k: jax.ShapeDtypeStruct((b, t), jnp.int32)
           for k in ("tokens", "targets", "segment_ids", "positions")}
  batch["loss_mask"] = jax.ShapeDtypeStruct((b, t), jnp.float32)
  calls = {"hook": 0, "hook_in_micro_batches": 0, "fq_weights": 0, "fq_acts": 0}
  inside = [False]
  real_qd, real_fq, real_lag = mx.quantize_dequantize, mx.fake_quant, step_lib.loss_and_grads

  def counting_qd(x, fmt, axis=-1, **kw):   # activations (mxfp8) come through here too
    if fmt == "mxfp4":
      calls["hook_in_micro_batches" if inside[0] else "hook"] += 1
    return real_qd(x, fmt, axis, **kw)

  def counting_fq(x, fmt, axis=-1, **kw):
    calls["fq_weights" if fmt == "mxfp4" else "fq_acts"] += 1
    return real_fq(x, fmt, axis, **kw)

  def marked_loss_and_grads(*args, **kw):    # the micro-batch scan runs in here
    inside[0] = True
    try:
      return real_lag(*args, **kw)
    finally:
      inside[0] = False

  monkeypatch.setattr(mx, "quantize_dequantize", counting_qd)
  monkeypatch.setattr(mx, "fake_quant", counting_fq)
  monkeypatch.setattr(step_lib, "loss_and_grads", marked_loss_and_grads)
  step_fn = step_lib.make_train_step(graphdef, optimizer, microbatches=2, quant=cfg.model.quant)
  jax.eval_shape(step_fn, state, batch)
  expert_leaves = [p for p, _ in nnx.to_flat_state(params) if moe.is_routed_expert_weight(tuple(p))]
  assert calls["hook"] == len(expert_leaves) > 0          # each weight once, before the scan
  assert calls["hook_in_micro_batches"] == 0 and calls["fq_weights"] == 0
  assert calls["fq_acts"] > 0                              # activations: inside the experts
