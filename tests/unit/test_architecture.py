"""The package's shape: no import cycles, algorithms kept apart, small files and functions,
generated docs up to date.

Imports are read from the source (every ``import`` statement, at module level or inside a
function), so a cycle that only a lazy import closes still fails here.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from sgl_spec.algorithm_list import PACKAGES

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "sgl_spec"
ALGORITHM_PACKAGES = tuple(name.rpartition(".")[2] for name in PACKAGES)
# Modules shared by every algorithm: they must not know any one of them.
SHARED = ("config.py", "flags.py", "model_defaults.py", "algorithms.py", "patches")
# MINEDRAFT's draft server can host the SpecBlock drafter (--minedraft-drafter specblock):
# these modules load, check and run it.
MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 60
HOSTS = {
    "sgl_spec.minedraft.settings": "specblock",
    "sgl_spec.minedraft.specblock_host": "specblock",
    "sgl_spec.minedraft.worker": "specblock",
}


def module_files() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def import_graph() -> dict[str, set[str]]:
    """module -> the ``sgl_spec`` modules it imports (a submodule where one is named)."""
    modules = module_files()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                ]
            else:
                continue
            for target in targets:
                resolved = resolve(target) if target.startswith("sgl_spec") else None
                if resolved and resolved != name:
                    graph[name].add(resolved)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_sees_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_algorithms_do_not_import_each_other() -> None:
    wrong = []
    for module, targets in import_graph().items():
        owner = (module.split(".") + [""])[1]
        if owner not in ALGORITHM_PACKAGES:
            continue
        for target in targets:
            other = (target.split(".") + [""])[1]
            if other in ALGORITHM_PACKAGES and other != owner and HOSTS.get(module) != other:
                wrong.append(f"{module} imports {target}")
    assert not wrong, wrong


def test_lower_layers_import_no_algorithm() -> None:
    """``config.py`` and ``common/`` import no algorithm module; the config reaches each
    algorithm's flag group through ``algorithm_list`` only, and a group (``<package>/flags.py``)
    imports nothing of sgl-spec but the flag declarations at module level."""
    graph = import_graph()
    wrong = [
        f"{module} imports {target}"
        for module, targets in graph.items()
        if module == "sgl_spec.config" or module.startswith("sgl_spec.common")
        for target in targets
        if (target.split(".") + [""])[1] in ALGORITHM_PACKAGES
    ]
    assert not wrong, wrong
    for package in PACKAGES:
        tree = ast.parse((ROOT / package.replace(".", "/") / "flags.py").read_text())
        imported = {
            node.module for node in tree.body if isinstance(node, ast.ImportFrom) and node.module
        }
        assert {m for m in imported if m.startswith("sgl_spec")} == {"sgl_spec.flags"}, package


def algorithm_mentions(source: str, words: tuple[str, ...]) -> list[str]:
    """Identifiers, imported modules and string constants of ``source`` (docstrings and comments
    aside) that contain one of ``words`` (case-insensitive)."""
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = "" if id(node) in docstrings else node.value
        elif isinstance(node, ast.Import | ast.ImportFrom):
            text = " ".join([getattr(node, "module", None) or "", *(a.name for a in node.names)])
        else:
            text = " ".join(
                str(getattr(node, key, "")) for key in ("id", "attr", "name", "arg")
            ).strip()
        if any(word in text.lower() for word in words):
            found.append(f"line {getattr(node, 'lineno', '?')}: {text[:60]!r}")
    return found


def test_algorithm_mentions_sees_a_name() -> None:
    words = ("specblock",)
    assert algorithm_mentions('"""SPECBLOCK here is fine."""\nx = 1\n', words) == []
    assert algorithm_mentions("from sgl_spec.specblock import flags\n", words)
    assert algorithm_mentions("if name == 'SPECBLOCK':\n    pass\n", words)


def shared_files() -> list[Path]:
    files = []
    for entry in SHARED:
        path = PACKAGE / entry
        files += sorted(path.glob("*.py")) if path.is_dir() else [path]
    return files


def test_shared_modules_name_no_algorithm() -> None:
    """An algorithm's flags, defaults, draft shape and KV needs live in its own package; the
    shared modules reach them through ``algorithm_list`` and the ``Algorithm`` interface."""
    from sgl_spec.algorithms import all_algorithms

    words = (*ALGORITHM_PACKAGES, *(a.name.lower() for a in all_algorithms()))
    wrong = {}
    for path in shared_files():
        found = algorithm_mentions(path.read_text(), words)
        if found:
            wrong[str(path.relative_to(ROOT))] = found
    assert not wrong, wrong


def oversized(files: dict[str, Path]) -> list[str]:
    """Files over ``MAX_FILE_LINES`` lines and functions over ``MAX_FUNCTION_LINES``."""
    found = []
    for module, path in files.items():
        source = path.read_text()
        if len(source.splitlines()) > MAX_FILE_LINES:
            found.append(f"{module}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{module}.{node.name}: {length} lines")
    return found


def test_oversized_sees_a_long_function(tmp_path: Path) -> None:
    path = tmp_path / "long.py"
    path.write_text("def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES)
    assert oversized({"long": path}) == [f"long.f: {MAX_FUNCTION_LINES + 1} lines"]


def test_files_and_functions_stay_small() -> None:
    assert not oversized(module_files()), oversized(module_files())


def test_flags_doc_is_generated_from_the_config() -> None:
    generated = subprocess.run(
        [sys.executable, "-m", "sgl_spec.config"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    assert (ROOT / "docs" / "flags.md").read_text() == generated, (
        "docs/flags.md is stale: python -m sgl_spec.config > docs/flags.md"
    )


def test_patches_doc_is_generated_from_the_patches() -> None:
    generated = subprocess.run(
        [sys.executable, "-m", "sgl_spec.patches"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    assert (ROOT / "docs" / "patches.md").read_text() == generated, (
        "docs/patches.md is stale: python -m sgl_spec.patches > docs/patches.md"
    )
