"""benchmarks/train_step.py's per-part profile: the model's named scopes reach the compiled HLO,
and `classify` puts ops of nested scopes into the part the PARTS order promises."""

from __future__ import annotations

import re

import jax
import pytest
import jax.numpy as jnp
from flax import nnx

from tests.benchmarks import scripts
from tests.conftest import xla_flags
from tests.model.test_moe import make_moe, tokens



def _script():
  return scripts.load("train_step")


def test_nested_scopes_go_to_the_outer_part():
  classify = _script().classify
  assert classify("x.py:jit(step)/while/body/moe_proj/ffn/dot_general") == "moe_proj"
  assert classify("x.py:jit(step)/transpose(jvp(ffn))/dot_general") == "ffn"
  assert classify("x.py:jit(step)/kda/norm/reduce_sum") == "kda"
  assert classify("x.py:jit(step)/checkpoint/attnres/reduce_sum") == "attnres"
  assert classify("x.py:jit(step)/optimizer/reduce_and") == "optimizer"
  assert classify("x.py:jit(step)/dynamic_update_slice") == "other"


def test_moe_projections_and_shared_experts_carry_their_scope():
  """Forward and backward of a MoE layer with a shared expert: every matmul's location (the
  op_name XLA keeps in the compiled HLO) names a part; the latent down / up projections and the
  shared expert's matmuls are `moe_proj`, not "other". Read from the lowered program (the
  persistent compilation cache would return a compiled text keyed without op names)."""
  moe = make_moe()
  x = tokens()

  def loss(moe, x):
    return jnp.sum(moe(x).astype(jnp.float32) ** 2)

  graphdef, state = nnx.split(moe)
  fn = jax.jit(lambda state, x: jax.grad(lambda s: loss(nnx.merge(graphdef, s), x))(state))
  text = fn.lower(state, x).as_text(debug_info=True)
  names = set(re.findall(r'loc\("([^"]*dot_general)"', text))
  classify = _script().classify
  parts = {name: classify(":" + name) for name in names}
  assert "other" not in parts.values(), parts
  shared = [n for n in names if "/ffn/" in n]
  assert shared and all(parts[n] == "moe_proj" for n in shared), parts
  assert {"moe_proj", "moe_gmm", "router"} <= set(parts.values()), parts


PEAK_PROGRAM = r'''
import sys
import jax, jax.numpy as jnp

def sharded_step(x, w):
  with jax.named_scope("kda"):
    y = jnp.tanh(x @ w)
  with jax.named_scope("moe_gmm"):
    return (y @ w.T) * 2.0, jnp.sin(y) @ w

x = jnp.ones((512, 512), jnp.float32)
compiled = jax.jit(sharded_step).lower(x, x).compile()
with open(sys.argv[1], "w") as f:
  f.write(compiled.as_text())
'''


def test_memory_report_reads_the_peak_from_the_live_range_dump(tmp_path):
  """`--memory_report`'s reader on a real XLA:CPU dump of a small step: the buffers live at the
  peak sum to the reported total, the two fp32 [512, 512] inputs (1 MiB each) count as
  arguments, and the step's two outputs (1 MiB each, live at its end) as the scope that made
  them."""
  import os
  import subprocess
  import sys
  dump, hlo = tmp_path / "xla", tmp_path / "hlo.txt"
  env = dict(os.environ,
             XLA_FLAGS=xla_flags(f"--xla_dump_to={dump}", "--xla_dump_hlo_module_re=sharded_step"),
             JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR="")
  subprocess.run([sys.executable, "-c", PEAK_PROGRAM, str(hlo)], check=True, env=env, timeout=300)
  script = _script()
  report = script.memory_report(str(dump), hlo.read_text())
  assert "xla_peak_error" not in report, report
  parts, mib = report["xla_peak_by_part_gib"], 1 / 1024
  total = report["xla_peak_live_gib"]
  assert abs(sum(parts.values()) - total) <= 1e-3 * total, (parts, total)   # 4-digit rounding
  assert abs(parts["arguments"] - 2 * mib) <= 1e-3 * mib, parts
  assert parts.get("moe_gmm", 0) >= 2 * mib * (1 - 1e-3), parts
  assert set(parts) <= {"arguments", "kda", "moe_gmm", "other"}, parts
  top = report["xla_peak_top"]
  assert [t["shape"] for t in top if t["part"] == "arguments"] == ["f32[512,512]"] * 2, top
  assert all(t["gib"] <= total for t in top) and len(top) == len({t["buffer"] for t in top})
  # No dump: an error naming the folder, not an exception.
  assert "xla_peak_error" in script.memory_report(str(tmp_path / "none"), "")


