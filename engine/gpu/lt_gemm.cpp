// Dense prefill GEMMs through cuBLASLt with one algorithm per problem class, not per row count (NOTES.md v39).
//
// Why: torch's mm / addmm / _scaled_mm ask cuBLASLt's heuristic for every call; its cache is keyed by the exact shape,
// so a row count M the process has not run costs ~3-4.5 ms of host time per product shape while the device waits
// (v37 item 1: ~30-40 ms on ds4-bench's first 6144-token chunk). Here the heuristic runs once per class: (types,
// transposes, N, K, leading dimensions, batch, strides, beta, alignments) with M >= LT_PICK_MIN taken as LT_PICK_M
// rows; the algorithm it returns then serves every M of the class, checked once per new M by cublasLtMatmulAlgoCheck
// (a failed check asks the heuristic for that exact M). Smaller M keep a class per exact M, as torch does.
//
// Row-major torch operands map to cuBLASLt's column-major as D^T[N, M] = op(W)[N, K] . X^T[K, M]: the weight is the
// "A" operand (transposed where it is given as w.T, i.e. its column stride is 1), the activations the "B" operand.
//
// cuBLASLt is loaded at run time (dlopen; the copy torch already holds where its major version matches the header's),
// so the module builds and imports without it; build.py compiles this file with DS4_HAVE_CUBLASLT only where it finds
// cublasLt.h. One workspace (32 MiB) serves every call: calls must stay on one stream (the prefill's).
#include <pybind11/pybind11.h>

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>
#include <algorithm>

#include "bindings.h"

namespace py = pybind11;

#ifdef DS4_HAVE_CUBLASLT
#include <cublasLt.h>
#include <dlfcn.h>
#endif

namespace ds4ext {

namespace {

constexpr int64_t LT_PICK_M = 8192;    // the row count the heuristic sees for a large-M class
constexpr int64_t LT_PICK_MIN = 1024;  // classes from this many rows share one algorithm
constexpr size_t LT_WORKSPACE = 32u << 20;

struct LtStats {
  int64_t calls = 0, heuristics = 0, checks = 0, check_failures = 0, timed = 0;
};
int g_lt_tune = 1;  // heuristic candidates timed on a class's first call (1: its first pick, untimed)
LtStats g_lt_stats;

#ifdef DS4_HAVE_CUBLASLT

struct LtApi {
  void* lib = nullptr;
  std::string path;
  decltype(&cublasLtCreate) create = nullptr;
  decltype(&cublasLtMatmul) matmul = nullptr;
  decltype(&cublasLtMatmulDescCreate) desc_create = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) desc_set = nullptr;
  decltype(&cublasLtMatmulDescDestroy) desc_destroy = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) layout_create = nullptr;
  decltype(&cublasLtMatrixLayoutSetAttribute) layout_set = nullptr;
  decltype(&cublasLtMatrixLayoutDestroy) layout_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) pref_create = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) pref_set = nullptr;
  decltype(&cublasLtMatmulPreferenceDestroy) pref_destroy = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic = nullptr;
  decltype(&cublasLtMatmulAlgoCheck) check = nullptr;
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
};
LtApi g_lt;

template <typename F>
void lt_sym(F& f, const char* name) {
  f = reinterpret_cast<F>(dlsym(g_lt.lib, name));
  if (!f) throw std::runtime_error(std::string("cuBLASLt: no symbol ") + name + " in " + g_lt.path);
}

void lt_ok(cublasStatus_t st, const char* what) {
  if (st != CUBLAS_STATUS_SUCCESS) throw std::runtime_error(std::string("cuBLASLt ") + what + " failed (status " +
                                                            std::to_string((int)st) + ")");
}

