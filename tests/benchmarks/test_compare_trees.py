"""benchmarks/compare_trees.py: alternating processes per tree, rows parsed, differences from the
first tree, failed, silent and timed-out processes reported, bad input refused before anything
runs."""

from __future__ import annotations

import json
import os
import textwrap

import pytest

from tests.benchmarks import scripts

# A stand-in benchmark: its step time comes from the tree's STEP file, each run appends the
# tree's name to a shared log (the run order), and a tree with a SLEEP file hangs after printing
# its compile line, as a run stopped mid-way would.
FAKE = textwrap.dedent('''
    import json, os, sys, time
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(sys.argv[1], "a") as f:
      f.write(os.path.basename(here) + "\\n")
    print("base: compiled in 12.5 s (trace + lower 2.0 s, XLA 10.5 s), 7 kernels",
          file=sys.stderr, flush=True)
    if os.path.exists(os.path.join(here, "SLEEP")):
      time.sleep(60)
    if os.path.exists(os.path.join(here, "FAIL")):
      print("Traceback: something broke", file=sys.stderr)
      sys.exit(3)
    if os.path.exists(os.path.join(here, "SILENT")):
      sys.exit(0)
    step = float(open(os.path.join(here, "STEP")).read())
    for name in sys.argv[2:] or ["base"]:
      print("not json {")
      print(json.dumps({"name": name, "step_s": step, "step_s_min": step - 0.01, "mfu": 0.3,
                        "compile_s": 12.5, "trace_lower_s": 2.0, "backend_compile_s": 10.5,
                        "kernels": 7, "kernels_distinct": 5, "xla_memory_gib": {"total": 1.5},
                        "loss_last": 2.0}))
''')


def _tree(root, name, step=None, sleep=False, fail=False, silent=False):
  path = os.path.join(root, name)
  os.makedirs(os.path.join(path, "benchmarks"))
  with open(os.path.join(path, "benchmarks", "train_step.py"), "w") as f:
    f.write(FAKE)
  if step is not None:
    with open(os.path.join(path, "STEP"), "w") as f:
      f.write(str(step))
  for flag, on in (("SLEEP", sleep), ("FAIL", fail), ("SILENT", silent)):
    if on:
      open(os.path.join(path, flag), "w").close()
  return path


def test_alternates_the_trees_and_reports_each_against_the_first(tmp_path, capsys):
  bench = scripts.load("compare_trees")
  a = _tree(tmp_path, "a", step=2.0)
  b = _tree(tmp_path, "b", step=2.2)
  log, out = tmp_path / "order.log", tmp_path / "out"
  assert bench.main([bench.PROG, f"--tree=old={a}", f"--tree=new={b}", "--rounds=2",
                     f"--out={out}", "--", str(log), "base", "v2"]) == 0
  assert log.read_text().split() == ["a", "b", "a", "b"]
  results = [json.loads(l) for l in (out / "rows.jsonl").read_text().splitlines()]
  assert [(r["order"], r["round"], r["tree"], r["row"]["name"]) for r in results] == [
      (1, 1, "old", "base"), (1, 1, "old", "v2"), (2, 1, "new", "base"), (2, 1, "new", "v2"),
      (3, 2, "old", "base"), (3, 2, "old", "v2"), (4, 2, "new", "base"), (4, 2, "new", "v2")]
  assert sorted(os.listdir(out)) == ["1_old.err", "1_old.out", "2_new.err", "2_new.out",
                                     "3_old.err", "3_old.out", "4_new.err", "4_new.out",
                                     "rows.jsonl"]
  text = capsys.readouterr().out
  assert "| 2 | new | base | 2,200.0 (2,190.0) | 30.00 % | 12.5 (2.0 / 10.5) | 7 (5) | 1.50 | 2.0000 |" in text
  diffs = bench.differences(results, [bench.Tree("old", a, a), bench.Tree("new", b, b)])
  assert [(d["round"], d["variant"], d["median_ms"], d["median_pct"], d["min_pct"])
          for d in diffs] == [(1, "base", 200.0, 10.0, 10.05), (1, "v2", 200.0, 10.0, 10.05),
                              (2, "base", 200.0, 10.0, 10.05), (2, "v2", 200.0, 10.0, 10.05)]
  assert "round 2 new v2: median +200.0 ms (+10.00 %)" in text


def test_a_failed_or_timed_out_process_gives_an_error_row(tmp_path, capsys):
  bench = scripts.load("compare_trees")
  a = _tree(tmp_path, "a", step=2.0)
  slow = _tree(tmp_path, "slow", sleep=True)
  broken = _tree(tmp_path, "broken", fail=True)
  silent = _tree(tmp_path, "silent", silent=True)
  log = tmp_path / "order.log"
  assert bench.main([bench.PROG, f"--tree={a}", f"--tree={slow}", f"--tree={broken}",
                     f"--tree={silent}", "--rounds=1", "--timeout=5", "--", str(log)]) == 1
  text = capsys.readouterr().out
  assert "| 2 | slow | base | ran past --timeout=5 s | – | 12.5 |" in text
  assert "| 3 | broken | base | exit status 3: Traceback: something broke | – | 12.5 |" in text
  assert "| 4 | silent | base | printed no JSON row | – | 12.5 |" in text
  assert "| 1 | a | base | 2,000.0 (1,990.0) |" in text


def test_a_git_revision_is_exported_and_run(tmp_path, capsys):
  if not os.path.isdir(os.path.join(scripts.REPO, ".git")):
    pytest.fail("this test needs the repository's git history (a clone, not an export)")
  bench = scripts.load("compare_trees")
  tree = bench.materialise("head", "git:HEAD", "benchmarks/train_step.py", str(tmp_path))
  assert os.path.isfile(os.path.join(tree.path, "pyproject.toml"))
  assert not os.path.exists(os.path.join(tree.path, ".git"))
  with pytest.raises(ValueError, match="git archive failed"):
    bench.materialise("nope", "git:no-such-revision", "benchmarks/train_step.py", str(tmp_path))


@pytest.mark.parametrize("argv, message", [
    (["--tree=a=."], "at least two --tree"),
    (["--tree=a=.", "--tree=a=."], "same name"),
    (["--tree=a b=.", "--tree=c=."], "expected NAME=PATH"),
    (["--tree=a=.", "--tree=b=.", "--rounds=0"], "--rounds=0"),
    (["--tree=a=.", "--tree=b=/no/such/folder"], "no benchmarks/train_step.py in /no/such/folder"),
])
def test_bad_input_is_refused_before_anything_runs(argv, message, capsys):
  bench = scripts.load("compare_trees")
  assert bench.main([bench.PROG, *argv]) == bench.USAGE_ERROR
  assert message in capsys.readouterr().err