def test_kernels_by_part_counts_the_compiled_steps_fusions_by_scope():
  """The compiled step's kernels by part: a small two-scope program compiled by XLA:CPU has its
  tanh fusion in "kda" and its multiply fusion in "moe_gmm", and the counts add up to every
  fusion and custom call of the module."""
  def sharded_step(x, w):
    with jax.named_scope("kda"):
      y = jnp.tanh(x) * 3.0 + 1.0
    with jax.named_scope("moe_gmm"):
      return y @ w, jnp.sin(y) * w
  x = jnp.ones((64, 64), jnp.float32)
  text = jax.jit(sharded_step).lower(x, x).compile().as_text()
  counts = _script().kernels_by_part(text)
  every = len(re.findall(r"=\s*\S+\s+(?:fusion|custom-call)\(", text))
  assert sum(counts.values()) == every > 0, (counts, every)
  assert counts.get("kda", 0) >= 1 and counts.get("moe_gmm", 0) >= 1, counts


def test_kernels_are_the_launched_fusions_and_calls_tuple_shaped_ones_included():
  """`_record.kernel_names` on HLO in the form XLA:GPU prints it: a multi-output fusion and a
  cuBLAS call (tuple shapes) are kernels; the instructions inside a fused computation (a nested
  GEMM operand fusion, a kernel called by a dynamic-slice fusion) are part of their fusion's one
  kernel; a while body's kernels count."""
  from benchmarks import _record
  excerpt = "\n".join([
      "%fused_operand.1 (p0: f32[8]) -> bf16[8] {",
      "  %c.1 = bf16[8]{0} convert(%p0)",
      "}",
      "%gemm_fusion.1_computation (p0: f32[8,8], p1: bf16[8,8]) -> bf16[8,8] {",
      "  %op.1 = bf16[8,8]{1,0} fusion(%p0), kind=kCustom, calls=%fused_operand.1",
      "  ROOT %d.1 = bf16[8,8]{1,0} dot(%op.1, %p1)",
      "}",
      "%dynamic-slice-fusion.1 (p0: bf16[4,8], p1: s32[]) -> bf16[8] {",
      '  ROOT %k.2 = bf16[8]{0} custom-call(%p0), custom_call_target="mosaic_gpu_v2"',
      "}",
      "%body.1 (p: (s32[], f32[8])) -> (s32[], f32[8]) {",
      "  %loop_add_fusion.1 = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused_add.1",
      "}",
      "ENTRY %main.1 (x: f32[8,8]) -> f32[8] {",
      "  %input_reduce_fusion.1 = (f32[8]{0}, f32[8,8]{1,0}) fusion(%x), kind=kInput, "
      "calls=%fused_reduce.1",
      '  %cublas-lt-matmul.1 = (f32[8,8]{1,0}, s8[64]{0}) custom-call(%x, %x), '
      'custom_call_target="__cublas$lt$matmul"',
      "  %gemm_fusion.1 = bf16[8,8]{1,0} fusion(%x, %y), kind=kCustom, calls=%gemm_fusion.1_computation",
      "  %dynamic-slice-fusion.1 = bf16[8]{0} fusion(%y, %i), kind=kCustom, "
      "calls=%dynamic-slice-fusion.1",
      "  ROOT %w.1 = (s32[], f32[8]) while(%t), condition=%cond.1, body=%body.1",
      "}"])
  assert _record.kernel_names(excerpt) == [
      "loop_add_fusion.1", "input_reduce_fusion.1", "cublas-lt-matmul.1", "gemm_fusion.1",
      "dynamic-slice-fusion.1"]
  # Two more copies of the add fusion, which XLA marks as repeats of it: one kernel to generate.
  repeats = excerpt.replace(
      "  ROOT %w.1", "  %loop_add_fusion.2 = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused_add.2, "
      'metadata={deduplicated_name="loop_add_fusion.1"}\n'
      "  %loop_add_fusion.3 = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused_add.3, "
      'metadata={op_name="a" deduplicated_name="loop_add_fusion.1"}\n  ROOT %w.1')
  assert len(_record.kernel_names(repeats)) == 7
  assert _script().distinct_kernels(repeats) == _script().distinct_kernels(excerpt) == 5


