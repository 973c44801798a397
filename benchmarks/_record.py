"""What every benchmark record carries: the run's environment, and per-call medians.

jax is imported on use, so scripts can parse their flags (and print help) without it.
"""

from __future__ import annotations

import platform
import re
import time


def environment(**extra) -> dict:
  """{device kind, jax and python versions, date} plus `extra` (e.g. XLA flags), for each row."""
  import jax
  return {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
          "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"), **extra}


def median_call_seconds(fn, args, iters: int) -> float:
  """Median wall time of `fn(*args)` to its results being ready, after one untimed call."""
  import jax
  import numpy as np
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def relative_errors(names, reference, other) -> dict:
  """{name: max |reference − other| / max |reference|} per output pair (fp32 on the host),
  rounded to 3 significant digits."""
  import numpy as np
  errors = {}
  for name, a, b in zip(names, reference, other):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    errors[name] = float(f"{float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30)):.3g}")
  return errors


def mark_agreement(rows, errors: dict, limit: float, key: str = "agree") -> list[dict]:
  """Stamps every row with the paths' `errors` (`relative_errors`) and key = (largest ≤ limit)."""
  for r in rows:
    r["max_err_rel_to_max"] = errors
    r[key] = max(errors.values()) <= limit
  return rows


def over_shapes(shapes, measure) -> list[dict]:
  """measure(*dims(shape)) for each shape text, every row printed as soon as it is measured
  (`emit`, with the run's `environment`); all rows, in order."""
  env = environment()
  rows = []
  for shape in shapes:
    rows += emit(measure(*dims(shape)), env)
  return rows


def emit(rows, env: dict) -> list[dict]:
  """Adds `env` to each row, prints it as one JSON line as soon as it is measured; returns them."""
  import json
  out = []
  for r in rows:
    r.update(env)
    out.append(r)
    print(json.dumps(r), flush=True)
  return out


def dims(text: str) -> tuple[int, ...]:
  """'2x4096x2048' → (2, 4096, 2048)."""
  return tuple(int(x) for x in text.lower().split("x"))


# A kernel of a compiled module: an instruction that is a fusion or a custom call (its name is
# group 1); the backend compiles, autotunes and launches these one by one. Its shape may be a
# tuple ("(f32[8]{0}, s8[64]{0})": multi-output fusions, cuBLAS calls with their workspace).
KERNEL_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(?:\(.*?\)|\S+)\s+(?:fusion|custom-call)\(")
# The header of a computation ("%fused_reduce.3 (p: f32[8]) -> f32[] {", "ENTRY %main.9 (…) … {").
COMPUTATION_LINE = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
FUSION_CALLS = re.compile(r"\bfusion\(.*?\bcalls=%?([\w.\-]+)")


def kernel_lines(hlo_text: str) -> list[tuple[str, str]]:
  """(name, line) of each kernel a compiled module launches: its fusions and custom calls,
  outside fused computations (what a fusion holds is part of its one kernel)."""
  fused = set(FUSION_CALLS.findall(hlo_text))
  kernels, inside_fusion = [], False
  for line in hlo_text.splitlines():
    head = COMPUTATION_LINE.match(line)
    if head:
      inside_fusion = head.group(1) in fused
      continue
    m = None if inside_fusion else KERNEL_LINE.match(line)
    if m:
      kernels.append((m.group(1), line))
  return kernels


def kernel_names(hlo_text: str) -> list[str]:
  """Names of the kernels a compiled module launches (`kernel_lines`)."""
  return [name for name, _ in kernel_lines(hlo_text)]
