"""Quantile Balancing's order statistics in pure JAX: radix selection over the floats' bits.

Every order statistic here is found by radix selection on the order-preserving uint32 image of
the floats (`kth_largest_per_column`): 32 / digit_bits rounds, each counting per column the
elements at or above the candidate digits. A token axis sharded over devices then costs one
[E, 2^digit_bits − 1] all-reduce per round, never a gather of the [T, E] margins, and the result
equals a sort's bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import platform


def default_bisection_unroll() -> int | bool:
  """All selection rounds unrolled on GPUs (on an H200, 4 bits per round, a loop of 8 takes 5 %
  longer at 64 experts and 19 % at 896: benchmarks/qb_bisection.md), a loop elsewhere: on CPU
  the unrolled rounds multiply the step's compile time for no run-time gain. Same bits either
  way."""
  return True if platform.current() == "gpu" else 1


def default_digit_bits() -> int:
  """Bits of the order statistic fixed per selection round (32 / bits rounds): 4 on GPUs (on an
  H200 one QB call over 8,192 tokens takes 150 µs instead of 276 µs with 1 bit at 64 experts,
  745 instead of 1,065 µs at 896; benchmarks/qb_bisection.md), 1 elsewhere (on CPU the wider
  compares cost more than the rounds they save). Same bits for every choice."""
  return 4 if platform.current() == "gpu" else 1


def ordered_uint32(x: jax.Array) -> jax.Array:
  """fp32 → uint32 with the same order (−inf smallest): flip negatives, offset the sign."""
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
  key = jnp.where(bits >= 0, bits, bits ^ jnp.int32(0x7FFFFFFF))
  return jax.lax.bitcast_convert_type(key ^ jnp.int32(-0x80000000), jnp.uint32)


def from_ordered_uint32(u: jax.Array) -> jax.Array:
  """The inverse of `ordered_uint32`."""
  key = jax.lax.bitcast_convert_type(u, jnp.int32) ^ jnp.int32(-0x80000000)
  bits = jnp.where(key >= 0, key, key ^ jnp.int32(0x7FFFFFFF))
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def kth_largest_per_column(x_te: jax.Array, k: jax.Array, *, unroll: int | bool = True,
                           digit_bits: int = 1) -> jax.Array:
  """[E]: the (k+1)-th largest value of each column of x_te [T, E] (k dynamic, 0 ≤ k < T).

  Radix selection on the order-preserving uint32 image of the floats: keep the largest threshold
  u with #{t : x_te ≥ u} ≥ k + 1, fixing `digit_bits` bits of u per round (32 / digit_bits
  rounds, most significant first). A round counts, per column, the elements at or above each of
  the 2^digit_bits − 1 non-zero candidate digits and keeps the largest digit whose count reaches
  k + 1 (counts fall as the digit grows). Rounds need only per-column counts, so a token axis
  sharded over devices costs one [E, 2^digit_bits − 1] all-reduce per round; the answer is an
  element of the column (NaN-free input assumed), equal to sorting. `unroll` rounds run per loop
  iteration (True: all unrolled, no loop). Every (unroll, digit_bits) gives the same bits.
  """
  if digit_bits not in (1, 2, 4, 8):
    raise ValueError(f"digit_bits must be 1, 2, 4 or 8 (a divisor of 32 up to 8), got {digit_bits}")
  rounds = 32 // digit_bits
  u_te = ordered_uint32(x_te)
  need = (k + 1).astype(jnp.int32)
  digits_d = jnp.arange(1, 2 ** digit_bits, dtype=jnp.uint32)           # candidate digits, 0 excluded

  def one_digit(i, ans_e):                   # digit i of `rounds`, most significant first
    shift = (32 - digit_bits * (i + 1)).astype(jnp.uint32)
    cand_ed = ans_e[:, None] | jnp.left_shift(digits_d, shift)[None, :]
    count_ed = jnp.sum(u_te[:, :, None] >= cand_ed[None], axis=0, dtype=jnp.int32)
    digit_e = jnp.sum(count_ed >= need, axis=1, dtype=jnp.int32).astype(jnp.uint32)
    return ans_e | jnp.left_shift(digit_e, shift)

  ans_e = jax.lax.fori_loop(0, rounds, one_digit, jnp.zeros((x_te.shape[1],), jnp.uint32),
                            unroll=unroll)
  return from_ordered_uint32(ans_e)


def margin_quantile(scores_te, bias_e, real_t, top_k: int, q, *,
                    unroll: int | bool | None = None, digit_bits: int | None = None):
  """reference.margin_quantile's contract: the (q+1)-th largest margin over real tokens per
  expert, margins against the (k+1)-th largest biased score per token. The cutoff is XLA's
  top_k; the quantile is `kth_largest_per_column` (unroll, digit_bits: None for the defaults)."""
  if unroll is None:
    unroll = default_bisection_unroll()
  if digit_bits is None:
    digit_bits = default_digit_bits()
  cutoff_t = jax.lax.top_k(scores_te + bias_e, top_k + 1)[0][:, top_k]
  margin_te = jnp.where(real_t[:, None], scores_te - cutoff_t[:, None], -jnp.inf)  # padding last
  return kth_largest_per_column(margin_te, q, unroll=unroll, digit_bits=digit_bits)
