"""The same benchmark from two or more source trees, in alternating processes on one machine, and
one table of the results with each tree's difference from the first.

  python benchmarks/compare_trees.py --tree=base=git:badac7a --tree=new=. --rounds=2 \
      --out=/tmp/cmp -- --config=configs/k3_h200.py --config.optim.optimizer=adamw --steps=3

Step times of one code differ from machine to machine by more than most changes are worth
(compile 41 s on one H100 and 60 s on the next; step medians a few per cent apart), so a change is
judged against its baseline timed in the same session on the same machine, each tree in its own
process (XLA keeps autotuning results per process), alternated so that a drift of the machine
falls on both: with `--rounds=2` and trees A, B the order is A B A B.

A tree is a folder holding the repository (`PATH`; `.` for this checkout) or a git revision of
this repository (`git:REV`), which is exported with `git archive` into a temporary folder, so
its files are exactly that commit's. Each process runs `python <tree>/<script> <args after -->`
with the tree as its working directory and first on PYTHONPATH (the rest of PYTHONPATH, e.g.
a folder of extra packages, is kept). The script is `benchmarks/train_step.py` unless
`--script` says otherwise; every JSON line it prints with a "name" is one row (one per
`--variants` entry).

With `--out`, each process's stdout and stderr are kept as `<order>_<tree>.out/.err` and all rows
as `rows.jsonl`. A process that fails or runs past `--timeout` gives a row with its error and,
when its stderr says it, the compile time it reached ("<name>: compiled in … s").

Only the standard library is used, so it runs on a machine that has nothing but jax.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

PROG = "compare_trees"
USAGE_ERROR = 2
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPILED = re.compile(r"^(\S+): compiled in ([\d.]+) s", re.M)


# name; spec, what was asked for (a folder or git:REV); path, the folder the processes run in.
Tree = collections.namedtuple("Tree", ["name", "spec", "path"])


def parse_tree(spec: str) -> tuple[str, str]:
  """"NAME=WHERE" or "WHERE" → (name, where); the name defaults to the folder's or revision's."""
  name, sep, where = spec.partition("=")
  if not sep:
    where = spec
    name = where[4:] if where.startswith("git:") else os.path.basename(os.path.abspath(where))
  if not name or not where or not re.fullmatch(r"[\w.@-]+", name):
    raise ValueError(f"--tree={spec!r}: expected NAME=PATH or NAME=git:REV (NAME of letters, "
                     "digits, '.', '@', '_' or '-')")
  return name, where


def materialise(name: str, where: str, script: str, workdir: str) -> Tree:
  """The folder a tree's processes run in: `where` itself, or `git:REV` exported into workdir."""
  if where.startswith("git:"):
    rev = where[4:]
    dest = os.path.join(workdir, name)
    os.makedirs(dest)
    archive = subprocess.run(["git", "-C", REPO, "archive", "--format=tar", rev],
                             capture_output=True)
    if archive.returncode:
      raise ValueError(f"--tree={name}={where}: git archive failed: "
                       f"{archive.stderr.decode(errors='replace').strip()[:300]}")
    subprocess.run(["tar", "-x", "-C", dest], input=archive.stdout, check=True)
    path = dest
  else:
    path = os.path.abspath(where)
  if not os.path.isfile(os.path.join(path, script)):
    raise ValueError(f"--tree={name}={where}: no {script} in {path}")
  return Tree(name, where, path)


def run_order(trees: list[Tree], rounds: int) -> list[Tree]:
  """Each round runs every tree once, in the order given: A B A B for two trees and two rounds."""
  return [tree for _ in range(rounds) for tree in trees]


