"""The optimizer chain: global-norm clipping, AdamW with decoupled weight decay, warmup + cosine.

AdamW everywhere for now; the per-head Muon partition replaces it for matrices (issue: Muon).
The schedule reads optax's own step counter, so a restored optimizer state resumes mid-schedule.
"""

from __future__ import annotations

import jax
import ml_collections
import optax

# Parameter names never weight-decayed: norm gains, gate biases/rates, conv kernels, AttnRes queries.
NO_DECAY_NAMES = ("scale", "A_log", "dt_bias", "q_conv", "k_conv", "v_conv", "query", "norm_scale")


def learning_rate_schedule(t: ml_collections.ConfigDict) -> optax.Schedule:
  """Linear warmup to `learning_rate`, then cosine decay to `min_lr_ratio × learning_rate` at `steps`."""
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=t.learning_rate, warmup_steps=t.warmup_steps,
      decay_steps=max(t.steps, t.warmup_steps + 1), end_value=t.learning_rate * t.min_lr_ratio)


def path_names(path) -> list[str]:
  """Module/attribute names of a pytree path, without nnx.Variable's trailing `.value`."""
  names = []
  for p in path:
    if isinstance(p, jax.tree_util.GetAttrKey) and p.name == "value":
      continue
    names.append(str(getattr(p, "key", getattr(p, "name", getattr(p, "idx", p)))))
  return names


def decay_mask(params):
  """True for parameters that get weight decay: matrices other than NO_DECAY_NAMES."""
  def keep(path, leaf):
    names = path_names(path)
    return leaf.ndim >= 2 and not any(n in NO_DECAY_NAMES for n in names[-2:])
  return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(t: ml_collections.ConfigDict) -> optax.GradientTransformation:
  return optax.chain(
      optax.clip_by_global_norm(t.grad_clip_norm),
      optax.adamw(learning_rate_schedule(t), b1=0.9, b2=0.95, eps=1e-8,
                  weight_decay=t.weight_decay, mask=decay_mask),
  )
