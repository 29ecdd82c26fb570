"""Where the tool reads its reference data and writes its results; each location overridable.

- Reference data, read-only (`data_dir()`): the shape inventories (corpus/shapes/), the committed corpora
  (corpus/<gpu>/) and the committed certified tables (generated/<gpu>/). They ship inside the package, so an
  installed tool finds them; `GEMV_DISPATCH_DATA` points elsewhere.
- Work folder (`home_dir()`): where a sweep writes corpora (corpus/<gpu>/) and `generate` writes modules
  (generated/<gpu>/). `GEMV_DISPATCH_HOME`, else the source checkout when the package runs from one (so a
  developer's sweep extends the committed corpus), else `$XDG_DATA_HOME/gemv-dispatch`.
- Installed tables (`tables_dir()`): `GEMV_DISPATCH_TABLES`, else `$XDG_DATA_HOME/gemv-dispatch/tables`.
- Sweep locks (`lock_dir()`): `GEMV_DISPATCH_LOCKS`, else `$XDG_RUNTIME_DIR/gemv-dispatch`, else
  /tmp/gemv-dispatch-locks.
Command-line flags override them. `gemv-dispatch paths` prints them all; `resolve` turns what a user names (a
folder, or a GPU model such as nvidia-h200) into the corpus or table folder it means.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from ...kernels.errors import InputError
from .gpu import gpu_slug

DATA_ENV = "GEMV_DISPATCH_DATA"
HOME_ENV = "GEMV_DISPATCH_HOME"
TABLES_ENV = "GEMV_DISPATCH_TABLES"
LOCKS_ENV = "GEMV_DISPATCH_LOCKS"
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


def lock_dir() -> Path:
    """GEMV_DISPATCH_LOCKS, else $XDG_RUNTIME_DIR/gemv-dispatch (per user, cleared at logout), else
    /tmp/gemv-dispatch-locks (shared by every user of the machine, as the GPUs are)."""
    if os.environ.get(LOCKS_ENV):
        return Path(os.environ[LOCKS_ENV])
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return Path(runtime) / "gemv-dispatch" if runtime else Path("/tmp/gemv-dispatch-locks")


Kind = Literal["corpus", "generated"]
# What makes a folder under corpus/ or generated/ one of that kind (shapes/ under corpus/ is none).
_MARKER: dict[str, str] = {"corpus": "manifest.json", "generated": "certificate.json"}
_WHAT: dict[str, str] = {"corpus": "corpus", "generated": "table"}


def _roots() -> list[Path]:
    """Where a GPU model's folders are looked for, in order: the work folder, then the shipped data."""
    return list(dict.fromkeys((home_dir(), data_dir())))


def known(kind: Kind) -> list[str]:
    """The GPU models (slugs) with a folder of `kind` in the work folder or the shipped data."""
    return sorted({p.parent.name for root in _roots() for p in (root / kind).glob(f"*/{_MARKER[kind]}")})


def resolve(given: str | os.PathLike[str], kind: Kind) -> Path:
    """The corpus or table folder (`kind` "corpus" or "generated") a user means by `given`: the path itself when
    it exists; else a GPU model ("nvidia-h200", "NVIDIA H200") or the README's spelling of its folder
    ("corpus/nvidia-h200", "generated/nvidia-h200/"), looked up in the work folder, then in the shipped data.
    InputError naming where it looked and the models found there when nothing matches, or when the path is a
    file."""
    path = Path(given)
    if path.exists():
        if not path.is_dir():
            raise InputError(f"{path}: a file, not a {_WHAT[kind]} folder")
        return path
    parts = path.parts
    name = parts[-1] if len(parts) == 1 or (len(parts) == 2 and parts[0] == kind) else None
    if name is not None:
        slug = gpu_slug(name)
        for root in _roots():
            if (root / kind / slug).is_dir():
                return root / kind / slug
    where = " or ".join(str(root / kind) for root in _roots())
    found = ", ".join(known(kind)) or "none"
    raise InputError(f"{given}: no such {_WHAT[kind]} folder, nor a GPU model with one in {where} (there: {found})")


def describe() -> dict[str, str]:
    """Every location the tool reads or writes, for `gemv-dispatch paths`."""
    data, home = data_dir(), home_dir()
    return {
        "shapes": str(shapes_dir()),
        "shipped_corpora": str(data / "corpus"),
        "shipped_tables": str(data / "generated"),
        "work_folder": str(home),
        "work_corpora": str(home / "corpus"),
        "work_generated": str(home / "generated"),
        "installed_tables": str(tables_dir()),
        "locks": str(lock_dir()),
    }
