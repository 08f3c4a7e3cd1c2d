/*
 * topk_estimate.cu - fused low-rank scoring + exact top-K selection per query group (sm_90a).
 *
 * Semantics (dsv.h): for group g of (b, h), rep = mean of q_lr rows of the group's members (last
 * group may be partial); score_j = rep . k_lr[b, j, h, :]; the list (b, h, g) receives the
 * positions of the kv_count[b, h] highest scores, ascending, ties broken towards the lower
 * position, then -1 up to kmax. No score matrix is ever written: scores are recomputed.
 *
 * Design
 *  - One CTA = 4 warps; each warp owns GPW = 16 groups (rows 0-15 of an m16n8k16 tensor-core
 *    MMA: a lane's groups A = rows 0-7 and B = rows 8-15) or GPW = 8 (rows 0-7 only: twice the
 *    warps for the same groups, for grids too small to fill the device; kernel tuning tk_gpw).
 *    Keys are the N dimension, the rank the K dimension (padded to RP = 16..64 with zeros).
 *  - Exact scores on tensor cores: the fp32 representative is split into three 16-bit parts
 *    (hi + mid + lo == rep exactly for bf16; for fp16 the rep is first scaled by a power of two
 *    per group, which preserves order and ties), the keys are the exact 16-bit inputs, so every
 *    product is exact and only the fp32 accumulation rounds, as in an fp32 dot product.
 *    Each (group, key) score is bit-identical in every pass (same inputs, same instruction order).
 *  - Keys are streamed through shared memory in tiles of 64 (cp.async, double buffered). Every
 *    pass recomputes the scores; the time is the number of passes over all S keys.
 *  - Selection. Per group a window [lo, hi] of order-preserving uint32 score keys holds the K-th
 *    largest key, with `need` = its rank from the top of the window (#(key > hi) = K - need).
 *     0. Sample (tuning tk_sample = 1, the default, and S >= TK_MIN_S; two or three passes over
 *        1/16 of the keys): keys 16 i + h(i) (h a fixed hash in [0, 16), so that score patterns
 *        of period 16 cannot bias it), 8 + 8 bits of radix select for the sample ranks
 *        mu +- (4 sqrt(mu) + 2), mu = K n / S (n sample keys): T_lo, T_hi to 16 bits (with the
 *        band buffer below, a third pass when T_hi lies in another top-8-bit bin than T_lo;
 *        without it T_hi is then the top of its 8-bit bin). With high probability
 *        #(key >= T_lo) >= K > #(key > T_hi).
 *     1. Band pass (all keys): bin 0 = keys below T_lo (not counted: S minus the rest), bins
 *        1..254 = [T_lo, T_hi] in power-of-two steps, bin 255 = keys above T_hi (counted in
 *        registers). The boundary bin becomes the window. A sample that misled is no error:
 *        bin 0 or bin 255 is then the window, refined by the generic passes. Where the band
 *        holds at most 1/20 of the keys (with more, the stores cost more than the pass they
 *        save), the band pass also stores every key of bins 1..254 (~32 sqrt(K) + 64 of them)
 *        in a band buffer: the group's own list row, free until the compaction (in a cluster
 *        each CTA its part), in 4 segments, one per lane of the quad that holds the group (a
 *        register count and a predicated store, no atomics).
 *     2. Collect pass (all keys) when the window holds at most TK_CAP keys (the usual case:
 *        ~10 at S = 64k, K = 10%): its keys are appended to the group's histogram slab, and the
 *        K-th largest T and the number q of ties at T to take follow exactly. When every
 *        collecting group's window lies in its band and no segment of its band buffer
 *        overflowed (in any CTA of the cluster), the keys come from the buffers instead of a
 *        pass over all keys (dsv_tk_fill; PERF_LOG v23). Otherwise a
 *        generic pass: a 256-bin histogram of [lo, hi] (bin width 2^s, the smallest s with
 *        (hi - lo) >> s <= 255), which shrinks the window >= 128x. Without the sample the first
 *        pass is generic over the full key range (an MSB-first radix select, 8 bits per pass).
 *        A pass has one kind for the whole CTA (band, generic or collect: no per-score mode
 *        tests); collecting groups wait while any group of the CTA needs a generic pass.
 *        Bound: band + 4 generic + 1 collect passes. Exactness never depends on the sample:
 *        every window update is a count over all S keys.
 *     3. Compaction pass: {key > T} and the first q of {key == T} in position order: per tile,
 *        each lane quad rebuilds the group's 64-bit selection mask in position order and writes
 *        ranks from popcounts, so the list comes out ascending without any sort. From the band
 *        pass's key masks (no scores), the entries go through a stage in shared memory and
 *        reach the lists 16 consecutive entries of one group per store (PERF_LOG v42, v43).
 *    At S = 64k and K = 10% a group takes ~2 passes of all scores (band, compaction; the collect
 *    step reads the band buffer; the radix select alone: 4 histogram passes + the compaction).
 *    Times: benchmarks/PERF_LOG.md (v12, v16, v17, v23).
 *  - Clusters (tuning tk_split = 2, 4 or 8, sm_90): CL CTAs share a set of groups, each scoring
 *    its part of the keys (whole tiles, the CTAs in order); after every pass each adds the
 *    others' histograms (distributed shared memory) and takes the same decisions, and its own
 *    counts above / in the window place its part of every list (dsv_tk_find_split,
 *    dsv_tk_resolve; PERF_LOG v18; 4 and 8, for grids of one or two heads, v45).
 */
#include <stdlib.h>
#include <string.h>

#include "cuda_common.cuh"
#include "tuning.h"

#define TK_WARPS 4
#define TK_THREADS (32 * TK_WARPS)
#define TK_GPW 16 /* groups per warp, the larger setting (tk_gpw picks 16 or 8) */
#define TK_GPC (TK_WARPS * TK_GPW)
#define TK_TILE 64
#define TK_BINS 256
#define TK_STRIDE 16    /* sample: one key in TK_STRIDE */
#define TK_MIN_S 4096   /* sample from this sequence length on */
#define TK_CAP TK_BINS  /* collect pass: windows of at most this many keys (one slab) */
#define TK_MAX_PASSES 6 /* band + at most 4 generic passes + one collect pass */
/* 0: the compaction stores only each list's last entry, for measuring what the list stores cost
 * (csrc/dev/topk_no_list_stores.cu; its lists are not the op's) */
#ifndef DSV_TK_LIST_STORES
#define DSV_TK_LIST_STORES 1
#endif
/* the compaction from masks stages its list entries in shared memory, this many per group (16
 * groups fill a warp's 384 words of the key tiles, free there) */
#define TK_STAGE 24

/* what a group does in the next pass */
#define TK_OFF 0     /* resolved (or not a group): nothing */
#define TK_HIST 1    /* 256-bin histogram of [lo, hi] */
#define TK_BAND 2    /* band histogram: bins 1..254 from lo = T_lo, bin 255 above top */
#define TK_COLLECT 3 /* append every key of [lo, hi] to the slab */
/* pass kinds, not a group's mode: the band pass of TK_BAND groups without its histogram (the
 * keys of the band stored, those above counted); the histogram then comes from the band buffer
 * (dsv_tk_band_hist). TK_BANDM also writes the keys' masks (tuning tk_compact). */
#define TK_BANDS 4
#define TK_BANDM 5

struct dsv_topk_args {
  const void* q;
  const void* k;
  int64_t q_sb, q_ss, q_sh, k_sb, k_ss, k_sh;
  const int32_t* count;
  int32_t* out;
  int64_t S, H, r, G, NG, kmax;
  int tiles_per_bh;
  int kvec;
  int sample; /* tuning tk_sample */
  int band;   /* tuning tk_band */
  /* tuning tk_compact: the band pass's key masks, [CTA][tile][group][lane of the quad] (one CTA
   * per set of groups only; null: the compaction rescores the keys) */
  uint32_t* masks;
};

/* per-group selection state of a CTA of GPC groups (shared memory) */
template <int GPC>
struct dsv_tk_groups {
  uint32_t lo[GPC], hi[GPC], top[GPC];
  int s[GPC], mode[GPC], need[GPC], cnt[GPC], done[GPC], ccnt[GPC];
  int base[GPC]; /* list length written by the compaction */
  int sneed_lo[GPC], sneed_hi[GPC];
  uint32_t thi[GPC]; /* sample stage: T_hi when known from 8 bits only */
  int bcnt[GPC * 4]; /* band pass: the keys of the band each lane of the quad found (may exceed
                      * its segment of the buffer: then it overflowed) */
  int bufok[GPC];    /* the window lies in the band and no segment overflowed (cluster-wide) */
};

/* a cluster's split (tk_split): per group, this CTA's keys above the window and in it (after the
 * collect: equal to T); for the compaction, its ties to take and its first list index */
template <int GPC>
struct dsv_tk_split {
  int above[GPC], wcnt[GPC];
  int q[GPC], base[GPC];
};

/* shared memory: [GPC][256] histogram slabs, [2][TILE][SW] key tiles, the group states,
 * [threads] sink slots, and with a cluster (CL > 1) the split counts. Nothing more: at RP = 16
 * and 16 groups per warp this is 76800 bytes, exactly what lets three CTAs share an SM of
 * 228 KB (with the 1 KB each CTA reserves; 16 bytes more and two fit: PERF_LOG v29). */
template <int RP, int GPW, int CL>
static constexpr size_t dsv_topk_smem_bytes() {
  constexpr int GPC = TK_WARPS * GPW;
  constexpr int SW = RP / 2 + 4;
  return (size_t)GPC * TK_BINS * 4 + (size_t)2 * TK_TILE * SW * 4 + sizeof(dsv_tk_groups<GPC>) +
         (size_t)TK_THREADS * 4 + (CL > 1 ? sizeof(dsv_tk_split<GPC>) : 0);
}
static_assert(dsv_topk_smem_bytes<16, 16, 1>() <= 76800,
              "the rank-16 estimation CTA must stay within 76800 bytes: three CTAs per SM (v29)");

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

/* Scores of one staged 64-key tile, two-phase (the MMA chains of all 8 blocks, independent and
 * pipelined): the lane's 4 accumulators of each of the 8 key blocks (exact: hi + mid + lo parts
 * of the representative against the 16-bit keys). */
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

/* Compaction flags of one 8-key block: bit (2 * blk + e) of the masks of u > T and u == T of
 * group A (scores c0 / c1) and, with HASB, group B (c2 / c3). */
