"""The repository's config files, loaded by path (configs/ is not an installed package)."""

import pathlib

from k3train import config as config_lib

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[1] / "configs"

k3_full = config_lib.load_module(CONFIG_DIR / "k3_full.py")
k3_tiny = config_lib.load_module(CONFIG_DIR / "k3_tiny.py")
k3_h200 = config_lib.load_module(CONFIG_DIR / "k3_h200.py")

# k3_tiny's text stack cut to four layers that still hold every kind and the scan: layer 1 KDA +
# dense FFN, layer 2 MLA + MoE (the unscanned prefix), then one scanned super-block [KDA + MoE,
# MLA + MoE]. On 2 CPU cores its step compiles in ~40 % of k3_tiny's time (41 s against 95 s)
# and runs in ~30 % (155 ms against 585 ms): the loop, checkpoint and sharding tests use it.
QUICK_MODEL = {"model.num_layers": 4, "model.mla_layers": (2, 4), "model.attn_res.block_size": 2}


def quick(cfg):
  """cfg (a k3_tiny-based config) with QUICK_MODEL applied in place; returns cfg."""
  for dotted, value in QUICK_MODEL.items():
    *parents, key = dotted.split(".")
    node = cfg
    for name in parents:
      node = node[name]
    node[key] = value
  return cfg


def quick_flags() -> list[str]:
  """QUICK_MODEL as command-line overrides for `python -m k3train.main --config=configs/k3_tiny.py`."""
  return [f"--config.{dotted}={value}" for dotted, value in QUICK_MODEL.items()]


def one_layer_tiny(seq_len: int, global_batch_size: int):
  """k3_tiny cut to one MLA layer with the dense FFN and no MTP head, at the given batch and
  sequence length (not validated: callers set more keys first)."""
  cfg = k3_tiny.get_config()
  cfg.model.num_layers = 1
  cfg.model.mla_layers = (1,)
  cfg.model.mtp.enabled = False
  cfg.data.seq_len = seq_len
  cfg.train.global_batch_size = global_batch_size
  return cfg
