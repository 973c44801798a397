"""The accumulating layer scan: its forward is a scan, its backward adds w · ∂/∂params into the
accumulator (k3train/model/layer_scan.py), and the train step's accumulation through it equals
the accumulation after the backward pass."""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl

from tests.configs import k3_tiny
from k3train.model import layer_scan
from k3train.model.decoder import build_model
from k3train.train.step import loss_and_grads
from pallas_kernels import platform

L = 3


def _body(carry, p, x, consts):
  """A layer with an integer carry leaf, a saved name, an xs input and a const."""
  s, n = carry
  (scale,) = consts
  h = checkpoint_name(jnp.tanh(s @ p["w"] * scale), "h")
  return (s + h @ p["v"] * x["b"], n + 1), {"stat": jax.lax.stop_gradient(jnp.sum(h))}


def _inputs(dtype):
  rng = np.random.default_rng(0)
  draw = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
  params = {"w": 0.3 * draw(L, 8, 8), "v": 0.3 * draw(L, 8, 8)}
  xs = {"b": 1.0 + 0.1 * draw(L, 8)}
  return params, xs, draw(4, 8), (draw(4, 1),), {k: draw(*v.shape) for k, v in params.items()}


@pytest.mark.parametrize("policy", [None, "saved_h", "nothing"])
def test_gradient_into_the_accumulator_equals_the_scan_gradient(policy):
  with jax.enable_x64():
    params, xs, s0, consts, acc = _inputs(jnp.float64)
    body = _body
    if policy == "saved_h":
      body = jax.checkpoint(_body, policy=jax.checkpoint_policies.save_only_these_names("h"))
    elif policy == "nothing":
      body = jax.checkpoint(_body)
    weight = jnp.float64(0.37)

    def plain(params, s):
      (c, n), ys = jax.lax.scan(lambda c, i: body(c, i[0], i[1], consts), (s, jnp.int32(0)),
                                (params, xs))
      return jnp.sum(c ** 2), (n, ys)

    def accumulating(acc, s):
      (c, n), ys = layer_scan.accumulating_scan(body, (s, jnp.int32(0)), params, xs, consts, acc,
                                                weight)
      return jnp.sum(c ** 2), (n, ys)

    (l0, (n0, ys0)), (g_params, g_s) = jax.value_and_grad(plain, (0, 1), has_aux=True)(params, s0)
    (l1, (n1, ys1)), (g_acc, g_s1) = jax.jit(jax.value_and_grad(accumulating, (0, 1),
                                                                has_aux=True))(acc, s0)
    assert float(l0) == float(l1) and int(n0) == int(n1) == L
    np.testing.assert_array_equal(ys0["stat"], ys1["stat"])
    np.testing.assert_allclose(g_s1, g_s, rtol=1e-12, atol=1e-12)
    for k in params:
      np.testing.assert_allclose(g_acc[k], acc[k] + 0.37 * g_params[k], rtol=1e-12, atol=1e-12)


def test_parameters_xs_and_consts_are_not_stacked_as_residuals():
  """Each iteration's parameters, xs and consts are sliced again in the backward pass, not
  copied into stacked residual buffers (the stacked parameters would be a copy of them all)."""
  params, xs, s0, consts, acc = _inputs(jnp.float32)
  body = layer_scan._Body(jax.checkpoint(_body, policy=jax.checkpoint_policies.save_only_these_names("h")))
  out, residuals = layer_scan._fwd(body, (s0, jnp.int32(0)), params, xs, consts, acc, jnp.float32(1))
  kinds = collections.Counter(kind for kind, _ in body.layout["sources"])
  assert kinds["param"] == 2 and kinds["xs"] == 1 and kinds["const"] == 1
  saved = residuals[3]
  # What is stacked: the saved name h [4, 8] and the iteration's input carry s [4, 8].
  assert sorted(x.shape for x in saved) == [(L, 4, 8), (L, 4, 8)]


