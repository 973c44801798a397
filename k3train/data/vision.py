"""Image and video preprocessing for the MoonViT-V2 vision tower (docs/maths.md §6).

Images: decoded with Pillow, converted to RGB, resized (bicubic) to "native" resolution: the
original size where it fits, otherwise scaled down just enough that (a) the longer side is at
most `max_side` px (3,584 = 256 patches) and (b) the patch count h·w (14-px patches) is at most
`max_patches`; then both sides are rounded to multiples of 28 px (so h and w in patches are even
and the 2×2 merge of §6.1 tiles the grid; §6.5 invariant 3). One image is one grid (t=1, h, w).

Videos: frames sampled at `video_fps` frames per second of media time, at most
`max_video_frames` (uniformly thinned beyond that), all resized to the first frame's target size
under the per-frame budget `max_video_frame_patches`, and cut into chunks of at most
`frames_per_chunk` (4) consecutive frames; each chunk is one grid (t ≤ 4, h, w) (§6.4).
Supported containers (no ffmpeg needed): animated GIF, APNG, animated WebP, multi-page TIFF
(Pillow's ImageSequence), and a directory of still frames (sorted by name; an optional `fps.txt`
gives their rate, otherwise every frame is taken as sampled). MP4/WebM/AVI are *not* decoded:
they are skipped as `unknown_format`.

Patch layout: a grid (t, h, w) yields t·h·w patches in (t, row, column) raster order, each
patch flattened as (14, 14, 3) → 588 uint8 values (pixel values, 0–255; normalisation is the
model's job, which keeps host memory and host→device traffic 4× smaller than float32).

Each grid contributes exactly h·w/4 placeholder tokens to the text (t frames are pooled by
`sd2_tpool`, so a 4-frame chunk costs the same as one image).

Bad media raise `MediaError(reason)`; the caller skips the item and counts the reason
(`REASONS`), so corrupt / truncated files, zero-size or oversized images and unknown formats
never crash the pipeline and never produce a wrong sample.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import warnings
from typing import Sequence

import numpy as np
from PIL import Image, ImageFile, ImageSequence, UnidentifiedImageError

PATCH = 14          # ViT patch side, px
MERGE = 2           # 2×2 spatial merge after the encoder
ALIGN = PATCH * MERGE  # 28 px: both sides are multiples of this
PATCH_DIM = PATCH * PATCH * 3  # 588 values per patch

# Why an item was skipped; also the order of the per-source error counters.
REASONS = ("missing", "unknown_format", "corrupt", "truncated", "zero_size", "oversized",
           "too_long_for_row", "bad_record", "vision_disabled")

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".gif", ".webp", ".bmp", ".tif", ".tiff", ".ppm")
# Containers we recognise but cannot decode without extra dependencies.
UNSUPPORTED_VIDEO_EXTENSIONS = (".mp4", ".mkv", ".webm", ".avi", ".mov", ".m4v")

# Pillow must never return a silently-partial image.
ImageFile.LOAD_TRUNCATED_IMAGES = False


class MediaError(Exception):
  """A media item that must be skipped; `reason` is one of REASONS."""

  def __init__(self, reason: str, message: str):
    if reason not in REASONS:
      raise ValueError(f"unknown skip reason {reason!r}; allowed: {REASONS}")
    super().__init__(f"{reason}: {message}")
    self.reason = reason


@dataclasses.dataclass(frozen=True)
class VisionConfig:
  """Preprocessing limits (the `data.vision` config section)."""
  max_patches: int = 16384            # h·w budget of one image (in 14-px patches)
  max_side: int = 3584                # px, after resizing
  max_input_pixels: int = 16384 * 16384  # larger decoded images are refused (decompression bombs)
  video_fps: float = 2.0              # sampling rate of video frames
  max_video_frames: int = 64
  max_video_frame_patches: int = 1024  # h·w budget of one video frame
  frames_per_chunk: int = 4

  def __post_init__(self):
    if self.max_patches < MERGE * MERGE:
      raise ValueError(f"vision max_patches must be >= 4, got {self.max_patches}")
    if self.max_side < ALIGN or self.max_side % ALIGN:
      raise ValueError(f"vision max_side must be a positive multiple of {ALIGN}, got {self.max_side}")
    if not 1 <= self.frames_per_chunk <= 4:
      raise ValueError(f"vision frames_per_chunk must lie in [1, 4] (MoonViT-3D's time table), "
                       f"got {self.frames_per_chunk}")
    if self.video_fps <= 0 or self.max_video_frames < 1 or self.max_video_frame_patches < 4:
      raise ValueError("vision video_fps must be > 0, max_video_frames >= 1, "
                       "max_video_frame_patches >= 4")


@dataclasses.dataclass
class Visual:
  """One preprocessed image or video: grids [(t, h, w)] and their patches, concatenated."""
  kind: str                    # "image" | "video"
  grids: list[tuple[int, int, int]]
  patches: np.ndarray          # uint8 [Σ t·h·w, 588]

  def tokens_per_grid(self) -> list[int]:
    return [h * w // (MERGE * MERGE) for _, h, w in self.grids]


def target_size(width: int, height: int, max_patches: int, max_side: int) -> tuple[int, int]:
  """(width, height) in px, multiples of 28, ≤ max_side, with (w/14)·(h/14) ≤ max_patches.

  Keeps the native size when it fits (rounded to the nearest multiple of 28), otherwise the
  largest size of the same aspect ratio that fits. Never smaller than 28 px per side.
  """
  if width <= 0 or height <= 0:
    raise MediaError("zero_size", f"image is {width}x{height} px")
  if max(width, height) / min(width, height) > max_side / ALIGN:
    raise MediaError("oversized", f"aspect ratio of {width}x{height} px exceeds {max_side // ALIGN}:1")
  scale = min(1.0, max_side / max(width, height),
              math.sqrt(max_patches * PATCH * PATCH / (width * height)))

  def fits(w, h):
    return w <= max_side and h <= max_side and (w // PATCH) * (h // PATCH) <= max_patches

  w = max(ALIGN, round(width * scale / ALIGN) * ALIGN)
  h = max(ALIGN, round(height * scale / ALIGN) * ALIGN)
  if not fits(w, h):
    w = max(ALIGN, math.floor(width * scale / ALIGN) * ALIGN)
    h = max(ALIGN, math.floor(height * scale / ALIGN) * ALIGN)
  while not fits(w, h):  # Only for budgets below a 28-px-aligned rectangle; shrink the long side.
    if w >= h and w > ALIGN:
      w -= ALIGN
    elif h > ALIGN:
      h -= ALIGN
    else:
      raise MediaError("oversized", f"no 28-px-aligned size fits max_patches={max_patches}")
  return w, h


def patchify(frames_thwc: np.ndarray) -> np.ndarray:
  """uint8 [t, H, W, 3] (H, W multiples of 14) → [t·(H/14)·(W/14), 588] in (t, row, col) order."""
  t, hh, ww, c = frames_thwc.shape
  if c != 3 or hh % PATCH or ww % PATCH:
    raise ValueError(f"patchify needs [t, H, W, 3] with H, W multiples of {PATCH}, got {frames_thwc.shape}")
  gh, gw = hh // PATCH, ww // PATCH
  x = frames_thwc.reshape(t, gh, PATCH, gw, PATCH, 3).transpose(0, 1, 3, 2, 4, 5)
  return np.ascontiguousarray(x).reshape(t * gh * gw, PATCH_DIM)


def _open(data: bytes | str) -> Image.Image:
  """Opens (lazily) an image from a path or bytes, mapping Pillow errors to MediaError."""
  try:
    if isinstance(data, (bytes, bytearray)):
      if not data:
        raise MediaError("zero_size", "empty image bytes")
      return Image.open(io.BytesIO(data))
    if not os.path.exists(data):
      raise MediaError("missing", f"{data} does not exist")
    if os.path.getsize(data) == 0:
      raise MediaError("zero_size", f"{data} is an empty file")
    return Image.open(data)
  except MediaError:
    raise
  except UnidentifiedImageError as e:
    raise MediaError("unknown_format", str(e)) from e
  except Image.DecompressionBombError as e:
    raise MediaError("oversized", str(e)) from e
  except (OSError, ValueError, SyntaxError) as e:
    raise MediaError("corrupt", f"{type(e).__name__}: {e}") from e


def _load_rgb(img: Image.Image, cfg: VisionConfig, what: str) -> Image.Image:
  """Fully decodes the current frame as RGB, with size checks before decoding."""
  w, h = img.size
  if w <= 0 or h <= 0:
    raise MediaError("zero_size", f"{what} is {w}x{h} px")
  if w * h > cfg.max_input_pixels:
    raise MediaError("oversized", f"{what} is {w}x{h} px > max_input_pixels={cfg.max_input_pixels}")
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")  # Pillow warns on some palettes with transparency.
      img.load()
      return img.convert("RGB")
  except Image.DecompressionBombError as e:
    raise MediaError("oversized", str(e)) from e
  except OSError as e:
    reason = "truncated" if "truncated" in str(e).lower() else "corrupt"
    raise MediaError(reason, f"{what}: {e}") from e
  except (ValueError, SyntaxError, EOFError, IndexError) as e:
    raise MediaError("corrupt", f"{what}: {type(e).__name__}: {e}") from e


def _resize(img: Image.Image, size: tuple[int, int]) -> np.ndarray:
  if img.size != size:
    img = img.resize(size, Image.Resampling.BICUBIC, reducing_gap=3.0)
  return np.asarray(img, dtype=np.uint8)


def load_image(data: bytes | str, cfg: VisionConfig) -> Visual:
  """One image → a (1, h, w) grid and its h·w patches."""
  with warnings.catch_warnings():
    warnings.simplefilter("error", Image.DecompressionBombWarning)
    try:
      img = _open(data)
      rgb = _load_rgb(img, cfg, "image")
    except Image.DecompressionBombWarning as e:
      raise MediaError("oversized", str(e)) from e
  size = target_size(*rgb.size, cfg.max_patches, cfg.max_side)
  pixels = _resize(rgb, size)[None]
  return Visual("image", [(1, size[1] // PATCH, size[0] // PATCH)], patchify(pixels))


def _sample_times(durations_s: Sequence[float], fps: float, max_frames: int) -> list[int]:
  """Indices of the frames shown at times 0, 1/fps, 2/fps, ... (thinned to max_frames)."""
  starts = np.concatenate([[0.0], np.cumsum(durations_s)[:-1]])
  total = float(np.sum(durations_s))
  n = max(1, int(math.floor(total * fps + 1e-9)))
  times = np.arange(n) / fps
  idx = np.clip(np.searchsorted(starts, times, side="right") - 1, 0, len(durations_s) - 1)
  if len(idx) > max_frames:
    idx = idx[np.round(np.linspace(0, len(idx) - 1, max_frames)).astype(int)]
  return [int(i) for i in idx]


def _video_frames(data: str | bytes, cfg: VisionConfig) -> list[Image.Image]:
  """Decoded RGB frames sampled at cfg.video_fps (see module docstring for formats)."""
  if isinstance(data, str) and os.path.isdir(data):
    names = sorted(n for n in os.listdir(data) if n.lower().endswith(IMAGE_EXTENSIONS))
    if not names:
      raise MediaError("zero_size", f"frame folder {data} holds no images")
    fps_file = os.path.join(data, "fps.txt")
    if os.path.exists(fps_file):
      try:
        src_fps = float(open(fps_file).read().strip())
        if not src_fps > 0:
          raise ValueError
      except ValueError as e:
        raise MediaError("corrupt", f"{fps_file} must hold a positive number") from e
      idx = _sample_times([1.0 / src_fps] * len(names), cfg.video_fps, cfg.max_video_frames)
    else:
      idx = _sample_times([1.0 / cfg.video_fps] * len(names), cfg.video_fps, cfg.max_video_frames)
    return [_load_rgb(_open(os.path.join(data, names[i])), cfg, f"frame {names[i]}") for i in idx]
  if isinstance(data, str) and data.lower().endswith(UNSUPPORTED_VIDEO_EXTENSIONS):
    raise MediaError("unknown_format", f"{data}: only GIF/APNG/WebP/TIFF animations and frame "
                     "folders are decoded")
  img = _open(data)
  n = getattr(img, "n_frames", 1)
  durations = []
  try:
    for frame in ImageSequence.Iterator(img):
      durations.append(max(float(frame.info.get("duration", 0) or 0), 10.0) / 1000.0)
  except (OSError, EOFError, ValueError) as e:
    raise MediaError("truncated" if "truncated" in str(e).lower() else "corrupt", f"video: {e}") from e
  if len(durations) != n or n < 1:
    raise MediaError("corrupt", f"video declares {n} frames, {len(durations)} readable")
  frames = []
  for i in _sample_times(durations, cfg.video_fps, cfg.max_video_frames):
    try:
      img.seek(i)
    except (OSError, EOFError, ValueError) as e:
      raise MediaError("corrupt", f"video frame {i}: {e}") from e
    frames.append(_load_rgb(img, cfg, f"video frame {i}"))
  return frames


def load_video(data: str | bytes, cfg: VisionConfig) -> Visual:
  """A video → chunks of ≤ frames_per_chunk frames, one (t, h, w) grid each."""
  frames = _video_frames(data, cfg)
  size = target_size(*frames[0].size, cfg.max_video_frame_patches, cfg.max_side)
  pixels = np.stack([_resize(f, size) for f in frames])       # [n, H, W, 3]
  gh, gw = size[1] // PATCH, size[0] // PATCH
  grids, patches = [], []
  for start in range(0, len(pixels), cfg.frames_per_chunk):
    chunk = pixels[start:start + cfg.frames_per_chunk]
    grids.append((len(chunk), gh, gw))
    patches.append(patchify(chunk))
  return Visual("video", grids, np.concatenate(patches))


def load_media(kind: str, data: bytes | str, cfg: VisionConfig) -> Visual:
  """`kind` "image" or "video"; errors are MediaError (never another exception for bad data)."""
  try:
    if kind == "image":
      return load_image(data, cfg)
    if kind == "video":
      return load_video(data, cfg)
  except MediaError:
    raise
  except MemoryError as e:
    raise MediaError("oversized", f"{kind} needs too much memory") from e
  except (OSError, ValueError, SyntaxError, EOFError, IndexError, TypeError,
          Image.DecompressionBombError) as e:
    raise MediaError("corrupt", f"{kind}: {type(e).__name__}: {e}") from e
  raise ValueError(f"unknown media kind {kind!r}; expected 'image' or 'video'")
