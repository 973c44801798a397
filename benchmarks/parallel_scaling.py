"""Training-step throughput of a k3_h200-shaped model on 1 GPU and on 2 GPUs with expert or
sequence parallelism (issue 3, item 7). One mesh per process; prints one JSON line.

  python benchmarks/parallel_scaling.py --mesh=""                                  # 1 GPU
  python benchmarks/parallel_scaling.py --mesh=expert=2 --batch=4                   # 2 GPUs, EP
  python benchmarks/parallel_scaling.py --mesh=sequence=2 --rules=long_context      # 2 GPUs, SP
  python benchmarks/parallel_scaling.py --mesh="" --moe-backend=ragged_dot          # vs auto (pallas_gpu)

The model is configs/k3_h200.py cut to `--layers` decoder layers (dense layer, 2 KDA, 1 MLA
prefix; scanned super-blocks; final MLA), AdamW, bf16, full remat, synthetic packed batch.
Reported: seconds per step (median of --steps after 2 warm-up steps), tokens/s and tokens/s per
GPU, peak device memory, compile time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from k3train import config as config_lib  # noqa: E402

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from k3train import config as config_lib  # noqa: E402
from k3train.optim.optimizer import make_optimizer  # noqa: E402
from k3train.train import layout as layout_lib  # noqa: E402


def make_config(args):
  cfg = config_lib.load_file(os.path.join(_REPO, "configs", "k3_h200.py"))
  cfg.model.num_layers = args.layers
  cfg.model.mla_layers = tuple(range(4, args.layers, 4)) + (args.layers,)
  cfg.optim.optimizer = "adamw"
  cfg.data.seq_len = args.seq
  cfg.train.global_batch_size = args.batch
  cfg.parallel.rules = args.rules
  cfg.parallel.expert_exchange = args.exchange
  cfg.model.moe.backend = args.moe_backend
  if args.smoke:   # a CPU-sized stand-in, to check the script itself
    m = cfg.model
    m.vocab_size, m.d_model, m.dense_ffn_hidden, m.dtype = 4096, 128, 256, "float32"
    m.kda.num_heads = m.mla.num_heads = 2
    m.moe.num_experts, m.moe.latent_dim, m.moe.expert_hidden, m.moe.shared_hidden = 8, 64, 64, 128
  for axis in ("data", "expert", "sequence", "tensor"):
    cfg.parallel[axis] = 1
  cfg.parallel.fsdp = -1
  for item in filter(None, args.mesh.split(",")):
    key, value = item.split("=")
    cfg.parallel[key] = int(value)
  return config_lib.validate(cfg)


def packed_batch(b: int, t: int, vocab: int, seed: int = 0):
  """Rows of 4 documents each (segment resets inside chunks and across sequence shards)."""
  rng = np.random.default_rng(seed)
  seg = np.repeat(np.arange(1, 5)[None], b, 0).repeat(t // 4, axis=1).astype(np.int32)
  seg = np.roll(seg, 37, axis=1)
  return {"tokens": rng.integers(8, vocab, (b, t), dtype=np.int32),
          "targets": rng.integers(8, vocab, (b, t), dtype=np.int32),
          "segment_ids": seg, "positions": np.zeros((b, t), np.int32),
          "loss_mask": np.ones((b, t), np.float32)}


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--mesh", default="")
  p.add_argument("--rules", default="default")
  p.add_argument("--layers", type=int, default=9)
  p.add_argument("--seq", type=int, default=4096)
  p.add_argument("--batch", type=int, default=2)
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--exchange", default="auto", help="parallel.expert_exchange")
  p.add_argument("--moe-backend", default="auto",
                 help="model.moe.backend: auto | ragged_dot | pallas_gpu | … (issue 7's step timing)")
  p.add_argument("--smoke", action="store_true", help="tiny widths, for a CPU check of the script")
  args = p.parse_args()
  cfg = make_config(args)
  layout = layout_lib.make_layout(cfg)
  model = layout_lib.build_sharded_model(cfg, layout)
  optimizer = make_optimizer(cfg, nnx.state(model, nnx.Param))
  graphdef, state, shardings = layout_lib.init_sharded_state(model, optimizer, layout)
  del model
  step = layout_lib.jit_train_step(graphdef, optimizer, cfg, layout, shardings)
  batch = layout.global_batch(packed_batch(args.batch, args.seq, cfg.model.vocab_size))
  t0 = time.perf_counter()
  compiled = step.lower(state, batch).compile()
  compile_s = time.perf_counter() - t0
  times, losses = [], []
  for i in range(args.steps + 2):
    t0 = time.perf_counter()
    state, metrics = compiled(state, batch)
    losses.append(float(metrics["loss"]))          # blocks on the step
    if i >= 2:
      times.append(time.perf_counter() - t0)
  step_s = statistics.median(times)
  tokens = args.batch * args.seq
  n = jax.device_count()
  peak = max((d.memory_stats() or {}).get("peak_bytes_in_use", 0) for d in jax.local_devices())
  print(json.dumps({
      "mesh": dict(layout.mesh.shape), "rules": args.rules, "devices": n,
      "device": jax.devices()[0].device_kind, "layers": args.layers, "batch": [args.batch, args.seq],
      "step_s": round(step_s, 4), "tokens_per_s": round(tokens / step_s),
      "tokens_per_s_per_device": round(tokens / step_s / n), "compile_s": round(compile_s, 1),
      "peak_gib": round(peak / 2**30, 2), "losses": [round(l, 4) for l in losses],
      "expert_exchange": cfg.parallel.expert_exchange, "moe_backend": cfg.model.moe.backend,
      "jax": jax.__version__}), flush=True)


if __name__ == "__main__":
  main()
