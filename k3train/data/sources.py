"""Document sources: the embedded default corpus, the Python standard library's own sources.

Every machine that runs Python has its standard library on disk, so `python_stdlib` gives a
real-text corpus (code, comments, docstrings) with no network and no download. Files are
listed in sorted relative-path order so the corpus order is deterministic on a given
installation. Test suites, site-packages and caches are left out: test suites are stripped by
many distributions (so they would make the corpus machine-dependent) and deliberately hold
odd encodings; site-packages holds whatever the user installed, not the standard library.

Files are read lazily, one per `__getitem__`, so building a pipeline costs one directory walk.
A file that cannot be read or is not valid UTF-8 is skipped with a warning that counts the
skips; it never stops training.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sysconfig
import threading

import numpy as np

log = logging.getLogger(__name__)

# Directory names that are never descended into (see the module docstring for why).
EXCLUDED_DIRS = frozenset({
    "site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test",
})
# Large enough for all but a handful of stdlib files; bounds the cost of tokenizing one
# document so the first batch arrives quickly.
DEFAULT_MAX_BYTES_PER_FILE = 256 * 1024
# Files are served as pieces of about this many bytes (cut at newlines) so that shuffling mixes
# the corpus finely: a whole 256 KiB file would fill ~150 consecutive tiny-model batches.
DEFAULT_PIECE_BYTES = 16 * 1024


def stdlib_root() -> str:
  """The directory of this interpreter's pure-Python standard library."""
  return sysconfig.get_paths()["stdlib"]


def list_python_files(root: str, *, excluded_dirs=EXCLUDED_DIRS) -> list[str]:
  """All *.py files under `root`, as absolute paths sorted by their path relative to root.

  Sorting by relative path (not by absolute path or walk order) keeps the order identical
  wherever the same tree is installed.
  """
  if not os.path.isdir(root):
    raise ValueError(f"corpus root {root!r} is not a directory")
  found = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if d not in excluded_dirs]
    for name in filenames:
      if name.endswith(".py"):
        path = os.path.join(dirpath, name)
        found.append((os.path.relpath(path, root).replace(os.sep, "/"), path))
  found.sort()
  return [path for _, path in found]


def read_text_file(path: str, max_bytes: int | None) -> str:
  """Reads `path` as strict UTF-8, keeping at most `max_bytes` bytes.

  A truncated file is cut at the last newline within the limit, so no line (and no UTF-8
  sequence) is split. Raises OSError / UnicodeDecodeError for unreadable or non-UTF-8 files.
  """
  with open(path, "rb") as f:
    data = f.read()
  text = data.decode("utf-8")  # Validate the whole file, not only the kept prefix.
  if max_bytes is not None and len(data) > max_bytes:
    cut = data.rfind(b"\n", 0, max_bytes)
    cut = max_bytes if cut < 0 else cut + 1
    text = data[:cut].decode("utf-8", errors="ignore")
  return text


def _line_start_at_or_after(data: bytes, offset: int) -> int:
  """The first line start at byte `offset` or later (len(data) if none)."""
  if offset <= 0:
    return 0
  nl = data.find(b"\n", offset - 1)
  return len(data) if nl < 0 else nl + 1


