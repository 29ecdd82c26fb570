"""Shape inventories: shipped files, the synthetic grid, validation, GGUF import and the `shapes` CLI."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from gemv_dispatch.dispatch.cli import main
from gemv_dispatch.dispatch.measure.shapes import (
    GRID_MAX_ELEMENTS,
    ROLES,
    Inventory,
    Shape,
    default_inventory_dir,
    from_config,
    from_gguf,
    inventory_from_dict,
    load_inventories,
    load_inventory,
    synthetic_grid,
    tensor_parallel,
    write_inventory,
    write_synthetic_grid,
)
from gemv_dispatch.kernels.errors import BLOCK, InputError

REQUIRED_MODELS = {
    "llama-3.1-8b", "llama-3.1-70b", "qwen2.5-7b", "qwen2.5-32b", "qwen3-8b",
    "mistral-7b-v0.3", "gemma-2-9b", "phi-3-mini-4k",
}


@pytest.fixture(scope="module")
def shipped() -> dict[str, Inventory]:
    return {inv.name: inv for inv in load_inventories(default_inventory_dir())}


def models(shipped: dict[str, Inventory]) -> list[Inventory]:
    return [inv for inv in shipped.values() if inv.family != "synthetic"]


# --- shipped inventories ------------------------------------------------------------------------

def test_shipped_inventories_cover_required_models_and_ten_families(shipped):
    assert shipped.keys() >= REQUIRED_MODELS
    assert len(models(shipped)) >= 10
    assert len({inv.family for inv in models(shipped)}) >= 10


def test_every_model_has_the_ten_roles_with_whole_blocks(shipped):
    for inv in models(shipped):
        assert [s.role for s in inv.shapes] == list(ROLES), inv.name
        assert all(s.k % BLOCK == 0 and s.n > 0 for s in inv.shapes)
        assert all(s.model == inv.name and s.family == inv.family for s in inv.shapes)
        assert inv.source.endswith("/config.json")


def test_every_model_file_is_derived_from_its_own_config(shipped):
    for inv in models(shipped):
        assert from_config(inv.name, inv.family, inv.source, dict(inv.config)) == inv


@pytest.mark.parametrize(
    ("model", "role", "n", "k"),
    [
        ("llama-3.1-8b", "q", 4096, 4096),
        ("llama-3.1-8b", "k", 1024, 4096),
        ("llama-3.1-8b", "gate_up", 28672, 4096),
        ("llama-3.1-8b", "down", 4096, 14336),
        ("llama-3.1-8b", "lm_head", 128256, 4096),
        ("llama-3.1-70b", "qkv", 10240, 8192),
        ("llama-3.1-70b", "down", 8192, 28672),
        ("qwen2.5-7b", "k", 512, 3584),
        ("qwen2.5-7b", "gate", 18944, 3584),
        ("qwen2.5-7b", "lm_head", 152064, 3584),
        ("qwen2.5-32b", "down", 5120, 27648),
        ("qwen3-8b", "lm_head", 151936, 4096),
        ("mistral-7b-v0.3", "lm_head", 32768, 4096),
        ("gemma-2-9b", "q", 4096, 3584),  # 16 heads × head_dim 256 ≠ hidden 3584
        ("gemma-2-9b", "o", 3584, 4096),
        ("phi-3-mini-4k", "qkv", 9216, 3072),
        ("phi-3-mini-4k", "gate_up", 16384, 3072),
    ],
)
def test_known_dims(shipped, model, role, n, k):
    by_role = {s.role: (s.n, s.k) for s in shipped[model].shapes}
    assert by_role[role] == (n, k)


def test_geometries_are_sorted_and_unique(shipped):
    inv = shipped["llama-3.1-8b"]
    geoms = inv.geometries()
    assert geoms == sorted(set(geoms))
    assert (1024, 4096) in geoms  # k and v share one geometry
    assert len(geoms) == len(inv.shapes) - 3  # k=v, gate=up, q=o (square 4096)


# --- synthetic grid -----------------------------------------------------------------------------

def test_synthetic_grid_file_equals_function(shipped, tmp_path):
    assert shipped["synthetic-grid"] == synthetic_grid()
    regenerated = write_synthetic_grid(tmp_path)
    assert regenerated.read_bytes() == (default_inventory_dir() / "synthetic-grid.json").read_bytes()


def test_synthetic_grid_spans_the_ranges_with_partial_tiles():
    grid = synthetic_grid()
    ns, ks = {s.n for s in grid.shapes}, {s.k for s in grid.shapes}
    assert (min(ns), max(ns), min(ks), max(ks)) == (256, 262144, 256, 65536)
    assert all(s.k % BLOCK == 0 and s.n * s.k <= GRID_MAX_ELEMENTS for s in grid.shapes)
    assert any(k % 64 == BLOCK for k in ks) and any(n % 64 == BLOCK for n in ns)
    assert len(grid.geometries()) == len(grid.shapes) >= 100
    assert grid.family == "synthetic"


# --- validation ---------------------------------------------------------------------------------

def good() -> dict:
    return {"name": "m", "family": "f", "source": "s",
            "shapes": [{"role": "q", "n": 64, "k": 64}, {"role": "k", "n": 64, "k": 64}]}


def with_shape(**entry) -> dict:
    data = good()
    data["shapes"][1] = entry
    return data


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "malformed JSON"),
        ([1, 2], "expected a JSON object"),
        ({"name": "m", "family": "f", "source": "s"}, "missing key(s) shapes"),
        ({**good(), "name": ""}, "'name' must be a non-empty string"),
        ({**good(), "shapes": []}, "'shapes' must be a non-empty list"),
        ({**good(), "config": {"hidden_size": "big"}}, "'config' must be an object of integers"),
        (with_shape(role="k", n=64), r"shapes[1]: missing key(s) k"),
        (with_shape(role="k", n="64", k=64), r"shapes[1] (role 'k'): n must be an integer > 0"),
        (with_shape(role="k", n=64.0, k=64), r"shapes[1] (role 'k'): n must be an integer > 0"),
        (with_shape(role="k", n=True, k=64), r"shapes[1] (role 'k'): n must be an integer > 0"),
        (with_shape(role="k", n=0, k=64), r"shapes[1] (role 'k'): n must be an integer > 0"),
        (with_shape(role="k", n=64, k=-32), r"shapes[1] (role 'k'): k must be an integer > 0"),
        (with_shape(role="k", n=64, k=100), r"shapes[1] (role 'k'): k=100 is not a multiple of 32"),
        (with_shape(role="q", n=32, k=64), r"shapes[1] (role 'q'): duplicate role, already at shapes[0]"),
        (with_shape(role="", n=32, k=64), r"shapes[1]: 'role' must be a non-empty string"),
    ],
)
def test_malformed_inventory_names_file_and_entry(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(InputError) as err:
        load_inventory(path)
    assert str(err.value).startswith(f"{path}: ")
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_duplicate_names_across_files(tmp_path):
    for stem in ("a", "b"):
        (tmp_path / f"{stem}.json").write_text(json.dumps(good()))
    with pytest.raises(InputError, match=r"b\.json: inventory name 'm' is already used by .*a\.json"):
        load_inventories(tmp_path)


def test_missing_file_and_empty_directory(tmp_path):
    with pytest.raises(InputError, match="no such inventory file"):
        load_inventory(tmp_path / "absent.json")
    with pytest.raises(InputError, match="no inventory files"):
        load_inventories(tmp_path)


def test_load_inventories_accepts_files_and_directories(tmp_path):
    single = load_inventories(default_inventory_dir() / "qwen3-8b.json")
    assert [inv.name for inv in single] == ["qwen3-8b"]
    (tmp_path / "m.json").write_text(json.dumps(good()))
    both = load_inventories([tmp_path, default_inventory_dir() / "qwen3-8b.json"])
    assert [inv.name for inv in both] == ["m", "qwen3-8b"]


def test_write_inventory_round_trips_deterministically(tmp_path, shipped):
    inv = shipped["gemma-2-9b"]
    out = write_inventory(inv, tmp_path / "sub" / "g.json")
    assert load_inventory(out) == inv
    text = out.read_text()
    assert text.endswith("}\n") and text == (default_inventory_dir() / "gemma-2-9b.json").read_text()
    assert json.loads(text) == json.loads(json.dumps(json.loads(text), sort_keys=True))
    assert [p.name for p in out.parent.iterdir()] == ["g.json"]  # no temp file left behind


# --- GGUF import --------------------------------------------------------------------------------

def write_gguf(path: Path, tensors: dict[str, tuple[int, ...]], name: str | None = "Tiny Test Model") -> Path:
    """A GGUF file with zero-filled F32 tensors; numpy shapes are (rows=N, cols=K) as in a converter."""
    import gguf

    writer = gguf.GGUFWriter(path, "llama")
    if name is not None:
        writer.add_name(name)
    for tensor_name, shape in tensors.items():
        writer.add_tensor(tensor_name, np.zeros(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


HIDDEN, Q_OUT, KV_OUT, FF, VOCAB = 64, 96, 32, 160, 128

LAYER = {
    "attn_q": (Q_OUT, HIDDEN),
    "attn_k": (KV_OUT, HIDDEN),
    "attn_v": (KV_OUT, HIDDEN),
    "attn_output": (HIDDEN, Q_OUT),
    "ffn_gate": (FF, HIDDEN),
    "ffn_up": (FF, HIDDEN),
    "ffn_down": (HIDDEN, FF),
}


def tiny_model(**extra: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    tensors: dict[str, tuple[int, ...]] = {"token_embd.weight": (VOCAB + 32, HIDDEN)}
    for layer in (0, 1):
        tensors[f"blk.{layer}.attn_norm.weight"] = (HIDDEN,)
        tensors.update({f"blk.{layer}.{base}.weight": shape for base, shape in LAYER.items()})
    tensors["output_norm.weight"] = (HIDDEN,)
    tensors["output.weight"] = (VOCAB, HIDDEN)
    tensors.update(extra)
    return tensors


def test_gguf_reader_reports_ne_order(tmp_path):
    """The convention from_gguf relies on: ReaderTensor.shape is ne = [K, N] for a numpy (N, K) matrix."""
    import gguf

    path = write_gguf(tmp_path / "t.gguf", {"blk.0.attn_q.weight": (Q_OUT, HIDDEN)})
    (tensor,) = gguf.GGUFReader(path).tensors
    assert [int(d) for d in tensor.shape] == [HIDDEN, Q_OUT]


def test_from_gguf_maps_roles_and_orientation(tmp_path):
    inv = from_gguf(write_gguf(tmp_path / "tiny.gguf", tiny_model()))
    assert [(s.role, s.n, s.k) for s in inv.shapes] == [
        ("q", Q_OUT, HIDDEN),
        ("k", KV_OUT, HIDDEN),
        ("v", KV_OUT, HIDDEN),
        ("o", HIDDEN, Q_OUT),
        ("gate", FF, HIDDEN),
        ("up", FF, HIDDEN),
        ("down", HIDDEN, FF),
        ("lm_head", VOCAB, HIDDEN),  # from output.weight; token_embd (VOCAB+32 rows) is skipped
    ]
    assert (inv.name, inv.family, inv.source) == ("tiny-test-model", "llama", "gguf:tiny.gguf")


def test_from_gguf_fused_expert_and_tied_tensors(tmp_path):
    tensors = tiny_model(**{
        "blk.0.attn_qkv.weight": (Q_OUT + 2 * KV_OUT, HIDDEN),
        "blk.0.ffn_up_exps.weight": (4, FF, HIDDEN),  # 4 experts of FF×HIDDEN
    })
    del tensors["output.weight"]  # tied: the engine multiplies by token_embd
    inv = from_gguf(write_gguf(tmp_path / "fused.gguf", tensors, name=None))
    by_role = {s.role: (s.n, s.k) for s in inv.shapes}
    assert by_role["qkv"] == (Q_OUT + 2 * KV_OUT, HIDDEN)
    assert by_role["expert_up"] == (FF, HIDDEN)
    assert by_role["lm_head"] == (VOCAB + 32, HIDDEN)
    assert inv.name == "fused"  # no general.name: the file stem


def test_from_gguf_per_layer_widths_and_bad_k(tmp_path):
    tensors = tiny_model(**{
        "blk.1.ffn_up.weight": (FF + 32, HIDDEN),
        "blk.2.attn_q.weight": (Q_OUT, 48),  # K = 48: not whole blocks
    })
    with pytest.warns(UserWarning, match="skipped 1 tensor"):
        inv = from_gguf(write_gguf(tmp_path / "wide.gguf", tensors))
    roles = [s.role for s in inv.shapes]
    assert f"up:{FF}x{HIDDEN}" in roles and f"up:{FF + 32}x{HIDDEN}" in roles and "up" not in roles
    assert all(s.k % BLOCK == 0 for s in inv.shapes)
    assert load_inventory(write_inventory(inv, tmp_path / "wide.json")) == inv  # still one role per entry


def test_from_gguf_warns_about_unknown_projections(tmp_path):
    tensors = tiny_model(**{"blk.0.attn_kv_a_mqa.weight": (KV_OUT, HIDDEN)})  # MLA: no role of ours
    with pytest.warns(UserWarning, match="unknown role: attn_kv_a_mqa"):
        inv = from_gguf(write_gguf(tmp_path / "mla.gguf", tensors))
    assert len(inv.shapes) == len(LAYER) + 1


def test_from_gguf_rejects_non_gguf_and_missing(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"definitely not gguf")
    with pytest.raises(InputError, match=r"junk\.gguf: not a readable GGUF file"):
        from_gguf(junk)
    with pytest.raises(InputError, match="no such GGUF file"):
        from_gguf(tmp_path / "absent.gguf")
    whole = write_gguf(tmp_path / "whole.gguf", tiny_model()).read_bytes()
    (tmp_path / "cut.gguf").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(InputError, match=r"cut\.gguf: not a readable GGUF file"):
        from_gguf(tmp_path / "cut.gguf")
    empty = write_gguf(tmp_path / "norms.gguf", {"output_norm.weight": (HIDDEN,)})
    with pytest.raises(InputError, match="no GEMV weight tensors"):
        from_gguf(empty)


# --- CLI ----------------------------------------------------------------------------------------

def run(*args: str):
    return CliRunner().invoke(main, ["shapes", *args])


def test_cli_list_table_and_json():
    table = run("list")
    assert table.exit_code == 0, table.output
    rows = [line.split() for line in table.stdout.splitlines()]
    assert ["llama-3.1-8b", "llama-3.1", "10", "7"] in rows
    listed = run("list", "--json")
    assert listed.exit_code == 0
    data = json.loads(listed.stdout)
    assert {"llama-3.1-8b", "synthetic-grid"} <= {inv["name"] for inv in data}


def test_cli_list_bad_file_is_one_line_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(with_shape(role="k", n=64, k=100)))
    result = run("list", str(bad))
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: ")
    assert "bad.json: shapes[1] (role 'k'): k=100" in result.stderr
    assert "Traceback" not in result.output


def test_cli_from_gguf_table_output_and_json(tmp_path):
    model = write_gguf(tmp_path / "tiny.gguf", tiny_model())
    table = run("from-gguf", str(model))
    assert table.exit_code == 0, table.output
    assert "lm_head" in table.stdout and f"n={VOCAB}" in table.stdout

    out = tmp_path / "tiny.json"
    written = run("from-gguf", str(model), "-o", str(out), "--json")
    assert written.exit_code == 0
    assert json.loads(written.stdout) == from_gguf(model).to_dict()
    assert load_inventory(out) == from_gguf(model)


def test_cli_from_gguf_bad_input_is_one_line_error(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"nope")
    result = run("from-gguf", str(junk))
    assert result.exit_code != 0
    assert result.stderr.count("\n") == 1 and "junk.gguf" in result.stderr
    assert "Traceback" not in result.output


@pytest.mark.parametrize("command", [[], ["list"], ["from-gguf"], ["tp"]])
def test_cli_help(command):
    result = run(*command, "--help")
    assert result.exit_code == 0 and "Usage:" in result.stdout


# --- GGUF types: mixed-codebook inventories ------------------------------------------------------

# Super-block types need K a multiple of 256.
T_HIDDEN, T_FF, T_KV, T_VOCAB = 256, 512, 64, 96


def write_typed_gguf(path: Path, tensors: dict[str, tuple[tuple[int, ...], str]]) -> Path:
    """A GGUF file whose tensors have the given numpy shape ((N, K) for a matrix) and GGUF type; formats we
    quantize hold real blocks."""
    import gguf
    from gemv_dispatch.kernels import codebooks

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("Tiny Mixed")
    rng = np.random.default_rng(0)
    for name, (shape, gtype) in tensors.items():
        qtype = gguf.GGMLQuantizationType[gtype]
        if gtype in ("F32", "F16"):
            writer.add_tensor(name, np.zeros(shape, dtype=np.float32 if gtype == "F32" else np.float16))
        elif gtype in codebooks.CODEBOOKS:
            w = rng.standard_normal(shape).astype(np.float32)
            writer.add_tensor(name, codebooks.quantize(gtype, w), raw_dtype=qtype)
        else:  # a type the tool does not run: zero bytes of the right size
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            n, k = shape
            writer.add_tensor(name, np.zeros((n, k // block * size), np.uint8), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def q4_k_m_model(**extra: tuple[tuple[int, ...], str]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Two layers as llama.cpp's Q4_K_M mix stores them: Q4_K, with v and down of some layers in Q6_K."""
    tensors = {"token_embd.weight": ((T_VOCAB, T_HIDDEN), "Q4_K")}
    for layer, wide in ((0, "Q6_K"), (1, "Q4_K")):
        tensors[f"blk.{layer}.attn_norm.weight"] = ((T_HIDDEN,), "F32")
        tensors[f"blk.{layer}.attn_q.weight"] = ((T_HIDDEN, T_HIDDEN), "Q4_K")
        tensors[f"blk.{layer}.attn_v.weight"] = ((T_KV, T_HIDDEN), wide)
        tensors[f"blk.{layer}.ffn_up.weight"] = ((T_FF, T_HIDDEN), "Q4_K")
        tensors[f"blk.{layer}.ffn_down.weight"] = ((T_HIDDEN, T_FF), wide)
    tensors["output.weight"] = ((T_VOCAB, T_HIDDEN), "Q6_K")
    tensors.update(extra)
    return tensors


