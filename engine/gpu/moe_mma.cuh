// The tensor-core (int8 mma.sync) gate/up kernel of the routed MoE for IQ2_XXS experts (moe_mma.cu), and
// the gate/up half of launch_moe on its own (moe.cu), for tests and the kernel bench.
#pragma once

#include "common.cuh"

namespace ds4gpu {

// Whether launch_moe runs IQ2_XXS gate/up through the mma kernel: $DS4_GPU_GU_MMA ("1" on, default off),
// read once; set_gateup_mma overrides it for this process (mode 0 off, 1 on, -1 back to the environment).
// splits > 0 fixes the warps per (pair, 16-row tile) unit (1, 2, 4 or 8); 0 chooses from the work size
// ($DS4_GPU_GU_MMA_SPLIT overrides that choice).
void set_gateup_mma(int mode, int splits);
// moe.cu: the rows kernel's IQ2_XXS sign-mask tables ($DS4_GPU_GU_LUT): 1 on (3 CTAs per SM), 2 on (2 CTAs per SM),
// 3 (default) form 2's tables read by byte offsets, 0 off, -1 as the environment says.
void set_gateup_lut(int mode);
// moe.cu: whether the routed experts read 8-bit activations (hi plane only; $DS4_GPU_MOE_X8=1): decode gate/up and
// down, prefill mmq. set_moe_x8: 1 on, 0 off, -1 as the environment says.
void set_moe_x8(int mode);
void set_gu_off32(int mode);  // $DS4_GPU_GU_OFF32 (moe.cu)
long long gu_off32_launches();
void set_gu_unroll(int mode);  // $DS4_GPU_GU_UNROLL (moe.cu)
long long gu_unroll_launches();
bool moe_x8();
bool gateup_mma_enabled();

// h[pair, f] = silu(min(W1 b, c)) clamp(W3 b, -c, c) w for IQ2_XXS gate/up through int8 mma.sync. False
// (nothing launched) where the kernel does not apply: other types, n_ff % 16 or ncols % 256 not zero.
bool launch_gateup_mma(const Packed& gate, const Packed& up, int n_ff, int n_expert, const XQ& xq,
                       const int32_t* ids, const float* wts, int pairs, int k, float clamp, float* h,
                       cudaStream_t stream);

// The first half of launch_moe: x quantized into s.xq_in (unless x_quantized: it is there already), then gate/up +
// SwiGLU into s.h ([tokens k, n_ff]), through whichever kernel launch_moe would use.
void launch_moe_gateup(const Packed& gate, const Packed& up, int n_expert, const float* x, const int32_t* ids,
                       const float* weights, int tokens, int k, float clamp, const MoeScratch& s,
                       cudaStream_t stream, bool x_quantized = false);

}  // namespace ds4gpu
