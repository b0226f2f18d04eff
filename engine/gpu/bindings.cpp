// Python bindings of the ds4 CUDA kernels (module ds4.engine.gpu._ext).
//
// Objects: Tensor (a weight uploaded once and kept resident in the device layout of common.cuh),
// Array (a float32/int32 device array for activations), Graph (a captured CUDA graph of ops).
// Every op runs asynchronously on one module-wide stream; Array.numpy() synchronizes.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <sstream>
#include <vector>

#include "bindings.h"
#include "common.cuh"
#include "moe_mma.cuh"
#include "router.cuh"

namespace py = pybind11;
using namespace ds4gpu;

namespace ds4ext {

cudaStream_t g_stream = nullptr;
bool g_capturing_flag = false;

bool g_stream_external = false;  // set_stream() was called (its handle may be 0, the legacy stream)

cudaStream_t stream() {
  if (!g_stream && !g_stream_external) DS4_CHECK(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
  return g_stream;
}

// True during our own capture or one begun by someone else on our stream (torch.cuda.graph).
bool capturing() {
  if (g_capturing_flag) return true;
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  if ((g_stream || g_stream_external) && cudaStreamIsCapturing(g_stream, &st) == cudaSuccess) return st == cudaStreamCaptureStatusActive;
  return false;
}

}  // namespace ds4ext

using namespace ds4ext;

namespace {


std::string mib(size_t n) {
  std::ostringstream s;
  s.setf(std::ios::fixed);
  s.precision(1);
  s << n / 1048576.0 << " MiB";
  return s.str();
}

[[noreturn]] void raise_oom(const std::string& what, size_t need) {
  size_t free_b = 0, total_b = 0;
  cudaGetLastError();
  cudaMemGetInfo(&free_b, &total_b);
  std::string msg = "GPU out of memory " + what + ": needs " + mib(need) + ", " + mib(free_b) + " free of " +
                    mib(total_b);
  PyErr_SetString(PyExc_MemoryError, msg.c_str());
  throw py::error_already_set();
}

}  // namespace

namespace ds4ext {

void* device_alloc(size_t n, const std::string& what) {
  if (capturing()) throw std::runtime_error("cannot allocate device memory (" + what + ") during graph capture");
  void* p = nullptr;
  if (cudaMalloc(&p, n ? n : 1) != cudaSuccess) raise_oom(what, n);
  return p;
}

Scratch g_scratch;
Scratch g_prefill_scratch;

size_t xq_bytes(int64_t nvec, int64_t n) {
  return 2 * align256(nvec * n) + align256(nvec * n / 32 * 4) + align256(nvec * n / 16 * 4);
}

// The planes of take_xq laid out from base (xq_bytes(nvec, n) bytes: a caller-owned buffer).
XQ xq_at(uint8_t* base, int64_t nvec, int64_t n) {
  XQ q;
  q.hi = (int8_t*)base;
  q.lo = q.hi + align256(nvec * n);
  q.scale = (float*)(q.lo + align256(nvec * n));
  q.sum16 = (float*)((uint8_t*)q.scale + align256(nvec * n / 32 * 4));
  q.n = (int)n;
  q.rows = nvec;
  return q;
}

XQ take_xq(int64_t nvec, int64_t n, Scratch& from) {
  XQ q;
  q.hi = (int8_t*)from.take(nvec * n);
  q.lo = (int8_t*)from.take(nvec * n);
  q.scale = (float*)from.take(nvec * n / 32 * 4);
  q.sum16 = (float*)from.take(nvec * n / 16 * 4);
  q.n = (int)n;
  q.rows = nvec;
  return q;
}

int64_t gguf_row_bytes(int qt, int64_t ncols) {
  switch (qt) {
    case QT_F16: return ncols * 2;
    case QT_Q8_0: return ncols / 32 * 34;
    case QT_Q2_K: return ncols / 256 * 84;
    case QT_Q4_K: return ncols / 256 * 144;
    case QT_IQ2_XXS: return ncols / 256 * 66;
    default: throw std::invalid_argument("quant type " + std::to_string(qt) + " has no GPU kernel");
  }
}

}  // namespace ds4ext

namespace {





const char* qtype_name(int qt) {
  switch (qt) {
    case QT_F16: return "F16";
    case QT_Q8_0: return "Q8_0";
    case QT_Q2_K: return "Q2_K";
    case QT_Q4_K: return "Q4_K";
    case QT_IQ2_XXS: return "IQ2_XXS";
    default: return "?";
  }
}



std::shared_ptr<Tensor> upload(const std::string& name, int qtype, std::vector<int64_t> ne, py::buffer raw) {
  if (ne.empty()) throw std::invalid_argument(name + ": empty shape");
  py::buffer_info info = raw.request();
  auto t = std::make_shared<Tensor>();
  t->name = name;
  t->qtype = qtype;
  t->ne = ne;
  int64_t ncols = ne[0], nrows = 1;
  for (size_t i = 1; i < ne.size(); ++i) nrows *= ne[i];
  int64_t qs_row, sc_row;
  try {
    packed_row_bytes(qtype, ncols, &qs_row, &sc_row);
  } catch (const std::exception& e) {
    throw std::invalid_argument(name + ": " + e.what());
  }
  const int64_t rb = gguf_row_bytes(qtype, ncols);
  const size_t nraw = (size_t)(rb * nrows);
  if ((size_t)(info.size * info.itemsize) != nraw)
    throw std::invalid_argument(name + ": " + qtype_name(qtype) + " data has " +
                                std::to_string(info.size * info.itemsize) + " bytes, the shape needs " +
                                std::to_string(nraw));
  if (info.ndim > 0 && info.strides.back() != info.itemsize)
    throw std::invalid_argument(name + ": tensor data must be C-contiguous");
  size_t qs_bytes = align256(qs_row * nrows), total = qs_bytes + align256(sc_row * nrows);
  std::ostringstream what;
  what << "uploading tensor '" << name << "' (" << qtype_name(qtype) << ", ne=[";
  for (size_t i = 0; i < ne.size(); ++i) what << (i ? ", " : "") << ne[i];
  what << "])";
  t->mem = device_alloc(total, what.str());
  t->nbytes = total;
  t->p.qtype = qtype;
  t->p.ncols = ncols;
  t->p.nrows = nrows;
  t->p.qs = (const uint8_t*)t->mem;
  t->p.qs_row = qs_row;
  t->p.sc = (const uint8_t*)t->mem + qs_bytes;
  t->p.sc_row = sc_row;
  // Stage the GGUF bytes through a bounded buffer, repacking chunk by chunk.
  const int64_t chunk_rows = std::max<int64_t>(1, std::min<int64_t>(nrows, (256ll << 20) / rb));
  void* staging = device_alloc((size_t)(chunk_rows * rb), "staging " + what.str());
  const uint8_t* host = (const uint8_t*)info.ptr;
  try {
    for (int64_t r = 0; r < nrows; r += chunk_rows) {
      int64_t n = std::min(chunk_rows, nrows - r);
      DS4_CHECK(cudaMemcpyAsync(staging, host + r * rb, (size_t)(n * rb), cudaMemcpyHostToDevice, stream()));
      launch_repack(qtype, (const uint8_t*)staging, n, ncols, (uint8_t*)t->mem + r * qs_row, qs_row,
                    (uint8_t*)t->p.sc + r * sc_row, sc_row, stream());
    }
    DS4_CHECK(cudaStreamSynchronize(stream()));
  } catch (...) {
    cudaFree(staging);
    throw;
  }
  DS4_CHECK(cudaFree(staging));
  return t;
}


std::shared_ptr<Array> make_array(std::vector<int64_t> shape, bool is_int) {
  auto a = std::make_shared<Array>();
  a->shape = shape;
  a->is_int = is_int;
  a->nbytes = (size_t)a->size() * 4;
  a->ptr = device_alloc(a->nbytes, "for an activation array");
  return a;
}

// Host -> device on the extension's stream, complete on return. Not cudaMemcpy: from pageable memory it may return
// before its DMA has landed, and it runs on the legacy stream, which a non-blocking stream (torch's, once set_stream
// has handed it over) does not wait for: a kernel launched next could read the rows not yet copied (v27: the last
// rows of a test's activations, seen once in a run of the mmq tests).
void copy_in(void* dst, const void* src, size_t nbytes) {
  DS4_CHECK(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyHostToDevice, stream()));
  DS4_CHECK(cudaStreamSynchronize(stream()));
}

void array_copy_from(Array& a, py::array arr) {
  bool is_int = py::isinstance<py::array_t<int32_t>>(arr);
  bool is_f32 = py::isinstance<py::array_t<float>>(arr);
  if ((a.is_int && !is_int) || (!a.is_int && !is_f32))
    throw std::invalid_argument(std::string("array dtype must be ") + (a.is_int ? "int32" : "float32"));
  if ((size_t)arr.nbytes() != a.nbytes) throw std::invalid_argument("array size mismatch");
  if (!(arr.flags() & py::array::c_style)) throw std::invalid_argument("array must be C-contiguous");
  copy_in(a.ptr, arr.data(), a.nbytes);
}

// A view of device memory owned by someone else (e.g. torch.Tensor.data_ptr()); never freed here.
std::shared_ptr<Array> array_view(uintptr_t ptr, std::vector<int64_t> shape, bool is_int) {
  auto a = std::make_shared<Array>();
  a->shape = shape;
  a->is_int = is_int;
  a->owns = false;
  a->nbytes = (size_t)a->size() * 4;
  a->ptr = (void*)ptr;
  return a;
}

std::shared_ptr<Array> array_from_numpy(py::array arr) {
  bool is_int = py::isinstance<py::array_t<int32_t>>(arr);
  if (!is_int && !py::isinstance<py::array_t<float>>(arr))
    throw std::invalid_argument("device arrays hold float32 or int32");
  std::vector<int64_t> shape(arr.shape(), arr.shape() + arr.ndim());
  auto a = make_array(shape, is_int);
  py::array c = py::array::ensure(arr, py::array::c_style);
  array_copy_from(*a, c);
  return a;
}

py::array array_to_numpy(const Array& a) {
  DS4_CHECK(cudaStreamSynchronize(stream()));
  py::array out = a.is_int ? (py::array)py::array_t<int32_t>(a.shape) : (py::array)py::array_t<float>(a.shape);
  DS4_CHECK(cudaMemcpy(out.mutable_data(), a.ptr, a.nbytes, cudaMemcpyDeviceToHost));
  return out;
}

void array_fill(Array& a, float value) {
  std::vector<float> host((size_t)a.size(), value);
  copy_in(a.ptr, host.data(), a.nbytes);
}

// norm_w != 0: y = W . (rms_norm(x) * norm_w) (eps; batch 1, groups 1), the norm applied by the streaming kernel
// while it stages x (returns True), or where that kernel does not take W, by the rms_norm launch into scratch before
// the plain product (False): the bits of rms_norm then matvec either way. Without norm_w: False.
bool matvec(const Tensor& w, const Array& x, Array& y, int groups, uintptr_t norm_w, float eps) {
  if (x.shape.empty() || y.shape.size() != 2) throw std::invalid_argument("matvec: x is [B, ...], y is [B, rows]");
  int64_t B = x.shape[0];
  if (B < 1 || B > MAX_BATCH) throw std::invalid_argument("matvec: batch must be 1..8, got " + std::to_string(B));
  if (x.size() != B * groups * w.p.ncols)
    throw std::invalid_argument("matvec '" + w.name + "': x has " + std::to_string(x.size()) + " values, needs " +
                                std::to_string(B) + " x " + std::to_string(groups) + " x " + std::to_string(w.p.ncols));
  if (y.shape[0] != B || y.shape[1] != w.p.nrows)
    throw std::invalid_argument("matvec '" + w.name + "': y must be [" + std::to_string(B) + ", " +
                                std::to_string(w.p.nrows) + "]");
  const float* x_in = x.f();
  const int64_t n = w.p.ncols;
  if (norm_w) {
    if (B != 1 || groups != 1) throw std::invalid_argument("matvec '" + w.name + "': norm_w takes batch 1, groups 1");
    const Packed* ps[1] = {&w.p};
    float* yp[1] = {y.f()};
    const float* nw = reinterpret_cast<const float*>(norm_w);
    if (launch_matvec_multi(ps, yp, 1, x_in, MV_X_RMS, 0.0f, stream(), nw, eps)) return true;
    g_scratch.reserve(align256(4 * n) + (w.qtype != QT_F16 ? xq_bytes(1, n) : 0));
    g_scratch.begin();
    float* xn = (float*)g_scratch.take(4 * n);
    XQ xq;
    if (w.qtype != QT_F16) xq = take_xq(1, n);
    launch_rms_norm(x_in, nw, xn, 1, (int)n, eps, stream());
    launch_matvec(w.p, xn, xq, 1, 1, y.f(), stream());
    return false;
  }
  XQ xq;
  if (w.qtype != QT_F16) {
    Scratch& sc = scratch_for(B);
    sc.reserve(xq_bytes(B * groups, n));
    sc.begin();
    xq = take_xq(B * groups, n, sc);
  }
  launch_matvec(w.p, x_in, xq, (int)B, groups, y.f(), stream());
  return false;
}

void moe(const Tensor& gate, const Tensor& up, const Tensor& down, const Array& x, const Array& ids,
         const Array& weights, Array& y, float clamp, uintptr_t xq_in) {
  if (gate.ne.size() != 3) throw std::invalid_argument("moe: expert tensors are [cols, rows, experts]");
  int n_expert = (int)gate.ne[2];
  if (x.shape.size() != 2 || ids.shape.size() != 2 || weights.shape != ids.shape || y.shape != x.shape)
    throw std::invalid_argument("moe: x, y are [T, n_embd]; ids, weights are [T, k]");
  int64_t T = x.shape[0], k = ids.shape[1], D = gate.p.ncols, F = gate.ne[1];
  if (ids.shape[0] != T || x.shape[1] != D) throw std::invalid_argument("moe: shapes of x/ids disagree with the experts");
  Scratch& sc = scratch_for(T);
  sc.reserve(xq_bytes(T, D) + align256(T * k * F * 4) + xq_bytes(T * k, F));
  sc.begin();
  MoeScratch s;
  s.xq_in = take_xq(T, D, sc);
  s.h = (float*)sc.take(T * k * F * 4);
  s.xq_h = take_xq(T * k, F, sc);
  if (xq_in) {  // x already quantized (quantize_x_into, e.g. on a side stream beside the router)
    if (gate.qtype == QT_F16 || T != 1) throw std::invalid_argument("moe: a quantized x takes one token and quantized experts");
    s.xq_in = xq_at(reinterpret_cast<uint8_t*>(xq_in), T, D);
  }
  launch_moe(gate.p, up.p, down.p, n_expert, x.f(), ids.i(), weights.f(), (int)T, (int)k, clamp, y.f(), s, stream(),
             xq_in != 0);
}

// moe with the shared expert in the same two launches (DS4_GPU_MOE_SHEXP; one token): y the routed experts' sum,
// y_shexp the shared expert's output. False (nothing launched) where launch_moe_shexp does not take the shapes.
bool moe_shexp(const Tensor& gate, const Tensor& up, const Tensor& down, const Tensor& sgate, const Tensor& sup,
               const Tensor& sdown, const Array& x, const Array& ids, const Array& weights, Array& y, Array& y_shexp,
               float clamp, uintptr_t xq_in) {
  if (gate.ne.size() != 3) throw std::invalid_argument("moe_shexp: expert tensors are [cols, rows, experts]");
  const int n_expert = (int)gate.ne[2];
  if (x.shape.size() != 2 || ids.shape.size() != 2 || weights.shape != ids.shape || y.shape != x.shape ||
      y_shexp.shape != x.shape || ids.shape[0] != x.shape[0] || x.shape[1] != gate.p.ncols)
    throw std::invalid_argument("moe_shexp: x, y, y_shexp are [1, n_embd]; ids, weights are [1, k]");
  const int64_t T = x.shape[0], k = ids.shape[1], D = gate.p.ncols, F = gate.ne[1];
  if (!moe_shexp_takes(gate.p, down.p, sgate.p, sup.p, sdown.p, n_expert, (int)T)) return false;
  Scratch& sc = scratch_for(T);
  sc.reserve(xq_bytes(T, D) + align256((k + 1) * F * 4) + xq_bytes(k + 1, F));
  sc.begin();
  MoeScratch s;
  s.xq_in = xq_in ? xq_at(reinterpret_cast<uint8_t*>(xq_in), T, D) : take_xq(T, D, sc);
  s.h = (float*)sc.take((k + 1) * F * 4);
  s.xq_h = take_xq(k + 1, F, sc);
  launch_moe_shexp(gate.p, up.p, down.p, sgate.p, sup.p, sdown.p, n_expert, x.f(), ids.i(), weights.f(), (int)k, clamp,
                   y.f(), y_shexp.f(), s, stream(), xq_in != 0);
  return true;
}

// The gate/up half of moe on its own: h[t k + j] = silu(min(g, c)) clamp(u, -c, c) weights[t, j] (tests, bench).
void moe_gateup(const Tensor& gate, const Tensor& up, const Array& x, const Array& ids, const Array& weights, Array& h,
                float clamp) {
  if (gate.ne.size() != 3) throw std::invalid_argument("moe_gateup: expert tensors are [cols, rows, experts]");
  int n_expert = (int)gate.ne[2];
  if (x.shape.size() != 2 || ids.shape.size() != 2 || weights.shape != ids.shape || h.shape.size() != 2)
    throw std::invalid_argument("moe_gateup: x is [T, n_embd], ids and weights [T, k], h [T k, n_ff]");
  int64_t T = x.shape[0], k = ids.shape[1], D = gate.p.ncols, F = gate.ne[1];
  if (ids.shape[0] != T || x.shape[1] != D || h.shape[0] != T * k || h.shape[1] != F)
    throw std::invalid_argument("moe_gateup: shapes of x/ids/h disagree with the experts");
  Scratch& sc = scratch_for(T);
  sc.reserve(xq_bytes(T, D));
  sc.begin();
  MoeScratch s;
  s.xq_in = take_xq(T, D, sc);
  s.h = h.f();
  launch_moe_gateup(gate.p, up.p, n_expert, x.f(), ids.i(), weights.f(), (int)T, (int)k, clamp, s, stream());
}

// Several matrices reading the same x (same ncols): x is quantized once for all of them.
void matvec_shared(const std::vector<std::shared_ptr<Tensor>>& ws, const Array& x, const std::vector<std::shared_ptr<Array>>& ys) {
  if (ws.empty() || ws.size() != ys.size()) throw std::invalid_argument("matvec_shared: one y per weight");
  int64_t B = x.shape.empty() ? 0 : x.shape[0];
  if (B < 1 || B > MAX_BATCH) throw std::invalid_argument("matvec_shared: batch must be 1..8");
  const int64_t n = ws[0]->p.ncols;
  bool any_q = false;
  for (size_t i = 0; i < ws.size(); ++i) {
    const Tensor& w = *ws[i];
    if (w.p.ncols != n || x.size() != B * n) throw std::invalid_argument("matvec_shared '" + w.name + "': x must be [B, ncols] for every weight");
    if (ys[i]->shape.size() != 2 || ys[i]->shape[0] != B || ys[i]->shape[1] != w.p.nrows)
      throw std::invalid_argument("matvec_shared '" + w.name + "': y must be [B, rows]");
    any_q |= w.qtype != QT_F16;
  }
  XQ xq;
  if (any_q) {
    Scratch& sc = scratch_for(B);
    sc.reserve(xq_bytes(B, n));
    sc.begin();
    xq = take_xq(B, n, sc);
    launch_quantize_x(x.f(), (int)B, (int)n, xq, stream());
  }
  for (size_t i = 0; i < ws.size(); ++i) launch_matvec(ws[i]->p, x.f(), xq, (int)B, 1, ys[i]->f(), stream(), false);
}

// ys[i] = ws[i] . x in one launch (batch 1; raw device pointers, y_i of ws[i] rows, x of ncols values or
// 2 ncols for swiglu). False, with nothing launched, when the kernel does not take these matrices.
// The segments of a launch over several matrices: their packed weights and outputs (device pointers). False when
// there are more than the streaming kernel's MV_MAX_SEG (5).
struct Segs {
  const Packed* ps[5];
  float* yp[5];
  int n = 0;
};
static bool segs_of(const std::vector<std::shared_ptr<Tensor>>& ws, const std::vector<uintptr_t>& ys, const char* what,
                    Segs& s) {
  if (ws.empty() || ws.size() != ys.size()) throw std::invalid_argument(std::string(what) + ": one y per weight");
  if (ws.size() > 5) return false;  // mv_stream.cuh MV_MAX_SEG
  for (size_t i = 0; i < ws.size(); ++i) {
    s.ps[i] = &ws[i]->p;
    s.yp[i] = ptr<float>(ys[i]);
  }
  s.n = (int)ws.size();
  return true;
}

bool matvec_multi(const std::vector<std::shared_ptr<Tensor>>& ws, uintptr_t x, const std::vector<uintptr_t>& ys,
                  bool swiglu, float clamp, uintptr_t norm_w, float eps) {
  if (swiglu && norm_w) throw std::invalid_argument("matvec_multi: swiglu or norm_w, not both");
  Segs sg;
  if (!segs_of(ws, ys, "matvec_multi", sg)) return false;
  const int x_op = norm_w ? MV_X_RMS : (swiglu ? MV_X_SWIGLU : MV_X_PLAIN);
  return launch_matvec_multi(sg.ps, sg.yp, sg.n, ptr<const float>(x), x_op, clamp, stream(), ptr<const float>(norm_w),
                             eps);
}

// y_parts [S, rows] = the S column slices' products of w . x (matvec_stream.cu); false when it does not take them.
bool matvec_sliced(const std::shared_ptr<Tensor>& w, uintptr_t x, uintptr_t y_parts, int slices) {
  return launch_matvec_sliced(w->p, ptr<const float>(x), ptr<float>(y_parts), slices, stream(), true);
}

// ys[i] [B, rows_i] = ws[i] . x[b] for the B rows of x (matvec_stream.cu); false when it does not take them.
bool matvec_rows(const std::vector<std::shared_ptr<Tensor>>& ws, uintptr_t x, int B, const std::vector<uintptr_t>& ys) {
  Segs sg;
  return segs_of(ws, ys, "matvec_rows", sg) &&
         launch_matvec_rows(sg.ps, sg.yp, sg.n, ptr<const float>(x), B, stream(), true);
}

// yb = wb . (A's output) after ya[i] = wa[i] . x, in one launch (matvec_chain.cu); false when it does not take them.
bool matvec_chain(const std::vector<std::shared_ptr<Tensor>>& wa, uintptr_t x, const std::vector<uintptr_t>& ya,
                  int groups_a, const std::shared_ptr<Tensor>& wb, uintptr_t yb, bool swiglu, float clamp) {
  if (wa.empty() || wa.size() != ya.size()) throw std::invalid_argument("matvec_chain: one y per phase-A weight");
  if (wa.size() > 4) return false;
  const Packed* ps[4];
  float* yp[4];
  for (size_t i = 0; i < wa.size(); ++i) {
    ps[i] = &wa[i]->p;
    yp[i] = ptr<float>(ya[i]);
  }
  return launch_matvec_chain(ps, yp, (int)wa.size(), groups_a, ptr<const float>(x), wb->p, ptr<float>(yb),
                             swiglu ? MV_X_SWIGLU : MV_X_PLAIN, clamp, stream());
}

// L2 prefetch of the first `fraction` of each weight (both planes; of each of `groups` equal row blocks, since a
// grouped matvec walks its groups side by side), for a later kernel (see matvec_stream.cu).
void prefetch_l2(const std::vector<std::shared_ptr<Tensor>>& ws, double fraction, int ctas, int mode, int groups) {
  const uint8_t* p[PF_MAX_RANGES];
  int64_t n[PF_MAX_RANGES];
  int k = 0;
  fraction = std::min(1.0, std::max(0.0, fraction));
  for (const auto& w : ws) {
    const Packed& q = w->p;
    if (groups < 1 || q.nrows % groups) throw std::invalid_argument("prefetch_l2: groups must divide the rows");
    const int64_t rows = q.nrows / groups;
    const int64_t row_bytes[2] = {q.qs_row, q.sc ? q.sc_row : 0};
    const uint8_t* base[2] = {q.qs, q.sc};
    for (int g = 0; g < groups; ++g)
      for (int i = 0; i < 2; ++i) {
        if (!base[i] || row_bytes[i] <= 0) continue;
        if (k == PF_MAX_RANGES) throw std::invalid_argument("prefetch_l2: too many ranges (weights x groups x planes)");
        p[k] = base[i] + g * rows * row_bytes[i];
        n[k++] = (int64_t)(rows * row_bytes[i] * fraction);
      }
  }
  if (ctas <= 0) {  // one per SM
    int dev = 0;
    DS4_CHECK(cudaGetDevice(&dev));
    DS4_CHECK(cudaDeviceGetAttribute(&ctas, cudaDevAttrMultiProcessorCount, dev));
  }
  launch_l2_prefetch(p, n, k, ctas, mode, stream());
}


struct Graph {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ~Graph() {
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
  }
  void launch(int n) {
    for (int i = 0; i < n; ++i) DS4_CHECK(cudaGraphLaunch(exec, stream()));
  }
  // Mean milliseconds per replay over `iters` replays after `warmup` ones (device events).
  double time_ms(int iters, int warmup) {
    launch(warmup);
    return time_on_stream_ms([&](int) { launch(1); }, iters, stream());
  }
};

void capture_begin() {
  if (capturing()) throw std::runtime_error("a capture is already running");
  DS4_CHECK(cudaStreamSynchronize(stream()));
  DS4_CHECK(cudaStreamBeginCapture(stream(), cudaStreamCaptureModeThreadLocal));
  g_capturing_flag = true;
}

std::shared_ptr<Graph> capture_end() {
  if (!g_capturing_flag) throw std::runtime_error("no capture is running");
  g_capturing_flag = false;
  auto g = std::make_shared<Graph>();
  DS4_CHECK(cudaStreamEndCapture(stream(), &g->graph));
  DS4_CHECK(cudaGraphInstantiate(&g->exec, g->graph, 0));
  return g;
}

// Device-to-device copy bandwidth, counting bytes read plus bytes written (the usual convention).
py::dict copy_bandwidth(size_t nbytes, int iters) {
  void* a = device_alloc(nbytes, "for the copy benchmark");
  void* b = nullptr;
  try {
    b = device_alloc(nbytes, "for the copy benchmark");
  } catch (...) {
    cudaFree(a);
    throw;
  }
  DS4_CHECK(cudaMemsetAsync(a, 0x5a, nbytes, stream()));
  for (int i = 0; i < 3; ++i) DS4_CHECK(cudaMemcpyAsync(b, a, nbytes, cudaMemcpyDeviceToDevice, stream()));
  const double per = time_on_stream_ms(
      [&](int i) {
        DS4_CHECK(cudaMemcpyAsync(i & 1 ? a : b, i & 1 ? b : a, nbytes, cudaMemcpyDeviceToDevice, stream()));
      },
      iters, stream());
  cudaFree(a);
  cudaFree(b);
  py::dict d;
  d["ms"] = per;
  d["bytes"] = 2.0 * nbytes;
  d["gbps"] = 2.0 * nbytes / (per * 1e-3) / 1e9;
  return d;
}

// Read-only stream bandwidth (read_stream.cu): bytes read per second, nothing written; the peer that says how much of the
// copy bandwidth a kernel that only reads (every matvec) can reach.
py::dict read_bandwidth(size_t nbytes, int iters) {
  nbytes = nbytes / 16 * 16;
  void* a = device_alloc(nbytes, "for the read benchmark");
  void* sink = nullptr;
  try {
    sink = device_alloc(16, "for the read benchmark");
  } catch (...) {
    cudaFree(a);
    throw;
  }
  DS4_CHECK(cudaMemsetAsync(a, 0x5a, nbytes, stream()));
  float per = 0;
  try {
    per = read_stream_ms(a, nbytes, iters, (unsigned*)sink, stream());
  } catch (...) {
    cudaFree(a);
    cudaFree(sink);
    throw;
  }
  cudaFree(a);
  cudaFree(sink);
  py::dict d;
  d["ms"] = per;
  d["bytes"] = (double)nbytes;
  d["gbps"] = nbytes / (per * 1e-3) / 1e9;
  return d;
}

py::dict device_info() {
  int n = 0;
  DS4_CHECK(cudaGetDeviceCount(&n));
  if (n == 0) throw std::runtime_error("no CUDA device");
  int dev = 0;
  DS4_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp p;
  DS4_CHECK(cudaGetDeviceProperties(&p, dev));
  size_t free_b = 0, total_b = 0;
  DS4_CHECK(cudaMemGetInfo(&free_b, &total_b));
  py::dict d;
  d["name"] = std::string(p.name);
  d["cc"] = std::to_string(p.major) + "." + std::to_string(p.minor);
  d["sms"] = p.multiProcessorCount;
  d["l2_bytes"] = p.l2CacheSize;
  d["mem_free"] = free_b;
  d["mem_total"] = total_b;
  d["devices"] = n;
  return d;
}

}  // namespace

