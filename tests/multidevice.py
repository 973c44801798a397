"""Runs a test script in a subprocess with N host-platform CPU devices (a pytest process has one)
and returns the JSON lines it printed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import CACHE_DIR, xla_flags


def run_json_lines(script: str, devices: int, args=(), timeout: int = 1800):
  """(completed process, [the dicts of stdout's lines that start with '{']) of
  `python script *args` with `devices` CPU devices and this run's compilation cache."""
  env = dict(os.environ, XLA_FLAGS=xla_flags(f"--xla_force_host_platform_device_count={devices}"),
             K3TRAIN_TEST_COMPILATION_CACHE=CACHE_DIR, PYTHONPATH=os.getcwd())
  proc = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, env=env,
                        timeout=timeout)
  return proc, [json.loads(l) for l in proc.stdout.splitlines() if l.startswith("{")]
