"""Metric writers: TensorBoard scalars equal the JSONL rows (read back from the event files' own
records), a resumed run writes every step once without losing rows, vectors round-trip, only
process 0 writes, W&B gets the same rows, and progress lines are never silent. And two metrics
the train step hands them: per-group gradient norms (they split the global norm) and per-layer
expert loads (rows in layer order)."""

import glob
import json
import math
import os
import struct
import sys
import threading
import types

import numpy as np
import pytest

from k3train.train import writers

ROWS = 30


def tensorboard_events(logdir):
  """Every event in the directory's event files, parsed from the TFRecord framing
  (u64 length, u32 crc, payload, u32 crc) with TensorBoard's Event protobuf."""
  from tensorboardX.proto import event_pb2
  events = []
  for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
    with open(path, "rb") as f:
      data = f.read()
    pos = 0
    while pos < len(data):
      (length,) = struct.unpack("<Q", data[pos:pos + 8])
      payload = data[pos + 12:pos + 12 + length]
      assert len(payload) == length, f"{path}: truncated record at byte {pos}"
      events.append(event_pb2.Event.FromString(payload))
      pos += 12 + length + 4
  return events


def tb_scalars(logdir):
  """{(tag, step): (value, wall time)} of every scalar; a tag written twice at one step fails."""
  out = {}
  for e in tensorboard_events(logdir):
    for v in e.summary.value:
      if v.WhichOneof("value") == "simple_value":
        key = (v.tag, e.step)
        assert key not in out, f"scalar {key} written twice"
        out[key] = (v.simple_value, e.wall_time)
  return out


def jsonl_scalars(workdir):
  """{(TensorBoard tag of the key, step): (value, time)} of every recorded JSONL scalar."""
  out = {}
  for stream in ("train", "eval"):
    for row in writers.read_rows(os.path.join(workdir, writers.STREAM_FILES[stream])):
      for k, v in row.items():
        if k not in ("step", "time") and not isinstance(v, str) and math.isfinite(v):
          out[(writers.tensorboard_tag(k), row["step"])] = (v, row["time"])
  return out


