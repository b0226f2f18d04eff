// Resident quantized rows -> f16 rows, the operand of the prefill GEMMs (tensor cores need a float
// type; prefill multiplies each weight by thousands of tokens, so writing it out once per chunk costs
// little next to the products). The decode is the matvec kernels' own (load_xb / decode_xb of
// mv_core.cuh), so the device layout is read one way only:
//   element j of an x block = dscale * mul_h * code_j - min_h,  h = j / 16,
// with signed int8 codes for Q8_0 and IQ2_XXS and unsigned ones for the K-quants.
// A quantized weight needs up to ~22 significant bits (an f16 scale times a small integer), f16 has 11:
// with `lo`, the value times `scale` is written as hi + lo (two f16s, ~22 bits), so a GEMM split in
// hi/lo parts reproduces the float32 product; `scale` (a power of two) keeps lo out of f16 subnormals.
#include <cuda_fp8.h>

#include <cstdlib>

#include "mv_core.cuh"

namespace ds4gpu {

constexpr int DQ_THREADS = 256;

// Stores one warp's 32 x blocks (64 B per lane) through shared memory, so that consecutive lanes write
// consecutive 16-byte words: each store instruction covers 512 contiguous bytes when the warp's blocks
// are adjacent in the row (a lane writing its own 64 B spread every instruction over 2 KB).
__device__ __forceinline__ void warp_store_blocks(uint4* stage, const uint32_t (&bits)[16], __half* out, int64_t dst,
                                                  bool valid) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int q = 0; q < 4; ++q) stage[4 * lane + q] = make_uint4(bits[4 * q], bits[4 * q + 1], bits[4 * q + 2], bits[4 * q + 3]);
  __syncwarp();
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int word = 32 * q + lane, src = word >> 2, part = word & 3;
    const int64_t at = __shfl_sync(0xffffffffu, dst, src);
    const bool ok = __shfl_sync(0xffffffffu, valid, src);
    if (ok) *reinterpret_cast<uint4*>(out + at + 8 * part) = stage[word];
  }
  __syncwarp();
}

// block_map (prefill's routed experts): output rows come in blocks of block_rows (one expert's matrix), and output
// block b is the weight's block block_map[b] (clamped into range), so the experts a chunk uses are written busiest
// first, adjacent, in the order its grouped GEMMs take them; null: rows row0.. in order.
// b8 (DS4_GPU_DEQUANT_FP8): also the float8 operand of fp8_split's correction GEMM, rows of 2 ncols bytes: [lo 2^11 k |
// hi k] with k = *kp (the weight's scale on the device), as pack_fp8 packs the two planes (the same conversions, so the
// same bytes), without writing lo and reading both planes back.
__device__ __forceinline__ uint32_t fp8x4(uint32_t h01, uint32_t h23, float sc) {
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&h01));
  const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&h23));
  const uint32_t p0 = __nv_cvt_float2_to_fp8x2(make_float2(a.x * sc, a.y * sc), __NV_SATFINITE, __NV_E4M3);
  const uint32_t p1 = __nv_cvt_float2_to_fp8x2(make_float2(b.x * sc, b.y * sc), __NV_SATFINITE, __NV_E4M3);
  return p0 | (p1 << 16);
}

