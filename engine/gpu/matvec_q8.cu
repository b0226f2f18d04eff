// Batch-1 Q8_0 matvec, second design (selected by DS4_GPU_MV=2 or 3 in matvec.cu): y[r] = W[r] . x[g(r)].
//
// Why another kernel: the general one (matvec.cu) reached 0.46-0.54 of copy bandwidth on the 35.6 MB
// attention matrices and 0.2-0.3 on 4-9 MB ones. Its costs are fixed per call: a separate activation
// quantization launch, one DRAM round trip per warp (for K = 1024 each lane does a single x block and
// the warp exits) and a partial last wave. This kernel
//   - quantizes x itself (identical arithmetic to quantize_x_kernel) into shared memory, after the
//     first weight loads are already in flight, so a call is one launch;
//   - runs a persistent grid (resident CTAs only); each warp walks row tiles gw, gw + NW, ... and
//     streams each tile in steps of C x 512 columns, loading step n + 1 (two register buffers) before
//     it computes step n, so a warp always has one to two steps of loads outstanding;
//   - loads codes coalesced: lane l reads bytes 16 l .. 16 l + 15 of each 512-byte chunk of a row
//     (the general kernel reads 2 x 16 B at a 32-byte lane stride, so every sector is requested twice).
// Numerics are those of the general kernel: per 32 columns the exact int32 sum 254 * (codes . hi) +
// (codes . lo) (two lanes' 16-column halves added with one shuffle) and one float FMA with
// d * x_scale; only the order of the float sums differs.
//
// DS4_GPU_MV=3 additionally launches with programmatic dependent launch: the first weight loads are
// issued before griddepcontrol.wait (weights never depend on the previous kernel: upload synchronizes
// after its repack; x does), and the
// kernel lets its own successor start early, so back-to-back matvecs overlap their tails and heads.
#include <map>
#include <tuple>

#include "mv_core.cuh"

namespace ds4gpu {

constexpr int Q8_CHUNK = 512;      // columns of one warp-wide 16-byte load (32 lanes x 16 codes)
constexpr int Q8_MAX_THREADS = 256;
constexpr int Q8_MAX_COLS = 16384;  // x planes in shared memory: 2.125 B per column (34 KB here)

struct Q8Args {
  const uint8_t* qs;
  int64_t qs_row;
  const uint8_t* sc;
  int64_t sc_row;
  int ncols;
  int rows_per_group;   // rows of one x vector (all rows when groups == 1)
  int tiles_per_group;  // ceil(rows_per_group / R)
  int nsteps;           // steps of C chunks per row
  int kpad;             // nsteps * C * 512: columns staged in shared memory (zeros past ncols)
  const float* x;       // [groups, ncols] (quantize) ...
  XQ xq;                // ... or already quantized (!quantize)
  int quantize;
  float* y;
};

// One step of one warp: R rows x C chunks, one 16-byte code load and one f16 scale per (row, chunk).
template <int R, int C>
struct Q8Step {
  uint4 q[R][C];
  uint32_t s[R][C];
};

template <int R, int C>
__device__ __forceinline__ void q8_load(const Q8Args& a, int g, int tile, int step, int lane, Q8Step<R, C>& o) {
  const int col0 = step * (C * Q8_CHUNK) + 16 * lane;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    // rows past the end of the group read its last row (never written)
    const int64_t row = (int64_t)g * a.rows_per_group + min(tile * R + r, a.rows_per_group - 1);
    const uint8_t* qrow = a.qs + row * a.qs_row;
    const uint8_t* srow = a.sc + row * a.sc_row;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int col = col0 + c * Q8_CHUNK;
      if (col < a.ncols) {  // uniform per half warp (ncols is a multiple of 256)
        o.q[r][c] = ld_stream16(qrow + col);
        o.s[r][c] = ld_stream2(srow + 2 * (col >> 5));
      } else {
        o.q[r][c] = make_uint4(0, 0, 0, 0);
        o.s[r][c] = 0;  // f16 +0: the padded x scales are 0 too, so the term is exactly 0
      }
    }
  }
}

// acc[r] += this step's part of row r . x. Only even lanes accumulate (they hold the 32-column sums).
template <int R, int C>
__device__ __forceinline__ void q8_consume(const Q8Step<R, C>& st, const int4* s_hi, const int4* s_lo,
                                           const float* s_xs, int step, int lane, float (&acc)[R]) {
#pragma unroll
  for (int c = 0; c < C; ++c) {
    const int i16 = (step * C + c) * 32 + lane;  // 16-column unit of this lane
    const int4 xh = s_hi[i16], xl = s_lo[i16];
    const float xs = s_xs[i16 >> 1];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const uint4 q = st.q[r][c];
      int th = __dp4a((int)q.x, xh.x, 0), tl = __dp4a((int)q.x, xl.x, 0);
      th = __dp4a((int)q.y, xh.y, th);
      tl = __dp4a((int)q.y, xl.y, tl);
      th = __dp4a((int)q.z, xh.z, th);
      tl = __dp4a((int)q.z, xl.z, tl);
      th = __dp4a((int)q.w, xh.w, th);
      tl = __dp4a((int)q.w, xl.w, tl);
      int t = 254 * th + tl;
      t += __shfl_xor_sync(0xffffffffu, t, 1);  // exact int32 sum of the 32-column x block
      if (!(lane & 1)) acc[r] = fmaf(half_bits(st.s[r][c]) * xs, (float)t, acc[r]);
    }
  }
}

