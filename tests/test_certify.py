"""Certification checks (docs/policy.md §7) on the emulator: each named check passes on a sound table and fails, naming
the key, on a table or device broken in exactly the way it guards against (the estimator_checks pattern)."""

from __future__ import annotations

import json
from unittest import mock

import numpy as np
import pytest
from gemv_dispatch.dispatch.common.digests import sha256
from gemv_dispatch.dispatch.learn.policy import Choice
from gemv_dispatch.dispatch.table import bundle, certify, generate
from gemv_dispatch.dispatch.table.certify import CHECKS, EmulatorRunner, Shape, Tally, run_checks
from gemv_dispatch.kernels.errors import InputError
from gemv_dispatch.kernels.ptxas import KernelResources
from table_fixture import small_policy

SHAPES = [Shape("q4_0", 256, 512, "measured"), Shape("q4_0", 1001, 4096, "sampled")]
SHAPE_ONLY = ("selection", "grouped_equals_serial", "repeat_identical", "permutation", "poison")


def quiet(line: str) -> None:
    pass


def outcomes(select, runner=None, checks=SHAPE_ONLY):
    with runner or EmulatorRunner() as r:
        return run_checks(r, select, SHAPES, seed=7, checks=checks, log=quiet)


def sound(codebook, m, n, k, mode):
    """A sound table: wide at S = 1 for every key (valid everywhere)."""
    return Choice("wide.s1.t128.c1", 1, "fallback")


def test_sound_table_passes_every_shape_check():
    for name, outcome in outcomes(sound).items():
        assert outcome.result == "pass", (name, outcome.failures)
        assert outcome.counts["comparisons"] > 0


def test_identity_changing_with_m_is_caught_naming_the_key():
    def broken(codebook, m, n, k, mode):
        return Choice("kpar.s8.t128.c1", 8, "fallback") if (m == 5 and k == 4096) else sound(codebook, m, n, k, mode)

    result = outcomes(broken)
    for name in ("selection", "grouped_equals_serial"):
        assert result[name].result == "fail"
        assert any("K=4096 M=5" in f for f in result[name].failures), result[name].failures
    assert "row " in result["grouped_equals_serial"].failures[0]  # the first differing element is named


def test_invalid_candidate_is_caught():
    def broken(codebook, m, n, k, mode):  # mma needs N % 8 == 0: N = 1001 is not
        return Choice("wide.s1.t128.mma2", 1, "fallback")

    assert outcomes(broken)["selection"].result == "fail"


class Unwritten(EmulatorRunner):
    def launch(self, candidate, rows):
        out = super().launch(candidate, rows).copy()
        out.view(np.uint32)[-1, -1] = certify.POISON
        return out


class Flaky(EmulatorRunner):
    def __init__(self) -> None:
        super().__init__()
        self.calls: dict = {}

    def launch(self, candidate, rows):
        out = super().launch(candidate, rows).copy()
        key = (self._n, candidate.id, rows)
        self.calls[key] = self.calls.get(key, 0) + 1
        if self.calls[key] == 2:
            out.view(np.uint32)[0, 0] ^= 1
        return out


class RowOrderDependent(EmulatorRunner):
    def launch(self, candidate, rows):
        out = super().launch(candidate, rows).copy()
        if list(rows) != sorted(rows):
            out.view(np.uint32)[0, 0] ^= 1
        return out


class IgnoresIdentity(EmulatorRunner):
    def launch(self, candidate, rows):
        return super().launch(certify.by_id("wide.s1.t128.c1"), rows)


@pytest.mark.parametrize("runner,check", [(Unwritten, "poison"), (Flaky, "repeat_identical"),
                                          (RowOrderDependent, "permutation")])
def test_broken_devices_are_caught(runner, check):
    result = outcomes(sound, runner())
    assert result[check].result == "fail", result[check]
    assert result["selection"].result == "pass"  # the table is sound: the device is what the check caught


def test_negative_control_detects_a_device_that_ignores_the_identity():
    assert outcomes(sound, checks=["negative_control"])["negative_control"].result == "pass"
    assert outcomes(sound, IgnoresIdentity(), checks=["negative_control"])["negative_control"].result == "fail"


