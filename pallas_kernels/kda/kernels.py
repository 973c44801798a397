"""Pallas kernel bodies for chunked KDA shared by the Triton (GPU) and Mosaic (TPU) launchers.

The state passes (`fwd_step`, `bwd_step`, and the split forward's `state_step` + `out_kernel`),
the per-chunk gradient kernel `chunk_bwd_kernel`, the dot helpers and the gating of q and k.
Only value-level jnp ops that both lowerings support are used here: 2-D dots (with transposed
operands expressed through `lax.dot_general`) and elementwise maths. The launchers decide how
refs map onto HBM (`pallas_gpu.py`: whole-sequence refs walked with `pl.ds`; `pallas_tpu.py`:
per-chunk blocks with the chunk loop on the grid and the state in VMEM scratch).

Notation per (batch, head, chunk): C tokens, K key dim, V value (or value-block) dim; Γ the
in-chunk cumulative log-decay; masks from the in-chunk reset count cnt (docs/maths.md §1.4–1.5).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

F32 = jnp.float32


def mm(a, b, dtype):
  """a [M, D] @ b [D, N] with operands cast to `dtype` (bf16: tensor cores) and fp32 accumulation."""
  return lax.dot_general(a.astype(dtype), b.astype(dtype), (((1,), (0,)), ((), ())),
                         preferred_element_type=F32, precision=_precision(dtype))


def mm_tn(a, b, dtype):
  """aᵀ b for a [D, M], b [D, N] -> [M, N]."""
  return lax.dot_general(a.astype(dtype), b.astype(dtype), (((0,), (0,)), ((), ())),
                         preferred_element_type=F32, precision=_precision(dtype))


def mm_nt(a, b, dtype):
  """a bᵀ for a [M, D], b [N, D] -> [M, N]."""
  return lax.dot_general(a.astype(dtype), b.astype(dtype), (((1,), (1,)), ((), ())),
                         preferred_element_type=F32, precision=_precision(dtype))


def gated(q, k, gam, sees, in_last, gam_last):
  """e^Γ⊙Q and e^Γ⊙K on the rows that see S₀, e^{Γ_C−Γ}⊙K on the rows of the chunk's last
  segment (0 elsewhere): the decayed operands of the state passes and of W. Γ never rises inside
  a chunk, so no exponent here is positive."""
  decay = jnp.exp(gam)
  return (jnp.where(sees, q * decay, 0.0), jnp.where(sees, k * decay, 0.0),
          jnp.where(in_last, k * jnp.exp(gam_last - gam), 0.0))


def _precision(dtype):
  # fp32 operands: full fp32 products (no TF32), so fp32 runs match the reference to ~1e-6.
  return lax.Precision.HIGHEST if jnp.dtype(dtype) == F32 else None


def fwd_step(s, qg, kt, w, u, aqk, d, mm_dtype):
  """One chunk of the state pass: Δ = U − W S; O = Qg S + A_qk Δ; S' = d⊙S + Ktᵀ Δ.

  s [K, V] fp32; qg, kt, w [C, K]; u [C, V]; aqk [C, C]; d [K, 1]. Returns (S', O, Δ) fp32.
  """
  delta = u.astype(F32) - mm(w, s, mm_dtype)
  o = mm(qg, s, mm_dtype) + mm(aqk, delta, mm_dtype)
  s_next = d * s + mm_tn(kt, delta, mm_dtype)
  return s_next, o, delta


def bwd_step(ds, do, qg, kt, w, aqk, d, mm_dtype):
  """Reverse of `fwd_step` for the state path, given dS' (grad of the state leaving the chunk).

  dΔ = A_qkᵀ dO + Kt dS';  dS = Qgᵀ dO + d⊙dS' − Wᵀ dΔ.  Returns (dS, dΔ) fp32.
  """
  do = do.astype(F32)
  ddelta = mm_tn(aqk, do, mm_dtype) + mm(kt, ds, mm_dtype)
  ds_prev = mm_tn(qg, do, mm_dtype) + d * ds - mm_tn(w, ddelta, mm_dtype)
  return ds_prev, ddelta


def state_step(s, kt, w, u, d, mm_dtype):
  """Sequential part of one chunk in the split forward: Δ = U − W S; S' = d⊙S + Ktᵀ Δ.

  Same maths (and operand casts) as the Δ and S' of `fwd_step`, without the output. s [K, V]
  fp32; kt, w [C, K]; u [C, V]; d [K, 1]. Returns (S', Δ) fp32.
  """
  delta = u.astype(F32) - mm(w, s, mm_dtype)
  return d * s + mm_tn(kt, delta, mm_dtype), delta


def out_kernel(qg_ref, h_ref, aqk_ref, delta_ref, o_ref, *, mm_dtype):
  """Chunk-parallel output of the split forward: O = Qg h + A_qk Δ for one chunk, from the
  entering state h and Δ that the sequential pass stored (in the dots' operand dtype, which is
  exactly what `fwd_step`'s dots cast S and Δ to, so both variants compute the same O).
  Refs: qg [C, K]; h [K, V]; aqk [C, C]; delta [C, V]; o [C, V] (fp32 out).
  """
  o = mm(qg_ref[...], h_ref[...], mm_dtype) + mm(aqk_ref[...], delta_ref[...], mm_dtype)
  o_ref[...] = o.astype(o_ref.dtype)


def chunk_bwd_kernel(h_ref, dh_ref, delta_ref, ddelta_ref, do_ref,
                     dqg_ref, dw_ref, dkt_ref, daqk_ref, dd_ref, *, mm_dtype):
  """Per-chunk gradients of the state-pass inputs that need the whole V: given S (entering),
  dS' (leaving), Δ, dΔ, dO: dQg = dO Sᵀ, dW = −dΔ Sᵀ, dKt = Δ dS'ᵀ, dA_qk = dO Δᵀ,
  dd = rowsum(S ⊙ dS'). Refs: h, dh [K, V]; delta, ddelta, do [C, V]; outputs fp32.
  """
  h = h_ref[...].astype(F32)
  dh = dh_ref[...].astype(F32)
  delta = delta_ref[...].astype(F32)
  ddelta = ddelta_ref[...].astype(F32)
  do = do_ref[...].astype(F32)
  dqg_ref[...] = mm_nt(do, h, mm_dtype)
  dw_ref[...] = -mm_nt(ddelta, h, mm_dtype)
  dkt_ref[...] = mm_nt(delta, dh, mm_dtype)
  daqk_ref[...] = mm_nt(do, delta, mm_dtype)
  dd_ref[...] = jnp.sum(h * dh, axis=1, keepdims=True)