def test_custom_calls_are_counted_by_target_inside_fusions_too():
  """`custom_calls`: a CPU compile with LAPACK custom calls counts each by its target, matching
  every custom-call instruction of the module; a call inside a fused computation counts as
  well (an HLO excerpt in the form XLA:GPU prints a dynamic-slice fusion)."""
  script = _script()
  a = jnp.eye(32, dtype=jnp.float32) * 2.0
  text = jax.jit(lambda a: jnp.linalg.cholesky(a) @ jnp.linalg.qr(a)[0]).lower(a).compile().as_text()
  counts = script.custom_calls_by_target(text)
  every = len(re.findall(r"\bcustom-call\(", text))
  assert sum(counts.values()) == every >= 2 and len(counts) >= 2, counts
  excerpt = "\n".join([
      "%dynamic-slice-fusion.1 (p0: bf16[4,8], p1: s32[]) -> bf16[4,8] {",
      '  %k.2 = bf16[8]{0} custom-call(%p0), custom_call_target="mosaic_gpu_v2", api_version=4',
      "}",
      "ENTRY %main {",
      '  %k.1 = bf16[8]{0} custom-call(%x), custom_call_target="mosaic_gpu_v2"',
      '  %s.1 = (f32[8]{0}) custom-call(%y), custom_call_target="xla.gpu.ext.cub_sort_pairs"',
      "}"])
  assert script.custom_calls_by_target(excerpt) == {"mosaic_gpu_v2": 2,
                                                     "xla.gpu.ext.cub_sort_pairs": 1}


_GPU_HLO = "\n".join([
    # One line per kind, in the form XLA:GPU prints them (operands and metadata shortened).
    '  %cublas-lt-matmul.2 = (f32[4096,163840]{1,0}, s8[33554432]{0}) custom-call(%a, %b), '
    'custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(s)/transpose(jvp(kda))/dot"}',
    '  %gemm_fusion_dot.5 = f32[2048,2048]{1,0} fusion(%a, %b), kind=kCustom, calls=%g, '
    'backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}',
    '  %pallas_call.7 = bf16[4,4096,16,128]{3,2,1,0} custom-call(%a), '
    'custom_call_target="__gpu$xla.gpu.triton"',
    '  %mpmd_map.3 = bf16[131072,768]{1,0} custom-call(%a, %b), custom_call_target="mosaic_gpu_v2"',
    '  %dynamic_slice_fusion.1 = bf16[4,131072,768]{2,1,0} fusion(%a), kind=kCustom, calls=%d, '
    'backend_config={"fusion_backend_config":{"kind":"__custom_fusion"}}',
    '  %input_add_reduce_fusion = (bf16[128,16,128]{2,1,0}, bf16[4,4096]{1,0}) fusion(%a, %b), '
    'kind=kInput, calls=%r',
    '  %copy.632 = bf16[4,4,4096,2048]{3,2,1,0} copy(%a)',
    '  ROOT %ffi_call.1 = f32[4,64]{1,0} custom-call(), custom_call_target="AllocateBuffer"',
    '  %get-tuple-element.9 = f32[4]{0} get-tuple-element(%t), index=1'])


def test_op_kinds_tell_gemms_kernels_and_xla_fusions_apart():
  kinds = _script().op_kinds(_GPU_HLO)
  assert kinds == {"cublas-lt-matmul.2": "gemm", "gemm_fusion_dot.5": "gemm",
                   "pallas_call.7": "kernel", "mpmd_map.3": "kernel",
                   "dynamic_slice_fusion.1": "kernel", "input_add_reduce_fusion": "fusion",
                   "copy.632": "copy", "ffi_call.1": "other", "get-tuple-element.9": "other"}


