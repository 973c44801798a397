"""Joint text + vision training on CPU (configs/k3_tiny_mm.py with a short text stack): the text
loss reaches the tower, placeholders carry no loss, batches hold whole grids and count bad media,
and a run over synthetic text, captioned images and interleaved video chunks trains 30 steps
with a falling loss and resumes bit-identically.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from PIL import Image

from k3train import config as config_lib
from k3train.data import pipeline
from k3train.data import tokenizer as tokenizer_lib
from k3train.model.decoder import K3Model
from k3train.train import loop, step
from k3train.train.checkpoint import Checkpointer
from tests.configs import CONFIG_DIR

k3_tiny_mm = config_lib.load_module(CONFIG_DIR / "k3_tiny_mm.py")
STEPS = 30
PAD = tokenizer_lib.load_tokenizer().special_ids[tokenizer_lib.IMAGE_PAD]


def write_videos(root: str, n: int = 6) -> str:
  """Interleaved documents: text, a GIF video (10 frames at 2 fps → chunks of 4, 4, 2 frames),
  an image, and one document with a broken image (skipped and counted). Returns the JSONL path."""
  os.makedirs(root, exist_ok=True)
  rng = np.random.default_rng(0)
  docs = []
  for i in range(n):
    cells = rng.integers(0, 200, (4, 4, 3))
    frames = [Image.fromarray(np.clip(cells + 5 * f, 0, 255).astype(np.uint8)).resize(
        (56, 56), Image.Resampling.NEAREST) for f in range(10)]
    frames[0].save(os.path.join(root, f"v{i}.gif"), save_all=True, append_images=frames[1:],
                   duration=500, loop=0)
    Image.fromarray(rng.integers(0, 255, (42, 70, 3), dtype=np.uint8)).save(os.path.join(root, f"i{i}.png"))
    docs.append({"segments": [{"text": f"clip {i} shows"}, {"video": f"v{i}.gif"},
                              {"text": " and then a still:"}, {"image": f"i{i}.png"}, {"text": " the end."}]})
  with open(os.path.join(root, "broken.png"), "wb") as f:
    f.write(b"\x89PNG\r\n\x1a\n" + b"\x00" * 30)
  docs.append({"segments": [{"text": "a broken picture"}, {"image": "broken.png"}, {"text": " here."}]})
  path = os.path.join(root, "docs.jsonl")
  with open(path, "w") as f:
    f.writelines(json.dumps(d) + "\n" for d in docs)
  return path


@pytest.fixture(scope="module")
def media(tmp_path_factory):
  return write_videos(str(tmp_path_factory.mktemp("media")))


def make_config(media_path):
  """k3_tiny_mm over three sources, with a 4-layer unscanned text stack (KDA ×3, then MLA): these
  tests are about the tower, and the short stack compiles in a fraction of k3_tiny's time."""
  cfg = k3_tiny_mm.get_config()
  cfg.model.num_layers, cfg.model.mla_layers = 4, (4,)
  cfg.data.sources = ("synthetic_text", "synthetic_images", f"interleaved:{media_path}")
  cfg.data.weights = (1.0, 1.0, 1.0)
  cfg.train.steps = STEPS
  cfg.checkpoint.every_steps = STEPS // 2
  return config_lib.validate(cfg)


