"""The "pallas_gpu" gmm backend: Mosaic GPU kernels (mgpu.py) behind a custom_vjp.

Forward gmm_mgpu(lhs, rhs); backward through `vjp.differentiable_gmm` (dlhs by gmm_mgpu with
rhs[g]ᵀ, drhs by tgmm_mgpu), with the padding rows tgmm reads zeroed first.
Shapes the kernels cannot tile (see mgpu.py) raise ValueError; "auto" routes those to ragged_dot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.moe.mgpu import MgpuConfig, gmm_mgpu, tgmm_mgpu
from pallas_kernels.moe.vjp import differentiable_gmm

DEFAULT_CONFIG = MgpuConfig()


def supports(lhs_shape, rhs_shape, dtype, config: MgpuConfig = DEFAULT_CONFIG) -> bool:
  """Whether the kernels tile these shapes (fwd, dlhs and drhs) and this dtype."""
  _, k = lhs_shape
  _, _, n = rhs_shape
  cta_n = 2 * config.tile_n
  return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
          and k % config.tile_k == 0 and n % config.tile_k == 0
          and n % cta_n == 0 and k % cta_n == 0 and k % config.tile_m == 0)


def _zero_rows_after_groups(lhs_mk, group_sizes_g, config: MgpuConfig):
  """lhs with the tile_k rows after sum(group_sizes) zeroed (no full pass over lhs).

  tgmm reduces each group in blocks of tile_k rows from the group's first row, and zeroes the
  cotangent past the group's end; a padding row holding inf/NaN would still give 0 · inf = NaN
  in the last group's weight gradient. Those are the only padding rows it reads, so zeroing this
  window keeps drhs finite whatever the padding holds.
  """
  m = lhs_mk.shape[0]
  window = min(config.tile_k, m)
  total = jnp.minimum(jnp.sum(jnp.maximum(group_sizes_g, 0)), m)
  start = jnp.clip(total, 0, m - window)
  block = jax.lax.dynamic_slice_in_dim(lhs_mk, start, window, axis=0)
  past = (start + jnp.arange(window)) >= total
  block = jnp.where(past[:, None], jnp.zeros((), block.dtype), block)
  return jax.lax.dynamic_update_slice_in_dim(lhs_mk, block, start, axis=0)


_gmm = differentiable_gmm(gmm_mgpu, tgmm_mgpu, prepare_tgmm_lhs=_zero_rows_after_groups)


def gmm_pallas_gpu(lhs_mk: jax.Array, rhs_gkn: jax.Array, group_sizes_g: jax.Array, *,
                   config: MgpuConfig = DEFAULT_CONFIG, interpret: bool = False) -> jax.Array:
  """ragged_dot(lhs, rhs, group_sizes) on the Mosaic GPU kernels, differentiable in lhs and rhs."""
  return _gmm(lhs_mk, rhs_gkn, group_sizes_g, config=config, interpret=interpret)
