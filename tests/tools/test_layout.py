"""The tools modules import each other in one direction only (no circle, not even through an import inside a
function), and each imports alone in a fresh interpreter."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import hf_mars.tools

TOOLS = Path(hf_mars.tools.__file__).parent
# "group.module" for every tools module: the subpackages say which job each does
MODULES = sorted(f"{path.parent.name}.{path.stem}" for path in TOOLS.glob("*/*.py") if path.stem != "__init__")


def sibling_imports(module: str) -> set[str]:
    """The tools modules `module` imports anywhere in its code, at the top or inside a function."""
    group = module.split(".")[0]
    found = set()
    for node in ast.walk(ast.parse((TOOLS / f"{module.replace('.', '/')}.py").read_text())):
        if isinstance(node, ast.ImportFrom):
            name = node.module or ""
            if node.level == 1:  # from .x import y / from . import x: the same group
                found |= {f"{group}.{name.split('.')[0]}"} if name else {f"{group}.{a.name}" for a in node.names}
            elif node.level == 2 and name:  # from ..group.x import y / from ..group import x
                parts = name.split(".")
                found |= {".".join(parts[:2])} if len(parts) > 1 else {f"{parts[0]}.{a.name}" for a in node.names}
            elif name.startswith("hf_mars.tools."):
                found.add(".".join(name.split(".")[2:4]))
    return found & set(MODULES)


def test_no_import_circle_among_the_tools():
    graph = {module: sibling_imports(module) for module in MODULES}
    loading = "checkpoints.loading"
    assert graph[loading] <= {"checkpoints.shipped"}
    assert loading in graph["evaluate.evals"] and loading in graph["data.distillation"]
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
    code = "import sys, hf_mars.tools.checkpoints.loading, hf_mars.tools.measure.trees; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "False", result.stderr
