"""The package layout is the architecture: layers import only downward, no cycles.

Reads every module of ``kvd``, ``kvd_client`` and ``kvd_protocol`` with
``ast`` (imports inside functions count too) and checks the rules the
packages' docstrings state: each package imports only the packages listed
for it below, no module imports another module's private (``_``) names, no
import cycle exists between modules, and no module grows past the size we
keep files at.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"kvd": ROOT / "kvd", "kvd_client": ROOT / "clients" / "kvd_client",
           "kvd_protocol": ROOT / "clients" / "kvd_protocol"}
MAX_LINES = 420

# package -> the packages its modules may import (besides its own modules); "kvd" is the
# top package itself and its plain modules (its __version__, kvd.quota_rules,
# kvd.config_checks; of kvd's own they import only kvd.sizes). TIERS: kvd.tiers' subpackages,
# in layer order (each may import those before it), and its top package of shared modules.
TIERS = ("kvd.tiers.host", "kvd.tiers.disk", "kvd.tiers.remote", "kvd.tiers")
ALLOWED = {
    "kvd_protocol": set(),
    "kvd_client": {"kvd_protocol"},
    "kvd_client.vllm": {"kvd_client", "kvd_protocol"},
    "kvd_client.sglang": {"kvd_client", "kvd_protocol"},
    "kvd": {"kvd.sizes", "kvd_protocol"},
    "kvd.sizes": set(),
    "kvd.knobs": {"kvd", "kvd.sizes", "kvd_protocol"},
    "kvd.config": {"kvd", "kvd.knobs", "kvd.sizes", "kvd_protocol"},
    "kvd.config_env": {"kvd.config"},
    "kvd.tiers": {"kvd_protocol"},
    "kvd.tiers.host": {"kvd.tiers", "kvd_protocol"},
    "kvd.tiers.disk": {"kvd.tiers", "kvd.tiers.host", "kvd_protocol"},
    "kvd.tiers.remote": {"kvd.tiers", *TIERS[:2], "kvd_protocol"},
    "kvd.copy": {"kvd_protocol"},
    "kvd.cuda.dma": {"kvd_protocol"},
    "kvd.cuda": {"kvd.cuda.dma", "kvd.copy", *TIERS, "kvd_protocol"},
    "kvd.server": {"kvd", "kvd.cuda", "kvd.cuda.dma", "kvd.copy", *TIERS, "kvd.config", "kvd.config_env",
                   "kvd_protocol"},
    "kvd.bench": {"kvd.server", "kvd.cuda", *TIERS, "kvd.config", "kvd_client", "kvd_protocol"},
    "kvd.cli": {"kvd", "kvd.bench", "kvd.server", "kvd.config", "kvd.config_env", "kvd_client",
                "kvd_protocol"},
    "kvd.__main__": {"kvd.cli"},
}
OURS = ("kvd", "kvd_client", "kvd_protocol")


def _modules() -> dict[str, Path]:
    out = {}
    for top, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([top, *parts])] = path
    return out


MODULES = _modules()


def _owner(module: str) -> str:
    """The package a module belongs to, as the keys of ALLOWED name them."""
    for prefix in sorted(ALLOWED, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return prefix
    raise AssertionError(f"{module} belongs to no package of ALLOWED: add it there")


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    is_package = MODULES[module].name == "__init__.py"
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) of our own modules."""
    tree = ast.parse(MODULES[module].read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, node)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.append((sub, None, node.lineno) if sub in MODULES
                             else (target, alias.name, node.lineno))
    return [(m, n, line) for m, n, line in found if m.split(".")[0] in OURS]


GRAPH = {m: _imports(m) for m in MODULES}