def check_rows(b, max_patches):
  """Per row: Σ h·w/4 placeholders, all t·h·w patches of every grid (nothing cut mid-grid),
  padding only at the tail, no loss on placeholder targets. Returns the frame counts seen."""
  kinds = set()
  for r in range(len(b["tokens"])):
    grids = b["vision_grids"][r]
    real = grids[np.prod(grids, -1) > 0]
    kinds |= {int(t) for t in real[:, 0]}
    assert int(np.sum(b["tokens"][r] == PAD)) == int(np.sum(real[:, 1] * real[:, 2] // 4))
    ids = b["vision_grid_ids"][r]
    for g, (t, h, w) in enumerate(real):
      assert int(np.sum(ids == g + 1)) == t * h * w
    used = int(np.sum(np.prod(real, -1)))
    assert used <= max_patches and np.all(ids[used:] == 0)
    assert np.all(b["loss_mask"][r][b["targets"][r] == PAD] == 0)
  return kinds


def test_batches_hold_whole_grids_and_count_bad_media(media):
  """Whole grids in every row, also when a document's 176 patches (chunks of 64, 64 and 32
  patches and a 16-patch image) must be split over rows of 72 patches; the broken image is
  skipped and counted; nothing else is dropped."""
  cfg = make_config(media)
  it = pipeline.make_iterator(cfg.data, batch_size=4, seed=0)
  kinds = set()
  for _ in range(12):
    kinds |= check_rows(next(it), cfg.data.vision.max_patches_per_row)
  assert {1, 4} <= kinds                                              # images and 4-frame chunks
  errors = it.metrics()
  assert errors[f"errors/interleaved:{media}/corrupt"] + errors[f"errors/interleaved:{media}/unknown_format"] >= 1
  tight = make_config(media).data
  tight.sources, tight.weights = (f"interleaved:{media}",), (1.0,)
  tight.vision.max_patches_per_row = 72
  it = pipeline.make_iterator(tight, batch_size=4, seed=0)
  grids_per_row = []
  for _ in range(6):
    b = next(it)
    check_rows(b, 72)
    grids_per_row += [int(np.sum(np.prod(g, -1) > 0)) for g in b["vision_grids"]]
  assert max(grids_per_row) < 4 and sum(grids_per_row) >= 12           # documents split between grids
  errors = it.metrics()
  assert errors[f"errors/interleaved:{media}/too_long_for_row"] == 0
  assert errors[f"errors/interleaved:{media}/corrupt"] + errors[f"errors/interleaved:{media}/unknown_format"] >= 1


@pytest.fixture(scope="module")
def short_model(media):
  """The model of make_config, its first pipeline batch (4 rows) and a jitted loss_and_grads."""
  cfg = make_config(media)
  batch = {k: jnp.asarray(v) for k, v in next(pipeline.make_iterator(cfg.data, batch_size=4, seed=0)).items()}
  assert int(jnp.sum(batch["tokens"] == PAD)) > 0
  model = K3Model(cfg.model, rngs=nnx.Rngs(params=jax.random.key(0, impl="rbg")))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  run = jax.jit(step.loss_and_grads, static_argnums=(0, 4))
  return cfg, graphdef, params, rest, batch, run


def test_text_loss_reaches_the_tower_and_placeholders_carry_no_loss(short_model):
  cfg, graphdef, params, rest, batch, run = short_model
  value_and_grad = lambda p, b: (lambda out: (out[0][0], out[1]))(run(graphdef, p, rest, b, 1))
  loss, grads = value_and_grad(params, batch)
  assert np.isfinite(float(loss))
  flat = nnx.to_flat_state(grads["vision"])
  assert len(flat) == 14
  for path, g in flat:
    assert float(jnp.max(jnp.abs(g[...]))) > 0, path       # every tower parameter learns from text
  # Every position marked for loss, with and without the placeholder targets removed by hand:
  # the same loss, bit for bit (the step never trains on a placeholder); removing another
  # position instead changes it.
  ones = jnp.ones_like(batch["loss_mask"])
  a, _ = value_and_grad(params, dict(batch, loss_mask=ones))
  b, _ = value_and_grad(params, dict(batch, loss_mask=ones * (batch["targets"] != PAD)))
  assert float(a) == float(b)
  assert int(batch["targets"][0, 0]) != PAD
  c, _ = value_and_grad(params, dict(batch, loss_mask=ones.at[0, 0].set(0)))
  assert float(c) != float(a)
  logits = jax.random.normal(jax.random.key(1), (*batch["tokens"].shape, cfg.model.vocab_size))
  loss_of = lambda lg: step.cross_entropy(lg, batch["targets"], step.loss_mask_of(
      dict(batch, loss_mask=ones), PAD))[0]
  moved = jnp.where((batch["targets"] == PAD)[..., None], logits + 50.0 * logits ** 2, logits)
  assert float(loss_of(moved)) == float(loss_of(logits))    # placeholder logits carry no loss


def test_micro_batches_carry_the_vision_keys(short_model):
  """Two micro-batches (rows 0, 2 and 1, 3 with their patches and grids) give the one-batch
  loss and tower gradients (fp32, 1e-5 relative: summation order only)."""
  _, graphdef, params, rest, batch, run = short_model
  (one, _), g_one = run(graphdef, params, rest, batch, 1)
  (two, _), g_two = run(graphdef, params, rest, batch, 2)
  np.testing.assert_allclose(float(two), float(one), rtol=1e-5)
  for (path, a), (_, b) in zip(nnx.to_flat_state(g_one["vision"]), nnx.to_flat_state(g_two["vision"])):
    a, b = np.asarray(a[...]), np.asarray(b[...])
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-5 * np.max(np.abs(a)), err_msg=str(path))


def read_losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return {r["step"]: r["loss"] for r in map(json.loads, f)}


def final_state(workdir, cfg):
  import orbax.checkpoint as ocp
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), cfg)
  step_ = ckpt.latest_step()
  restored = ckpt.manager.restore(step_, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
  ckpt.close()
  return step_, {k: np.asarray(v) for k, v in restored.items()}


def test_multimodal_run_trains_and_resumes_bit_identically(media, tmp_path):
  cfg = make_config(media)
  full_dir, part_dir = str(tmp_path / "full"), str(tmp_path / "part")
  full = loop.train(cfg, full_dir)
  losses = full.losses
  assert sorted(losses) == list(range(1, STEPS + 1)) and all(np.isfinite(list(losses.values())))
  first = np.mean([losses[s] for s in range(1, 6)])
  last = np.mean([losses[s] for s in range(STEPS - 4, STEPS + 1)])
  assert first > 8.0 and last < first - 0.5, (first, last)   # log(4096) = 8.3 at the start
  assert loop.train(make_config(media), part_dir, stop_at_step=STEPS // 2).end_step == STEPS // 2
  resumed = loop.train(make_config(media), part_dir)
  assert resumed.start_step == STEPS // 2
  assert read_losses(part_dir) == losses                      # bitwise
  _, a = final_state(full_dir, cfg)
  _, b = final_state(part_dir, cfg)
  assert a.keys() == b.keys() and any(k.startswith("params.vision.") for k in a)
  for key in a:
    np.testing.assert_array_equal(a[key], b[key], err_msg=key)
