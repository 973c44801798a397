"""Training-step throughput on 1 GPU and on 2 GPUs with expert or sequence parallelism. One mesh
per process; prints one JSON line.

  B="--config=configs/k3_h200.py --config.optim.optimizer=adamw --config.train.microbatches=1"
  python benchmarks/parallel_scaling.py $B --config.parallel.rules=default \\
      --config.train.global_batch_size=2                                           # 1 GPU
  python benchmarks/parallel_scaling.py $B --config.parallel.rules=default \\
      --config.train.global_batch_size=4 --config.parallel.expert=2                # 2 GPUs, EP
  python benchmarks/parallel_scaling.py $B --config.parallel.rules=long_context \\
      --config.train.global_batch_size=2 --config.parallel.sequence=2              # 2 GPUs, SP
  python benchmarks/parallel_scaling.py $B --config.parallel.rules=default \\
      --config.train.global_batch_size=2 --config.model.moe.backend=ragged_dot     # vs auto

(AdamW, batch 2 or 4 without micro-batches and these rules are the settings of the runs in
parallel_scaling.md.)

The run is the config's (model, optimizer, mesh and rules from `parallel`, batch
train.global_batch_size × data.seq_len), built by `k3train.train.builder.build` exactly as the
train loop builds it, with the model cut to `--layers` decoder layers (dense prefix, MLA every 4th
layer and the last; 0 keeps the config's depth). The batch is synthetic and packed, 4 documents
per row. `--smoke` shrinks the widths to check the script on a CPU:

  python benchmarks/parallel_scaling.py --config=configs/k3_h200.py --smoke --steps=1 \\
      --config.data.seq_len=256 --config.optim.optimizer=adamw --config.train.global_batch_size=2 \\
      --config.train.microbatches=1

Reported: seconds per step (median of --steps after 2 warm-up steps), tokens/s and tokens/s per
device, peak device memory, compile time.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import numpy as np
from absl import flags
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from k3train import cli  # noqa: E402
from k3train import config as config_lib  # noqa: E402

PROG = "python benchmarks/parallel_scaling.py"


def define(fv: flags.FlagValues) -> None:
  flags.DEFINE_integer("layers", 9, "cut the model to this many decoder layers (MLA every 4th and "
                       "the last); 0 keeps the config's model.num_layers", lower_bound=0,
                       flag_values=fv)
  flags.DEFINE_integer("steps", 5, "timed steps (after 2 warm-up steps)", lower_bound=1,
                       flag_values=fv)
  flags.DEFINE_bool("smoke", False, "tiny widths, for a CPU check of the script", flag_values=fv)


def shape_config(cfg, fv: flags.FlagValues):
  """The config with the benchmark's cuts applied (`--layers`, `--smoke`), validated again."""
  overridden = config_flags.get_override_values(fv["config"])
  if fv.layers:
    given = sorted(k for k in overridden if k in ("model.num_layers", "model.mla_layers"))
    if given:
      raise config_lib.ConfigError(f"--layers={fv.layers} and --config.{given[0]} both set the "
                                   "depth; pass --layers=0 to keep the config's")
    cfg.model.num_layers = fv.layers
    cfg.model.mla_layers = tuple(range(4, fv.layers, 4)) + (fv.layers,)
  if fv.smoke:
    m = cfg.model
    m.vocab_size, m.d_model, m.dense_ffn_hidden, m.dtype = 4096, 128, 256, "float32"
    m.kda.num_heads = m.mla.num_heads = 2
    m.moe.num_experts, m.moe.latent_dim, m.moe.expert_hidden, m.moe.shared_hidden = 8, 64, 64, 128
  return config_lib.validate(cfg)


def packed_batch(b: int, t: int, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
  """Rows of 4 documents each (segment resets inside chunks and across sequence shards)."""
  rng = np.random.default_rng(seed)
  seg = np.repeat(np.arange(1, 5)[None], b, 0).repeat(t // 4, axis=1).astype(np.int32)
  seg = np.roll(seg, 37, axis=1)
  return {"tokens": rng.integers(8, vocab, (b, t), dtype=np.int32),
          "targets": rng.integers(8, vocab, (b, t), dtype=np.int32),
          "segment_ids": seg, "positions": np.zeros((b, t), np.int32),
          "loss_mask": np.ones((b, t), np.float32)}


def main(argv=None) -> int:
  args = cli.parse(argv, PROG, define=define)
  if args.exit_code is not None:
    return args.exit_code
  try:
    cfg = shape_config(args.config, args.flags)
  except config_lib.ConfigError as e:
    cli.error(PROG, f"config error: {e}")
    return cli.USAGE_ERROR
  import jax                                        # after the flags: the backend starts here
  from k3train.parallel.mesh import MeshError
  from k3train.train import builder
  steps = args.flags.steps
  try:
    run = builder.build(cfg)
  except MeshError as e:
    cli.error(PROG, str(e))
    return cli.USAGE_ERROR
  b, t = cfg.train.global_batch_size, cfg.data.seq_len
  batch = run.layout.global_batch(packed_batch(b, t, cfg.model.vocab_size))
  t0 = time.perf_counter()
  compiled = run.step.lower(run.state, batch).compile()
  compile_s = time.perf_counter() - t0
  state, times, losses = run.state, [], []
  for i in range(steps + 2):
    t0 = time.perf_counter()
    state, metrics = compiled(state, batch)
    losses.append(float(metrics["loss"]))          # blocks on the step
    if i >= 2:
      times.append(time.perf_counter() - t0)
  step_s = statistics.median(times)
  tokens = b * t
  n = jax.device_count()
  peak = max((d.memory_stats() or {}).get("peak_bytes_in_use", 0) for d in jax.local_devices())
  print(json.dumps({
      "config": args.flags["config"].config_filename, "mesh": dict(run.layout.mesh.shape),
      "rules": cfg.parallel.rules, "devices": n, "device": jax.devices()[0].device_kind,
      "layers": cfg.model.num_layers, "optimizer": cfg.optim.optimizer, "batch": [b, t],
      "step_s": round(step_s, 4), "tokens_per_s": round(tokens / step_s),
      "tokens_per_s_per_device": round(tokens / step_s / n), "compile_s": round(compile_s, 1),
      "peak_gib": round(peak / 2**30, 2), "losses": [round(l, 4) for l in losses],
      "expert_exchange": cfg.parallel.expert_exchange, "moe_backend": cfg.model.moe.backend,
      "smoke": args.flags.smoke, "jax": jax.__version__}), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
