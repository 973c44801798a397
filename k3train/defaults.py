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
  m.remat_policy = "full"         # none | full | selective | selective_kda | dots_saveable | dots_with_no_batch_dims_saveable (model/remat.py)
  # The fused head loss's log-normaliser and target logit per row (train.loss_chunk_tokens > 0),
  # pallas_kernels.logsumexp: xla (two reads of each chunk's logits) | pallas_gpu (one) | auto
  # (the kernel on a single GPU, else xla). On an H100 the kernel takes a k3_h200 chunk in 1.22
  # against XLA's 2.02 ms, and the 9-layer slice's update 1.5 % less time (benchmarks/logsumexp.md).
  m.head_lse_backend = "auto"

  k = m.kda = ml_collections.ConfigDict()
  k.num_heads = 96
  k.head_dim = 128
  k.conv_size = 4
  k.gate_lower_bound = -5.0
  k.chunk_size = 64
  k.backend = "auto"              # see pallas_kernels.kda: reference | jax | pallas_gpu | pallas_tpu | auto
  k.conv_backend = "auto"         # the short conv, pallas_kernels.short_conv: xla | pallas_gpu | auto

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
  e.qb_rounds = 4                 # train: QB rounds on the batch's own scores before routing (0: route with the stored bias)
  e.qb_mean_correction = False    # train: first move the stored bias by each expert's mean-score change
  e.backend = "auto"              # pallas_kernels.moe: auto (pallas_gpu on GPU, else ragged_dot)
  e.qb_backend = "auto"           # pallas_kernels.qb: auto (pallas_gpu on one GPU, else xla) | xla | pallas_gpu
  # The routed and shared experts' SiTU-GLU, pallas_kernels.situ_glu: xla | pallas_gpu | auto
  # (the kernels on a GPU). "xla": on an H200 the kernels are 3× slower forward + backward than
  # XLA's fusions and made the k3_h200 update 9 % slower (benchmarks/situ_glu.md).
  e.situ_backend = "xla"
  # Who copies the dispatch's token rows into expert order, pallas_kernels.moe.GATHERS: xla |
  # pallas_gpu (a row-copy kernel) | auto (the kernel on a GPU). The kernel copies at 1.7× XLA's
  # rate on an H200 and took 0.4 % off the k3_h200 update (configs/k3_h200.py sets "auto");
  # "xla" here: it is measured on that one-GPU proxy only (benchmarks/train_step.md).
  e.gather_backend = "xla"

  q = m.quant = ml_collections.ConfigDict()   # MX QAT of the routed experts (docs/maths.md §7.5)
  q.enabled = False               # K3 pre-trains in bf16; QAT is switched on for SFT / RL
  q.start_step = 0                # first quantised step (state.step >= start_step; resume-exact)
  q.weights = "mxfp4"             # expert weights, blocks of 32 along the input dim: mxfp4 | mxfp8
  q.activations = "mxfp8"         # expert GEMM inputs, blocks along the contraction dim: mxfp8 | mxfp4 | none
  q.scale_rule = "floor"          # E8M0 scale rule: floor (OCP reference) | rceil (cuBLAS / Blackwell)
  q.gemm = "auto"                 # fake_quant | mx (gmm_mx reads MX codes) | auto (fake_quant: faster today)

  r = m.attn_res = ml_collections.ConfigDict()
  r.block_size = 12               # decoder layers per AttnRes block
  r.backend = "auto"              # see pallas_kernels.attnres: xla | pallas_gpu | auto

  mt = m.mtp = ml_collections.ConfigDict()     # multi-token prediction (docs/maths.md §8, k3train/model/mtp.py)
  mt.enabled = True               # one MLA + MoE module predicting t+2; released as model.mtp.*
  mt.loss_weight = 0.1            # λ: total loss = main + λ · MTP loss

  w = m.vision = ml_collections.ConfigDict()   # MoonViT-V2 tower + PatchMergerMLPV2 (docs/maths.md §6.2)
  w.enabled = True                # trained jointly with the text model from scratch; must equal data.vision.enabled
  w.num_layers = 27
  w.d_model = 1024                # tower width
  w.num_heads = 12
  w.head_dim = 128                # fused qkv width 3 × 12 × 128
  w.mlp_hidden = 4096             # tanh-GELU MLP
  w.patch_size = 14               # px: the pipeline's patches hold 14 × 14 × 3 = 588 values
  w.pos_height = 64               # learnable position table, bilinearly interpolated to each grid
  w.pos_width = 64
  w.max_frames = 4                # fixed sin-cos time table: frames of one video chunk
  w.rope_theta = 10_000.0         # 2D RoPE base
  w.norm_eps = 1e-6               # the tower's RMSNorms
  w.projector_norm_eps = 1e-5     # the projector's output RMSNorm
  w.placeholder_id = 5            # <|image_pad|> id of data.tokenizer (checked at start)
  w.backend = "auto"              # see pallas_kernels.attention: reference | xla | pallas_gpu | pallas_tpu | auto

  d = c.data = ml_collections.ConfigDict()
  # Sources (k3train/data/sources.py): python_stdlib (embedded default corpus), synthetic_text,
  # synthetic_images, or KIND:PATH with KIND in jsonl, interleaved, text, parquet, array_record,
  # image_caption. `weights` (one per source) may change between curriculum stages.
  # synthetic_passkey / _multikey / _vartrack: generated long-range retrieval documents sized for
  # the stage's seq_len; weight 0 until a curriculum stage mixes them in (train.stages).
  d.sources = ("python_stdlib", "synthetic_passkey", "synthetic_multikey", "synthetic_vartrack")
  d.weights = (1.0, 0.0, 0.0, 0.0)
  d.tokenizer = "default"         # the shipped byte-level BPE, a tokenizers JSON or a tiktoken file
  d.seq_len = 4096
  d.shuffle_seed = 0
  d.num_workers = 0               # worker processes per source (grain mp_prefetch); 0 = in-process
  d.num_threads = 1               # reader threads per source (grain ReadOptions)
  d.long_doc_weight = 1.0         # ≥ 1: keep documents of ≤ seq_len / 2 tokens with prob. 1 / this
  # A source that yields no usable document in this many records in a row, or seconds, fails
  # naming its skip counts (counts go to metrics.jsonl as data/skipped/<source>/<reason>).
  d.max_unusable_records = 10_000
  d.max_unusable_seconds = 300.0
  # Warn when a source's skip rate (records skipped wholly or in part / records read, cumulative)
  # passes this share (a warning line on stderr), and again each time it climbs 10 more points;
  # 1 never warns.
  d.skip_warn_fraction = 0.1
  # Share of every source's documents held out from training for evaluation, chosen by a hash of
  # the document's id (k3train/data/split.py); eval.sources naming a training source read it.
  d.heldout_fraction = 0.01

  v = d.vision = ml_collections.ConfigDict()   # MoonViT-V2 input (docs/maths.md §6)
  v.enabled = True                # emit vision_* batch keys; media segments are skipped when off
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
  # > 0: the output head and cross-entropy run fused, this many positions of every row at a time
  # (no [tokens, vocab] logits; gradients computed in the forward pass; k3train/train/head_loss.py).
  # Must divide every stage's data.seq_len (and be a multiple of parallel.sequence). 0: unfused.
  t.loss_chunk_tokens = 0
  t.steps = 1_000_000
  t.log_every = 10
  # XLA compiler options for the train step only, 'name=value' pairs separated by spaces, e.g.
  # "xla_gpu_enable_dynamic_slice_fusion=true" (jax.jit's compiler_options; values true / false,
  # integers and floats are typed, anything else stays text). "": XLA's defaults.
  t.xla_options = ""
  # The step as two programs, the gradients and the update, compiled on two threads and run back
  # to back (k3train/train/phased.py): the same work and memory, and the compile ends when the
  # larger program's does. False: one program.
  t.split_step = True
  t.peak_flops_per_device = 0.0     # MFU's peak; 0: by device kind (train/metrics.py PEAK_BF16_FLOPS)
  # Share of each device's memory limit that the start-up memory plan keeps free: a stage whose
  # planned peak exceeds (1 − margin) × the limit is refused before anything is built
  # (k3train/tools/plan). The plan errs high (by 8–9 % of XLA's own figure for k3_h200 on an
  # H200), so a run that its measured memory shows to fit may need a smaller margin.
  t.memory_margin = 0.10
  # The staged context curriculum (docs/maths.md §9), run in one process when use_stages is True:
  # an ordered tuple of `curriculum_stage(...)` entries (README "Curriculum"). The run ends at
  # the last stage's end or at train.steps, whichever comes first.
  t.use_stages = True
  t.stages = k3_curriculum()

  o = c.optim = ml_collections.ConfigDict()
  o.optimizer = "muon"             # muon (per-head Muon for matrices, AdamW for the rest) | adamw
  o.learning_rate = 3e-4
  o.schedule = "cosine"            # cosine (warmup + cosine) | wsd (warmup-stable-decay)
  o.warmup_steps = 2000
  o.min_lr_ratio = 0.1
  o.wsd_decay_fraction = 0.1       # wsd: share of train.steps spent decaying
  o.weight_decay = 0.1
  o.router_lr_factor = 1.0         # the MoE router weight's learning rate relative to the rest
  o.grad_clip_norm = 1.0
  o.adam_b1 = 0.9
  o.adam_b2 = 0.95
  o.adam_eps = 1e-8
  o.adam_mu_dtype = "float32"      # AdamW first moment: float32 | bfloat16 (half its bytes; the second stays fp32)
  o.muon_momentum = 0.95
  o.muon_update_rms = 0.2
  o.muon_ns_dtype = "bfloat16"     # Newton–Schulz matmul operands: bfloat16 | float32 (fp32 accumulation)
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

  ev = c.eval = ml_collections.ConfigDict()  # evals at the training length (k3train/train/evals.py)
  ev.every_steps = 0              # > 0: also every N steps; with stages, always at each stage's end
  ev.batches = 1                  # held-out batches (of train.global_batch_size rows) per eval
  ev.sources = ("python_stdlib",)  # held-out text for the loss by position: point at a held-out split
  ev.seed = 9_176                 # of the held-out stream and of the retrieval examples
  ev.position_buckets = 4         # loss by position: [0, T/2^(n-1)), …, [T/4, T/2), [T/2, T)
  ev.retrieval = ("passkey", "multikey", "vartrack")   # tasks scored at the training length

  s = c.metrics = ml_collections.ConfigDict()  # metric sinks (k3train/train/writers.py); process 0 writes
  s.tensorboard = True            # event files in WORKDIR/tensorboard (besides WORKDIR/*.jsonl, always)
  s.wandb = False                 # Weights & Biases (pip install wandb); the run resumes with the workdir
  s.wandb_project = "k3train"
  s.vectors_every = 100           # steps between per-layer per-expert load rows (vectors.jsonl); 0: never
  return c