// Loads the library once: path if given, else the soname of the header's major version (torch's copy when loaded).
bool lt_init(const std::string& path) {
  if (g_lt.handle) return true;
  const std::string soname = "libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR);
  void* lib = dlopen(soname.c_str(), RTLD_NOW | RTLD_NOLOAD);
  std::string used = soname;
  if (!lib && !path.empty()) lib = dlopen((used = path).c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) lib = dlopen((used = soname).c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) return false;
  // the enums and structs come from the header: a library of another major version is not used
  auto version = reinterpret_cast<decltype(&cublasLtGetVersion)>(dlsym(lib, "cublasLtGetVersion"));
  if (!version || (int)(version() / 10000) != CUBLAS_VER_MAJOR) {
    dlclose(lib);
    return false;
  }
  g_lt.lib = lib;
  g_lt.path = used;
  lt_sym(g_lt.create, "cublasLtCreate");
  lt_sym(g_lt.matmul, "cublasLtMatmul");
  lt_sym(g_lt.desc_create, "cublasLtMatmulDescCreate");
  lt_sym(g_lt.desc_set, "cublasLtMatmulDescSetAttribute");
  lt_sym(g_lt.desc_destroy, "cublasLtMatmulDescDestroy");
  lt_sym(g_lt.layout_create, "cublasLtMatrixLayoutCreate");
  lt_sym(g_lt.layout_set, "cublasLtMatrixLayoutSetAttribute");
  lt_sym(g_lt.layout_destroy, "cublasLtMatrixLayoutDestroy");
  lt_sym(g_lt.pref_create, "cublasLtMatmulPreferenceCreate");
  lt_sym(g_lt.pref_set, "cublasLtMatmulPreferenceSetAttribute");
  lt_sym(g_lt.pref_destroy, "cublasLtMatmulPreferenceDestroy");
  lt_sym(g_lt.heuristic, "cublasLtMatmulAlgoGetHeuristic");
  lt_sym(g_lt.check, "cublasLtMatmulAlgoCheck");
  DS4_CHECK(cudaMalloc(&g_lt.workspace, LT_WORKSPACE));
  lt_ok(g_lt.create(&g_lt.handle), "create");
  return true;
}

// One problem as the caller states it (row-major torch views) and the cuBLASLt objects made for it.
struct LtProblem {
  int ab_type;         // 0: float16 operands, 1: float8 e4m3
  int w_trans;         // 1: W given as w.T (column stride 1); 0: W row-major [K, N]
  int64_t M, N, K, ldw, ldx, ldy, batch, sw, sx, sy;
  int beta1, fast;     // accumulate into y; float8 fast accumulation
  int aw, ax, ay;      // alignments of the three addresses (bytes, up to 256)
  auto key(int64_t m) const { return std::make_tuple(ab_type, w_trans, m, N, K, ldw, ldx, ldy, batch, sw, sx, sy, beta1,
                                                     fast, aw, ax, ay); }
};

struct LtDescs {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  LtDescs() = default;
  LtDescs(const LtDescs&) = delete;
  LtDescs& operator=(const LtDescs&) = delete;
  ~LtDescs() {
    if (a) g_lt.layout_destroy(a);
    if (b) g_lt.layout_destroy(b);
    if (c) g_lt.layout_destroy(c);
    if (op) g_lt.desc_destroy(op);
  }
};

void lt_layout(cublasLtMatrixLayout_t* l, cudaDataType_t t, int64_t rows, int64_t cols, int64_t ld, int64_t batch,
               int64_t stride) {
  lt_ok(g_lt.layout_create(l, t, (uint64_t)rows, (uint64_t)cols, ld), "layout");
  if (batch > 1) {
    const int32_t n = (int32_t)batch;
    lt_ok(g_lt.layout_set(*l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &n, sizeof(n)), "batch count");
    lt_ok(g_lt.layout_set(*l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)), "batch stride");
  }
}

