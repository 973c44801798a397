"""Held-out loss and perplexity of a run's latest checkpoint: the training loop's eval, on demand.

  python -m k3train.tools.eval --workdir=W [--config=FILE] [--config.eval.sources=SPEC,...] \
      [--batches=N]

Restores the latest intact checkpoint of W (read-only) and runs the held-out part of the loop's
evals (`k3train.train.evals.Evaluator.held_out`: the same batches and the same compiled forward
as the eval rows the loop writes to W/eval_metrics.jsonl), then prints one JSON line:

  {"workdir": W, "step": S, "loss": …, "perplexity": …, "tokens": …,
   "sources": {SPEC: {"loss": …, "perplexity": …, "tokens": …}, …},
   "loss_by_pos": {"LO_HI": …, …}}

The config is --config (with its overrides) or, without one, the config saved in the
checkpoint; a staged run evaluates with the stage that wrote the checkpoint. Its model section
must equal the checkpoint's. Eval sources are eval.sources (a training source is read on its
held-out part, any other source whole; k3train/train/evaluation.py), --batches overrides
eval.batches. The loss is the next-token loss alone (without the MTP term of a model with one).
Errors (no such workdir, no checkpoint, unknown or empty source, a different model) are one line
on stderr and exit code 2.
"""

from __future__ import annotations

import json
import math
import os
import sys

from absl import flags

from k3train import cli

PROG = "python -m k3train.tools.eval"


class EvalError(ValueError):
  """A run directory or config this tool cannot evaluate (the message names what)."""


def _define(fv: flags.FlagValues) -> None:
  flags.DEFINE_string("workdir", None, "run directory (its latest checkpoint is evaluated)",
                      flag_values=fv)
  flags.DEFINE_integer("batches", None, "held-out batches per eval source (default: "
                       "eval.batches)", flag_values=fv)


def _checkpointer(workdir: str, cfg):
  """(Checkpointer, latest intact step, that step's saved config as JSON)."""
  import orbax.checkpoint as ocp
  from k3train.train.checkpoint import Checkpointer
  directory = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(workdir):
    raise EvalError(f"--workdir {workdir!r} does not exist")
  if not os.path.isdir(directory) or not any(n.isdigit() for n in os.listdir(directory)):
    raise EvalError(f"{workdir!r} has no checkpoint to evaluate")
  ckpt = Checkpointer(directory, cfg)
  step = ckpt.latest_step()
  if step is None:
    ckpt.close()
    raise EvalError(f"{workdir!r} has no checkpoint to evaluate")
  saved = ckpt.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
  return ckpt, step, saved["config"]


def eval_config(cfg, saved: dict, step: int):
  """The config to evaluate with: `cfg` (or the saved one), at the stage that wrote `step`;
  refuses a model section that differs from the checkpoint's."""
  from k3train import config as config_lib
  from k3train.tools.hf import config_from_json
  from k3train.train import checkpoint
  if cfg is None:
    return config_lib.validate(config_from_json(saved))
  if cfg.train.use_stages:
    run_stages = config_lib.stages(cfg)
    cfg = run_stages[config_lib.stage_at(run_stages, max(step - 1, 0))].cfg
  diffs = [d for d in checkpoint.config_diffs(saved, checkpoint.config_to_json(cfg))
           if d[0].startswith("model.")]
  if diffs:
    key, was, now = diffs[0]
    raise EvalError(f"the checkpoint at step {step} holds a different model: {key} is {was!r} "
                    f"there and {now!r} in the config ({len(diffs)} keys differ)")
  return cfg


def restore(workdir: str, cfg=None):
  """(eval config, step, the run shell for `evals.Evaluator`, restored TrainState)."""
  from k3train import config as config_lib
  from k3train.tools.hf import config_from_json
  from k3train.train import builder
  from k3train.train import layout as layout_lib
  ckpt, step, saved = _checkpointer(workdir, cfg if cfg is not None else _defaults())
  try:
    cfg = eval_config(cfg, saved, step)
    ckpt.use_config(config_lib.validate(config_from_json(saved)))   # the restore checks it
    layout = layout_lib.make_layout(cfg)
    graphdef, like, shardings = builder.restore_target(ckpt.cfg, layout)
    state, _ = ckpt.restore(step, like)
  finally:
    ckpt.close()
  shell = builder.Run(cfg=cfg, layout=layout, optimizer=None, graphdef=graphdef, state=None,
                      shardings=shardings, step=None)
  return cfg, ckpt.restored_step, shell, state


def _defaults():
  from k3train import defaults
  return defaults.k3_full()


def summarise(metrics: dict, step: int, workdir: str) -> dict:
  """The JSON line of `Evaluator.held_out` metrics."""
  ppl = lambda loss: math.exp(loss) if loss < 700 else math.inf
  sources = {}
  for key, tokens in metrics.items():
    if key.startswith("eval/tokens/"):
      spec = key[len("eval/tokens/"):]
      loss = metrics.get(f"eval/loss/{spec}")
      sources[spec] = {"loss": loss, "perplexity": None if loss is None else ppl(loss),
                       "tokens": tokens}
  loss = metrics.get("eval/loss")
  return {"workdir": os.path.abspath(workdir), "step": step, "loss": loss,
          "perplexity": None if loss is None else ppl(loss), "tokens": metrics.get("eval/tokens", 0.0),
          "sources": sources,
          "loss_by_pos": {k[len("eval/loss_by_pos/"):]: v for k, v in metrics.items()
                          if k.startswith("eval/loss_by_pos/")}}


def main(argv=None) -> int:
  args = cli.parse(argv, PROG, define=_define, config_required=False)
  if args.exit_code is not None:
    return args.exit_code
  fv, cfg = args.flags, args.config
  if not fv.workdir:
    cli.error(PROG, "--workdir is required")
    return cli.USAGE_ERROR
  if fv.batches is not None and fv.batches < 1:
    cli.error(PROG, f"--batches must be >= 1, got {fv.batches}")
    return cli.USAGE_ERROR
  from k3train.config import ConfigError
  from k3train.train import evals
  from k3train.train.checkpoint import CheckpointMismatchError, NoIntactCheckpointError
  try:
    cfg, step, shell, state = restore(fv.workdir, cfg)
    if fv.batches is not None:
      cfg.eval.batches = fv.batches
    if not cfg.eval.batches:
      raise EvalError("eval.batches is 0: give --batches=N")
    metrics = evals.Evaluator(cfg, shell).held_out(state)
  except (EvalError, ConfigError, CheckpointMismatchError, NoIntactCheckpointError, ValueError,
          FileNotFoundError) as e:
    cli.error(PROG, " ".join(str(e).split()))
    return cli.USAGE_ERROR
  print(json.dumps(summarise(metrics, step, fv.workdir)), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
