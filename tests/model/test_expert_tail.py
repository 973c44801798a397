"""k3train.model.expert_tail: the experts' SiTU-GLU and down GEMM as one op equal the two ops
under autodiff, and their backward runs the activation once, not a second forward pass."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3train.model import expert_tail
from pallas_kernels import moe as moe_ops
from pallas_kernels.situ_glu import pallas_gpu as situ_pallas_gpu
from pallas_kernels.situ_glu import situ_glu
from tests.jaxprs import _equations

F32 = jnp.float32
BETA, LINEAR_BETA = 4.0, 25.0
M, F, L, E = 64, 32, 16, 4
GMM = functools.partial(moe_ops.gmm, backend="ragged_dot")


def _inputs(seed=0):
  ks = jax.random.split(jax.random.key(seed), 6)
  g = (jax.random.normal(ks[0], (M, F), F32) * 4).astype(jnp.bfloat16)
  u = (jax.random.normal(ks[1], (M, F), F32) * 20).astype(jnp.bfloat16)
  r = jax.random.uniform(ks[2], (M,), F32, 0.1, 1.0)
  w = (jax.random.normal(ks[3], (E, F, L), F32) * 0.2).astype(jnp.bfloat16)
  dy = jax.random.normal(ks[4], (M, L), F32).astype(jnp.bfloat16)
  group_sizes = jnp.array([20, 0, 30, 10], jnp.int32)        # 60 of 64 rows: 4 padding rows
  return g, u, r, w, dy, group_sizes


def _fused(situ_backend):
  return lambda g, u, r, w, gs: expert_tail.situ_glu_down(
      g, u, r, w, (gs,), down=GMM, beta=BETA, linear_beta=LINEAR_BETA, situ_backend=situ_backend)


def _composed(g, u, r, w, gs):
  return GMM(situ_glu(g, u, BETA, LINEAR_BETA, r, backend="xla"), w, gs)


def _value_and_grads(fn, g, u, r, w, dy, gs):
  y, pull = jax.vjp(lambda a, b, c, d: fn(a, b, c, d, gs), g, u, r, w)
  return (y, *pull(dy))


@pytest.mark.parametrize("situ_backend", ["xla", "pallas_gpu"])
def test_equals_autodiff_of_the_two_ops(situ_backend):
  """y, dg, du, dr and dW of the one op against autodiff of SiTU-GLU then the grouped matmul:
  the xla activation gives the same numbers (the same roundings, to fp32 summation order); the
  kernels within one bf16 rounding of h (dW, dr) and of the gradients."""
  g, u, r, w, dy, gs = _inputs()
  with situ_pallas_gpu.configured(rows=16, cols=16):
    got = jax.jit(lambda *a: _value_and_grads(_fused(situ_backend), *a, gs))(g, u, r, w, dy)
  want = jax.jit(lambda *a: _value_and_grads(_composed, *a, gs))(g, u, r, w, dy)
  for name, a, b in zip(("y", "dg", "du", "dr", "dw"), got, want):
    assert a.dtype == b.dtype and a.shape == b.shape, name
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = np.abs(b).max()
    tol = 1e-6 if situ_backend == "xla" and name != "dr" else 2.0 ** -7
    np.testing.assert_allclose(a, b, rtol=0, atol=tol * scale, err_msg=name)


def _activation_kernels(fn):
  """Counts of the SiTU-GLU kernels in the gradient of Σ fn(...) · dy, rematerialised with
  nothing saved (what the train step's layers do), traced for the kernels (interpret mode)."""
  g, u, r, w, dy, gs = _inputs()
  loss = lambda g, u, r, w: jnp.sum(
      jax.checkpoint(fn, policy=jax.checkpoint_policies.nothing_saveable)(g, u, r, w, gs)
      .astype(F32) * dy.astype(F32))
  with situ_pallas_gpu.configured(rows=16, cols=16):
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(g, u, r, w).jaxpr
  names = [e.params.get("name") or e.params.get("name_and_src_info") for e in _equations(jaxpr)
           if e.primitive.name == "pallas_call"]
  return {k: sum(str(n).startswith(k) for n in names)
          for k in ("situ_glu_forward", "situ_glu_backward")}


def test_backward_runs_no_second_forward():
  composed = lambda g, u, r, w, gs: GMM(situ_glu(g, u, BETA, LINEAR_BETA, r,
                                                 backend="pallas_gpu"), w, gs)
  assert _activation_kernels(composed) == {"situ_glu_forward": 2, "situ_glu_backward": 1}
  assert _activation_kernels(_fused("pallas_gpu")) == {"situ_glu_forward": 1,
                                                       "situ_glu_backward": 1}


def test_dense_projection_equals_autodiff_of_the_two_ops():
  """The shared experts' form: a dense down projection (`layers.project`, bf16 with fp32
  accumulation) of [B, T, F] activations without a row scale, against autodiff of the two ops."""
  from k3train.model import layers
  g, u, _, _, _, _ = _inputs(seed=2)
  g, u = g.reshape(4, 16, F), u.reshape(4, 16, F)
  w = jax.random.normal(jax.random.key(7), (F, L), F32) * 0.2          # fp32 master weight
  dy = jax.random.normal(jax.random.key(8), (4, 16, L), F32).astype(jnp.bfloat16)
  down = functools.partial(layers.project, n_in=1, dtype=jnp.bfloat16)
  fused = lambda a, b, c: expert_tail.situ_glu_down(
      a, b, None, c, down=down, beta=BETA, linear_beta=LINEAR_BETA, situ_backend="pallas_gpu")
  composed = lambda a, b, c: down(situ_glu(a, b, BETA, LINEAR_BETA, backend="xla"), c)
  with situ_pallas_gpu.configured(rows=16, cols=16):
    got = jax.jit(lambda *a: (lambda y, pull: (y, *pull(dy)))(*jax.vjp(fused, *a)))(g, u, w)
  want = jax.jit(lambda *a: (lambda y, pull: (y, *pull(dy)))(*jax.vjp(composed, *a)))(g, u, w)
  for name, a, b in zip(("y", "dg", "du", "dw"), got, want):
    assert a.dtype == b.dtype and a.shape == b.shape, name
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    np.testing.assert_allclose(a, b, rtol=0, atol=2.0 ** -7 * np.abs(b).max(), err_msg=name)
