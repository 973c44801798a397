"""Test-only: let jax 0.10.2's Mosaic GPU interpreter run wgmma on transposed shared-memory refs
and with its A operand in registers.

`plgpu.transpose_ref` adds a TransposeTransform after the ref's indexers; the interpreter's wgmma
callback reads operand buffers through their indexers only and fails on it (AttributeError:
'TransposeTransform' object has no attribute 'indices'). `install()` wraps that callback: it reads
each operand through its indexers and applies the transposes to the values, as the hardware's
transposed-operand wgmma does, then accumulates in the operand-precision product like the original.

The interpreter also passes every wgmma A operand to the callback as a shared-memory allocation
key, so an A given as an array (the register-operand wgmma) fails there. `install()` replaces the
interpreter's wgmma rule with one that sends such an A to the callback as its value.
"""

from __future__ import annotations

import functools

import numpy as np
from jax._src import callback
from jax._src.pallas.mosaic.interpret import utils as interpret_utils
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as cb
from jax._src.pallas.mosaic_gpu.interpret import jaxpr_interpret
from jax._src.state import types as state_types
from jax._src.state.types import TransposeTransform

_installed = False


def _read(shared_memory, key_array, transforms, thread, logging_info):
  perm = None
  indexers = []
  for t in cb._remove_noop_transforms(transforms):
    if isinstance(t, TransposeTransform):
      perm = t.permutation if perm is None else tuple(perm[i] for i in t.permutation)
    else:
      assert perm is None, "indexing after a transpose is not supported by this shim"
      indexers.append(t)
  value, _, _ = shared_memory.get_buffer_content(
      cb.HostAllocationKey.from_array(key_array), interpret_utils.to_range(tuple(indexers)),
      thread, logging_info=logging_info)
  return value if perm is None else np.transpose(value, perm)


def _wgmma(*, token, device_id, grid_point_coords, thread_id, acc_allocation_key_as_array,
           acc_transforms, acc_dtype, a_allocation_key_as_array, a_transforms,
           b_allocation_key_as_array, b_transforms, source_info=None, a_value=None):
  device_id, thread_id = int(device_id), int(thread_id)
  shared_memory = cb._get_shared_memory()
  thread = shared_memory.get_global_thread_id(device_id, thread_id)
  info = interpret_utils.GPULoggingInfo(
      device_id=device_id, grid_point_coords=tuple(int(x) for x in grid_point_coords),
      thread_id=thread_id, source_info=source_info)
  to_int = lambda ts: tuple(t if isinstance(t, TransposeTransform) else
                            cb.jax.tree.map(int, t) for t in ts)
  if a_value is not None:             # A in registers: the value itself
    a = np.asarray(a_value)
  else:
    a = _read(shared_memory, a_allocation_key_as_array, to_int(a_transforms), thread, info)
  b = _read(shared_memory, b_allocation_key_as_array, to_int(b_transforms), thread, info)
  acc_key = cb.HostAllocationKey.from_array(acc_allocation_key_as_array)
  acc_range = interpret_utils.to_range(cb.jax.tree.map(int, cb._remove_noop_transforms(acc_transforms)))
  acc, _, _ = shared_memory.get_buffer_content(acc_key, acc_range, thread, logging_info=info)
  shared_memory.store_buffer_content(acc_key, acc_range, acc + np.matmul(a, b, dtype=acc_dtype),
                                     thread, logging_info=info)
  return token


_original_rule = jaxpr_interpret.JaxprInterpreter._interpret_wgmma_ref_p


def _interpret_wgmma_ref_p(self, eqn, token, get_invals):
  """The interpreter's wgmma rule, with an array A passed to the callback as `a_value`."""
  if isinstance(eqn.invars[1].aval, state_types.AbstractRef):
    return _original_rule(self, eqn, token, get_invals)
  acc, a, b, *leaves = get_invals()
  empty = cb.jax.tree.structure([])
  acc_transforms, a_transforms, b_transforms = cb.jax.tree.unflatten(
      cb.jax.tree_util.treedef_tuple((eqn.params["acc_transforms_tree"] or empty,
                                      eqn.params["a_transforms_tree"] or empty,
                                      eqn.params["b_transforms_tree"] or empty)), leaves)
  return callback.io_callback(
      functools.partial(_wgmma, acc_dtype=eqn.invars[0].aval.dtype, source_info=eqn.source_info),
      cb.TOKEN_SHAPE_DTYPE, token=token, device_id=self.device_info.device_id,
      grid_point_coords=self.grid_point_coords, thread_id=self.thread_id,
      acc_allocation_key_as_array=acc, acc_transforms=acc_transforms,
      a_allocation_key_as_array=acc, a_transforms=a_transforms, a_value=a,   # key unused
      b_allocation_key_as_array=b, b_transforms=b_transforms, ordered=True), []


def install() -> None:
  """Idempotently replace the interpreter's wgmma callback with the transpose-aware one and its
  wgmma rule with the one that accepts a register A."""
  global _installed
  if not _installed:
    cb.wgmma = _wgmma
    jaxpr_interpret.JaxprInterpreter._interpret_wgmma_ref_p = _interpret_wgmma_ref_p
    _installed = True