def test_each_op_is_put_in_its_pass_and_the_parts_split_by_pass_and_kind():
  """Op names as jax writes them: a rematerialised forward sits under `rematted_computation`
  inside the backward's `transpose(...)`; the split sums to the part's total."""
  script = _script()
  fwd = "m.py:jit(step)/while/body/jvp(kda)/jit(_kda_pallas_core)/pallas_call"
  bwd = "m.py:jit(step)/transpose(jvp())/while/body/transpose(jvp(jvp()))/checkpoint/kda/dot_general"
  remat = ("m.py:jit(step)/transpose(jvp())/while/body/transpose(jvp(jvp()))/checkpoint/"
           "rematted_computation/kda/jit(_kda_pallas_core)/pallas_call")
  assert [script.pass_of(w) for w in (fwd, bwd, remat, "")] == [
      "forward", "backward", "recomputed", "forward"]
  times = {"pallas_call.1": 0.004, "pallas_call.2": 0.002, "custom-call.3": 0.006,
           "loop_fusion.4": 0.001}
  where = {"pallas_call.1": fwd, "pallas_call.2": remat, "custom-call.3": bwd,
           "loop_fusion.4": "m.py:jit(step)/optimizer/add"}
  kinds = {"pallas_call.1": "kernel", "pallas_call.2": "kernel", "custom-call.3": "gemm",
           "loop_fusion.4": "fusion"}
  out = script.part_breakdown(times, where, kinds, steps=2)
  assert out["parts_ms_per_step"] == {"kda": 6.0, "optimizer": 0.5}
  assert out["pass_ms_per_step"] == {"kda": {"backward": 3.0, "forward": 2.0, "recomputed": 1.0},
                                     "optimizer": {"forward": 0.5}}
  assert out["kind_ms_per_step"] == {"kda": {"kernel": 3.0, "gemm": 3.0},
                                     "optimizer": {"fusion": 0.5}}
  assert list(out["pass_ms_per_step"]) == ["kda", "optimizer"]       # largest part first


def test_the_part_profile_carries_the_splits_and_dumps_them_per_op(tmp_path, monkeypatch):
  """`part_profile` end to end on the GPU excerpt, with the trace reader replaced by fixed op
  times (a CPU trace has no device ops): parts, both splits, and the dumped op list with each
  op's pass and kind."""
  import json
  script = _script()
  hlo = _GPU_HLO.replace('custom_call_target="mosaic_gpu_v2"',
                         'custom_call_target="mosaic_gpu_v2", metadata={op_name='
                         '"jit(s)/jvp(moe_gmm)/jit(gmm_mgpu)/kernel/mpmd_map"}')
  times = {"cublas-lt-matmul.2": 0.003, "mpmd_map.3": 0.002, "copy.632": 0.001}
  monkeypatch.setattr(script, "device_op_times",
                      lambda trace_dir: (times, [], [(0.0, 1e6, "mpmd_map.3")]))
  out = script.part_profile(str(tmp_path), hlo, steps=1, dump_prefix=str(tmp_path / "v"))
  assert out["parts_ms_per_step"] == {"kda": 3.0, "moe_gmm": 2.0, "other": 1.0}
  assert out["pass_ms_per_step"]["kda"] == {"backward": 3.0}
  assert out["kind_ms_per_step"] == {"kda": {"gemm": 3.0}, "moe_gmm": {"kernel": 2.0},
                                     "other": {"copy": 1.0}}
  ops = json.load(open(tmp_path / "v_ops.json"))
  assert [(o["op"], o["part"], o["pass"], o["kind"]) for o in ops] == [
      ("cublas-lt-matmul.2", "kda", "backward", "gemm"),
      ("mpmd_map.3", "moe_gmm", "forward", "kernel"), ("copy.632", "other", "forward", "copy")]


def test_compile_events_name_the_compilers_host_activities(tmp_path):
  """`--compile_profile`'s reader on a real host trace of a compile: XLA's compile activities
  appear with positive inclusive seconds and counts, Python frames are left out, and the list is
  ordered longest first."""
  options = jax.profiler.ProfileOptions()
  options.python_tracer_level = 0
  options.host_tracer_level = 2
  x = jnp.ones((128, 128), jnp.float32)
  jax.profiler.start_trace(str(tmp_path), profiler_options=options)
  jax.jit(lambda a: jnp.tanh(a @ a.T).sum()).lower(x).compile()
  jax.profiler.stop_trace()
  events = _script().compile_events(str(tmp_path))
  assert events and not any(name.startswith("$") for name in events), events
  assert any("Compile" in name for name in events), events
  seconds = [s for s, _ in events.values()]
  assert seconds == sorted(seconds, reverse=True) and seconds[0] > 0
  assert all(n >= 1 for _, n in events.values())


def test_python_profile_lists_the_profiled_functions_longest_first():
  """`--lower_profile`'s summary of a cProfile run: the profiled function appears with its call
  count, and both lists are ordered longest first."""
  import cProfile

  def lower_something():
    return jax.jit(lambda a: jnp.tanh(a @ a).sum()).lower(jnp.ones((8, 8)))

  profiler = cProfile.Profile()
  profiler.enable()
  lower_something()
  profiler.disable()
  summary = _script().python_profile(profiler, top=400)
  names = [where for _, _, where in summary["cumulative"]]
  assert any(w.endswith("(lower_something)") for w in names), names[:20]
  for key in ("cumulative", "own"):
    seconds = [s for s, _, _ in summary[key]]
    assert seconds == sorted(seconds, reverse=True)
  assert [n for _, n, w in summary["cumulative"] if w.endswith("(lower_something)")] == [1]