def run_one(tree: Tree, script: str, args: list[str], timeout: float) -> tuple[str, str, str]:
  """(stdout, stderr, problem) of one benchmark process in `tree`; problem is "" on success."""
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (tree.path, env.get("PYTHONPATH", "")) if p)
  try:
    done = subprocess.run([sys.executable, os.path.join(tree.path, script), *args], cwd=tree.path,
                          env=env, capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired as e:
    text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
    return text(e.stdout), text(e.stderr), f"ran past --timeout={timeout:g} s"
  problem = "" if done.returncode == 0 else f"exit status {done.returncode}"
  return done.stdout, done.stderr, problem


def rows_of(stdout: str, stderr: str, problem: str) -> list[dict]:
  """The JSON rows a process printed; a process without rows gives one error row (with the
  compile time its stderr reports)."""
  rows = []
  for line in stdout.splitlines():
    line = line.strip()
    if line.startswith("{"):
      try:
        row = json.loads(line)
      except json.JSONDecodeError:
        continue
      if isinstance(row, dict) and "name" in row:
        rows.append(row)
  if rows:
    return rows
  problem = problem or "printed no JSON row"
  compiled = COMPILED.findall(stderr)
  last = [l.strip() for l in stderr.splitlines() if l.strip()][-1:]
  said = last and not COMPILED.match(last[0])      # the last thing it said, unless its compile
  row = {"name": compiled[-1][0] if compiled else "base",
         "error": problem + (f": {last[0][:200]}" if said else "")}
  if compiled:
    row["compile_s"] = float(compiled[-1][1])
  return [row]


def _num(value, fmt: str) -> str:
  return format(value, fmt) if isinstance(value, (int, float)) else "–"


def table(results: list[dict]) -> str:
  """Markdown: one row per process and variant, in the order run."""
  head = ("| order | tree | variant | ms per update (min) | MFU | compile s (trace + lower / XLA) "
          "| kernels (distinct) | XLA GiB | loss |\n|---|---|---|---|---|---|---|---|---|")
  lines = [head]
  for r in results:
    row = r["row"]
    if "error" in row:
      compile_s = _num(row.get("compile_s"), ".1f")
      lines.append(f"| {r['order']} | {r['tree']} | {row['name']} | {row['error'][:80]} | – | "
                   f"{compile_s} | – | – | – |")
      continue
    step = f"{_num(1e3 * row['step_s'], ',.1f')} ({_num(1e3 * row['step_s_min'], ',.1f')})" \
        if "step_s" in row else "–"
    mfu = f"{100 * row['mfu']:.2f} %" if isinstance(row.get("mfu"), (int, float)) else "–"
    compile_s = (f"{_num(row.get('compile_s'), '.1f')} ({_num(row.get('trace_lower_s'), '.1f')} / "
                 f"{_num(row.get('backend_compile_s'), '.1f')})")
    kernels = f"{_num(row.get('kernels'), ',d')} ({_num(row.get('kernels_distinct'), ',d')})"
    xla = _num((row.get("xla_memory_gib") or {}).get("total"), ".2f")
    lines.append(f"| {r['order']} | {r['tree']} | {row['name']} | {step} | {mfu} | {compile_s} | "
                 f"{kernels} | {xla} | {_num(row.get('loss_last'), '.4f')} |")
  return "\n".join(lines)


def differences(results: list[dict], trees: list[Tree]) -> list[dict]:
  """Each later tree against the first, round by round and variant by variant: the step's
  median and minimum in ms and per cent (positive: slower than the first tree)."""
  timed = {}
  for r in results:
    if "step_s" in r["row"]:
      timed[(r["round"], r["tree"], r["row"]["name"])] = r["row"]
  out = []
  base = trees[0].name
  for (rnd, tree, variant), row in sorted(timed.items()):
    ref = timed.get((rnd, base, variant))
    if tree == base or ref is None:
      continue
    d_med = 1e3 * (row["step_s"] - ref["step_s"])
    d_min = 1e3 * (row["step_s_min"] - ref["step_s_min"])
    out.append({"round": rnd, "tree": tree, "variant": variant,
                "median_ms": round(d_med, 1), "median_pct": round(100 * d_med / (1e3 * ref["step_s"]), 2),
                "min_ms": round(d_min, 1), "min_pct": round(100 * d_min / (1e3 * ref["step_s_min"]), 2)})
  return out


def parse_args(argv: list[str]):
  parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
  parser.add_argument("--tree", action="append", default=[], metavar="NAME=PATH|NAME=git:REV",
                      help="a source tree to run (give two or more; the first is the baseline)")
  parser.add_argument("--rounds", type=int, default=2, help="how many times each tree runs")
  parser.add_argument("--timeout", type=float, default=900.0, help="seconds per process")
  parser.add_argument("--script", default="benchmarks/train_step.py",
                      help="the benchmark, relative to each tree")
  parser.add_argument("--out", default="", help="folder for each process's output and rows.jsonl")
  argv = list(argv)
  split = argv.index("--") if "--" in argv else len(argv)
  args = parser.parse_args(argv[:split])
  args.bench_args = argv[split + 1:]
  return parser, args


def main(argv=None) -> int:
  """argv as sys.argv (argv[0] is the program's name)."""
  parser, args = parse_args((sys.argv if argv is None else argv)[1:])
  problem = None
  if len(args.tree) < 2:
    problem = f"give at least two --tree (got {len(args.tree)}): a baseline and a tree to compare"
  elif args.rounds < 1:
    problem = f"--rounds={args.rounds}: at least 1"
  elif args.timeout <= 0:
    problem = f"--timeout={args.timeout:g}: must be positive"
  if problem is None:
    try:
      specs = [parse_tree(s) for s in args.tree]
    except ValueError as e:
      problem = str(e)
  if problem is None and len({n for n, _ in specs}) < len(specs):
    problem = "two --tree entries have the same name: " + ", ".join(n for n, _ in specs)
  if problem:
    parser.print_usage(sys.stderr)
    print(f"{PROG}: error: {problem}", file=sys.stderr)
    return USAGE_ERROR
  workdir = tempfile.mkdtemp(prefix="k3_compare_trees_")
  try:
    return _compare(specs, args, workdir)
  finally:
    shutil.rmtree(workdir, ignore_errors=True)


def _compare(specs, args, workdir: str) -> int:
  try:
    trees = [materialise(n, w, args.script, workdir) for n, w in specs]
  except ValueError as e:
    print(f"{PROG}: error: {e}", file=sys.stderr)
    return USAGE_ERROR
  if args.out:
    os.makedirs(args.out, exist_ok=True)
  results = []
  for order, tree in enumerate(run_order(trees, args.rounds), start=1):
    rnd = (order - 1) // len(trees) + 1
    t0 = time.perf_counter()
    stdout, stderr, problem = run_one(tree, args.script, args.bench_args, args.timeout)
    wall = time.perf_counter() - t0
    if args.out:
      for ext, text in (("out", stdout), ("err", stderr)):
        with open(os.path.join(args.out, f"{order}_{tree.name}.{ext}"), "w") as f:
          f.write(text)
    rows = rows_of(stdout, stderr, problem)
    print(f"{order}: {tree.name} ({tree.spec}) {len(rows)} row(s) in {wall:.0f} s"
          + (f", {problem}" if problem else ""), file=sys.stderr, flush=True)
    for row in rows:
      result = {"order": order, "round": rnd, "tree": tree.name, "spec": tree.spec,
                "wall_s": round(wall, 1), "row": row}
      results.append(result)
      if args.out:
        with open(os.path.join(args.out, "rows.jsonl"), "a") as f:
          f.write(json.dumps(result) + "\n")
  print(table(results))
  diffs = differences(results, trees)
  if diffs:
    print(f"\nagainst {trees[0].name}, same round and variant (positive: slower):")
    for d in diffs:
      print(f"  round {d['round']} {d['tree']} {d['variant']}: median {d['median_ms']:+.1f} ms "
            f"({d['median_pct']:+.2f} %), min {d['min_ms']:+.1f} ms ({d['min_pct']:+.2f} %)")
  return 0 if all("error" not in r["row"] for r in results) and results else 1


if __name__ == "__main__":
  sys.exit(main())
