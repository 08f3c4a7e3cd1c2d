/*
 * topk_sampled.cu - exact top-K estimation with a sampled threshold band (a variant of
 * csrc/cuda/topk_estimate.cu, to be measured against it; same contract, same lists).
 *
 *   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
 *        -Icsrc -Xcompiler -fPIC -shared csrc/dev/topk_sampled.cu -o topk_sampled.so
 *
 * Exports dsv_topk_estimate_workspace_cuda / dsv_topk_estimate_cuda (this variant, so that a
 * library built from it with predictor_loss.cu, profile_attention.cu and rows.cu works as
 * DSV_OPS_LIB for the tests and benchmarks/bench_topk.py), dsv_dev_topk_estimate_fold_cuda
 * (the variant with its collect pass folded into the compaction, FOLD below) and the shipped
 * kernel as dsv_dev_topk_estimate_shipped_cuda (all with the same arguments and lists), for
 * comparisons in one process (benchmarks/topk_variant.py, benchmarks/device_topk_variant.sh).
 *
 * Why: the shipped kernel selects by an MSB-first radix select over the whole uint32 key range,
 * 8 bits per pass: 4 histogram passes at the target shape plus the compaction pass, each
 * recomputing all S scores per group (issue-bound on the per-score integer work, PERF_LOG v6).
 * Most of those passes only locate the K-th largest score, which a small sample already locates
 * to within a narrow band.
 *
 * Design (the CTA layout, the exact split-representative scores, the staging and the
 * compaction pass are the shipped kernel's, reused from its source; every (group, key) score is
 * bit-identical to the shipped kernel's, so the lists are too). Per group the selection keeps a
 * window [lo, hi] of the order-preserving uint32 score keys that contains the K-th largest key,
 * with `need` = its rank counted from the top of the window (#(key > hi) = K - need).
 *  0. Sample (two cheap passes): one key in 16 (key 16 i + h(i), h a fixed hash in [0, 16), so
 *     that periodic score patterns do not bias it; clipped to S - 1), 8 + 8 bits of
 *     radix select over the sample for two sample ranks around the expected one,
 *     mu = K n / S (n = ceil(S / 16)): m_lo = mu + 4 sqrt(mu) + 2 and m_hi = mu - 4 sqrt(mu) - 2.
 *     T_lo = the lower edge of the 16-bit key bin holding the m_lo-th largest sample key,
 *     T_hi = the upper edge of the bin holding the m_hi-th (to 8 bits if it lies in another
 *     8-bit bin; open when m_hi < 1). With high probability #(key >= T_lo) >= K > #(key > T_hi).
 *  1. Band pass (all keys): bin 0 = keys below T_lo (not counted: S minus the rest), bins
 *     1..254 = [T_lo, T_hi] in 254 equal power-of-two steps, bin 255 = keys above the band
 *     (counted in registers, no shared atomics). The boundary bin becomes the window. A K-th
 *     largest key outside the band (a sample that misled) is no error: bin 0 or bin 255 is then
 *     the window, refined by the generic passes below (the fallback).
 *  2. Collect pass (all keys): when the window holds at most TKS_CAP keys (the usual case:
 *     ~10 at S = 64k, K = 10%), its keys are appended to the group's histogram slab and the
 *     K-th largest T and the number q of ties at T to take follow exactly from them.
 *     Otherwise a generic pass: a 256-bin histogram over [lo, hi] (bin width 2^s, s the
 *     smallest with (hi - lo) >> s <= 255), which shrinks the window >= 128x, so at most
 *     4 generic passes reach one key value from any window. A pass has one kind for the whole
 *     CTA (band, generic or collect: no per-score mode tests); collecting groups wait while any
 *     group of the CTA needs a generic pass. Bound: band + 4 generic + 1 collect passes.
 *  3. Compaction pass (the shipped one): {key > T} and the first q of {key == T}, ascending.
 * Without a sample (S < TKS_MIN_S) the first pass is generic over the full key range (the
 * shipped radix, 8 bits per pass) or a collect pass when S <= TKS_CAP.
 * Exactness never depends on the sample: every window update is a count over all S keys.
 *
 * Expected cost (PERF_LOG v12), bf16, r = 16, SASS instructions per 64-key tile and warp
 * (static counts of the tile loops, CUDA 13.0): shipped histogram pass 628, compaction 814,
 * and at S = 64k, K = 10% or 5% every CTA runs 4 histogram passes (CPU emulation of both
 * selections on N(0, 1) scores): ~3330 per tile. Here: sample 2 x 565 / 16, band 763, collect
 * 654 (~490 executed: the appends are rare), compaction 824: ~2150-2310, i.e. ~0.65-0.7x of the
 * shipped time (8.3 -> ~5.6 ms at 0.9).
 *
 * FOLD (dsv_dev_topk_estimate_fold_cuda): when every unresolved group of a CTA waits for a
 * collect pass of a window of at most TKS_FOLD_CAP keys, that pass is skipped: the compaction
 * takes every key above the window and every window key (list entries from K on go to a spill
 * in the group's slab), appends the window keys as (key, position) pairs and records the list
 * index of each; dsv_tks_unfold then keeps the `need` best window keys (key descending, then
 * position ascending) and shifts the rest of the list left over the others (one read and one
 * write of the list from the first dropped entry on: ~half a list per group, ~0.2 ms at the
 * target shape). Compaction loop 1246 static (~930 executed): ~1800 per tile with the sample
 * and band passes, ~0.55x of the shipped time plus the shift (8.3 -> ~4.7 ms at 0.9).
 */
#define dsv_topk_estimate_cuda dsv_dev_topk_estimate_shipped_cuda
#define dsv_topk_estimate_workspace_cuda dsv_dev_topk_estimate_shipped_workspace_cuda
#include "cuda/topk_estimate.cu"
#undef dsv_topk_estimate_cuda
#undef dsv_topk_estimate_workspace_cuda

