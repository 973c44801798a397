"""Batched quintic Newton–Schulz orthogonalisation for Muon (docs/maths.md §4.1).

Muon orthogonalises many small blocks: one per attention head, per expert, per stacked layer and
per whole matrix. One matmul chain per block leaves a GPU mostly idle, so `orthogonalize_leaves`
gathers every block of the same shape, across all leaves, into one [batch, m, n] array and runs
one batched chain per shape (`orthogonalize`). Blocks are oriented so that m ≤ n before grouping
(a tall [in, out] block is handled as its transpose, NS(Gᵀ) = NS(G)ᵀ), so a tall and a wide block
of transposed sizes share one chain too.

The matmuls take `compute_dtype` operands and accumulate in float32. bfloat16 runs at the
tensor-core rate as a chain of alpha·(L·R) + C GEMMs (`_scaled_chain`); float32 is the plain
fp32 iteration (the same arithmetic as optax's `orthogonalize_via_newton_schulz`), kept as the
reference path.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from optax.contrib import MuonDimensionNumbers

from pallas_kernels import platform

NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-8
NS_DTYPES = ("bfloat16", "float32")

# dot_general dimension numbers for batched [b, ·, ·] operands (batch axis 0 on both sides).
_X_XT = (((2,), (2,)), ((0,), (0,)))      # [b, m, n] · [b, m, n]ᵀ → [b, m, m]
_MATMUL = (((2,), (1,)), ((0,), (0,)))    # [b, m, k] · [b, k, n] → [b, m, n]


def compute_dtype_of(name) -> jnp.dtype:
  """jnp dtype of an NS compute dtype given by name ("bfloat16" | "float32") or dtype."""
  dtype = jnp.dtype(name)
  if dtype.name not in NS_DTYPES:
    raise ValueError(f"Newton–Schulz compute dtype must be one of {NS_DTYPES}, got {name!r}")
  return dtype


def _bmm(lhs, rhs, dims, out_dtype):
  """Batched matmul accumulating in float32 (the GEMM's own accumulator), written in
  `out_dtype`: bf16 outputs halve the memory traffic between the chain's matmuls."""
  return lax.dot_general(lhs, rhs, dims, preferred_element_type=out_dtype)


def _quintic_step(x_bmn, coeffs, compute_dtype):
  """X ← aX + (bA + cA²)X with A = X Xᵀ; operands and results in compute_dtype, the linear
  combinations in float32. The float32 path (the same arithmetic as optax)."""
  a, b, c = coeffs
  gram_bmm = _bmm(x_bmn, x_bmn, _X_XT, compute_dtype)
  gram2_bmm = _bmm(gram_bmm, gram_bmm, _MATMUL, compute_dtype)
  poly_bmm = (b * gram_bmm.astype(jnp.float32) + c * gram2_bmm.astype(jnp.float32))
  update_bmn = _bmm(poly_bmm.astype(compute_dtype), x_bmn, _MATMUL, compute_dtype)
  return (a * x_bmn.astype(jnp.float32) + update_bmn.astype(jnp.float32)).astype(compute_dtype)


def _scaled_chain(y_bmn, coeffs, steps: int, epilogue_dtype=jnp.float32):
  """The quintic steps as three GEMMs of the form alpha·(L·R) + C: the scalar alpha and the
  addend C are what a GEMM epilogue takes, and no other arithmetic runs between the GEMMs.

  X is carried as s·Y (s a Python float). With Â = b·A = (b s²)·Y Yᵀ:
    bA + cA² = Â + (c / b²)·Â²
    X' = aX + (bA + cA²)X = (a s)·(Y + (1/a)·(bA + cA²)Y)
  so a step is Â = (b s²)·(Y Yᵀ); P = (c / b²)·(Â Â) + Â; Y ← (1/a)·(P Y) + Y; s ← a s.
  Returns (Y, s); X = s·Y.
  """
  a, b, c = coeffs
  dtype = y_bmn.dtype

  def gemm(lhs, rhs, dims, alpha, addend=None):
    out = _bmm(lhs, rhs, dims, epilogue_dtype) * alpha
    if addend is not None:
      out = out + addend.astype(epilogue_dtype)
    return out.astype(dtype)

  scale = 1.0
  for _ in range(steps):
    gram_bmm = gemm(y_bmn, y_bmn, _X_XT, b * scale * scale)
    poly_bmm = gemm(gram_bmm, gram_bmm, _MATMUL, c / (b * b), gram_bmm)
    y_bmn = gemm(poly_bmm, y_bmn, _MATMUL, 1.0 / a, y_bmn)
    scale *= a
  return y_bmn, scale


def epilogue_dtype(compute_dtype, backend: str | None = None) -> jnp.dtype:
  """The dtype `_scaled_chain` writes its alpha·(L·R) + C in.

  On GPUs, `compute_dtype`: bf16 GEMM outputs and a bf16 scale and add, which XLA fuses into
  the fewest passes over memory (on an H200 the whole update runs 16 % faster than the plain
  steps; the GEMM output is rounded, then the scaled sum: benchmarks/newton_schulz.md). The
  explicit float32 form rounds once per GEMM but writes float32 GEMM outputs, slower there.
  Other backends get the float32 form (XLA:CPU would round bf16 after every op)."""
  backend = platform.current() if backend is None else backend
  return jnp.dtype(compute_dtype) if backend == "gpu" else jnp.dtype(jnp.float32)


def orthogonalize(x_bmn: jax.Array, coeffs: Sequence[float] = NS_COEFFS, steps: int = NS_STEPS,
                  eps: float = NS_EPS, compute_dtype="bfloat16") -> jax.Array:
  """Quintic Newton–Schulz on each [m, n] block of `x_bmn`; float32 result of the same shape.

  Each block is divided by (its Frobenius norm + eps) in float32 first. Blocks with m > n are
  iterated on their transpose, so the Gram matrix X Xᵀ is the smaller one. Every matmul writes
  `compute_dtype` (accumulating in float32). bfloat16 runs the scaled chain (`_scaled_chain`:
  each linear combination is one GEMM's alpha·(L·R) + C); float32 runs the plain steps.
  """
  compute_dtype = compute_dtype_of(compute_dtype)
  if x_bmn.ndim != 3:
    raise ValueError(f"orthogonalize expects [batch, m, n], got shape {x_bmn.shape}")
  tall = x_bmn.shape[1] > x_bmn.shape[2]
  x_bmn = jnp.swapaxes(x_bmn, 1, 2) if tall else x_bmn
  x_bmn = x_bmn.astype(jnp.float32)
  norm_b11 = jnp.sqrt(jnp.sum(jnp.square(x_bmn), axis=(1, 2), keepdims=True))
  x_bmn = x_bmn / (norm_b11 + eps)
  x_bmn = x_bmn.astype(compute_dtype)
  if compute_dtype == jnp.float32:
    for _ in range(steps):
      x_bmn = _quintic_step(x_bmn, coeffs, compute_dtype)
    x_bmn = x_bmn.astype(jnp.float32)
  else:
    coeffs = tuple(float(k) for k in coeffs)
    if coeffs[0] == 0 or coeffs[1] == 0:
      raise ValueError(f"the bf16 Newton–Schulz chain divides by the coefficients a and b; "
                       f"both must be nonzero, got {coeffs}")
    y_bmn, scale = _scaled_chain(x_bmn, coeffs, steps, epilogue_dtype(compute_dtype))
    x_bmn = y_bmn.astype(jnp.float32) * scale
  return jnp.swapaxes(x_bmn, 1, 2) if tall else x_bmn


def ns_flops(m: int, n: int, steps: int = NS_STEPS) -> int:
  """Matmul FLOPs of `steps` quintic steps on one m×n block (X Xᵀ, A², (bA + cA²)X)."""
  m, n = min(m, n), max(m, n)
  return steps * (2 * m * m * n + 2 * m * m * m + 2 * m * m * n)


# ---------------------------------------------------------------------------------------------
# Leaves with Muon dimension numbers → batched blocks and back


def _axes(axis, ndim: int) -> tuple[int, ...]:
  axes = tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)
  return tuple(a % ndim for a in axes)


