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
