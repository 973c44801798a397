"""The memory plan's command line (flags: `python -m k3train.tools.plan --help`).

  python -m k3train.tools.plan --config=configs/k3_full.py --devices=1024 --device_memory=139 \\
      --mesh=data=1,fsdp=-1,expert=2,sequence=1,tensor=8 --rules=full --seq_len=4096 \\
      --batch_per_device=1 --remat=full [--verbose | --json]
  python -m k3train.tools.plan --config=configs/k3_full.py --devices=4096 --device_memory=139 \\
      --seq_len=1048576 --search [--top=10] [--max_tensor=8]

`--rules`, `--seq_len`, `--remat`, `--microbatches` and the mesh default to the config
(parallel.rules, data.seq_len, model.remat_policy, train.microbatches, parallel.*), which
`--config.x=y` overrides like any other command. Exit code: 0 the plan fits (or `--search`
found meshes), 1 it does not (none found), 2 a usage, config or mesh error.

A config with a curriculum (train.use_stages) is planned stage by stage, one line each (with
`--json` one JSON line each, with `--verbose` each stage's table), unless --mesh, --seq_len,
--batch_per_device, --microbatches or --search ask for one plan of the config as given:

  python -m k3train.tools.plan --config=configs/k3_full.py --devices=4096 --device_memory=139
"""

from __future__ import annotations

import json
import sys

from absl import flags

from k3train import cli
from k3train import config as config_lib
from k3train.parallel import mesh as mesh_lib
from k3train.tools import plan

PROG = "python -m k3train.tools.plan"
DOES_NOT_FIT = 1


class _GiBParser(flags.FloatParser):
  """A size in GiB: 139, 139GiB or 139GB (GB is read as GiB)."""

  def convert(self, argument):
    if isinstance(argument, str):
      argument = argument.strip().lower().removesuffix("gib").removesuffix("gb")
    return super().convert(argument)


def define(fv: flags.FlagValues) -> None:
  flags.DEFINE_integer("devices", None, "number of devices", lower_bound=1, flag_values=fv)
  flags.DEFINE(_GiBParser(lower_bound=0.0), "device_memory", None,
               "usable memory per device in GiB (H200: 139, TPU v5p: 95)", flag_values=fv)
  flags.DEFINE_string("mesh", None, "e.g. data=1,fsdp=-1,expert=2,sequence=1,tensor=8 (axes not "
                      "named are 1); default: the config's parallel section", flag_values=fv)
  flags.DEFINE_enum("rules", None, list(config_lib.PARALLEL_RULES),
                    "rule recipe (default: parallel.rules)", flag_values=fv)
  flags.DEFINE_integer("seq_len", None, "sequence length (default: data.seq_len)", lower_bound=1,
                       flag_values=fv)
  flags.DEFINE_integer("batch_per_device", 1, "sequences per batch shard and micro-batch (global "
                       "batch = this × data·fsdp·expert × microbatches)", lower_bound=1,
                       flag_values=fv)
  flags.DEFINE_integer("microbatches", None, "gradient accumulation steps; more than 1 adds the "
                       "accumulator (default: train.microbatches)", lower_bound=1, flag_values=fv)
  flags.DEFINE_enum("remat", None, list(config_lib.REMAT_POLICIES),
                    "remat policy (default: model.remat_policy)", flag_values=fv)
  flags.DEFINE_enum("attention", "flash", ["flash", "naive"],
                    "MLA attention memory model (naive: today's [B,H,T,S] logits)", flag_values=fv)
  flags.DEFINE_float("margin", None, "share of device memory kept free for XLA and the runtime "
                     "(default: train.memory_margin)", lower_bound=0.0, upper_bound=1.0,
                     flag_values=fv)
  flags.DEFINE_float("expert_capacity", None, "plan a capacity-bounded expert exchange of c·n·k "
                     "rows instead of the dropless ep·n·k (hypothetical: not implemented in "
                     "k3train)", lower_bound=0.0, flag_values=fv)
  flags.DEFINE_bool("search", False, "list the meshes that fit", flag_values=fv)
  flags.DEFINE_integer("max_tensor", 8, "--search: largest tensor axis", lower_bound=1,
                       flag_values=fv)
  flags.DEFINE_integer("top", 10, "--search: how many meshes to print", lower_bound=1,
                       flag_values=fv)
  flags.DEFINE_bool("json", False, "one JSON line per plan instead of the table", flag_values=fv)
  flags.DEFINE_bool("verbose", False, "list every activation term", flag_values=fv)
  flags.mark_flags_as_required(["devices", "device_memory"], flag_values=fv)


