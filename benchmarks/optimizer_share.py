"""Share of the training step spent in the optimizer update (Muon or AdamW), measured in one run.

  python benchmarks/optimizer_share.py --config=configs/k3_tiny.py --config.optim.optimizer=muon \\
      --steps=10

Times (a) the jitted forward + backward alone and (b) the train step a run uses (forward,
backward, optimizer update, QK-Clip, QB bias update; `k3train.train.builder.build`, state
donated) on the same synthetic batch of train.global_batch_size × data.seq_len, after one
warm-up call each; the optimizer share is (b − a) / b. The optimizer is the config's
(optim.optimizer). Prints one JSON line.

  python benchmarks/optimizer_share.py --config=configs/k3_h200.py --config.optim.optimizer=muon \\
      --cost_only

--cost_only measures nothing (no parameters allocated, nothing compiled or run), so a model too
large for the machine still gets an estimate of the optimizer's FLOP share: the optimizer update
(Newton–Schulz and the rest) lowered on the abstract train state (`builder.abstract_state`) and
counted by XLA's static cost analysis, against the model's training FLOPs per step from the
train loop's own formula (`builder.model_size`, from k3train/train/metrics.py: matmuls of the
active parameters, attention and KDA terms; no remat recompute). The model side is not taken
from XLA's count because that counts `ragged_dot` as dense over every expert (64× too much for
k3_h200). On an accelerator the time share also depends on how well the many small
Newton–Schulz matmuls use it, which only the timed mode shows.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from k3train import cli  # noqa: E402

PROG = "python benchmarks/optimizer_share.py"


def define(fv: flags.FlagValues) -> None:
  flags.DEFINE_integer("steps", 10, "timed calls of each program", lower_bound=1, flag_values=fv)
  flags.DEFINE_bool("cost_only", False, "static XLA cost analysis instead of timing",
                    flag_values=fv)


def _machine() -> dict:
  import jax
  return {"host": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
          "jax": jax.__version__}


def static_estimate(cfg) -> dict:
  """Optimizer-update FLOPs (XLA static count) against the model's training FLOPs per step."""
  import jax
  from k3train.optim.optimizer import make_optimizer
  from k3train.train import builder
  state = builder.abstract_state(cfg)
  optimizer = make_optimizer(cfg, state.params)        # the builder's optimizer for these shapes
  lowered = jax.jit(optimizer.update).lower(state.params, state.opt, state.params)  # grads ~ params
  cost = lowered.cost_analysis()
  optimizer_flops = float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])
  size = builder.model_size(cfg)       # the same counts and FLOP formula as the train loop's MFU
  tokens = cfg.train.global_batch_size * cfg.data.seq_len
  model_flops = size.flops_per_token * tokens
  return {"optimizer": cfg.optim.optimizer, "mode": "static estimate (nothing run)",
          "tokens_per_step": tokens, "params_b": round(size.total_params / 1e9, 3),
          "active_params_b": round(size.active_params / 1e9, 3),
          "model_tflop_per_step": round(model_flops / 1e12, 2),
          "optimizer_tflop_per_step": round(optimizer_flops / 1e12, 2),
          "optimizer_flop_share": round(optimizer_flops / (optimizer_flops + model_flops), 4)}


def synthetic_batch(b: int, t: int, vocab: int, seed: int = 0) -> dict:
  """One document per row: every position counts in the loss."""
  import numpy as np
  rng = np.random.default_rng(seed)
  return {"tokens": rng.integers(8, vocab, (b, t), dtype=np.int32),
          "targets": rng.integers(8, vocab, (b, t), dtype=np.int32),
          "segment_ids": np.ones((b, t), np.int32),
          "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(),
          "loss_mask": np.ones((b, t), np.float32)}


def measure(cfg, steps: int) -> dict:
  """Seconds per call of forward + backward alone and of the run's train step."""
  import jax
  from k3train.train import builder
  from k3train.model import moe
  from k3train.train.step import loss_and_grads
  run = builder.build(cfg)
  b, t = cfg.train.global_batch_size, cfg.data.seq_len
  batch = run.layout.global_batch(synthetic_batch(b, t, cfg.model.vocab_size))

  def fwd_bwd(params, rest, x):
    # Traced on the run's mesh and rules and with the step's training routing (QB rounds), as the
    # step's own forward + backward is.
    with run.layout.activate(), moe.qb_training_routing():
      return loss_and_grads(run.graphdef, params, rest, x, cfg.train.microbatches,
                            cfg.train.loss_chunk_tokens)

  grad_only = jax.jit(fwd_bwd)
  jax.block_until_ready(grad_only(run.state.params, run.state.rest, batch))
  start = time.perf_counter()
  for _ in range(steps):
    out = grad_only(run.state.params, run.state.rest, batch)
  jax.block_until_ready(out)
  t_grad = (time.perf_counter() - start) / steps

  state, metrics = run.step(run.state, batch)          # warm-up; the step donates the state
  jax.block_until_ready(metrics)
  start = time.perf_counter()
  for _ in range(steps):
    state, metrics = run.step(state, batch)
  jax.block_until_ready((state, metrics))
  t_step = (time.perf_counter() - start) / steps
  return {"optimizer": cfg.optim.optimizer, "batch": [b, t], "fwd_bwd_s": round(t_grad, 5),
          "train_step_s": round(t_step, 5), "optimizer_share": round((t_step - t_grad) / t_step, 4),
          "device": str(jax.devices()[0].device_kind), "num_devices": jax.device_count()}


def main(argv=None) -> int:
  args = cli.parse(argv, PROG, define=define)
  if args.exit_code is not None:
    return args.exit_code
  from k3train.parallel.mesh import MeshError
  cfg, f = args.config, args.flags
  try:
    result = static_estimate(cfg) if f.cost_only else measure(cfg, f.steps)
  except MeshError as e:
    cli.error(PROG, str(e))
    return cli.USAGE_ERROR
  print(json.dumps({"config": f["config"].config_filename, **result, **_machine()}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