class BlockLayout:
  """How one leaf maps to oriented blocks [batch, m, n] (m ≤ n) and back.

  Every axis that is neither a reduction nor an output axis is a batch axis. The leaf is
  transposed to (batch…, reduction…, output…) and flattened to [batch, in, out]; a tall block
  (in > out) is stored transposed, so every block has its smaller side first.
  """

  def __init__(self, shape: Sequence[int], dims: MuonDimensionNumbers):
    ndim = len(shape)
    if ndim < 2:
      raise ValueError(f"a Muon leaf needs rank >= 2, got shape {tuple(shape)}")
    red, out = _axes(dims.reduction_axis, ndim), _axes(dims.output_axis, ndim)
    if set(red) & set(out):
      raise ValueError(f"reduction axes {red} and output axes {out} overlap (shape {tuple(shape)})")
    batch = tuple(a for a in range(ndim) if a not in red and a not in out)
    self.perm = batch + red + out
    self.inv_perm = tuple(int(i) for i in np.argsort(self.perm))
    self.moved_shape = tuple(shape[a] for a in self.perm)
    self.batch = math.prod(shape[a] for a in batch)
    self.fan_in = math.prod(shape[a] for a in red)
    self.fan_out = math.prod(shape[a] for a in out)
    self.tall = self.fan_in > self.fan_out

  @property
  def block_shape(self) -> tuple[int, int]:
    """(m, n) of the oriented block, m ≤ n: the key blocks are grouped by."""
    return (min(self.fan_in, self.fan_out), max(self.fan_in, self.fan_out))

  def to_blocks(self, x):
    x_bio = jnp.transpose(x, self.perm).reshape(self.batch, self.fan_in, self.fan_out)
    return jnp.swapaxes(x_bio, 1, 2) if self.tall else x_bio

  def from_blocks(self, x_bmn):
    x_bio = jnp.swapaxes(x_bmn, 1, 2) if self.tall else x_bmn
    return jnp.transpose(x_bio.reshape(self.moved_shape), self.inv_perm)

  def rms_factor(self, rms_scale: float) -> float:
    """Consistent-RMS scale rms_scale · sqrt(max(fan_in, fan_out)) of one block."""
    return rms_scale * math.sqrt(max(self.fan_in, self.fan_out))


