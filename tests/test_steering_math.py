"""Steering math and flags: the projection edit of model-spec §6, stacking, the direction builder's
difference of means (tooling-spec §8.2), and the reusable argparse helper."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from ds4.steering import apply as A
from ds4.steering.build import direction_from_activations, normalize, read_prompt_file, render_prompt
from ds4.steering.format import DirectionSet, SteeringFileError, write_f32


def _unit(rng, d):
    v = rng.standard_normal(d).astype(np.float32)
    return v / np.linalg.norm(v)


def test_projection_removes_keeps_and_amplifies():
    rng = np.random.default_rng(0)
    D = 64
    v = _unit(rng, D)
    y = rng.standard_normal((5, D)).astype(np.float32) * 3
    along = y @ v
    ortho = y - along[:, None] * v
    out1 = A.project_out(y, v, 1.0)
    np.testing.assert_allclose(out1 @ v, 0.0, atol=1e-5)  # s = 1: component along v removed
    np.testing.assert_allclose(out1, ortho, atol=1e-5)  # ... and nothing else touched
    assert np.array_equal(A.project_out(y, v, 0.0), y)  # s = 0: untouched, bit for bit
    for s in (-2.0, -0.5, 0.3, 1.7):
        out = A.project_out(y, v, s)
        np.testing.assert_allclose(out @ v, (1 - s) * along, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(out - (out @ v)[:, None] * v, ortho, atol=1e-5)  # orthogonal part unchanged
    # the vectorised edit equals the sequential CPU-order reference
    np.testing.assert_allclose(A.project_out(y, v, 0.75), A.project_out_reference(y, v, 0.75), rtol=1e-6, atol=1e-6)


def test_stacked_directions_apply_in_order_with_their_own_scales():
    rng = np.random.default_rng(1)
    L, D = 3, 32
    sets = [DirectionSet(np.stack([_unit(rng, D) for _ in range(L)])) for _ in range(3)]
    stack = [A.SteeringDirection(sets[0], attn_scale=0.5, ffn_scale=1.0),
             A.SteeringDirection(sets[1], attn_scale=0.0, ffn_scale=-1.5),
             A.SteeringDirection(sets[2], attn_scale=2.0, ffn_scale=0.0)]
    st = A.Steering(stack)
    y = rng.standard_normal((4, D)).astype(np.float32)
    for layer in range(L):
        want = A.project_out(A.project_out(y, sets[0].vectors[layer], 1.0), sets[1].vectors[layer], -1.5)
        np.testing.assert_allclose(st.edit(layer, "ffn", y), want, rtol=1e-6)
        want = A.project_out(A.project_out(y, sets[0].vectors[layer], 0.5), sets[2].vectors[layer], 2.0)
        np.testing.assert_allclose(st.edit(layer, "attn", y), want, rtol=1e-6)
    assert A.Steering([A.SteeringDirection(sets[0], 0.0, 0.0)]).edit(0, "ffn", y) is None
    with pytest.raises(ValueError):
        A.Steering([A.SteeringDirection(sets[0])] * 9)


def test_direction_from_activations():
    rng = np.random.default_rng(2)
    n, L, D = 20, 3, 16
    bad = rng.standard_normal((n, L, D)) + 2.0
    good = rng.standard_normal((n, L, D)) + 2.0
    d = direction_from_activations(good, bad, orthogonalize=False)
    want = good.mean(0) - bad.mean(0)
    np.testing.assert_allclose(d, want / np.linalg.norm(want, axis=1, keepdims=True), rtol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(d, axis=1), 1.0, rtol=1e-6)
    d_orth = direction_from_activations(good, bad)
    b = normalize(bad.mean(0))
    np.testing.assert_allclose(np.sum(d_orth * b, axis=1), 0.0, atol=1e-6)  # orthogonal to the control mean
    np.testing.assert_allclose(np.linalg.norm(d_orth, axis=1), 1.0, rtol=1e-6)
    d_pair = direction_from_activations(good, bad, pair_normalize=True, orthogonalize=False)
    diffs = good - bad
    pn = (diffs / np.linalg.norm(diffs, axis=2, keepdims=True)).mean(0)
    np.testing.assert_allclose(d_pair, pn / np.linalg.norm(pn, axis=1, keepdims=True), rtol=1e-5)
    # the longer set is truncated to the shorter one
    np.testing.assert_allclose(direction_from_activations(good, bad[:5], orthogonalize=False),
                               direction_from_activations(good[:5], bad[:5], orthogonalize=False))
    assert np.all(normalize(np.zeros((2, 4))) == 0)


def test_prompt_files_and_rendering(tmp_path):
    (tmp_path / "p.txt").write_text("# comment\nfirst prompt\n\n  second  \n")
    assert read_prompt_file(tmp_path / "p.txt") == ["first prompt", "second"]
    assert render_prompt("Hi", "Sys") == "<｜begin▁of▁sentence｜>Sys<｜User｜>Hi<｜Assistant｜></think>"
    assert render_prompt("Hi", "", thinking=True) == "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜><think>"


# ---- the argparse helper -------------------------------------------------------------------------

def _parse(argv):
    p = argparse.ArgumentParser()
    A.add_arguments(p)
    return p.parse_args(argv)


@pytest.fixture
def dir_files(tmp_path):
    rng = np.random.default_rng(3)
    files = []
    for k in range(2):
        path = tmp_path / f"d{k}.f32"
        write_f32(path, DirectionSet(np.stack([_unit(rng, 16) for _ in range(4)])))
        files.append(str(path))
    return files


def test_flag_defaults_follow_ds4(dir_files):
    st = A.steering_from_args(_parse(["--dir-steering-file", dir_files[0]]), 4, 16)
    assert [(d.attn_scale, d.ffn_scale) for d in st.stack] == [(0.0, 1.0)]  # file only: ffn 1, attn 0
    st = A.steering_from_args(_parse(["--dir-steering-file", dir_files[0], "--dir-steering-attn", "0.5"]), 4, 16)
    assert [(d.attn_scale, d.ffn_scale) for d in st.stack] == [(0.5, 0.0)]
    st = A.steering_from_args(_parse(["--dir-steering-file", dir_files[0], "--dir-steering-file", dir_files[1],
                                      "--dir-steering-ffn", "-1", "--dir-steering-ffn", "2"]), 4, 16)
    assert [d.ffn_scale for d in st.stack] == [-1.0, 2.0]
    assert A.steering_from_args(_parse([]), 4, 16) is None
    # both scales 0: the file is not even read (a missing file is no error), as in ds4
    assert A.steering_from_args(_parse(["--dir-steering-file", "/nonexistent.f32", "--dir-steering-ffn", "0"]),
                                4, 16) is None


def test_flag_errors(dir_files, capsys):
    with pytest.raises(SystemExit) as e:
        _parse(["--dir-steering-ffn", "101"])
    assert e.value.code == 2
    with pytest.raises(SteeringFileError, match="size|bytes"):
        A.steering_from_args(_parse(["--dir-steering-file", dir_files[0]]), 5, 16)  # wrong model shape
    with pytest.raises(SteeringFileError, match="given 3 times"):
        A.steering_from_args(_parse(["--dir-steering-file", dir_files[0], "--dir-steering-file", dir_files[1]]
                                    + ["--dir-steering-ffn", "1"] * 3), 4, 16)
    with pytest.raises(SteeringFileError, match="at most 8"):
        A.steering_from_args(_parse(["--dir-steering-file", dir_files[0]] * 9), 4, 16)
    with pytest.raises(SteeringFileError, match="need --dir-steering-file"):
        A.steering_from_args(_parse(["--dir-steering-ffn", "1"]), 4, 16)
