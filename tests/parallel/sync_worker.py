"""One process of the two-process `sync` test (run through launch/local.py).

Process 1 starts its first collective `delay_s` seconds after process 0, as a process that
compiles slower would. With --wrap the jitted sum goes through `sync.CompiledTogether`; without
it, process 0 meets gloo's 30 s context timeout when delay_s exceeds it.
"""

import sys
import time

from k3train.parallel import distributed, sync

distributed.initialize_from_environment()

import jax                                          # noqa: E402  (after the distributed start)
import jax.numpy as jnp                             # noqa: E402
import numpy as np                                  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P   # noqa: E402

delay_s, wrap = float(sys.argv[1]), "--wrap" in sys.argv
mesh = Mesh(np.array(jax.devices()), ("d",))
rows = np.arange(jax.local_device_count(), dtype=np.float32) + 100 * jax.process_index()
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), rows)
total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))
if wrap:
  total = sync.CompiledTogether(total, "sum")
if jax.process_index() == 1:
  time.sleep(delay_s)
print(f"sum {float(total(x)):.1f}", flush=True)
print(f"sum again {float(total(x + 1)):.1f}", flush=True)
sync.wait_for_every_process("end")
