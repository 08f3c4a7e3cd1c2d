/*
 * topk_estimate.cu - fused low-rank scoring + exact top-K selection per query group (sm_90a).
 *
 * Semantics (dsv.h): for group g of (b, h), rep = mean of q_lr rows of the group's members (last
 * group may be partial); score_j = rep . k_lr[b, j, h, :]; the list (b, h, g) receives the
 * positions of the kv_count[b, h] highest scores, ascending, ties broken towards the lower
 * position, then -1 up to kmax. No score matrix is ever written: scores are recomputed.
 *
 * Design
 *  - One CTA = 4 warps = 64 consecutive groups of one (b, h). Each warp owns 16 groups, the M
 *    dimension of an m16n8k16 tensor-core MMA; keys are the N dimension, the rank the K dimension
 *    (padded to RP = 16..64 with zeros).
 *  - Exact scores on tensor cores: the fp32 representative is split into three 16-bit parts
 *    (hi + mid + lo == rep exactly for bf16; for fp16 the rep is first scaled by a power of two
 *    per group, which preserves order and ties), the keys are the exact 16-bit inputs, so every
 *    product is exact and only the fp32 accumulation rounds, as in an fp32 dot product.
 *    Each (group, key) score is bit-identical in every pass (same inputs, same instruction order).
 *  - Keys are streamed through shared memory in tiles of 64 (cp.async, double buffered).
 *  - Selection: MSB-first radix select on the order-preserving uint32 key of the score, 8 bits per
 *    pass, one 256-bin shared-memory histogram per group; at most 4 histogram passes (a group
 *    whose boundary bin is needed completely stops early; the CTA skips passes once all its
 *    groups are resolved). This yields the K-th largest key T and the number q of ties at T to
 *    take. A final compaction pass emits {u > T} and the first q of {u == T} in position order:
 *    per tile, each lane quad rebuilds the group's 64-bit selection mask in position order and
 *    writes ranks from popcounts, so the list comes out ascending without any sort.
 * Work per pass at S = 64k, 24 heads, 1024 groups: 1.6G scores (3 MMAs per 128 scores) plus a
 * few integer ops and at most one shared atomic per score, in two-phase tile loops (times:
 * benchmarks/PERF_LOG.md).
 */
#include <stdlib.h>

#include "cuda_common.cuh"
#include "tuning.h"

#define TK_WARPS 4
#define TK_THREADS (32 * TK_WARPS)
#define TK_GPW 16
#define TK_GPC (TK_WARPS * TK_GPW)
#define TK_TILE 64
#define TK_BINS 256

struct dsv_topk_args {
  const void* q;
  const void* k;
  int64_t q_sb, q_ss, q_sh, k_sb, k_ss, k_sh;
  const int32_t* count;
  int32_t* out;
  int64_t S, H, r, G, NG, kmax;
  int tiles_per_bh;
  int kvec;
};

template <int RP, int GPW = TK_GPW>
static size_t dsv_topk_smem_bytes() {
  const int SW = RP / 2 + 4;
  return (size_t)TK_WARPS * GPW * TK_BINS * 4 + (size_t)2 * TK_TILE * SW * 4 +
         (size_t)TK_WARPS * GPW * 4 * 4 + (size_t)TK_THREADS * 4 + 16;
}

/* spread bit (2*b + e) of an 8-bit value to bit (8*b + e), b < 4, e < 2 */
static __device__ __forceinline__ uint32_t dsv_tk_spread(uint32_t x) {
  return (x & 3u) | ((x & 0xCu) << 6) | ((x & 0x30u) << 12) | ((x & 0xC0u) << 18);
}
/* keep the lowest n set bits of x (0 <= n) */
static __device__ __forceinline__ uint32_t dsv_tk_keep_lowest(uint32_t x, int n) {
  if (n >= __popc(x)) return x;
  uint32_t kept = 0;
  for (int i = 0; i < n; ++i) {
    const uint32_t low = x & (0u - x);
    kept |= low;
    x ^= low;
  }
  return kept;
}

/* Two-phase tile loops (template parameter TWO). */
/* hist[(u >> shift) & 255] += 1 when ok and u matches the prefix, else sink += 1: an
 * unconditional shared reduction, so that no branch is needed per score */
