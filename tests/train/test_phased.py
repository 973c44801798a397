"""The train step as a gradient program and an update program (k3train/train/phased.py) against
the same step jitted as one program."""

import jax
import numpy as np
import pytest

from tests.configs import one_layer_tiny
from k3train import config as config_lib
from k3train.train import builder
from k3train.train import phased
from k3train.train import step as step_lib

BT, TT = 4, 32
# Compiled as model initialisation compiles (k3train/model/decoder.py): fast on CPU, and both
# forms of the step alike.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _config():
  """One MLA layer with a dense FFN plus the MTP module (an MoE block: router state, expert
  loads), 2 micro-batches, AdamW."""
  cfg = one_layer_tiny(seq_len=TT, global_batch_size=BT)
  cfg.model.mtp.enabled = True
  cfg.train.microbatches = 2
  cfg.optim.warmup_steps = 0
  return config_lib.validate(cfg)


def _batch(vocab):
  rng = np.random.default_rng(0)
  loss_mask = np.ones((BT, TT), np.float32)
  loss_mask[1, 20:] = 0.0
  return {"tokens": rng.integers(8, vocab, (BT, TT)).astype(np.int32),
          "targets": rng.integers(8, vocab, (BT, TT)).astype(np.int32),
          "segment_ids": np.ones((BT, TT), np.int32),
          "positions": np.tile(np.arange(TT, dtype=np.int32), (BT, 1)),
          "loss_mask": loss_mask}


@pytest.fixture(scope="module")
def built():
  cfg = _config()
  run = builder.build(cfg)
  return cfg, run, run.layout.global_batch(_batch(cfg.model.vocab_size))


def _copy(tree):
  return jax.tree.map(lambda x: x.copy(), tree)


def test_two_programs_compute_the_one_program_step(built):
  cfg, run, batch = built
  assert isinstance(run.step, phased.PhasedStep)
  phases = builder.train_step_fn(cfg, run.graphdef, run.optimizer)
  assert isinstance(phases, step_lib.StepPhases)
  one = jax.jit(phases).lower(run.state, batch).compile(FAST_COMPILE)      # no donation
  want_state, want = one(run.state, batch)

  state_in = _copy(run.state)
  compiled = run.step.lower(state_in, batch).compile(FAST_COMPILE)
  assert isinstance(compiled, phased.CompiledPhases)
  assert set(compiled.seconds) == {"gradients", "update", "wall"}
  got_state, got = compiled(state_in, batch)

  assert set(got) == set(want) and {"mtp_loss", "moe_max_load", "grad_norm"} <= set(got)
  for key in want:
    np.testing.assert_allclose(np.asarray(got[key]), np.asarray(want[key]), rtol=1e-6, atol=1e-7,
                               err_msg=key)
  moved = 0.0
  for p, a, b in zip(*(jax.tree.leaves(s) for s in (run.state, want_state, got_state))):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-7)
    if np.issubdtype(np.asarray(a).dtype, np.floating):
      moved = max(moved, float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(p, np.float64)))))
  assert moved > 1e-4                                   # the step did update the parameters
  assert int(got_state.step) == int(run.state.step) + 1
  # The state given to the step is donated (to the gradient program, which hands it on).
  assert all(x.is_deleted() for x in jax.tree.leaves(state_in.params))


def test_the_gradient_program_holds_the_whole_state_as_arguments(built):
  """Its memory analysis counts what is live while it runs: the whole state (the optimizer
  moments included, though it does not read them; donated and handed on unchanged, so aliased)
  and the batch; its outputs add the gradients."""
  _, run, batch = built
  compiled = run.step.lower(run.state, batch).compile(FAST_COMPILE)
  gradients, update = compiled.memory_analysis()
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(run.state))
  batch_bytes = sum(x.nbytes for x in jax.tree.leaves(batch))
  # (a batch array the model does not read, "positions" here, is left out)
  assert state_bytes < gradients.argument_size_in_bytes <= state_bytes + batch_bytes
  assert gradients.alias_size_in_bytes == state_bytes              # the state, handed on
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(run.state.params))
  assert gradients.output_size_in_bytes >= state_bytes + param_bytes   # + gradients, fp32
  assert update.alias_size_in_bytes == pytest.approx(state_bytes, rel=1e-3)


def test_a_call_compiles_once_per_signature(built, monkeypatch):
  cfg, _, batch = built
  run = builder.build(cfg)
  compiles = []
  real = phased.LoweredPhases.compile

  def counted(self, compiler_options=None):
    compiles.append(1)
    return real(self, compiler_options=FAST_COMPILE)
  monkeypatch.setattr(phased.LoweredPhases, "compile", counted)
  state = run.state
  for _ in range(3):
    state, metrics = run.step(state, batch)
  assert len(compiles) == 1
  assert int(state.step) == 3 and np.isfinite(float(metrics["loss"]))


def test_split_step_false_jits_one_program_with_the_same_result(built):
  """`train.split_step=False`: the step is one jitted program; from the same state and batch it
  gives the two programs' state and metrics."""
  cfg, run, batch = built
  one_cfg = _config()
  one_cfg.train.split_step = False
  one = builder.jit_train_step(one_cfg, run.graphdef, run.optimizer, run.layout, run.shardings)
  assert not isinstance(one, phased.PhasedStep)
  want_state, want = one.lower(run.state, batch).compile(FAST_COMPILE)(_copy(run.state), batch)
  got_state, got = run.step.lower(run.state, batch).compile(FAST_COMPILE)(_copy(run.state), batch)
  for key in want:
    np.testing.assert_allclose(np.asarray(got[key]), np.asarray(want[key]), rtol=1e-6, atol=1e-7,
                               err_msg=key)
  for a, b in zip(jax.tree.leaves(want_state), jax.tree.leaves(got_state)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-7)
