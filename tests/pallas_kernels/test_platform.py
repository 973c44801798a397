"""`pallas_kernels.platform`: the platform kernels are traced for, and `targeting`, which traces
for another platform on this machine (the GPU program on a CPU-only machine)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import attention, platform
from pallas_kernels import moe as moe_ops
from pallas_kernels import qb, short_conv
from pallas_kernels.kda import op as kda
from pallas_kernels.moe import pallas_gpu as moe_gpu


def test_the_default_is_jaxs_backend_and_kernels_run_where_they_can():
  assert platform.current() == jax.default_backend() == "cpu"
  assert not platform.is_targeted()
  assert platform.interpret("gpu") and platform.interpret("tpu")
  assert kda.resolve_backend("auto") == "jax"
  assert moe_ops.resolve_backend("auto", (4096, 1024), (64, 1024, 768),
                                 jnp.bfloat16) == "ragged_dot"


def test_targeting_the_gpu_makes_every_auto_choice_and_grid_the_gpus():
  with platform.targeting("gpu"):
    assert platform.current() == "gpu" and platform.is_targeted()
    assert not platform.interpret("gpu") and platform.interpret("tpu")
    assert platform.gpu_sm_count() == platform.HOPPER_SM_COUNT
    assert moe_gpu._num_sms(interpret=False) == platform.HOPPER_SM_COUNT
    assert kda.resolve_backend("auto") == "pallas_gpu"
    assert moe_ops.resolve_backend("auto", (4096, 1024), (64, 1024, 768),
                                   jnp.bfloat16) == "pallas_gpu"
    assert qb.resolve_backend("auto", 16384) == "pallas_gpu"
    assert short_conv.resolve_backend("auto", 16384, 2048) == "pallas_gpu"
    assert attention.resolve_backend("auto", 192, 128, jnp.bfloat16) == "pallas_gpu"
  with platform.targeting("gpu", sm_count=78):
    assert moe_gpu._num_sms(interpret=False) == 78
  with platform.targeting("tpu"):
    assert kda.resolve_backend("auto") == "pallas_tpu" and platform.gpu_sm_count() is None
  # The block ends: back to this machine.
  assert platform.current() == "cpu" and kda.resolve_backend("auto") == "jax"


def test_targeting_ends_even_when_the_block_raises():
  with pytest.raises(RuntimeError, match="inside"):
    with platform.targeting("gpu"):
      raise RuntimeError("inside")
  assert platform.current() == "cpu" and not platform.is_targeted()


def test_a_gpu_without_a_multiprocessor_count_is_refused_by_the_gmm_grid():
  with platform.targeting("gpu", sm_count=None):
    with pytest.raises(ValueError, match="multiprocessor count"):
      moe_gpu._num_sms(interpret=False)


@pytest.mark.parametrize("kwargs, match", [
    (dict(platform="cuda"), "unknown kernel target platform 'cuda'"),
    (dict(platform="gpu", sm_count=0), "sm_count must be a positive"),
])
def test_bad_targets_are_refused(kwargs, match):
  with pytest.raises(ValueError, match=match):
    with platform.targeting(**kwargs):
      pass
  assert platform.current() == "cpu"