// The descriptors of p at m rows; sw_ptr / sx_ptr: float8 scales (device float32), null for float16.
void lt_descs(const LtProblem& p, int64_t m, const void* sw_ptr, const void* sx_ptr, LtDescs& d) {
  const cudaDataType_t ab = p.ab_type ? CUDA_R_8F_E4M3 : CUDA_R_16F;
  lt_ok(g_lt.desc_create(&d.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "matmul desc");
  const cublasOperation_t ta = p.w_trans ? CUBLAS_OP_T : CUBLAS_OP_N, tb = CUBLAS_OP_N;
  lt_ok(g_lt.desc_set(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)), "transa");
  lt_ok(g_lt.desc_set(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)), "transb");
  if (p.ab_type) {
    lt_ok(g_lt.desc_set(d.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sw_ptr, sizeof(sw_ptr)), "a scale");
    lt_ok(g_lt.desc_set(d.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sx_ptr, sizeof(sx_ptr)), "b scale");
    const int8_t fast = (int8_t)p.fast;
    lt_ok(g_lt.desc_set(d.op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)), "fast accum");
  }
  // A = W: stored [K, N] column-major (w.T of a row-major [N, K]) or [N, K] column-major (a row-major [K, N])
  if (p.w_trans) lt_layout(&d.a, ab, p.K, p.N, p.ldw, p.batch, p.sw);
  else lt_layout(&d.a, ab, p.N, p.K, p.ldw, p.batch, p.sw);
  lt_layout(&d.b, ab, p.K, m, p.ldx, p.batch, p.sx);   // X^T: row-major [M, K] rows
  lt_layout(&d.c, CUDA_R_32F, p.N, m, p.ldy, p.batch, p.sy);  // Y^T: row-major [M, N] float32
}

// The heuristic's algorithms for p at m rows, best first, at most n (throws where it has none).
std::vector<cublasLtMatmulAlgo_t> lt_candidates(const LtProblem& p, int64_t m, const void* sw_ptr, const void* sx_ptr,
                                                int n) {
  LtDescs d;
  lt_descs(p, m, sw_ptr, sx_ptr, d);
  cublasLtMatmulPreference_t pref = nullptr;
  lt_ok(g_lt.pref_create(&pref), "preference");
  const uint64_t ws = LT_WORKSPACE;
  const uint32_t al[4] = {(uint32_t)p.aw, (uint32_t)p.ax, (uint32_t)p.ay, (uint32_t)p.ay};
  g_lt.pref_set(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  g_lt.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al[0], sizeof(uint32_t));
  g_lt.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al[1], sizeof(uint32_t));
  g_lt.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al[2], sizeof(uint32_t));
  g_lt.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al[3], sizeof(uint32_t));
  std::vector<cublasLtMatmulHeuristicResult_t> res((size_t)std::max(n, 1));
  int found = 0;
  const cublasStatus_t st =
      g_lt.heuristic(g_lt.handle, d.op, d.a, d.b, d.c, d.c, pref, (int)res.size(), res.data(), &found);
  g_lt.pref_destroy(pref);
  ++g_lt_stats.heuristics;
  if (st != CUBLAS_STATUS_SUCCESS || found < 1)
    throw std::runtime_error("cuBLASLt has no algorithm for this product (status " + std::to_string((int)st) + ")");
  std::vector<cublasLtMatmulAlgo_t> algos;
  for (int i = 0; i < found; ++i)
    if (res[i].state == CUBLAS_STATUS_SUCCESS && res[i].workspaceSize <= LT_WORKSPACE) algos.push_back(res[i].algo);
  if (algos.empty()) throw std::runtime_error("cuBLASLt has no algorithm for this product within the workspace");
  return algos;
}

cublasLtMatmulAlgo_t lt_pick(const LtProblem& p, int64_t m, const void* sw_ptr, const void* sx_ptr) {
  return lt_candidates(p, m, sw_ptr, sx_ptr, 1)[0];
}

struct LtChoice {
  cublasLtMatmulAlgo_t algo;
};
std::map<decltype(LtProblem{}.key(0)), LtChoice> g_lt_classes;  // per class: the algorithm
std::map<decltype(LtProblem{}.key(0)), LtChoice> g_lt_rows;     // per class and exact M: checked or picked for it

