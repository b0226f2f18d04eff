// Dequant-fused matvec for batch 1..8: y[b, r] = W[r] . x[b, g(r)] for every quant type ds4 uses.
#include <cstdlib>

#include "mv_core.cuh"

namespace ds4gpu {

// Rows per warp for a batch width: more rows reuse each loaded x word more often, fewer keep the
// registers (R * 8 code words + NB * 8 x words) under ~128 so enough warps stay resident.
template <int NB>
__host__ __device__ constexpr int rows_per_warp() {
  return NB <= 2 ? 8 : (NB <= 4 ? 4 : 2);
}

template <int QT, int NB, int R>
__global__ void __launch_bounds__(CTA_THREADS) matvec_kernel(Packed w, const float* x, XQ xq, int batch,
                                                             int groups, int S, float* y) {
  pdl_begin();
  __shared__ unsigned long long s_grid[QT == QT_IQ2_XXS ? 256 : 1];
  __shared__ float red[CTA_WARPS][R][NB];
  Iq2Tables tb{s_grid};
  if constexpr (QT == QT_IQ2_XXS) {
    iq2_tables_init(s_grid);
    __syncthreads();
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int RG = CTA_WARPS / S, rg = warp / S, cs = warp % S;
  const int64_t row0 = ((int64_t)blockIdx.x * RG + rg) * R;
  const int64_t rows_per_group = w.nrows / groups;
  const int g = (int)(min(row0, w.nrows - 1) / rows_per_group);
  const uint8_t* qrow[R];
  const uint8_t* srow[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    int64_t row = min(row0 + r, w.nrows - 1);  // rows past the end read the last row; not written
    qrow[r] = w.qs + row * w.qs_row;
    srow[r] = w.sc + row * w.sc_row;
  }
  int vec[NB];
#pragma unroll
  for (int b = 0; b < NB; ++b) vec[b] = min(b, batch - 1) * groups + g;
  float acc[R][NB];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int b = 0; b < NB; ++b) acc[r][b] = 0.0f;

  if constexpr (QT == QT_F16) {
    mv_accumulate_f16<NB, R>(qrow, w.ncols, cs * 32 + lane, 32 * S, x, vec, acc);
  } else {
    mv_accumulate<QT, NB, R>(qrow, srow, (int)(w.ncols / 32), (int)(w.ncols / 256), cs * 32 + lane, 32 * S, xq,
                             vec, tb, acc);
  }
  warp_sum<R, NB>(acc);
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int b = 0; b < NB; ++b) red[warp][r][b] = acc[r][b];
  }
  __syncthreads();
  for (int t = threadIdx.x; t < RG * R * NB; t += CTA_THREADS) {
    int grp = t / (R * NB), r = (t / NB) % R, b = t % NB;
    float s = 0.0f;
    for (int c = 0; c < S; ++c) s += red[grp * S + c][r][b];
    int64_t row = ((int64_t)blockIdx.x * RG + grp) * R + r;
    if (row < w.nrows && b < batch) y[(int64_t)b * w.nrows + row] = s;
  }
}

template <int QT, int NB, int R>
static void launch_r(const Packed& w, const float* x, const XQ& xq, int batch, int groups, int S, float* y,
                     cudaStream_t stream) {
  int64_t rows_per_cta = (int64_t)(CTA_WARPS / S) * R;
  if ((w.nrows / groups) % R)
    throw std::invalid_argument("rows per group must be a multiple of " + std::to_string(R));
  unsigned grid = (unsigned)((w.nrows + rows_per_cta - 1) / rows_per_cta);
  launch_k(matvec_kernel<QT, NB, R>, dim3(grid), dim3(CTA_THREADS), 0, stream, w, x, xq, batch, groups, S, y);
  DS4_CHECK_LAUNCH("matvec");
}

// Small matrices (q_a, kv, router, shared expert) give too few warps at R rows each to keep enough
// loads in flight (v1: 64-256 CTAs, 7-9 us for 2-9 MB); they take 2 rows per warp instead.
// $DS4_GPU_MIN_WARPS overrides the threshold (benchmark A/B: a huge value forces 2 rows everywhere).
static int64_t min_warps() {
  static const int64_t v = [] {
    const char* e = getenv("DS4_GPU_MIN_WARPS");
    return e ? atoll(e) : (int64_t)132 * 16;
  }();
  return v;
}

