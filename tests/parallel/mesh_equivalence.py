"""Loss and gradients of the four-layer k3_tiny (tests/configs.py QUICK_MODEL) on several 8-device
CPU meshes vs one device (run as a script).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/parallel/mesh_equivalence.py \
        fsdp=8 fsdp=2,expert=4 ...

Prints one JSON line per mesh: {"mesh": ..., "loss_ref", "loss", "grad_err", "grad_scale", ...}.
The reference runs on device 0 with no layout; each mesh gets the same parameters and batch,
placed with the explicit shardings the train loop uses.
"""

from __future__ import annotations

import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tests.configs import k3_tiny, quick
from k3train.parallel import rules as rules_lib
from k3train.train import layout as layout_lib
from k3train.train import step as step_lib

GLOBAL_BATCH = 16   # ≥ 2 rows per device on every mesh below


def tiny_config(mesh_arg: str = ""):
  cfg = quick(k3_tiny.get_config())
  cfg.train.global_batch_size = GLOBAL_BATCH
  for item in filter(None, mesh_arg.split(",")):
    key, value = item.split("=")
    if key == "rules":
      cfg.parallel.rules = value
    elif key == "microbatches":
      cfg.train.microbatches = int(value)
    elif key == "attnres":
      cfg.model.attn_res.backend = value
    else:
      cfg.parallel[key] = int(value)
  for axis in ("data", "expert", "sequence", "tensor"):
    cfg.parallel[axis] = cfg.parallel[axis] if f"{axis}=" in mesh_arg else 1
  cfg.parallel.fsdp = cfg.parallel.fsdp if "fsdp=" in mesh_arg else -1
  return cfg


# Compile fast rather than well: each mesh is a new program and only its numbers matter here.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
COLLECTIVES = ("all-to-all", "all-gather", "collective-permute", "all-reduce", "reduce-scatter")


def loss_and_grads(graphdef, layout, params, rest, batch, microbatches: int = 1):
  """(loss, grads, {collective: count in the compiled HLO}); gradients accumulated over
  `microbatches` micro-batches as the train step does."""
  def f(params, rest, batch):
    with rules_lib.activate(layout.mesh, layout.rules):
      (loss, _), grads = step_lib.loss_and_grads(graphdef, params, rest, batch, microbatches)
    return loss, grads
  compiled = jax.jit(f).lower(params, rest, batch).compile(compiler_options=FAST_COMPILE)
  hlo = compiled.as_text()
  counts = {c: hlo.count(f" {c}(") + hlo.count(f" {c}-start(") for c in COLLECTIVES}
  return (*compiled(params, rest, batch), counts)


def packed_batch(cfg, seed: int = 0) -> dict[str, np.ndarray]:
  """A [16, 128] batch of many short documents: boundaries mid-chunk and exactly on every
  sequence-shard edge (multiples of 16), one-token documents, and tail padding (id 0)."""
  rng = np.random.default_rng(seed)
  b, t = GLOBAL_BATCH, cfg.data.seq_len
  seg = np.zeros((b, t), np.int32)
  for row in range(b):
    edges = set(rng.choice(np.arange(1, t - 8), size=6, replace=False).tolist())
    edges |= {16 * (1 + row % 7), 32, 33}           # on shard edges; a one-token document
    pos, doc = 0, 1
    for end in sorted(edges) + [t - (row % 5) * 3]:
      seg[row, pos:end] = doc
      pos, doc = end, doc + 1
  positions = np.zeros_like(seg)
  for row in range(b):
    for i in range(1, t):
      positions[row, i] = positions[row, i - 1] + 1 if seg[row, i] == seg[row, i - 1] else 0
  tokens = rng.integers(1, cfg.model.vocab_size, (b, t), dtype=np.int32)
  targets = rng.integers(1, cfg.model.vocab_size, (b, t), dtype=np.int32)
  loss_mask = (seg > 0).astype(np.float32)
  return {"tokens": np.where(seg > 0, tokens, 0), "targets": targets, "segment_ids": seg,
          "positions": positions, "loss_mask": loss_mask}


def main(mesh_args):
  cfg = tiny_config()
  host_batch = packed_batch(cfg)
  ref_layout = layout_lib.make_layout(cfg, devices=jax.devices()[:1])
  model = layout_lib.build_sharded_model(cfg, ref_layout)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  ref_loss, ref_grads, _ = loss_and_grads(graphdef, ref_layout, params, rest,
                                       ref_layout.global_batch(host_batch))
  ref_flat = {jax.tree_util.keystr(p): np.asarray(g) for p, g in
              jax.tree_util.tree_flatten_with_path(ref_grads)[0]}
  for mesh_arg in mesh_args:
    start = time.perf_counter()
    cfg = tiny_config(mesh_arg)
    layout = layout_lib.make_layout(cfg)
    sh = layout_lib.model_shardings(cfg, layout)
    p_sh, r_sh = nnx.split_state(sh, nnx.Param, ...)
    loss, grads, collectives = loss_and_grads(graphdef, layout, jax.device_put(params, p_sh),
                                 jax.device_put(rest, r_sh), layout.global_batch(host_batch),
                                 cfg.train.microbatches)
    worst, worst_name, scale = 0.0, "", 0.0
    for p, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
      name = jax.tree_util.keystr(p)
      ref = ref_flat[name]
      err = float(np.max(np.abs(np.asarray(g) - ref))) if ref.size else 0.0
      scale = max(scale, float(np.max(np.abs(ref))) if ref.size else 0.0)
      if err > worst:
        worst, worst_name = err, name
    print(json.dumps({"mesh": mesh_arg, "seconds": round(time.perf_counter() - start, 1), "loss_ref": float(ref_loss), "loss": float(loss),
                      "grad_err": worst, "grad_err_at": worst_name, "grad_scale": scale,
                      "collectives": collectives}), flush=True)


if __name__ == "__main__":
  if os.environ.get("K3TRAIN_TEST_COMPILATION_CACHE"):
    jax.config.update("jax_compilation_cache_dir", os.environ["K3TRAIN_TEST_COMPILATION_CACHE"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
  main(sys.argv[1:])
