"""An HTML page with plots of a run, from its metric files alone.

  python -m k3train.tools.report --workdir=/tmp/k3_tiny [--out=/tmp/k3_tiny/report]

reads WORKDIR/metrics.jsonl, eval_metrics.jsonl and vectors.jsonl (k3train/train/writers.py) and
writes OUT/index.html (default OUT: WORKDIR/report) with one PNG per panel. It works on a finished
run and on one still writing (only complete rows are read; run it again to refresh). A panel
whose metrics the run did not record says "not recorded". Panels (`PANELS`):

  loss                   training loss per step (faint), its moving average, and held-out eval
                         loss (overall and per eval source) at every evaluation; dashed lines
                         mark the start of each curriculum stage (here and in the next two)
  throughput             tokens/s, model FLOPs utilisation and step time
  learning_rate          the learning rate applied at each step
  grad_norm              global gradient norm (before clipping) and per parameter group, log scale
  expert_load            the latest per-layer per-expert load: layer × expert, each expert's share
                         relative to its layer's mean (1 = balanced; red above, blue below)
  expert_load_evolution  per layer, max / mean expert load at every recorded step (layer × step),
                         and the worst layer's max / mean load per step
  router_bias            spread of the Quantile Balancing router biases
  max_logit              largest MLA attention logit per step, overall and per layer (QK-Clip
                         acts above optim.qk_clip_tau), and the number of heads clipped
  data_skips             cumulative documents / media items the pipeline skipped, per source
                         (data/skipped/<source>) and reason (…/<reason>, once one occurs); the
                         padding share of each batch
  eval_details           eval loss by position bucket and retrieval accuracy, when recorded
"""

from __future__ import annotations

import dataclasses
import datetime
import html
import math
import os
import sys
import time

import numpy as np
from absl import flags

from k3train import cli
from k3train.train import writers
from k3train.tools import report_plots as plots

PROG = "python -m k3train.tools.report"
NOT_RECORDED = "not recorded"

PANELS = (
    ("loss", "Loss"),
    ("throughput", "Throughput: tokens/s and MFU"),
    ("learning_rate", "Learning rate"),
    ("grad_norm", "Gradient norms"),
    ("expert_load", "Expert load: layer × expert"),
    ("expert_load_evolution", "Expert load over steps"),
    ("router_bias", "Router bias spread (Quantile Balancing)"),
    ("max_logit", "Max logits (QK-Clip)"),
    ("data_skips", "Data skip counts"),
    ("eval_details", "Evaluation details"),
)


# --- metric tables --------------------------------------------------------------------------


@dataclasses.dataclass
class Table:
  """Rows of one stream as columns: steps ascending, one float array per key (NaN: absent)."""
  steps: np.ndarray
  times: np.ndarray
  columns: dict[str, np.ndarray]

  def get(self, key: str) -> np.ndarray | None:
    col = self.columns.get(key)
    return col if col is not None and np.isfinite(col).any() else None

  def with_prefix(self, *prefixes: str) -> list[str]:
    keys = [k for k in self.columns if k.startswith(prefixes) and self.get(k) is not None]
    return sorted(keys, key=plots.natural_key)

  def __len__(self) -> int:
    return len(self.steps)


def _number(v) -> float:
  if isinstance(v, bool):
    return float(v)
  if isinstance(v, (int, float)):
    return float(v)
  return math.nan


def make_table(rows: list[dict]) -> Table:
  """One row per step (the first row of a step wins, as the writers keep it)."""
  seen, kept = set(), []
  for row in rows:
    if row["step"] not in seen:
      seen.add(row["step"])
      kept.append(row)
  kept.sort(key=lambda r: r["step"])
  keys = sorted({k for r in kept for k, v in r.items()
                 if k not in ("step", "time") and not isinstance(v, (list, dict, str, bool))})
  return Table(np.asarray([r["step"] for r in kept], np.float64),
               np.asarray([_number(r.get("time")) for r in kept], np.float64),
               {k: np.asarray([_number(r.get(k)) for r in kept], np.float64) for k in keys})


