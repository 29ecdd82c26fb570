"""First use (issue 50, 1e and 2): path-kind mistakes are input errors (exit 2, one line), a GPU model names its
corpus or table folder from any folder, `paths` says where everything is, help text counts what it states, the
CuPy hint fits a wheel user, `install --rollback` never guesses a model from a folder's name, writers are atomic."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from corpus_fixture import build_corpus
from gemv_dispatch.dispatch.cli import main
from gemv_dispatch.dispatch.common import paths
from gemv_dispatch.dispatch.learn import policy as policy_module
from gemv_dispatch.dispatch.measure.sweep import parse_plan
from gemv_dispatch.dispatch.serve import install
from gemv_dispatch.dispatch.table import bundle
from gemv_dispatch.kernels.codebooks import CODEBOOKS
from table_fixture import certified_folder, small_policy


def run(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """A shipped-data folder holding a corpus and a certified table of the fake GPU, and a policy file."""
    root = tmp_path_factory.mktemp("data")
    build_corpus(root / "corpus")
    (root / "corpus" / "shapes").symlink_to(paths.shapes_dir())  # rendering digests the shipped inventories
    certified_folder(root / "generated" / "fake-gpu-9000")
    small_policy().save(root / "policy.json")
    return root


@pytest.fixture()
def user(data, tmp_path, monkeypatch) -> Path:
    """A user in an empty folder outside any checkout: shipped data `data`, an empty work folder."""
    monkeypatch.setenv(paths.DATA_ENV, str(data))
    monkeypatch.setenv(paths.HOME_ENV, str(tmp_path / "home"))
    monkeypatch.setenv(paths.TABLES_ENV, str(tmp_path / "tables"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "D").mkdir()
    (tmp_path / "F").write_text("x\n")
    return tmp_path


def one_line(result, code: int = 2) -> str:
    assert result.exit_code == code, result.output
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: "), result.stderr
    return result.stderr.strip()


PATH_KINDS = [
    (("certify", "D", "-o", "x.json"), "error: D: a folder, not a policy file"),
    (("certify", "{policy}", "-o", "D"), "error: D: a folder; name the certificate file to write"),
    (("certify", "{policy}", "-o", "nodir/x.json"), "error: nodir: no such folder to write the certificate file"),
    (("certify", "{policy}", "-o", "x.json", "--corpus", "F"), "error: F: a file, not a corpus folder"),
    (("generate", "D", "--cert", "{cert}"), "error: D: a folder, not a policy file"),
    (("generate", "{policy}", "--cert", "D"), "error: D: a folder, not a certificate file"),
    (("generate", "{policy}", "--cert", "{cert}", "-o", "F"), "error: F: a file; name the folder to write the table"),
    (("train", "F", "-o", "p.json"), "error: F: a file, not a corpus folder"),
    (("train", "fake-gpu-9000", "-o", "D"), "error: D: a folder; name the policy file to write"),
    (("evaluate", "F"), "error: F: a file, not a corpus folder"),
    (("evaluate", "fake-gpu-9000", "--plot", "D"), "error: D: a folder; name the plot file to write"),
    (("explain", "q4_0", "1", "256", "512", "--policy", "D"), "error: D: a folder, not a policy file"),
    (("corpus", "check", "F"), "error: F: a file, not a corpus folder"),
    (("corpus", "compact", "F"), "error: F: a file, not a corpus folder"),
    (("install", "F"), "error: F: a file, not a table folder"),
    (("install", "{cert}"), "error: {cert}: a file, not a table folder"),
    (("install", "fake-gpu-9000", "--tables", "F"), "error: F: a file, not a folder to write below"),
    (("check", "F"), "error: F: a file, not a table folder"),
    (("sweep", "--replay", "F"), "error: F: a file, not a corpus folder"),
    (("sweep", "--replay", "fake-gpu-9000", "--corpus-root", "F"), "error: F: a file, not a folder to write below"),
    (("tune", "--replay", "F"), "error: F: a file, not a corpus folder"),
    (("shapes", "from-gguf", "D"), "error: D: a folder, not a GGUF file"),
]


@pytest.mark.parametrize(("args", "message"), PATH_KINDS, ids=[" ".join(a) for a, _ in PATH_KINDS])
def test_path_kind_mistakes_are_input_errors_in_one_line(args, message, user, data):
    """Issue 50 (1e): `certify DIR` exited 3 "Is a directory", a machine problem. Every command that takes a
    file or a folder says what is wrong with the path given, exit 2, before any work."""
    where = {"policy": data / "policy.json", "cert": data / "generated" / "fake-gpu-9000" / bundle.CERTIFICATE}
    assert one_line(run(*(a.format(**where) for a in args))).startswith(message.format(**where))
    assert sorted(p.name for p in user.iterdir()) == ["D", "F"]  # nothing written


def test_an_os_path_kind_error_from_deep_inside_is_still_exit_2(user, monkeypatch):
    """The command line's net: an IsADirectoryError that no check caught is an input mistake, not exit 3."""
    def read(path, what):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))

    monkeypatch.setattr(policy_module, "read_input", read)
    message = one_line(run("explain", "q4_0", "1", "256", "512", "--policy", "P"))
    assert message == "error: P: a folder where a file was expected"


