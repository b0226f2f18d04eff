"""Scoring and KL-divergence math on small hand-checkable arrays; score TSV and saved-logits formats."""

import math

import numpy as np
import pytest

from ds4.quality import kld as K
from ds4.quality import metrics as M


def test_teacher_forced_nll_first_match_lcp_by_hand():
    # vocab 3; logits chosen so probabilities are exact fractions
    #   step 0: p = [1/2, 1/4, 1/4], target 0 (greedy 0: match)
    #   step 1: p = [1/4, 1/2, 1/4], target 1 (greedy 1: match)
    #   step 2: p = [1/2, 1/4, 1/4], target 2 (greedy 0: mismatch, lcp stops at 2)
    #   step 3: p = [1/4, 1/4, 1/2], target 2 (greedy 2 again: lcp stays 2)
    L = np.log
    logits = np.array([[L(2), 0, 0], [0, L(2), 0], [L(2), 0, 0], [0, 0, L(2)]]) + 5.0  # shift-invariant
    s = M.score_logits("c", 10, logits, [0, 1, 2, 2])
    assert s.nll == pytest.approx(-(L(0.5) + L(0.5) + L(0.25) + L(0.5)))
    assert (s.first_match, s.greedy_lcp, s.target_tokens) == (1, 2, 4)
    assert s.avg_nll == pytest.approx(s.nll / 4)
    s2 = M.score_logits("d", 3, logits[2:], [2, 2])
    assert (s2.first_match, s2.greedy_lcp) == (0, 0)
    summ = M.summarize([s, s2])
    assert summ.tokens == 6 and summ.first_match == 1 and summ.avg_lcp == 1.0
    assert summ.avg_nll == pytest.approx((s.nll + s2.nll) / 6)  # token-weighted, not a mean of means


def test_log_softmax_ignores_non_finite_logits():
    lp = M.log_softmax(np.array([0.0, -np.inf, np.nan, 0.0]))
    np.testing.assert_allclose(lp[[0, 3]], [math.log(0.5)] * 2)
    assert np.isneginf(lp[1]) and np.isneginf(lp[2])


def test_score_tsv_round_trip_and_compare(tmp_path):
    old = [M.CaseScore("case_000", 20, 4, 4.0, 1, 3), M.CaseScore("case_001", 30, 6, 3.0, 0, 0),
           M.CaseScore("case_002", 25, 2, 1.0, 1, 2)]
    new = [M.CaseScore("case_000", 20, 4, 3.5, 1, 4), M.CaseScore("case_001", 30, 6, 3.0, 1, 1),
           M.CaseScore("case_002", 25, 2, 1.5, 0, 0), M.CaseScore("case_009", 1, 1, 1.0, 0, 0)]
    M.write_scores(tmp_path / "old.tsv", old)
    text = (tmp_path / "old.tsv").read_text()
    assert text.splitlines()[0] == "id\tprompt_tokens\ttarget_tokens\tnll\tavg_nll\tfirst_match\tgreedy_lcp"
    assert "case_000\t20\t4\t4.000000000\t1.000000000\t1\t3" in text  # %.9f (tooling-spec §4.3)
    assert M.read_scores(tmp_path / "old.tsv") == old
    c = M.compare_scores(old, new)
    assert (c.cases, c.tokens) == (3, 12)  # case_009 has no partner
    assert c.old_avg_nll == pytest.approx(8 / 12) and c.new_avg_nll == pytest.approx(8 / 12)
    assert (c.wins_new, c.wins_old, c.ties) == (1, 1, 1)
    assert (c.first_old, c.first_new) == (2, 2)
    rep = c.report()
    assert "case_wins_new_old_ties\t1\t1\t1" in rep
    assert rep.index("new best cases:") < rep.index("case_000\tdelta_nll=-0.500000")
    with pytest.raises(M.ScoreFormatError, match="target_tokens differ"):
        M.compare_scores(old, [M.CaseScore("case_000", 20, 5, 1.0, 1, 1)])
    (tmp_path / "bad.tsv").write_text("hello\n")
    with pytest.raises(M.ScoreFormatError):
        M.read_scores(tmp_path / "bad.tsv")


def test_kld_by_hand():
    # base p = [1/2, 1/2], test q = [1/4, 3/4]: KL = 1/2 ln 2 + 1/2 ln(2/3)
    a = np.log(np.array([[0.5, 0.5]]))
    b = np.log(np.array([[0.25, 0.75]]))
    ps = K.position_stats(a, b, np.array([1]))
    assert ps.kld[0] == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(2 / 3))
    assert ps.dp[0] == pytest.approx(0.25)  # q_y - p_y for y = 1
    assert not ps.same_top[0]  # argmax [.5,.5] = 0 (first), argmax [.25,.75] = 1
    assert ps.nll_base[0] == pytest.approx(math.log(2)) and ps.nll_test[0] == pytest.approx(-math.log(0.75))
    # a zero-probability base token contributes nothing even when the test gives it mass
    with np.errstate(divide="ignore"):
        base = np.log(np.array([[1.0, 0.0]]))
    ps = K.position_stats(base, np.log(np.array([[0.5, 0.5]])), np.array([0]))
    assert ps.kld[0] == pytest.approx(math.log(2))