static __device__ __forceinline__ void dsv_tk_hist_inc(uint32_t base, uint32_t u, uint32_t pmask,
                                                       uint32_t pref, int shift, bool ok,
                                                       uint32_t sink) {
  const uint32_t addr = (ok && (u & pmask) == pref) ? base + (((u >> shift) & 255u) << 2) : sink;
  asm volatile("red.shared.add.u32 [%0], 1;\n" ::"r"(addr) : "memory");
}

/* One staged tile of the histogram pass, two-phase: the MMA chains of all 8 blocks first
 * (independent, pipelined), then branch-free histogram updates (every score adds 1 to its bin
 * or to this thread's sink slot). */
/* Scores of one staged 64-key tile, two-phase: the lane's 4 accumulators of each of the 8
 * key blocks (exact: hi + mid + lo parts of the representative against the 16-bit keys). */
template <typename T, int KS, int SW>
static __device__ __forceinline__ void dsv_tk_tile_scores(const uint32_t* kt,
                                                          const uint32_t (&A)[KS][3][4], int lane,
                                                          int j4, float (&d)[TK_TILE / 8][4]) {
#pragma unroll
  for (int blk = 0; blk < TK_TILE / 8; ++blk) {
    const int n = blk * 8 + (lane >> 2);
    d[blk][0] = d[blk][1] = d[blk][2] = d[blk][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      const uint32_t b0 = kt[n * SW + ks * 8 + j4], b1 = kt[n * SW + ks * 8 + j4 + 4];
      mma16816<T>(d[blk], A[ks][2][0], A[ks][2][1], A[ks][2][2], A[ks][2][3], b0, b1);
      mma16816<T>(d[blk], A[ks][1][0], A[ks][1][1], A[ks][1][2], A[ks][1][3], b0, b1);
      mma16816<T>(d[blk], A[ks][0][0], A[ks][0][1], A[ks][0][2], A[ks][0][3], b0, b1);
    }
  }
}

template <typename T, int KS, int SW, bool HASB = true>
static __device__ __forceinline__ void dsv_tk_hist_tile(const uint32_t* kt, const uint32_t (&A)[KS][3][4],
                                                        int lane, int j4, int t0, int S32,
                                                        uint32_t hA_addr, uint32_t hB_addr,
                                                        uint32_t sink, uint32_t pmask,
                                                        uint32_t prefA, uint32_t prefB, int shift,
                                                        bool actA, bool actB) {
  /* all 8 blocks' MMA chains first (independent, pipelined), then the histogram updates:
   * branch-free, every score adds 1 to its bin or to this thread's sink slot */
  float d[TK_TILE / 8][4];
  dsv_tk_tile_scores<T, KS, SW>(kt, A, lane, j4, d);
#pragma unroll
  for (int blk = 0; blk < TK_TILE / 8; ++blk) {
    const int key0 = t0 + blk * 8 + j4 * 2;
    const bool k0 = key0 < S32, k1 = key0 + 1 < S32;
    dsv_tk_hist_inc(hA_addr, dsv_float_key(d[blk][0]), pmask, prefA, shift, actA && k0, sink);
    dsv_tk_hist_inc(hA_addr, dsv_float_key(d[blk][1]), pmask, prefA, shift, actA && k1, sink);
    if constexpr (HASB) { /* rows 8-15 of the tile hold groups (16 groups per warp) */
      dsv_tk_hist_inc(hB_addr, dsv_float_key(d[blk][2]), pmask, prefB, shift, actB && k0, sink);
      dsv_tk_hist_inc(hB_addr, dsv_float_key(d[blk][3]), pmask, prefB, shift, actB && k1, sink);
    }
  }
}

/* One staged tile of the compaction pass, two-phase: selection flags (u > T, u == T) of the
 * lane's 16 scores as bit (2 * block + e) of the group masks. */
