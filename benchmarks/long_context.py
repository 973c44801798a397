"""Forward + backward of a k3_h200-shaped slice at long context on one device; one JSON line.

  python benchmarks/long_context.py --config=configs/k3_h200.py --config.data.seq_len=131072
  python benchmarks/long_context.py --config=configs/k3_h200.py --config.data.seq_len=1048576

The slice is the config's model cut to five decoder layers: the dense first layer (KDA), three
KDA layers and one MLA layer, each with its Block-AttnRes mixes, the last four with the latent MoE;
model.dtype and model.remat_policy as configured (k3_h200: bf16, selective remat; the records in
long_context.md used full remat: add --config.model.remat_policy=full to repeat them). Batch 1 of
data.seq_len tokens in `--documents` equal documents. The loss is the mean square of the final
AttnRes mix (no LM head: a [T, 163,840] logit array would dwarf the slice at these lengths), so
the timed program is the layers' forward and the gradient of every parameter. MLA runs through
the attention op's `auto` backend.

Reported: seconds per forward+backward (median of --steps after one warm-up), compile seconds,
peak device memory (bytes in use as the device reports it), tokens/s.

CPU check of the script: `--config=configs/k3_tiny.py --config.data.seq_len=512 --steps=1`.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROG = "python benchmarks/long_context.py"


def _define(fv) -> None:
  from absl import flags
  flags.DEFINE_integer("documents", 8, "documents per row (equal lengths)", lower_bound=1,
                       flag_values=fv)
  flags.DEFINE_integer("steps", 3, "timed steps after one warm-up", lower_bound=1, flag_values=fv)


def slice_config(cfg):
  """The five-layer slice: dense KDA layer, three KDA layers, one MLA layer (unscanned)."""
  cfg = cfg.copy_and_resolve_references()
  m = cfg.model
  m.num_layers, m.mla_layers, m.num_dense_layers = 5, (5,), 1
  return cfg


def main(argv=None) -> int:
  from k3train import cli
  args = cli.parse(argv, PROG, define=_define)
  if args.exit_code is not None:
    return args.exit_code
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx
  from k3train import config as config_lib
  from k3train.model.decoder import build_model

  cfg = config_lib.validate(slice_config(args.config))
  t, docs = cfg.data.seq_len, args.flags.documents
  model = build_model(cfg.model, seed=0)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  del model
  tokens = jnp.asarray(np.random.default_rng(0).integers(3, cfg.model.vocab_size, (1, t)), jnp.int32)
  seg = jnp.asarray((np.arange(t) * docs // t + 1)[None], jnp.int32)

  def loss_fn(params, tokens, seg):   # the batch is an argument: no constant folding of it
    m = nnx.merge(graphdef, params, rest, copy=True)
    h = m.hidden_states(tokens, seg)
    return jnp.mean(jnp.square(h.astype(jnp.float32)))

  step = jax.jit(jax.value_and_grad(loss_fn))
  t0 = time.perf_counter()
  compiled = step.lower(params, tokens, seg).compile()
  compile_s = time.perf_counter() - t0
  jax.block_until_ready(compiled(params, tokens, seg))
  times = []
  for _ in range(args.flags.steps):
    t0 = time.perf_counter()
    loss, grads = compiled(params, tokens, seg)
    jax.block_until_ready((loss, grads))
    times.append(time.perf_counter() - t0)
  stats = jax.devices()[0].memory_stats() or {}
  memory = compiled.memory_analysis()
  step_s = statistics.median(times)
  print(json.dumps({
      "seq_len": t, "documents": docs, "device": jax.devices()[0].device_kind,
      "jax": jax.__version__, "mla_backend": cfg.model.mla.backend,
      "kda_backend": cfg.model.kda.backend, "moe_backend": cfg.model.moe.backend,
      "step_s": round(step_s, 4), "tokens_per_s": round(t / step_s, 1),
      "compile_s": round(compile_s, 1), "loss": float(loss),
      "peak_bytes": stats.get("peak_bytes_in_use"),
      "xla_temp_gib": round(memory.temp_size_in_bytes / 2**30, 2) if memory else None,
      "peak_gib": round(stats["peak_bytes_in_use"] / 2**30, 2) if "peak_bytes_in_use" in stats else None,
  }), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