// Of the heuristic's first g_lt_tune algorithms for the class (asked at LT_PICK_M rows), the one that runs this call's
// operands fastest (v40: the heuristic's first pick ran the float16 mm products at 6144 rows ~20% slower than torch's
// own calls on the H100). Each candidate that passes the check at M runs once to warm up and twice timed, into a scratch output, so
// y is untouched; during a stream capture, and with g_lt_tune = 1, the first pick that passes the check.
bool lt_algo_ok(const LtDescs& d, const cublasLtMatmulAlgo_t& algo) {
  cublasLtMatmulHeuristicResult_t res{};
  ++g_lt_stats.checks;
  const bool ok = g_lt.check(g_lt.handle, d.op, d.a, d.b, d.c, d.c, &algo, &res) == CUBLAS_STATUS_SUCCESS &&
                  res.workspaceSize <= LT_WORKSPACE;
  if (!ok) ++g_lt_stats.check_failures;
  return ok;
}

bool lt_fastest(const LtDescs& d, const std::vector<cublasLtMatmulAlgo_t>& algos, const void* w, const void* x,
                size_t y_bytes, float beta, cublasLtMatmulAlgo_t& best) {
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  DS4_CHECK(cudaStreamIsCapturing(stream(), &cap));
  std::vector<size_t> live;
  for (size_t i = 0; i < algos.size(); ++i)
    if (lt_algo_ok(d, algos[i])) live.push_back(i);
  if (live.empty()) return false;
  best = algos[live[0]];
  if (live.size() == 1 || cap != cudaStreamCaptureStatusNone) return true;
  void* scratch = nullptr;
  cudaEvent_t e0, e1;
  DS4_CHECK(cudaMallocAsync(&scratch, y_bytes, stream()));
  DS4_CHECK(cudaEventCreate(&e0));
  DS4_CHECK(cudaEventCreate(&e1));
  const float one = 1.0f;
  float best_ms = 1e30f;
  for (size_t i : live) {
    auto run = [&]() {
      lt_ok(g_lt.matmul(g_lt.handle, d.op, &one, w, d.a, x, d.b, &beta, scratch, d.c, scratch, d.c, &algos[i],
                        g_lt.workspace, LT_WORKSPACE, stream()), "matmul (timing)");
    };
    run();
    DS4_CHECK(cudaEventRecord(e0, stream()));
    run();
    run();
    DS4_CHECK(cudaEventRecord(e1, stream()));
    DS4_CHECK(cudaEventSynchronize(e1));
    float ms = 0.0f;
    DS4_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    ++g_lt_stats.timed;
    if (ms < best_ms) best_ms = ms, best = algos[i];
  }
  DS4_CHECK(cudaEventDestroy(e0));
  DS4_CHECK(cudaEventDestroy(e1));
  DS4_CHECK(cudaFreeAsync(scratch, stream()));
  return true;
}

int align_of(uintptr_t a) {
  int al = 1;
  while (al < 256 && (a % (2 * al)) == 0) al *= 2;
  return al;
}