// Last step of a tile: sum the even lanes, write the R rows, reset.
template <int R>
__device__ __forceinline__ void q8_finish(const Q8Args& a, int g, int tile, int lane, float (&acc)[R]) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int o = 16; o > 1; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);  // odd lanes hold 0
    const int rg = tile * R + r;
    if (lane == 2 * r && rg < a.rows_per_group) a.y[(int64_t)g * a.rows_per_group + rg] = acc[r];
    acc[r] = 0.0f;
  }
}

// x vector g -> the hi/lo/scale planes in shared memory, columns [0, kpad), zeros past ncols.
// quantize: the arithmetic of quantize_x_kernel (repack.cu), 8 lanes x 4 columns per x block, all
// loads of a thread issued before the first use.
__device__ __forceinline__ void q8_stage_x(const Q8Args& a, int g, int8_t* s_hi, int8_t* s_lo, float* s_xs) {
  const int tid = threadIdx.x, nthr = blockDim.x, lane = tid & 31;
  if (a.quantize) {
    constexpr int QU = 8;
    const float* xv = a.x + (int64_t)g * a.ncols;
    for (int base = 4 * tid; base < a.kpad; base += 4 * nthr * QU) {
      float4 v[QU];
#pragma unroll
      for (int u = 0; u < QU; ++u) {
        const int col = base + u * 4 * nthr;
        v[u] = col < a.ncols ? __ldg((const float4*)(xv + col)) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int u = 0; u < QU; ++u) {
        const int col = base + u * 4 * nthr;
        if (col >= a.kpad) break;  // uniform per warp: a warp spans 128 columns, kpad is a multiple of 512
        float amax = fmaxf(fmaxf(fabsf(v[u].x), fabsf(v[u].y)), fmaxf(fabsf(v[u].z), fabsf(v[u].w)));
#pragma unroll
        for (int o = 4; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        const float s = amax / 127.0f;
        const float e[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
        uint32_t hw = 0, lw = 0;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          int h = 0, l = 0;
          if (amax > 0.0f) {
            const float t = e[k] / s;
            const float hr = rintf(t);
            h = (int)hr;
            l = (int)rintf((t - hr) * 254.0f);
            l = max(-127, min(127, l));
          }
          hw |= (uint32_t)(uint8_t)(int8_t)h << (8 * k);
          lw |= (uint32_t)(uint8_t)(int8_t)l << (8 * k);
        }
        *(uint32_t*)(s_hi + col) = hw;
        *(uint32_t*)(s_lo + col) = lw;
        if ((lane & 7) == 0) s_xs[col >> 5] = s / 254.0f;
      }
    }
  } else {
    const int4* hi = (const int4*)(a.xq.hi + (int64_t)g * a.xq.n);
    const int4* lo = (const int4*)(a.xq.lo + (int64_t)g * a.xq.n);
    const float* sc = a.xq.scale + (int64_t)g * (a.xq.n / 32);
    const int4 z = make_int4(0, 0, 0, 0);
    for (int i = tid; i < a.kpad / 16; i += nthr) {
      const bool in = 16 * i < a.ncols;
      ((int4*)s_hi)[i] = in ? __ldg(hi + i) : z;
      ((int4*)s_lo)[i] = in ? __ldg(lo + i) : z;
    }
    for (int i = tid; i < a.kpad / 32; i += nthr) s_xs[i] = 32 * i < a.ncols ? __ldg(sc + i) : 0.0f;
  }
}

__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Grid (persistent CTAs per group, groups); CTA of 4 or 8 warps; dynamic shared memory: the x planes.
template <int R, int C>
__global__ void __launch_bounds__(Q8_MAX_THREADS, 2) matvec_q8_kernel(Q8Args a) {
  extern __shared__ __align__(16) unsigned char q8_smem[];
  int8_t* s_hi = (int8_t*)q8_smem;
  int8_t* s_lo = s_hi + a.kpad;
  float* s_xs = (float*)(s_lo + a.kpad);
  const int lane = threadIdx.x & 31, W = blockDim.x >> 5;
  const int g = blockIdx.y, T = a.tiles_per_group, NW = gridDim.x * W;

  Q8Step<R, C> A, B;
  int ta = blockIdx.x * W + (threadIdx.x >> 5), sa = 0;  // the step buffer A holds
  if (ta < T) q8_load<R, C>(a, g, ta, sa, lane, A);     // weights: independent of earlier kernels
  grid_launch_dependents();
  grid_dependency_wait();                                // x (and y's readers) are from earlier kernels
  q8_stage_x(a, g, s_hi, s_lo, s_xs);
  __syncthreads();

  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.0f;
  const int last = a.nsteps - 1;
  while (ta < T) {
    int tb = ta, sb = sa + 1;  // the step after A's, into B
    if (sb > last) { sb = 0; tb += NW; }
    if (tb < T) q8_load<R, C>(a, g, tb, sb, lane, B);
    q8_consume<R, C>(A, (const int4*)s_hi, (const int4*)s_lo, s_xs, sa, lane, acc);
    if (sa == last) q8_finish<R>(a, g, ta, lane, acc);
    if (tb >= T) break;
    ta = tb;  // the step after B's, into A
    sa = sb + 1;
    if (sa > last) { sa = 0; ta += NW; }
    if (ta < T) q8_load<R, C>(a, g, ta, sa, lane, A);
    q8_consume<R, C>(B, (const int4*)s_hi, (const int4*)s_lo, s_xs, sb, lane, acc);
    if (sb == last) q8_finish<R>(a, g, tb, lane, acc);
  }
}

static int sm_count() {
  static const int v = [] {
    int dev = 0, n = 0;
    DS4_CHECK(cudaGetDevice(&dev));
    DS4_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    return n;
  }();
  return v;
}

template <int R, int C>
static void launch_rc(Q8Args a, int groups, int threads, size_t smem, bool pdl, cudaStream_t stream) {
  static std::map<std::pair<int, size_t>, int> resident;  // CTAs per SM for (threads, smem)
  auto key = std::make_pair(threads, smem);
  auto it = resident.find(key);
  if (it == resident.end()) {
    int n = 0;
    DS4_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, matvec_q8_kernel<R, C>, threads, smem));
    it = resident.emplace(key, std::max(1, n)).first;
  }
  const int W = threads / 32;
  const int64_t per_group = std::max<int64_t>(1, (int64_t)it->second * sm_count() / groups);
  const unsigned gx = (unsigned)std::min<int64_t>((a.tiles_per_group + W - 1) / W, per_group);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(gx, (unsigned)groups, 1);
  cfg.blockDim = dim3((unsigned)threads, 1, 1);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  DS4_CHECK(cudaLaunchKernelEx(&cfg, matvec_q8_kernel<R, C>, a));
}

