"""Packed rows from the pipeline never leak between documents through the model's masks.

Takes real packed rows (several documents per row, padding at the tail), embeds them with a
random table, and runs the model's MLA and KDA mixers with the rows' segment ids. Replacing one
document's tokens (or the padding) must leave every other document's outputs unchanged, while
changing the document itself changes its own outputs (so the check can fail).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from k3train.data import pipeline
from k3train.model import kda as kda_lib
from k3train.model import mla as mla_lib

D = 16
SEQ_LEN = 48
ATOL = 1e-6   # fp32; outputs of other documents must be unchanged up to summation rounding


@pytest.fixture(scope="module")
def packed_row(tmp_path_factory):
  path = tmp_path_factory.mktemp("docs") / "d.jsonl"
  with open(path, "w") as f:
    for i in range(60):
      f.write(json.dumps({"text": "w " * (3 + i % 9)}) + "\n")
  from tests.configs import k3_tiny
  cfg = k3_tiny.get_config().data
  cfg.sources, cfg.weights, cfg.seq_len = (f"jsonl:{path}",), (1.0,), SEQ_LEN
  it = pipeline.make_iterator(cfg, batch_size=2, seed=0)
  for _ in range(20):
    batch = next(it)
    for b in range(2):
      seg = batch["segment_ids"][b]
      if seg.max() >= 3 and (seg == 0).any():
        return batch["tokens"][b:b + 1], seg[None]
  raise AssertionError("no packed row with >= 3 documents and tail padding")


def mixers():
  rngs = nnx.Rngs(params=jax.random.key(0, impl="rbg"))
  mla = mla_lib.GatedMLA(ml_collections.ConfigDict(dict(
      num_heads=2, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4,
      v_head_dim=8, latent_norm_eps=1e-6, output_gate=True, backend="auto")), d_model=D, init_std=0.4,
      dtype=jnp.float32, param_dtype=jnp.float32, rngs=rngs)
  kda = kda_lib.KimiDeltaAttention(ml_collections.ConfigDict(dict(
      num_heads=2, head_dim=8, conv_size=4, gate_lower_bound=-5.0, chunk_size=16, backend="jax")),
      d_model=D, init_std=0.4, norm_eps=1e-5, dtype=jnp.float32, param_dtype=jnp.float32, rngs=rngs)
  return {"mla": mla, "kda": kda}


@pytest.mark.parametrize("name", ["mla", "kda"])
def test_other_documents_do_not_change_outputs(packed_row, name):
  tokens, seg = packed_row
  table = np.random.default_rng(0).normal(size=(4096, D)).astype(np.float32)
  layer = mixers()[name]
  fwd = nnx.jit(lambda m, x, s: m(x, s))
  run = lambda x, s: fwd(layer, x, s)
  base = np.asarray(run(jnp.asarray(table[tokens]), jnp.asarray(seg)))
  rng = np.random.default_rng(1)
  for victim in list(range(1, int(seg.max()) + 1)) + [0]:     # each document, then the padding
    changed = tokens.copy()
    where = seg == victim
    changed[where] = rng.integers(10, 4096, int(where.sum()))
    out = np.asarray(run(jnp.asarray(table[changed]), jnp.asarray(seg)))
    others = (seg != victim) & (seg != 0)
    np.testing.assert_allclose(out[others], base[others], atol=ATOL, rtol=0,
                               err_msg=f"{name}: changing segment {victim} moved other documents")
    if victim:
      assert np.abs(out[where] - base[where]).max() > 1e-3     # the document itself did change
