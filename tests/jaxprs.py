"""Counting primitives in a jaxpr, the jaxprs nested in its equations (jit, scan, remat,
custom_vjp, cond) included: for tests that check what a program computes, not its values."""

from __future__ import annotations

import collections

import jax
from jax.extend import core as jcore


def primitive_counts(fn, *args) -> collections.Counter:
  """name → number of equations of that primitive in make_jaxpr(fn)(*args), nested ones too."""
  counts: collections.Counter = collections.Counter()

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      counts[eqn.primitive.name] += 1
      for value in eqn.params.values():
        for sub in value if isinstance(value, (list, tuple)) else [value]:
          if isinstance(sub, jcore.ClosedJaxpr):
            walk(sub.jaxpr)
          elif isinstance(sub, jcore.Jaxpr):
            walk(sub)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return counts