#define TKS_STRIDE 16    /* sample: one key in TKS_STRIDE */
#define TKS_MIN_S 4096   /* sample from this sequence length on */
#define TKS_CAP TK_BINS  /* collect pass: windows of at most this many keys (one slab) */
#define TKS_FOLD_CAP 64  /* folded collect: windows of at most this many keys (a quarter slab) */
#define TKS_MAX_PASSES 6 /* band + at most 4 generic passes + one collect pass (the design) */

/* what a group does in the next pass */
#define TKS_OFF 0     /* resolved (or not a group): nothing */
#define TKS_HIST 1    /* 256-bin histogram of [lo, hi] */
#define TKS_BAND 2    /* band histogram: bins 1..254 from lo = T_lo, bin 255 above top */
#define TKS_COLLECT 3 /* append every key of [lo, hi] to the slab */
/* A pass has one kind for the whole CTA (no per-score mode tests): the groups in another mode
 * wait for their kind (collecting groups wait while any group still needs a histogram). */

/* per-group selection state of a CTA (shared memory) */
struct dsv_tks_groups {
  uint32_t lo[TK_GPC], hi[TK_GPC], top[TK_GPC];
  int s[TK_GPC], mode[TK_GPC], need[TK_GPC], cnt[TK_GPC], done[TK_GPC], ccnt[TK_GPC];
  int base[TK_GPC];                   /* list length written by the compaction */
  int sneed_lo[TK_GPC], sneed_hi[TK_GPC];
  uint32_t thi[TK_GPC];               /* sample stage: T_hi when known from 8 bits only */
};

template <int RP>
static size_t dsv_tks_smem_bytes() {
  const int SW = RP / 2 + 4;
  return (size_t)TK_GPC * TK_BINS * 4 + (size_t)2 * TK_TILE * SW * 4 + sizeof(dsv_tks_groups) +
         (size_t)TK_THREADS * 4 + 16;
}

/* one group's pass parameters in registers (groups not taking part: an empty window) */
struct dsv_tks_prm {
  uint32_t lo, hi, top, slab; /* slab: shared address of the group's 256 words */
  int s;
  uint32_t* cslab;
  int* ccnt;
};

template <int MODE>
static __device__ __forceinline__ dsv_tks_prm dsv_tks_load(dsv_tks_groups& gs, uint32_t* hist,
                                                           int g, bool valid) {
  dsv_tks_prm p;
  const bool on = valid && gs.mode[g] == MODE;
  p.lo = on ? gs.lo[g] : 1u;
  p.hi = on ? gs.hi[g] : 0u;
  p.top = on ? gs.top[g] : 0u;
  p.s = on ? gs.s[g] : 0;
  p.cslab = hist + g * TK_BINS;
  p.slab = smem_u32(p.cslab);
  p.ccnt = gs.ccnt + g;
  return p;
}

/* One score key u of a group in a pass of kind MODE.
 * HIST: bin (u - lo) >> s of [lo, hi]; BAND: bin 1 + ((u - lo) >> s) of [lo, top] and the
 * register count of u > top (bin 255); both add 1 to the bin or, unconditionally as in the
 * shipped passes, to this thread's sink slot. COLLECT: append u in [lo, hi] to the slab. */
template <int MODE>
static __device__ __forceinline__ void dsv_tks_score(const dsv_tks_prm& p, uint32_t u, uint32_t ok,
                                                     uint32_t& above, uint32_t sink) {
  if constexpr (MODE == TKS_COLLECT) {
    if (ok && u >= p.lo && u <= p.hi) {
      const int i = atomicAdd(p.ccnt, 1);
      if (i < TKS_CAP) p.cslab[i] = u;
    }
  } else {
    constexpr uint32_t off = MODE == TKS_BAND ? 1u : 0u;
    const uint32_t last = MODE == TKS_BAND ? p.top : p.hi;
    const bool h = ok && u >= p.lo && u <= last;
    const uint32_t addr = h ? p.slab + ((off + ((u - p.lo) >> p.s)) << 2) : sink;
    asm volatile("red.shared.add.u32 [%0], 1;\n" ::"r"(addr) : "memory");
    if constexpr (MODE == TKS_BAND) above += (uint32_t)(ok && u > p.top);
  }
}

/* the 4 scores of one 8-key block of a lane: c0/c1 of group A, c2/c3 of group B */
template <int MODE>
static __device__ __forceinline__ void dsv_tks_block(const float (&d)[4], uint32_t k0, uint32_t k1,
                                                     const dsv_tks_prm& pA, const dsv_tks_prm& pB,
                                                     uint32_t& aboveA, uint32_t& aboveB,
                                                     uint32_t sink) {
  dsv_tks_score<MODE>(pA, dsv_float_key(d[0]), k0, aboveA, sink);
  dsv_tks_score<MODE>(pA, dsv_float_key(d[1]), k1, aboveA, sink);
  dsv_tks_score<MODE>(pB, dsv_float_key(d[2]), k0, aboveB, sink);
  dsv_tks_score<MODE>(pB, dsv_float_key(d[3]), k1, aboveB, sink);
}

/* One 8-key block's scores, block at a time (the shipped kernel's instruction order). */
template <typename T, int KS, int SW>
static __device__ __forceinline__ void dsv_tks_block_scores(const uint32_t* kt,
                                                            const uint32_t (&A)[KS][3][4],
                                                            int lane, int j4, int blk,
                                                            float (&d)[4]) {
  const int n = blk * 8 + (lane >> 2);
  d[0] = d[1] = d[2] = d[3] = 0.f;
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    const uint32_t b0 = kt[n * SW + ks * 8 + j4], b1 = kt[n * SW + ks * 8 + j4 + 4];
    mma16816<T>(d, A[ks][2][0], A[ks][2][1], A[ks][2][2], A[ks][2][3], b0, b1);
    mma16816<T>(d, A[ks][1][0], A[ks][1][1], A[ks][1][2], A[ks][1][3], b0, b1);
    mma16816<T>(d, A[ks][0][0], A[ks][0][1], A[ks][0][2], A[ks][0][3], b0, b1);
  }
}

/* One staged tile of a pass of kind MODE: two-phase (the shipped tile scores first) or block at
 * a time (fp16 with RP >= 48, see the shipped kernel's kTwoPhase). */
