"""Parameter keys: `layers.next_params_key` draws what `rngs.params()` draws, and building a model
under a trace no longer formats jax error messages per parameter (which made model
construction quadratic in the parameter count)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax._src.interpreters import partial_eval

from k3train.model import decoder, layers
from tests.configs import k3_tiny


def _keys(draw, seed: int, n: int):
  rngs = nnx.Rngs(params=seed)
  return jnp.stack([jax.random.key_data(draw(rngs)) for _ in range(n)])


def test_next_params_key_draws_the_rngs_sequence():
  ours = _keys(layers.next_params_key, 7, 5)
  flax_own = _keys(lambda r: r.params(), 7, 5)
  np.testing.assert_array_equal(ours, flax_own)
  assert len({tuple(np.asarray(k).ravel()) for k in ours}) == 5      # every draw differs


def test_next_params_key_draws_the_rngs_sequence_under_jit():
  ours = jax.jit(lambda: _keys(layers.next_params_key, 3, 4))()
  np.testing.assert_array_equal(ours, _keys(lambda r: r.params(), 3, 4))


def test_model_parameters_are_flax_draws():
  """The tiny model's parameters equal those of a model built with flax's own draws."""
  cfg = k3_tiny.get_config().model
  ours = nnx.state(decoder.build_model(cfg, seed=1), nnx.Param)
  original = layers.next_params_key
  try:
    layers.next_params_key = lambda rngs: rngs.params()
    flax_own = nnx.state(decoder.build_model(cfg, seed=1), nnx.Param)
  finally:
    layers.next_params_key = original
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(flax_own)):
    np.testing.assert_array_equal(a, b)


def test_abstract_model_formats_no_tracer_error_messages(monkeypatch):
  """Each message walks every equation traced so far: one per parameter was quadratic. (A
  scanned stack's `nnx.split_rngs` still formats one per stack; unrolled layers none.)"""
  calls = []
  original = partial_eval.DynamicJaxprTracer._origin_msg

  def counting(self):
    calls.append(1)
    return original(self)

  monkeypatch.setattr(partial_eval.DynamicJaxprTracer, "_origin_msg", counting)
  cfg = k3_tiny.get_config().model
  cfg.scan_layers = False           # unrolled: every parameter drawn one by one
  model = decoder.abstract_model(cfg)
  assert len(jax.tree.leaves(nnx.state(model, nnx.Param))) > 50
  assert not calls
