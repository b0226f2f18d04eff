"""`ds4-imatrix collect` end to end on the `tiny` model: both output formats, the GGUF one read by the
`gguf` package, counts equal to tokens × experts used, the heat-map, and Ctrl+C leaving a valid
partial file."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

import gguf
import numpy as np

from ds4.imatrix import format as F

TEXT = "\n".join(f"\n===== DS4_IMATRIX_PROMPT p{i} test nothink src =====\n"
                 f"<｜begin▁of▁sentence｜><｜User｜>Question {i}: why do rivers bend and meander over time?"
                 f"<｜Assistant｜></think>Because erosion on the outer bank ... {i}<｜end▁of▁sentence｜>"
                 for i in range(6))


def _cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "ds4.imatrix.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=300, **kw)


def test_collect_writes_both_formats(tiny_gguf, tmp_path):
    from ds4.engine.model import Model

    cfg = Model.load(tiny_gguf).config
    src = tmp_path / "calib.txt"
    src.write_text(TEXT)
    out = tmp_path / "im.gguf"
    r = _cli("collect", "-m", tiny_gguf, "--rendered", src, "-o", out, "--max-tokens", 150, "--chunk", 32,
             "--heatmap", tmp_path / "heat.png")
    assert r.returncode == 0, r.stderr
    assert "tok/s" in r.stderr and "150 tokens" in r.stderr
    assert "experts never routed" in r.stdout
    reader = gguf.GGUFReader(out)
    assert reader.fields["general.type"].contents() == "imatrix"
    assert reader.fields["imatrix.datasets"].contents() == [str(src)]
    tensors = {t.name: t for t in reader.tensors}
    for layer in range(cfg.n_layer):
        for kind in ("gate", "up", "down"):
            counts = np.asarray(tensors[f"blk.{layer}.ffn_{kind}_exps.weight.counts"].data).reshape(-1)
            assert counts.sum() == 150 * cfg.n_expert_used  # every (token, slot) counted once
        width = cfg.n_embd
        assert list(tensors[f"blk.{layer}.ffn_gate_exps.weight.in_sum2"].shape) == [width, cfg.n_expert]
    assert (tmp_path / "heat.png").stat().st_size > 1000

    from ds4.imatrix.cli import main  # in-process this time (the subprocess path is covered above)

    assert main(["collect", "-m", str(tiny_gguf), "--rendered", str(src), "-o", str(tmp_path / "im.dat"),
                 "--max-prompts", "2", "-q"]) == 0
    dat = F.load(tmp_path / "im.dat")
    assert len(dat.entries) == 3 * cfg.n_layer and dat.datasets == [str(src)] and not dat.partial
    name = "blk.3.ffn_down_exps.weight"
    assert dat.entries[name].ncols == cfg.n_expert * cfg.expert_ffn
    assert np.all(dat.entries[name].sum2 > 0)


def test_ctrl_c_writes_a_valid_partial_file(tiny_gguf, tmp_path):
    src = tmp_path / "calib.txt"
    src.write_text(TEXT * 40)  # 240 prompts: far more than runs before the interrupt
    out = tmp_path / "partial.gguf"
    proc = subprocess.Popen([sys.executable, "-m", "ds4.imatrix.cli", "collect", "-m", str(tiny_gguf),
                             "--rendered", str(src), "-o", str(out), "--chunk", "16"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = threading.Event()
    err: list[str] = []

    def read_err():
        while True:
            ch = proc.stderr.read(1)
            if not ch:
                break
            err.append(ch)
            if "prompts=" in "".join(err[-200:]):
                seen.set()

    t = threading.Thread(target=read_err, daemon=True)
    t.start()
    assert seen.wait(240), "".join(err)
    proc.send_signal(signal.SIGINT)
    rc = proc.wait(120)
    t.join(5)
    assert rc == 130, "".join(err)
    assert "partial" in "".join(err)
    im = F.load(out)
    assert im.partial and im.tokens > 0
    c = im.entries["blk.0.ffn_gate_exps.weight"].counts
    assert c.sum() == im.tokens * 2  # consistent: the sums describe exactly the tokens counted
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.txt", "partial.gguf"]
