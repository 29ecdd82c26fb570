"""Certification on the GPU (docs/policy.md §7), marker `gpu`: a table certifies at GPU level with every check run,
device bytes equal the emulator's, and a table whose identity changes with M is caught on the device."""

from __future__ import annotations

import pytest
from gemv_dispatch.dispatch.common.gpu import current_gpu
from gemv_dispatch.dispatch.learn.policy import Choice
from gemv_dispatch.dispatch.table import certify, generate
from gemv_dispatch.dispatch.table.certify import GpuRunner, Shape, run_checks
from policy_fixture import random_policy

pytestmark = pytest.mark.gpu


def quiet(line: str) -> None:
    pass


@pytest.fixture(scope="module")
def device_name():
    return current_gpu()["name"]


def test_policy_certifies_at_gpu_level(device_name):
    policy = random_policy(31, codebooks=("iq4_nl", "q4_1", "q8_0"), shapes=((4096, 4096), (1000, 14336)),
                           gpu_name=device_name)
    rendered = generate.render(policy)
    with GpuRunner() as runner:
        cert = certify.certify(policy, rendered, runner, log=print)
    assert cert["passed"], {n: c["failures"][:2] for n, c in cert["checks"].items()}
    assert cert["level"] == "gpu" and cert["device"]["name"] == device_name
    for name in ("grouped_equals_serial", "repeat_identical", "permutation", "poison", "emulator_equality",
                 "negative_control"):
        assert cert["checks"][name]["level"] == "gpu" and cert["checks"][name]["counts"]["comparisons"] > 0, name


def test_identity_changing_with_m_is_caught_on_the_device():
    def broken(codebook, m, n, k, mode):
        return Choice("kpar.s8.t128.c1", 8, "fallback") if m == 5 else Choice("wide.s1.t128.c1", 1, "fallback")

    shapes = [Shape("q4_0", 1000, 4096, "measured")]
    with GpuRunner() as runner:
        result = run_checks(runner, broken, shapes, seed=1, checks=["grouped_equals_serial", "emulator_equality"],
                            log=quiet)
    assert result["grouped_equals_serial"].result == "fail"
    assert any("M=5" in f for f in result["grouped_equals_serial"].failures)
    assert result["emulator_equality"].result == "pass"  # each launch is right; the table is what is wrong
