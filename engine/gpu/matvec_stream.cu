// The batch-1 streaming matvec's kernel and launches (the building blocks and the design notes are in
// mv_stream.cuh), and the L2 prefetch kernel.
#include <algorithm>
#include <cstdlib>
#include <map>
#include <stdexcept>
#include <tuple>

#include "mv_stream.cuh"

namespace ds4gpu {

// Grid (persistent CTAs per group, groups); CTA of 4 or 8 warps; dynamic shared memory: the staged x.
template <int QT, int R, int C>
__global__ void __launch_bounds__(MV_MAX_THREADS, 2) matvec_stream_kernel(MvArgs a) {
  extern __shared__ __align__(16) unsigned char mv_smem[];
  const int g = blockIdx.y;
  MvStep<QT, R, C> A;
  mv_first_load<QT, R, C>(a, g, blockIdx.x, A);  // weights: independent of earlier kernels
  pdl_trigger();
  pdl_wait();  // x (and y's readers) are from earlier kernels
  mv_stage_x<QT>(a, g, mv_smem);
  __syncthreads();
  mv_loop<QT, R, C>(a, g, blockIdx.x, gridDim.x, mv_smem, A);
}

// Q8_0 and F16 matrices reading one x, in one launch: phase A the Q8_0 segments (x staged as quantized planes),
// phase B the F16 ones (x staged as floats, after A's in shared memory). Why: decode's indexed layers read the
// normalized q_a through q_b (Q8_0) and the indexer's q_b (F16), and a through q_a/kv (Q8_0) and the indexer's
// proj (F16); one launch each instead of two dependent ones on the critical chain. Each warp streams its A tiles,
// then its B tiles; every row's sums are those of the one-type launches (the same staging arithmetic, the same
// per-row order), so the outputs are their bits.
// wa > 0 ($DS4_GPU_PAIR_SPLIT=1, prepared in v20, not yet measured): the first wa warps of every CTA stream A and the
// others B, each from the start, so there is no phase boundary and every SM streams both types at once; 0: phases.
template <int CA, int CB>
__global__ void __launch_bounds__(MV_MAX_THREADS, 2) matvec_pair_kernel(MvArgs a, MvArgs b, int smem_b, int wa) {
  extern __shared__ __align__(16) unsigned char mv_smem[];
  constexpr int RA = 8 / CA, RB = 8 / CB;
  const int W = blockDim.x >> 5, warp = threadIdx.x >> 5;
  const bool on_a = wa == 0 || warp < wa;
  // this warp's index among the warps streaming its matrix, and their number
  const int wi = wa == 0 ? blockIdx.x * W + warp : (on_a ? blockIdx.x * wa + warp : blockIdx.x * (W - wa) + warp - wa);
  const int nw = wa == 0 ? gridDim.x * W : gridDim.x * (on_a ? wa : W - wa);
  MvStep<QT_Q8_0, RA, CA> A;
  if (on_a) mv_first_load_w<QT_Q8_0, RA, CA>(a, 0, wi, A);  // B's first loads wait for the staging: no spills
  pdl_trigger();
  pdl_wait();
  const float rr = a.x_op == MV_X_RMS ? mv_rms_scale<false>(a, mv_smem) : 1.0f;  // one x: one norm for both
  mv_stage_x_rr<QT_Q8_0>(a, 0, mv_smem, rr);
  mv_stage_x_rr<QT_F16>(b, 0, mv_smem + smem_b, rr);
  __syncthreads();
  if (on_a) mv_loop_w<QT_Q8_0, RA, CA>(a, 0, wi, nw, mv_smem, A);
  if (wa == 0 || !on_a) {
    MvStep<QT_F16, RB, CB> B;
    mv_first_load_w<QT_F16, RB, CB>(b, 0, wi, B);
    mv_loop_w<QT_F16, RB, CB>(b, 0, wi, nw, mv_smem + smem_b, B);
  }
}

// $DS4_GPU_PAIR_SPLIT=1: matvec_pair_kernel's warps split between the two types by their bytes (prepared, off).
// set_pair_split overrides it for this process (0, 1; -1 the environment).
static int& pair_split_override() {
  static int v = -1;
  return v;
}
void set_pair_split(int mode) { pair_split_override() = mode == 0 || mode == 1 ? mode : -1; }
static bool pair_split() {
  static const bool env = [] {
    const char* e = std::getenv("DS4_GPU_PAIR_SPLIT");
    return e && e[0] == '1';
  }();
  return pair_split_override() >= 0 ? pair_split_override() == 1 : env;
}

template <int CA, int CB>
static void launch_pair_cc(const MvArgs& a, const MvArgs& b, double frac_a, int threads, size_t smem_b, size_t smem,
                           bool pdl, cudaStream_t stream) {
  static std::map<std::pair<int, size_t>, int> resident;  // CTAs per SM for (threads, smem)
  auto key = std::make_pair(threads, smem);
  auto it = resident.find(key);
  if (it == resident.end()) {
    if (smem > 48 * 1024)
      DS4_CHECK(cudaFuncSetAttribute(matvec_pair_kernel<CA, CB>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     (int)smem));
    int n = 0;
    DS4_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, matvec_pair_kernel<CA, CB>, threads, smem));
    it = resident.emplace(key, std::max(1, n)).first;
  }
  const int W = threads / 32;
  const int per_sm = mv_ctas_per_sm() > 0 ? std::min(mv_ctas_per_sm(), it->second) : it->second;
  const int64_t most = (int64_t)per_sm * sm_count();
  // split: A warps per CTA by A's share of the bytes (at least one of each); the grid then covers both lists at once
  const int wa = pair_split() ? std::max(1, std::min(W - 1, (int)(W * frac_a + 0.5))) : 0;
  const int64_t need = wa ? std::max((a.tiles + wa - 1) / wa, (b.tiles + (W - wa) - 1) / (W - wa))
                          : (std::max(a.tiles, b.tiles) + W - 1) / W;
  const unsigned gx = (unsigned)std::min<int64_t>(need, most);
  launch_pdl(pdl, matvec_pair_kernel<CA, CB>, dim3(gx), dim3((unsigned)threads), smem, stream, a, b, (int)smem_b, wa);
}

