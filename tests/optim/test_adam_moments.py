"""optim.adam_mu_dtype: the AdamW first moment stored in bfloat16 (the second stays float32).

Both optimizers that carry AdamW leaves honour it (`adamw`, and `muon` for its non-matrix
leaves). Against the float32-moment optimizer over several steps the updates agree to bfloat16
rounding of the moment (relative error ≈ 2⁻⁸ per step, well inside 2 %), and they do differ.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.configs import k3_tiny
from k3train.optim.optimizer import make_optimizer
from k3train.tree_paths import path_names


def _params():
  rng = np.random.default_rng(0)
  return {"embed": {"embedding": jnp.asarray(rng.standard_normal((64, 32)), jnp.float32)},
          "attn_norm": {"scale": jnp.asarray(rng.standard_normal((32,)), jnp.float32)},
          "mixer": {"q_a_proj": {"kernel": jnp.asarray(rng.standard_normal((32, 48)),
                                                       jnp.float32)}}}


def _run(optimizer: str, mu_dtype: str, steps: int = 6):
  cfg = k3_tiny.get_config()
  cfg.optim.optimizer, cfg.optim.adam_mu_dtype = optimizer, mu_dtype
  cfg.optim.warmup_steps, cfg.optim.muon_ns_dtype = 0, "float32"
  params = _params()
  tx = make_optimizer(cfg, params)
  state, update = tx.init(params), jax.jit(tx.update)
  rng = np.random.default_rng(1)
  updates = []
  for _ in range(steps):
    grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), params)
    upd, state = update(grads, state, params)
    updates.append(upd)
  return updates, state


def _moment_dtypes(state) -> dict[str, set]:
  """{'mu' / 'nu': dtypes of those leaves} over the optimizer state."""
  out = {"mu": set(), "nu": set()}
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    names = path_names(path)
    for key in out:
      if key in names:
        out[key].add(jnp.dtype(leaf.dtype))
  return out


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_bf16_first_moment(optimizer):
  ref_updates, ref_state = _run(optimizer, "float32")
  updates, state = _run(optimizer, "bfloat16")
  assert _moment_dtypes(ref_state) == {"mu": {jnp.dtype(jnp.float32)},
                                       "nu": {jnp.dtype(jnp.float32)}}
  got = _moment_dtypes(state)
  assert got["nu"] == {jnp.dtype(jnp.float32)}
  # adamw: every mu is bf16; muon: the AdamW leaves' mu is bf16, Muon's momentum keeps its own.
  assert jnp.dtype(jnp.bfloat16) in got["mu"]
  if optimizer == "adamw":
    assert got["mu"] == {jnp.dtype(jnp.bfloat16)}
  differs = False
  for ref_step, step in zip(ref_updates, updates):
    for (path, want), have in zip(jax.tree_util.tree_flatten_with_path(ref_step)[0],
                                  jax.tree.leaves(step)):
      want, have = np.asarray(want, np.float64), np.asarray(have, np.float64)
      scale = np.max(np.abs(want))
      np.testing.assert_allclose(have, want, atol=2e-2 * scale, rtol=0,
                                 err_msg=".".join(path_names(path)))
      differs |= bool(np.any(have != want))
  assert differs


def test_unknown_mu_dtype_is_rejected():
  from k3train import config as config_lib
  cfg = k3_tiny.get_config()
  cfg.optim.adam_mu_dtype = "float16"
  with pytest.raises(ValueError, match="optim.adam_mu_dtype"):
    config_lib.validate(cfg)
