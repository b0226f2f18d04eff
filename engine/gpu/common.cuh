// Shared declarations of the ds4 CUDA extension: quant types, the device layout of an uploaded
// weight, quantized activations, and the host-side launchers each .cu file provides.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <cstdlib>
#include <stdexcept>
#include <string>

namespace ds4gpu {

// ggml type codes (gguf_tools/constants.py QuantType).
enum QType : int { QT_F32 = 0, QT_F16 = 1, QT_Q8_0 = 8, QT_Q2_K = 10, QT_Q4_K = 12, QT_IQ2_XXS = 16 };

constexpr int XB = 32;        // columns per activation-quant block ("x block"); every quant type's sub-unit
constexpr int MAX_BATCH = 8;  // vectors per matvec launch

// L2 priority of decode's weight streams (NOTES v42). A token reads ~9.5 GB of weights through a ~50 MB L2 that also
// holds the activations, the KV rows and the kernels' code. At the default priority about four layers of weights pass
// through it between two runs of the same kernel, so each layer fetches its kernels' code and the previous kernels'
// outputs from DRAM again. With DS4_L2_EVICT_FIRST the weight loads and bulk copies of the decode kernels carry an
// evict_first policy: their lines are the first to go, nothing else's. The policy is a compile-time constant folded
// into the loads' memory descriptor (no instruction per load; the values loaded are the same). The prefill GEMMs (mmq,
// mmf, mmw) re-read a weight tile for each activation tile and keep the default, as do dequant and the read-stream peer.
// Measured (NOTES v42, H100, Flash's first 20 layers, ds4-bench in turn): gen 315.8 / 314.9 -> 325.8 / 324.8 t/s at 2k,
// 311.9 / 310.7 -> 321.6 / 320.6 at 8k (+3.1%), prefill unchanged. A build define: build.py passes
// $DS4_GPU_L2_EVICT_FIRST (default 1; 0 builds the v41 kernels).
#ifndef DS4_L2_EVICT_FIRST
#define DS4_L2_EVICT_FIRST 1
#endif
constexpr bool kStreamEvictFirst = DS4_L2_EVICT_FIRST != 0;

__device__ __forceinline__ uint64_t l2_evict_first_policy() {
  uint64_t p;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));  // not volatile: hoisted and shared
  return p;
}

inline void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

// Mean milliseconds per call of launch() over `iters` calls on `stream`, timed by device events (host code: the
// benchmarks' copy, read and graph timings).
template <class Launch>
inline double time_on_stream_ms(Launch launch, int iters, cudaStream_t stream) {
  cudaEvent_t a, b;
  check(cudaEventCreate(&a), "cudaEventCreate");
  check(cudaEventCreate(&b), "cudaEventCreate");
  check(cudaEventRecord(a, stream), "cudaEventRecord");
  for (int i = 0; i < iters; ++i) launch(i);
  check(cudaEventRecord(b, stream), "cudaEventRecord");
  check(cudaEventSynchronize(b), "cudaEventSynchronize");
  float ms = 0;
  check(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms / iters;
}
#define DS4_CHECK(call) ::ds4gpu::check((call), #call)
#define DS4_CHECK_LAUNCH(what) ::ds4gpu::check(cudaGetLastError(), what)

// The device's multiprocessors (read once: one device per process).
inline int sm_count() {
  static const int v = [] {
    int dev = 0, n = 0;
    DS4_CHECK(cudaGetDevice(&dev));
    DS4_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    return n;
  }();
  return v;
}

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
  int64_t rows = 0;  // rows in the planes (xq_at / take_xq; 0: not known)
  bool row_scale = false;  // one scale per row, for mmq's XROW kernels (they apply it once, after the sums; the
                           // 16-column sums are then in units of that scale: quantize_x's sums_per_scale)
};

// ---- programmatic dependent launch (sm_90) ----
// Kernels launched by launch_k start with pdl_begin(): griddepcontrol.launch_dependents lets the next kernel
// of the stream be scheduled at once (its CTAs are resident and waiting when this grid ends, instead of being
// launched then), and griddepcontrol.wait holds this kernel until the previous grid has completed and its
// memory is visible. So the ~1-2 us launch gap between dependent kernels overlaps the previous kernel, and
// nothing is read or written before the data it depends on is complete. Without the launch attribute
// ($DS4_GPU_PDL=0) both instructions do nothing and the stream orders kernels as usual.
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_begin() {
  pdl_trigger();
  pdl_wait();
}
bool pdl_enabled();  // $DS4_GPU_PDL, default on

