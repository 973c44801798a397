"""Float32 logits of a model for given token ids (scoring, parity checks).

  python -m k3train.tools.logits --hf_checkpoint=DIR --tokens=T.npy --out=L.npy
  python -m k3train.tools.logits --workdir=W --tokens=T.npy --out=L.npy [--config=FILE]

T.npy holds int token ids [B, T] (a 1-D array is one row); L.npy receives float32 logits
[B, T, V] of the full forward (one document per row). The model comes from a release
directory (`k3train.tools.hf`) or from the latest checkpoint of a run directory (its
config.py, or the config saved in the checkpoint, unless --config is given).
"""

from __future__ import annotations

import sys

from absl import flags

from k3train import cli

PROG = "python -m k3train.tools.logits"


def define_model_source(fv: flags.FlagValues) -> None:
  """--hf_checkpoint / --workdir: where a model-reading tool takes its weights (exactly one)."""
  flags.DEFINE_string("hf_checkpoint", None, "release directory (config.json + *.safetensors)",
                      flag_values=fv)
  flags.DEFINE_string("workdir", None, "k3train run directory (its latest checkpoint)",
                      flag_values=fv)


def check_model_source(fv, prog: str) -> bool:
  """True when exactly one of --hf_checkpoint and --workdir is given; else prints the error."""
  if bool(fv.hf_checkpoint) == bool(fv.workdir):
    cli.error(prog, "give exactly one of --hf_checkpoint and --workdir")
    return False
  return True


def _define(fv: flags.FlagValues) -> None:
  define_model_source(fv)
  flags.DEFINE_string("tokens", None, "input .npy of int token ids [B, T]", flag_values=fv)
  flags.DEFINE_string("out", None, "output .npy of float32 logits [B, T, V]", flag_values=fv)


def load_model(fv, cfg):
  """(model, cfg) from --hf_checkpoint or --workdir (exactly one)."""
  from k3train.tools import hf
  if fv.hf_checkpoint:
    return hf.load_release_model(fv.hf_checkpoint, cfg)
  return hf.load_workdir_model(fv.workdir, cfg)


def logits(model, tokens_bt):
  """fp32 logits [B, T, V] of the full forward."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  graphdef, state = nnx.split(model)
  forward = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x).astype(jnp.float32))
  return forward(state, jnp.asarray(tokens_bt, jnp.int32))


def main(argv=None) -> int:
  args = cli.parse(argv, PROG, define=_define, config_required=False)
  if args.exit_code is not None:
    return args.exit_code
  fv = args.flags
  if not check_model_source(fv, PROG):
    return cli.USAGE_ERROR
  for name in ("tokens", "out"):
    if not fv[name].value:
      cli.error(PROG, f"--{name} is required")
      return cli.USAGE_ERROR
  import numpy as np
  try:
    tokens = np.load(fv.tokens)
  except (OSError, ValueError) as e:
    cli.error(PROG, f"--tokens: cannot read {fv.tokens!r} ({e})")
    return cli.USAGE_ERROR
  if tokens.ndim == 1:
    tokens = tokens[None]
  if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
    cli.error(PROG, f"--tokens must hold int token ids [B, T], got {tokens.dtype} {tokens.shape}")
    return cli.USAGE_ERROR
  from k3train.config import ConfigError
  from k3train.tools.hf import HFError
  from k3train.tools.hf_files import ReleaseError
  try:
    model, cfg = load_model(fv, args.config)
  except (ConfigError, ReleaseError, HFError) as e:
    cli.error(PROG, str(e))
    return cli.USAGE_ERROR
  vocab = cfg.model.vocab_size
  if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
    cli.error(PROG, f"--tokens: ids must lie in [0, {vocab}), got [{tokens.min()}, {tokens.max()}]")
    return cli.USAGE_ERROR
  out = np.asarray(logits(model, tokens), np.float32)
  np.save(fv.out, out)
  print(f"wrote logits {out.shape} float32 to {fv.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
