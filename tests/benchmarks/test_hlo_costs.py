"""benchmarks/hlo_costs.py: launches, GEMM FLOPs and bytes of a compiled module's kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from benchmarks import hlo_costs

# A GPU module as XLA prints it, cut to what the cost model reads: a loop of 4 around a loop of 3
# whose body runs a cuBLAS GEMM and a Triton GEMM fusion, and an in-place slice update that reads
# one row of its parameter.
GPU_MODULE = """HloModule jit_step, is_scheduled=true

%triton_gemm_computation (p0: bf16[64,32], p1: bf16[32,16]) -> bf16[64,16] {
  %p0 = bf16[64,32]{1,0} parameter(0)
  %p1 = bf16[32,16]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_update (q0: f32[8,16], q1: f32[8,16], q2: s32[]) -> f32[8,16] {
  %q0 = f32[8,16]{1,0} parameter(0)
  %q1 = f32[8,16]{1,0} parameter(1)
  %q2 = s32[] parameter(2)
  %zero = s32[] constant(0)
  %row = f32[1,16]{1,0} dynamic-slice(%q1, %q2, %zero), dynamic_slice_sizes={1,16}
  %twice = f32[1,16]{1,0} add(%row, %row)
  ROOT %dus = f32[8,16]{1,0} dynamic-update-slice(%q0, %twice, %q2, %zero)
}

%inner_body (s: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %s = (s32[], f32[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %buf = f32[8,16]{1,0} get-tuple-element(%s), index=1
  %a = bf16[64,32]{1,0} constant({...})
  %b = bf16[32,16]{1,0} constant({...})
  %gemm = (f32[32,16]{1,0}, s8[1024]{0}) custom-call(%a, %a), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["0"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %tgemm = bf16[64,16]{1,0} fusion(%a, %b), kind=kCustom, calls=%triton_gemm_computation, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %upd = f32[8,16]{1,0} fusion(%buf, %buf, %i), kind=kLoop, calls=%fused_update
  ROOT %t = (s32[], f32[8,16]{1,0}) tuple(%i, %upd)
}

%inner_cond (c: (s32[], f32[8,16])) -> pred[] {
  %c = (s32[], f32[8,16]{1,0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

%outer_body (o: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %o = (s32[], f32[8,16]{1,0}) parameter(0)
  ROOT %w = (s32[], f32[8,16]{1,0}) while(%o), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"3"}}
}

%outer_cond (d: (s32[], f32[8,16])) -> pred[] {
  %d = (s32[], f32[8,16]{1,0}) parameter(0)
  ROOT %q = pred[] constant(true)
}

ENTRY %main (x: f32[8,16]) -> (s32[], f32[8,16]) {
  %x = f32[8,16]{1,0} parameter(0)
  %z = s32[] constant(0)
  %init = (s32[], f32[8,16]{1,0}) tuple(%z, %x)
  ROOT %loop = (s32[], f32[8,16]{1,0}) while(%init), condition=%outer_cond, body=%outer_body, backend_config={"known_trip_count":{"n":"4"}}
}
"""


def test_gpu_module_kernels_run_per_trip_and_count_their_work():
  costs, note = hlo_costs.kernel_costs(GPU_MODULE)
  assert set(costs) == {"gemm", "tgemm", "upd"}
  assert note == {"kernels_under_conditionals": 0, "loops_without_trip_count": 0}
  for c in costs.values():
    assert c.runs == 12                                   # 4 outer trips × 3 inner trips
  # cuBLAS: out [32,16], contracting lhs dim 0 of [64,32] (64): 2·512·64; its s8 workspace and
  # its operands' bytes are plain shapes.
  assert costs["gemm"].flops == 2 * 32 * 16 * 64 and costs["gemm"].kind == "gemm"
  assert costs["gemm"].bytes == 2 * (64 * 32 * 2) + 32 * 16 * 4
  assert costs["tgemm"].flops == 2 * 64 * 16 * 32 and costs["tgemm"].kind == "gemm"
  # The in-place update reads one row of q1 (64 B) and the index (4 B), not the buffer it
  # updates, and writes its one-row update (64 B).
  assert costs["upd"].flops == 0 and costs["upd"].bytes == 64 + 4 + 64
  assert costs["upd"].kind == "fusion"


def test_totals_and_rates_by_part_add_runs_times_work():
  costs, _ = hlo_costs.kernel_costs(GPU_MODULE)
  part = {"gemm": "head", "tgemm": "head", "upd": "attnres"}.get
  totals = hlo_costs.totals_by_part(costs, part)
  gemm_flop = 12 * (2 * 32 * 16 * 64 + 2 * 64 * 16 * 32)
  assert totals["head"] == {"gemm_tflop": round(gemm_flop / 1e12, 2), "fusion_gib": 0.0,
                            "kernel_gib": 0.0, "launches": 24}
  assert totals["attnres"]["launches"] == 12
  rates = hlo_costs.rates_by_part(costs, {"gemm": 1e-6, "tgemm": 1e-6, "upd": 12 * 132e-12},
                                  part, lambda name: name == "upd")
  assert rates["head"] == {"gemm_tflops": round(gemm_flop / 2e-6 / 1e12, 1)}
  assert rates["attnres"] == {"fusion_tbps": 1.0}           # 132 B per 132 ps


def test_a_cpu_compiled_scan_runs_its_body_per_trip_and_reads_one_slice():
  def scan(x, ws):
    return jax.lax.scan(lambda c, w: (jnp.sin(c) * w + 1.0, None), x, ws)[0]
  x, ws = jnp.zeros((128, 128)), jnp.ones((5, 128, 128))
  costs, note = hlo_costs.kernel_costs(jax.jit(scan).lower(x, ws).compile().as_text())
  assert not any(note.values())
  body = [c for c in costs.values() if c.bytes > 1000]
  assert len(body) == 1
  # 5 trips; reads the carry and one [128,128] slice of ws (not all of ws), writes the carry,
  # plus the s32 index.
  assert body[0].runs == 5 and body[0].bytes == 3 * 128 * 128 * 4 + 4


@pytest.mark.parametrize("shape, expected", [("bf16[4,8]{1,0}", 64), ("(f32[2], s8[100])", 108),
                                              ("pred[3]", 3), ("s4[6]", 3)])
def test_shape_bytes(shape, expected):
  assert hlo_costs.shape_bytes(shape) == expected
  if shape.startswith("("):
    assert hlo_costs.shape_bytes(shape, skip_workspace=True) == 8


def test_command_line_reads_a_dump_and_its_op_list(tmp_path, capsys):
  import gzip
  import json
  hlo = tmp_path / "step_hlo.txt.gz"
  with gzip.open(hlo, "wt") as f:
    f.write(GPU_MODULE)
  ops = tmp_path / "step_ops.json"
  ops.write_text(json.dumps([{"op": "gemm", "ms_per_step": 1e-3, "kind": "gemm"},
                             {"op": "upd", "ms_per_step": 12 * 132e-9, "kind": "fusion"}]))
  assert hlo_costs.main([str(hlo), str(ops)]) == 0
  out = json.loads(capsys.readouterr().out)
  assert out["totals"]["other"]["launches"] == 36 and out["loops_without_trip_count"] == 0
  assert out["rates"]["other"] == {"gemm_tflops": round(12 * 2 * 32 * 16 * 64 / 1e-6 / 1e12, 1),
                                   "fusion_tbps": 1.0}
