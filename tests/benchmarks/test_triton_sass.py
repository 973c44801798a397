"""benchmarks/triton_sass.py: the main-loop reading of a kernel's SASS (the compile path needs jax's
CUDA plugin and nvdisasm, which CI does not install; it is exercised by running the script)."""

from __future__ import annotations

from benchmarks import triton_sass

# nvdisasm's layout, cut down: a 2-instruction prologue, a loop of 7 instructions (.L_x_1 up to
# its backward branch) holding a 3-instruction block that a forward branch can jump over, a short
# inner retry loop of 2, and an epilogue.
SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/              @P0 BRA `(.L_x_0) ;
.L_x_1:
        /*0020*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ ;
        /*0030*/              @!P1 BRA P2, `(.L_x_2) ;
        /*0040*/                   ISETP.GE.AND P3, PT, R4, R5, PT ;
        /*0050*/                   FSEL R24, R24, -INF , !P3 ;
        /*0060*/                   FSEL R25, R25, -INF , !P3 ;
.L_x_2:
        /*0070*/                   MUFU.EX2 R26, R24 ;
        /*0080*/              @!P4 BRA `(.L_x_1) ;
.L_x_0:
.L_x_3:
        /*0090*/                   NOP ;
        /*00a0*/                   BRA `(.L_x_3);
        /*00b0*/                   EXIT ;
"""


def test_main_loop_and_its_skippable_block():
  loop = triton_sass.main_loop(SASS)
  assert (loop["loop"], loop["skippable"]) == (7, 3)


def test_no_loop():
  """No backward branch, or only the end-of-kernel trap (a branch to itself): no loop."""
  for sass in ("        /*0000*/                   EXIT ;\n",
               ".L_x_9:\n        /*0000*/                   BRA `(.L_x_9);\n"):
    loop = triton_sass.main_loop(sass)
    assert (loop["loop"], loop["skippable"]) == (0, 0)


def test_settings_parse_to_config_values():
  assert triton_sass.parse_settings("dkv_block_k=64,dkv_keys_as_rows=true,name=x") == {
      "dkv_block_k": 64, "dkv_keys_as_rows": True, "name": "x"}
  assert triton_sass.parse_settings("") == {}


def test_loop_classes_and_programs_per_sm():
  loop = triton_sass.main_loop(SASS)["loop_classes"]
  assert loop["mma"] == 1 and loop["mufu"] == 1 and loop["stl"] == 0
  # 255 registers × 4 warps → 2 programs by registers; 40 KiB of shared memory would allow 5.
  assert triton_sass.programs_per_sm(255, 40 * 1024, 4) == 2
  assert triton_sass.programs_per_sm(128, 160 * 1024, 8) == 1
