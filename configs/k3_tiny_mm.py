"""k3_tiny with a tiny MoonViT-V2 tower: images, video chunks and text trained jointly on a CPU.

The text model is k3_tiny's; the tower keeps every K3 piece (patch embedding, interpolated
position table, time embedding, 2D RoPE, grid-local attention, sd2_tpool, PatchMergerMLPV2) at a
width of 32. Data: synthetic captioned images mixed 1:1 with synthetic text; small images
(≤ 64 patches, ≤ 16 placeholders) so several fit one 129-token row.
"""

import os

from k3train import config as config_lib


def get_config():
  c = config_lib.load_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "k3_tiny.py"))
  w = c.model.vision
  w.enabled = True
  w.num_layers = 2
  w.d_model = 32
  w.num_heads = 2
  w.head_dim = 16
  w.mlp_hidden = 64
  w.pos_height = 16
  w.pos_width = 16

  v = c.data.vision
  v.enabled = True
  v.max_patches = 64                       # ≤ 16 placeholders per image
  v.max_video_frame_patches = 16           # 4-frame chunks of ≤ 4 × 4 patches
  v.max_patches_per_row = 256
  v.max_grids_per_row = 16
  c.data.sources = ("synthetic_text", "synthetic_images")
  c.data.weights = (1.0, 1.0)
  c.train.use_stages = False               # one stage: no context curriculum on the tiny run
  return c
