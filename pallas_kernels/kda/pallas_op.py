"""Chunked KDA through Pallas kernels, with a chunked custom_vjp backward (k3-math §1.4).

Forward:  intra-chunk kernel (A_qk, W, U, e^Γ⊙Q, e^{Γ_C−Γ}⊙K per chunk, parallel over chunks)
          → state pass, sequential over chunks and parallel over B × H × V-blocks, in one of two
            variants (pallas_gpu.Settings.split / split_fwd, by default split when the B·H·V-block
            programs outnumber the GPU's SMs; the TPU launchers have only the fused one):
            fused: one sequential kernel computes Δ = U − W S, O = Qg S + A_qk Δ and
                   S' = d⊙S + Ktᵀ Δ per chunk;
            split: the sequential kernel computes only Δ and S' and stores every chunk's entering
                   state h and Δ, then a chunk-parallel kernel computes O = Qg h + A_qk Δ.
          Both return O, the final state and, for the backward, h per chunk and Δ.
Backward: reverse state pass (dS' per chunk, dΔ = A_qkᵀ dO + Kt dS', dS = Qgᵀ dO + d⊙dS' − Wᵀ dΔ);
            split variant: a chunk-parallel kernel first computes the state-independent
            A_qkᵀ dO (and Qgᵀ dO, Settings.hoist_qdo), so the sequential loop only adds
            Kt dS' and Wᵀ dΔ
          → chunk kernel (dQg, dW, dKt, dA_qk, dd from S, dS', Δ, dΔ, dO)
          → intra-chunk backward kernel (WY solve and score gradients; its jnp twin is the VJP
            of `intra.intra_all`, which the tests compare it with) → dg = in-chunk reverse
            cumsum of dΓ.
The recurrence is never differentiated. `platform` picks the launchers (pallas_gpu / pallas_tpu);
the GPU launchers read their variants from pallas_gpu.SETTINGS (pallas_gpu.configured swaps it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.kda import intra as intra_lib

F32 = jnp.float32


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
  gam = mod.chunk_cumsum(g, chunk, interpret=interpret)
  d = intra_lib.state_decay(gam, cnt, chunk)
  aqk, w, u, qg, kt, akk, inv = mod.intra(q, k, v, gam, beta.astype(F32), cnt, scale=scale,
                                          chunk=chunk, interpret=interpret, save=save)
  outs = mod.state_fwd(qg, kt, w, u, aqk, d, s0.astype(F32), chunk=chunk, save=save,
                       interpret=interpret)
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
