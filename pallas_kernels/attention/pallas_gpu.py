"""The "pallas_gpu" backend: Pallas-Triton flash-attention kernels with document-aware block
skipping, emitting the per-row max logit from the forward's own online softmax.

Three kernels, in the native [B, T, H, ·] layout (BlockSpecs squeeze B and H, so no transposes):
* forward, grid (query blocks, B, H): one query block against the key blocks lo ≤ j < hi of
  tiles.key_block_schedule (only tiles whose segment-id ranges meet and that are not above the
  causal diagonal); online softmax in fp32; writes out, the logsumexp and the row max of the
  masked logits — the exact max logit of the row, so max_logit needs no pass of its own.
* dK/dV, grid (key blocks, B, H): loops over the query blocks of tiles.query_block_schedule,
  recomputing P = exp(S − lse); dV += Pᵀ dO, dS = P ⊙ (dO Vᵀ − Δ), dK += dSᵀ Q. By default
  its tiles are keys × queries (Sᵀ = K Qᵀ), so every dot takes its register operand as it is.
* dQ, grid (query blocks, B, H): the forward's key blocks again; dQ += dS K.
Δ = rowsum(dO ⊙ O) is one fused XLA elementwise-reduce. The masks use −inf (never a finite
stand-in), so a row's running max is exactly the largest allowed logit, and rows with no allowed
key give out 0, lse −inf and zero gradients. A fourth kernel (row_max_pallas_gpu) is the
forward's tiles without softmax or values: the max-logit pass of the cudnn backend.

Per pair the kernels do little besides the two (forward) or four (backward) tile dots, so the
elementwise work between them counts. The mask (segment-id and causal comparisons, a select) is
applied under a branch only on the tiles that are not full (tiles.py: a document's edges and
the diagonal), and the exponentials are base 2 with the scale and log2(e) folded into one
multiply-add, P = 2^(c·(Q·K) − log2(e)·lse), c = scale · log2(e) (libdevice's expf wraps
the same ex2 instruction in a range reduction).

Head dims need not be powers of two: a dim D (a multiple of 16, ≤ 256) is split into
power-of-two parts (192 = 128 + 64) that are separate BlockSpec views of the same array, so
Q·Kᵀ is a sum of per-part dots and nothing is padded or copied. Sequence lengths are padded to a
multiple of the largest block with padding rows that see nothing (q_last = −1) and padding keys
past every q_last.

Dot operands are the inputs' dtype (bf16/f16 on tensor cores, fp32 at full precision) with fp32
accumulation; P and dS are cast to that dtype before their dots. fp32 inputs use FP32_CONFIG
(smaller tiles, one stage: fp32 tiles take twice the shared memory). With interpret=True the
same kernels run on CPU (tests); their lowering to Triton for CUDA is also checked on CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.attention import tiles
from pallas_kernels.attention.vjp import differentiable_attention

F32 = jnp.float32
LOG2_E = 1.4426950408889634                # log2(e): exp(x) = 2^(x · log2(e))
_DTYPES = tuple(jnp.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32))
MAX_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True)
class Config:
  """Block sizes (powers of two ≥ 16) and Triton launch settings of the three kernels.

  Defaults: from the settings sweeps at Dk192 Dv128 bf16 (benchmarks/attention.md): B1 H32
  T 8192 with 4 documents and 1, and B4 H16 T 4096 (the k3_h200 step's shape). On an H100, with
  the mask applied only to the tiles that need it: the forward's 128 × 128 tiles in 2 stages
  took 7–9 % off the forward against 128 × 64 in 3 (1 % on an H200 before that masking change),
  and the dK/dV kernel in keys-as-rows form with 64 keys × 32 queries took 15–17 % off the
  forward + backward against the queries-as-rows form with 32 keys × 64 queries, at all three
  shapes. Each was the fastest setting measured.
  """
  block_q: int = 128        # forward: query rows per program
  block_k: int = 128        # forward: keys per loop step
  fwd_warps: int = 8
  fwd_stages: int = 2       # 3 stages of 128 × 128 tiles exceed the SM's shared memory
  dkv_block_q: int = 32     # dK/dV: query rows per loop step
  dkv_block_k: int = 64     # dK/dV: keys per program
  dkv_warps: int = 4
  dkv_stages: int = 3
  # dK/dV in keys-as-rows form: Sᵀ = K Qᵀ computed directly, so Pᵀ·dO and dSᵀ·Q take their
  # register operand untransposed. wgmma (Hopper's asynchronous tensor-core dot) wants that and
  # 64 rows per warpgroup, hence 64 keys per program with 4 warps (one warpgroup). The
  # queries-as-rows form (False) runs those two dots as mma.sync; FP32_CONFIG keeps it.
  dkv_keys_as_rows: bool = True
  dq_block_q: int = 64      # dQ: query rows per program
  dq_block_k: int = 32      # dQ: keys per loop step
  dq_warps: int = 4
  dq_stages: int = 3

  def __post_init__(self):
    for f in dataclasses.fields(self):
      val = getattr(self, f.name)
      if f.name.endswith(("block_q", "block_k")):
        if not (isinstance(val, int) and val >= 16 and val & (val - 1) == 0):
          raise ValueError(f"attention pallas_gpu: {f.name} must be a power of two >= 16, "
                           f"got {val!r}")
      elif f.name.endswith("warps") and val not in (1, 2, 4, 8, 16):
        raise ValueError(f"attention pallas_gpu: {f.name} must be 1, 2, 4, 8 or 16, got {val!r}")
      elif f.name.endswith("stages") and val not in (1, 2, 3, 4, 5):
        raise ValueError(f"attention pallas_gpu: {f.name} must be 1..5, got {val!r}")
      elif f.name == "dkv_keys_as_rows" and not isinstance(val, bool):
        raise ValueError(f"attention pallas_gpu: dkv_keys_as_rows must be a bool, got {val!r}")

  @property
  def query_multiple(self) -> int:
    return max(self.block_q, self.dkv_block_q, self.dq_block_q)

  @property
  def key_multiple(self) -> int:
    return max(self.block_k, self.dkv_block_k, self.dq_block_k)


CONFIG = Config()
# fp32 operands take twice the shared memory per tile: smaller tiles, no software pipelining.
FP32_CONFIG = Config(block_q=64, block_k=32, fwd_warps=4, fwd_stages=1, dkv_block_q=32,
                     dkv_block_k=32, dkv_warps=4, dkv_stages=1, dkv_keys_as_rows=False,
                     dq_block_q=32, dq_block_k=32, dq_warps=4, dq_stages=1)


def config_for(dtype) -> Config:
  """CONFIG for 16-bit inputs, FP32_CONFIG for fp32."""
  return FP32_CONFIG if jnp.dtype(dtype).itemsize == 4 else CONFIG


@contextlib.contextmanager
def configured(**overrides):
  """Inside the block, Config(**overrides) (fields not named keep their defaults) is the
  configuration for every dtype (CONFIG and FP32_CONFIG): benchmarks and tests."""
  global CONFIG, FP32_CONFIG
  saved = CONFIG, FP32_CONFIG
  CONFIG = FP32_CONFIG = dataclasses.replace(Config(), **overrides)
  try:
    yield CONFIG
  finally:
    CONFIG, FP32_CONFIG = saved


def supports(dk: int, dv: int, dtype) -> bool:
  """Whether the kernels take these head dims and this dtype."""
  return (dk % 16 == 0 and dv % 16 == 0 and 0 < dk <= MAX_HEAD_DIM and 0 < dv <= MAX_HEAD_DIM
          and dtype is not None and jnp.dtype(dtype) in _DTYPES)


def check_supported(dk: int, dv: int, dtype) -> None:
  if not (dk % 16 == 0 and 0 < dk <= MAX_HEAD_DIM):
    raise ValueError(f"attention[pallas_gpu]: q and k head dim Dk must be a multiple of 16 and "
                     f"<= {MAX_HEAD_DIM}, got {dk}")
  if not (dv % 16 == 0 and 0 < dv <= MAX_HEAD_DIM):
    raise ValueError(f"attention[pallas_gpu]: v head dim Dv must be a multiple of 16 and "
                     f"<= {MAX_HEAD_DIM}, got {dv}")
  if jnp.dtype(dtype) not in _DTYPES:
    raise ValueError(f"attention[pallas_gpu]: q has dtype {dtype}; the kernels take bfloat16, "
                     "float16 or float32 (use 'xla' or 'reference' for float64)")


def head_parts(d: int) -> tuple[tuple[int, int], ...]:
  """((offset, size), ...): d (a multiple of 16) as descending powers of two; each offset is a
  multiple of its size, so a part is block `offset // size` of a BlockSpec of width `size`."""
  parts, offset = [], 0
  for bit in reversed(range(d.bit_length())):
    size = 1 << bit
    if d & size:
      parts.append((offset, size))
      offset += size
  return tuple(parts)


# ---------------------------------------------------------------------------------------------
# Kernel bodies.

def _precision(dtype):
  return lax.Precision.HIGHEST if jnp.dtype(dtype) == F32 else None


def _mm(a, b, dtype):
  """a [M, K] @ b [K, N], operands in `dtype`, fp32 accumulation."""
  return lax.dot_general(a.astype(dtype), b.astype(dtype), (((1,), (0,)), ((), ())),
                         preferred_element_type=F32, precision=_precision(dtype))


def _mm_nt(a, b, dtype):
  """a [M, K] @ b[N, K]ᵀ → [M, N]."""
  return lax.dot_general(a.astype(dtype), b.astype(dtype), (((1,), (1,)), ((), ())),
                         preferred_element_type=F32, precision=_precision(dtype))


def _mm_tn(a, b, dtype):
  """a[K, M]ᵀ @ b [K, N] → [M, N]."""
  return lax.dot_general(a.astype(dtype), b.astype(dtype), (((0,), (0,)), ((), ())),
                         preferred_element_type=F32, precision=_precision(dtype))


def _dots_nt(a_parts, b_parts, dtype):
  """A Bᵀ [rows of A, rows of B] in fp32, summed over the head-dim parts: the unscaled logits
  Q Kᵀ (or K Qᵀ), and dO Vᵀ (or V dOᵀ)."""
  s = None
  for a, b in zip(a_parts, b_parts):
    d = _mm_nt(a, b, dtype)
    s = d if s is None else s + d
  return s


def _allowed(seg_q, last_q, seg_k, start_k, block_k):
  """[rows, keys] bool: same segment and key index start_k + c ≤ q_last of the row."""
  cols = start_k + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
  return (seg_q[:, None] == seg_k[None, :]) & (cols <= last_q[:, None])


def _split(refs, counts):
  out, i = [], 0
  for n in counts:
    out.append(refs[i:i + n])
    i += n
  return out


def _masked_outside(full_lo, full_hi, tile, x, mask):
  """mask(x) on a tile outside the full run full_lo ≤ tile < full_hi, x itself inside it
  (tiles.py: every pair there is allowed). The branch is uniform over the program, so the loop
  stays one software-pipelined loop and only the tiles that need the mask pay for it."""
  outside = (tile < full_lo) | (tile >= full_hi)
  return lax.cond(outside, mask, lambda x: x, x)


def _fwd_kernel(lo_ref, full_lo_ref, full_hi_ref, hi_ref, qseg_ref, qlast_ref, kseg_ref, *refs,
                nkp, nvp, scale, block_k, dtype):
  """One query block: out parts, lse and row max (see module doc).

  The running max is kept of the unscaled dots Q·K (scale > 0 keeps the order, and scale · max is
  exactly the max of the scaled logits), and the exponentials are base 2: p = 2^(c·d − c·m) with
  c = scale · log2(e), one multiply-add and one exp2 per pair."""
  q_refs, k_refs, v_refs, o_refs, (lse_ref, m_ref) = _split(refs, (nkp, nkp, nvp, nvp, 2))
  bq = qseg_ref.shape[0]
  c = scale * LOG2_E
  q_parts = [r[...] for r in q_refs]
  seg_q, last_q = qseg_ref[...], qlast_ref[...]
  full_lo, full_hi = full_lo_ref[()], full_hi_ref[()]

  def step(j, carry):
    accs, m_q, l_q = carry
    start = pl.multiple_of(j * block_k, block_k)
    keys = pl.ds(start, block_k)
    d = _dots_nt(q_parts, [r[keys, :] for r in k_refs], dtype)
    seg_k = kseg_ref[keys]
    d = _masked_outside(full_lo, full_hi, j, d, lambda d: jnp.where(
        _allowed(seg_q, last_q, seg_k, start, block_k), d, -jnp.inf))
    m_new = jnp.maximum(m_q, jnp.max(d, axis=1))
    cm = c * jnp.where(m_new == -jnp.inf, 0.0, m_new)   # row empty so far: exps stay finite
    alpha = jnp.exp2(c * m_q - cm)
    p = jnp.exp2(d * c - cm[:, None])
    l_q = l_q * alpha + jnp.sum(p, axis=1)
    accs = tuple(a * alpha[:, None] + _mm(p, r[keys, :], dtype) for a, r in zip(accs, v_refs))
    return accs, m_new, l_q

  init = (tuple(jnp.zeros((bq, r.shape[-1]), F32) for r in o_refs),
          jnp.full((bq,), -jnp.inf, F32), jnp.zeros((bq,), F32))
  accs, m_q, l_q = lax.fori_loop(lo_ref[()], hi_ref[()], step, init)
  empty = l_q == 0.0
  inv_l = 1.0 / jnp.where(empty, 1.0, l_q)
  for o_ref, acc in zip(o_refs, accs):
    o_ref[...] = (acc * inv_l[:, None]).astype(o_ref.dtype)
  row_max = m_q * scale
  lse_ref[...] = jnp.where(empty, -jnp.inf, row_max + jnp.log(jnp.where(empty, 1.0, l_q)))
  m_ref[...] = row_max


def _row_max_kernel(lo_ref, full_lo_ref, full_hi_ref, hi_ref, qseg_ref, qlast_ref, kseg_ref,
                    *refs, nkp, scale, block_k, dtype):
  """One query block: only the row max of the masked logits (no softmax, no values)."""
  q_refs, k_refs, (m_ref,) = _split(refs, (nkp, nkp, 1))
  bq = qseg_ref.shape[0]
  q_parts = [r[...] for r in q_refs]
  seg_q, last_q = qseg_ref[...], qlast_ref[...]
  full_lo, full_hi = full_lo_ref[()], full_hi_ref[()]

  def step(j, m_q):
    start = pl.multiple_of(j * block_k, block_k)
    keys = pl.ds(start, block_k)
    d = _dots_nt(q_parts, [r[keys, :] for r in k_refs], dtype)
    seg_k = kseg_ref[keys]
    d = _masked_outside(full_lo, full_hi, j, d, lambda d: jnp.where(
        _allowed(seg_q, last_q, seg_k, start, block_k), d, -jnp.inf))
    return jnp.maximum(m_q, jnp.max(d, axis=1))

  m_q = lax.fori_loop(lo_ref[()], hi_ref[()], step, jnp.full((bq,), -jnp.inf, F32))
  m_ref[...] = m_q * scale


def _probs(d, lse2, c):
  """P = 2^(c·d − lse2) = exp(scale·d − lse) for every pair (the caller zeroes the pairs not
  allowed). lse2 = log2(e) · lse, with rows of lse −inf (no allowed key) taken as 0."""
  return jnp.exp2(d * c - lse2[:, None])


def _lse2(lse):
  """log2(e) · lse, rows without keys (−inf) as 0 (their P is masked to 0)."""
  return jnp.where(lse == -jnp.inf, 0.0, lse * LOG2_E)


def _dkv_kernel(lo_ref, full_lo_ref, full_hi_ref, hi_ref, qseg_ref, qlast_ref, kseg_ref, lse_ref,
                delta_ref, *refs, nkp, nvp, scale, block_q, keys_as_rows, dtype):
  """One key block: dK, dV over the query blocks lo ≤ i < hi (tiles oriented by keys_as_rows)."""
  q_refs, k_refs, v_refs, do_refs, dk_refs, dv_refs = _split(refs, (nkp, nkp, nvp, nvp, nkp, nvp))
  bk = kseg_ref.shape[0]
  c = scale * LOG2_E
  start_k = pl.program_id(0) * bk
  k_parts = [r[...] for r in k_refs]
  v_parts = [r[...] for r in v_refs]
  seg_k = kseg_ref[...]
  full_lo, full_hi = full_lo_ref[()], full_hi_ref[()]
  keys_k1 = start_k + lax.broadcasted_iota(jnp.int32, (bk, 1), 0)

  def step(i, carry):
    dks, dvs = carry
    rows = pl.ds(pl.multiple_of(i * block_q, block_q), block_q)
    q_parts = [r[rows, :] for r in q_refs]
    do_parts = [r[rows, :] for r in do_refs]
    seg_q, last_q = qseg_ref[rows], qlast_ref[rows]
    lse2, delta = _lse2(lse_ref[rows]), delta_ref[rows]
    if keys_as_rows:                         # [keys, queries] tiles: Pᵀ, dPᵀ, dSᵀ
      p = jnp.exp2(_dots_nt(k_parts, q_parts, dtype) * c - lse2[None, :])
      p = _masked_outside(full_lo, full_hi, i, p, lambda p: jnp.where(
          (seg_k[:, None] == seg_q[None, :]) & (keys_k1 <= last_q[None, :]), p, 0.0))
      dvs = tuple(a + _mm(p, do, dtype) for a, do in zip(dvs, do_parts))
      ds = p * (_dots_nt(v_parts, do_parts, dtype) - delta[None, :])
      dks = tuple(a + _mm(ds, q, dtype) for a, q in zip(dks, q_parts))
    else:                                    # [queries, keys] tiles: P, dP, dS
      p = _probs(_dots_nt(q_parts, k_parts, dtype), lse2, c)
      p = _masked_outside(full_lo, full_hi, i, p, lambda p: jnp.where(
          _allowed(seg_q, last_q, seg_k, start_k, bk), p, 0.0))
      dvs = tuple(a + _mm_tn(p, do, dtype) for a, do in zip(dvs, do_parts))
      ds = p * (_dots_nt(do_parts, v_parts, dtype) - delta[:, None])
      dks = tuple(a + _mm_tn(ds, q, dtype) for a, q in zip(dks, q_parts))
    return dks, dvs

  init = (tuple(jnp.zeros((bk, r.shape[-1]), F32) for r in dk_refs),
          tuple(jnp.zeros((bk, r.shape[-1]), F32) for r in dv_refs))
  dks, dvs = lax.fori_loop(lo_ref[()], hi_ref[()], step, init)
  for r, a in zip(dk_refs, dks):
    r[...] = (a * scale).astype(r.dtype)
  for r, a in zip(dv_refs, dvs):
    r[...] = a.astype(r.dtype)


def _dq_kernel(lo_ref, full_lo_ref, full_hi_ref, hi_ref, qseg_ref, qlast_ref, kseg_ref, lse_ref,
               delta_ref, *refs, nkp, nvp, scale, block_k, dtype):
  """One query block: dQ over the key blocks lo ≤ j < hi."""
  q_refs, k_refs, v_refs, do_refs, dq_refs = _split(refs, (nkp, nkp, nvp, nvp, nkp))
  c = scale * LOG2_E
  q_parts = [r[...] for r in q_refs]
  do_parts = [r[...] for r in do_refs]
  seg_q, last_q = qseg_ref[...], qlast_ref[...]
  lse2, delta = _lse2(lse_ref[...]), delta_ref[...]
  full_lo, full_hi = full_lo_ref[()], full_hi_ref[()]

  def step(j, dqs):
    start = pl.multiple_of(j * block_k, block_k)
    keys = pl.ds(start, block_k)
    k_parts = [r[keys, :] for r in k_refs]
    d = _dots_nt(q_parts, k_parts, dtype)
    seg_k = kseg_ref[keys]
    p = _probs(d, lse2, c)
    p = _masked_outside(full_lo, full_hi, j, p, lambda p: jnp.where(
        _allowed(seg_q, last_q, seg_k, start, block_k), p, 0.0))
    ds = p * (_dots_nt(do_parts, [r[keys, :] for r in v_refs], dtype) - delta[:, None])
    return tuple(a + _mm(ds, k, dtype) for a, k in zip(dqs, k_parts))

  init = tuple(jnp.zeros((r.shape[0], r.shape[-1]), F32) for r in dq_refs)
  dqs = lax.fori_loop(lo_ref[()], hi_ref[()], step, init)
  for r, a in zip(dq_refs, dqs):
    r[...] = (a * scale).astype(r.dtype)


# ---------------------------------------------------------------------------------------------
# Launchers (inputs already padded to the block multiples).

def _params(warps, stages, interpret):
  return None if interpret else plgpu.CompilerParams(num_warps=warps, num_stages=stages)


def _tile_map(part):
  return lambda i, b, h: (b, i, h, part)


def _column_map(part):
  return lambda i, b, h: (b, 0, h, part)


def _tiled(rows, parts):
  """BlockSpecs of `rows` tokens × each head-dim part, token block = grid axis 0."""
  return [pl.BlockSpec((None, rows, None, size), _tile_map(off // size)) for off, size in parts]


def _whole(t, parts):
  """BlockSpecs of the whole sequence × each head-dim part of one (batch, head)."""
  return [pl.BlockSpec((None, t, None, size), _column_map(off // size)) for off, size in parts]


def _part_outputs(x_shape, parts, dtype):
  return [jax.ShapeDtypeStruct(x_shape[:3] + (size,), dtype) for _, size in parts]


def _part_out_specs(rows, parts):
  return [pl.BlockSpec((None, rows, None, size), lambda i, b, h: (b, i, h, 0))
          for _, size in parts]


def _join(outs):
  return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=3)


_SCALAR = pl.BlockSpec((None, None), lambda i, b, h: (b, i))


def _row_stats_spec(rows):
  return pl.BlockSpec((None, None, rows), lambda i, b, h: (b, h, i))


def _whole_stats_spec(t):
  return pl.BlockSpec((None, None, t), lambda i, b, h: (b, h, 0))


def _forward_call(q, k, v, q_seg, kv_seg, q_last, *, scale, config: Config, interpret):
  b, tq, h, dk = q.shape
  tk, dv = k.shape[1], v.shape[3]
  bq, bk = config.block_q, config.block_k
  kp, vp = head_parts(dk), head_parts(dv)
  schedule = tiles.key_block_schedule(q_seg, kv_seg, q_last, bq, bk)
  kernel = functools.partial(_fwd_kernel, nkp=len(kp), nvp=len(vp), scale=scale, block_k=bk,
                             dtype=q.dtype)
  in_specs = ([_SCALAR] * 4 + [pl.BlockSpec((None, bq), lambda i, b, h: (b, i)),
                                pl.BlockSpec((bq,), lambda i, b, h: (i,)),
                                pl.BlockSpec((None, tk), lambda i, b, h: (b, 0))]
              + _tiled(bq, kp) + _whole(tk, kp) + _whole(tk, vp))
  stats = jax.ShapeDtypeStruct((b, h, tq), F32)
  outs = pl.pallas_call(
      kernel, grid=(tq // bq, b, h), in_specs=in_specs,
      out_specs=_part_out_specs(bq, vp) + [_row_stats_spec(bq)] * 2,
      out_shape=_part_outputs(q.shape, vp, q.dtype) + [stats, stats],
      compiler_params=_params(config.fwd_warps, config.fwd_stages, interpret),
      interpret=interpret, name="attention_fwd",
  )(*schedule, q_seg, q_last, kv_seg, *[q] * len(kp), *[k] * len(kp), *[v] * len(vp))
  return _join(outs[:-2]), outs[-2], outs[-1]


def _row_max_call(q, k, q_seg, kv_seg, q_last, *, scale, config: Config, interpret):
  b, tq, h, dk = q.shape
  tk = k.shape[1]
  bq, bk = config.block_q, config.block_k
  kp = head_parts(dk)
  schedule = tiles.key_block_schedule(q_seg, kv_seg, q_last, bq, bk)
  kernel = functools.partial(_row_max_kernel, nkp=len(kp), scale=scale, block_k=bk,
                             dtype=q.dtype)
  in_specs = ([_SCALAR] * 4 + [pl.BlockSpec((None, bq), lambda i, b, h: (b, i)),
                                pl.BlockSpec((bq,), lambda i, b, h: (i,)),
                                pl.BlockSpec((None, tk), lambda i, b, h: (b, 0))]
              + _tiled(bq, kp) + _whole(tk, kp))
  return pl.pallas_call(
      kernel, grid=(tq // bq, b, h), in_specs=in_specs, out_specs=_row_stats_spec(bq),
      out_shape=jax.ShapeDtypeStruct((b, h, tq), F32),
      compiler_params=_params(config.fwd_warps, config.fwd_stages, interpret),
      interpret=interpret, name="attention_row_max",
  )(*schedule, q_seg, q_last, kv_seg, *[q] * len(kp), *[k] * len(kp))


def _backward_call(q, k, v, q_seg, kv_seg, q_last, lse, delta, dout, *, scale, config: Config,
                   interpret):
  b, tq, h, dk = q.shape
  tk, dv = k.shape[1], v.shape[3]
  kp, vp = head_parts(dk), head_parts(dv)
  nkp, nvp = len(kp), len(vp)
  operands = (*[q] * nkp, *[k] * nkp, *[v] * nvp, *[dout] * nvp)

  # dK, dV: one program per key block, grid axis 0 = key block.
  bq, bk = config.dkv_block_q, config.dkv_block_k
  schedule = tiles.query_block_schedule(q_seg, kv_seg, q_last, bq, bk)
  kernel = functools.partial(_dkv_kernel, nkp=nkp, nvp=nvp, scale=scale, block_q=bq,
                             keys_as_rows=config.dkv_keys_as_rows, dtype=q.dtype)
  in_specs = ([_SCALAR] * 4 + [pl.BlockSpec((None, tq), lambda j, b, h: (b, 0)),
                                pl.BlockSpec((tq,), lambda j, b, h: (0,)),
                                pl.BlockSpec((None, bk), lambda j, b, h: (b, j)),
                                _whole_stats_spec(tq), _whole_stats_spec(tq)]
              + _whole(tq, kp) + _tiled(bk, kp) + _tiled(bk, vp) + _whole(tq, vp))
  grads = pl.pallas_call(
      kernel, grid=(tk // bk, b, h), in_specs=in_specs,
      out_specs=_part_out_specs(bk, kp) + _part_out_specs(bk, vp),
      out_shape=_part_outputs(k.shape, kp, k.dtype) + _part_outputs(v.shape, vp, v.dtype),
      compiler_params=_params(config.dkv_warps, config.dkv_stages, interpret),
      interpret=interpret, name="attention_dkv",
  )(*schedule, q_seg, q_last, kv_seg, lse, delta, *operands)
  dk_, dv_ = _join(grads[:nkp]), _join(grads[nkp:])

  # dQ: one program per query block.
  bq, bk = config.dq_block_q, config.dq_block_k
  schedule = tiles.key_block_schedule(q_seg, kv_seg, q_last, bq, bk)
  kernel = functools.partial(_dq_kernel, nkp=nkp, nvp=nvp, scale=scale, block_k=bk,
                             dtype=q.dtype)
  in_specs = ([_SCALAR] * 4 + [pl.BlockSpec((None, bq), lambda i, b, h: (b, i)),
                                pl.BlockSpec((bq,), lambda i, b, h: (i,)),
                                pl.BlockSpec((None, tk), lambda i, b, h: (b, 0)),
                                _row_stats_spec(bq), _row_stats_spec(bq)]
              + _tiled(bq, kp) + _whole(tk, kp) + _whole(tk, vp) + _tiled(bq, vp))
  dqs = pl.pallas_call(
      kernel, grid=(tq // bq, b, h), in_specs=in_specs,
      out_specs=_part_out_specs(bq, kp),
      out_shape=_part_outputs(q.shape, kp, q.dtype),
      compiler_params=_params(config.dq_warps, config.dq_stages, interpret),
      interpret=interpret, name="attention_dq",
  )(*schedule, q_seg, q_last, kv_seg, lse, delta, *operands)
  return _join(dqs), dk_, dv_


# ---------------------------------------------------------------------------------------------
# Padding and the differentiable op.

def _pad_axis1(x, pad, mode="constant", value=0):
  if not pad:
    return x
  widths = [(0, 0)] * x.ndim
  widths[1] = (0, pad)
  if mode == "edge":
    return jnp.pad(x, widths, mode="edge")
  return jnp.pad(x, widths, constant_values=value)


def _pad_inputs(q, k, v, q_seg, kv_seg, q_last, config: Config):
  """Pad Tq / Tk to the block multiples: padding queries see nothing (q_last −1), padding keys
  lie past every q_last; segment ids repeat the last one to keep the tile ranges tight."""
  pq = -q.shape[1] % config.query_multiple
  pk = -k.shape[1] % config.key_multiple
  q_last = q_last if not pq else jnp.pad(q_last, (0, pq), constant_values=-1)
  return (_pad_axis1(q, pq), _pad_axis1(k, pk), _pad_axis1(v, pk),
          _pad_axis1(q_seg, pq, "edge"), _pad_axis1(kv_seg, pk, "edge"), q_last)


def _forward(q, k, v, q_seg, kv_seg, q_last, *, scale, options):
  config, interpret = options
  tq = q.shape[1]
  padded = _pad_inputs(q, k, v, q_seg, kv_seg, q_last, config)
  out, lse, row_max = _forward_call(*padded, scale=scale, config=config, interpret=interpret)
  return out[:, :tq], lse[..., :tq], row_max[..., :tq]


def _backward(q, k, v, q_seg, kv_seg, q_last, out, lse, dout, *, scale, options):
  config, interpret = options
  tq, tk = q.shape[1], k.shape[1]
  delta_bhq = jnp.swapaxes(jnp.sum(dout.astype(F32) * out.astype(F32), axis=3), 1, 2)
  pq = -tq % config.query_multiple
  lse, delta_bhq = (jnp.pad(x, ((0, 0), (0, 0), (0, pq))) if pq else x for x in (lse, delta_bhq))
  padded = _pad_inputs(q, k, v, q_seg, kv_seg, q_last, config)
  dq, dk, dv = _backward_call(*padded, lse, delta_bhq, _pad_axis1(dout, pq), scale=scale,
                              config=config, interpret=interpret)
  return dq[:, :tq], dk[:, :tk], dv[:, :tk]


_attention = differentiable_attention(_forward, _backward)


def attention_pallas_gpu(q, k, v, q_seg, kv_seg, q_last, *, scale: float,
                         config: Config | None = None, interpret: bool = False):
  """(out [B,Tq,H,Dv] in q's dtype, row_max [B,H,Tq] fp32) on the canonical form (op.py),
  differentiable in q, k, v (custom_vjp, vjp.py)."""
  config = config_for(q.dtype) if config is None else config
  check_supported(q.shape[3], v.shape[3], q.dtype)
  return _attention(q, k, v, q_seg, kv_seg, q_last, float(scale), (config, bool(interpret)))


def row_max_pallas_gpu(q, k, q_seg, kv_seg, q_last, *, scale: float, config: Config | None = None,
                       interpret: bool = False):
  """row_max [B,H,Tq] fp32 only (a max-logit pass for a path whose attention kernel does not
  report it): the forward's tiles without softmax or values. No gradient."""
  config = config_for(q.dtype) if config is None else config
  tq = q.shape[1]
  q, k, q_seg, kv_seg = (lax.stop_gradient(x) for x in (q, k, q_seg, kv_seg))
  q, k, _, q_seg, kv_seg, q_last = _pad_inputs(q, k, k[..., :16], q_seg, kv_seg, q_last, config)
  return _row_max_call(q, k, q_seg, kv_seg, q_last, scale=float(scale), config=config,
                       interpret=interpret)[..., :tq]
