"""The figures of `python -m k3train.tools.report`: line charts and heatmaps written as PNG files.

Plain matplotlib on the Agg backend (no display needed). Every function takes arrays and a
path, draws one figure, writes it and closes it; none reads metric files.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Sequence

import numpy as np

DPI = 100
WIDE = (10.0, 4.0)
_MANY = 10          # more series than this: thin unlabelled lines under the highlighted ones


def _plt():
  import matplotlib
  matplotlib.use("Agg", force=True)
  import matplotlib.pyplot as plt
  return plt


@dataclasses.dataclass
class Series:
  label: str
  steps: np.ndarray
  values: np.ndarray
  style: str = "line"        # line | faint | points | bold
  axis: int = 0              # which stacked subplot


def natural_key(text: str):
  """Sort key that orders embedded numbers by value ("layer_9" before "layer_10")."""
  return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text)]


def smooth(values: np.ndarray, span: int) -> np.ndarray:
  """Exponential moving average with the given span, skipping NaNs (they keep the last value)."""
  out = np.empty_like(values, dtype=np.float64)
  alpha, acc = 2.0 / (span + 1.0), math.nan
  for i, v in enumerate(values):
    if math.isfinite(v):
      acc = v if not math.isfinite(acc) else acc + alpha * (v - acc)
    out[i] = acc
  return out


def _finite(steps, values):
  steps, values = np.asarray(steps, np.float64), np.asarray(values, np.float64)
  keep = np.isfinite(values)
  return steps[keep], values[keep]


def lines(path: str, series: Sequence[Series], *, title: str, ylabels: Sequence[str],
          logy: Sequence[bool] = (), xlabel: str = "step",
          marks: Sequence[tuple[float, str]] = ()) -> None:
  """One figure of len(ylabels) stacked subplots sharing the step axis; `marks` (x, label) are
  dashed vertical lines on every subplot, labelled on the top one."""
  plt = _plt()
  n = len(ylabels)
  fig, axes = plt.subplots(n, 1, figsize=(WIDE[0], 2.6 * n + 0.8), sharex=True, squeeze=False)
  axes = axes[:, 0]
  for k, ax in enumerate(axes):
    mine = [s for s in series if s.axis == k]
    many = len([s for s in mine if s.style == "line"]) > _MANY
    for s in mine:
      x, y = _finite(s.steps, s.values)
      if not len(y):
        continue
      if s.style == "points":
        ax.plot(x, y, "o-", ms=3.5, lw=1.2, label=s.label)
      elif s.style == "faint":
        ax.plot(x, y, lw=0.8, alpha=0.3, label=s.label)
      elif s.style == "bold":
        ax.plot(x, y, lw=2.0, color="black", label=s.label)
      elif many:
        ax.plot(x, y, lw=0.7, alpha=0.6)
      else:
        ax.plot(x, y, lw=1.2, label=s.label)
    for x, label in marks:
      ax.axvline(x, color="grey", ls="--", lw=0.8)
      if k == 0:
        ax.annotate(label, (x, 1.0), xycoords=("data", "axes fraction"), xytext=(3, -10),
                    textcoords="offset points", fontsize=7, color="grey")
    ax.set_ylabel(ylabels[k])
    if k < len(logy) and logy[k]:
      positive = [v for s in mine for v in _finite(s.steps, s.values)[1] if v > 0]
      if positive:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize=8, loc="best")
  axes[-1].set_xlabel(xlabel)
  axes[0].set_title(title)
  fig.tight_layout()
  fig.savefig(path, dpi=DPI)
  plt.close(fig)


def heatmap(path: str, matrix: np.ndarray, *, title: str, xlabel: str, ylabel: str,
            row_labels: Sequence | None = None, x_values: Sequence | None = None,
            colorbar: str = "", vmin: float | None = None, vmax: float | None = None,
            cmap: str = "RdBu_r", line: tuple[np.ndarray, np.ndarray, str] | None = None) -> None:
  """A [rows, cols] heatmap (rows top to bottom), optionally with a line chart under it sharing
  the x axis (`line` = (x, y, ylabel)); `x_values` label the columns (e.g. steps)."""
  plt = _plt()
  m = np.asarray(matrix, np.float64)
  rows, cols = m.shape
  height = min(9.0, max(2.5, 0.12 * rows + 1.5))
  if line is not None:
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(WIDE[0], height + 2.4),
                                  gridspec_kw={"height_ratios": [height, 2.2]})
  else:
    fig, ax = plt.subplots(figsize=(WIDE[0], height + 0.8))
  if x_values is not None and len(x_values):
    xs = np.asarray(x_values, np.float64)
    half = (xs[1] - xs[0]) / 2 if len(xs) > 1 else 0.5
    extent = (xs[0] - half, xs[-1] + half, rows - 0.5, -0.5)
  else:
    extent = (-0.5, cols - 0.5, rows - 0.5, -0.5)
  image = ax.imshow(np.ma.masked_invalid(m), aspect="auto", interpolation="nearest", cmap=cmap,
                    vmin=vmin, vmax=vmax, extent=extent)
  if row_labels is not None and len(row_labels) == rows:
    every = max(1, math.ceil(rows / 24))
    ticks = list(range(0, rows, every))
    ax.set_yticks(ticks)
    ax.set_yticklabels([str(row_labels[i]) for i in ticks], fontsize=7)
  ax.set_xlabel(xlabel if line is None else "")
  ax.set_ylabel(ylabel)
  ax.set_title(title)
  bar = fig.colorbar(image, ax=[ax, ax2] if line is not None else ax, fraction=0.04, pad=0.02)
  if colorbar:
    bar.set_label(colorbar)
  if line is not None:
    x, y = _finite(line[0], line[1])
    ax2.plot(x, y, lw=1.2)
    ax2.set_ylabel(line[2])
    ax2.set_xlabel(xlabel)
    ax2.grid(True, alpha=0.3)
    ax2.set_xlim(ax.get_xlim())
  if line is None:
    fig.tight_layout()
  fig.savefig(path, dpi=DPI, bbox_inches="tight")
  plt.close(fig)


__all__ = ["Series", "heatmap", "lines", "natural_key", "smooth"]
