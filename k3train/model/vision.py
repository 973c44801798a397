"""The K3 vision tower (MoonViT-V2 / MoonViT-3D) and its PatchMergerMLPV2 projector (docs/maths.md §6).

Input: the packed patches of each batch row, as the pipeline emits them (k3train/data/pipeline.py):

  patches_bpc  [B, P, 588] uint8   14 × 14 × 3 pixels per patch; the row's grids concatenated in
                                   token order, each grid's patches in (frame, row, column) order
  grids_bg3    [B, G, 3] int32     (t, h, w) of each grid (image: t = 1; video chunk: t ≤ 4);
                                   zero rows at the tail are padding
  grid_ids_bp  [B, P] int32        1-based grid of each patch, 0 = padding

Output: vision tokens [B, P/4, d_model]. Slot k of row b holds the row's k-th token: grid after
grid, h·w/4 tokens each in raster order of the grid's 2×2 cells; the slots after the row's last
token are padding (never read by the splice).

Steps:
  1. pixels → [−1, 1] (x / 127.5 − 1); patch embedding 588 → D, no bias (the 14 × 14 conv);
  2. + the learnable 64 × 64 × D position table, bilinearly resampled to the grid's h × w (the
     sampling of torch's `interpolate(mode="bilinear", align_corners=False)`), the same for every
     frame; + the fixed sin-cos embedding of the frame index, only for grids with t > 1 (§6.4);
  3. L pre-norm blocks: x += o_proj(attention(RoPE2D(q), RoPE2D(k), v)) of RMSNorm(x), one fused
     q/k/v matmul (12 heads × 128, no biases), bidirectional and only within one grid — the
     attention op with causal=False and segment ids = grid ids, so no patch sees another grid
     of its row; x += down(GELU_tanh(up(RMSNorm(x))));
  4. final RMSNorm;
  5. sd2_tpool: the mean over a grid's t frames, then each 2×2 cell concatenated in the order
     (0,0), (0,1), (1,0), (1,1) → 4D values per token;
  6. PatchMergerMLPV2: Linear 4D → 4D, GELU (erf), Linear 4D → d_model, RMSNorm (§6.2).

2D RoPE (§6.3): head dims as D/2 adjacent pairs; pair 2j turns by column · ω_j, pair 2j + 1 by
row · ω_j, ω_j = θ^(−4j/D). Every frame of a chunk uses the same (row, column) angles.

Everything has static shapes: each patch finds its grid, frame, row and column from the grid
table; the merge gathers the patches of each token (no scatter in the forward pass). Placeholder
splicing (`splice`) replaces the k-th <|image_pad|> embedding of a row by the row's k-th token.

Parameter names follow the text layers' roles (per-head q/k/v [D, H, K] and o [H, K, D], whole
matrices up/down, `embedding` tables, `scale` norm gains), so per-head Muon, weight decay and
the rule tables treat them like their text counterparts; the 27 blocks are one scanned `stack`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from k3train.model import layers
from k3train.model import remat
from k3train.parallel import attention as parallel_attention
from k3train.parallel import axes as ax
from k3train.parallel.rules import constrain

PATCH_VALUES = 14 * 14 * 3     # values per patch (model.vision.patch_size = 14, RGB)
MERGE = 2                      # 2×2 spatial merge
# Offsets (row, column) of the four patches of a merged token, in concatenation order.
MERGE_ORDER = ((0, 0), (0, 1), (1, 0), (1, 1))
TIME_BASE = 10_000.0           # sin-cos time embedding base


# ----------------------------------------------------------------------------- geometry


def patch_geometry(grids_bg3: jax.Array, grid_ids_bp: jax.Array):
  """Per patch: dict of int32 [B, P] arrays frame, row, col, t, h, w and bool valid.

  Padding patches (grid id 0) get frame = row = col = 0, t = h = w = 1 and valid = False.
  """
  grids = grids_bg3.astype(jnp.int32)
  t_bg, h_bg, w_bg = grids[..., 0], grids[..., 1], grids[..., 2]
  sizes_bg = t_bg * h_bg * w_bg
  starts_bg = jnp.cumsum(sizes_bg, axis=1) - sizes_bg
  valid = grid_ids_bp > 0
  g_bp = jnp.maximum(grid_ids_bp.astype(jnp.int32) - 1, 0)
  take = lambda a_bg: jnp.take_along_axis(a_bg, g_bp, axis=1)
  t, h, w, start = (jnp.where(valid, take(a), d) for a, d in
                    ((t_bg, 1), (h_bg, 1), (w_bg, 1), (starts_bg, 0)))
  h, w, t = jnp.maximum(h, 1), jnp.maximum(w, 1), jnp.maximum(t, 1)
  local = jnp.arange(grid_ids_bp.shape[1], dtype=jnp.int32)[None, :] - start
  local = jnp.where(valid, jnp.maximum(local, 0), 0)
  frame, within = local // (h * w), local % (h * w)
  return {"frame": frame, "row": within // w, "col": within % w, "t": t, "h": h, "w": w,
          "valid": valid}


def bilinear_taps(pos: jax.Array, out_size: jax.Array, in_size: int):
  """torch bilinear sampling with align_corners=False along one axis.

  Output index `pos` of `out_size` reads the source at s = (pos + 0.5) · in/out − 0.5, clamped at
  0: returns (i0, i1, frac) with value = (1 − frac) · src[i0] + frac · src[i1] (fp32 frac).
  """
  scale = jnp.float32(in_size) / out_size.astype(jnp.float32)
  src = jnp.maximum((pos.astype(jnp.float32) + 0.5) * scale - 0.5, 0.0)
  i0 = jnp.minimum(jnp.floor(src).astype(jnp.int32), in_size - 1)
  i1 = jnp.minimum(i0 + 1, in_size - 1)
  return i0, i1, src - i0.astype(jnp.float32)


def time_embedding(frame: jax.Array, dim: int) -> jax.Array:
  """Fixed 1-D sin-cos embedding of the frame index: [sin(f·ω), cos(f·ω)], ω_i = 10⁴^(−2i/dim)."""
  omega = TIME_BASE ** (-jnp.arange(dim // 2, dtype=jnp.float32) / (dim / 2))
  angle = frame.astype(jnp.float32)[..., None] * omega
  return jnp.concatenate([jnp.sin(angle), jnp.cos(angle)], axis=-1)


def rope_2d(row: jax.Array, col: jax.Array, head_dim: int, theta: float):
  """(cos, sin) [..., head_dim/2] fp32: pair 2j turns by col·ω_j, pair 2j+1 by row·ω_j (§6.3)."""
  omega = theta ** (-4.0 * jnp.arange(head_dim // 4, dtype=jnp.float32) / head_dim)
  ang_col = col.astype(jnp.float32)[..., None] * omega
  ang_row = row.astype(jnp.float32)[..., None] * omega
  angle = jnp.stack([ang_col, ang_row], axis=-1).reshape(*row.shape, head_dim // 2)
  return jnp.cos(angle), jnp.sin(angle)


def apply_rope(x_bphk: jax.Array, cos_bpk: jax.Array, sin_bpk: jax.Array) -> jax.Array:
  """Rotates adjacent pairs (x₂ᵢ, x₂ᵢ₊₁) of every head by the angles of their patch; fp32."""
  x = x_bphk.astype(jnp.float32).reshape(*x_bphk.shape[:-1], -1, 2)
  a, b = x[..., 0], x[..., 1]
  c, s = cos_bpk[:, :, None, :], sin_bpk[:, :, None, :]
  return jnp.stack([a * c - b * s, a * s + b * c], axis=-1).reshape(x_bphk.shape)


# ----------------------------------------------------------------------------- modules


def _dense(x: jax.Array, kernel: jax.Array, n_in: int, dtype) -> jax.Array:
  """x · W over x's trailing n_in dims and W's leading ones, in `dtype` with fp32 accumulation."""
  dims = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
  y = jax.lax.dot_general(x.astype(dtype), kernel.astype(dtype), (dims, ((), ())),
                          preferred_element_type=jnp.float32)
  return y.astype(dtype)


class PatchEmbed(nnx.Module):
  """The 14 × 14 patch convolution as a [588, D] matrix (no bias)."""

  def __init__(self, dim: int, *, dtype, param_dtype, rngs: nnx.Rngs):
    self.dtype = dtype
    self.embedding = layers.param(rngs, layers.normal_init(PATCH_VALUES ** -0.5), (PATCH_VALUES, dim),
                                  (ax.PATCH_DIM, ax.VIT_EMBED), param_dtype)

  def __call__(self, patches_bpc: jax.Array) -> jax.Array:
    pixels = patches_bpc.astype(jnp.float32) / 127.5 - 1.0
    return _dense(pixels, self.embedding[...], 1, self.dtype)


class PositionTable(nnx.Module):
  """The learnable [pos_height, pos_width, D] table (normal init, std 1), resampled per grid."""

  def __init__(self, height: int, width: int, dim: int, *, param_dtype, rngs: nnx.Rngs):
    self.height, self.width = height, width
    self.embedding = layers.param(rngs, layers.normal_init(1.0), (height, width, dim),
                                  (ax.POS_GRID, ax.POS_GRID, ax.VIT_EMBED), param_dtype)

  def __call__(self, geo) -> jax.Array:
    """[B, P, D] fp32: the table bilinearly resampled to each patch's grid at (row, col)."""
    table = self.embedding[...].astype(jnp.float32).reshape(self.height * self.width, -1)
    r0, r1, fr = bilinear_taps(geo["row"], geo["h"], self.height)
    c0, c1, fc = bilinear_taps(geo["col"], geo["w"], self.width)
    out = 0.0
    for r, wr in ((r0, 1.0 - fr), (r1, fr)):
      for c, wc in ((c0, 1.0 - fc), (c1, fc)):
        out = out + (wr * wc)[..., None] * jnp.take(table, r * self.width + c, axis=0)
    return out


