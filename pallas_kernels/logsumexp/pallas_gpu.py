"""`op.logsumexp_and_pick` as one Pallas-Triton (GPU) kernel: one read of the logits.

XLA computes log Σ exp(x) over a row as two reductions (the maximum, then Σ exp(x − max) with
the target pick fused in), so the head loss reads each chunk's fp32 logits [rows, V] twice before
the pass that forms their gradient. A variadic XLA reduction carrying (max, Σ exp) reads them
once but evaluates two exponentials per element in its combiner and turns compute-bound
(benchmarks/train_step.md). Here a program walks `rows` rows in blocks of `block_v` columns and
keeps, per row, the running maximum m, the running sum s of exp(x − m) (rescaled by
exp(m_old − m_new) when the maximum grows: one exponential per element, one per row and block)
and the picked target logit. With interpret=True it runs on CPU (tests).

Semantics match the XLA path for finite logits and for −inf entries (a row of −inf only gives
lse = −inf); a +inf logit gives lse = +inf.
"""

from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import launch

F32 = jnp.float32
_MIN_BLOCK_V = 128


@dataclasses.dataclass(frozen=True)
class Settings:
  """Launch parameters. Validated on construction."""
  rows: int = 1           # rows per program, at most (a power of two dividing the row count)
  block_v: int = 4096     # columns per loop step, at most (a power of two dividing V, >= 128)
  num_warps: int = 4      # 1, 2, 4, 8 or 16
  num_stages: int = 3     # Triton's software pipelining of the column loop's loads

  def __post_init__(self):
    owner = "logsumexp pallas_gpu"
    launch.require_pow2(owner, "rows", self.rows)
    launch.require_pow2(owner, "block_v", self.block_v, _MIN_BLOCK_V)
    launch.require_warps(owner, "num_warps", self.num_warps)
    if not 1 <= self.num_stages <= 8:
      raise ValueError(f"{owner}: num_stages must lie in [1, 8], got {self.num_stages!r}")


SETTINGS = Settings()


def configured(**overrides):
  """Context manager: SETTINGS with these fields replaced for a block (`launch.swapped`)."""
  return launch.swapped(sys.modules[__name__], overrides)


def supports(num_rows: int, vocab: int, dtype) -> bool:
  """Whether the kernel takes [num_rows, vocab] logits of `dtype`: a float dtype, V divisible by
  a power of two >= 128, at least one row."""
  return (num_rows > 0 and jnp.issubdtype(jnp.dtype(dtype), jnp.floating) and
          launch.largest_pow2_divisor(vocab, SETTINGS.block_v) >= _MIN_BLOCK_V)


def logsumexp_and_pick(logits_nv: jax.Array, targets_n: jax.Array, *, interpret: bool = False):
  """(lse [N], picked [N]) fp32 for logits [N, V] and int targets [N] (op.py)."""
  n, v = logits_nv.shape
  if not supports(n, v, logits_nv.dtype) or targets_n.shape != (n,):
    raise ValueError(f"logsumexp pallas_gpu: needs float logits [N, V] with V a multiple of "
                     f"{_MIN_BLOCK_V} and targets [N], got {logits_nv.shape} {logits_nv.dtype} "
                     f"and {targets_n.shape}")
  s = SETTINGS
  rows = launch.largest_pow2_divisor(n, s.rows)
  block_v = launch.largest_pow2_divisor(v, s.block_v)
  steps = v // block_v

  def kernel(targets_ref, logits_ref, lse_ref, picked_ref):
    t = targets_ref[...][:, None]                                   # [rows, 1]
    cols = lax.broadcasted_iota(jnp.int32, (rows, block_v), 1)

    def step(j, carry):
      m, total, picked = carry
      x = logits_ref[:, pl.ds(j * block_v, block_v)].astype(F32)  # [rows, block_v]
      m_new = jnp.maximum(m, jnp.max(x, axis=1, keepdims=True))
      shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)          # no (−inf) − (−inf)
      total = total * jnp.exp(m - shift) + jnp.sum(jnp.exp(x - shift), axis=1, keepdims=True)
      hit = cols == t - j * block_v
      picked = picked + jnp.sum(jnp.where(hit, x, 0.0), axis=1, keepdims=True)
      return m_new, total, picked

    start = (jnp.full((rows, 1), -jnp.inf, F32), jnp.zeros((rows, 1), F32),
             jnp.zeros((rows, 1), F32))
    m, total, picked = lax.fori_loop(0, steps, step, start)
    shift = jnp.where(jnp.isfinite(m), m, 0.0)
    lse_ref[...] = (shift + jnp.log(total))[:, 0]
    picked_ref[...] = picked[:, 0]

  from jax.experimental.pallas import triton as plgpu
  return pl.pallas_call(
      kernel, grid=(n // rows,),
      in_specs=[pl.BlockSpec((rows,), lambda i: (i,)),
                pl.BlockSpec((rows, v), lambda i: (i, 0))],         # columns walked in the kernel
      out_specs=[pl.BlockSpec((rows,), lambda i: (i,)), pl.BlockSpec((rows,), lambda i: (i,))],
      out_shape=[jax.ShapeDtypeStruct((n,), F32), jax.ShapeDtypeStruct((n,), F32)],
      compiler_params=plgpu.CompilerParams(num_warps=s.num_warps, num_stages=s.num_stages),
      interpret=interpret, name="logsumexp_and_pick",
  )(targets_n.astype(jnp.int32), logits_nv)
