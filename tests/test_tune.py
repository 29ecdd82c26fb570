"""`gemv-dispatch tune` end to end on a CPU (replay of the synthetic fixture corpus): every stage, a table
installed at emulator level; then `check` on it, including a table whose module decides wrongly."""

from __future__ import annotations

from dataclasses import replace

import pytest
from click.testing import CliRunner
from corpus_fixture import build_corpus
from gemv_dispatch.dispatch.cli import main
from gemv_dispatch.dispatch.common import gpu as gpu_module
from gemv_dispatch.dispatch.common.digests import sha256
from gemv_dispatch.dispatch.serve import install
from gemv_dispatch.dispatch.table import bundle, certify, generate
from policy_fixture import FAKE_GPU
from table_fixture import forge


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    root = tmp_path_factory.mktemp("tune")
    corpus = build_corpus(root / "corpus")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(certify.shutil, "which", lambda name: None)  # the spill check has its own tests
        result = CliRunner().invoke(main, ["tune", "--replay", str(corpus), "--generated", str(root / "generated"),
                                           "--tables", str(root / "tables")])
    return root, result


def test_tune_runs_every_stage_and_installs(tuned):
    root, result = tuned
    assert result.exit_code == 0, result.output
    for stage in ("sweep", "train", "certify", "generate", "install"):
        assert f"[{stage}] done" in result.output
    for fact in ("cells)", "regret geomean", "price of invariance", "certificate: passed at emulator level",
                 "installed:"):
        assert fact in result.output, fact
    folder = root / "generated" / "fake-gpu-9000"
    assert sorted(p.name for p in folder.iterdir()) == sorted([*bundle.FILES, "policy.json"])
    loaded = install.installed_table(FAKE_GPU, root / "tables")
    assert loaded is not None and loaded.gpu_level is False
    # Issue 50 (2): the summary named the temp folder the replay went into, deleted by the time it was read.
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("corpus: ")]
    assert line == f"corpus: a replay of {root / 'corpus' / 'fake-gpu-9000'} in a temporary folder (removed) (16 cells)"


def test_check_passes_on_the_table_and_fails_naming_the_key(tuned, tmp_path, monkeypatch):
    root, _ = tuned
    monkeypatch.setattr(certify.shutil, "which", lambda name: None)
    folder = root / "generated" / "fake-gpu-9000"
    ok = CliRunner().invoke(main, ["check", str(folder)])
    assert ok.exit_code == 0, ok.output
    assert "no GPU: emulator-level check" in ok.output and "q4_0" in ok.output
    # A module that changes the identity at M = 3, re-bound by a forged certificate: check must catch it.
    bad = tmp_path / "fake-gpu-9000"
    bad.mkdir()
    for name in bundle.FILES:
        (bad / name).write_bytes((folder / name).read_bytes())
    module = (bad / bundle.MODULE).read_text() + (
        "\n\n_select = select\n\n\ndef select(codebook, m, n, k, mode='graph'):\n"
        "    c = _select(codebook, m, n, k, mode)\n"
        "    if m == 3 and k == 4096:\n"
        "        return Choice('kpar.s8.t128.c1', 8, c.source)\n"
        "    return c\n")
    (bad / bundle.MODULE).write_text(module)
    forge(bad, lambda c: c["digests"]["artifacts"].update({bundle.MODULE: sha256(module.encode())}))
    failed = CliRunner().invoke(main, ["check", str(bad)])
    assert failed.exit_code == 1, failed.output
    assert "K=4096 M=3" in failed.output and "row " in failed.output


def test_check_and_tune_refuse_bad_input(tuned, tmp_path):
    result = CliRunner().invoke(main, ["check", str(tmp_path / "nothing")])
    assert result.exit_code == 2 and "no such table folder" in result.output
    result = CliRunner().invoke(main, ["tune", "--replay", str(tmp_path / "nothing")])
    assert result.exit_code == 2, result.output


def test_embedded_default_reproduces_the_committed_table(monkeypatch, tmp_path):
    """The CPU default (replay, train, emulator certification, render, compare), on a data folder holding a
    small corpus of the default GPU model: without a committed table it says so; with one (made by a first
    run) it is byte-identical; with an edited one it says NO and exits 1. Nothing is installed."""
    from corpus_fixture import fake_provenance
    from gemv_dispatch.dispatch import tune
    from gemv_dispatch.dispatch.common import paths

    data = tmp_path / "data"
    build_corpus(data / "corpus", fake_provenance(gpu_name="NVIDIA H200"))
    (data / "corpus" / "shapes").symlink_to(paths.shapes_dir())
    monkeypatch.setenv(paths.DATA_ENV, str(data))
    monkeypatch.setattr(gpu_module, "current_gpu", lambda: None)
    monkeypatch.setattr(certify.shutil, "which", lambda name: None)
    # Train once (train has tests of its own; it is deterministic): every run below gets this policy.
    assert tune.committed_models() == ["nvidia-h200"]
    policy = tune.train_policy(data / "corpus" / "nvidia-h200")
    monkeypatch.setattr(tune, "train_policy", lambda folder, log=None: policy)

    def run():
        return CliRunner().invoke(main, ["tune"])

    first = run()
    assert first.exit_code == 0, first.output
    assert "no GPU here" in first.output and "holds no table yet" in first.output
    assert "installed: nothing" in first.output
    committed = data / "generated" / "nvidia-h200"
    assert not committed.exists()
    # Commit what a GPU run would have produced from the same corpus: the same policy, rendered.
    committed.mkdir(parents=True)

    def commit(p):
        for name, data_bytes in generate.render(p).items():
            (committed / name).write_bytes(data_bytes)
        (committed / tune.POLICY).write_bytes(p.to_bytes())

    commit(policy)
    second = run()
    assert second.exit_code == 0 and "reproducible: yes" in second.output, second.output
    (committed / bundle.HEADER).write_bytes((committed / bundle.HEADER).read_bytes() + b"\n")
    third = run()
    assert third.exit_code == 1 and "reproducible: NO" in third.output, third.output
    assert "the policy is the same, so the rendering differs" in third.output
    # A committed table from another training (another seed and scikit-learn): NO, and why.
    commit(replace(policy, options={**policy.options, "random_state": 7},
                   source={**policy.source, "sklearn_version": "0.0"}))
    fourth = run()
    assert fourth.exit_code == 1, fourth.output
    assert "the policy differs in options.random_state, source.sklearn_version (trained with scikit-learn 0.0, " \
        "here" in fourth.output, fourth.output
    (committed / tune.POLICY).write_text("[]")  # a broken policy file: still NO, and no traceback
    fifth = run()
    assert fifth.exit_code == 1 and "policy.json is no policy" in fifth.output, fifth.output
