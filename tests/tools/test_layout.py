"""The tools modules import each other in one direction only (no circle, not even through an import inside a
function), and each imports alone in a fresh interpreter."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import hf_mars.tools

TOOLS = Path(hf_mars.tools.__file__).parent
MODULES = sorted(path.stem for path in TOOLS.glob("*.py") if path.stem != "__init__")


def sibling_imports(module: str) -> set[str]:
    """The tools modules `module` imports anywhere in its code, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse((TOOLS / f"{module}.py").read_text())):
        if isinstance(node, ast.ImportFrom):
            name = node.module or ""
            if node.level == 1:  # from .x import y / from . import x
                found |= {name.split(".")[0]} if name else {alias.name for alias in node.names}
            elif name.startswith("hf_mars.tools."):
                found.add(name.split(".")[2])
    return found & set(MODULES)


def test_no_import_circle_among_the_tools():
    graph = {module: sibling_imports(module) for module in MODULES}
    assert graph["loading"] <= {"shipped"} and "loading" in graph["evals"] and "loading" in graph["distillation"]
    done, path = set(), []

    def visit(module):
        assert module not in path, f"import circle: {' -> '.join(path[path.index(module) :] + [module])}"
        if module in done:
            return
        path.append(module)
        for imported in graph[module]:
            visit(imported)
        path.pop()
        done.add(module)

    for module in MODULES:
        visit(module)


def test_each_tools_module_imports_alone():
    for module in MODULES:
        result = subprocess.run(
            [sys.executable, "-c", f"import hf_mars.tools.{module}"], capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, f"hf_mars.tools.{module}: {result.stderr[-2000:]}"


def test_the_shared_helpers_load_no_torch():
    """cli builds its parsers from these: `hf-mars --help` must not wait for torch."""
    code = "import sys, hf_mars.tools.loading, hf_mars.tools.trees; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "False", result.stderr
