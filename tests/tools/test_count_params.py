"""k3train.tools.count_params on the full K3 config, against a hand count from docs/maths.md §0.2/§1.1/
§2.1/§3/§5.5 and the 2.8 T total / 104 B active of the release (within 2%)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.configs import k3_full
from k3train.model import counting

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def hand_count(m) -> dict[str, int]:
  """Parameters by component, written from the reference tables, not from the module code."""
  d, vocab, n_layers = m.d_model, m.vocab_size, m.num_layers
  n_mla = len(m.mla_layers)
  n_kda = n_layers - n_mla
  n_dense = m.num_dense_layers
  n_moe = n_layers - n_dense

  k = m.kda
  hk = k.num_heads * k.head_dim
  kda = (3 * d * hk                      # q, k, v projections
         + 3 * k.conv_size * hk          # depthwise short convs (per channel, 4 taps)
         + d * k.head_dim + k.head_dim * hk   # f_a (d × K), f_b (K × H·K)
         + k.num_heads                   # A_log
         + hk                            # dt_bias
         + d * k.num_heads               # b_proj
         + d * hk                        # g_proj (full rank)
         + k.head_dim                    # o_norm gain (shared by heads)
         + hk * d)                       # o_proj

  a = m.mla
  h = a.num_heads
  mla = (d * a.q_lora_rank + a.q_lora_rank                                # q_a_proj, q_a_layernorm
         + a.q_lora_rank * h * (a.qk_nope_head_dim + a.qk_rope_head_dim)  # q_b_proj
         + d * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank     # kv_a_proj_with_mqa, norm
         + a.kv_lora_rank * h * (a.qk_nope_head_dim + a.v_head_dim)       # kv_b_proj
         + d * h * a.v_head_dim                                           # g_proj
         + h * a.v_head_dim * d)                                          # o_proj

  e = m.moe
  routed = e.num_experts * 3 * e.latent_dim * e.expert_hidden   # gate, up, down per expert
  return {
      "embedding": vocab * d,
      "lm_head": d * vocab,
      "kda": n_kda * kda,
      "mla": n_mla * mla,
      "dense_ffn": n_dense * 3 * d * m.dense_ffn_hidden,
      "router": n_moe * d * e.num_experts,                      # the QB bias is not a parameter
      "latent_projections": n_moe * (d * e.latent_dim + e.latent_dim + e.latent_dim * d),
      "routed_experts": n_moe * routed,
      "shared_experts": n_moe * 3 * d * e.shared_hidden,
      # two mixing sites per layer (pseudo-query w and gain γ, d each) + the output site
      "attn_res": n_layers * 2 * 2 * d + 2 * d,
      # pre-mixer and pre-FFN RMSNorm gains of every layer + the final norm
      "norms": n_layers * 2 * d + d,
  }


@pytest.fixture(scope="module")
def cfg():
  return k3_full.get_config()


@pytest.fixture(scope="module")
def result(cfg):
  return counting.count(cfg)


def test_total_and_active_near_release_figures(result):
  assert abs(result["total_params"] / 2.8e12 - 1) < 0.02, result["total_params"]
  assert abs(result["active_params"] / 104e9 - 1) < 0.02, result["active_params"]


def test_total_equals_hand_count(cfg, result):
  expected = hand_count(cfg.model)
  assert result["total_params"] == sum(expected.values())


def test_active_equals_hand_count(cfg, result):
  m = cfg.model
  expected = hand_count(m)
  e = m.moe
  # active: everything except the routed experts a token does not use
  active = (sum(expected.values()) - expected["routed_experts"]
            + expected["routed_experts"] * e.top_k // e.num_experts)
  assert expected["routed_experts"] * e.top_k % e.num_experts == 0
  assert result["active_params"] == active


def test_components_match_hand_count(cfg, result):
  expected = hand_count(cfg.model)
  comps = {k: v["params"] for k, v in result["components"].items()}
  assert sum(comps.values()) == result["total_params"]
  for name in ("embedding", "lm_head", "kda", "mla", "dense_ffn", "router", "latent_projections",
               "routed_experts", "shared_experts", "attn_res", "norms"):
    assert comps.get(name) == expected[name], name
  shares = sum(v["share"] for v in result["components"].values())
  assert abs(shares - 1) < 1e-4


def test_cli_prints_one_json_line():
  proc = subprocess.run([sys.executable, "-m", "k3train.tools.count_params",
                         "--config=configs/k3_full.py"], cwd=REPO, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr
  lines = [line for line in proc.stdout.splitlines() if line.strip()]
  assert len(lines) == 1, proc.stdout
  out = json.loads(lines[0])
  expected_total = sum(hand_count(k3_full.get_config().model).values())
  assert out["total_params"] == expected_total
  assert isinstance(out["active_params"], int)
  assert abs(out["active_params"] / 104e9 - 1) < 0.02
