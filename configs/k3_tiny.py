"""A tiny K3 that trains on a laptop CPU: every layer kind, 2 scanned super-blocks, 4 AttnRes blocks.

Derived from k3_full; only sizes change. One step takes well under a second on 2 CPU cores.
"""

from k3train import defaults


def get_config():
  c = defaults.k3_full()
  m = c.model
  m.vocab_size = 4096             # the shipped default tokenizer's vocabulary
  m.d_model = 64
  m.num_layers = 13               # 4-layer prefix (dense layer 0), 2 scanned super-blocks, final MLA
  m.mla_layers = (4, 8, 12, 13)
  m.dense_ffn_hidden = 192
  m.dtype = "float32"
  m.remat_policy = "none"

  m.kda.num_heads = 2
  m.kda.head_dim = 32
  m.kda.chunk_size = 32

  m.mla.num_heads = 2
  m.mla.q_lora_rank = 48
  m.mla.kv_lora_rank = 32
  m.mla.qk_nope_head_dim = 32
  m.mla.qk_rope_head_dim = 16
  m.mla.v_head_dim = 32

  m.moe.num_experts = 8
  m.moe.top_k = 2
  m.moe.latent_dim = 32
  m.moe.expert_hidden = 32
  m.moe.shared_hidden = 64

  m.attn_res.block_size = 4

  m.vision.enabled = False        # text only (configs/k3_tiny_mm.py adds a tiny vision tower)
  m.mtp.enabled = False           # no MTP module (--config.model.mtp.enabled=true adds it)

  c.data.seq_len = 128
  c.data.vision.enabled = False
  c.data.vision.max_patches = 256          # ≤ 64 placeholders per image: fits a 129-token row
  c.data.vision.max_video_frame_patches = 64
  c.data.vision.max_patches_per_row = 512
  c.data.vision.max_grids_per_row = 16

  c.train.global_batch_size = 4
  c.train.steps = 200
  # AdamW: Muon's ~2,000 small Newton-Schulz matmuls add ~25 s to the CPU compile of the step.
  # `--config.optim.optimizer=muon` runs the K3 recipe on the tiny model too.
  c.optim.optimizer = "adamw"
  c.optim.learning_rate = 3e-3
  c.optim.warmup_steps = 10
  c.train.log_every = 10
  c.train.peak_flops_per_device = 1e11   # rough fp32 peak of 2 laptop cores, for the MFU estimate

  c.parallel.rules = "default"

  c.checkpoint.every_steps = 50
  c.checkpoint.max_to_keep = 2

  # A CPU-sized 128 → 256 → 512-token curriculum, 512 tokens per step throughout (batch 4 → 2 → 1),
  # off by default: `--config.train.use_stages=true` runs it (three step compiles, about a minute
  # each on 2 cores). Stage meshes follow the config's parallel section (one device: one shard);
  # with more devices e.g. `--config.train.stages[2].parallel.sequence=4`.
  c.train.use_stages = False
  c.train.stages = (
      defaults.curriculum_stage(name="short_128", until_step=120, lr="stable"),
      defaults.curriculum_stage(name="mid_256", until_step=170, seq_len=256, long_doc_weight=4.0,
                                lr="decay"),
      defaults.curriculum_stage(name="long_512", seq_len=512, weights=(0.7, 0.1, 0.1, 0.1),
                                lr="low"),
  )
  c.eval.every_steps = 0          # with the curriculum: evals at each stage's end
  return c
