"""Row gather out[i] = x[idx[i]] as one Pallas-Triton (GPU) kernel, for the MoE permutations.

The dispatch's gathers (permute.py: the token rows into expert order, and the combine's gradient
rows) are [T·k, D] copies of [T, D] rows. XLA emits a gather as a loop fusion in which every
thread reloads its row index and moves 8 bytes at a time; the optimised HLO of the k3_h200 step
has these at ~2 TB/s on an H200 (benchmarks/train_step.md). Here a program copies `rows` whole
rows: it loads their indices once and moves each row in 16-byte vectors, `cols` columns per
block. With interpret=True it runs on CPU (tests).
"""

from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import launch

_DTYPES = tuple(jnp.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32))


@dataclasses.dataclass(frozen=True)
class Settings:
  """Launch parameters. Validated on construction."""
  rows: int = 16        # rows per program, at most (a power of two dividing the row count)
  cols: int = 1024      # columns per block, at most (a power of two dividing D, >= 16)
  num_warps: int = 4    # 1, 2, 4, 8 or 16

  def __post_init__(self):
    launch.require_pow2("row gather pallas_gpu", "rows", self.rows)
    launch.require_pow2("row gather pallas_gpu", "cols", self.cols, launch.MIN_BLOCK_COLS)
    launch.require_warps("row gather pallas_gpu", "num_warps", self.num_warps)


SETTINGS = Settings()


def configured(**overrides):
  """Context manager: SETTINGS with these fields replaced for a block (`launch.swapped`)."""
  return launch.swapped(sys.modules[__name__], overrides)


def supports(x: jax.Array, idx: jax.Array) -> bool:
  """Whether the kernel takes x [N, D] and idx [P]: a float dtype it handles, D divisible by a
  power of two >= 16, an integer index vector."""
  return (x.ndim == 2 and idx.ndim == 1 and jnp.dtype(x.dtype) in _DTYPES and
          jnp.issubdtype(idx.dtype, jnp.integer) and x.shape[0] > 0 and idx.shape[0] > 0 and
          launch.largest_pow2_divisor(x.shape[1], SETTINGS.cols) >= launch.MIN_BLOCK_COLS)


def gather_rows(x_nd: jax.Array, idx_p: jax.Array, *, interpret: bool = False) -> jax.Array:
  """out [P, D] with out[i] = x[idx[i]]; every idx must lie in [0, N) (not checked: the MoE
  permutations guarantee it, and an index outside reads outside x)."""
  if not supports(x_nd, idx_p):
    raise ValueError(f"row gather pallas_gpu: needs x [N, D] in {[str(d) for d in _DTYPES]} "
                     f"with D a multiple of {launch.MIN_BLOCK_COLS} and idx [P] int, got x "
                     f"{x_nd.shape} {x_nd.dtype} and idx {idx_p.shape} {idx_p.dtype}")
  s = SETTINGS
  n, d = x_nd.shape
  p = idx_p.shape[0]
  rows = launch.largest_pow2_divisor(p, s.rows)
  cols = launch.largest_pow2_divisor(d, s.cols)

  def kernel(idx_ref, x_ref, out_ref):
    src = idx_ref[...]                                             # [rows] source row numbers
    for c in range(d // cols):
      out_ref[:, pl.ds(c * cols, cols)] = x_ref[src, pl.ds(c * cols, cols)]

  from jax.experimental.pallas import triton as plgpu
  return pl.pallas_call(
      kernel, grid=(p // rows,),
      in_specs=[pl.BlockSpec((rows,), lambda i: (i,)),
                pl.BlockSpec((n, d), lambda i: (0, 0))],              # rows picked in the kernel
      out_specs=pl.BlockSpec((rows, d), lambda i: (i, 0)),
      out_shape=jax.ShapeDtypeStruct((p, d), x_nd.dtype),
      compiler_params=plgpu.CompilerParams(num_warps=s.num_warps),
      interpret=interpret, name="moe_gather_rows",
  )(idx_p.astype(jnp.int32), x_nd)
