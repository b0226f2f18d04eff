// GGUF blocks -> the device layout of common.cuh (run once per tensor at upload), and the
// per-call quantization of activations to the two-plane int8 form the matvec kernels read.
#include "block_ops.cuh"
#include "common.cuh"

namespace ds4gpu {

void packed_row_bytes(int qtype, int64_t ncols, int64_t* qs_row, int64_t* sc_row) {
  auto need = [&](int64_t mult) {
    if (ncols <= 0 || ncols % mult)
      throw std::invalid_argument("rows of type " + std::to_string(qtype) + " need a multiple of " +
                                  std::to_string(mult) + " columns, got " + std::to_string(ncols));
  };
  switch (qtype) {
    case QT_F16: need(8); *qs_row = ncols * 2; *sc_row = 0; return;
    case QT_Q8_0: need(32); *qs_row = ncols; *sc_row = ncols / 32 * 2; return;
    case QT_Q4_K: need(256); *qs_row = ncols / 2; *sc_row = ncols / 256 * 4 + ncols / 32 * 2; return;
    case QT_Q2_K: need(256); *qs_row = ncols / 4; *sc_row = ncols / 256 * 4 + ncols / 256 * 16; return;
    case QT_IQ2_XXS: need(256); *qs_row = ncols / 4; *sc_row = ncols / 256 * 2; return;
    default: throw std::invalid_argument("quant type " + std::to_string(qtype) + " has no GPU kernel");
  }
}

// One thread per GGUF block. `raw` holds `rows` rows of GGUF blocks, rows contiguous.
__global__ void repack_q8_0(const uint8_t* raw, int64_t rows, int64_t nblk, uint8_t* qs, int64_t qs_row,
                            uint8_t* sc, int64_t sc_row) {
  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= rows * nblk) return;
  int64_t r = i / nblk, j = i % nblk;
  const uint8_t* b = raw + i * 34;
  sc[r * sc_row + 2 * j] = b[0];
  sc[r * sc_row + 2 * j + 1] = b[1];
  uint8_t* q = qs + r * qs_row + 32 * j;
  for (int e = 0; e < 32; ++e) q[e] = b[2 + e];
}

__global__ void repack_q4_k(const uint8_t* raw, int64_t rows, int64_t nblk, uint8_t* qs, int64_t qs_row,
                            uint8_t* sc, int64_t sc_row) {
  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= rows * nblk) return;
  int64_t r = i / nblk, j = i % nblk;
  const uint8_t* b = raw + i * 144;  // d, dmin, scales[12], qs[128]
  uint8_t* srow = sc + r * sc_row;
  for (int e = 0; e < 4; ++e) srow[4 * j + e] = b[e];
  const uint8_t* s = b + 4;
  uint8_t* sub = srow + 4 * nblk + 16 * j;  // (sc, m) for the 8 sub-blocks of this block
  for (int t = 0; t < 8; ++t) {
    int scale, mn;
    if (t < 4) {
      scale = s[t] & 63;
      mn = s[t + 4] & 63;
    } else {
      scale = (s[t + 4] & 15) | ((s[t - 4] >> 6) << 4);
      mn = (s[t + 4] >> 4) | ((s[t] >> 6) << 4);
    }
    sub[2 * t] = (uint8_t)scale;
    sub[2 * t + 1] = (uint8_t)mn;
  }
  const uint8_t* q = b + 16;
  uint8_t* out = qs + r * qs_row + 128 * j;
  for (int t = 0; t < 8; ++t) {  // sub-block t: pair t/2, low nibble for even t
    int shift = (t & 1) * 4;
    const uint8_t* src = q + 32 * (t / 2);
    for (int e = 0; e < 16; ++e) {
      int lo = (src[e] >> shift) & 15, hi = (src[e + 16] >> shift) & 15;
      out[16 * t + e] = (uint8_t)(lo | (hi << 4));
    }
  }
}

