"""QK-Clip for gated MLA (docs/maths.md §4.4, Kimi K2's MuonClip rule), applied after the optimizer step.

For every GatedMLA and head h, with S_max^h the head's largest pre-softmax scaled logit of the
step's forward pass (the `max_logit` variable the layer writes):

    γ_h = min(1, τ / S_max^h)
    q_b_proj  q^C columns of head h   × sqrt(γ_h)
    q_b_proj  q^R columns of head h   × γ_h
    kv_b_proj k^C columns of head h   × sqrt(γ_h)

so every logit of head h, q^C·k^C + q^R·k^R, scales by exactly γ_h. The shared k^R (the last
`rope` outputs of kv_a_proj), the value columns of kv_b_proj, g_proj and o_proj are untouched.

The edit is a pure function of (params, rest): elementwise multiplies of each kernel by a small
broadcast factor (no reshape, slice or concatenate of a kernel), so it runs under jit and a sharded
kernel keeps its layout. Heads that are not clipped (S_max ≤ τ, or a non-finite S_max) keep their
weights bit-for-bit: the result is selected with `jnp.where(factor == 1, kernel, kernel × factor)`,
which is exact even where the backend flushes subnormals.

Layers are found by path: every `<owner>/max_logit` leaf in `rest` pairs with
`<owner>/q_b_proj/kernel` and `<owner>/kv_b_proj/kernel` in `params` (and, to infer the head
split, `<owner>/kv_a_proj/kernel`). Scanned layers carry leading layer axes on every variable:
max_logit [L, H] and kernels [L, in, H, cols]; the factors then have shape [L, H].
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from k3train.tree_paths import path_names

MAX_LOGIT = "max_logit"
Q_B, KV_B, KV_A, KERNEL = "q_b_proj", "kv_b_proj", "kv_a_proj", "kernel"
STAT_PREFIX = "mla_max_logit/"
STAT_HEADS = "qk_clip_heads"


def _flat(tree) -> dict[tuple[str, ...], jax.Array]:
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {tuple(path_names(path)): leaf for path, leaf in leaves}


def _nope_from_config(config) -> int | None:
  """qk_nope_head_dim from a full config (model.mla), a model config (mla) or the mla config itself."""
  if config is None:
    return None
  for keys in (("model", "mla"), ("mla",), ()):
    node = config
    try:
      for k in keys:
        node = node[k]
      return int(node["qk_nope_head_dim"])
    except (KeyError, AttributeError, TypeError):
      continue
  raise ValueError("qk_clip: config has none of model.mla.qk_nope_head_dim, mla.qk_nope_head_dim, "
                   "qk_nope_head_dim")


def _layer_name(owner: tuple[str, ...]) -> str:
  names = owner[:-1] if owner and owner[-1] == "mixer" else owner
  return ".".join(names) or ".".join(owner) or "root"


def _resolve_nope(owner, nope, q_b, kv_b, kv_a) -> int:
  where = "/".join(owner)
  inferred = None
  if kv_a is not None:
    rope = kv_a.shape[-1] - kv_b.shape[-3]      # kv_a: [..., d, kv_lora + rope]; kv_b: [..., kv_lora, H, ·]
    inferred = q_b.shape[-1] - rope
  if nope is None:
    if inferred is None:
      raise ValueError(f"qk_clip: {where}: pass `nope` or `config` (no kv_a_proj kernel to infer it from)")
    nope = inferred
  elif inferred is not None and inferred != nope:
    raise ValueError(f"qk_clip: {where}: qk_nope_head_dim={nope} disagrees with the kernel shapes "
                     f"(q_b_proj {tuple(q_b.shape)}, kv_a_proj {tuple(kv_a.shape)}, "
                     f"kv_b_proj {tuple(kv_b.shape)} imply {inferred})")
  if not (0 < nope <= q_b.shape[-1] and nope <= kv_b.shape[-1]):
    raise ValueError(f"qk_clip: {where}: nope={nope} does not fit q_b_proj {tuple(q_b.shape)} / "
                     f"kv_b_proj {tuple(kv_b.shape)}")
  return nope


def _scale_columns(kernel: jax.Array, first: jax.Array, rest: jax.Array, n_first: int) -> jax.Array:
  """kernel [..., in, H, C] with per-head columns [:n_first] × first[..., H], [n_first:] × rest[..., H]."""
  cols = jnp.arange(kernel.shape[-1]) < n_first                            # [C]
  factor = jnp.where(cols, first[..., None], rest[..., None])[..., None, :, :]  # [..., 1, H, C]
  compute = jnp.promote_types(kernel.dtype, jnp.float32)
  scaled = (kernel.astype(compute) * factor.astype(compute)).astype(kernel.dtype)
  return jnp.where(factor == 1.0, kernel, scaled)


def clip_factors(max_logit: jax.Array, tau) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(γ, sqrt γ, clipped) per head, fp32. γ = τ / S where finite S > τ, else exactly 1."""
  s = jnp.asarray(max_logit, jnp.float32)
  clipped = jnp.isfinite(s) & (s > tau)
  gamma = jnp.where(clipped, tau / jnp.where(clipped, s, 1.0), 1.0).astype(jnp.float32)
  return gamma, jnp.sqrt(gamma), clipped   # sqrt(1.0) == 1.0 exactly