def test_from_gguf_keeps_each_tensors_type(tmp_path):
    model = write_typed_gguf(tmp_path / "mixed.gguf", q4_k_m_model())
    inv = from_gguf(model)
    assert [(s.role, s.n, s.k, s.codebooks) for s in inv.shapes] == [
        ("q", T_HIDDEN, T_HIDDEN, ("Q4_K",)),
        ("v", T_KV, T_HIDDEN, ("Q4_K", "Q6_K")),  # one entry: the same geometry in two codebooks
        ("up", T_FF, T_HIDDEN, ("Q4_K",)),
        ("down", T_HIDDEN, T_FF, ("Q4_K", "Q6_K")),
        ("lm_head", T_VOCAB, T_HIDDEN, ("Q6_K",)),
    ]
    out = write_inventory(inv, tmp_path / "mixed.json")
    assert load_inventory(out) == inv
    entries = json.loads(out.read_text())["shapes"]
    assert entries[1] == {"role": "v", "n": T_KV, "k": T_HIDDEN, "codebooks": ["Q4_K", "Q6_K"]}
    # The sweep (and tune, which plans through it) sweeps each shape in the types it is stored in.
    from gemv_dispatch.dispatch.measure import sweep

    plan = sweep.parse_plan("all", "1", "graph", [out])
    assert set(plan.geometries) == set(inv.geometries())
    assert sorted((c.codebook, c.n, c.k) for c in plan.cells()) == sorted(
        (cb, s.n, s.k) for s in inv.shapes for cb in s.codebooks)
    only_q6 = sweep.parse_plan("Q6_K", "1", "graph", [out])
    assert {c.codebook for c in only_q6.cells()} == {"Q6_K"}


