// Shared by the extension's binding files: bindings.cpp (the module: resident weights, arrays, graphs, the matvec and
// MoE ops), bindings_fused.cpp (the layer's other ops on raw device pointers: norms, mHC, RoPE, attention, router,
// compressor, indexer, top-k) and bindings_prefill.cpp (the prefill product kernels mmq / mmf and the barrier
// benchmark): the module-wide stream, the scratch area, Tensor and Array.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>
#include <string>
#include <vector>

#include "common.cuh"

namespace ds4ext {

using namespace ds4gpu;

cudaStream_t stream();  // every op's stream (set_stream, or one of the module's own)
bool capturing();       // during our own graph capture or one begun by someone else on our stream
void* device_alloc(size_t n, const std::string& what);  // cudaMalloc, or MemoryError naming what needs it
int64_t gguf_row_bytes(int qt, int64_t ncols);

inline size_t align256(size_t n) { return (n + 255) & ~size_t(255); }
// A grow-only scratch area for quantized activations and MoE intermediates. Ops run in stream
// order, so consecutive ops can reuse the same bytes.
struct Scratch {
  uint8_t* base = nullptr;
  size_t cap = 0;
  size_t used = 0;
  // Bumped whenever base moves: a CUDA graph captured before holds pointers into the freed buffer, so its owner
  // compares generations before a replay and captures again (Session._graph_fresh).
  uint64_t generation = 0;
  void reserve(size_t n) {
    if (n <= cap) return;
    if (capturing())
      throw std::runtime_error("scratch too small during graph capture: call reserve_scratch(" + std::to_string(n) +
                               ") or run the op once before capturing");
    if (base) {
      DS4_CHECK(cudaStreamSynchronize(stream()));
      DS4_CHECK(cudaFree(base));
      base = nullptr;
    }
    cap = 0;
    base = (uint8_t*)device_alloc(n, "for scratch");
    cap = n;
    ++generation;
  }
  // Sub-allocations of one op; call begin() first.
  void begin() { used = 0; }
  uint8_t* take(size_t n) {
    uint8_t* p = base + used;
    used += align256(n);
    return p;
  }
};
// Two scratch buffers, so that a prefill's growth never moves the one a decode graph points into: ops of one token
// (the decode step) take g_scratch, ops of more rows (prefill products) g_prefill_scratch.
extern Scratch g_scratch;
extern Scratch g_prefill_scratch;
inline Scratch& scratch_for(int64_t tokens) { return tokens == 1 ? g_scratch : g_prefill_scratch; }

size_t xq_bytes(int64_t nvec, int64_t n);  // scratch bytes of take_xq
XQ take_xq(int64_t nvec, int64_t n, Scratch& from = g_scratch);  // quantized-activation planes: nvec vectors of n columns
XQ xq_at(uint8_t* base, int64_t nvec, int64_t n);  // the same planes laid out from base (xq_bytes(nvec, n) bytes)

struct Tensor {
  std::string name;
  int qtype = 0;
  std::vector<int64_t> ne;
  Packed p;
  void* mem = nullptr;
  size_t nbytes = 0;
  ~Tensor() {
    if (mem) cudaFree(mem);
  }
  int64_t gguf_nbytes() const { return gguf_row_bytes(qtype, p.ncols) * p.nrows; }
};

struct Array {
  std::vector<int64_t> shape;
  bool is_int = false;
  bool owns = true;  // false for views of memory owned elsewhere (torch tensors)
  void* ptr = nullptr;
  size_t nbytes = 0;
  ~Array() {
    if (ptr && owns) cudaFree(ptr);
  }
  int64_t size() const {
    int64_t n = 1;
    for (auto s : shape) n *= s;
    return n;
  }
  float* f() const {
    if (is_int) throw std::invalid_argument("expected a float32 array, got int32");
    return (float*)ptr;
  }
  int32_t* i() const {
    if (!is_int) throw std::invalid_argument("expected an int32 array, got float32");
    return (int32_t*)ptr;
  }
};

// A raw device address from Python (a torch tensor's data_ptr()) as a typed pointer.
template <typename T>
T* ptr(uintptr_t p) { return reinterpret_cast<T*>(p); }

void bind_prefill_products(pybind11::module_& m);  // bindings_prefill.cpp
void bind_fused_ops(pybind11::module_& m);         // bindings_fused.cpp

}  // namespace ds4ext