def fake_run_rows(step, scale=1.0):
  rng = np.random.default_rng(step)
  return {"stage": "pretrain_4k", "loss": scale * (4.0 / step + rng.random()),
          "lr": 3e-3 * min(1.0, step / 10),
          "grad_norm": float(rng.lognormal()), "grad_norm/kda": float(rng.random()),
          "mla_max_logit/stack.layers.3[1]": float(rng.random()),
          "tokens_per_s": math.nan if step == 1 else 1000.0 + step, "mfu": 1e-3 * step,
          "data/errors/python_stdlib/bad_record": float(step // 7)}


def test_tensorboard_scalars_equal_jsonl_rows(tmp_path):
  w = writers.open_writers(str(tmp_path), {"tensorboard": True, "vectors_every": 10})
  for step in range(1, ROWS + 1):
    assert w.scalars(step, fake_run_rows(step))
    if step % 10 == 0:
      w.scalars(step, {"eval/loss": 3.0 - step / 100, "eval/loss/python_stdlib": 3.1}, stream="eval")
    if w.wants_vectors(step):
      w.vectors(step, {"moe_load": np.full((3, 4), 0.25)}, rows={"moe_load": [2, 3, 4]})
  w.close()
  expected, got = jsonl_scalars(str(tmp_path)), tb_scalars(str(tmp_path / writers.TENSORBOARD_DIR))
  assert set(got) == set(expected)          # same (tag, step) pairs: null values left out of both
  assert ("tokens_per_s", 1) not in got and ("stage", 1) not in got   # null and label: JSONL only
  assert writers.read_rows(str(tmp_path / "metrics.jsonl"))[0]["stage"] == "pretrain_4k"
  for key, (value, t) in expected.items():
    # TensorBoard stores float32 scalars: exactly the float32 rounding of the JSONL value, and
    # the JSONL row's wall time (a float64 in the event) to the microsecond.
    assert got[key][0] == np.float32(value), key
    assert abs(got[key][1] - t) < 1e-6, key
  assert len(expected) == ROWS * 8 - 1 + 3 * 2
  assert ("mla_max_logit/stack.layers.3_1_", 5) in got
  tags = {v.tag for e in tensorboard_events(str(tmp_path / writers.TENSORBOARD_DIR)) for v in e.summary.value}
  assert {"moe_load/2", "moe_load/3", "moe_load/4", "moe_load/heatmap"} <= tags


def test_resumed_run_writes_each_step_once_and_keeps_written_rows(tmp_path):
  workdir = str(tmp_path)
  first = writers.open_writers(workdir, {"tensorboard": True})
  for step in range(1, 8):
    first.scalars(step, fake_run_rows(step))
  first.close()
  metrics = os.path.join(workdir, writers.STREAM_FILES["train"])
  with open(metrics, "a") as f:
    f.write('{"step": 8, "time": 1.0, "loss": 0.')          # a crash in mid-row
  assert writers.last_step(metrics) == 7
  # Resume from a checkpoint at step 5: steps 6.. are replayed (with other values here).
  second = writers.open_writers(workdir, {"tensorboard": True})
  written = [step for step in range(6, 13) if second.scalars(step, fake_run_rows(step, scale=2.0))]
  second.close()
  assert written == list(range(8, 13)) and second.dropped["train"] == 2
  rows = writers.read_rows(metrics)
  assert [r["step"] for r in rows] == list(range(1, 13))
  for r in rows:   # rows 1..7 are the first run's, untouched; 8.. the resumed run's
    assert r["loss"] == fake_run_rows(r["step"], scale=1.0 if r["step"] <= 7 else 2.0)["loss"]
  with open(metrics, "rb") as f:
    assert f.read().endswith(b"\n")
  expected, got = jsonl_scalars(workdir), tb_scalars(os.path.join(workdir, writers.TENSORBOARD_DIR))
  assert set(got) == set(expected)
  assert all(got[k][0] == np.float32(v) for k, (v, _) in expected.items())


def test_vectors_round_trip_and_cadence(tmp_path):
  rng = np.random.default_rng(0)
  w = writers.open_writers(str(tmp_path), {"tensorboard": False, "vectors_every": 5})
  assert [s for s in range(1, 16) if w.wants_vectors(s)] == [5, 10, 15]
  big = rng.random((4, 20_000))            # a row far longer than the tail-read chunk
  small = rng.dirichlet(np.ones(8), size=3)
  small[1, 2] = math.nan
  assert w.vectors(5, {"moe_load": small}, rows={"moe_load": [2, 3, 4]})
  assert w.vectors(10, {"big": big})
  assert not w.vectors(10, {"big": big})   # once per step
  w.close()
  path = str(tmp_path / writers.STREAM_FILES["vectors"])
  assert writers.last_step(path) == 10
  rows = writers.read_vectors(path)
  assert [r["step"] for r in rows] == [5, 10]
  np.testing.assert_allclose(rows[0]["moe_load"], small, rtol=1e-5)   # 6 significant digits
  assert math.isnan(rows[0]["moe_load"][1, 2])
  assert rows[0]["rows"] == {"moe_load": [2, 3, 4]}
  np.testing.assert_allclose(rows[1]["big"], big, rtol=1e-5)
  again = writers.open_writers(str(tmp_path), {"vectors_every": 5})
  assert not again.wants_vectors(10) and again.wants_vectors(15)
  again.close()


def test_only_process_zero_writes(tmp_path):
  w = writers.open_writers(str(tmp_path / "w"), {"tensorboard": True, "vectors_every": 1},
                           process_index=1)
  assert not w.scalars(1, {"loss": 1.0}) and not w.wants_vectors(1)
  w.close()
  assert not os.path.exists(tmp_path / "w")


def test_wandb_gets_the_same_rows_and_resumes_its_run(tmp_path, monkeypatch):
  calls = []

  class Run:
    def log(self, data, step):
      calls.append(("log", step, dict(data)))

    def finish(self):
      calls.append(("finish",))

  fake = types.ModuleType("wandb")
  fake.util = types.SimpleNamespace(generate_id=lambda: "run123")
  fake.Histogram = lambda values: ("histogram", len(values))
  fake.init = lambda **kw: calls.append(("init", kw)) or Run()
  monkeypatch.setitem(sys.modules, "wandb", fake)
  cfg = {"wandb": True, "wandb_project": "proj"}
  w = writers.open_writers(str(tmp_path), cfg)
  w.scalars(1, {"loss": 2.5})
  w.vectors(1, {"moe_load": np.ones((2, 3))})
  w.close()
  fake.util = types.SimpleNamespace(generate_id=lambda: "other")
  w = writers.open_writers(str(tmp_path), cfg)
  w.scalars(1, {"loss": 9.9})                       # replayed: dropped everywhere
  w.scalars(2, {"loss": 2.0})
  w.close()
  inits = [c[1] for c in calls if c[0] == "init"]
  assert [i["id"] for i in inits] == ["run123", "run123"] and inits[0]["project"] == "proj"
  assert inits[0]["resume"] == "allow"
  logs = [(c[1], c[2]) for c in calls if c[0] == "log"]
  assert logs == [(1, {"loss": 2.5}), (1, {"moe_load": ("histogram", 6)}), (2, {"loss": 2.0})]


def test_wandb_asked_for_but_missing_says_how_to_fix(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "wandb", None)    # import wandb raises ImportError
  with pytest.raises(RuntimeError, match="pip install wandb"):
    writers.open_writers(str(tmp_path), {"wandb": True})


def test_progress_lines_begin_beat_and_end():
  lines = []
  beat = threading.Event()

  def log(msg):
    lines.append(msg)
    if "still running" in msg:
      beat.set()

  with writers.progress("compiling the train step", log, every_s=0.01):
    assert beat.wait(10.0)                 # the body waits until a heartbeat line came
  assert lines[0] == "compiling the train step …"
  assert lines[-1].startswith("compiling the train step: done in ")
  with pytest.raises(KeyError):
    with writers.progress("restoring", lines.append, every_s=60):
      raise KeyError("x")
  assert lines[-1].startswith("restoring: failed after ")


# --- what the train step hands the writers -----------------------------------------------------


def test_gradient_norm_groups_split_the_global_norm():
  """Every parameter lands in one group: the groups' squared norms sum to the global norm's
  square (fp32 sums; 1e-5 relative against a float64 sum), and representative parameters land in
  the groups the README names (an MLA and a KDA mixer share the name o_proj)."""
  import jax
  import jax.numpy as jnp
  import optax
  from k3train import config as config_lib
  from k3train.train import builder, step
  from k3train.tree_paths import path_names
  from tests.configs import CONFIG_DIR
  cfg = config_lib.validate(config_lib.load_file(CONFIG_DIR / "k3_tiny_mm.py"))   # with vision
  shapes = builder.abstract_state(cfg).params
  rng = np.random.default_rng(0)
  leaves, treedef = jax.tree.flatten(shapes)
  grads = jax.tree.unflatten(treedef, [
      jnp.asarray(rng.standard_normal(s.shape) * 10.0 ** rng.integers(-3, 2), jnp.float32)
      for s in leaves])
  total, norms = step.grad_norms(grads)
  assert set(norms) == {f"grad_norm/{g}" for g in step.GRAD_GROUPS}
  total64 = sum(float(np.sum(np.square(np.asarray(x, np.float64)))) for x in jax.tree.leaves(grads))
  groups64 = sum(float(v) ** 2 for v in norms.values())
  assert groups64 == pytest.approx(total64, rel=1e-5)
  assert groups64 == pytest.approx(float(optax.tree.norm(grads)) ** 2, rel=1e-5)
  # The step's global norm is the root of the groups' sums (one sum of squares per leaf).
  assert float(total) ** 2 == pytest.approx(total64, rel=1e-5)
  group_of = {"/".join(path_names(p)): g for (p, _), g in
              zip(jax.tree_util.tree_leaves_with_path(grads), step.grad_groups(grads))}
  expected = {
      "embed/embedding": "embeddings", "lm_head/kernel": "embeddings",
      "prefix/0/mixer/A_log": "kda", "prefix/0/mixer/o_proj/kernel": "kda",
      "prefix/3/mixer/kv_b_proj/kernel": "mla", "prefix/3/mixer/o_proj/kernel": "mla",
      "stack/layers/3/mixer/g_proj/kernel": "mla", "stack/layers/0/mixer/g_proj/kernel": "kda",
      "prefix/0/ffn/gate_proj/kernel": "dense_ffn",
      "suffix/0/ffn/router/weight": "router", "stack/layers/1/ffn/router/weight": "router",
      "suffix/0/ffn/experts/gate": "moe_experts", "suffix/0/ffn/down_proj/kernel": "moe_experts",
      "suffix/0/ffn/latent_norm/scale": "moe_experts",
      "stack/layers/2/ffn/shared/up_proj/kernel": "moe_shared",
      "vision/stack/q_proj/kernel": "vision", "vision/projector/up_proj/kernel": "vision",
      "final_norm/scale": "other", "prefix/1/attn_res/query": "other",
  }
  assert {k: group_of[k] for k in expected} == expected
  # One group's gradients alone: only that group's norm is non-zero.
  only_router = jax.tree.unflatten(treedef, [
      x if g == "router" else jnp.zeros_like(x)
      for x, g in zip(jax.tree.leaves(grads), step.grad_groups(grads))])
  alone = step.grad_norms(only_router)[1]
  assert alone["grad_norm/router"] == pytest.approx(float(norms["grad_norm/router"]), rel=1e-6)
  assert all(float(v) == 0.0 for k, v in alone.items() if k != "grad_norm/router")


def test_expert_load_rows_are_the_moe_layers_in_order():
  """`per_layer` stacks the prefix's, the scanned super-blocks' and the suffix's MoE layers in
  layer order: filled with each layer's own number (read from the layer schedule), its rows are
  the MoE layers of `config.layer_schedule(...).kinds`, which label the loop's moe_load rows."""
  import jax
  import jax.numpy as jnp
  from k3train import config as config_lib
  from k3train.model import moe
  from k3train.train import builder, loop, step
  from k3train.tree_paths import path_names
  from tests.configs import k3_tiny
  cfg = config_lib.validate(k3_tiny.get_config())
  sched = config_lib.layer_schedule(cfg.model)
  period = len(sched.period)
  rest = builder.abstract_state(cfg).rest

  def layer_number(path, shape):
    names = path_names(path)
    if names[0] == "prefix":
      return jnp.full(shape, int(names[1]), jnp.float32)
    if names[0] == "suffix":
      return jnp.full(shape, sched.suffix_start + int(names[1]), jnp.float32)
    blocks = jnp.arange(shape[0], dtype=jnp.float32)[:, None] * period
    return jnp.broadcast_to(sched.prefix + blocks + int(names[2]), shape)

  loads = jax.tree_util.tree_map_with_path(lambda p, s: layer_number(p, s.shape),
                                           rest.filter(moe.ExpertLoad))
  rows = step.per_layer(loads, moe.ExpertLoad)
  moe_layers = [i for i, (_, ffn) in enumerate(sched.kinds) if ffn == "moe"]
  assert rows.shape == (len(moe_layers), cfg.model.moe.num_experts)
  np.testing.assert_array_equal(np.asarray(rows), np.repeat(np.asarray(moe_layers, np.float32)[:, None],
                                                            cfg.model.moe.num_experts, axis=1))
  assert loop.moe_layer_numbers(cfg.model) == [i + 1 for i in moe_layers]
  assert step.per_layer(loads, moe.RouterBias) is None


def test_integer_values_stay_integers(tmp_path):
  """An int (the curriculum's seq_len label) reads back as an int, so code formatting it (bucket
  names such as "eval/loss_by_pos/64_128") sees 64, not 64.0; bools and floats become floats."""
  w = writers.open_writers(str(tmp_path), {"tensorboard": True})
  w.scalars(1, {"seq_len": 128, "rows": np.int64(4), "flag": True, "loss": 2.0, "stage": "a"})
  w.close()
  (row,) = writers.read_rows(str(tmp_path / "metrics.jsonl"))
  assert row["seq_len"] == 128 and type(row["seq_len"]) is int and type(row["rows"]) is int
  assert type(row["flag"]) is float and row["flag"] == 1.0 and row["stage"] == "a"
  assert f"{row['seq_len'] // 2}" == "64"
  got = tb_scalars(str(tmp_path / writers.TENSORBOARD_DIR))
  assert got[("seq_len", 1)][0] == 128.0 and ("stage", 1) not in got
