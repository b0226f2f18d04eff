"""The q2-q4 product two ways (tooling-spec §1.8-1.9): `ds4-quantize convert --q4-last-layers N`
and `ds4-quantize splice` of the q2 file with the q4 file's last layers; published file names.

A reduced checkpoint (hidden 256, expert ffn 256, 4 layers, 8 experts) is converted three times
with the real CLI: q2, q4 and q2-q4 (last 2 layers q4, written with `--out-dir`). The oracles are
the q2 and q4 files themselves (each tensor of the mixed product must be the q2 or the q4 file's
tensor, by layer) and the spec's published names; the splice must then rebuild the q2-q4 file
byte for byte from q2 + q4.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from ds4.engine.config import preset
from ds4.gguf_tools.constants import QuantType
from ds4.gguf_tools.plan import Policy, model_stem, published_filename
from ds4.gguf_tools.reader import open_gguf, open_model
from ds4.gguf_tools.splice import SpliceError, parse_layers
from ds4.gguf_tools.synth import synth_checkpoint

from conftest import quantize_cli
from ds4_tool_util import reduced_config

Q = QuantType
ROUTED = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
MIXED_NAME = ("ds4-red-Layers02-03Q4KExperts-OtherExpertLayersIQ2XXSGateUp-Q2KDown-AProjQ8-SExpQ8-OutQ8-"
              "chat-v2.gguf")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("splice")
    hf = synth_checkpoint(reduced_config(n_expert=8), root / "ds4-red", seed=4)
    out = {"root": root, "hf": hf}
    for mix in ("q2", "q4"):
        out[mix] = root / f"{mix}.gguf"
        quantize_cli("convert", str(hf), str(out[mix]), "--type", "q8_0", "--mix", mix, "--quiet")
    (root / "products").mkdir()
    quantize_cli("convert", str(hf), "--type", "q8_0", "--mix", "q2", "--q4-last-layers", "2",
                 "--out-dir", str(root / "products"), "--quiet")
    out["mixed"] = root / "products" / MIXED_NAME
    return out


def _cli(*args: str) -> subprocess.CompletedProcess:
    return quantize_cli(*args, check=False)


# ---- --q4-last-layers ---------------------------------------------------------------------------

def test_q4_last_layers_takes_each_tensor_from_the_q2_or_q4_product(files):
    assert files["mixed"].is_file(), sorted(p.name for p in (files["root"] / "products").iterdir())
    mixed, q2, q4 = (open_model(files[k]) for k in ("mixed", "q2", "q4"))
    assert list(mixed.tensors) == list(q2.tensors)
    assert mixed.metadata == q2.metadata
    n_routed = 0
    for name, t in mixed.tensors.items():
        m = ROUTED.match(name)
        src = q4 if m and int(m.group(1)) >= 2 else q2
        assert t.qtype == src.tensors[name].qtype, name
        assert bytes(mixed.raw(name)) == bytes(src.raw(name)), name
        n_routed += m is not None
    assert n_routed == 12
    want = {0: (Q.IQ2_XXS, Q.IQ2_XXS, Q.Q2_K), 3: (Q.Q4_K, Q.Q4_K, Q.Q4_K)}
    for layer, types in want.items():
        assert tuple(mixed.tensors[f"blk.{layer}.ffn_{p}_exps.weight"].qtype for p in ("gate", "up", "down")) == types


def test_q4_last_layers_mistakes_are_one_line_errors(files, tmp_path):
    hf = str(files["hf"])
    for args, msg in ((["--mix", "q4", "--q4-last-layers", "2"], "goes with --mix q2"),
                      (["--q4-last-layers", "5"], "this model has 4 layers"),
                      (["--q4-last-layers", "-1"], "layer count >= 0")):
        r = _cli("convert", hf, str(tmp_path / "x.gguf"), "--type", "q8_0", *args)
        assert r.returncode == 2 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = _cli("convert", hf, str(tmp_path / "x.gguf"), "--out-dir", str(tmp_path))
    assert r.returncode == 2 and "not both" in r.stderr
    r = _cli("convert", hf, "--out-dir", str(tmp_path / "nope"))
    assert r.returncode == 2 and "no such directory" in r.stderr
    assert not any(tmp_path.iterdir())


def test_out_directory_gets_the_published_name(files, tmp_path):
    # OUT naming an existing directory behaves like --out-dir; the flags after the checkpoint are fine
    r = _cli("convert", str(files["hf"]), "--type", "q8_0", "--mix", "q2", "--q4-last-layers", "2", str(tmp_path),
             "--dry-run")
    assert r.returncode == 0 and MIXED_NAME in r.stderr, r.stderr


def test_published_names_match_the_spec():
    """The three product names of tooling-spec §1.8, for the Flash shape (43 layers)."""
    flash = preset("flash")
    stem = model_stem(flash, "unused")
    assert stem == "DeepSeek-V4-Flash"
    assert model_stem(reduced_config(), "ds4-red") == "ds4-red"
    name = lambda **kw: published_filename(stem, Policy(base="q8_0", **kw), flash.n_layer, imatrix=True)  # noqa: E731
    assert name(mix="q2") == "DeepSeek-V4-Flash-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-chat-v2-imatrix.gguf"
    assert name(mix="q4") == ("DeepSeek-V4-Flash-Q4KExperts-F16HC-F16Compressor-F16Indexer-Q8Attn-Q8Shared-"
                              "Q8Out-chat-v2-imatrix.gguf")
    assert name(mix="q2", q4_last_layers=6) == (
        "DeepSeek-V4-Flash-Layers37-42Q4KExperts-OtherExpertLayersIQ2XXSGateUp-Q2KDown-AProjQ8-SExpQ8-OutQ8-"
        "chat-v2-imatrix.gguf")
    assert published_filename(stem, Policy(base="q8_0", mix="q2", shared=Q.Q4_K), 43).endswith("-custom.gguf")
    assert published_filename(stem, Policy(base="f16"), 43) == "DeepSeek-V4-Flash-F16.gguf"


# ---- splice -------------------------------------------------------------------------------------

def test_splice_rebuilds_the_q2_q4_product_byte_for_byte(files, tmp_path):
    out = tmp_path / "spliced.gguf"
    r = _cli("splice", "--base", str(files["q2"]), "--donor", str(files["q4"]), "--q4-layers", "2-3",
             "--out", str(out), "--quiet")
    assert r.returncode == 0, r.stderr
    assert "donor_tensors: 6" in r.stdout
    q2_size = files["q2"].stat().st_size
    delta = int(re.search(r"delta_bytes: \+(\d+)", r.stdout).group(1))
    assert out.stat().st_size == q2_size + delta
    assert out.read_bytes() == files["mixed"].read_bytes()
    assert not (tmp_path / "spliced.gguf.tmp").exists()
    # the base's header and metadata stay verbatim, whatever the selection
    out2 = tmp_path / "one.gguf"
    _cli("splice", "--base", str(files["q2"]), "--donor", str(files["q4"]), "--layers", "0,3", "--out", str(out2),
         "--quiet")
    f = open_model(out2)
    assert [f.tensors[f"blk.{i}.ffn_down_exps.weight"].qtype for i in range(4)] == [Q.Q4_K, Q.Q2_K, Q.Q2_K, Q.Q4_K]
    header_end = open_gguf(files["q2"]).tensors  # same directory order as the base
    assert list(f.tensors) == list(header_end)
    assert f.metadata == open_gguf(files["q2"]).metadata


def test_splice_dry_run_and_force(files, tmp_path):
    out = tmp_path / "o.gguf"
    args = ["splice", "--base", str(files["q2"]), "--donor", str(files["q4"]), "--q4-layers", "3", "--out", str(out),
            "--quiet"]
    r = _cli(*args, "--dry-run")
    assert r.returncode == 0 and "donor_tensors: 3" in r.stdout and not out.exists()
    out.write_bytes(b"keep me")
    r = _cli(*args)
    assert r.returncode == 2 and "--force" in r.stderr and out.read_bytes() == b"keep me"
    assert _cli(*args, "--force").returncode == 0
    assert open_model(out).tensors["blk.3.ffn_gate_exps.weight"].qtype == Q.Q4_K


def test_splice_mistakes_are_one_line_errors(files, tiny_gguf, tmp_path):
    q2, q4 = str(files["q2"]), str(files["q4"])
    truncated = tmp_path / "trunc.gguf"
    truncated.write_bytes(files["q4"].read_bytes()[:100_000])
    (tmp_path / "left.gguf.tmp").write_bytes(b"")
    cases = [
        ((q2, str(tiny_gguf), "2"), "o.gguf", "different models"),
        ((q2, q4, "2-9"), "o.gguf", "the model has layers 0-3"),
        ((q2, q4, "3-2"), "o.gguf", "descending range"),
        ((q2, q4, "a"), "o.gguf", "not a layer id"),
        ((q2, str(truncated), "2"), "o.gguf", "truncated"),
        ((q2, str(tmp_path / "none.gguf"), "2"), "o.gguf", "no such file"),
        ((q2, q4, "2"), "left.gguf", "left by an interrupted run"),
    ]
    for (base, donor, spec), out, msg in cases:
        r = _cli("splice", "--base", base, "--donor", donor, "--q4-layers", spec, "--out", str(tmp_path / out))
        assert r.returncode == 2 and msg in r.stderr, (spec, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["left.gguf.tmp", "trunc.gguf"]


def test_parse_layers():
    assert parse_layers("37-42") == [37, 38, 39, 40, 41, 42]
    assert parse_layers("0-2,40-42") == [0, 1, 2, 40, 41, 42]
    assert parse_layers("5, 3,5") == [3, 5]
    for bad in ("", "4-3", "1,,2", "x", "-3"):
        with pytest.raises(SpliceError):
            parse_layers(bad)


def test_splice_streams_a_donor_of_another_seed(files, tmp_path):
    """Same config, different weights (another seed): allowed; the chosen layers carry the donor's bytes."""
    hf = synth_checkpoint(reduced_config(n_expert=8), tmp_path / "other", seed=11)
    donor = tmp_path / "q2b.gguf"
    quantize_cli("convert", str(hf), str(donor), "--type", "q8_0", "--mix", "q2", "--quiet")
    out = tmp_path / "o.gguf"
    r = _cli("splice", "--base", str(files["q2"]), "--donor", str(donor), "--layers", "1", "--out", str(out), "--quiet")
    assert r.returncode == 0, r.stderr
    f, a, b = open_gguf(out), open_gguf(files["q2"]), open_gguf(donor)
    for name in f.tensors:
        m = ROUTED.match(name)
        src = b if m and m.group(1) == "1" else a
        assert bytes(f.raw(name)) == bytes(src.raw(name)), name
    assert bytes(a.raw("blk.1.ffn_up_exps.weight")) != bytes(b.raw("blk.1.ffn_up_exps.weight"))
    shutil.rmtree(tmp_path / "other")
