"""Learning-rate schedules as optax schedules: plain functions of the optimizer's step count.

Both depend on nothing but the count (no hidden state), so an optimizer restored from a
checkpoint mid-run continues exactly where it stopped. Values are computed in fp32 from the
integer count (exact for counts below 2^24); each is written as `peak − drop·f(progress)` with
host-side constants, so it is exactly `peak` at the warmup end and through the stable phase; the
absolute error is a few ulp of `peak` (eager and jitted evaluation may differ by that much, e.g.
in cos; one program evaluated at one count is deterministic, which is what resumption needs).

warmup_cosine(peak, warmup_steps, total_steps, min_ratio):
    s < W:        peak · s / W                                   (0 at step 0, as optax's warmup)
    W ≤ s ≤ N:    peak · (r + (1 − r) · ½ (1 + cos(π (s − W) / (N − W))))
    s > N:        peak · r

warmup_stable_decay(peak, warmup_steps, total_steps, decay_fraction, min_ratio):
    D = round(decay_fraction · N) decay steps (Python round), decay start S0 = N − D (must be ≥ W)
    s < W:        peak · s / W
    W ≤ s ≤ S0:   peak
    S0 ≤ s ≤ N:   peak · (1 − (1 − r) (s − S0) / D)              (linear decay, not 1−sqrt)
    s > N:        peak · r
with W = warmup_steps, N = total_steps, r = min_ratio. With N = W (cosine) or D = 0 (wsd) there
is no decay phase: the value stays at peak through step N and is peak · r from step N + 1.
"""

from __future__ import annotations

import jax.numpy as jnp
import optax


def _check(peak, warmup_steps, total_steps, min_ratio) -> None:
  if peak < 0:
    raise ValueError(f"peak must be >= 0, got {peak}")
  if warmup_steps < 0 or total_steps < warmup_steps:
    raise ValueError(f"need 0 <= warmup_steps <= total_steps, got {warmup_steps}, {total_steps}")
  if not 0.0 <= min_ratio <= 1.0:
    raise ValueError(f"min_ratio must lie in [0, 1], got {min_ratio}")


def _warmup(step, peak: float, warmup_steps: int):
  # One multiply by a host-side constant (XLA may reorder `peak * step / W` under jit).
  return step * (peak / max(warmup_steps, 1))


def warmup_cosine(peak: float, warmup_steps: int, total_steps: int, min_ratio: float) -> optax.Schedule:
  """Linear warmup 0 → peak over `warmup_steps`, cosine decay to `min_ratio · peak` at `total_steps`."""
  _check(peak, warmup_steps, total_steps, min_ratio)
  peak, min_ratio = float(peak), float(min_ratio)
  inv_decay_len = 1.0 / max(total_steps - warmup_steps, 1)
  half_drop = peak * (1.0 - min_ratio) * 0.5

  def schedule(count):
    step = jnp.asarray(count, jnp.float32)
    progress = jnp.clip((step - warmup_steps) * inv_decay_len, 0.0, 1.0)
    cosine = peak - half_drop * (1.0 - jnp.cos(jnp.pi * progress))   # exactly `peak` at s = W
    return jnp.where(step < warmup_steps, _warmup(step, peak, warmup_steps), cosine)

  return schedule


def warmup_stable_decay(peak: float, warmup_steps: int, total_steps: int, decay_fraction: float,
                        min_ratio: float) -> optax.Schedule:
  """Linear warmup, constant `peak`, then linear decay to `min_ratio · peak` over the last
  `decay_fraction` of `total_steps` (D = round(decay_fraction · total_steps) steps)."""
  _check(peak, warmup_steps, total_steps, min_ratio)
  if not 0.0 <= decay_fraction <= 1.0:
    raise ValueError(f"decay_fraction must lie in [0, 1], got {decay_fraction}")
  decay_steps = int(round(decay_fraction * total_steps))
  decay_start = total_steps - decay_steps
  if decay_start < warmup_steps:
    raise ValueError(f"the decay ({decay_steps} steps from {decay_start}) overlaps the warmup "
                     f"({warmup_steps} steps); lower decay_fraction or warmup_steps")
  peak, min_ratio = float(peak), float(min_ratio)
  inv_decay_steps, drop = 1.0 / max(decay_steps, 1), peak * (1.0 - min_ratio)

  def schedule(count):
    step = jnp.asarray(count, jnp.float32)
    progress = jnp.clip((step - decay_start) * inv_decay_steps, 0.0, 1.0)
    stable_decay = peak - drop * progress
    return jnp.where(step < warmup_steps, _warmup(step, peak, warmup_steps), stable_decay)

  return schedule