def test_a_gpu_model_names_its_folders_from_any_folder(user, data):
    """Issue 50 (2): README commands (`corpus check corpus/nvidia-h200`, `install generated/nvidia-h200/`) failed
    outside a checkout. A GPU model (slug or name) or that spelling resolves in the work folder, then the
    shipped data; nothing matching is one line naming where it looked and what is there."""
    for name in ("fake-gpu-9000", "Fake GPU 9000", "corpus/fake-gpu-9000"):
        result = run("corpus", "check", name)
        assert result.exit_code == 0, result.output
        assert result.stdout.startswith(f"{data / 'corpus' / 'fake-gpu-9000'}: ok")
    mine = build_corpus(user / "home" / "corpus", compact=False)  # the work folder comes first
    assert run("corpus", "check", "fake-gpu-9000").stdout.startswith(f"{mine}: ok")
    for name in ("generated/fake-gpu-9000/", "fake-gpu-9000"):
        result = run("install", name)
        assert result.exit_code == 0, result.output
        assert result.stdout.startswith(f"{user / 'tables' / 'fake-gpu-9000'}: current is")
    message = one_line(run("corpus", "check", "nvidia-a100"))
    assert message == (f"error: nvidia-a100: no such corpus folder, nor a GPU model with one in "
                       f"{user / 'home' / 'corpus'} or {data / 'corpus'} (there: fake-gpu-9000)")
    assert "(there: fake-gpu-9000)" in one_line(run("check", "generated/nvidia-a100"))


