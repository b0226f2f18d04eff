// Prefill attention in one kernel (model-spec §3.5; session prefill.attend_rows is the torch form): for query t,
// the keys are its raw window (rows t .. t + Wn - 1 of win, valid from position 0 on) and its compressed rows
// (sel[t] of comp, or all n_comp rows, visible below (pos + 1) / ratio); scores q_h . k / sqrt(d), a softmax with
// the head's sink as one more score, output sum_j p_j k_j (the keys are the values).
//
// One CTA per (query, group of up to 64 heads), keys in tiles of 16, online softmax over the tiles. Products on
// the tensor cores as three TF32 products (hi.hi + hi.lo + lo.hi of x = hi + lo, each part rounded to TF32: ~22
// bits, float32-level like the prefill GEMMs' f16 splits, with float32's range), mma.sync.m16n8k8:
//   scores [16 heads x 8 keys] per warp over the head dimension, P.V [16 heads x 8 columns] tiles per warp.
// Shared memory: the group's queries, two key tiles (the next one loading), the tile's scores (rows padded by 4
// floats: conflict-free fragment reads). One CTA per SM (~200 KB for 64 heads of 512).
#include <math.h>

#include <cuda_bf16.h>

#include <algorithm>

#include "attn_prefill.cuh"

namespace ds4gpu {

namespace {

template <int MT, int NBUF, int MINB, bool PK>
// a: __grid_constant__, so the device functions' references read the parameter space (v25: without it nvcc copied the
// struct to local memory and every field read inside the tile loop was a local load)
__global__ void __launch_bounds__(AP_THREADS, MINB) prefill_attn_kernel(const __grid_constant__ PrefillAttn a) {
  constexpr int HG = 16 * MT;          // heads of this CTA (rows past H are zeros)
  constexpr int CP = AP_WARPS / MT;    // column parts of the output per m-tile
  constexpr int KS = AP_WARPS / (2 * MT);  // head-dimension parts of each score job
  constexpr int NT = 8 * MT;           // output tiles of 8 columns per warp, at most (d <= 512)
  constexpr int KC = 4;                // independent score chains
  extern __shared__ __align__(16) float sh[];
  const int d = a.d, ds = d + AP_PAD, d4 = d / 4, pk = PK ? a.pk_dims : 0, dsb = ap_smem_row_bytes<PK>(d, pk);
  float* Qs = sh;                      // [HG][ds]
  uint8_t* Kbuf = (uint8_t*)(Qs + HG * ds);  // [NBUF][AP_KT] rows of dsb bytes
  float* Ss = (float*)(Kbuf + NBUF * AP_KT * dsb);  // [KS][HG][AP_SP] partial scores; part 0 then the tile's weights
  float* m_s = Ss + KS * HG * AP_SP;   // [HG] running max
  float* l_s = m_s + HG;               // [HG] running sum
  float* f_s = l_s + HG;               // [HG] this tile's rescale, then the final factor
  int* ok_s = (int*)(f_s + HG);        // [NBUF][AP_KT] key present and visible
  int* sel_stage = ok_s + NBUF * AP_KT;  // [n_sel] with a.prefetch: the query's selected rows
  const int t = blockIdx.x, h_base = blockIdx.y * HG;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, i4 = lane & 3;
  const int64_t p = a.pos0 + t;
  const int n_cmp = a.comp ? (a.sel ? a.n_sel : a.n_comp) : 0;
  const int n_keys = a.Wn + n_cmp;
  const int64_t n_vis = a.ratio > 0 ? (p + 1) / a.ratio : 0;
  const int* sel_s = nullptr;
  if (a.prefetch && a.sel && a.comp) {
    ap_stage_sel(a, t, n_vis, sel_stage);
    __syncthreads();
    sel_s = sel_stage;
  }
  ap_load_tile<PK>(a, t, p, n_vis, n_keys, 0, Kbuf, ok_s, dsb, sel_s);  // the first tile loads while Q is staged
  for (int i = tid; i < HG * d4; i += AP_THREADS) {
    const int r = i / d4, c = i - r * d4, h = h_base + r;
    const float4 v = h < a.H ? __ldg((const float4*)(a.q + ((int64_t)t * a.H + h) * d) + c)
                             : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    *(float4*)(Qs + r * ds + 4 * c) = v;
  }
  if (a.q_post_on) {
    __syncthreads();  // rows staged by other warps
    ap_q_post<HG>(a, t, (float)p, h_base, Qs, ds);
  }
  if (tid < HG) {
    m_s[tid] = -INFINITY;
    l_s[tid] = 0.0f;
  }
  const int mt_o = warp % MT, cp = warp / MT, ntw = d / 8 / CP;  // this warp's output tiles
  const int kpart = d / KS, k_lo = (warp / (2 * MT)) * kpart, k_hi = k_lo + kpart;  // this warp's score columns
  float acc[NT][4];
#pragma unroll
  for (int n = 0; n < NT; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  // form 2's P.V: whole chunks of AP_PVC tiles, each on one side of exact_dims
  const bool pv_straight = a.form == 2 && ntw == NT && a.exact_dims % (8 * AP_PVC) == 0;

  for (int k0 = 0, buf = 0; k0 < n_keys; k0 += AP_KT, buf = NBUF == 2 ? buf ^ 1 : 0) {
    __syncthreads();  // the previous tile's reads of its buffer, Ss and f_s are done
    if constexpr (NBUF == 2) {
      if (k0 + AP_KT < n_keys) {
        ap_load_tile<PK>(a, t, p, n_vis, n_keys, k0 + AP_KT, Kbuf + (buf ^ 1) * AP_KT * dsb, ok_s + (buf ^ 1) * AP_KT,
                         dsb, sel_s);
        asm volatile("cp.async.wait_group 1;\n" ::);
      } else {
        asm volatile("cp.async.wait_group 0;\n" ::);
      }
    } else {
      if (k0 > 0) ap_load_tile<PK>(a, t, p, n_vis, n_keys, k0, Kbuf, ok_s, dsb, sel_s);
      asm volatile("cp.async.wait_group 0;\n" ::);
    }
    __syncthreads();  // this tile is in shared memory for every thread
    // one buffer: the next tile's rows head for L2 while this one is used, so its load waits on L2, not DRAM
    if (NBUF == 1 && a.prefetch >= 2 && k0 + AP_KT < n_keys)
      ap_prefetch_tile<PK>(a, t, p, n_vis, n_keys, k0 + AP_KT, sel_s);
    const uint8_t* Ks = Kbuf + buf * AP_KT * dsb;
    const int* ok = ok_s + buf * AP_KT;
    {  // scores: m-tile warp % MT, keys 8 ((warp / MT) % 2) .. + 7 of the tile, columns k_lo .. k_hi - 1
      const int mt = warp % MT, n0 = 8 * ((warp / MT) % 2);
      const float* q0 = Qs + (16 * mt + g) * ds + 2 * i4;
      const float* q1 = q0 + 8 * ds;
      const uint8_t* kr = Ks + (n0 + g) * dsb;
      float cm[KC][4], cc[KC][4];
#pragma unroll
      for (int j = 0; j < KC; ++j)
        cm[j][0] = cm[j][1] = cm[j][2] = cm[j][3] = cc[j][0] = cc[j][1] = cc[j][2] = cc[j][3] = 0.0f;
      const int e_hi = min(max(a.exact_dims, k_lo), k_hi);  // columns [k_lo, e_hi) need no key split
      if (a.form == 2 && (k_hi - k_lo) % (8 * KC) == 0 && (e_hi - k_lo) % (8 * KC) == 0) {
        int k = k_lo;
        for (; k < e_hi; k += 8 * KC) ap_score_steps<false, PK, KC>(q0, q1, kr, k, i4, pk, cm, cc);
        for (; k < k_hi; k += 8 * KC) ap_score_steps<true, PK, KC>(q0, q1, kr, k, i4, pk, cm, cc);
      } else
      for (int k = k_lo; k < k_hi; k += 8 * KC) {
#pragma unroll
        for (int j = 0; j < KC; ++j) {
          const int kk = k + 8 * j;
          if (kk >= k_hi) break;  // uniform: d / KS may not be a multiple of 32
          const float2 x0 = *(const float2*)(q0 + kk), x1 = *(const float2*)(q1 + kk);
          const float2 y = ap_key_pair<PK>(kr, kk + 2 * i4, pk);  // kk < pk: uniform (pk a multiple of 8)
          uint32_t ah[4], al[4], bh[2], bl[2];
          split_tf32(x0.x, ah[0], al[0]);
          split_tf32(x1.x, ah[1], al[1]);
          split_tf32(x0.y, ah[2], al[2]);
          split_tf32(x1.y, ah[3], al[3]);
          const bool split_k = kk + 8 > a.exact_dims;  // uniform; else the keys are their own TF32 hi, lo is zero
          bh[0] = __float_as_uint(y.x);
          bh[1] = __float_as_uint(y.y);
          if (split_k) {
            split_tf32(y.x, bh[0], bl[0]);
            split_tf32(y.y, bh[1], bl[1]);
          }
          mma_tf32(cc[j], al, bh);
          if (split_k) mma_tf32(cc[j], ah, bl);
          mma_tf32(cm[j], ah, bh);
        }
      }
      float c[4];
#pragma unroll
      for (int e = 0; e < 4; ++e)
        c[e] = ((cc[0][e] + cc[1][e]) + (cc[2][e] + cc[3][e])) + ((cm[0][e] + cm[1][e]) + (cm[2][e] + cm[3][e]));
      float* sp = Ss + (warp / (2 * MT)) * HG * AP_SP + (16 * mt + g) * AP_SP + n0 + 2 * i4;
      sp[0] = c[0];
      sp[1] = c[1];
      sp[8 * AP_SP] = c[2];
      sp[8 * AP_SP + 1] = c[3];
    }
    __syncthreads();
    ap_softmax<HG, KS>(a, k0, n_keys, ok, Ss, m_s, l_s, f_s);
    __syncthreads();
    const float r0 = f_s[16 * mt_o + g], r1 = f_s[16 * mt_o + g + 8];
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      acc[n][0] *= r0;
      acc[n][1] *= r0;
      acc[n][2] *= r1;
      acc[n][3] *= r1;
    }
#pragma unroll
    for (int ks = 0; ks < AP_KT; ks += 8) {  // P [16 heads x 8 keys] . V [8 keys x 8 columns] per output tile
      const float* p0 = Ss + (16 * mt_o + g) * AP_SP + ks;
      uint32_t ah[4], al[4];
      split_tf32(p0[i4], ah[0], al[0]);
      split_tf32(p0[8 * AP_SP + i4], ah[1], al[1]);
      split_tf32(p0[i4 + 4], ah[2], al[2]);
      split_tf32(p0[8 * AP_SP + i4 + 4], ah[3], al[3]);
      const uint8_t* v0 = Ks + (ks + i4) * dsb;
      if (pv_straight) {
#pragma unroll
        for (int c = 0; c < NT; c += AP_PVC) {
          const int col0 = (cp * NT + c) * 8;  // ntw == NT here
          if (col0 + 8 * AP_PVC > a.exact_dims) ap_pv_chunk<true, PK, AP_PVC, NT>(v0, dsb, col0, g, pk, ah, al, acc, c);
          else ap_pv_chunk<false, PK, AP_PVC, NT>(v0, dsb, col0, g, pk, ah, al, acc, c);
        }
        continue;
      }
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        if (n >= ntw) break;
        const int col = (cp * ntw + n) * 8;
        uint32_t bh[2], bl[2];
        const bool split_v = col + 8 > a.exact_dims;  // uniform; else the values are exact in TF32 (lo = 0)
        const float v_0 = ap_key_value<PK>(v0, col + g, pk), v_1 = ap_key_value<PK>(v0 + 4 * dsb, col + g, pk);
        bh[0] = __float_as_uint(v_0);
        bh[1] = __float_as_uint(v_1);
        if (split_v) {
          split_tf32(v_0, bh[0], bl[0]);
          split_tf32(v_1, bh[1], bl[1]);
        }
        // the split product's order (al . bh, ah . bl, ah . bh; no lo . lo: below float32 rounding), without the
        // zero product where the values are exact
        mma_tf32(acc[n], al, bh);
        if (split_v) mma_tf32(acc[n], ah, bl);
        mma_tf32(acc[n], ah, bh);
      }
    }
  }
  ap_finish<NT, HG>(a, t, p, h_base, mt_o, ntw, [&](int n) { return (cp * ntw + n) * 8; }, acc, m_s, l_s, f_s, Ss);
}

template <int MT, int NBUF, int MINB, bool PK = false>
void launch_mt(const PrefillAttn& a, cudaStream_t s) {
  constexpr int HG = 16 * MT, KS = AP_WARPS / (2 * MT);
  if (a.out_hi && HG % a.out_hpg)
    throw std::invalid_argument("prefill_attn: a head group of the split output spans two CTAs");
  const int ds = a.d + AP_PAD;
  const size_t shm = sizeof(float) * ((size_t)HG * ds + (size_t)KS * HG * AP_SP + 3 * HG) +
                     (size_t)NBUF * AP_KT * ap_smem_row_bytes<PK>(a.d, a.pk_dims) +
                     sizeof(int) * (NBUF * AP_KT + (a.prefetch && a.sel && a.comp ? a.n_sel : 0));
  static size_t shm_set = 0;
  if (shm > shm_set) {
    DS4_CHECK(cudaFuncSetAttribute(prefill_attn_kernel<MT, NBUF, MINB, PK>,
                                   cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shm));
    shm_set = shm;
  }
  prefill_attn_kernel<MT, NBUF, MINB, PK><<<dim3(a.T, (a.H + HG - 1) / HG), AP_THREADS, shm, s>>>(a);
}

// $DS4_GPU_ATTN_PREFETCH: 1 (default since v13: 8192-token prefill 3316/3344 -> 3398/3395 t/s) the selected rows
// staged once per query; 0 the v12 form (an index load before each key row's copy); 2 also the L2 prefetch of the
// next key tile in the single-buffered form (v13: no gain over 1, the keys are already in L2). Read once.
int attn_prefetch_mode() {
  static const int v = [] {
    const char* e = getenv("DS4_GPU_ATTN_PREFETCH");
    return e && *e ? std::max(0, std::min(2, atoi(e))) : 1;
  }();
  return v;
}

// $DS4_GPU_ATTN_FORM: 3 (default since v25) the bfloat16 products where the keys are packed with a split tail
// (attn_prefill_bf16.cu; not the TF32 forms' bits), form 2 elsewhere; 2 the inner loops without per-step branches and
// with each step's dependent products apart (ap_score_step, ap_pv_chunk); 1 the v13 loops (form 2's bits). Read once.
// (fused.prefill_attn passes its own reading of the variable, and packs the keys as form 3 wants them.)
int attn_form() {
  static const int v = [] {
    const char* e = getenv("DS4_GPU_ATTN_FORM");
    const int f = e && *e ? atoi(e) : 3;
    return f == 1 || f == 3 ? f : 2;
  }();
  return v;
}

// Heads per CTA for more than 32 heads ($DS4_GPU_ATTN_HEADS, read once): 32 (default: two CTAs per query, one key
// buffer, 2 CTAs per SM), 64 (one CTA per query, 1 per SM; v10, 2048 queries of a Flash top-k layer: 5.23 against
// 7.11 ms; v13 end to end 1.1x slower) or 16 (four CTAs per query, double-buffered keys, 2 CTAs per SM; each key row
// read from L2 four times).
int heads_per_cta() {
  static const int v = [] {
    const char* e = getenv("DS4_GPU_ATTN_HEADS");
    const int h = e ? atoi(e) : 32;
    return h == 64 || h == 16 ? h : 32;
  }();
  return v;
}

}  // namespace