template <int CA>
static void launch_pair_c(const MvArgs& a, const MvArgs& b, int cb, double frac_a, int threads, size_t smem_b,
                          size_t smem, bool pdl, cudaStream_t stream) {
  if (cb == 2) launch_pair_cc<CA, 2>(a, b, frac_a, threads, smem_b, smem, pdl, stream);
  else if (cb == 4) launch_pair_cc<CA, 4>(a, b, frac_a, threads, smem_b, smem, pdl, stream);
  else launch_pair_cc<CA, 8>(a, b, frac_a, threads, smem_b, smem, pdl, stream);
}

// ys[i] = ws[i] . x for Q8_0 and F16 matrices of one width (at least one of each, 4 in all) in one launch; false (nothing
// launched) where the streaming kernel does not take them.
static bool launch_matvec_pair(const Packed* const* ws, float* const* ys, int nw, const float* x, int x_op,
                               cudaStream_t stream, bool pdl, const float* norm_w, float eps) {
  const Packed* wq[MV_MAX_SEG];
  const Packed* wf[MV_MAX_SEG];
  float* yq[MV_MAX_SEG];
  float* yf[MV_MAX_SEG];
  int nq = 0, nf = 0;
  for (int i = 0; i < nw; ++i) {
    if (ws[i]->qtype == QT_Q8_0) wq[nq] = ws[i], yq[nq++] = ys[i];
    else if (ws[i]->qtype == QT_F16) wf[nf] = ws[i], yf[nf++] = ys[i];
    else return false;
  }
  MvArgs a, b;
  int64_t rows_a = 0, rows_b = 0;
  if (!nq || !nf || x_op == MV_X_SWIGLU || !mv_args(wq, yq, nq, x, nullptr, 1, x_op, 0.0f, a, rows_a) ||
      !mv_args(wf, yf, nf, x, nullptr, 1, x_op, 0.0f, b, rows_b) || a.ncols != b.ncols)
    return false;
  if (x_op == MV_X_RMS) {
    if (a.ncols % 4 || a.ncols > 16 * MV_RMS_THREADS || ((uintptr_t)norm_w & 15)) return false;
    a.norm_w = b.norm_w = norm_w;
    a.eps = b.eps = eps;
  }
  const MvPlan pa = mv_plan<QT_Q8_0>(a, 1, rows_a, true), pb = mv_plan<QT_F16>(b, 1, rows_b, true);
  const size_t smem_b = (pa.smem + 15) / 16 * 16, smem = smem_b + pb.smem;
  const int threads = (int64_t)a.tiles + b.tiles >= (int64_t)sm_count() * 8 ? 256 : 128;
  const double bytes_a = (double)rows_a * (a.qs_row + a.sc_row), bytes_b = (double)rows_b * 2 * b.ncols;
  const double frac_a = bytes_a / (bytes_a + bytes_b);
  if (pa.C == 2) launch_pair_c<2>(a, b, pb.C, frac_a, threads, smem_b, smem, pdl, stream);
  else if (pa.C == 4) launch_pair_c<4>(a, b, pb.C, frac_a, threads, smem_b, smem, pdl, stream);
  else launch_pair_c<8>(a, b, pb.C, frac_a, threads, smem_b, smem, pdl, stream);
  DS4_CHECK_LAUNCH("matvec pair");
  return true;
}

