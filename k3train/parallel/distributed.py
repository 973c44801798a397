"""Multi-process start-up: call `jax.distributed.initialize` the way the environment asks for.

`initialize_from_environment()` must run before anything touches a JAX backend (before the first
`jax.devices()`, array or jit). It picks one of four cases, in this order:

  local     K3TRAIN_COORDINATOR, K3TRAIN_NUM_PROCESSES and K3TRAIN_PROCESS_ID are set (by
            `launch/local.py`, or by hand on machines without a cluster manager): initialize
            with exactly these values. Optional: K3TRAIN_LOCAL_DEVICE_IDS="0,1" limits the
            process to those local accelerators; K3TRAIN_CPU_DEVICES=N gives the process N CPU
            devices and selects the gloo CPU collectives (multi-process runs on CPU). Gloo binds
            to K3TRAIN_GLOO_HOSTNAME (an address) or K3TRAIN_GLOO_INTERFACE (e.g. lo); when
            neither is set and the coordinator is on this machine it binds to 127.0.0.1, because
            gloo's default (the address the machine's hostname resolves to) may not be
            reachable from the machine itself in containers and CI sandboxes.
  slurm     SLURM_JOB_ID is set and SLURM_NTASKS > 1: `jax.distributed.initialize()` without
            arguments. jax's own SLURM detection (jax/_src/clusters/slurm_cluster.py, jax 0.10.2)
            reads SLURM_JOB_ID, SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID and SLURM_LOCALID:
            the coordinator is the first host of SLURM_STEP_NODELIST on port
            65535 - 4095 + SLURM_JOB_ID % 4096 (JAX_COORDINATOR_PORT overrides the port), and each
            process sees only local device SLURM_LOCALID, i.e. one task per GPU. When slurm hands
            each task a single GPU (CUDA_VISIBLE_DEVICES of one entry, e.g. --gpus-per-task=1),
            that GPU is device 0 of the task, so we pass local_device_ids=[0] explicitly.
  tpu_pod   a multi-host TPU slice: K3TRAIN_TPU_POD=1 (set by launch/tpu/launch.sh), or
            TPU_WORKER_HOSTNAMES / TPU_PROCESS_ADDRESSES listing several hosts (GKE), or
            MEGASCALE_COORDINATOR_ADDRESS (multislice). `jax.distributed.initialize()` then finds
            the workers itself (jax/_src/clusters/cloud_tpu_cluster.py): on a Cloud TPU VM from the
            metadata server (agent-worker-number, worker-network-endpoints), on GKE from
            TPU_WORKER_ID and TPU_WORKER_HOSTNAMES / TPU_PROCESS_ADDRESSES, and for multislice
            from MEGASCALE_COORDINATOR_ADDRESS, MEGASCALE_NUM_SLICES and MEGASCALE_SLICE_ID.
  single    none of the above: nothing to do (one process sees all local devices).

The environment is passed in (default os.environ) and `initialize` / `config_update` can be
replaced, so the parsing is testable without starting a coordinator.
"""

from __future__ import annotations

import os
from typing import Callable, Mapping, Sequence

ENV_COORDINATOR = "K3TRAIN_COORDINATOR"
ENV_NUM_PROCESSES = "K3TRAIN_NUM_PROCESSES"
ENV_PROCESS_ID = "K3TRAIN_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "K3TRAIN_LOCAL_DEVICE_IDS"
ENV_CPU_DEVICES = "K3TRAIN_CPU_DEVICES"
ENV_TPU_POD = "K3TRAIN_TPU_POD"
ENV_GLOO_HOSTNAME = "K3TRAIN_GLOO_HOSTNAME"
ENV_GLOO_INTERFACE = "K3TRAIN_GLOO_INTERFACE"
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1", "[::1]")
LOCAL_KEYS = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)


class DistributedSetupError(ValueError):
  """The K3TRAIN_* / SLURM environment is incomplete or malformed."""


def _int(env: Mapping[str, str], key: str, minimum: int) -> int:
  raw = env[key]
  try:
    value = int(raw)
  except ValueError:
    raise DistributedSetupError(f"{key}={raw!r} is not an integer") from None
  if value < minimum:
    raise DistributedSetupError(f"{key}={value} must be >= {minimum}")
  return value


def _device_ids(env: Mapping[str, str]) -> list[int] | None:
  raw = env.get(ENV_LOCAL_DEVICE_IDS, "").strip()
  if not raw:
    return None
  try:
    ids = [int(x) for x in raw.split(",")]
  except ValueError:
    raise DistributedSetupError(f"{ENV_LOCAL_DEVICE_IDS}={raw!r} must be comma-separated "
                                "integers, e.g. 0,1,2,3") from None
  if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
    raise DistributedSetupError(f"{ENV_LOCAL_DEVICE_IDS}={raw!r} must list distinct ids >= 0")
  return ids


