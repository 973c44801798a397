"""`benchmarks/train_step.py --lower_for=gpu|tpu`: the k3_h200 step (its layers scanned) as one
H200 (or a TPU) builds it, traced and lowered on this CPU-only machine. Every hand-written kernel
of the model's hot path must be in that program: a shape or setting that sends one back to XLA's
own ops (ragged_dot, the chunked KDA, dense attention) fails here, without a GPU."""

from __future__ import annotations

import pytest

from pallas_kernels import platform
from tests.benchmarks import scripts
from tests.configs import k3_h200, k3_tiny, quick

# Each distinct lowering once (a kernel jitted for the same shapes is one function of the
# program). The routed experts: forward at two shapes (gate/up, down) and their input gradients
# (gmm with rhsᵀ), the weight gradients (tgmm) at two shapes. KDA: the forward kernels in the
# forward and again in the backward's recompute, and the backward kernels. MLA: the flash
# forward (also recomputed) and its two backward kernels. QB's two kernels, AttnRes' backward,
# the short conv's backward. The dispatch's row copies (k3_h200's `gather_backend = "auto"` takes
# the row-copy kernel on a GPU): one Triton call per copy in the lowered step. The head loss's
# log-normaliser ("auto": the one-pass kernel on a single GPU) in its chunk loop.
EXPECTED_KERNELS = {
    "gmm_mgpu": 4, "tgmm_mgpu": 2,
    "chunk_cumsum_kernel": 2, "strip_scores_kernel": 2, "inverse_kernel": 2, "wu_kernel": 2,
    "state_seq_kernel": 2, "out_kernel": 2,
    "state_bwd_kernel": 1, "chunk_bwd_kernel": 1, "wy_bwd_kernel": 1, "score_bwd_kernel": 1,
    "attention_fwd": 2, "attention_dq": 1, "attention_dkv": 1,
    "qb_margin_rows": 2, "qb_margin_columns": 2,
    "attnres_mix_backward": 3, "short_conv_backward": 1,
    "moe_gather_rows": 24, "logsumexp_and_pick": 1,
}


def _k3_h200():
  cfg = k3_h200.get_config()
  cfg.train.global_batch_size, cfg.train.microbatches = 8, 2     # the records' 32,768-token step
  # Scanned, as K3 runs its depth (k3_h200 itself unrolls its 21 layers): the scan's saved
  # residuals are what the AllocateBuffer check below is about, and the kernels are the same.
  cfg.model.scan_layers = True
  cfg.optim.optimizer = "adamw"
  return cfg


@pytest.fixture(scope="module")
def row():
  return scripts.load("train_step").lowered_row(_k3_h200(), "base", "gpu")


def test_the_gpu_step_lowers_on_cpu_with_every_kernel(row):
  assert row["lowered_for"] == "gpu" and row["tokens_per_step"] == 32768
  assert "lower_profile" not in row                                   # only when asked
  assert row["lowered_kernels"] == EXPECTED_KERNELS
  calls = row["lowered_custom_calls"]
  assert calls["mosaic_gpu_v2"] == 6 and calls["__gpu$xla.gpu.triton"] == 53     # 24 row copies
  # One device: the scanned layers' saved residuals go to unwritten buffers (layer_scan).
  assert calls["AllocateBuffer"] > 0
  assert row["trace_s"] > 0 and row["lower_s"] > 0 and row["stablehlo_ops"] > 10_000
  assert sum(row["stablehlo_ops_by_part"].values()) == row["stablehlo_ops"]
  assert {"kda", "mla", "moe_gmm", "optimizer", "attnres"} <= set(row["stablehlo_ops_by_part"])
  # Every matmul of the step (projections, head, MLA, and their gradients) takes bf16 operands;
  # weight gradients come out in fp32.
  assert set(row["lowered_dots"]) == {"bf16,bf16->bf16", "bf16,bf16->f32"}, row["lowered_dots"]
  # The block ended: this process traces for its own backend again.
  assert platform.current() == "cpu"


