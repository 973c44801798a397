"""Share of the training step spent in the optimizer update (Muon or AdamW), measured in one run.

  python benchmarks/optimizer_share.py --config=configs/k3_tiny.py --optimizer=muon --steps=10

Times (a) the jitted forward + backward alone and (b) the full jitted train step (forward,
backward, optimizer update, QK-Clip, QB bias update) on the same synthetic batch, after one
warm-up call each; the optimizer share is (b − a) / b. Prints one JSON line.

  python benchmarks/optimizer_share.py --config=configs/k3_h200.py --cost_only

--cost_only measures nothing (no parameters allocated, nothing compiled or run), so a model too
large for the machine still gets an estimate of the optimizer's FLOP share: the optimizer update
(Newton–Schulz and the rest) lowered on abstract inputs and counted by XLA's static cost
analysis, against the model's training FLOPs per step from the train loop's own formula
(`k3train/train/metrics.py`: matmuls of the active parameters, attention and KDA terms; no remat
recompute). The model side is not taken from XLA's count because that counts `ragged_dot` as
dense over every expert (64× too much for k3_h200). On an accelerator the time share also depends on how well the many
small Newton–Schulz matmuls use it, which only the timed mode shows.
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
from k3train.model.decoder import K3Model, build_model  # noqa: E402
from k3train.optim.optimizer import make_optimizer  # noqa: E402
from k3train.model.counting import count  # noqa: E402
from k3train.train import metrics as metrics_lib  # noqa: E402
from k3train.train.step import init_state, loss_and_grads, make_train_step  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/k3_tiny.py", "config file")
_OPTIMIZER = flags.DEFINE_enum("optimizer", "muon", ["muon", "adamw"], "optimizer to time")
_STEPS = flags.DEFINE_integer("steps", 10, "timed calls of each program")
_COST_ONLY = flags.DEFINE_bool("cost_only", False, "static XLA cost analysis instead of timing")


def _time(fn, *args, steps: int) -> float:
  jax.block_until_ready(fn(*args))
  start = time.perf_counter()
  for _ in range(steps):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / steps


def _machine() -> dict:
  return {"host": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
          "jax": jax.__version__}


def _static_estimate(cfg) -> dict:
  """Optimizer-update FLOPs (XLA static count) against the model's training FLOPs per step."""
  model = nnx.eval_shape(lambda: K3Model(cfg.model, rngs=nnx.Rngs(params=0)))
  params = nnx.state(model, nnx.Param)
  optimizer = make_optimizer(cfg, params)
  opt_state = jax.eval_shape(optimizer.init, params)
  lowered = jax.jit(optimizer.update).lower(params, opt_state, params)   # grads shaped as params
  cost = lowered.cost_analysis()
  optimizer_flops = float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])
  counts = count(cfg)          # the same counts and FLOP formula as the train loop's MFU
  flops_per_token = metrics_lib.train_flops_per_token(
      cfg, counts["active_params"], counts["components"].get("embedding", {}).get("params", 0),
      cfg.data.seq_len)
  tokens = cfg.train.global_batch_size * cfg.data.seq_len
  model_flops = flops_per_token * tokens
  return {"config": flags.FLAGS["config"].config_filename, "optimizer": _OPTIMIZER.value,
          "mode": "static estimate (nothing run)", "tokens_per_step": tokens,
          "params_b": round(counts["total_params"] / 1e9, 3),
          "active_params_b": round(counts["active_params"] / 1e9, 3),
          "model_tflop_per_step": round(model_flops / 1e12, 2),
          "optimizer_tflop_per_step": round(optimizer_flops / 1e12, 2),
          "optimizer_flop_share": round(optimizer_flops / (optimizer_flops + model_flops), 4)}


def main(argv):
  del argv
  cfg = _CONFIG.value
  cfg.optim.optimizer = _OPTIMIZER.value
  config_lib.validate(cfg)
  if _COST_ONLY.value:
    print(json.dumps(dict(_static_estimate(cfg), **_machine())))
    return
  model = build_model(cfg.model, seed=0)
  optimizer = make_optimizer(cfg, nnx.state(model, nnx.Param))
  graphdef, state = init_state(model, optimizer)
  b, t = cfg.train.global_batch_size, cfg.data.seq_len
  rng = np.random.default_rng(0)
  batch = {"tokens": jnp.asarray(rng.integers(8, cfg.model.vocab_size, (b, t)), jnp.int32),
           "targets": jnp.asarray(rng.integers(8, cfg.model.vocab_size, (b, t)), jnp.int32),
           "segment_ids": jnp.ones((b, t), jnp.int32), "loss_mask": jnp.ones((b, t), jnp.float32)}
  grad_only = jax.jit(lambda p, r, x: loss_and_grads(graphdef, p, r, x, cfg.train.microbatches))
  step = jax.jit(make_train_step(graphdef, optimizer, qk_clip_tau=cfg.optim.qk_clip_tau,
                                 mla_nope_dim=cfg.model.mla.qk_nope_head_dim,
                                 microbatches=cfg.train.microbatches))
  t_grad = _time(grad_only, state.params, state.rest, batch, steps=_STEPS.value)
  t_step = _time(lambda s, x: step(s, x)[1], state, batch, steps=_STEPS.value)
  print(json.dumps({
      "config": flags.FLAGS["config"].config_filename, "optimizer": _OPTIMIZER.value,
      "batch": [b, t], "fwd_bwd_s": round(t_grad, 5), "train_step_s": round(t_step, 5),
      "optimizer_share": round((t_step - t_grad) / t_step, 4),
      "device": str(jax.devices()[0].device_kind), "num_devices": jax.device_count(),
      **_machine()}))


if __name__ == "__main__":
  app.run(main)
