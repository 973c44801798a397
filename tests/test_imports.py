"""The package's imports run one way (WORKSPACE.md, "Layers"): no cycles between modules, and no
module imports a layer above its own. Parsed from the sources (function-level imports included),
so nothing is executed."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("k3train", "pallas_kernels")

# Layer of each group; a module may import its own group and groups of a lower layer only.
LAYERS = {
    "pallas_kernels": 0, "k3train": 0, "k3train.tree_paths": 0, "k3train.defaults": 0,
    "k3train.quant": 0,
    "k3train.config": 1,
    "k3train.cli": 2, "k3train.parallel": 2,
    "k3train.data": 3, "k3train.model": 3,
    "k3train.optim": 4,
    "k3train.train": 5,
    "k3train.tools": 6,
    "k3train.main": 7,
}


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
  return {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def _imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
  """Project modules imported anywhere in the file (resolved to the longest known module)."""
  out = set()
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    targets = []
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
      # `from pkg import name`: the submodule pkg.name if there is one, else pkg itself.
      targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    for t in targets:
      while t and t not in known:
        t = t.rpartition(".")[0]
      if t and t != name:
        out.add(t)
  return out


def _group(module: str) -> str:
  # k3train/__init__.py itself is layer 0 (it must import nothing); its modules have their own.
  for g in sorted(LAYERS, key=len, reverse=True):
    if module == g or (g != "k3train" and module.startswith(g + ".")):
      return g
  raise AssertionError(f"{module} belongs to no layer; add its group to LAYERS and WORKSPACE.md")


GRAPH = None


def _graph() -> dict[str, set[str]]:
  global GRAPH
  if GRAPH is None:
    mods = _modules()
    GRAPH = {m: _imports(m, p, set(mods)) for m, p in mods.items()}
  return GRAPH


def test_every_module_has_a_layer():
  for module in _graph():
    _group(module)


def test_no_module_imports_a_higher_or_sibling_layer():
  bad = []
  for module, deps in _graph().items():
    g = _group(module)
    for dep in deps:
      h = _group(dep)
      if h != g and LAYERS[h] >= LAYERS[g]:
        bad.append(f"{module} (layer {LAYERS[g]}) imports {dep} (layer {LAYERS[h]})")
  assert not bad, "imports against the layer order:\n" + "\n".join(sorted(bad))


def test_no_import_cycles():
  graph = _graph()
  state: dict[str, int] = {}
  stack: list[str] = []
  cycles = []

  def visit(m):
    state[m] = 1
    stack.append(m)
    for d in sorted(graph[m]):
      if state.get(d) == 1:
        cycles.append(stack[stack.index(d):] + [d])
      elif d not in state:
        visit(d)
    stack.pop()
    state[m] = 2

  for m in sorted(graph):
    if m not in state:
      visit(m)
  assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("source, expected", [
    ("from k3train.model import decoder\n", {"k3train.model.decoder"}),
    ("import k3train.parallel.rules as r\n", {"k3train.parallel.rules"}),
    ("def f():\n  from k3train.train import loop\n", {"k3train.train.loop"}),
])
def test_the_parser_sees_imports(tmp_path, source, expected):
  """The checker itself: top-level, aliased and function-level imports are all found."""
  f = tmp_path / "m.py"
  f.write_text(source)
  known = {"k3train.model.decoder", "k3train.parallel.rules", "k3train.train.loop", "k3train.model"}
  assert _imports("x.m", f, known) == expected