template <typename T, int KS, int SW, bool TWO, int MODE>
static __device__ __forceinline__ void dsv_tks_tile(const uint32_t* kt,
                                                    const uint32_t (&A)[KS][3][4], int lane,
                                                    int j4, int t0, int nvalid,
                                                    const dsv_tks_prm& pA, const dsv_tks_prm& pB,
                                                    uint32_t& aboveA, uint32_t& aboveB,
                                                    uint32_t sink) {
  if constexpr (TWO) {
    float d[TK_TILE / 8][4];
    dsv_tk_tile_scores<T, KS, SW>(kt, A, lane, j4, d);
#pragma unroll
    for (int blk = 0; blk < TK_TILE / 8; ++blk) {
      const int key0 = t0 + blk * 8 + j4 * 2;
      dsv_tks_block<MODE>(d[blk], key0 < nvalid, key0 + 1 < nvalid, pA, pB, aboveA, aboveB, sink);
    }
  } else {
#pragma unroll 2
    for (int blk = 0; blk < TK_TILE / 8; ++blk) {
      float d[4];
      dsv_tks_block_scores<T, KS, SW>(kt, A, lane, j4, blk, d);
      const int key0 = t0 + blk * 8 + j4 * 2;
      dsv_tks_block<MODE>(d, key0 < nvalid, key0 + 1 < nvalid, pA, pB, aboveA, aboveB, sink);
    }
  }
}

/* Sample row i: key min(16 i + h(i), S - 1), h(i) in [0, 16) a fixed multiplicative hash of
 * i, so that a score pattern of period 16 (or a divisor) cannot bias the sample. */
static __device__ __forceinline__ int64_t dsv_tks_sample_key(int64_t i, int64_t S) {
  static_assert(TKS_STRIDE == 16, "h(i) takes the top 4 bits of the hash");
  const int64_t j = i * TKS_STRIDE + (int64_t)(((uint32_t)i * 0x9E3779B1u) >> 28);
  return j < S ? j : S - 1;
}

/* dsv_stage_rows16 for the sample stream: staged row r is key dsv_tks_sample_key(row0 + r)
 * (zero rows from ns on). */
