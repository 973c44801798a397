"""Entry point: flags → config → model and data → train loop (fresh or resumed from --workdir).

  python -m k3train.main --config=configs/k3_tiny.py --workdir=/tmp/k3_tiny
  python -m k3train.main --config=configs/k3_tiny.py --workdir=/tmp/k3_tiny --config.train.steps=10

Re-running with the same --workdir resumes from its latest checkpoint.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from k3train import config as config_lib

_CACHE_DIR = flags.DEFINE_string(
    "compilation_cache_dir", os.path.join(os.path.expanduser("~"), ".cache", "k3train", "xla"),
    "Persistent XLA compilation cache (resumes and repeated runs skip compilation); '' disables it")


def enable_compilation_cache(path: str) -> None:
  """Caches compiled executables on disk so a resumed run does not compile the step again."""
  if not path:
    return
  import jax
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)

_CONFIG = config_flags.DEFINE_config_file("config", None, "Python config file, e.g. configs/k3_tiny.py",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints and metrics.jsonl go (resumes from it)")
_STOP_AT = flags.DEFINE_integer("stop_at_step", None,
                                "Stop (with a checkpoint) after this step, as if interrupted")


def main(argv) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _CONFIG.value is None or _WORKDIR.value is None:
    raise app.UsageError("both --config and --workdir are required")
  try:
    cfg = config_lib.validate(_CONFIG.value)
  except config_lib.ConfigError as e:
    print(f"config error: {e}", file=sys.stderr)
    return 2
  from k3train.parallel import distributed
  try:
    description = distributed.initialize_from_environment()  # before any JAX computation
  except distributed.DistributedSetupError as e:
    print(f"distributed set-up error: {e}", file=sys.stderr)
    return 2
  enable_compilation_cache(_CACHE_DIR.value)
  import jax
  if jax.process_index() == 0:
    print(description, flush=True)
  logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
  from k3train.train import loop  # heavy imports after flag parsing
  try:
    loop.train(cfg, _WORKDIR.value, stop_at_step=_STOP_AT.value)
  except loop.NonFiniteLossError as e:
    print(f"error: {e}", file=sys.stderr)
    return 3
  return 0


if __name__ == "__main__":
  app.run(main)