// A host-side A/B switch: the digit 0..hi of environment variable `var` (anything else: dflt), read at the first get();
// set(mode) overrides it for this process (a mode outside 0..hi: back to the environment). Launchers read it when a
// launch is made or captured; the session's launches come from one host thread.
struct EnvSwitch {
  const char* var;
  int hi, dflt;
  int forced = -1, env = -1;
  int get() {
    if (env < 0) {
      const char* e = std::getenv(var);
      env = e && e[0] >= '0' && e[0] <= '0' + hi && e[1] == 0 ? e[0] - '0' : dflt;
    }
    return forced >= 0 ? forced : env;
  }
  void set(int mode) { forced = mode >= 0 && mode <= hi ? mode : -1; }
};
// $DS4_GPU_PREWAIT (fused.cu): the latency-bound row kernels (norm_rope, compress_step, the attention combine) stage
// what depends only on weights and the position before griddepcontrol.wait (2: also the mHC pre, router, attention
// partials, top-k and index keys); set_prewait overrides it (0-2; -1 env).
int prewait_mode();
void set_prewait(int mode);

// launch_pdl: the same with programmatic dependent launch only where `pdl` (and $DS4_GPU_PDL) allow it.
template <typename... KArgs, typename... Args>
inline void launch_pdl(bool pdl, void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                       Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl && pdl_enabled() ? 1 : 0;
  DS4_CHECK(cudaLaunchKernelEx(&cfg, kernel, static_cast<KArgs>(args)...));
}
template <typename... KArgs, typename... Args>
inline void launch_k(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                     Args... args) {
  launch_pdl(true, kernel, grid, block, smem, stream, args...);
}

// Whether this device can run `kernel` (compiled with __cluster_dims__(ctas)) as clusters of `ctas` CTAs of `threads`
// threads: allows a non-portable size (above 8) first, then asks for the clusters that fit at once. Errors of either
// call mean no (cleared, so they do not surface at the next launch check). Host code; call once and keep the answer.
template <typename... KArgs>
inline bool cluster_fits(void (*kernel)(KArgs...), int ctas, int threads) {
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)ctas);
  cfg.blockDim = dim3((unsigned)threads);
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return clusters > 0;
}

// ---- launchers (all asynchronous on `stream`) ----
// repack.cu
void launch_repack(int qtype, const uint8_t* raw, int64_t rows, int64_t ncols, uint8_t* qs, int64_t qs_row,
                   uint8_t* sc, int64_t sc_row, cudaStream_t stream);
// rows != null: quantized row r is x row rows[r] (x then has at least max(rows) + 1 rows of n values).
// group 32 (decode's quantization), 256 (mmq's S256 form: one scale per 256 columns, still stored per 32-column
// block, so every reader of the planes takes either; n a multiple of group) or 0 (mmq's XROW form: one scale per row,
// stored per 32-column block too; quantize_x_row_takes(n)).
// SwiGLU source of quantize_x (prefill's routed down input, never stored as floats): x is the gate product g, and
// the quantized row r is swiglu(g[r], up[r]) * row_w[row_of[r]] with fused.cu swiglu_kernel's operations.
struct XSwiglu {
  const float* up = nullptr;  // null: x as it is
  float limit = 0.0f;
  const float* row_w = nullptr;
  const int64_t* row_of = nullptr;
};
// sums_per_scale (group 0 only): the 16-column sums divided by the row's scale (mmq's XROW min terms).
bool quantize_x_row_takes(int64_t n);  // group 0's lengths: multiples of 256 up to 2048, of 512 up to 4096
void launch_quantize_x(const float* x, int nvec, int n, XQ out, cudaStream_t stream, const int64_t* rows = nullptr,
                       int group = 32, XSwiglu sw = XSwiglu(), bool sums_per_scale = false);
// dequant.cu: rows row0..row0+nrows of a weight, times scale, as f16 into out (row stride ld elements);
// lo != null: also the remainder (value - out) as f16, so out + lo carries ~22 significant bits. b8 != null: also the
// float8 operand of fp8_split's corrections, rows [lo 2^11 k | hi k] of 2 ncols bytes, k = *kp (device scalar).
void launch_dequant(const Packed& w, int64_t row0, int64_t nrows, __half* out, __half* lo, int64_t ld, float scale,
                    cudaStream_t stream, const int32_t* block_map = nullptr, int64_t block_rows = 0,
                    uint8_t* b8 = nullptr, const float* kp = nullptr);
// x [rows, n] f32 -> s[row] = max |x| (>= 1e-30), hi = f16(x / s), lo (if not null) = f16(x / s - hi).
void launch_split_half(const float* x, int64_t rows, int64_t n, __half* hi, __half* lo, float* s, cudaStream_t stream);
// y [G, T, n] times r [T, G] per (row, group) as rows [T, G n], split like launch_split_half (lo, or a8 [T, 2 G n] e4m3 =
// [hi 2^8 | lo 2^19] instead), s [T] the rows' scales; G n <= 8192.
void launch_split_groups(const float* y, const float* r, int G, int64_t T, int n, __half* hi, __half* lo, uint8_t* a8,
                         float* s, cudaStream_t stream);
