"""Safetensors shards of a release directory, read and written one tensor at a time.

Reading: `Release(directory)` parses config.json, the optional `model.safetensors.index.json`
and the header of every shard, and checks them before any tensor is read: every tensor's bytes
must lie inside its file (a truncated shard is refused naming the shard and the first tensor
that does not fit), sizes must match dtypes and shapes, and every tensor the index lists must be
in the file the index names. Tensors are then read (or sliced) individually through
`safetensors.safe_open`, so memory holds one tensor at a time.

Writing: `write_shard` writes the header first (from the planned names, dtypes and shapes) and
then streams each tensor's bytes as a callback produces it, into `<file>.tmp`, renamed when
complete. The format is the safetensors one: an 8-byte little-endian header length, a JSON
header padded with spaces to 8 bytes, then the tensors back to back in header order.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from typing import Callable, Iterable

import ml_dtypes
import numpy as np
from safetensors import safe_open

INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
DTYPES = {"BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16),
          "F32": np.dtype(np.float32), "F64": np.dtype(np.float64), "U8": np.dtype(np.uint8),
          "I8": np.dtype(np.int8), "I32": np.dtype(np.int32), "I64": np.dtype(np.int64),
          "BOOL": np.dtype(np.bool_)}
_NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 * 1024 * 1024


class ReleaseError(ValueError):
  """A release directory that cannot be read as stated (message names the file and tensor)."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  name: str
  dtype: str
  shape: tuple[int, ...]
  file: str            # shard file name (relative to the directory)
  begin: int           # byte offsets inside the data section
  end: int


def dtype_name(dtype) -> str:
  return _NAMES[np.dtype(dtype)]


def read_header(path: str) -> tuple[list[TensorInfo], dict]:
  """(tensors in file order, __metadata__) of one shard; ReleaseError if it is malformed."""
  base = os.path.basename(path)
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    head = f.read(8)
    if len(head) < 8:
      raise ReleaseError(f"shard {base}: truncated ({size} bytes, no safetensors header)")
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER or 8 + n > size:
      raise ReleaseError(f"shard {base}: truncated or corrupt header (header of {n} bytes, file "
                         f"of {size})")
    try:
      header = json.loads(f.read(n))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise ReleaseError(f"shard {base}: header is not valid JSON ({e})") from None
  meta = header.pop("__metadata__", None) or {}
  data_size = size - 8 - n
  tensors = []
  for name, info in header.items():
    dtype, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPES or not isinstance(shape, list) or not isinstance(offs, list):
      raise ReleaseError(f"shard {base}: tensor {name!r} has an unreadable entry {info!r}")
    begin, end = int(offs[0]), int(offs[1])
    if end - begin != math.prod(shape) * DTYPES[dtype].itemsize:
      raise ReleaseError(f"shard {base}: tensor {name!r} has {end - begin} bytes for {dtype} "
                         f"{shape}")
    if end > data_size:
      raise ReleaseError(f"shard {base} is truncated: tensor {name!r} needs bytes up to {end} of "
                         f"the data section, which has {data_size}")
    tensors.append(TensorInfo(name, dtype, tuple(int(s) for s in shape), base, begin, end))
  tensors.sort(key=lambda t: t.begin)
  return tensors, meta


