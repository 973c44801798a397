"""Share of the training step spent in the optimizer update (Muon or AdamW), measured in one run.

  python benchmarks/optimizer_share.py --config=configs/k3_tiny.py --optimizer=muon --steps=10

Times (a) the jitted forward + backward alone and (b) the full jitted train step (forward,
backward, optimizer update, QK-Clip, QB bias update) on the same synthetic batch, after one
warm-up call each; the optimizer share is (b − a) / b. Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from k3train import config as config_lib  # noqa: E402
from k3train.model.decoder import build_model  # noqa: E402
from k3train.optim.optimizer import make_optimizer  # noqa: E402
from k3train.train.step import forward_loss, init_state, make_train_step  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/k3_tiny.py", "config file")
_OPTIMIZER = flags.DEFINE_enum("optimizer", "muon", ["muon", "adamw"], "optimizer to time")
_STEPS = flags.DEFINE_integer("steps", 10, "timed calls of each program")


def _time(fn, *args, steps: int) -> float:
  jax.block_until_ready(fn(*args))
  start = time.perf_counter()
  for _ in range(steps):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / steps


def main(argv):
  del argv
  cfg = _CONFIG.value
  cfg.optim.optimizer = _OPTIMIZER.value
  config_lib.validate(cfg)
  model = build_model(cfg.model, seed=0)
  optimizer = make_optimizer(cfg, nnx.state(model, nnx.Param))
  graphdef, state = init_state(model, optimizer)
  b, t = cfg.train.global_batch_size, cfg.data.seq_len
  rng = np.random.default_rng(0)
  batch = {"tokens": jnp.asarray(rng.integers(8, cfg.model.vocab_size, (b, t)), jnp.int32),
           "targets": jnp.asarray(rng.integers(8, cfg.model.vocab_size, (b, t)), jnp.int32),
           "segment_ids": jnp.ones((b, t), jnp.int32), "loss_mask": jnp.ones((b, t), jnp.float32)}
  grad_only = jax.jit(jax.value_and_grad(lambda p, r, x: forward_loss(graphdef, p, r, x)[0]))
  step = jax.jit(make_train_step(graphdef, optimizer, qk_clip_tau=cfg.optim.qk_clip_tau,
                                 mla_nope_dim=cfg.model.mla.qk_nope_head_dim))
  t_grad = _time(grad_only, state.params, state.rest, batch, steps=_STEPS.value)
  t_step = _time(lambda s, x: step(s, x)[1], state, batch, steps=_STEPS.value)
  print(json.dumps({
      "config": flags.FLAGS["config"].config_filename, "optimizer": _OPTIMIZER.value,
      "batch": [b, t], "fwd_bwd_s": round(t_grad, 5), "train_step_s": round(t_step, 5),
      "optimizer_share": round((t_step - t_grad) / t_step, 4),
      "device": str(jax.devices()[0].device_kind), "num_devices": jax.device_count(),
      "host": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
      "jax": jax.__version__}))


if __name__ == "__main__":
  app.run(main)
