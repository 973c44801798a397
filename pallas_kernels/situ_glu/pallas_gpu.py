"""SiTU-GLU as two Pallas-Triton (GPU) kernels, forward and backward.

The leading axes of g and u are one axis of N rows and the hidden units one axis of F; a program
covers `rows` × `cols` of them (grid (N / rows, F / cols)). In fp32, with t = tanh(g/β₁),
σ = σ(g), gate = β₁·t·σ, up = β₂·tanh(u/β₂) (u when β₂ is None) and r the row scale (1 if none):

  forward   h = gate · up · r, rounded once to g's dtype;
  backward  dg = dh·r · up · ((1 − t²)·σ + β₁·t·σ·(1 − σ)),
            du = dh·r · gate · (1 − tanh²(u/β₂))   (dh·r·gate when β₂ is None),
            dr = Σ_f dh · gate · up, as per-program partial sums [F / cols, N] that the caller adds;
            optionally h as well (`with_h`: for an op whose backward needs h and dh together).

The backward reads g, u, dh (and r) once and recomputes every term in registers. Under XLA the
same maths writes autodiff's fp32 residuals tanh(g/β₁) and tanh(u/β₂) in the rematerialised
forward and reads them back in a second pass (benchmarks/situ_glu.md). With interpret=True the
kernels run on CPU (tests).
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
_DTYPES = tuple(jnp.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32))


@dataclasses.dataclass(frozen=True)
class Settings:
  """Launch parameters. Validated on construction."""
  rows: int = 64        # rows per program, at most (a power of two dividing N is taken)
  cols: int = 256       # hidden units per program, at most (a power of two dividing F is taken)
  num_warps: int = 4    # 1, 2, 4, 8 or 16

  def __post_init__(self):
    launch.require_pow2("situ_glu pallas_gpu", "rows", self.rows, launch.MIN_BLOCK_ROWS)
    launch.require_pow2("situ_glu pallas_gpu", "cols", self.cols, launch.MIN_BLOCK_COLS)
    launch.require_warps("situ_glu pallas_gpu", "num_warps", self.num_warps)


SETTINGS = Settings()


def configured(**overrides):
  """Context manager: SETTINGS with these fields replaced for a block (`launch.swapped`)."""
  return launch.swapped(sys.modules[__name__], overrides)


def tiles(num_rows: int, hidden: int, settings: Settings | None = None) -> tuple[int, int] | None:
  """(rows, cols) of one program for N = num_rows rows and F = hidden units, or None when N has
  no power-of-two divisor of 8 or more or F none of 16 or more (Triton blocks are powers of two)."""
  settings = settings or SETTINGS
  return launch.block_2d(num_rows, hidden, settings.rows, settings.cols)


def supports(num_rows: int, hidden: int, dtype) -> bool:
  """Whether the kernels take N = num_rows rows of F = hidden units in this dtype."""
  return jnp.dtype(dtype) in _DTYPES and tiles(num_rows, hidden) is not None


def checked_tiles(g, settings: Settings | None = None) -> tuple[int, int]:
  """tiles() for g [..., F], or a ValueError naming the shape or dtype."""
  if jnp.dtype(g.dtype) not in _DTYPES:
    raise ValueError(f"situ_glu pallas_gpu: g has dtype {g.dtype}; the kernels take bfloat16, "
                     "float16 or float32 (use backend 'xla' for other dtypes)")
  hidden = g.shape[-1]
  tile = tiles(g.size // max(hidden, 1), hidden, settings or SETTINGS)
  if tile is None:
    raise ValueError(f"situ_glu pallas_gpu: {g.size // max(hidden, 1)} rows × F = {hidden} hidden "
                     "units do not tile into power-of-two blocks (>= 8 rows, >= 16 units)")
  return tile


# ---------------------------------------------------------------------------------------------
# Kernel bodies.

def _terms(g, u, beta: float, linear_beta: float | None):
  """fp32 (t = tanh(g/β₁), σ(g), gate, tanh(u/β₂) or None, up) for fp32 g and u."""
  t = jnp.tanh(g / beta)
  sig = 1.0 / (1.0 + jnp.exp(-g))
  gate = beta * t * sig
  if linear_beta is None:
    return t, sig, gate, None, u
  tu = jnp.tanh(u / linear_beta)
  return t, sig, gate, tu, linear_beta * tu


def _forward_kernel(*refs, beta: float, linear_beta: float | None, scaled: bool):
  if scaled:
    g_ref, u_ref, r_ref, h_ref = refs
  else:
    (g_ref, u_ref, h_ref), r_ref = refs, None
  _, _, gate, _, up = _terms(g_ref[...].astype(F32), u_ref[...].astype(F32), beta, linear_beta)
  h = gate * up
  if scaled:
    h = h * r_ref[...][:, None]
  h_ref[...] = h.astype(h_ref.dtype)


def _backward_kernel(*refs, beta: float, linear_beta: float | None, scaled: bool,
                     with_h: bool):
  refs = list(refs)
  h_ref = refs.pop() if with_h else None
  if scaled:
    g_ref, u_ref, dh_ref, r_ref, dg_ref, du_ref, dr_ref = refs
  else:
    (g_ref, u_ref, dh_ref, dg_ref, du_ref), r_ref = refs, None
  t, sig, gate, tu, up = _terms(g_ref[...].astype(F32), u_ref[...].astype(F32), beta,
                                linear_beta)
  dh = dh_ref[...].astype(F32)
  if with_h:
    h = gate * up
    h_ref[...] = (h * r_ref[...][:, None] if scaled else h).astype(h_ref.dtype)
  if scaled:
    dr_ref[...] = jnp.sum(dh * gate * up, axis=1)
    dh = dh * r_ref[...][:, None]
  dgate = (1.0 - t * t) * sig + beta * t * sig * (1.0 - sig)
  dg_ref[...] = (dh * up * dgate).astype(dg_ref.dtype)
  dup = dh * gate if tu is None else dh * gate * (1.0 - tu * tu)
  du_ref[...] = dup.astype(du_ref.dtype)


# ---------------------------------------------------------------------------------------------
# Launchers.

def _compiler_params(interpret: bool, settings: Settings):
  if interpret:
    return None
  from jax.experimental.pallas import triton as plgpu
  return plgpu.CompilerParams(num_warps=settings.num_warps, num_stages=1)


def _specs(rows: int, cols: int, scaled: bool, n_arrays: int):
  """BlockSpecs of n_arrays [N, F] operands, then (if scaled) the row scale [N]."""
  block = pl.BlockSpec((rows, cols), lambda i, j: (i, j))
  specs = [block] * n_arrays
  if scaled:
    specs.append(pl.BlockSpec((rows,), lambda i, j: (i,)))
  return specs


# Jitted with shapes and settings static: every MoE layer calls the kernels at the same shapes
# (forward, recompute, backward), and jax lowers each once and calls it from every site.
@functools.partial(jax.jit, static_argnames=("beta", "linear_beta", "interpret", "settings"))
def forward(g, u, row_scale, *, beta: float, linear_beta: float | None, interpret: bool = False,
            settings: Settings | None = None):
  """h [..., F] in g's dtype (xla.situ_glu's contract); row_scale [...] or None."""
  settings = settings or SETTINGS
  rows, cols = checked_tiles(g, settings)
  f = g.shape[-1]
  n = g.size // f
  scaled = row_scale is not None
  operands = [g.reshape(n, f), u.reshape(n, f)]
  if scaled:
    operands.append(row_scale.reshape(n).astype(F32))
  kernel = functools.partial(_forward_kernel, beta=beta, linear_beta=linear_beta, scaled=scaled)
  h = pl.pallas_call(kernel, grid=(n // rows, f // cols), in_specs=_specs(rows, cols, scaled, 2),
                     out_specs=pl.BlockSpec((rows, cols), lambda i, j: (i, j)),
                     out_shape=jax.ShapeDtypeStruct((n, f), g.dtype), interpret=interpret,
                     compiler_params=_compiler_params(interpret, settings),
                     name="situ_glu_forward")(*operands)
  return h.reshape(g.shape)


@functools.partial(jax.jit, static_argnames=("beta", "linear_beta", "interpret", "settings",
                                             "with_h"))
def backward(g, u, dh, row_scale, *, beta: float, linear_beta: float | None,
             interpret: bool = False, settings: Settings | None = None, with_h: bool = False):
  """(dg in g's dtype, du in u's dtype, d_row_scale fp32 [...] or None) for the cotangent dh;
  with_h: (h, dg, du, d_row_scale), the forward's h written by the same pass."""
  settings = settings or SETTINGS
  rows, cols = checked_tiles(g, settings)
  f = g.shape[-1]
  n = g.size // f
  scaled = row_scale is not None
  operands = [g.reshape(n, f), u.reshape(n, f), dh.reshape(n, f)]
  out_shape = [jax.ShapeDtypeStruct((n, f), g.dtype), jax.ShapeDtypeStruct((n, f), u.dtype)]
  out_specs = [pl.BlockSpec((rows, cols), lambda i, j: (i, j))] * 2
  if scaled:
    operands.append(row_scale.reshape(n).astype(F32))
    out_shape.append(jax.ShapeDtypeStruct((f // cols, n), F32))
    out_specs.append(pl.BlockSpec((None, rows), lambda i, j: (j, i)))
  if with_h:
    out_shape.append(jax.ShapeDtypeStruct((n, f), g.dtype))
    out_specs.append(pl.BlockSpec((rows, cols), lambda i, j: (i, j)))
  kernel = functools.partial(_backward_kernel, beta=beta, linear_beta=linear_beta, scaled=scaled,
                             with_h=with_h)
  # dg overwrites dh where they match (each program reads its dh block before writing dg's):
  # the backward then needs one new [N, F] buffer, not two.
  aliases = {2: 0} if dh.dtype == g.dtype else {}
  outs = pl.pallas_call(kernel, grid=(n // rows, f // cols),
                        in_specs=_specs(rows, cols, scaled, 3), out_specs=out_specs,
                        out_shape=out_shape, input_output_aliases=aliases, interpret=interpret,
                        compiler_params=_compiler_params(interpret, settings),
                        name="situ_glu_backward")(*operands)
  dg, du = outs[0].reshape(g.shape), outs[1].reshape(u.shape)
  dr = jnp.sum(outs[2], axis=0).reshape(row_scale.shape) if scaled else None
  if with_h:
    return outs[-1].reshape(g.shape), dg, du, dr
  return dg, du, dr
