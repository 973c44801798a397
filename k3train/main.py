"""Entry point: flags → config → model and data → train loop (fresh or resumed from --workdir).

  python -m k3train.main --config=configs/k3_tiny.py --workdir=/tmp/k3_tiny
  python -m k3train.main --config=configs/k3_tiny.py --workdir=/tmp/k3_tiny --config.train.steps=10

Re-running with the same --workdir resumes from its latest checkpoint.
"""

from __future__ import annotations

import logging as py_logging
import os
import sys

from absl import flags

from k3train import cli
from k3train import config as config_lib

PROG = "python -m k3train.main"
STOPPED_BY_SIGNAL = 143   # 128 + SIGTERM, as a shell reports a process SIGTERM ended
DEFAULT_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "k3train", "xla")


def _define(fv: flags.FlagValues) -> None:
  flags.DEFINE_string("workdir", None, "where checkpoints and metrics.jsonl go (resumes from it)",
                      flag_values=fv)
  flags.DEFINE_integer("stop_at_step", None, "stop (with a checkpoint) after this step, as if "
                       "interrupted", flag_values=fv)
  flags.DEFINE_string("compilation_cache_dir", DEFAULT_CACHE_DIR, "persistent XLA compilation "
                      "cache (resumes and repeated runs skip compilation); '' disables it",
                      flag_values=fv)


def enable_compilation_cache(path: str) -> None:
  """Caches compiled executables on disk so a resumed run does not compile the step again."""
  if not path:
    return
  import jax
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def check_checkpoint_config(cfg, workdir: str) -> None:
  """Refuses, before anything is built or written, a workdir whose newest checkpoint was written
  with an incompatible config (checkpoint.MUST_MATCH): building a large model first would waste
  minutes before the same refusal. Raises CheckpointMismatchError or ConfigError."""
  from k3train.train import checkpoint
  run_stages = config_lib.stages(cfg)
  checkpoint.check_before_build(
      os.path.join(workdir, "checkpoints"),
      lambda step: run_stages[config_lib.stage_at(run_stages, step)].cfg)


def main(argv=None) -> int:
  args = cli.parse(argv, PROG, define=_define)
  if args.exit_code is not None:
    return args.exit_code
  cfg, fv = args.config, args.flags
  if not fv.workdir:
    cli.error(PROG, "--workdir is required")
    return cli.USAGE_ERROR
  if os.path.exists(fv.workdir) and not os.path.isdir(fv.workdir):
    cli.error(PROG, f"--workdir={fv.workdir} is a file; give a directory (new or from an earlier run)")
    return cli.USAGE_ERROR
  from k3train.data import sources as sources_lib
  for spec in cfg.data.sources:
    if spec.partition(":")[0] not in sources_lib.SOURCES:
      try:
        sources_lib.make_source(spec)
      except ValueError as e:
        cli.error(PROG, f"config error: data.sources: {e}")
        return cli.USAGE_ERROR
  from k3train.train import checkpoint
  try:
    check_checkpoint_config(cfg, fv.workdir)
  except config_lib.ConfigError as e:     # a curriculum stage that does not derive
    cli.error(PROG, "config error: " + " ".join(str(e).split()))
    return cli.USAGE_ERROR
  except checkpoint.CheckpointMismatchError as e:
    cli.error(PROG, str(e))
    return cli.USAGE_ERROR
  from k3train.parallel import distributed
  # JAX logs "Unable to initialize backend ..." (INFO) for every backend it probes and does not
  # find, e.g. TPU on a GPU host; its warnings (a GPU without a CUDA jaxlib) stay.
  py_logging.getLogger("jax._src.xla_bridge").setLevel(py_logging.WARNING)
  try:
    description = distributed.initialize_from_environment()  # before any JAX computation
  except distributed.DistributedSetupError as e:
    cli.error(PROG, f"distributed set-up error: {e}")
    return cli.USAGE_ERROR
  enable_compilation_cache(fv.compilation_cache_dir)
  import jax
  from absl import logging
  if jax.process_index() == 0:
    print(description, flush=True)
  logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
  from k3train.train import loop  # heavy imports after flag parsing
  from k3train.tools import plan

  def log(msg: str) -> None:
    if jax.process_index() == 0:
      print(msg, flush=True)

  try:
    # The memory plan refuses, before anything is built, a curriculum stage that does not fit.
    result = loop.train(cfg, fv.workdir, stop_at_step=fv.stop_at_step,
                        preflight=plan.preflight(log=log))
  except config_lib.ConfigError as e:     # a stage the devices or their memory cannot hold
    cli.error(PROG, "config error: " + " ".join(str(e).split()))
    return cli.USAGE_ERROR
  except loop.NonFiniteError as e:
    print(f"error: {e}", file=sys.stderr)
    return 3
  except checkpoint.CheckpointMismatchError as e:
    cli.error(PROG, str(e))
    return cli.USAGE_ERROR
  except (checkpoint.NoIntactCheckpointError, sources_lib.NoUsableDocumentsError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  # Exit codes: 0 finished, 143 stopped by SIGTERM / Ctrl-C after saving a checkpoint (rerun to
  # resume), 2 start-up errors, 3 non-finite values, 1 other errors.
  return STOPPED_BY_SIGNAL if result.stopped_by_signal else 0


if __name__ == "__main__":
  sys.exit(main())