__global__ void repack_q2_k(const uint8_t* raw, int64_t rows, int64_t nblk, uint8_t* qs, int64_t qs_row,
                            uint8_t* sc, int64_t sc_row) {
  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= rows * nblk) return;
  int64_t r = i / nblk, j = i % nblk;
  const uint8_t* b = raw + i * 84;  // scales[16], qs[64], d, dmin
  uint8_t* srow = sc + r * sc_row;
  for (int e = 0; e < 4; ++e) srow[4 * j + e] = b[80 + e];
  for (int e = 0; e < 16; ++e) srow[4 * nblk + 16 * j + e] = b[e];
  const uint8_t* q = b + 16;
  uint32_t* out = (uint32_t*)(qs + r * qs_row + 64 * j);
  for (int w = 0; w < 16; ++w) {  // word w of the block = elements 16w .. 16w+15
    uint32_t word = 0;
    for (int k = 0; k < 4; ++k)
      for (int byte = 0; byte < 4; ++byte) {
        int e = 16 * w + 4 * k + byte;  // element within the 256-block
        int h = e / 128, g = (e % 128) / 32, l = e % 32;
        uint32_t code = (q[32 * h + l] >> (2 * g)) & 3;
        word |= code << (8 * byte + 2 * k);
      }
    out[w] = word;
  }
}

__global__ void repack_iq2_xxs(const uint8_t* raw, int64_t rows, int64_t nblk, uint8_t* qs, int64_t qs_row,
                               uint8_t* sc, int64_t sc_row) {
  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= rows * nblk) return;
  int64_t r = i / nblk, j = i % nblk;
  const uint8_t* b = raw + i * 66;  // d, qs[64]
  sc[r * sc_row + 2 * j] = b[0];
  sc[r * sc_row + 2 * j + 1] = b[1];
  uint8_t* out = qs + r * qs_row + 64 * j;
  for (int e = 0; e < 64; ++e) out[e] = b[2 + e];
}

void launch_repack(int qtype, const uint8_t* raw, int64_t rows, int64_t ncols, uint8_t* qs, int64_t qs_row,
                   uint8_t* sc, int64_t sc_row, cudaStream_t stream) {
  if (qtype == QT_F16) {
    DS4_CHECK(cudaMemcpyAsync(qs, raw, rows * ncols * 2, cudaMemcpyDeviceToDevice, stream));
    return;
  }
  int64_t per = qtype == QT_Q8_0 ? 32 : 256;
  int64_t nblk = ncols / per, total = rows * nblk;
  int threads = 128;
  unsigned grid = (unsigned)((total + threads - 1) / threads);
  switch (qtype) {
    case QT_Q8_0: repack_q8_0<<<grid, threads, 0, stream>>>(raw, rows, nblk, qs, qs_row, sc, sc_row); break;
    case QT_Q4_K: repack_q4_k<<<grid, threads, 0, stream>>>(raw, rows, nblk, qs, qs_row, sc, sc_row); break;
    case QT_Q2_K: repack_q2_k<<<grid, threads, 0, stream>>>(raw, rows, nblk, qs, qs_row, sc, sc_row); break;
    case QT_IQ2_XXS: repack_iq2_xxs<<<grid, threads, 0, stream>>>(raw, rows, nblk, qs, qs_row, sc, sc_row); break;
    default: throw std::invalid_argument("repack: unsupported type " + std::to_string(qtype));
  }
  DS4_CHECK_LAUNCH("repack");
}

// Eight threads per 32 columns, four consecutive columns each (float4 loads, char4 stores: a warp moves 512 bytes
// per load). hi = round(x / s), lo = round((x / s - hi) * 254) with s = amax / 127, so x = s * hi + s / 254 * lo to
// within s / 508 (about 1.6e-5 of the block's largest value).
// The 16-column sums keep the one-warp-per-block form's addition tree bit for bit (the decode kernels that quantize
// x themselves, moe.cu gu_quantize_x and mv_stream.cuh, use that tree): column pairs differing in bit 3 first, then
// bit 2 (both across threads), then bit 1 and bit 0 (inside the thread).
// SWIGLU: the values are swiglu(x, sw.up) * sw.row_w[sw.row_of[row]] (swiglu_kernel's operations, so the same bits).
// Four values of the SwiGLU source in place: swiglu(v, u) times the row's routing weight rw (swiglu_kernel's operations).
__device__ __forceinline__ void swiglu4(float (&v)[4], const float (&u)[4], const XSwiglu& sw, float rw) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float a = fminf(v[i], sw.limit), c = fminf(fmaxf(u[i], -sw.limit), sw.limit);
    v[i] = a * sigmoidf_(a) * c;
    if (sw.row_w) v[i] = v[i] * rw;
  }
}

