"""One command-line style for every k3train entry point: absl flags, `--config=FILE` and
`--config.x=y` overrides (ml_collections config flags), plus the command's own flags.

    args = cli.parse(argv, "python -m k3train.tools.count_params")
    if args.exit_code is not None:
      return args.exit_code
    args.config, args.flags.devices, ...

`define(fv)` adds the command's own flags (`flags.DEFINE_integer(..., flag_values=fv)`). Each call
parses into its own `FlagValues`, so a command's `main(argv)` can be called from tests. Errors in
flags or in the config are one line on stderr naming the flag or config key, and exit_code is 2;
`--help` prints the flags and exit_code is 0.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Callable

from absl import flags
from ml_collections import config_flags

from k3train import config as config_lib

USAGE_ERROR = 2


def error(prog: str, message: str) -> None:
  """One line on stderr, prefixed with the command."""
  print(f"{prog}: error: {message}", file=sys.stderr, flush=True)


@dataclasses.dataclass
class Args:
  config: Any                    # the validated ConfigDict, or None
  flags: flags.FlagValues
  exit_code: int | None = None   # set when the command should stop now (help or an error)


def parse(argv, prog: str, *, define: Callable[[flags.FlagValues], None] | None = None,
          config_required: bool = True, validate: bool = True) -> Args:
  """Parses argv (argv[0] is the program name, as in sys.argv; None: sys.argv)."""
  argv = list(sys.argv if argv is None else argv)
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "config file, e.g. configs/k3_tiny.py; "
                                  "override any key with --config.section.key=value",
                                  flag_values=fv, lock_config=True, sys_argv=argv)
  if define is not None:
    define(fv)
  if any(a in ("--help", "-h", "--helpfull") for a in argv[1:]):
    print(f"usage: {prog} [flags]\n{fv.get_help()}")
    return Args(None, fv, 0)
  path = _config_path(argv)
  if path is not None and not os.path.isfile(path):
    error(prog, f"config file {path!r} does not exist")
    return Args(None, fv, USAGE_ERROR)
  try:
    rest = fv(argv)
  except (flags.Error, config_lib.ConfigError) as e:
    error(prog, _flag_message(e))
    return Args(None, fv, USAGE_ERROR)
  except (AttributeError, KeyError) as e:   # --config.x=y with a key the config does not have
    key = str(e.args[0]).strip("'\"") if e.args else "?"
    error(prog, f"unknown config key {key!r} in {_overrides(argv, key)}; see k3train/defaults.py "
          "for every key")
    return Args(None, fv, USAGE_ERROR)
  except (OSError, TypeError, ValueError) as e:
    error(prog, f"bad config: {_flag_message(e)}")
    return Args(None, fv, USAGE_ERROR)
  if len(rest) > 1:
    error(prog, f"unexpected arguments {rest[1:]}")
    return Args(None, fv, USAGE_ERROR)
  cfg = fv.config
  if cfg is None:
    if config_required:
      error(prog, "--config=FILE is required")
      return Args(None, fv, USAGE_ERROR)
    return Args(None, fv)
  if validate:
    try:
      cfg = config_lib.validate(cfg)
    except config_lib.ConfigError as e:
      error(prog, f"config error: {e}")
      return Args(None, fv, USAGE_ERROR)
  return Args(cfg, fv)


def _config_path(argv) -> str | None:
  for i, a in enumerate(argv[1:], start=1):
    if a.startswith("--config="):
      return a.split("=", 1)[1]
    if a == "--config" and i + 1 < len(argv):
      return argv[i + 1]
  return None


def _overrides(argv, key: str) -> str:
  """The command-line override(s) that name `key`, else all of them, else the config file."""
  given = [a for a in argv[1:] if a.startswith("--config.")]
  naming = [a for a in given if key in a.partition("=")[0].split(".")]
  return " ".join(naming or given) if given else "the config file"


def _flag_message(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  return text[0] if text else type(e).__name__