template <typename T>
static __device__ __forceinline__ void dsv_tks_stage_sample(uint32_t* smem, int sw, const T* base,
                                                            int64_t row_stride, int64_t row0,
                                                            int64_t ns, int64_t S, int dim,
                                                            int dp, bool vec, int tid) {
  const int cpr = dp / 8; /* 16-byte chunks per row */
  for (int c = tid; c < TK_TILE * cpr; c += TK_THREADS) {
    const int r = c / cpr, ch = c - r * cpr;
    const int64_t row = row0 + r;
    uint32_t* dst = smem + r * sw + ch * 4;
    const int e0 = ch * 8;
    const T* src = base + dsv_tks_sample_key(row, S) * row_stride;
    if (row < ns && vec && e0 + 8 <= dim) {
      cp_async16(dst, src + e0);
    } else {
      uint32_t w[4];
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        unsigned short lo = 0, hi = 0;
        if (row < ns) {
          if (e0 + 2 * t < dim) lo = *reinterpret_cast<const unsigned short*>(src + e0 + 2 * t);
          if (e0 + 2 * t + 1 < dim)
            hi = *reinterpret_cast<const unsigned short*>(src + e0 + 2 * t + 1);
        }
        w[t] = (uint32_t)lo | ((uint32_t)hi << 16);
      }
      *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
}

/* Stage tile `it` of a pass: all keys, or the sample (nrows = ns sample rows). */
template <typename T, bool SAMPLE>
static __device__ __forceinline__ void dsv_tks_stage(uint32_t* dst, int sw, const T* kb,
                                                     const dsv_topk_args& a, int64_t nrows,
                                                     int it, int dp, int tid) {
  if constexpr (SAMPLE)
    dsv_tks_stage_sample<T>(dst, sw, kb, a.k_ss, (int64_t)it * TK_TILE, nrows, a.S, (int)a.r,
                            dp, a.kvec, tid);
  else
    dsv_stage_rows16<T>(dst, sw, kb, a.k_ss, (int64_t)it * TK_TILE, TK_TILE, nrows, (int)a.r, dp,
                        a.kvec, tid, TK_THREADS);
}

/* One pass of kind MODE over a key stream (all S keys, or the ns sample rows): the groups in
 * that mode take part, the others wait. Called by all threads; a BAND pass ends with the
 * above-band counts in bin 255 of the slabs. */
template <typename T, int KS, int SW, bool TWO, int MODE, bool SAMPLE>
static __device__ __forceinline__ void dsv_tks_pass(const dsv_topk_args& a, const T* kb,
                                                    int64_t nrows,
                                                    uint32_t* ktile, const uint32_t (&A)[KS][3][4],
                                                    dsv_tks_groups& gs, uint32_t* hist,
                                                    bool warp_active, int tid, int lane, int gA,
                                                    int gB, bool vA, bool vB) {
  const int j4 = lane & 3;
  const dsv_tks_prm pA = dsv_tks_load<MODE>(gs, hist, gA, vA);
  const dsv_tks_prm pB = dsv_tks_load<MODE>(gs, hist, gB, vB);
  const uint32_t sink = smem_u32(reinterpret_cast<uint32_t*>(&gs + 1) + tid);
  uint32_t aboveA = 0, aboveB = 0;
  const int ntiles = (int)((nrows + TK_TILE - 1) / TK_TILE);
  const int nv = (int)nrows;
  dsv_tks_stage<T, SAMPLE>(ktile, SW, kb, a, nrows, 0, KS * 16, tid);
  cp_async_commit();
  for (int it = 0; it < ntiles; ++it) {
    cp_async_wait_all();
    __syncthreads();
    if (it + 1 < ntiles)
      dsv_tks_stage<T, SAMPLE>(ktile + ((it + 1) & 1) * TK_TILE * SW, SW, kb, a, nrows, it + 1,
                               KS * 16, tid);
    cp_async_commit();
    if (!warp_active) continue;
    dsv_tks_tile<T, KS, SW, TWO, MODE>(ktile + (it & 1) * TK_TILE * SW, A, lane, j4,
                                       it * TK_TILE, nv, pA, pB, aboveA, aboveB, sink);
  }
  if constexpr (MODE == TKS_BAND) {
    /* the quad of lanes (lane >> 2) holds all keys of its two groups */
    aboveA += __shfl_xor_sync(DSV_FULL_MASK, aboveA, 1);
    aboveA += __shfl_xor_sync(DSV_FULL_MASK, aboveA, 2);
    aboveB += __shfl_xor_sync(DSV_FULL_MASK, aboveB, 1);
    aboveB += __shfl_xor_sync(DSV_FULL_MASK, aboveB, 2);
    if (warp_active && j4 == 0) {
      if (vA) hist[gA * TK_BINS + TK_BINS - 1] = aboveA;
      if (vB) hist[gB * TK_BINS + TK_BINS - 1] = aboveB;
    }
  }
  __syncwarp();
}

/* Boundary bin of a 256-bin slab for rank `need` from the top (the shipped kernel's scan); a
 * band slab gets bin 0 = nkeys minus the rest. All lanes return the same bin, the count above
 * it and its count. Requires need <= the slab's total. */
static __device__ __forceinline__ void dsv_tks_find(const uint32_t* slab, uint32_t need, int lane,
                                                    bool band, uint32_t nkeys, uint32_t& bin,
                                                    uint32_t& above_out, uint32_t& cnt) {
  const uint4 c0 = *reinterpret_cast<const uint4*>(slab + lane * 8);
  const uint4 c1 = *reinterpret_cast<const uint4*>(slab + lane * 8 + 4);
  uint32_t c[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
  uint32_t csum = 0;
#pragma unroll
  for (int t = 0; t < 8; ++t) csum += c[t];
  if (band) {
    const uint32_t total = __reduce_add_sync(DSV_FULL_MASK, csum);
    if (lane == 0) {
      c[0] += nkeys - total;
      csum += nkeys - total;
    }
  }
  uint32_t s = csum;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const uint32_t t = __shfl_down_sync(DSV_FULL_MASK, s, off);
    if (lane + off < 32) s += t;
  }
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
  above_out = __shfl_sync(DSV_FULL_MASK, above, L);
  bin = (uint32_t)L * 8u + __shfl_sync(DSV_FULL_MASK, bsel, L);
  cnt = __shfl_sync(DSV_FULL_MASK, bcnt, L);
}

/* the next pass of an unresolved group whose window [lo, hi] (lo < hi) holds cnt keys */
static __device__ __forceinline__ void dsv_tks_plan(dsv_tks_groups& gs, int g) {
  if (gs.cnt[g] <= TKS_CAP) {
    gs.mode[g] = TKS_COLLECT;
    gs.s[g] = 0;
  } else {
    const int bits = 32 - __clz((int)(gs.hi[g] - gs.lo[g]));
    gs.mode[g] = TKS_HIST;
    gs.s[g] = bits > 8 ? bits - 8 : 0;
  }
  gs.top[g] = gs.hi[g];
}

/* After a pass over all keys: every group of this warp that took part (mode == pass_mode)
 * narrows its window (or resolves T and q). Whole warp; lane 0 writes the state. */
static __device__ __forceinline__ void dsv_tks_resolve(dsv_tks_groups& gs, uint32_t* hist,
                                                       int pass_mode, int warp, int lane, int ngl,
                                                       uint32_t S) {
  for (int gi = 0; gi < TK_GPW; ++gi) {
    const int gl = warp * TK_GPW + gi;
    if (gl >= ngl) break;
    const int mode = gs.mode[gl];
    if (gs.done[gl] || mode != pass_mode) continue;
    const uint32_t* slab = hist + gl * TK_BINS;
    const int need = gs.need[gl];
    const int n = gs.ccnt[gl] < TKS_CAP ? gs.ccnt[gl] : TKS_CAP;
    __syncwarp(); /* every lane has read the state before any lane writes it */
    if (mode == TKS_COLLECT) {
      /* the window's keys: T = the one with #(> T) < need <= #(>= T) (the first lane that
       * finds it writes) */
      for (int i0 = 0; i0 < n; i0 += 32) {
        const int i = i0 + lane;
        uint32_t x = 0;
        int gt = 0, ge = 0;
        if (i < n) {
          x = slab[i];
          for (int j = 0; j < n; ++j) {
            const uint32_t y = slab[j];
            gt += y > x;
            ge += y >= x;
          }
        }
        const uint32_t hit = __ballot_sync(DSV_FULL_MASK, i < n && gt < need && need <= ge);
        if (hit && lane == __ffs((int)hit) - 1) {
          gs.lo[gl] = x;
          gs.need[gl] = need - gt;
        }
        if (hit) break;
      }
      __syncwarp();
      if (lane == 0) {
        gs.done[gl] = 1;
        gs.mode[gl] = TKS_OFF;
      }
      continue;
    }
    uint32_t b, above, cnt;
    dsv_tks_find(slab, (uint32_t)need, lane, mode == TKS_BAND, S, b, above, cnt);
    if (lane == 0) {
      const uint64_t lo = gs.lo[gl], hi = gs.hi[gl], top = gs.top[gl];
      const int s = gs.s[gl];
      uint64_t nlo, nhi;
      if (mode == TKS_BAND && b == 0) { /* below the band */
        nlo = 0;
        nhi = lo - 1;
      } else if (mode == TKS_BAND && b == TK_BINS - 1) { /* above the band */
        nlo = top + 1;
        nhi = hi;
      } else {
        nlo = lo + ((uint64_t)(b - (mode == TKS_BAND)) << s);
        nhi = nlo + ((uint64_t)1 << s) - 1;
        if (nhi > top) nhi = top;
      }
      const int nneed = need - (int)above;
      gs.lo[gl] = (uint32_t)nlo;
      gs.hi[gl] = (uint32_t)nhi;
      gs.need[gl] = nneed;
      gs.cnt[gl] = (int)cnt;
      if ((int)cnt == nneed) { /* the whole window: every key >= lo */
        gs.done[gl] = 2;
        gs.mode[gl] = TKS_OFF;
      } else if (nlo == nhi) { /* one key value: T = lo, take need of its ties */
        gs.done[gl] = 1;
        gs.mode[gl] = TKS_OFF;
      } else {
        dsv_tks_plan(gs, gl);
      }
    }
  }
}

/* The shipped prologue's A fragments (hi / mid / lo parts of the fp32 representative; fp16:
 * scaled by a power of two per group), the same arithmetic so that the scores are identical. */
template <typename T, int RP>
static __device__ __forceinline__ void dsv_tks_fragments(const float* reps, int gA, int gB,
                                                         int j4, uint32_t (&A)[RP / 16][3][4]) {
  constexpr int KS = RP / 16;
  float sclA = 1.f, sclB = 1.f;
  if (!dsv_is_bf16<T>::value) {
    float mA = 0.f, mB = 0.f;
    for (int c = 0; c < RP; ++c) {
      mA = fmaxf(mA, fabsf(reps[gA * RP + c]));
      mB = fmaxf(mB, fabsf(reps[gB * RP + c]));
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
        float x0 = reps[g * RP + col] * scl, x1 = reps[g * RP + col + 1] * scl;
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

/* A group's compaction thresholds: selected = key > tg, or key in [el, eh] within the tie
 * budget (el == eh == T for a resolved group, as shipped; FOLD, a folded group: tg = eh = hi,
 * el = lo, every window key selected and appended to the slab as a (key, position) pair). */
struct dsv_tks_cmp {
  uint32_t tg, el, eh;
  bool fold;
  uint32_t* slab;
  int* ccnt;
};

static __device__ __forceinline__ dsv_tks_cmp dsv_tks_cmp_of(dsv_tks_groups& gs, uint32_t* hist,
                                                             int g, bool valid, bool selected,
                                                             bool fold) {
  dsv_tks_cmp c;
  c.fold = fold && valid && gs.mode[g] == TKS_COLLECT;
  const uint32_t T = selected ? gs.lo[g] : 0u; /* not selected (K >= S): every key, T = 0 */
  c.tg = c.fold ? gs.hi[g] : T;
  c.el = T;
  c.eh = c.fold ? gs.hi[g] : T;
  c.slab = hist + g * TK_BINS;
  c.ccnt = gs.ccnt + g;
  return c;
}

static __device__ __forceinline__ void dsv_tks_append_pair(const dsv_tks_cmp& c, uint32_t u,
                                                           int pos) {
  const int i = atomicAdd(c.ccnt, 1);
  if (i < TKS_FOLD_CAP) {
    c.slab[2 * i] = u;
    c.slab[2 * i + 1] = (uint32_t)pos;
  }
}

/* compaction flags of one 8-key block (the shipped dsv_tk_compact_flags, per block); FOLD:
 * "equal" widened to [el, eh] and the folded groups' window keys appended */
template <bool FOLD>
static __device__ __forceinline__ void dsv_tks_flags(const float (&d)[4], int blk, uint32_t k0,
                                                     uint32_t k1, int key0, const dsv_tks_cmp& cA,
                                                     const dsv_tks_cmp& cB, uint32_t& mgA,
                                                     uint32_t& mgB, uint32_t& meA,
                                                     uint32_t& meB) {
  const uint32_t u0 = dsv_float_key(d[0]), u1 = dsv_float_key(d[1]);
  const uint32_t u2 = dsv_float_key(d[2]), u3 = dsv_float_key(d[3]);
  mgA |= ((k0 & (u0 > cA.tg)) << (2 * blk)) | ((k1 & (u1 > cA.tg)) << (2 * blk + 1));
  mgB |= ((k0 & (u2 > cB.tg)) << (2 * blk)) | ((k1 & (u3 > cB.tg)) << (2 * blk + 1));
  if constexpr (!FOLD) {
    meA |= ((k0 & (u0 == cA.el)) << (2 * blk)) | ((k1 & (u1 == cA.el)) << (2 * blk + 1));
    meB |= ((k0 & (u2 == cB.el)) << (2 * blk)) | ((k1 & (u3 == cB.el)) << (2 * blk + 1));
  } else {
    const uint32_t e0 = k0 & (u0 >= cA.el) & (u0 <= cA.eh), e1 = k1 & (u1 >= cA.el) & (u1 <= cA.eh);
    const uint32_t e2 = k0 & (u2 >= cB.el) & (u2 <= cB.eh), e3 = k1 & (u3 >= cB.el) & (u3 <= cB.eh);
    meA |= (e0 << (2 * blk)) | (e1 << (2 * blk + 1));
    meB |= (e2 << (2 * blk)) | (e3 << (2 * blk + 1));
    if (cA.fold && (e0 | e1)) {
      if (e0) dsv_tks_append_pair(cA, u0, key0);
      if (e1) dsv_tks_append_pair(cA, u1, key0 + 1);
    }
    if (cB.fold && (e2 | e3)) {
      if (e2) dsv_tks_append_pair(cB, u2, key0);
      if (e3) dsv_tks_append_pair(cB, u3, key0 + 1);
    }
  }
}

/* FOLD, after the compaction: a folded group's list holds its K - need keys above the window
 * and all n window keys (list entries from Keff on in the slab's spill words); keep the need
 * best window keys (key descending, then position ascending) and close the gaps left by the
 * other n - need. Slab: pairs [0, 2 CAP), spill [2 CAP, 3 CAP), list index of the window key
 * of each position-order ordinal [3 CAP, 4 CAP). Whole warp. */
static __device__ __forceinline__ void dsv_tks_unfold(uint32_t* slab, int n, int need,
                                                      int64_t Keff, int32_t* out, int lane) {
  const uint32_t* spill = slab + 2 * TKS_FOLD_CAP;
  uint32_t* wrank = slab + 3 * TKS_FOLD_CAP;
  uint32_t lr[2];
  bool drop[2];
#pragma unroll
  for (int t = 0; t < 2; ++t) {
    const int i = lane + 32 * t;
    drop[t] = false;
    lr[t] = 0xFFFFFFFFu;
    if (i < n) {
      const uint32_t u = slab[2 * i], p = slab[2 * i + 1];
      int r = 0, o = 0;
      for (int j = 0; j < n; ++j) {
        const uint32_t uj = slab[2 * j], pj = slab[2 * j + 1];
        r += (uj > u) || (uj == u && pj < p);
        o += pj < p;
      }
      drop[t] = r >= need;
      lr[t] = wrank[o];
    }
  }
  __syncwarp();
#pragma unroll
  for (int t = 0; t < 2; ++t) {
    const int i = lane + 32 * t;
    if (i < n) wrank[i] = drop[t] ? lr[t] : 0xFFFFFFFFu;
  }
  __syncwarp();
  /* the dropped keys' list indices, ascending, into slab[0 .. m) */
#pragma unroll
  for (int t = 0; t < 2; ++t) {
    const int i = lane + 32 * t;
    if (i < n && drop[t]) {
      int k = 0;
      for (int j = 0; j < n; ++j) k += wrank[j] < lr[t];
      slab[k] = lr[t];
    }
  }
  __syncwarp();
  const int m = n - need;
  const int64_t L = Keff + m;
  int k = 0; /* this lane's cursor: dropped indices below its current entry */
  for (int64_t jb = slab[0]; jb < L; jb += 32 * 8) {
    int32_t e[8];
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      const int64_t j = jb + 32 * t + lane;
      e[t] = j < L ? (j < Keff ? out[j] : (int32_t)spill[j - Keff]) : 0;
    }
    __syncwarp(); /* every read of this batch before any write (writes go to lower indices) */
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      const int64_t j = jb + 32 * t + lane;
      if (j < L) {
        while (k < m && (int64_t)slab[k] < j) ++k;
        if (!(k < m && (int64_t)slab[k] == j)) out[j - k] = e[t];
      }
    }
    __syncwarp();
  }
}

template <typename T, int RP, bool FOLD>
__global__ void __launch_bounds__(TK_THREADS) dsv_tks_kernel(const dsv_topk_args a) {
  constexpr int KS = RP / 16;
  constexpr int SW = RP / 2 + 4;
  constexpr bool kTwoPhase = dsv_is_bf16<T>::value || RP <= 32; /* as shipped */
  extern __shared__ __align__(16) unsigned char dsv_tks_smem[];
  uint32_t* hist = reinterpret_cast<uint32_t*>(dsv_tks_smem); /* [64 groups][256] slabs */
  float* reps = reinterpret_cast<float*>(dsv_tks_smem);       /* alias, prologue: [64][RP] */
  uint32_t* ktile = hist + TK_GPC * TK_BINS;                  /* [2][TILE][SW] */
  dsv_tks_groups& gs = *reinterpret_cast<dsv_tks_groups*>(ktile + 2 * TK_TILE * SW);
  /* followed by [threads] sink slots */

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t bh = blockIdx.x / a.tiles_per_bh;
  const int tile = (int)(blockIdx.x - bh * a.tiles_per_bh);
  const int64_t b = bh / a.H, h = bh - b * a.H;
  const int64_t g0 = (int64_t)tile * TK_GPC;
  const int64_t S = a.S, NG = a.NG, kmax = a.kmax;
  const int S32 = (int)S; /* S < 2^31 (host check) */
  const int ngl = (int)((NG - g0) < TK_GPC ? (NG - g0) : TK_GPC);
  int64_t K = a.count[bh];
  K = K < 0 ? 0 : (K > kmax ? kmax : K);
  const int64_t Keff = K < S ? K : S;
  int32_t* outg0 = a.out + (bh * NG + g0) * kmax;

  if (Keff == 0) {
    const int64_t n = (int64_t)ngl * kmax;
    for (int64_t e = tid; e < n; e += TK_THREADS) outg0[e] = -1;
    return;
  }

  /* ---- prologue: representatives (fp32 mean of member rows), zero-padded (as shipped) ---- */
  {
    const T* qb = reinterpret_cast<const T*>(a.q) + b * a.q_sb + h * a.q_sh;
    for (int idx = tid; idx < TK_GPC * RP; idx += TK_THREADS) {
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
  const int gA = warp * TK_GPW + (lane >> 2), gB = gA + 8, j4 = lane & 3;
  uint32_t A[KS][3][4];
  dsv_tks_fragments<T, RP>(reps, gA, gB, j4, A);
  __syncthreads(); /* reps (aliasing the slabs) no longer read */

  const bool warp_active = (warp * TK_GPW) < ngl;
  const bool vA = gA < ngl, vB = gB < ngl;
  uint32_t* histw = hist + warp * TK_GPW * TK_BINS;
  const T* kb = reinterpret_cast<const T*>(a.k) + b * a.k_sb + h * a.k_sh;
  bool fold = false; /* FOLD: the collect pass folded into the compaction (CTA-uniform) */

  if (Keff < S) {
    /* ---- 0. sample: T_lo / T_hi per group ---- */
    const bool sampled = S >= TKS_MIN_S;
    if (sampled) {
      const int64_t ns = (S + TKS_STRIDE - 1) / TKS_STRIDE;
      const float mu = (float)Keff * (float)ns / (float)S, sd = sqrtf(mu);
      const float flo = ceilf(mu + 4.f * sd + 2.f), fhi = floorf(mu - 4.f * sd - 2.f);
      const int m_lo = flo >= (float)ns ? (int)ns : (int)flo;
      const int m_hi = fhi < 1.f ? 0 : (int)fhi;
      for (int i = tid; i < TK_GPC; i += TK_THREADS) {
        gs.mode[i] = TKS_HIST;
        gs.lo[i] = 0u;
        gs.hi[i] = 0xFFFFFFFFu;
        gs.top[i] = 0xFFFFFFFFu;
        gs.s[i] = 24;
        gs.done[i] = 0;
      }
      for (int sp = 0; sp < 2; ++sp) {
        for (int i = lane; i < TK_GPW * TK_BINS; i += 32) histw[i] = 0;
        __syncthreads();
        dsv_tks_pass<T, KS, SW, kTwoPhase, TKS_HIST, true>(a, kb, ns, ktile, A, gs, hist,
                                                           warp_active, tid, lane, gA, gB, vA, vB);
        for (int gi = 0; gi < TK_GPW; ++gi) {
          const int gl = warp * TK_GPW + gi;
          if (gl >= ngl) break;
          const uint32_t* slab = hist + gl * TK_BINS;
          uint32_t bl, al, cl, bh8 = 0, ah = 0, ch = 0;
          const uint32_t nlo = sp == 0 ? (uint32_t)m_lo : (uint32_t)gs.sneed_lo[gl];
          const int nhi = sp == 0 ? m_hi : gs.sneed_hi[gl];
          dsv_tks_find(slab, nlo, lane, false, 0u, bl, al, cl);
          if (nhi > 0) dsv_tks_find(slab, (uint32_t)nhi, lane, false, 0u, bh8, ah, ch);
          if (lane == 0) {
            const uint32_t lo = gs.lo[gl];
            if (sp == 0) {
              gs.lo[gl] = bl << 24;
              gs.hi[gl] = (bl << 24) | 0xFFFFFFu;
              gs.top[gl] = gs.hi[gl];
              gs.s[gl] = 16;
              gs.sneed_lo[gl] = (int)(nlo - al);
              gs.sneed_hi[gl] = (nhi > 0 && bh8 == bl) ? nhi - (int)al : 0;
              gs.thi[gl] = nhi > 0 ? ((bh8 << 24) | 0xFFFFFFu) : 0xFFFFFFFFu;
            } else {
              gs.lo[gl] = lo + (bl << 16); /* T_lo */
              gs.hi[gl] = nhi > 0 ? lo + (bh8 << 16) + 0xFFFFu : gs.thi[gl]; /* T_hi */
            }
          }
        }
      }
      __syncthreads();
      /* ---- band pass parameters ---- */
      for (int i = tid; i < TK_GPC; i += TK_THREADS) {
        const uint32_t tlo = gs.lo[i], thi = gs.hi[i];
        const uint32_t w = thi - tlo;
        int s = 0;
        while ((w >> s) > 253u) ++s;
        const uint64_t top = (uint64_t)tlo + ((uint64_t)254 << s) - 1;
        gs.top[i] = top > 0xFFFFFFFFull ? 0xFFFFFFFFu : (uint32_t)top;
        gs.s[i] = s;
        gs.hi[i] = 0xFFFFFFFFu;
        gs.mode[i] = TKS_BAND;
        gs.need[i] = (int)Keff;
        gs.cnt[i] = S32;
        gs.done[i] = 0;
      }
    } else {
      for (int i = tid; i < TK_GPC; i += TK_THREADS) {
        gs.lo[i] = 0u;
        gs.hi[i] = 0xFFFFFFFFu;
        gs.need[i] = (int)Keff;
        gs.cnt[i] = S32;
        gs.done[i] = 0;
        dsv_tks_plan(gs, i);
      }
    }

    /* ---- 1-2. band / generic / collect passes over all keys until every group is resolved */
    for (int pass = 0; pass < TKS_MAX_PASSES; ++pass) {
      for (int i = lane; i < TK_GPW * TK_BINS; i += 32) histw[i] = 0;
      if (lane < TK_GPW) gs.ccnt[warp * TK_GPW + lane] = 0;
      __syncthreads(); /* also publishes the states written in the previous pass */
      const bool all_done = __syncthreads_and(tid >= ngl || gs.done[tid] != 0);
      if (all_done) break;
      /* the pass kind: BAND (the first, sampled), else HIST while any group needs one (the
       * collecting groups wait), else COLLECT */
      const bool band = __syncthreads_or(tid < ngl && gs.mode[tid] == TKS_BAND);
      const bool hst = __syncthreads_or(tid < ngl && gs.mode[tid] == TKS_HIST);
      const int kind = band ? TKS_BAND : (hst ? TKS_HIST : TKS_COLLECT);
      if (FOLD && kind == TKS_COLLECT) {
        fold = __syncthreads_and(tid >= ngl || gs.mode[tid] != TKS_COLLECT ||
                                 gs.cnt[tid] <= TKS_FOLD_CAP);
        if (fold) break;
      }
      if (kind == TKS_BAND)
        dsv_tks_pass<T, KS, SW, kTwoPhase, TKS_BAND, false>(a, kb, S, ktile, A, gs, hist,
                                                            warp_active, tid, lane, gA, gB, vA, vB);
      else if (kind == TKS_HIST)
        dsv_tks_pass<T, KS, SW, kTwoPhase, TKS_HIST, false>(a, kb, S, ktile, A, gs, hist,
                                                            warp_active, tid, lane, gA, gB, vA, vB);
      else
        dsv_tks_pass<T, KS, SW, kTwoPhase, TKS_COLLECT, false>(a, kb, S, ktile, A, gs, hist,
                                                               warp_active, tid, lane, gA, gB, vA,
                                                               vB);
      dsv_tks_resolve(gs, hist, kind, warp, lane, ngl, (uint32_t)S);
    }
  }
  __syncthreads();

  /* ---- 3. compaction pass: ascending positions (the shipped pass) ---- */
  {
    const dsv_tks_cmp cA = dsv_tks_cmp_of(gs, hist, gA, vA, Keff < S, fold);
    const dsv_tks_cmp cB = dsv_tks_cmp_of(gs, hist, gB, vB, Keff < S, fold);
    const int sel_grp = j4 >> 1, w = j4 & 1;
    const int gC = sel_grp ? gB : gA;
    const bool vC = gC < ngl;
    const bool foldC = FOLD && (sel_grp ? cB.fold : cA.fold);
    uint32_t* spillC = hist + gC * TK_BINS + 2 * TKS_FOLD_CAP;
    uint32_t* wrankC = hist + gC * TK_BINS + 3 * TKS_FOLD_CAP;
    int64_t qC;
    if (Keff >= S) qC = S;                       /* every key: T = 0 (lowest key), all ties */
    else if (gs.done[gC] == 2 || foldC) qC = S;  /* every key >= T, or every window key */
    else qC = gs.need[gC];
    int64_t baseC = 0, eqbaseC = 0;
    int32_t* outC = outg0 + (int64_t)gC * kmax;
    const int bsh = 16 * sel_grp + 8 * w;
    const int qbase = lane & ~3;
    const int ntiles = (int)((S + TK_TILE - 1) / TK_TILE);

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
      const int t0 = it * TK_TILE;
      uint32_t mgA = 0, mgB = 0, meA = 0, meB = 0;
      if constexpr (kTwoPhase) {
        float dd[TK_TILE / 8][4];
        dsv_tk_tile_scores<T, KS, SW>(kt, A, lane, j4, dd);
#pragma unroll
        for (int blk = 0; blk < TK_TILE / 8; ++blk) {
          const int key0 = t0 + blk * 8 + j4 * 2;
          dsv_tks_flags<FOLD>(dd[blk], blk, key0 < S32, key0 + 1 < S32, key0, cA, cB, mgA, mgB,
                              meA, meB);
        }
      } else {
#pragma unroll 2
        for (int blk = 0; blk < TK_TILE / 8; ++blk) {
          float d[4];
          dsv_tks_block_scores<T, KS, SW>(kt, A, lane, j4, blk, d);
          const int key0 = t0 + blk * 8 + j4 * 2;
          dsv_tks_flags<FOLD>(d, blk, key0 < S32, key0 + 1 < S32, key0, cA, cB, mgA, mgB, meA,
                              meB);
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
          else if (FOLD && foldC && rank - Keff < TKS_FOLD_CAP) spillC[rank - Keff] = pos0 + bit;
          if (FOLD && foldC && ((We >> bit) & 1u)) { /* a window key: its list index by ordinal */
            const int64_t o = eq_before + __popc(We & ((1u << bit) - 1u));
            if (o < TKS_FOLD_CAP) wrankC[o] = (uint32_t)rank;
          }
          ++rank;
        }
      }
      baseC += sel_cnt + sel_other;
      eqbaseC += eq_cnt + eq_other;
    }
    if (warp_active && vC && w == 0) gs.base[gC] = (int)(baseC < Keff ? baseC : Keff);
  }
  __syncwarp();
  if (FOLD && fold) {
    for (int gi = 0; gi < TK_GPW; ++gi) {
      const int gl = warp * TK_GPW + gi;
      if (gl >= ngl) break;
      if (gs.mode[gl] != TKS_COLLECT) continue;
      dsv_tks_unfold(hist + gl * TK_BINS, gs.cnt[gl], gs.need[gl], Keff,
                     outg0 + (int64_t)gl * kmax, lane);
    }
  }
  /* -1 padding after the selected entries */
  for (int gi = 0; gi < TK_GPW; ++gi) {
    const int gl = warp * TK_GPW + gi;
    if (gl >= ngl) break;
    int32_t* o = outg0 + (int64_t)gl * kmax;
    for (int64_t e = gs.base[gl] + lane; e < kmax; e += 32) o[e] = -1;
  }
}

template <typename T, int RP, bool FOLD>
static int dsv_tks_launch(const dsv_topk_args& a, int64_t grid, cudaStream_t st) {
  const size_t smem = dsv_tks_smem_bytes<RP>();
  DSV_CUDA_TRY(cudaFuncSetAttribute(dsv_tks_kernel<T, RP, FOLD>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  dsv_tks_kernel<T, RP, FOLD><<<(unsigned)grid, TK_THREADS, smem, st>>>(a);
  DSV_CUDA_CHECK_LAUNCH();
  return DSV_OK;
}

template <typename T, bool FOLD>
static int dsv_tks_dispatch(const dsv_topk_args& a, int RP, int64_t grid, cudaStream_t st) {
  switch (RP) {
    case 16: return dsv_tks_launch<T, 16, FOLD>(a, grid, st);
    case 32: return dsv_tks_launch<T, 32, FOLD>(a, grid, st);
    case 48: return dsv_tks_launch<T, 48, FOLD>(a, grid, st);
    case 64: return dsv_tks_launch<T, 64, FOLD>(a, grid, st);
  }
  return DSV_ERR_UNSUPPORTED;
}

extern "C" size_t dsv_topk_estimate_workspace_cuda(const dsv_lowrank_shape* p) {
  (void)p;
  return 0;
}

/* The shipped argument checks (dsv_topk_entry), then this variant's kernel (FOLD: the collect
 * pass folded into the compaction). */
template <bool FOLD>
static int dsv_tks_entry(const dsv_lowrank_shape* p, dsv_bshd q_lr, dsv_bshd k_lr,
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
  a.tiles_per_bh = (int)dsv_cdiv64(p->num_groups, TK_GPC);
  a.kvec = dsv_bshd_rows_aligned16(k_lr, 2);
  const int64_t grid = BH * a.tiles_per_bh;
  if (grid > 0x7fffffffLL) return DSV_ERR_UNSUPPORTED;
  const int RP = (int)((p->rank + 15) / 16 * 16);
  cudaStream_t st = (cudaStream_t)stream;
  if (p->dtype == DSV_BFLOAT16) return dsv_tks_dispatch<__nv_bfloat16, FOLD>(a, RP, grid, st);
  return dsv_tks_dispatch<__half, FOLD>(a, RP, grid, st);
}

extern "C" int dsv_topk_estimate_cuda(const dsv_lowrank_shape* p, dsv_bshd q_lr, dsv_bshd k_lr,
                                      const int32_t* kv_count, int32_t* kv_index,
                                      void* workspace, size_t workspace_bytes, void* stream) {
  (void)workspace;
  (void)workspace_bytes;
  return dsv_tks_entry<false>(p, q_lr, k_lr, kv_count, kv_index, stream);
}

/* The same with the collect pass folded into the compaction (same arguments, same lists). */
extern "C" int dsv_dev_topk_estimate_fold_cuda(const dsv_lowrank_shape* p, dsv_bshd q_lr,
                                               dsv_bshd k_lr, const int32_t* kv_count,
                                               int32_t* kv_index, void* workspace,
                                               size_t workspace_bytes, void* stream) {
  (void)workspace;
  (void)workspace_bytes;
  return dsv_tks_entry<true>(p, q_lr, k_lr, kv_count, kv_index, stream);
}