// Four values' planes at scale s: hi = rint(v / s), lo = clamp(rint((v / s - hi) 254)); zero where !live_scale (an
// all-zero or NaN block / row).
__device__ __forceinline__ void hilo4(const float (&v)[4], float s, bool live_scale, char4& hq, char4& lq) {
  hq = make_char4(0, 0, 0, 0), lq = make_char4(0, 0, 0, 0);
  if (!live_scale) return;
  int h[4], l[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float t = v[i] / s, hr = rintf(t);
    h[i] = (int)hr;
    l[i] = max(-127, min(127, (int)rintf((t - hr) * 254.0f)));
  }
  hq = make_char4((signed char)h[0], (signed char)h[1], (signed char)h[2], (signed char)h[3]);
  lq = make_char4((signed char)l[0], (signed char)l[1], (signed char)l[2], (signed char)l[3]);
}

template <bool SWIGLU>
__global__ void quantize_x_kernel(const float* x, int64_t nxb_total, XQ out, const int64_t* rows, int nb, XSwiglu sw) {
  pdl_begin();
  const int lane = threadIdx.x & 31, sub = lane & 7;  // sub: this thread's columns 4 sub .. 4 sub + 3 of the block
  const int64_t xb = (blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32) * 4 + lane / 8;
  const bool live = xb < nxb_total;  // dead threads still take part in the shuffles
  const int64_t b = live ? xb : nxb_total - 1;
  const int64_t src = rows ? rows[b / nb] * nb + b % nb : b;
  const float4 v4 = reinterpret_cast<const float4*>(x + src * 32)[sub];
  float v[4] = {v4.x, v4.y, v4.z, v4.w};
  if constexpr (SWIGLU) {
    const float4 u4 = reinterpret_cast<const float4*>(sw.up + src * 32)[sub];
    const float u[4] = {u4.x, u4.y, u4.z, u4.w};
    const int64_t r = src / nb;
    const float rw = sw.row_w ? sw.row_w[sw.row_of ? sw.row_of[r] : r] : 1.0f;
    swiglu4(v, u, sw, rw);
  }
  float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
  for (int o = 4; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float s = amax / 127.0f;
  char4 hq, lq;
  hilo4(v, s, amax > 0.0f, hq, lq);
  // column c = 4 sub + i: bit 3 of c is bit 1 of sub, bit 2 is bit 0 of sub
  float a[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) a[i] = v[i] + __shfl_xor_sync(0xffffffffu, v[i], 2);
#pragma unroll
  for (int i = 0; i < 4; ++i) a[i] += __shfl_xor_sync(0xffffffffu, a[i], 1);
  const float sum = (a[0] + a[2]) + (a[1] + a[3]);
  if (!live) return;
  reinterpret_cast<char4*>(out.hi + xb * 32)[sub] = hq;
  reinterpret_cast<char4*>(out.lo + xb * 32)[sub] = lq;
  if (sub == 0) out.scale[xb] = s / 254.0f;
  if ((sub & 3) == 0) out.sum16[xb * 2 + sub / 4] = sum;
}

// group 256 (mmq's S256 form): one warp per 256 columns, 8 consecutive columns per lane (two float4): s = the 256
// columns' amax / 127, hi and lo per value with quantize_x_kernel's formulas; scale s / 254 written for each of the
// eight 32-column blocks; sum16: a lane pair's 16 values (each lane's 8 summed pairwise, then its neighbour's).
__global__ void quantize_x256_kernel(const float* x, int64_t nsb_total, XQ out, const int64_t* rows, int nsb) {
  pdl_begin();
  const int lane = threadIdx.x & 31;
  const int64_t sb = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (sb >= nsb_total) return;  // a whole warp
  const int64_t src = rows ? rows[sb / nsb] * nsb + sb % nsb : sb;
  const float4* p = reinterpret_cast<const float4*>(x + src * 256) + 2 * lane;
  const float4 a = p[0], b = p[1];
  const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float s = amax / 127.0f;
  uint32_t hw[2] = {0u, 0u}, lw[2] = {0u, 0u};
  if (amax > 0.0f) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float t = v[i] / s, hr = rintf(t);
      const int h = (int)hr, l = max(-127, min(127, (int)rintf((t - hr) * 254.0f)));
      hw[i / 4] |= (uint32_t)(uint8_t)(int8_t)h << (8 * (i % 4));
      lw[i / 4] |= (uint32_t)(uint8_t)(int8_t)l << (8 * (i % 4));
    }
  }
  float sum = ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
  sum += __shfl_xor_sync(0xffffffffu, sum, 1);
  reinterpret_cast<uint2*>(out.hi + sb * 256)[lane] = make_uint2(hw[0], hw[1]);
  reinterpret_cast<uint2*>(out.lo + sb * 256)[lane] = make_uint2(lw[0], lw[1]);
  if ((lane & 3) == 0) out.scale[sb * 8 + lane / 4] = s / 254.0f;
  if ((lane & 1) == 0) out.sum16[sb * 16 + lane / 2] = sum;
}