template <typename T, int KS, int SW, bool HASB = true>
static __device__ __forceinline__ void dsv_tk_compact_flags(const uint32_t* kt,
                                                            const uint32_t (&A)[KS][3][4], int lane,
                                                            int j4, int t0, int S32, uint32_t TA,
                                                            uint32_t TB, uint32_t& mgA,
                                                            uint32_t& mgB, uint32_t& meA,
                                                            uint32_t& meB) {
  /* MMA chains of all 8 blocks first, then the flags (see the histogram passes) */
  float dd[TK_TILE / 8][4];
  dsv_tk_tile_scores<T, KS, SW>(kt, A, lane, j4, dd);
#pragma unroll
  for (int blk = 0; blk < TK_TILE / 8; ++blk) {
    const float* d = dd[blk];
    const int key0 = t0 + blk * 8 + j4 * 2;
    const uint32_t k0 = key0 < S32, k1 = key0 + 1 < S32;
    const uint32_t u0 = dsv_float_key(d[0]), u1 = dsv_float_key(d[1]);
    const uint32_t u2 = HASB ? dsv_float_key(d[2]) : 0u, u3 = HASB ? dsv_float_key(d[3]) : 0u;
    mgA |= ((k0 & (u0 > TA)) << (2 * blk)) | ((k1 & (u1 > TA)) << (2 * blk + 1));
    meA |= ((k0 & (u0 == TA)) << (2 * blk)) | ((k1 & (u1 == TA)) << (2 * blk + 1));
    if constexpr (HASB) { /* rows 8-15 hold groups */
      mgB |= ((k0 & (u2 > TB)) << (2 * blk)) | ((k1 & (u3 > TB)) << (2 * blk + 1));
      meB |= ((k0 & (u2 == TB)) << (2 * blk)) | ((k1 & (u3 == TB)) << (2 * blk + 1));
    }
  }
}


