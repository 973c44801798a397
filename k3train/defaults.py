"""The released Kimi K3 text model (docs/maths.md §0.2) with the default training recipe.

Every model-defining number is written here explicitly. This config is also the schema:
`k3train.config.validate` accepts exactly its keys with its value types, and every config file
in configs/ starts from `k3_full()` and changes values only.
"""

import ml_collections


def k3_full() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()

  m = c.model = ml_collections.ConfigDict()
  m.vocab_size = 163_840
  m.d_model = 7168
  m.num_layers = 93
  # 1-indexed layer numbers of the gated NoPE MLA layers; every other layer is KDA.
  m.mla_layers = tuple(range(4, 93, 4)) + (93,)
  m.num_dense_layers = 1          # layers [0, num_dense_layers) use the dense FFN
  m.dense_ffn_hidden = 33_792
  m.norm_eps = 1e-5
  m.init_std = 0.02
  m.situ_beta = 4.0
  m.situ_linear_beta = 25.0
  m.dtype = "bfloat16"            # activation / matmul dtype (fp32 accumulation)
  m.param_dtype = "float32"
  m.scan_layers = True
  m.remat_policy = "full"         # none | full | dots_saveable | dots_with_no_batch_dims_saveable

  k = m.kda = ml_collections.ConfigDict()
  k.num_heads = 96
  k.head_dim = 128
  k.conv_size = 4
  k.gate_lower_bound = -5.0
  k.chunk_size = 64
  k.backend = "auto"              # see pallas_kernels.kda: reference | jax | pallas_gpu | pallas_tpu | auto

  a = m.mla = ml_collections.ConfigDict()
  a.num_heads = 96
  a.q_lora_rank = 1536
  a.kv_lora_rank = 512
  a.qk_nope_head_dim = 128
  a.qk_rope_head_dim = 64         # present but never rotated (NoPE)
  a.v_head_dim = 128
  a.latent_norm_eps = 1e-6
  a.output_gate = True
  a.backend = "auto"              # see pallas_kernels.attention: reference | xla | pallas_gpu | pallas_tpu | auto

  e = m.moe = ml_collections.ConfigDict()
  e.num_experts = 896
  e.top_k = 16
  e.latent_dim = 3584
  e.expert_hidden = 3072
  e.num_shared_experts = 2
  e.shared_hidden = 6144          # both shared experts together, stored as one MLP
  e.routed_scaling_factor = 1.0
  e.renormalize = True
  e.latent_norm = True
  e.quantile_balancing = True
  e.backend = "auto"              # pallas_kernels.moe: auto (pallas_gpu on GPU, else ragged_dot)

  r = m.attn_res = ml_collections.ConfigDict()
  r.block_size = 12               # decoder layers per AttnRes block

  d = c.data = ml_collections.ConfigDict()
  # Sources (k3train/data/sources.py): python_stdlib (embedded default corpus), synthetic_text,
  # synthetic_images, or KIND:PATH with KIND in jsonl, interleaved, text, parquet, array_record,
  # image_caption. `weights` (one per source) may change between curriculum stages.
  d.sources = ("python_stdlib",)
  d.weights = (1.0,)
  d.tokenizer = "default"         # the shipped byte-level BPE, a tokenizers JSON or a tiktoken file
  d.seq_len = 4096
  d.shuffle_seed = 0
  d.num_workers = 0               # worker processes per source (grain mp_prefetch); 0 = in-process
  d.num_threads = 1               # reader threads per source (grain ReadOptions)

  v = d.vision = ml_collections.ConfigDict()   # MoonViT-V2 input (docs/maths.md §6)
  v.enabled = False               # emit vision_* batch keys; media segments are skipped when off
  v.max_patches = 16384           # 14-px patches per image (h·w), after resizing
  v.max_side = 3584               # px, after resizing (sides are multiples of 28)
  v.max_input_pixels = 16384 * 16384  # larger decoded images are skipped as oversized
  v.video_fps = 2.0
  v.max_video_frames = 64
  v.max_video_frame_patches = 1024
  v.frames_per_chunk = 4          # frames per MoonViT-3D chunk (one grid)
  v.max_patches_per_row = 16384   # patch budget of one packed row
  v.max_grids_per_row = 64

  t = c.train = ml_collections.ConfigDict()
  t.seed = 0
  t.global_batch_size = 2048
  t.microbatches = 1               # gradient accumulation: the batch runs as N micro-batches
  t.steps = 1_000_000
  t.log_every = 10
  t.peak_flops_per_device = 989e12  # dense bf16 peak of one H100/H200, for MFU

  o = c.optim = ml_collections.ConfigDict()
  o.optimizer = "muon"             # muon (per-head Muon for matrices, AdamW for the rest) | adamw
  o.learning_rate = 3e-4
  o.schedule = "cosine"            # cosine (warmup + cosine) | wsd (warmup-stable-decay)
  o.warmup_steps = 2000
  o.min_lr_ratio = 0.1
  o.wsd_decay_fraction = 0.1       # wsd: share of train.steps spent decaying
  o.weight_decay = 0.1
  o.grad_clip_norm = 1.0
  o.adam_b1 = 0.9
  o.adam_b2 = 0.95
  o.adam_eps = 1e-8
  o.muon_momentum = 0.95
  o.muon_update_rms = 0.2
  o.qk_clip = True                 # rescale MLA heads whose max logit exceeds qk_clip_tau
  o.qk_clip_tau = 100.0
  o.loss_spike_factor = 0.0        # > 0: skip an update whose loss exceeds factor × running mean
  o.loss_spike_ema = 0.99          # decay of that running mean

  p = c.parallel = ml_collections.ConfigDict()
  # Device mesh, outermost → innermost; -1 fills the devices the other axes leave
  # (see k3train/parallel/mesh.py; `python -m k3train.tools.plan` sizes it for a cluster).
  p.data = 1
  p.fsdp = -1
  p.expert = 1
  p.sequence = 1
  p.tensor = 1
  p.rules = "full"                 # logical → mesh rule table: default | long_context | full
  p.expert_exchange = "auto"       # token exchange for expert parallelism: auto | all_to_all | ragged

  k = c.checkpoint = ml_collections.ConfigDict()
  k.every_steps = 1000
  k.max_to_keep = 3
  k.async_save = True

  return c