def detect(env: Mapping[str, str] | None = None) -> tuple[str, dict]:
  """(mode, keyword arguments for jax.distributed.initialize) without side effects.

  mode is one of "local", "slurm", "tpu_pod", "single".
  """
  env = os.environ if env is None else env
  present = [k for k in LOCAL_KEYS if env.get(k)]
  if present:
    missing = [k for k in LOCAL_KEYS if not env.get(k)]
    if missing:
      raise DistributedSetupError(f"{', '.join(present)} set but {', '.join(missing)} missing; "
                                  f"a local multi-process run needs all of {', '.join(LOCAL_KEYS)}")
    coordinator = env[ENV_COORDINATOR]
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit():
      raise DistributedSetupError(f"{ENV_COORDINATOR}={coordinator!r} must be host:port")
    num = _int(env, ENV_NUM_PROCESSES, 1)
    pid = _int(env, ENV_PROCESS_ID, 0)
    if pid >= num:
      raise DistributedSetupError(f"{ENV_PROCESS_ID}={pid} must be < {ENV_NUM_PROCESSES}={num}")
    kwargs = dict(coordinator_address=coordinator, num_processes=num, process_id=pid)
    ids = _device_ids(env)
    if ids is not None:
      kwargs["local_device_ids"] = ids
    return "local", kwargs
  if env.get("SLURM_JOB_ID") and env.get("SLURM_NTASKS") and _int(env, "SLURM_NTASKS", 1) > 1:
    kwargs = {}
    ids = _device_ids(env)
    visible = [v for v in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if ids is not None:
      kwargs["local_device_ids"] = ids
    elif len(visible) == 1:
      kwargs["local_device_ids"] = [0]   # slurm bound one GPU to this task; it is device 0 here
    return "slurm", kwargs
  hosts = env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES") or ""
  if (env.get(ENV_TPU_POD, "") not in ("", "0") or len([h for h in hosts.split(",") if h]) > 1
      or env.get("MEGASCALE_COORDINATOR_ADDRESS")):
    return "tpu_pod", {}
  return "single", {}


def _cpu_devices(env: Mapping[str, str]) -> int | None:
  if not env.get(ENV_CPU_DEVICES):
    return None
  return _int(env, ENV_CPU_DEVICES, 1)


def gloo_address(env: Mapping[str, str], mode: str, kwargs: Mapping) -> dict:
  """Keyword arguments (hostname / interface) for gloo's TCP transport; {} keeps gloo's default."""
  hostname, interface = env.get(ENV_GLOO_HOSTNAME, "").strip(), env.get(ENV_GLOO_INTERFACE, "").strip()
  if hostname or interface:
    return {k: v for k, v in (("hostname", hostname), ("interface", interface)) if v}
  if mode == "local" and kwargs["coordinator_address"].rpartition(":")[0] in LOOPBACK_HOSTS:
    return {"hostname": "127.0.0.1"}      # every process is on this machine
  return {}


def _use_gloo_address(address: Mapping[str, str]) -> None:
  """Make the CPU backend (created lazily, after this) use gloo bound to `address`.

  jax (0.10.2) builds gloo collectives without a hostname or interface, so we register the CPU
  backend factory again with collectives built our way; jax's own `make_cpu_client` does the rest.
  """
  from jax._src import distributed as jax_distributed
  from jax._src import xla_bridge
  from jax._src.lib import _jax

  def make_cpu_client():
    collectives = _jax.make_gloo_tcp_collectives(
        distributed_client=jax_distributed.global_state.client, **address)
    return xla_bridge.make_cpu_client(collectives=collectives)

  xla_bridge.register_backend_factory("cpu", make_cpu_client, priority=0)


def initialize_from_environment(env: Mapping[str, str] | None = None, *,
                                initialize: Callable[..., None] | None = None,
                                config_update: Callable[[str, object], None] | None = None,
                                use_gloo_address: Callable[[Mapping[str, str]], None] | None = None
                                ) -> str:
  """Start jax's distributed runtime if the environment describes several processes.

  Returns a one-line description for the log, e.g. "distributed: local, process 1 of 2,
  coordinator localhost:41234, 4 CPU devices per process (gloo)" or "distributed: single process".
  """
  env = os.environ if env is None else env
  if initialize is None or config_update is None:
    import jax
    initialize = jax.distributed.initialize if initialize is None else initialize
    config_update = jax.config.update if config_update is None else config_update
  use_gloo_address = _use_gloo_address if use_gloo_address is None else use_gloo_address
  mode, kwargs = detect(env)
  cpu = _cpu_devices(env)
  notes = []
  if cpu is not None:
    # Both must be set before the CPU backend starts: N devices in this process, and gloo for
    # the cross-process collectives (XLA:CPU has no other implementation without MPI).
    config_update("jax_num_cpu_devices", cpu)
    config_update("jax_cpu_collectives_implementation", "gloo")
    notes.append(f"{cpu} CPU devices per process (gloo)")
  if mode == "single":
    return "distributed: single process" + (f", {notes[0]}" if notes else "")
  initialize(**kwargs)
  if cpu is not None:
    address = gloo_address(env, mode, kwargs)
    if address:
      use_gloo_address(address)
      notes.append("gloo on " + " ".join(f"{k}={v}" for k, v in address.items()))
  if mode == "local":
    desc = (f"distributed: local, process {kwargs['process_id']} of {kwargs['num_processes']}, "
            f"coordinator {kwargs['coordinator_address']}")
  elif mode == "slurm":
    desc = (f"distributed: slurm job {env['SLURM_JOB_ID']}, task {env.get('SLURM_PROCID', '?')} "
            f"of {env['SLURM_NTASKS']}")
  else:
    desc = "distributed: TPU pod (workers from the TPU environment)"
  if "local_device_ids" in kwargs:
    notes.append(f"local devices {kwargs['local_device_ids']}")
  return desc + "".join(f", {n}" for n in notes)


__all__ = ["DistributedSetupError", "detect", "gloo_address", "initialize_from_environment"]
