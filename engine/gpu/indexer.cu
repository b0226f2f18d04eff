// The lightning indexer's scores (model-spec 3.6). Prefill on the bfloat16 tensor cores (below); decode, the one
// query's keys against every compressed row, at the end of the file (index_keys_kernel, index_keys_v2_kernel).
// Prefill:
//   scores[t, c] = sum_h w[t, h] * relu(q[t, h, :] . keys[c, :])  for c < n_vis[t], -inf for n_vis[t] <= c < n.
//
// Why bfloat16 is exact here: under the indexer QAT both the queries and the keys are e2m1 codes times a power of two
// (model-spec 3.1, "Indexer QAT"), i.e. at most 2 significant bits with a float32 exponent, so converting them to
// bfloat16 loses nothing and each tensor-core product is the float32 product; the sums run in float32. The result is
// the float32 formula up to summation order, without the [T, heads, n] float32 dots the torch form writes and reads
// back (3.2 GB per Flash layer of an 8192-token chunk) and on the tensor cores instead of the SIMT cores.
//
// Layout: a CTA of 4 warps takes QT queries (their q in shared memory as bfloat16, rows padded so the B-fragment
// reads are conflict-free) and walks the keys in tiles of 64, 16 per warp. A warp holds its 16 keys' A fragments
// (16 x 128 bf16: 32 registers) and, per query, runs HT independent m16n8k16 chains (8 heads each) over the key
// length; relu, the head weights and the sum over heads follow in registers and two shuffles.
#include <cuda_bf16.h>

#include "block_ops.cuh"
#include "common.cuh"
#include "mma_ops.cuh"
#include "row_warp.cuh"

