"""Shared test set-up: XLA:CPU's code generation at its lowest optimisation level, a persistent
XLA compilation cache so identical programs compile once per run, and the test files handed to
the xdist workers longest first."""

import os
import tempfile

import jax
import pytest

# The suite's programs are small and run a few steps, so compiling them takes most of its time;
# LLVM's optimisation level 0 compiles them ~25 % faster. Set before any backend starts, and so
# inherited by the test scripts run in subprocesses (`xla_flags` adds to it).
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
if TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{TEST_XLA_FLAGS} {os.environ.get('XLA_FLAGS', '')}".strip()


def xla_flags(*extra: str) -> str:
  """This run's XLA_FLAGS followed by `extra` (for a subprocess's environment)."""
  return " ".join((os.environ["XLA_FLAGS"], *extra))


CACHE_DIR = os.environ.get("K3TRAIN_TEST_COMPILATION_CACHE",
                           os.path.join(tempfile.gettempdir(), "k3train-test-xla-cache"))
jax.config.update("jax_compilation_cache_dir", CACHE_DIR)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


@pytest.fixture(scope="session")
def compilation_cache_dir():
  return CACHE_DIR


# `-n 2 --dist loadfile` hands out whole files. xdist's default order (most tests first) leaves
# the files of one or two long subprocess tests (test_multiprocess, test_preemption, test_sync)
# for last, where one worker runs them alone while the other idles. Longest first instead
# (seconds per file, measured on 2 cores under -n 2); files not listed follow in collection
# order. Only the order changes: every test still runs, in its own file's order.
FILE_SECONDS = {
    "tests/train/test_curriculum.py": 210, "tests/model/test_decoder.py": 125,
    "tests/parallel/test_mesh_equivalence.py": 120, "tests/train/test_train.py": 115,
    "tests/model/test_vision_train.py": 110, "tests/model/test_mtp.py": 110,
    "tests/pallas_kernels/test_moe_mx.py": 105, "tests/tools/test_hf.py": 100,
    "tests/parallel/test_multiprocess.py": 80, "tests/pallas_kernels/test_kda_pallas.py": 70,
    "tests/quant/test_qat_train.py": 65, "tests/train/test_preemption.py": 65,
    "tests/tools/test_generate.py": 65, "tests/train/test_robustness.py": 55,
    "tests/train/test_microbatches.py": 50, "tests/model/test_layer_scan.py": 50,
    "tests/pallas_kernels/test_moe_pallas_gpu.py": 40, "tests/parallel/test_sync.py": 40,
    "tests/pallas_kernels/test_qb_ops.py": 35, "tests/pallas_kernels/test_attention.py": 30,
    "tests/optim/test_muon_sharding.py": 30, "tests/tools/test_eval.py": 25,
    "tests/pallas_kernels/test_short_conv.py": 25,
    "tests/pallas_kernels/test_moe_pallas_tpu.py": 25,
}


def pytest_configure(config):
  if hasattr(config.option, "loadscopereorder"):      # pytest-xdist's reorder by test count
    config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
  root = str(config.rootpath)
  seconds = lambda item: FILE_SECONDS.get(os.path.relpath(str(item.path), root), 0)
  items.sort(key=lambda item: -seconds(item))          # stable: files stay whole and in order
