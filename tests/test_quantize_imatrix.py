"""`ds4-quantize convert --imatrix` and `--compare-tensor` (tooling-spec §1.6-1.7).

A reduced checkpoint (hidden 256, 8 experts) is synthesized; imatrix files are written with our
imatrix writer (legacy .dat and GGUF) from known per-expert importance rows. Expected bytes come
from the quantizer kernels (held byte-identical to ggml elsewhere) applied to the checkpoint's
own expert matrices with the importance row the spec's lookup must pick.
"""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest

from ds4.gguf_tools.compare import FNV_OFFSET, fnv1a64, fnv1a64_reference
from ds4.gguf_tools.constants import QuantType
from ds4.gguf_tools.hf import HFCheckpoint
from ds4.gguf_tools.layout import layout_by_name
from ds4.gguf_tools.plan import Policy
from ds4.gguf_tools.quantize import generate_tensor
from ds4.gguf_tools.quants import quantize
from ds4.gguf_tools.reader import open_gguf
from ds4.gguf_tools.synth import synth_checkpoint
from ds4.imatrix import format as imformat

from conftest import quantize_cli
from ds4_tool_util import reduced_config

GATE = "blk.1.ffn_gate_exps.weight"
DOWN = "blk.1.ffn_down_exps.weight"
Q2 = Policy(base="q8_0", mix="q2")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("imatrix_convert")
    cfg = reduced_config(n_expert=8)
    hf = synth_checkpoint(cfg, root / "hf", seed=5)
    rng = np.random.default_rng(9)
    im = imformat.Imatrix(datasets=["unit-test"], chunks=3)
    for li in range(cfg.n_layer):
        for part, ncols in (("gate", cfg.n_embd), ("up", cfg.n_embd), ("down", cfg.expert_ffn)):
            sum2 = rng.gamma(0.5, 1.0, (cfg.n_expert, ncols)).astype(np.float32)
            counts = rng.integers(1, 50, cfg.n_expert).astype(np.float32)
            im.entries[f"blk.{li}.ffn_{part}_exps.weight"] = imformat.ImatrixEntry(sum2, counts)
    imformat.save(root / "im.dat", im)
    imformat.save(root / "im.gguf", im)
    return {"root": root, "hf": hf, "cfg": cfg, "im": im}


def _expert_bytes(work, name: str, qtype: QuantType, importance_of) -> np.ndarray:
    ckpt = HFCheckpoint(work["hf"])
    slot = layout_by_name(work["cfg"])[name]
    return np.concatenate([quantize(qtype, w, importance_of(e)).reshape(-1)
                           for e, w in enumerate(ckpt.iter_slot(slot))])


def test_imatrix_sets_per_expert_importance_for_q2_targets(work):
    im = work["im"]
    plan, none = generate_tensor(work["hf"], GATE, Q2)
    assert plan.qtype == QuantType.IQ2_XXS
    _, dat = generate_tensor(work["hf"], GATE, Q2, imatrix=str(work["root"] / "im.dat"))
    _, ggf = generate_tensor(work["hf"], GATE, Q2, imatrix=str(work["root"] / "im.gguf"))
    assert not np.array_equal(dat, none)  # the imatrix changes the IQ2_XXS bytes
    np.testing.assert_array_equal(dat, ggf)  # both formats carry the same importance
    gate_imp = im.entries[GATE].importance()  # [n_expert, ncols] = sum2 / counts
    np.testing.assert_array_equal(dat, _expert_bytes(work, GATE, QuantType.IQ2_XXS, lambda e: gate_imp[e]))
    np.testing.assert_array_equal(none, _expert_bytes(work, GATE, QuantType.IQ2_XXS, lambda e: None))
    _, down = generate_tensor(work["hf"], DOWN, Q2, imatrix=str(work["root"] / "im.dat"))
    down_imp = im.entries[DOWN].importance()
    np.testing.assert_array_equal(down, _expert_bytes(work, DOWN, QuantType.Q2_K, lambda e: down_imp[e]))