def test_the_tpu_step_lowers_on_cpu_with_the_mosaic_tpu_kernels():
  """The same step as a TPU builds it: KDA's Mosaic TPU kernels and splash attention lowered for
  real (the kernels' CPU tests run them in interpret mode)."""
  row = scripts.load("train_step").lowered_row(_k3_h200(), "base", "tpu")
  assert row["lowered_kernels"] == {
      "intra_kernel": 2, "state_seq_kernel": 2, "state_bwd_kernel": 1, "chunk_bwd_kernel": 1,
      "intra_bwd_kernel": 1, "splash_mha_fwd_segmented_residuals": 2,
      "splash_mha_dkv_segmented_no_residuals": 1, "splash_mha_dq_segmented_no_residuals": 1}
  assert set(row["lowered_custom_calls"]) == {"tpu_custom_call"}
  assert platform.current() == "cpu"


def test_lower_profile_takes_the_host_cost_apart_by_function():
  """`--lower_for` with `--lower_profile`: tracing and lowering under cProfile, the model's own
  functions among the longest (the four-layer k3_tiny, lowered for the GPU)."""
  row = scripts.load("train_step").lowered_row(quick(k3_tiny.get_config()), "tiny", "gpu",
                                               profile=True)
  cumulative = row["lower_profile"]["cumulative"]
  assert len(cumulative) == 150 and cumulative == sorted(cumulative, key=lambda r: -r[0])
  assert any("k3train/model/decoder.py" in where and "hidden_states" in where
             for _, _, where in cumulative)


def test_dots_are_counted_by_operand_and_result_types():
  text = "\n".join([
      "%3 = stablehlo.dot_general %1, %2, contracting_dims = [1] x [0] : (tensor<4x8xf32>, "
      "tensor<8xf32>) -> tensor<4xf32>",
      "%4 = stablehlo.dot_general %a, %b, batching_dims = [0] x [0], contracting_dims = [2] x [1] "
      ": (tensor<2x4x8xbf16>, tensor<2x8x3xbf16>) -> tensor<2x4x3xf32> loc(#loc3)",
      "%5 = stablehlo.dot_general %a, %b, contracting_dims = [1] x [0] : (tensor<?x8xbf16>, "
      "tensor<8x3xbf16>) -> tensor<?x3xf32>",
      "%6 = stablehlo.add %a, %b : tensor<4xf32>"])
  assert scripts.load("train_step").dots_by_dtypes(text) == {"bf16,bf16->f32": 2, "f32,f32->f32": 1}


def test_lowered_kernels_name_triton_and_tpu_calls_and_mosaic_gpu_functions():
  text = "\n".join([
      'func.func private @gmm_mgpu_35(%a: tensor<8xf32>) -> tensor<8xf32> {',
      '  %0 = stablehlo.custom_call @mosaic_gpu_v2(%a) {module = "x"} : (tensor<8xf32>) -> '
      'tensor<8xf32>',
      '}',
      'func.func private @_launch_3(%a: tensor<8xf32>) -> tensor<8xf32> {',
      '  %0 = stablehlo.custom_call @__gpu$xla.gpu.triton(%a) {mhlo.backend_config = '
      '{name = "wu_kernel"}} : (tensor<8xf32>) -> tensor<8xf32>',
      '  %1 = stablehlo.custom_call @__gpu$xla.gpu.triton(%0) {mhlo.backend_config = '
      '{name = "wu_kernel"}} : (tensor<8xf32>) -> tensor<8xf32>',
      '  %2 = stablehlo.custom_call @AllocateBuffer() : () -> tensor<8xf32>',
      '  %3 = stablehlo.custom_call @tpu_custom_call(%2) {backend_config = "x", '
      'kernel_name = "chunk_bwd_kernel"} : (tensor<8xf32>) -> tensor<8xf32>',
      '}'])
  assert scripts.load("train_step").lowered_kernels(text) == {"wu_kernel": 2, "gmm_mgpu": 1,
                                                               "chunk_bwd_kernel": 1}