@dataclasses.dataclass
class RunMetrics:
  train: Table
  eval: Table
  vectors: list[dict]            # rows of vectors.jsonl (arrays as float64)
  stages: list[tuple[int, str]]  # (first step, name) of every curriculum stage in the rows


def load(workdir: str) -> RunMetrics:
  """The run's three streams. Rows marked "eval": true in metrics.jsonl (written there by loops
  without an eval stream) count as eval rows."""
  path = lambda stream: os.path.join(workdir, writers.STREAM_FILES[stream])
  train_rows, eval_rows = [], []
  for row in writers.read_rows(path("train")):
    (eval_rows if row.get("eval") is True else train_rows).append(row)
  eval_rows += writers.read_rows(path("eval"))
  vectors, seen = [], set()
  for row in writers.read_vectors(path("vectors")):
    if row["step"] not in seen:
      seen.add(row["step"])
      vectors.append(row)
  vectors.sort(key=lambda r: r["step"])
  stages, current = [], None
  for row in sorted(train_rows, key=lambda r: r["step"]):
    name = row.get("stage")
    if isinstance(name, str) and name != current:
      stages.append((row["step"], name))
      current = name
  return RunMetrics(make_table(train_rows), make_table(eval_rows), vectors, stages)


# --- panels ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Panel:
  id: str
  title: str
  image: str | None = None       # PNG file name in the output folder; None: not recorded
  note: str = ""


def _series(table: Table, key: str, label: str | None = None, **kw) -> plots.Series:
  return plots.Series(label or key, table.steps, table.columns[key], **kw)


