"""Chunked KDA through the Pallas kernels, with a chunked custom_vjp backward (docs/maths.md §1.4).

Shared by the "pallas_gpu" and "pallas_tpu" backends: `platform` picks the launchers
(pallas_gpu.py / pallas_tpu.py), which have the same contracts.
Forward:  chunk cumsum Γ → intra-chunk kernels (A_qk, W, U, e^Γ⊙Q, e^{Γ_C−Γ}⊙K per chunk,
            parallel over chunks)
          → state pass, sequential over chunks and parallel over B × H × V-blocks: per chunk
            Δ = U − W S, O = Qg S + A_qk Δ, S' = d⊙S + Ktᵀ Δ (on the GPU either in one kernel or,
            when the programs outnumber the SMs, split into a sequential Δ / S' kernel and a
            chunk-parallel output kernel: pallas_gpu.split_forward).
          Returns O, the final state and, for the backward, the entering state h per chunk and Δ.
Backward: reverse state pass (dS' per chunk, dΔ = A_qkᵀ dO + Kt dS', dS = Qgᵀ dO + d⊙dS' − Wᵀ dΔ)
          → chunk kernel (dQg, dW, dKt, dA_qk, dd from S, dS', Δ, dΔ, dO)
          → intra-chunk backward kernels (WY solve and score gradients; their jnp twin is the VJP
            of `intra.intra_all`) → dg = in-chunk reverse cumsum of dΓ.
The recurrence is never differentiated.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from pallas_kernels.kda import intra as intra_lib

F32 = jnp.float32

# The name the training forward gives every kernel output that the backward pass or the layer
# after it reads (the intra-chunk A_qk, W, U, gated Q and K, A_kk and its inverse, the chunk
# decays, the output, the per-chunk entering states and Δ), so that a remat policy can keep them
# all instead of running the forward kernels again in the backward pass. They are named where
# they are made: a value the state pass reads before it is named would be recomputed to rerun
# that pass. The in-chunk cumsum Γ stays unnamed (recomputed: one cheap kernel from g). jax
# leaves every pallas_call of the recomputation in the backward's jaxpr (its dead-code rule
# keeps them); XLA drops those whose outputs go unused.
RESIDUAL_NAME = "kda_residuals"


def _launchers(platform: str):
  if platform == "gpu":
    from pallas_kernels.kda import pallas_gpu as mod
  elif platform == "tpu":
    from pallas_kernels.kda import pallas_tpu as mod
  else:
    raise ValueError(f"kda pallas: unknown platform {platform!r} (gpu or tpu)")
  return mod


def _forward(q, k, v, g, beta, s0, cnt, *, scale, chunk, platform, interpret, save):
  mod = _launchers(platform)
  name = (lambda x: checkpoint_name(x, RESIDUAL_NAME)) if save else (lambda x: x)
  gam = mod.chunk_cumsum(g, chunk, interpret=interpret)
  d = name(intra_lib.state_decay(gam, cnt, chunk))
  inter = mod.intra(q, k, v, gam, beta.astype(F32), cnt, scale=scale, chunk=chunk,
                    interpret=interpret, save=save)
  aqk, w, u, qg, kt, akk, inv = (x if x is None else name(x) for x in inter)
  outs = mod.state_fwd(qg, kt, w, u, aqk, d, s0.astype(F32), chunk=chunk, save=save,
                       interpret=interpret)
  if save:
    o, sf, hs, delta = outs
    outs = (name(o), sf, name(hs), name(delta))
  return outs, (aqk, w, u, qg, kt, akk, inv, gam, d)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def kda_pallas(q, k, v, g, beta, s0, cnt, scale, chunk, platform, interpret):
  """q, k [B,T,H,K] (q unscaled), v [B,T,H,V] in one float dtype (bf16 or fp32: also the dots'
  operand dtype); g [B,T,H,K], beta [B,T,H], s0 [B,H,K,V] fp32; cnt = intra.reset_counts(...).
  T must be a multiple of chunk. Returns (o [B,T,H,V] in q's dtype (fp32 sums rounded once in
  the state kernel), S_final [B,H,K,V] fp32)."""
  (o, sf), _ = _forward(q, k, v, g, beta, s0, cnt, scale=scale, chunk=chunk, platform=platform,
                        interpret=interpret, save=False)
  return o, sf


def _fwd(q, k, v, g, beta, s0, cnt, scale, chunk, platform, interpret):
  (o, sf, hs, delta), inter = _forward(
      q, k, v, g, beta, s0, cnt, scale=scale, chunk=chunk, platform=platform,
      interpret=interpret, save=True)
  return (o, sf), (q, k, v, g, beta, cnt, hs, delta) + inter


def _bwd(scale, chunk, platform, interpret, res, cts):
  q, k, v, g, beta, cnt, hs, delta, aqk, w, u, qg, kt, akk, inv, gam, d = res
  do, dsf = cts
  mod = _launchers(platform)
  ds0, dhs, ddelta = mod.state_bwd(do.astype(F32), dsf.astype(F32), qg, kt, w, aqk, d,
                                   chunk=chunk, interpret=interpret)
  dqg, dw, dkt, daqk, dd = mod.chunk_bwd(hs, dhs, delta, ddelta, do.astype(F32), chunk=chunk,
                                         interpret=interpret)
  dq, dk, dv, dbeta, dg = mod.intra_bwd(
      q, k, v, gam, beta.astype(F32), cnt, akk, inv, w, u, daqk, dw, ddelta, dqg, dkt, dd, d,
      scale=scale, chunk=chunk, interpret=interpret)
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dg.astype(g.dtype),
          dbeta[..., 0].astype(beta.dtype), ds0, jnp.zeros_like(cnt))


kda_pallas.defvjp(_fwd, _bwd)