def main(argv=None) -> int:
  args = cli.parse(argv, PROG, define=define)
  if args.exit_code is not None:
    return args.exit_code
  from k3train.train import builder    # the model and optimizer code, once the flags are good
  cfg, f = args.config, args.flags
  config_name = f["config"].config_filename
  rules_name = f.rules or cfg.parallel.rules
  seq_len = f.seq_len or cfg.data.seq_len
  remat = f.remat or cfg.model.remat_policy
  microbatches = f.microbatches or cfg.train.microbatches
  margin = _margin(cfg, f)
  common = dict(rules_name=rules_name, seq_len=seq_len, remat=remat, attention=f.attention,
                device_memory_gib=f.device_memory, margin=margin,
                expert_capacity=f.expert_capacity)
  single = any(f[name].present for name in ("mesh", "seq_len", "batch_per_device", "microbatches",
                                            "search"))
  if cfg.train.use_stages and not single:
    return _plan_stages(cfg, f, config_name)
  try:
    state = builder.abstract_state(cfg)
    if f.search:
      plans = plan.search(cfg, state, f.devices, max_tensor=f.max_tensor, top=f.top, **common)
      if not plans:
        print(f"no mesh with tensor <= {f.max_tensor} fits {config_name} at seq_len {seq_len} "
              f"on {f.devices} devices of {f.device_memory:g} GiB (remat={remat}, "
              f"attention={f.attention})")
        return DOES_NOT_FIT
      for p in plans:
        print(json.dumps(plan.plan_json(p)) if f.json else plan.format_plan(p, config_name))
      return 0
    requested = plan.parse_mesh(f.mesh) if f.mesh else mesh_lib.sizes_from_config(cfg.parallel)
    sizes = mesh_lib.resolve_axis_sizes(requested, f.devices)
    p = plan.make_plan(cfg, state, sizes, batch_per_device=f.batch_per_device,
                       microbatches=microbatches, **common)
  except (mesh_lib.MeshError, config_lib.ConfigError, ValueError) as e:
    cli.error(PROG, str(e))
    return cli.USAGE_ERROR
  print(json.dumps(plan.plan_json(p)) if f.json else plan.format_plan(p, config_name, f.verbose))
  return 0 if p.fits else DOES_NOT_FIT


def _margin(cfg, f) -> float:
  """--margin, else the config's train.memory_margin (the share the train loop's check keeps)."""
  return f.margin if f.margin is not None else cfg.train.memory_margin


def _plan_stages(cfg, f, config_name: str) -> int:
  """One plan per curriculum stage; exit 0 when every stage fits, 1 otherwise, 2 on an error."""
  try:
    rows = plan.stage_plans(cfg, f.devices, device_memory_gib=f.device_memory,
                            margin=_margin(cfg, f),
                            attention=f.attention, expert_capacity=f.expert_capacity)
  except (mesh_lib.MeshError, config_lib.ConfigError, ValueError) as e:
    cli.error(PROG, str(e))
    return cli.USAGE_ERROR
  if not f.json:
    print(f"plan {config_name}: {len(rows)} curriculum stages on {f.devices} devices of "
          f"{f.device_memory:g} GiB ({_margin(cfg, f):.0%} margin), attention={f.attention}")
  for stage, p in rows:
    if f.json:
      print(json.dumps(plan.stage_json(stage, p)))
    else:
      print(plan.format_stage_line(stage, p, len(rows)))
      if f.verbose and not isinstance(p, str):
        print(plan.format_plan(p, f"{config_name} stage {stage.name!r}", True))
  errors = [p for _, p in rows if isinstance(p, str)]
  if errors:
    for e in errors:
      cli.error(PROG, e)
    return cli.USAGE_ERROR
  return 0 if all(p.fits for _, p in rows) else DOES_NOT_FIT


if __name__ == "__main__":
  sys.exit(main())