template <bool HASB>
static __device__ __forceinline__ void dsv_tk_flags(const float (&d)[4], int blk, uint32_t k0,
                                                    uint32_t k1, uint32_t TA, uint32_t TB,
                                                    uint32_t& mgA, uint32_t& mgB, uint32_t& meA,
                                                    uint32_t& meB) {
  const uint32_t u0 = dsv_float_key(d[0]), u1 = dsv_float_key(d[1]);
  mgA |= ((k0 & (u0 > TA)) << (2 * blk)) | ((k1 & (u1 > TA)) << (2 * blk + 1));
  meA |= ((k0 & (u0 == TA)) << (2 * blk)) | ((k1 & (u1 == TA)) << (2 * blk + 1));
  if constexpr (HASB) {
    const uint32_t u2 = dsv_float_key(d[2]), u3 = dsv_float_key(d[3]);
    mgB |= ((k0 & (u2 > TB)) << (2 * blk)) | ((k1 & (u3 > TB)) << (2 * blk + 1));
    meB |= ((k0 & (u2 == TB)) << (2 * blk)) | ((k1 & (u3 == TB)) << (2 * blk + 1));
  }
}

/* One 8-key block's scores, block at a time (the tile loops of fp16 with RP >= 48, see
 * kTwoPhase in the kernel). */
