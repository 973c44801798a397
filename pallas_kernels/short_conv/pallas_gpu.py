"""The depthwise causal conv as two Pallas-Triton (GPU) kernels, forward and backward.

The tokens of all rows are one axis of N = B·T rows and the channels one axis of C; a program
covers `rows` tokens × `cols` channels. A tap's tokens are gathered by row index (token − shift
forward, token + shift for the input gradient), masked where the token leaves its sequence or
its document, so the conv reads no padded copy of x.

  forward   y = Σ_s w[W−1−s] · x[t−s], fp32, rounded once to x's dtype;
  backward  dx = Σ_s w[W−1−s] · dy[t+s] (fp32, rounded once) and, per program, the partial
            weight gradient Σ_rows x[t−s] · dy[t] in fp32, summed over programs afterwards.

XLA runs the backward as several multi-output column reductions over the same inputs (the
weight gradient of each tap); here every input element is read once per tap from cache and the
reduction stays in registers. The forward kernel is no faster than XLA's fused elementwise pass
and cannot fuse with the SiLU after it, so the op runs it only with SETTINGS.forward = "kernel"
(benchmarks/short_conv.md). With interpret=True the same kernels run on CPU (tests).
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import launch

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Settings:
  """Launch parameters. Validated on construction."""
  rows: int = 64        # tokens per program, at most (a power of two dividing B·T is taken)
  cols: int = 128       # channels per program, at most (a power of two dividing C is taken)
  num_warps: int = 4    # 1, 2, 4, 8 or 16
  # The forward of the differentiable op: "xla" (xla.py's elementwise pass, which XLA fuses with
  # the SiLU and the projection's output that surround it) or "kernel" (_forward_kernel).
  forward: str = "xla"

  def __post_init__(self):
    launch.require_pow2("short_conv pallas_gpu", "rows", self.rows, launch.MIN_BLOCK_ROWS)
    launch.require_pow2("short_conv pallas_gpu", "cols", self.cols, launch.MIN_BLOCK_COLS)
    launch.require_warps("short_conv pallas_gpu", "num_warps", self.num_warps)
    if self.forward not in ("xla", "kernel"):
      raise ValueError(f"short_conv pallas_gpu: forward must be 'xla' or 'kernel', got "
                       f"{self.forward!r}")


SETTINGS = Settings()


def configured(**overrides):
  """Context manager: SETTINGS with these fields replaced for a block (`launch.swapped`)."""
  return launch.swapped(sys.modules[__name__], overrides)


def tiles(num_rows: int, channels: int, settings: Settings | None = None) -> tuple[int, int] | None:
  """(rows, cols) of one program for N = num_rows tokens and C channels, or None when N has no
  power-of-two divisor of 8 or more or C none of 16 or more (Triton blocks are powers of two)."""
  settings = settings or SETTINGS
  return launch.block_2d(num_rows, channels, settings.rows, settings.cols)


def supports(num_rows: int, channels: int, settings: Settings | None = None) -> bool:
  """Whether the kernels tile N = num_rows tokens × C = channels."""
  return tiles(num_rows, channels, settings) is not None


def _program(rows: int, cols: int, seq_len: int):
  """This program's token indices r [rows], their positions t in the sequence, its first token,
  and its channel indices [cols] (int32)."""
  r0 = pl.multiple_of(pl.program_id(0) * rows, rows)
  c0 = pl.multiple_of(pl.program_id(1) * cols, cols)
  r = r0 + jnp.arange(rows, dtype=jnp.int32)
  return r, r % seq_len, r0, c0 + jnp.arange(cols, dtype=jnp.int32), c0


def _gather(ref, token, ok, channel):
  """ref[token, channel] as fp32 [rows, cols], zeros where `ok` [rows] is false. The token
  indices are in bounds wherever they are read (callers clamp them)."""
  from jax.experimental.pallas import triton as plgpu
  return plgpu.load(ref.at[token[:, None], channel[None, :]], mask=ok[:, None],
                    other=0).astype(F32)


def _forward_kernel(x_ref, seg_ref, w_ref, y_ref, *, rows: int, cols: int, width: int,
                    seq_len: int):
  r, t, r0, channel, c0 = _program(rows, cols, seq_len)
  block, cs = pl.ds(r0, rows), pl.ds(c0, cols)
  seg = seg_ref[block]
  y = x_ref[block, cs].astype(F32) * w_ref[width - 1, cs][None, :]
  for shift in range(1, width):
    src = jnp.maximum(r - shift, 0)
    ok = (t >= shift) & (seg_ref[src] == seg)
    y = y + _gather(x_ref, src, ok, channel) * w_ref[width - 1 - shift, cs][None, :]
  y_ref[block, cs] = y.astype(y_ref.dtype)


def _backward_kernel(x_ref, dy_ref, seg_ref, w_ref, dx_ref, dw_ref, *, rows: int, cols: int,
                     width: int, seq_len: int, num_rows: int):
  r, t, r0, channel, c0 = _program(rows, cols, seq_len)
  block, cs = pl.ds(r0, rows), pl.ds(c0, cols)
  program = pl.program_id(0)
  seg = seg_ref[block]
  dy = dy_ref[block, cs].astype(F32)
  dx = dy * w_ref[width - 1, cs][None, :]
  dw_ref[program, width - 1, cs] = jnp.sum(x_ref[block, cs].astype(F32) * dy, axis=0)
  for shift in range(1, width):
    back = jnp.maximum(r - shift, 0)                 # the token this one reads through the tap
    ok_back = (t >= shift) & (seg_ref[back] == seg)
    dw_ref[program, width - 1 - shift, cs] = jnp.sum(_gather(x_ref, back, ok_back, channel) * dy,
                                                     axis=0)
    ahead = jnp.minimum(r + shift, num_rows - 1)     # the token that reads this one
    ok_ahead = (t + shift < seq_len) & (seg_ref[ahead] == seg)
    dx = dx + _gather(dy_ref, ahead, ok_ahead, channel) * w_ref[width - 1 - shift, cs][None, :]
  dx_ref[block, cs] = dx.astype(dx_ref.dtype)


def _compiler_params(interpret: bool, settings: Settings):
  if interpret:
    return None
  from jax.experimental.pallas import triton as plgpu
  return plgpu.CompilerParams(num_warps=settings.num_warps, num_stages=1)


def _flat(x_btc, w_wc, segment_ids_bt):
  """([N, C] x, [W, C] fp32 w, [N] int32 segment ids)."""
  b, t = x_btc.shape[:2]
  channels = w_wc[0].size
  seg = (jnp.zeros((b, t), jnp.int32) if segment_ids_bt is None
         else segment_ids_bt.astype(jnp.int32))
  return (x_btc.reshape(b * t, channels), w_wc.reshape(w_wc.shape[0], channels).astype(F32),
          seg.reshape(b * t))


def checked_tiles(x_btc, w_wc, settings: Settings | None = None) -> tuple[int, int]:
  """tiles() for x [B, T, C…] and w [W, C…], or a ValueError naming the shapes."""
  b, t = x_btc.shape[:2]
  tile = tiles(b * t, w_wc[0].size, settings or SETTINGS)
  if tile is None:
    raise ValueError(f"short_conv pallas_gpu: B·T = {b * t} tokens × C = {w_wc[0].size} channels "
                     f"do not tile into power-of-two blocks (>= 8 tokens, >= 16 channels)")
  return tile


# Jitted with shapes and settings static: a step calls the kernels at the same shapes from every
# KDA layer (q, k, v; forward, recompute, backward), and jax lowers each once and calls it from
# every site.
@functools.partial(jax.jit, static_argnames=("interpret", "settings"))
def forward(x_btc, w_wc, segment_ids_bt, *, interpret: bool = False,
            settings: Settings | None = None):
  """y [B, T, C…] in x's dtype (xla.causal_conv's contract)."""
  settings = settings or SETTINGS
  rows, cols = checked_tiles(x_btc, w_wc, settings)
  x, w, seg = _flat(x_btc, w_wc, segment_ids_bt)
  n, c = x.shape
  kernel = functools.partial(_forward_kernel, rows=rows, cols=cols, width=w.shape[0],
                             seq_len=x_btc.shape[1])
  y = pl.pallas_call(kernel, grid=(n // rows, c // cols),
                     out_shape=jax.ShapeDtypeStruct((n, c), x.dtype), interpret=interpret,
                     compiler_params=_compiler_params(interpret, settings),
                     name="short_conv_forward")(x, seg, w)
  return y.reshape(x_btc.shape)


@functools.partial(jax.jit, static_argnames=("interpret", "settings"))
def backward(x_btc, dy_btc, w_wc, segment_ids_bt, *, interpret: bool = False,
             settings: Settings | None = None):
  """(dx [B, T, C…] in x's dtype, dw [W, C…] fp32) for the cotangent dy of y."""
  settings = settings or SETTINGS
  rows, cols = checked_tiles(x_btc, w_wc, settings)
  x, w, seg = _flat(x_btc, w_wc, segment_ids_bt)
  dy = dy_btc.reshape(x.shape).astype(x.dtype)
  n, c = x.shape
  width = w.shape[0]
  programs = n // rows
  kernel = functools.partial(_backward_kernel, rows=rows, cols=cols, width=width,
                             seq_len=x_btc.shape[1], num_rows=n)
  dx, dw_parts = pl.pallas_call(
      kernel, grid=(programs, c // cols),
      out_shape=(jax.ShapeDtypeStruct((n, c), x.dtype),
                 jax.ShapeDtypeStruct((programs, width, c), F32)),
      interpret=interpret, compiler_params=_compiler_params(interpret, settings),
      name="short_conv_backward")(x, dy, seg, w)
  return dx.reshape(x_btc.shape), jnp.sum(dw_parts, axis=0).reshape(w_wc.shape)