template <typename T, int RP, bool TWO, int GPW>
__global__ void __launch_bounds__(TK_THREADS) dsv_topk_kernel(const dsv_topk_args a) {
  /* GPW groups per warp: 16 (rows 0-7 and 8-15 of the MMA tile: groups A and B of a lane) or 8
   * (rows 0-7 only: twice the warps for the same groups, half the selection work per warp,
   * where the grid is too small to fill the device) */
  static_assert(GPW == 16 || GPW == 8, "GPW: 16 or 8 groups per warp");
  constexpr bool HASB = GPW == 16;
  constexpr int GPC = TK_WARPS * GPW; /* groups per CTA */
  constexpr int KS = RP / 16;
  constexpr int SW = RP / 2 + 4; /* 32-bit words per staged key row (conflict-free B loads) */
  /* Tile loops. With TWO (the default): the MMA chains of all 8 blocks of a tile first, then
   * branch-free histogram updates (fewer instructions, more independent MMAs in flight;
   * identical lists). Without (TWO = false, csrc/dev/): one 8-key block at a time (unroll 2),
   * histogram atomics behind a branch. ptxas (CUDA 13.0) miscompiles fully unrolled
   * fp16 tile loops for RP >= 48 (HMMA results overwritten unread: seen in the SASS and as lost
   * keys on the H200), so those instantiations always keep the block-at-a-time loops. */
  constexpr bool kTwoPhase = TWO && (dsv_is_bf16<T>::value || RP <= 32);
  extern __shared__ __align__(16) unsigned char dsv_tk_smem[];
  uint32_t* hist = reinterpret_cast<uint32_t*>(dsv_tk_smem); /* [warps][GPW][256] */
  float* reps = reinterpret_cast<float*>(dsv_tk_smem);       /* alias, prologue: [GPC][RP] */
  uint32_t* ktile = hist + TK_WARPS * GPW * TK_BINS;         /* [2][TILE][SW] */
  uint32_t* st_prefix = ktile + 2 * TK_TILE * SW;            /* [GPC] */
  int* st_need = reinterpret_cast<int*>(st_prefix + GPC);    /* [GPC] */
  int* st_done = st_need + GPC;                              /* [GPC] */
  int* st_base = st_done + GPC;                              /* [GPC] */
  uint32_t* dummy = reinterpret_cast<uint32_t*>(st_base + GPC); /* [threads] sink slots */
  (void)dummy;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t bh = blockIdx.x / a.tiles_per_bh;
  const int tile = (int)(blockIdx.x - bh * a.tiles_per_bh);
  const int64_t b = bh / a.H, h = bh - b * a.H;
  const int64_t g0 = (int64_t)tile * GPC;
  const int64_t S = a.S, NG = a.NG, kmax = a.kmax;
  const int S32 = (int)S; /* S < 2^31 (host check) */
  const int ngl = (int)((NG - g0) < GPC ? (NG - g0) : GPC); /* valid groups here */
  int64_t K = a.count[bh];
  K = K < 0 ? 0 : (K > kmax ? kmax : K);
  const int64_t Keff = K < S ? K : S;
  int32_t* outg0 = a.out + (bh * NG + g0) * kmax;

  if (Keff == 0) {
    const int64_t n = (int64_t)ngl * kmax;
    for (int64_t e = tid; e < n; e += TK_THREADS) outg0[e] = -1;
    return;
  }

  /* ---- prologue: representatives (fp32 mean of member rows), zero-padded ---- */
  {
    const T* qb = reinterpret_cast<const T*>(a.q) + b * a.q_sb + h * a.q_sh;
    for (int idx = tid; idx < GPC * RP; idx += TK_THREADS) {
      const int gl = idx / RP, c = idx - gl * RP;
      const int64_t g = g0 + gl;
      float v = 0.f;
      if (gl < ngl && c < a.r) {
        const int64_t s0 = g * a.G;
        const int64_t n = (S - s0) < a.G ? (S - s0) : a.G;
        const T* p = qb + s0 * a.q_ss + c;
        float acc = 0.f;
        for (int64_t m = 0; m < n; ++m) acc += dsv_to_float(p[m * a.q_ss]);
        v = acc / (float)n;
      }
      reps[idx] = v;
    }
  }
  __syncthreads();

  const int gA = warp * GPW + (lane >> 2); /* local group of c0/c1 */
  const int gB = gA + 8;                   /* local group of c2/c3 (with HASB) */
  const int j4 = lane & 3;
  /* A fragments: [ks][part][reg]; part 0 = hi, 1 = mid, 2 = lo */
  uint32_t A[KS][3][4];
  {
    float sclA = 1.f, sclB = 1.f;
    if (!dsv_is_bf16<T>::value) {
      /* fp16: scale each rep by 2^e so that its largest |component| is in [2^14, 2^15) */
      float mA = 0.f, mB = 0.f;
      for (int c = 0; c < RP; ++c) {
        mA = fmaxf(mA, fabsf(reps[gA * RP + c]));
        if (HASB) mB = fmaxf(mB, fabsf(reps[gB * RP + c]));
      }
      int e;
      if (mA > 0.f && mA < INFINITY) {
        frexpf(mA, &e);
        e = 15 - e;
        e = e > 100 ? 100 : (e < -100 ? -100 : e);
        sclA = ldexpf(1.f, e);
      }
      if (mB > 0.f && mB < INFINITY) {
        frexpf(mB, &e);
        e = 15 - e;
        e = e > 100 ? 100 : (e < -100 ? -100 : e);
        sclB = ldexpf(1.f, e);
      }
    }
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int col = ks * 16 + j4 * 2 + half * 8;
#pragma unroll
        for (int gsel = 0; gsel < 2; ++gsel) {
          const int g = gsel ? gB : gA;
          const float scl = gsel ? sclB : sclA;
          const bool row = !gsel || HASB; /* without HASB rows 8-15 are zero */
          float x0 = row ? reps[g * RP + col] * scl : 0.f, x1 = row ? reps[g * RP + col + 1] * scl : 0.f;
          float h0 = dsv_round_to<T>(x0), h1 = dsv_round_to<T>(x1);
          float r0 = x0 - h0, r1 = x1 - h1;
          float m0 = dsv_round_to<T>(r0), m1 = dsv_round_to<T>(r1);
          float l0 = r0 - m0, l1 = r1 - m1;
          A[ks][0][half * 2 + gsel] = dsv_pack2<T>(h0, h1);
          A[ks][1][half * 2 + gsel] = dsv_pack2<T>(m0, m1);
          A[ks][2][half * 2 + gsel] = dsv_pack2<T>(l0, l1);
        }
      }
    }
  }
  __syncthreads(); /* reps (aliasing hist) no longer read */

  for (int i = tid; i < GPC; i += TK_THREADS) {
    st_prefix[i] = 0;
    st_need[i] = (int)Keff;
    st_done[i] = 0;
    st_base[i] = 0;
  }

  const bool warp_active = (warp * GPW) < ngl;
  const bool vA = gA < ngl, vB = HASB && gB < ngl;
  uint32_t* histw = hist + warp * GPW * TK_BINS;
  const T* kb = reinterpret_cast<const T*>(a.k) + b * a.k_sb + h * a.k_sh;
  const int ntiles = (int)((S + TK_TILE - 1) / TK_TILE);

  /* ---- radix-select passes (skipped when every key is selected) ---- */
  if (Keff < S) {
    for (int pass = 0; pass < 4; ++pass) {
      const int shift = 24 - 8 * pass;
      const uint32_t pmask = pass == 0 ? 0u : (0xFFFFFFFFu << (shift + 8));
      for (int i = lane; i < GPW * TK_BINS; i += 32) histw[i] = 0;
      __syncthreads(); /* also publishes the states written in the previous pass */
      const bool all_done = __syncthreads_and(tid >= ngl || st_done[tid] != 0);
      if (all_done) break;
      const uint32_t prefA = st_prefix[gA], prefB = HASB ? st_prefix[gB] : 0u;
      const bool actA = vA && !st_done[gA], actB = vB && !st_done[gB];
      const uint32_t hA_addr = smem_u32(histw + (lane >> 2) * TK_BINS);
      const uint32_t hB_addr = hA_addr + 8 * TK_BINS * 4;
      const uint32_t sink = smem_u32(dummy + tid);
      (void)hA_addr;
      (void)hB_addr;
      (void)sink;

      dsv_stage_rows16<T>(ktile, SW, kb, a.k_ss, 0, TK_TILE, S, (int)a.r, RP, a.kvec, tid,
                          TK_THREADS);
      cp_async_commit();
      for (int it = 0; it < ntiles; ++it) {
        cp_async_wait_all();
        __syncthreads();
        if (it + 1 < ntiles) {
          dsv_stage_rows16<T>(ktile + ((it + 1) & 1) * TK_TILE * SW, SW, kb, a.k_ss,
                              (int64_t)(it + 1) * TK_TILE, TK_TILE, S, (int)a.r, RP, a.kvec, tid,
                              TK_THREADS);
        }
        cp_async_commit();
        if (!warp_active) continue;
        const uint32_t* kt = ktile + (it & 1) * TK_TILE * SW;
        const int64_t t0 = (int64_t)it * TK_TILE;
        if constexpr (kTwoPhase) {
          dsv_tk_hist_tile<T, KS, SW, HASB>(kt, A, lane, j4, (int)t0, S32, hA_addr, hB_addr, sink,
                                           pmask, prefA, prefB, shift, actA, actB);
        } else {
        /* one block at a time, branchy atomics (see kTwoPhase) */
#pragma unroll 2
        for (int blk = 0; blk < TK_TILE / 8; ++blk) {
          const int n = blk * 8 + (lane >> 2);
          float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
          for (int ks = 0; ks < KS; ++ks) {
            const uint32_t b0 = kt[n * SW + ks * 8 + j4], b1 = kt[n * SW + ks * 8 + j4 + 4];
            mma16816<T>(d, A[ks][2][0], A[ks][2][1], A[ks][2][2], A[ks][2][3], b0, b1);
            mma16816<T>(d, A[ks][1][0], A[ks][1][1], A[ks][1][2], A[ks][1][3], b0, b1);
            mma16816<T>(d, A[ks][0][0], A[ks][0][1], A[ks][0][2], A[ks][0][3], b0, b1);
          }
          const int key0 = (int)t0 + blk * 8 + j4 * 2;
          const bool k0 = key0 < S32, k1 = key0 + 1 < S32;
          const uint32_t u0 = dsv_float_key(d[0]), u1 = dsv_float_key(d[1]);
          const uint32_t u2 = dsv_float_key(d[2]), u3 = dsv_float_key(d[3]);
          uint32_t* hA = histw + (lane >> 2) * TK_BINS;
          uint32_t* hB = hA + 8 * TK_BINS;
          if (actA && k0 && (u0 & pmask) == prefA) atomicAdd(hA + ((u0 >> shift) & 255u), 1u);
          if (actA && k1 && (u1 & pmask) == prefA) atomicAdd(hA + ((u1 >> shift) & 255u), 1u);
          if (actB && k0 && (u2 & pmask) == prefB) atomicAdd(hB + ((u2 >> shift) & 255u), 1u);
          if (actB && k1 && (u3 & pmask) == prefB) atomicAdd(hB + ((u3 >> shift) & 255u), 1u);
        }
        }
      }
      __syncwarp();

      /* boundary bin of every group of this warp */
      for (int gi = 0; gi < GPW; ++gi) {
        const int gl = warp * GPW + gi;
        if (gl >= ngl) break;
        if (st_done[gl]) continue;
        const uint32_t* hg = histw + gi * TK_BINS + lane * 8;
        const uint4 c0 = *reinterpret_cast<const uint4*>(hg);
        const uint4 c1 = *reinterpret_cast<const uint4*>(hg + 4);
        const uint32_t c[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
        uint32_t csum = 0;
#pragma unroll
        for (int t = 0; t < 8; ++t) csum += c[t];
        uint32_t s = csum;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
          const uint32_t t = __shfl_down_sync(DSV_FULL_MASK, s, off);
          if (lane + off < 32) s += t;
        }
        const uint32_t need = (uint32_t)st_need[gl];
        const uint32_t bal = __ballot_sync(DSV_FULL_MASK, s >= need);
        const int L = bal ? 31 - __clz((int)bal) : 0;
        uint32_t above = s - csum, bsel = 0, bcnt = 0;
        bool found = false;
#pragma unroll
        for (int t = 7; t >= 0; --t) {
          if (!found) {
            if (above + c[t] >= need) {
              found = true;
              bsel = (uint32_t)t;
              bcnt = c[t];
            } else {
              above += c[t];
            }
          }
        }
        above = __shfl_sync(DSV_FULL_MASK, above, L);
        bsel = __shfl_sync(DSV_FULL_MASK, bsel, L);
        bcnt = __shfl_sync(DSV_FULL_MASK, bcnt, L);
        if (lane == 0) {
          const uint32_t nneed = need - above;
          st_prefix[gl] |= ((uint32_t)L * 8u + bsel) << shift;
          st_need[gl] = (int)nneed;
          if (nneed == bcnt || shift == 0 || bal == 0) st_done[gl] = (nneed == bcnt || bal == 0) ? 2 : 1;
        }
      }
    }
  }
  __syncthreads();

  /* ---- compaction pass: ascending positions ---- */
  {
    /* threshold keys of this lane's two score groups */
    uint32_t TA = 0, TB = 0;
    if (Keff < S) {
      TA = st_prefix[gA];
      TB = HASB ? st_prefix[gB] : 0u;
    }
    const int sel_grp = j4 >> 1, w = j4 & 1;
    const int gC = sel_grp ? gB : gA;
    const bool vC = HASB ? gC < ngl : !sel_grp && vA; /* without HASB rows 8-15 hold no group */
    int64_t qC;
    if (!HASB && !vC) qC = 0;
    else if (Keff >= S) qC = S;            /* every key: T = 0 (lowest key), all ties */
    else if (st_done[gC] == 2) qC = S;     /* boundary bin taken completely */
    else qC = st_need[gC];
    int64_t baseC = 0, eqbaseC = 0;
    int32_t* outC = outg0 + (int64_t)gC * kmax;
    const int bsh = 16 * sel_grp + 8 * w;
    const int qbase = lane & ~3;

    dsv_stage_rows16<T>(ktile, SW, kb, a.k_ss, 0, TK_TILE, S, (int)a.r, RP, a.kvec, tid,
                        TK_THREADS);
    cp_async_commit();
    for (int it = 0; it < ntiles; ++it) {
      cp_async_wait_all();
      __syncthreads();
      if (it + 1 < ntiles) {
        dsv_stage_rows16<T>(ktile + ((it + 1) & 1) * TK_TILE * SW, SW, kb, a.k_ss,
                            (int64_t)(it + 1) * TK_TILE, TK_TILE, S, (int)a.r, RP, a.kvec, tid,
                            TK_THREADS);
      }
      cp_async_commit();
      if (!warp_active) continue;
      const uint32_t* kt = ktile + (it & 1) * TK_TILE * SW;
      const int64_t t0 = (int64_t)it * TK_TILE;
      uint32_t mgA = 0, mgB = 0, meA = 0, meB = 0;
      if constexpr (kTwoPhase) {
        dsv_tk_compact_flags<T, KS, SW, HASB>(kt, A, lane, j4, (int)t0, S32, TA, TB, mgA, mgB, meA,
                                              meB);
      } else {
      /* block at a time, unroll 2 (never fully unrolled: see kTwoPhase) */
#pragma unroll 2
      for (int blk = 0; blk < TK_TILE / 8; ++blk) {
        const int n = blk * 8 + (lane >> 2);
        float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
          const uint32_t b0 = kt[n * SW + ks * 8 + j4], b1 = kt[n * SW + ks * 8 + j4 + 4];
          mma16816<T>(d, A[ks][2][0], A[ks][2][1], A[ks][2][2], A[ks][2][3], b0, b1);
          mma16816<T>(d, A[ks][1][0], A[ks][1][1], A[ks][1][2], A[ks][1][3], b0, b1);
          mma16816<T>(d, A[ks][0][0], A[ks][0][1], A[ks][0][2], A[ks][0][3], b0, b1);
        }
        const int key0 = (int)t0 + blk * 8 + j4 * 2;
        const uint32_t k0 = key0 < S32, k1 = key0 + 1 < S32;
        const uint32_t u0 = dsv_float_key(d[0]), u1 = dsv_float_key(d[1]);
        const uint32_t u2 = dsv_float_key(d[2]), u3 = dsv_float_key(d[3]);
        mgA |= ((k0 & (u0 > TA)) << (2 * blk)) | ((k1 & (u1 > TA)) << (2 * blk + 1));
        meA |= ((k0 & (u0 == TA)) << (2 * blk)) | ((k1 & (u1 == TA)) << (2 * blk + 1));
        mgB |= ((k0 & (u2 > TB)) << (2 * blk)) | ((k1 & (u3 > TB)) << (2 * blk + 1));
        meB |= ((k0 & (u2 == TB)) << (2 * blk)) | ((k1 & (u3 == TB)) << (2 * blk + 1));
      }
      }
      const uint32_t mg = mgA | (mgB << 16), me = meA | (meB << 16);
      uint32_t Wg = 0, We = 0;
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        const uint32_t xg = __shfl_sync(DSV_FULL_MASK, mg, qbase + jj);
        const uint32_t xe = __shfl_sync(DSV_FULL_MASK, me, qbase + jj);
        Wg |= dsv_tk_spread((xg >> bsh) & 0xFFu) << (2 * jj);
        We |= dsv_tk_spread((xe >> bsh) & 0xFFu) << (2 * jj);
      }
      /* ties: keep the first (qC - eqbase) in position order */
      const int eq_cnt = __popc(We);
      const int eq_other = __shfl_xor_sync(DSV_FULL_MASK, eq_cnt, 1);
      const int64_t eq_before = eqbaseC + (w ? eq_other : 0);
      int64_t allow = qC - eq_before;
      allow = allow < 0 ? 0 : (allow > 32 ? 32 : allow);
      const uint32_t sel = Wg | dsv_tk_keep_lowest(We, (int)allow);
      const int sel_cnt = __popc(sel);
      const int sel_other = __shfl_xor_sync(DSV_FULL_MASK, sel_cnt, 1);
      int64_t rank = baseC + (w ? sel_other : 0);
      if (vC) {
        uint32_t x = sel;
        const int32_t pos0 = (int32_t)(t0 + 32 * w);
        while (x) {
          const int bit = __ffs(x) - 1;
          x &= x - 1;
          if (rank < Keff) outC[rank] = pos0 + bit;
          ++rank;
        }
      }
      baseC += sel_cnt + sel_other;
      eqbaseC += eq_cnt + eq_other;
    }
    if (warp_active && vC && w == 0) st_base[gC] = (int)(baseC < Keff ? baseC : Keff);
  }
  __syncwarp();
  /* -1 padding after the selected entries */
  for (int gi = 0; gi < GPW; ++gi) {
    const int gl = warp * GPW + gi;
    if (gl >= ngl) break;
    int32_t* o = outg0 + (int64_t)gl * kmax;
    for (int64_t e = st_base[gl] + lane; e < kmax; e += 32) o[e] = -1;
  }
}

