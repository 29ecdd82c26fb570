"""Training and evaluation: refusals, overlays, the CLI, and train -> evaluate on the committed corpus."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from corpus_fixture import build_corpus, fake_provenance
from gemv_dispatch.dispatch.cli import main
from gemv_dispatch.dispatch.learn import evaluate as ev
from gemv_dispatch.dispatch.learn.policy import load as load_policy
from gemv_dispatch.dispatch.learn.train import (
    Measurements,
    TimeModel,
    TrainOptions,
    _NodeRows,
    _preference,
    _Rows,
    best_launch,
    fit_policy,
    train,
)
from gemv_dispatch.dispatch.measure.corpus import load
from gemv_dispatch.dispatch.measure.shapes import GRID_NAME, Inventory, Shape
from gemv_dispatch.kernels.errors import InputError
from gemv_dispatch.kernels.registry import BY_ID

COMMITTED = Path(__file__).resolve().parents[1] / "corpus" / "nvidia-h200"


@pytest.fixture(scope="module")
def fixture_folder(tmp_path_factory) -> Path:
    return build_corpus(tmp_path_factory.mktemp("corpus"))


def test_stale_records_are_left_out_and_a_corpus_of_only_stale_ones_is_refused(tmp_path, monkeypatch):
    """Training uses only records of code the kernels still run, says how many it left out, and refuses a corpus
    without any (issue 53: stale records are never used)."""
    from gemv_dispatch.kernels import digests

    folder = build_corpus(tmp_path)
    _, notes = train(load(folder))
    assert notes == []
    table = digests.table()
    first = load(folder).records[0]
    used = BY_ID[first.candidate].kernel_name(first.codebook, first.m)
    monkeypatch.setattr(digests, "table", lambda: dict(table, **{used: "0" * 64}))
    monkeypatch.setattr(digests, "code_digest", lambda: "e" * 64)
    loaded = load(folder)
    assert 0 < loaded.stale < len(loaded.records)
    _, notes = train(loaded)
    assert f"{loaded.stale} of {len(loaded.records)} records" in notes[0] and "left out" in notes[0]
    monkeypatch.setattr(digests, "table", lambda: dict.fromkeys(table, "0" * 64))
    with pytest.raises(InputError, match=r"no record of the kernels' current code \(\d+ stale"):
        train(load(folder))


def test_refuses_a_partial_corpus(tmp_path):
    from corpus_fixture import cells, fake_records
    from gemv_dispatch.dispatch.measure import corpus

    folder = build_corpus(tmp_path, codebooks=("Q4_0",))
    prov = fake_provenance()
    for cell in cells(codebooks=("Q8_0",), modes=("graph",)):  # Q8_0 lacks eager
        corpus.write_shard(folder, prov, fake_records(cell, prov))
    with pytest.raises(InputError, match="codebook q8_0 has no measured cell at M=1 eager"):
        train(load(folder))


def test_overlays_make_the_policy_exact_on_measured_cells(fixture_folder):
    meas = Measurements.from_corpus(load(fixture_folder))
    policy = fit_policy(meas)
    for key, cell in meas.times.items():
        cb, m, n, k, _ = key
        ident = policy.select(cb, 1, n, k).identity
        best = cell[best_launch(cell, ident, m, n, k, meas.noise_rel)]
        assert cell[policy.select(*key).candidate] <= best * (1 + meas.noise_rel), key


def test_profile_changes_identities_where_they_matter(fixture_folder):
    meas = Measurements.from_corpus(load(fixture_folder))
    decode = fit_policy(meas, TrainOptions(profile={1: 1}))
    assert decode.options["profile"] == {"1": 1}
    assert fit_policy(meas, TrainOptions(profile={1: 1})).to_bytes() == decode.to_bytes()


def test_time_model_reproduces_measurements_and_fills_missing_m(fixture_folder):
    meas = Measurements.from_corpus(load(fixture_folder))
    model = TimeModel(max_iter=50).fit(meas)
    (cb, m, n, k, mode), cell = next(iter(sorted(meas.times.items())))
    cand = sorted(cell)[0]
    got = model.predict([(cb, cand, m, n, k, mode), (cb, cand, 2, n, k, mode)])
    assert got[0] == cell[cand]
    assert got[1] > 0


def test_cli_train_writes_deterministic_file_and_refuses_bad_input(fixture_folder, tmp_path):
    runner = CliRunner()
    out = tmp_path / "p.json"
    res = runner.invoke(main, ["train", str(fixture_folder), "-o", str(out)])
    assert res.exit_code == 0, res.output
    first = out.read_bytes()
    assert runner.invoke(main, ["train", str(fixture_folder), "-o", str(out)]).exit_code == 0
    assert out.read_bytes() == first
    for args, needle in ((["--profile", "0:1"], "profile entry"), (["--profile", "1:x"], "profile entry")):
        bad = tmp_path / "bad.json"
        res = runner.invoke(main, ["train", str(fixture_folder), "-o", str(bad), *args])
        assert res.exit_code == 2 and needle in res.output and len(res.output.strip().splitlines()) == 1
        assert not bad.exists()
    empty = tmp_path / "empty" / "fake-gpu"
    from gemv_dispatch.dispatch.measure import corpus

    corpus.init(empty)
    res = runner.invoke(main, ["train", str(empty), "-o", str(tmp_path / "e.json")])
    assert res.exit_code == 2 and "no records" in res.output


def test_cli_explain_and_tampered_policy(fixture_folder, tmp_path):
    runner = CliRunner()
    out = tmp_path / "p.json"
    assert runner.invoke(main, ["train", str(fixture_folder), "-o", str(out)]).exit_code == 0
    res = runner.invoke(main, ["explain", "Q4_0", "3", "1024", "4096", "--mode", "eager", "--policy", str(out),
                               "--corpus", str(fixture_folder), "--json"])
    assert res.exit_code == 0, res.output
    info = json.loads(res.output)
    assert info["candidate"] == load_policy(out).select("q4_0", 3, 1024, 4096, "eager").candidate
    assert info["neighbours"] and info["predicted_us"] > 0 and info["gbps"] > 0
    res = runner.invoke(main, ["explain", "q4_0", "1", "1024", "4100", "--policy", str(out),
                               "--corpus", str(fixture_folder)])
    assert res.exit_code == 2 and "multiple of 32" in res.output
    out.write_text(out.read_text().replace('"noise_rel": 0.02', '"noise_rel": 0.2'))
    res = runner.invoke(main, ["explain", "q4_0", "1", "1024", "4096", "--policy", str(out),
                               "--corpus", str(fixture_folder)])
    assert res.exit_code == 2 and "digest mismatch" in res.output


@pytest.mark.parametrize(("args", "message"), [
    (["q4_k", "1", "4096", "4128"], "error: K=4128 is not a multiple of 256, the super-block of Q4_K"),
    (["q4_0", "-1", "4096", "4096"], "error: M=-1 must be an integer >= 1"),
    (["q4_0", "1", "4096", "-32"], "error: K=-32 must be an integer >= 1"),
    (["Q9_9", "1", "4096", "4096"], "error: unknown codebook 'Q9_9'; known: Q4_0, "),
])
def test_explain_refuses_bad_arguments_in_one_line_before_training(args, message, tmp_path, monkeypatch):
    """Issue 50 (1f, 2): one line, exit 2, and before the corpus is read (no policy trained for a mistake)."""
    from gemv_dispatch.dispatch import cli

    monkeypatch.setattr(cli, "_corpus_folder", lambda folder: pytest.fail("the corpus was read first"))
    res = CliRunner().invoke(main, ["explain", *args])
    assert res.exit_code == 2, res.output
    assert res.stderr.count("\n") == 1 and res.stderr.startswith(message), res.stderr


def test_mmvq_rule_maps_onto_valid_candidates():
    assert ev.mmvq_pick(1, 4096, 4096) == "direct.s4.t32.c1"
    assert ev.mmvq_pick(8, 4096, 4096) == "direct.s2.t64.c1"
    assert ev.mmvq_pick(9, 4096, 4096) == "wide.s1.t128.mma2"
    assert ev.mmvq_pick(16, 4100, 4096) == "wide.s1.t128.c1"  # N not a multiple of 8: no mma


def test_holdout_rule_is_fixed_and_sealed():
    from gemv_dispatch.dispatch.measure.shapes import load_inventories

    inventories = load_inventories(COMMITTED.parent / "shapes")
    held = ev.holdout_geometries(inventories)
    assert ev.HOLDOUT_FAMILIES == ("falcon3", "phi-3", "phi-4")
    assert (5120, 17920) in held and (4096, 4096) not in held  # phi-4's up/down; llama's q/o stay in training


def test_train_then_evaluate_on_the_committed_corpus(tmp_path):
    """Also: training here reproduces the committed policy byte for byte, though that one was trained on
    another machine and Python (the GPU run's); float sums are correctly rounded (math.fsum), not left to
    the Python version (3.12's sum() compensates, 3.11's does not)."""
    corpus = load(COMMITTED)
    policy, _ = train(corpus)
    committed = COMMITTED.parents[1] / "generated" / "nvidia-h200" / "policy.json"
    assert policy.to_bytes() == committed.read_bytes()
    report = ev.evaluate(corpus, folds=2)
    data = report.data
    assert data["overlays"] == {"identity": len(policy.identity_overlays), "launch": len(policy.launch_overlays)}
    methods = data["methods"]
    assert methods["policy"]["all"]["n"] == data["cells"]
    assert data["policy_within_noise"] >= 0.99
    for cb, res in methods["policy"]["codebook"].items():  # both baselines beaten on every codebook
        assert res["geomean"] < methods["best-single"]["codebook"][cb]["geomean"]
        assert res["geomean"] < methods["mmvq"]["codebook"][cb]["geomean"]
    assert "price of invariance" in ev.render(data)


def test_a_leaf_ranks_an_identity_it_never_saw_by_its_nearest_ancestor():
    """A launch leaf whose rows all hold one identity (here options 'b32') must still order the launches of another
    identity sensibly when the identity tree hands it one: by their regret in the nearest ancestor that saw them.
    Negative control: without ancestors they tie, and registry order puts the slow launch first."""
    options = ("a16.slow", "a16.fast", "b32")
    usable = np.array([[False, False, True], [False, False, True], [True, True, False], [True, True, False]])
    y = np.array([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.1, 1.0], [1.2, 0.2, 1.2]])
    rows = _Rows(np.zeros((4, 1), dtype=np.int64), y, np.ones(4), usable, np.full(4, 2.0))
    leaf, ancestor = np.array([0, 1]), np.array([0, 1, 2, 3])
    assert _preference(rows, leaf, options, [_NodeRows(rows, ancestor)]) == ("b32", "a16.fast", "a16.slow")
    assert _preference(rows, leaf, options) == ("b32", "a16.slow", "a16.fast")


LOFO_GEOMETRIES = ((256, 512), (1024, 4096), (512, 1024), (2048, 1024), (768, 2048), (4096, 512))


def inventory(name: str, family: str, geometries) -> Inventory:
    shapes = tuple(Shape(n, k, f"g{i}", name, family) for i, (n, k) in enumerate(geometries))
    return Inventory(name, family, "test", shapes)


def test_leave_one_family_out_leaves_each_family_out_and_measures_the_excess(tmp_path, monkeypatch):
    """Every model family in turn: its geometries (also one another family shares) are out of the fold's training
    and scored; the synthetic grid is no family. The excess is the fallback's time over the invariant oracle's
    on the same cells, so its geomean is the ratio of theirs."""
    corpus = load(build_corpus(tmp_path, geometries=LOFO_GEOMETRIES))
    inventories = [inventory("a-1", "fam-a", [(256, 512), (1024, 4096)]),
                   inventory("b-1", "fam-b", [(512, 1024), (2048, 1024), (1024, 4096)]),
                   inventory("phi-3-x", "phi-3", [(768, 2048)]), inventory("c-1", "fam-c", [(4096, 512)]),
                   inventory(GRID_NAME, "synthetic", [(512, 1024), (256, 512)])]
    trained_on: list[set[tuple[int, int]]] = []
    real = ev.fit_fallback

    def spy(meas, rows, options=None):
        trained_on.append({(n, k) for _, n, k in meas.geometries()})
        assert {tuple(nk) for nk in rows.launch_nk} == trained_on[-1]  # rows of exactly those geometries
        return real(meas, rows, options)

    monkeypatch.setattr(ev, "fit_fallback", spy)
    lines: list[str] = []
    data = ev.evaluate(corpus, inventories=inventories, folds=2, progress=lines.append, workers=1).data
    lofo = data["lofo"]
    assert lofo["families"] == {"fam-a": 2, "fam-b": 3, "fam-c": 1, "phi-3": 1}
    cells_per_geometry = 2 * 2 * 2  # codebooks x M x modes
    assert lofo["cells"] == (2 + 3 + 1 + 1) * cells_per_geometry  # (1024, 4096) counted in fam-a and fam-b
    assert set(lofo["fallback"]["family"]) == set(lofo["families"])
    folds = trained_on[1:1 + len(lofo["families"])]  # after the whole corpus's fallback
    held = [{(256, 512), (1024, 4096)}, {(512, 1024), (2048, 1024), (1024, 4096)}, {(4096, 512)}, {(768, 2048)}]
    assert [set(LOFO_GEOMETRIES) - f for f in folds] == held
    fb, oracle, excess = (lofo[name]["all"]["geomean"] for name in ("fallback", "invariant-oracle", "excess"))
    assert (1 + excess / 100) == pytest.approx((1 + fb / 100) / (1 + oracle / 100), rel=1e-12)
    assert oracle <= fb + 1e-9 or excess < 0  # the fallback may beat the profile's identity only cell by cell
    assert {"<1 MiB"} <= set(lofo["excess"]["size"]) and set(lofo["excess"]["m"]) == {"1", "4"}
    assert [(t["figure"], t["statistic"], t["at_most"]) for t in lofo["targets"]] == [
        ("excess", "geomean", 1.0), ("excess", "p95", 8.0), ("fallback", "geomean", 5.0)]
    assert all(t["passed"] == (t["value"] <= t["at_most"]) for t in lofo["targets"])
    text = ev.render(data)
    assert text.count("target: ") == 3 and ("PASS" in text or "FAIL" in text)
    assert any("leave-one-family-out 4/4: phi-3" in line for line in lines)
    # The folds in worker processes (which the spy cannot see) give the same report.
    lines.clear()
    assert ev.evaluate(corpus, inventories=inventories, folds=2, progress=lines.append, workers=2).data == data
    assert sum(line.endswith(": done") for line in lines) == 1 + 4 + 2, lines  # the hold-out, the families, CV


def test_size_buckets_count_true_weight_bytes():
    """A super-block codebook's bytes are per 256 weights: Q4_K 4096x4096 is 9 MiB (4.5 bits a weight), not 72."""
    assert ev.size_bucket("q4_k", 4096, 4096) == "4-16 MiB"
    assert ev.size_bucket("q8_0", 4096, 4096) == "16-64 MiB"  # 8.5 bits a weight: 17 MiB
    assert ev.size_bucket("q4_0", 128, 1024) == "<1 MiB" and ev.size_bucket("q8_0", 152064, 8192) == ">=256 MiB"