def test_spill_check_reads_spills_as_failures(monkeypatch):
    """Negative control of spill_free: a ptxas report with spills fails it (no nvcc needed)."""
    from gemv_dispatch.kernels import ptxas

    spilled = KernelResources("gemv_partial<0, 1, 1, false>", 255, 16, 8, 12)
    monkeypatch.setattr(certify.shutil, "which", lambda name: "/usr/bin/nvcc")
    monkeypatch.setattr(ptxas, "compile_report", lambda names, arch, text=None: ptxas.Build([spilled], "", b""))
    tally = Tally()
    assert certify.check_spill_free(["gemv_partial<0, 1, 1, false>"], "sm_90", tally) is None
    assert tally.failed == 1 and "spill" in tally.failures[0]
    monkeypatch.setattr(certify.shutil, "which", lambda name: None)
    assert certify.check_spill_free(["x"], "sm_90", Tally()) == "nvcc is not on PATH"


def test_certificate_binds_and_refuses_edits(tmp_path):
    policy = small_policy()
    rendered = generate.render(policy)
    with mock.patch.object(certify.shutil, "which", return_value=None), EmulatorRunner() as runner:
        cert = certify.certify(policy, rendered, runner, log=quiet)
    assert cert["passed"] and cert["level"] == "emulator" and cert["device"]["uuid"] == "emulator"
    assert set(cert["checks"]) == set(CHECKS)
    assert cert["checks"]["spill_free"] == {**cert["checks"]["spill_free"], "result": "skipped",
                                            "reason": "nvcc is not on PATH"}
    assert cert["digests"]["artifacts"] == {name: sha256(data) for name, data in rendered.items()}
    assert {s[3] for s in cert["shapes"]} == {"measured", "sampled"}
    data = bundle.certificate_bytes(cert)
    assert bundle.read_certificate(data, "cert") == cert
    # Each edit must reach the check it names (issue 50, 6): flipping arbitrary bytes mostly breaks the JSON, so
    # it never reached the digest check. Content edits keep valid, canonical JSON and leave the digest as it was.
    content_edits = {"passed": False, "seed": cert["seed"] + 1, "level": "gpu",
                     "checks": {**cert["checks"], "poison": {**cert["checks"]["poison"], "result": "pass!"}}}
    for key, value in content_edits.items():
        edited = bundle.certificate_bytes({**cert, key: value})
        assert json.loads(edited)["digest"] == cert["digest"]
        with pytest.raises(InputError, match=r"^cert: digest mismatch: the certificate was edited after `certify`"):
            bundle.read_certificate(edited, "cert")
    with pytest.raises(InputError, match=r"^cert: not in canonical form"):
        bundle.read_certificate(data.replace(b'\n "format"', b'\n  "format"', 1), "cert")
    with pytest.raises(InputError, match=r"^cert: not a JSON certificate file"):
        bundle.read_certificate(data[:-20], "cert")
    # generate refuses a certificate that binds other bytes.
    with pytest.raises(InputError, match="other module bytes"):
        generate.check_binding(generate.render(small_policy(23)), cert, "x")


def test_policy_for_another_corpus_or_gpu_is_refused(tmp_path):
    policy = small_policy()
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "manifest.json").write_text("{}\n")
    with pytest.raises(InputError, match="another corpus"):
        certify.check_policy(policy, corpus)

    class OtherGpu(EmulatorRunner):
        level = "gpu"

        def device(self):
            return {"name": "NVIDIA A100", "uuid": "u"}

    with pytest.raises(InputError, match="this GPU is a NVIDIA A100"):
        certify.certify(policy, {}, OtherGpu(), log=quiet)


def test_sampled_shapes_of_a_super_block_format_hold_whole_super_blocks():
    shapes = certify.sampled_shapes(["q4_k"], [], seed=3)
    assert shapes and all(s.k % 256 == 0 for s in shapes)
    assert min(s.k for s in shapes) == 256 and max(s.k for s in shapes) >= 2**16  # the smallest and a huge K


def test_sampled_shapes_cover_the_awkward_kinds():
    shapes = certify.sampled_shapes(["q4_0", "q8_0"], [], seed=3)
    assert len(shapes) == 2 * certify.SAMPLED_PER_CODEBOOK
    assert any(s.n % 2 for s in shapes) and any(s.n % 8 == 4 for s in shapes) and any(s.n == 1 for s in shapes)
    assert any(s.k == 32 for s in shapes) and any(s.k >= 1 << 16 for s in shapes)
    assert all(s.n * s.k <= certify.MAX_SAMPLED_WEIGHTS for s in shapes)
    assert shapes == certify.sampled_shapes(["q4_0", "q8_0"], [], seed=3)