PYBIND11_MODULE(_ext, m) {
  m.doc() = "ds4 CUDA kernels: resident quantized weights, fused dequant matvec and routed MoE";
  py::class_<Tensor, std::shared_ptr<Tensor>>(m, "Tensor")
      .def_readonly("name", &Tensor::name)
      .def_readonly("qtype", &Tensor::qtype)
      .def_readonly("ne", &Tensor::ne)
      .def_readonly("nbytes", &Tensor::nbytes, "device bytes held")
      .def_property_readonly("gguf_nbytes", &Tensor::gguf_nbytes, "bytes of the GGUF data (= bytes a matvec reads)")
      .def_property_readonly("ncols", [](const Tensor& t) { return t.p.ncols; })
      .def_property_readonly("nrows", [](const Tensor& t) { return t.p.nrows; })
      .def("__repr__", [](const Tensor& t) {
        return "<gpu.Tensor '" + t.name + "' " + qtype_name(t.qtype) + " " + mib(t.nbytes) + ">";
      });
  py::class_<Array, std::shared_ptr<Array>>(m, "Array")
      .def_static("from_numpy", &array_from_numpy, py::arg("a"))
      .def_static("view", &array_view, py::arg("ptr"), py::arg("shape"), py::arg("int32") = false,
                  "A non-owning view of device memory (e.g. a torch tensor's data_ptr()).")
      .def_static("empty", [](std::vector<int64_t> shape, bool is_int) { return make_array(shape, is_int); },
                  py::arg("shape"), py::arg("int32") = false)
      .def_readonly("shape", &Array::shape)
      .def_property_readonly("ptr", [](const Array& a) { return (uintptr_t)a.ptr; }, "the device address")
      .def("numpy", &array_to_numpy)
      .def("copy_from", &array_copy_from, py::arg("a"))
      .def("fill", &array_fill, py::arg("value"));
  py::class_<Graph, std::shared_ptr<Graph>>(m, "Graph")
      .def("launch", &Graph::launch, py::arg("n") = 1)
      .def("time_ms", &Graph::time_ms, py::arg("iters") = 20, py::arg("warmup") = 3);
  m.def("upload", &upload, py::arg("name"), py::arg("qtype"), py::arg("ne"), py::arg("raw"),
        "Upload GGUF blocks (C-contiguous bytes) of a tensor with GGUF shape ne; returns a resident Tensor.");
  m.def("matvec", &matvec, py::arg("w"), py::arg("x"), py::arg("y"), py::arg("groups") = 1, py::arg("norm_w") = 0,
        py::arg("eps") = 0.0f,
        "y[b, r] = W[r] . x[b, r // (rows / groups)]; x is [B, groups * ncols], B <= 8. norm_w (device address, "
        "batch 1): y = W . (rms_norm(x, eps) * norm_w); True when the norm was folded into the matvec launch, False "
        "when it ran as its own launch (or there is none): the same bits.");
  m.def("xq_bytes", &xq_bytes, py::arg("nvec"), py::arg("n"), "Bytes of the quantized planes of nvec vectors of n.");
  m.def("quantize_x_into", [](uintptr_t x, int64_t T, int64_t n, uintptr_t buf) {
    if (n % 32) throw std::invalid_argument("quantize_x_into: n must be a multiple of 32");
    launch_quantize_x(ptr<const float>(x), (int)T, (int)n, xq_at(reinterpret_cast<uint8_t*>(buf), T, n), stream());
  }, py::arg("x"), py::arg("T"), py::arg("n"), py::arg("buf"),
        "The activation planes of quantize_x (hi, lo, scales, sums) of x [T, n] into buf (xq_bytes(T, n) bytes).");
  m.def("moe", &moe, py::arg("gate"), py::arg("up"), py::arg("down"), py::arg("x"), py::arg("ids"),
        py::arg("weights"), py::arg("y"), py::arg("clamp") = 10.0f, py::arg("xq_in") = 0,
        "Routed experts: y[t] = sum_j down[ids[t,j]] (silu(min(g,c)) clamp(u,-c,c) weights[t,j]).");
  m.def("moe_shexp_takes", [](const Tensor& gate, const Tensor& down, const Tensor& sgate, const Tensor& sup,
                              const Tensor& sdown) {
    return gate.ne.size() == 3 && moe_shexp_takes(gate.p, down.p, sgate.p, sup.p, sdown.p, (int)gate.ne[2], 1);
  }, "Whether moe_shexp runs these experts and this shared expert (one token).");
  m.def("moe_shexp", &moe_shexp, py::arg("gate"), py::arg("up"), py::arg("down"), py::arg("sgate"), py::arg("sup"),
        py::arg("sdown"), py::arg("x"), py::arg("ids"), py::arg("weights"), py::arg("y"), py::arg("y_shexp"),
        py::arg("clamp"), py::arg("xq") = 0,
        "Decode's routed experts and the shared expert (Q8_0) in two launches (DS4_GPU_MOE_SHEXP): y the routed sum, "
        "y_shexp the shared expert's; False where the shapes or types are not ones it runs.");
  m.def("moe_gateup", &moe_gateup, py::arg("gate"), py::arg("up"), py::arg("x"), py::arg("ids"), py::arg("weights"),
        py::arg("h"), py::arg("clamp") = 10.0f,
        "The gate/up half of moe: h[t k + j] = silu(min(g, c)) clamp(u, -c, c) weights[t, j]; h is [T k, n_ff].");
  m.def("set_gateup_mma", [](std::optional<bool> enabled, int splits) {
    set_gateup_mma(enabled ? (*enabled ? 1 : 0) : -1, splits);
  }, py::arg("enabled"), py::arg("splits") = 0,
        "IQ2_XXS MoE gate/up through the int8 mma kernel (True), the rows kernel (False) or as $DS4_GPU_GU_MMA "
        "says (None); splits: warps per 16-row unit (1, 2, 4, 8; 0 = automatic / $DS4_GPU_GU_MMA_SPLIT).");
  m.def("gateup_mma_enabled", &gateup_mma_enabled);
  m.def("set_gateup_lut", &set_gateup_lut, py::arg("mode"),
        "IQ2_XXS gate/up rows kernel with the sign-mask tables (1: 3 CTAs per SM, 2: 2, 3 (default): 2 read by byte offsets), "
        "without (0) or as "
        "$DS4_GPU_GU_LUT says (-1).");
  m.def("set_moe_x8", &set_moe_x8, py::arg("mode"),
        "Routed experts' activations at 8 bits, hi plane only, as ds4 (1), at ~16 bits, hi + lo (0), or as "
        "$DS4_GPU_MOE_X8 says (-1).");
  m.def("moe_x8", &moe_x8, "Whether the routed experts read 8-bit activations now.");
  m.def("set_gu_off32", &set_gu_off32, py::arg("mode"),
        "Decode's IQ2_XXS gate/up rows kernel: rows addressed by 32-bit offsets (1), by 64-bit pointers (0), or as "
        "$DS4_GPU_GU_OFF32 says (-1).");
  m.def("gu_off32_launches", &gu_off32_launches, "Gate/up launches of this process that took the 32-bit-offset form.");
  m.def("set_gu_unroll", &set_gu_unroll, py::arg("mode"),
        "Decode's IQ2_XXS gate/up on rows of 4096 columns: the 32-bit-offset form unrolled (1), rolled (0), or as "
        "$DS4_GPU_GU_UNROLL says (-1).");
  m.def("gu_unroll_launches", &gu_unroll_launches, "Gate/up launches of this process that took the unrolled form.");
  m.def("set_pair_split", &set_pair_split, py::arg("mode"),
        "matvec_multi's Q8_0 + F16 launches: 1 warps split between the types, 0 one phase after the other, -1 back to "
        "$DS4_GPU_PAIR_SPLIT");
  m.def("set_mv_cap", &set_mv_cap, py::arg("ctas_per_sm"),
        "Caps the streaming matvec's persistent grid at this many CTAs per SM for the launches that follow "
        "(0: back to $DS4_GPU_MV_PER_SM); read when a launch is made or captured.");
  m.def("set_mv_tma", &set_mv_tma, py::arg("mode"),
        "Batch-1 Q8_0 matvecs on the bulk-copy kernel (1: all, 2: launches of at most $DS4_GPU_MV_TMA_MAX_MB, 3: all "
        "but q_b-like and grouped ones), the "
        "register-streaming one (0) or as $DS4_GPU_MV_TMA says (-1, default 2); read when a launch is made or captured.");
  m.def("matvec_sliced", &matvec_sliced, py::arg("w"), py::arg("x"), py::arg("y_parts"), py::arg("slices"),
        "y_parts[s, r] = w[r, s K/S:(s+1) K/S] . x[s K/S:(s+1) K/S] (Q8_0, batch 1, device pointers, S = 2..4, K/S a "
        "multiple of 512); the parts sum to w . x. False when the kernel does not take the shape.");
  m.def("matvec_rows", &matvec_rows, py::arg("ws"), py::arg("x"), py::arg("B"), py::arg("ys"),
        "ys[i][b, r] = ws[i][r] . x[b] for the B rows of x [B, ncols] (device pointers; up to 5 matrices of one type and "
        "width, F16 or Q8_0): the batch-1 streaming kernel's bits, each weight tile read by the B vectors at once. False "
        "(nothing launched) when the streaming kernel does not take them.");
  m.def("set_mv_chain_form", &set_mv_chain_form, py::arg("form"),
        "matvec_chain's kernel: 2 the bulk-copy chain (matvec_tma.cu) where it takes the shapes, else 1 the register "
        "form; -1: as $DS4_GPU_MV_CHAIN says (2, else 1).");
  m.def("mv_tma_launches", &mv_tma_launches, "Launches of the bulk-copy matvec kernel so far in this process.");
  m.def("dequant", [](const Tensor& w, uintptr_t out, uintptr_t lo, float scale, int64_t row0, int64_t nrows,
                       int64_t ld, uintptr_t block_map, int64_t block_rows, uintptr_t b8, uintptr_t kp) {
    launch_dequant(w.p, row0, nrows < 0 ? w.p.nrows - row0 : nrows, (__half*)out, (__half*)lo,
                   ld < 0 ? w.p.ncols : ld, scale, stream(), (const int32_t*)block_map, block_rows, (uint8_t*)b8,
                   (const float*)kp);
  }, py::arg("w"), py::arg("out"), py::arg("lo") = 0, py::arg("scale") = 1.0f, py::arg("row0") = 0,
        py::arg("nrows") = -1, py::arg("ld") = -1, py::arg("block_map") = 0, py::arg("block_rows") = 0,
        py::arg("b8") = 0, py::arg("kp") = 0,
        "rows of a resident weight times scale as float16 at device address `out` (row stride ld elements); "
        "lo != 0: also the remainder there, so out + lo holds the value to ~22 bits; block_map != 0 (int32 on the "
        "device, nrows / block_rows entries): output block b holds the weight's block block_map[b]; b8 != 0 (with kp, "
        "the device address of a float32 scale k): also fp8_split's float8 operand of the corrections, rows [lo 2^11 k "
        "| hi k] of 2 ncols e4m3 bytes (pack_fp8's bytes)");
  m.def("split_half", [](uintptr_t x, int64_t rows, int64_t n, uintptr_t hi, uintptr_t lo, uintptr_t s) {
    launch_split_half((const float*)x, rows, n, (__half*)hi, (__half*)lo, (float*)s, stream());
  }, py::arg("x"), py::arg("rows"), py::arg("n"), py::arg("hi"), py::arg("lo"), py::arg("s"),
        "rows of float32 x as f16 hi (+ lo when lo != 0) parts of x / s, s = the row's largest magnitude");
  m.def("split_groups", [](uintptr_t y, uintptr_t r, int G, int64_t T, int n, uintptr_t hi, uintptr_t lo, uintptr_t a8,
                           uintptr_t s) {
    launch_split_groups((const float*)y, (const float*)r, G, T, n, (__half*)hi, (__half*)lo, (uint8_t*)a8, (float*)s,
                        stream());
  }, py::arg("y"), py::arg("r"), py::arg("G"), py::arg("T"), py::arg("n"), py::arg("hi"), py::arg("lo"), py::arg("a8"),
        py::arg("s"),
        "a grouped product's y [G, T, n] float32 times r [T, G] as rows [T, G n], split as split_half splits rows: "
        "hi (+ lo, or a8 [T, 2 G n] float8 e4m3 = [hi 2^8 | lo 2^19] instead), s [T]; device addresses, G n <= 8192");
  m.def("pack_fp8", [](uintptr_t a, uintptr_t b, int64_t batch, int64_t rows, int64_t n, int64_t ld, int64_t sbt,
                       float sa, float sb, uintptr_t kp, uintptr_t out) {
    launch_pack_fp8((const __half*)a, (const __half*)b, batch, rows, n, ld, sbt, sa, sb, (const float*)kp,
                    (uint8_t*)out, stream());
  }, py::arg("a"), py::arg("b"), py::arg("batch"), py::arg("rows"), py::arg("n"), py::arg("ld"), py::arg("sbt"),
        py::arg("sa"), py::arg("sb"), py::arg("kp"), py::arg("out"),
        "out [batch, rows, 2n] float8 e4m3 = [a * sa * k | b * sb * k] from float16 planes a, b (element (bt, r, c) "
        "at bt * sbt + r * ld + c), k = the float32 at kp or 1 (kp = 0); device addresses; rounded to nearest even, "
        "saturating (fp8_split's operands)");
  m.def("matvec_multi", &matvec_multi, py::arg("ws"), py::arg("x"), py::arg("ys"), py::arg("swiglu") = false,
        py::arg("clamp") = 0.0f, py::arg("norm_w") = 0, py::arg("eps") = 0.0f,
        "ys[i] = ws[i] . x (batch 1, device pointers) in one launch; swiglu: x = [g | u] -> swiglu(g, u); norm_w: "
        "x -> rms_norm(x, eps) * norm_w (the bits of the rms_norm op). "
        "Returns False (nothing launched) when the matrices do not fit the streaming kernel.");
  m.def("matvec_chain", &matvec_chain, py::arg("wa"), py::arg("x"), py::arg("ya"), py::arg("groups_a"), py::arg("wb"),
        py::arg("yb"), py::arg("swiglu") = false, py::arg("clamp") = 0.0f,
        "yb = wb . (ya = wa . x) in one launch (batch 1, Q8_0); False, nothing launched, where it does not apply");
  m.def("prefetch_l2", &prefetch_l2, py::arg("ws"), py::arg("fraction") = 1.0, py::arg("ctas") = 0,
        py::arg("mode") = 0, py::arg("groups") = 1, "ask L2 to fetch the first fraction of these weights (for a later kernel)");
  m.def("matvec_shared", &matvec_shared, py::arg("ws"), py::arg("x"), py::arg("ys"),
        "ys[i] = ws[i] . x for matrices of the same width; x is quantized once.");
  // Fused layer ops on raw device pointers (torch data_ptr()); see fused.cu and hc.cu for the semantics.
  bind_fused_ops(m);
  m.def("reserve_scratch", [](size_t n) { g_scratch.reserve(n); }, py::arg("nbytes"));
  m.def("reserve_prefill_scratch", [](size_t n) { g_prefill_scratch.reserve(n); }, py::arg("nbytes"),
        "grow the prefill ops' scratch buffer to at least nbytes now (each later growth synchronizes the device)");
  m.def("prefill_scratch_bytes", []() { return g_prefill_scratch.cap; });
  m.def("prefill_scratch_generation", []() { return g_prefill_scratch.generation; },
        "how many times the prefill ops' scratch buffer has grown (each growth synchronizes the device)");
  m.def("l2_evict_first", []() { return ds4gpu::kStreamEvictFirst; },
        "whether this build streams decode's weights with L2's evict_first policy ($DS4_GPU_L2_EVICT_FIRST at build time)");
  m.def("scratch_generation", []() { return g_scratch.generation; },
        "how many times the one-token ops' scratch buffer has moved (a decode graph captured before it moved is stale)");
  m.def("capture_begin", &capture_begin);
  m.def("capture_end", &capture_end);
  m.def("synchronize", []() { DS4_CHECK(cudaStreamSynchronize(stream())); });
  m.def("set_stream", [](uintptr_t s) {
          g_stream = (cudaStream_t)s;
          g_stream_external = true;
        }, py::arg("stream"),
        "Launch every later op on this CUDA stream handle (e.g. torch.cuda.current_stream().cuda_stream).");
  m.def("reset_stream", []() {
          g_stream = nullptr;
          g_stream_external = false;
        }, "Forget set_stream: later ops run on the extension's own non-blocking stream (created on first use).");
  m.def("read_bandwidth", &read_bandwidth, py::arg("nbytes") = size_t(1) << 31, py::arg("iters") = 20,
        "Read-only stream bandwidth: {ms, bytes, gbps} with bytes read only (the peer for kernels that only read).");
  m.def("copy_bandwidth", &copy_bandwidth, py::arg("nbytes") = size_t(1) << 31, py::arg("iters") = 20);
  m.def("device_info", &device_info);
  m.def("device_count", []() {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
      cudaGetLastError();
      throw std::runtime_error(std::string("no usable CUDA device: ") + cudaGetErrorString(e));
    }
    return n;
  });
  m.def("packed_row_bytes", [](int qtype, int64_t ncols) {
    int64_t a, b;
    packed_row_bytes(qtype, ncols, &a, &b);
    return py::make_tuple(a, b);
  });
  bind_prefill_products(m);
}
