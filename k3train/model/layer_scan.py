"""A scan over stacked layers whose backward pass adds the weight gradients into an accumulator.

Gradient accumulation over micro-batches (k3train/train/step.py) needs, per micro-batch,
acc ← acc + w · ∂L/∂θ. Through `jax.lax.scan`'s own transpose the stacked layers' gradient is a
fresh buffer (11.2 GiB of fp32 at k3_h200): JAX fills it with zeros, the backward scan writes
one layer's slice per iteration, and a separate pass adds it to the accumulator.

`accumulating_scan` runs the same forward scan, but its backward scan carries the accumulator
itself and adds each layer's gradient, scaled by w, into that layer's slice in place: no zero
fill and no second stack-sized buffer beside the accumulator (benchmarks/train_step.md). The
accumulator is an input of the function and the result comes back as *its* cotangent (the
stacked parameters get none), so the caller differentiates with respect to the accumulator:

    grads = jax.grad(lambda acc: loss(accumulating_scan(body, c, params, xs, consts, acc, w)))(acc)
    # grads == acc + w · ∂loss/∂params   (leaf by leaf, in the accumulator's dtype)

The forward keeps exactly what a plain scan of `body` keeps: each iteration's `jax.vjp` residuals
(under a `jax.checkpoint` policy, what the policy saves plus the iteration's inputs), stacked
over the iterations. Residuals that are the iteration's own parameter, `xs` or `consts` arrays
are not stacked (they would be copies); the backward slices them again. The forward loop is
written out (one iteration traced to a jaxpr, then a `fori_loop`) so that on a GPU its stacked
buffers are allocated unwritten (`_unread_buffers`) rather than zero-filled and copied.

A saved residual that a kernel (a Pallas call or another custom call) computed reaches its stacked
buffer through an optimization barrier (`_kernel_outputs`). Without it XLA:GPU's dynamic-slice
fusion gives the buffer write its own copy of the kernel whenever the kernel's result has other
users too, so the kernel runs twice: at k3_h200 every scanned layer ran its gate and up expert
matmuls twice in the forward (benchmarks/train_step.md).
"""

from __future__ import annotations

import functools
import itertools
from typing import Any, Callable

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from k3train.parallel import rules
from pallas_kernels import platform

# Where a residual of one iteration's vjp comes from.
_PARAM, _XS, _CONST, _SAVED = "param", "xs", "const", "saved"


def _is_float(x) -> bool:
  return jnp.issubdtype(x.dtype, jnp.inexact)


# Primitives that pass their first operand through unchanged in value or only in shape; XLA keeps
# them as bitcasts or drops them, so the kernel's own buffer reaches the stacked-buffer write.
_TRANSPARENT = frozenset({"name", "reduce_precision", "reshape", "squeeze", "expand_dims",
                          "copy"})
# Primitives that run a kernel of their own (a custom call in the compiled program).
# (Pallas-Triton and Mosaic TPU kernels are `pallas_call`, Pallas' Mosaic GPU `plgpu.kernel` is
# `mpmd_map`.)
_KERNELS = frozenset({"pallas_call", "mpmd_map", "ffi_call", "custom_call"})


def _inner_jaxpr(eqn):
  """The jaxpr a call-like equation (jit, custom_vjp_call, custom_vmap_call, checkpoint, ...)
  runs, or None."""
  for key in ("jaxpr", "call_jaxpr", "fun_jaxpr", "call"):
    inner = eqn.params.get(key)
    if inner is not None:
      return getattr(inner, "jaxpr", inner)
  return None


def _producers(jaxpr) -> dict:
  """Each variable of `jaxpr` that an equation defines -> that equation."""
  return {v: e for e in jaxpr.eqns for v in e.outvars}


def _kernel_made(producer: dict, var) -> bool:
  """Whether `var` (of the jaxpr whose `_producers` map is `producer`) is the result of a kernel
  call, through pass-through ops and into call-like equations."""
  for _ in range(64):                       # a bound on the walk, far above any real chain
    if isinstance(var, jax.extend.core.Literal):
      return False
    eqn = producer.get(var)
    if eqn is None:                         # an input of the jaxpr
      return False
    name = eqn.primitive.name
    if name in _KERNELS:
      return True
    if name in _TRANSPARENT:
      var = eqn.invars[0]
      continue
    inner = _inner_jaxpr(eqn)
    if inner is None or len(inner.outvars) != len(eqn.outvars):
      return False
    var, producer = inner.outvars[eqn.outvars.index(var)], _producers(inner)
  return False


def _kernel_outputs(closed_jaxpr, first: int) -> list[bool]:
  """For each output of `closed_jaxpr` from index `first` on: computed by a kernel call?"""
  producer = _producers(closed_jaxpr.jaxpr)
  return [_kernel_made(producer, v) for v in closed_jaxpr.jaxpr.outvars[first:]]


def _fenced(values: list, mask: list[bool]) -> list:
  """values with the masked ones passed through one optimization barrier."""
  picked = [v for v, m in zip(values, mask) if m]
  if not picked:
    return list(values)
  it = iter(jax.lax.optimization_barrier(picked))
  return [next(it) if m else v for v, m in zip(values, mask)]


