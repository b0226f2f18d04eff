// Bindings of the fused layer ops (fused.cu, attn_decode.cu, hc.cu, hc_cluster.cu, attn_prefill.cu, indexer.cu, topk.cu, repack.cu, moe.cu's combine):
// raw device pointers from torch tensors (data_ptr()), launched on the module's stream; registered by bindings.cpp's
// module. ds4.engine.gpu.fused wraps them for the session.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <vector>

#include "bindings.h"
#include "router.cuh"

namespace py = pybind11;

namespace ds4ext {

namespace {

RowPost row_post_args(bool norm, uintptr_t w, float eps, uintptr_t freq, int rope_dim, bool inverse, int fp8_nope,
                      bool qat, float had_scale) {
  RowPost o;
  o.norm = norm;
  o.w = ptr<const float>(w);
  o.eps = eps;
  o.freq = ptr<const float>(freq);
  o.rope_dim = rope_dim;
  o.inverse = inverse;
  o.fp8_nope = fp8_nope;
  o.qat = qat;
  o.had_scale = had_scale;
  return o;
}

NormRopeJob norm_rope_job(const py::tuple& t) {
  if (t.size() != 16) throw std::invalid_argument("norm_rope: a job has 16 fields");
  NormRopeJob j;
  j.x = ptr<const float>(t[0].cast<uintptr_t>());
  j.rows = t[1].cast<int>();
  j.d = t[2].cast<int>();
  j.rows_per_token = t[3].cast<int>();
  j.o = row_post_args(t[4].cast<bool>(), t[5].cast<uintptr_t>(), t[6].cast<float>(), t[7].cast<uintptr_t>(),
                      t[8].cast<int>(), t[9].cast<bool>(), t[10].cast<int>(), t[11].cast<bool>(), t[12].cast<float>());
  j.ring_cap = t[13].cast<int>();
  j.out = ptr<float>(t[14].cast<uintptr_t>());
  j.in_scale = ptr<const float>(t[15].cast<uintptr_t>());
  return j;
}

}  // namespace

void bind_fused_ops(py::module_& m) {
  m.def("rms_norm", [](uintptr_t x, uintptr_t w, uintptr_t y, int rows, int n, float eps) {
    launch_rms_norm(ptr<const float>(x), ptr<const float>(w), ptr<float>(y), rows, n, eps, stream());
  }, py::arg("x"), py::arg("w"), py::arg("y"), py::arg("rows"), py::arg("n"), py::arg("eps"));
  m.def("hc_parts", &hc_parts, "partial sums per token of the mHC mix (scratch rows for hc_pre)");
  m.def("hc_pre", [](uintptr_t X, uintptr_t Wf, uintptr_t part, uintptr_t scale, uintptr_t base, uintptr_t norm_w, int T,
                     int n, int D, int iters, float eps_rms, float eps_hc, bool head, uintptr_t out, uintptr_t post,
                     uintptr_t comb, int parts) {
    launch_hc_pre(ptr<const float>(X), ptr<const float>(Wf), ptr<float>(part), ptr<const float>(scale),
                  ptr<const float>(base), ptr<const float>(norm_w), T, n, D, iters, eps_rms, eps_hc, head,
                  ptr<float>(out), ptr<float>(post), ptr<float>(comb), stream(), parts);
  }, "mHC pre; parts > 0: part already holds that many partial mixes per token [T, parts, M + 1] (the last "
     "column: the sum of squares), so only pass 2 runs; parts = -1: part is the mix [T, M] and the kernel sums the "
     "squares itself (prefill, where hc_pre_rows_takes)",
     py::arg("X"), py::arg("Wf"), py::arg("part"), py::arg("scale"), py::arg("base"), py::arg("norm_w"), py::arg("T"),
     py::arg("n"), py::arg("D"), py::arg("iters"), py::arg("eps_rms"), py::arg("eps_hc"), py::arg("head"),
     py::arg("out"), py::arg("post"), py::arg("comb"), py::arg("parts") = 0);
  m.def("set_hc_cluster", &set_hc_cluster, py::arg("mode"),
        "Decode's one-launch mHC pre as one thread block cluster of 16 CTAs per token (1), the arrival-count kernel (0) "
        "or as $DS4_GPU_HC_CLUSTER says (-1); the same values to float rounding, not the same bits");
  m.def("hc_cluster_takes", &hc_cluster_takes, py::arg("n"), py::arg("D"), py::arg("M"),
        "whether decode's one-launch mHC pre runs as the cluster kernel now (switch on, shape and device allow it)");
  m.def("set_hc_rcp", &set_hc_rcp, py::arg("mode"),
        "Sinkhorn of the one-launch mHC kernels by reciprocals and multiplies (1), by fast divisions (0) or as "
        "$DS4_GPU_HC_RCP says (-1); the same bits");
  m.def("hc_mix_rows", [](uintptr_t X, uintptr_t Wf, int64_t T, int64_t K, int M, uintptr_t out, uintptr_t scratch) {
    launch_hc_mix_rows(ptr<const float>(X), ptr<const float>(Wf), T, K, M, ptr<float>(out), ptr<float>(scratch),
                       stream());
  }, py::arg("X"), py::arg("Wf"), py::arg("T"), py::arg("K"), py::arg("M"), py::arg("out"), py::arg("scratch") = 0,
     "out [T, M] = X [T, K] . Wf [M, K]^T, float32 (device addresses; K a multiple of 128, M <= 24): the mHC's mix of "
     "prefill rows, X read once (DS4_GPU_HC_MIX); scratch: hc_mix_rows_splits(T, K) x T x M floats where that is > 1");
  m.def("hc_mix_rows_takes", &hc_mix_rows_takes, py::arg("K"), py::arg("M"));
  m.def("hc_post_mix_takes", &hc_post_mix_takes, py::arg("n"), py::arg("D"), py::arg("M"));
  m.def("hc_post_mix", [](uintptr_t X, uintptr_t y1, uintptr_t y2, uintptr_t post, uintptr_t comb, uintptr_t r1,
                          uintptr_t r2, uintptr_t Wf, int64_t T, int64_t D, int M, uintptr_t Xo, uintptr_t out,
                          uintptr_t scratch) {
    launch_hc_post_mix(ptr<const float>(X), ptr<const float>(y1), ptr<const float>(y2), ptr<const float>(post),
                       ptr<const float>(comb), ptr<const float>(r1), ptr<const float>(r2), ptr<const float>(Wf), T, D,
                       M, ptr<float>(Xo), ptr<float>(out), ptr<float>(scratch), stream());
  }, "Xo = hc_post(X, y1, y2, post, comb) (hc_post's bits) and out [T, M] = Xo . Wf^T in one pass over X (prefill, "
     "4 streams; device addresses; scratch: hc_mix_rows_splits(T, 4 D) x T x M floats where that is > 1)");

  m.def("set_hc_mix_ptrs", &set_hc_mix_ptrs, py::arg("mode"),
        "hc_mix_rows' stage loads from per-thread pointers (1) or from each element's index (0), or as "
        "$DS4_GPU_HC_MIX_PTRS says (-1); the same bits");
  m.def("set_hc_split_waves", &set_hc_split_waves, py::arg("mode"),
        "hc_mix_rows_splits by the fewest stage waves (1), by the v30 doubling rule (0), or as $DS4_GPU_HC_SPLIT_WAVES "
        "says (-1); the mix to float rounding, not the same bits");
  m.def("hc_mix_rows_splits", &hc_mix_rows_splits, py::arg("T"), py::arg("K"),
        "column slices hc_mix_rows cuts a T-row mix into (1: none; more: it needs that many T x M scratch planes)");
  m.def("hc_pre_rows_takes", &hc_pre_rows_takes, py::arg("n"), py::arg("D"), py::arg("head"),
        "whether hc_pre takes parts = -1 (the mix [T, M] from a GEMM, the norm in the kernel) for this shape");
  m.def("hc_one_launch_takes", &hc_one_launch_takes, py::arg("T"), py::arg("n"), py::arg("D"), py::arg("head"),
        "whether hc_post_pre (and the one-launch hc_pre) take this shape");
  m.def("hc_post_pre", [](uintptr_t X, uintptr_t y1, uintptr_t y2, uintptr_t post_in, uintptr_t comb_in, uintptr_t Xo,
                          uintptr_t Wf, uintptr_t part, uintptr_t scale, uintptr_t base, uintptr_t norm_w, int T, int n,
                          int D, int iters, float eps_rms, float eps_hc, bool head, uintptr_t out, uintptr_t post,
                          uintptr_t comb, uintptr_t logits, uintptr_t ring, uintptr_t ring_pos, int ring_r) {
    return launch_hc_post_pre(ptr<const float>(X), ptr<const float>(y1), ptr<const float>(y2),
                              ptr<const float>(post_in), ptr<const float>(comb_in), ptr<float>(Xo), ptr<const float>(Wf),
                              ptr<float>(part), ptr<const float>(scale), ptr<const float>(base),
                              ptr<const float>(norm_w), T, n, D, iters, eps_rms, eps_hc, head, ptr<float>(out),
                              ptr<float>(post), ptr<float>(comb), stream(), ptr<float>(logits), ptr<float>(ring),
                              ptr<const int64_t>(ring_pos), ring_r);
  }, "Xo = hc_post(X, y1, y2, post_in, comb_in), then hc_pre of Xo, in one launch; logits (non-zero): comb's 16 "
     "logits per token written there instead of comb (sinkhorn4 makes comb from them). ring, ring_pos, ring_r "
     "(T = 1): out also into row *ring_pos % ring_r of ring [ring_r, D] (float32; ring_pos int64 on the device); "
     "returns whether the kernel wrote it (False: the caller copies it)",
     py::arg("X"), py::arg("y1"), py::arg("y2"), py::arg("post_in"), py::arg("comb_in"), py::arg("Xo"), py::arg("Wf"),
     py::arg("part"), py::arg("scale"), py::arg("base"), py::arg("norm_w"), py::arg("T"), py::arg("n"), py::arg("D"),
     py::arg("iters"), py::arg("eps_rms"), py::arg("eps_hc"), py::arg("head"), py::arg("out"), py::arg("post"),
     py::arg("comb"), py::arg("logits") = 0, py::arg("ring") = 0, py::arg("ring_pos") = 0, py::arg("ring_r") = 0);
  m.def("sinkhorn4", [](uintptr_t logits, int T, int iters, float eps, uintptr_t comb) {
    launch_sinkhorn4(ptr<const float>(logits), T, iters, eps, ptr<float>(comb), stream());
  }, "comb [T, 4, 4] = Sinkhorn of the logits hc_post_pre wrote (the one-launch kernel's arithmetic)",
     py::arg("logits"), py::arg("T"), py::arg("iters"), py::arg("eps"), py::arg("comb"));
  m.def("hc_post", [](uintptr_t X, uintptr_t y1, uintptr_t y2, uintptr_t post, uintptr_t comb, int T, int n, int D,
                      uintptr_t Xo, uintptr_t r1, uintptr_t r2) {
    launch_hc_post(ptr<const float>(X), ptr<const float>(y1), ptr<const float>(y2), ptr<const float>(post),
                   ptr<const float>(comb), T, n, D, ptr<float>(Xo), stream(), ptr<const float>(r1), ptr<const float>(r2));
  }, "Xo = mHC post of X: post (y1 r1 + y2 r2) + comb^T X per token; r1, r2 (0: none) per-row rescales of y1, y2",
     py::arg("X"), py::arg("y1"), py::arg("y2"), py::arg("post"), py::arg("comb"), py::arg("T"), py::arg("n"),
     py::arg("D"), py::arg("Xo"), py::arg("r1") = 0, py::arg("r2") = 0);
  m.def("norm_rope", [](uintptr_t pos, const std::vector<py::tuple>& jobs) {
    if (jobs.empty() || jobs.size() > 3) throw std::invalid_argument("norm_rope: one to three jobs");
    NormRopeJob j[3];
    for (size_t i = 0; i < jobs.size(); ++i) j[i] = norm_rope_job(jobs[i]);
    launch_norm_rope(j[0], jobs.size() > 1 ? &j[1] : nullptr, ptr<const int64_t>(pos), stream(),
                     jobs.size() > 2 ? &j[2] : nullptr);
  }, "jobs: (x, rows, d, rows_per_token, norm, w, eps, freq, rope_dim, inverse, fp8_nope, qat, had_scale, "
     "ring_cap, out, in_scale) each (in_scale: float32 per token, the row is x * in_scale[token]; 0: none); the second "
     "and third run in the same launch", py::arg("pos"), py::arg("jobs"));
  m.def("prefill_attn", [](uintptr_t q, uintptr_t win, uintptr_t comp, uintptr_t sel, uintptr_t sinks, uintptr_t out,
                           int T, int H, int d, int Wn, int n_comp, int n_sel, int ratio, int64_t pos0, float scale,
                           int exact_dims, uintptr_t out_freq, int out_rope_dim, int prefetch, uintptr_t win_pk,
                           uintptr_t comp_pk, int pk_dims, int form, bool q_norm, float q_eps, uintptr_t q_freq,
                           int q_rope_dim, uintptr_t q_in_scale, uintptr_t out_hi, uintptr_t out_lo, uintptr_t out_s,
                           int out_hpg, bool pk_split, uintptr_t out_a8) {
    PrefillAttn a;
    a.q = ptr<const float>(q);
    a.win = ptr<const float>(win);
    a.comp = ptr<const float>(comp);
    a.sel = ptr<const int64_t>(sel);
    a.sinks = ptr<const float>(sinks);
    a.out = ptr<float>(out);
    a.T = T, a.H = H, a.d = d, a.Wn = Wn, a.n_comp = n_comp, a.n_sel = n_sel, a.ratio = ratio, a.pos0 = pos0;
    a.scale = scale;
    a.exact_dims = exact_dims;
    a.out_freq = ptr<const float>(out_freq);
    a.out_rope_dim = out_rope_dim;
    a.prefetch = prefetch;
    a.win_pk = ptr<const uint16_t>(win_pk);
    a.comp_pk = ptr<const uint16_t>(comp_pk);
    a.pk_dims = pk_dims;
    a.pk_split = pk_split;
    a.form = form;
    a.q_post_on = q_norm || q_freq || q_in_scale;
    a.q_post.norm = q_norm;
    a.q_post.eps = q_eps;
    a.q_post.freq = ptr<const float>(q_freq);
    a.q_post.rope_dim = q_rope_dim;
    a.q_in_scale = ptr<const float>(q_in_scale);
    a.out_hi = ptr<__half>(out_hi);
    a.out_lo = ptr<__half>(out_lo);
    a.out_s = ptr<float>(out_s);
    a.out_hpg = out_hpg;
    a.out_a8 = ptr<uint8_t>(out_a8);
    launch_prefill_attn(a, stream());
  }, "prefill attention of T queries (attn_prefill.cu): q [T, H, d], win [T + Wn - 1, d], comp [n_comp, d] or 0, "
     "sel [T, n_sel] int64 or 0 (all comp rows), sinks [H], out [T, H, d]; exact_dims: key columns [0, exact_dims) "
     "are exact in TF32 (FP8-simulated), so their products skip the keys' zero lo part; out_freq (rope_dim / 2 floats, "
     "or 0): the output's last out_rope_dim columns get the inverse RoPE at each query's position; prefetch: 0, 1 (the "
     "selected rows staged once per query), 2 (also the next key tile into L2), -1: $DS4_GPU_ATTN_PREFETCH; win_pk "
     "(and comp_pk where comp): the keys from packed rows (pack_keys) with pk_dims == exact_dims; form: 2 the inner loops "
     "without per-step branches, 1 the v13 loops (the same bits), -1: $DS4_GPU_ATTN_FORM; q_norm, q_eps, q_freq, "
     "q_rope_dim, q_in_scale ([T] or 0): q holds raw rows that the kernel stages as norm_rope(q, norm=q_norm, "
     "freq=q_freq, rope_dim=q_rope_dim, in_scale=q_in_scale) at the query positions writes them (the same bits); "
     "out_hi, out_lo ([T, H, d] float16), out_s ([T, H / out_hpg] float32): the output written as to_half's split "
     "per group of out_hpg heads instead of out; pk_split: the packed rows' tail as bfloat16 hi and lo (pack_keys' "
     "split_tail; form 3 only, an error where it declines); out_a8 (instead of out_lo): the split as fp8_split's float8 "
     "operand [H / out_hpg, T, 2 out_hpg d] e4m3, [hi 2^8 | lo 2^19] per group and query",
     py::arg("q"), py::arg("win"), py::arg("comp"), py::arg("sel"), py::arg("sinks"), py::arg("out"), py::arg("T"),
     py::arg("H"), py::arg("d"), py::arg("Wn"), py::arg("n_comp"), py::arg("n_sel"), py::arg("ratio"), py::arg("pos0"),
     py::arg("scale"), py::arg("exact_dims") = 0, py::arg("out_freq") = 0, py::arg("out_rope_dim") = 0,
     py::arg("prefetch") = -1, py::arg("win_pk") = 0, py::arg("comp_pk") = 0, py::arg("pk_dims") = 0,
     py::arg("form") = -1, py::arg("q_norm") = false, py::arg("q_eps") = 1e-6f, py::arg("q_freq") = 0,
     py::arg("q_rope_dim") = 0, py::arg("q_in_scale") = 0, py::arg("out_hi") = 0, py::arg("out_lo") = 0,
     py::arg("out_s") = 0, py::arg("out_hpg") = 0, py::arg("pk_split") = false, py::arg("out_a8") = 0);
  m.def("pack_keys", [](uintptr_t x, int64_t rows, int d, int pk_dims, uintptr_t out, bool split_tail) {
    launch_pack_keys(ptr<const float>(x), rows, d, pk_dims, ptr<uint16_t>(out), stream(), split_tail);
  }, "float32 key rows [rows, d] as packed rows at out: pk_dims bfloat16 values (by truncation: exact for FP8-simulated "
     "values), then d - pk_dims float32 (2 pk_dims + 4 (d - pk_dims) bytes per row); split_tail: those d - pk_dims "
     "columns as bfloat16 hi, then bfloat16 lo (both rounded; prefill attention form 3's rows)",
     py::arg("x"), py::arg("rows"), py::arg("d"), py::arg("pk_dims"), py::arg("out"), py::arg("split_tail") = false);
  m.def("set_attn_tma", &set_attn_tma, py::arg("mode"),
        "prefill attention form 3's key tiles: 1 bulk copies, 0 cp.async pieces (the same bits), -1 back to "
        "$DS4_GPU_ATTN_TMA; read at each launch");
  m.def("set_attn_qregs", &set_attn_qregs, py::arg("mode"),
        "prefill attention form 3's query rows: 1 staged in registers by whole rows per warp, 0 through a float32 stage "
        "in shared memory (the same bits), -1 back to $DS4_GPU_ATTN_QREGS; read at each launch");
  m.def("set_attn_ostage", &set_attn_ostage, py::arg("mode"),
        "prefill attention form 3's split output: 1 staged in shared memory and written in whole runs per head row, 0 "
        "stored from the fragments (the same bits), -1 back to $DS4_GPU_ATTN_OSTAGE; read at each launch");
  m.def("prefill_attn_bf16_takes", &prefill_attn_bf16_takes, py::arg("d"), py::arg("pk_dims"), py::arg("out_hpg"),
        "whether prefill attention form 3 takes these shapes (out_hpg: the split output's heads per group, 0: none)");
  m.def("prefill_attn_takes", &prefill_attn_takes, py::arg("H"), py::arg("d"));
  m.def("argmax", [](uintptr_t x, int64_t n, uintptr_t out, uintptr_t pos, uintptr_t hist, int64_t hist_len,
                     uintptr_t banned) {
    launch_argmax(ptr<const float>(x), n, ptr<int64_t>(out), stream(), ptr<int64_t>(pos), ptr<int64_t>(hist), hist_len,
                  ptr<const int64_t>(banned));
  }, py::arg("x"), py::arg("n"), py::arg("out"), py::arg("pos") = 0, py::arg("hist") = 0, py::arg("hist_len") = 0,
        py::arg("banned") = 0,
        "out[0] = the argmax of x[:n] (torch.argmax's answer); pos non-zero: also pos[0] += 1 and hist[p] = out[0] at "
        "p = pos[0] clamped to [0, hist_len) (greedy decode's next step, fed on the device); banned non-zero: x[banned[0]] counts as -inf");
  m.def("embed", [](uintptr_t emb, bool f16, int64_t vocab, int D, uintptr_t tok, int T, int n_hc, uintptr_t X) {
    launch_embed(ptr<const void>(emb), f16, vocab, D, ptr<const int64_t>(tok), T, n_hc, ptr<float>(X), stream());
  }, py::arg("emb"), py::arg("f16"), py::arg("vocab"), py::arg("D"), py::arg("tok"), py::arg("T"), py::arg("n_hc"),
        py::arg("X"), "X[t, h] = float32(emb[tok[t]]) for h < n_hc (a token id out of range: a row of NaN)");
  m.def("router", [](uintptr_t logits, uintptr_t bias, uintptr_t table, uintptr_t tok, int T, int E, int k, float scale,
                     uintptr_t ids, uintptr_t wts) {
    launch_router(ptr<const float>(logits), ptr<const float>(bias), ptr<const int64_t>(table), ptr<const int64_t>(tok),
                  T, E, k, scale, ptr<int32_t>(ids), ptr<float>(wts), stream());
  });
  m.def("set_router_cluster", &set_router_cluster, py::arg("mode"),
        "router_one as one thread block cluster of 16 CTAs (1), the arrival-count kernel (0) or as "
        "$DS4_GPU_ROUTER_CLUSTER says (-1); the same bits");
  m.def("router_cluster_takes", &router_cluster_takes, py::arg("E"), py::arg("K"),
        "whether router_one runs as the cluster kernel now for E experts of K columns");
  m.def("router_one", [](const Tensor& w, uintptr_t x, uintptr_t logits, uintptr_t bias, uintptr_t table, uintptr_t tok,
                         int k, float scale, uintptr_t ids, uintptr_t wts) {
    return launch_router_one(w.p, ptr<const float>(x), ptr<float>(logits), ptr<const float>(bias),
                             ptr<const int64_t>(table), ptr<const int64_t>(tok), k, scale, ptr<int32_t>(ids),
                             ptr<float>(wts), stream());
  }, py::arg("w"), py::arg("x"), py::arg("logits"), py::arg("bias"), py::arg("table"), py::arg("tok"), py::arg("k"),
        py::arg("scale"), py::arg("ids"), py::arg("wts"),
        "decode (one token): logits = w . x (the bits of matvec's F16 launch) and the router on them (as router) in "
        "one launch (router.cu); False, nothing launched, where that kernel does not take w");
  m.def("swiglu", [](uintptr_t g, uintptr_t u, int64_t n, float limit, uintptr_t out, uintptr_t row_w, int64_t width,
                     uintptr_t row_of, uintptr_t g_scale, uintptr_t u_scale) {
    launch_swiglu(ptr<const float>(g), ptr<const float>(u), n, limit, ptr<float>(out), stream(), ptr<const float>(row_w),
                  width, ptr<const int64_t>(row_of), ptr<const float>(g_scale), ptr<const float>(u_scale));
  }, py::arg("g"), py::arg("u"), py::arg("n"), py::arg("limit"), py::arg("out"), py::arg("row_w") = 0,
     py::arg("width") = 0, py::arg("row_of") = 0, py::arg("g_scale") = 0, py::arg("u_scale") = 0,
     "out = silu(min(g, limit)) * clamp(u, +-limit) over n floats (device addresses); row_w: each row of width values "
     "also times row_w[row_of[row]] (row_of: int64, or 0 for the row itself); g_scale, u_scale: per-row rescales of "
     "g and u applied as they are read (rows of width values).");
  m.def("compress_step", [](uintptr_t pos, const std::vector<py::tuple>& jobs) {
    if (jobs.empty() || jobs.size() > 2) throw std::invalid_argument("compress_step: one or two jobs");
    CompressJob j[2];
    for (size_t i = 0; i < jobs.size(); ++i) {
      const py::tuple& t = jobs[i];
      if (t.size() != 15 && t.size() != 18) throw std::invalid_argument("compress_step: a job has 15 or 18 fields");
      j[i].kv = ptr<const float>(t[0].cast<uintptr_t>());
      j[i].sc = ptr<const float>(t[1].cast<uintptr_t>());
      j[i].ape = ptr<const float>(t[2].cast<uintptr_t>());
      j[i].s_kv = ptr<float>(t[3].cast<uintptr_t>());
      j[i].s_sc = ptr<float>(t[4].cast<uintptr_t>());
      j[i].rows = ptr<float>(t[5].cast<uintptr_t>());
      j[i].r = t[6].cast<int>();
      j[i].width = t[7].cast<int>();
      j[i].o = row_post_args(true, t[8].cast<uintptr_t>(), t[9].cast<float>(), t[10].cast<uintptr_t>(),
                             t[11].cast<int>(), false, t[12].cast<int>(), t[13].cast<bool>(), t[14].cast<float>());
      if (t.size() == 18) {
        j[i].ring_kv = ptr<const float>(t[15].cast<uintptr_t>());
        j[i].ring_sc = ptr<const float>(t[16].cast<uintptr_t>());
        j[i].start = ptr<const int64_t>(t[17].cast<uintptr_t>());
      }
    }
    launch_compress_step(j[0], jobs.size() > 1 ? &j[1] : nullptr, ptr<const int64_t>(pos), stream());
  }, "jobs: (kv, sc, ape, s_kv, s_sc, rows, r, width, norm_w, eps, freq, rope_dim, fp8_nope, qat, had_scale"
     "[, ring_kv, ring_sc, start]) each; a second job runs beside the first in the same launch. ring_*: the window's "
     "deferred products for its positions from *start (comp_defer.py; compress_ring_takes)", py::arg("pos"),
     py::arg("jobs"));
  m.def("compress_ring_takes", &compress_ring_takes, py::arg("r"));
  m.def("attn_chunks", &attn_chunks);
  m.def("set_attn_tiles", &set_attn_tiles, py::arg("mode"),
        "decode attention's partial blocks in register tiles (the same bits): 1 on, 0 off, -1 back to $DS4_GPU_ATTN_TILES");
  m.def("set_compress_regs", &set_compress_regs, py::arg("mode"),
        "decode compressor's ratio-4 pooling with the candidates' loads in flight (the same bits): 1 on, 0 the v15 "
        "loops, -1 back to $DS4_GPU_COMPRESS_REGS; read when a launch is made or captured");
  m.def("set_compress_wide", &set_compress_wide, py::arg("mode"),
        "decode compressor's pooling of ratios other than 4 split over the block's warps (not the loops' bits): 1 on, "
        "0 off, -1 back to $DS4_GPU_COMPRESS_WIDE; read when a launch is made or captured");
  m.def("set_prewait", &set_prewait, py::arg("mode"),
        "norm_rope, the ratio-4 compressor steps and the attention combine stage their position-only inputs before "
        "griddepcontrol.wait (the same bits): 1 on, 2 also the mHC pre, router, attention partials, top-k and index keys, "
        "0 off, -1 back to $DS4_GPU_PREWAIT; read when a launch is made");
  m.def("attention", [](uintptr_t q, int H, int d, uintptr_t raw, int cap, uintptr_t comp, uintptr_t sel, int n_comp,
                        int ratio, uintptr_t pos, float scale, uintptr_t sinks, uintptr_t freq, int rope_dim,
                        uintptr_t part_o, uintptr_t part_ml, uintptr_t out) {
    launch_attention(ptr<const float>(q), H, d, ptr<const float>(raw), cap, ptr<const float>(comp),
                     ptr<const int64_t>(sel), n_comp, ratio, ptr<const int64_t>(pos), scale, ptr<const float>(sinks),
                     row_post_args(false, 0, 0.0f, freq, rope_dim, true, 0, false, 1.0f), ptr<float>(part_o),
                     ptr<float>(part_ml), ptr<float>(out), stream());
  });
  m.def("index_keys", [](uintptr_t q, uintptr_t w, uintptr_t idx, int n_rows, int Hi, int di, uintptr_t pos, int ratio,
                         float scale, uintptr_t keys) {
    launch_index_keys(ptr<const float>(q), ptr<const float>(w), ptr<const float>(idx), n_rows, Hi, di,
                      ptr<const int64_t>(pos), ratio, scale, ptr<double>(keys), stream());
  });
  m.def("index_keys_v2_takes", &index_keys_v2_takes, py::arg("Hi"), py::arg("di"));
  m.def("index_keys_v2", [](uintptr_t q, uintptr_t w, uintptr_t idx, int n_rows, int Hi, int di, uintptr_t pos,
                            int ratio, float scale, uintptr_t freq, int rope_dim, bool qat, float had_scale,
                            uintptr_t keys) {
    launch_index_keys_v2(ptr<const float>(q), ptr<const float>(w), ptr<const float>(idx), n_rows, Hi, di,
                         ptr<const int64_t>(pos), ratio, scale,
                         row_post_args(false, 0, 0.0f, freq, rope_dim, false, 0, qat, had_scale),
                         ptr<double>(keys), stream());
  }, "Decode indexer keys (v16 form); freq/rope_dim/qat: norm_rope's post of the raw query, applied while staging.");
  m.def("topk_rows", [](uintptr_t keys, int n, int k, uintptr_t pos, int ratio, uintptr_t sel) {
    launch_topk_rows(ptr<const double>(keys), n, k, ptr<const int64_t>(pos), ratio, ptr<int64_t>(sel), stream());
  });
  m.def("quantize_x", [](uintptr_t x, int nvec, int n, uintptr_t rows, uintptr_t hi, uintptr_t lo, uintptr_t scale,
                         uintptr_t sum16, int group) {
    XQ q;
    q.hi = ptr<int8_t>(hi), q.lo = ptr<int8_t>(lo), q.scale = ptr<float>(scale), q.sum16 = ptr<float>(sum16), q.n = n;
    launch_quantize_x(ptr<const float>(x), nvec, n, q, stream(), ptr<const int64_t>(rows), group);
  }, "The activation planes the quantized kernels read: nvec rows of n floats (rows: int64 source row per output row, "
     "or 0), hi and lo int8 [nvec, n], scale [nvec, n / 32], sum16 [nvec, n / 16] (device addresses); group: columns "
     "per scale, 32 (decode's), 256 (mmq's S256 form) or 0 (one per row: mmq's XROW form; n a multiple of 512 up to 4096); "
     "the scale is stored per 32 columns in every case",
     py::arg("x"), py::arg("nvec"), py::arg("n"), py::arg("rows"), py::arg("hi"), py::arg("lo"), py::arg("scale"),
     py::arg("sum16"), py::arg("group") = 32);
  m.def("moe_combine", [](uintptr_t y_sorted, uintptr_t slot_row, int tokens, int k, int n, uintptr_t out) {
    launch_moe_combine(ptr<const float>(y_sorted), ptr<const int64_t>(slot_row), tokens, k, n, ptr<float>(out),
                       stream());
  });
  m.def("topk_rows_f32", [](uintptr_t keys, int n, int64_t ld, int rows, int k, uintptr_t pos, int ratio,
                            uintptr_t sel) {
    launch_topk_rows_f32(ptr<const float>(keys), n, ld, rows, k, ptr<const int64_t>(pos), ratio, ptr<int64_t>(sel),
                         stream());
  });
  m.def("comp_pool_takes", &comp_pool_takes, py::arg("r"), py::arg("width"));
  m.def("comp_pool_chunk", [](uintptr_t kv, uintptr_t kv_r, uintptr_t sc, uintptr_t sc_r, uintptr_t ape,
                              uintptr_t s_kv, uintptr_t s_sc, int width, int r, int off, int live0, int64_t n_full,
                              uintptr_t out) {
    launch_comp_pool_chunk(ptr<const float>(kv), ptr<const float>(kv_r), ptr<const float>(sc), ptr<const float>(sc_r),
                           ptr<const float>(ape), ptr<const float>(s_kv), ptr<const float>(s_sc), width, r, off, live0,
                           n_full, ptr<float>(out), stream());
  }, "The compressors' pooling of a prefill chunk's finished windows (compress_prefill.cu; device addresses).");
  m.def("index_scores_takes", &index_scores_takes, py::arg("Hi"), py::arg("di"));
  m.def("index_scores", [](uintptr_t q, uintptr_t w, uintptr_t keys, int n, int T, int Hi, int di, uintptr_t n_vis,
                           uintptr_t scores) {
    launch_index_scores(ptr<const float>(q), ptr<const float>(w), ptr<const __nv_bfloat16>(keys), n, T, Hi, di,
                        ptr<const int64_t>(n_vis), ptr<float>(scores), stream());
  });
}

}  // namespace ds4ext
