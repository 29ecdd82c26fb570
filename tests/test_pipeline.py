"""The pipeline reads as a straight line: a stage imports `kernels` and earlier stages only, `kernels` never
imports `dispatch`, and only the learning stages import scikit-learn. Checked on the source by walking every
import statement (module level and inside functions)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "gemv_dispatch"
# Utilities first, then the stages in pipeline order; cli drives them all.
ORDER = ("__init__", "paths", "files", "environment", "shapes", "timing", "corpus", "gpulock", "sweep", "fleet",
         "features", "policy", "train", "evaluate", "explain", "certify", "generate", "install", "runtime",
         "check", "tune", "cli")
LEARNING = ("train", "evaluate")


def imported_modules(path: Path) -> set[str]:
    """Absolute module names imported anywhere in the file."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def stage_of(module: str) -> str | None:
    prefix = f"{PACKAGE}.dispatch."
    if module == f"{PACKAGE}.dispatch":
        return "__init__"
    return module[len(prefix):].split(".")[0] if module.startswith(prefix) else None


def test_every_dispatch_module_has_a_place_in_the_order():
    assert {p.stem for p in (REPO / "dispatch").glob("*.py")} == set(ORDER)


@pytest.mark.parametrize("stage", ORDER)
def test_a_stage_imports_only_earlier_stages(stage):
    earlier = set(ORDER[: ORDER.index(stage)]) | {"__init__"}
    later = {s for m in imported_modules(REPO / "dispatch" / f"{stage}.py")
             if (s := stage_of(m)) is not None and s in ORDER and s not in earlier}
    assert not later, f"dispatch/{stage}.py imports later stages {sorted(later)}"


def test_kernels_never_import_dispatch():
    offenders = {p.name: sorted(m for m in imported_modules(p) if stage_of(m) or m == f"{PACKAGE}.dispatch")
                 for p in (REPO / "kernels").glob("*.py")}
    assert not {k: v for k, v in offenders.items() if v}


def test_only_the_learning_stages_import_scikit_learn():
    users = {p.stem for p in (REPO / "dispatch").glob("*.py")
             if any(m == "sklearn" or m.startswith("sklearn.") for m in imported_modules(p))}
    assert users <= set(LEARNING), f"scikit-learn imported by {sorted(users - set(LEARNING))}"


def test_the_walk_sees_a_later_import(tmp_path):
    """Negative control: an import of a later stage is found, so the checks above can fail."""
    bad = tmp_path / "policy.py"
    bad.write_text("def f():\n    from gemv_dispatch.dispatch.serve.install import Table\n")
    assert "install" in {stage_of(m) for m in imported_modules(bad)}