def test_from_gguf_skips_types_it_cannot_run_and_keeps_float_tensors_untyped(tmp_path):
    tensors = q4_k_m_model(**{
        "blk.0.ffn_gate.weight": ((T_FF, T_HIDDEN), "Q2_K"),
        "blk.1.ffn_gate.weight": ((T_FF, T_HIDDEN), "IQ2_XXS"),
        "blk.0.attn_k.weight": ((T_KV, T_HIDDEN), "F16"),  # unquantized: the geometry, untyped
        "blk.1.attn_output.weight": ((T_HIDDEN, T_HIDDEN), "Q8_0"),
    })
    with pytest.warns(UserWarning) as caught:
        inv = from_gguf(write_typed_gguf(tmp_path / "odd.gguf", tensors))
    (message,) = [str(w.message) for w in caught]
    assert "skipped 2 tensor(s) of a type the tool does not run" in message
    assert "IQ2_XXS (blk.1.ffn_gate.weight); Q2_K (blk.0.ffn_gate.weight)" in message
    by_role = {s.role: s for s in inv.shapes}
    assert "gate" not in by_role
    assert by_role["k"].codebooks == () and by_role["o"].codebooks == ("Q8_0",)
    assert load_inventory(write_inventory(inv, tmp_path / "odd.json")) == inv

    only_bad = {"blk.0.attn_q.weight": ((T_HIDDEN, T_HIDDEN), "Q3_K"), "blk.0.attn_v.weight": ((64, 256), "TQ1_0")}
    refused = r"no GEMV weight tensors .* of a type the tool runs \(skipped: Q3_K \(blk\.0\.attn_q\.weight\); TQ1_0"
    with pytest.warns(UserWarning, match="Q3_K"), pytest.raises(InputError, match=refused):
        from_gguf(write_typed_gguf(tmp_path / "bad.gguf", only_bad))


