"""Environment parsing of `initialize_from_environment`, and launch/local.py end to end on CPU."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from k3train.parallel import distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Recorder:
  """Stands in for jax.distributed.initialize and jax.config.update."""

  def __init__(self):
    self.init_calls, self.config, self.gloo = [], {}, []

  def initialize(self, **kwargs):
    self.init_calls.append(kwargs)

  def update(self, key, value):
    self.config[key] = value

  def use_gloo_address(self, address):
    self.gloo.append(dict(address))


def run(env):
  rec = Recorder()
  desc = dist.initialize_from_environment(env, initialize=rec.initialize, config_update=rec.update,
                                          use_gloo_address=rec.use_gloo_address)
  return rec, desc


LOCAL = {"K3TRAIN_COORDINATOR": "localhost:1234", "K3TRAIN_NUM_PROCESSES": "2",
         "K3TRAIN_PROCESS_ID": "1"}


def test_single_process_does_nothing():
  rec, desc = run({"PATH": "/bin"})
  assert rec.init_calls == [] and rec.config == {}
  assert desc == "distributed: single process"


def test_local_passes_explicit_values():
  rec, desc = run(dict(LOCAL, K3TRAIN_LOCAL_DEVICE_IDS="2,3"))
  assert rec.init_calls == [dict(coordinator_address="localhost:1234", num_processes=2,
                                 process_id=1, local_device_ids=[2, 3])]
  assert "process 1 of 2" in desc and "localhost:1234" in desc


def test_local_cpu_devices_select_gloo_before_initialize():
  rec, desc = run(dict(LOCAL, K3TRAIN_CPU_DEVICES="4"))
  assert rec.config == {"jax_num_cpu_devices": 4, "jax_cpu_collectives_implementation": "gloo"}
  assert len(rec.init_calls) == 1 and "local_device_ids" not in rec.init_calls[0]
  assert "4 CPU devices" in desc
  # Every process is on this machine: gloo binds to loopback, not to what the hostname resolves to.
  assert rec.gloo == [{"hostname": "127.0.0.1"}] and "gloo on hostname=127.0.0.1" in desc


@pytest.mark.parametrize("extra, expected", [
    ({"K3TRAIN_GLOO_INTERFACE": "eth1"}, [{"interface": "eth1"}]),
    ({"K3TRAIN_GLOO_HOSTNAME": "10.0.0.7"}, [{"hostname": "10.0.0.7"}]),
    ({"K3TRAIN_COORDINATOR": "node17:1234"}, []),          # other hosts: keep gloo's default
])
def test_gloo_address_from_environment(extra, expected):
  rec, _ = run(dict(LOCAL, K3TRAIN_CPU_DEVICES="4", **extra))
  assert rec.gloo == expected


def test_accelerator_processes_leave_gloo_alone():
  rec, _ = run(LOCAL)
  assert rec.gloo == []


@pytest.mark.parametrize("env, words", [
    ({"K3TRAIN_COORDINATOR": "localhost:1", "K3TRAIN_PROCESS_ID": "0"}, ["K3TRAIN_NUM_PROCESSES", "missing"]),
    (dict(LOCAL, K3TRAIN_PROCESS_ID="2"), ["K3TRAIN_PROCESS_ID=2", "< K3TRAIN_NUM_PROCESSES=2"]),
    (dict(LOCAL, K3TRAIN_NUM_PROCESSES="two"), ["K3TRAIN_NUM_PROCESSES='two'", "not an integer"]),
    (dict(LOCAL, K3TRAIN_COORDINATOR="localhost"), ["host:port"]),
    (dict(LOCAL, K3TRAIN_LOCAL_DEVICE_IDS="0,0"), ["distinct"]),
    (dict(LOCAL, K3TRAIN_CPU_DEVICES="0"), ["K3TRAIN_CPU_DEVICES=0", ">= 1"]),
])
def test_bad_local_environment_is_named(env, words):
  with pytest.raises(dist.DistributedSetupError) as e:
    run(env)
  for w in words:
    assert w in str(e.value)


SLURM = {"SLURM_JOB_ID": "77", "SLURM_NTASKS": "16", "SLURM_PROCID": "9", "SLURM_LOCALID": "1",
         "SLURM_STEP_NODELIST": "gpu[001-002]"}


def test_slurm_uses_auto_detection():
  rec, desc = run(SLURM)
  assert rec.init_calls == [{}]            # jax reads SLURM_* itself
  assert "slurm job 77" in desc and "task 9 of 16" in desc


def test_slurm_task_with_one_bound_gpu_uses_device_zero():
  rec, _ = run(dict(SLURM, CUDA_VISIBLE_DEVICES="5"))
  assert rec.init_calls == [{"local_device_ids": [0]}]


def test_slurm_single_task_is_single_process():
  rec, desc = run(dict(SLURM, SLURM_NTASKS="1"))
  assert rec.init_calls == [] and desc == "distributed: single process"


def test_local_variables_win_over_slurm():
  rec, desc = run(dict(SLURM, **LOCAL))
  assert rec.init_calls[0]["coordinator_address"] == "localhost:1234" and "local" in desc


@pytest.mark.parametrize("env, expect", [
    ({"K3TRAIN_TPU_POD": "1"}, True),
    ({"TPU_WORKER_HOSTNAMES": "t-0,t-1,t-2,t-3"}, True),
    ({"TPU_WORKER_HOSTNAMES": "t-0"}, False),             # single-host slice
    ({"MEGASCALE_COORDINATOR_ADDRESS": "10.0.0.2"}, True),
    ({"K3TRAIN_TPU_POD": "0"}, False),
])
def test_tpu_pod_detection(env, expect):
  rec, desc = run(env)
  assert rec.init_calls == ([{}] if expect else [])
  assert ("TPU pod" in desc) == expect


# ----------------------------------------------------------------------------- launch/local.py

PSUM = textwrap.dedent("""
    from k3train.parallel.distributed import initialize_from_environment
    print(initialize_from_environment())
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()), ("x",))
    local = np.arange(jax.local_device_count(), dtype=np.float32) + 10 * jax.process_index()
    arr = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), local)
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(arr)
    print("devices", jax.device_count(), "sum", float(total))
""")


def _launch(tmp_path, script, *launcher_args, timeout=120):
  path = tmp_path / "script.py"
  path.write_text(script)
  cmd = [sys.executable, os.path.join(ROOT, "launch", "local.py"), *launcher_args, "--",
         sys.executable, str(path)]
  return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_local_launcher_runs_a_cross_process_sum(tmp_path):
  r = _launch(tmp_path, PSUM, "--processes=2", "--cpu-devices-per-process=3")
  assert r.returncode == 0, r.stdout + r.stderr
  # 2 processes × 3 devices: process 0 holds 0,1,2 and process 1 holds 10,11,12 → 36.
  for rank in (0, 1):
    assert f"[{rank}] devices 6 sum 36.0" in r.stdout, r.stdout
    assert f"[{rank}] distributed: local, process {rank} of 2" in r.stdout


def test_local_launcher_stops_the_others_when_one_fails(tmp_path):
  script = textwrap.dedent("""
      import os, sys, time
      if os.environ["K3TRAIN_PROCESS_ID"] == "1":
          print("failing", flush=True)
          sys.exit(3)
      time.sleep(120)
  """)
  t0 = time.monotonic()
  r = _launch(tmp_path, script, "--processes=2")
  assert r.returncode == 3, r.stdout + r.stderr
  assert "[1] failing" in r.stdout and "process 1 exited with code 3" in r.stdout
  assert time.monotonic() - t0 < 60          # process 0 was stopped, not waited for
