"""`sync`: a process that reaches the first collective long after the others (a slow compile)
no longer kills the run.

Two processes × 4 CPU devices; process 1 starts 40 s late, past gloo's 30 s context timeout
(without `CompiledTogether` process 0 fails with "Gloo context initialization failed"). Both
must print the global sum, which needs a collective across the processes.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax

from k3train.parallel import sync

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_single_process_is_a_pass_through():
  calls = []

  def jitted(x):
    calls.append(x)
    return 2 * x

  assert jax.process_count() == 1
  assert sync.CompiledTogether(jitted, "double")(3) == 6 and calls == [3]
  sync.wait_for_every_process("nothing to wait for")


def test_a_late_process_is_waited_for():
  cmd = [sys.executable, os.path.join(ROOT, "launch", "local.py"), "--processes=2",
         "--cpu-devices-per-process=4", "--", sys.executable,
         os.path.join(ROOT, "tests", "parallel", "sync_worker.py"), "40", "--wrap"]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                        env=dict(os.environ, PYTHONPATH=ROOT))
  out = proc.stdout + proc.stderr
  assert proc.returncode == 0, out[-4000:]
  # Rows 0..3 on process 0 and 100..103 on process 1: 6 + 406; then +1 on each of 8 rows.
  for rank in (0, 1):
    assert f"[{rank}] sum 412.0" in out and f"[{rank}] sum again 420.0" in out, out[-4000:]