// [batch, rows, 2n] e4m3 = [a * sa * k | b * sb * k] of two f16 planes (element (bt, r, c) at bt * sbt + r * ld + c),
// k = *kp (device) or 1 (kp null).
void launch_pack_fp8(const __half* a, const __half* b, int64_t batch, int64_t rows, int64_t n, int64_t ld, int64_t sbt,
                     float sa, float sb, const float* kp, uint8_t* out, cudaStream_t stream);
// matvec.cu: y[b, r] = W[r] . x[b, g(r)], x is [B, groups, ncols], row r in group r / (nrows / groups).
// quantize = false: xq already holds x quantized (shared by several matrices reading the same x).
void launch_matvec(const Packed& w, const float* x, const XQ& xq, int batch, int groups, float* y,
                   cudaStream_t stream, bool quantize = true);
// matvec.cu / matvec_stream.cu: y_i = W_i . x for up to 4 matrices of one width and type (Q8_0 or F16), batch 1,
// one launch; x_op MV_X_SWIGLU: x = swiglu(g, u) of x = [g | u] (2 ncols values, clamp c); MV_X_RMS:
// x = rms_norm(x) * norm_w with eps (the bits of launch_rms_norm's output; ncols a multiple of 4, at most 8192).
// False (nothing launched) when the shapes or types do not fit that kernel or DS4_GPU_MV < 4.
enum MvXOp { MV_X_PLAIN = 0, MV_X_SWIGLU = 1, MV_X_RMS = 2 };
bool launch_matvec_multi(const Packed* const* ws, float* const* ys, int nw, const float* x, int x_op, float clamp,
                         cudaStream_t stream, const float* norm_w = nullptr, float eps = 0.0f);
// matvec_stream.cu: ask L2 to fetch byte ranges of weights that a later kernel streams (decode: during the
// latency-bound kernels before it). mode 0: bulk prefetch (TMA), 1: one prefetch.global.L2 per 128-byte line.
constexpr int PF_MAX_RANGES = 16;
void set_mv_cap(int ctas_per_sm);  // 0: back to $DS4_GPU_MV_PER_SM (matvec_stream.cu)
void set_pair_split(int mode);  // matvec_pair_kernel warps split by type: 0, 1, or -1 ($DS4_GPU_PAIR_SPLIT)
void set_mv_tma(int mode);  // matvec_tma.cu: 1 all / 2 small / 3 all but q_b, o_a / 0 no Q8_0 launches on it; -1: env
int64_t mv_tma_launches();  // matvec_tma.cu: launches of that kernel so far in this process
void launch_l2_prefetch(const uint8_t* const* ptrs, const int64_t* nbytes, int n, int ctas, int mode,
                        cudaStream_t stream);
// matvec_chain.cu: phase A (ya[i] = wa[i] . x, batch 1; groups_a: one grouped matrix) then, in the same launch
// after a grid barrier, yb = wb . x_B with x_B A's output (x_op_b MV_X_SWIGLU: swiglu of [ya[0] | ya[1]], which
// must follow each other). Q8_0 only; false (nothing launched) for shapes it does not take.
void set_mv_chain_form(int form);  // matvec_chain.cu: 1 register form, 2 bulk-copy form first; -1: $DS4_GPU_MV_CHAIN
// read_stream.cu: ms per read-only pass over nbytes (the read bandwidth peer of the kernel benchmark).
float read_stream_ms(const void* src, size_t nbytes, int iters, unsigned* sink, cudaStream_t stream);
// matvec_stream.cu: a Q8_0 matvec in S column slices, y_parts[s * rows + r] (v18, DS4_GPU_OB_SLICES).
bool launch_matvec_sliced(const Packed& w, const float* x, float* y_parts, int S, cudaStream_t stream, bool pdl);
// matvec_stream.cu: ys[i][b, r] = ws[i][r] . x[b] for B rows of x, the batch-1 kernel's bits (comp_defer's windows).
bool launch_matvec_rows(const Packed* const* ws, float* const* ys, int nw, const float* x, int B, cudaStream_t stream,
                        bool pdl);
bool launch_matvec_chain(const Packed* const* wa, float* const* ya, int na, int groups_a, const float* x,
                         const Packed& wb, float* yb, int x_op_b, float clamp, cudaStream_t stream);
// moe.cu: routed experts for `tokens` tokens with k experts each (ids/weights [tokens, k] on device).
struct MoeScratch {
  XQ xq_in;      // tokens vectors of n_embd
  float* h;      // tokens*k vectors of n_ff
  XQ xq_h;       // tokens*k vectors of n_ff
};
// out[t] = sum over j < k of y_sorted[slot_row[t k + j]] (prefill: the routed experts' rows back in token order,
// summed in slot order); rows of n floats, n % 4 == 0.
void launch_moe_combine(const float* y_sorted, const int64_t* slot_row, int tokens, int k, int n, float* out,
                        cudaStream_t stream);
