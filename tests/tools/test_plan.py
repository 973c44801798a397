"""k3train.tools.plan: per-device state bytes against a direct computation from the specs and
against the shardings a run builds, the divisibility errors, activation-model invariants, the
fused head's and the MTP module's terms, the mesh search, config overrides, and the CLI on k3_full."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from flax import nnx

from k3train import config as config_lib
from k3train.parallel import rules as rules_lib
from k3train.parallel import state_sharding
from k3train.parallel.mesh import MeshError
from k3train.tools import plan
from k3train.tools.plan import __main__ as plan_cli
from k3train.tools.plan.state import KEPT_IN_COMPUTE, unit_of
from k3train.train import builder
from k3train.tree_paths import path_names
from tests.configs import k3_tiny

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(REPO, "configs", "k3_tiny.py")
FULL = os.path.join(REPO, "configs", "k3_full.py")
SMALL_MESH = dict(data=1, fsdp=2, expert=2, sequence=1, tensor=2)


@pytest.fixture(scope="module")
def tiny():
  cfg = config_lib.validate(k3_tiny.get_config())
  return cfg, builder.abstract_state(cfg)


def direct_param_bytes(params, rules, sizes) -> tuple[int, int]:
  """(bytes per device, unsharded bytes) from each Variable's logical names → spec → shard."""
  per_device = unsharded = 0
  for _, var in jax.tree_util.tree_flatten_with_path(
      params, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]:
    value = var.get_value()
    itemsize = np.dtype(value.dtype).itemsize
    spec = rules_lib.logical_to_spec(tuple(var.get_metadata()["out_sharding"]), rules)
    local = 1
    for size, axes in zip(value.shape, spec):
      axes = (axes,) if isinstance(axes, str) else (axes or ())
      div = math.prod(sizes[a] for a in axes)
      assert size % div == 0
      local *= size // div
    per_device += local * itemsize
    unsharded += math.prod(value.shape) * itemsize
  return per_device, unsharded


def run_sharding_bytes(state, rules, sizes) -> plan.StateBytes:
  """The definition: per-device bytes from the NamedShardings a run builds on this mesh."""
  mesh = plan.abstract_mesh(sizes)
  param_sh = state_sharding.nnx_state_shardings(state.params, rules, mesh)
  rest_sh = state_sharding.nnx_state_shardings(state.rest, rules, mesh)
  opt_sh = state_sharding.mirror_shardings(state.opt, state.params, param_sh, mesh)

  def local_bytes(x, sharding) -> int:
    return math.prod(sharding.shard_shape(tuple(x.shape))) * np.dtype(x.dtype).itemsize

  def total(tree, shardings) -> int:
    return sum(local_bytes(x, s) for x, s in zip(jax.tree_util.tree_leaves(tree),
                                                 jax.tree_util.tree_leaves(shardings)))

  # Optimizer leaves that mirror no parameter: the same matching with indices for shardings.
  treedef = jax.tree_util.tree_structure(param_sh)
  index_tree = jax.tree_util.tree_unflatten(treedef, list(range(treedef.num_leaves)))
  matched = jax.tree_util.tree_leaves(
      state_sharding.mirror_shardings(state.opt, state.params, index_tree, mesh))
  largest, replicated = 0, []
  for (path, x), s, hit in zip(jax.tree_util.tree_flatten_with_path(state.opt)[0],
                               jax.tree_util.tree_leaves(opt_sh), matched):
    b = local_bytes(x, s)
    largest = max(largest, b)
    if not isinstance(hit, int) and len(x.shape) >= 2:
      replicated.append((".".join(path_names(path)), b))
  units = {}
  for (path, x), s in zip(jax.tree_util.tree_flatten_with_path(state.params)[0],
                          jax.tree_util.tree_leaves(param_sh)):
    names = path_names(path)
    kept = 1
    for dim_axes in s.spec:
      axes = (dim_axes,) if isinstance(dim_axes, str) else (dim_axes or ())
      kept *= math.prod(mesh.shape[a] for a in axes if a in KEPT_IN_COMPUTE)
    count = math.prod(x.shape) // kept
    if names[0] == "stack":
      count //= x.shape[0]
    units[unit_of(names)] = units.get(unit_of(names), 0) + count
  return plan.StateBytes(total(state.params, param_sh), total(state.rest, rest_sh),
                         total(state.opt, opt_sh), largest, replicated, units)