def curriculum_stage(**values) -> ml_collections.ConfigDict:
  """One entry of `train.stages`: every stage has exactly these keys (the stage schema).

  0, 0.0, "" and () mean "as the previous stage" (the first stage: as the config outside
  train.stages). A stage ends at `until_step` or when `until_tokens` tokens (global batch ×
  seq_len per step, summed over the stages) have been seen; the last may give neither and
  then ends at train.steps. With global_batch_size 0 the tokens per step stay those of the
  previous stage. `lr` is the stage's learning-rate segment, a warmup-stable-decay shape over the
  whole run: "stable" (the peak after optim.warmup_steps), "decay" (linear to
  optim.min_lr_ratio × peak over the decay stages), "low" (min_lr_ratio × peak, constant).
  `parallel.*` is the stage's mesh (-1 fills the devices) and rule recipe.
  """
  s = ml_collections.ConfigDict()
  s.name = ""
  s.until_step = 0
  s.until_tokens = 0
  s.seq_len = 0
  s.global_batch_size = 0
  s.microbatches = 0
  s.weights = ()                  # one per data.sources
  s.long_doc_weight = 0.0
  s.lr = ""                       # stable | decay | low
  p = s.parallel = ml_collections.ConfigDict()
  for axis in ("data", "fsdp", "expert", "sequence", "tensor"):
    p[axis] = 0
  p.rules = ""
  for key, value in values.items():
    if key == "parallel":
      for axis, size in dict(value).items():
        if axis not in p:
          raise ValueError(f"curriculum_stage: unknown key parallel.{axis}; known: {sorted(p)}")
        p[axis] = size
    elif key not in s:
      raise ValueError(f"curriculum_stage: unknown key {key!r}; known: {sorted(s)}")
    else:
      s[key] = value
  return s


