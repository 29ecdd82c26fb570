"""The committed generated/nvidia-h200/ (made on an H200 with GPU-level certification): it verifies, and its
certificate and module digests match this repository's kernel sources, corpus and shape inventories."""

from __future__ import annotations

import pytest
from gemv_dispatch.dispatch.common.paths import data_dir
from gemv_dispatch.dispatch.table import bundle, certify, generate
from gemv_dispatch.kernels import digests, program

FOLDER = data_dir() / "generated" / "nvidia-h200"
pytestmark = pytest.mark.skipif(not (FOLDER / bundle.MODULE).is_file(),
                                reason=f"{FOLDER} holds no table yet (committed after a GPU run)")


def test_committed_table_matches_the_repository():
    table = bundle.verify(FOLDER)  # certificate, module and header bytes, DIGESTS, kernel digest
    cert = table.certificate
    assert cert["level"] == "gpu" and cert["gpu_name"] == "NVIDIA H200" and cert["passed"]
    assert cert["digests"]["kernels"] == program.digest()
    assert cert["digests"]["corpus"] == certify.corpus_digest(data_dir() / "corpus" / "nvidia-h200")
    assert cert["digests"]["inventories"] == certify.inventories_digest()
    assert cert["digests"]["code"] == digests.code_digest()
    # The device evidence: the checks ran on the GPU, or were carried from a certificate whose checks did
    # (the table then decides every certified key as that one did: the decisions_equal check).
    evidence = cert.get("carried")
    if evidence is None:
        assert all(c["level"] == "gpu" for n, c in cert["checks"].items() if n not in ("selection", "spill_free"))
    else:
        assert evidence["level"] == "gpu" and evidence["device"]["name"] == "NVIDIA H200"
        assert set(evidence["checks"].values()) == {"pass"} and cert["fresh"]["shapes"] == 0
        assert cert["checks"]["decisions_equal"]["counts"]["comparisons"] == cert["keys"]
    policy_path = FOLDER / "policy.json"
    if policy_path.is_file():
        from gemv_dispatch.dispatch.learn.policy import load

        assert generate.render(load(policy_path)) == {n: table.files[n] for n in (bundle.MODULE, bundle.HEADER)}
