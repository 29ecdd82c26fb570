"""Certified table folders for the install / check / tune tests, made on the emulator in well under a second.

The spill check is skipped in them (as on a machine without nvcc): it costs ~15 s of nvcc per call and has
tests of its own. `forge` re-signs an edited certificate, to build certificates this machine cannot make (a
GPU-level one, one for other kernels): the digest detects edits, it is not a signature.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest import mock

from gemv_dispatch.dispatch.common.digests import with_digest
from gemv_dispatch.dispatch.learn.policy import Policy
from gemv_dispatch.dispatch.table import bundle, certify, generate
from policy_fixture import random_policy


def small_policy(seed: int = 21, overlays: int = 4) -> Policy:
    return random_policy(seed, codebooks=("q4_0",), shapes=((256, 512),), overlays=overlays, depth=3)


def certified_folder(folder: Path, policy: Policy | None = None) -> Path:
    """generated/<slug>/ for `policy` (default: small_policy()), certified at emulator level."""
    policy = policy or small_policy()
    rendered = generate.render(policy)
    with mock.patch.object(certify.shutil, "which", return_value=None), certify.EmulatorRunner() as runner:
        cert = certify.certify(policy, rendered, runner, log=lambda line: None)
    assert cert["passed"], cert["checks"]
    return generate.write(folder, rendered, cert, policy)


def forge(folder: Path, edit: Any) -> None:
    """Apply `edit(cert)` to the folder's certificate and give it a matching digest."""
    path = folder / bundle.CERTIFICATE
    cert = bundle.read_certificate(path.read_bytes(), str(path))
    edit(cert)
    path.write_bytes(bundle.certificate_bytes(with_digest(cert)))


def as_gpu_level(cert: dict[str, Any]) -> None:
    cert["level"] = "gpu"
    cert["device"] = {"name": cert["gpu_name"], "uuid": "GPU-00000000-0000-0000-0000-000000000001"}