class VisionBlock(nnx.Module):
  """One pre-norm block: RMSNorm → 2D-RoPE attention within grids, RMSNorm → tanh-GELU MLP."""

  def __init__(self, w: ml_collections.ConfigDict, *, dtype, param_dtype, rngs: nnx.Rngs):
    d, h, k, f = w.d_model, w.num_heads, w.head_dim, w.mlp_hidden
    self.dtype, self.backend, self.scale = dtype, w.backend, k ** -0.5
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    norm = lambda: layers.RMSNorm(d, eps=w.norm_eps, param_dtype=param_dtype, rngs=rngs)
    self.attn_norm = norm()
    qkv = lambda: layers.Linear((d,), (h, k), (ax.VIT_EMBED, ax.VIT_HEADS, ax.HEAD_DIM),
                                std=d ** -0.5, **kw)
    self.q_proj, self.k_proj, self.v_proj = qkv(), qkv(), qkv()
    self.o_proj = layers.Linear((h, k), (d,), (ax.VIT_HEADS, ax.HEAD_DIM, ax.VIT_EMBED),
                                std=(h * k) ** -0.5, **kw)
    self.mlp_norm = norm()
    self.up_proj = layers.Linear((d,), (f,), (ax.VIT_EMBED, ax.VIT_MLP), std=math.sqrt(2 / d), **kw)
    self.down_proj = layers.Linear((f,), (d,), (ax.VIT_MLP, ax.VIT_EMBED), std=math.sqrt(2 / f), **kw)

  def __call__(self, x_bpd, grid_ids_bp, cos_bpk, sin_bpk):
    h = self.q_proj.out_shape[0]
    y = self.attn_norm(x_bpd)
    # One fused q/k/v matmul over the three per-head kernels [D, 3H, K].
    w_qkv = jnp.concatenate([p.kernel[...] for p in (self.q_proj, self.k_proj, self.v_proj)], axis=1)
    qkv = constrain(_dense(y, w_qkv, 1, self.dtype), ax.BATCH, ax.PATCHES, ax.VIT_HEADS, ax.HEAD_DIM)
    q, k, v = qkv[:, :, :h], qkv[:, :, h:2 * h], qkv[:, :, 2 * h:]
    q = apply_rope(q, cos_bpk, sin_bpk).astype(self.dtype)
    k = apply_rope(k, cos_bpk, sin_bpk).astype(self.dtype)
    out, _ = parallel_attention.attention(q, k, v, grid_ids_bp, scale=self.scale, causal=False,
                                          backend=self.backend,
                                          names=(ax.BATCH, ax.PATCHES, ax.VIT_HEADS))
    out = constrain(out.astype(self.dtype), ax.BATCH, ax.PATCHES, ax.VIT_HEADS, ax.HEAD_DIM)
    x_bpd = x_bpd + self.o_proj(out)
    hidden = jax.nn.gelu(self.up_proj(self.mlp_norm(x_bpd)).astype(jnp.float32), approximate=True)
    hidden = constrain(hidden.astype(self.dtype), ax.BATCH, ax.PATCHES, ax.VIT_MLP)
    x_bpd = x_bpd + self.down_proj(hidden)
    return constrain(x_bpd, ax.BATCH, ax.PATCHES, ax.VIT_EMBED)


