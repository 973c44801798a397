"""benchmarks/newton_schulz.py's step forms: three writings of one bf16 Newton–Schulz step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from k3train.optim import newton_schulz as ns
from tests.benchmarks import scripts


def test_step_forms_are_the_same_iteration():
  """Each form lands within bf16 reach of the fp32 iteration, and the fp32-epilogue chain (one
  rounding per GEMM) is closer to it than the plain steps (measured 1.4e-2 against 1.8e-2)."""
  forms = scripts.load("newton_schulz").step_forms()
  assert set(forms) == {"plain", "scaled_fp32", "scaled_bf16"}
  x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 48, 80)), jnp.float32)
  ref = np.asarray(ns.orthogonalize(x, compute_dtype="float32"))
  err = {name: float(np.linalg.norm(np.asarray(jax.jit(fn)(x)) - ref) / np.linalg.norm(ref))
         for name, fn in forms.items()}
  assert all(e < 7e-2 for e in err.values()), err
  assert err["scaled_fp32"] < err["plain"], err
