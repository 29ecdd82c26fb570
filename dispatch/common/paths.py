"""Where the tool reads its reference data and writes its results; each location overridable.

- Reference data, read-only (`data_dir()`): the shape inventories (corpus/shapes/), the committed corpora
  (corpus/<gpu>/) and the committed certified tables (generated/<gpu>/). They ship inside the package, so an
  installed tool finds them; `GEMV_DISPATCH_DATA` points elsewhere.
- Work folder (`home_dir()`): where a sweep writes corpora (corpus/<gpu>/) and `generate` writes modules
  (generated/<gpu>/). `GEMV_DISPATCH_HOME`, else the source checkout when the package runs from one (so a
  developer's sweep extends the committed corpus), else `$XDG_DATA_HOME/gemv-dispatch`.
- Installed tables (`tables_dir()`): `GEMV_DISPATCH_TABLES`, else `$XDG_DATA_HOME/gemv-dispatch/tables`.
Command-line flags override all three.
"""

from __future__ import annotations

import os
from pathlib import Path

DATA_ENV = "GEMV_DISPATCH_DATA"
HOME_ENV = "GEMV_DISPATCH_HOME"
TABLES_ENV = "GEMV_DISPATCH_TABLES"
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the checkout, or site-packages/gemv_dispatch


def _xdg_data() -> Path:
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "gemv-dispatch"


def data_dir() -> Path:
    """The folder holding corpus/ and generated/ as shipped (read-only reference data)."""
    return Path(os.environ[DATA_ENV]) if os.environ.get(DATA_ENV) else _PACKAGE_ROOT


def source_checkout() -> Path | None:
    """The source checkout the package runs from (editable install or PYTHONPATH), else None."""
    return _PACKAGE_ROOT if (_PACKAGE_ROOT / "pyproject.toml").is_file() else None


def home_dir() -> Path:
    """The work folder: corpus/<gpu>/ and generated/<gpu>/ are written below it."""
    if os.environ.get(HOME_ENV):
        return Path(os.environ[HOME_ENV])
    return source_checkout() or _xdg_data()


def tables_dir() -> Path:
    """Where `install` puts certified tables and the runtime looks for them: <tables_dir>/<gpu-slug>/."""
    return Path(os.environ[TABLES_ENV]) if os.environ.get(TABLES_ENV) else _xdg_data() / "tables"


def shapes_dir() -> Path:
    """The shipped shape inventories."""
    return data_dir() / "corpus" / "shapes"