template <typename T, int RP, bool TWO, int GPW>
static int dsv_topk_launch_v(const dsv_topk_args& a, int64_t grid, cudaStream_t st) {
  const size_t smem = dsv_topk_smem_bytes<RP, GPW>();
  DSV_CUDA_TRY(cudaFuncSetAttribute(dsv_topk_kernel<T, RP, TWO, GPW>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  dsv_topk_kernel<T, RP, TWO, GPW><<<(unsigned)grid, TK_THREADS, smem, st>>>(a);
  DSV_CUDA_CHECK_LAUNCH();
  return DSV_OK;
}

template <typename T, int RP, bool TWO>
static int dsv_topk_launch_gpw(const dsv_topk_args& a, int gpw, int64_t grid, cudaStream_t st) {
  return gpw == 8 ? dsv_topk_launch_v<T, RP, TWO, 8>(a, grid, st)
                  : dsv_topk_launch_v<T, RP, TWO, 16>(a, grid, st);
}

/* The shipped tile loops are the two-phase ones (dsv_topk_entry<true>; the block-at-a-time
 * instantiation, TWO = false, is csrc/dev/topk_block_at_a_time.cu). */
template <typename T, bool TWO>
static int dsv_topk_dispatch(const dsv_topk_args& a, int RP, int gpw, int64_t grid, cudaStream_t st) {
  switch (RP) {
    case 16: return dsv_topk_launch_gpw<T, 16, TWO>(a, gpw, grid, st);
    case 32: return dsv_topk_launch_gpw<T, 32, TWO>(a, gpw, grid, st);
    case 48: return dsv_topk_launch_gpw<T, 48, TWO>(a, gpw, grid, st);
    case 64: return dsv_topk_launch_gpw<T, 64, TWO>(a, gpw, grid, st);
  }
  return DSV_ERR_UNSUPPORTED;
}

extern "C" size_t dsv_topk_estimate_workspace_cuda(const dsv_lowrank_shape* p) {
  (void)p;
  return 0;
}

/* The argument checks and the run, with the two-phase tile loops (TWO, shipped) or the
 * block-at-a-time ones (csrc/dev/topk_block_at_a_time.cu). */
template <bool TWO>
static int dsv_topk_entry(const dsv_lowrank_shape* p, dsv_bshd q_lr, dsv_bshd k_lr,
                          const int32_t* kv_count, int32_t* kv_index, void* stream) {
  if (!p) return DSV_ERR_INVALID;
  if (p->batch < 0 || p->seqlen < 0 || p->heads < 0 || p->rank <= 0 || p->group_size <= 0 ||
      p->kmax < 0 || p->seqlen > 0x7fffffffLL)
    return DSV_ERR_INVALID;
  if (p->num_groups != dsv_cdiv64(p->seqlen, p->group_size)) return DSV_ERR_INVALID;
  if (p->dtype != DSV_BFLOAT16 && p->dtype != DSV_FLOAT16) return DSV_ERR_UNSUPPORTED;
  if (p->rank > 64) return DSV_ERR_UNSUPPORTED;
  const int64_t BH = p->batch * p->heads;
  if (BH == 0 || p->num_groups == 0 || p->kmax == 0) return DSV_OK;
  if (!q_lr.data || !k_lr.data || !kv_count || !kv_index) return DSV_ERR_INVALID;
  const dsv_tuning* tun = nullptr;
  const int tst = dsv_tuning_current(&tun);
  if (tst != DSV_OK) return tst;
  /* groups per warp: the tuning's, or automatic: 8 where 16 would leave the grid under two CTAs
   * per SM (the estimation is then bound by each warp's chain of passes, not by issue) */
  int gpw = tun->tk_gpw;
  if (gpw != 8 && gpw != 16)
    gpw = BH * dsv_cdiv64(p->num_groups, (int64_t)TK_GPC) < 2LL * tun->sm_count ? 8 : 16;
  dsv_topk_args a;
  a.q = q_lr.data;
  a.k = k_lr.data;
  a.q_sb = q_lr.stride_b;
  a.q_ss = q_lr.stride_s;
  a.q_sh = q_lr.stride_h;
  a.k_sb = k_lr.stride_b;
  a.k_ss = k_lr.stride_s;
  a.k_sh = k_lr.stride_h;
  a.count = kv_count;
  a.out = kv_index;
  a.S = p->seqlen;
  a.H = p->heads;
  a.r = p->rank;
  a.G = p->group_size;
  a.NG = p->num_groups;
  a.kmax = p->kmax;
  a.tiles_per_bh = (int)dsv_cdiv64(p->num_groups, (int64_t)TK_WARPS * gpw);
  a.kvec = dsv_bshd_rows_aligned16(k_lr, 2);
  const int64_t grid = BH * a.tiles_per_bh;
  if (grid > 0x7fffffffLL) return DSV_ERR_UNSUPPORTED;
  const int RP = (int)((p->rank + 15) / 16 * 16);
  cudaStream_t st = (cudaStream_t)stream;
  if (p->dtype == DSV_BFLOAT16) return dsv_topk_dispatch<__nv_bfloat16, TWO>(a, RP, gpw, grid, st);
  return dsv_topk_dispatch<__half, TWO>(a, RP, gpw, grid, st);
}

extern "C" int dsv_topk_estimate_cuda(const dsv_lowrank_shape* p, dsv_bshd q_lr, dsv_bshd k_lr,
                                      const int32_t* kv_count, int32_t* kv_index,
                                      void* workspace, size_t workspace_bytes, void* stream) {
  (void)workspace;
  (void)workspace_bytes;
  return dsv_topk_entry<true>(p, q_lr, k_lr, kv_count, kv_index, stream);
}
