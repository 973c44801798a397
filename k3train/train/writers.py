"""Metric writers: JSONL files (always), TensorBoard event files and Weights & Biases, behind one
small interface, plus progress lines for long silent waits.

    writers = open_writers(workdir, cfg.metrics, process_index=jax.process_index())
    writers.scalars(step, {"loss": 2.31, "lr": 3e-4})               # one row per step
    writers.scalars(step, {"eval/loss": 2.40}, stream="eval")
    if writers.wants_vectors(step):
      writers.vectors(step, {"moe_load": load_le}, rows={"moe_load": moe_layers})
    writers.flush(); writers.close()

Streams and files (in the work directory), one JSON object per line, steps strictly increasing:

  train    metrics.jsonl         {"step", "time", <scalar>: float, ...}; a step's training scalars
                                 (a string value, e.g. "stage": name, is a label: JSONL only; an
                                 int, e.g. "seq_len", stays an int)
  eval     eval_metrics.jsonl    {"step", "time", "eval/...": float, ...}; one row per evaluation
  vectors  vectors.jsonl         {"step", "time", <name>: [[...], ...], "rows": {<name>: [...]}}
                                 e.g. moe_load [MoE layers, experts], rows = their layer numbers

"time" is Unix seconds. Non-finite values are written as null (JSON has no NaN) and read back as
NaN. TensorBoard (WORKDIR/tensorboard) gets every scalar under its JSONL name as tag (characters
TensorBoard does not allow in tags, outside [A-Za-z0-9_./-], become "_": `tensorboard_tag`), with
the same step and wall time; a vector [R, C] becomes one histogram per row (`<name>/<row label>`) and a
grey-scale heatmap image `<name>/heatmap` (value / row mean, 0 .. 2 mapped to black .. white);
non-finite scalars (null in the JSONL) are left out.

Only process 0 writes (`open_writers` gives other processes a writer that drops everything).

Resuming. A resumed run replays the steps after its checkpoint. Every stream writes a step at most
once: on opening, each stream's last complete row gives its high-water mark, and rows at or below
it are dropped, for every sink at once, so the files never hold two rows for one step and nothing
already written is lost or rewritten. (A row cut off by a crash in mid-write was never complete;
it is removed on reopening so the file stays line-parseable.) JSONL rows are flushed as they are
written; TensorBoard and W&B buffer until `flush()`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import threading
import time as time_lib
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

STREAM_FILES = {"train": "metrics.jsonl", "eval": "eval_metrics.jsonl", "vectors": "vectors.jsonl"}
TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb_run_id"
_TAIL_CHUNK = 1 << 16


# --- reading ------------------------------------------------------------------------------


def _from_json(value):
  """A JSON value of a vectors row → float64 array (null → NaN)."""
  return np.asarray(value, np.float64)


def read_rows(path: str) -> list[dict[str, Any]]:
  """The complete rows of a metrics JSONL file, in file order; [] when it does not exist.

  Lines that do not parse (a row being written right now, in a running work directory) are
  skipped. Scalar nulls become NaN; lists stay lists (`read_vectors` turns them into arrays).
  """
  if not os.path.exists(path):
    return []
  rows = []
  with open(path, "rb") as f:
    for line in f:
      if not line.endswith(b"\n"):
        break                                   # the row being written
      try:
        row = json.loads(line)
      except ValueError:
        continue
      if not isinstance(row, dict) or not isinstance(row.get("step"), int):
        continue
      rows.append({k: (math.nan if v is None else v) for k, v in row.items()})
  return rows


def read_vectors(path: str) -> list[dict[str, Any]]:
  """Rows of a vectors JSONL file with every list value as a float64 array (nulls → NaN)."""
  out = []
  for row in read_rows(path):
    out.append({k: (_from_json(v) if isinstance(v, list) else v) for k, v in row.items()})
  return out


def _last_line(path: str) -> bytes | None:
  """The last newline-terminated line of `path` (read backwards, so a large file costs little)."""
  with open(path, "rb") as f:
    f.seek(0, os.SEEK_END)
    end = f.tell()
    # Ignore an unterminated tail: it is not a complete row.
    buf, pos = b"", end
    while pos > 0:
      step = min(_TAIL_CHUNK, pos)
      pos -= step
      f.seek(pos)
      buf = f.read(step) + buf
      last_nl = buf.rfind(b"\n")
      if last_nl < 0:
        continue
      prev_nl = buf.rfind(b"\n", 0, last_nl)
      if prev_nl >= 0 or pos == 0:
        return buf[prev_nl + 1:last_nl + 1]
    return None


def _repair_tail(path: str) -> None:
  """Cuts an unterminated last line (a row a crash left half-written)."""
  with open(path, "rb+") as f:
    f.seek(0, os.SEEK_END)
    size = f.tell()
    if size == 0:
      return
    f.seek(size - 1)
    if f.read(1) == b"\n":
      return
    pos = size
    while pos > 0:
      step = min(_TAIL_CHUNK, pos)
      pos -= step
      f.seek(pos)
      nl = f.read(step).rfind(b"\n")
      if nl >= 0:
        f.truncate(pos + nl + 1)
        return
    f.truncate(0)


def last_step(path: str) -> int | None:
  """The step of the last complete row of a metrics JSONL file (None when there is none).

  Rows are written in increasing step order, so this is the file's high-water mark. A last line
  that is complete but not a row (hand-edited) is skipped in favour of the row before it."""
  if not os.path.exists(path):
    return None
  with open(path, "rb") as f:
    f.seek(0, os.SEEK_END)
    if f.tell() == 0:
      return None
  line = _last_line(path)
  try:
    row = json.loads(line) if line else None
  except ValueError:
    row = None
  if isinstance(row, dict) and isinstance(row.get("step"), int):
    return row["step"]
  steps = [r["step"] for r in read_rows(path)]
  return max(steps) if steps else None


# --- the interface -------------------------------------------------------------------------


class MetricWriter:
  """One sink. Every method is a no-op here; sinks override what they support."""

  def scalars(self, step: int, values: Mapping[str, float], *, stream: str = "train",
              time: float | None = None) -> None:
    pass

  def vectors(self, step: int, values: Mapping[str, np.ndarray], *,
              rows: Mapping[str, Sequence] | None = None, time: float | None = None) -> None:
    pass

  def flush(self) -> None:
    pass

  def close(self) -> None:
    pass


def _finite_or_none(x: float):
  x = float(x)
  return x if math.isfinite(x) else None


def _json_scalar(v):
  """A row value as JSON: labels (str) and integers (e.g. seq_len) as they are, every other
  number as a float, null when not finite."""
  if isinstance(v, str):
    return v
  if isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)):
    return int(v)
  return _finite_or_none(v)


def _array_json(a: np.ndarray) -> str:
  """A float array as nested JSON lists with 6 significant digits (null for NaN/Inf)."""
  if a.ndim == 0:
    x = float(a)
    return f"{x:.6g}" if math.isfinite(x) else "null"
  return "[" + ",".join(_array_json(x) for x in a) + "]"


class JsonlWriter(MetricWriter):
  """The JSONL files of the module docstring; each row is flushed as it is written."""

  def __init__(self, workdir: str):
    self.workdir = workdir
    self._files: dict[str, Any] = {}

  def _file(self, stream: str):
    fh = self._files.get(stream)
    if fh is None:
      if stream not in STREAM_FILES:
        raise ValueError(f"unknown metrics stream {stream!r}; known: {sorted(STREAM_FILES)}")
      path = os.path.join(self.workdir, STREAM_FILES[stream])
      if os.path.exists(path):
        _repair_tail(path)
      fh = self._files[stream] = open(path, "a", encoding="utf-8")
    return fh

  def _write(self, stream: str, text: str) -> None:
    fh = self._file(stream)
    fh.write(text + "\n")
    fh.flush()

  def scalars(self, step, values, *, stream="train", time=None):
    row = {"step": int(step), "time": float(time_lib.time() if time is None else time)}
    row.update({k: _json_scalar(v) for k, v in values.items()})
    self._write(stream, json.dumps(row))

  def vectors(self, step, values, *, rows=None, time=None):
    t = float(time_lib.time() if time is None else time)
    head = json.dumps({"step": int(step), "time": t})[:-1]
    parts = [head]
    for name, value in values.items():
      parts.append(f"{json.dumps(name)}: {_array_json(np.asarray(value, np.float64))}")
    if rows:
      parts.append('"rows": ' + json.dumps({k: [_plain(r) for r in v] for k, v in rows.items()}))
    self._write("vectors", ", ".join(parts) + "}")

  def flush(self):
    for fh in self._files.values():
      fh.flush()

  def close(self):
    for fh in self._files.values():
      fh.close()
    self._files = {}


def _plain(x):
  return x.item() if isinstance(x, np.generic) else x


def heatmap_image(matrix_rc: np.ndarray) -> np.ndarray:
  """[R, C] → uint8 [1, R, C]: value / row mean, 0 .. 2 mapped to 0 .. 255 (balanced = grey)."""
  m = np.asarray(matrix_rc, np.float64)
  mean = np.nanmean(m, axis=1, keepdims=True)
  rel = np.where(mean > 0, m / np.where(mean > 0, mean, 1.0), 0.0)
  return np.clip(np.nan_to_num(rel) * 127.5, 0, 255).astype(np.uint8)[None]


_TAG_INVALID = re.compile(r"[^-/\w.]")


def tensorboard_tag(name: str) -> str:
  """The TensorBoard tag of a metric name, e.g. "mla_max_logit/stack.layers.3[0]" →
  "mla_max_logit/stack.layers.3_0_" (TensorBoard's own rule, applied here so it is ours)."""
  return _TAG_INVALID.sub("_", name).lstrip("/")


class TensorBoardWriter(MetricWriter):
  """TensorBoard event files through tensorboardX (module docstring for the tags)."""

  def __init__(self, logdir: str, *, flush_secs: int = 60):
    try:
      from tensorboardX import SummaryWriter
    except ImportError as e:   # an install without it: say how to get it or turn it off
      raise RuntimeError("metrics.tensorboard is on but tensorboardX is not installed: "
                         "pip install tensorboardX, or set --config.metrics.tensorboard=False") from e
    self.logdir = logdir
    # Event file names carry whole seconds only: a unique suffix keeps a run restarted within the
    # same second from overwriting the previous file.
    self._writer = SummaryWriter(logdir=logdir, flush_secs=flush_secs, max_queue=1000,
                                 filename_suffix=f".{os.getpid()}.{time_lib.time_ns()}")

  def scalars(self, step, values, *, stream="train", time=None):
    for tag, value in values.items():
      if not isinstance(value, str) and math.isfinite(float(value)):   # null in the JSONL: nothing
        self._writer.add_scalar(tensorboard_tag(tag), float(value), global_step=int(step),
                                walltime=time)

  def vectors(self, step, values, *, rows=None, time=None):
    for name, value in values.items():
      a = np.asarray(value, np.float64)
      if a.ndim == 1:
        a = a[None]
      labels = list((rows or {}).get(name, range(a.shape[0])))
      for label, row in zip(labels, a.reshape(a.shape[0], -1)):
        finite = row[np.isfinite(row)]
        if finite.size:
          self._writer.add_histogram(tensorboard_tag(f"{name}/{label}"), finite,
                                     global_step=int(step), walltime=time)
      if a.ndim == 2 and a.shape[0] > 1:
        self._writer.add_image(tensorboard_tag(f"{name}/heatmap"), heatmap_image(a), global_step=int(step),
                               walltime=time, dataformats="CHW")

  def flush(self):
    self._writer.flush()

  def close(self):
    self._writer.close()


class WandbWriter(MetricWriter):
  """Weights & Biases. The run id is kept in WORKDIR/wandb_run_id so a resumed run continues the
  same W&B run."""

  def __init__(self, workdir: str, *, project: str, name: str | None = None, config: dict | None = None):
    try:
      import wandb
    except ImportError as e:
      raise RuntimeError("metrics.wandb is on but wandb is not installed: pip install wandb, or set "
                         "--config.metrics.wandb=False") from e
    self._wandb = wandb
    id_path = os.path.join(workdir, WANDB_ID_FILE)
    if os.path.exists(id_path):
      with open(id_path) as f:
        run_id = f.read().strip()
    else:
      run_id = wandb.util.generate_id()
      with open(id_path, "w") as f:
        f.write(run_id + "\n")
    self._run = wandb.init(project=project, name=name or os.path.basename(os.path.abspath(workdir)),
                           id=run_id, resume="allow", dir=workdir, config=config)

  def scalars(self, step, values, *, stream="train", time=None):
    self._run.log({k: float(v) for k, v in values.items() if not isinstance(v, str)}, step=int(step))

  def vectors(self, step, values, *, rows=None, time=None):
    logged = {}
    for name, value in values.items():
      a = np.asarray(value, np.float64)
      logged[name] = self._wandb.Histogram(a[np.isfinite(a)].reshape(-1))
    self._run.log(logged, step=int(step))

  def close(self):
    self._run.finish()


class MetricWriters(MetricWriter):
  """Fans every call out to its sinks, drops replayed steps (module docstring) and stamps rows
  with one wall time so every sink records the same time for a step."""

  def __init__(self, sinks: Iterable[MetricWriter], *, high_water: Mapping[str, int] | None = None,
               vectors_every: int = 0, clock: Callable[[], float] = time_lib.time):
    self.sinks = list(sinks)
    self.high_water = {s: -1 for s in STREAM_FILES}     # nothing written yet: step 0 is allowed
    self.high_water.update({s: v for s, v in (high_water or {}).items() if v is not None})
    self.vectors_every = int(vectors_every)
    self.dropped = {s: 0 for s in STREAM_FILES}   # replayed rows not written, per stream
    self._clock = clock

  def _admit(self, stream: str, step: int) -> bool:
    if stream not in STREAM_FILES:
      raise ValueError(f"unknown metrics stream {stream!r}; known: {sorted(STREAM_FILES)}")
    if step <= self.high_water[stream]:
      self.dropped[stream] += 1
      return False
    self.high_water[stream] = step
    return True

  def wants_vectors(self, step: int) -> bool:
    """Whether `vectors(step, ...)` would write: every `vectors_every` steps, never replayed."""
    return (bool(self.sinks) and self.vectors_every > 0 and step % self.vectors_every == 0
            and step > self.high_water["vectors"])

  def scalars(self, step, values, *, stream="train", time=None):
    """Writes one row; returns False when the step was already written (a replayed step)."""
    step = int(step)
    if not self.sinks or not self._admit(stream, step):
      return False
    t = round(self._clock() if time is None else time, 3)
    for sink in self.sinks:
      sink.scalars(step, values, stream=stream, time=t)
    return True

  def vectors(self, step, values, *, rows=None, time=None):
    step = int(step)
    if not self.sinks or not self._admit("vectors", step):
      return False
    t = round(self._clock() if time is None else time, 3)
    for sink in self.sinks:
      sink.vectors(step, values, rows=rows, time=t)
    return True

  def flush(self):
    for sink in self.sinks:
      sink.flush()

  def close(self):
    errors = []
    for sink in self.sinks:
      try:
        sink.close()
      except Exception as e:                # close every sink even if one fails
        errors.append(e)
    self.sinks = []
    if errors:
      raise errors[0]

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def open_writers(workdir: str, metrics_cfg=None, *, process_index: int = 0,
                 config: dict | None = None, clock: Callable[[], float] = time_lib.time) -> MetricWriters:
  """The run's writers: JSONL always, TensorBoard and W&B as `metrics_cfg` (the `metrics` config
  section, or None for JSONL only) asks. Processes other than 0 get a writer that drops
  everything. `config` (a plain dict) is attached to the W&B run."""
  get = (lambda k, d: metrics_cfg.get(k, d)) if metrics_cfg is not None else (lambda k, d: d)
  vectors_every = int(get("vectors_every", 0))
  if process_index != 0:
    return MetricWriters([], vectors_every=vectors_every, clock=clock)
  os.makedirs(workdir, exist_ok=True)
  high_water = {s: last_step(os.path.join(workdir, f)) for s, f in STREAM_FILES.items()}
  sinks: list[MetricWriter] = [JsonlWriter(workdir)]
  try:
    if get("tensorboard", False):
      sinks.append(TensorBoardWriter(os.path.join(workdir, TENSORBOARD_DIR)))
    if get("wandb", False):
      sinks.append(WandbWriter(workdir, project=get("wandb_project", "k3train"), config=config))
  except Exception:
    for sink in sinks:
      sink.close()
    raise
  return MetricWriters(sinks, high_water=high_water, vectors_every=vectors_every, clock=clock)


# --- progress lines ------------------------------------------------------------------------


@contextlib.contextmanager
def progress(what: str, log: Callable[[str], None], *, every_s: float = 30.0,
             clock: Callable[[], float] = time_lib.monotonic):
  """Logs `what …` on entry, `what: still running (N s)` every `every_s` seconds while the body
  runs, and `what: done in N s` (or `failed after`) at the end: long waits never go silent."""
  start = clock()
  stop = threading.Event()
  log(f"{what} …")

  def beat():
    while not stop.wait(every_s):
      log(f"{what}: still running ({clock() - start:.0f} s)")

  thread = threading.Thread(target=beat, name=f"progress: {what}", daemon=True)
  thread.start()
  ok = False
  try:
    yield
    ok = True
  finally:
    stop.set()
    thread.join()
    log(f"{what}: {'done in' if ok else 'failed after'} {clock() - start:.1f} s")


__all__ = ["JsonlWriter", "MetricWriter", "MetricWriters", "STREAM_FILES", "TENSORBOARD_DIR",
           "TensorBoardWriter", "WandbWriter", "heatmap_image", "last_step", "open_writers",
           "progress", "read_rows", "read_vectors", "tensorboard_tag"]