@pytest.mark.parametrize(
    ("codebooks", "k", "message"),
    [
        ("Q4_K", 256, "'codebooks' must be a non-empty list of codebook names, got 'Q4_K'"),
        ([], 256, "'codebooks' must be a non-empty list"),
        (["Q4_K", 4], 256, "'codebooks' must be a non-empty list"),
        (["Q2_K"], 256, "unknown codebook 'Q2_K'"),
        (["Q4_K", "q4_k"], 256, "lists a codebook twice"),
        (["Q4_0", "Q6_K"], 288, "k=288 is not a multiple of 256, the Q6_K super-block"),
    ],
)
def test_malformed_codebooks_are_named(tmp_path, codebooks, k, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(with_shape(role="k", n=64, k=k, codebooks=codebooks)))
    with pytest.raises(InputError) as err:
        load_inventory(path)
    assert str(err.value).startswith(f"{path}: shapes[1] (role 'k'): ") and message in str(err.value)


def test_codebooks_are_canonical_and_old_files_unchanged(tmp_path):
    path = tmp_path / "typed.json"
    path.write_text(json.dumps(with_shape(role="k", n=64, k=512, codebooks=["q6_k", "IQ4_XS", "Q4_0"])))
    inv = load_inventory(path)
    assert inv.shapes[1].codebooks == ("IQ4_XS", "Q4_0", "Q6_K") and inv.shapes[0].codebooks == ()
    assert "codebooks" not in inv.to_dict()["shapes"][0]  # untyped shapes keep the old form