// group 0 (mmq's XROW form, the routed experts): one scale per row. One CTA of THREADS (128 where n is a multiple of 512,
// else 64) per row, four consecutive columns per chunk (float4 in, char4 out) at columns 4 (tid + THREADS j),
// j < n / (4 THREADS) <= 8: s = the row's amax / 127, hi and lo
// per value with quantize_x_kernel's formulas; scale s / 254 written for every 32-column block, so every reader of the
// planes takes them; sum16: each thread's four values ((v0 + v1) + (v2 + v3)), then the neighbours' (xor 1, xor 2),
// with sums_per_scale divided by that scale (mmq's XROW min terms). SWIGLU: quantize_x_kernel's SwiGLU source.
constexpr int kRowChunks = 8;  // n <= 32 THREADS
template <bool SWIGLU, int THREADS>
__global__ void __launch_bounds__(THREADS) quantize_x_row_kernel(const float* x, XQ out, const int64_t* rows, int n,
                                                                 XSwiglu sw, bool sums_per_scale) {
  constexpr int kRowThreads = THREADS;
  pdl_begin();
  __shared__ float s_amax[kRowThreads / 32];
  const int tid = threadIdx.x, lane = tid & 31, nch = n / (4 * kRowThreads);
  const int64_t r = blockIdx.x, src = rows ? rows[r] : r;
  float rw = 1.0f;
  if constexpr (SWIGLU) rw = sw.row_w ? sw.row_w[sw.row_of ? sw.row_of[src] : src] : 1.0f;
  float v[kRowChunks][4];
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < kRowChunks; ++j) {
    if (j >= nch) break;
    const float4 f = reinterpret_cast<const float4*>(x + src * n)[tid + kRowThreads * j];
    v[j][0] = f.x, v[j][1] = f.y, v[j][2] = f.z, v[j][3] = f.w;
    if constexpr (SWIGLU) {
      const float4 u4 = reinterpret_cast<const float4*>(sw.up + src * n)[tid + kRowThreads * j];
      const float u[4] = {u4.x, u4.y, u4.z, u4.w};
      swiglu4(v[j], u, sw, rw);
    }
    amax = fmaxf(amax, fmaxf(fmaxf(fabsf(v[j][0]), fabsf(v[j][1])), fmaxf(fabsf(v[j][2]), fabsf(v[j][3]))));
  }
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (lane == 0) s_amax[tid >> 5] = amax;
  __syncthreads();
  amax = s_amax[0];