def test_stacked_buffers_on_one_gpu_are_unwritten_allocations_each_its_own(monkeypatch):
  """Lowered for one GPU, each stacked buffer of the forward loop (the saved h and the input
  carry s, both [L, 4, 8]; the ys statistic is unused here) is its own `AllocateBuffer`
  (distinct tags, so XLA cannot merge them into one buffer to copy)."""
  params, xs, s0, consts, acc = _inputs(jnp.float32)
  body = jax.checkpoint(_body, policy=jax.checkpoint_policies.save_only_these_names("h"))
  loss = lambda a, s: jnp.sum(layer_scan.accumulating_scan(body, (s, jnp.int32(0)), params, xs,
                                                           consts, a, jnp.float32(1))[0][0] ** 2)
  monkeypatch.setattr(jax, "device_count", lambda *a: 1)
  with platform.targeting("gpu"):
    text = jax.export.export(jax.jit(jax.grad(loss)), platforms=["cuda"])(acc, s0).mlir_module()
  allocations = [line for line in text.splitlines() if "@AllocateBuffer" in line]
  tags = {re.search(r'backend_config = "([^"]+)"', line).group(1) for line in allocations}
  assert len(allocations) == len(tags) == 2, allocations
  assert all(f"tensor<{L}x4x8xf32>" in line for line in allocations)
  monkeypatch.undo()
  zeros = layer_scan._unread_buffers([jax.ShapeDtypeStruct((4, 8), jnp.bfloat16)], L)
  assert zeros[0].shape == (L, 4, 8) and not bool(jnp.any(zeros[0]))       # CPU: zeros


def test_stacked_buffers_of_a_step_over_several_gpus_are_zeros():
  """A step whose layout spans several GPUs gets zero-filled stacked buffers, whatever this
  process's device count (the partitioner would give an unwritten allocation the global shape
  on every device); a layout of one GPU gets unwritten ones."""
  from jax.sharding import AbstractMesh
  from k3train.parallel import rules
  shape = [jax.ShapeDtypeStruct((4, 8), jnp.bfloat16)]
  make = lambda: jax.make_jaxpr(lambda: layer_scan._unread_buffers(shape, L))()
  calls = lambda jaxpr: sum(e.primitive.name == "ffi_call" for e in jaxpr.jaxpr.eqns)
  table = rules.get_rules("default")
  with platform.targeting("gpu"):
    for devices, allocations in ((8, 0), (1, 1)):
      mesh = AbstractMesh((devices,), ("data",))
      with rules.activate(mesh, table):
        jaxpr = make()
      assert calls(jaxpr) == allocations, (devices, jaxpr)
      if not allocations:
        assert any(e.primitive.name == "broadcast_in_dim" for e in jaxpr.jaxpr.eqns), jaxpr


def _doubled(x):
  """2x through a Pallas kernel (interpreted off the GPU): a custom call in the compiled step."""
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0
  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                        interpret=platform.interpret("gpu"))(x)


@jax.custom_vjp
def _kernel_matmul(s, w):
  return _doubled(s @ w)


_kernel_matmul.defvjp(lambda s, w: (_kernel_matmul(s, w), (s, w)),
                      lambda res, g: (2.0 * g @ res[1].T, res[0].T @ (2.0 * g)))


def _kernel_body(carry, p, x, consts):
  """_body with a second saved name computed by a kernel and used again in the layer."""
  s, n = carry
  k = checkpoint_name(_kernel_matmul(s, p["v"]), "k")
  h = checkpoint_name(jnp.tanh(s @ p["w"] * consts[0]), "h")
  return (s + h * jnp.tanh(k) * x["b"], n + 1), {}


def test_saved_kernel_outputs_reach_their_stack_through_a_barrier():
  """A saved residual that a kernel computed is fenced by an optimization barrier before its
  stacked-buffer write (XLA:GPU would otherwise clone the kernel into the write); elementwise
  residuals are not; the gradients are those of the plain scan."""
  s, w = jnp.ones((4, 8)), jnp.ones((8, 8))
  one = jax.make_jaxpr(lambda s, w: (checkpoint_name(_kernel_matmul(s, w), "k").reshape(32),
                                     jnp.tanh(s), _doubled(s) + 1.0, s, 1.0))(s, w)
  assert layer_scan._kernel_outputs(one, 0) == [True, False, False, False, False]
  assert layer_scan._kernel_outputs(one, 1) == [False, False, False, False]

  params, xs, s0, consts, acc = _inputs(jnp.float32)
  body = jax.checkpoint(_kernel_body, policy=jax.checkpoint_policies.save_only_these_names("h", "k"))
  loss = lambda a, s: jnp.sum(layer_scan.accumulating_scan(body, (s, jnp.int32(0)), params, xs,
                                                           consts, a, jnp.float32(1))[0][0] ** 2)
  text = jax.jit(jax.grad(loss)).lower(acc, s0).as_text()
  # (jax.checkpoint's own barrier in the backward fences all the layer's inputs at once.)
  fences = re.findall(r"%\w+ = stablehlo.optimization_barrier %\w+ : (tensor<[^>]*>)", text)
  assert fences == ["tensor<4x8xf32>"], fences

  def plain(params, s):
    (c, _), _ = jax.lax.scan(lambda c, i: body(c, i[0], i[1], consts), (s, jnp.int32(0)),
                             (params, xs))
    return jnp.sum(c ** 2)
  g_params = jax.grad(plain)(params, s0)
  g_acc = jax.jit(jax.grad(loss))(acc, s0)
  for k in params:
    np.testing.assert_allclose(g_acc[k], acc[k] + g_params[k], rtol=1e-6, atol=1e-6)