def _sources(residuals, params_i, xs_i, consts) -> list[tuple[str, int]]:
  """(kind, index) of each residual: the iteration's own parameter, xs or const array (the
  same traced object), or a value to save."""
  known = {}
  for kind, group in ((_CONST, consts), (_XS, xs_i), (_PARAM, params_i)):
    known.update({id(x): (kind, k) for k, x in enumerate(group)})
  return [known.get(id(r), (_SAVED, -1)) for r in residuals]


class _Body:
  """The layer function, plus what tracing the forward learnt about its residuals (the
  backward's static information: residual tree structure and where each residual comes from)."""

  def __init__(self, fn: Callable):
    self.fn = fn
    self.layout: dict = {}


def accumulating_scan(body: Callable, carry: Any, params: Any, xs: Any, consts: Any,
                      grad_acc: Any, weight: jax.Array):
  """(carry, ys) of `jax.lax.scan` over the leading axis of `params` and `xs` with
  body(carry, params_i, xs_i, consts) -> (carry, ys).

  Differentiation: the carry gets its usual cotangent; `grad_acc` (a tree shaped like `params`,
  usually fp32) gets grad_acc + weight · ∂/∂params, accumulated in place layer by layer; `params`,
  `xs`, `consts` and `weight` get none, and `ys` (statistics the layers write) pass no gradient.
  Wrap `body` in `jax.checkpoint` for rematerialisation, as for a plain scan.
  """
  if jax.tree.structure(grad_acc) != jax.tree.structure(params):
    raise ValueError(f"grad_acc must have the structure of params: {jax.tree.structure(grad_acc)} "
                     f"vs {jax.tree.structure(params)}")
  return _scan(_Body(body), carry, params, xs, consts, grad_acc, weight)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _scan(body: _Body, carry, params, xs, consts, grad_acc, weight):
  del grad_acc, weight

  def step(c, inputs):
    p_i, x_i = inputs
    return body.fn(c, p_i, x_i, consts)
  return jax.lax.scan(step, carry, (params, xs))


def _fwd(body: _Body, carry, params, xs, consts, grad_acc, weight):
  param_leaves, param_def = jax.tree.flatten(params)
  xs_leaves, xs_def = jax.tree.flatten(xs)
  const_leaves = jax.tree.leaves(consts)
  carry_leaves, carry_def = jax.tree.flatten(carry)
  layout = body.layout                       # filled while the iteration is traced (once)

  def step(c_leaves, p_leaves, x_leaves):
    p_i = jax.tree.unflatten(param_def, p_leaves)
    # xs rebuilt inside the differentiated function: containers holding state (flax nnx
    # Variables) must be created at the trace level that may write them.
    layer = lambda p, cc: body.fn(cc, p, jax.tree.unflatten(xs_def, x_leaves), consts)
    c_out, vjp_fn, ys = jax.vjp(layer, p_i, jax.tree.unflatten(carry_def, c_leaves), has_aux=True)
    res_leaves, res_def = jax.tree.flatten(vjp_fn)
    sources = _sources(res_leaves, p_leaves, x_leaves, const_leaves)
    layout["treedef"], layout["sources"] = res_def, sources
    ys_leaves, layout["ys_def"] = jax.tree.flatten(ys)
    saved = [r for r, (kind, _) in zip(res_leaves, sources) if kind == _SAVED]
    return jax.tree.leaves(c_out), ys_leaves, saved

  # One iteration traced to a jaxpr: its outputs' shapes size the stacked buffers, and the
  # loop below evaluates the jaxpr instead of tracing the layers a second time.
  length = _length(param_leaves, xs_leaves)
  one = jax.make_jaxpr(step)(carry_leaves, [p[0] for p in param_leaves],
                             [x[0] for x in xs_leaves])
  run_one = jax.extend.core.jaxpr_as_fun(one)
  n_carry = len(carry_leaves)
  stacked_avals = one.out_avals[n_carry:]
  kernel_made = _kernel_outputs(one, n_carry)

  def loop(i, state):
    c_leaves, stacks = state
    outs = run_one(*c_leaves, *[jax.lax.dynamic_index_in_dim(p, i, keepdims=False)
                                for p in param_leaves],
                   *[jax.lax.dynamic_index_in_dim(x, i, keepdims=False) for x in xs_leaves])
    stacks = [jax.lax.dynamic_update_index_in_dim(b, v, i, 0)
              for b, v in zip(stacks, _fenced(outs[n_carry:], kernel_made))]
    return list(outs[:n_carry]), stacks

  carry_out, stacks = jax.lax.fori_loop(0, length, loop,
                                        (carry_leaves, _unread_buffers(stacked_avals, length)))
  n_ys = layout["ys_def"].num_leaves
  ys = jax.tree.unflatten(layout["ys_def"], stacks[:n_ys])
  saved = stacks[n_ys:]
  layout["carry"] = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)),
                                 carry)   # the carry's structure and types, not its values
  return (jax.tree.unflatten(carry_def, carry_out), ys), (params, xs, consts, saved, grad_acc,
                                                          weight)