template <typename T, int KS, int SW>
static __device__ __forceinline__ void dsv_tk_block_scores(const uint32_t* kt,
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

/* Each 8-key block of one staged tile: f(d, blk, k0, k1) with the lane's 4 scores of the block
 * and whether its two keys exist (FULL: every key of the tile, no per-key test). Two-phase (the
 * MMA chains of all 8 blocks first) or block at a time. */
template <typename T, int KS, int SW, bool TWO, bool FULL, typename F>
static __device__ __forceinline__ void dsv_tk_tile_blocks(const uint32_t* kt,
                                                          const uint32_t (&A)[KS][3][4], int lane,
                                                          int j4, int t0, int nvalid, F&& f) {
  if constexpr (TWO) {
    float d[TK_TILE / 8][4];
    dsv_tk_tile_scores<T, KS, SW>(kt, A, lane, j4, d);
#pragma unroll
    for (int blk = 0; blk < TK_TILE / 8; ++blk) {
      const int key0 = t0 + blk * 8 + j4 * 2;
      f(d[blk], blk, (uint32_t)(FULL || key0 < nvalid), (uint32_t)(FULL || key0 + 1 < nvalid));
    }
  } else {
#pragma unroll 2
    for (int blk = 0; blk < TK_TILE / 8; ++blk) {
      float d[4];
      dsv_tk_block_scores<T, KS, SW>(kt, A, lane, j4, blk, d);
      const int key0 = t0 + blk * 8 + j4 * 2;
      f(d, blk, (uint32_t)(FULL || key0 < nvalid), (uint32_t)(FULL || key0 + 1 < nvalid));
    }
  }
}

/* one group's pass parameters in registers: the window [lo, lo + span] (HIST, COLLECT: hi;
 * BAND: top, which the band's construction keeps >= lo), on = 0 for a group not taking part or
 * an empty window */
struct dsv_tk_prm {
  uint32_t lo, span, top, slab; /* slab: shared address of the group's 256 words */
  uint32_t on;
  int s;
  uint32_t* cslab;
  int* ccnt;
  uint32_t* buf; /* BAND: this lane's segment of the group's band buffer, seg words */
  uint32_t seg;
};

template <int MODE, int GPC>
static __device__ __forceinline__ dsv_tk_prm dsv_tk_load(dsv_tk_groups<GPC>& gs, uint32_t* hist,
                                                         int g, bool valid, uint32_t* brow,
                                                         int64_t kmax, uint32_t seg) {
  dsv_tk_prm p;
  constexpr int GM = MODE == TK_BANDS || MODE == TK_BANDM ? TK_BAND : MODE; /* the groups' mode */
  const bool on = valid && gs.mode[g] == GM;
  const uint32_t lo = on ? gs.lo[g] : 0u;
  const uint32_t last = on ? (GM == TK_BAND ? gs.top[g] : gs.hi[g]) : 0u;
  p.lo = lo;
  p.span = last - lo;
  p.on = on && (GM == TK_BAND || lo <= last) ? 1u : 0u;
  p.top = on ? gs.top[g] : 0xFFFFFFFFu;
  p.s = on ? gs.s[g] : 0;
  p.cslab = hist + (valid ? g : 0) * TK_BINS;
  p.slab = smem_u32(p.cslab);
  p.ccnt = gs.ccnt + (valid ? g : 0);
  /* one 64-bit base in registers (opaque to the compiler, which otherwise rebuilds the address
   * from several parts at every store): a store is then one wide multiply-add and the STG */
  uint32_t* buf = brow + (valid ? g : 0) * kmax;
  asm("mov.b64 %0, %0;" : "+l"(buf));
  p.buf = buf;
  p.seg = seg;
  return p;
}

/* One score key u of a group in a pass of kind MODE (ok: the key exists; a constant 1 in a
 * whole tile). In the window means d = u - lo <= span (one unsigned test for lo <= u <= last).
 * HIST: bin d >> s of [lo, hi]; BAND: bin 1 + (d >> s) of [lo, top] and the register count of
 * u > top (bin 255); both add 1 to the bin or, unconditionally (no branch per score), to this
 * thread's sink slot. BAND also stores u in [lo, top] at position bc of the lane's buffer
 * segment while it has room, and counts it in bc; BANDS does only that and the count above, no
 * bin; BANDM instead of the count sets the key's bits in `mask` (above the band: bit `bit`,
 * counted from the mask per tile; in it: bit + 16). COLLECT: append u in [lo, hi] to the slab. */
template <int MODE>
static __device__ __forceinline__ void dsv_tk_score(const dsv_tk_prm& p, uint32_t u, uint32_t ok,
                                                    uint32_t& above, uint32_t& bc,
                                                    uint32_t sink, uint32_t& mask, int bit) {
  const uint32_t d = u - p.lo;
  const bool on = (ok & p.on) != 0u;
  if constexpr (MODE == TK_COLLECT) {
    if (on && d <= p.span) {
      const int i = atomicAdd(p.ccnt, 1);
      if (i < TK_CAP) p.cslab[i] = u;
    }
  } else {
    const bool in = on && d <= p.span;
    constexpr bool BANDLIKE = MODE == TK_BAND || MODE == TK_BANDS || MODE == TK_BANDM;
    if constexpr (MODE == TK_HIST || MODE == TK_BAND) {
      constexpr uint32_t off = MODE == TK_BAND ? 1u : 0u;
      const uint32_t addr = in ? p.slab + ((off + (d >> p.s)) << 2) : sink;
      asm volatile("red.shared.add.u32 [%0], 1;\n" ::"r"(addr) : "memory");
    }
    if constexpr (BANDLIKE) {
      const bool up = on && u > p.top;
      if (in && bc < p.seg) __stcg(p.buf + bc, u);
      bc += (uint32_t)in;
      /* BANDM: the key's bit (2 blk + e) in the tile's masks: above the band (low half: counted
       * per tile from it), in it (high half), for the compaction from masks (tk_compact) */
      if constexpr (MODE == TK_BANDM)
        mask |= ((uint32_t)up << bit) | ((uint32_t)in << (bit + 16));
      else
        above += (uint32_t)up;
    }
  }
}

/* the scores of one 8-key block of a lane: c0 / c1 of group A, c2 / c3 of group B (HASB) */
template <int MODE, bool HASB>
static __device__ __forceinline__ void dsv_tk_block(const float (&d)[4], int blk, uint32_t k0,
                                                    uint32_t k1, const dsv_tk_prm& pA,
                                                    const dsv_tk_prm& pB, uint32_t (&cA)[2],
                                                    uint32_t (&cB)[2], uint32_t sink,
                                                    uint32_t& mA, uint32_t& mB) {
  dsv_tk_score<MODE>(pA, dsv_float_key(d[0]), k0, cA[0], cA[1], sink, mA, 2 * blk);
  dsv_tk_score<MODE>(pA, dsv_float_key(d[1]), k1, cA[0], cA[1], sink, mA, 2 * blk + 1);
  if constexpr (HASB) {
    dsv_tk_score<MODE>(pB, dsv_float_key(d[2]), k0, cB[0], cB[1], sink, mB, 2 * blk);
    dsv_tk_score<MODE>(pB, dsv_float_key(d[3]), k1, cB[0], cB[1], sink, mB, 2 * blk + 1);
  }
}

/* One staged tile of a pass of kind MODE (FULL: every key of the tile exists). */
template <typename T, int KS, int SW, bool TWO, int MODE, bool HASB, bool FULL>
static __device__ __forceinline__ void dsv_tk_tile(const uint32_t* kt, const uint32_t (&A)[KS][3][4],
                                                   int lane, int j4, int t0, int nvalid,
                                                   const dsv_tk_prm& pA, const dsv_tk_prm& pB,
                                                   uint32_t (&cA)[2], uint32_t (&cB)[2],
                                                   uint32_t sink, uint32_t& mA, uint32_t& mB) {
  dsv_tk_tile_blocks<T, KS, SW, TWO, FULL>(
      kt, A, lane, j4, t0, nvalid, [&](const float (&d)[4], int blk, uint32_t k0, uint32_t k1) {
        dsv_tk_block<MODE, HASB>(d, blk, k0, k1, pA, pB, cA, cB, sink, mA, mB);
      });
}

/* Sample row i: key min(16 i + h(i), S - 1), h(i) in [0, 16) a fixed multiplicative hash of
 * i, so that a score pattern of period 16 (or a divisor) cannot bias the sample. */
static __device__ __forceinline__ int64_t dsv_tk_sample_key(int64_t i, int64_t S) {
  static_assert(TK_STRIDE == 16, "h(i) takes the top 4 bits of the hash");
  const int64_t j = i * TK_STRIDE + (int64_t)(((uint32_t)i * 0x9E3779B1u) >> 28);
  return j < S ? j : S - 1;
}

/* dsv_stage_rows16 for the sample stream: staged row r is key dsv_tk_sample_key(row0 + r)
 * (zero rows from ns on). */
template <typename T>
static __device__ __forceinline__ void dsv_tk_stage_sample(uint32_t* smem, int sw, const T* base,
                                                           int64_t row_stride, int64_t row0,
                                                           int64_t ns, int64_t S, int dim,
                                                           int dp, bool vec, int tid) {
  const int cpr = dp / 8; /* 16-byte chunks per row */
  for (int c = tid; c < TK_TILE * cpr; c += TK_THREADS) {
    const int r = c / cpr, ch = c - r * cpr;
    const int64_t row = row0 + r;
    uint32_t* dst = smem + r * sw + ch * 4;
    const int e0 = ch * 8;
    const T* src = base + dsv_tk_sample_key(row, S) * row_stride;
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

/* Stage tile `it` of a pass over the stream rows [base, end): keys, or sample rows (end: ns or
 * this CTA's part of them). */
template <typename T, bool SAMPLE>
static __device__ __forceinline__ void dsv_tk_stage(uint32_t* dst, int sw, const T* kb,
                                                    const dsv_topk_args& a, int64_t base,
                                                    int64_t end, int it, int dp, int tid) {
  if constexpr (SAMPLE)
    dsv_tk_stage_sample<T>(dst, sw, kb, a.k_ss, base + (int64_t)it * TK_TILE, end, a.S, (int)a.r,
                           dp, a.kvec, tid);
  else
    dsv_stage_rows16<T>(dst, sw, kb, a.k_ss, base + (int64_t)it * TK_TILE, TK_TILE, end,
                        (int)a.r, dp, a.kvec, tid, TK_THREADS);
}

/* One pass of kind MODE over the stream rows [base, end) (keys, or sample rows; all of them, or
 * this CTA's part in a cluster): the groups in that mode take part, the others wait. Called by
 * all threads; a BAND pass ends with the above-band counts in bin 255 of the slabs and each
 * lane's band count in gs.bcnt (its keys in the buffer segment of seg words at brow + g kmax). */
template <typename T, int KS, int SW, bool TWO, int MODE, bool SAMPLE, int GPC, bool HASB>
static __device__ __forceinline__ void dsv_tk_pass(const dsv_topk_args& a, const T* kb,
                                                   int64_t base, int64_t end, uint32_t* ktile,
                                                   const uint32_t (&A)[KS][3][4],
                                                   dsv_tk_groups<GPC>& gs, uint32_t* hist,
                                                   bool warp_active, int tid, int lane, int gA,
                                                   int gB, bool vA, bool vB, uint32_t* brow,
                                                   uint32_t seg, uint32_t* masks = nullptr) {
  const int j4 = lane & 3;
  const dsv_tk_prm pA = dsv_tk_load<MODE>(gs, hist, gA, vA, brow, a.kmax, seg);
  const dsv_tk_prm pB = dsv_tk_load<MODE>(gs, hist, gB, HASB && vB, brow, a.kmax, seg);
  const uint32_t sink = smem_u32(reinterpret_cast<uint32_t*>(&gs + 1) + tid);
  uint32_t cA[2] = {0u, 0u}, cB[2] = {0u, 0u}; /* BAND: above the band, in it */
  const int64_t nrows = end - base;
  const int ntiles = (int)((nrows + TK_TILE - 1) / TK_TILE);
  const int nv = (int)nrows;
  dsv_tk_stage<T, SAMPLE>(ktile, SW, kb, a, base, end, 0, KS * 16, tid); /* zeros if empty */
  cp_async_commit();
  for (int it = 0; it < ntiles; ++it) {
    cp_async_wait_all();
    __syncthreads();
    if (it + 1 < ntiles)
      dsv_tk_stage<T, SAMPLE>(ktile + ((it + 1) & 1) * TK_TILE * SW, SW, kb, a, base, end, it + 1,
                              KS * 16, tid);
    cp_async_commit();
    if (!warp_active) continue;
    const uint32_t* kt = ktile + (it & 1) * TK_TILE * SW;
    uint32_t mA = 0u, mB = 0u;
    if ((it + 1) * TK_TILE <= nv) /* all but a partial last tile */
      dsv_tk_tile<T, KS, SW, TWO, MODE, HASB, true>(kt, A, lane, j4, it * TK_TILE, nv, pA, pB,
                                                    cA, cB, sink, mA, mB);
    else
      dsv_tk_tile<T, KS, SW, TWO, MODE, HASB, false>(kt, A, lane, j4, it * TK_TILE, nv, pA, pB,
                                                     cA, cB, sink, mA, mB);
    if constexpr (MODE == TK_BANDM) { /* the tile's masks: [tile][group][lane of the quad] */
      cA[0] += __popc(mA & 0xFFFFu);
      cB[0] += __popc(mB & 0xFFFFu);
      masks[((int64_t)it * GPC + gA) * 4 + j4] = mA;
      if constexpr (HASB) masks[((int64_t)it * GPC + gB) * 4 + j4] = mB;
    }
  }
  if constexpr (MODE == TK_BAND || MODE == TK_BANDS || MODE == TK_BANDM) {
    if (warp_active) {
      if (vA) gs.bcnt[gA * 4 + j4] = (int)cA[1];
      if (HASB && vB) gs.bcnt[gB * 4 + j4] = (int)cB[1];
    }
    /* the quad of lanes (lane >> 2) holds all keys of its groups */
    uint32_t aboveA = cA[0], aboveB = cB[0];
    aboveA += __shfl_xor_sync(DSV_FULL_MASK, aboveA, 1);
    aboveA += __shfl_xor_sync(DSV_FULL_MASK, aboveA, 2);
    aboveB += __shfl_xor_sync(DSV_FULL_MASK, aboveB, 1);
    aboveB += __shfl_xor_sync(DSV_FULL_MASK, aboveB, 2);
    if (warp_active && j4 == 0) {
      if (vA) hist[gA * TK_BINS + TK_BINS - 1] = aboveA;
      if (HASB && vB) hist[gB * TK_BINS + TK_BINS - 1] = aboveB;
    }
  }
  __syncwarp();
}

/* Every entry of the band buffers of FG groups from group gi0 of the warp where on[f] (rows: local
 * group 0's buffer, segments seg words apart, groups kmax words apart; at most seg entries per
 * segment), 32 at a time per segment: visit(f, t, i0, ok, v), v the lane's entry i0 + lane of
 * segment t of group f, ok where it exists. The whole warp calls visit (ballots in it are fine);
 * 4 x FG coalesced loads in flight per lane. */
template <int FG, int GPW, int GPC, typename V>
static __device__ __forceinline__ void dsv_tk_buf_each(const dsv_tk_groups<GPC>& gs,
                                                       const uint32_t* rows, int64_t kmax,
                                                       uint32_t seg, int warp, int gi0, int lane,
                                                       const bool (&on)[FG], V&& visit) {
  int c[FG][4], cmax = 0;
#pragma unroll
  for (int f = 0; f < FG; ++f)
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      const int n = on[f] ? gs.bcnt[(warp * GPW + gi0 + f) * 4 + t] : 0;
      c[f][t] = n < (int)seg ? n : (int)seg;
      cmax = c[f][t] > cmax ? c[f][t] : cmax;
    }
  for (int i0 = 0; i0 < cmax; i0 += 32) {
    const int i = i0 + lane;
    uint32_t v[FG][4];
#pragma unroll
    for (int f = 0; f < FG; ++f) {
      const uint32_t* row = rows + (int64_t)(warp * GPW + gi0 + f) * kmax;
#pragma unroll
      for (int t = 0; t < 4; ++t) v[f][t] = i < c[f][t] ? __ldcg(row + (int64_t)t * seg + i) : 0u;
    }
#pragma unroll
    for (int f = 0; f < FG; ++f)
#pragma unroll
      for (int t = 0; t < 4; ++t) visit(f, t, i0, i < c[f][t], v[f][t]);
  }
}

/* The collect step from the band buffers, without a pass over the keys: each collecting group of
 * this warp appends to its slab the keys of its window [lo, hi] that this CTA's 4 lane segments
 * of its band buffer hold (every count <= seg: gs.bufok), as the collect pass would, in another
 * order on which no decision depends. Whole warp; 4 groups at a time. */
template <int GPW, int GPC>
static __device__ __forceinline__ void dsv_tk_fill(dsv_tk_groups<GPC>& gs, uint32_t* hist,
                                                   const uint32_t* rows, int64_t kmax,
                                                   uint32_t seg, int warp, int lane, int ngl) {
  constexpr int FG = 4;
  static_assert(GPW % FG == 0, "groups per warp: a multiple of the groups per step");
  for (int gi0 = 0; gi0 < GPW; gi0 += FG) {
    int n[FG];
    uint32_t lo[FG], span[FG];
    bool on[FG];
#pragma unroll
    for (int f = 0; f < FG; ++f) {
      const int gl = warp * GPW + gi0 + f;
      on[f] = gl < ngl && !gs.done[gl] && gs.mode[gl] == TK_COLLECT;
      lo[f] = on[f] ? gs.lo[gl] : 0u;
      span[f] = on[f] ? gs.hi[gl] - lo[f] : 0u;
      n[f] = 0;
    }
    dsv_tk_buf_each<FG, GPW>(gs, rows, kmax, seg, warp, gi0, lane, on,
                             [&](int f, int, int, bool ok, uint32_t v) {
                               const bool hit = ok && v - lo[f] <= span[f];
                               const uint32_t bal = __ballot_sync(DSV_FULL_MASK, hit);
                               const int pos = n[f] + __popc(bal & ((1u << lane) - 1u));
                               uint32_t* slab = hist + (warp * GPW + gi0 + f) * TK_BINS;
                               if (hit && pos < TK_CAP) slab[pos] = v;
                               n[f] += __popc(bal);
                             });
    if (lane < FG) {
      const int gl = warp * GPW + gi0 + lane;
      int nl = n[0];
#pragma unroll
      for (int f = 1; f < FG; ++f) nl = lane == f ? n[f] : nl;
      if (gl < ngl && !gs.done[gl] && gs.mode[gl] == TK_COLLECT) gs.ccnt[gl] = nl;
    }
  }
  __syncwarp();
}

/* The band pass's histogram from the band buffers, after a BANDS pass: bins 1 + ((u - lo) >> s)
 * of the keys u each band group's 4 lane segments (in this CTA) hold, which are all the keys of
 * its band when no segment overflowed (the caller's condition); bin 255 (above the band) the
 * pass wrote. The same counts as a BAND pass: the same decisions follow. Whole warp; 4 groups
 * at a time. */
template <int GPW, int GPC>
static __device__ __forceinline__ void dsv_tk_band_hist(dsv_tk_groups<GPC>& gs, uint32_t* hist,
                                                        const uint32_t* rows, int64_t kmax,
                                                        uint32_t seg, int warp, int lane,
                                                        int ngl) {
  constexpr int FG = 4;
  static_assert(GPW % FG == 0, "groups per warp: a multiple of the groups per step");
  for (int gi0 = 0; gi0 < GPW; gi0 += FG) {
    uint32_t lo[FG], sh[FG];
    bool on[FG];
#pragma unroll
    for (int f = 0; f < FG; ++f) {
      const int gl = warp * GPW + gi0 + f;
      on[f] = gl < ngl && !gs.done[gl] && gs.mode[gl] == TK_BAND;
      lo[f] = on[f] ? gs.lo[gl] : 0u;
      sh[f] = on[f] ? (uint32_t)gs.s[gl] : 0u;
    }
    dsv_tk_buf_each<FG, GPW>(gs, rows, kmax, seg, warp, gi0, lane, on,
                             [&](int f, int, int, bool ok, uint32_t v) {
                               uint32_t* slab = hist + (warp * GPW + gi0 + f) * TK_BINS;
                               if (ok) atomicAdd(slab + 1 + ((v - lo[f]) >> sh[f]), 1u);
                             });
  }
  __syncwarp();
}

/* The word pairs of a group's codes in its slab, XOR-swizzled by group and segment: the
 * compaction's 32 lanes (8 groups x 4 segments, one slab of 256 words each) read their own
 * pair at once, without the swizzle all in one bank (32 ways), with it in 16 (2 ways at most). */
static __device__ __forceinline__ int dsv_tk_code_swz(int g, int t) {
  return (2 * (4 * (g & 7) + t)) & 62;
}

/* For the compaction from masks (tuning tk_compact), after the selection: for each group of the
 * warp and lane segment t of its band buffer, in the segment's order, bit i % 32 of word
 * [t][(2 (i / 32)) ^ swz][0] of the group's slab: key i of the segment > T, of word [..][1]:
 * == T (T = gs.lo, every count <= 1024: the caller's condition; swz: dsv_tk_code_swz). Whole
 * warp; 4 groups at a time. */
template <int GPW, int GPC>
static __device__ __forceinline__ void dsv_tk_codes(dsv_tk_groups<GPC>& gs, uint32_t* hist,
                                                    const uint32_t* rows, int64_t kmax,
                                                    uint32_t seg, int warp, int lane, int ngl) {
  constexpr int FG = 4;
  static_assert(GPW % FG == 0, "groups per warp: a multiple of the groups per step");
  for (int gi0 = 0; gi0 < GPW; gi0 += FG) {
    uint32_t T[FG];
    bool on[FG];
#pragma unroll
    for (int f = 0; f < FG; ++f) {
      const int gl = warp * GPW + gi0 + f;
      on[f] = gl < ngl;
      T[f] = on[f] ? gs.lo[gl] : 0u;
    }
    dsv_tk_buf_each<FG, GPW>(gs, rows, kmax, seg, warp, gi0, lane, on,
                             [&](int f, int t, int i0, bool ok, uint32_t v) {
                               const uint32_t gt = __ballot_sync(DSV_FULL_MASK, ok && v > T[f]);
                               const uint32_t eq = __ballot_sync(DSV_FULL_MASK, ok && v == T[f]);
                               const int g = warp * GPW + gi0 + f;
                               uint32_t* w = hist + g * TK_BINS + t * 64;
                               if (lane == 0 && ok) { /* lane 0's entry i0 exists */
                                 const int x = (2 * (i0 >> 5)) ^ dsv_tk_code_swz(g, t);
                                 w[x] = gt;
                                 w[x + 1] = eq;
                               }
                             });
  }
  __syncwarp();
}

/* Boundary bin of 256 bins for rank `need` from the top, lane l holding bins 8 l .. 8 l + 7 (c,
 * their sum csum): all lanes return the same bin, the count above it and its count. Requires
 * need <= the bins' total. */
static __device__ __forceinline__ void dsv_tk_find_bins(const uint32_t (&c)[8], uint32_t csum,
                                                        uint32_t need, int lane, uint32_t& bin,
                                                        uint32_t& above_out, uint32_t& cnt) {
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

/* dsv_tk_find_bins of a 256-bin slab; a band slab gets bin 0 = nkeys minus the rest. */
static __device__ __forceinline__ void dsv_tk_find(const uint32_t* slab, uint32_t need, int lane,
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
  dsv_tk_find_bins(c, csum, need, lane, bin, above_out, cnt);
}

/* the next pass of an unresolved group whose window [lo, hi] (lo < hi) holds cnt keys */
template <int GPC>
static __device__ __forceinline__ void dsv_tk_plan(dsv_tk_groups<GPC>& gs, int g) {
  if (gs.cnt[g] <= TK_CAP) {
    gs.mode[g] = TK_COLLECT;
    gs.s[g] = 0;
  } else {
    const int bits = 32 - __clz((int)(gs.hi[g] - gs.lo[g]));
    gs.mode[g] = TK_HIST;
    gs.s[g] = bits > 8 ? bits - 8 : 0;
  }
  gs.top[g] = gs.hi[g];
}

/* ---- cluster split (tk_split = CL > 1): the CL CTAs of a cluster share one set of groups, CTA c
 * scores the keys of its part of [0, S) (and of the sample); after every pass each CTA adds the
 * others' partial histograms (distributed shared memory) and takes the same decisions, and it
 * keeps its own counts, which place its part of each list. */

/* dsv_tk_find over the sum of the CL CTAs' slabs; also this CTA's count above the boundary bin
 * and in it (a band slab's bin 0: own_nkeys minus the rest). */
template <int CL>
static __device__ __forceinline__ void dsv_tk_find_split(const uint32_t* slab, uint32_t crank,
                                                         uint32_t need, int lane, bool band,
                                                         uint32_t nkeys, uint32_t own_nkeys,
                                                         uint32_t& bin, uint32_t& above_out,
                                                         uint32_t& cnt, uint32_t& above_own,
                                                         uint32_t& cnt_own) {
  const uint4 o0 = *reinterpret_cast<const uint4*>(slab + lane * 8);
  const uint4 o1 = *reinterpret_cast<const uint4*>(slab + lane * 8 + 4);
  uint32_t own[8] = {o0.x, o0.y, o0.z, o0.w, o1.x, o1.y, o1.z, o1.w};
  uint32_t c[8];
#pragma unroll
  for (int t = 0; t < 8; ++t) c[t] = own[t];
#pragma unroll
  for (int r = 1; r < CL; ++r) {
    const uint32_t ra = dsv_cluster_map(smem_u32(slab + lane * 8), (crank + r) % CL);
    const uint4 v0 = dsv_ld_cluster_v4(ra), v1 = dsv_ld_cluster_v4(ra + 16);
    c[0] += v0.x, c[1] += v0.y, c[2] += v0.z, c[3] += v0.w;
    c[4] += v1.x, c[5] += v1.y, c[6] += v1.z, c[7] += v1.w;
  }
  uint32_t csum = 0, osum = 0;
#pragma unroll
  for (int t = 0; t < 8; ++t) {
    csum += c[t];
    osum += own[t];
  }
  if (band) {
    const uint32_t total = __reduce_add_sync(DSV_FULL_MASK, csum);
    const uint32_t own_total = __reduce_add_sync(DSV_FULL_MASK, osum);
    if (lane == 0) {
      c[0] += nkeys - total;
      csum += nkeys - total;
      own[0] += own_nkeys - own_total;
      osum += own_nkeys - own_total;
    }
  }
  dsv_tk_find_bins(c, csum, need, lane, bin, above_out, cnt);
  const int L = (int)(bin >> 3);
  const uint32_t tb = bin & 7u;
  uint32_t oa = lane > L ? osum : 0u, oc = 0;
  if (lane == L) {
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      if ((uint32_t)t > tb) oa += own[t];
      if ((uint32_t)t == tb) oc = own[t];
    }
  }
  above_own = __reduce_add_sync(DSV_FULL_MASK, oa);
  cnt_own = __reduce_add_sync(DSV_FULL_MASK, oc);
}

/* After a pass over all keys: every group of this warp that took part (mode == pass_mode)
 * narrows its window (or resolves T and q). Whole warp; lane 0 writes the state. In a cluster
 * (CL > 1) the decisions come from the CTAs' summed histograms (a collect pass: the other CTAs'
 * window keys appended to this CTA's slab first), and sp keeps this CTA's own counts. After the
 * band pass, bufok: the window is a bin of the band and no lane segment of the group's band
 * buffer (of segment seg words, in any CTA of the cluster) overflowed; a later window within it
 * keeps the flag. */
template <int GPW, int GPC, int CL>
static __device__ __forceinline__ void dsv_tk_resolve(dsv_tk_groups<GPC>& gs,
                                                      dsv_tk_split<GPC>& sp, uint32_t* hist,
                                                      int pass_mode, int warp, int lane, int ngl,
                                                      uint32_t S, uint32_t crank, uint32_t seg) {
  for (int gi = 0; gi < GPW; ++gi) {
    const int gl = warp * GPW + gi;
    if (gl >= ngl) break;
    const int mode = gs.mode[gl];
    if (gs.done[gl] || mode != pass_mode) continue;
    uint32_t* slab = hist + gl * TK_BINS;
    const int need = gs.need[gl];
    const int n_own = gs.ccnt[gl] < TK_CAP ? gs.ccnt[gl] : TK_CAP;
    const int wcnt_own = CL > 1 ? sp.wcnt[gl] : 0;
    __syncwarp(); /* every lane has read the state before any lane writes it */
    if (mode == TK_COLLECT) {
      int n = n_own;
      if constexpr (CL > 1) {
#pragma unroll 1
        for (int r = 1; r < CL; ++r) { /* the window holds <= TK_CAP keys in all */
          const uint32_t other = (crank + r) % CL;
          int m = (int)dsv_ld_cluster_u32(dsv_cluster_map(smem_u32(gs.ccnt + gl), other));
          m = m < TK_CAP - n ? m : TK_CAP - n;
          const uint32_t ra = dsv_cluster_map(smem_u32(slab), other);
          for (int i = lane; i < m; i += 32) slab[n + i] = dsv_ld_cluster_u32(ra + 4u * i);
          n += m;
        }
        __syncwarp();
      }
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
      if constexpr (CL > 1) {
        const uint32_t T = gs.lo[gl];
        int gt = 0, eq = 0; /* this CTA's window keys above T and equal to it */
        for (int i = lane; i < n_own; i += 32) {
          gt += slab[i] > T;
          eq += slab[i] == T;
        }
        gt = (int)__reduce_add_sync(DSV_FULL_MASK, (uint32_t)gt);
        eq = (int)__reduce_add_sync(DSV_FULL_MASK, (uint32_t)eq);
        if (lane == 0) {
          sp.above[gl] += gt;
          sp.wcnt[gl] = eq;
        }
      }
      if (lane == 0) {
        gs.done[gl] = 1;
        gs.mode[gl] = TK_OFF;
      }
      continue;
    }
    bool ovf = false; /* BAND: some lane segment of the band buffer overflowed */
    if (mode == TK_BAND) {
      uint32_t c = 0;
      if (lane < 4 * CL) {
        const int* bc = gs.bcnt + gl * 4 + (lane & 3);
        if (CL == 1 || lane < 4)
          c = (uint32_t)*bc;
        else
          c = dsv_ld_cluster_u32(dsv_cluster_map(smem_u32(bc), (crank + (lane >> 2)) % CL));
      }
      ovf = seg == 0 || __any_sync(DSV_FULL_MASK, c > seg);
    }
    uint32_t b, above, cnt, above_own = 0, cnt_own = 0;
    if constexpr (CL > 1)
      dsv_tk_find_split<CL>(slab, crank, (uint32_t)need, lane, mode == TK_BAND, S,
                            (uint32_t)wcnt_own, b, above, cnt, above_own, cnt_own);
    else
      dsv_tk_find(slab, (uint32_t)need, lane, mode == TK_BAND, S, b, above, cnt);
    if (lane == 0) {
      const uint64_t lo = gs.lo[gl], hi = gs.hi[gl], top = gs.top[gl];
      const int s = gs.s[gl];
      uint64_t nlo, nhi;
      if (mode == TK_BAND && b == 0) { /* below the band */
        nlo = 0;
        nhi = lo - 1;
      } else if (mode == TK_BAND && b == TK_BINS - 1) { /* above the band */
        nlo = top + 1;
        nhi = hi;
      } else {
        nlo = lo + ((uint64_t)(b - (mode == TK_BAND)) << s);
        nhi = nlo + ((uint64_t)1 << s) - 1;
        if (nhi > top) nhi = top;
      }
      const int nneed = need - (int)above;
      if (mode == TK_BAND) gs.bufok[gl] = b >= 1 && b <= TK_BINS - 2 && !ovf;
      gs.lo[gl] = (uint32_t)nlo;
      gs.hi[gl] = (uint32_t)nhi;
      gs.need[gl] = nneed;
      gs.cnt[gl] = (int)cnt;
      if constexpr (CL > 1) {
        sp.above[gl] += (int)above_own;
        sp.wcnt[gl] = (int)cnt_own;
      }
      if ((int)cnt == nneed) { /* the whole window: every key >= lo */
        gs.done[gl] = 2;
        gs.mode[gl] = TK_OFF;
      } else if (nlo == nhi) { /* one key value: T = lo, take need of its ties */
        gs.done[gl] = 1;
        gs.mode[gl] = TK_OFF;
      } else {
        dsv_tk_plan(gs, gl);
      }
    }
  }
}

template <typename T, int RP, bool TWO, int GPW, int CL>
__global__ void __launch_bounds__(TK_THREADS) dsv_topk_kernel(const dsv_topk_args a) {
  /* GPW groups per warp: 16 (rows 0-7 and 8-15 of the MMA tile: groups A and B of a lane) or 8
   * (rows 0-7 only: twice the warps for the same groups, half the selection work per warp,
   * where the grid is too small to fill the device). CL CTAs per cluster share the groups and
   * split the keys (1: no cluster). */
  static_assert(GPW == 16 || GPW == 8, "GPW: 16 or 8 groups per warp");
  static_assert(CL >= 1 && CL <= 8, "CL: 1 to 8 CTAs per cluster");
  constexpr bool HASB = GPW == 16;
  constexpr int GPC = TK_WARPS * GPW; /* groups per CTA */
  static_assert(GPC <= TK_THREADS, "one thread per group in the CTA-wide votes");
  constexpr int KS = RP / 16;
  constexpr int SW = RP / 2 + 4; /* 32-bit words per staged key row (conflict-free B loads) */
  static_assert(TK_WARPS * GPW * TK_STAGE <= 2 * TK_TILE * SW,
                "the staged list entries must fit the key tiles");
  /* Tile loops. With TWO (the default): the MMA chains of all 8 blocks of a tile first, then
   * branch-free updates (fewer instructions, more independent MMAs in flight; identical lists).
   * Without (TWO = false, csrc/dev/): one 8-key block at a time (unroll 2). ptxas (CUDA 13.0)
   * miscompiles fully unrolled fp16 tile loops for RP >= 48 (HMMA results overwritten unread:
   * seen in the SASS and as lost keys on the H200), so those instantiations always keep the
   * block-at-a-time loops. */
  constexpr bool kTwoPhase = TWO && (dsv_is_bf16<T>::value || RP <= 32);
  extern __shared__ __align__(16) unsigned char dsv_tk_smem[];
  uint32_t* hist = reinterpret_cast<uint32_t*>(dsv_tk_smem); /* [GPC][256] slabs */
  float* reps = reinterpret_cast<float*>(dsv_tk_smem);       /* alias, prologue: [GPC][RP] */
  uint32_t* ktile = hist + GPC * TK_BINS;                    /* [2][TILE][SW] */
  dsv_tk_groups<GPC>& gs = *reinterpret_cast<dsv_tk_groups<GPC>*>(ktile + 2 * TK_TILE * SW);
  /* followed by [threads] sink slots, then (CL > 1) the split counts */
  dsv_tk_split<GPC>& sp = *reinterpret_cast<dsv_tk_split<GPC>*>(
      reinterpret_cast<uint32_t*>(&gs + 1) + TK_THREADS);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const uint32_t crank = CL > 1 ? dsv_cluster_rank() : 0u;
  const unsigned cid = blockIdx.x / CL; /* the cluster: one set of groups */
  const int64_t bh = cid / a.tiles_per_bh;
  const int tile = (int)(cid - bh * a.tiles_per_bh);
  const int64_t b = bh / a.H, h = bh - b * a.H;
  const int64_t g0 = (int64_t)tile * GPC;
  const int64_t S = a.S, NG = a.NG, kmax = a.kmax;
  const int S32 = (int)S; /* S < 2^31 (host check) */
  const int ngl = (int)((NG - g0) < GPC ? (NG - g0) : GPC); /* valid groups here */
  int64_t K = a.count[bh];
  K = K < 0 ? 0 : (K > kmax ? kmax : K);
  const int64_t Keff = K < S ? K : S;
  int32_t* outg0 = a.out + (bh * NG + g0) * kmax;
  /* this CTA's keys [kbeg, kend): whole tiles, the CTAs in order */
  int64_t kbeg = 0, kend = S;
  if constexpr (CL > 1) {
    const int64_t kt = ((S + TK_TILE - 1) / TK_TILE + CL - 1) / CL * TK_TILE;
    kbeg = crank * kt < S ? crank * kt : S;
    kend = kbeg + kt < S ? kbeg + kt : S;
  }

  if (Keff == 0) {
    const int64_t n = (int64_t)ngl * kmax;
    if (crank == 0)
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


  const bool warp_active = (warp * GPW) < ngl;
  const bool vA = gA < ngl, vB = HASB && gB < ngl;
  uint32_t* histw = hist + warp * GPW * TK_BINS;
  const T* kb = reinterpret_cast<const T*>(a.k) + b * a.k_sb + h * a.k_sh;
  /* the band buffers: this CTA's part of each list row (kmax / CL words), in 4 lane segments of
   * seg words; brows: local group 0's part, brow: this lane's segment of it; bseg: the keys a
   * lane segment takes, seg where the buffer is used, else 0 (set with the sample) */
  const uint32_t seg = (uint32_t)(kmax / CL / 4);
  uint32_t* brows = reinterpret_cast<uint32_t*>(outg0) + (int64_t)crank * (kmax / CL);
  uint32_t* brow = brows + (int64_t)j4 * seg;
  uint32_t bseg = 0;
  bool bonly = false; /* the band pass stores its keys without a histogram (tuning tk_band) */
  /* this CTA's key masks (tuning tk_compact; one CTA per set of groups) */
  uint32_t* cmasks = CL == 1 && a.masks
                         ? a.masks + (int64_t)blockIdx.x * ((S + TK_TILE - 1) / TK_TILE) * GPC * 4
                         : nullptr;

  /* ---- selection: T and q per group (skipped when every key is selected) ---- */
  if (Keff < S) {
    if constexpr (CL > 1) {
      for (int i = tid; i < GPC; i += TK_THREADS) {
        sp.above[i] = 0;
        sp.wcnt[i] = (int)(kend - kbeg);
      }
    }
    if (a.sample && S >= TK_MIN_S) {
      /* 0. the sample: T_lo / T_hi per group (two 8-bit radix passes over ns sample keys; this
       * CTA's part [sbeg, send) of them in a cluster) */
      const int64_t ns = (S + TK_STRIDE - 1) / TK_STRIDE;
      int64_t sbeg = 0, send = ns;
      if constexpr (CL > 1) {
        const int64_t st = ((ns + TK_TILE - 1) / TK_TILE + CL - 1) / CL * TK_TILE;
        sbeg = crank * st < ns ? crank * st : ns;
        send = sbeg + st < ns ? sbeg + st : ns;
      }
      const float mu = (float)Keff * (float)ns / (float)S, sd = sqrtf(mu);
      const float flo = ceilf(mu + 4.f * sd + 2.f), fhi = floorf(mu - 4.f * sd - 2.f);
      const int m_lo = flo >= (float)ns ? (int)ns : (int)flo;
      const int m_hi = fhi < 1.f ? 0 : (int)fhi;
      /* the band buffer pays where the band holds at most 1/20 of the keys (PERF_LOG v23: 0.80x
       * of the time with 4.1% of the keys in the band, 1.06x-1.14x with 8.4%-8.6%) */
      if ((int64_t)(m_lo - m_hi) * TK_STRIDE * 20 <= S) bseg = seg;
      /* ... and without a histogram where the band's expected keys per lane segment (its ~(m_lo
       * - m_hi) x 16 keys over CL CTAs and 4 segments) fill at most 3/4 of a segment: an
       * overflow, which costs the pass again, is then rare (tk_band 2: wherever the buffer is
       * used, for the tests of that path) */
      bonly = bseg != 0 && (a.band == 2 || (a.band == 1 && (int64_t)(m_lo - m_hi) * TK_STRIDE <=
                                                                3 * (int64_t)seg * CL));
      for (int i = tid; i < GPC; i += TK_THREADS) {
        gs.mode[i] = TK_HIST;
        gs.lo[i] = 0u;
        gs.hi[i] = 0xFFFFFFFFu;
        gs.top[i] = 0xFFFFFFFFu;
        gs.s[i] = 24;
        gs.done[i] = 0;
      }
      for (int sp8 = 0; sp8 < 3; ++sp8) {
        if (sp8 == 2) { /* T_hi in another top-8-bit bin than T_lo: a third sample pass (for the
                         * band buffer: without it the band ends at the bin's top) */
          if (bseg == 0) break;
          __syncthreads();
          if (!__syncthreads_or(tid < ngl && gs.mode[tid] == TK_HIST)) break;
        }
        if constexpr (CL > 1) dsv_cluster_sync(); /* the others have read this CTA's slabs */
        __syncwarp(); /* every lane's reads of the slabs (dsv_tk_find) before they are cleared */
        for (int i = lane; i < GPW * TK_BINS; i += 32) histw[i] = 0;
        __syncthreads();
        dsv_tk_pass<T, KS, SW, kTwoPhase, TK_HIST, true, GPC, HASB>(
            a, kb, sbeg, send, ktile, A, gs, hist, warp_active, tid, lane, gA, gB, vA, vB, brow,
            bseg);
        if constexpr (CL > 1) dsv_cluster_sync(); /* every CTA's partial histograms complete */
        for (int gi = 0; gi < GPW; ++gi) {
          const int gl = warp * GPW + gi;
          if (gl >= ngl) break;
          if (gs.mode[gl] != TK_HIST) continue; /* T_lo and T_hi known */
          const uint32_t* slab = hist + gl * TK_BINS;
          uint32_t bl = 0, al = 0, cl, bh8 = 0, ah = 0, ch = 0;
          /* the sample ranks to find in this pass's window: both at first, then T_lo's (and
           * T_hi's when in the same top-8-bit bin), then T_hi's alone */
          const bool same = sp8 == 1 && (gs.thi[gl] >> 24) == (gs.lo[gl] >> 24);
          const uint32_t nlo = sp8 == 0 ? (uint32_t)m_lo : (sp8 == 1 ? (uint32_t)gs.sneed_lo[gl] : 1u);
          const int nhi = sp8 == 0 ? m_hi : (sp8 == 2 || same ? gs.sneed_hi[gl] : 0);
          if constexpr (CL > 1) {
            uint32_t x0, x1;
            if (sp8 < 2)
              dsv_tk_find_split<CL>(slab, crank, nlo, lane, false, 0u, 0u, bl, al, cl, x0, x1);
            if (nhi > 0)
              dsv_tk_find_split<CL>(slab, crank, (uint32_t)nhi, lane, false, 0u, 0u, bh8, ah, ch,
                                    x0, x1);
          } else {
            if (sp8 < 2) dsv_tk_find(slab, nlo, lane, false, 0u, bl, al, cl);
            if (nhi > 0) dsv_tk_find(slab, (uint32_t)nhi, lane, false, 0u, bh8, ah, ch);
          }
          __syncwarp(); /* every lane has read the state before lane 0 writes it */
          if (lane == 0) {
            const uint32_t lo = gs.lo[gl];
            if (sp8 == 0) {
              gs.lo[gl] = bl << 24;
              gs.hi[gl] = (bl << 24) | 0xFFFFFFu;
              gs.top[gl] = gs.hi[gl];
              gs.s[gl] = 16;
              gs.sneed_lo[gl] = (int)(nlo - al);
              gs.sneed_hi[gl] = nhi > 0 ? nhi - (int)(bh8 == bl ? al : ah) : 0;
              gs.thi[gl] = nhi > 0 ? ((bh8 << 24) | 0xFFFFFFu) : 0xFFFFFFFFu;
            } else if (sp8 == 1) {
              const uint32_t tlo = lo + (bl << 16);
              if (gs.sneed_hi[gl] > 0 && !same && bseg) { /* T_hi: the next pass; T_lo waits */
                gs.top[gl] = tlo;
                gs.lo[gl] = gs.thi[gl] & 0xFF000000u;
                gs.hi[gl] = gs.thi[gl];
              } else {
                gs.lo[gl] = tlo;
                gs.hi[gl] = nhi > 0 ? lo + (bh8 << 16) + 0xFFFFu : gs.thi[gl]; /* T_hi */
                gs.mode[gl] = TK_OFF;
              }
            } else {
              gs.hi[gl] = lo + (bh8 << 16) + 0xFFFFu; /* T_hi */
              gs.lo[gl] = gs.top[gl];                 /* T_lo */
              gs.mode[gl] = TK_OFF;
            }
          }
        }
      }
      __syncthreads();
      /* the band pass's parameters: [T_lo, T_hi] in at most 254 power-of-two bins, the band
       * ending at T_hi (keys above it count as above the band, bin 255) */
      for (int i = tid; i < GPC; i += TK_THREADS) {
        const uint32_t tlo = gs.lo[i], thi = gs.hi[i];
        const uint32_t w = thi - tlo;
        int s = 0;
        while ((w >> s) > 253u) ++s;
        const uint64_t top = (uint64_t)tlo + ((uint64_t)254 << s) - 1;
        gs.top[i] = top > (uint64_t)thi ? thi : (uint32_t)top;
        gs.s[i] = s;
        gs.hi[i] = 0xFFFFFFFFu;
        gs.mode[i] = TK_BAND;
        gs.need[i] = (int)Keff;
        gs.cnt[i] = S32;
        gs.done[i] = 0;
        gs.bufok[i] = 0;
      }
    } else {
      for (int i = tid; i < GPC; i += TK_THREADS) {
        gs.lo[i] = 0u;
        gs.hi[i] = 0xFFFFFFFFu;
        gs.need[i] = (int)Keff;
        gs.cnt[i] = S32;
        gs.done[i] = 0;
        gs.bufok[i] = 0;
        dsv_tk_plan(gs, i);
      }
    }
    /* 1-2. band / generic / collect passes over all keys until every group is resolved */
    for (int pass = 0; pass < TK_MAX_PASSES; ++pass) {
      if constexpr (CL > 1) dsv_cluster_sync(); /* the others have read this CTA's slabs */
      __syncwarp(); /* every lane's reads of the slabs (dsv_tk_find) before they are cleared */
      for (int i = lane; i < GPW * TK_BINS; i += 32) histw[i] = 0;
      if (lane < GPW) gs.ccnt[warp * GPW + lane] = 0;
      __syncthreads(); /* also publishes the states written in the previous pass */
      const bool all_done = __syncthreads_and(tid >= ngl || gs.done[tid] != 0);
      if (all_done) break;
      /* the pass kind: BAND (the first, sampled), else HIST while any group needs one (the
       * collecting groups wait), else COLLECT */
      const bool band = __syncthreads_or(tid < ngl && gs.mode[tid] == TK_BAND);
      const bool hst = __syncthreads_or(tid < ngl && gs.mode[tid] == TK_HIST);
      /* a collect step reads the band buffers when every collecting group can */
      const bool fill = __syncthreads_and(tid >= ngl || gs.mode[tid] != TK_COLLECT ||
                                          gs.bufok[tid] != 0);
      const int kind = band ? TK_BAND : (hst ? TK_HIST : TK_COLLECT);
      if (kind == TK_BAND && bonly) {
        /* the keys of the band into the buffers, then their histogram from there; where a
         * segment of this CTA overflowed, the histogram takes a band pass over all keys (it
         * stores the same keys again) */
        if (cmasks) /* and the keys' masks (tk_compact) */
          dsv_tk_pass<T, KS, SW, kTwoPhase, TK_BANDM, false, GPC, HASB>(
              a, kb, kbeg, kend, ktile, A, gs, hist, warp_active, tid, lane, gA, gB, vA, vB,
              brow, bseg, cmasks);
        else
          dsv_tk_pass<T, KS, SW, kTwoPhase, TK_BANDS, false, GPC, HASB>(
              a, kb, kbeg, kend, ktile, A, gs, hist, warp_active, tid, lane, gA, gB, vA, vB,
              brow, bseg);
        __syncthreads();
        const bool ovf = __syncthreads_or(
            tid < ngl && gs.mode[tid] == TK_BAND &&
            (gs.bcnt[4 * tid] > (int)bseg || gs.bcnt[4 * tid + 1] > (int)bseg ||
             gs.bcnt[4 * tid + 2] > (int)bseg || gs.bcnt[4 * tid + 3] > (int)bseg));
        if (ovf)
          dsv_tk_pass<T, KS, SW, kTwoPhase, TK_BAND, false, GPC, HASB>(
              a, kb, kbeg, kend, ktile, A, gs, hist, warp_active, tid, lane, gA, gB, vA, vB,
              brow, bseg);
        else if (warp_active)
          dsv_tk_band_hist<GPW, GPC>(gs, hist, brows, kmax, bseg, warp, lane, ngl);
      } else if (kind == TK_BAND)
        dsv_tk_pass<T, KS, SW, kTwoPhase, TK_BAND, false, GPC, HASB>(
            a, kb, kbeg, kend, ktile, A, gs, hist, warp_active, tid, lane, gA, gB, vA, vB, brow,
            bseg);
      else if (kind == TK_HIST)
        dsv_tk_pass<T, KS, SW, kTwoPhase, TK_HIST, false, GPC, HASB>(
            a, kb, kbeg, kend, ktile, A, gs, hist, warp_active, tid, lane, gA, gB, vA, vB, brow,
            bseg);
      else if (fill) {
        if (warp_active) dsv_tk_fill<GPW, GPC>(gs, hist, brows, kmax, seg, warp, lane, ngl);
      } else
        dsv_tk_pass<T, KS, SW, kTwoPhase, TK_COLLECT, false, GPC, HASB>(
            a, kb, kbeg, kend, ktile, A, gs, hist, warp_active, tid, lane, gA, gB, vA, vB, brow,
            bseg);
      if constexpr (CL > 1) dsv_cluster_sync(); /* every CTA's partial histograms complete */
      dsv_tk_resolve<GPW, GPC, CL>(gs, sp, hist, kind, warp, lane, ngl, (uint32_t)S, crank,
                                   bseg);
    }
  }
  __syncthreads();
  if constexpr (CL > 1) {
    /* this CTA's part of each list: its ties to take (the first `need` ties in position order,
     * the CTAs in order) and its first list index (what the CTAs before it select) */
    dsv_cluster_sync(); /* every CTA's counts final */
    for (int g = tid; g < ngl; g += TK_THREADS) {
      const int done = Keff < S ? gs.done[g] : 3;
      const int need = done == 3 ? 0 : gs.need[g];
      int64_t before = 0, ties_before = 0;
      int q = 0;
      for (uint32_t r = 0; r <= crank; ++r) {
        int above, wcnt;
        if (r == crank) {
          above = sp.above[g];
          wcnt = sp.wcnt[g];
        } else {
          above = (int)dsv_ld_cluster_u32(dsv_cluster_map(smem_u32(sp.above + g), r));
          wcnt = (int)dsv_ld_cluster_u32(dsv_cluster_map(smem_u32(sp.wcnt + g), r));
        }
        int64_t sel;
        if (done == 3) { /* every key: the range's keys */
          const int64_t kt = ((S + TK_TILE - 1) / TK_TILE + CL - 1) / CL * TK_TILE;
          const int64_t rb = r * kt < S ? r * kt : S, re = rb + kt < S ? rb + kt : S;
          sel = re - rb;
          q = (int)sel;
        } else if (done == 2) { /* the whole window */
          sel = above + wcnt;
          q = wcnt;
        } else { /* T and need of its ties */
          const int64_t left = need - ties_before;
          q = (int)(left < 0 ? 0 : (left < wcnt ? left : wcnt));
          sel = above + q;
          ties_before += wcnt;
        }
        if (r < crank) before += sel;
      }
      sp.q[g] = q;
      sp.base[g] = (int)before;
    }
    dsv_cluster_sync(); /* no CTA reads another's shared memory after this */
  }

  /* ---- 3a. the compaction from masks (tuning tk_compact): where the band pass wrote its key
   * masks and every group's T lies in its band, all of whose keys its buffer holds (bufok), at
   * most 1024 per lane segment, the compaction needs no scores: a key is selected when its mask
   * says above the band, or when it is in the band and its buffered value is > T (or == T, a
   * tie). Each lane segment's keys are in position order, so per segment two bits per key, > T
   * and == T, in the order of the segment (ballots over 32 keys at a time) are all the
   * compaction needs of the buffer: written to the group's slab, [segment][32-key word][gt, eq],
   * before the list (which overwrites the buffer) is written. ---- */
  bool mc = false;
  if constexpr (CL == 1) {
    if (cmasks && bonly && Keff < S) /* (the states final since the barrier above) */
      mc = __syncthreads_and(
          tid >= ngl || (gs.bufok[tid] && gs.done[tid] != 0 && gs.bcnt[4 * tid] <= 1024 &&
                         gs.bcnt[4 * tid + 1] <= 1024 && gs.bcnt[4 * tid + 2] <= 1024 &&
                         gs.bcnt[4 * tid + 3] <= 1024));
  }
  if (mc) {
    if (warp_active) dsv_tk_codes<GPW, GPC>(gs, hist, brows, kmax, bseg, warp, lane, ngl);
    __syncthreads();
  }

  /* ---- 3. compaction pass: {u > T} and the first q of {u == T}, ascending positions ---- */
  {
    const uint32_t TA = (Keff < S && vA) ? gs.lo[gA] : 0u; /* K >= S: every key, T = 0 */
    const uint32_t TB = (Keff < S && vB) ? gs.lo[gB] : 0u;
    const int sel_grp = j4 >> 1, w = j4 & 1;
    const int gC = (HASB && sel_grp) ? gB : gA;
    const bool vC = sel_grp ? vB : vA; /* without HASB rows 8-15 hold no group */
    int64_t qC;
    if (!vC) qC = 0;
    else if (Keff >= S) qC = S;        /* every key: T = 0 (lowest key), all ties */
    else if (gs.done[gC] == 2) qC = S; /* the whole window: every key >= T */
    else qC = CL > 1 ? sp.q[gC] : gs.need[gC];
    int64_t baseC = CL > 1 && vC ? sp.base[gC] : 0, eqbaseC = 0;
    int32_t* outC = outg0 + (int64_t)gC * kmax;
    const int bsh = 16 * sel_grp + 8 * w;
    const int qbase = lane & ~3;
    const int nkeys32 = (int)(kend - kbeg); /* this CTA's keys (S without a cluster) */
    const int ntiles = (int)((kend - kbeg + TK_TILE - 1) / TK_TILE);

    /* the staged entries (from masks): pend of the lane's group, the last pend ranks before
     * baseC, at [group of the warp][TK_STAGE] in the key tiles (free in the compaction from
     * masks). flush(n, r0): the first n staged entries of each group, of ranks r0..., to its
     * list, 16 lanes on consecutive entries of one group, two groups per store (the counts and
     * bases shuffled first, no dependent chain) */
    int pend = 0;
    auto flush = [&](int n, int r0) {
      __syncwarp();
      const int e = lane & 15, hi = lane >> 4;
      int gn[GPW / 2], gb[GPW / 2];
#pragma unroll
      for (int p = 0; p < GPW / 2; ++p) {
        const int g = 2 * p + hi, src = 4 * (g & 7) + 2 * (g >> 3); /* its quad's j4 0 / 2 */
        gn[p] = __shfl_sync(DSV_FULL_MASK, n, src);
        gb[p] = __shfl_sync(DSV_FULL_MASK, r0, src);
      }
      const uint32_t* stw = ktile + warp * GPW * TK_STAGE;
      int32_t* ow = outg0 + (int64_t)warp * GPW * kmax;
      bool more = false;
#pragma unroll
      for (int p = 0; p < GPW / 2; ++p) {
        const int g = 2 * p + hi;
        if (e < gn[p] && gb[p] + e < Keff && (DSV_TK_LIST_STORES || gb[p] + e == Keff - 1))
          ow[(int64_t)g * kmax + gb[p] + e] = (int32_t)stw[g * TK_STAGE + e];
        more |= gn[p] > 16;
      }
      if (__any_sync(DSV_FULL_MASK, more)) {
#pragma unroll
        for (int p = 0; p < GPW / 2; ++p) {
          const int g = 2 * p + hi, i = e + 16;
          if (i < gn[p] && gb[p] + i < Keff && (DSV_TK_LIST_STORES || gb[p] + i == Keff - 1))
            ow[(int64_t)g * kmax + gb[p] + i] = (int32_t)stw[g * TK_STAGE + i];
        }
      }
      __syncwarp();
    };
    /* one tile's selection from each lane's flags of its groups' keys (bit 2 blk + e: key 8 blk
     * + 2 j4 + e of the tile; u > T: mg, u == T: me), in position order */
    auto emit = [&](uint32_t mgA, uint32_t mgB, uint32_t meA, uint32_t meB, int t0) {
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
      /* from masks: the tile's entries appended to the group's pending ones in the warp's
       * stage, in windows of TK_STAGE: while some group's entries pass the window, the window
       * is stored (every group's part of it) and the next one begins */
      if (mc) {
        const int ntile = vC ? sel_cnt + sel_other : 0;
        const int tot = pend + ntile, r0 = (int)baseC - pend;
        uint32_t* st = ktile + (warp * GPW + (lane >> 2) + 8 * sel_grp) * TK_STAGE;
        const uint32_t pos0 = (uint32_t)(kbeg + t0 + 32 * w);
        uint32_t x = vC ? sel : 0u;
        int slot = pend + (w ? sel_other : 0), s0 = 0;
        while (__any_sync(DSV_FULL_MASK, tot - s0 > TK_STAGE)) {
          for (; x && slot < s0 + TK_STAGE; x &= x - 1, ++slot)
            st[slot - s0] = pos0 + (uint32_t)(__ffs(x) - 1);
          flush(tot - s0 < 0 ? 0 : (tot - s0 < TK_STAGE ? tot - s0 : TK_STAGE), r0 + s0);
          s0 += TK_STAGE;
        }
        for (; x; x &= x - 1, ++slot) st[slot - s0] = pos0 + (uint32_t)(__ffs(x) - 1);
        pend = tot - s0 > 0 ? tot - s0 : 0;
      } else if (vC) {
        uint32_t x = sel;
        const int32_t pos0 = (int32_t)(kbeg + t0 + 32 * w);
        while (x) {
          const int bit = __ffs(x) - 1;
          x &= x - 1;
          if (rank < Keff && (DSV_TK_LIST_STORES || rank == Keff - 1)) outC[rank] = pos0 + bit;
          ++rank;
        }
      }
      baseC += sel_cnt + sel_other;
      eqbaseC += eq_cnt + eq_other;
    };

    if (mc) {
      /* the flags from the masks and the slab's bits (3a): the masks of tile it + 1 load while
       * tile it is placed */
      const uint32_t* codeA = hist + gA * TK_BINS + j4 * 64;
      const uint32_t* codeB = hist + (HASB ? gB : gA) * TK_BINS + j4 * 64;
      const int swA = dsv_tk_code_swz(gA, j4), swB = dsv_tk_code_swz(HASB ? gB : gA, j4);
      int nA = 0, nB = 0; /* band keys of the lane's segments placed so far */
      uint32_t wA = 0u, wB = 0u;
      if (warp_active && ntiles > 0) {
        wA = cmasks[gA * 4 + j4];
        if constexpr (HASB) wB = cmasks[gB * 4 + j4];
      }
      for (int it = 0; it < ntiles && warp_active; ++it) {
        const uint32_t xA = wA, xB = wB;
        if (it + 1 < ntiles) {
          wA = cmasks[((int64_t)(it + 1) * GPC + gA) * 4 + j4];
          if constexpr (HASB) wB = cmasks[((int64_t)(it + 1) * GPC + gB) * 4 + j4];
        }
        uint32_t mgA = xA & 0xFFFFu, meA = 0u, mgB = xB & 0xFFFFu, meB = 0u;
        for (uint32_t b = xA >> 16; b; b &= b - 1, ++nA) {
          const int bit = __ffs((int)b) - 1;
          const int x = (2 * (nA >> 5)) ^ swA;
          mgA |= ((codeA[x] >> (nA & 31)) & 1u) << bit;
          meA |= ((codeA[x + 1] >> (nA & 31)) & 1u) << bit;
        }
        if constexpr (HASB) {
          for (uint32_t b = xB >> 16; b; b &= b - 1, ++nB) {
            const int bit = __ffs((int)b) - 1;
            const int x = (2 * (nB >> 5)) ^ swB;
            mgB |= ((codeB[x] >> (nB & 31)) & 1u) << bit;
            meB |= ((codeB[x + 1] >> (nB & 31)) & 1u) << bit;
          }
        }
        emit(mgA, mgB, meA, meB, it * TK_TILE);
      }
      if (warp_active) flush(pend, (int)baseC - pend);
    } else {
      /* the flags from the scores, recomputed */
      dsv_stage_rows16<T>(ktile, SW, kb, a.k_ss, kbeg, TK_TILE, kend, (int)a.r, RP, a.kvec, tid,
                          TK_THREADS);
      cp_async_commit();
      for (int it = 0; it < ntiles; ++it) {
        cp_async_wait_all();
        __syncthreads();
        if (it + 1 < ntiles) {
          dsv_stage_rows16<T>(ktile + ((it + 1) & 1) * TK_TILE * SW, SW, kb, a.k_ss,
                              kbeg + (int64_t)(it + 1) * TK_TILE, TK_TILE, kend, (int)a.r, RP,
                              a.kvec, tid, TK_THREADS);
        }
        cp_async_commit();
        if (!warp_active) continue;
        const uint32_t* kt = ktile + (it & 1) * TK_TILE * SW;
        const int t0 = it * TK_TILE;
        uint32_t mgA = 0, mgB = 0, meA = 0, meB = 0;
        auto flags = [&](const float (&d)[4], int blk, uint32_t k0, uint32_t k1) {
          dsv_tk_flags<HASB>(d, blk, k0, k1, TA, TB, mgA, mgB, meA, meB);
        };
        if (t0 + TK_TILE <= nkeys32) /* all but a partial last tile */
          dsv_tk_tile_blocks<T, KS, SW, kTwoPhase, true>(kt, A, lane, j4, t0, nkeys32, flags);
        else
          dsv_tk_tile_blocks<T, KS, SW, kTwoPhase, false>(kt, A, lane, j4, t0, nkeys32, flags);
        emit(mgA, mgB, meA, meB, t0);
      }
    }
    if (warp_active && vC && w == 0) gs.base[gC] = (int)(baseC < Keff ? baseC : Keff);
  }
  __syncwarp();
  /* -1 padding after the selected entries (a cluster: its first CTA, after all Keff) */
  if (CL > 1 && crank != 0) return;
  for (int gi = 0; gi < GPW; ++gi) {
    const int gl = warp * GPW + gi;
    if (gl >= ngl) break;
    int32_t* o = outg0 + (int64_t)gl * kmax;
    const int start = CL > 1 ? (int)Keff : gs.base[gl];
    for (int64_t e = start + lane; e < kmax; e += 32) o[e] = -1;
  }
}

/* grid: the groups' CTAs (clusters of CL CTAs: grid is CL x the sets of groups) */
template <typename T, int RP, bool TWO, int GPW, int CL>
static int dsv_topk_launch_v(const dsv_topk_args& a, int64_t grid, cudaStream_t st) {
  const size_t smem = dsv_topk_smem_bytes<RP, GPW, CL>();
  DSV_CUDA_TRY(cudaFuncSetAttribute(dsv_topk_kernel<T, RP, TWO, GPW, CL>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  if constexpr (CL == 1) {
    dsv_topk_kernel<T, RP, TWO, GPW, CL><<<(unsigned)grid, TK_THREADS, smem, st>>>(a);
  } else {
    cudaLaunchConfig_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.gridDim = dim3((unsigned)grid, 1, 1);
    cfg.blockDim = dim3(TK_THREADS, 1, 1);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = CL;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    DSV_CUDA_TRY(cudaLaunchKernelEx(&cfg, dsv_topk_kernel<T, RP, TWO, GPW, CL>, a));
  }
  DSV_CUDA_CHECK_LAUNCH();
  return DSV_OK;
}

template <typename T, int RP, bool TWO>
static int dsv_topk_launch_gpw(const dsv_topk_args& a, int gpw, int split, int64_t grid,
                               cudaStream_t st) {
  if (split == 2)
    return gpw == 8 ? dsv_topk_launch_v<T, RP, TWO, 8, 2>(a, grid, st)
                    : dsv_topk_launch_v<T, RP, TWO, 16, 2>(a, grid, st);
  if (split == 4)
    return gpw == 8 ? dsv_topk_launch_v<T, RP, TWO, 8, 4>(a, grid, st)
                    : dsv_topk_launch_v<T, RP, TWO, 16, 4>(a, grid, st);
  if (split == 8)
    return gpw == 8 ? dsv_topk_launch_v<T, RP, TWO, 8, 8>(a, grid, st)
                    : dsv_topk_launch_v<T, RP, TWO, 16, 8>(a, grid, st);
  return gpw == 8 ? dsv_topk_launch_v<T, RP, TWO, 8, 1>(a, grid, st)
                  : dsv_topk_launch_v<T, RP, TWO, 16, 1>(a, grid, st);
}

/* The shipped tile loops are the two-phase ones (dsv_topk_entry<true>; the block-at-a-time
 * instantiation, TWO = false, is csrc/dev/topk_block_at_a_time.cu). */
template <typename T, bool TWO>
static int dsv_topk_dispatch(const dsv_topk_args& a, int RP, int gpw, int split, int64_t grid,
                             cudaStream_t st) {
  switch (RP) {
    case 16: return dsv_topk_launch_gpw<T, 16, TWO>(a, gpw, split, grid, st);
    case 32: return dsv_topk_launch_gpw<T, 32, TWO>(a, gpw, split, grid, st);
    case 48: return dsv_topk_launch_gpw<T, 48, TWO>(a, gpw, split, grid, st);
    case 64: return dsv_topk_launch_gpw<T, 64, TWO>(a, gpw, split, grid, st);
  }
  return DSV_ERR_UNSUPPORTED;
}

/* Groups per warp and CTAs per set of groups: the tuning's, or automatic: where 16 groups per
 * warp would leave the grid under two CTAs per SM, the estimation is bound by each warp's chain
 * of passes, not by issue: 8 groups per warp, and clusters of two CTAs that each score half of
 * the keys (compute capability 9.0 and up; kernels v16 and v18 in PERF_LOG.md), of four or
 * eight where clusters of two still leave fewer CTAs than SMs and each CTA keeps at least 16
 * tiles of keys (models with few heads, short sequences; v45). */
static void dsv_topk_layout(const dsv_lowrank_shape* p, const dsv_tuning* tun, int* gpw,
                            int* split) {
  const int64_t BH = p->batch * p->heads;
  const bool small = BH * dsv_cdiv64(p->num_groups, (int64_t)TK_GPC) < 2LL * tun->sm_count;
  *gpw = tun->tk_gpw;
  if (*gpw != 8 && *gpw != 16) *gpw = small ? 8 : 16;
  *split = tun->tk_split;
  if (*split != 1 && *split != 2 && *split != 4 && *split != 8) {
    const int64_t sets = BH * dsv_cdiv64(p->num_groups, (int64_t)TK_WARPS * *gpw);
    *split = small ? 2 : 1;
    /* doubled while the grid stays under one CTA per SM and each CTA keeps >= 16 key tiles */
    while (small && *split < 8 && sets * *split < tun->sm_count &&
           p->seqlen >= (int64_t)TK_TILE * 16 * (*split * 2))
      *split *= 2;
  }
  if (tun->cc < 90) *split = 1;
}

/* The key masks of the compaction from masks (tuning tk_compact, one CTA per set of groups):
 * 16 bytes per group and 64-key tile, S / 4 bytes per group; none above 1 GiB (the compaction
 * then rescores the keys). */
static size_t dsv_topk_mask_bytes(const dsv_lowrank_shape* p, const dsv_tuning* tun) {
  int gpw, split;
  dsv_topk_layout(p, tun, &gpw, &split);
  if (!tun->tk_compact || split != 1 || p->seqlen <= 0 || p->num_groups <= 0) return 0;
  const int64_t gpc = (int64_t)TK_WARPS * gpw;
  const int64_t ctas = p->batch * p->heads * dsv_cdiv64(p->num_groups, gpc);
  const double bytes = (double)ctas * (double)dsv_cdiv64(p->seqlen, TK_TILE) * (double)gpc * 16.0;
  return bytes <= (double)(1LL << 30) ? (size_t)bytes : 0;
}

extern "C" size_t dsv_topk_estimate_workspace_cuda(const dsv_lowrank_shape* p) {
  const dsv_tuning* tun = nullptr;
  if (!p || dsv_tuning_current(&tun) != DSV_OK) return 0;
  return dsv_topk_mask_bytes(p, tun);
}

/* The argument checks and the run, with the two-phase tile loops (TWO, shipped) or the
 * block-at-a-time ones (csrc/dev/topk_block_at_a_time.cu). */
template <bool TWO>
static int dsv_topk_entry(const dsv_lowrank_shape* p, dsv_bshd q_lr, dsv_bshd k_lr,
                          const int32_t* kv_count, int32_t* kv_index, void* workspace,
                          size_t workspace_bytes, void* stream) {
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
  int gpw, split;
  dsv_topk_layout(p, tun, &gpw, &split);
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
  a.sample = tun->tk_sample;
  a.band = tun->tk_band;
  const size_t mbytes = dsv_topk_mask_bytes(p, tun);
  a.masks = mbytes > 0 && workspace && workspace_bytes >= mbytes ? (uint32_t*)workspace : nullptr;
  const int64_t grid = BH * a.tiles_per_bh * split;
  if (grid > 0x7fffffffLL) return DSV_ERR_UNSUPPORTED;
  const int RP = (int)((p->rank + 15) / 16 * 16);
  cudaStream_t st = (cudaStream_t)stream;
  if (p->dtype == DSV_BFLOAT16)
    return dsv_topk_dispatch<__nv_bfloat16, TWO>(a, RP, gpw, split, grid, st);
  return dsv_topk_dispatch<__half, TWO>(a, RP, gpw, split, grid, st);
}

extern "C" int dsv_topk_estimate_cuda(const dsv_lowrank_shape* p, dsv_bshd q_lr, dsv_bshd k_lr,
                                      const int32_t* kv_count, int32_t* kv_index,
                                      void* workspace, size_t workspace_bytes, void* stream) {
  return dsv_topk_entry<true>(p, q_lr, k_lr, kv_count, kv_index, workspace, workspace_bytes,
                              stream);
}