class PatchMergerMLPV2(nnx.Module):
  """[.., 4D] merged patches → Linear 4D→4D → GELU (erf) → Linear 4D→d_model → RMSNorm (§6.2)."""

  def __init__(self, merged: int, d_model: int, *, eps: float, dtype, param_dtype, rngs: nnx.Rngs):
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.dtype = dtype
    self.up_proj = layers.Linear((merged,), (merged,), (ax.VIT_MERGED, ax.VIT_MLP),
                                 std=math.sqrt(2 / merged), **kw)
    self.down_proj = layers.Linear((merged,), (d_model,), (ax.VIT_MLP, ax.EMBED),
                                   std=math.sqrt(2 / merged), **kw)
    self.norm = layers.RMSNorm(d_model, eps=eps, param_dtype=param_dtype, rngs=rngs)

  def __call__(self, x_bnm: jax.Array) -> jax.Array:
    hidden = jax.nn.gelu(self.up_proj(x_bnm).astype(jnp.float32), approximate=False)
    hidden = constrain(hidden.astype(self.dtype), ax.BATCH, ax.PATCHES, ax.VIT_MLP)
    return self.norm(self.down_proj(hidden))


def merge_tokens(x_bpd: jax.Array, grids_bg3: jax.Array, num_tokens: int, max_frames: int) -> jax.Array:
  """sd2_tpool: [B, P, D] encoded patches → [B, num_tokens, 4·D] (module docstring, step 5).

  Token n of row b belongs to grid g with tok_start[g] ≤ n < tok_start[g] + h·w/4; its local index
  m gives the cell (i, j) = divmod(m, w/2), whose patches (2i + di, 2j + dj) of every frame
  f < t are gathered, averaged over f (fp32) and concatenated in MERGE_ORDER. Slots past the
  row's tokens are zero.
  """
  grids = grids_bg3.astype(jnp.int32)
  t_bg, h_bg, w_bg = grids[..., 0], grids[..., 1], grids[..., 2]
  tokens_bg = (h_bg // MERGE) * (w_bg // MERGE)
  tok_end_bg = jnp.cumsum(tokens_bg, axis=1)
  tok_start_bg = tok_end_bg - tokens_bg
  patch_start_bg = jnp.cumsum(t_bg * h_bg * w_bg, axis=1) - t_bg * h_bg * w_bg
  n = jnp.arange(num_tokens, dtype=jnp.int32)
  g_bn = jnp.sum(tok_end_bg[:, None, :] <= n[None, :, None], axis=-1).astype(jnp.int32)
  valid = g_bn < grids.shape[1]
  g_bn = jnp.minimum(g_bn, grids.shape[1] - 1)
  take = lambda a_bg: jnp.take_along_axis(a_bg, g_bn, axis=1)
  t, h, w = jnp.maximum(take(t_bg), 1), take(h_bg), take(w_bg)
  local = n[None, :] - take(tok_start_bg)
  half_w = jnp.maximum(w // MERGE, 1)
  i, j = local // half_w, local % half_w
  base = take(patch_start_bg) + MERGE * i * w + MERGE * j
  x32 = x_bpd.astype(jnp.float32)
  parts = []
  for di, dj in MERGE_ORDER:
    acc = jnp.zeros((*g_bn.shape, x_bpd.shape[-1]), jnp.float32)
    for f in range(max_frames):
      ok = valid & (f < t)
      idx = jnp.where(ok, base + f * h * w + di * w + dj, 0)
      acc = acc + jnp.where(ok[..., None], jnp.take_along_axis(x32, idx[..., None], axis=1), 0.0)
    parts.append(acc / t[..., None].astype(jnp.float32))
  return jnp.concatenate(parts, axis=-1).astype(x_bpd.dtype)


class VisionTower(nnx.Module):
  """Patches of each row → vision tokens [B, P/4, d_model] (module docstring)."""

  def __init__(self, w: ml_collections.ConfigDict, *, d_model: int, remat_policy: str, dtype,
               param_dtype, rngs: nnx.Rngs):
    self.dtype, self.head_dim, self.theta = dtype, w.head_dim, w.rope_theta
    self.max_frames, self.dim, self.num_layers = w.max_frames, w.d_model, w.num_layers
    self.remat_policy = remat_policy          # model.remat_policy: none | full | a jax policy name
    self.patch_embed = PatchEmbed(w.d_model, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.pos_embed = PositionTable(w.pos_height, w.pos_width, w.d_model, param_dtype=param_dtype,
                                   rngs=rngs)

    @nnx.split_rngs(splits=w.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: ax.LAYERS})
    def make_stack(rngs):
      return VisionBlock(w, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    self.stack = make_stack(rngs)
    self.final_norm = layers.RMSNorm(w.d_model, eps=w.norm_eps, param_dtype=param_dtype, rngs=rngs)
    self.projector = PatchMergerMLPV2(MERGE * MERGE * w.d_model, d_model, eps=w.projector_norm_eps,
                                      dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def encode(self, patches_bpc, grids_bg3, grid_ids_bp) -> jax.Array:
    """Steps 1–4: encoded patches [B, P, D] (final RMSNorm applied)."""
    geo = patch_geometry(grids_bg3, grid_ids_bp)
    x = self.patch_embed(patches_bpc).astype(jnp.float32) + self.pos_embed(geo)
    video = (geo["t"] > 1)[..., None]
    x = jnp.where(video, x + time_embedding(geo["frame"], self.dim), x)
    x = constrain(x.astype(self.dtype), ax.BATCH, ax.PATCHES, ax.VIT_EMBED)
    cos, sin = rope_2d(geo["row"], geo["col"], self.head_dim, self.theta)
    segments = grid_ids_bp.astype(jnp.int32)
    graphdef, params, rest = nnx.split(self.stack, nnx.Param, ...)

    def body(x, xs):
      block = nnx.merge(graphdef, *xs)
      return block(x, segments, cos, sin), None

    if self.remat_policy != "none":
      body = jax.checkpoint(body, policy=remat.policy(self.remat_policy), prevent_cse=False)
    x, _ = jax.lax.scan(body, x, (params, rest))
    return self.final_norm(x)

  def __call__(self, patches_bpc, grids_bg3, grid_ids_bp) -> jax.Array:
    x = self.encode(patches_bpc, grids_bg3, grid_ids_bp)
    merged = merge_tokens(x, grids_bg3, patches_bpc.shape[1] // (MERGE * MERGE), self.max_frames)
    merged = constrain(merged, ax.BATCH, ax.PATCHES, ax.VIT_MERGED)
    return constrain(self.projector(merged), ax.BATCH, ax.PATCHES, ax.EMBED)


def splice(x_btd: jax.Array, tokens_bt: jax.Array, vision_bnd: jax.Array, placeholder_id: int) -> jax.Array:
  """Replaces the k-th placeholder embedding of each row by the row's k-th vision token.

  The pipeline puts exactly Σ h·w/4 placeholders in a row, in grid order, so they map one to one
  onto the row's tokens; every other position keeps its text embedding.
  """
  is_placeholder = tokens_bt == placeholder_id
  k_bt = jnp.clip(jnp.cumsum(is_placeholder.astype(jnp.int32), axis=1) - 1, 0, vision_bnd.shape[1] - 1)
  gathered = jnp.take_along_axis(vision_bnd, k_bt[..., None], axis=1).astype(x_btd.dtype)
  return jnp.where(is_placeholder[..., None], gathered, x_btd)