def test_paths_names_every_location(user, data):
    result = run("paths", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report == {
        "shapes": str(data / "corpus" / "shapes"), "shipped_corpora": str(data / "corpus"),
        "shipped_tables": str(data / "generated"), "work_folder": str(user / "home"),
        "work_corpora": str(user / "home" / "corpus"), "work_generated": str(user / "home" / "generated"),
        "installed_tables": str(user / "tables"), "locks": str(paths.lock_dir()),
        "gpu_models_with_a_corpus": ["fake-gpu-9000"], "gpu_models_with_a_table": ["fake-gpu-9000"],
    }
    text = run("paths").stdout
    assert f"installed tables: {user / 'tables'}  (${paths.TABLES_ENV})" in text


def test_sweep_help_counts_the_default_plan_now():
    """Issue 50 (2): the help said six codebooks, 1,728 cells and 6.5 minutes long after the plan grew."""
    text = " ".join(run("sweep", "--help").stdout.split())
    plan = parse_plan()
    assert f"all {len(CODEBOOKS)} codebooks" in text and f"racing: {len(plan.cells())} cells" in text
    assert f"the {len(plan.geometries)} (N, K) geometries" in text
    assert "six" not in text and "1728" not in text and "minutes" not in text


def test_the_cupy_hint_fits_an_installed_wheel(monkeypatch):
    from gemv_dispatch.kernels import launch
    from gemv_dispatch.kernels.errors import EnvironmentProblem

    monkeypatch.setattr(launch, "cupy", None)
    with pytest.raises(EnvironmentProblem) as caught:
        launch.require_cupy()
    assert "pip install 'gemv-dispatch[cuda]'" in str(caught.value) and "cupy-cuda12x" in str(caught.value)
    assert ".[cuda]" not in str(caught.value).replace("gemv-dispatch[cuda]", "")


def test_rollback_takes_a_model_or_a_certified_folder_never_a_folder_name(user, data):
    """Issue 50 (2): `install --rollback FOLDER` used the folder's name as the model."""
    table = data / "generated" / "fake-gpu-9000"
    other = certified_folder(user / "b" / "fake-gpu-9000", small_policy(22, overlays=5))
    assert run("install", table).exit_code == 0 and run("install", other).exit_code == 0
    renamed = user / "nvidia-h200"  # a table folder whose name is another model's
    renamed.mkdir()
    for name in bundle.FILES:
        (renamed / name).write_bytes((table / name).read_bytes())
    assert one_line(run("install", "--rollback", "nvidia-h200")).startswith(
        "error: nvidia-h200: ambiguous: the GPU model nvidia-h200, or the folder here holding a table for Fake GPU")
    for given in (user / "nvidia-h200", "fake-gpu-9000", "Fake GPU 9000"):  # a certified folder, a slug, a name
        result = run("install", "--rollback", given)
        assert result.exit_code == 0, result.output
        assert result.stdout.startswith(f"{user / 'tables' / 'fake-gpu-9000'}: current is")
    assert "ambiguous" in one_line(run("install", "--rollback", "D"))
    assert "names no GPU model" in one_line(run("install", "--rollback", user / "D"))
    assert "no installed table" in one_line(run("install", "--rollback", "nvidia-a100"))


def test_generate_without_output_writes_the_policy_beside_the_module_as_tune_does(user, data):
    result = run("generate", data / "policy.json", "--cert", data / "generated" / "fake-gpu-9000" / bundle.CERTIFICATE)
    assert result.exit_code == 0, result.output
    folder = user / "home" / "generated" / "fake-gpu-9000"
    assert sorted(p.name for p in folder.iterdir()) == sorted([*bundle.FILES, bundle.POLICY])
    assert (folder / bundle.POLICY).read_bytes() == (data / "policy.json").read_bytes()


@pytest.mark.parametrize("failing", ["third staged file", "second rename"])
def test_generate_writes_all_files_or_none(failing, user, data, monkeypatch):
    """Every file is staged (written and synced) before the first rename: a full disk while staging changes no
    file and removes the folder it made; the renames themselves cannot run out of space."""
    from gemv_dispatch.dispatch.common import files

    out = user / "out" / "fake-gpu-9000"
    calls = {"fsync": 0, "replace": 0}
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        calls["fsync"] += 1
        if failing == "third staged file" and calls["fsync"] == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    def replace(a, b):
        calls["replace"] += 1
        if failing == "second rename" and calls["replace"] == 2:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_replace(a, b)

    monkeypatch.setattr(files.os, "fsync", fsync)
    monkeypatch.setattr(files.os, "replace", replace)
    result = run("generate", data / "policy.json", "--cert", data / "generated" / "fake-gpu-9000" / bundle.CERTIFICATE,
                 "-o", out)
    one_line(result, 3)
    if failing == "third staged file":
        assert not (user / "out").exists()  # nothing renamed, and the folders it made are gone
    else:
        assert [p.name for p in out.iterdir()] == [bundle.MODULE]  # no temp file; the rest still absent
    monkeypatch.undo()
    assert run("generate", data / "policy.json", "--cert", data / "generated" / "fake-gpu-9000" / bundle.CERTIFICATE,
               "-o", out).exit_code == 0  # control: the same command with a working disk


def test_policy_save_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "policy.json"
    small_policy().save(path)
    before = path.read_bytes()
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left")))
    with pytest.raises(OSError, match="No space left") as caught:
        small_policy(22).save(path)
    monkeypatch.undo()
    assert caught.value.filename == str(path)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["policy.json"]


def test_install_repairs_through_the_cli_and_check_installed_takes_a_model(user, data, monkeypatch):
    monkeypatch.setattr(install, "current_gpu", lambda: None)
    assert run("install", "fake-gpu-9000").exit_code == 0
    assert "names no GPU model" in one_line(run("check", "--installed", user / "D"))
