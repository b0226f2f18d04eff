// Bindings of the prefill product kernels (mmq.cu: int8 tensor cores; mmf.cu: float16 tensor cores on the codes as
// exact integers) and of the grid-barrier benchmark (barrier.cu); registered by bindings.cpp's module.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings.h"
#include "moe_mma.cuh"

namespace py = pybind11;

namespace ds4ext {

namespace {

// Prefill product on the int8 tensor cores (mmq.cu): x quantized into scratch as the decode kernels quantize it, then
// y = W . x per row of x. False (nothing launched) where the kernel does not take W.
bool mmq(const Tensor& w, const Array& x, Array& y, int groups) {
  if (!mmq_takes(w.p, groups)) return false;
  if (x.shape.size() != 2 || y.shape.size() != 2 || x.shape[0] != y.shape[0] || x.shape[1] != w.p.ncols * groups ||
      y.shape[1] != w.p.nrows)
    throw std::invalid_argument("mmq '" + w.name + "': x must be [T, " + std::to_string(groups * w.p.ncols) +
                                "] and y [T, " + std::to_string(w.p.nrows) + "]");
  const int64_t T = x.shape[0], n = x.shape[1];
  if (T < 1 || T > (int64_t)65535 * 64) throw std::invalid_argument("mmq: 1 .. 4194240 rows of x");
  g_prefill_scratch.reserve(xq_bytes(T, n));
  g_prefill_scratch.begin();
  XQ xq = take_xq(T, n, g_prefill_scratch);
  launch_quantize_x(x.f(), (int)T, (int)n, xq, stream());
  launch_mmq(w.p, xq, (int)T, groups, y.f(), stream());
  return true;
}

// The routed experts' prefill products (mmq.cu): activation rows sorted by expert, tiles (device address, int32
// [ntiles, 4]) = (first row, rows <= 64, expert, 0); y [R, rows per expert]. x is [R, cols], or with rows (device
// address of int64 [R]) any [T, cols] whose row rows[i] is activation row i (quantized straight from x: no gathered
// copy). w2 / y2: a second expert tensor of the same shape and type on the same activations (gate and up: x is
// quantized once). False (nothing launched) where the kernel does not take the expert tensors.
bool mmq_experts(const Tensor& w, const Array& x, uintptr_t tiles, int ntiles, Array& y, uintptr_t rows,
                 const Tensor* w2, Array* y2, int s256, const Array* up, float limit, uintptr_t row_w,
                 uintptr_t row_of) {
  auto check = [](const Tensor& t) {
    if (t.ne.size() != 3) throw std::invalid_argument("mmq_experts '" + t.name + "': expert tensors are [cols, rows, experts]");
    return mmq_takes(t.p, (int)t.ne[2]);
  };
  if (!check(w) || (w2 && !check(*w2))) return false;
  const int n_expert = (int)w.ne[2];
  const int64_t rows_e = w.p.nrows / n_expert;
  if (w2 && (w2->ne != w.ne || w2->p.qtype != w.p.qtype))
    throw std::invalid_argument("mmq_experts: '" + w2->name + "' must have the shape and type of '" + w.name + "'");
  if ((w2 == nullptr) != (y2 == nullptr)) throw std::invalid_argument("mmq_experts: w2 and y2 go together");
  const int64_t R = y.shape.size() == 2 ? y.shape[0] : -1;
  auto bad_y = [&](const Array& a) { return a.shape.size() != 2 || a.shape[0] != R || a.shape[1] != rows_e; };
  if (x.shape.size() != 2 || x.shape[1] != w.p.ncols || (!rows && x.shape[0] != R) || bad_y(y) || (y2 && bad_y(*y2)))
    throw std::invalid_argument("mmq_experts '" + w.name + "': x must be [R, " + std::to_string(w.p.ncols) +
                                "] (or [T, " + std::to_string(w.p.ncols) + "] with rows) and y [R, " +
                                std::to_string(rows_e) + "]");
  const int64_t n = x.shape[1];
  if (up && (up->shape != x.shape || rows || w2))
    throw std::invalid_argument("mmq_experts '" + w.name + "': up must have x's shape, without rows or w2");
  if (R < 1 || ntiles < 1) return true;
  // S256 (Q2_K alone: one quantization serves both products of a pair only when both take it)
  const bool big = (s256 < 0 ? mmq_s256_default() : s256 != 0) && w.p.qtype == QT_Q2_K && !w2 && !up && n % 256 == 0;
  // with rows: x's T token rows quantized once and read through rows by the kernel (v26), not a quantized copy of
  // the R = k T gathered rows ($DS4_GPU_MMQ_XROWS=0: the copy)
  const bool direct = rows && !big && mmq_xrows_default();
  const int64_t Rq = direct ? x.shape[0] : R;
  // XROW ($DS4_GPU_MMQ_XROW): one activation scale per row (quantize_x group 0) for the XROW kernels
  const XrowPlan xrow = big ? XrowPlan() : mmq_xrow_plan(w.p, Rq, n, up != nullptr, moe_x8());
  g_prefill_scratch.reserve(xq_bytes(Rq, n));
  g_prefill_scratch.begin();
  XQ xq = take_xq(Rq, n, g_prefill_scratch);
  xq.row_scale = xrow.xrow_kernel;
  XSwiglu sw;
  if (up) sw = XSwiglu{up->f(), limit, (const float*)row_w, (const int64_t*)row_of};
  launch_quantize_x(x.f(), (int)Rq, (int)n, xq, stream(), direct ? nullptr : (const int64_t*)rows,
                    big ? 256 : xrow.row_planes ? 0 : 32, sw, xrow.xrow_kernel && w.p.qtype == QT_Q2_K);
  const int64_t* x_rows = direct ? (const int64_t*)rows : nullptr;
  launch_mmq_experts(w.p, n_expert, xq, (const int4*)tiles, ntiles, y.f(), stream(), big, x_rows);
  if (w2) launch_mmq_experts(w2->p, n_expert, xq, (const int4*)tiles, ntiles, y2->f(), stream(), false, x_rows);
  return true;
}

// The experts of an expert tensor ([cols, rows, experts]), for the products' argument checks.
int experts_of(const Tensor& w, const char* fn) {
  if (w.ne.size() != 3) throw std::invalid_argument(std::string(fn) + " '" + w.name + "': expert tensors are [cols, rows, experts]");
  return (int)w.ne[2];
}

// y must hold one row of each expert's rows per activation row.
void check_expert_y(const Tensor& w, int n_expert, const Array& y, const char* fn) {
  const int64_t rows_e = w.p.nrows / n_expert;
  if (y.shape.size() != 2 || y.shape[1] != rows_e)
    throw std::invalid_argument(std::string(fn) + " '" + w.name + "': y must be [R, " + std::to_string(rows_e) + "]");
}

// The routed experts' prefill products on the float16 tensor cores (mmf.cu): activation rows sorted by expert, split
// by split_half (hi, lo: device addresses of [R, cols] float16; s: [R] float32), K-quants also the split group sums
// (sum_hi, sum_lo: [R, cols / 256, 16] float16; 0 for IQ2_XXS); tiles as mmq_experts' with rows <= mmf_tile_rows().
// False where the kernel does not take the expert tensor.
bool mmf_experts(const Tensor& w, uintptr_t hi, uintptr_t lo, uintptr_t sum_hi, uintptr_t sum_lo, uintptr_t s,
                 uintptr_t tiles, int ntiles, Array& y) {
  const int n_expert = experts_of(w, "mmf_experts");
  if (!mmf_takes(w.p, n_expert)) return false;
  check_expert_y(w, n_expert, y, "mmf_experts");
  const bool mins = w.p.qtype != QT_IQ2_XXS;
  if (!hi || !lo || !s || (mins && (!sum_hi || !sum_lo)))
    throw std::invalid_argument("mmf_experts '" + w.name + "': missing activation planes" +
                                (mins ? std::string(" (K-quants need the group sums)") : std::string()));
  if (y.shape[0] < 1 || ntiles < 1) return true;
  MmfActivations x;
  x.hi = (const __half*)hi;
  x.lo = (const __half*)lo;
  x.sum_hi = (const __half*)sum_hi;
  x.sum_lo = (const __half*)sum_lo;
  x.scale = (const float*)s;
  launch_mmf_experts(w.p, n_expert, x, (const int4*)tiles, ntiles, y.f(), stream());
  return true;
}

// The IQ2_XXS experts' product on the warpgroup MMA (mmw.cu): mmf_experts' arithmetic and activations (no group
// sums), tiles with rows <= mmw_tile_rows(). False where the kernel does not take the expert tensor.
bool mmw_experts(const Tensor& w, uintptr_t hi, uintptr_t lo, uintptr_t s, uintptr_t tiles, int ntiles, Array& y,
                 int pipe) {
  const int n_expert = experts_of(w, "mmw_experts");
  if (!mmw_takes(w.p, n_expert)) return false;
  check_expert_y(w, n_expert, y, "mmw_experts");
  if (!hi || !lo || !s) throw std::invalid_argument("mmw_experts '" + w.name + "': missing activation planes");
  if (y.shape[0] < 1 || ntiles < 1) return true;
  MmfActivations x;
  x.hi = (const __half*)hi;
  x.lo = (const __half*)lo;
  x.scale = (const float*)s;
  launch_mmw_experts(w.p, n_expert, x, (const int4*)tiles, ntiles, y.f(), stream(), pipe);
  return true;
}

}  // namespace

void bind_prefill_products(py::module_& m) {
  m.def("mmq", &mmq, py::arg("w"), py::arg("x"), py::arg("y"), py::arg("groups") = 1,
        "y[t, r] = W[r] . x[t, r // (rows / groups)] for any number of rows of x (prefill), on the int8 tensor cores "
        "from the quantized codes with x quantized as the decode kernels quantize it; False (nothing done) for "
        "weights it does not take (F16, columns not a multiple of 128).");
  m.def("mmq_takes", [](const Tensor& w, int groups) { return mmq_takes(w.p, groups); }, py::arg("w"),
        py::arg("groups") = 1, "Whether mmq takes W as groups block-diagonal matrices (experts: groups = experts).");
  m.def("expert_tiles", [](uintptr_t counts, int E, int nt, uintptr_t tiles, int max_tiles) {
    launch_expert_tiles(reinterpret_cast<const int64_t*>(counts), E, nt, reinterpret_cast<int4*>(tiles), max_tiles,
                        stream());
  }, "mmq_experts' tile table (int32 [max_tiles, 4] at tiles) from the experts' row counts (int64 [E] at counts) on the "
     "device: moe_gemm.expert_tiles' tiles of at most nt rows, then empty ones",
     py::arg("counts"), py::arg("E"), py::arg("nt"), py::arg("tiles"), py::arg("max_tiles"));
  m.def("mmq_experts", &mmq_experts, py::arg("w"), py::arg("x"), py::arg("tiles"), py::arg("ntiles"), py::arg("y"),
        py::arg("rows") = 0, py::arg("w2") = nullptr, py::arg("y2") = nullptr, py::arg("s256") = -1,
        py::arg("up") = nullptr, py::arg("limit") = 0.0f, py::arg("row_w") = 0, py::arg("row_of") = 0,
        "y[i] = W_e . x[i] for activation rows sorted by expert: tiles (device address, int32 [ntiles, 4]) = (first "
        "row, rows <= mmq_tile_rows(), expert e, 0); rows (device address, int64 [R]): activation row i is x[rows[i]]; "
        "w2, y2: y2[i] = W2_e . x[i] from the same quantized rows; s256 (Q2_K without w2): x quantized per 256 "
        "columns and the super-block's sums kept in the mma's int32 registers (1 on, 0 off, -1 $DS4_GPU_MMQ_S256); up "
        "(x's shape): the rows are swiglu(x, up) clamped at limit, times row_w[row_of[i]] (row_w, row_of: device "
        "addresses or 0), quantized without a float copy. "
        "False where the kernel does not take the expert tensors.");
  m.def("mmf_experts", &mmf_experts, py::arg("w"), py::arg("hi"), py::arg("lo"), py::arg("sum_hi"), py::arg("sum_lo"),
        py::arg("s"), py::arg("tiles"), py::arg("ntiles"), py::arg("y"),
        "y[i] = W_e . x[i] for activation rows sorted by expert on the float16 tensor cores, the codes as exact float16 "
        "integers: x / s = hi + lo (split_half), K-quants' group sums of x / s split alike ([R, cols / 256, 16]); "
        "tiles as mmq_experts' with rows <= mmf_tile_rows(). False where the kernel does not take the expert tensor.");
  m.def("mmf_takes", [](const Tensor& w, int n_expert) { return mmf_takes(w.p, n_expert); }, py::arg("w"),
        py::arg("n_expert"), "Whether mmf_experts takes the expert tensor W (IQ2_XXS, Q2_K, Q4_K; columns % 256 == 0).");
  m.def("mmf_tile_rows", &mmf_tile_rows, "Activation rows per mmf tile.");
  m.def("mmw_experts", &mmw_experts, py::arg("w"), py::arg("hi"), py::arg("lo"), py::arg("s"), py::arg("tiles"),
        py::arg("ntiles"), py::arg("y"), py::arg("pipe") = -1,
        "mmf_experts' product for IQ2_XXS experts on the warpgroup MMA (wgmma: operands from shared memory, the "
        "next stage decoded while the products run); hi, lo, s as mmf_experts takes them, tiles with rows <= "
        "mmw_tile_rows(); pipe: 1 the warp-specialized form (a producer warpgroup, mbarrier stages), 0 the lock-step "
        "one, -1 $DS4_GPU_MMW_PIPE. False where the kernel does not take the expert tensor.");
  m.def("mmw_takes", [](const Tensor& w, int n_expert) { return mmw_takes(w.p, n_expert); }, py::arg("w"),
        py::arg("n_expert"), "Whether mmw_experts takes the expert tensor W (IQ2_XXS, columns % 256 == 0).");
  m.def("mmw_tile_rows", &mmw_tile_rows, "Activation rows per mmw tile.");
  m.def("barrier_check", [](int mode, int ctas, int threads, uintptr_t slots, uintptr_t data, int iters,
                            uintptr_t violations) {
    launch_barrier_check(mode, ctas, threads, (unsigned*)slots, (unsigned*)data, iters, (unsigned*)violations,
                         stream());
  }, py::arg("mode"), py::arg("ctas"), py::arg("threads"), py::arg("slots"), py::arg("data"), py::arg("iters"),
        py::arg("violations"),
        "iters grid-wide barriers in one grid of ctas resident CTAs (mode 0: fenced with sleep, 1: acquire/release, "
        "2: cooperative groups' grid.sync), each checked: slots (device int32 [iters], zeroed), data (device int32 "
        "[iters, ctas], zeroed), violations (device int32 [1]) counts CTAs that passed a barrier before every CTA "
        "arrived or before a neighbour's plain store was visible.");
  m.def("barrier_max_ctas", &barrier_max_ctas, py::arg("threads"), "CTAs of barrier_check that fit at once.");
  m.def("flag_relay", [](int ctas, uintptr_t flags, uintptr_t data, int laps, uintptr_t violations) {
    launch_flag_relay(ctas, (unsigned*)flags, (unsigned*)data, laps, (unsigned*)violations, stream());
  }, py::arg("ctas"), py::arg("flags"), py::arg("data"), py::arg("laps"), py::arg("violations"),
        "A token passed laps times around a ring of ctas CTAs (one per SM) by store-release / load-acquire flags; each "
        "hop checks the plain store made before the release. flags, data: device int32 [ctas], zeroed; violations "
        "(device int32 [1]) counts hops that saw a stale store or waited past their patience.");
  m.def("cluster_relay", [](int ctas, int laps, uintptr_t violations, uintptr_t received) {
    launch_cluster_relay(ctas, laps, (unsigned*)violations, (unsigned*)received, stream());
  }, py::arg("ctas"), py::arg("laps"), py::arg("violations"), py::arg("received"),
        "flag_relay inside one cluster of ctas (2..8) CTAs, one per SM: token and checked store through distributed "
        "shared memory with cluster-scope release / acquire; violations as flag_relay's; received (device int32 [1]) "
        "gains the hops taken, ctas x laps - 1.");
  m.def("flag_relay_max_ctas", &flag_relay_max_ctas, "CTAs flag_relay takes at most (the SMs).");
  m.def("launch_empty", [](int n) { launch_empty(n, stream()); }, py::arg("n"),
        "n launches of an empty kernel on the current stream (the launch-gap peer of the barriers).");
  m.def("mmq_tile_rows", &mmq_tile_rows, "Activation rows per mmq tile (DS4_GPU_MMQ_ROWS: 64 or 128).");
  m.def("set_mmq_straight", &set_mmq_straight, py::arg("v"),
        "1: a warp whose fragments all hold tile rows runs them without a test between them (v14, default), 0: the "
        "test before each (v13); the same bits. -1: $DS4_GPU_MMQ_STRAIGHT again.");
  m.def("set_mmq_min_mma", &set_mmq_min_mma, py::arg("mode"),
        "1: mmq's Q2_K / Q4_K min terms as TF32 tensor-core products once per 128-column stage (v27), 0: two FFMAs "
        "per element and 32-column block (v26); 2: the first with one decoded-weights buffer and four CTAs per SM; -1: "
        "$DS4_GPU_MMQ_MINMMA again.");
  m.def("set_mmq_four", &set_mmq_four, py::arg("mode"),
        "1: mmq's IQ2_XXS products with one decoded-weights buffer and four CTAs per SM, 0: three CTAs (the same "
        "bits); -1: $DS4_GPU_MMQ_FOUR again.");
  m.def("set_mmq_xptr", &set_mmq_xptr, py::arg("mode"),
        "1: mmq's four-CTA kernels find their activation rows once per CTA, 0: per stage (the same bits); -1: "
        "$DS4_GPU_MMQ_XPTR again.");
  m.def("set_mmq_xrow", &set_mmq_xrow, py::arg("mode"),
        "1: the routed IQ2_XXS gate and up (mmq_experts) on activations with one scale per row, multiplied by mmq's "
        "XROW kernel; 3: also the Q2_K down (its SwiGLU source); 2: those planes through the per-block kernels; 0: "
        "decode's 32-column scales; -1: $DS4_GPU_MMQ_XROW again.");
  m.def("mmq_xrow_mode", &mmq_xrow_mode, "The routed gate and up's activation scales: $DS4_GPU_MMQ_XROW or set_mmq_xrow's.");
  m.def("set_mmq_pairs", &set_mmq_pairs, py::arg("mode"),
        "1: mmq's K-quant row-pointer kernels take their fragments in pairs (one tile-rows test per pair), 0: one at "
        "a time (the same bits); -1: $DS4_GPU_MMQ_PAIRS again.");
}

}  // namespace ds4ext