@pytest.mark.parametrize("recipe", ["default", "full"])
def test_param_bytes_equal_direct_computation_from_specs(tiny, recipe):
  cfg, state = tiny
  rules = rules_lib.get_rules(recipe)
  sb = plan.state_bytes(plan.state_layout(state, recipe), SMALL_MESH)
  expected, unsharded = direct_param_bytes(state.params, rules, SMALL_MESH)
  assert sb.params == expected
  assert sb.params < unsharded                  # the mesh really shards something
  # Every device holds an equal shard, so all devices together hold at least one full copy.
  devices = math.prod(SMALL_MESH.values())
  assert sb.params * devices >= unsharded
  opt_unsharded = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize
                      for x in jax.tree_util.tree_leaves(state.opt))
  assert sb.opt * devices >= opt_unsharded


@pytest.mark.parametrize("recipe", ["default", "full"])
@pytest.mark.parametrize("sizes", [SMALL_MESH,
                                   dict(data=2, fsdp=1, expert=4, sequence=2, tensor=1)])
def test_state_bytes_match_the_run_shardings(tiny, recipe, sizes):
  cfg, state = tiny
  real = run_sharding_bytes(state, rules_lib.get_rules(recipe), sizes)
  sb = plan.state_bytes(plan.state_layout(state, recipe), sizes)
  assert (sb.params, sb.rest, sb.opt, sb.largest_opt_leaf) == \
         (real.params, real.rest, real.opt, real.largest_opt_leaf)
  assert sb.units == real.units
  assert sorted(sb.replicated_opt) == sorted(real.replicated_opt)


def test_non_dividing_mesh_fails_with_the_runs_error(tiny):
  cfg, state = tiny
  sizes = dict(data=1, fsdp=1, expert=1, sequence=1, tensor=3)
  with pytest.raises(MeshError) as run_error:
    state_sharding.nnx_state_shardings(state.params, rules_lib.get_rules("default"),
                                       plan.abstract_mesh(sizes))
  with pytest.raises(MeshError) as plan_error:
    plan.state_bytes(plan.state_layout(state, "default"), sizes)
  assert str(plan_error.value) == str(run_error.value)


def test_non_dividing_mesh_names_dimension_and_axis(tiny, capsys):
  code = plan_cli.main(["plan", f"--config={TINY}", "--devices=3", "--device_memory=1",
                        "--mesh=tensor=3"])
  err = capsys.readouterr().err
  assert code == 2
  assert "not divisible" in err and "dimension" in err and "tensor=3" in err
  assert "Traceback" not in err


def test_sequence_that_does_not_divide_names_the_batch(tiny, capsys):
  code = plan_cli.main(["plan", f"--config={TINY}", "--devices=3", "--device_memory=1",
                        "--mesh=sequence=3", "--rules=default", "--seq_len=128"])
  err = capsys.readouterr().err
  assert code == 2 and "seq_len" in err and "sequence=3" in err


def test_config_overrides_reach_the_plan(tiny, capsys):
  base = [f"--config={TINY}", "--devices=4", "--device_memory=1GB", "--json"]
  assert plan_cli.main(["plan"] + base) in (0, 1)
  default = json.loads(capsys.readouterr().out)
  assert default["seq_len"] == 128 and default["rules"] == "default"
  assert default["microbatches"] == 1 and default["mesh"]["fsdp"] == 4
  # As a user runs it: the overrides change the config the plan reads (sequence length, rules,
  # the mesh of the parallel section); a plan flag given too wins over its config key.
  r = subprocess.run([sys.executable, "-m", "k3train.tools.plan"] + base + [
      "--config.data.seq_len=256", "--config.parallel.rules=full", "--config.parallel.tensor=2",
      "--config.train.microbatches=2", "--microbatches=3"],
      capture_output=True, text=True, cwd=REPO, timeout=120)
  assert r.returncode in (0, 1), r.stderr
  out = json.loads(r.stdout)
  assert out["seq_len"] == 256 and out["rules"] == "full"
  assert out["mesh"]["tensor"] == 2 and out["mesh"]["fsdp"] == 2
  assert out["tokens_per_device"] == 2 * default["tokens_per_device"]
  assert out["microbatches"] == 3


@pytest.mark.parametrize("argv, message", [
    (["--config.data.no_such_key=1"], "no_such_key"),
    (["--rules=no_such_recipe"], "rules"),
    (["--devices=0"], "devices"),
    (["--mesh=model=2"], "model=2"),
])
def test_usage_errors_exit_2(argv, message, capsys):
  base = ["plan", f"--config={TINY}", "--devices=4", "--device_memory=1"]
  code = plan_cli.main(base + argv)
  err = capsys.readouterr().err
  assert code == 2 and message in err and "Traceback" not in err


