"""The backward of an AttnRes site as one Pallas-Triton (GPU) kernel.

XLA runs the backward of a site as several fusions: row reductions g · v_i, a column reduction
for ∂L/∂w fused with the elementwise source gradients, then adds into the stream's cotangents,
and it touches every slot of the block buffer whether it is valid or not. This kernel does the
whole site in two passes over its rows:

  pass 1  ∂L/∂π_i = g · v_i for every source i (row sums over d, chunk by chunk);
  pass 2  ∂L/∂v_i = π_i g + c_i w − e_i v_i added in place into the incoming cotangent of the
          block slot (input_output_aliases) or of the partial sum, and a per-program partial of
          ∂L/∂w = Σ_i c_i v_i, summed over programs afterwards.

A slot whose weight π is 0 for a row (an empty slot: its score is −∞) is neither read nor
written for that row (masked loads and stores), so the kernel's traffic grows with the valid
block count, not with the buffer size. Grid: one program per `rows` rows of B·T; d in chunks of
`chunk`. With interpret=True the same kernel runs on CPU (tests).
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import launch
from pallas_kernels.attnres import xla

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Settings:
  """Launch parameters (measured in benchmarks/attnres.md). Validated on construction."""
  rows: int = 16        # rows of B·T per program (power of two)
  chunk: int = 256      # columns of d per step (power of two >= 16; smaller when d needs it)
  num_warps: int = 4    # 1, 2, 4, 8 or 16

  def __post_init__(self):
    launch.require_pow2("attnres pallas_gpu", "rows", self.rows)
    launch.require_pow2("attnres pallas_gpu", "chunk", self.chunk, 16)
    launch.require_warps("attnres pallas_gpu", "num_warps", self.num_warps)


SETTINGS = Settings()


def configured(**overrides):
  """Context manager: SETTINGS with these fields replaced for a block (`launch.swapped`)."""
  return launch.swapped(sys.modules[__name__], overrides)


def chunk_for(d: int, settings: Settings | None = None) -> int | None:
  """The d-chunk the kernel uses for width d: `settings.chunk` or the largest power of two below
  it that divides d (at least 16); None when there is none."""
  c = (settings or SETTINGS).chunk
  while c >= 16:
    if d % c == 0:
      return c
    c //= 2
  return None


def supports(num_rows: int, d: int, settings: Settings | None = None) -> bool:
  """Whether the kernel tiles B·T = num_rows rows of width d."""
  settings = settings or SETTINGS
  return num_rows % settings.rows == 0 and chunk_for(d, settings) is not None


def _slot(i: int):
  """A static slot index as a traced int32 (masked loads and stores index with arrays)."""
  return jnp.int32(i)


def _kernel(blocks_ref, p_ref, g_ref, probs_ref, r_ref, s_ref, w_ref, ct_blocks_ref, ct_p_ref,
            ct_blocks_out, ct_p_out, dw_out, *, num_slots: int, rows: int, chunk: int, d: int):
  """One program: rows [row0, row0 + rows) of every source; see the module docstring."""
  from jax.experimental.pallas import triton as plgpu
  del ct_blocks_ref                              # aliased with ct_blocks_out
  program = pl.program_id(0)
  rs = pl.ds(pl.multiple_of(program * rows, rows), rows)
  n = num_slots
  probs = [probs_ref[i, rs] for i in range(n + 1)]
  r = [r_ref[i, rs] for i in range(n + 1)]
  s = [s_ref[i, rs] for i in range(n + 1)]
  masks = [jnp.broadcast_to((probs[i] != 0.0)[:, None], (rows, chunk)) for i in range(n)]

  def columns(k):
    return pl.ds(pl.multiple_of(k * chunk, chunk), chunk)

  def source(i, cs):
    """Source i at rows × columns cs in fp32; empty-slot rows are not read (zeros)."""
    if i == n:
      return p_ref[rs, cs].astype(F32)
    return plgpu.load(blocks_ref.at[_slot(i), rs, cs], mask=masks[i], other=0).astype(F32)

  def pass1(k, dprobs):
    cs = columns(k)
    g = g_ref[rs, cs].astype(F32)
    return tuple(dp + jnp.sum(g * source(i, cs), axis=1) for i, dp in enumerate(dprobs))

  dprobs = jax.lax.fori_loop(0, d // chunk, pass1,
                             tuple(jnp.zeros((rows,), F32) for _ in range(n + 1)))
  c, e = xla.score_coefficients(probs, dprobs, r, s, d)

  def pass2(k, carry):
    cs = columns(k)
    g = g_ref[rs, cs].astype(F32)
    w = w_ref[cs][None, :]
    dw = jnp.zeros((chunk,), F32)
    for i in range(n + 1):
      v = source(i, cs)
      grad = probs[i][:, None] * g + c[i][:, None] * w - e[i][:, None] * v
      dw = dw + jnp.sum(c[i][:, None] * v, axis=0)
      if i < n:
        ct = plgpu.load(ct_blocks_out.at[_slot(i), rs, cs], mask=masks[i], other=0).astype(F32)
        plgpu.store(ct_blocks_out.at[_slot(i), rs, cs], (ct + grad).astype(ct_blocks_out.dtype),
                    mask=masks[i])
      else:
        ct_p_out[rs, cs] = (ct_p_ref[rs, cs].astype(F32) + grad).astype(ct_p_out.dtype)
    dw_out[program, cs] = dw
    return carry

  jax.lax.fori_loop(0, d // chunk, pass2, 0)


def mix_backward(blocks_nbtd, p_btd, w_d, stats, g_btd, ct_blocks_nbtd, ct_p_btd, *,
                 interpret: bool = False, settings: Settings | None = None):
  """xla.mix_backward's contract: (ct_blocks + ∂L/∂blocks, ct_p + ∂L/∂p, ∂L/∂w [d] fp32), the
  block cotangent updated in place. `settings`: SETTINGS when None."""
  settings = settings or SETTINGS
  n, b, t, d = blocks_nbtd.shape
  if not supports(b * t, d, settings):
    raise ValueError(f"attnres pallas_gpu: B·T = {b * t} rows of width d = {d} do not tile "
                     f"into {settings.rows}-row programs and power-of-two d-chunks")
  return _launch(blocks_nbtd, p_btd, w_d, stats, g_btd, ct_blocks_nbtd, ct_p_btd,
                 interpret=interpret, settings=settings)


# Jitted with its settings static: a step calls the kernel at the same shapes from every site,
# and jax lowers it once per shape and calls it from each.
@functools.partial(jax.jit, static_argnames=("interpret", "settings"))
def _launch(blocks_nbtd, p_btd, w_d, stats, g_btd, ct_blocks_nbtd, ct_p_btd, *, interpret: bool,
            settings: Settings):
  n, b, t, d = blocks_nbtd.shape
  num_rows = b * t
  chunk = chunk_for(d, settings)
  rows = settings.rows
  probs, r, s = (x.reshape(n + 1, num_rows).astype(F32) for x in stats)
  flat = lambda x: x.reshape(x.shape[:-3] + (num_rows, d))
  programs = num_rows // rows
  kernel = functools.partial(_kernel, num_slots=n, rows=rows, chunk=chunk, d=d)
  compiler_params = None
  if not interpret:
    from jax.experimental.pallas import triton as plgpu
    compiler_params = plgpu.CompilerParams(num_warps=settings.num_warps, num_stages=1)
  ct_blocks, ct_p, dw_parts = pl.pallas_call(
      kernel, grid=(programs,),
      out_shape=(jax.ShapeDtypeStruct((n, num_rows, d), ct_blocks_nbtd.dtype),
                 jax.ShapeDtypeStruct((num_rows, d), ct_p_btd.dtype),
                 jax.ShapeDtypeStruct((programs, d), F32)),
      input_output_aliases={7: 0}, interpret=interpret, compiler_params=compiler_params,
      name="attnres_mix_backward",
  )(flat(blocks_nbtd), flat(p_btd), flat(g_btd), probs, r, s, w_d.astype(F32),
    flat(ct_blocks_nbtd), flat(ct_p_btd))
  return (ct_blocks.reshape(ct_blocks_nbtd.shape), ct_p.reshape(ct_p_btd.shape),
          jnp.sum(dw_parts, axis=0))
