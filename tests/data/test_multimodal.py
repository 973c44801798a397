"""Vision preprocessing, multimodal packing, mixtures, resume and resharding (images made in tmp dirs)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from PIL import Image

from k3train.data import documents, pipeline, vision
from k3train.data import tokenizer as tokenizer_lib
from tests.data.test_pipeline import assert_batches_equal, take

SEQ_LEN = 128
BATCH = 4
CFG = vision.VisionConfig(max_patches=256, max_side=3584, video_fps=2.0, max_video_frames=16,
                          max_video_frame_patches=64, frames_per_chunk=4)


def noise_image(w, h, seed=0, mode="RGB"):
  rng = np.random.default_rng(seed)
  arr = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
  return Image.fromarray(arr).convert(mode)


# --- resizing and patches -----------------------------------------------------------------


@pytest.mark.parametrize("size,budget,expect", [
    ((280, 140), 256, (280, 140)),          # native, already aligned: 20 x 10 = 200 patches
    ((300, 150), 1024, (308, 140)),         # native, rounded to multiples of 28
    ((1000, 500), 256, (308, 140)),         # scaled into the patch budget
    ((10, 5), 256, (28, 28)),               # tiny: never below one 2x2 merge cell
    ((8000, 100), 16384, (3584, 56)),       # max side 3,584 px
])
def test_target_size_rules(size, budget, expect):
  w, h = vision.target_size(*size, budget, 3584)
  assert (w, h) == expect
  assert w % 28 == 0 and h % 28 == 0 and max(w, h) <= 3584
  assert (w // 14) * (h // 14) <= budget


def test_target_size_over_random_shapes():
  rng = np.random.default_rng(0)
  for _ in range(300):
    w, h = (int(x) for x in rng.integers(1, 6000, 2))
    budget = int(rng.integers(4, 20000))
    if max(w, h) / min(w, h) > 128:
      continue
    tw, th = vision.target_size(w, h, budget, 3584)
    assert tw % 28 == 0 and th % 28 == 0 and max(tw, th) <= 3584
    assert (tw // 14) * (th // 14) <= max(budget, 4)
  with pytest.raises(vision.MediaError, match="aspect"):
    vision.target_size(20000, 10, 16384, 3584)


def test_patchify_layout_and_image_grid(tmp_path):
  img = noise_image(56, 28)
  path = tmp_path / "a.png"
  img.save(path)
  vis = vision.load_image(str(path), CFG)
  assert vis.grids == [(1, 2, 4)] and vis.tokens_per_grid() == [2]
  assert vis.patches.shape == (8, 588) and vis.patches.dtype == np.uint8
  arr = np.asarray(img)
  # Patch k = row k // 4, column k % 4, flattened as (14, 14, 3).
  np.testing.assert_array_equal(vis.patches[5].reshape(14, 14, 3), arr[14:28, 14:28])
  np.testing.assert_array_equal(vis.patches[3].reshape(14, 14, 3), arr[0:14, 42:56])


def test_rgb_conversion_of_other_modes(tmp_path):
  for mode in ("L", "RGBA", "P", "CMYK"):
    path = tmp_path / f"m_{mode}.{'jpg' if mode == 'CMYK' else 'png'}"
    noise_image(60, 30, mode=mode).save(path)
    vis = vision.load_image(str(path), CFG)
    assert vis.patches.shape[1] == 588 and vis.grids[0][0] == 1


def test_bad_media_are_reported_by_reason(tmp_path):
  good = tmp_path / "good.png"
  noise_image(64, 64).save(good)
  data = good.read_bytes()
  (tmp_path / "trunc.png").write_bytes(data[:len(data) // 2])
  (tmp_path / "empty.png").write_bytes(b"")
  (tmp_path / "text.png").write_bytes(b"this is not an image at all" * 10)
  (tmp_path / "clip.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42")
  big = vision.VisionConfig(max_patches=256, max_input_pixels=1000)
  cases = {"trunc.png": ("image", CFG, "truncated|corrupt"), "empty.png": ("image", CFG, "zero_size"),
           "text.png": ("image", CFG, "unknown_format"), "nothere.png": ("image", CFG, "missing"),
           "clip.mp4": ("video", CFG, "unknown_format"), "good.png": ("image", big, "oversized")}
  for name, (kind, cfg, reason) in cases.items():
    with pytest.raises(vision.MediaError) as e:
      vision.load_media(kind, str(tmp_path / name), cfg)
    assert __import__("re").fullmatch(reason, e.value.reason), (name, e.value.reason)


# --- video --------------------------------------------------------------------------------


def write_gif(path, n_frames, ms, size=(56, 56)):
  frames = [Image.fromarray(np.full((size[1], size[0], 3), 20 * i, np.uint8)) for i in range(n_frames)]
  frames[0].save(path, save_all=True, append_images=frames[1:], duration=ms, loop=0)


def test_gif_video_sampling_and_chunks(tmp_path):
  path = str(tmp_path / "v.gif")
  write_gif(path, 10, 100)                        # 10 frames x 0.1 s = 1 s of video
  cfg = vision.VisionConfig(max_patches=256, video_fps=5.0, max_video_frames=16,
                            max_video_frame_patches=64, frames_per_chunk=4)
  vis = vision.load_video(path, cfg)              # 5 frames at t = 0, .2, .4, .6, .8 s
  assert [g[0] for g in vis.grids] == [4, 1]
  assert all(g[1:] == (4, 4) for g in vis.grids) and vis.tokens_per_grid() == [4, 4]
  assert vis.patches.shape == (5 * 16, 588)
  firsts = vis.patches[::16, 0]                   # first value of each frame: 20 * source index
  np.testing.assert_array_equal(firsts, [0, 40, 80, 120, 160])


def test_frame_folder_video(tmp_path):
  folder = tmp_path / "frames"
  folder.mkdir()
  for i in range(9):
    Image.fromarray(np.full((28, 56, 3), i, np.uint8)).save(folder / f"{i:03d}.png")
  (folder / "fps.txt").write_text("4")
  vis = vision.load_video(str(folder), CFG)        # 9 frames at 4 fps = 2.25 s -> 4 at 2 fps
  assert vis.grids == [(4, 2, 4)]
  np.testing.assert_array_equal(vis.patches[::8, 0], [0, 2, 4, 6])


# --- documents and packing ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tok():
  return tokenizer_lib.load_tokenizer()


def test_placeholders_split_and_budgets(tok, tmp_path):
  paths = []
  for i, (w, h) in enumerate([(112, 56), (56, 56), (224, 112)]):
    p = tmp_path / f"{i}.png"
    noise_image(w, h, seed=i).save(p)
    paths.append(str(p))
  (tmp_path / "bad.png").write_bytes(b"garbage")
  budget = documents.RowBudget(seq_len=32, max_patches=64, max_grids=2)
  enc = documents.DocumentEncoder(tok, CFG, budget)
  long_text = "word " * 30
  doc = enc.map({"segments": [{"text": long_text}, {"image": paths[0]}, {"image": str(tmp_path / "bad.png")},
                              {"text": "between"}, {"image": paths[1]}, {"image": paths[2]},
                              {"text": long_text}]})
  pad = tok.special_ids[tokenizer_lib.IMAGE_PAD]
  assert doc.errors[vision.REASONS.index("unknown_format")] == 1
  # paths[2] is 16 x 8 = 128 patches > the row's 64: too large for any row, counted, left out.
  assert doc.errors[vision.REASONS.index("too_long_for_row")] == 1
  assert doc.grids.tolist() == [[1, 4, 8], [1, 4, 4]]
  assert int(np.sum(doc.tokens == pad)) == 8 + 4
  # Split into overlapping pieces; check every invariant of the pieces.
  start, pieces = 0, []
  while start >= 0:
    end, first, stop, start_next = documents.split_piece(doc, start, budget)
    piece = documents.make_piece(doc, start, end, first, stop, with_vision=True)
    pieces.append((start, end, piece))
    start = start_next
  for k, (s, e, piece) in enumerate(pieces):
    toks = piece["tokens"]
    assert 2 <= len(toks) <= 33
    assert toks[-1] != pad                                    # never ends inside a span
    assert int(np.sum(toks == pad)) == int(np.sum(np.prod(piece["vision_grids"], 1) // 4))
    assert len(piece["vision_patches"]) == int(np.sum(np.prod(piece["vision_grids"], 1)))
    assert len(piece["vision_patches"]) <= 64 and len(piece["vision_grids"]) <= 2
    if k:
      assert s == pieces[k - 1][1]                            # one-token overlap
  assert pieces[-1][1] == len(doc.tokens) - 1
  np.testing.assert_array_equal(np.concatenate([p["tokens"][1:] for _, _, p in pieces]), doc.tokens[1:])
  np.testing.assert_array_equal(np.concatenate([p["vision_patches"] for _, _, p in pieces]), doc.patches)


def write_caption_folder(root, n=12):
  os.makedirs(root, exist_ok=True)
  rng = np.random.default_rng(1)
  for i in range(n):
    w, h = (int(x) for x in rng.integers(20, 300, 2))
    noise_image(w, h, seed=i).save(os.path.join(root, f"img{i:02d}.png"))
    with open(os.path.join(root, f"img{i:02d}.txt"), "w") as f:
      f.write(f"caption number {i}: " + "a picture of noise " * int(rng.integers(1, 12)))
  with open(os.path.join(root, "broken.png"), "wb") as f:
    f.write(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)
  with open(os.path.join(root, "broken.txt"), "w") as f:
    f.write("")


def mm_cfg(root, **overrides):
  from tests.configs import k3_tiny
  cfg = k3_tiny.get_config().data
  cfg.sources = (f"image_caption:{root}", "python_stdlib")
  cfg.weights = (1.0, 1.0)
  cfg.vision.enabled = True
  cfg.update(overrides)
  return cfg


def check_vision_batch(batch, tok):
  pad = tok.special_ids[tokenizer_lib.IMAGE_PAD]
  assert set(batch) == set(pipeline.BATCH_KEYS) | set(pipeline.VISION_KEYS)
  assert batch["vision_patches"].shape == (BATCH, 512, 588) and batch["vision_patches"].dtype == np.uint8
  assert batch["vision_grids"].shape == (BATCH, 16, 3)
  for b in range(BATCH):
    grids = batch["vision_grids"][b]
    n_pad = int(np.sum(batch["tokens"][b] == pad))
    assert n_pad == int(np.sum(np.prod(grids, 1) // 4))       # exactly h·w/4 per grid
    assert np.all(grids[:, 1:] % 2 == 0)
    ids = batch["vision_grid_ids"][b]
    assert int(np.sum(ids > 0)) == int(np.sum(np.prod(grids, 1)))
    assert np.all(batch["loss_mask"][b][batch["targets"][b] == pad] == 0)


def test_multimodal_batches_resume_and_error_counters(tok, tmp_path):
  root = str(tmp_path / "caps")
  write_caption_folder(root)
  it = pipeline.make_iterator(mm_cfg(root), batch_size=BATCH, seed=0)
  ref = take(it, 8)
  for b in ref:
    check_vision_batch(b, tok)
  assert sum(int(np.count_nonzero(np.prod(b["vision_grids"], -1))) for b in ref) >= 5
  m = it.metrics()
  assert m[f"errors/image_caption:{root}/unknown_format"] + m[f"errors/image_caption:{root}/corrupt"] \
      + m[f"errors/image_caption:{root}/truncated"] >= 1
  # Resume: N batches, save, restore, M more == uninterrupted.
  it2 = pipeline.make_iterator(mm_cfg(root), batch_size=BATCH, seed=0)
  take(it2, 3)
  state = json.loads(json.dumps(it2.get_state()))
  it3 = pipeline.make_iterator(mm_cfg(root), batch_size=BATCH, seed=0)
  it3.set_state(state)
  assert_batches_equal(take(it3, 5), ref[3:])


# --- mixtures, stage changes, hosts -------------------------------------------------------


def write_jsonl(path, n):
  with open(path, "w") as f:
    for i in range(n):
      f.write(json.dumps({"text": f"document {i:04d} " + "filler words here " * (i % 17 + 1)}) + "\n")


def test_mixture_weights_change_keeps_source_positions(tmp_path, tok):
  a, b = str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")
  write_jsonl(a, 300)
  with open(b, "w") as f:
    for i in range(300):
      f.write(json.dumps({"text": f"other {i:04d} " + "zzz " * 20}) + "\n")
  from tests.configs import k3_tiny
  cfg = k3_tiny.get_config().data
  cfg.sources, cfg.weights = (f"jsonl:{a}", f"jsonl:{b}"), (3.0, 1.0)
  it = pipeline.make_iterator(cfg, batch_size=BATCH, seed=0)
  take(it, 6)
  state = json.loads(json.dumps(it.get_state()))
  readers = pipeline.reader_states(state)
  cont = take(it, 4)
  stage2 = k3_tiny.get_config().data
  stage2.sources, stage2.weights, stage2.seq_len = cfg.sources, (1.0, 3.0), 64
  new = pipeline.make_iterator(stage2, batch_size=2, seed=0)
  new.set_state(state)
  after = take(new, 12)
  # Each source continues from its saved position: the first document of source A after the
  # switch is the same as in the uninterrupted run.
  first_a = lambda bs: next(int(t.split()[0]) for bb in bs for r in bb["tokens"]
                            for t in tok.decode(r).split("document ")[1:] if t.split()[0].isdigit())
  assert first_a(after) == first_a(cont)
  assert pipeline.reader_states(new.get_state())[f"jsonl:{a}"]["doc"] >= readers[f"jsonl:{a}"]["doc"]
  assert after[0]["tokens"].shape == (2, 64)
  counts = [sum(("other " in tok.decode(r)) for bb in after for r in bb["tokens"]),
            sum(("document " in tok.decode(r)) for bb in after for r in bb["tokens"])]
  assert counts[0] > counts[1]                    # the new weights favour source B


def run_hosts(cfg, n, steps, init=None):
  its = [pipeline.make_iterator(cfg, batch_size=2, seed=0, process_index=p, process_count=n) for p in range(n)]
  if init is not None:
    for it in its:
      it.set_state({"hosts": init})
  for it in its:
    take(it, steps)
  return [json.loads(json.dumps(it.get_state())) for it in its]


@pytest.mark.parametrize("n_old,n_new", [(2, 1), (1, 2)])
def test_reshard_reads_every_document_exactly_once(tmp_path, n_old, n_new):
  path = str(tmp_path / "d.jsonl")
  write_jsonl(path, 40)           # 40 docs of 4..60 tokens: one epoch in a few batches
  from tests.configs import k3_tiny
  cfg = k3_tiny.get_config().data
  cfg.sources, cfg.weights, cfg.seq_len = (f"jsonl:{path}",), (1.0,), 32
  src = f"jsonl:{path}"
  before = run_hosts(cfg, n_old, 3)
  # Position of every document (and token offset) each old host had consumed:
  init = before
  after_its = [pipeline.make_iterator(cfg, batch_size=2, seed=0, process_index=p, process_count=n_new)
               for p in range(n_new)]
  for it in after_its:
    it.set_state({"hosts": init})
  new_states = [pipeline.reader_states(it.get_state())[src] for it in after_its]
  holes = dict((g, o) for g, o in new_states[0]["layout"]["holes"])
  frontier = new_states[0]["layout"]["frontier"]
  old_consumed = {}
  for s in before:
    r = pipeline.reader_states(s)[src]
    lay = r["layout"]
    for j in range(r["doc"]):
      old_consumed[lay["frontier"] + lay["index"] + lay["count"] * j] = -1
    if r["offset"]:
      old_consumed[lay["frontier"] + lay["index"] + lay["count"] * r["doc"]] = r["offset"]
  # Every position below the frontier was consumed; above it, exactly the holes were.
  assert all(g in old_consumed for g in range(frontier))
  assert {g: o for g, o in old_consumed.items() if g >= frontier} == holes
  # Drive the new hosts over the rest of epoch 0 and check: every document position in
  # [0, 40) is read exactly once overall (old + new), partial documents resume at their offset.
  new_reads = {}
  for q, it in enumerate(after_its):
    reader = it  # consume enough batches to pass position 40 on every host
    for _ in range(40):
      next(reader)
      r = pipeline.reader_states(reader.get_state())[src]
      if r["layout"]["frontier"] + q + n_new * r["doc"] >= 40:
        break
    r = pipeline.reader_states(reader.get_state())[src]
    for j in range(r["doc"]):
      g = frontier + q + n_new * j
      new_reads.setdefault(g, []).append(q)
  for g in range(40):
    fully_old = old_consumed.get(g) == -1
    read_new = g in new_reads and holes.get(g) != -1
    assert fully_old != read_new, (g, old_consumed.get(g), new_reads.get(g))
    if g in new_reads:
      assert len(new_reads[g]) == 1
