"""The row permutations of `dispatch` and `combine`, with gradients that are gathers too.

Autodiff turns a gather into a scatter-add: the gradient of `x_sorted = x[perm // k]` adds each
sorted row's cotangent back onto its token, k rows per token, and on a GPU XLA emits that as an
atomic scatter (slow in bf16, and its order of additions is not fixed). Both directions of a
permutation can be written as gathers instead, because the inverse permutation is known:

  sort_rows:   x_sorted[i] = x[perm[i] // k]
      grad:    dx[t] = Σ_j dx_sorted[inv[t·k + j]]                 (k rows per token, fp32)
  unsort_sum:  y[t] = Σ_j w[t, j] · y_sorted[inv[t·k + j]]          (fp32)
      grads:   dy_sorted[i] = w[pair perm[i]] · dy[perm[i] // k];  dw[t, j] = <y_sorted[inv[t·k+j]], dy[t]>
  unsort_add:  y[t] = Σ_j y_sorted[inv[t·k + j]]                    (fp32; sort_rows' transpose)
      grad:    dy_sorted[i] = dy[perm[i] // k]
  sort_pairs:  w_sorted[i] = w[pair perm[i]]                         (one value per pair)
      grad:    dw[p] = dw_sorted[inv[p]]

inv[p] is the sorted row holding pair p. Every sum is one gather feeding a reduction over the k
axis in fp32: no atomics, so results and gradients are deterministic on every backend.

Each row gather reads its source k times and computes its row index once per element, so both
are materialised first (`_gather_source`, `_token_rows`): left to itself XLA fuses the source's
producer (a norm's backward, a cast) and jnp's floor division into the gather and recomputes
them for every element of every gathered row.

`gather` (GATHERS) picks who copies the rows of the plain row gathers (sort_rows, and the
gradient of unsort_add): "xla" (a gather XLA fuses), "pallas_gpu" (pallas_gpu_rows.py: whole
rows in 16-byte vectors; interpret mode off a GPU) or "auto" (pallas_gpu on a GPU). The values
are the same bits either way; the gathers that feed a reduction (`_sum_pairs`) stay XLA's, which
fuses them into the sum.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import platform
from pallas_kernels.moe import pallas_gpu_rows

GATHERS = ("xla", "pallas_gpu", "auto")


def resolve_gather(gather: str) -> str:
  """"auto": "pallas_gpu" on a GPU, else "xla"; unknown names are refused."""
  if gather not in GATHERS:
    raise ValueError(f"moe row gather: unknown backend {gather!r}; allowed: {', '.join(GATHERS)}")
  if gather == "auto":
    return "pallas_gpu" if platform.current() == "gpu" else "xla"
  return gather


def inverse_permutation(perm_p: jax.Array) -> jax.Array:
  """inv[perm[i]] = i for a permutation perm [P] int32 (an index scatter; no sort)."""
  num = perm_p.shape[0]
  return jnp.zeros((num,), jnp.int32).at[perm_p].set(
      jnp.arange(num, dtype=jnp.int32), unique_indices=True)


def _gather_source(x):
  """x computed and stored once before a gather reads each of its rows k times (an optimization
  barrier: XLA does not fuse x's producer into the gather)."""
  return lax.optimization_barrier(x)


def _token_rows(perm_p, top_k: int):
  """perm[i] // k, the token of sorted row i, as a stored index array. perm is non-negative, so
  truncating division is floor division."""
  return lax.optimization_barrier(lax.div(perm_p, jnp.asarray(top_k, perm_p.dtype)))


def _rows(x, idx, gather: str = "xla"):
  """x[idx] along the first axis. Indices come from a permutation of range(rows): in bounds by
  construction, no fill select."""
  if resolve_gather(gather) == "pallas_gpu" and pallas_gpu_rows.supports(x, idx):
    return pallas_gpu_rows.gather_rows(x, idx, interpret=platform.interpret("gpu"))
  return x.at[idx].get(mode="promise_in_bounds")


def _sum_pairs(y_sorted_pd, inv_p, top_k: int, weights_tk=None) -> jax.Array:
  """Σ_j [w[t, j] ·] y_sorted[inv[t·k + j]] per token, in fp32 → [T, D] (one gather + reduce)."""
  y_tkd = _rows(y_sorted_pd, inv_p).reshape(-1, top_k, y_sorted_pd.shape[-1]).astype(jnp.float32)
  if weights_tk is not None:
    y_tkd = y_tkd * weights_tk.astype(jnp.float32)[:, :, None]
  return jnp.sum(y_tkd, axis=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def sort_rows(x_td: jax.Array, perm_p: jax.Array, top_k: int, gather: str = "xla") -> jax.Array:
  """x_sorted [T·k, D] with x_sorted[i] = x[perm[i] // top_k]."""
  return _rows(_gather_source(x_td), _token_rows(perm_p, top_k), gather)


def _sort_rows_fwd(x_td, perm_p, top_k, gather):
  # A zero-size array carries x's dtype (residuals must be arrays) for the gradient's cast.
  return sort_rows(x_td, perm_p, top_k, gather), (perm_p, jnp.zeros((0,), x_td.dtype))


def _sort_rows_bwd(top_k, gather, residuals, g_sorted_pd):
  perm_p, like = residuals
  dx_td = _sum_pairs(g_sorted_pd, inverse_permutation(perm_p), top_k).astype(like.dtype)
  return dx_td, None


sort_rows.defvjp(_sort_rows_fwd, _sort_rows_bwd)


@jax.custom_vjp
def unsort_sum(y_sorted_pd: jax.Array, weights_tk: jax.Array, perm_p: jax.Array) -> jax.Array:
  """y [T, D] fp32 with y[t] = Σ_j w[t, j] · y_sorted[row of pair (t, j)], summed in fp32."""
  return _unsort_sum_fwd(y_sorted_pd, weights_tk, perm_p)[0]


def _unsort_sum_fwd(y_sorted_pd, weights_tk, perm_p):
  inv_p = inverse_permutation(perm_p)
  return (_sum_pairs(y_sorted_pd, inv_p, weights_tk.shape[1], weights_tk),
          (y_sorted_pd, weights_tk, perm_p, inv_p))


def _unsort_sum_bwd(residuals, dy_td):
  y_sorted_pd, weights_tk, perm_p, inv_p = residuals
  num_tokens, top_k = weights_tk.shape
  dy_td = _gather_source(dy_td.astype(jnp.float32))
  w_p = weights_tk.reshape(-1).astype(jnp.float32)
  d_sorted = _rows(dy_td, _token_rows(perm_p, top_k)) * _rows(w_p, perm_p)[:, None]
  y_tkd = _rows(y_sorted_pd, inv_p).reshape(num_tokens, top_k, -1)
  d_weights = jnp.sum(y_tkd.astype(jnp.float32) * dy_td[:, None, :], axis=-1)
  return d_sorted.astype(y_sorted_pd.dtype), d_weights.astype(weights_tk.dtype), None


unsort_sum.defvjp(_unsort_sum_fwd, _unsort_sum_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def unsort_add(y_sorted_pd: jax.Array, perm_p: jax.Array, top_k: int,
               gather: str = "xla") -> jax.Array:
  """y [T, D] fp32 with y[t] = Σ_j y_sorted[row of pair (t, j)]: the unweighted combine, for rows
  that already carry their pair's weight. Needs no residual but the permutation; `gather` picks
  who copies its gradient's rows."""
  return _sum_pairs(y_sorted_pd, inverse_permutation(perm_p), top_k)


def _unsort_add_fwd(y_sorted_pd, perm_p, top_k, gather):
  return (unsort_add(y_sorted_pd, perm_p, top_k, gather),
          (perm_p, jnp.zeros((0,), y_sorted_pd.dtype)))


def _unsort_add_bwd(top_k, gather, residuals, dy_td):
  perm_p, like = residuals
  # Rounded before the gather (the same values as rounding each gathered row): half the bytes.
  return _rows(_gather_source(dy_td.astype(like.dtype)), _token_rows(perm_p, top_k), gather), None


unsort_add.defvjp(_unsort_add_fwd, _unsort_add_bwd)


@jax.custom_vjp
def sort_pairs(values_tk: jax.Array, perm_p: jax.Array) -> jax.Array:
  """values [T, k] (one per pair) → [T·k] in the sorted row order: out[i] = values[pair perm[i]]."""
  return _rows(values_tk.reshape(-1), perm_p)


def _sort_pairs_fwd(values_tk, perm_p):
  return sort_pairs(values_tk, perm_p), (perm_p, jnp.zeros((0,) + values_tk.shape, values_tk.dtype))


def _sort_pairs_bwd(residuals, g_p):
  perm_p, like = residuals
  shape = like.shape[1:]
  return _rows(g_p, inverse_permutation(perm_p)).reshape(shape).astype(like.dtype), None


sort_pairs.defvjp(_sort_pairs_fwd, _sort_pairs_bwd)