void launch_moe(const Packed& gate, const Packed& up, const Packed& down, int n_expert, const float* x,
                const int32_t* ids, const float* weights, int tokens, int k, float clamp, float* y,
                const MoeScratch& scratch, cudaStream_t stream, bool x_quantized = false);  // true: scratch.xq_in holds x

// DS4_GPU_MOE_SHEXP (decode, one token): the routed experts and the shared expert (Q8_0 gate sg, up su, down sd) in
// one gate/up launch and one down launch; y the routed sum, y_shexp the shared expert's output. scratch.h and xq_h
// hold k + 1 vectors of n_ff. moe_shexp_takes: whether the shapes and types are ones it runs.
bool moe_shexp_takes(const Packed& gate, const Packed& down, const Packed& sg, const Packed& su, const Packed& sd,
                     int n_expert, int tokens);
void launch_moe_shexp(const Packed& gate, const Packed& up, const Packed& down, const Packed& sg, const Packed& su,
                      const Packed& sd, int n_expert, const float* x, const int32_t* ids, const float* weights, int k,
                      float clamp, float* y, float* y_shexp, const MoeScratch& scratch, cudaStream_t stream,
                      bool x_quantized);

// fused.cu and hc.cu (mHC): the non-matvec chains of a layer (see the kernels there for the exact semantics).
struct RowPost {
  bool norm = false;
  const float* w = nullptr;
  float eps = 1e-6f;
  const float* freq = nullptr;  // null: no RoPE
  int rope_dim = 0;
  bool inverse = false;
  int fp8_nope = 0;  // 0: no FP8 simulation
  bool qat = false;
  float had_scale = 1.0f;
};
void launch_rms_norm(const float* x, const float* w, float* y, int rows, int n, float eps, cudaStream_t s);
int hc_parts(int n, int D);
void launch_hc_pre(const float* X, const float* Wf, float* part, const float* scale, const float* base,
                   const float* norm_w, int T, int n, int D, int iters, float eps_rms, float eps_hc, bool head,
                   float* out, float* post, float* comb, cudaStream_t s, int parts = 0);
// hc_post then hc_pre of the next sublayer in one launch (decode): Xo = hc_post(X, y1, y2, post_in, comb_in),
// then hc_pre of Xo. Only where hc_one_launch_takes(T, n, D, head); Xo must not overlap the inputs (not in
// place, unlike hc_post); X, Xo, y1, y2 16-byte aligned. One stream per device (per-device arrival counts).
bool hc_one_launch_takes(int T, int n, int D, bool head);
// $DS4_GPU_HC_RCP: Sinkhorn's divisions as reciprocals and multiplies in the one-thread form (1 on, 0 off, -1 as the
// environment says; the same bits).
void set_hc_rcp(int mode);
void set_hc_cluster(int mode);
bool hc_cluster_takes(int n, int D, int M);  // whether decode's mHC pre runs as hc_cluster_kernel now  // hc.cu: 1 decode's one-launch mHC pre as one cluster of 16 CTAs ($DS4_GPU_HC_CLUSTER); -1: env
bool hc_pre_rows_takes(int n, int D, bool head);  // hc_pre with parts = -1 (prefill rows form)
// hc_mix.cu: out [T, M] = X [T, K] . Wf [M, K]^T in float32 (the mHC's mix of prefill rows; K % 128 == 0, M <= 24).
bool hc_mix_rows_takes(int64_t K, int M);
// column slices of a T-row mix (1: none); with S > 1 the launch needs a scratch of S T M floats
int hc_mix_rows_splits(int64_t T, int64_t K);
// hc_mix.cu (v31): X' = hc_post(X, y1, y2, post, comb) (hc_post4's bits; r1, r2: the y's per-row rescales or null)
// and out [T, M] = X' [T, 4 D] . Wf [M, 4 D]^T in one pass (scratch: hc_mix_rows_splits(T, 4 D) planes where > 1).
bool hc_post_mix_takes(int n, int64_t D, int M);
void launch_hc_post_mix(const float* X, const float* y1, const float* y2, const float* post, const float* comb,
                        const float* r1, const float* r2, const float* Wf, int64_t T, int64_t D, int M, float* Xo,
                        float* out, float* scratch, cudaStream_t s);
void set_hc_split_waves(int mode);  // 1/0: hc_mix_rows_splits by the fewest waves, or the v30 doubling rule; -1
void set_hc_mix_ptrs(int mode);  // 1/0: hc_mix_rows' loads from per-thread pointers, or per element; -1: the env
void launch_hc_mix_rows(const float* X, const float* Wf, int64_t T, int64_t K, int M, float* out, float* scratch,
                        cudaStream_t s);