def test_missing_entry_falls_back_and_strict_refuses(work, tmp_path):
    partial = imformat.Imatrix(entries={k: v for k, v in work["im"].entries.items() if k != GATE})
    imformat.save(tmp_path / "partial.dat", partial)
    _, none = generate_tensor(work["hf"], GATE, Q2)
    _, fallback = generate_tensor(work["hf"], GATE, Q2, imatrix=str(tmp_path / "partial.dat"))
    np.testing.assert_array_equal(fallback, none)  # IQ2_XXS falls back to the synthetic importance
    r = quantize_cli("convert", str(work["hf"]), str(tmp_path / "x.gguf"), "--type", "q8_0", "--mix", "q2",
                     "--imatrix", str(tmp_path / "partial.dat"), "--imatrix-strict", "--quiet", check=False)
    assert r.returncode == 2 and GATE in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "x.gguf").exists() and not list(tmp_path.glob(".x.gguf*"))
    bad = imformat.Imatrix(entries={GATE: imformat.ImatrixEntry(np.ones((1, 100), np.float32), np.ones(1))})
    imformat.save(tmp_path / "bad.dat", bad)
    r = quantize_cli("convert", str(work["hf"]), str(tmp_path / "y.gguf"), "--mix", "q2", "--imatrix",
                     str(tmp_path / "bad.dat"), "--quiet", check=False)
    assert r.returncode == 2 and "100" in r.stderr and "Traceback" not in r.stderr
    (tmp_path / "junk.dat").write_bytes(b"\x05\x00")
    r = quantize_cli("convert", str(work["hf"]), str(tmp_path / "z.gguf"), "--imatrix", str(tmp_path / "junk.dat"),
                     check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_convert_writes_imatrix_metadata_and_compare_tensor(work, tmp_path):
    out = tmp_path / "q2-imatrix.gguf"
    imfile = str(work["root"] / "im.dat")
    quantize_cli("convert", str(work["hf"]), str(out), "--type", "q8_0", "--mix", "q2", "--imatrix", imfile, "--quiet")
    reader = gguf.GGUFReader(out)
    f = reader.fields
    assert f["quantize.imatrix.file"].contents() == imfile
    assert f["quantize.imatrix.entries_count"].types == [gguf.GGUFValueType.UINT64]
    assert f["quantize.imatrix.entries_count"].contents() == len(work["im"].entries)
    assert f["quantize.imatrix.chunks_count"].contents() == 3
    assert f["quantize.imatrix.dataset"].contents() == "unit-test"
    stored = open_gguf(out).raw(GATE).reshape(-1)
    _, want = generate_tensor(work["hf"], GATE, Q2, imatrix=imfile)
    np.testing.assert_array_equal(stored, want)

    args = ["convert", str(work["hf"]), str(out), "--type", "q8_0", "--mix", "q2", "--imatrix", imfile,
            "--compare-tensor", GATE]
    ok = quantize_cli(*args, check=False)
    assert ok.returncode == 0, ok.stderr
    lines = dict(line.split(": ", 1) for line in ok.stdout.strip().splitlines())
    assert lines["tensor"] == GATE and lines["type"] == "IQ2_XXS" and lines["byte_compare"] == "OK"
    assert lines["generated_bytes"] == lines["reference_bytes"] == str(stored.size)
    assert lines["generated_fnv1a64"] == lines["reference_fnv1a64"] == f"{fnv1a64_reference(stored.tobytes()):016x}"

    perturbed = tmp_path / "perturbed.gguf"
    shutil.copyfile(out, perturbed)
    info = open_gguf(perturbed).info(GATE)
    with open(perturbed, "r+b") as fh:
        fh.seek(info.offset + 1000)
        byte = fh.read(1)[0]
        fh.seek(info.offset + 1000)
        fh.write(bytes([byte ^ 0x10]))
    bad = quantize_cli(*args, "--compare-gguf", str(perturbed), check=False)
    assert bad.returncode == 1
    lines = dict(line.split(": ", 1) for line in bad.stdout.strip().splitlines())
    assert lines["byte_compare"] == "FAIL mismatches=1 first=1000"
    assert lines["generated_fnv1a64"] != lines["reference_fnv1a64"]
    # without the imatrix the regenerated tensor no longer matches the file made with it
    plain = quantize_cli(*args[:-4], "--compare-tensor", GATE, check=False)
    assert plain.returncode == 1 and "byte_compare: FAIL" in plain.stdout


def test_fnv1a64():
    assert fnv1a64(b"") == FNV_OFFSET
    assert fnv1a64(b"a") == 0xAF63DC4C8601EC8C  # published FNV-1a 64 test vector
    data = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    assert fnv1a64(data) == fnv1a64_reference(data)
