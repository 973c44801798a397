"""The train step as two XLA programs that compile side by side.

`Layout.jit_step` jits a `StepPhases` (k3train/train/step.py) as two programs: the gradient
program (every micro-batch's forward and backward: nearly all of the step's work and of its
compile) and the update program (the optimizer over every parameter leaf, QK-Clip, the
router-bias update, the guards and the metrics). XLA runs the passes that fuse, schedule and
assign buffers for a program on one thread, and that time grows with the program; here the two
programs compile on two threads, and the update program is traced and lowered while XLA compiles
the gradient program, so the step is ready when the larger one is, not after both
(benchmarks/train_step.md measures it).

At run time the two programs run back to back on the device's stream, as one program would run
its two halves. The gradients stay in device memory between them, where one program kept them
as temporaries: the step's work and peak memory are the same. Each program donates the state
and returns it: the gradient program unchanged (its buffers aliased, nothing copied), the update
program updated. On an H100 (benchmarks/train_step.md) a gradient program that only read the
state, with the update program donating it, made the step 0.9 % slower than one program; with
the state handed on as an output, as one step's state is to the next step, the step took as long
as one program's. The gradient program's memory analysis counts the whole state (arguments,
aliased), the batch, the gradients and the activations: what is live while it runs.

`train.split_step=False` jits the step as one program instead.

    step = layout.jit_step(phases, shardings)
    state, metrics = step(state, batch)          # the first call for new shapes compiles both
    compiled = step.lower(state, batch).compile()  # ahead of time, the same two programs
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any, Callable

import jax

from k3train.parallel.sync import argument_signature


class CompiledPhases:
  """The two compiled programs; called as `(state, batch) -> (state, metrics)`.

  seconds: each program's compile on its thread ("gradients": XLA; "update": its trace and
  lowering too, unless done before) and "wall", the time until both were ready (less than their
  sum when they overlapped)."""

  def __init__(self, gradients, update, seconds: dict[str, float]):
    self.gradients, self.update, self.seconds = gradients, update, seconds

  def __call__(self, state, batch):
    return self.update(*self.gradients(state, batch))

  def as_text(self) -> str:
    """Both optimised HLO modules, the gradient program's first."""
    return "\n".join(c.as_text() or "" for c in (self.gradients, self.update))

  def memory_analysis(self) -> tuple[Any, Any]:
    """XLA's memory analysis of each program: (gradients, update)."""
    return self.gradients.memory_analysis(), self.update.memory_analysis()


class LoweredPhases:
  """The gradient program lowered, and the update program lowered when first needed: `compile()`
  starts XLA on the gradient program first, then traces, lowers and compiles the update program
  while it runs."""

  def __init__(self, gradients, lower_update: Callable[[], Any]):
    self.gradients = gradients
    self._lower_update = lower_update
    self._update = None

  @property
  def update(self):
    if self._update is None:
      self._update = self._lower_update()
    return self._update

  def as_text(self, **kwargs) -> str:
    """Both lowered modules (StableHLO), the gradient program's first."""
    return "\n".join(l.as_text(**kwargs) for l in (self.gradients, self.update))

  def compile(self, compiler_options: dict | None = None) -> CompiledPhases:
    """Both programs compiled at once: the gradient program on a worker thread, the update
    program (traced and lowered here if it was not yet) on this one; XLA releases Python's lock
    while it compiles."""
    kwargs = {"compiler_options": compiler_options} if compiler_options else {}
    seconds = {}

    def timed(name, lowered):
      t0 = time.perf_counter()
      out = lowered().compile(**kwargs)
      seconds[name] = time.perf_counter() - t0
      return out

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
      gradients = pool.submit(timed, "gradients", lambda: self.gradients)
      update = timed("update", lambda: self.update)
      gradients = gradients.result()
    seconds["wall"] = time.perf_counter() - t0
    return CompiledPhases(gradients, update, seconds)


class TracedPhases:
  """The gradient program traced, and the update program's trace (it needs only the gradient
  program's output shapes) deferred to when it is lowered; `lower()` lowers the gradient
  program."""

  def __init__(self, gradients, trace_update: Callable[[], Any]):
    self.gradients = gradients
    self.trace_update = trace_update

  def lower(self, **kwargs) -> LoweredPhases:
    return LoweredPhases(self.gradients.lower(**kwargs),
                         lambda: self.trace_update().lower(**kwargs))


def passing_state(gradients: Callable) -> Callable:
  """`gradients(state, batch) -> StepGradients` as `(state, batch) -> (state, StepGradients)`:
  the gradient program hands the state it was given on to the update program."""
  def gradients_passing_state(state, batch):
    return state, gradients(state, batch)
  return gradients_passing_state


class PhasedStep:
  """`(state, batch) -> (state, metrics)` as a gradient program and an update program.

  gradients: `passing_state(phases.gradients)` under `jax.jit` (explicit shardings, the state
  donated); update: `phases.update` under `jax.jit` (the state donated); out_shardings: the
  gradient program's output shardings (the state's, the `StepGradients`'), which the update
  program is traced against. Compiled executables are kept per argument signature (tree
  structure, shapes and dtypes), as `jax.jit` keeps its own."""

  def __init__(self, gradients, update, out_shardings):
    self.gradients, self.update = gradients, update
    self.out_shardings = out_shardings
    self._compiled: dict[tuple, CompiledPhases] = {}

  def trace(self, state, batch) -> TracedPhases:
    traced = self.gradients.trace(state, batch)
    state_like, grads_like = jax.tree.map(
        lambda o, sh: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=sh),
        traced.out_info, self.out_shardings)
    return TracedPhases(traced, lambda: self.update.trace(state_like, grads_like))

  def lower(self, state, batch, **kwargs) -> LoweredPhases:
    return self.trace(state, batch).lower(**kwargs)

  def __call__(self, state, batch):
    key = argument_signature((state, batch))
    compiled = self._compiled.get(key)
    if compiled is None:
      compiled = self._compiled[key] = self.lower(state, batch).compile()
    return compiled(state, batch)


__all__ = ["CompiledPhases", "LoweredPhases", "PhasedStep", "TracedPhases", "passing_state"]