bool launch_hc_post_pre(const float* X, const float* y1, const float* y2, const float* post_in, const float* comb_in,
                        float* Xo, const float* Wf, float* part, const float* scale, const float* base,
                        const float* norm_w, int T, int n, int D, int iters, float eps_rms, float eps_hc, bool head,
                        float* out, float* post, float* comb, cudaStream_t s, float* logits = nullptr,
                        float* ring = nullptr, const int64_t* ring_pos = nullptr, int ring_r = 0);
// logits (non-null, n = 4, not head): comb's 16 logits per token go there and comb is not written; launch_sinkhorn4
// makes comb from them ($DS4_GPU_HC_DEFER, the session's deferred Sinkhorn). ring (T = 1): out also into row
// *ring_pos % ring_r of ring [ring_r, D]; returns whether the launched kernel wrote it (the cluster kernel does, the
// arrival-count kernel does not).
void launch_sinkhorn4(const float* logits, int T, int iters, float eps, float* comb, cudaStream_t s);
// r1, r2 (each may be null): per-row rescales of y1 and y2 (y r[t], rounded before the sum: mm_unscaled's products).
void launch_hc_post(const float* X, const float* y1, const float* y2, const float* post, const float* comb, int T,
                    int n, int D, float* Xo, cudaStream_t s, const float* r1 = nullptr, const float* r2 = nullptr);
struct NormRopeJob {
  const float* x = nullptr;
  const float* in_scale = nullptr;  // per token: x * in_scale[token] is the row (a GEMM's deferred per-row rescale)
  int rows = 0, d = 0, rows_per_token = 1;
  RowPost o;
  int ring_cap = 0;
  float* out = nullptr;
};
// rows of x -> row post -> out; b, c (optional): a second and a third job in the same launch (same positions).
void launch_norm_rope(const NormRopeJob& a, const NormRopeJob* b, const int64_t* pos, cudaStream_t s,
                      const NormRopeJob* c = nullptr);
void launch_router(const float* logits, const float* bias, const int64_t* table, const int64_t* tok, int T, int E,
                   int k, float scale, int32_t* ids, float* wts, cudaStream_t s);
// row_w: out row r (width values) times row_w[row_of ? row_of[r] : r]; g_scale, u_scale: row r of g and u read as
// g r-th row times g_scale[r] (rounded first: the bits of rescaling before the call).
void launch_swiglu(const float* g, const float* u, int64_t n, float limit, float* out, cudaStream_t s,
                   const float* row_w = nullptr, int64_t width = 0, const int64_t* row_of = nullptr,
                   const float* g_scale = nullptr, const float* u_scale = nullptr);
// step_edges.cu. argmax: out[0] = torch.argmax(x[:n]); with pos, also pos[0] += 1 and hist[p] = out[0] at p = pos[0]
// clamped to [0, hist_len); with banned, x[banned[0]] counts as -inf: greedy decode's next step fed on the device. embed: X[t, h] = float32(emb[tok[t]]) for h < n_hc
// (emb float16 or float32, vocab rows of D; a token id out of range gives NaN).
void launch_argmax(const float* x, int64_t n, int64_t* out, cudaStream_t s, int64_t* pos = nullptr,
                   int64_t* hist = nullptr, int64_t hist_len = 0, const int64_t* banned = nullptr);
void launch_embed(const void* emb, bool f16, int64_t vocab, int D, const int64_t* tok, int T, int n_hc, float* X,
                  cudaStream_t s);