def panel_loss(m: RunMetrics, path: str) -> str | None:
  series = []
  loss = m.train.get("loss")
  if loss is not None:
    series.append(_series(m.train, "loss", "train loss", style="faint"))
    if np.isfinite(loss).sum() >= 20:
      span = max(5, int(np.isfinite(loss).sum()) // 50)
      series.append(plots.Series(f"train loss (moving average, {span} steps)", m.train.steps,
                                 plots.smooth(loss, span)))
  for key in ["eval/loss"] + m.eval.with_prefix("eval/loss/"):
    if m.eval.get(key) is not None and not key.startswith("eval/loss/pos_"):
      series.append(_series(m.eval, key, key.replace("eval/loss/", "eval loss: ").replace(
          "eval/loss", "eval loss"), style="points"))
  if not series:
    return None
  plots.lines(path, series, title="Loss", ylabels=["next-token loss (nats)"], marks=m.stages)
  return "train loss, its moving average and held-out eval loss"


def panel_throughput(m: RunMetrics, path: str) -> str | None:
  t = m.train
  parts = []
  if t.get("tokens_per_s") is not None:
    parts.append(([_series(t, "tokens_per_s", "tokens/s")], "tokens/s"))
  if t.get("mfu") is not None:
    parts.append(([plots.Series("MFU", t.steps, 100.0 * t.columns["mfu"])], "MFU (%)"))
  if t.get("step_time_s") is not None:
    parts.append(([_series(t, "step_time_s", "step time")], "step time (s)"))
  if not parts:
    return None
  series = [dataclasses.replace(s, axis=k) for k, (ss, _) in enumerate(parts) for s in ss]
  plots.lines(path, series, title="Throughput", ylabels=[y for _, y in parts], marks=m.stages)
  return ""


def panel_learning_rate(m: RunMetrics, path: str) -> str | None:
  key = next((k for k in ("lr", "learning_rate") if m.train.get(k) is not None), None)
  if key is None:
    return None
  plots.lines(path, [_series(m.train, key, "learning rate")], title="Learning rate",
              ylabels=["learning rate"], marks=m.stages)
  return ""


def _parts_and_total(t, key: str, total_label: str):
  """(the "<key>/<part>" keys, their series + the bold "<key>" total), or (…, None) when neither
  was recorded."""
  parts = t.with_prefix(key + "/")
  if t.get(key) is None and not parts:
    return parts, None
  series = [_series(t, k, k.split("/", 1)[1]) for k in parts]
  if t.get(key) is not None:
    series.append(_series(t, key, total_label, style="bold"))
  return parts, series


def panel_grad_norm(m: RunMetrics, path: str) -> str | None:
  t = m.train
  groups, series = _parts_and_total(t, "grad_norm", "global")
  if series is None:
    return None
  plots.lines(path, series, title="Gradient norms", ylabels=["L2 norm"], logy=[True])
  return "" if groups else "per-group norms not recorded; global norm only"


def _load_rows(m: RunMetrics, name: str = "moe_load") -> list[dict]:
  return [r for r in m.vectors if isinstance(r.get(name), np.ndarray) and r[name].ndim == 2]


def _relative(load_le: np.ndarray) -> np.ndarray:
  mean = np.nanmean(load_le, axis=1, keepdims=True)
  return np.where(mean > 0, load_le / np.where(mean > 0, mean, 1.0), np.nan)


def _layer_labels(row: dict, name: str, n: int) -> list:
  labels = (row.get("rows") or {}).get(name) if isinstance(row.get("rows"), dict) else None
  return list(labels) if labels is not None and len(labels) == n else list(range(n))


def panel_expert_load(m: RunMetrics, path: str) -> str | None:
  rows = _load_rows(m)
  if not rows:
    return None
  last = rows[-1]
  rel = _relative(last["moe_load"])
  labels = _layer_labels(last, "moe_load", rel.shape[0])
  plots.heatmap(path, rel, title=f"step {last['step']}: expert load / layer mean (1 = balanced)",
                xlabel="expert", ylabel="layer", row_labels=labels, colorbar="load / mean",
                vmin=0.0, vmax=2.0, cmap="RdBu_r")
  worst = int(np.nanargmax(np.nanmax(rel, axis=1)))
  return (f"step {last['step']}: {rel.shape[0]} MoE layers × {rel.shape[1]} experts; the most "
          f"loaded expert gets {np.nanmax(rel):.2f}× its layer's mean (layer {labels[worst]})")


def panel_expert_load_evolution(m: RunMetrics, path: str) -> str | None:
  rows = _load_rows(m)
  scalar = m.train.get("moe_max_load")
  if not rows and scalar is None:
    return None
  if rows and len({r["moe_load"].shape for r in rows}) == 1:
    imbalance = np.stack([np.nanmax(_relative(r["moe_load"]), axis=1) for r in rows], axis=1)
    steps = [r["step"] for r in rows]
    line = (m.train.steps, m.train.columns["moe_max_load"], "worst layer max/mean") \
        if scalar is not None else None
    plots.heatmap(path, imbalance, title="Expert load over steps: max / mean per layer",
                  xlabel="step", ylabel="layer", x_values=steps,
                  row_labels=_layer_labels(rows[-1], "moe_load", imbalance.shape[0]),
                  colorbar="max / mean load", vmin=1.0, cmap="viridis", line=line)
    return f"{len(rows)} recorded steps (metrics.vectors_every)"
  plots.lines(path, [_series(m.train, "moe_max_load", "worst layer max/mean load")],
              title="Expert load over steps", ylabels=["max / mean load"])
  return "per-layer per-expert loads not recorded; the worst layer's max/mean only"


def panel_router_bias(m: RunMetrics, path: str) -> str | None:
  keys = [k for k in ("router_bias_spread",) if m.train.get(k) is not None] + \
      m.train.with_prefix("router_bias_spread/")
  if not keys:
    return None
  plots.lines(path, [_series(m.train, k) for k in keys], title="Router bias spread",
              ylabels=["max − min router bias"])
  return ""


def panel_max_logit(m: RunMetrics, path: str) -> str | None:
  t = m.train
  _, series = _parts_and_total(t, "mla_max_logit", "max over layers")
  if series is None:
    return None
  ylabels = ["max logit"]
  if t.get("qk_clip_heads") is not None:
    series.append(_series(t, "qk_clip_heads", "heads clipped", axis=1))
    ylabels.append("heads clipped")
  plots.lines(path, series, title="Max MLA logits", ylabels=ylabels)
  return ""


def panel_data_skips(m: RunMetrics, path: str) -> str | None:
  t = m.train
  prefixes = ("data/skipped/", "data/errors/", "errors/")
  keys = t.with_prefix(*prefixes)
  series = [_series(t, k, next(k[len(p):] for p in prefixes if k.startswith(p))) for k in keys]
  ylabels = []
  if keys:
    ylabels.append("skipped (cumulative)")
  if t.get("skipped_update") is not None and np.nansum(t.columns["skipped_update"]) > 0:
    series.append(plots.Series("updates skipped by the loss-spike guard", t.steps,
                               np.nancumsum(t.columns["skipped_update"]), axis=len(ylabels)))
    ylabels.append("skipped updates")
  if t.get("padding_fraction") is not None:
    series.append(_series(t, "padding_fraction", "padding share of the batch", axis=len(ylabels)))
    ylabels.append("padding share")
  if not keys:
    if not ylabels:
      return None
  plots.lines(path, series, title="Data skip counts", ylabels=ylabels)
  if not keys:
    return "per-source skip counters not recorded"
  totals = [k for k in keys if k.rsplit("/", 1)[0] not in keys]   # not a per-reason child
  total = sum(float(np.nanmax(t.columns[k])) for k in totals)
  return "no document or media item was skipped" if total == 0 else f"{total:.0f} skipped in all"


def panel_eval_details(m: RunMetrics, path: str) -> str | None:
  e = m.eval
  pos = e.with_prefix("eval/loss_by_pos/", "eval/loss/pos_")
  retrieval = e.with_prefix("eval/retrieval/")
  if not pos and not retrieval:
    return None
  series, ylabels = [], []
  if pos:
    series += [_series(e, k, "positions " + k.split("/")[-1].removeprefix("pos_").replace("_", "–"),
                       style="points") for k in pos]
    ylabels.append("eval loss by position")
  if retrieval:
    series += [_series(e, k, k.split("/")[-1], style="points", axis=len(ylabels)) for k in retrieval]
    ylabels.append("retrieval accuracy")
  plots.lines(path, series, title="Evaluation details", ylabels=ylabels)
  return ""


PANEL_FUNCTIONS = {
    "loss": panel_loss, "throughput": panel_throughput, "learning_rate": panel_learning_rate,
    "grad_norm": panel_grad_norm, "expert_load": panel_expert_load,
    "expert_load_evolution": panel_expert_load_evolution, "router_bias": panel_router_bias,
    "max_logit": panel_max_logit, "data_skips": panel_data_skips, "eval_details": panel_eval_details,
}


# --- the page -------------------------------------------------------------------------------


def _last(table: Table, key: str) -> float | None:
  col = table.get(key)
  if col is None:
    return None
  finite = col[np.isfinite(col)]
  return float(finite[-1]) if len(finite) else None


def _summary(m: RunMetrics, now: float) -> list[tuple[str, str]]:
  out = []
  if len(m.train):
    out.append(("last step", f"{int(m.train.steps[-1])}"))
  for label, table, key, fmt in (("loss", m.train, "loss", "{:.4f}"),
                                 ("eval loss", m.eval, "eval/loss", "{:.4f}"),
                                 ("tokens/s", m.train, "tokens_per_s", "{:,.0f}"),
                                 ("MFU", m.train, "mfu", "{:.2%}"),
                                 ("learning rate", m.train, "lr", "{:.3g}"),
                                 ("gradient norm", m.train, "grad_norm", "{:.3g}")):
    v = _last(table, key)
    if v is not None:
      out.append((label, fmt.format(v)))
  times = np.concatenate([m.train.times, m.eval.times])
  times = times[np.isfinite(times)]
  if len(times):
    last = float(np.max(times))
    stamp = datetime.datetime.fromtimestamp(last).strftime("%Y-%m-%d %H:%M:%S")
    out.append(("last row written", f"{stamp} ({max(0.0, now - last):,.0f} s before this report)"))
  out.append(("rows", f"{len(m.train)} training, {len(m.eval)} eval, {len(m.vectors)} vector"))
  return out


_STYLE = """
body { font-family: sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
table.summary td { padding: 2px 14px 2px 0; }
section { margin: 2em 0; border-top: 1px solid #ddd; }
p.note { color: #555; }
p.missing { color: #999; font-style: italic; }
img { max-width: 100%; }
"""


def render_html(workdir: str, m: RunMetrics, panels: list[Panel], now: float) -> str:
  esc = html.escape
  rows = "".join(f"<tr><td>{esc(k)}</td><td>{esc(v)}</td></tr>" for k, v in _summary(m, now))
  index = " · ".join(f'<a href="#{p.id}">{esc(p.title)}</a>' for p in panels)
  body = []
  for p in panels:
    part = [f'<section id="{p.id}"><h2>{esc(p.title)}</h2>']
    if p.image is None:
      part.append(f'<p class="missing">{NOT_RECORDED}{": " + esc(p.note) if p.note else ""}</p>')
    else:
      if p.note:
        part.append(f'<p class="note">{esc(p.note)}</p>')
      part.append(f'<img src="{esc(p.image)}" alt="{esc(p.title)}">')
    part.append("</section>")
    body.append("".join(part))
  return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>k3train run: "
          f"{esc(os.path.basename(os.path.abspath(workdir)))}</title><style>{_STYLE}</style></head>"
          f"<body><h1>Run {esc(os.path.abspath(workdir))}</h1>"
          f"<table class=\"summary\">{rows}</table>"
          f"<p>{index}</p>{''.join(body)}</body></html>\n")