template <int QT>
__global__ void __launch_bounds__(DQ_THREADS) dequant_kernel(Packed w, int64_t row0, int64_t nrows, __half* out,
                                                             __half* lo_out, int64_t ld, float scale,
                                                             const int32_t* block_map, int64_t block_rows,
                                                             uint8_t* b8 = nullptr, const float* kp = nullptr) {
  __shared__ unsigned long long grid[256];
  __shared__ uint4 stage[DQ_THREADS / 32][128];
  if constexpr (QT == QT_IQ2_XXS) {
    iq2_tables_init(grid);
    __syncthreads();
  }
  const int nxb = (int)(w.ncols / 32), nb = (int)(w.ncols / 256);
  const int64_t i = blockIdx.x * (int64_t)DQ_THREADS + threadIdx.x;
  const bool valid = i < nrows * nxb;
  const int64_t r = valid ? i / nxb : 0;
  const int xb = valid ? (int)(i % nxb) : 0;
  int64_t src = row0 + r;
  if (block_map) {
    const int64_t blk = r / block_rows, n_blocks = w.nrows / block_rows;
    const int64_t from = min(max((int64_t)block_map[blk], (int64_t)0), n_blocks - 1);
    src = from * block_rows + (r - blk * block_rows);
  }
  const uint8_t* qrow = w.qs + src * w.qs_row;
  const uint8_t* srow = w.sc + src * w.sc_row;
  RawXb raw;
  load_xb<QT, false>(qrow, srow, xb, nb, raw);
  XbCodes c;
  decode_xb<QT>(raw, Iq2Tables{grid}, c);
  constexpr bool is_signed = QT == QT_Q8_0 || QT == QT_IQ2_XXS;
  uint32_t hi_bits[16], lo_bits[16];
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const float mul = c.dscale * (float)(k < 4 ? c.mul0 : c.mul1);
    const float mn = k < 4 ? c.min0 : c.min1;
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      float v[2];
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        const uint32_t byte = (c.c[k] >> (16 * p + 8 * b)) & 255u;
        const int code = is_signed ? (int)(int8_t)byte : (int)byte;
        v[b] = (mul * (float)code - mn) * scale;
      }
      const __half2 h = __floats2half2_rn(v[0], v[1]);
      const float2 hf = __half22float2(h);
      const __half2 l = __floats2half2_rn(v[0] - hf.x, v[1] - hf.y);
      hi_bits[2 * k + p] = *reinterpret_cast<const uint32_t*>(&h);
      lo_bits[2 * k + p] = *reinterpret_cast<const uint32_t*>(&l);
    }
  }
  const int64_t dst = r * ld + 32 * (int64_t)xb;
  uint4* st = stage[threadIdx.x / 32];
  warp_store_blocks(st, hi_bits, out, dst, valid);
  if (lo_out) warp_store_blocks(st, lo_bits, lo_out, dst, valid);
  if (b8 && valid) {
    const float k = *kp, s_lo = 2048.0f * k;
    uint32_t q_lo[8], q_hi[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      q_lo[j] = fp8x4(lo_bits[2 * j], lo_bits[2 * j + 1], s_lo);
      q_hi[j] = fp8x4(hi_bits[2 * j], hi_bits[2 * j + 1], k);
    }
    uint8_t* row = b8 + r * 2 * w.ncols + 32 * (int64_t)xb;
    *reinterpret_cast<uint4*>(row) = make_uint4(q_lo[0], q_lo[1], q_lo[2], q_lo[3]);
    *reinterpret_cast<uint4*>(row + 16) = make_uint4(q_lo[4], q_lo[5], q_lo[6], q_lo[7]);
    *reinterpret_cast<uint4*>(row + w.ncols) = make_uint4(q_hi[0], q_hi[1], q_hi[2], q_hi[3]);
    *reinterpret_cast<uint4*>(row + w.ncols + 16) = make_uint4(q_hi[4], q_hi[5], q_hi[6], q_hi[7]);
  }
}