namespace {
// One thread per 16 output bytes (8 bfloat16 values, or 4 floats) of a packed key row. split_tail: the columns from
// pk on as bfloat16 hi (8 per thread), then lo = x - hi, both rounded to nearest.
__global__ void pack_keys_kernel(const float* x, int64_t rows, int d, int pk, bool split_tail, uint16_t* out) {
  const int per_row = pk / 8 + (d - pk) / 4, tail8 = (d - pk) / 8;
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= rows * per_row) return;
  const int64_t r = i / per_row;
  const int u = (int)(i - r * per_row);
  const float* xr = x + r * d;
  uint4* dst = (uint4*)(out + r * (pk + 2 * (int64_t)(d - pk))) + u;
  if (u < pk / 8) {  // bfloat16 by truncation: exact for the FP8-simulated values these columns hold
    const float4 a = ((const float4*)xr)[2 * u], b = ((const float4*)xr)[2 * u + 1];
    auto two = [](float lo, float hi) { return (__float_as_uint(lo) >> 16) | (__float_as_uint(hi) & 0xffff0000u); };
    *dst = make_uint4(two(a.x, a.y), two(a.z, a.w), two(b.x, b.y), two(b.z, b.w));
  } else if (split_tail) {
    const int v = u - pk / 8, lo = v >= tail8, c = pk + 8 * (lo ? v - tail8 : v);
    uint32_t w[4];
    for (int j = 0; j < 4; ++j) {
      const float2 y = make_float2(xr[c + 2 * j], xr[c + 2 * j + 1]);
      const __nv_bfloat162 h = __float22bfloat162_rn(y);
      const float2 hf = __bfloat1622float2(h);
      const __nv_bfloat162 l = __float22bfloat162_rn(make_float2(y.x - hf.x, y.y - hf.y));
      w[j] = lo ? *reinterpret_cast<const uint32_t*>(&l) : *reinterpret_cast<const uint32_t*>(&h);
    }
    *dst = make_uint4(w[0], w[1], w[2], w[3]);
  } else {
    const float4 v = ((const float4*)(xr + pk))[u - pk / 8];
    *dst = make_uint4(__float_as_uint(v.x), __float_as_uint(v.y), __float_as_uint(v.z), __float_as_uint(v.w));
  }
}
}  // namespace