// One compressor's decode step (fused.cu compress_step_kernel); pos is shared by the jobs of a launch.
struct CompressJob {
  const float* kv = nullptr;
  const float* sc = nullptr;
  const float* ape = nullptr;
  float* s_kv = nullptr;
  float* s_sc = nullptr;
  float* rows = nullptr;
  int r = 0, width = 0;
  RowPost o;
  // comp_defer.py, ratio 4 with $DS4_GPU_PREWAIT only: the window's deferred products [4, width] (phase i in row i;
  // ring_sc without its APE) for the window's positions at or after *start; null: every slot from the frontier.
  const float* ring_kv = nullptr;
  const float* ring_sc = nullptr;
  const int64_t* start = nullptr;
};
// b (optional): a second compressor's step in the same launch (block 1). Jobs with ring_kv need prewait_mode() >= 1
// and r == 4 (compress_ring_takes).
void launch_compress_step(const CompressJob& a, const CompressJob* b, const int64_t* pos, cudaStream_t s);
bool compress_ring_takes(int r);
int attn_chunks(int n_keys);
void set_attn_tiles(int mode);  // decode attention partials in register tiles: 0, 1, or -1 ($DS4_GPU_ATTN_TILES)
// Prefill attention of T queries in one launch (attn_prefill.cu): query t (position pos0 + t) reads rows t .. t + Wn - 1
// of win (valid from position 0) and the comp rows sel[t] (n_sel each; null: all n_comp rows), visible below
// (pos + 1) / ratio; out [T, H, d]. Takes d a multiple of 64 up to 512 (prefill_attn_takes).
struct PrefillAttn {
  const float* q = nullptr;
  const float* win = nullptr;
  const float* comp = nullptr;
  const int64_t* sel = nullptr;
  const float* sinks = nullptr;
  float* out = nullptr;
  int T = 0, H = 0, d = 0, Wn = 0, n_comp = 0, n_sel = 0, ratio = 0;
  int64_t pos0 = 0;
  float scale = 1.0f;
  // key (and value) columns [0, exact_dims) are exact in TF32 (the FP8 KV simulation's e4m3 values: 4 significant
  // bits): their products skip the keys' lo part, which is zero there (the same bits); a multiple of 8, or 0
  int exact_dims = 0;
  // out_freq != null: the output's last out_rope_dim columns get the inverse RoPE at the query's position (the bits of
  // norm_rope's inverse on the stored output), so the session skips that pass
  const float* out_freq = nullptr;
  int out_rope_dim = 0;
  // 1 = the query's selected rows staged in shared memory once (no dependent index load per key tile), 2 = also the
  // next key tile prefetched into L2 while this one is used, 0 = neither, -1 = as $DS4_GPU_ATTN_PREFETCH says
  int prefetch = -1;
  // inner loops: 2 = without per-step branches (v14), 1 = the v13 loops (the same bits), -1 = $DS4_GPU_ATTN_FORM
  int form = -1;
  // win_pk != null: the keys come from packed copies of win and comp (pack_keys): per row pk_dims bfloat16 values
  // (exact: pk_dims == exact_dims, the FP8-simulated columns), then the other d - pk_dims columns as float32. Rows of
  // 1152 instead of 2048 bytes (Flash), so two key buffers fit beside the queries at two CTAs per SM.
  const uint16_t* win_pk = nullptr;
  const uint16_t* comp_pk = nullptr;
  int pk_dims = 0;
  // pk_split (form 3 only, attn_prefill_bf16.cu): the packed rows' other d - pk_dims columns as bfloat16 hi, then
  // bfloat16 lo (x = hi + lo, both rounded: |x - hi - lo| <= 2^-18 |x|) instead of float32; the same row size
  bool pk_split = false;
  // q_post_on: q holds the q_b product's raw rows; the kernel stages each head row as norm_rope_warp_kernel would
  // write it (times q_in_scale[t] when given, then q_post: norm, RoPE at the query's position), so the session skips
  // that pass over [T, H, d] (the same bits)
  bool q_post_on = false;
  RowPost q_post;
  const float* q_in_scale = nullptr;
  // out_hi != null: the output written as the float16 split of the o_a GEMM instead of out: out_hi + out_lo
  // [T, H, d] = y / s with s = out_s [T, H / out_hpg] the largest |y| of each group of out_hpg heads (to_half's
  // operations per group); out_hpg divides 16 or is a multiple of it, and the heads of a CTA
  __half* out_hi = nullptr;
  __half* out_lo = nullptr;
  float* out_s = nullptr;
  int out_hpg = 0;
  // out_a8 != null (instead of out_lo): the float8 operand of fp8_split's correction GEMM, [H / out_hpg, T, 2 K] e4m3
  // with K = out_hpg d: per head group and query [hi * 2^8 | lo * 2^19] (fp8_split.pack_x's values of this split)
  uint8_t* out_a8 = nullptr;
};
// attn_prefill.cu: rows of float32 x [rows, d] as packed key rows (see PrefillAttn::win_pk; split_tail: the
// PrefillAttn::pk_split form) at out
void launch_pack_keys(const float* x, int64_t rows, int d, int pk_dims, uint16_t* out, cudaStream_t s,
                      bool split_tail = false);
