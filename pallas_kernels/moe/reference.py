"""Readable dense reference for the grouped matmul (gmm) used by routed experts.

Every row is multiplied by every group's matrix and the product of the row's own group is picked
with a one-hot group-membership mask. That is O(M·G·K·N) work, so it is only for tests and tiny
shapes, but it states the semantics every other backend must match (those of
`jax.lax.ragged_dot`): rows are grouped contiguously in group order, empty groups are allowed and
rows at or past sum(group_sizes) belong to no group and give zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.moe.mx_operands import decode_e4m3


def group_membership(group_sizes_g: jax.Array, num_rows: int) -> jax.Array:
  """member_mg [M, G] bool: row r is in group g iff start_g <= r < end_g (contiguous groups)."""
  ends_g = jnp.cumsum(group_sizes_g.astype(jnp.int32))
  starts_g = ends_g - group_sizes_g.astype(jnp.int32)
  rows_m1 = jnp.arange(num_rows, dtype=jnp.int32)[:, None]
  return (rows_m1 >= starts_g[None, :]) & (rows_m1 < ends_g[None, :])


def gmm_reference(lhs_mk: jax.Array, rhs_gkn: jax.Array, group_sizes_g: jax.Array) -> jax.Array:
  """out[r] = lhs[r] · rhs[group(r)] (zeros for rows in no group); fp32 accumulation.

  Returns the promoted input dtype, like `jax.lax.ragged_dot`.
  """
  dtype = jnp.result_type(lhs_mk.dtype, rhs_gkn.dtype)
  # Every row through every group's matrix: prod_gmn[g, r] = lhs[r] · rhs[g].
  prod_gmn = jnp.einsum("mk,gkn->gmn", lhs_mk.astype(dtype), rhs_gkn.astype(dtype),
                        preferred_element_type=jnp.float32)
  member_gm1 = group_membership(group_sizes_g, lhs_mk.shape[0]).T[:, :, None]
  # At most one group holds each row, so this sum adds exactly one product (or none) per row;
  # `where` rather than a multiply keeps a non-finite product of another group from leaking in.
  out_mn = jnp.sum(jnp.where(member_gm1, prod_gmn, 0.0), axis=0)
  return out_mn.astype(dtype)


# E2M1 magnitudes by 3-bit index; bit 3 of a nibble is the sign (docs/maths.md §7.4).
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def gmm_mx_reference(lhs_codes: jax.Array, lhs_scales: jax.Array, rhs_packed: jax.Array,
                     rhs_scales: jax.Array, group_sizes_g: jax.Array, dtype) -> jax.Array:
  """gmm of MX operands (layout: mx_operands.py), decoded plainly: E4M3 from its bits, a table for E2M1, 2^(s − 127)
  for the E8M0 bytes (NaN for 255), both in fp32 (fp64 with x64), then `gmm_reference`.
  (`ldexp`, not `exp2`: XLA's exp2 is not exact at integers.)"""
  wide = jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
  def scale(bytes_):
    s = bytes_.astype(jnp.int32)
    return jnp.where(s == 255, jnp.nan, jnp.ldexp(jnp.ones(s.shape, wide), s - 127))
  k = lhs_codes.shape[1]
  lhs_mk = decode_e4m3(lhs_codes).astype(wide) * jnp.repeat(scale(lhs_scales), 32, axis=1)
  nib = jnp.stack([rhs_packed & 0xF, rhs_packed >> 4], axis=-1).reshape(*rhs_packed.shape[:2], k)
  mag = jnp.asarray(E2M1_MAGNITUDES, wide)[(nib & 7).astype(jnp.int32)]
  rhs_gnk = jnp.where((nib & 8) != 0, -mag, mag) * jnp.repeat(scale(rhs_scales), 32, axis=2)
  out = gmm_reference(lhs_mk, jnp.swapaxes(rhs_gnk, 1, 2), group_sizes_g)
  return out.astype(dtype)
