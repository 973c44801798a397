"""benchmarks/gpu_target.py and `train_step.py --compile_for`: the described GPU targets and the
clear refusals (the compile itself needs jax's CUDA plugin, which the test machine does not
install)."""

from __future__ import annotations

import importlib.util
import os

import pytest

from benchmarks import gpu_target
from k3train import cli
from pallas_kernels import platform
from tests.benchmarks import scripts


def test_the_h200_target_describes_the_gpu_the_kernels_are_sized_for():
  """The target's multiprocessors are the ones `platform.targeting("gpu")` sizes persistent
  grids by, so the kernels lowered and the program compiled agree on the device."""
  target = gpu_target.load("h200")
  assert target.description == "NVIDIA H200"
  assert target.sm_count == platform.HOPPER_SM_COUNT == 132
  assert "major: 9" in target.config_text and 'platform_name: "CUDA"' in target.config_text


def test_an_unknown_target_or_an_incomplete_file_is_refused_by_name(tmp_path, monkeypatch):
  with pytest.raises(ValueError, match=r"unknown GPU target 'h900'; known: h200"):
    gpu_target.load("h900")
  (tmp_path / "h200.txtpb").write_text('device_description_str: "NVIDIA H200"\n')
  monkeypatch.setattr(gpu_target, "TARGET_DIR", str(tmp_path))
  with pytest.raises(ValueError, match="needs gpu_device_info.core_count"):
    gpu_target.load("h200")


def test_the_environment_runs_on_the_cpu_and_skips_the_driver_check():
  assert gpu_target.environment() == {"JAX_PLATFORMS": "cpu",
                                      "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}


def test_a_missing_plugin_is_named_with_the_install_command_at_jax_version(monkeypatch):
  import jax
  monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
  message = gpu_target.missing_plugin()
  assert f'pip install "jax-cuda12-plugin[with-cuda]=={jax.__version__}"' in message
  monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
  assert gpu_target.missing_plugin() is None


def test_compile_for_refuses_without_the_plugin_and_beside_lower_for(monkeypatch, capsys):
  train_step = scripts.load("train_step")
  monkeypatch.setattr(gpu_target, "missing_plugin", lambda: "needs the plugin")
  argv = ["train_step.py", f"--config={os.path.join(scripts.REPO, 'configs', 'k3_tiny.py')}",
          "--compile_for=h200"]
  assert train_step.main(argv) == cli.USAGE_ERROR
  assert "needs the plugin" in capsys.readouterr().err
  monkeypatch.setattr(gpu_target, "missing_plugin", lambda: None)
  assert train_step.main(argv + ["--lower_for=gpu"]) == cli.USAGE_ERROR
  assert "--compile_for and --lower_for exclude each other" in capsys.readouterr().err
  assert train_step.main(argv[:2] + ["--target_devices=2"]) == cli.USAGE_ERROR
  assert "--target_devices is the number of --compile_for GPUs" in capsys.readouterr().err


def test_a_target_has_at_least_one_device():
  with pytest.raises(ValueError, match="at least one device, got 0"):
    gpu_target.devices(gpu_target.load("h200"), 0)