bool prefill_attn_takes(int H, int d);
// attn_prefill_bf16.cu: whether form 3 takes keys of d columns, pk_dims of them exact, and the split output's head
// groups of out_hpg (0: float32 output)
bool prefill_attn_bf16_takes(int d, int pk_dims, int out_hpg);
// $DS4_GPU_ATTN_TMA (form 3's key tiles by bulk copies: 1 on, 0 cp.async, -1 env)
void set_attn_tma(int mode);
void set_attn_qregs(int mode);  // 1/0: form 3 stages its query rows in registers, or in shared memory; -1: env
void set_attn_ostage(int mode);  // 1/0: form 3 stages its split output in shared memory, or stores fragments; -1: env
void launch_prefill_attn(const PrefillAttn& a, cudaStream_t s);
// mmq.cu: y[t, g rows_g + r] = W[g rows_g + r] . x[t, g K ..] for T activation rows quantized by quantize_x, on the int8
// tensor cores straight from the codes (prefill); mmq_takes: Q8_0, Q2_K, Q4_K or IQ2_XXS with columns a multiple of
// 128. launch_mmq_experts: activation rows sorted by expert, tiles[i] = (first row, rows <= mmq_tile_rows(), expert, 0), y rows
// [rows of x, rows per expert].
bool mmq_takes(const Packed& w, int groups);
int mmq_tile_rows();
// mmq.cu: the tile table of launch_mmq_experts built on the device from the experts' row counts (int64 [E]), padded
// with empty tiles to max_tiles (>= ceil(rows / nt) + E holds every expert's tiles)
void launch_expert_tiles(const int64_t* counts, int E, int nt, int4* tiles, int max_tiles, cudaStream_t stream);  // activation rows per CTA tile: DS4_GPU_MMQ_ROWS, 64 (default) or 128
void set_mmq_straight(int v);  // 1/0: full fragments without per-fragment tests or with (the same bits); -1: env
void set_mmq_min_mma(int mode);  // 2/1/0: the K-quants' min terms on the TF32 tensor cores (2: four CTAs per SM); -1: env
void set_mmq_four(int mode);  // 1/0: IQ2_XXS with one weights' buffer and four CTAs per SM, or three; -1: env
void set_mmq_xptr(int mode);  // 1/0: the four-CTA forms find their activation rows once per CTA, or per stage; -1: env
void set_mmq_pairs(int mode);  // 1/0: the K-quants' row-pointer forms take fragments in pairs, or one by one; -1: env
// $DS4_GPU_MMQ_XROW: 1 the routed IQ2_XXS gate and up on activations with one scale per row (mmq's XROW kernel), 2
// the same planes through the per-block kernel, 0 decode's 32-column scales; set_mmq_xrow overrides it (-1: env)
void set_mmq_xrow(int mode);
int mmq_xrow_mode();
// How mmq_experts quantizes the activations of w (rows x n; swiglu_source: the down's SwiGLU input): row_planes one
// scale per row (quantize_x group 0), xrow_kernel through the XROW form (XQ::row_scale; K-quants: the sums in units of
// the row's scale). Both false: decode's 32-column planes.
struct XrowPlan {
  bool row_planes = false, xrow_kernel = false;
};
XrowPlan mmq_xrow_plan(const Packed& w, int64_t rows, int64_t n, bool swiglu_source, bool x8);
void launch_mmq(const Packed& w, const XQ& x, int T, int groups, float* y, cudaStream_t stream);
// s256 (Q2_K only): x quantized with group 256, so the int32 sums run over each 256-column super-block inside the
// mma accumulators and the float epilogue runs once per super-block (DS4_GPU_MMQ_S256; mmq_s256_default()).
// x_rows (int64 [rows of y]): activation row i is x's row x_rows[i] (x quantized once per token, read in expert order).
void launch_mmq_experts(const Packed& w, int n_expert, const XQ& x, const int4* tiles, int ntiles, float* y,
                        cudaStream_t stream, bool s256 = false, const int64_t* x_rows = nullptr);
bool mmq_s256_default();  // $DS4_GPU_MMQ_S256 (default 0), read once
bool mmq_xrows_default();  // $DS4_GPU_MMQ_XROWS (default 1): gathered expert rows quantized once per token, read once
// mmf.cu: the routed experts' prefill products on the float16 tensor cores, the codes as exact float16 integers
// (IQ2_XXS, Q2_K, Q4_K; columns a multiple of 256). Activation rows sorted by expert, split as split_half splits them
// (x / scale = hi + lo, [R, cols]); K-quants also the group sums of x / scale per 256 columns, split alike
// ([R, cols / 256, 16]: 16 sums of 16 columns for Q2_K, 8 of 32 and 8 zeros for Q4_K). tiles as launch_mmq_experts'
// with rows <= mmf_tile_rows(); y [R, rows per expert].
// barrier.cu: iters grid-wide barriers in one resident grid (mode 0 fenced + sleep, 1 acquire/release, 2
// cooperative groups' grid.sync), each checked through slots[i] (iters zeroed counters) and data (iters x ctas,
// zeroed: plain stores seen across CTAs); violations counts failures.
int barrier_max_ctas(int threads);
void launch_barrier_check(int mode, int ctas, int threads, unsigned* slots, unsigned* data, int iters,
                          unsigned* violations, cudaStream_t stream);
