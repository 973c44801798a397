"""Shared test set-up: a persistent XLA compilation cache so identical programs compile once per run."""

import os
import tempfile

import jax
import pytest

CACHE_DIR = os.environ.get("K3TRAIN_TEST_COMPILATION_CACHE",
                           os.path.join(tempfile.gettempdir(), "k3train-test-xla-cache"))
jax.config.update("jax_compilation_cache_dir", CACHE_DIR)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


@pytest.fixture(scope="session")
def compilation_cache_dir():
  return CACHE_DIR
