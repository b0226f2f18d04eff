// GGUF blocks -> the device layout of common.cuh (run once per tensor at upload), and the
// per-call quantization of activations to the two-plane int8 form the matvec kernels read.
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

// One warp per 32 columns. hi = round(x / s), lo = round((x / s - hi) * 254) with s = amax / 127,
// so x = s * hi + s / 254 * lo to within s / 508 (about 1.6e-5 of the block's largest value).
// rows != null: output row r quantizes x row rows[r] (nb = blocks of 32 per row), a gather without a copy of x.
__global__ void quantize_x_kernel(const float* x, int64_t nxb_total, XQ out, const int64_t* rows, int nb) {
  pdl_begin();
  int64_t xb = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32;
  if (xb >= nxb_total) return;
  int lane = threadIdx.x & 31;
  const int64_t src = rows ? rows[xb / nb] * nb + xb % nb : xb;
  float v = x[src * 32 + lane];
  float amax = fabsf(v);
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  float s = amax / 127.0f;
  int h = 0, l = 0;
  if (amax > 0.0f) {
    float t = v / s;
    float hr = rintf(t);
    h = (int)hr;
    l = (int)rintf((t - hr) * 254.0f);
    l = max(-127, min(127, l));
  }
  out.hi[xb * 32 + lane] = (int8_t)h;
  out.lo[xb * 32 + lane] = (int8_t)l;
  float sum = v;
  for (int o = 8; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if (lane == 0) out.scale[xb] = s / 254.0f;
  if ((lane & 15) == 0) out.sum16[xb * 2 + lane / 16] = sum;
}

void launch_quantize_x(const float* x, int nvec, int n, XQ out, cudaStream_t stream, const int64_t* rows) {
  if (n % 32) throw std::invalid_argument("activation length must be a multiple of 32");
  int64_t total = (int64_t)nvec * n / 32;
  int threads = 256;
  unsigned grid = (unsigned)((total + 7) / 8);
  launch_k(quantize_x_kernel, dim3(grid), dim3(threads), 0, stream, x, total, out, rows, n / 32);
  DS4_CHECK_LAUNCH("quantize_x");
}

}  // namespace ds4gpu
