// Shared declarations of the ds4 CUDA extension: quant types, the device layout of an uploaded
// weight, quantized activations, and the host-side launchers each .cu file provides.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <stdexcept>
#include <string>

namespace ds4gpu {

// ggml type codes (gguf_tools/constants.py QuantType).
enum QType : int { QT_F32 = 0, QT_F16 = 1, QT_Q8_0 = 8, QT_Q2_K = 10, QT_Q4_K = 12, QT_IQ2_XXS = 16 };

constexpr int XB = 32;        // columns per activation-quant block ("x block"); every quant type's sub-unit
constexpr int MAX_BATCH = 8;  // vectors per matvec launch

inline void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}
#define DS4_CHECK(call) ::ds4gpu::check((call), #call)
#define DS4_CHECK_LAUNCH(what) ::ds4gpu::check(cudaGetLastError(), what)

// Device layout of a weight (see repack.cu). The GGUF blocks are split into two planes of the same
// total size: `qs` holds the codes of each row so that the 32 columns of one x block are contiguous
// and dp4a-ready, `sc` holds the per-block scales. Row r of the (experts-stacked) matrix starts at
// qs + r * qs_row and sc + r * sc_row. Layout per type, nb = ncols / 256, nxb = ncols / 32:
//   F16    qs: the f16 row                         sc: -
//   Q8_0   qs: int8 q[ncols]                       sc: f16 d[nxb]
//   Q4_K   qs: 16 B per xb, byte i = e_i | e_{i+16} << 4     sc: (f16 d, f16 dmin)[nb], (u8 sc, u8 m)[nxb]
//   Q2_K   qs: 8 B per xb, u32 word w, byte b, bits 2k hold element 16w + 4k + b
//                                                  sc: (f16 d, f16 dmin)[nb], u8 (sc | m << 4)[16 nb]
//   IQ2_XXS qs: the GGUF (a0, a1) u32 pair per xb    sc: f16 d[nb]
struct Packed {
  int qtype = QT_F16;
  int64_t ncols = 0;
  int64_t nrows = 0;  // all rows, experts stacked (ne1 * ne2)
  const uint8_t* qs = nullptr;
  int64_t qs_row = 0;
  const uint8_t* sc = nullptr;
  int64_t sc_row = 0;
};

// Bytes per row of each plane for a type; throws for unsupported types / column counts.
void packed_row_bytes(int qtype, int64_t ncols, int64_t* qs_row, int64_t* sc_row);

// Activations quantized per 32 columns to two int8 planes: x ~= scale * (254 * hi + lo), with
// scale = amax / (127 * 254). Vector v of n columns: hi + v n, lo + v n, scale + v n/32, sum16 + v n/16
// (sum16 = exact f32 sums of 16 columns, for the K-quant minimum terms).
struct XQ {
  int8_t* hi = nullptr;
  int8_t* lo = nullptr;
  float* scale = nullptr;
  float* sum16 = nullptr;
  int n = 0;
};

// ---- launchers (all asynchronous on `stream`) ----
// repack.cu
void launch_repack(int qtype, const uint8_t* raw, int64_t rows, int64_t ncols, uint8_t* qs, int64_t qs_row,
                   uint8_t* sc, int64_t sc_row, cudaStream_t stream);
void launch_quantize_x(const float* x, int nvec, int n, XQ out, cudaStream_t stream);
// matvec.cu: y[b, r] = W[r] . x[b, g(r)], x is [B, groups, ncols], row r in group r / (nrows / groups)
void launch_matvec(const Packed& w, const float* x, const XQ& xq, int batch, int groups, float* y,
                   cudaStream_t stream);
// moe.cu: routed experts for `tokens` tokens with k experts each (ids/weights [tokens, k] on device).
struct MoeScratch {
  XQ xq_in;      // tokens vectors of n_embd
  float* h;      // tokens*k vectors of n_ff
  XQ xq_h;       // tokens*k vectors of n_ff
};
void launch_moe(const Packed& gate, const Packed& up, const Packed& down, int n_expert, const float* x,
                const int32_t* ids, const float* weights, int tokens, int k, float clamp, float* y,
                const MoeScratch& scratch, cudaStream_t stream);
}  // namespace ds4gpu
