"""Public MoE ops: grouped matmul with a backend switch, and sort-based dispatch / combine.

Token routing in k3train is dropless: the T·k (token, expert) pairs are sorted by expert so every
expert's rows are contiguous, the experts run as one grouped matmul over the sorted rows, and the
results are un-sorted and summed per token with the routing weights (docs/maths.md §5.5).

gmm backends (BACKENDS): "reference" (dense, readable: reference.py), "ragged_dot"
(`jax.lax.ragged_dot`, portable: xla.py), "pallas_gpu" (Mosaic GPU kernels: pallas_gpu.py),
"pallas_tpu" (Mosaic TPU kernels: pallas_tpu.py) — both Pallas backends through the custom_vjp of
vjp.py — and "auto" (see `resolve_backend`).

`gmm_mx` is the same grouped matmul on MX-quantised operands (MXFP8 activations, MXFP4 weights
in the release byte layout; mx_operands.py states the layout), with straight-through gradients
(vjp.py). Its backends (MX_BACKENDS) run the gmm backend of the same name on the dequantised
operands, pallas_gpu decoding them inside its kernel; see `gmm_mx`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from pallas_kernels import platform
from pallas_kernels.moe import mx_operands, pallas_gpu, pallas_tpu, permute
from pallas_kernels.moe.reference import gmm_mx_reference, gmm_reference
from pallas_kernels.moe.vjp import straight_through_gmm_mx
from pallas_kernels.moe.xla import gmm_ragged_dot


def _gmm_pallas_gpu(lhs, rhs, group_sizes):
  # Off-GPU the Mosaic GPU kernels run in Pallas' GPU interpret mode (slow; for tests).
  return pallas_gpu.gmm_pallas_gpu(lhs, rhs, group_sizes,
                                   interpret=platform.interpret("gpu"))


def _gmm_pallas_tpu(lhs, rhs, group_sizes):
  # Off-TPU the Mosaic TPU kernels run in Pallas' TPU interpret mode (slow; for tests).
  return pallas_tpu.gmm_pallas_tpu(lhs, rhs, group_sizes,
                                   interpret=platform.interpret("tpu"))


_GMM_IMPLS = {
    "reference": gmm_reference,
    "ragged_dot": gmm_ragged_dot,
    "pallas_gpu": _gmm_pallas_gpu,
    "pallas_tpu": _gmm_pallas_tpu,
}
BACKENDS = ("auto",) + tuple(_GMM_IMPLS)


def resolve_backend(backend: str, lhs_shape=None, rhs_shape=None, dtype=None) -> str:
  """Map a backend name to a concrete implementation name.

  "auto" → "pallas_gpu" on a GPU when the kernels tile the shapes and the dtype is bf16/f16
  (measured 580–660 TFLOP/s on an H200 vs ragged_dot's 23–96, benchmarks/moe_gmm.md); else
  "ragged_dot" (CPU, TPU, odd shapes and dtypes). "pallas_tpu" is chosen only by name: it has
  run in TPU interpret mode and lowered to Mosaic, but never compiled or been timed on a TPU,
  so "auto" does not bet the default TPU path on it yet.
  """
  if backend == "auto":
    if (platform.current() == "gpu" and lhs_shape is not None
        and pallas_gpu.supports(lhs_shape, rhs_shape, dtype)):
      return "pallas_gpu"
    return "ragged_dot"
  if backend not in _GMM_IMPLS:
    raise ValueError(f"unknown gmm backend {backend!r}; allowed: {', '.join(BACKENDS)}")
  return backend


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
        backend: str = "auto") -> jax.Array:
  """Grouped matmul with `jax.lax.ragged_dot` semantics.

  lhs [M, K], rhs [G, K, N], group_sizes [G] int → out [M, N]: rows are grouped contiguously in
  group order, row r of group g gives lhs[r] · rhs[g]; empty groups are allowed; rows at or past
  sum(group_sizes) give zeros. Accumulates in fp32 and returns the promoted input dtype.
  Backends: "reference" (dense one-hot, readable, O(M·G·K·N)), "ragged_dot", "pallas_gpu"
  (Mosaic GPU kernels with a custom_vjp: dlhs by the same kernel on rhsᵀ, drhs by a tgmm kernel;
  bf16/f16 on hardware), "pallas_tpu" (Mosaic TPU kernels, the same custom_vjp structure; bf16/fp32)
  and "auto" (see resolve_backend).
  """
  if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.ndim != 1:
    raise ValueError(f"gmm expects lhs [M, K], rhs [G, K, N], group_sizes [G]; got "
                     f"{lhs.shape}, {rhs.shape}, {group_sizes.shape}")
  if lhs.shape[1] != rhs.shape[1] or rhs.shape[0] != group_sizes.shape[0]:
    raise ValueError(f"gmm shape mismatch: lhs {lhs.shape}, rhs {rhs.shape}, "
                     f"group_sizes {group_sizes.shape}")
  dtype = jnp.result_type(lhs.dtype, rhs.dtype)
  impl = _GMM_IMPLS[resolve_backend(backend, lhs.shape, rhs.shape, dtype)]
  return impl(lhs, rhs, group_sizes)


def _xla_dequant_forward(gmm_impl):
  """An MX forward that dequantises in XLA, then runs the plain gmm `gmm_impl`."""
  def forward(lhs_codes, lhs_scales, rhs_packed, rhs_scales, group_sizes, dtype):
    lhs = mx_operands.dequantize_lhs(lhs_codes, lhs_scales, dtype)
    rhs = mx_operands.dequantize_rhs(rhs_packed, rhs_scales, dtype)
    return gmm_impl(lhs, rhs, group_sizes)
  return forward


def _gmm_mx_reference_forward(lhs_codes, lhs_scales, rhs_packed, rhs_scales, group_sizes, dtype):
  return gmm_mx_reference(lhs_codes, lhs_scales, rhs_packed, rhs_scales, group_sizes, dtype)


def _gmm_mx_pallas_gpu_forward(lhs_decode: str):
  """The Mosaic GPU MX forward, MXFP8 activations decoded in the kernel ("kernel") or in XLA."""
  def forward(lhs_codes, lhs_scales, rhs_packed, rhs_scales, group_sizes, dtype):
    return pallas_gpu.gmm_mx_pallas_gpu_forward(lhs_codes, lhs_scales, rhs_packed, rhs_scales,
                                                group_sizes, dtype, lhs_decode=lhs_decode,
                                                interpret=platform.interpret("gpu"))
  return forward


_GMM_MX_IMPLS = {
    "reference": straight_through_gmm_mx(_gmm_mx_reference_forward, gmm_reference),
    "ragged_dot": straight_through_gmm_mx(_xla_dequant_forward(gmm_ragged_dot), gmm_ragged_dot),
    "pallas_gpu": straight_through_gmm_mx(_gmm_mx_pallas_gpu_forward("kernel"), _gmm_pallas_gpu),
    "pallas_tpu": straight_through_gmm_mx(_xla_dequant_forward(_gmm_pallas_tpu), _gmm_pallas_tpu),
}
# pallas_gpu with the MXFP8 activations dequantised in XLA before the kernel (lhs_decode="xla").
_GMM_MX_PALLAS_GPU_XLA_LHS = straight_through_gmm_mx(_gmm_mx_pallas_gpu_forward("xla"),
                                                     _gmm_pallas_gpu)
MX_BACKENDS = ("auto",) + tuple(_GMM_MX_IMPLS)
LHS_DECODES = ("kernel", "xla")


def gmm_mx(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, lhs_codes: jax.Array,
           lhs_scales: jax.Array, rhs_packed: jax.Array, rhs_scales: jax.Array,
           backend: str = "auto", lhs_decode: str = "kernel") -> jax.Array:
  """Grouped matmul of MX operands: gmm(Q(lhs), Q(rhs)) read from their encodings.

  lhs [M, K] and rhs [G, K, N] are the unquantised operands (any float dtype; the result has
  their promoted dtype, like `gmm`); the encodings must have been made from them:
  lhs_codes float8_e4m3fn [M, K] and lhs_scales uint8 [M, K/32] (MXFP8, blocks along K);
  rhs_packed uint8 [G, N, K/2] and rhs_scales uint8 [G, N, K/32] (MXFP4 in the release layout,
  each group's [out, in] weight, blocks along K). See mx_operands.py.

  Forward: the grouped matmul (ragged_dot semantics, fp32 accumulation) of the dequantised
  operands, which are exactly representable in bf16 (except values below 2^-126). Backward:
  straight-through, on the dequantised operands in the promoted dtype (vjp.py); the encodings
  get no gradient. Backends: "reference" (dense, fp32 dequantisation), "ragged_dot" and
  "pallas_tpu" (dequantise in XLA, then that gmm), "pallas_gpu" (pallas_gpu.py:
  `gmm_mx_pallas_gpu_forward`), "auto" (as for `gmm`, by shape and promoted dtype).
  lhs_decode (pallas_gpu only): "kernel" (default) decodes the MXFP8 activations inside the
  Mosaic GPU kernel, which then reads 1 byte per activation element; "xla" dequantises them
  in XLA first, as before. The other backends always dequantise in XLA.
  """
  if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.ndim != 1:
    raise ValueError(f"gmm_mx expects lhs [M, K], rhs [G, K, N], group_sizes [G]; got "
                     f"{lhs.shape}, {rhs.shape}, {group_sizes.shape}")
  if rhs.shape[0] != group_sizes.shape[0]:
    raise ValueError(f"gmm_mx: rhs {rhs.shape} and group_sizes {group_sizes.shape} disagree on G")
  if lhs_decode not in LHS_DECODES:
    raise ValueError(f"gmm_mx: lhs_decode must be one of {', '.join(LHS_DECODES)}, got "
                     f"{lhs_decode!r}")
  mx_operands.check_operands(lhs.shape, rhs.shape, lhs_codes, lhs_scales, rhs_packed, rhs_scales)
  dtype = jnp.result_type(lhs.dtype, rhs.dtype)
  name = resolve_backend(backend, lhs.shape, rhs.shape, dtype)
  impl = (_GMM_MX_PALLAS_GPU_XLA_LHS if (name, lhs_decode) == ("pallas_gpu", "xla")
          else _GMM_MX_IMPLS[name])
  return impl(lhs, rhs, group_sizes, lhs_codes, lhs_scales, rhs_packed, rhs_scales)


def dispatch(x: jax.Array, expert_idx: jax.Array, num_experts: int, *, gather: str = "xla",
             order_name: str | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Sort the (token, expert) pairs by expert and gather the token rows into that order.

  x [T, D], expert_idx [T, k] int → (x_sorted [T·k, D], group_sizes [E] int32, perm [T·k] int32).
  Pair p = t·k + j is (token t, its j-th expert); perm lists pair ids in expert order (stable, so
  within one expert tokens keep their order) and x_sorted[i] = x[perm[i] // k]. Dropless: every
  pair gets a row, group_sizes[e] = #pairs routed to e. The gradient wrt x sums each token's k
  row cotangents in fp32 by a gather through the inverse permutation (permute.py: no scatter).
  `gather`: who copies the rows (permute.GATHERS). `order_name`: a checkpoint name
  (`jax.ad_checkpoint.checkpoint_name`) given to perm and group_sizes, so that a remat policy
  keeping that name does not sort the pairs again when it rematerialises the forward.
  """
  num_tokens, top_k = expert_idx.shape
  if x.shape[0] != num_tokens:
    raise ValueError(f"dispatch: x has {x.shape[0]} tokens, expert_idx {num_tokens}")
  expert_p = expert_idx.reshape(num_tokens * top_k).astype(jnp.int32)
  perm_p = jnp.argsort(expert_p, stable=True).astype(jnp.int32)
  group_sizes_e = count_ids(expert_p, num_experts)
  if order_name is not None:
    perm_p = checkpoint_name(perm_p, order_name)
    group_sizes_e = checkpoint_name(group_sizes_e, order_name)
  x_sorted_pd = permute.sort_rows(x, perm_p, top_k, permute.resolve_gather(gather))
  return x_sorted_pd, group_sizes_e, perm_p


def count_ids(ids: jax.Array, num_bins: int) -> jax.Array:
  """counts [num_bins] int32: how many entries of `ids` (int, any shape) equal each bin; ids
  outside [0, num_bins) are not counted.

  A reduction over the one-hot comparison (XLA fuses the comparison into the reduction, so no
  [ids, bins] array is written), not `jnp.bincount`: that is a scatter-add whose updates all land
  on num_bins addresses, which a GPU serialises as atomics per bin (37–56 µs for 131,072 ids into
  64 bins on an H200, against the few µs of reading 0.5 MB; benchmarks/train_step.md). Exact
  integer counts either way.
  """
  flat = ids.reshape(-1)
  bins = jnp.arange(num_bins, dtype=flat.dtype)
  return jnp.sum(flat[:, None] == bins[None, :], axis=0, dtype=jnp.int32)


def combine(y_sorted: jax.Array, weights: jax.Array, perm: jax.Array) -> jax.Array:
  """Inverse of `dispatch`: un-sort expert outputs and sum each token's k weighted results.

  y_sorted [T·k, D] (row i belongs to pair perm[i]), weights [T, k], perm [T·k] → y [T, D] with
  y[t] = Σ_j weights[t, j] · y_sorted[row of pair (t, j)]. The weights are applied in fp32 to each
  expert output and the k products are summed in fp32 in a fixed order (deterministic, no
  scatter-add), then cast to y_sorted's dtype (docs/maths.md §5.1 numerics note). Its gradients
  are gathers as well (permute.py).
  """
  num_tokens, top_k = weights.shape
  num_pairs = num_tokens * top_k
  if y_sorted.shape[0] != num_pairs or perm.shape != (num_pairs,):
    raise ValueError(f"combine: y_sorted {y_sorted.shape}, weights {weights.shape} and perm "
                     f"{perm.shape} disagree on T·k = {num_pairs}")
  return permute.unsort_sum(y_sorted, weights, perm).astype(y_sorted.dtype)


def sorted_pair_weights(weights: jax.Array, perm: jax.Array) -> jax.Array:
  """weights [T, k] → [T·k] float32 in `dispatch`'s row order (row i: pair perm[i]'s weight).

  For experts that scale their own rows (`combine_scaled`). The gradient is a gather through the
  inverse permutation (permute.py)."""
  num_tokens, top_k = weights.shape
  if perm.shape != (num_tokens * top_k,):
    raise ValueError(f"sorted_pair_weights: weights {weights.shape} and perm {perm.shape} "
                     f"disagree on T·k = {num_tokens * top_k}")
  return permute.sort_pairs(weights.astype(jnp.float32), perm)


def combine_scaled(y_sorted: jax.Array, perm: jax.Array, top_k: int, *,
                   gather: str = "xla") -> jax.Array:
  """`combine` for expert outputs that already carry their pair's weight (rows scaled inside the
  expert, before its last GEMM): y[t] = Σ_j y_sorted[row of pair (t, j)], summed in fp32 and cast
  to y_sorted's dtype.

  The weights' gradient then comes from the expert's own backward (a row dot product of
  quantities it already holds), so the backward needs no copy of the expert outputs: under
  selective remat the last expert GEMM is not run again (docs/maths.md §5.1). `gather`: who
  copies the gradient's rows (permute.GATHERS)."""
  if perm.shape != (y_sorted.shape[0],) or y_sorted.shape[0] % top_k:
    raise ValueError(f"combine_scaled: y_sorted {y_sorted.shape}, perm {perm.shape} and "
                     f"top_k={top_k} disagree")
  return permute.unsort_add(y_sorted, perm, top_k,
                            permute.resolve_gather(gather)).astype(y_sorted.dtype)