template <int QT, int R, int C>
static void launch_rc(const MvArgs& a, int groups, int threads, size_t smem, bool pdl, cudaStream_t stream) {
  static std::map<std::pair<int, size_t>, int> resident;  // CTAs per SM for (threads, smem)
  auto key = std::make_pair(threads, smem);
  auto it = resident.find(key);
  if (it == resident.end()) {
    if (smem > 48 * 1024)
      DS4_CHECK(cudaFuncSetAttribute(matvec_stream_kernel<QT, R, C>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     (int)smem));
    int n = 0;
    DS4_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, matvec_stream_kernel<QT, R, C>, threads, smem));
    it = resident.emplace(key, std::max(1, n)).first;
  }
  const int W = threads / 32;
  const int per_sm = mv_ctas_per_sm() > 0 ? std::min(mv_ctas_per_sm(), it->second) : it->second;
  const int64_t per_group = std::max<int64_t>(1, (int64_t)per_sm * sm_count() / groups);
  const unsigned gx = (unsigned)std::min<int64_t>((a.tiles + W - 1) / W, per_group);
  launch_pdl(pdl, matvec_stream_kernel<QT, R, C>, dim3(gx, (unsigned)groups), dim3((unsigned)threads), smem, stream, a);
}

template <int QT>
static void launch_qt(MvArgs& a, int groups, int64_t rows, bool pdl, cudaStream_t stream) {
  const MvPlan p = mv_plan<QT>(a, groups, rows);
  if (p.C == 2 && p.R == 4) launch_rc<QT, 4, 2>(a, groups, p.threads, p.smem, pdl, stream);
  else if (p.C == 2 && p.R == 2) launch_rc<QT, 2, 2>(a, groups, p.threads, p.smem, pdl, stream);
  else if (p.C == 2) launch_rc<QT, 1, 2>(a, groups, p.threads, p.smem, pdl, stream);
  else if (p.C == 4 && p.R == 2) launch_rc<QT, 2, 4>(a, groups, p.threads, p.smem, pdl, stream);
  else if (p.C == 4) launch_rc<QT, 1, 4>(a, groups, p.threads, p.smem, pdl, stream);
  else launch_rc<QT, 1, 8>(a, groups, p.threads, p.smem, pdl, stream);
}

