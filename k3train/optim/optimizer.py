"""The optimizer built from the `optim` config section: AdamW everywhere, or per-head Muon for
matrices with AdamW for the rest; global-norm clipping; warmup + cosine or warmup-stable-decay.

The schedule reads optax's own step counter, so a restored optimizer state resumes mid-schedule.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import optax

from k3train.optim import schedules
from k3train.optim.muon import ADAMW_NO_DECAY
from k3train.tree_paths import path_names



def learning_rate_schedule(o: ml_collections.ConfigDict, steps: int) -> optax.Schedule:
  """Warmup + cosine or warmup-stable-decay (optim.schedule) over `steps`, ending at min_lr_ratio × peak.

  A run shorter than its warmup warms up over the whole run.
  """
  warmup = min(o.warmup_steps, steps)
  if o.schedule == "wsd":
    return schedules.warmup_stable_decay(o.learning_rate, warmup, steps, o.wsd_decay_fraction,
                                         o.min_lr_ratio)
  return schedules.warmup_cosine(o.learning_rate, warmup, steps, o.min_lr_ratio)


def decay_mask(params):
  """True for parameters that get weight decay: matrices other than `muon.ADAMW_NO_DECAY`."""
  def keep(path, leaf):
    names = path_names(path)
    return leaf.ndim >= 2 and not any(n in ADAMW_NO_DECAY for n in names[-2:])
  return jax.tree_util.tree_map_with_path(keep, params)


def is_router_weight(names) -> bool:
  """The MoE router's [d, E] weight (its path ends in router/weight)."""
  return len(names) >= 2 and names[-2:] == ("router", "weight")


def scale_router_updates(factor: float) -> optax.GradientTransformation:
  """Multiplies the router weight's final update by `factor` (its learning-rate factor: weight
  decay included), leaving every other leaf's update as it is."""
  def update(updates, state, params=None):
    del params
    scaled = jax.tree_util.tree_map_with_path(
        lambda path, u: u * factor if is_router_weight(tuple(path_names(path))) else u, updates)
    return scaled, state
  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def make_optimizer(cfg: ml_collections.ConfigDict, params_like=None) -> optax.GradientTransformation:
  """The optax chain for `cfg.optim` over `cfg.train.steps` steps.

  `params_like` (the parameter tree, shapes suffice) is needed for Muon, whose per-head /
  per-expert / whole-matrix partition is derived from parameter paths.
  """
  o = cfg.optim
  base = _base_optimizer(cfg, params_like)
  if o.router_lr_factor == 1.0:
    return base
  return optax.chain(base, scale_router_updates(o.router_lr_factor))


def _base_optimizer(cfg: ml_collections.ConfigDict, params_like) -> optax.GradientTransformation:
  o = cfg.optim
  schedule = learning_rate_schedule(o, cfg.train.steps)
  if o.optimizer == "muon":
    if params_like is None:
      raise ValueError("optim.optimizer='muon' needs params_like to derive the per-head partition")
    from k3train.optim.muon import make_muon_optimizer
    return make_muon_optimizer(
        learning_rate=schedule, params_like=params_like, weight_decay=o.weight_decay,
        momentum=o.muon_momentum, rms_scale=o.muon_update_rms, adam_b1=o.adam_b1, adam_b2=o.adam_b2,
        adam_eps=o.adam_eps, adam_mu_dtype=o.adam_mu_dtype, grad_clip_norm=o.grad_clip_norm,
        ns_dtype=o.muon_ns_dtype)
  clip = [optax.clip_by_global_norm(o.grad_clip_norm)] if o.grad_clip_norm > 0 else []
  return optax.chain(
      *clip,
      optax.adamw(schedule, b1=o.adam_b1, b2=o.adam_b2, eps=o.adam_eps,
                  mu_dtype=jnp.dtype(o.adam_mu_dtype), weight_decay=o.weight_decay,
                  mask=decay_mask),
  )
