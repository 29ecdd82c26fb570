"""A table folder: the generated module, its C header and the certificate that binds them.

`verify` is the one place a table folder is judged (install, check, and the runtime through the installed
tables): certificate present, canonical and self-consistent, passed; module and header bytes equal to what it
binds; the module's own DIGESTS and GPU_NAME equal to the certificate's; made for these kernels. This module
imports neither jinja2 nor the certifier, so serving a table never loads the build pipeline.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...kernels import digests, program
from ...kernels.errors import InputError
from ..common.digests import canonical_bytes, read_digested, sha256

MODULE = "dispatch_table.py"
HEADER = "dispatch_table.h"
CERTIFICATE = "certificate.json"
FILES = (MODULE, HEADER, CERTIFICATE)  # what a table is: install copies these
POLICY = "policy.json"  # the policy the table was rendered from, beside it in generated/<gpu-slug>/ (not installed)
CERT_FORMAT = "gemv-dispatch-certificate/1"


def certificate_bytes(cert: Mapping[str, Any]) -> bytes:
    return canonical_bytes(cert)


def other_kernels(cert: Mapping[str, Any]) -> str | None:
    """Why a certificate's evidence is not about the code these kernels run, or None when it is: its code digest
    (kernels.digests.code_digest), or for a certificate made before code digests its kernel source digest."""
    made_for = cert["digests"].get("code")
    if made_for is not None and made_for != digests.code_digest():
        return f"certified for kernel code {made_for[:12]}, these kernels run {digests.code_digest()[:12]}"
    if made_for is None and cert["digests"]["kernels"] != program.digest():
        return f"certified for kernel sources {cert['digests']['kernels'][:12]}, these are {program.digest()[:12]}"
    return None


def read_certificate(data: bytes, where: str) -> dict[str, Any]:
    """Parse certificate bytes; InputError unless they are the canonical bytes of a certificate whose digest
    matches its content (a one-byte edit anywhere is refused)."""
    return read_digested(data, where, CERT_FORMAT, "certificate", "certify")


@dataclass(frozen=True)
class Table:
    """A verified table folder: its file bytes, certificate, and the module executed from the verified bytes."""

    folder: Path
    files: dict[str, bytes]
    certificate: dict[str, Any]
    module: types.ModuleType

    @property
    def gpu_name(self) -> str:
        return str(self.certificate["gpu_name"])

    @property
    def level(self) -> str:
        return str(self.certificate["level"])

    @property
    def version(self) -> str:
        return f"{sha256(self.files[MODULE])[:16]}-{self.certificate['digest'][:8]}"


def _module(data: bytes, name: str, where: Path) -> types.ModuleType:
    """Execute module bytes already verified (never re-read from disk: what was checked is what runs)."""
    module = types.ModuleType(name)
    module.__file__ = str(where)
    exec(compile(data, str(where), "exec"), module.__dict__)  # bytes bound by a passed certificate
    return module


def verify(folder: Path) -> Table:
    """Judge a table folder (generated/<gpu-slug>/ or an installed version); InputError naming the defect."""
    folder = Path(folder)
    if not folder.is_dir():
        raise InputError(f"{folder}: no such table folder")
    try:
        cert_bytes = (folder / CERTIFICATE).read_bytes()
    except (FileNotFoundError, IsADirectoryError):
        raise InputError(f"{folder}: no {CERTIFICATE} file; a table is installed only with its certificate") from None
    cert = read_certificate(cert_bytes, str(folder / CERTIFICATE))
    files = {CERTIFICATE: cert_bytes}
    for name in (MODULE, HEADER):
        try:
            files[name] = (folder / name).read_bytes()
        except (FileNotFoundError, IsADirectoryError):
            raise InputError(f"{folder}: no {name} file") from None
        if sha256(files[name]) != cert["digests"]["artifacts"].get(name):
            raise InputError(f"{folder / name}: its bytes differ from what the certificate binds (edited after "
                             "generation?)")
    if cert.get("passed") is not True:
        raise InputError(f"{folder / CERTIFICATE}: the certificate records failed or missing checks")
    stale = other_kernels(cert)
    if stale:
        raise InputError(f"{folder}: {stale}: sweep (only what changed), train and certify again")
    module = _module(files[MODULE], f"gemv_dispatch_table_{cert['gpu_slug'].replace('-', '_')}", folder / MODULE)
    bound = {k: v for k, v in cert["digests"].items() if k != "artifacts"}
    if getattr(module, "DIGESTS", None) != bound or getattr(module, "GPU_NAME", None) != cert["gpu_name"]:
        raise InputError(f"{folder / MODULE}: its DIGESTS or GPU_NAME differ from the certificate's")
    return Table(folder, files, cert, module)