def test_a_mosaic_gpu_grouped_matmul_counts_as_a_kernel():
  """The routed experts' Mosaic GPU kernel (traced for the GPU, not run) is found as a kernel
  through its jit and custom_vmap_call wrappers, as the layer scan needs for the expert
  matmul outputs the selective policy saves."""
  from pallas_kernels.moe import pallas_gpu
  shapes = [jax.ShapeDtypeStruct((1024, 256), jnp.bfloat16),
            jax.ShapeDtypeStruct((4, 256, 512), jnp.bfloat16),
            jax.ShapeDtypeStruct((4,), jnp.int32)]
  with platform.targeting("gpu"):
    one = jax.make_jaxpr(lambda x, w, g: (checkpoint_name(pallas_gpu.gmm_mgpu(x, w, g), "k"),
                                          x * 2))(*shapes)
  assert layer_scan._kernel_outputs(one, 0) == [True, False]


def test_accumulator_must_match_the_parameters():
  params, xs, s0, consts, acc = _inputs(jnp.float32)
  bad = {"w": acc["w"]}
  loss = lambda a: jnp.sum(layer_scan.accumulating_scan(_body, (s0, jnp.int32(0)), params, xs,
                                                        consts, a, jnp.float32(1))[0][0])
  with pytest.raises(ValueError, match="grad_acc must have the structure of params"):
    jax.grad(loss)(bad)


def test_micro_batch_gradients_accumulated_in_the_stack_equal_the_plain_sum():
  """loss_and_grads over 2 micro-batches, the stack's gradients summed inside its backward scan
  or after it: the same arithmetic, so the same numbers (fp32, bit for bit here)."""
  cfg = k3_tiny.get_config()
  cfg.model.num_layers, cfg.model.mla_layers = 6, (2, 4, 6)   # prefix [KDA, MLA], 2 × [KDA, MLA]
  cfg.model.remat_policy = "selective"
  model = build_model(cfg.model, seed=0)
  assert model.stack is not None
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  b, t = 4, 32
  rng = np.random.default_rng(1)
  loss_mask = np.ones((b, t), np.float32)
  loss_mask[1, 9:] = 0.0                                       # unequal micro-batch weights
  batch = {"tokens": jnp.asarray(rng.integers(8, cfg.model.vocab_size, (b, t)), jnp.int32),
           "targets": jnp.asarray(rng.integers(8, cfg.model.vocab_size, (b, t)), jnp.int32),
           "segment_ids": jnp.ones((b, t), jnp.int32), "loss_mask": jnp.asarray(loss_mask)}
  run = jax.jit(loss_and_grads, static_argnums=(0, 4, 5, 6, 7))
  (loss0, (rest0, _)), grads0 = run(graphdef, params, rest, batch, 2, 0, None, False)
  (loss1, (rest1, _)), grads1 = run(graphdef, params, rest, batch, 2, 0, None, True)
  assert float(loss0) == float(loss1)
  leaves0 = jax.tree_util.tree_leaves_with_path(grads0)
  assert any(p[0].key == "stack" for p, _ in leaves0)
  for (path, a), b_ in zip(leaves0, jax.tree.leaves(grads1)):
    scale = max(float(jnp.max(jnp.abs(a))), 1e-30)
    assert float(jnp.max(jnp.abs(a - b_))) <= 1e-6 * scale, jax.tree_util.keystr(path)
  for a, b_ in zip(jax.tree.leaves(rest0), jax.tree.leaves(rest1)):
    np.testing.assert_array_equal(a, b_)