int flag_relay_max_ctas();  // one CTA per SM
void launch_flag_relay(int ctas, unsigned* flags, unsigned* data, int laps, unsigned* violations, cudaStream_t stream);
// one cluster of 2..8 CTAs; received counts the hops taken (ctas x laps - 1)
void launch_cluster_relay(int ctas, int laps, unsigned* violations, unsigned* received, cudaStream_t stream);
void launch_empty(int n, cudaStream_t stream);  // n launches of an empty kernel: the launch-gap peer
struct MmfActivations {
  const __half *hi = nullptr, *lo = nullptr, *sum_hi = nullptr, *sum_lo = nullptr;
  const float* scale = nullptr;
};
bool mmf_takes(const Packed& w, int n_expert);
int mmf_tile_rows();
void launch_mmf_experts(const Packed& w, int n_expert, const MmfActivations& x, const int4* tiles, int ntiles,
                        float* y, cudaStream_t stream);
// mmw.cu: the IQ2_XXS experts' product on the warpgroup MMA (wgmma, sm_90a), mmf's arithmetic; hi, lo, scale as
// mmf takes them (no group sums); tiles with rows <= mmw_tile_rows().
bool mmw_takes(const Packed& w, int n_expert);
int mmw_tile_rows();
void launch_mmw_experts(const Packed& w, int n_expert, const MmfActivations& x, const int4* tiles, int ntiles,
                        float* y, cudaStream_t stream, int pipe = -1);  // pipe: 1 warp-specialized, 0 lock-step, -1 env
// fused.cu: $DS4_GPU_COMPRESS_REGS (the ratio-4 pooling with its candidates' loads in flight: 1 on, 0 off, -1 env) and
// $DS4_GPU_COMPRESS_WIDE (the other ratios' pooling split over the warps: 1 on, 0 off, -1 env)
void set_compress_regs(int mode);
void set_compress_wide(int mode);
void launch_attention(const float* q, int H, int d, const float* raw, int cap, const float* comp, const int64_t* sel,
                      int n_comp, int ratio, const int64_t* pos, float scale, const float* sinks, const RowPost& o,
                      float* part_o, float* part_ml, float* out, cudaStream_t s);
void launch_index_keys(const float* q, const float* w, const float* idx, int n_rows, int Hi, int di,
                       const int64_t* pos, int ratio, float scale, double* keys, cudaStream_t s);
// The v16 form of launch_index_keys (other summation order), with norm_rope's RoPE/QAT of the raw query applied while
// staging it when post says so; only where index_keys_v2_takes(Hi, di).
bool index_keys_v2_takes(int Hi, int di);
void launch_index_keys_v2(const float* q, const float* w, const float* idx, int n_rows, int Hi, int di,
                          const int64_t* pos, int ratio, float scale, const RowPost& post, double* keys, cudaStream_t s);
// topk.cu: sel[0..k) = indices of the k largest keys in ascending order (ties: lowest index; NaN smallest), one
// block. pos != null and (*pos + 1) / ratio <= k: sel = 0..k-1 (all visible rows; the attention masks the rest).
void launch_topk_rows(const double* keys, int n, int k, const int64_t* pos, int ratio, int64_t* sel, cudaStream_t s);
// The same for `rows` rows of float keys (row b at keys + b * ld, pos + b, sel + b * k), one block each: the
// prefill indexer's top-k per query.
void launch_topk_rows_f32(const float* keys, int n, int64_t ld, int rows, int k, const int64_t* pos, int ratio,
                          int64_t* sel, cudaStream_t s);
// indexer.cu: prefill indexer scores on the bfloat16 tensor cores, scores[t, c] = sum_h w[t, h] relu(q[t, h] . keys[c])
// for c < n_vis[t], else -inf (c < n); q [T, Hi, di] and w [T, Hi] float32, keys [n, di] bfloat16 (exact under the
// indexer QAT). Takes di = 128 and Hi = 8..64 in multiples of 8 (index_scores_takes).
bool index_scores_takes(int Hi, int di);
void launch_index_scores(const float* q, const float* w, const __nv_bfloat16* keys, int n, int T, int Hi, int di,
                         const int64_t* n_vis, float* scores, cudaStream_t s);
// compress_prefill.cu: the compressors' pooling of a prefill chunk's finished windows (prefill.compress_chunk, v31):
// out [n_full, d] from the products kv, sc [T, width] (times kv_r / sc_r [T] where given; sc plus ape [r, width]) and
// the frontier s_kv, s_sc (its live rows from live0, off of them). Ratios >= 2, an even width at ratio 4.
bool comp_pool_takes(int r, int width);
void launch_comp_pool_chunk(const float* kv, const float* kv_r, const float* sc, const float* sc_r, const float* ape,
                            const float* s_kv, const float* s_sc, int width, int r, int off, int live0, int64_t n_full,
                            float* out, cudaStream_t stream);
}  // namespace ds4gpu