def test_idle_profile_charges_each_gap_to_the_op_that_ends_it():
  # Two streams overlap on [10, 30); gaps: 30 → 40 (before "b"), 45 → 100 (before "c").
  intervals = [(0.0, 20e6, "a1"), (10e6, 30e6, "a2"), (40e6, 45e6, "b"), (100e6, 110e6, "c")]
  parts = {"a1": "kda", "a2": "mla", "b": "optimizer", "c": "other"}
  train_step = _script()
  out = train_step.idle_profile(intervals, parts.__getitem__, steps=2)
  assert out["busy_ms_per_step"] == (30 + 5 + 10) / 2
  assert out["idle_ms_per_step"] == (10 + 55) / 2
  assert out["gaps_per_step"] == 1.0
  assert out["idle_by_part_ms_per_step"] == {"other": 27.5, "optimizer": 5.0}
  assert [g["before"] for g in out["longest_gaps"]] == ["c", "b"]
  assert out["longest_gaps"][0]["ms"] == 55.0
  assert train_step.idle_profile([], parts.__getitem__, steps=1) == {}


def test_variants_keep_commas_inside_a_value():
  parse = _script().parse_variants
  got = parse("cb:train.xla_options=xla_gpu_enable_command_buffer=FUSION,WHILE,model.dtype=float32;"
              "two:a.b=1,c.d=x")
  assert got == [("cb", {"train.xla_options": "xla_gpu_enable_command_buffer=FUSION,WHILE",
                         "model.dtype": "float32"}),
                 ("two", {"a.b": "1", "c.d": "x"})]
  with pytest.raises(ValueError, match="is not key=value"):
    parse("bad:novalue,a=1")


def test_the_profile_runs_its_own_executable_where_the_backend_asks(monkeypatch):
  """With options for the backend, the profiled executable is a second compile of the same
  lowered step with them (here: a CPU option that keeps the HLO, so the profile's op names
  still come from the executable it traces); without, or when asked, the timed one."""
  script = _script()
  lowered = jax.jit(lambda x: jnp.tanh(x) * 2.0).lower(jnp.ones((8,), jnp.float32))
  compiled = lowered.compile()
  same = script.profile_executable(lowered, compiled, "hlo", "cpu", use_timed=False)
  assert same == (compiled, "hlo", "the timed one")
  monkeypatch.setitem(script.PROFILE_COMPILER_OPTIONS, "cpu",
                      {"xla_llvm_disable_expensive_passes": True})
  exe, hlo, which = script.profile_executable(lowered, compiled, "hlo", "cpu", use_timed=False)
  assert exe is not compiled and which.startswith("compiled apart with")
  assert "tanh" in hlo
  assert float(exe(jnp.ones((8,), jnp.float32))[0]) == float(compiled(jnp.ones((8,), jnp.float32))[0])
  assert script.profile_executable(lowered, compiled, "hlo", "cpu", use_timed=True)[2] == "the timed one"
  assert script.PROFILE_COMPILER_OPTIONS["gpu"] == {"xla_gpu_enable_command_buffer": ""}


def test_a_later_variant_with_an_autotuning_option_is_flagged():
  # XLA serves a later variant the autotuning results earlier ones left in memory: a variant
  # whose options change autotuning is flagged unless it is the process's base.
  caveat = _script().shared_autotuning_caveat
  options = {"train.xla_options": "xla_gpu_autotune_level=0"}
  assert caveat(0, options) is None
  assert "autotuning" in caveat(1, options)
  assert caveat(2, {"train.xla_options": "xla_gpu_enable_triton_gemm=false"}) is None
  assert caveat(1, {"model.dtype": "float32"}) is None


