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
import logging
import os
import sysconfig
import threading

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


SOURCES = ("python_stdlib",)


def make_source(name: str, **kwargs) -> PythonStdlibSource:
  """The document source called `name` (see SOURCES)."""
  if name == "python_stdlib":
    return PythonStdlibSource(**kwargs)
  raise ValueError(f"unknown data source {name!r}; allowed values: {', '.join(SOURCES)}")
