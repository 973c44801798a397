"""The MoonViT-V2 tower (docs/maths.md §6): a float64 per-grid reference, the §6.5 invariants
(packing invariance, RoPE relativity, h·w/4 tokens per grid, t = 1 = image, a 4-frame chunk
gives one image's tokens), bilinear resampling, splicing, and the config / count / FLOP hooks.

One tiny tower (configs/k3_tiny_mm.py's model.vision, fp32) serves every test; its jitted forward
is compiled once for one batch shape [2 rows, 160 patches, 4 grids].
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3train import config as config_lib
from k3train.model import vision
from k3train.parallel import axes as ax
from k3train.parallel import rules as rules_lib
from k3train.parallel import state_sharding
from tests.configs import CONFIG_DIR, k3_full

k3_tiny_mm = config_lib.load_module(CONFIG_DIR / "k3_tiny_mm.py")
P, G = 160, 4         # patches and grids per row of every batch below


def make_tower(backend: str = "auto"):
  cfg = k3_tiny_mm.get_config()
  w = cfg.model.vision
  w.backend = backend
  model = vision.VisionTower(w, d_model=cfg.model.d_model, remat_policy="none", dtype=jnp.float32,
                             param_dtype=jnp.float32,
                             rngs=nnx.Rngs(params=jax.random.key(0, impl="rbg")))
  forward = nnx.jit(lambda m, p, g, i: m(p, g, i))
  return model, w, forward


@pytest.fixture(scope="module")
def tower():
  return make_tower()


def pack(rows, seed=0):
  """rows: per row a list of (t, h, w) grids (or (t, h, w, patches)) → (patches, grids, grid ids)."""
  rng = np.random.default_rng(seed)
  patches = np.zeros((len(rows), P, vision.PATCH_VALUES), np.uint8)
  grids = np.zeros((len(rows), G, 3), np.int32)
  ids = np.zeros((len(rows), P), np.int32)
  for b, row in enumerate(rows):
    at = 0
    for g, grid in enumerate(row):
      t, h, w = grid[:3]
      n = t * h * w
      data = grid[3] if len(grid) > 3 else rng.integers(0, 256, (n, vision.PATCH_VALUES))
      patches[b, at:at + n], grids[b, g], ids[b, at:at + n] = data, (t, h, w), g + 1
      at += n
  return patches, grids, ids


def run(tower, patches, grids, ids) -> np.ndarray:
  model, _, forward = tower
  return np.asarray(forward(model, jnp.asarray(patches), jnp.asarray(grids), jnp.asarray(ids)))


def row_tokens(out, grids, b):
  """The row's tokens (Σ h·w/4 of them), one array per grid."""
  counts = [h * w // 4 for t, h, w in grids[b] if t]
  ends = np.cumsum(counts)
  return [out[b, e - c:e] for c, e in zip(counts, ends)]


# ----------------------------------------------------------------------------- float64 reference


def _params(model):
  return jax.tree.map(lambda x: np.asarray(x, np.float64), nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def _resample_matrix(out_size: int, in_size: int) -> np.ndarray:
  """[out, in] weights of torch's bilinear resampling, align_corners=False (written per output)."""
  m = np.zeros((out_size, in_size))
  for i in range(out_size):
    src = max((i + 0.5) * in_size / out_size - 0.5, 0.0)
    lo = min(int(math.floor(src)), in_size - 1)
    hi = min(lo + 1, in_size - 1)
    m[i, lo] += 1 - (src - lo)
    m[i, hi] += src - lo
  return m


def _rms(x, gain, eps):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * gain


def _gelu_tanh(x):
  return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def _gelu_erf(x):
  return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def reference_grid(params, w, t, h, wd, patches, *, time_table=True) -> np.ndarray:
  """One grid alone, float64, written from docs/maths.md §6.2–6.4: [h·w/4, d_model]."""
  d, heads, k = w.d_model, w.num_heads, w.head_dim
  x = (patches.astype(np.float64) / 127.5 - 1) @ params["patch_embed"]["embedding"]     # [t·h·w, D]
  table = params["pos_embed"]["embedding"]
  pos = np.einsum("hH,HWd,wW->hwd", _resample_matrix(h, table.shape[0]), table,
                  _resample_matrix(wd, table.shape[1])).reshape(h * wd, d)
  x = x.reshape(t, h * wd, d) + pos
  if t > 1 and time_table:
    omega = 10000.0 ** (-np.arange(d // 2) / (d / 2))
    x = x + np.concatenate([np.sin(np.arange(t)[:, None] * omega), np.cos(np.arange(t)[:, None] * omega)], -1)[:, None]
  x = x.reshape(t * h * wd, d)
  rows, cols = np.divmod(np.tile(np.arange(h * wd), t), wd)
  omega = w.rope_theta ** (-4 * np.arange(k // 4) / k)
  angle = np.empty((len(rows), k // 2))
  angle[:, 0::2], angle[:, 1::2] = cols[:, None] * omega, rows[:, None] * omega   # §6.3: x even, y odd
  turn = np.exp(1j * angle)[:, None, :]

  def rope(v):
    z = (v[..., 0::2] + 1j * v[..., 1::2]) * turn
    return np.stack([z.real, z.imag], -1).reshape(v.shape)

  s = params["stack"]
  for layer in range(w.num_layers):
    p = jax.tree.map(lambda a: a[layer], s)
    y = _rms(x, p["attn_norm"]["scale"], w.norm_eps)
    q, kk, v = (np.einsum("nd,dhk->nhk", y, p[n]["kernel"]) for n in ("q_proj", "k_proj", "v_proj"))
    logits = np.einsum("qhk,shk->hqs", rope(q), rope(kk)) / math.sqrt(k)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    x = x + np.einsum("hqs,shk,hkd->qd", probs, v, p["o_proj"]["kernel"])
    y = _gelu_tanh(_rms(x, p["mlp_norm"]["scale"], w.norm_eps) @ p["up_proj"]["kernel"])
    x = x + y @ p["down_proj"]["kernel"]
  x = _rms(x, params["final_norm"]["scale"], w.norm_eps)
  cells = x.reshape(t, h // 2, 2, wd // 2, 2, d).mean(0).transpose(0, 2, 1, 3, 4)   # [h/2, w/2, 2, 2, D]
  merged = cells.reshape(h // 2 * wd // 2, 4 * d)                                  # (0,0),(0,1),(1,0),(1,1)
  pr = params["projector"]
  y = _gelu_erf(merged @ pr["up_proj"]["kernel"]) @ pr["down_proj"]["kernel"]
  return _rms(y, pr["norm"]["scale"], w.projector_norm_eps)


# ----------------------------------------------------------------------------- the tower


ROWS = [[(1, 4, 6), (4, 2, 4), (1, 2, 2)],          # image, 4-frame chunk, small image: 60 patches
        [(3, 4, 4), (1, 18, 2)]]                    # 3-frame chunk, image taller than the table


def test_tokens_match_the_float64_reference_grid_by_grid(tower):
  """h·w/4 tokens per grid, in grid order, each equal to the grid encoded alone by the reference
  (grid-local attention, 2D RoPE, time embedding only for t > 1, mean over frames, merge order)."""
  model, w, _ = tower
  patches, grids, ids = pack(ROWS)
  out = run(tower, patches, grids, ids)
  assert out.shape == (2, P // 4, model.projector.norm.scale.shape[0])
  params = _params(model)
  for b, row in enumerate(ROWS):
    got = row_tokens(out, grids, b)
    assert [len(x) for x in got] == [h * wd // 4 for _, h, wd in row]
    at = 0
    for (t, h, wd), tokens in zip(row, got):
      ref = reference_grid(params, w, t, h, wd, patches[b, at:at + t * h * wd])
      at += t * h * wd
      np.testing.assert_allclose(tokens, ref, atol=2e-5, rtol=0)   # fp32 against fp64


def test_packing_invariance(tower):
  """§6.5.1: an image's tokens are the same alone or packed after other grids, in fp32.

  Packed, its patches 116–139 straddle two key blocks of the blockwise attention (128 keys), so
  the online softmax rounds differently: ≤ 1e-6 of the tokens' largest value there (measured
  4e-7); with the dense `reference` attention backend the tokens agree to 1e-6 absolute. A leak
  across grids would move them by O(1)."""
  rng = np.random.default_rng(3)
  image = (1, 4, 6, rng.integers(0, 256, (24, vision.PATCH_VALUES)))
  alone = pack([[image], [(1, 2, 2)]], seed=1)
  packed = pack([[(3, 4, 4)], [(3, 4, 4), (4, 2, 4), (1, 6, 6), image]], seed=2)
  a = row_tokens(run(tower, *alone), alone[1], 0)[0]
  p = row_tokens(run(tower, *packed), packed[1], 1)[3]
  assert np.max(np.abs(a - p)) <= 1e-6 * np.max(np.abs(a))
  dense = make_tower("reference")
  a = row_tokens(run(dense, *alone), alone[1], 0)[0]
  p = row_tokens(run(dense, *packed), packed[1], 1)[3]
  assert np.max(np.abs(a - p)) <= 1e-6


def test_rope_is_relative():
  """§6.5.2: rotated q·k depends only on (Δrow, Δcol), and does depend on it."""
  rng = np.random.default_rng(0)
  q, k = (jnp.asarray(rng.standard_normal((1, 1, 1, 16)), jnp.float32) for _ in range(2))

  def score(rq, cq, rk, ck):
    cos, sin = vision.rope_2d(jnp.array([[rq, rk]]), jnp.array([[cq, ck]]), 16, 10_000.0)
    qr = vision.apply_rope(q, cos[:, :1], sin[:, :1])
    kr = vision.apply_rope(k, cos[:, 1:], sin[:, 1:])
    return float(jnp.sum(qr * kr))

  base = score(3, 5, 1, 2)
  for dr, dc in ((7, 0), (0, 11), (40, 23)):
    assert abs(score(3 + dr, 5 + dc, 1 + dr, 2 + dc) - base) < 1e-4 * max(1.0, abs(base))
  assert abs(score(3, 5, 2, 2) - base) > 1e-3            # another row offset
  assert abs(score(3, 5, 1, 3) - base) > 1e-3            # another column offset


def test_every_grid_gives_hw_over_4_tokens_and_padding_slots_stay_unread(tower):
  """§6.5.3: Σ h·w/4 tokens per row; the slots after them are padding and the splice never reads
  them (one placeholder per token)."""
  patches, grids, ids = pack(ROWS)
  out = run(tower, patches, grids, ids)
  for b, row in enumerate(ROWS):
    n = sum(h * wd // 4 for _, h, wd in row)
    assert np.all(out[b, n:] == out[b, n])                  # identical padding slots
    assert not np.allclose(out[b, n - 1], out[b, n])
  x = np.zeros((2, 30, out.shape[-1]), np.float32)
  tokens = np.full((2, 30), 9, np.int32)
  tokens[0, 1:10], tokens[1, 4:17] = 5, 5                 # 6 + 2 + 1 and 4 + 9 placeholders
  spliced = np.asarray(vision.splice(jnp.asarray(x), jnp.asarray(tokens), jnp.asarray(out), 5))
  np.testing.assert_array_equal(spliced[0, 1:10], out[0, :9])
  np.testing.assert_array_equal(spliced[1, 4:17], out[1, :13])
  text = np.ones((2, 30), bool)
  text[0, 1:10] = text[1, 4:17] = False
  assert np.all(spliced[text] == 0)                        # text positions keep their embedding


def test_one_frame_path_equals_the_image_path(tower, tmp_path):
  """§6.5.4: a one-frame video and the same picture as an image give identical tokens."""
  from PIL import Image
  from k3train.data import vision as data_vision
  rng = np.random.default_rng(5)
  pixels = rng.integers(0, 256, (56, 84, 3), np.uint8)
  Image.fromarray(pixels).save(tmp_path / "image.png")
  (tmp_path / "frames").mkdir()
  Image.fromarray(pixels).save(tmp_path / "frames" / "000.png")
  cfg = data_vision.VisionConfig(max_patches=64, max_video_frame_patches=64)
  image = data_vision.load_image(str(tmp_path / "image.png"), cfg)
  video = data_vision.load_video(str(tmp_path / "frames"), cfg)
  assert image.grids == video.grids == [(1, 4, 6)]
  outs = [run(tower, *pack([[(*vis.grids[0], vis.patches)], []])) for vis in (image, video)]
  np.testing.assert_array_equal(outs[0], outs[1])


def test_four_frame_chunk_yields_the_tokens_of_one_image(tower, monkeypatch):
  """§6.4: a chunk (4, h, w) gives h·w/4 tokens, like an image (1, h, w); with four copies of the
  image's frame and the time table set to zero it gives that image's tokens exactly (attention
  over four identical copies of every key is attention over one, the mean of four equal frames
  is the frame)."""
  rng = np.random.default_rng(7)
  frame = rng.integers(0, 256, (8, vision.PATCH_VALUES))
  image = pack([[(1, 2, 4, frame)], []])
  chunk = pack([[(4, 2, 4, np.tile(frame, (4, 1)))], []])
  img_tokens = row_tokens(run(tower, *image), image[1], 0)[0]
  chunk_tokens = row_tokens(run(tower, *chunk), chunk[1], 0)[0]
  assert img_tokens.shape == chunk_tokens.shape == (2, img_tokens.shape[1])
  assert np.max(np.abs(img_tokens - chunk_tokens)) > 1e-3     # the time embedding is seen
  model, w, _ = tower
  monkeypatch.setattr(vision, "time_embedding", lambda frame, dim: jnp.zeros((*frame.shape, dim)))
  fresh = nnx.jit(lambda m, p, g, i: m(p, g, i))
  out = np.asarray(fresh(model, *(jnp.asarray(a) for a in chunk)))
  np.testing.assert_allclose(row_tokens(out, chunk[1], 0)[0], img_tokens, atol=1e-5, rtol=0)


def test_bilinear_resampling_of_the_position_table():
  """Same size: the table itself; half size: the mean of each 2×2 block (torch's
  align_corners=False sampling lands halfway between two rows/columns); any size: the
  [out, in] resampling matrices of the reference."""
  rng = np.random.default_rng(0)
  table = rng.standard_normal((8, 6, 3)).astype(np.float32)
  pt = vision.PositionTable(8, 6, 3, param_dtype=jnp.float32, rngs=nnx.Rngs(params=0))
  pt.embedding[...] = jnp.asarray(table)

  def resample(h, w):
    ids = np.ones((1, h * w), np.int32)
    geo = vision.patch_geometry(jnp.array([[[1, h, w]]]), jnp.asarray(ids))
    return np.asarray(pt(geo)).reshape(h, w, 3)

  np.testing.assert_allclose(resample(8, 6), table, atol=1e-6)
  half = table.reshape(4, 2, 3, 2, 3).mean((1, 3))
  np.testing.assert_allclose(resample(4, 3), half, atol=1e-6)
  for h, w in ((5, 9), (12, 2), (1, 1)):
    ref = np.einsum("hH,HWd,wW->hwd", _resample_matrix(h, 8), table, _resample_matrix(w, 6))
    np.testing.assert_allclose(resample(h, w), ref, atol=1e-5)


def test_every_vision_parameter_has_logical_axes_of_its_rank(tower):
  model, _, _ = tower
  known = {v for k, v in vars(ax).items() if k.isupper() and isinstance(v, str)}
  flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
  assert len(flat) == 14
  for path, var in flat:
    names = var.get_metadata("out_sharding", None)
    assert names is not None and len(names) == len(var.shape) and set(names) <= known, path
  for recipe in rules_lib.RECIPES:   # a row's patches and grids stay with its batch shard
    rules = rules_lib.get_rules(recipe)
    for key, names in state_sharding.VISION_BATCH_KEYS.items():
      spec = rules_lib.logical_to_spec(names, rules)
      assert spec[0] == rules_lib.logical_to_spec((ax.BATCH,), rules)[0] and all(s is None for s in spec[1:]), key


# ----------------------------------------------------------------------------- config, counts, FLOPs


def test_data_and_model_vision_must_agree():
  cfg = k3_tiny_mm.get_config()
  config_lib.validate(cfg)
  cfg.data.vision.enabled = False
  with pytest.raises(config_lib.ConfigError, match="model.vision.enabled.*data.vision.enabled"):
    config_lib.validate(cfg)
  cfg = k3_full.get_config()
  assert cfg.model.vision.enabled and cfg.data.vision.enabled      # K3 trains the tower
  cfg.model.vision.enabled = False
  with pytest.raises(config_lib.ConfigError, match="model.vision.enabled.*data.vision.enabled"):
    config_lib.validate(cfg)
  cfg = k3_tiny_mm.get_config()
  cfg.model.vision.head_dim = 18
  with pytest.raises(config_lib.ConfigError, match="model.vision.head_dim"):
    config_lib.validate(cfg)


def test_placeholder_id_is_checked_against_the_tokenizer():
  from k3train.data import tokenizer as tokenizer_lib
  from k3train.train import layout
  cfg = k3_tiny_mm.get_config()
  assert tokenizer_lib.load_tokenizer().special_ids[tokenizer_lib.IMAGE_PAD] == cfg.model.vision.placeholder_id
  layout.check_placeholder_id(cfg)
  cfg.model.vision.placeholder_id = 7
  with pytest.raises(config_lib.ConfigError, match="model.vision.placeholder_id.*data.tokenizer"):
    layout.check_placeholder_id(cfg)


def vision_hand_count(w, d_model):
  d, f = w.d_model, w.mlp_hidden
  hk = w.num_heads * w.head_dim
  per_layer = 3 * d * hk + hk * d + 2 * d * f + 2 * d
  return (vision.PATCH_VALUES * d + w.pos_height * w.pos_width * d + w.num_layers * per_layer + d
          + (4 * d) ** 2 + 4 * d * d_model + d_model)


def test_count_params_reports_the_k3_tower_apart():
  """K3's tower + projector ≈ 0.45 B (0.4 B tower), counted apart from the text totals."""
  from k3train.model import counting
  small = config_lib.load_file(CONFIG_DIR / "k3_tiny.py")
  text = counting.count(small)
  small.model.vision = k3_full.get_config().model.vision            # K3's tower on the tiny text model
  with_tower = counting.count(small)
  assert with_tower["total_params"] == text["total_params"]
  assert with_tower["components"] == text["components"] and "vision" not in text
  n = with_tower["vision"]["total_params"]
  assert n == vision_hand_count(small.model.vision, small.model.d_model)
  k3 = vision_hand_count(k3_full.get_config().model.vision, 7168)
  assert 0.38e9 < k3 - (4 * 1024) ** 2 - 4 * 1024 * 7168 - 7168 < 0.42e9   # the tower alone
  assert with_tower["vision"]["components"]["projector"]["params"] == (4 * 1024) ** 2 + 4 * 1024 * 64 + 64


def test_vision_flops_enter_the_mfu_formula():
  from k3train.train import metrics
  cfg = k3_tiny_mm.get_config()
  w, v = cfg.model.vision, cfg.data.vision
  text = k3_tiny_mm.get_config()
  text.model.vision.enabled = False
  per_token = lambda c: metrics.train_flops_per_token(c, 10_000, 1_000, c.data.seq_len)
  p, d, hk = v.max_patches_per_row, w.d_model, w.num_heads * w.head_dim
  span = min(p, max(v.max_patches, v.frames_per_chunk * v.max_video_frame_patches))
  row = (2 * p * (588 * d + w.num_layers * (4 * d * hk + 2 * d * w.mlp_hidden))
         + 4 * w.num_layers * p * hk * span + 2 * (p // 4) * (16 * d * d + 4 * d * cfg.model.d_model))
  assert per_token(cfg) - per_token(text) == pytest.approx(3 * row / cfg.data.seq_len, rel=1e-12)
