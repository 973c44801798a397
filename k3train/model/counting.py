"""Parameter counts of a model config by component, from the abstract model (nothing allocated).

Active parameters per token = total − routed-expert parameters × (1 − top_k / num_experts).
The vision tower and its projector (model.vision) are counted apart, under "vision": the totals,
active count and components above are the text model's (a text token never runs the tower).
The multi-token-prediction module (model.mtp) is counted apart too, under "mtp", as released
model sizes leave it out: it trains beside the model and serves only as a draft in decoding.
The command line is `python -m k3train.tools.count_params`.
"""

from __future__ import annotations

import math

from flax import nnx

from k3train.model import attnres, decoder, layers, moe
from k3train.model.kda import KimiDeltaAttention
from k3train.model.mla import GatedMLA


def count(cfg) -> dict:
  """Counts parameters by component for `cfg` (a full config with a `model` section)."""
  model = decoder.abstract_model(cfg.model)
  params = nnx.state(model, nnx.Param)
  by_component: dict[str, int] = {}
  vision: dict[str, int] = {}
  mtp = 0
  for path, leaf in nnx.to_flat_state(params):
    n = math.prod(leaf.shape)
    if str(path[0]) == "mtp":
      mtp += n
      continue
    if str(path[0]) == "vision":
      comp = _classify_vision(path)
      vision[comp] = vision.get(comp, 0) + n
      continue
    comp = _classify(model, path, leaf)
    by_component[comp] = by_component.get(comp, 0) + n
  total = sum(by_component.values())
  m = cfg.model.moe
  routed = by_component.get("routed_experts", 0)
  active = total - routed * (1 - m.top_k / m.num_experts)
  out = {"total_params": int(total), "active_params": int(round(active)),
         "components": {k: {"params": v, "share": round(v / total, 5)}
                        for k, v in sorted(by_component.items(), key=lambda kv: -kv[1])}}
  if mtp:
    out["mtp"] = {"total_params": mtp}
  if vision:
    n_vision = sum(vision.values())
    out["vision"] = {"total_params": n_vision,
                     "components": {k: {"params": v, "share": round(v / n_vision, 5)}
                                    for k, v in sorted(vision.items(), key=lambda kv: -kv[1])}}
  return out


def _classify_vision(path) -> str:
  """Component of a vision tower parameter: patch_embed, position_table, attention, mlp, norms,
  projector."""
  names = [str(p) for p in path]
  if names[1] == "projector":
    return "projector"
  if names[1] == "patch_embed":
    return "patch_embed"
  if names[1] == "pos_embed":
    return "position_table"
  if names[-2].endswith("norm"):
    return "norms"
  if names[-2] in ("q_proj", "k_proj", "v_proj", "o_proj"):
    return "attention"
  return "mlp"


def _classify(model, path, leaf) -> str:
  """Component name of a parameter, from the module types along its path (outermost first)."""
  nodes = [model]
  for key in path[:-1]:
    parent = nodes[-1]
    nodes.append(parent[key] if isinstance(parent, (list, nnx.List)) else getattr(parent, str(key)))
  for i, node in enumerate(nodes):
    if isinstance(node, KimiDeltaAttention):
      return "kda"
    if isinstance(node, GatedMLA):
      return "mla"
    if isinstance(node, attnres.AttnResMix):
      return "attn_res"
    if isinstance(node, moe.StableLatentMoE):
      child = nodes[i + 1] if i + 1 < len(nodes) else None
      if isinstance(child, moe.Router):
        return "router"
      if isinstance(child, layers.GluMLP):
        return "shared_experts"
      if "experts" in (getattr(leaf, "out_sharding", None) or ()):
        return "routed_experts"
      return "latent_projections"
    if isinstance(node, layers.GluMLP):
      return "dense_ffn"
    if isinstance(node, layers.Embed):
      return "embedding"
  return "lm_head" if str(path[0]) == "lm_head" else "norms"  # pre-sublayer and final RMSNorm gains
