// The compressors' pooling over a prefill chunk in one launch (prefill.compress_chunk with $DS4_GPU_COMP_POOL=1, v31).
//
// The torch form builds the sequence (the frontier's live rows, then the chunk's kv and scores), rescales the GEMM
// products, adds the APE rows, concatenates each window's candidates, and runs softmax, multiply and sum over them:
// ~11 launches over [T, width] float32 per compressor (~0.3 ms per ratio-4 layer at 8192 tokens, v30's profile).
// Here every output column of every finished window reads its candidates straight from the GEMM products (times their
// per-row rescale, plus the APE row: the bits of the torch elementwise ops) or from the frontier, once.
//
// Sequence row k is position pos0 - off + k (its APE row is k % r); rows k < off are the frontier's live rows
// live0 + k, the rest chunk row k - off. Window w holds rows [w r, (w + 1) r). Ratio 4 (the overlapping windows):
// column j's 8 candidates are the first-half column j of the previous window's 4 rows (window -1: the frontier's rows
// 0-3) and the second-half column d + j of the window's own, pooled with the decode step's expressions (fused.cu);
// other ratios: column j of the window's r rows, split over 8 warps as pool_wide does (max, sum e, sum kv e per warp,
// combined rescaled to the common max; A / S).
#include "common.cuh"

namespace ds4gpu {

namespace {

struct ChunkPool {
  const float* kv;    // [T, width] the kv product (unscaled when kv_r is given)
  const float* kv_r;  // [T] its per-row rescale, or null
  const float* sc;    // [T, width] the score product (unscaled when sc_r is given), without the APE
  const float* sc_r;  // [T] or null
  const float* ape;   // [r, width]
  const float* s_kv;  // the frontier [rows, width] (its scores include the APE)
  const float* s_sc;
  float* out;  // [n_full, d]
  int width, d, r, off, live0;
};

// kv and score of sequence row k at column c
__device__ __forceinline__ void seq_load(const ChunkPool& p, int64_t k, int c, float& kv, float& sc) {
  if (k < p.off) {
    const int64_t at = (p.live0 + k) * p.width + c;
    kv = p.s_kv[at];
    sc = p.s_sc[at];
    return;
  }
  const int64_t t = k - p.off, at = t * p.width + c;
  kv = p.kv[at];
  sc = p.sc[at];
  if (p.kv_r) kv = __fmul_rn(kv, p.kv_r[t]);
  if (p.sc_r) sc = __fmul_rn(sc, p.sc_r[t]);
  sc = __fadd_rn(sc, p.ape[(k % p.r) * p.width + c]);
}

// ratio 4: thread per (window blockIdx.x, column j)
__global__ void __launch_bounds__(128) pool_r4_kernel(ChunkPool p) {
  const int j = blockIdx.y * blockDim.x + threadIdx.x;
  const int64_t w = blockIdx.x;
  if (j >= p.d) return;
  float sc8[8], kv8[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (w == 0) {
      kv8[i] = p.s_kv[(int64_t)i * p.width + j];
      sc8[i] = p.s_sc[(int64_t)i * p.width + j];
    } else {
      seq_load(p, 4 * (w - 1) + i, j, kv8[i], sc8[i]);
    }
    seq_load(p, 4 * w + i, p.d + j, kv8[4 + i], sc8[4 + i]);
  }
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < 8; ++i) mx = fmaxf(mx, sc8[i]);
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) sum += expf(sc8[i] - mx);
  float acc = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) acc += kv8[i] * (expf(sc8[i] - mx) / sum);
  p.out[w * p.d + j] = isfinite(acc) ? acc : 0.0f;
}

// other ratios: block per (window blockIdx.x, 32 columns blockIdx.y), warp q takes candidates q, q + 8, ...
constexpr int POOL_WARPS = 8;
__global__ void __launch_bounds__(32 * POOL_WARPS) pool_wide_kernel(ChunkPool p) {
  __shared__ float part[3][POOL_WARPS][32];  // [m, sum e, sum kv e][warp][lane]
  const int lane = threadIdx.x & 31, q = threadIdx.x >> 5;
  const int j = blockIdx.y * 32 + lane;
  const int64_t k0 = (int64_t)blockIdx.x * p.r;
  float m = -INFINITY, s = 0.0f, a = 0.0f;
  if (j < p.d) {
    float kv, sc;
    for (int i = q; i < p.r; i += POOL_WARPS) {
      seq_load(p, k0 + i, j, kv, sc);
      m = fmaxf(m, sc);
    }
    for (int i = q; i < p.r; i += POOL_WARPS) {
      seq_load(p, k0 + i, j, kv, sc);
      const float e = expf(sc - m);
      s += e;
      a += kv * e;
    }
  }
  part[0][q][lane] = m;
  part[1][q][lane] = s;
  part[2][q][lane] = a;
  __syncthreads();
  if (q != 0 || j >= p.d) return;
  float M = -INFINITY;
#pragma unroll
  for (int u = 0; u < POOL_WARPS; ++u) M = fmaxf(M, part[0][u][lane]);
  float S = 0.0f, A = 0.0f;
#pragma unroll
  for (int u = 0; u < POOL_WARPS; ++u) {
    const float mu = part[0][u][lane];
    const float f = mu == -INFINITY ? 0.0f : expf(mu - M);  // a warp without finite candidates adds nothing
    S += part[1][u][lane] * f;
    A += part[2][u][lane] * f;
  }
  const float v = A / S;
  p.out[blockIdx.x * (int64_t)p.d + j] = isfinite(v) ? v : 0.0f;
}

}  // namespace

bool comp_pool_takes(int r, int width) { return r >= 2 && width > 0 && (r != 4 || width % 2 == 0); }

void launch_comp_pool_chunk(const float* kv, const float* kv_r, const float* sc, const float* sc_r, const float* ape,
                            const float* s_kv, const float* s_sc, int width, int r, int off, int live0, int64_t n_full,
                            float* out, cudaStream_t stream) {
  if (!comp_pool_takes(r, width) || off < 0 || off >= r || live0 < 0)
    throw std::invalid_argument("comp_pool_chunk: ratio >= 2, an even width at ratio 4, 0 <= off < ratio");
  if (n_full <= 0) return;
  if (n_full > 0x7fffffff) throw std::invalid_argument("comp_pool_chunk: too many windows");
  ChunkPool p{kv, kv_r, sc, sc_r, ape, s_kv, s_sc, out, width, r == 4 ? width / 2 : width, r, off, live0};
  if (r == 4) {
    pool_r4_kernel<<<dim3((unsigned)n_full, (unsigned)((p.d + 127) / 128)), 128, 0, stream>>>(p);
    DS4_CHECK_LAUNCH("pool_r4_kernel");
  } else {
    pool_wide_kernel<<<dim3((unsigned)n_full, (unsigned)((p.d + 31) / 32)), 32 * POOL_WARPS, 0, stream>>>(p);
    DS4_CHECK_LAUNCH("pool_wide_kernel");
  }
}

}  // namespace ds4gpu