def test_kld_summary_self_is_zero_and_stats_match_numpy():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(200, 50)) * 2
    y = rng.integers(0, 50, size=200)
    acc = K.KldAccumulator()
    acc.add(M.log_softmax(logits), logits, y)
    s = acc.result().summary()
    assert s["kld_mean"] == 0 and s["kld_max"] == 0 and s["same_top"] == 1.0 and s["dp_rms"] == 0
    assert s["ppl_base"] == s["ppl_test"] and s["ln_ppl_corr"] == pytest.approx(1.0)
    # a perturbed test model: summary statistics agree with direct numpy formulas
    test = logits + rng.normal(size=logits.shape) * 0.5
    acc = K.KldAccumulator()
    acc.add(M.log_softmax(logits[:120]), test[:120], y[:120])
    acc.add(M.log_softmax(logits[120:]), test[120:], y[120:])
    r = acc.result()
    s = r.summary()
    p, q = np.exp(M.log_softmax(logits)), np.exp(M.log_softmax(test))
    kl = (p * (np.log(p) - np.log(q))).sum(1)
    assert s["kld_mean"] == pytest.approx(kl.mean()) and s["kld_mean"] > 0
    assert s["kld_mean_err"] == pytest.approx(kl.std(ddof=1) / math.sqrt(200))
    assert s["kld_p50"] == pytest.approx(np.median(kl)) and s["kld_p99.9"] <= s["kld_max"]
    assert s["same_top"] == pytest.approx(np.mean(p.argmax(1) == q.argmax(1)))
    dp = q[np.arange(200), y] - p[np.arange(200), y]
    assert s["dp_rms"] == pytest.approx(math.sqrt((dp ** 2).mean()))
    nb, nt = -np.log(p[np.arange(200), y]), -np.log(q[np.arange(200), y])
    assert s["ppl_base"] == pytest.approx(math.exp(nb.mean())) and s["ppl_test"] == pytest.approx(math.exp(nt.mean()))
    rep = K.format_report(s)
    for label in ("Mean    KLD:", "Median  KLD:", "99.9%   KLD:", " 0.1%   KLD:", "RMS Δp", "Same top p:",
                  "Mean PPL(Q)", "Mean PPL(base)", "Cor(ln(PPL(Q)), ln(PPL(base)))"):
        assert label in rep


@pytest.mark.parametrize("dtype", ["f16", "f32"])
def test_saved_logits_round_trip(tmp_path, dtype):
    rng = np.random.default_rng(2)
    ctx, vocab, s0, chunks = 9, 40, 3, 2
    toks = rng.integers(0, vocab, size=(chunks, ctx))
    lps = [M.log_softmax(rng.normal(size=(ctx - 1 - s0, vocab)) * 3) for _ in range(chunks)]
    path = tmp_path / "base.logits"
    with K.LogitsWriter(path, vocab, ctx, chunks, s0, dtype=dtype, model="m.gguf") as w:
        for t, lp in zip(toks, lps):
            w.add_chunk(t, lp)
    saved = K.read_saved_logits(path)
    assert saved.header["model"] == "m.gguf" and saved.score_start == s0
    np.testing.assert_array_equal(saved.tokens, toks)
    tol = 2e-3 if dtype == "f16" else 1e-6
    for i in range(chunks):
        np.testing.assert_allclose(saved.chunk_logprobs(i), lps[i], atol=tol * 10, rtol=tol)
        # KLD of the stored base against itself through the file is ~0 (f16 rounding only)
        ps = K.position_stats(saved.chunk_logprobs(i), lps[i], toks[i, s0 + 1:])
        assert ps.kld.max() < (1e-5 if dtype == "f16" else 1e-10)
    # truncated file → clear error, no half-written file from an aborted writer
    data = path.read_bytes()
    (tmp_path / "trunc.logits").write_bytes(data[:-10])
    with pytest.raises(K.LogitsFormatError, match="truncated"):
        K.read_saved_logits(tmp_path / "trunc.logits")
    with pytest.raises(RuntimeError):
        with K.LogitsWriter(tmp_path / "aborted.logits", vocab, ctx, chunks, s0) as w:
            w.add_chunk(toks[0], lps[0])
            raise RuntimeError("interrupted")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base.logits", "trunc.logits"]


def test_histogram_png(tmp_path):
    out = tmp_path / "h.png"
    K.plot_histogram(np.abs(np.random.default_rng(3).normal(size=500)) * 1e-3, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_table_mixes_kld_and_score_results(tmp_path):
    import json

    from ds4.quality.report import CompareError, compare_files
    M.write_scores(tmp_path / "q2.tsv", [M.CaseScore("case_000", 20, 4, 6.0, 0, 1)])
    rng = np.random.default_rng(4)
    lg = rng.normal(size=(50, 30))
    acc = K.KldAccumulator()
    acc.add(M.log_softmax(lg), lg + rng.normal(size=lg.shape) * 0.3, rng.integers(0, 30, 50))
    s = acc.result().summary()
    (tmp_path / "q8.json").write_text(json.dumps({"kind": "ds4-quality-kld", "label": "q8_0", "stats": s}))
    import io
    buf = io.StringIO()
    md = compare_files([str(tmp_path / "q8.json"), str(tmp_path / "q2.tsv")], csv_out=str(tmp_path / "t.csv"),
                       chart=str(tmp_path / "t.svg"), stdout=buf)
    rows = (tmp_path / "t.csv").read_text().splitlines()
    assert rows[0].split(",")[:2] == ["model", "mean KLD"] and "score avg_nll" in rows[0]
    assert rows[1].startswith(f"q8_0,{s['kld_mean']:.6f}") and rows[2].startswith("q2,")
    assert "1.500000" in rows[2]  # avg_nll = 6 / 4
    assert md == buf.getvalue() and (tmp_path / "t.svg").read_text().lstrip().startswith("<?xml")
    (tmp_path / "bad.json").write_text('{"kind": "other"}')
    with pytest.raises(CompareError, match="not a ds4-quality kld result"):
        compare_files([str(tmp_path / "bad.json")], stdout=io.StringIO())
