"""Learning-rate schedules: closed-form values at key steps, monotonicity, resumption from a count.

Schedules compute in fp32, so values are compared against float64 formulas to 1e-6 × peak
(absolute: the decay is peak − drop·f, whose rounding is a few ulp of peak, not of the value).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from k3train.optim.schedules import warmup_cosine, warmup_stable_decay

PEAK, WARMUP, TOTAL, MIN_RATIO, DECAY_FRACTION = 3e-4, 100, 1000, 0.1, 0.2
RTOL = 1e-6
ATOL = 1e-6 * PEAK


def values(schedule, steps):
  return np.asarray(jax.jit(jax.vmap(schedule))(jnp.asarray(steps, jnp.int32)), np.float64)


def cosine_ref(s):
  if s < WARMUP:
    return PEAK * s / WARMUP
  p = min((s - WARMUP) / (TOTAL - WARMUP), 1.0)
  return PEAK * (MIN_RATIO + (1 - MIN_RATIO) * 0.5 * (1 + math.cos(math.pi * p)))


def wsd_ref(s):
  decay_start = TOTAL - round(DECAY_FRACTION * TOTAL)
  if s < WARMUP:
    return PEAK * s / WARMUP
  if s <= decay_start:
    return PEAK
  p = min((s - decay_start) / (TOTAL - decay_start), 1.0)
  return PEAK * (1 - (1 - MIN_RATIO) * p)


SCHEDULES = {
    "cosine": (lambda: warmup_cosine(PEAK, WARMUP, TOTAL, MIN_RATIO), cosine_ref),
    "wsd": (lambda: warmup_stable_decay(PEAK, WARMUP, TOTAL, DECAY_FRACTION, MIN_RATIO), wsd_ref),
}


def test_cosine_key_steps():
  sched = warmup_cosine(PEAK, WARMUP, TOTAL, MIN_RATIO)
  mid = (WARMUP + TOTAL) // 2
  got = values(sched, [0, WARMUP // 2, WARMUP, mid, TOTAL, TOTAL + 500])
  np.testing.assert_allclose(got, [0.0, PEAK / 2, PEAK, PEAK * (1 + MIN_RATIO) / 2,
                                   PEAK * MIN_RATIO, PEAK * MIN_RATIO], rtol=0, atol=ATOL)
  assert float(sched(0)) == 0.0 and float(sched(WARMUP)) == np.float32(PEAK)


def test_wsd_key_steps():
  sched = warmup_stable_decay(PEAK, WARMUP, TOTAL, DECAY_FRACTION, MIN_RATIO)
  decay_start = 800
  got = values(sched, [0, WARMUP // 2, WARMUP, 500, decay_start, 900, TOTAL, TOTAL + 500])
  np.testing.assert_allclose(got, [0.0, PEAK / 2, PEAK, PEAK, PEAK, PEAK * (1 + MIN_RATIO) / 2,
                                   PEAK * MIN_RATIO, PEAK * MIN_RATIO], rtol=0, atol=ATOL)
  assert np.all(values(sched, np.arange(WARMUP, decay_start + 1)) == np.float32(PEAK))  # flat exactly


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_matches_closed_form_everywhere(name):
  make, ref = SCHEDULES[name]
  steps = np.arange(0, TOTAL + 50)
  np.testing.assert_allclose(values(make(), steps), [ref(s) for s in steps], rtol=0, atol=ATOL)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_monotonic(name):
  v = values(SCHEDULES[name][0](), np.arange(0, TOTAL + 50))
  assert np.all(np.diff(v[:WARMUP + 1]) > 0)             # strictly rising warmup
  assert np.all(np.diff(v[WARMUP:]) <= 0)                # never rising afterwards
  assert v.min() == 0.0 and v[WARMUP:].min() == pytest.approx(PEAK * MIN_RATIO, abs=ATOL)


def test_edge_cases():
  no_warmup = warmup_cosine(1.0, 0, 10, 0.0)
  np.testing.assert_allclose(values(no_warmup, [0, 5, 10]), [1.0, 0.5, 0.0], atol=1e-7)
  no_decay = warmup_stable_decay(1.0, 2, 10, 0.0, 0.5)
  np.testing.assert_allclose(values(no_decay, [0, 1, 2, 10, 11]), [0.0, 0.5, 1.0, 1.0, 0.5])
  all_decay = warmup_stable_decay(2.0, 0, 10, 1.0, 0.0)
  np.testing.assert_allclose(values(all_decay, [0, 5, 10]), [2.0, 1.0, 0.0], atol=1e-7)
  with pytest.raises(ValueError, match="overlaps the warmup"):
    warmup_stable_decay(1.0, 50, 100, 0.6, 0.1)
  with pytest.raises(ValueError, match="min_ratio"):
    warmup_cosine(1.0, 10, 100, 1.5)
  with pytest.raises(ValueError, match="warmup_steps"):
    warmup_cosine(1.0, 200, 100, 0.1)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_python_int_and_array_counts_agree(name):
  sched = SCHEDULES[name][0]()
  for s in (0, 37, WARMUP, 731, 950, TOTAL):
    assert float(sched(s)) == float(sched(jnp.int32(s))) == float(sched(np.int64(s)))
    assert float(jax.jit(sched)(jnp.int32(s))) == pytest.approx(float(sched(s)), abs=ATOL)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_resume_from_restored_count(name):
  """An optax optimizer restored mid-run (state round-tripped through numpy, fresh schedule
  object) applies exactly the learning rates of the uninterrupted run."""
  make = SCHEDULES[name][0]
  n, stop = 260, 123

  def run(opt, state, k):
    update = jax.jit(opt.update)
    lrs = []
    for _ in range(k):
      u, state = update(jnp.ones(()), state)  # scale_by_schedule: update = lr(count) × 1
      lrs.append(float(u))
    return lrs, state

  opt = optax.scale_by_schedule(make())
  full, _ = run(opt, opt.init(jnp.zeros(())), n)
  first, state = run(opt, opt.init(jnp.zeros(())), stop)
  saved = jax.tree.map(np.asarray, state)                       # "checkpoint"
  opt2 = optax.scale_by_schedule(make())                        # a new process builds it anew
  restored = jax.tree.map(jnp.asarray, saved)
  second, _ = run(opt2, restored, n - stop)
  assert first + second == full
  assert full[stop] == float(make()(stop))