def test_collectives_are_counted_by_kind_async_pairs_once():
  """`collectives_by_kind` on HLO in the form XLA:GPU prints it: an async all-gather (start and
  done) counts once, tuple-shaped and plain collectives by their kind, a fusion named after one
  not at all."""
  excerpt = "\n".join([
      "  %all-gather-start = (bf16[8]{0}, bf16[64]{0}) all-gather-start(%p), dimensions={0}",
      "  %all-gather-done = bf16[64]{0} all-gather-done(%all-gather-start)",
      "  %all-reduce.1 = f32[8]{0} all-reduce(%g), to_apply=%add",
      "  %reduce-scatter.2 = f32[1]{0} reduce-scatter(%g), dimensions={0}, to_apply=%add",
      "  %ragged-all-to-all.3 = bf16[64,8]{1,0} ragged-all-to-all(%a, %b, %c, %d, %e, %f)",
      "  %all-to-all.4 = (f32[4]{0}, f32[4]{0}) all-to-all(%x, %y)",
      "  %all-reduce.5 = f32[] all-reduce(%s), to_apply=%add",
      "  %all_reduce_fusion = f32[8]{0} fusion(%x), kind=kLoop, calls=%f"])
  assert _script().collectives_by_kind(excerpt) == {
      "all-reduce": 2, "all-gather": 1, "reduce-scatter": 1, "ragged-all-to-all": 1,
      "all-to-all": 1}


def test_two_programs_are_read_apart():
  """The train step's two programs (k3train/train/phased.py) print as two HLO modules whose
  instruction names repeat: counts add up per module, and op names are qualified by module so
  that a profiled op is classified by its own program's metadata."""
  bench = _script()

  def sharded_step_gradients(x):
    with jax.named_scope("kda"):
      return jnp.tanh(x) * 2.0, jnp.sum(x * x)

  def sharded_step_update(x):
    with jax.named_scope("optimizer"):
      return jnp.tanh(x) * 2.0, jnp.sum(x * x)

  x = jnp.ones((64, 64), jnp.float32)
  texts = [jax.jit(f).lower(x).compile().as_text() for f in (sharded_step_gradients,
                                                               sharded_step_update)]
  both = "\n".join(texts)
  modules = bench.hlo_modules(both)
  assert list(modules) == ["jit_sharded_step_gradients", "jit_sharded_step_update"]
  assert [t.strip() for t in modules.values()] == [t.strip() for t in texts]
  assert bench.hlo_modules(texts[0]) == {"jit_sharded_step_gradients": texts[0]}

  each = [bench.kernels_by_part(t) for t in texts]
  assert each[0].get("kda", 0) > 0 and each[1].get("optimizer", 0) > 0
  summed = bench.summed_over_modules(bench.kernels_by_part, both)
  assert summed == {k: each[0].get(k, 0) + each[1].get(k, 0) for k in {**each[0], **each[1]}}

  where = bench.qualified(bench.op_locations, both)
  plain = [bench.op_locations(t) for t in texts]
  assert len(where) == len(plain[0]) + len(plain[1])
  shared = sorted(set(plain[0]) & set(plain[1]))   # names both modules use
  assert shared, "the two programs should repeat instruction names"
  name = bench.traced_op_name(list(modules), where)
  op = next(o for o in shared if "kda" in plain[0][o] and "optimizer" in plain[1][o])
  assert bench.classify(where[name(f"jit_sharded_step_update::{op}")]) == "optimizer"
  assert bench.classify(where[name(f"jit_sharded_step_gradients::{op}")]) == "kda"
  assert name(op) == op                       # no module stat and in both: left as traced
  only = next(iter(set(plain[1]) - set(plain[0])), None)
  if only is not None:                        # in one module only: found without the stat
    assert name(only) == f"jit_sharded_step_update::{only}"


def test_xla_rematerialized_counts_the_copies_xlas_remat_pass_made():
  """XLA's rematerialisation names each copy after the original with ".remat", ".remat2", …
  (later passes may add a suffix); jax's own remat shows only in metadata and is not counted."""
  excerpt = "\n".join([
      '  %fusion.1 = f32[8]{0} fusion(%p), kind=kLoop, calls=%f, metadata={op_name="jit(f)/checkpoint/remat/mul"}',
      "  %input_reduce_fusion.3.remat = f32[8]{0} fusion(%p), kind=kInput, calls=%g",
      "  %gte.remat.2 = f32[8]{0} get-tuple-element(%t), index=0",
      "  ROOT %loop_dynamic_slice_fusion.remat2 = f32[8]{0} fusion(%q), kind=kLoop, calls=%h",
      "  %rematerialized_by_hand = f32[8]{0} add(%a, %b)",
      "  %y = f32[8]{0} add(%gte.remat.2, %input_reduce_fusion.3.remat)"])
  assert _script().xla_rematerialized(excerpt) == 3
  assert _script().xla_rematerialized(excerpt.replace(".remat", ".copy")) == 0
