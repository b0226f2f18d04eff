// Grid-wide barriers for kernels whose CTAs are all resident at once (matvec_chain.cu; barrier.cu measures them).
// Each user owns its two words (a count of arrivals and a generation); one barrier kernel at a time per pair.
#pragma once

#include <cuda_runtime.h>

namespace ds4gpu {

// Fences around an atomic arrival; the others spin on the generation word with a short sleep.
__device__ __forceinline__ void grid_barrier_fenced(unsigned* count, unsigned* gen_word, unsigned nctas) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned gen = *(volatile unsigned*)gen_word;  // read before arriving
    __threadfence();                                      // this CTA's writes, device-wide
    if (atomicAdd(count, 1u) == nctas - 1) {
      *count = 0;
      __threadfence();
      atomicAdd(gen_word, 1u);
    } else {
      while (*(volatile unsigned*)gen_word == gen) __nanosleep(64);
    }
    __threadfence();
  }
  __syncthreads();
}

__device__ __forceinline__ unsigned ld_acquire_gpu(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// The arrival's acq_rel atomic publishes this CTA's writes (ordered before it by __syncthreads); the last arrival's
// release of the generation word hands everything to the spinning CTAs' acquire loads. No sleep.
__device__ __forceinline__ void grid_barrier_acq_rel(unsigned* count, unsigned* gen_word, unsigned nctas) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned gen = ld_acquire_gpu(gen_word);
    unsigned old;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;\n" : "=r"(old) : "l"(count) : "memory");
    if (old == nctas - 1) {
      *count = 0;  // no CTA touches the count again before the generation moves
      asm volatile("red.release.gpu.global.add.u32 [%0], 1;\n" ::"l"(gen_word) : "memory");
    } else {
      while (ld_acquire_gpu(gen_word) == gen) {
      }
    }
  }
  __syncthreads();
}

}  // namespace ds4gpu