// matvec_tma.cu: the same products with the weights streamed by bulk copies ($DS4_GPU_MV_TMA; the same bits).
int mv_tma_mode();
bool launch_matvec_tma(MvArgs a, int groups, bool pdl, cudaStream_t stream);

void set_mv_cap(int ctas_per_sm) { mv_cap_override() = ctas_per_sm > 0 ? ctas_per_sm : 0; }

bool launch_matvec_stream(const Packed* const* ws, float* const* ys, int nw, const float* x, const XQ* xq, int groups,
                          int x_op, float clamp, cudaStream_t stream, bool pdl, const float* norm_w, float eps) {
  MvArgs a;
  int64_t rows = 0;
  bool mixed = false;
  for (int i = 1; i < nw; ++i) mixed |= ws[i]->qtype != ws[0]->qtype;
  if (mixed) return xq == nullptr && groups == 1 && launch_matvec_pair(ws, ys, nw, x, x_op, stream, pdl, norm_w, eps);
  if (!mv_args(ws, ys, nw, x, xq, groups, x_op, clamp, a, rows)) return false;
  if (x_op == MV_X_RMS) {  // one x vector of rms_norm_kernel's float4 path (the shapes whose bits mv_rms_scale has)
    if (groups != 1 || xq != nullptr || a.ncols % 4 || a.ncols > 16 * MV_RMS_THREADS || ((uintptr_t)norm_w & 15))
      return false;
    a.norm_w = norm_w;
    a.eps = eps;
  }
  if (ws[0]->qtype == QT_Q8_0 && mv_tma_mode() && launch_matvec_tma(a, groups, pdl, stream)) return true;
  if (ws[0]->qtype == QT_F16) launch_qt<QT_F16>(a, groups, rows, pdl, stream);
  else launch_qt<QT_Q8_0>(a, groups, rows, pdl, stream);
  return true;
}

// ys[i][b * rows_i + r] = W_i[r] . x[b] for B vectors of x (rows of one [B, K] block): the batch-1 streaming launch with
// one group per vector over the same weights (the groups' weight offsets 0). Why: comp_defer.py's window of ring rows
// (4 in ratio-4 layers, 128 in ratio-128 ones) through the compressors; every row's sum is the batch-1 kernel's (the
// same bits as a launch per vector), and the B groups' CTAs walk the same tiles at once, so most repeated weight
// reads meet in L2. False (nothing launched) where the streaming kernel does not take the matrices.
bool launch_matvec_rows(const Packed* const* ws, float* const* ys, int nw, const float* x, int B, cudaStream_t stream,
                        bool pdl) {
  MvArgs a;
  int64_t rows = 0;
  for (int i = 1; i < nw; ++i)
    if (ws[i]->qtype != ws[0]->qtype) return false;
  if (B < 1 || B > 65535 || !mv_args(ws, ys, nw, x, nullptr, 1, MV_X_PLAIN, 0.0f, a, rows)) return false;
  a.gq = 0;
  a.gs = 0;
  if (ws[0]->qtype == QT_F16) launch_qt<QT_F16>(a, B, rows, pdl, stream);
  else launch_qt<QT_Q8_0>(a, B, rows, pdl, stream);
  DS4_CHECK_LAUNCH("matvec rows");
  return true;
}