class PythonStdlibSource:
  """A grain RandomAccessDataSource over pieces of the stdlib's *.py files, read lazily.

  Each file (first `max_bytes_per_file` bytes, cut at a newline) is split into pieces of about
  `piece_bytes` bytes at line boundaries; the pieces of a file are disjoint and cover it.
  `source[i]` is the text of the i-th piece in sorted (file, piece) order, or None when the
  file could not be read as UTF-8 or the piece is empty (the pipeline drops Nones).
  Picklable, so it also works in grain worker processes.
  """

  def __init__(self, *, root: str | None = None,
               max_bytes_per_file: int | None = DEFAULT_MAX_BYTES_PER_FILE,
               piece_bytes: int | None = DEFAULT_PIECE_BYTES):
    if max_bytes_per_file is not None and max_bytes_per_file <= 0:
      raise ValueError(f"max_bytes_per_file must be positive or None, got {max_bytes_per_file}")
    if piece_bytes is not None and piece_bytes <= 0:
      raise ValueError(f"piece_bytes must be positive or None, got {piece_bytes}")
    self.root = root if root is not None else stdlib_root()
    self.max_bytes_per_file = max_bytes_per_file
    self.piece_bytes = piece_bytes
    self.paths = list_python_files(self.root)
    if not self.paths:
      raise ValueError(f"no *.py files found under {self.root!r}")
    self.pieces: list[tuple[int, int, int]] = []   # (file index, piece index, pieces in file)
    for file_index, path in enumerate(self.paths):
      try:
        size = os.path.getsize(path)
      except OSError:
        size = 0
      if max_bytes_per_file is not None:
        size = min(size, max_bytes_per_file)
      n = 1 if piece_bytes is None else max(1, -(-size // piece_bytes))
      self.pieces += [(file_index, i, n) for i in range(n)]
    self._skipped: set[str] = set()
    self._lock = threading.Lock()  # grain may read from several threads.

  def __len__(self) -> int:
    return len(self.pieces)

  def __getitem__(self, index: int) -> str | None:
    file_index, piece, num_pieces = self.pieces[index]
    path = self.paths[file_index]
    try:
      text = read_text_file(path, self.max_bytes_per_file)
    except (OSError, UnicodeDecodeError) as e:
      self._warn_skip(path, e)
      return None
    if num_pieces == 1:
      return text
    data = text.encode("utf-8")
    start = _line_start_at_or_after(data, piece * self.piece_bytes)
    end = len(data) if piece == num_pieces - 1 else _line_start_at_or_after(data, (piece + 1) * self.piece_bytes)
    return data[start:end].decode("utf-8") if end > start else None

  def _warn_skip(self, path: str, error: Exception) -> None:
    with self._lock:
      if path in self._skipped:  # Warn once per file, not once per epoch.
        return
      self._skipped.add(path)
      count = len(self._skipped)
    log.warning("skipping corpus file %s (%s: %s); %d of %d file(s) skipped so far",
                path, type(error).__name__, error, count, len(self.paths))

  @property
  def num_skipped(self) -> int:
    """Number of distinct files skipped so far in this process."""
    return len(self._skipped)

  def __repr__(self) -> str:
    return (f"PythonStdlibSource(root={self.root!r}, files={len(self.paths)}, pieces={len(self.pieces)}, "
            f"max_bytes_per_file={self.max_bytes_per_file}, piece_bytes={self.piece_bytes})")

  def __getstate__(self):
    state = dict(self.__dict__)
    del state["_lock"]
    return state

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._lock = threading.Lock()


def python_stdlib_documents(*, root: str | None = None,
                            max_bytes_per_file: int | None = DEFAULT_MAX_BYTES_PER_FILE,
                            max_total_bytes: int | None = None) -> list[str]:
  """Eagerly reads the stdlib corpus: one string per readable, non-blank file, sorted order.

  `max_total_bytes` bounds the total size (used to bound tokenizer training time) by keeping
  a deterministic pseudo-random subset of files: files are taken in the order of a hash of
  their relative path until the budget is spent, so the subset is spread over the whole
  library rather than being an alphabetical prefix. Unreadable / non-UTF-8 files are skipped
  with one counted warning.
  """
  source = PythonStdlibSource(root=root, max_bytes_per_file=max_bytes_per_file)
  docs, skipped = [], []
  for path in source.paths:
    try:
      text = read_text_file(path, source.max_bytes_per_file)
    except (OSError, UnicodeDecodeError) as e:
      skipped.append(f"{path} ({type(e).__name__})")
      continue
    if text.strip():
      docs.append((path, text))
  if skipped:
    log.warning("skipped %d of %d corpus file(s) that are unreadable or not UTF-8: %s",
                len(skipped), len(source.paths), ", ".join(skipped))
  sizes = [len(text.encode("utf-8")) for _, text in docs]
  if max_total_bytes is not None and sum(sizes) > max_total_bytes:
    def key(i):
      rel = os.path.relpath(docs[i][0], source.root).replace(os.sep, "/")
      return hashlib.sha256(rel.encode("utf-8")).hexdigest()
    keep, total = set(), 0
    for i in sorted(range(len(docs)), key=key):
      if total + sizes[i] <= max_total_bytes:
        keep.add(i)
        total += sizes[i]
    docs = [d for i, d in enumerate(docs) if i in keep]
  return [text for _, text in docs]


# --- Other document sources ----------------------------------------------------------------
#
# Every source is a grain RandomAccessDataSource (len + getitem, picklable). An item is one
# document in one of these forms, which `k3train.data.documents` encodes:
#   str                                   plain text
#   {"segments": [{"text": str} | {"image": path or bytes} | {"video": path}, ...]}
#                                         an interleaved document (image-caption pairs too)
#   None                                  nothing to train on (blank piece, unreadable file)
#   BadRecord(reason, message)            a record that could not be parsed; counted, skipped


# A source that yields no usable document (every record malformed, empty or skipped) fails after
# this many records in a row, or this many seconds (data.max_unusable_records /
# data.max_unusable_seconds), instead of waiting forever.
MAX_UNUSABLE_RECORDS = 10_000
MAX_UNUSABLE_SECONDS = 300.0
# Set by the train loop's SIGTERM / SIGINT handler: a reader waiting for a usable document
# stops waiting (NoUsableDocumentsError) instead of holding the signal off.
STOP_WAITING = threading.Event()


class NoUsableDocumentsError(ValueError):
  """A source read many records in a row without one usable document (or the wait was
  interrupted by a signal)."""


def skip_summary(counts: dict[str, int]) -> str:
  """'bad_record 812, empty 3' from {reason: count} (zero counts left out)."""
  shown = [f"{reason} {n}" for reason, n in counts.items() if n]
  return ", ".join(shown) if shown else "none"


class BadRecord:
  """A source item that could not be parsed; the pipeline counts it under `reason`."""

  __slots__ = ("reason", "message")

  def __init__(self, reason: str, message: str):
    self.reason, self.message = reason, message

  def __reduce__(self):
    return (BadRecord, (self.reason, self.message))

  def __repr__(self) -> str:
    return f"BadRecord({self.reason!r}, {self.message!r})"


def expand_paths(pattern: str, *, suffixes: tuple[str, ...] | None = None) -> list[str]:
  """Files named by `pattern`: a file, a directory (all files below it, recursively, optionally
  filtered by suffix), or a glob; sorted, so the document order is deterministic."""
  import glob
  if os.path.isdir(pattern):
    found = []
    for dirpath, dirnames, filenames in os.walk(pattern):
      dirnames.sort()
      found += [os.path.join(dirpath, n) for n in filenames
                if suffixes is None or n.lower().endswith(suffixes)]
    paths = sorted(found)
  else:
    paths = sorted(p for p in glob.glob(pattern) if os.path.isfile(p))
  if not paths:
    raise ValueError(f"no input files match {pattern!r}")
  return paths


def _resolve_media(segments, base_dir: str):
  """Validates a segments list and makes relative media paths absolute (relative to base_dir)."""
  if not isinstance(segments, list):
    raise ValueError(f"'segments' must be a list, got {type(segments).__name__}")
  out = []
  for seg in segments:
    if not isinstance(seg, dict) or len(seg) != 1:
      raise ValueError(f"each segment must be a one-key object, got {seg!r:.80}")
    (kind, value), = seg.items()
    if kind == "text":
      if not isinstance(value, str):
        raise ValueError("a text segment must hold a string")
    elif kind in ("image", "video"):
      if not isinstance(value, str):
        raise ValueError(f"an {kind} segment must hold a path")
      value = value if os.path.isabs(value) else os.path.join(base_dir, value)
    else:
      raise ValueError(f"unknown segment kind {kind!r}; allowed: text, image, video")
    out.append({kind: value})
  return {"segments": out}


def parse_document(obj, *, field: str, base_dir: str):
  """A parsed JSON value → a document (see the list above) or BadRecord."""
  if isinstance(obj, dict) and "segments" in obj:
    try:
      return _resolve_media(obj["segments"], base_dir)
    except ValueError as e:
      return BadRecord("bad_record", str(e))
  if isinstance(obj, dict) and isinstance(obj.get(field), str):
    return obj[field]
  return BadRecord("bad_record", f"record has neither a string {field!r} field nor 'segments'")


class JsonlSource:
  """Lines of JSONL files: `{"text": ...}` or `{"segments": [...]}` (interleaved documents).

  Construction scans the files once for line offsets; items are read lazily with a seek.
  Media paths in segments are relative to the JSONL file's directory.
  """

  def __init__(self, pattern: str, *, field: str = "text"):
    self.paths = expand_paths(pattern, suffixes=(".jsonl", ".json"))
    self.field = field
    self.index: list[tuple[int, int, int]] = []   # (file, offset, length)
    for f, path in enumerate(self.paths):
      with open(path, "rb") as fh:
        data = fh.read()
      start = 0
      while start < len(data):
        end = data.find(b"\n", start)
        end = len(data) if end < 0 else end
        if data[start:end].strip():
          self.index.append((f, start, end - start))
        start = end + 1

  def __len__(self) -> int:
    return len(self.index)

  def __getitem__(self, i: int):
    f, offset, length = self.index[i]
    try:
      with open(self.paths[f], "rb") as fh:
        fh.seek(offset)
        obj = json.loads(fh.read(length).decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
      return BadRecord("bad_record", f"{self.paths[f]} line at byte {offset}: {e}")
    return parse_document(obj, field=self.field, base_dir=os.path.dirname(self.paths[f]))

  def __repr__(self) -> str:
    return f"JsonlSource(files={len(self.paths)}, documents={len(self)})"


class TextFilesSource:
  """Plain UTF-8 text files, one document per file (a directory, a glob or one file)."""

  def __init__(self, pattern: str, *, suffixes=(".txt", ".md", ".text")):
    self.paths = expand_paths(pattern, suffixes=suffixes)

  def __len__(self) -> int:
    return len(self.paths)

  def __getitem__(self, i: int):
    try:
      return read_text_file(self.paths[i], None)
    except (OSError, UnicodeDecodeError) as e:
      return BadRecord("bad_record", f"{self.paths[i]}: {type(e).__name__}: {e}")


class ParquetSource:
  """A text column of Parquet files; row groups are read on demand and cached per thread."""

  def __init__(self, pattern: str, *, field: str = "text"):
    import pyarrow.parquet as pq
    self.paths = expand_paths(pattern, suffixes=(".parquet",))
    self.field = field
    self.groups: list[tuple[int, int, int]] = []   # (file, row group, first global row)
    total = 0
    for f, path in enumerate(self.paths):
      meta = pq.ParquetFile(path).metadata
      if field not in meta.schema.names:
        raise ValueError(f"{path} has no column {field!r}; columns: {meta.schema.names}")
      for g in range(meta.num_row_groups):
        self.groups.append((f, g, total))
        total += meta.row_group(g).num_rows
    self.num_rows = total
    self._starts = [s for _, _, s in self.groups]
    self._local = threading.local()

  def __len__(self) -> int:
    return self.num_rows

  def __getitem__(self, i: int):
    import bisect
    import pyarrow.parquet as pq
    if not 0 <= i < self.num_rows:
      raise IndexError(i)
    k = bisect.bisect_right(self._starts, i) - 1
    cache = getattr(self._local, "cache", None)
    if cache is None or cache[0] != k:
      f, g, _ = self.groups[k]
      column = pq.ParquetFile(self.paths[f]).read_row_group(g, columns=[self.field]).column(0)
      cache = self._local.cache = (k, column.to_pylist())
    value = cache[1][i - self.groups[k][2]]
    return value if isinstance(value, str) else BadRecord("bad_record", f"row {i}: {self.field!r} is not text")

  def __getstate__(self):
    state = dict(self.__dict__)
    del state["_local"]
    return state

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._local = threading.local()


class ArrayRecordSource:
  """ArrayRecord files whose records are UTF-8 JSON documents (as JSONL lines) or plain text."""

  def __init__(self, pattern: str, *, field: str = "text"):
    import grain
    self.paths = expand_paths(pattern, suffixes=(".array_record", ".arrayrecord"))
    self.field = field
    self._source = grain.sources.ArrayRecordDataSource(self.paths)

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, i: int):
    raw = self._source[i]
    try:
      text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
      return BadRecord("bad_record", f"record {i} is not UTF-8: {e}")
    if text.lstrip().startswith("{"):
      try:
        obj = json.loads(text)
      except ValueError as e:
        return BadRecord("bad_record", f"record {i}: {e}")
      return parse_document(obj, field=self.field, base_dir=os.path.dirname(self.paths[0]))
    return text


class ImageCaptionSource:
  """A folder of images (and animations), each with an optional same-name .txt caption.

  Document = [image, caption]. Animated GIF/APNG/WebP files count as images (first frame);
  put them in an interleaved document as {"video": path} to use them as video.
  """

  def __init__(self, root: str):
    from k3train.data import vision
    self.paths = expand_paths(root, suffixes=vision.IMAGE_EXTENSIONS)

  def __len__(self) -> int:
    return len(self.paths)

  def __getitem__(self, i: int):
    path = self.paths[i]
    caption_path = os.path.splitext(path)[0] + ".txt"
    caption = ""
    if os.path.exists(caption_path):
      try:
        caption = read_text_file(caption_path, None)
      except (OSError, UnicodeDecodeError) as e:
        return BadRecord("bad_record", f"caption {caption_path}: {e}")
    return {"segments": [{"image": path}, {"text": caption}]}


_WORDS = ("the of and to in is that for it as with was on be by this are from at or an which "
          "data model token image train layer value state batch shard host step loss code def "
          "return class import self none true false while yield lambda").split()


class SyntheticSource:
  """Deterministic generated documents for benchmarks: text, or images with captions.

  `synthetic_text`: item i is ~`words` pseudo-random words (seeded by i).
  `synthetic_images`: item i is a caption and one of 16 pre-encoded JPEG/PNG images of
  varied sizes (so decoding cost is real, encoding cost is paid once at construction).
  """

  def __init__(self, kind: str, *, size: int = 100_000, words: int = 400):
    if kind not in ("text", "images"):
      raise ValueError(f"synthetic kind must be 'text' or 'images', got {kind!r}")
    self.kind, self.size, self.words = kind, size, words
    self.pool: list[bytes] = []
    if kind == "images":
      import io
      from PIL import Image
      rng = np.random.default_rng(0)
      for j in range(16):
        w, h = int(rng.integers(200, 900)), int(rng.integers(200, 900))
        base = rng.integers(0, 255, (h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8)
        img = Image.fromarray(base).resize((w, h), Image.Resampling.BILINEAR)
        buf = io.BytesIO()
        img.save(buf, format="JPEG" if j % 2 == 0 else "PNG", quality=90)
        self.pool.append(buf.getvalue())

  def __len__(self) -> int:
    return self.size

  def _text(self, i: int, n: int) -> str:
    rng = np.random.default_rng([i, 7])
    return " ".join(_WORDS[k] for k in rng.integers(0, len(_WORDS), n)) + "\n"

  def __getitem__(self, i: int):
    if not 0 <= i < self.size:
      raise IndexError(i)
    if self.kind == "text":
      return self._text(i, self.words)
    return {"segments": [{"image": self.pool[i % len(self.pool)]}, {"text": self._text(i, 24)}]}


SOURCES = ("python_stdlib", "synthetic_text", "synthetic_images", "synthetic_passkey",
           "synthetic_multikey", "synthetic_vartrack", "jsonl", "interleaved", "text", "parquet",
           "array_record", "image_caption")
# Generated retrieval documents (k3train/data/retrieval.py): sized for the stage's seq_len and
# tokenized by the run's tokenizer, so `make_source` needs tokenizer=, seq_len= and seed= for them.
RETRIEVAL_SOURCES = ("synthetic_passkey", "synthetic_multikey", "synthetic_vartrack")


def make_source(spec: str, **kwargs):
  """The document source described by `spec`: a name, or `kind:path` (path may be a glob).

  python_stdlib | synthetic_text | synthetic_images | synthetic_passkey | synthetic_multikey |
  synthetic_vartrack | jsonl:PATH | interleaved:PATH (JSONL with segments) | text:PATH |
  parquet:PATH | array_record:PATH | image_caption:DIR.
  """
  kind, _, path = spec.partition(":")
  if kind == "python_stdlib" and not path:
    return PythonStdlibSource(**kwargs)
  if kind in RETRIEVAL_SOURCES and not path:
    from k3train.data import retrieval
    return retrieval.RetrievalSource(kind.split("_", 1)[1], **kwargs)
  if kind in ("synthetic_text", "synthetic_images") and not path:
    return SyntheticSource(kind.split("_")[1], **kwargs)
  makers = {"jsonl": JsonlSource, "interleaved": JsonlSource, "text": TextFilesSource,
            "parquet": ParquetSource, "array_record": ArrayRecordSource,
            "image_caption": ImageCaptionSource}
  if kind in makers and path:
    return makers[kind](path, **kwargs)
  raise ValueError(f"unknown data source {spec!r}; allowed values: python_stdlib, synthetic_text, "
                   "synthetic_images, synthetic_passkey, synthetic_multikey, synthetic_vartrack, or KIND:PATH with KIND one of jsonl, interleaved, text, "
                   "parquet, array_record, image_caption")
