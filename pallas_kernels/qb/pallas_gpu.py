"""Quantile Balancing's order statistics as two Pallas-Triton (GPU) kernels.

XLA runs one QB call (xla.margin_quantile) as about thirty kernels: a sort per token for the
top-(k+1) cutoff (most of the call's time at 896 experts), then a count and an update per radix
round. Here it is two kernels:

  rows     one program per `rows` tokens: each token's (k+1)-th largest biased score s + b by
           radix selection over its experts, then its margins s − cutoff (−inf for a padding
           token), written expert-major [E', T] so that the next kernel reads them contiguously;
  columns  one program per expert: the (q+1)-th largest of its T margins by the same radix
           selection, the column held in registers across the rounds (streamed in chunks per
           round when T exceeds `resident` or is not a power of two).

Both select `digit_bits` bits per round (32 / digit_bits rounds; a round counts the elements at
or above each of the 2^digit_bits − 1 candidate digits) on the order-preserving uint32 image of
the floats (xla.ordered_uint32). One bit per round is the default in both: 32 block-wide counts
instead of the 120 of 4-bit rounds, 2.8–2.9× faster per QB call on an H200 at 64 and 896 experts
(benchmarks/qb_bisection.md), where XLA's rounds, a launch per round, favour 4 bits. The answer
is an element of the input and the only arithmetic is s + b and s − cutoff in fp32, as in
xla.py, so the result equals xla.margin_quantile's bit for bit. The
experts are padded to a power of two E' with −inf scores, which top_k < E never selects. With
interpret=True the same kernels run on CPU (tests).
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import launch
from pallas_kernels.qb import xla

F32 = jnp.float32
DIGIT_BITS = (1, 2, 4, 8)     # bits fixed per radix round (32 / bits rounds)


@dataclasses.dataclass(frozen=True)
class Settings:
  """Launch parameters (benchmarks/qb_bisection.md). Validated on construction."""
  rows: int = 32        # tokens per program of the rows kernel (power of two), at most
  row_elements: int = 4096  # ... this many scores (rows × E') per program
  resident: int = 32768 # longest column the columns kernel keeps in registers (power of two)
  chunk: int = 1024     # tokens per step of the columns kernel beyond that (power of two >= 16)
  num_warps: int = 8    # 1, 2, 4, 8 or 16: the rows kernel's, for E' < wide_experts ...
  wide_warps: int = 4   # ... and from wide_experts padded experts on (long rows)
  wide_experts: int = 512       # padded expert count from which the rows kernel takes wide_warps
  digit_bits: int = 1   # bits per radix round of the rows kernel (DIGIT_BITS)
  column_warps: int = 16        # num_warps of the columns kernel
  column_digit_bits: int = 1    # bits per radix round of the columns kernel

  def __post_init__(self):
    launch.require_pow2("qb pallas_gpu", "rows", self.rows)
    if not (launch.is_pow2(self.row_elements) and launch.is_pow2(self.resident)
            and self.resident >= 16):
      raise ValueError(f"qb pallas_gpu: row_elements and resident must be powers of two, got "
                       f"{self.row_elements!r}, {self.resident!r}")
    launch.require_pow2("qb pallas_gpu", "chunk", self.chunk, 16)
    for name in ("num_warps", "wide_warps", "column_warps"):
      launch.require_warps("qb pallas_gpu", name, getattr(self, name))
    for name in ("digit_bits", "column_digit_bits"):
      if getattr(self, name) not in DIGIT_BITS:
        raise ValueError(f"qb pallas_gpu: {name} must be one of {DIGIT_BITS}, got "
                         f"{getattr(self, name)!r}")


SETTINGS = Settings()


def configured(**overrides):
  """Context manager: SETTINGS with these fields replaced for a block (`launch.swapped`)."""
  return launch.swapped(sys.modules[__name__], overrides)


def _padded(num_experts: int) -> int:
  """E', the power of two at or above E that the rows kernel's blocks span."""
  return 1 << max(num_experts - 1, 0).bit_length()


def tiles(num_tokens: int, num_experts: int = 1,
          settings: Settings | None = None) -> tuple[int, int] | None:
  """(rows, chunk) for T = num_tokens tokens and E experts: rows a power of two dividing T with
  rows × E' <= row_elements (and <= the settings' rows); chunk = T when T is a power of two
  <= resident (the column stays in registers: Triton blocks are powers of two), else the largest
  power of two <= the settings' chunk dividing T. None when T has no power-of-two divisor of
  16 or more."""
  settings = settings or SETTINGS
  if launch.largest_pow2_divisor(num_tokens, 16) < 16:
    return None
  row_cap = max(1, min(settings.rows, settings.row_elements // _padded(num_experts)))
  rows = launch.largest_pow2_divisor(num_tokens, row_cap)
  chunk = (num_tokens if launch.is_pow2(num_tokens) and num_tokens <= settings.resident
           else launch.largest_pow2_divisor(num_tokens, settings.chunk))
  return rows, chunk


def supports(num_tokens: int, settings: Settings | None = None) -> bool:
  """Whether the kernels tile T = num_tokens tokens."""
  return tiles(num_tokens, 1, settings) is not None


def keeps_column(num_tokens: int, settings: Settings | None = None) -> bool:
  """Whether the columns kernel holds an expert's T = num_tokens margins in registers (the fast
  form; streaming them every round was slower than XLA: benchmarks/qb_bisection.md)."""
  t = tiles(num_tokens, 1, settings)
  return t is not None and t[1] == num_tokens


def _radix_select(count_at_or_above, need, ans, bits: int):
  """The largest u (uint32, shaped like `ans`, which starts at zeros) with
  count_at_or_above(u) >= need, `bits` bits per round, most significant first. Counts fall as
  the candidate digit grows, so a round's digit is the number of non-zero digits whose count
  reaches `need`."""
  def one_round(r, ans):
    shift = (32 - bits * (r + 1)).astype(jnp.uint32)
    digit = jnp.zeros(jnp.shape(ans), jnp.int32)
    for c in range(1, 2 ** bits):
      cand = ans | jnp.left_shift(jnp.uint32(c), shift)
      digit = digit + (count_at_or_above(cand) >= need).astype(jnp.int32)
    return ans | jnp.left_shift(digit.astype(jnp.uint32), shift)

  return jax.lax.fori_loop(0, 32 // bits, one_round, ans)


def _rows_kernel(scores_ref, bias_ref, real_ref, margins_ref, *, rows: int, need: int, bits: int):
  """Tokens [t0, t0 + rows): cutoffs by radix selection along the experts, then margins."""
  t0 = pl.multiple_of(pl.program_id(0) * rows, rows)
  ts = pl.ds(t0, rows)
  s = scores_ref[ts, :]                                      # [rows, E'] fp32
  u = xla.ordered_uint32(s + bias_ref[...][None, :])

  ans = _radix_select(lambda cand: jnp.sum((u >= cand[:, None]).astype(jnp.int32), axis=1),
                      need, jnp.zeros((rows,), jnp.uint32), bits)
  cutoff = xla.from_ordered_uint32(ans)
  real = real_ref[ts] != 0
  margin = jnp.where(real[:, None], s - cutoff[:, None], -jnp.inf)
  margins_ref[:, ts] = margin.T


def _columns_kernel(margins_ref, need_ref, beta_ref, *, num_tokens: int, chunk: int, bits: int):
  """Expert e: the need-th largest of margins[e, :] by radix selection along the tokens.

  With chunk == num_tokens the column is loaded once and every round counts it in registers;
  otherwise each round streams it in chunks (a serial chain of loads: slower, for long T)."""
  e = pl.program_id(0)
  need = need_ref[0]
  resident = chunk == num_tokens
  column = xla.ordered_uint32(margins_ref[e, :]) if resident else None

  def count_at_or_above(cand):
    if resident:
      return jnp.sum((column >= cand).astype(jnp.int32))

    def one_chunk(c, total):
      u = xla.ordered_uint32(margins_ref[e, pl.ds(pl.multiple_of(c * chunk, chunk), chunk)])
      return total + jnp.sum((u >= cand).astype(jnp.int32))
    return jax.lax.fori_loop(0, num_tokens // chunk, one_chunk, jnp.int32(0))

  ans = _radix_select(count_at_or_above, need, jnp.uint32(0), bits)
  beta_ref[...] = jnp.broadcast_to(xla.from_ordered_uint32(ans), (1,))


def margin_quantile(scores_te, bias_e, real_t, top_k: int, q, *, interpret: bool = False,
                    settings: Settings | None = None):
  """reference.margin_quantile's contract (β [E] fp32), bit-equal to xla.margin_quantile.
  `settings`: SETTINGS when None."""
  settings = settings or SETTINGS
  t, e = scores_te.shape
  if not supports(t, settings):
    raise ValueError(f"qb pallas_gpu: T = {t} tokens have no power-of-two divisor of 16 or "
                     "more to tile by")
  if not 0 <= top_k < e:
    raise ValueError(f"qb pallas_gpu: top_k must lie in [0, E = {e}), got {top_k}")
  return _launch(scores_te, bias_e, real_t, jnp.asarray(q, jnp.int32), top_k=top_k,
                 interpret=interpret, settings=settings)


# Jitted with its settings static: every MoE layer calls it at the same shapes, and jax lowers
# it once per shape and calls it from each.
@functools.partial(jax.jit, static_argnames=("top_k", "interpret", "settings"))
def _launch(scores_te, bias_e, real_t, q, *, top_k: int, interpret: bool, settings: Settings):
  t, e = scores_te.shape
  rows, chunk = tiles(t, e, settings)
  e_pad = _padded(e)
  scores = scores_te.astype(F32)
  bias = bias_e.astype(F32)
  if e_pad != e:
    scores = jnp.pad(scores, ((0, 0), (0, e_pad - e)), constant_values=-jnp.inf)
    bias = jnp.pad(bias, (0, e_pad - e))
  def params(num_warps):
    if interpret:
      return None
    from jax.experimental.pallas import triton as plgpu
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=1)

  margins = pl.pallas_call(
      functools.partial(_rows_kernel, rows=rows, need=top_k + 1, bits=settings.digit_bits),
      grid=(t // rows,), out_shape=jax.ShapeDtypeStruct((e_pad, t), F32), interpret=interpret,
      compiler_params=params(settings.wide_warps if e_pad >= settings.wide_experts
                             else settings.num_warps),
      name="qb_margin_rows",
  )(scores, bias, real_t.reshape(t).astype(jnp.int32))
  need = (q + 1).astype(jnp.int32).reshape(1)
  return pl.pallas_call(
      functools.partial(_columns_kernel, num_tokens=t, chunk=chunk,
                        bits=settings.column_digit_bits), grid=(e,),
      out_shape=jax.ShapeDtypeStruct((e,), F32),
      out_specs=pl.BlockSpec((1,), lambda i: (i,)), interpret=interpret,
      compiler_params=params(settings.column_warps), name="qb_margin_columns",
  )(margins, need)
