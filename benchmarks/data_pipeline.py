"""Input-pipeline throughput per host: text tokens/s and images/s, vs. one H200's consumption.

  python benchmarks/data_pipeline.py [--seconds 20] [--workers 0 2]

Text: the embedded stdlib corpus and synthetic text, seq_len 4096, per-host batch 8, tokenized
by the shipped BPE and packed (the same pipeline the trainer uses). Images: synthetic
image-caption documents (16 pre-encoded JPEG/PNG of 200–900 px, decoded, resized to multiples
of 28 px, patchified) with data.vision.enabled. Each configuration runs with data.num_workers = 0
(in-process, data.num_threads reader threads) and with grain mp_prefetch worker processes.

Consumption: tokens/s one H200 trains k3_h200 at an assumed 40 % MFU of 989 TFLOP/s (dense
bf16), from k3train.train.metrics' FLOPs-per-token formula. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from k3train import config as config_lib  # noqa: E402

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from k3train.data import pipeline  # noqa: E402
from k3train.model.counting import count  # noqa: E402
from k3train.train import metrics as metrics_lib  # noqa: E402

MFU = 0.40
PEAK = 989e12


def h200_tokens_per_s() -> tuple[float, float]:
  cfg = config_lib.load_file(os.path.join(_REPO, "configs", "k3_h200.py"))
  c = count(cfg)
  fpt = metrics_lib.train_flops_per_token(cfg, c["active_params"],
                                          c["components"].get("embedding", {}).get("params", 0),
                                          cfg.data.seq_len)
  return MFU * PEAK / fpt, fpt


def measure(sources, *, workers: int, threads: int, vision: bool, seconds: float, batch: int = 8):
  cfg = config_lib.load_file(os.path.join(_REPO, "configs", "k3_full.py")).data
  cfg.sources, cfg.weights = tuple(sources), tuple(1.0 for _ in sources)
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


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--seconds", type=float, default=20.0)
  ap.add_argument("--workers", type=int, nargs="+", default=[0, 2])
  args = ap.parse_args()
  consume, fpt = h200_tokens_per_s()
  print(f"k3_h200: {fpt:.3g} training FLOPs/token -> {consume:,.0f} tokens/s per H200 at "
        f"{MFU:.0%} MFU of {PEAK / 1e12:.0f} TFLOP/s; goal >= 3x = {3 * consume:,.0f} tokens/s\n")
  print("| source | workers | threads | tokens/s | images/s | padding | headroom vs 1 H200 |")
  print("|---|---|---|---|---|---|---|")
  for name, srcs, vision in [("python_stdlib", ["python_stdlib"], False),
                             ("synthetic_text", ["synthetic_text"], False),
                             ("synthetic_images", ["synthetic_images"], True)]:
    for w in args.workers:
      threads = 2 if w == 0 else 1
      r = measure(srcs, workers=w, threads=threads, vision=vision, seconds=args.seconds)
      print(f"| {name} | {w} | {threads} | {r['tokens_per_s']:,.0f} | {r['images_per_s']:,.1f} | "
            f"{r['padding']:.3f} | {r['tokens_per_s'] / consume:.1f}x |", flush=True)


if __name__ == "__main__":
  main()
