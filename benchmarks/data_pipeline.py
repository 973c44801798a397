"""Input-pipeline throughput per host: text tokens/s and images/s, against one device's
consumption.

  python benchmarks/data_pipeline.py --config=configs/k3_h200.py [--seconds=20] [--workers=0,2]

The pipeline is the trainer's own (`k3train.data.pipeline`) with the config's `data` section
(tokenizer, seq_len, vision limits), per-host batch 8. Sources: the embedded stdlib corpus,
synthetic text, and synthetic image-caption documents (16 pre-encoded JPEG/PNG of 200–900 px,
decoded, resized to multiples of 28 px, patchified) with data.vision.enabled. Each source runs
with each `--workers` count as data.num_workers: 0 is in-process with 2 reader threads
(data.num_threads), more is grain mp_prefetch worker processes with 1 thread each.

Consumption: tokens/s one device trains the config's model at an assumed 40 % MFU of
train.peak_flops_per_device, or when that is 0 of an H200's dense bf16 peak (989 TFLOP/s, the
train loop's device-kind table), from the train loop's
FLOPs-per-token formula (`builder.model_size`). Prints a markdown table.
"""

from __future__ import annotations

import os
import sys
import time

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from k3train import cli  # noqa: E402

PROG = "python benchmarks/data_pipeline.py"
MFU = 0.40
BATCH_PER_HOST = 8
SOURCES = [("python_stdlib", False), ("synthetic_text", False), ("synthetic_images", True)]


def define(fv: flags.FlagValues) -> None:
  flags.DEFINE_float("seconds", 20.0, "measured seconds per row of the table", lower_bound=0.0,
                     flag_values=fv)
  flags.DEFINE_list("workers", ["0", "2"], "data.num_workers values to measure (comma-separated; "
                    "0 = in-process)", flag_values=fv)


def device_tokens_per_s(cfg) -> tuple[float, float]:
  """(tokens/s one device trains at MFU, training FLOPs per token)."""
  from k3train.train import builder
  fpt = builder.model_size(cfg).flops_per_token
  return MFU * _peak(cfg) / fpt, fpt


def _peak(cfg) -> float:
  """The config's peak, or an H200's (the device the consumption is quoted for)."""
  from k3train.train import metrics
  return metrics.peak_flops_per_device(cfg.train.peak_flops_per_device, "NVIDIA H200")


def measure(data_cfg, source: str, *, workers: int, threads: int, vision: bool, seconds: float,
            batch: int = BATCH_PER_HOST) -> dict:
  from k3train.data import pipeline
  cfg = data_cfg.copy_and_resolve_references()
  cfg.sources, cfg.weights = (source,), (1.0,)
  cfg.num_workers, cfg.num_threads, cfg.vision.enabled = workers, threads, vision
  it = pipeline.make_iterator(cfg, batch_size=batch, seed=0)
  try:
    next(it)  # start-up (worker processes, first documents) is not counted
    start, n, tokens, images, pad = time.perf_counter(), 0, 0, 0, 0.0
    while time.perf_counter() - start < seconds:
      b = next(it)
      n += 1
      tokens += int((b["segment_ids"] > 0).sum())
      pad += pipeline.padding_fraction(b)
      if vision:
        images += int((b["vision_grids"].prod(-1) > 0).sum())
    dt = time.perf_counter() - start
    return {"batches": n, "tokens_per_s": tokens / dt, "images_per_s": images / dt,
            "padding": pad / max(n, 1)}
  finally:
    it.close()


def main(argv=None) -> int:
  args = cli.parse(argv, PROG, define=define)
  if args.exit_code is not None:
    return args.exit_code
  cfg, f = args.config, args.flags
  try:
    workers = [int(w) for w in f.workers]
    if any(w < 0 for w in workers):
      raise ValueError
  except ValueError:
    cli.error(PROG, f"--workers must be non-negative integers, got {','.join(f.workers)}")
    return cli.USAGE_ERROR
  consume, fpt = device_tokens_per_s(cfg)
  peak = _peak(cfg)
  print(f"{f['config'].config_filename}: {fpt:.3g} training FLOPs/token -> {consume:,.0f} "
        f"tokens/s per device at {MFU:.0%} MFU of {peak / 1e12:.0f} TFLOP/s; goal >= 3x = "
        f"{3 * consume:,.0f} tokens/s\n")
  print("| source | workers | threads | tokens/s | images/s | padding | headroom vs 1 device |")
  print("|---|---|---|---|---|---|---|")
  for source, vision in SOURCES:
    for w in workers:
      threads = 2 if w == 0 else 1
      r = measure(cfg.data, source, workers=w, threads=threads, vision=vision, seconds=f.seconds)
      print(f"| {source} | {w} | {threads} | {r['tokens_per_s']:,.0f} | {r['images_per_s']:,.1f} | "
            f"{r['padding']:.3f} | {r['tokens_per_s'] / consume:.1f}x |", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