def orthogonalize_leaves(leaves: Sequence[jax.Array], dims: Sequence[MuonDimensionNumbers], *,
                         coeffs: Sequence[float] = NS_COEFFS, steps: int = NS_STEPS,
                         eps: float = NS_EPS, compute_dtype="bfloat16",
                         rms_scale: float | None = None) -> list[jax.Array]:
  """Newton–Schulz of every block of every leaf, one batched chain per block shape.

  `dims[i]` gives leaf i's reduction and output axes; all its other axes are batch axes. Blocks
  of the same (oriented) shape from all leaves are concatenated along the batch axis,
  orthogonalised together and split back. With `rms_scale`, each block is multiplied by
  rms_scale · sqrt(max(fan_in, fan_out)). Each result has its leaf's shape and dtype.
  """
  if len(leaves) != len(dims):
    raise ValueError(f"{len(leaves)} leaves but {len(dims)} dimension numbers")
  layouts = [BlockLayout(x.shape, d) for x, d in zip(leaves, dims)]
  groups: dict[tuple[int, int], list[int]] = {}
  for i, layout in enumerate(layouts):
    groups.setdefault(layout.block_shape, []).append(i)

  results: list[jax.Array | None] = [None] * len(leaves)
  for members in groups.values():
    x_bmn = jnp.concatenate([layouts[i].to_blocks(leaves[i]).astype(jnp.float32)
                             for i in members], axis=0)
    o_bmn = orthogonalize(x_bmn, coeffs, steps, eps, compute_dtype)
    offsets = np.cumsum([layouts[i].batch for i in members])[:-1].tolist()
    for i, part in zip(members, jnp.split(o_bmn, offsets, axis=0)):
      y = layouts[i].from_blocks(part)
      if rms_scale is not None:
        y = y * layouts[i].rms_factor(rms_scale)
      results[i] = y.astype(leaves[i].dtype)
  return results


def ns_flops_of_leaves(shapes: Sequence[Sequence[int]], dims: Sequence[MuonDimensionNumbers],
                       steps: int = NS_STEPS) -> int:
  """Matmul FLOPs of one `orthogonalize_leaves` call on leaves of these shapes."""
  total = 0
  for shape, d in zip(shapes, dims):
    layout = BlockLayout(shape, d)
    total += layout.batch * ns_flops(*layout.block_shape, steps)
  return total
