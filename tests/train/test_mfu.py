"""The MFU meter's peak: the config's override, else the device-kind table, else no MFU."""

import math

import pytest

from k3train.train import metrics


@pytest.mark.parametrize("kind,peak", [
    ("NVIDIA H200", 989e12), ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA A100-SXM4-80GB", 312e12), ("TPU v5 lite", 197e12), ("TPU v5", 459e12),
    ("TPU v6 lite", 918e12), ("TPU v4", 275e12),
])
def test_known_device_kinds_give_their_dense_bf16_peak(kind, peak):
  assert metrics.peak_flops_per_device(0.0, kind) == peak
  assert "device-kind table" in metrics.describe_peak(0.0, kind)


def test_the_config_value_overrides_the_table_and_unknown_kinds_have_no_mfu():
  assert metrics.peak_flops_per_device(5e12, "NVIDIA H200") == 5e12
  assert metrics.peak_flops_per_device(5e12, "cpu") == 5e12
  assert metrics.peak_flops_per_device(0.0, "cpu") is None
  assert "not reported" in metrics.describe_peak(0.0, "cpu")
  assert math.isnan(metrics.mfu(1000.0, 1e9, None, 1))
  # 1000 tokens/s × 1 GFLOP per token on 2 devices of 1 TFLOP/s: 50 %.
  assert metrics.mfu(1000.0, 1e9, metrics.peak_flops_per_device(1e12, "cpu"), 2) == pytest.approx(0.5)


def test_a_negative_peak_is_refused():
  from k3train import config as config_lib
  from tests.configs import k3_tiny
  cfg = k3_tiny.get_config()
  cfg.train.peak_flops_per_device = -1.0
  with pytest.raises(config_lib.ConfigError, match="train.peak_flops_per_device"):
    config_lib.validate(cfg)
