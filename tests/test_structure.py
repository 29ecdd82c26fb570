"""The package reads as the pipeline: kernels at the bottom, then common, then the stages in order (measure ->
learn -> table -> serve), with tune and cli on top driving them all. A module imports only its own layer and
the layers below (every import statement, module level and inside functions, relative ones resolved); serving
a table loads neither scikit-learn nor jinja2 nor the certifier."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "gemv_dispatch"
LAYERS = ("kernels", "dispatch.common", "dispatch.measure", "dispatch.learn", "dispatch.table", "dispatch.serve",
          "dispatch.top")
TOP = ("cli", "tune")  # dispatch/*.py besides __init__: they drive every stage


def module_name(path: Path) -> str:
    """gemv_dispatch.<dotted path> of a source file of the checkout."""
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join([PACKAGE, *(parts[:-1] if parts[-1] == "__init__" else parts)])


def imported_modules(path: Path, name: str | None = None) -> set[str]:
    """Absolute module names imported anywhere in the file, relative imports resolved against `name`."""
    name = name or module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def layer_of(module: str) -> int | None:
    """The layer index of a gemv_dispatch module, None for anything else."""
    parts = module.split(".")
    if parts[0] != PACKAGE or len(parts) < 2:
        return None
    if parts[1] == "kernels":
        return 0
    if parts[1] != "dispatch":
        return None
    if len(parts) == 2:
        return LAYERS.index("dispatch.common")  # the package itself holds only the version
    sub = parts[2]
    if sub in TOP:
        return LAYERS.index("dispatch.top")
    if f"dispatch.{sub}" in LAYERS:
        return LAYERS.index(f"dispatch.{sub}")
    return LAYERS.index("dispatch.common") if sub == "__version__" else None


def package_files() -> list[Path]:
    return sorted([*(REPO / "kernels").rglob("*.py"), *(REPO / "dispatch").rglob("*.py")])


def test_every_module_has_a_layer():
    assert package_files(), "no package sources found"
    unplaced = [str(p.relative_to(REPO)) for p in package_files() if layer_of(module_name(p)) is None]
    assert not unplaced, f"modules outside every layer: {unplaced}"


@pytest.mark.parametrize("path", package_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_a_module_imports_only_its_layer_and_below(path):
    own = layer_of(module_name(path))
    later = sorted(m for m in imported_modules(path) if (layer := layer_of(m)) is not None and layer > own)
    assert not later, f"{path.relative_to(REPO)} ({LAYERS[own]}) imports later layers: {later}"


def test_only_the_learn_stage_imports_scikit_learn():
    users = [str(p.relative_to(REPO)) for p in package_files()
             if any(m == "sklearn" or m.startswith("sklearn.") for m in imported_modules(p))
             and layer_of(module_name(p)) != LAYERS.index("dispatch.learn")]
    assert not users, f"scikit-learn imported outside learn/: {users}"


def test_the_walk_sees_a_later_import(tmp_path):
    """Negative control: a relative import of a later stage is resolved and found, so the check above can fail."""
    bad = tmp_path / "policy.py"
    bad.write_text("def f():\n    from ..serve.install import Table\n")
    found = imported_modules(bad, f"{PACKAGE}.dispatch.learn.policy")
    assert f"{PACKAGE}.dispatch.serve.install" in found
    assert layer_of(f"{PACKAGE}.dispatch.serve.install") > layer_of(f"{PACKAGE}.dispatch.learn.policy")


SERVING = ("gemv_dispatch.dispatch.serve.runtime", "gemv_dispatch.dispatch.serve.install")
NOT_FOR_SERVING = ("sklearn", "jinja2", "gemv_dispatch.dispatch.table.certify", "gemv_dispatch.dispatch.table.generate",
                   "gemv_dispatch.dispatch.learn.train", "gemv_dispatch.dispatch.measure.sweep")


def loaded_by(modules: tuple[str, ...]) -> set[str]:
    code = ("import importlib, json, sys\n"
            f"for m in {list(modules)!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(json.loads(out))


def test_serving_loads_no_build_pipeline():
    loaded = loaded_by(SERVING)
    assert set(SERVING) <= loaded
    heavy = sorted(m for m in NOT_FOR_SERVING if m in loaded)
    assert not heavy, f"serving a table loads {heavy}"


def test_the_serving_check_sees_a_heavy_import():
    """Negative control: importing the certifier is seen."""
    assert "jinja2" in loaded_by(("gemv_dispatch.dispatch.table.generate",))
