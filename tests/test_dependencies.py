"""pyproject.toml declares what the code imports, and nothing it does not: every third-party module a tracked
Python file imports (or looks up with importlib) belongs to a declared distribution, and every declared
distribution is imported somewhere."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LOCAL = {"reference", "optimized", "conformance", "sentinels", "perf", "tests", "noxfile", "conftest"}
TOP_LEVEL_SKIPPED = {"build", "dist", "runs", "data"}  # build outputs, training runs, downloaded data
# distribution name -> the module it provides, where the two differ beyond '-' vs '_'
MODULE_OF = {"pyyaml": "yaml", "pytest-xdist": "xdist", "fla-core": "fla"}
LOOKUPS = {"find_spec", "import_module", "importorskip"}


def python_files() -> list[Path]:
    files = []
    for path in REPO.rglob("*.py"):
        folders = path.relative_to(REPO).parts[:-1]
        if folders and folders[0] in TOP_LEVEL_SKIPPED:
            continue
        if not any(part.startswith(".") or part.endswith(".egg-info") for part in folders):
            files.append(path)
    return files


def imported_modules(source: str) -> set[str]:
    """Top-level names of absolute imports and of constant-string importlib lookups."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in LOOKUPS and re.fullmatch(r"[A-Za-z_][\w.]*", node.args[0].value):
                names.add(node.args[0].value.split(".")[0])
    return names


def third_party_imports() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in python_files():
        for name in imported_modules(path.read_text()) - LOCAL - set(sys.stdlib_module_names) - {"__future__"}:
            if (path.parent / f"{name}.py").is_file() or (path.parent / name).is_dir():
                continue  # a module beside the importing file (a test helper on pytest's rootdir path)
            found.setdefault(name, []).append(str(path.relative_to(REPO)))
    return found


def declared_distributions() -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    return {re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower() for req in requirements}


def module_of(distribution: str) -> str:
    return MODULE_OF.get(distribution, distribution.replace("-", "_"))


def test_the_import_scan_sees_imports_and_lookups():
    source = ("import torch.nn\nfrom yaml import safe_load\nfrom . import local\nimport importlib\n"
              "importlib.util.find_spec('gensim')\nimportlib.import_module('fla.ops')\nfind_spec(name)\n")
    assert imported_modules(source) == {"torch", "yaml", "importlib", "gensim", "fla"}


def test_every_imported_module_is_declared():
    declared = {module_of(d) for d in declared_distributions()}
    undeclared = {name: files[:3] for name, files in third_party_imports().items() if name not in declared}
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"


def test_every_declared_distribution_is_imported():
    imported = set(third_party_imports())
    unused = sorted(d for d in declared_distributions() if module_of(d) not in imported)
    assert not unused, f"declared in pyproject.toml but imported nowhere: {unused}"
