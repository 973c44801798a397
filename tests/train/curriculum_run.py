"""k3_tiny through a three-stage curriculum on 4 CPU devices (run as a script).

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/train/curriculum_run.py WORKDIR

Stages: 128 → 256 → 512 tokens, global batch 4 → 2 → 1 (512 tokens per step throughout), mesh
sequence 1 → 2 → 4 (fsdp fills the rest), two steps each, learning rate stable → decay → low,
evals at every stage's end. Rerunning with the same WORKDIR resumes. The model is k3_tiny at four
layers (a dense KDA layer, an MLA layer, one scanned [KDA, MLA] super-block: every layer kind) so
that the three stages' programs compile in about a minute each on 2 cores.

Prints the train loop's progress lines, then one JSON line {"result": ...} with the losses, the
first loss of every stage, the evals and a sha256 of every array of the final checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp

from tests.configs import k3_tiny, quick
from k3train import config as config_lib
from k3train.train import loop
from k3train.train.checkpoint import Checkpointer

STAGE_ENDS = (2, 4, 6)
SEQUENCE = (1, 2, 4)


def config():
  cfg = quick(k3_tiny.get_config())
  cfg.train.use_stages = True
  cfg.train.steps = 1000                       # the stages end the run
  cfg.optim.warmup_steps = 1
  for stage, end, sequence in zip(cfg.train.stages, STAGE_ENDS, SEQUENCE):
    stage.until_step = end                     # as --config.train.stages[i].until_step=...
    stage.parallel.sequence = sequence
  cfg.checkpoint.every_steps = 100             # only the boundary and final checkpoints
  cfg.eval.batches = 1
  return config_lib.validate(cfg)


def main(argv):
  if os.environ.get("K3TRAIN_TEST_COMPILATION_CACHE"):
    jax.config.update("jax_compilation_cache_dir", os.environ["K3TRAIN_TEST_COMPILATION_CACHE"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
  cfg = config()
  result = loop.train(cfg, argv[1])
  ckpt = Checkpointer(os.path.join(argv[1], "checkpoints"), cfg)
  step = ckpt.latest_step()
  state = ckpt.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
  ckpt.close()
  digests = {k: hashlib.sha256(np.ascontiguousarray(np.asarray(v)).tobytes()).hexdigest()
             for k, v in state.items()}
  print(json.dumps({"result": {"start_step": result.start_step, "end_step": result.end_step,
                               "losses": result.losses, "first": result.stage_first_losses,
                               "evals": result.evals, "fingerprint": result.fingerprint,
                               "checkpoint_step": step, "digests": digests}}), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