def qk_clip(params: Any, rest: Any, *, tau: float = 100.0, nope: int | None = None,
            config: Any = None) -> tuple[Any, dict[str, jax.Array]]:
  """Rescales the q/k weights of every MLA head whose last max logit exceeds `tau`.

  Args:
    params: pytree of parameters (nnx.State of nnx.Param as in TrainState.params, or nested dicts).
    rest: pytree holding the layers' `max_logit` leaves ([H], or [L, H] for scanned layers).
    tau: the logit cap τ (> 0; docs/maths.md §4.4 uses 100).
    nope: qk_nope_head_dim (per-head q^C / k^C width). If omitted it is read from `config`
      (`model.mla.qk_nope_head_dim`, `mla.qk_nope_head_dim` or `qk_nope_head_dim`), else inferred
      from the shapes: rope = kv_a_proj cols − kv_lora_rank, nope = q_b_proj head width − rope.
      When given and kv_a_proj is present, it is checked against the shapes.

  Returns:
    (params with the same tree structure, Variable metadata, dtypes and shapes, stats), where
    stats is a flat dict of scalars for logging:
      "mla_max_logit/<layer>": max over heads of S_max for that layer (before the clip), with
        <layer> the module path without the trailing "mixer", e.g. "prefix.3", "suffix.0"; a
        scanned layer gives one entry per leading index, e.g. "stack.layers.3[0]", "stack.layers.3[1]".
      "qk_clip_heads": int32, the number of heads clipped in this call over all layers.
  Pure and jit-compatible (the tree walk happens at trace time; `tau` may be a traced scalar).
  """
  if isinstance(tau, (int, float)) and not tau > 0:
    raise ValueError(f"qk_clip: tau must be > 0, got {tau}")
  nope_cfg = nope if nope is not None else _nope_from_config(config)
  flat_params = _flat(params)
  owners = {names[:-1]: leaf for names, leaf in _flat(rest).items() if names and names[-1] == MAX_LOGIT}

  factors: dict[tuple[str, ...], tuple[jax.Array, jax.Array, jax.Array]] = {}
  splits: dict[tuple[str, ...], int] = {}
  stats: dict[str, jax.Array] = {}
  n_clipped = jnp.zeros((), jnp.int32)
  for owner, s_max in owners.items():
    where = "/".join(owner)
    q_b = flat_params.get(owner + (Q_B, KERNEL))
    kv_b = flat_params.get(owner + (KV_B, KERNEL))
    if q_b is None or kv_b is None:
      raise ValueError(f"qk_clip: {where}/{MAX_LOGIT} has no matching {Q_B}/{KERNEL} and "
                       f"{KV_B}/{KERNEL} in params")
    lead, heads = tuple(s_max.shape[:-1]), s_max.shape[-1]
    for name, k in ((Q_B, q_b), (KV_B, kv_b)):
      if k.ndim != s_max.ndim + 2 or tuple(k.shape[:len(lead)]) != lead or k.shape[-2] != heads:
        raise ValueError(f"qk_clip: {where}/{name} kernel {tuple(k.shape)} does not match "
                         f"max_logit {tuple(s_max.shape)} (expected [*lead, in, H, cols])")
    splits[owner] = _resolve_nope(owner, nope_cfg, q_b, kv_b, flat_params.get(owner + (KV_A, KERNEL)))
    gamma, sqrt_gamma, clipped = clip_factors(s_max, tau)
    factors[owner] = (gamma, sqrt_gamma, clipped)
    n_clipped = n_clipped + jnp.sum(clipped, dtype=jnp.int32)
    layer_max = jnp.max(jnp.asarray(s_max, jnp.float32), axis=-1)         # [*lead]
    base = STAT_PREFIX + _layer_name(owner)
    if not lead:
      stats[base] = layer_max
    else:
      for idx in np.ndindex(*lead):
        stats[f"{base}[{','.join(map(str, idx))}]"] = layer_max[idx]
  stats[STAT_HEADS] = n_clipped

  def edit(path, leaf):
    names = tuple(path_names(path))
    if len(names) < 2 or names[-1] != KERNEL or names[:-2] not in factors:
      return leaf
    owner = names[:-2]
    gamma, sqrt_gamma, _ = factors[owner]
    if names[-2] == Q_B:      # q^C × sqrt γ, q^R × γ
      return _scale_columns(leaf, sqrt_gamma, gamma, splits[owner])
    if names[-2] == KV_B:     # k^C × sqrt γ, v × 1
      return _scale_columns(leaf, sqrt_gamma, jnp.ones_like(gamma), splits[owner])
    return leaf

  return jax.tree_util.tree_map_with_path(edit, params), stats
