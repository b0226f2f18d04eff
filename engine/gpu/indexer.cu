// Prefill scores of the lightning indexer (model-spec 3.6) on the bfloat16 tensor cores:
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

#include "common.cuh"

namespace ds4gpu {
namespace {

constexpr int IX_DI = 128;          // key length (every DeepSeek V4 shape); the launcher rejects others
constexpr int IX_QT = 4;            // queries per CTA
constexpr int IX_WARPS = 4;
constexpr int IX_ROW = IX_DI + 8;   // padded q row in bf16: 68 words, so rows g = 0..7 start in distinct banks

__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

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

}  // namespace ds4gpu
