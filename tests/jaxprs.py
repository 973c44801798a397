"""Counting primitives in a jaxpr, the jaxprs nested in its equations (jit, scan, remat,
custom_vjp, cond) included: for tests that check what a program computes, not its values."""

from __future__ import annotations

import collections

import jax
from jax.extend import core as jcore


def _equations(jaxpr):
  """Every equation of `jaxpr` and of the jaxprs nested in its equations' parameters."""
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      for sub in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(sub, jcore.ClosedJaxpr):
          yield from _equations(sub.jaxpr)
        elif isinstance(sub, jcore.Jaxpr):
          yield from _equations(sub)


def primitive_counts(fn, *args) -> collections.Counter:
  """name → number of equations of that primitive in make_jaxpr(fn)(*args), nested ones too."""
  return collections.Counter(eqn.primitive.name
                             for eqn in _equations(jax.make_jaxpr(fn)(*args).jaxpr))
