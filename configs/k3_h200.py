"""A K3 proxy that trains on one 141 GB H200, used by the device benchmarks.

K3 per-layer shapes where they fit (128-dim KDA/MLA heads, MLA ranks, latent MoE with top-8 over
64 experts, SiTU-GLU, AttnRes), fewer and narrower layers. About 4.5 B parameters (1.9 B active per token, 0.7 B of them the embedding and head):
fp32 weights, gradients and AdamW second moment, a bf16 first moment ≈ 63 GB, leaving room for
bf16 activations with remat.
"""

from k3train import defaults


def get_config():
  c = defaults.k3_full()
  m = c.model
  m.d_model = 2048
  m.num_layers = 21                      # dense prefix to the first MLA, 4 super-blocks, final MLA
  m.mla_layers = (4, 8, 12, 16, 20, 21)
  m.dense_ffn_hidden = 8192
  m.dtype = "bfloat16"
  # Keeps projections, routing, expert GEMM and attention kernel outputs, and the KDA chunk
  # kernels' residuals (no KDA forward kernel reruns in the backward). On a 9-layer slice on one
  # H100: 2,942.7 → 2,868.9 ms per update (−2.5 %) against "selective" with an fp32 first moment.
  # It needs ~9 GiB more than "selective"; the bf16 AdamW first moment below frees ~8 GiB, so
  # compiled for the H200 XLA's analysis is 105.3 GiB (104.2 before) with nothing rematerialised
  # by XLA (benchmarks/train_step.md).
  m.remat_policy = "selective_kda"
  # Unrolled, not scanned: at 21 layers the scan's stacked residuals (each saved GEMM or kernel
  # output copied into its [iterations, …] buffer) and its in-place gradient-accumulator updates
  # cost ~5 % of the step on one H200 (6.06 → 5.75 s per update), more than its compile saves
  # (~90 → ~124 s); benchmarks/train_step.md. K3's 93 layers stay scanned.
  m.scan_layers = False

  m.kda.num_heads = 16                   # 16 × 128, as K3's per-head shape
  m.mla.num_heads = 16
  m.mla.q_lora_rank = 768

  m.moe.num_experts = 64
  m.moe.top_k = 8
  m.moe.latent_dim = 1024
  m.moe.expert_hidden = 768
  m.moe.shared_hidden = 2048
  # The dispatch's row copies by the row-copy kernel on a GPU (XLA's gather elsewhere): on one
  # H200 the update took 5,643.2 against 5,666.4 ms with XLA's gathers, and XLA 3.9 GiB less
  # (benchmarks/train_step.md).
  m.moe.gather_backend = "auto"

  m.attn_res.block_size = 6
  m.vision.enabled = False               # text benchmarks; set both to True for a multimodal step
  m.mtp.enabled = False                  # the main model's step only
  c.data.vision.enabled = False
  c.train.use_stages = False             # one stage; the K3 stage plan needs a pod

  c.data.seq_len = 4096
  # 196,608 tokens per update (K3's tokens per update and per GPU), as 12 micro-batches of
  # 4 × 4096 with the remat above and the fused, chunked head loss: the plan 125.8 GiB per H200
  # (benchmarks/train_step.md). On an H200, XLA's own analysis has run ~8 GiB above its CPU
  # compile's (112.5 against 104.2 GiB for the previous default). The micro-batch size sets the
  # memory; their number spreads the optimizer's ~44 ms per update over more tokens.
  # Micro-batches of 2 × 4096 run ~6 % slower.
  c.train.global_batch_size = 48
  c.train.microbatches = 12
  c.train.loss_chunk_tokens = 1024
  # AdamW's first moment in bf16, the second in fp32 (DeepSeek-V3 trained with both in bf16):
  # 8.4 GiB less state, which pays for the KDA residuals kept above.
  c.optim.adam_mu_dtype = "bfloat16"
  c.train.steps = 1000
  c.optim.warmup_steps = 100
  c.checkpoint.every_steps = 500
  return c