namespace ds4gpu {
namespace {

constexpr int IX_DI = 128;          // key length (every DeepSeek V4 shape); the launcher rejects others
constexpr int IX_QT = 4;            // queries per CTA
constexpr int IX_WARPS = 4;
constexpr int IX_ROW = IX_DI + 8;   // padded q row in bf16: 68 words, so rows g = 0..7 start in distinct banks

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x = lo: the lower address
  return *reinterpret_cast<const uint32_t*>(&v);
}

// HT = heads / 8
template <int HT>
__global__ void __launch_bounds__(IX_WARPS * 32) index_scores_kernel(const float* __restrict__ q,
                                                                    const float* __restrict__ w,
                                                                    const __nv_bfloat16* __restrict__ keys, int n, int T,
                                                                    const int64_t* __restrict__ n_vis,
                                                                    float* __restrict__ scores) {
  constexpr int HI = HT * 8;
  extern __shared__ __align__(16) unsigned char ix_smem[];
  __nv_bfloat16* q_s = reinterpret_cast<__nv_bfloat16*>(ix_smem);           // [QT][HI][IX_ROW]
  float* w_s = reinterpret_cast<float*>(q_s + IX_QT * HI * IX_ROW);          // [QT][HI]
  __shared__ int vis_s[IX_QT];
  pdl_begin();
  const int t0 = blockIdx.x * IX_QT;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;

  // stage q (float32 -> bfloat16: exact under the QAT) and w; queries past T are zeros
  for (int i = threadIdx.x; i < IX_QT * HI * (IX_DI / 4); i += blockDim.x) {
    const int qi = i / (HI * (IX_DI / 4)), rest = i % (HI * (IX_DI / 4));
    const int h = rest / (IX_DI / 4), d4 = rest % (IX_DI / 4);
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (t0 + qi < T) v = reinterpret_cast<const float4*>(q + ((int64_t)(t0 + qi) * HI + h) * IX_DI)[d4];
    uint32_t* dst = reinterpret_cast<uint32_t*>(q_s + (qi * HI + h) * IX_ROW + 4 * d4);
    dst[0] = pack_bf16(v.x, v.y);
    dst[1] = pack_bf16(v.z, v.w);
  }
  for (int i = threadIdx.x; i < IX_QT * HI; i += blockDim.x) {
    const int qi = i / HI;
    w_s[i] = t0 + qi < T ? w[(int64_t)(t0 + qi) * HI + i % HI] : 0.f;
  }
  if (threadIdx.x < IX_QT) {
    const int t = t0 + threadIdx.x;
    vis_s[threadIdx.x] = t < T ? (int)(n_vis[t] < (int64_t)n ? n_vis[t] : (int64_t)n) : 0;
  }
  __syncthreads();
  int max_vis = 0;
#pragma unroll
  for (int qi = 0; qi < IX_QT; ++qi) max_vis = max(max_vis, vis_s[qi]);

  for (int k0 = warp * 16; k0 < n; k0 += IX_WARPS * 16) {
    const int r0 = k0 + g, r1 = k0 + g + 8;
    if (k0 >= max_vis) {  // no query of this CTA sees these keys
      if (c == 0) {
#pragma unroll
        for (int qi = 0; qi < IX_QT; ++qi) {
          if (t0 + qi >= T) break;
          float* out = scores + (int64_t)(t0 + qi) * n;
          if (r0 < n) out[r0] = -INFINITY;
          if (r1 < n) out[r1] = -INFINITY;
        }
      }
      continue;
    }
    // A fragments: keys r0 / r1, columns ks*16 + 2c (+1) and + 8 (+9); keys past n are zeros
    uint32_t a[IX_DI / 16][4];
    const uint32_t* k0p = reinterpret_cast<const uint32_t*>(keys + (int64_t)min(r0, n - 1) * IX_DI);
    const uint32_t* k1p = reinterpret_cast<const uint32_t*>(keys + (int64_t)min(r1, n - 1) * IX_DI);
#pragma unroll
    for (int ks = 0; ks < IX_DI / 16; ++ks) {
      a[ks][0] = r0 < n ? __ldg(k0p + ks * 8 + c) : 0u;
      a[ks][1] = r1 < n ? __ldg(k1p + ks * 8 + c) : 0u;
      a[ks][2] = r0 < n ? __ldg(k0p + ks * 8 + 4 + c) : 0u;
      a[ks][3] = r1 < n ? __ldg(k1p + ks * 8 + 4 + c) : 0u;
    }
#pragma unroll 1
    for (int qi = 0; qi < IX_QT; ++qi) {
      if (t0 + qi >= T) break;
      float acc[HT][4];
#pragma unroll
      for (int ht = 0; ht < HT; ++ht) acc[ht][0] = acc[ht][1] = acc[ht][2] = acc[ht][3] = 0.f;
      const uint32_t* qrow = reinterpret_cast<const uint32_t*>(q_s + (qi * HI + g) * IX_ROW);
#pragma unroll
      for (int ks = 0; ks < IX_DI / 16; ++ks) {
#pragma unroll
        for (int ht = 0; ht < HT; ++ht) {  // B = q^T: column n = head 8 ht + g, rows = key columns
          const uint32_t* qh = qrow + ht * 8 * (IX_ROW / 2) + ks * 8 + c;
          mma_bf16(acc[ht], a[ks], qh[0], qh[4]);
        }
      }
      // acc[ht]: [0], [1] = key r0 with heads 8 ht + 2c, + 1; [2], [3] = key r1, same heads
      const float* wq = w_s + qi * HI;
      float s0 = 0.f, s1 = 0.f;
#pragma unroll
      for (int ht = 0; ht < HT; ++ht) {
        const float w0 = wq[8 * ht + 2 * c], w1 = wq[8 * ht + 2 * c + 1];
        s0 += w0 * fmaxf(acc[ht][0], 0.f) + w1 * fmaxf(acc[ht][1], 0.f);
        s1 += w0 * fmaxf(acc[ht][2], 0.f) + w1 * fmaxf(acc[ht][3], 0.f);
      }
      s0 += __shfl_xor_sync(0xffffffffu, s0, 1);
      s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
      s0 += __shfl_xor_sync(0xffffffffu, s0, 2);
      s1 += __shfl_xor_sync(0xffffffffu, s1, 2);
      if (c == 0) {
        float* out = scores + (int64_t)(t0 + qi) * n;
        const int vis = vis_s[qi];
        if (r0 < n) out[r0] = r0 < vis ? s0 : -INFINITY;
        if (r1 < n) out[r1] = r1 < vis ? s1 : -INFINITY;
      }
    }
  }
}

template <int HT>
void launch_ht(const float* q, const float* w, const __nv_bfloat16* keys, int n, int T, const int64_t* n_vis,
               float* scores, cudaStream_t s) {
  const size_t smem = (size_t)IX_QT * HT * 8 * (IX_ROW * sizeof(__nv_bfloat16) + sizeof(float));
  static bool attr = false;  // per instantiation, once
  if (!attr) {
    DS4_CHECK(cudaFuncSetAttribute(index_scores_kernel<HT>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    attr = true;
  }
  launch_k(index_scores_kernel<HT>, dim3((T + IX_QT - 1) / IX_QT), dim3(IX_WARPS * 32), smem, s, q, w, keys, n, T,
           n_vis, scores);
}

}  // namespace

bool index_scores_takes(int Hi, int di) { return di == IX_DI && Hi % 8 == 0 && Hi >= 8 && Hi <= 64; }

void launch_index_scores(const float* q, const float* w, const __nv_bfloat16* keys, int n, int T, int Hi, int di,
                         const int64_t* n_vis, float* scores, cudaStream_t s) {
  if (!index_scores_takes(Hi, di))
    throw std::invalid_argument("index_scores: needs key length 128 and 8..64 heads in multiples of 8, got " +
                                std::to_string(Hi) + " x " + std::to_string(di));
  if (n < 1 || T < 1) throw std::invalid_argument("index_scores: needs n >= 1 keys and T >= 1 queries");
  switch (Hi / 8) {
    case 1: launch_ht<1>(q, w, keys, n, T, n_vis, scores, s); break;
    case 2: launch_ht<2>(q, w, keys, n, T, n_vis, scores, s); break;
    case 3: launch_ht<3>(q, w, keys, n, T, n_vis, scores, s); break;
    case 4: launch_ht<4>(q, w, keys, n, T, n_vis, scores, s); break;
    case 5: launch_ht<5>(q, w, keys, n, T, n_vis, scores, s); break;
    case 6: launch_ht<6>(q, w, keys, n, T, n_vis, scores, s); break;
    case 7: launch_ht<7>(q, w, keys, n, T, n_vis, scores, s); break;
    default: launch_ht<8>(q, w, keys, n, T, n_vis, scores, s); break;
  }
  DS4_CHECK_LAUNCH("index_scores");
}

// ---- decode: the keys of one query (the decode token) against every compressed row ----------------------------

namespace {

// Indexer keys for decode: score[c] = sum_h w_h scale relu(q_h . idx_c) for visible rows, as doubles
// minus c * 1e-300 (lowest index first among ties, as the torch path), -inf for rows not yet visible.
// One warp per row; lane l owns heads l, l + 32, ... (q in shared memory, rows padded by one float
// so the lanes' reads of one column fall in different banks).
__global__ void index_keys_kernel(const float* q, const float* w, const float* idx, int n_rows, int Hi, int di,
                                  const int64_t* pos, int ratio, float scale, double* keys) {
  pdl_begin();
  extern __shared__ float sh[];
  float* qs = sh;                          // [Hi][di + 1]
  float* rows = sh + Hi * (di + 1);        // [warps][di]
  for (int i = threadIdx.x; i < Hi * di; i += blockDim.x) qs[(i / di) * (di + 1) + i % di] = q[i];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
  const int c = blockIdx.x * nw + warp;
  float* row = rows + warp * di;
  if (c < n_rows)
    for (int i = lane; i < di; i += 32) row[i] = idx[(int64_t)c * di + i];
  __syncthreads();
  if (c >= n_rows) return;
  const int64_t n_vis = (*pos + 1) / ratio;
  if (c >= n_vis) {
    if (lane == 0) keys[c] = -INFINITY;
    return;
  }
  float total = 0.0f;
  for (int h = lane; h < Hi; h += 32) {
    const float* qh = qs + h * (di + 1);
    float s0 = 0.0f, s1 = 0.0f;
    for (int i = 0; i < di; i += 2) {
      s0 += qh[i] * row[i];
      s1 += qh[i + 1] * row[i + 1];
    }
    total += w[h] * scale * fmaxf(s0 + s1, 0.0f);
  }
  total = warp_sum_f(total);
  if (lane == 0) keys[c] = (double)total - (double)c * 1e-300;
}

// Indexer keys for decode, v16 form (DS4_GPU_INDEX_KEYS=2; di == 128, Hi a multiple of 32 up to 64): the same
// scores with lanes over the dims. Lane l holds row dims 4l..4l+3 in registers and forms the partial dot of every
// head with one 16-byte shared read and four FMAs; a transposing butterfly (16 + 8 + 4 + 2 + 1 shuffles for 32
// heads) leaves head h's full dot on lane h % 32. The v3 form's lane walked two 128-long dependent chains per row.
// post.qat or post.freq: q is the raw query (the indexer's q_b product) and each block applies norm_rope's RoPE and
// Hadamard + FP4 rows while staging it (warp_row_post: the block kernel's bits), so that launch is gone.
// Scores sum in another order than index_keys_kernel: other last bits, the same meaning.
constexpr int IK2_DI = 128, IK2_MAX_H = 64, IK2_ROWS = 8;
// One step of the transposing butterfly: lanes with bit O set keep the upper O values, the others the lower O, each
// adding its partner's copy of the half it keeps (O a compile-time constant: the values stay in registers).
template <int O>
__device__ __forceinline__ void ik2_fold(float (&d)[32], int lane) {
  const bool upper = lane & O;
#pragma unroll
  for (int i = 0; i < O; ++i) {
    const float send = upper ? d[i] : d[i + O];
    const float keep = upper ? d[i + O] : d[i];
    d[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
  }
}
__global__ void __launch_bounds__(256) index_keys_v2_kernel(const float* q, const float* w, const float* idx,
                                                             int n_rows, int Hi, const int64_t* pos, int ratio,
                                                             float scale, RowPost post, double* keys, bool pre) {
  __shared__ __align__(16) float qs[IK2_MAX_H * IK2_DI];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const bool has_post = post.qat || post.freq;
  const int c = blockIdx.x * IK2_ROWS + warp;
  // pre ($DS4_GPU_PREWAIT=2): before the wait, the position (written before the step's graph starts) and this warp's
  // compressed key row, unless it is the row this step's compressor pools (the last visible one on a pooling step):
  // the others were written by earlier steps. The same values, so the same bits.
  pdl_trigger();
  int64_t p = pre ? *pos : 0;
  float4 r = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  bool have_r = false;
  if (pre && c < n_rows && c < (p + 1) / ratio && !((p + 1) % ratio == 0 && c == (p + 1) / ratio - 1)) {
    r = __ldg((const float4*)(idx + (int64_t)c * IK2_DI) + lane);
    have_r = true;
  }
  pdl_wait();
  if (!pre) p = *pos;
  // A block whose rows are all past the visible ones writes their -inf and stops before staging the query (v34: a
  // decode graph sized for a 32k session at position 2048 ran 1026 blocks for 65 blocks of visible rows).
  if ((int64_t)blockIdx.x * IK2_ROWS >= (p + 1) / ratio) {
    if (lane == 0 && c < n_rows) keys[c] = -INFINITY;
    return;
  }
  float wv[IK2_MAX_H / 32];  // the heads' weights (this step's), loaded with q instead of inside the head loop
#pragma unroll
  for (int i = 0; i < IK2_MAX_H / 32; ++i) wv[i] = pre && 32 * i + lane < Hi ? w[32 * i + lane] : 0.0f;
  for (int h = warp; h < Hi; h += 8) {  // stage (and post-process) one head row per warp
    float v[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = q[h * IK2_DI + lane + 32 * k];
    if (has_post) warp_row_post<4>(v, IK2_DI, lane, post, (float)p);
#pragma unroll
    for (int k = 0; k < 4; ++k) qs[h * IK2_DI + lane + 32 * k] = v[k];
  }
  if (c < n_rows && !have_r) r = __ldg((const float4*)(idx + (int64_t)c * IK2_DI) + lane);
  __syncthreads();
  if (c >= n_rows) return;
  const int64_t n_vis = (p + 1) / ratio;
  if (c >= n_vis) {
    if (lane == 0) keys[c] = -INFINITY;
    return;
  }
  float total = 0.0f;
  for (int h0 = 0; h0 < Hi; h0 += 32) {
    float d[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const float4 a = ((const float4*)(qs + (h0 + i) * IK2_DI))[lane];
      d[i] = fmaf(a.w, r.w, fmaf(a.z, r.z, fmaf(a.y, r.y, a.x * r.x)));
    }
    ik2_fold<16>(d, lane);
    ik2_fold<8>(d, lane);
    ik2_fold<4>(d, lane);
    ik2_fold<2>(d, lane);
    ik2_fold<1>(d, lane);
    const int h = h0 + lane;  // d[0] is head h's dot over all 128 dims
    float wh = w[0];
    if (pre) {
#pragma unroll
      for (int i = 0; i < IK2_MAX_H / 32; ++i)  // a select, not an index: wv stays in registers
        if (i == h0 / 32) wh = wv[i];
    } else {
      wh = w[h];
    }
    total += wh * scale * fmaxf(d[0], 0.0f);
  }
  total = warp_sum_f(total);
  if (lane == 0) keys[c] = (double)total - (double)c * 1e-300;
}

}  // namespace

bool index_keys_v2_takes(int Hi, int di) { return di == IK2_DI && Hi % 32 == 0 && Hi <= IK2_MAX_H; }

void launch_index_keys_v2(const float* q, const float* w, const float* idx, int n_rows, int Hi, int di,
                          const int64_t* pos, int ratio, float scale, const RowPost& post, double* keys, cudaStream_t s) {
  if (!index_keys_v2_takes(Hi, di)) throw std::invalid_argument("index_keys v2: needs di 128 and Hi a multiple of 32 <= 64");
  if (post.norm || post.fp8_nope || post.inverse) throw std::invalid_argument("index_keys v2: post is RoPE and QAT only");
  if (!pos) throw std::invalid_argument("index_keys v2: needs the position");
  launch_k(index_keys_v2_kernel, dim3((n_rows + IK2_ROWS - 1) / IK2_ROWS), dim3(256), 0, s, q, w, idx, n_rows, Hi, pos,
           ratio, scale, post, keys, prewait_mode() >= 2);
  DS4_CHECK_LAUNCH("index_keys_v2");
}

void launch_index_keys(const float* q, const float* w, const float* idx, int n_rows, int Hi, int di,
                       const int64_t* pos, int ratio, float scale, double* keys, cudaStream_t s) {
  if (di % 2 || di > 512) throw std::invalid_argument("index_keys: indexer dim must be even, <= 512");
  size_t shm = (size_t)(Hi * (di + 1) + 8 * di) * sizeof(float);
  static size_t shm_set = 0;
  if (shm > 48 * 1024 && shm > shm_set) {
    DS4_CHECK(cudaFuncSetAttribute(index_keys_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shm));
    shm_set = shm;
  }
  launch_k(index_keys_kernel, dim3((n_rows + 7) / 8), dim3(256), shm, s, q, w, idx, n_rows, Hi, di, pos, ratio, scale,
           keys);
  DS4_CHECK_LAUNCH("index_keys");
}

}  // namespace ds4gpu
