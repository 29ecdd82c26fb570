"""The policy file and the normative select: totality, batch invariance, overlays, digest, bad input, no sklearn."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest
from corpus_fixture import build_corpus
from gemv_dispatch.dispatch.learn import features
from gemv_dispatch.dispatch.learn.policy import (
    DEFAULT_PROFILE,
    Policy,
    canonical,
    parse_profile,
    validate_profile,
)
from gemv_dispatch.dispatch.learn.policy import load as load_policy
from gemv_dispatch.dispatch.learn.train import train
from gemv_dispatch.dispatch.measure.corpus import load
from gemv_dispatch.kernels.errors import InputError
from gemv_dispatch.kernels.registry import BY_ID, CANDIDATES, shape_error
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


@pytest.fixture(scope="module")
def fixture_policy(tmp_path_factory) -> Policy:
    folder = build_corpus(tmp_path_factory.mktemp("corpus"))
    policy, notes = train(load(folder))
    assert notes == []
    return policy


@pytest.fixture(scope="module")
def policy_file(fixture_policy, tmp_path_factory):
    path = tmp_path_factory.mktemp("policy") / "policy.json"
    fixture_policy.save(path)
    return path


shapes = st.tuples(
    st.sampled_from(["q4_0", "q8_0"]),
    st.one_of(st.integers(1, 40), st.integers(1, 1 << 20)),
    st.one_of(st.integers(1, 300), st.integers(1, 1 << 24)),
    st.one_of(st.integers(1, 64), st.integers(1, 1 << 16)).map(lambda kb: 32 * kb),
    st.sampled_from(["graph", "eager"]),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shapes)
def test_select_is_total_valid_and_batch_invariant(fixture_policy, shape):
    cb, m, n, k, mode = shape
    if shape_error(m, n, k):  # planes beyond the kernels' 32-bit indices: no candidate runs them
        with pytest.raises(InputError, match="2\\^32"):
            fixture_policy.select(cb, m, n, k, mode)
        return
    choice = fixture_policy.select(cb, m, n, k, mode)
    cand = BY_ID[choice.candidate]
    assert cand.invalid_reason(m, n, k) is None
    assert cand.identity(k) == choice.identity
    assert fixture_policy.select(cb, 1, n, k, "graph").identity == choice.identity  # one identity for all M, modes


def test_select_on_edge_shapes(fixture_policy):
    for n, k in ((1, 32), (1, 1 << 22), (1 << 24, 32), (7, 96), (3, 32 * 65)):
        for m in (1, 2, 16, 17, 31, 1000):
            choice = fixture_policy.select("q8_0", m, n, k, "eager")
            assert BY_ID[choice.candidate].valid(m, n, k)


def test_canonical_candidates_are_valid_for_every_m():
    for k in (32, 64, 96, 32 * 48, 32 * 560, 32 * 4096):
        for ident in {c.identity(k) for c in CANDIDATES if c.valid(1, 8, k)}:
            cand = canonical(ident, 8, k)
            assert cand is not None and cand.identity(k) == ident
            assert all(cand.valid(m, 8, k) for m in (1, 16, 31, 4096))
    assert canonical(64, 8, 32 * 560) is None  # S=64 is not effective for KB=560 (it acts as 63)


def test_same_training_gives_same_bytes(fixture_policy, tmp_path):
    again, _ = train(load(build_corpus(tmp_path)))
    assert again.to_bytes() == fixture_policy.to_bytes()


def test_round_trip_and_digest_tamper(policy_file):
    data = policy_file.read_bytes()
    assert load_policy(policy_file).to_bytes() == data
    obj = json.loads(data)
    obj["options"]["noise_rel"] = 0.5  # a plausible hand edit
    policy_file.with_name("edited.json").write_text(json.dumps(obj, sort_keys=True, indent=1) + "\n")
    with pytest.raises(InputError, match="digest mismatch"):
        load_policy(policy_file.with_name("edited.json"))
    policy_file.with_name("junk.json").write_text("{not json")
    with pytest.raises(InputError, match="not a JSON policy"):
        load_policy(policy_file.with_name("junk.json"))
    with pytest.raises(InputError, match="no such policy"):
        load_policy(policy_file.with_name("absent.json"))


def test_structural_defects_are_refused_even_with_a_fresh_digest(policy_file):
    from gemv_dispatch.dispatch.common.digests import canonical_bytes, content_digest

    obj = json.loads(policy_file.read_bytes())
    obj["fallback"]["launch_tree"]["leaves"][0] = ["no.such.candidate"]
    obj["digest"] = content_digest(obj)
    with pytest.raises(InputError, match="unknown candidate"):
        Policy.from_bytes(canonical_bytes(obj))


def test_digest_follows_the_content(policy_file):
    """A file out of canonical order is refused (its digest would not be the policy's), and a policy changed in
    code has its own digest, not a stale copy."""
    from dataclasses import replace

    from gemv_dispatch.dispatch.common.digests import content_digest

    obj = json.loads(policy_file.read_bytes())
    cb = next(cb for cb, rows in obj["shapes"].items() if len(rows) > 1)
    obj["shapes"][cb].reverse()
    obj["digest"] = content_digest(obj)
    with pytest.raises(InputError, match="canonical form"):
        Policy.from_bytes(json.dumps(obj).encode())
    policy = load_policy(policy_file)
    assert policy.digest == json.loads(policy_file.read_bytes())["digest"]
    changed = replace(policy, options={**policy.options, "random_state": 7})
    assert changed.digest != policy.digest and changed.digest == json.loads(changed.to_bytes())["digest"]


@pytest.mark.parametrize("args, match", [
    (("q4_1", 1, 64, 64, "graph"), "not in this policy"),
    (("q4_0", 0, 64, 64, "graph"), "M=0"),
    (("q4_0", 1, 0, 64, "graph"), "N=0"),
    (("q4_0", 1, 64, 48, "graph"), "multiple of 32"),
    (("q4_0", 1, 64, 0, "graph"), "K=0"),
    (("q4_0", 1, 64, 64, "replay"), "mode"),
])
def test_select_refuses_bad_arguments(fixture_policy, args, match):
    with pytest.raises(InputError, match=match):
        fixture_policy.select(*args)


def test_overlays_apply_only_when_they_fit(fixture_policy):
    n, k = 4096, 4096
    other = next(i for i in (2, 4, 8, 16) if i != fixture_policy.select("q4_0", 1, n, k).identity)
    pick = f"kpar.s{other}.t128.mma2"
    forced = replace(fixture_policy, identity_overlays={("q4_0", n, k): other},
                     launch_overlays={("q4_0", 16, n, k, "graph"): pick, ("q4_0", 4, n, k, "graph"): "wide.s1.t128.c1"})
    assert forced.select("q4_0", 16, n, k) == (pick, other, "overlay")
    assert forced.select("q4_0", 3, n, k).source == "overlay"  # the identity overlay decides every M
    # negative control: an overlay of another identity is ignored, select stays within the identity
    wrong = forced.select("q4_0", 4, n, k)
    assert wrong.candidate != "wide.s1.t128.c1" and BY_ID[wrong.candidate].identity(k) == other
    assert fixture_policy.select("q8_0", 16, n, k).source == "fallback"


def test_table_shapes_cover_trained_shapes_and_overlays(fixture_policy):
    keys = fixture_policy.table_shapes()
    assert set(fixture_policy.shapes) <= set(keys)
    assert {("q4_0", 256, 512), ("q8_0", 1024, 4096)} <= set(keys)


def test_select_never_imports_sklearn(policy_file):
    code = ("import sys; from gemv_dispatch.dispatch.learn.policy import load; p = load(sys.argv[1]); "
            "print(p.select('q4_0', 5, 3000, 4096, 'eager').candidate); "
            "assert 'sklearn' not in sys.modules, 'sklearn imported'")
    out = subprocess.run([sys.executable, "-c", code, str(policy_file)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    # negative control: the same probe does see sklearn once something imports it
    probe = subprocess.run([sys.executable, "-c", "import sys, sklearn; assert 'sklearn' not in sys.modules"],
                           capture_output=True, text=True)
    assert probe.returncode != 0


def test_profiles():
    assert parse_profile("1:0.5,2:0.25,31:0.25") == {1: 2, 2: 1, 31: 1}
    assert parse_profile("4:3, 1:6") == {1: 2, 4: 1}
    assert validate_profile({str(m): w for m, w in DEFAULT_PROFILE.items()}) == DEFAULT_PROFILE
    assert DEFAULT_PROFILE[1] == sum(w for m, w in DEFAULT_PROFILE.items() if m != 1)  # 0.5 on M = 1
    for bad in ("1", "0:1", "1:-1", "x:1", "1:1,1:2", "1:0", "1:abc"):
        with pytest.raises(InputError):
            parse_profile(bad)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(features.execution_codebooks()), st.integers(1, 64), st.integers(1, 1 << 22),
       st.integers(1, 1 << 16), st.sampled_from(features.MODES), st.sampled_from([1, 2, 8, 64]))
def test_features_are_integers_in_declared_order(cb, m, n, kb, mode, ident):
    f = features.launch_features(cb, ident, m, n, 32 * kb, mode, 132)
    assert tuple(f) == features.LAUNCH_FEATURES
    assert all(type(v) is int for v in f.values())
    assert tuple(features.identity_features(cb, n, 32 * kb, 132)) == features.IDENTITY_FEATURES


def test_codebook_names_are_case_insensitive_with_one_spelling_inside(fixture_policy):
    """Issue 50 (3): the GGUF type name a user holds ("Q4_0") and the execution key ("q4_0") select alike, in any
    case; an unknown name is one line listing the known ones."""
    want = fixture_policy.select("q4_0", 4, 1024, 4096, "graph")
    for name in ("Q4_0", "q4_0", "Q4_0".swapcase(), "q4_0".capitalize()):
        assert fixture_policy.select(name, 4, 1024, 4096, "graph") == want
    with pytest.raises(InputError, match=r"unknown codebook 'Q9_9'; known: Q4_0, Q4_1, .*, IQ4_XS"):
        fixture_policy.select("Q9_9", 1, 64, 64, "graph")
    with pytest.raises(InputError, match="not in this policy"):
        fixture_policy.select("Q4_K", 1, 64, 256, "graph")  # known, but this policy was not trained on it


def test_select_refuses_k_that_splits_a_super_block():
    """Issue 50 (1f): a super-block codebook needs K a multiple of 256; a legacy one does not (control)."""
    from policy_fixture import random_policy

    policy = random_policy(31, codebooks=("q4_0", "q4_k", "q6_k"), shapes=((4096, 4096),), overlays=4, depth=3)
    for cb, fmt in (("q4_k", "Q4_K"), ("Q6_K", "Q6_K")):
        with pytest.raises(InputError, match=f"^K=4128 is not a multiple of 256, the super-block of {fmt}$"):
            policy.select(cb, 1, 4096, 4128, "graph")
        assert policy.select(cb, 1, 4096, 4096, "graph").identity >= 1
    assert policy.select("q4_0", 1, 4096, 4128, "graph").identity >= 1


def whitespace_edit(data: bytes) -> bytes:
    """The same JSON content (and digest) in other bytes: one more space of indentation on one line."""
    edited = data.replace(b'\n "format"', b'\n  "format"', 1)
    assert edited != data and json.loads(edited) == json.loads(data)
    return edited


def test_whitespace_only_edits_are_refused_by_every_reader_alike(tmp_path):
    """Issue 50 (1d): `generate` accepted a policy.json edited in white space only (its digest still matches),
    while the certificate reader refused the same edit. Every reader of a digested file (generate, certify and
    explain read policies; generate, install and check read certificates) now refuses it with one message."""
    from click.testing import CliRunner
    from gemv_dispatch.dispatch.cli import main
    from table_fixture import certified_folder, small_policy

    table = certified_folder(tmp_path / "table", small_policy())
    policy_path, cert_path = tmp_path / "policy.json", table / "certificate.json"
    small_policy().save(policy_path)
    good_policy, good_cert = policy_path.read_bytes(), cert_path.read_bytes()
    runs = {
        "generate": ["generate", str(policy_path), "--cert", str(cert_path), "-o", str(tmp_path / "out")],
        "certify": ["certify", str(policy_path), "-o", str(tmp_path / "cert.json"), "--device", "emulator"],
        "explain": ["explain", "q4_0", "1", "256", "512", "--policy", str(policy_path)],
    }
    for name, args in runs.items():
        policy_path.write_bytes(whitespace_edit(good_policy))
        res = CliRunner().invoke(main, args)
        assert res.exit_code == 2, (name, res.output)
        assert res.stderr == (f"error: {policy_path}: not in canonical form: the policy was edited after `train` "
                              "wrote it\n"), (name, res.stderr)
    assert not (tmp_path / "out").exists() and not (tmp_path / "cert.json").exists()
    policy_path.write_bytes(good_policy)
    cert_path.write_bytes(whitespace_edit(good_cert))
    for args in (runs["generate"], ["install", str(table), "--tables", str(tmp_path / "tables")],
                 ["check", str(table), "--device", "emulator"]):
        res = CliRunner().invoke(main, args)
        assert res.exit_code == 2, res.output
        assert res.stderr == (f"error: {cert_path}: not in canonical form: the certificate was edited after "
                              "`certify` wrote it\n"), res.stderr
    cert_path.write_bytes(good_cert)  # control: the files as written pass
    res = CliRunner().invoke(main, runs["generate"])
    assert res.exit_code == 0, res.output
