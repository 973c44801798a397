"""Parameter counts of a model config by component, from the abstract model (nothing allocated).

Active parameters per token = total − routed-expert parameters × (1 − top_k / num_experts).
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
  for path, leaf in nnx.to_flat_state(params):
    n = math.prod(leaf.shape)
    comp = _classify(model, path, leaf)
    by_component[comp] = by_component.get(comp, 0) + n
  total = sum(by_component.values())
  m = cfg.model.moe
  routed = by_component.get("routed_experts", 0)
  active = total - routed * (1 - m.top_k / m.num_experts)
  return {"total_params": int(total), "active_params": int(round(active)),
          "components": {k: {"params": v, "share": round(v / total, 5)}
                         for k, v in sorted(by_component.items(), key=lambda kv: -kv[1])}}


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