// y[b] (+)= x[b] . W[b] for b < batch, in float32: see the file's comment for the layout.
void lt_matmul(int ab_type, uintptr_t w, int w_trans, uintptr_t x, uintptr_t y, int64_t M, int64_t N, int64_t K,
               int64_t ldw, int64_t ldx, int64_t ldy, int64_t batch, int64_t sw, int64_t sx, int64_t sy, bool beta1,
               uintptr_t scale_w, uintptr_t scale_x, bool fast) {
  if (!g_lt.handle) throw std::runtime_error("lt_matmul: cuBLASLt is not loaded (call lt_init first)");
  if (M < 1 || N < 1 || K < 1 || batch < 1) throw std::invalid_argument("lt_matmul: M, N, K and batch must be >= 1");
  if (ab_type && (!scale_w || !scale_x)) throw std::invalid_argument("lt_matmul: float8 operands need both scales");
  LtProblem p{ab_type, w_trans, M, N, K, ldw, ldx, ldy, batch, sw, sx, sy, (int)beta1, (int)fast,
              align_of(w), align_of(x), align_of(y)};
  const void* swp = reinterpret_cast<const void*>(scale_w);
  const void* sxp = reinterpret_cast<const void*>(scale_x);
  ++g_lt_stats.calls;
  LtDescs d;
  lt_descs(p, M, swp, sxp, d);
  auto rk = p.key(M);
  auto it = g_lt_rows.find(rk);
  if (it == g_lt_rows.end()) {
    LtChoice c;
    if (M >= LT_PICK_MIN) {
      auto ck = p.key(-1);
      auto cl = g_lt_classes.find(ck);
      if (cl == g_lt_classes.end()) {
        const auto algos = lt_candidates(p, LT_PICK_M, swp, sxp, g_lt_tune);
        const size_t y_bytes = 4 * (size_t)((batch - 1) * sy + (M - 1) * ldy + N);
        LtChoice first{};
        if (!lt_fastest(d, algos, reinterpret_cast<const void*>(w), reinterpret_cast<const void*>(x), y_bytes,
                        beta1 ? 1.0f : 0.0f, first.algo))
          first.algo = algos[0];  // none passes at this M: the class keeps the heuristic's pick, this M its own below
        cl = g_lt_classes.emplace(ck, first).first;
      }
      if (lt_algo_ok(d, cl->second.algo)) c = cl->second;
      else c.algo = lt_pick(p, M, swp, sxp);
    } else {
      c.algo = lt_pick(p, M, swp, sxp);
    }
    it = g_lt_rows.emplace(rk, c).first;
  }
  const float one = 1.0f, beta = beta1 ? 1.0f : 0.0f;
  void* yp = reinterpret_cast<void*>(y);
  lt_ok(g_lt.matmul(g_lt.handle, d.op, &one, reinterpret_cast<const void*>(w), d.a, reinterpret_cast<const void*>(x),
                    d.b, &beta, yp, d.c, yp, d.c, &it->second.algo, g_lt.workspace, LT_WORKSPACE, stream()),
        "matmul");
}

#endif  // DS4_HAVE_CUBLASLT

}  // namespace

void bind_lt_gemm(py::module_& m) {
#ifdef DS4_HAVE_CUBLASLT
  m.def("lt_init", &lt_init, py::arg("path") = "",
        "Load cuBLASLt (the copy already in the process where its major version matches; else path, else the "
        "soname). False where it cannot be found.");
  m.def("lt_path", []() { return g_lt.path; }, "The cuBLASLt library lt_init loaded ('' before).");
  m.def("lt_set_tune", [](int n) {
    if (n < 1 || n > 32) throw std::invalid_argument("lt_set_tune: candidates must be 1..32");
    g_lt_tune = n;
  }, py::arg("candidates"), "Heuristic candidates timed on each class's first call from now on (1: the first pick).");
  m.def("lt_matmul", &lt_matmul, py::arg("ab_type"), py::arg("w"), py::arg("w_trans"), py::arg("x"), py::arg("y"),
        py::arg("M"), py::arg("N"), py::arg("K"), py::arg("ldw"), py::arg("ldx"), py::arg("ldy"), py::arg("batch"),
        py::arg("sw"), py::arg("sx"), py::arg("sy"), py::arg("beta1"), py::arg("scale_w") = 0, py::arg("scale_x") = 0,
        py::arg("fast") = false,
        "y[b] (+)= x[b] . W[b] in float32 on the module's stream (engine/gpu/lt_gemm.py states the layouts).");
#endif
  m.def("lt_compiled", []() {
#ifdef DS4_HAVE_CUBLASLT
    return true;
#else
    return false;
#endif
  }, "Whether the module was built with cuBLASLt's header (lt_init and lt_matmul exist).");
  m.def("lt_stats", []() {
    py::dict d;
    d["calls"] = g_lt_stats.calls;
    d["heuristics"] = g_lt_stats.heuristics;
    d["checks"] = g_lt_stats.checks;
    d["check_failures"] = g_lt_stats.check_failures;
    d["timed"] = g_lt_stats.timed;
    return d;
  }, "Counts: lt_matmul calls, heuristic queries, algorithm checks for a new M, the checks that failed and the "
      "candidates timed.");
}

}  // namespace ds4ext
