"""Shared fixtures: the `gpu` marker skips with a clear reason where CuPy or a CUDA device is missing; the replay
corpus, shapes and one-process replay sweep that the sweep and fleet tests compare against."""

from __future__ import annotations

from pathlib import Path

import pytest
from corpus_fixture import SLUG, build_corpus, invoke, sweep_args, tree, write_shapes


def cuda_unavailable_reason() -> str | None:
    from gemv_dispatch.kernels import launch
    from gemv_dispatch.kernels.errors import EnvironmentProblem

    try:
        launch.require_device()
    except EnvironmentProblem as err:
        return str(err)
    return None


def pytest_collection_modifyitems(config, items):
    reason = None
    for item in items:
        if "gpu" in item.keywords:
            reason = reason or cuda_unavailable_reason() or ""
            if reason:
                item.add_marker(pytest.mark.skip(reason=f"gpu test: {reason}"))


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """The fixture corpus a replay sweep reads."""
    return build_corpus(tmp_path_factory.mktemp("source"))


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> Path:
    return write_shapes(tmp_path_factory.mktemp("shapes") / "fixture.json")


@pytest.fixture(scope="module")
def clean_sweep(source, shapes, tmp_path_factory) -> dict[str, bytes]:
    """The corpus files of one uninterrupted one-process replay sweep: what every other run must equal."""
    root = tmp_path_factory.mktemp("clean")
    result = invoke(*sweep_args(source, shapes, root))
    assert result.exit_code == 0, result.output
    return tree(root / SLUG)