void launch_dequant(const Packed& w, int64_t row0, int64_t nrows, __half* out, __half* lo, int64_t ld, float scale,
                    cudaStream_t stream, const int32_t* block_map, int64_t block_rows, uint8_t* b8, const float* kp) {
  if (b8 && (!kp || block_map || w.qtype == QT_F16 || (uintptr_t)b8 % 16 || w.ncols % 16))
    throw std::invalid_argument("dequant: the float8 operand needs its scale, rows in order, a quantized weight and "
                                "16-byte aligned rows");
  if (block_map) {
    if (block_rows <= 0 || w.nrows % block_rows || nrows % block_rows || row0 != 0)
      throw std::invalid_argument("dequant: a block map needs row0 = 0 and rows in whole blocks of block_rows");
    if (w.qtype == QT_F16) throw std::invalid_argument("dequant: F16 rows take no block map");
  } else if (row0 < 0 || nrows < 0 || row0 + nrows > w.nrows) {
    throw std::invalid_argument("dequant: rows out of range");
  }
  if (ld < w.ncols || ld % 8) throw std::invalid_argument("dequant: ld must be >= ncols and a multiple of 8");
  if (nrows == 0) return;
  if (w.qtype == QT_F16) {  // already f16: a copy (exact, so no lo part and no scale)
    if (lo || scale != 1.0f) throw std::invalid_argument("dequant: F16 rows take no lo part and no scale");
    DS4_CHECK(cudaMemcpy2DAsync(out, (size_t)ld * 2, w.qs + row0 * w.qs_row, (size_t)w.qs_row, (size_t)w.ncols * 2,
                                (size_t)nrows, cudaMemcpyDeviceToDevice, stream));
    return;
  }
  const int64_t threads = nrows * (w.ncols / 32);
  const unsigned blocks = (unsigned)((threads + DQ_THREADS - 1) / DQ_THREADS);
  switch (w.qtype) {
    case QT_Q8_0: dequant_kernel<QT_Q8_0><<<blocks, DQ_THREADS, 0, stream>>>(w, row0, nrows, out, lo, ld, scale, block_map,
                                                                           block_rows, b8, kp); break;
    case QT_Q4_K: dequant_kernel<QT_Q4_K><<<blocks, DQ_THREADS, 0, stream>>>(w, row0, nrows, out, lo, ld, scale, block_map,
                                                                           block_rows, b8, kp); break;
    case QT_Q2_K: dequant_kernel<QT_Q2_K><<<blocks, DQ_THREADS, 0, stream>>>(w, row0, nrows, out, lo, ld, scale, block_map,
                                                                           block_rows, b8, kp); break;
    case QT_IQ2_XXS: dequant_kernel<QT_IQ2_XXS><<<blocks, DQ_THREADS, 0, stream>>>(w, row0, nrows, out, lo, ld, scale, block_map,
                                                                           block_rows, b8, kp); break;
    default: throw std::invalid_argument("dequant: quant type " + std::to_string(w.qtype) + " has no GPU kernel");
  }
  DS4_CHECK_LAUNCH("dequant_kernel");
}

}  // namespace ds4gpu