template <int QT, int NB>
static void launch_nb(const Packed& w, const float* x, const XQ& xq, int batch, int groups, float* y,
                      cudaStream_t stream) {
  constexpr int R = rows_per_warp<NB>();
  int64_t units = QT == QT_F16 ? w.ncols / 8 : w.ncols / 32;
  int S = column_splits(units);
  if constexpr (R > 2) {
    if (w.nrows / R * S < min_warps() && (w.nrows / groups) % 2 == 0) {
      launch_r<QT, NB, 2>(w, x, xq, batch, groups, S, y, stream);
      return;
    }
  }
  launch_r<QT, NB, R>(w, x, xq, batch, groups, S, y, stream);
}

template <int QT>
static void launch_qt(const Packed& w, const float* x, const XQ& xq, int batch, int groups, float* y,
                      cudaStream_t stream) {
  if (batch <= 1) launch_nb<QT, 1>(w, x, xq, batch, groups, y, stream);
  else if (batch <= 2) launch_nb<QT, 2>(w, x, xq, batch, groups, y, stream);
  else if (batch <= 4) launch_nb<QT, 4>(w, x, xq, batch, groups, y, stream);
  else launch_nb<QT, 8>(w, x, xq, batch, groups, y, stream);
}

// matvec_stream.cu: the batch-1 streaming kernel for Q8_0 and F16 (x staged in the kernel unless xq is
// given; up to 4 matrices of one width per launch); false if it does not take this shape.
bool launch_matvec_stream(const Packed* const* ws, float* const* ys, int nw, const float* x, const XQ* xq, int groups,
                          int x_op, float clamp, cudaStream_t stream, bool pdl, const float* norm_w = nullptr,
                          float eps = 0.0f);

// $DS4_GPU_MV selects the batch-1 kernels: 1 this file's, 2 matvec_stream.cu's for Q8_0, 3 the same with
// programmatic dependent launch, 4 (default) also F16 and several matrices per launch (matvec_multi).
// Read once (benchmark A/B; H200, Flash q2 decode at 2k: 11.10 / 9.95 / 9.76 ms per token for 1 / 2 / 3).
static int mv_variant() {
  static const int v = [] {
    const char* e = getenv("DS4_GPU_MV");
    return e ? atoi(e) : 4;
  }();
  return v;
}

bool pdl_enabled() {
  static const bool v = [] {
    const char* e = getenv("DS4_GPU_PDL");
    return !(e && e[0] == '0');
  }();
  return v;
}

bool launch_matvec_multi(const Packed* const* ws, float* const* ys, int nw, const float* x, int x_op, float clamp,
                         cudaStream_t stream, const float* norm_w, float eps) {
  return mv_variant() >= 4 && launch_matvec_stream(ws, ys, nw, x, nullptr, 1, x_op, clamp, stream, true, norm_w, eps);
}

void launch_matvec(const Packed& w, const float* x, const XQ& xq, int batch, int groups, float* y,
                   cudaStream_t stream, bool quantize) {
  if (batch < 1 || batch > MAX_BATCH) throw std::invalid_argument("matvec batch must be 1..8");
  if (groups < 1 || w.nrows % groups) throw std::invalid_argument("rows must split evenly into groups");
  if (batch == 1 && ((w.qtype == QT_Q8_0 && mv_variant() >= 2) || (w.qtype == QT_F16 && mv_variant() >= 4))) {
    const Packed* ws[1] = {&w};
    float* ys[1] = {y};
    const XQ* planes = (quantize || w.qtype == QT_F16) ? nullptr : &xq;
    if (launch_matvec_stream(ws, ys, 1, x, planes, groups, 0, 0.0f, stream, mv_variant() >= 3)) return;
  }
  if (w.qtype != QT_F16 && quantize) launch_quantize_x(x, batch * groups, (int)w.ncols, xq, stream);
  switch (w.qtype) {
    case QT_F16: launch_qt<QT_F16>(w, x, xq, batch, groups, y, stream); break;
    case QT_Q8_0: launch_qt<QT_Q8_0>(w, x, xq, batch, groups, y, stream); break;
    case QT_Q4_K: launch_qt<QT_Q4_K>(w, x, xq, batch, groups, y, stream); break;
    case QT_Q2_K: launch_qt<QT_Q2_K>(w, x, xq, batch, groups, y, stream); break;
    case QT_IQ2_XXS: launch_qt<QT_IQ2_XXS>(w, x, xq, batch, groups, y, stream); break;
    default: throw std::invalid_argument("matvec: unsupported type " + std::to_string(w.qtype));
  }
}

}  // namespace ds4gpu