#pragma unroll
  for (int w = 1; w < kRowThreads / 32; ++w) amax = fmaxf(amax, s_amax[w]);
  const float s = amax / 127.0f;
#pragma unroll
  for (int j = 0; j < kRowChunks; ++j) {
    if (j >= nch) break;
    char4 hq, lq;
    hilo4(v[j], s, amax > 0.0f, hq, lq);
    const int64_t c4 = r * (n / 4) + tid + kRowThreads * j;  // this chunk in units of four columns
    reinterpret_cast<char4*>(out.hi)[c4] = hq;
    reinterpret_cast<char4*>(out.lo)[c4] = lq;
    float sum = (v[j][0] + v[j][1]) + (v[j][2] + v[j][3]);
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const float scale = s / 254.0f;
    if ((tid & 7) == 0) out.scale[c4 / 8] = scale;
    if ((tid & 3) == 0) out.sum16[c4 / 4] = sums_per_scale && amax > 0.0f ? sum / scale : sum;
  }
}

bool quantize_x_row_takes(int64_t n) { return n > 0 && n % 256 == 0 && (n % 512 == 0 ? n <= 4096 : n <= 2048); }

void launch_quantize_x(const float* x, int nvec, int n, XQ out, cudaStream_t stream, const int64_t* rows, int group,
                       XSwiglu sw, bool sums_per_scale) {
  if (sw.up && ((group != 32 && group != 0) || rows))
    throw std::invalid_argument("quantize_x: SwiGLU source needs group 32 or 0, no rows");
  if (sums_per_scale && group != 0) throw std::invalid_argument("quantize_x: sums per scale need group 0");
  if (group == 256) {
    if (n % 256) throw std::invalid_argument("quantize_x: group 256 needs a length that is a multiple of 256");
    const int64_t total = (int64_t)nvec * (n / 256);
    const int warps = 8;
    launch_k(quantize_x256_kernel, dim3((unsigned)((total + warps - 1) / warps)), dim3(32 * warps), 0, stream, x,
             total, out, rows, n / 256);
    DS4_CHECK_LAUNCH("quantize_x (group 256)");
    return;
  }
  if (group == 0) {
    if (!quantize_x_row_takes(n))
      throw std::invalid_argument("quantize_x: one scale per row (group 0) needs a length of 256 .. 4096, a multiple of "
                                  "256 (of 512 past 2048)");
    const bool wide = n % 512 == 0;
    const dim3 grid((unsigned)nvec), block(wide ? 128 : 64);
    if (nvec <= 0) return;
    if (sw.up && wide) launch_k(quantize_x_row_kernel<true, 128>, grid, block, 0, stream, x, out, rows, n, sw, sums_per_scale);
    else if (sw.up) launch_k(quantize_x_row_kernel<true, 64>, grid, block, 0, stream, x, out, rows, n, sw, sums_per_scale);
    else if (wide) launch_k(quantize_x_row_kernel<false, 128>, grid, block, 0, stream, x, out, rows, n, sw, sums_per_scale);
    else launch_k(quantize_x_row_kernel<false, 64>, grid, block, 0, stream, x, out, rows, n, sw, sums_per_scale);
    DS4_CHECK_LAUNCH("quantize_x (one scale per row)");
    return;
  }
  if (group != 32) throw std::invalid_argument("quantize_x: group must be 32, 256 or 0 (one scale per row)");
  if (n % 32) throw std::invalid_argument("activation length must be a multiple of 32");
  const int64_t total = (int64_t)nvec * n / 32;
  const int threads = 256, blocks_per_cta = threads / 8;
  const unsigned grid = (unsigned)((total + blocks_per_cta - 1) / blocks_per_cta);
  if (sw.up)
    launch_k(quantize_x_kernel<true>, dim3(grid), dim3(threads), 0, stream, x, total, out, rows, n / 32, sw);
  else
    launch_k(quantize_x_kernel<false>, dim3(grid), dim3(threads), 0, stream, x, total, out, rows, n / 32, sw);
  DS4_CHECK_LAUNCH("quantize_x");
}

}  // namespace ds4gpu