def test_device_memory_is_required(capsys):
  assert plan_cli.main(["plan", f"--config={TINY}", "--devices=4"]) == 2
  assert "device_memory" in capsys.readouterr().err


def test_activation_model_invariants(tiny):
  cfg, state = tiny
  kw = dict(rules_name="full", seq_len=128, batch_per_device=2, device_memory_gib=1.0)
  plans = {r: plan.make_plan(cfg, state, SMALL_MESH, remat=r, **kw)
           for r in ("none", "selective_kda", "selective", "dots_saveable", "full")}
  saved = {r: dict((l.strip(), b) for l, b, _ in p.lines)["saved activations"]
           for r, p in plans.items()}
  assert saved["none"] > saved["selective_kda"] > saved["selective"] > saved["dots_saveable"] \
      > saved["full"] > 0
  # selective_kda keeps, besides selective's, the KDA chunk kernels' residuals and output of
  # every KDA layer (tiny: K = V, the activation dtype A, fp32 A_kk and chunk decays).
  m = cfg.model
  K, C, A = m.kda.head_dim, m.kda.chunk_size, np.dtype(m.dtype).itemsize
  kda_layers = sum(mixer == "kda" for mixer, _ in config_lib.layer_schedule(m).kinds)
  n, h = plans["full"].dims.n, plans["full"].dims.kda_heads
  per_layer = n * h * (K * K * A // C + 2 * K * A + C * (2 * A + 4) + 4 * K * A + K * 4 // C)
  assert saved["selective_kda"] - saved["selective"] == kda_layers * per_layer
  p = plans["full"]
  d = p.dims
  assert d.n == 2 * 128 and d.batch_shards == 4 and d.global_batch == 8   # fsdp·expert = 4
  # The dropless exchange buffers: 3 × [ep·n·k, ℓ] in model.dtype (tiny: float32).
  m = cfg.model
  lines = {l.strip(): b for l, b, _ in p.lines}
  assert lines["of which expert buffers"] == 3 * 2 * d.n * m.moe.top_k * m.moe.latent_dim * 4
  capped = plan.make_plan(cfg, state, SMALL_MESH, remat="full", expert_capacity=1.0, **kw)
  assert {l.strip(): b for l, b, _ in capped.lines}["of which expert buffers"] == \
      lines["of which expert buffers"] // 2
  # Doubling the sequence shards halves the tokens per device and the scan carry.
  p2 = plan.make_plan(cfg, state, dict(SMALL_MESH, fsdp=1, sequence=2), remat="full", **kw)
  assert p2.dims.n == d.n // 2 and p2.detail["carry"] * 2 == p.detail["carry"]
  assert p.peak == max(p.phases.values()) and p.fits == (p.peak <= p.budget)
  # Gradient accumulation: activations per micro-batch unchanged, one more gradient buffer live
  # in forward and backward (the running sum), none extra in the optimizer phase; the scanned
  # stack's backward adds into the running sum, so its own gradient buffer is not live then.
  p4 = plan.make_plan(cfg, state, SMALL_MESH, remat="full", microbatches=4, **kw)
  grads = lines["gradients"]
  assert {l.strip(): b for l, b, _ in p4.lines}["gradient accumulator"] == grads > 0
  assert lines["gradient accumulator"] == 0
  stack = plan.state_bytes(plan.state_layout(state, "full"), SMALL_MESH).stack_params
  assert 0 < stack < grads
  assert p4.phases["backward"] == p.phases["backward"] + grads - stack
  assert p4.phases["forward"] == p.phases["forward"] + grads
  assert p4.phases["optimizer"] == p.phases["optimizer"]
  assert plan.plan_json(p4)["global_batch"] == 4 * d.global_batch
  # A precomputed state layout gives the same plan as the shapes it was made from.
  layout = plan.state_layout(state, "full")
  assert plan.make_plan(cfg, layout, SMALL_MESH, remat="full", **kw).phases == p.phases
  with pytest.raises(ValueError, match="rules"):
    plan.make_plan(cfg, layout, SMALL_MESH, remat="full", **dict(kw, rules_name="default"))


def _lines(p) -> dict:
  return {label.strip(): b for label, b, _ in p.lines}


def test_fused_head_replaces_the_logits_by_its_residuals_and_one_chunk(tiny):
  """train.loss_chunk_tokens = c > 0: no [n, V] logits term; the dx and fp32 dW residuals are
  saved, and one chunk's buffers are live in forward only. Expected bytes from the shapes: mesh
  fsdp=2, sequence=2, tensor=2 under `full` (head kernel [d, V]: d over fsdp·sequence, V over
  tensor; activations: batch over fsdp, sequence over sequence, vocab over tensor)."""
  cfg, state = tiny
  chunk = 32
  fused = copy.deepcopy(cfg)
  fused.train.loss_chunk_tokens = chunk
  sizes = dict(data=1, fsdp=2, expert=1, sequence=2, tensor=2)
  kw = dict(rules_name="full", seq_len=128, batch_per_device=2, remat="full", device_memory_gib=1.0)
  p0, pc = (plan.make_plan(c, state, sizes, **kw) for c in (cfg, fused))
  m = cfg.model
  A, F = np.dtype(m.dtype).itemsize, 4
  b, d = 2, m.d_model
  n = b * 128 // 2                       # tokens per device: 2 sequences, half of each
  v = m.vocab_size // 2                  # vocab per device
  tokens = b * chunk // 2                # one chunk's tokens per device
  logits = n * v * (A + F)               # the unfused head's logits and their fp32 copy
  dx, dw = n * d * A, (d // 4) * v * F
  assert pc.dims.loss_chunk == chunk // 2 and p0.dims.loss_chunk == 0
  assert (pc.dims.head_d, pc.dims.head_vocab) == (d // 4, v)

  # The head's cost: unfused as before (logits and their fp32 copy, reused for their gradient) …
  costs0 = plan.layer_costs(cfg, p0.dims, "flash")
  costsc = plan.layer_costs(fused, pc.dims, "flash")
  attn_res = costs0["attn_res"]
  head0, headc = costs0["head"], costsc["head"]
  assert head0.saved - attn_res.saved == n * d * A + n * d * (F + A) + logits
  assert head0.transient == attn_res.transient
  assert "head_chunk" not in costs0
  # … fused: the logits replaced by the residuals, no head transient in backward.
  assert head0.saved - headc.saved == logits - dx - dw
  assert headc.transient == attn_res.transient
  chunk_loop = (n * (d * A + 8)                      # x, targets, mask in chunk layout
                + tokens * v * (F + F + A)           # fp32 logits, fp32 softmax, d_logits
                + tokens * d * F + d * v * F)        # fp32 dx and dW GEMM outputs of a chunk
  assert costsc["head_chunk"].transient == chunk_loop

  lines0, linesc = _lines(p0), _lines(pc)
  assert lines0["saved activations"] - linesc["saved activations"] == logits - dx - dw
  assert linesc["fused head chunk loop"] == chunk_loop and "fused head chunk loop" not in lines0
  assert pc.peak < p0.peak
  # The key's checks: T must be a multiple of c, c a multiple of the sequence shards.
  fused.train.loss_chunk_tokens = 48
  with pytest.raises(ValueError, match=r"train.loss_chunk_tokens=48 .* T=128"):
    plan.make_plan(fused, state, sizes, **kw)
  fused.train.loss_chunk_tokens = 1
  with pytest.raises(MeshError, match="sequence=2"):
    plan.make_plan(fused, state, sizes, **kw)



@pytest.fixture(scope="module")
def tiny_mtp():
  cfg = config_lib.validate(k3_tiny.get_config())
  cfg.model.mtp.enabled = True
  return cfg, builder.abstract_state(cfg)


@pytest.mark.parametrize("remat", ["full", "dots_saveable", "none"])
@pytest.mark.parametrize("chunk", [0, 32])
def test_mtp_adds_its_block_and_a_second_pass_through_the_head(tiny, tiny_mtp, remat, chunk):
  """model.mtp on: the block inputs h and Emb(t+1), the head's terms a second time, and the
  rematerialised block (five norms, proj, one MLA mixer and one MoE) as one more unscanned layer
  under the remat policy. Same mesh and shapes as the fused-head test; the same state on both
  sides, so the difference is the activations alone."""
  cfg, state = tiny
  cfg = copy.deepcopy(cfg)
  cfg.train.loss_chunk_tokens = chunk
  on = copy.deepcopy(cfg)
  on.model.mtp.enabled = True
  sizes = dict(data=1, fsdp=2, expert=1, sequence=2, tensor=2)
  kw = dict(rules_name="full", seq_len=128, batch_per_device=2, remat=remat, device_memory_gib=1.0)
  p0, p1 = (plan.make_plan(c, state, sizes, **kw) for c in (cfg, on))
  m = cfg.model
  A, F = np.dtype(m.dtype).itemsize, 4
  b, d = 2, m.d_model
  n = b * 128 // 2                       # tokens per device: 2 sequences, half of each
  v = m.vocab_size // 2                  # vocab per device
  logits = n * v * (A + F)               # the unfused head's logits and their fp32 copy
  inputs = 2 * n * d * A                 # h and Emb(t+1), the block's inputs
  head = n * d * A + (logits if not chunk else (d // 4) * v * F)   # head input or dx; or fp32 dW

  costs = plan.layer_costs(on, p1.dims, "flash")
  mla, moe = costs["mla"], costs["moe"]
  block_saved = n * d * A + 5 * n * d * (F + A) + mla.saved + moe.saved   # proj, 5 norms
  block_dots = n * d * A + mla.dots + moe.dots
  assert (costs["mtp"].saved, costs["mtp"].dots) == (block_saved, block_dots)
  assert costs["mtp_head"].saved == inputs + head
  mtp_saved, mtp_working = {"full": (inputs + head, block_saved),
                            "dots_saveable": (inputs + head + block_dots, block_saved - block_dots),
                            "none": (inputs + head + block_saved, 0)}[remat]

  lines0, lines1 = _lines(p0), _lines(p1)
  assert lines1["of which MTP"] == mtp_saved
  assert lines1["saved activations"] - lines0["saved activations"] == mtp_saved
  # The block joins the candidates for the backward working set (one super-block here).
  est = dict(seq_len=128, batch_per_device=2, remat=remat)
  a0 = plan.estimate(cfg, rules_lib.get_rules("full"), plan.abstract_mesh(sizes), **est)
  a1 = plan.estimate(on, rules_lib.get_rules("full"), plan.abstract_mesh(sizes), **est)
  assert (a1.mtp_saved, a1.mtp_working) == (mtp_saved, mtp_working)
  sched = config_lib.layer_schedule(m)
  period = plan.Cost()
  for kind in sched.period:
    period = period + plan.layer_cost(costs, kind)
  if remat != "none":
    largest = period.saved - (period.dots if remat != "full" else 0)
    assert a1.working - a0.working == max(0, mtp_working - largest)
  else:
    assert a1.working == a0.working
  growth = lines1["backward working set"] - lines0["backward working set"]
  assert p1.phases["backward"] - p0.phases["backward"] == mtp_saved + growth
  assert p1.phases["optimizer"] == p0.phases["optimizer"]
  assert p1.peak - p0.peak >= (logits if not chunk else n * d * A + (d // 4) * v * F)
  assert set(p1.detail) - set(p0.detail) == {"mtp"}

  # The run's own state (MTP parameters too) raises the peak further.
  p_run = plan.make_plan(on, tiny_mtp[1], sizes, **kw)
  assert p_run.peak > p1.peak and _lines(p_run)["of which MTP"] == mtp_saved

  # Off, or no mtp section at all: no MTP term, the plan as without the module.
  none = copy.deepcopy(cfg)
  del none.model["mtp"]
  for c in (cfg, none):
    assert "mtp" not in plan.layer_costs(c, p0.dims, "flash")
  p_none = plan.make_plan(none, state, sizes, **kw)
  assert "of which MTP" not in lines0 and "mtp" not in p0.detail
  assert (p_none.lines, p_none.phases, p_none.detail) == (p0.lines, p0.phases, p0.detail)
  assert plan.format_plan(p_none, verbose=True) == plan.format_plan(p0, verbose=True)

def test_search_returns_fitting_plans_best_first(tiny):
  cfg, state = tiny
  kw = dict(rules_name="full", seq_len=128, remat="full", attention="flash",
            device_memory_gib=1.0, margin=0.1)
  plans = plan.search(cfg, state, 8, top=100, **kw)
  assert plans
  keys = [(-p.dims.n, p.sizes["data"], p.sizes["sequence"], p.peak) for p in plans]
  assert keys == sorted(keys)
  for p in plans:
    assert p.fits and math.prod(p.sizes.values()) == 8
    again = plan.make_plan(cfg, state, p.sizes, batch_per_device=p.dims.b, **kw)
    assert again.phases == p.phases
    # The largest power-of-two batch: twice as many sequences does not fit (or does not divide).
    if 2 * p.dims.b <= 64:
      try:
        bigger = plan.make_plan(cfg, state, p.sizes, batch_per_device=2 * p.dims.b, **kw)
      except MeshError:
        continue
      assert not bigger.fits


def test_cli_on_k3_full_is_fast_and_allocates_nothing():
  t0 = time.monotonic()
  r = subprocess.run([sys.executable, "-m", "k3train.tools.plan", f"--config={FULL}",
                      "--devices=1024", "--device_memory=139",
                      "--mesh=data=1,fsdp=-1,expert=4,sequence=2,tensor=8", "--rules=full",
                      "--seq_len=4096", "--batch_per_device=1", "--remat=full", "--json"],
                     capture_output=True, text=True, cwd=REPO, timeout=120)
  elapsed = time.monotonic() - t0
  assert r.returncode in (0, 1), r.stderr     # 1 = does not fit; both are answers
  out = json.loads(r.stdout)
  assert out["mesh"] == dict(data=1, fsdp=16, expert=4, sequence=2, tensor=8)
  # 2.78 T fp32 parameters spread over 1024 devices: at least total/1024 each.
  assert out["bytes"]["parameters"] * 1024 >= 2_779_484_393_568 * 4
  assert out["tokens_per_device"] == 2048 and out["global_batch"] == 64
  assert elapsed < 20, f"plan CLI took {elapsed:.1f} s"


def test_h200_proxy_as_configured_fits_one_h200():
  """configs/k3_h200.py runs on one 141 GB H200 as written (batch, micro-batches, remat): the
  plan's peak is within the 10 % margin; the same batch without micro-batches is not."""
  from k3train.tools.plan import stages as stages_lib
  from tests.configs import k3_h200
  cfg = config_lib.validate(k3_h200.get_config())
  assert cfg.train.microbatches > 1
  (_, p), = stages_lib.stage_plans(cfg, 1, device_memory_gib=141.0)
  assert not isinstance(p, str), p
  assert p.fits, (p.peak / 2**30, p.budget / 2**30)
  whole = config_lib.validate(k3_h200.get_config())
  whole.train.microbatches = 1
  (_, q), = stages_lib.stage_plans(whole, 1, device_memory_gib=141.0)
  assert not q.fits and q.peak > 2 * p.peak


def test_expert_weight_copy_and_narrower_expert_gradients(tiny):
  """bf16 compute with fp32 masters: the once-per-step bf16 copy of the routed-expert weights is
  live in forward and backward, and the backward's expert gradients are bf16, so the backward
  phase holds the copy and 2 bytes less per expert parameter of gradient; with QAT on (the
  in-layer form) or an fp32 model neither term exists. Mesh fsdp=2, expert=2 under `full`."""
  cfg, state = tiny
  sizes = dict(data=1, fsdp=2, expert=2, sequence=1, tensor=1)
  kw = dict(rules_name="full", seq_len=128, batch_per_device=2, remat="full", device_memory_gib=1.0)
  rules = rules_lib.get_rules("full")
  expert_local = 0
  for path, var in jax.tree_util.tree_flatten_with_path(
      state.params, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]:
    if tuple(path_names(path))[-2:] in (("experts", "gate"), ("experts", "up"), ("experts", "down")):
      spec = rules_lib.logical_to_spec(tuple(var.get_metadata()["out_sharding"]), rules)
      count = math.prod(var.get_value().shape)
      for axes in spec:
        axes = (axes,) if isinstance(axes, str) else (axes or ())
        count //= math.prod(sizes[a] for a in axes)
      expert_local += count
  assert expert_local > 0

  def planned(dtype, qat):
    c = copy.deepcopy(cfg)
    c.model.dtype, c.model.quant.enabled = dtype, qat
    return plan.make_plan(c, state, sizes, **kw)

  bf16, qat, fp32 = planned("bfloat16", False), planned("bfloat16", True), planned("float32", False)
  assert _lines(bf16)["expert weights cast"] == 2 * expert_local
  assert _lines(qat)["expert weights cast"] == _lines(fp32)["expert weights cast"] == 0
  assert bf16.phases["forward"] - qat.phases["forward"] == 2 * expert_local
  # Backward: the copy (+2 bytes per expert parameter) and the bf16 expert gradients (−2) cancel.
  assert bf16.phases["backward"] == qat.phases["backward"]
  assert fp32.phases["backward"] > bf16.phases["backward"]   # fp32 activations, no narrowing
  assert bf16.phases["optimizer"] == qat.phases["optimizer"]