// y_parts[s * rows + r] = W[r, s K/S .. (s + 1) K/S) . x[s K/S ..]: a Q8_0 matrix cut into S column slices, each a
// group of the streaming kernel's grouped launch (the slices' weights are strided within the rows: gq, gs). Why: at the
// same bytes a row of 8192 columns costs more than one of 4096 (v18 k-sweep: 13.9 against 11.6 us for 35.6 MB), since
// every CTA stages and quantizes the whole x and a warp's steps along a row are serial; the caller sums the S parts
// (the mHC post takes two summands). Per 32-column block the products are the unsliced kernel's; only the float sums
// are split. False (nothing launched) unless Q8_0, S in 2..4, K / S a multiple of 512, x 16-byte aligned.
bool launch_matvec_sliced(const Packed& w, const float* x, float* y_parts, int S, cudaStream_t stream, bool pdl) {
  if (w.qtype != QT_Q8_0 || S < 2 || S > 4 || w.ncols % (512 * S) || w.ncols / S > Q8_MAX_COLS ||
      w.qs_row != w.ncols || w.sc_row != w.ncols / 16 || ((uintptr_t)x & 15) || w.nrows < 1 || w.nrows > (1 << 30))
    return false;
  MvArgs a{};
  const int K = (int)(w.ncols / S);
  a.seg[0] = MvSeg{w.qs, w.sc, y_parts, (int)w.nrows, 0};
  a.nseg = 1;
  a.qs_row = w.qs_row;
  a.sc_row = w.sc_row;
  a.gq = K;       // one slice's codes of a row
  a.gs = K / 16;  // ... and its scales (2 bytes per 32 columns)
  a.ncols = K;
  a.x = x;        // slice s of x is x + s K: the grouped launch's x_g
  a.quantize = 1;
  a.x_op = MV_X_PLAIN;
  launch_qt<QT_Q8_0>(a, S, w.nrows, pdl, stream);
  DS4_CHECK_LAUNCH("matvec sliced");
  return true;
}

// L2 prefetch. Decode spends ~40% of a token in latency-bound kernels (mHC, norms, attention, router)
// while DRAM idles; a matvec that follows them finds the first part of its weights in L2 if they were
// requested when the chain began. The kernel only issues requests: bulk prefetches (mode 0, one
// cp.async.bulk.prefetch.L2 per chunk, fire and forget) or one prefetch.global.L2 per 128-byte line (mode 1).
// It waits for its predecessor only at the end, so the kernel after it (whose griddepcontrol.wait covers
// this grid only) still runs after everything launched before the prefetch.
struct PfArgs {
  const uint8_t* p[PF_MAX_RANGES];
  int64_t n[PF_MAX_RANGES];
  int count, mode;
};
constexpr int64_t PF_CHUNK = 32 * 1024;

__global__ void l2_prefetch_kernel(PfArgs a) {
  pdl_trigger();
  const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, nt = (int64_t)gridDim.x * blockDim.x;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  for (int i = 0; i < a.count; ++i) {
    const int64_t n = a.n[i] & ~int64_t(15);  // bulk sizes are multiples of 16 (a hint: the tail may be left)
    if (a.mode == 0) {
      for (int64_t off = t * PF_CHUNK; off < n; off += nt * PF_CHUNK) {
        const uint32_t len = (uint32_t)min(PF_CHUNK, n - off);
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(a.p[i] + off), "r"(len) : "memory");
      }
    } else {
      for (int64_t off = t * 128; off < n; off += nt * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(a.p[i] + off));
    }
  }
#endif
  pdl_wait();
}

void launch_l2_prefetch(const uint8_t* const* ptrs, const int64_t* nbytes, int n, int ctas, int mode,
                        cudaStream_t stream) {
  if (n < 1) return;
  if (n > PF_MAX_RANGES) throw std::invalid_argument("l2_prefetch: at most 16 ranges");
  PfArgs a = {};
  for (int i = 0; i < n; ++i) {
    if ((uintptr_t)ptrs[i] & 15 && mode == 0) throw std::invalid_argument("l2_prefetch: ranges must start 16-byte aligned");
    a.p[i] = ptrs[i];
    a.n[i] = std::max<int64_t>(0, nbytes[i]);
  }
  a.count = n;
  a.mode = mode;
  launch_k(l2_prefetch_kernel, dim3((unsigned)std::max(1, ctas)), dim3(mode == 0 ? 32 : 256), 0, stream, a);
  DS4_CHECK_LAUNCH("l2 prefetch");
}

}  // namespace ds4gpu