def test_every_module_is_placed():
    assert len(MODULES) > 30
    for module in MODULES:
        _owner(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_only_downward(module):
    owner = _owner(module)
    for target, _, line in GRAPH[module]:
        if target not in MODULES:
            raise AssertionError(f"{module}:{line} imports {target}, which does not exist")
        dest = _owner(target)
        assert dest == owner or dest in ALLOWED[owner], \
            f"{module}:{line} imports {target}: {owner} may import only {sorted(ALLOWED[owner])}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_names_across_modules(module):
    for target, name, line in GRAPH[module]:
        dunder = name is not None and name.startswith("__") and name.endswith("__")  # __version__
        if name is not None and name.startswith("_") and not dunder and target != module:
            raise AssertionError(f"{module}:{line} imports the private name {name} of {target}")


def test_no_import_cycles():
    edges = {m: sorted({t for t, _, _ in GRAPH[m] if t in MODULES and t != m}) for m in MODULES}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for nxt in edges[module]:
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt] if nxt in path else [module, nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[module] = 2

    for module in sorted(MODULES):
        if module not in state:
            visit(module, [module])


def test_the_checker_sees_cycles_and_private_names():
    """The rules above would fire: a made-up graph with a cycle, a real private import."""
    saved = dict(GRAPH)
    try:
        GRAPH["kvd.tiers.host.tier"] = saved["kvd.tiers.host.tier"] + [("kvd.tiers.host.arena", None, 1)]
        GRAPH["kvd.tiers.host.arena"] = saved["kvd.tiers.host.arena"] + [("kvd.tiers.host.tier", "_x", 1)]
        with pytest.raises(AssertionError, match="import cycle"):
            test_no_import_cycles()
        with pytest.raises(AssertionError, match="private name _x"):
            test_no_private_names_across_modules("kvd.tiers.host.arena")
        GRAPH["kvd.tiers.host.arena"] = saved["kvd.tiers.host.arena"] + [("kvd.server.daemon", None, 1)]
        with pytest.raises(AssertionError, match="may import only"):
            test_imports_go_only_downward("kvd.tiers.host.arena")
    finally:
        GRAPH.clear()
        GRAPH.update(saved)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_modules_stay_small(module):
    lines = MODULES[module].read_text().count("\n")
    assert lines <= MAX_LINES, f"{MODULES[module]} has {lines} lines; split it (limit {MAX_LINES})"


@pytest.mark.parametrize("package", sorted(p for p in MODULES if MODULES[p].name == "__init__.py"))
def test_every_package_states_its_contract(package):
    doc = ast.get_docstring(ast.parse(MODULES[package].read_text())) or ""
    assert len(doc.split()) >= 20, f"{package}/__init__.py needs a docstring stating its contract"


def test_the_client_needs_nothing_of_the_daemon():
    """An engine's environment has kvd_client and kvd_protocol, never the daemon."""
    import subprocess
    import sys
    code = ("import sys; sys.modules['kvd'] = None\n"
            "import kvd_client, kvd_client.torch_pool, kvd_client.transport, kvd_protocol.wire\n"
            "pool = kvd_client.SharedKVPool('vllm_flash_attn', 2, 4, 4, 2, 8)\n"
            "client = kvd_client.KvdClient(runtime_dir='/nonexistent-kvd-dir', timeout=0.2)\n"
            "pool.close(); print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


MAX_DOC_LINES = 12


def _docstring_lines(source: str) -> int:
    """Source lines the module docstring spans, quotes included (0 without one)."""
    body = ast.parse(source).body
    first = body[0] if body else None
    if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)):
        return 0
    return first.end_lineno - first.lineno + 1


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_contracts_fit_a_screen(module):
    """A module opens with its contract (owns, promises, never does) in at most 12 lines;
    how a request flows through the modules is told once, in docs/architecture.md."""
    lines = _docstring_lines(MODULES[module].read_text())
    assert lines <= MAX_DOC_LINES, (f"{MODULES[module]}: module docstring is {lines} lines; "
                                    f"keep the contract to {MAX_DOC_LINES}, the story in docs")


def test_the_docstring_counter_counts_lines():
    assert _docstring_lines('"""One line."""\nx = 1\n') == 1
    assert _docstring_lines('"""Contract.\n' + "more\n" * 12 + '"""\n') == 14
    assert _docstring_lines("x = 1\n") == 0