def build_report(workdir: str, out_dir: str | None = None, *, now: float | None = None) -> tuple[str, list[Panel]]:
  """Writes OUT/index.html and the panels' PNGs; returns (path of the page, panels)."""
  out_dir = out_dir or os.path.join(workdir, "report")
  os.makedirs(out_dir, exist_ok=True)
  m = load(workdir)
  panels = []
  for pid, title in PANELS:
    name = f"{pid}.png"
    target = os.path.join(out_dir, name)
    if os.path.exists(target):
      os.remove(target)           # a panel no longer drawable must not show an old picture
    note = PANEL_FUNCTIONS[pid](m, target)
    panels.append(Panel(pid, title, name if note is not None else None, note or ""))
  page = os.path.join(out_dir, "index.html")
  tmp = page + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(render_html(workdir, m, panels, time.time() if now is None else now))
  os.replace(tmp, page)           # a browser refreshing the page never sees half of it
  return page, panels


def _define(fv: flags.FlagValues) -> None:
  flags.DEFINE_string("workdir", None, "the run's work directory (holds metrics.jsonl)", flag_values=fv)
  flags.DEFINE_string("out", None, "where index.html and the PNGs go (default: WORKDIR/report)",
                      flag_values=fv)


def main(argv=None) -> int:
  args = cli.parse(argv, PROG, define=_define, config_required=False)
  if args.exit_code is not None:
    return args.exit_code
  fv = args.flags
  if not fv.workdir:
    cli.error(PROG, "--workdir is required")
    return cli.USAGE_ERROR
  if not os.path.isdir(fv.workdir):
    cli.error(PROG, f"--workdir {fv.workdir!r} is not a directory")
    return cli.USAGE_ERROR
  files = writers.STREAM_FILES.values()
  if not any(os.path.exists(os.path.join(fv.workdir, f)) for f in files):
    cli.error(PROG, f"--workdir {fv.workdir!r} holds no metric files ({', '.join(files)})")
    return cli.USAGE_ERROR
  page, panels = build_report(fv.workdir, fv.out)
  missing = [p.id for p in panels if p.image is None]
  print(f"report: {page} ({len(panels) - len(missing)} panels drawn"
        + (f"; not recorded: {', '.join(missing)})" if missing else ")"), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