bool launch_matvec_q8(const Packed& w, const float* x, const XQ& xq, int groups, float* y, cudaStream_t stream,
                      bool quantize, bool pdl) {
  const int64_t K = w.ncols;
  if (w.qtype != QT_Q8_0 || K % 256 || K > Q8_MAX_COLS || w.nrows < 1 || groups > 65535 ||
      w.nrows / groups > (1 << 30))
    return false;
  // 16-byte vector loads of x (torch views may start anywhere) or of the shared xq planes
  if (quantize ? ((uintptr_t)x & 15) != 0 : (((uintptr_t)xq.hi | (uintptr_t)xq.lo) & 15) != 0 || xq.n % 16) return false;
  const int nchunks = (int)((K + Q8_CHUNK - 1) / Q8_CHUNK);
  const int C = nchunks <= 2 ? 2 : (nchunks <= 4 ? 4 : 8);
  const int rpg = (int)(w.nrows / groups);
  // R * C = 8 chunks per step (40 registers per buffer); fewer rows per tile while that leaves fewer
  // than 16 tiles per SM, or when R does not divide the rows of a group (groups > 1)
  int R = 8 / C;
  const int64_t want = (int64_t)sm_count() * 16;
  while (R > 1 && ((groups > 1 && rpg % R) || (int64_t)groups * ((rpg + R - 1) / R) < want)) R /= 2;
  Q8Args a;
  a.qs = w.qs;
  a.qs_row = w.qs_row;
  a.sc = w.sc;
  a.sc_row = w.sc_row;
  a.ncols = (int)K;
  a.rows_per_group = rpg;
  a.tiles_per_group = (rpg + R - 1) / R;
  a.nsteps = (int)((K + C * Q8_CHUNK - 1) / (C * Q8_CHUNK));
  a.kpad = a.nsteps * C * Q8_CHUNK;
  a.x = x;
  a.xq = xq;
  a.quantize = quantize ? 1 : 0;
  a.y = y;
  const size_t smem = 2 * (size_t)a.kpad + (size_t)a.kpad / 32 * 4;
  // 8 warps per CTA amortize the x staging; 4 when that would leave SMs without a CTA
  const int threads = (int64_t)groups * a.tiles_per_group >= (int64_t)sm_count() * 8 ? 256 : 128;
  if (C == 2 && R == 4) launch_rc<4, 2>(a, groups, threads, smem, pdl, stream);
  else if (C == 2 && R == 2) launch_rc<2, 2>(a, groups, threads, smem, pdl, stream);
  else if (C == 2) launch_rc<1, 2>(a, groups, threads, smem, pdl, stream);
  else if (C == 4 && R == 2) launch_rc<2, 4>(a, groups, threads, smem, pdl, stream);
  else if (C == 4) launch_rc<1, 4>(a, groups, threads, smem, pdl, stream);
  else launch_rc<1, 8>(a, groups, threads, smem, pdl, stream);
  return true;
}

}  // namespace ds4gpu
