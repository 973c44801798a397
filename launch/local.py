"""Run N processes of one command on this machine, as one multi-process JAX job.

  python launch/local.py --processes=2 --cpu-devices-per-process=4 -- \
      python -m k3train.main --config=configs/k3_tiny.py --workdir=/tmp/k3_2proc

Each process gets K3TRAIN_COORDINATOR (localhost and a free port), K3TRAIN_NUM_PROCESSES and
K3TRAIN_PROCESS_ID; `k3train.parallel.distributed.initialize_from_environment` turns these into
`jax.distributed.initialize(...)`. With --cpu-devices-per-process=N each process also gets
K3TRAIN_CPU_DEVICES=N and JAX_PLATFORMS=cpu (N CPU devices, gloo collectives); with
--devices-per-process=N process i gets accelerators [i·N, (i+1)·N) (K3TRAIN_LOCAL_DEVICE_IDS).

Every output line is prefixed with "[rank] ". The launcher waits for all processes; when one
fails it stops the others and exits with the first failure's code (0 when all succeed).
"""

from __future__ import annotations

import argparse
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import time


def free_port() -> int:
  """A TCP port nothing listens on right now (the OS picks it)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def child_env(base: dict, rank: int, processes: int, port: int, cpu_devices: int | None,
              devices_per_process: int | None) -> dict:
  env = dict(base)
  env.update(K3TRAIN_COORDINATOR=f"localhost:{port}", K3TRAIN_NUM_PROCESSES=str(processes),
             K3TRAIN_PROCESS_ID=str(rank))
  env["PYTHONUNBUFFERED"] = "1"          # lines appear as they are printed
  env.setdefault("PYTHONFAULTHANDLER", "1")   # an abort (a failed barrier) prints all threads' stacks
  if cpu_devices is not None:
    env["K3TRAIN_CPU_DEVICES"] = str(cpu_devices)
    env["JAX_PLATFORMS"] = "cpu"
    # An inherited --xla_force_host_platform_device_count would disagree with the count above.
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags.strip()} --xla_force_host_platform_device_count={cpu_devices}".strip()
  if devices_per_process is not None:
    first = rank * devices_per_process
    env["K3TRAIN_LOCAL_DEVICE_IDS"] = ",".join(str(first + i) for i in range(devices_per_process))
  return env


def _stop(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
  """SIGTERM the processes still running (each is its own process group), then SIGKILL."""
  for p in procs:
    if p.poll() is None:
      try:
        os.killpg(p.pid, signal.SIGTERM)
      except ProcessLookupError:
        pass
  deadline = time.monotonic() + grace_s
  for p in procs:
    try:
      p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      try:
        os.killpg(p.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
      p.wait()


def run(command: list[str], processes: int, cpu_devices: int | None = None,
        devices_per_process: int | None = None, out=None) -> int:
  """Start `processes` copies of `command`, relay their output with rank prefixes, return a code."""
  out = sys.stdout if out is None else out
  port = free_port()
  procs = []
  sel = selectors.DefaultSelector()
  try:
    for rank in range(processes):
      env = child_env(dict(os.environ), rank, processes, port, cpu_devices, devices_per_process)
      p = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           start_new_session=True)
      procs.append(p)
      sel.register(p.stdout, selectors.EVENT_READ, rank)
    first_failure = None
    partial = {rank: b"" for rank in range(processes)}
    open_streams = processes
    while open_streams:
      for key, _ in sel.select(timeout=1.0):
        rank = key.data
        chunk = os.read(key.fileobj.fileno(), 65536)
        if not chunk:                      # EOF: the process closed its output
          sel.unregister(key.fileobj)
          open_streams -= 1
          chunk = b"\n" if partial[rank] else b""
        *lines, partial[rank] = (partial[rank] + chunk).split(b"\n")
        for line in lines:
          out.write(f"[{rank}] {line.decode(errors='replace')}\n")
        out.flush()
      for rank, p in enumerate(procs):
        code = p.poll()
        if code not in (None, 0) and first_failure is None:
          first_failure = code
          out.write(f"[launch] process {rank} exited with code {code}; stopping the others\n")
          out.flush()
          _stop(procs)
    codes = [p.wait() for p in procs]
    if first_failure is not None:
      return first_failure if first_failure > 0 else 1
    bad = [c for c in codes if c != 0]
    return (bad[0] if bad[0] > 0 else 1) if bad else 0
  except KeyboardInterrupt:
    _stop(procs)
    return 130
  finally:
    _stop(procs)
    sel.close()


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  if "--" not in argv:
    print("usage: launch/local.py --processes=N [--cpu-devices-per-process=M] "
          "[--devices-per-process=K] -- COMMAND ...", file=sys.stderr)
    return 2
  split = argv.index("--")
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--processes", type=int, required=True)
  parser.add_argument("--cpu-devices-per-process", type=int, default=None)
  parser.add_argument("--devices-per-process", type=int, default=None,
                      help="accelerators per process (GPU boxes); process i gets ids [i*K, (i+1)*K)")
  args = parser.parse_args(argv[:split])
  command = argv[split + 1:]
  if not command:
    parser.error("no command after --")
  if args.processes < 1:
    parser.error("--processes must be >= 1")
  for name in ("cpu_devices_per_process", "devices_per_process"):
    value = getattr(args, name)
    if value is not None and value < 1:
      parser.error(f"--{name.replace('_', '-')} must be >= 1")
  return run(command, args.processes, args.cpu_devices_per_process, args.devices_per_process)


if __name__ == "__main__":
  sys.exit(main())