class Release:
  """A checked view of a release directory (config.json + safetensors shards)."""

  def __init__(self, directory: str):
    self.directory = os.path.abspath(directory)
    if not os.path.isdir(self.directory):
      raise ReleaseError(f"{directory!r} is not a directory")
    cfg_path = os.path.join(self.directory, CONFIG)
    if not os.path.isfile(cfg_path):
      raise ReleaseError(f"{directory!r} has no {CONFIG}")
    try:
      with open(cfg_path) as f:
        self.config = json.load(f)
    except json.JSONDecodeError as e:
      raise ReleaseError(f"{CONFIG}: not valid JSON ({e})") from None
    index_path = os.path.join(self.directory, INDEX)
    self.index = None
    if os.path.isfile(index_path):
      with open(index_path) as f:
        self.index = json.load(f)
      files = sorted(set(self.index.get("weight_map", {}).values()))
    else:
      files = sorted(f for f in os.listdir(self.directory) if f.endswith(".safetensors"))
    if not files:
      raise ReleaseError(f"{directory!r} has no *.safetensors shards")
    self.shards: list[tuple[str, dict, list[TensorInfo]]] = []
    self.tensors: dict[str, TensorInfo] = {}
    for name in files:
      path = os.path.join(self.directory, name)
      if not os.path.isfile(path):
        listed = next(k for k, v in self.index["weight_map"].items() if v == name)
        raise ReleaseError(f"missing tensor {listed!r}: its shard {name} (from {INDEX}) does not exist")
      tensors, meta = read_header(path)
      self.shards.append((name, meta, tensors))
      for t in tensors:
        if t.name in self.tensors:
          raise ReleaseError(f"tensor {t.name!r} is in both {self.tensors[t.name].file} and {name}")
        self.tensors[t.name] = t
    if self.index is not None:
      for tname, fname in self.index["weight_map"].items():
        if tname not in self.tensors or self.tensors[tname].file != fname:
          raise ReleaseError(f"missing tensor {tname!r}: {INDEX} places it in {fname}, which "
                             "does not hold it")
    self._open: dict[str, object] = {}

  def _handle(self, file: str):
    if file not in self._open:
      self._open[file] = safe_open(os.path.join(self.directory, file), framework="np")
    return self._open[file]

  def read(self, name: str) -> np.ndarray:
    """The whole tensor as a numpy array of its stored dtype."""
    info = self.tensors[name]
    return self._handle(info.file).get_tensor(name)

  def read_slice(self, name: str, index: tuple) -> np.ndarray:
    info = self.tensors[name]
    return self._handle(info.file).get_slice(name)[index]

  def other_files(self) -> list[str]:
    """Files besides config.json, the index and the shards (tokenizer, generation config, …)."""
    skip = {CONFIG, INDEX} | {s[0] for s in self.shards}
    out = []
    for root, _, names in os.walk(self.directory):
      for n in names:
        rel = os.path.relpath(os.path.join(root, n), self.directory)
        if rel not in skip and not n.endswith(".safetensors"):
          out.append(rel)
    return sorted(out)


def header_bytes(tensors: Iterable[tuple[str, str, tuple[int, ...]]], metadata: dict | None) -> bytes:
  """The safetensors header for tensors in this order (8-byte length + padded JSON)."""
  header, offset = {}, 0
  if metadata:
    header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
  for name, dtype, shape in tensors:
    n = math.prod(shape) * DTYPES[dtype].itemsize
    header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
    offset += n
  text = json.dumps(header, separators=(",", ":")).encode()
  text += b" " * (-len(text) % 8)
  return struct.pack("<Q", len(text)) + text


def write_shard(path: str, tensors: list[tuple[str, str, tuple[int, ...]]],
                produce: Callable[[str], np.ndarray], metadata: dict | None = None) -> int:
  """Writes one shard, asking `produce(name)` for each tensor in order; returns bytes written."""
  tmp = path + ".tmp"
  total = 0
  with open(tmp, "wb") as f:
    f.write(header_bytes(tensors, metadata))
    for name, dtype, shape in tensors:
      value = np.asarray(produce(name))
      if value.dtype != DTYPES[dtype] or tuple(value.shape) != tuple(shape):
        raise ValueError(f"tensor {name!r}: produced {value.dtype} {value.shape}, planned "
                         f"{dtype} {tuple(shape)}")
      data = np.ascontiguousarray(value).tobytes()
      f.write(data)
      total += len(data)
  os.replace(tmp, path)
  return total


def write_index(directory: str, weight_map: dict[str, str], total_size: int,
                metadata: dict | None = None) -> None:
  meta = dict(metadata or {})
  meta["total_size"] = total_size
  with open(os.path.join(directory, INDEX), "w") as f:
    json.dump({"metadata": meta, "weight_map": weight_map}, f, indent=2)
    f.write("\n")
