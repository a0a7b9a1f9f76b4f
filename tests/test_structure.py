"""The house's structure: dependencies point down, and there is no import circle.

Reads the source (every ``import``, at module level or inside a function) of ``tensorhub``,
the one top-level package the wheel installs (the engine adapters are
``tensorhub.integrations.<engine>``); nothing is imported or run. Fails on the rest of
``tensorhub`` importing the adapters (they register through entry points instead), on one engine
adapter (vLLM, SGLang) or framework backend (verl) importing another, or the adapters' core
importing any (what they share lives in ``tensorhub.integrations._core``), on an adapter
importing a private tensorhub module, on the project declaring a second top-level package, and
on the coordinator's inside (``tensorhub.server``) importing the client side or being imported
by anything but what starts a coordinator, and on any circle of modules importing each other,
naming the modules of each circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tensorhub",)
ADAPTERS = "tensorhub.integrations"


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            parts = list(p.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = p
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ours that ``name`` imports (``from pkg import mod`` counts as ``pkg.mod``)."""
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                stem = base[: len(base) - node.level + 1]
                mod = ".".join(stem + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" for a in node.names] + [mod]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {m: _imports(m, p, known) for m, p in mods.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _package_faces(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """A package's ``__init__`` re-exporting its own submodules is not a circle of design:
    drop the edges from a package to modules inside it."""
    return {m: {t for t in deps if not t.startswith(m + ".")} for m, deps in graph.items()}


def test_the_graph_is_read():
    g = _graph()
    assert "tensorhub._fetch" in g["tensorhub.hub"] and "tensorhub._session" in g["tensorhub._fetch"]
    assert "tensorhub.follow" in g[f"{ADAPTERS}.vllm.follow"]
    assert f"{ADAPTERS}._core.worker" in g[f"{ADAPTERS}.sglang.pull"]
    assert f"{ADAPTERS}._core.worker" in g[f"{ADAPTERS}.verl.engine"]


def _adapter(module: str) -> bool:
    return module == ADAPTERS or module.startswith(ADAPTERS + ".")


def test_tensorhub_never_imports_the_engine_adapters():
    bad = sorted((m, t) for m, deps in _graph().items() if not _adapter(m)
                 for t in deps if _adapter(t))
    assert not bad, f"tensorhub imports its engine adapters (register a driver instead): {bad}"


def test_the_project_declares_one_top_level_package():
    """The wheel installs ``tensorhub`` only (tests/test_wheel.py checks the built wheel):
    no generic top-level name such as ``integrations`` that other distributions use too."""
    import tomllib

    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert find["include"] == ["tensorhub*"], find
    tops = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file())
    assert tops == ["tensorhub"], f"top-level packages in the checkout: {tops}"


@pytest.mark.parametrize("engine, other", [("vllm", "sglang"), ("sglang", "vllm"), ("vllm", "verl"),
                                           ("verl", "vllm"), ("sglang", "verl"), ("verl", "sglang")])
def test_an_engine_adapter_never_imports_the_other(engine, other):
    """What both engines need is in the core (``tensorhub.integrations._core``), below both."""
    bad = sorted((m, t) for m, deps in _graph().items() if m.startswith(f"{ADAPTERS}.{engine}")
                 for t in deps if t.startswith(f"{ADAPTERS}.{other}"))
    assert not bad, f"{engine} imports {other} (share it through {ADAPTERS}._core): {bad}"


def test_the_adapters_core_imports_no_adapter():
    bad = sorted((m, t) for m, deps in _graph().items() if m.startswith(f"{ADAPTERS}._core")
                 for t in deps if t.startswith(tuple(f"{ADAPTERS}.{e}" for e in ("vllm", "sglang", "verl"))))
    assert not bad, f"{ADAPTERS}._core imports an engine adapter: {bad}"


#: What the coordinator's inside (``tensorhub.server``) may import beside itself: the wire
#: (``tensorhub.protocol``) and the pure pieces it shares with readers. Never the client side
#: (``hub``, its reads, its session, the transports).
SERVER_USES = {"tensorhub", "tensorhub._addresses", "tensorhub._checksum", "tensorhub._exceptions",
               "tensorhub._kept", "tensorhub._metrics", "tensorhub._planner", "tensorhub._slices"}
#: Who starts a coordinator: the only modules outside ``tensorhub.server`` that import it.
SERVER_STARTERS = {"tensorhub.coordinator", "tensorhub.cli"}


def _server(module: str) -> bool:
    return module == "tensorhub.server" or module.startswith("tensorhub.server.")


def test_the_coordinator_and_the_client_are_packages_apart():
    g = _graph()
    assert "tensorhub.server.state" in g["tensorhub.server.grants"] or \
        "tensorhub.server.grants" in g["tensorhub.server.state"]  # (the graph sees the package)
    out = sorted((m, t) for m, deps in g.items() if _server(m) for t in deps
                 if not _server(t) and t not in SERVER_USES and not t.startswith("tensorhub.protocol"))
    assert not out, f"the coordinator imports the client side: {out}"
    into = sorted((m, t) for m, deps in g.items() if not _server(m) and m not in SERVER_STARTERS
                  for t in deps if _server(t))
    assert not into, f"only {sorted(SERVER_STARTERS)} import tensorhub.server: {into}"


def test_no_import_circle():
    circles = _circles(_package_faces(_graph()))
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)


def test_a_circle_is_found_when_there_is_one():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _private_uses(path: Path) -> list[str]:
    """``tensorhub`` privates an adapter module imports: a ``_module`` on the path, or a
    ``_name`` taken from a public one. The adapters' own modules (``tensorhub.integrations``,
    its ``_core`` among them) are theirs to import."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.split(".")[0] == "tensorhub" and not _adapter(a.name)
                    and any(p.startswith("_") for p in a.name.split("."))]
        elif (isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "tensorhub"
              and not _adapter(node.module or "")):
            mod = node.module or ""
            out += [f"{mod}.{a.name}" for a in node.names
                    if any(p.startswith("_") for p in mod.split(".")) or a.name.startswith("_")]
    return out


def test_the_adapters_import_only_tensorhubs_public_names():
    """Adapters speak to tensorhub through its public modules (``tensorhub``, ``.protocol``,
    ``.coordinator``, ``.follow``, ``.config``, ``.envs``, ``.testing``, ...), never a
    ``_private`` module or name, so tensorhub's insides can move without breaking them."""
    bad = {str(p.relative_to(ROOT)): u for p in (ROOT / "tensorhub" / "integrations").rglob("*.py")
           if (u := _private_uses(p))}
    assert not bad, f"adapters import tensorhub privates: {bad}"


def test_a_private_import_is_found(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("import tensorhub._fetch\nfrom tensorhub.coordinator import _bind\nfrom tensorhub import _wire, hub\n"
                 "def f():\n    from tensorhub._slices import SLICED\n"
                 "from tensorhub.integrations._core import worker\nimport tensorhub.integrations._core.load\n")
    assert sorted(_private_uses(p)) == ["tensorhub._fetch", "tensorhub._slices.SLICED", "tensorhub._wire",
                                        "tensorhub.coordinator._bind"]