def k3_curriculum() -> tuple:
  """K3's 4K → 1M plan (docs/maths.md §9) at 8 M tokens per step; meshes and micro-batches for
  4,096 H200s (`python -m k3train.tools.plan --config=configs/k3_full.py --devices=4096
  --device_memory=139` plans every stage: 8,192 tokens per device and micro-batch throughout)."""
  return (
      curriculum_stage(name="pretrain_4k", until_tokens=7_000_000_000_000, microbatches=2,
                       lr="stable", parallel=dict(expert=2, tensor=8)),
      curriculum_stage(name="midtrain_32k", until_tokens=7_800_000_000_000, seq_len=32_768,
                       global_batch_size=256, long_doc_weight=4.0, lr="decay",
                       parallel=dict(sequence=4)),
      curriculum_stage(name="long_128k", until_tokens=8_100_000_000_000, seq_len=131_072,
                       global_batch_size=64, weights=(0.94, 0.02, 0.02, 0.02), lr="low",
                       parallel=dict(sequence=16)),
      curriculum_stage(name="long_512k", until_tokens=8_300_000_000_000, seq_len=524_288,
                       global_batch_size=16, parallel=dict(sequence=64)),
      curriculum_stage(name="long_1m", seq_len=1_048_576, global_batch_size=8,
                       weights=(0.8, 0.05, 0.1, 0.05), parallel=dict(sequence=128)),
  )
