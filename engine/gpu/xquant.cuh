// One 32-value activation block quantized by one warp (lane = column) into XQ's planes with quantize_x_kernel's
// arithmetic (repack.cu), so the planes are bitwise the same: moe.cu (gate/up's own x and h) uses it.
#pragma once

#include "common.cuh"

namespace ds4gpu {

// One x block of 32 values, one per lane, with exactly the arithmetic and shuffle order of quantize_x_kernel
// (repack.cu), so the planes are bitwise the same: hi = rint(v / s), lo = clamp(rint((v / s - hi) 254)),
// s = amax / 127; scale = s / 254; sum16 = the xor-shuffle sum of the lane's 16-value half (NaN or an all-zero
// block: hi = lo = 0, as there).
struct XLaneQ {
  int hi, lo;
  float scale, sum16;
};
__device__ __forceinline__ XLaneQ quantize_x_lane(float v) {
  float amax = fabsf(v);
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float s = amax / 127.0f;
  XLaneQ q{0, 0, 0.0f, 0.0f};
  if (amax > 0.0f) {
    const float t = v / s;
    const float hr = rintf(t);
    q.hi = (int)hr;
    q.lo = max(-127, min(127, (int)rintf((t - hr) * 254.0f)));
  }
  float sum = v;
  for (int o = 8; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  q.scale = s / 254.0f;
  q.sum16 = sum;
  return q;
}

// Writes the quantized block xb (0-based over the whole array) of lane's value v into q.
__device__ __forceinline__ void put_x_block(const XQ& q, int64_t xb, int lane, float v) {
  const XLaneQ r = quantize_x_lane(v);
  q.hi[xb * 32 + lane] = (int8_t)r.hi;
  q.lo[xb * 32 + lane] = (int8_t)r.lo;
  if (lane == 0) q.scale[xb] = r.scale;
  if ((lane & 15) == 0) q.sum16[xb * 2 + lane / 16] = r.sum16;
}

}  // namespace ds4gpu
