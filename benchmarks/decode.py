"""Prefill and greedy decoding throughput of the config's model, random-initialised, through the
cached decode path that `python -m k3train.tools.generate` runs; one JSON line per batch size.

  python benchmarks/decode.py --config=configs/k3_h200.py --batch=1,32 --prompt_len=128 \
      --new_tokens=64

The model is built directly (`decoder.build_model`, one jitted initialisation; no checkpoint) and
wrapped in `decode.Decoder` with max_len = prompt_len + new_tokens: `Decoder.prefill` runs the
prompt and fills the KDA recurrent state / conv history and the MLA latent cache, then each
`Decoder.step` feeds one token per row, the next token being `decode.sample` at temperature 0
(greedy), jitted apart, as `tools/generate.py` does. One Decoder serves every batch size (each
size compiles its own programs). Prompts are random token ids, one document per row.

Per batch size:
  prefill  the first call (tracing, compiling and running) is timed on its own; then
           --prefill_repeats calls, each blocked on its logits; prefill tokens/s = batch ×
           prompt_len / their median. prefill_compile_s = first call − that median.
  decode   new_tokens − 1 steps after the prefill's token (the prefill's logits give that one);
           each step is timed from its dispatch to its greedy token being ready (the step's own
           host read of the cache length included, as in generate). The first step compiles and
           is reported apart (decode_compile_s = first step − median step); decode tokens/s =
           batch × steady steps / their summed time.
Each batch size is measured inside its own try: an error is printed in its JSON line and the
next size runs. The weights are the config's (model.param_dtype: fp32 by default; override with
--config.model.param_dtype=bfloat16 to decode from bf16 weights).
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

PROG = "python benchmarks/decode.py"


def define(fv: flags.FlagValues) -> None:
  flags.DEFINE_list("batch", ["1", "32"], "batch sizes (rows decoded together), comma-separated",
                    flag_values=fv)
  flags.DEFINE_integer("prompt_len", 128, "prompt tokens per row", lower_bound=1, flag_values=fv)
  flags.DEFINE_integer("new_tokens", 64, "tokens generated per row (the first from the prefill; "
                       "at least 3, so that one steady decode step remains)", lower_bound=3,
                       flag_values=fv)
  flags.DEFINE_integer("prefill_repeats", 3, "timed prefill calls after the first",
                       lower_bound=1, flag_values=fv)
  flags.DEFINE_integer("seed", 0, "seed of the prompts (the weights use train.seed)",
                       flag_values=fv)


def one_line(e: BaseException) -> str:
  text = " ".join(str(e).split())
  return f"{type(e).__name__}: {text}"[:300]


def memory() -> dict:
  import jax
  stats = jax.devices()[0].memory_stats() or {}
  if not stats:
    return {}
  return {"peak_gib": round(stats.get("peak_bytes_in_use", 0) / 2**30, 2),
          "limit_gib": round(stats.get("bytes_limit", 0) / 2**30, 2)}


def measure(decoder, pick, vocab: int, batch: int, fv) -> dict:
  import jax
  import numpy as np
  rng = np.random.default_rng(fv.seed + batch)
  tokens = rng.integers(0, vocab, (batch, fv.prompt_len)).astype(np.int32)
  key = jax.random.key(fv.seed)

  t0 = time.perf_counter()
  logits, cache = decoder.prefill(tokens)
  jax.block_until_ready(logits)
  prefill_first = time.perf_counter() - t0
  prefill_times = []
  for _ in range(fv.prefill_repeats):
    del logits, cache
    t0 = time.perf_counter()
    logits, cache = decoder.prefill(tokens)
    jax.block_until_ready(logits)
    prefill_times.append(time.perf_counter() - t0)
  prefill_s = float(np.median(prefill_times))

  nxt = pick(logits[:, -1], key)
  out = [nxt]
  times = []
  for _ in range(fv.new_tokens - 1):
    t0 = time.perf_counter()
    logits, cache = decoder.step(nxt, cache)
    nxt = pick(logits, key)
    jax.block_until_ready(nxt)
    times.append(time.perf_counter() - t0)
    out.append(nxt)
  steady = times[1:]
  step_s = float(np.median(steady))
  ids = np.stack([np.asarray(t) for t in out], axis=1)
  prefill_tokens = batch * fv.prompt_len
  return {"batch": batch, "prompt_len": fv.prompt_len, "new_tokens": fv.new_tokens,
          "max_len": decoder.max_len,
          "prefill_s": round(prefill_s, 5), "prefill_s_min": round(min(prefill_times), 5),
          "prefill_tokens": prefill_tokens,
          "prefill_tokens_per_s": round(prefill_tokens / prefill_s, 1),
          "prefill_first_s": round(prefill_first, 3),
          "prefill_compile_s": round(prefill_first - prefill_s, 3),
          "decode_steps_timed": len(steady), "decode_step_ms": round(1e3 * step_s, 3),
          "decode_step_ms_min": round(1e3 * min(steady), 3),
          "decode_step_ms_p90": round(1e3 * float(np.percentile(steady, 90)), 3),
          "decode_tokens_per_s": round(batch * len(steady) / sum(steady), 1),
          "decode_first_step_s": round(times[0], 3),
          "decode_compile_s": round(times[0] - step_s, 3),
          "cache_length": int(cache.length),
          "row0_first_ids": [int(i) for i in ids[0, :8]], **memory()}


def main(argv=None) -> int:
  args = cli.parse(argv, PROG, define=define, config_required=True)
  if args.exit_code is not None:
    return args.exit_code
  fv = args.flags
  try:
    batches = [int(b) for b in fv.batch]
    if not batches or min(batches) < 1:
      raise ValueError
  except ValueError:
    cli.error(PROG, f"--batch must be positive integers separated by commas, got {fv.batch}")
    return cli.USAGE_ERROR
  import jax
  from flax import nnx
  from k3train.model import decode
  from k3train.model.decoder import build_model
  cfg = args.config
  env = {"device": jax.devices()[0].device_kind, "devices": jax.device_count(),
         "jax": jax.__version__, "python": platform.python_version(),
         "date": time.strftime("%Y-%m-%d"), "param_dtype": cfg.model.param_dtype,
         "dtype": cfg.model.dtype}
  rows = []
  try:
    t0 = time.perf_counter()
    model = build_model(cfg.model, seed=cfg.train.seed)
    decoder = decode.Decoder(model, max_len=fv.prompt_len + fv.new_tokens)
    jax.block_until_ready(decoder.state)
    env["model_init_s"] = round(time.perf_counter() - t0, 2)
    env["params"] = int(sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))))
    del model
    pick = jax.jit(lambda logits, k: decode.sample(logits, k, temperature=0.0))
  except Exception as e:                                      # noqa: BLE001
    row = {"batch": None, "error": f"model: {one_line(e)}", **env}
    print(json.dumps(row), flush=True)
    return 1
  for batch in batches:
    try:
      row = measure(decoder, pick, cfg.model.vocab_size, batch, fv)
    except Exception as e:                                    # noqa: BLE001
      row = {"batch": batch, "error": one_line(e), **memory()}
    row.update(env)
    rows.append(row)
    print(json.dumps(row), flush=True)
  print(f"{'batch':>5} {'prefill tok/s':>13} {'prefill ms':>10} {'decode tok/s':>12} "
        f"{'step ms':>8} {'compile s (prefill + step)':>26}")
  for r in rows:
    if "error" in r:
      print(f"{r['batch']:>5} error: {r['error'][:100]}")
      continue
    print(f"{r['batch']:>5} {r['prefill_tokens_per_s']:>13.0f} {1e3 * r['prefill_s']:>10.2f} "
          f"{r['decode_tokens_per_s']:>12.1f} {r['decode_step_ms']:>8.2f} "
          f"{r['prefill_compile_s']:>12.1f} + {r['decode_compile_s']:.1f}")
  return 0 if rows and all("error" not in r for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
