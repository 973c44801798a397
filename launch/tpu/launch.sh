#!/bin/bash
# k3train on a Cloud TPU pod slice (e.g. v5p-4096 = 2,048 chips): one process per TPU VM host.
#
#   TPU=my-v5p ZONE=us-east5-a launch/tpu/launch.sh install        # once: code + venv on all hosts
#   TPU=my-v5p ZONE=us-east5-a WORKDIR=/mnt/shared/k3 launch/tpu/launch.sh run \
#       --config.parallel.fsdp=16 --config.parallel.expert=4 --config.parallel.sequence=2 \
#       --config.parallel.tensor=16 --config.train.global_batch_size=64
#   TPU=my-v5p ZONE=us-east5-a launch/tpu/launch.sh stop           # SIGTERM: checkpoint and exit
#
# `run` starts `python -m k3train.main` on every worker (--worker=all) with K3TRAIN_TPU_POD=1, so
# `initialize_from_environment()` calls `jax.distributed.initialize()`, which finds the other
# workers through the TPU VM metadata server (jax/_src/clusters/cloud_tpu_cluster.py). Each host
# drives its 4 chips. WORKDIR must be a directory every host sees at the same path (Filestore /
# NFS or a gcsfuse mount): checkpoints and metrics.jsonl are written with POSIX file calls.
set -euo pipefail

MODE=${1:?usage: launch.sh install|run|stop [k3train.main config overrides...]}
shift
: "${TPU:?set TPU to the TPU VM name}"
: "${ZONE:?set ZONE, e.g. us-east5-a}"
REMOTE_DIR=${REMOTE_DIR:-k3train}           # relative to each worker's home directory
CONFIG=${CONFIG:-configs/k3_full.py}
GCLOUD=(gcloud compute tpus tpu-vm)
WHERE=(--zone="$ZONE" ${PROJECT:+--project="$PROJECT"} --worker=all)

case "$MODE" in
  install)
    # The same code on every host: copy this checkout (git-tracked files) and install it.
    # The venv gets jax with libtpu; pin the versions you tested.
    tmp=$(mktemp -d)
    git -C "$(dirname "$0")/../.." archive --format=tar.gz -o "$tmp/k3train.tar.gz" HEAD
    "${GCLOUD[@]}" scp "$tmp/k3train.tar.gz" "$TPU":k3train.tar.gz "${WHERE[@]}"
    "${GCLOUD[@]}" ssh "$TPU" "${WHERE[@]}" --command "set -e; rm -rf $REMOTE_DIR; \
      mkdir -p $REMOTE_DIR; tar -xzf k3train.tar.gz -C $REMOTE_DIR; cd $REMOTE_DIR; \
      python3 -m venv .venv; .venv/bin/pip install -q -U pip; \
      .venv/bin/pip install -q -e . 'jax[tpu]'"
    rm -rf "$tmp"
    ;;
  run)
    : "${WORKDIR:?set WORKDIR to a directory shared by all hosts}"
    args=$(printf ' %q' "$@")
    # nohup + log file: the job keeps running if this ssh session drops.
    "${GCLOUD[@]}" ssh "$TPU" "${WHERE[@]}" --command "cd $REMOTE_DIR || exit 1; \
      K3TRAIN_TPU_POD=1 nohup .venv/bin/python -m k3train.main --config=$CONFIG \
      --workdir=$WORKDIR$args > \$HOME/k3train.log 2>&1 & echo \$! > \$HOME/k3train.pid; \
      echo \"\$(hostname): started pid \$(cat \$HOME/k3train.pid), log in ~/k3train.log\""
    ;;
  stop)
    # The pid that `run` recorded on each host; k3train saves a checkpoint on SIGTERM.
    "${GCLOUD[@]}" ssh "$TPU" "${WHERE[@]}" --command \
      "test -f \$HOME/k3train.pid && kill -TERM \$(cat \$HOME/k3train.pid) || true"
    ;;
  *)
    echo "unknown mode $MODE (install | run | stop)" >&2
    exit 2
    ;;
esac