namespace ds4gpu {

// One CTA per row: s = max |x| (floored at 1e-30), hi = f16(x / s), lo = f16(x / s - hi): the activation
// operand of the prefill GEMMs in one pass (the torch chain abs/amax/div/cast/sub/cast took six).
constexpr int SPLIT_THREADS = 256;

// The row's scale from each thread's running max m: the block's max (warp butterflies, then the warps in order),
// floored at 1e-30. Every thread of the CTA calls it.
__device__ __forceinline__ float split_row_scale(float m, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if ((threadIdx.x & 31) == 0) red[threadIdx.x / 32] = m;
  __syncthreads();
  m = red[0];
#pragma unroll
  for (int w = 1; w < SPLIT_THREADS / 32; ++w) m = fmaxf(m, red[w]);
  return fmaxf(m, 1e-30f);
}

__device__ __forceinline__ float abs_max4(float m, const float4 v) {
  return fmaxf(m, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
}

// hi = f16(x / m), lo = f16(x / m - hi) of four values.
__device__ __forceinline__ void split4(const float4 x4, float m, __half (&h)[4], __half (&l)[4]) {
  const float v[4] = {x4.x / m, x4.y / m, x4.z / m, x4.w / m};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    h[j] = __float2half_rn(v[j]);
    l[j] = __float2half_rn(v[j] - __half2float(h[j]));
  }
}

// float4 i of the row: split4, stored as 8-byte half quads (lo: when not null).
__device__ __forceinline__ void split_store4(const float4 x4, float m, __half* hi, __half* lo, int64_t i) {
  __align__(8) __half h[4];
  __align__(8) __half l[4];
  split4(x4, m, h, l);
  reinterpret_cast<uint2*>(hi)[i] = *reinterpret_cast<const uint2*>(h);
  if (lo) reinterpret_cast<uint2*>(lo)[i] = *reinterpret_cast<const uint2*>(l);
}

// V4: rows of n % 4 == 0 in float4 loads and 8-byte half stores (the same values; v1-v11 read one float per thread).
template <bool V4>
__global__ void __launch_bounds__(SPLIT_THREADS) split_half_kernel(const float* x, int64_t n, __half* hi, __half* lo,
                                                                  float* s) {
  __shared__ float red[SPLIT_THREADS / 32];
  const int64_t row = blockIdx.x;
  const float* xr = x + row * n;
  float m = 0.0f;
  if constexpr (V4) {
    for (int64_t i = threadIdx.x; i < n / 4; i += SPLIT_THREADS) m = abs_max4(m, reinterpret_cast<const float4*>(xr)[i]);
  } else {
    for (int64_t i = threadIdx.x; i < n; i += SPLIT_THREADS) m = fmaxf(m, fabsf(xr[i]));
  }
  m = split_row_scale(m, red);
  if constexpr (V4) {
    for (int64_t i = threadIdx.x; i < n / 4; i += SPLIT_THREADS)
      split_store4(reinterpret_cast<const float4*>(xr)[i], m, hi + row * n, lo ? lo + row * n : nullptr, i);
  } else {
    for (int64_t i = threadIdx.x; i < n; i += SPLIT_THREADS) {
      const float v = xr[i] / m;
      const __half h = __float2half_rn(v);
      hi[row * n + i] = h;
      if (lo) lo[row * n + i] = __float2half_rn(v - __half2float(h));
    }
  }
  if (threadIdx.x == 0) s[row] = m;
}

// v13: rows of up to SPLIT_CACHE float4s per thread (n <= 8192) read once: the values stay in registers between the
// row's max and its split (the v4 form reads the row twice). The same per-thread order, so the same bits.
constexpr int SPLIT_CACHE = 8;
__global__ void __launch_bounds__(SPLIT_THREADS) split_half_cached_kernel(const float* x, int64_t n, __half* hi,
                                                                         __half* lo, float* s) {
  __shared__ float red[SPLIT_THREADS / 32];
  const int64_t row = blockIdx.x;
  const float4* xr = reinterpret_cast<const float4*>(x + row * n);
  const int n4 = (int)(n / 4);
  float4 v[SPLIT_CACHE];
#pragma unroll
  for (int c = 0; c < SPLIT_CACHE; ++c) {
    const int i = threadIdx.x + c * SPLIT_THREADS;
    v[c] = i < n4 ? xr[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  float m = 0.0f;
#pragma unroll
  for (int c = 0; c < SPLIT_CACHE; ++c) m = abs_max4(m, v[c]);
  m = split_row_scale(m, red);
#pragma unroll
  for (int c = 0; c < SPLIT_CACHE; ++c) {
    const int i = threadIdx.x + c * SPLIT_THREADS;
    if (i >= n4) break;
    split_store4(v[c], m, hi + row * n, lo ? lo + row * n : nullptr, i);
  }
  if (threadIdx.x == 0) s[row] = m;
}

void launch_split_half(const float* x, int64_t rows, int64_t n, __half* hi, __half* lo, float* s, cudaStream_t stream) {
  if (rows <= 0 || n <= 0) return;
  const bool v4 = n % 4 == 0 && (uintptr_t)x % 16 == 0 && (uintptr_t)hi % 8 == 0 && (uintptr_t)lo % 8 == 0;
  static const bool cached = [] {  // $DS4_GPU_SPLIT_CACHE=0: the v12 kernel (an A/B switch, read once)
    const char* e = std::getenv("DS4_GPU_SPLIT_CACHE");
    return !(e && *e && std::atoi(e) == 0);
  }();
  if (v4 && cached && n <= 4 * SPLIT_CACHE * SPLIT_THREADS)
    split_half_cached_kernel<<<(unsigned)rows, SPLIT_THREADS, 0, stream>>>(x, n, hi, lo, s);
  else if (v4) split_half_kernel<true><<<(unsigned)rows, SPLIT_THREADS, 0, stream>>>(x, n, hi, lo, s);
  else split_half_kernel<false><<<(unsigned)rows, SPLIT_THREADS, 0, stream>>>(x, n, hi, lo, s);
  DS4_CHECK_LAUNCH("split_half_kernel");
}

// Four float16 values times scale as e4m3 bytes in order (pack_fp8's conversion).
__device__ __forceinline__ uint32_t fp8x4(const __half (&h)[4], float scale) {
  const uint32_t p0 = __nv_cvt_float2_to_fp8x2(make_float2(__half2float(h[0]) * scale, __half2float(h[1]) * scale),
                                               __NV_SATFINITE, __NV_E4M3);
  const uint32_t p1 = __nv_cvt_float2_to_fp8x2(make_float2(__half2float(h[2]) * scale, __half2float(h[3]) * scale),
                                               __NV_SATFINITE, __NV_E4M3);
  return p0 | (p1 << 16);
}

// A grouped product's output y [G, T, n] (float32, row t of group g at (g T + t) n) rescaled per (row, group) by
// r [T, G] and split for the next product in one pass (v26, Weights.mm_split_then): row t of x = [y[0, t] r[t, 0] |
// .. | y[G-1, t] r[t, G-1]] (n G values, the torch product's bits), then s[t] = max |x| (floored at 1e-30), hi =
// f16(x / s) and lo = f16(x / s - hi) as split_half_cached_kernel computes them (the same bits as to_half of the
// rescaled rows); a8 != null instead of lo: [hi 2^8 | lo 2^19] e4m3 (pack_fp8's values) at a8 + t 2 G n. One CTA per
// row; up to SPLIT_CACHE float4s per thread (G n <= 8192).
__global__ void __launch_bounds__(SPLIT_THREADS) split_groups_kernel(const float* y, const float* r, int G, int64_t T,
                                                                    int n, __half* hi, __half* lo, uint8_t* a8,
                                                                    float* s) {
  __shared__ float red[SPLIT_THREADS / 32];
  const int64_t t = blockIdx.x;
  const int n4 = n / 4, w4 = G * n4;
  float4 v[SPLIT_CACHE];
#pragma unroll
  for (int c = 0; c < SPLIT_CACHE; ++c) {
    const int i = threadIdx.x + c * SPLIT_THREADS;
    v[c] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (i < w4) {
      const int g = i / n4, j = i - g * n4;
      const float4 a = reinterpret_cast<const float4*>(y + ((int64_t)g * T + t) * n)[j];
      const float k = r[t * G + g];
      v[c] = make_float4(__fmul_rn(a.x, k), __fmul_rn(a.y, k), __fmul_rn(a.z, k), __fmul_rn(a.w, k));
    }
  }
  float m = 0.0f;
#pragma unroll
  for (int c = 0; c < SPLIT_CACHE; ++c) m = abs_max4(m, v[c]);
  m = split_row_scale(m, red);
  const int64_t row = t * (int64_t)G * n;
#pragma unroll
  for (int c = 0; c < SPLIT_CACHE; ++c) {
    const int i = threadIdx.x + c * SPLIT_THREADS;
    if (i >= w4) break;
    if (!a8) {
      split_store4(v[c], m, hi + row, lo + row, i);
      continue;
    }
    __align__(8) __half h[4];
    __align__(8) __half l[4];
    split4(v[c], m, h, l);
    reinterpret_cast<uint2*>(hi + row)[i] = *reinterpret_cast<const uint2*>(h);
    uint8_t* o = a8 + 2 * row + 4 * (int64_t)i;  // then both parts as pack_fp8 converts them
    *reinterpret_cast<uint32_t*>(o) = fp8x4(h, 256.0f);
    *reinterpret_cast<uint32_t*>(o + (int64_t)G * n) = fp8x4(l, 524288.0f);
  }
  if (threadIdx.x == 0) s[t] = m;
}

void launch_split_groups(const float* y, const float* r, int G, int64_t T, int n, __half* hi, __half* lo, uint8_t* a8,
                         float* s, cudaStream_t stream) {
  if (G < 1 || n % 4 || (int64_t)G * n > 4 * SPLIT_CACHE * SPLIT_THREADS || (!lo == !a8) || (uintptr_t)y % 16 ||
      (uintptr_t)hi % 8 || (uintptr_t)lo % 8 || (uintptr_t)a8 % 4)
    throw std::invalid_argument("split_groups: n a multiple of 4, G n <= 8192, one of lo and a8, aligned planes");
  if (T <= 0) return;
  split_groups_kernel<<<(unsigned)T, SPLIT_THREADS, 0, stream>>>(y, r, G, T, n, hi, lo, a8, s);
  DS4_CHECK_LAUNCH("split_groups_kernel");
}

// fp8_split.py's operands in one pass (DS4_GPU_PREFILL_GEMM=fp8): rows of two float16 planes a, b (batch bt of
// rows, element (bt, r, c) at bt * sbt + r * ld + c) -> out [batch, rows, 2n] e4m3 = [a * sa * k | b * sb * k] with
// k = *kp (a device scalar: the weight's scale, computed on the device) or 1, rounded to nearest even with saturation
// (the scales keep every value below 448, so torch's non-saturating cast agrees). Eight elements per thread: 16-byte
// loads, 8-byte stores.
__device__ __forceinline__ uint2 fp8x8(uint4 h, float scale) {
  const __half2* h2 = reinterpret_cast<const __half2*>(&h);
  uint32_t w[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const float2 e01 = __half22float2(h2[2 * j]), e23 = __half22float2(h2[2 * j + 1]);
    const uint32_t p0 = __nv_cvt_float2_to_fp8x2(make_float2(e01.x * scale, e01.y * scale), __NV_SATFINITE, __NV_E4M3);
    const uint32_t p1 = __nv_cvt_float2_to_fp8x2(make_float2(e23.x * scale, e23.y * scale), __NV_SATFINITE, __NV_E4M3);
    w[j] = p0 | (p1 << 16);
  }
  return make_uint2(w[0], w[1]);
}

__global__ void pack_fp8_kernel(const __half* a, const __half* b, int64_t rows, int64_t n, int64_t ld, int64_t sbt,
                                float sa, float sb, const float* kp, uint8_t* out) {
  const int64_t n8 = n / 8, i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= rows * n8) return;
  if (kp) {
    const float k = *kp;
    sa *= k, sb *= k;
  }
  const int64_t bt = blockIdx.y, r = i / n8, c = 8 * (i % n8);
  const int64_t src = bt * sbt + r * ld + c;
  uint8_t* o = out + (bt * rows + r) * 2 * n + c;
  *reinterpret_cast<uint2*>(o) = fp8x8(*reinterpret_cast<const uint4*>(a + src), sa);
  *reinterpret_cast<uint2*>(o + n) = fp8x8(*reinterpret_cast<const uint4*>(b + src), sb);
}

void launch_pack_fp8(const __half* a, const __half* b, int64_t batch, int64_t rows, int64_t n, int64_t ld, int64_t sbt,
                     float sa, float sb, const float* kp, uint8_t* out, cudaStream_t stream) {
  if (n % 8 || ld % 8 || sbt % 8 || (uintptr_t)a % 16 || (uintptr_t)b % 16 || (uintptr_t)out % 8)
    throw std::invalid_argument("pack_fp8: n, ld and the batch stride must be multiples of 8, the planes 16-byte "
                                "aligned");
  if (batch <= 0 || rows <= 0 || batch > 65535) {
    if (batch == 0 || rows == 0) return;
    throw std::invalid_argument("pack_fp8: batch must be 1..65535");
  }
  const int64_t threads = rows * (n / 8);
  pack_fp8_kernel<<<dim3((unsigned)((threads + 255) / 256), (unsigned)batch), 256, 0, stream>>>(a, b, rows, n, ld, sbt,
                                                                                               sa, sb, kp, out);
  DS4_CHECK_LAUNCH("pack_fp8_kernel");
}

}  // namespace ds4gpu