def _length(param_leaves, xs_leaves) -> int:
  return (param_leaves or xs_leaves)[0].shape[0]


def _unread_buffers(avals, length: int) -> list[jax.Array]:
  """[length, *shape] buffers for the loop to fill, one per aval; their initial values are never
  read.

  On a single GPU they are left unwritten (XLA's `AllocateBuffer`). `jax.lax.scan` zero-fills
  its stacked outputs instead; XLA merges equal fills into one buffer and copies it once per
  output, and XLA's fill kernels write bf16 at a fifth of the memory bandwidth: leaving them
  unwritten took 22 ms off a k3_h200 step (benchmarks/train_step.md). Each allocation carries its
  own tag, so that XLA does not merge them into one buffer to copy. Elsewhere (CPU, TPU, or a
  step over more than one device, where the partitioner would give an unknown custom call the
  global shape: every device would hold the whole batch's buffer) the buffers are zeros, as in
  `jax.lax.scan`. The devices are the active layout's mesh (`rules.activate`), else all of jax's.
  """
  shapes = [jax.ShapeDtypeStruct((length, *a.shape), a.dtype) for a in avals]
  mesh_size = rules.active_mesh_size()
  one_device = (mesh_size if mesh_size is not None else jax.device_count()) == 1
  if platform.current() == "gpu" and one_device:
    return [_allocate(shape) for shape in shapes]
  return [jnp.zeros(shape.shape, shape.dtype) for shape in shapes]


_allocation_tags = itertools.count()


def _allocate(shape: jax.ShapeDtypeStruct) -> jax.Array:
  """An unwritten buffer (XLA:GPU's `AllocateBuffer`, as `jax.lax.empty` lowers there), tagged so
  that no two allocations are merged."""
  call = jax.ffi.ffi_call("AllocateBuffer", shape, custom_call_api_version=1,
                          legacy_backend_config=f"k3train_stack_{next(_allocation_tags)}")
  return call()


def _carry_cotangent(carry_leaves, float_slots, float_cts):
  """The carry's cotangent leaves: `float_cts` at the float leaves, float0 zeros at the integer
  and boolean ones (which carry no gradient)."""
  out = [np.zeros(x.shape, jax.dtypes.float0) for x in carry_leaves]
  for slot, ct in zip(float_slots, float_cts):
    out[slot] = ct
  return out


def _add_at(acc, update, index):
  """acc[index] += update along the leading axis, in place. Written as a scatter-add, which XLA
  turns into one in-place dynamic-update-slice fusion; a dynamic-update-slice of (slice +
  update) written out made the GPU compiler add in a separate pass first."""
  return acc.at[index].add(update)


def _bwd(body: _Body, residuals, cotangents):
  params, xs, consts, saved, grad_acc, weight = residuals
  res_def, sources, carry = body.layout["treedef"], body.layout["sources"], body.layout["carry"]
  ct_carry, _ = cotangents                   # the ys are statistics: no gradient flows through them
  param_leaves = jax.tree.leaves(params)
  xs_leaves = jax.tree.leaves(xs)
  const_leaves = jax.tree.leaves(consts)
  carry_leaves, carry_def = jax.tree.flatten(carry)
  float_slots = [i for i, x in enumerate(carry_leaves) if _is_float(x)]
  ct_leaves = jax.tree.leaves(ct_carry)
  acc_leaves, acc_def = jax.tree.flatten(grad_acc)
  length = _length(param_leaves, xs_leaves)

  def step(state, inputs):
    ct_float, acc = state
    index, p_i, x_i, saved_i = inputs      # the scan slices parameters and xs, as its own would
    it = iter(saved_i)
    res = [p_i[k] if kind == _PARAM else x_i[k] if kind == _XS else
           const_leaves[k] if kind == _CONST else next(it) for kind, k in sources]
    vjp_fn = jax.tree.unflatten(res_def, res)
    ct_p, ct_c = vjp_fn(jax.tree.unflatten(carry_def,
                                           _carry_cotangent(carry_leaves, float_slots, ct_float)))
    ct_p_leaves = jax.tree.leaves(ct_p)
    acc = [_add_at(a, weight.astype(a.dtype) * g.astype(a.dtype), index)
           for a, g in zip(acc, ct_p_leaves)]
    ct_c_leaves = jax.tree.leaves(ct_c)
    return ([ct_c_leaves[slot] for slot in float_slots], acc), None

  ct_float0 = [ct_leaves[slot] for slot in float_slots]
  indices = jnp.arange(length, dtype=jnp.int32)
  (ct_float, acc), _ = jax.lax.scan(step, (ct_float0, acc_leaves),
                                    (indices, param_leaves, xs_leaves, saved), reverse=True)
  ct_in = jax.tree.unflatten(carry_def, _carry_cotangent(carry_leaves, float_slots, ct_float))
  return ct_in, None, None, None, jax.tree.unflatten(acc_def, acc), None


_scan.defvjp(_fwd, _bwd)