void launch_pack_keys(const float* x, int64_t rows, int d, int pk_dims, uint16_t* out, cudaStream_t s,
                      bool split_tail) {
  if (pk_dims <= 0 || pk_dims >= d || pk_dims % 8 || d % 8)
    throw std::invalid_argument("pack_keys: pk_dims must be a multiple of 8 in (0, d), d a multiple of 8");
  if ((uintptr_t)x % 16 || (uintptr_t)out % 16) throw std::invalid_argument("pack_keys: rows must be 16-byte aligned");
  if (rows <= 0) return;
  const int64_t n = rows * (pk_dims / 8 + (d - pk_dims) / 4);
  pack_keys_kernel<<<(unsigned)((n + 255) / 256), 256, 0, s>>>(x, rows, d, pk_dims, split_tail, out);
  DS4_CHECK_LAUNCH("pack_keys");
}

bool prefill_attn_takes(int H, int d) { return H > 0 && d > 0 && d % 64 == 0 && d <= 512; }

void launch_prefill_attn(const PrefillAttn& args, cudaStream_t s) {
  PrefillAttn a = args;
  if (a.prefetch < 0 || a.prefetch > 2) a.prefetch = attn_prefetch_mode();
  if (a.form < 1 || a.form > 3) a.form = attn_form();
  if (a.sel && a.n_sel > 1024) a.prefetch = 0;  // the staged rows (4 KB at most) keep two CTAs per SM where two fit
  if (!prefill_attn_takes(a.H, a.d)) throw std::invalid_argument("prefill_attn: head dim must be a multiple of 64, <= 512");
  if (a.T < 0 || a.Wn < 1 || a.n_comp < 0 || (a.sel && a.n_sel < 1) || (a.comp && a.ratio < 1))
    throw std::invalid_argument("prefill_attn: bad sizes");
  if (a.exact_dims < 0 || a.exact_dims % 8 || a.exact_dims > a.d)
    throw std::invalid_argument("prefill_attn: exact_dims must be a multiple of 8 in [0, d]");
  if (a.out_freq && (a.out_rope_dim <= 0 || a.out_rope_dim % 8 || a.out_rope_dim > a.d))
    throw std::invalid_argument("prefill_attn: out_rope_dim must be a multiple of 8 in (0, d]");
  for (const void* ptr : {(const void*)a.q, (const void*)a.win, (const void*)a.comp, (const void*)a.out})
    if ((uintptr_t)ptr % 16) throw std::invalid_argument("prefill_attn: rows must be 16-byte aligned");
  if (a.win_pk) {
    if ((a.comp && a.n_comp > 0 && !a.comp_pk) || a.pk_dims != a.exact_dims || a.pk_dims <= 0 || a.pk_dims >= a.d)
      throw std::invalid_argument("prefill_attn: packed keys need pk_dims == exact_dims in (0, d) and packed comp rows");
    for (const void* ptr : {(const void*)a.win_pk, (const void*)a.comp_pk})
      if ((uintptr_t)ptr % 16) throw std::invalid_argument("prefill_attn: packed rows must be 16-byte aligned");
  }
  if (a.out_hi && (!(a.out_lo || a.out_a8) || !a.out_s || a.out_hpg < 1 || a.H % a.out_hpg ||
                   16 % a.out_hpg != 0 && a.out_hpg % 16))
    throw std::invalid_argument("prefill_attn: the split output needs hi, lo (or the float8 operand), s and head groups "
                                "that tile 16-head blocks");
  if (a.out_a8 && (!a.out_hi || (a.out_hpg * a.d) % 2))
    throw std::invalid_argument("prefill_attn: the float8 operand comes with the split output (hi, s)");
  if (a.T == 0) return;
  if (a.form == 3) {
    if (launch_prefill_attn_bf16(a, s)) return;
    a.form = 2;  // not its shapes (or keys not packed): the TF32 form 2
  }
  if (a.pk_split) throw std::invalid_argument("prefill_attn: keys packed with a split tail are form 3's, which declined");
  if (a.win_pk) {  // packed keys: two key buffers in every form (the half-size rows leave room for them)
    if (a.H <= 16 || heads_per_cta() == 16) launch_mt<1, 2, 2, true>(a, s);
    else if (a.H <= 32 || heads_per_cta() == 32) launch_mt<2, 2, 2, true>(a, s);
    else launch_mt<4, 2, 1, true>(a, s);
    DS4_CHECK_LAUNCH("prefill_attn (packed keys)");
    return;
  }
  // heads per CTA: 16, 32 or 64 (d * MT / 64 output tiles of 8 columns per warp)
  if (a.H <= 16 || heads_per_cta() == 16) launch_mt<1, 2, 2>(a, s);
  else if (a.H <= 32 || heads_per_cta() == 32) launch_mt<2, 1, 2>(a, s);
  else launch_mt<4, 2, 1>(a, s);
  DS4_CHECK_LAUNCH("prefill_attn");
}

}  // namespace ds4gpu
