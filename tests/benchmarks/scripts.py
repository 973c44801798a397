"""Load a script of benchmarks/ as a module (they are run as files, not imported as a package)."""

from __future__ import annotations

import importlib.util
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load(name: str):
  """benchmarks/<name>.py as a fresh module."""
  path = os.path.join(REPO, "benchmarks", f"{name}.py")
  spec = importlib.util.spec_from_file_location(f"benchmark_{name}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module
