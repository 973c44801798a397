"""Seeded host-side perturbation of model parameters for tests that need values off their
initialisation (zero queries, unit gains and zero biases would hide wiring mistakes)."""

import jax
import numpy as np


def perturbed(x: jax.Array, rng: np.random.Generator, scale: float) -> np.ndarray:
  """x + scale · (std(x) + 0.1) · N(0, 1), fp32 on the host. Drawn with NumPy: a jitted
  jax.random map over a model's few hundred leaves costs ~10 s of compile per call on CPU."""
  v = np.asarray(x, np.float32)
  return v + np.float32(scale) * (v.std(dtype=np.float32) + np.float32(0.1)) * \
      rng.standard_normal(v.shape, np.float32)
