"""Flags of the kernel benchmarks: one list of flags, parsed the k3train way wherever it can be.

    FLAGS = (Flag("shapes", "list", ["2x8192x16"], "B×T×H to time"),
             Flag("calls", "int", 5, "traced calls"))
    args = _flags.parse(argv, PROG, FLAGS)
    if args.exit_code is not None:
      return args.exit_code
    args.flags.shapes, args.flags.calls, args.config (None without --config)

Where `k3train.cli` imports, this is `cli.parse(..., config_required=False)`: absl flags, and
`--config=FILE` with `--config.x=y` overrides. A GPU machine with only jax (and torch) installed
has no ml_collections (nor, necessarily, absl): there the same flags, with the same underscore
names and defaults, parse with argparse (`--x=v` or `--x v`; a bool as `--x`, `--nox` or
`--x=false`), and `--config` is refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

USAGE_ERROR = 2
KINDS = ("str", "int", "float", "bool", "list", "multi", "enum")   # multi: a repeatable str


@dataclasses.dataclass(frozen=True)
class Flag:
  name: str
  kind: str                  # one of KINDS
  default: Any
  help: str
  choices: tuple = ()        # the values of an "enum"


@dataclasses.dataclass
class Args:
  flags: Any                 # absl FlagValues or argparse Namespace; read the flags as attributes
  config: Any = None         # the validated ConfigDict with --config, else None
  given: frozenset = frozenset()   # names of the flags set on the command line
  exit_code: int | None = None     # set when the command should stop now (help or an error)


def error(prog: str, message: str) -> None:
  print(f"{prog}: error: {message}", file=sys.stderr, flush=True)


def parse(argv, prog: str, specs) -> Args:
  """Parses argv (argv[0] is the program name, as in sys.argv; None: sys.argv)."""
  argv = list(sys.argv if argv is None else argv)
  try:
    from k3train import cli
  except ImportError as e:
    return _parse_argparse(argv, prog, specs, e)
  args = cli.parse(argv, prog, define=lambda fv: _define_absl(fv, prog, specs),
                   config_required=False)
  if args.exit_code is not None:
    return Args(None, exit_code=args.exit_code)
  given = frozenset(f.name for f in specs if args.flags[f.name].present)
  return Args(args.flags, args.config, given)


def _define_absl(fv, prog: str, specs) -> None:
  from absl import flags
  define = dict(str=flags.DEFINE_string, int=flags.DEFINE_integer, float=flags.DEFINE_float,
                bool=flags.DEFINE_bool, list=flags.DEFINE_list, multi=flags.DEFINE_multi_string)
  for f in specs:
    if f.kind == "enum":
      flags.DEFINE_enum(f.name, f.default, list(f.choices), f.help, flag_values=fv,
                        module_name=prog)
    else:
      define[f.kind](f.name, f.default, f.help, flag_values=fv, module_name=prog)


def _parse_argparse(argv, prog: str, specs, missing: ImportError) -> Args:
  if any(a == "--config" or a.startswith(("--config=", "--config.")) for a in argv[1:]):
    error(prog, f"--config needs k3train's dependencies, which do not import here ({missing})")
    return Args(None, exit_code=USAGE_ERROR)
  ap = argparse.ArgumentParser(prog=prog, allow_abbrev=False,
                               formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                               description=f"(no --config here: {missing})")
  for f in specs:
    opt = f"--{f.name}"
    if f.kind == "bool":
      ap.add_argument(opt, nargs="?", const=True, default=f.default, type=_bool, help=f.help)
      ap.add_argument(f"--no{f.name}", dest=f.name, action="store_false", help=argparse.SUPPRESS)
    elif f.kind == "multi":
      ap.add_argument(opt, action="append", default=list(f.default), help=f.help)
    elif f.kind == "enum":
      ap.add_argument(opt, choices=f.choices, default=f.default, help=f.help)
    else:
      kind = dict(str=str, int=int, float=float, list=_list)[f.kind]
      ap.add_argument(opt, type=kind, default=f.default, help=f.help)
  try:
    values = ap.parse_args(argv[1:])
  except SystemExit as e:   # --help (0) or a bad flag (2); argparse has printed why
    return Args(None, exit_code=e.code if isinstance(e.code, int) else USAGE_ERROR)
  given = frozenset(f.name for f in specs for a in argv[1:]
                    if a.split("=", 1)[0] in (f"--{f.name}", f"--no{f.name}"))
  return Args(values, None, given)


def _bool(text: str) -> bool:
  if text.lower() in ("true", "t", "1"):
    return True
  if text.lower() in ("false", "f", "0"):
    return False
  raise argparse.ArgumentTypeError(f"not a bool: {text!r}")


def _list(text: str) -> list[str]:
  """A comma-separated list, as absl's DEFINE_list reads it ("" is the empty list)."""
  return [item.strip() for item in text.split(",")] if text.strip() else []


def kernel_settings(texts, settings_type) -> list[tuple[str, Any]]:
  """[(text, settings_type(*fields))] for `--kernel_settings` entries such as "4:2048:8:3": the
  colon-separated integer fields of a Pallas backend's launch Settings, in its field order."""
  out = []
  for text in texts:
    try:
      fields = [int(x) for x in text.split(":")]
    except ValueError:
      raise ValueError(f"--kernel_settings: {text!r} is not colon-separated integers") from None
    out.append((text, settings_type(*fields)))
  return out


def kernel_paths(texts, settings_type) -> dict:
  """The paths a kernel benchmark times, name → (backend, launch settings or None): "xla",
  "pallas_gpu" at its default settings, and "pallas_gpu[text]" for each `kernel_settings` entry."""
  paths = {"xla": ("xla", None), "pallas_gpu": ("pallas_gpu", None)}
  for text, settings in kernel_settings(texts, settings_type):
    paths[f"pallas_gpu[{text}]"] = ("pallas_gpu", settings)
  return paths
