"""Two processes × 4 CPU devices through `launch/local.py` and `jax.distributed`: train, save,
then restore onto a different mesh shape and continue.

Run 1: mesh fsdp=8, steps 1–3, checkpoint at 3. Run 2: mesh data=2 × fsdp=2 × expert=2 (another
sharding of every parameter and optimizer leaf), resumes at 3 and trains to 5. The parameter
fingerprint (Σ x² over all parameters) printed after run 1's save equals the one printed after
run 2's restore (relative 1e-6: only the reduction order differs), and every step's loss is
finite. A 2-layer k3_tiny (KDA + dense FFN, then MLA + MoE: every layer kind) keeps it quick.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--config.model.num_layers=2", "--config.model.mla_layers=(2,)",
         "--config.train.global_batch_size=8", "--config.checkpoint.every_steps=3"]


def launch(workdir, steps: int, mesh: list[str], cache_dir: str) -> str:
  cmd = [sys.executable, os.path.join(ROOT, "launch", "local.py"), "--processes=2",
         "--cpu-devices-per-process=4", "--", sys.executable, "-m", "k3train.main",
         "--config=configs/k3_tiny.py", f"--workdir={workdir}", f"--config.train.steps={steps}",
         f"--compilation_cache_dir={cache_dir}", *SMALL, *mesh]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200,
                        env=dict(os.environ, PYTHONPATH=ROOT))
  assert proc.returncode == 0, _failure_report(proc.stdout + proc.stderr)
  return proc.stdout


def _failure_report(log: str, lines_per_process: int = 40) -> str:
  """Each process's last lines, without native stack frames: the Python error comes first."""
  kept = [l for l in log.splitlines() if not re.match(r"\[\d+\]\s+@\s+0x", l)
          and "[Gloo] Rank" not in l]
  out = []
  for rank in sorted({m.group(1) for l in kept if (m := re.match(r"\[(\d+)\]", l))}):
    mine = [l for l in kept if l.startswith(f"[{rank}]")]
    shown = mine[-lines_per_process:]
    out += [f"--- process {rank}: last {len(shown)} lines", *shown]
  return "\n".join(out + [l for l in kept if l.startswith("[launch]")])


def fingerprint(log: str, what: str) -> float:
  match = re.search(rf"\[0\] {what}.*parameter fingerprint ([0-9.e+-]+)", log)
  assert match, log[-2000:]
  return float(match.group(1))


def test_two_processes_train_save_and_restore_on_another_mesh(tmp_path, compilation_cache_dir):
  workdir = str(tmp_path / "run")
  first = launch(workdir, 3, ["--config.parallel.fsdp=8"], compilation_cache_dir)
  assert "2 processes" in first and "fsdp=8" in first
  second = launch(workdir, 5, ["--config.parallel.data=2", "--config.parallel.fsdp=2",
                               "--config.parallel.expert=2"], compilation_cache_dir)
  assert "data=2 fsdp=2 expert=2" in second and "resumed" in second
  saved, restored = fingerprint(first, "done at step 3"), fingerprint(second, "resumed")
  assert math.isclose(saved, restored, rel_tol=1e-6), (saved, restored)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]     # process 0 writes, once per step
  assert all(math.isfinite(r["loss"]) for r in rows)
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["3", "5"]
