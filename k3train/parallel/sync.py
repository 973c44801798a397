"""Keep the processes of a multi-process run in step where their speeds can differ by minutes.

Processes compile the same program at different speeds. The plainest cause: jax's persistent
compilation cache is written by process 0 only, and on CPU the key is not the same on every
process (jax 0.10.2 leaves the device assignment out of it on GPU only), so a warm cache lets
process 0 load its executable in seconds while every other process compiles from scratch. A
host whose cache is cold (a replaced node) does the same on GPU. The first device collective
then waits for the slow process under the collective library's own timeout (gloo: 30 s), which
is far shorter than a compile, and the run dies.

`wait_for_every_process` is a barrier of the coordination service (no device work, its own
timeout). `CompiledTogether` wraps a jitted function: on a new argument signature, each process
compiles ahead of time, waits at that barrier, and only then runs the executable, so the first
collective starts with every process ready. With one process both are plain pass-throughs.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

import jax

BARRIER_TIMEOUT_S = 3600.0     # longer than any compile we have seen (k3_h200: ~200 s)

_barrier_ids = itertools.count()   # every process calls the barriers in the same order


def _client():
  from jax._src import distributed as jax_distributed
  return jax_distributed.global_state.client


def wait_for_every_process(what: str, timeout_s: float = BARRIER_TIMEOUT_S) -> None:
  """Returns once every process has called it with the same `what` (in the same order).

  Raises jax's error naming the barrier when some process does not arrive within timeout_s.
  """
  if jax.process_count() == 1 or _client() is None:
    return
  _client().wait_at_barrier(f"k3train/{next(_barrier_ids)}/{what}", int(timeout_s * 1000))


def argument_signature(args: tuple) -> tuple:
  """Tree structure, shapes and dtypes of `args`: what a compiled executable is specific to."""
  leaves, treedef = jax.tree.flatten(args)
  return treedef, tuple((getattr(x, "shape", None), str(getattr(x, "dtype", type(x))))
                        for x in leaves)


class CompiledTogether:
  """Calls `jitted(*args)`; with several processes, compiles each new signature on every
  process before any process runs it.

  jitted: a `jax.jit` function (it must have `.lower`). what: the name the barrier carries
  (it appears in the timeout error). The compiled executables are kept per signature (tree
  structure, shapes and dtypes of the arguments).
  """

  def __init__(self, jitted: Callable[..., Any], what: str,
               timeout_s: float = BARRIER_TIMEOUT_S):
    self.jitted, self.what, self.timeout_s = jitted, what, timeout_s
    self._compiled: dict[tuple, Any] = {}

  def __call__(self, *args):
    if jax.process_count() == 1:
      return self.jitted(*args)
    key = argument_signature(args)
    compiled = self._compiled.get(key)
    if compiled is None:
      compiled = self.jitted.lower(*args).compile()
      wait_for_every_process(f"{self.what} compiled", self.timeout_s)
      self._compiled[key] = compiled
    return compiled(*args)


__all__ = ["BARRIER_TIMEOUT_S", "CompiledTogether", "argument_signature", "wait_for_every_process"]
