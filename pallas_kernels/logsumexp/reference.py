"""float64 oracle of `op.logsumexp_and_pick`, in numpy."""

from __future__ import annotations

import numpy as np


def logsumexp_and_pick(logits, targets):
  """(lse [...], picked [...]) in float64 for logits [..., V] and integer targets [...]: lse the
  log of Σ_v exp(logits[..., v]); picked = logits[..., t] for t in [0, V), else 0."""
  x = np.asarray(logits, np.float64)
  t = np.asarray(targets).astype(np.int64)
  m = np.max(x, axis=-1, keepdims=True)
  m = np.where(np.isfinite(m), m, 0.0)
  with np.errstate(divide="ignore"):
    lse = np.log(np.sum(np.exp(x - m), axis=-1)) + m[..., 0]
  inside = (t >= 0) & (t < x.shape[-1])
  picked = np.take_along_axis(x, np.clip(t, 0, x.shape[-1] - 1)[..., None], axis=-1)[..., 0]
  return lse, np.where(inside, picked, 0.0)
