"""The pipeline reads as a straight line: a module of dispatch/ imports `kernels` and modules earlier in ORDER only,
`kernels` never imports `dispatch`, and only the learning modules import scikit-learn. Checked on the source by
walking every import statement (module level and inside functions; relative imports resolved against the file's
package)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "gemv_dispatch"
DISPATCH = f"{PACKAGE}.dispatch"
# The modules of dispatch/ by folder: the shared utilities first, then the stages in pipeline order (check re-runs a
# certificate's checks on an installed table, so it follows serve's modules); tune and cli drive them all.
ORDER = ("__init__", "common.__init__", "common.paths", "common.files", "common.environment",
         "measure.__init__", "measure.shapes", "measure.timing", "measure.corpus", "measure.gpulock", "measure.sweep",
         "measure.fleet",
         "learn.__init__", "learn.features", "learn.policy", "learn.train", "learn.evaluate", "learn.explain",
         "table.__init__", "table.certify", "table.generate",
         "serve.__init__", "serve.install", "serve.runtime",
         "table.check", "tune", "cli")
LEARNING = ("learn.train", "learn.evaluate")


def package_of(path: Path) -> str:
    """The package a source file of the checkout belongs to (kernels/ and dispatch/ install under PACKAGE)."""
    return ".".join([PACKAGE, *path.parent.relative_to(REPO).parts])


def imported_modules(path: Path, package: str | None = None) -> set[str]:
    """Absolute module names imported anywhere in the file, relative imports resolved against `package` (default:
    the file's own, where it lies in the checkout)."""
    if package is None and path.is_relative_to(REPO):
        package = package_of(path)
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module
            if node.level:
                assert package, f"{path}: a relative import outside a package"
                parts = package.split(".")
                anchor = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{anchor}.{node.module}" if node.module else anchor
            if base:
                names.add(base)
                names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def module_of(name: str) -> str | None:
    """The ORDER entry an absolute module (or attribute) name belongs to; None outside dispatch."""
    if name == DISPATCH:
        return "__init__"
    if not name.startswith(DISPATCH + "."):
        return None
    parts = name[len(DISPATCH) + 1:].split(".")
    for width in (2, 1):
        if (key := ".".join(parts[:width])) in ORDER:
            return key
    if f"{parts[0]}.__init__" in ORDER:
        return f"{parts[0]}.__init__"  # the subpackage itself, or one of its attributes
    return "__init__"  # an attribute of the package (__version__)


def dispatch_modules() -> dict[str, Path]:
    """ORDER key -> file of every module under dispatch/."""
    found = {}
    for path in (REPO / "dispatch").rglob("*.py"):
        parts = path.relative_to(REPO / "dispatch").with_suffix("").parts
        found[".".join(parts)] = path
    return found


def test_every_dispatch_module_has_a_place_in_the_order():
    assert set(dispatch_modules()) == set(ORDER)


@pytest.mark.parametrize("stage", ORDER)
def test_a_stage_imports_only_earlier_stages(stage):
    earlier = set(ORDER[: ORDER.index(stage)]) | {"__init__", stage}
    later = {s for m in imported_modules(dispatch_modules()[stage])
             if (s := module_of(m)) is not None and s not in earlier}
    assert not later, f"dispatch/{stage.replace('.', '/')}.py imports later stages {sorted(later)}"


def test_kernels_never_import_dispatch():
    offenders = {p.name: sorted(m for m in imported_modules(p) if module_of(m))
                 for p in (REPO / "kernels").glob("*.py")}
    assert not {k: v for k, v in offenders.items() if v}


def test_only_the_learning_stages_import_scikit_learn():
    users = {key for key, p in dispatch_modules().items()
             if any(m == "sklearn" or m.startswith("sklearn.") for m in imported_modules(p))}
    assert users <= set(LEARNING), f"scikit-learn imported by {sorted(users - set(LEARNING))}"
    assert users, "no module imports scikit-learn: the walk misses the learning stages' imports"


def test_the_walk_sees_a_later_import(tmp_path):
    """Negative control: an import of a later stage is found, absolute or relative, so the checks above can fail."""
    bad = tmp_path / "policy.py"
    bad.write_text("def f():\n    from gemv_dispatch.dispatch.serve.install import Table\n"
                   "from ..serve import runtime\nfrom ..table.check import check\n")
    found = {module_of(m) for m in imported_modules(bad, f"{DISPATCH}.learn")}
    assert {"serve.install", "serve.runtime", "table.check"} <= found
    assert module_of(f"{DISPATCH}.measure.corpus.Corpus") == "measure.corpus" and module_of("numpy") is None