def test_cli_from_gguf_prints_codebooks(tmp_path):
    model = write_typed_gguf(tmp_path / "mixed.gguf", q4_k_m_model())
    result = run("from-gguf", str(model))
    assert result.exit_code == 0, result.output
    rows = [line.split() for line in result.stdout.splitlines()]
    assert ["v", f"n={T_KV}", f"k={T_HIDDEN}", "Q4_K,Q6_K"] in rows


# --- tensor-parallel inventories -----------------------------------------------------------------

def small_model(heads: int = 8, kv: int = 2, extra: tuple[tuple[str, int, tuple[str, ...]], ...] = ()) -> Inventory:
    """from_config's ten roles, plus `extra` shapes (role, k, codebooks) named like from_gguf's per-geometry
    roles (`down:1024x512`)."""
    config = {"hidden_size": 1024, "intermediate_size": 2048, "num_attention_heads": heads,
              "num_key_value_heads": kv, "head_dim": 64, "vocab_size": 1000}
    inv = from_config("small", "small-family", "test", config)
    more = tuple(Shape(int(role.split(":")[1].split("x")[0]), k, role, "small", "small-family", books)
                 for role, k, books in extra)
    return Inventory(inv.name, inv.family, inv.source, inv.shapes + more, inv.config)


def test_tensor_parallel_splits_columns_by_n_and_rows_by_k(shipped):
    llama = shipped["llama-3.1-8b"]
    for tp in (2, 4, 8):
        split = {s.role: (s.n, s.k) for s in tensor_parallel(llama, tp).shapes}
        whole = {s.role: (s.n, s.k) for s in llama.shapes}
        for role in ("q", "k", "v", "qkv", "gate", "up", "gate_up"):
            assert split[role] == (whole[role][0] // tp, whole[role][1]), (tp, role)
        for role in ("o", "down"):
            assert split[role] == (whole[role][0], whole[role][1] // tp), (tp, role)
        assert split["lm_head"] == (128256 // tp, 4096)  # 128256 is already a multiple of 64
    derived = tensor_parallel(llama, 4)
    assert (derived.name, derived.family) == ("llama-3.1-8b-tp4", "llama-3.1")  # a family leaves out its shards
    assert dict(derived.config)["tensor_parallel"] == 4
    assert inventory_from_dict(derived.to_dict(), "derived") == derived  # a valid inventory file for sweep


def test_tensor_parallel_replicates_kv_heads_and_pads_the_vocabulary():
    split = {s.role: (s.n, s.k) for s in tensor_parallel(small_model(heads=8, kv=2), 4).shapes}
    assert split["q"] == (2 * 64, 1024) and split["k"] == split["v"] == (64, 1024)  # one KV head per rank
    assert split["qkv"] == ((2 + 2) * 64, 1024) and split["o"] == (1024, 2 * 64)
    assert split["lm_head"] == (1024 // 4, 1024)  # 1000 padded to 1024, then split
    assert split["gate_up"] == (2 * 2048 // 4, 1024)


@pytest.mark.parametrize(("inv", "tp", "message"), [
    (small_model(heads=8, kv=2), 3, "small tp=3 role q: 8 attention heads do not split 3 ways"),
    (small_model(heads=12, kv=3), 4, "small tp=4 role q: 3 KV heads neither split 4 ways"),
    (small_model(extra=(("down:1024x512", 512, ("Q4_K",)),)), 4,
     "small tp=4 role down:1024x512: K=512/4=128 is not a multiple of 256 (the Q4_K block)"),
    (small_model(extra=(("down:1024x96", 96, ()),)), 2,
     "small tp=2 role down:1024x96: K=96/2=48 is not a multiple of 32"),
    (small_model(extra=(("gate:2x1024", 1024, ()),)), 4,
     "small tp=4 role gate:2x1024: N=2 leaves less than one output"),
    (synthetic_grid(), 2, "synthetic-grid tp=2 role grid_"),
    (small_model(), 1, "tensor-parallel degree 1: must be 2 or more"),
])
def test_tensor_parallel_refuses_splits_that_do_not_exist(inv, tp, message):
    with pytest.raises(InputError, match=re.escape(message)):
        tensor_parallel(inv, tp)


def test_tensor_parallel_keeps_super_block_k_whole_for_typed_shapes():
    typed = small_model(extra=(("down:1024x1024", 1024, ("Q4_K",)),))
    assert [(s.role, s.k) for s in tensor_parallel(typed, 4).shapes][-1] == ("down:1024x256", 256)
    with pytest.raises(InputError, match=r"K=1024/8=128 is not a multiple of 256 \(the Q4_K block\)"):
        tensor_parallel(typed, 8)
    untyped = small_model(extra=(("down:1024x1024", 1024, ()),))
    assert tensor_parallel(untyped, 8).shapes[-1].k == 128  # untyped: a sweep skips super-block codebooks there


def test_cli_tp_writes_json_files_and_refuses_in_one_line(tmp_path):
    out = tmp_path / "tp"
    written = run("tp", "llama-3.1-8b", "qwen3-8b", "--tp", "2,4", "-o", str(out), "--json")
    assert written.exit_code == 0, written.output
    names = sorted(p.stem for p in out.glob("*.json"))
    assert names == ["llama-3.1-8b-tp2", "llama-3.1-8b-tp4", "qwen3-8b-tp2", "qwen3-8b-tp4"]
    assert [inv["name"] for inv in json.loads(written.stdout)] == [
        "llama-3.1-8b-tp2", "llama-3.1-8b-tp4", "qwen3-8b-tp2", "qwen3-8b-tp4"]
    llama = load_inventory(default_inventory_dir() / "llama-3.1-8b.json")
    assert load_inventories(out)[0] == tensor_parallel(llama, 2)
    table = run("tp", str(default_inventory_dir() / "llama-3.1-8b.json"), "--tp", "8")
    assert table.exit_code == 0 and ["llama-3.1-8b-tp8", "o", "4096", "512"] in [
        line.split() for line in table.stdout.splitlines()]
    refused = tmp_path / "refused"
    for args, message in ((("falcon3-10b", "--tp", "2,8"), "falcon3-10b tp=8 role q: 12 attention heads"),
                          (("llama-3.1-8b", "--tp", "2,x"), "--tp '2,x': expected"),
                          (("no-such-model", "--tp", "2"), "no-such-model: no such inventory file")):
        result = run("tp", *args, "-o", str(refused))
        assert result.exit_code == 2, result.output
        assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
        assert not refused.exists()  # every split is checked before anything is written
