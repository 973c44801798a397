"""train.xla_options reach the train step's compile, and only the train step's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from tests.configs import one_layer_tiny
from k3train import config as config_lib
from k3train.train import builder


def _one_layer(xla_options: str):
  cfg = one_layer_tiny(seq_len=32, global_batch_size=2)
  cfg.train.xla_options = xla_options
  return config_lib.validate(cfg)


def test_the_step_compiles_with_the_configured_options():
  """An option name XLA does not know passes the config check (only XLA knows its names) and
  then fails the step's compile, naming it: so the options are handed to that compile. The
  model's initialisation, compiled before, does not see them."""
  run = builder.build(_one_layer("xla_k3train_no_such_option=1"))
  batch = {k: jnp.zeros((2, 32), jnp.int32) for k in ("tokens", "targets", "segment_ids", "positions")}
  batch["loss_mask"] = jnp.ones((2, 32), jnp.float32)
  with pytest.raises(jax.errors.JaxRuntimeError, match="xla_k3train_no_such_option"):
    run.step.lower(run.state, batch).compile()
  # A real option compiles and runs: the step's loss is finite.
  ok = builder.build(_one_layer("xla_backend_optimization_level=0"))
  _, metrics = ok.step(ok.state, batch)
  assert jnp.isfinite(metrics["loss"])
