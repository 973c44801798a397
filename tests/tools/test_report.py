"""python -m k3train.tools.report renders every panel from a synthetic metrics directory (written
with the run's own writers, one row cut off as in a running run), reports what it computed from
the vectors, and shows "not recorded" for what a run did not record."""

import json
import os

import numpy as np
import pytest

from k3train.tools import report
from k3train.train import writers

STEPS = 60
LAYERS, EXPERTS = (2, 3, 4, 5), 8
PNG = b"\x89PNG\r\n\x1a\n"


def write_run(workdir):
  rng = np.random.default_rng(0)
  w = writers.open_writers(workdir, {"tensorboard": False, "vectors_every": 10})
  for step in range(1, STEPS + 1):
    w.scalars(step, {
        "loss": 6.0 / (1 + step / 20) + 0.05 * rng.random(), "lr": 1e-3 * min(1.0, step / 10),
        "grad_norm": 1.0 + rng.random(), "grad_norm/kda": 0.5, "grad_norm/moe_experts": 0.7,
        "tokens_per_s": 900.0 + step, "mfu": 0.012, "step_time_s": 0.55,
        "mla_max_logit": 12.0 + step / 10, "mla_max_logit/prefix.3": 11.0, "qk_clip_heads": 0.0,
        "moe_max_load": 1.4, "router_bias_spread": 0.001 * step, "padding_fraction": 0.03,
        "data/errors/python_stdlib/bad_record": float(step // 20), "skipped_update": 0.0})
    if w.wants_vectors(step):
      load = rng.dirichlet(np.full(EXPERTS, 20.0), size=len(LAYERS))
      if step == STEPS:            # layer 4, expert 5: half the layer's load, 4x the mean 1/8
        load[2] = 0.5 / (EXPERTS - 1)
        load[2, 5] = 0.5
      w.vectors(step, {"moe_load": load}, rows={"moe_load": list(LAYERS)})
    if step % 20 == 0:
      w.scalars(step, {"eval/loss": 6.5 / (1 + step / 20), "eval/loss/python_stdlib": 6.4 / (1 + step / 20),
                       "eval/loss_by_pos/0_32": 6.0, "eval/retrieval/passkey": 0.5}, stream="eval")
  w.close()
  with open(os.path.join(workdir, writers.STREAM_FILES["train"]), "a") as f:
    f.write('{"step": 61, "time": 1.0, "lo')        # the row being written right now


def test_report_renders_every_panel(tmp_path):
  workdir = str(tmp_path / "run")
  write_run(workdir)
  assert report.main(["report", f"--workdir={workdir}"]) == 0
  out = os.path.join(workdir, "report")
  with open(os.path.join(out, "index.html"), encoding="utf-8") as f:
    page = f.read()
  for pid, title in report.PANELS:
    assert f'<section id="{pid}"><h2>' in page and title.replace("&", "&amp;") in page
    assert f'<img src="{pid}.png"' in page, pid
    with open(os.path.join(out, f"{pid}.png"), "rb") as f:
      assert f.read(8) == PNG, pid
  assert report.NOT_RECORDED not in page
  assert "4.00× its layer&#x27;s mean (layer 4)" in page     # computed from the last vectors row
  assert "6 recorded steps" in page                          # vectors rows of steps 10 .. 60
  assert "<td>last step</td><td>60</td>" in page             # the cut-off row 61 is not read


def test_report_of_a_run_that_recorded_little(tmp_path):
  workdir = tmp_path / "old"
  workdir.mkdir()
  with open(workdir / "metrics.jsonl", "w") as f:   # a loop's rows without the writers: no time,
    for step in range(1, 6):                          # stage labels, eval rows in the same file
      f.write(json.dumps({"step": step, "stage": "pretrain", "loss": 5.0 - step, "grad_norm": 1.0}) + "\n")
    f.write(json.dumps({"step": 5, "stage": "pretrain", "eval": True, "eval/loss": 2.5}) + "\n")
  out = tmp_path / "page"
  assert report.main(["report", f"--workdir={workdir}", f"--out={out}"]) == 0
  page = (out / "index.html").read_text(encoding="utf-8")
  drawn = {"loss", "grad_norm"}
  for pid, _ in report.PANELS:
    assert (f'<img src="{pid}.png"' in page) == (pid in drawn), pid
    assert os.path.exists(out / f"{pid}.png") == (pid in drawn), pid
  assert page.count(f'<p class="missing">{report.NOT_RECORDED}') == len(report.PANELS) - len(drawn)
  assert "<td>last step</td><td>5</td>" in page and "<td>eval loss</td><td>2.5000</td>" in page


@pytest.mark.parametrize("args", [[], ["--workdir=/nonexistent/k3run"]])
def test_report_usage_errors(args, capsys, tmp_path):
  assert report.main(["report", *args]) == 2
  assert "--workdir" in capsys.readouterr().err
