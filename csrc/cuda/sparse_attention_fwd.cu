/*
 * sparse_attention_fwd.cu - forward of sparse grouped attention on CUDA (sm_90a).
 *
 * One CTA handles a chunk of consecutive queries of one group (all queries of a chunk share the
 * group's key list). The group's keys are gathered BN at a time with cp.async into an NS-stage
 * shared-memory pipeline (each gathered row is D contiguous elements); S = Q K^T and O += P V
 * accumulate in fp32 with an online (base-2) softmax. List entries past kv_count and positions
 * outside [0, S) become masked zero rows, so nothing is read out of bounds. Block lists
 * (dsv_attn_shape.kv_block 16 or 64: entry e covers keys e b .. e b + b - 1) run the same
 * kernels with the block size as a template argument: a tile's rows are whole blocks or parts
 * of one, contiguous rows of K and V (list_key, attention_common.cuh), keys past S masked.
 * Two kernels:
 *  - sparse_attn_fwd_wg_kernel (default on H100 / H200, D = 64, 128 or 256, G >= 64; D = 256
 *    unless the kernel tuning wg256 is 0): one warpgroup per 64 queries on wgmma, tiles
 *    128-byte swizzled (wgmma.cuh);
 *  - sparse_attn_fwd_kernel (every other case): BM / 16 warps of 16 query rows each on
 *    mma.sync.m16n8k16 with ldmatrix from padded tiles.
 */
#include "attention_common.cuh"
#include "merged_groups.cuh"
#include "tuning.h"
#include "wgmma.cuh"

namespace dsv_attn {

template <typename T>
struct FwdParams {
  const T* q;
  const T* k;
  const T* v;
  T* out;
  float* lse;
  int64_t qb, qs, qh, kb, ks, kh, vb, vs, vh, ob, os, oh;
  const int* kv_index;
  const int* kv_count;
  int S, H, G, NG, kmax, chunks;
  float scale_log2;
  int g128; /* the tuning's g128: groups of a multiple of 128 rows on two warpgroups per CTA */
  int wg256; /* the tuning's wg256: D 256 on the wgmma kernel */
  /* merged groups (the tuning's merge, G 16 / 32; merged_groups.cuh), in the workspace:
   * nullptr when not merging */
  int* uidx; /* [B, H, NSG, ucap] */
  int* ucnt; /* [B, H, NSG] */
  int* knf;  /* [B, H] */
  int NSG, ucap, ug;
  float merge; /* the tuning's merge */
};

/* The BM queries a CTA handles (blockIdx.x = group x chunks + chunk, blockIdx.y = head,
 * blockIdx.z = batch): rows [row0, row0 + nrows) of group g, the group's list and clamped key
 * count, and the (batch, head) bases of q, k and v. */
template <typename T>
struct FwdChunk {
  int g, h, b, row0, nrows, count;
  const int* list;
  const T *qbase, *kbase, *vbase;
};

/* The chunk's rows; false when it has none (past the end of a partial last group). */
template <typename T, int BM>
__device__ __forceinline__ bool fwd_chunk(const FwdParams<T>& p, FwdChunk<T>& c) {
  c.g = blockIdx.x / p.chunks;
  const int chunk = blockIdx.x - c.g * p.chunks;
  c.h = blockIdx.y;
  c.b = blockIdx.z;
  c.row0 = c.g * p.G + chunk * BM;
  c.nrows = min(BM, min(c.g * p.G + p.G, p.S) - c.row0);
  return c.nrows > 0;
}

/* The chunk's list, its key count (clamped, trailing -1 padding trimmed) and (batch, head)
 * bases (after fwd_chunk returned true; every thread of the CTA calls it). */
template <typename T, int NT>
__device__ __forceinline__ void fwd_chunk_list(const FwdParams<T>& p, FwdChunk<T>& c) {
  const int count = __ldg(p.kv_count + (size_t)c.b * p.H + c.h);
  c.list = p.kv_index + (((size_t)c.b * p.H + c.h) * p.NG + c.g) * p.kmax;
  c.count = trim_count<NT>(c.list, count < 0 ? 0 : (count > p.kmax ? p.kmax : count));
  c.qbase = p.q + c.b * p.qb + c.h * p.qh;
  c.kbase = p.k + c.b * p.kb + c.h * p.kh;
  c.vbase = p.v + c.b * p.vb + c.h * p.vh;
}

/* Merged groups: the chunk is 128-query block c.g (the launch's G = 128); its union and count,
 * and the (batch, head) bases; false where the block was not merged (uniform per CTA). */
template <typename T>
__device__ __forceinline__ bool fwd_chunk_union(const FwdParams<T>& p, FwdChunk<T>& c) {
  const size_t bh = (size_t)c.b * p.H + c.h;
  c.count = __ldg(p.ucnt + bh * p.NSG + c.g);
  if (c.count < 0 || __ldg(p.knf + bh)) return false;
  c.list = p.uidx + (bh * p.NSG + c.g) * (size_t)p.ucap;
  c.qbase = p.q + c.b * p.qb + c.h * p.qh;
  c.kbase = p.k + c.b * p.kb + c.h * p.kh;
  c.vbase = p.v + c.b * p.vb + c.h * p.vh;
  return true;
}

/* Starts the copy of the chunk's BM query rows into Qs (padded, or swizzled with SWZ: one
 * swizzled tile of 64 rows per warpgroup, one after the other; rows past nrows are zero); qidx
 * is shared scratch of BM ints. */
template <typename T, int D, int NT, int BM, bool SWZ>
__device__ __forceinline__ void fwd_load_q(T* Qs, int* qidx, const FwdParams<T>& p,
                                           const FwdChunk<T>& c) {
  for (int r = threadIdx.x; r < BM; r += NT) qidx[r] = r < c.nrows ? c.row0 + r : -1;
  __syncthreads();
  if constexpr (SWZ) {
#pragma unroll
    for (int w = 0; w < BM / 64; ++w)
      gather_rows_async<T, D, NT, 64, true>(Qs + w * 64 * D, c.qbase, p.qs, qidx + 64 * w, 64);
  } else {
    gather_rows_async<T, D, NT, BM, false>(Qs, c.qbase, p.qs, qidx, BM);
  }
}

/* Online-softmax step of one key tile for the two rows a lane holds (lane / 4 and lane / 4 + 8
 * of its warp's 16): masks the columns of missing keys (int mask: position -1; float mask: a
 * bias of -inf, 0 for present keys; UN: packed entries of merged groups, whose member bit ush
 * must be set too), scales to base 2, updates the running maximum (m0, m1) and sum (l0, l1),
 * leaves P = exp2(s - max) in s and returns the factors (a0, a1) that rescale the output
 * accumulated so far. */
template <int BN, typename MaskT, bool UN = false>
__device__ __forceinline__ void softmax_tile(float (&s)[BN / 8][4], const MaskT* mask,
                                             float scale_log2, int lane, float& m0, float& m1,
                                             float& l0, float& l1, float& a0, float& a1,
                                             int ush = 0) {
  float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
  for (int nt = 0; nt < BN / 8; ++nt) {
    const int col = nt * 8 + (lane & 3) * 2;
    if constexpr (sizeof(MaskT) == sizeof(float) && (MaskT)0.5f != 0) {
      /* mask = a bias per key: 0 or -inf (KeyGather) */
      const float2 bb = *reinterpret_cast<const float2*>(mask + col);
      s[nt][0] = fmaf(s[nt][0], scale_log2, bb.x);
      s[nt][1] = fmaf(s[nt][1], scale_log2, bb.y);
      s[nt][2] = fmaf(s[nt][2], scale_log2, bb.x);
      s[nt][3] = fmaf(s[nt][3], scale_log2, bb.y);
    } else {
      /* mask = the keys' positions, -1 for none */
      const int e0 = mask[col], e1 = mask[col + 1];
      const bool v0 = e0 >= 0 && (!UN || ((e0 >> ush) & 1));
      const bool v1 = e1 >= 0 && (!UN || ((e1 >> ush) & 1));
      s[nt][0] = v0 ? s[nt][0] * scale_log2 : -INFINITY;
      s[nt][1] = v1 ? s[nt][1] * scale_log2 : -INFINITY;
      s[nt][2] = v0 ? s[nt][2] * scale_log2 : -INFINITY;
      s[nt][3] = v1 ? s[nt][3] * scale_log2 : -INFINITY;
    }
    mx0 = fmaxf(mx0, fmaxf(s[nt][0], s[nt][1]));
    mx1 = fmaxf(mx1, fmaxf(s[nt][2], s[nt][3]));
  }
  mx0 = quad_max(mx0);
  mx1 = quad_max(mx1);
  const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
  const float mu0 = mn0 == -INFINITY ? 0.f : mn0;
  const float mu1 = mn1 == -INFINITY ? 0.f : mn1;
  a0 = fast_exp2(m0 - mu0);
  a1 = fast_exp2(m1 - mu1);
  m0 = mn0;
  m1 = mn1;
  float rs0 = 0.f, rs1 = 0.f;
#pragma unroll
  for (int nt = 0; nt < BN / 8; ++nt) {
    s[nt][0] = fast_exp2(s[nt][0] - mu0);
    s[nt][1] = fast_exp2(s[nt][1] - mu0);
    s[nt][2] = fast_exp2(s[nt][2] - mu1);
    s[nt][3] = fast_exp2(s[nt][3] - mu1);
    rs0 += s[nt][0] + s[nt][1];
    rs1 += s[nt][2] + s[nt][3];
  }
  l0 = l0 * a0 + rs0;
  l1 = l1 * a1 + rs1;
}

template <int D>
__device__ __forceinline__ void rescale_out(float (&o)[D / 8][4], float a0, float a1) {
  /* after the first tiles a row's maximum rarely moves: skip the D / 2 multiplies when no row
   * of the warp needs them (a warp-uniform branch) */
  if (!__any_sync(0xffffffffu, a0 != 1.f || a1 != 1.f)) return;
#pragma unroll
  for (int i = 0; i < D / 8; ++i) {
    o[i][0] *= a0;
    o[i][1] *= a0;
    o[i][2] *= a1;
    o[i][3] *= a1;
  }
}

/* P of key columns 16 kk .. 16 kk + 15 as the m16n8k16 A fragment (T precision). */
template <typename T, int BN>
__device__ __forceinline__ void pack_p(uint32_t* pa, const float (&s)[BN / 8][4], int kk) {
  pa[0] = Elem<T>::pack(s[2 * kk][0], s[2 * kk][1]);
  pa[1] = Elem<T>::pack(s[2 * kk][2], s[2 * kk][3]);
  pa[2] = Elem<T>::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
  pa[3] = Elem<T>::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

/* Epilogue: out = O / l for the lane's two rows (rows past nrows are not written) and
 * lse = (m + log2 l) ln 2 (-inf for rows without keys). ush >= 0: the list is a merged
 * groups' union and ush the member bit of the warp's group. */
template <typename T, int D>
__device__ __forceinline__ void store_out_lse(const FwdParams<T>& p, const float (&o)[D / 8][4],
                                              float m0, float m1, float l0, float l1, int b, int h,
                                              int row0, int nrows, int warp, int lane,
                                              const int* list, int count, int ebound,
                                              int ush = -1) {
  l0 = quad_sum(l0);
  l1 = quad_sum(l1);
  const int lr0 = warp * 16 + (lane >> 2), lr1 = lr0 + 8;
  /* A NaN or +inf score makes l NaN (the running maximum ignores NaN, exp2(NaN) and
   * exp2(inf - inf) do not): out and lse are NaN then, as with softmax, and the backward turns
   * a NaN lse into NaN gradients. l == 0: either no valid key (an empty list: 0, lse -inf) or
   * every score -inf (the softmax is 0 / 0: NaN, as SDPA gives); a look at the list tells
   * them apart, only in the rare CTA that has such a row (every thread reaches this point);
   * an entry is valid below ebound (S for token lists, the number of key blocks for block
   * lists); in a union, the warp's group has a key when an entry has its member bit. */
  float zero_out = 0.f, zero_lse = -INFINITY;
  if (__syncthreads_or((l0 == 0.f && lr0 < nrows) || (l1 == 0.f && lr1 < nrows))) {
    bool any = false;
    if (ush < 0) {
      for (int j = threadIdx.x; j < count && !any; j += blockDim.x)
        any = (unsigned)__ldg(list + j) < (unsigned)ebound;
      any = __syncthreads_or(any);
    } else {
      int bits = 0; /* the member masks of the union's entries, OR-ed over the CTA */
      for (int j = threadIdx.x; j < count; j += blockDim.x) bits |= __ldg(list + j) >> UKEY_BITS;
      int all = 0;
      for (int m = 0; m < 8; ++m) all |= __syncthreads_or((bits >> m) & 1) << m;
      any = (all >> (ush - UKEY_BITS)) & 1;
    }
    if (any) zero_out = zero_lse = __int_as_float(0x7fc00000);
  }
  const float inv0 = l0 == 0.f ? zero_out : 1.f / l0;
  const float inv1 = l1 == 0.f ? zero_out : 1.f / l1;
  T* obase = p.out + b * p.ob + h * p.oh;
  if (lr0 < nrows) {
    T* orow = obase + (int64_t)(row0 + lr0) * p.os + (lane & 3) * 2;
#pragma unroll
    for (int i = 0; i < D / 8; ++i)
      *reinterpret_cast<uint32_t*>(orow + i * 8) = Elem<T>::pack(o[i][0] * inv0, o[i][1] * inv0);
  }
  if (lr1 < nrows) {
    T* orow = obase + (int64_t)(row0 + lr1) * p.os + (lane & 3) * 2;
#pragma unroll
    for (int i = 0; i < D / 8; ++i)
      *reinterpret_cast<uint32_t*>(orow + i * 8) = Elem<T>::pack(o[i][2] * inv1, o[i][3] * inv1);
  }
  if ((lane & 3) == 0) {
    float* lrow = p.lse + ((size_t)b * p.H + h) * p.S + row0;
    if (lr0 < nrows) lrow[lr0] = l0 == 0.f ? zero_lse : (m0 + log2f(l0)) * DSV_LN2;
    if (lr1 < nrows) lrow[lr1] = l1 == 0.f ? zero_lse : (m1 + log2f(l1)) * DSV_LN2;
  }
}

template <typename T, int D, int BM, int BN, int NS, int BLK = 1>
__global__ void __launch_bounds__(BM * 2) sparse_attn_fwd_kernel(const FwdParams<T> p) {
  constexpr int NT = BM * 2;
  constexpr int LD = D + 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* Qs = reinterpret_cast<T*>(smem_raw);
  T* Ks = Qs + BM * LD;        /* [NS][BN][LD] */
  T* Vs = Ks + NS * BN * LD;   /* [NS][BN][LD] */
  int* kidx = reinterpret_cast<int*>(Vs + NS * BN * LD); /* [NS][BN] */
  int* qidx = kidx + NS * BN;                            /* [BM] */

  FwdChunk<T> c;
  if (!fwd_chunk<T, BM>(p, c)) return;
  /* a merged 128-query block (the tuning's merge): sparse_attn_fwd_wg_kernel has its rows */
  if (BLK == 1 && p.ucnt) {
    const size_t bh = (size_t)c.b * p.H + c.h;
    if (__ldg(p.ucnt + bh * p.NSG + c.row0 / 128) >= 0 && !__ldg(p.knf + bh)) return;
  }
  fwd_chunk_list<T, NT>(p, c);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  fwd_load_q<T, D, NT, BM, false>(Qs, qidx, p, c);
  const int nkeys = c.count * BLK; /* the list's keys (block lists: BLK per entry) */
  const int ntiles = (nkeys + BN - 1) / BN;
  /* NS-stage cp.async pipeline: NS - 1 key tiles in flight while one is computed; group s of
   * the prologue holds tile s (group 0 also the Q tile); one group is committed per tile. The
   * list entries of the next tile to gather are loaded one tile ahead (KeyTileIdx). */
  KeyTileIdx<D, NT, BN, BLK> ix;
#pragma unroll
  for (int st = 0; st < NS - 1; ++st) {
    if (st < ntiles) {
      ix.load(c.list, st * BN, nkeys);
      gather_keys_pre<T, D, NT, BN>(Ks + st * BN * LD, Vs + st * BN * LD, c.kbase, p.ks, c.vbase,
                                    p.vs,
                                    ix, 0, p.S, kidx + st * BN);
    }
    cp_async_commit();
  }
  ix.load(c.list, (NS - 1) * BN, nkeys);

  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;

  for (int t = 0; t < ntiles; ++t) {
    const int buf = t % NS;
    cp_async_wait<NS - 2>(); /* tile t (and the Q tile) have landed for this thread */
    __syncthreads();         /* ... for all threads; and stage (t - 1) % NS is free again */
    {
      const int tn = t + NS - 1;
      if (tn < ntiles) {
        const int nb = tn % NS;
        gather_keys_pre<T, D, NT, BN>(Ks + nb * BN * LD, Vs + nb * BN * LD, c.kbase, p.ks, c.vbase,
                                      p.vs, ix, 0, p.S, kidx + nb * BN);
        ix.load(c.list, (tn + 1) * BN, nkeys);
      }
      cp_async_commit();
    }
    const T* Kt = Ks + buf * BN * LD;
    const T* Vt = Vs + buf * BN * LD;
    const int* ki = kidx + buf * BN;

    float s[BN / 8][4];
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t qa[4];
      load_a<LD>(qa, Qs, warp * 16, kk * 16, lane);
#pragma unroll
      for (int np = 0; np < BN / 16; ++np) {
        uint32_t kf[4];
        load_b<LD>(kf, Kt, np * 16, kk * 16, lane);
        mma16816<T>(s[2 * np], qa, kf);
        mma16816<T>(s[2 * np + 1], qa, kf + 2);
      }
    }
    float a0, a1;
    softmax_tile<BN>(s, ki, p.scale_log2, lane, m0, m1, l0, l1, a0, a1);
    rescale_out<D>(o, a0, a1);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t pa[4];
      pack_p<T, BN>(pa, s, kk);
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t vf[4];
        load_b_t<LD>(vf, Vt, kk * 16, dp * 16, lane);
        mma16816<T>(o[2 * dp], pa, vf);
        mma16816<T>(o[2 * dp + 1], pa, vf + 2);
      }
    }
    /* no barrier here: the next tile's top barrier already orders this tile's reads of stage
     * buf before that stage is refilled */
  }
  cp_async_wait<0>();

  store_out_lse<T, D>(p, o, m0, m1, l0, l1, c.b, c.h, c.row0, c.nrows, warp, lane, c.list, c.count,
                      BLK == 1 ? p.S : (p.S + BLK - 1) / BLK);
}

/* S = Q K^T for one key tile on wgmma: D / 16 steps of k16 over swizzled Q (64 rows) and K (BN
 * rows) tiles; step kk reads column block kk / 4 (rows x 128 bytes) at byte 32 (kk % 4). */
template <typename T, int D, int BN>
__device__ __forceinline__ void wg_scores(float (&s)[BN / 8][4], uint64_t qdesc, uint64_t kdesc) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const uint32_t qo = (kk >> 2) * (64 * 128) + (kk & 3) * 32;
    const uint32_t ko = (kk >> 2) * (BN * 128) + (kk & 3) * 32;
    Wgmma<T, BN>::ss(&s[0][0], wg_desc_add(qdesc, qo), wg_desc_add(kdesc, ko), kk > 0);
  }
}

/* O += P V for one key tile on wgmma: BN / 16 steps of k16 (16 keys), P from registers, V as
 * the transposed (MN-major) B operand; step kk starts at key row 16 kk = byte 2048 kk. D 256:
 * two m64n128 products per step, over the column blocks 0-1 and 2-3 of V (BN x 128 bytes
 * each) into the accumulator's columns 0-127 and 128-255. */
template <typename T, int D, int BN>
__device__ __forceinline__ void wg_pv(float (&o)[D / 8][4], const float (&s)[BN / 8][4],
                                      uint64_t vdesc) {
  constexpr int N = D < 128 ? D : 128; /* columns of one product */
  uint32_t pa[BN / 16][4];
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) pack_p<T, BN>(pa[kk], s, kk);
  wg_fence();
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
    for (int n = 0; n < D / N; ++n)
      Wgmma<T, N>::rs_bt(&o[n * N / 8][0], pa[kk],
                         wg_desc_add(vdesc, n * (N / 64) * (BN * 128) + kk * 2048), 1);
}

/* The same forward on Hopper warpgroup MMAs (wgmma, sm_90a): one warpgroup (4 warps, 128
 * threads) per chunk of 64 queries. The gathered Q, K and V tiles are stored 128-byte swizzled
 * (wgmma.cuh); S = Q K^T reads Q and K from shared memory, O += P V takes P from registers and V
 * from shared memory, so each gathered tile is read once per warpgroup instead of once per warp
 * as with ldmatrix + mma.sync. The online softmax and the epilogue are those of the kernel
 * above (the accumulator fragments have the same layout). cp.async writes the tiles, so each
 * thread fences them to the async proxy before the barrier that precedes the MMAs. Per tile:
 * gather-wait, S (the next tile's gather issued while S runs), softmax, P V, one after the
 * other; the other CTAs on the SM (4 with 32-key tiles) fill the gaps. (Computing the scores
 * of tile t + 1 during the softmax of tile t, with two score register sets and more stages,
 * measured slower: fewer CTAs fit; PERF_LOG v6.)
 * WG = 2 (groups of a multiple of 128 queries, the tuning's g128): 256 threads, 128 rows per
 * CTA, warpgroup w owning rows 64 w .. 64 w + 63 (its own Q tile) and both on one K / V
 * pipeline gathered by all 256 threads, so each key tile is copied once for 128 rows instead of
 * twice (PERF_LOG v15); 2 CTAs per SM. UN (WG = 2, merged groups of 16 or 32 queries, launched
 * with G = 128 over the 128-query blocks; PERF_LOG v27): the CTA of block u walks its union
 * (nothing where it was not merged), packed entries whose member bit of the warp's group masks
 * each row's scores (int masks instead of the bias). */
template <bool UN> struct FwdMask { using type = float; };
template <> struct FwdMask<true> { using type = int; };

template <typename T, int D, int BN, int NS, int MINB, int BLK = 1, int WG = 1, bool UN = false>
__global__ void __launch_bounds__(128 * WG, MINB) sparse_attn_fwd_wg_kernel(const FwdParams<T> p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(!UN || (WG == 2 && BLK == 1), "merged groups: 128 rows, token lists");
  using MaskT = typename FwdMask<UN>::type;
  constexpr int KM = UN ? UKEY_MASK : 0;
  constexpr int BM = 64 * WG, NT = 128 * WG;
  constexpr int QE = 64 * D, KE = BN * D; /* elements of a warpgroup's Q tile, of a K or V tile */
  extern __shared__ __align__(16) unsigned char smem_raw[];
  /* the swizzle pattern repeats every 1024 bytes: start the tiles on such a boundary */
  unsigned char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  T* Qs = reinterpret_cast<T*>(smem); /* [WG][64 x D] */
  T* Ks = Qs + WG * QE;  /* [NS][BN x D] */
  T* Vs = Ks + NS * KE;  /* [NS][BN x D] */
  MaskT* kbias = reinterpret_cast<MaskT*>(Vs + NS * KE); /* [NS][BN]: 0 or -inf per key (UN:
                                                            the entry or -1) */
  int* qidx = reinterpret_cast<int*>(kbias + NS * BN);   /* [BM] */

  FwdChunk<T> c;
  if (!fwd_chunk<T, BM>(p, c)) return; /* uniform per CTA */
  if constexpr (UN) {
    if (!fwd_chunk_union<T>(p, c)) return;
  } else {
    fwd_chunk_list<T, NT>(p, c);
  }
  const int tid = threadIdx.x, lane = tid & 31;
  const int warp = WG == 1 ? tid >> 5 : (tid >> 5) & 3; /* in the warpgroup */
  const int wg = WG == 1 ? 0 : tid >> 7;
  fwd_load_q<T, D, NT, BM, true>(Qs, qidx, p, c);
  const int nkeys = c.count * BLK; /* the list's keys (block lists: BLK per entry) */
  const int ntiles = (nkeys + BN - 1) / BN;
  /* NS-stage cp.async pipeline as in the kernel above: group s of the prologue holds tile s
   * (group 0 also the Q tile), one group is committed per tile, list entries one tile ahead */
  KeyGather<T, D, NT, BN, true, MaskT, false, BLK, KM> ix;
  ix.init(c.kbase, p.ks, c.vbase, p.vs);
  /* merged groups: the member bit of the warp's 16 rows (one group: ug >= 16) */
  const int ush = UN ? UKEY_BITS + (64 * wg + 16 * warp) / p.ug : -1;
  const uint32_t ks0 = smem_u32(Ks), vs0 = smem_u32(Vs); /* stage 0's K and V tiles */
#pragma unroll
  for (int st = 0; st < NS - 1; ++st) {
    if (st < ntiles) {
      ix.load(c.list, st * BN, nkeys);
      ix.issue(ks0 + st * KE * 2, vs0 + st * KE * 2, 0, p.S, kbias + st * BN);
    }
    cp_async_commit();
  }
  ix.load(c.list, (NS - 1) * BN, nkeys);

  float o[D / 8][4];
  float s[BN / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
#pragma unroll
  for (int i = 0; i < BN / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
  /* descriptors of the Q tile and of stage 0's K (K-major) and V (MN-major) tiles */
  const uint64_t qdesc = wg_desc(smem_u32(Qs + wg * QE), 16, 1024);
  const uint64_t kdesc0 = wg_desc(ks0, 16, 1024);
  const uint64_t vdesc0 = wg_desc(vs0, BN * 128, 1024);

  for (int t = 0; t < ntiles; ++t) {
    const int buf = t % NS;
    cp_async_wait<NS - 2>();
    fence_proxy_async_smem(); /* this thread's cp.async writes -> visible to the tensor cores */
    __syncthreads();          /* tile t landed; every warpgroup is done with the stage refilled
                                 below (each waited for its MMAs of tile t - 1) */
    wg_fence();
    wg_scores<T, D, BN>(s, qdesc, wg_desc_add(kdesc0, buf * KE * 2));
    wg_commit();
    {
      const int tn = t + NS - 1;
      if (tn < ntiles) {
        const int nb = tn % NS;
        ix.issue(ks0 + nb * KE * 2, vs0 + nb * KE * 2, 0, p.S, kbias + nb * BN);
        ix.load(c.list, (tn + 1) * BN, nkeys);
      }
      cp_async_commit();
    }
    wg_wait<0>();
    wg_fence_regs<BN / 2>(&s[0][0]);
    float a0, a1;
    softmax_tile<BN, MaskT, UN>(s, kbias + buf * BN, p.scale_log2, lane, m0, m1, l0, l1, a0, a1,
                                ush);
    rescale_out<D>(o, a0, a1);
    wg_pv<T, D, BN>(o, s, wg_desc_add(vdesc0, buf * KE * 2));
    wg_commit();
    wg_wait<0>(); /* before the next barrier, after which stage buf may be refilled */
    wg_fence_regs<D / 2>(&o[0][0]);
  }
  cp_async_wait<0>();
  /* every thread of the CTA reaches the epilogue (its barriers are CTA-wide); a warpgroup past
   * the group's end has nrows <= 0 and writes nothing */
  store_out_lse<T, D>(p, o, m0, m1, l0, l1, c.b, c.h, c.row0 + 64 * wg, c.nrows - 64 * wg, warp,
                      lane, c.list, c.count, BLK == 1 ? p.S : (p.S + BLK - 1) / BLK, ush);
#endif
}

template <typename T, int D, int BM, int BN, int NS, int BLK = 1>
static int launch_fwd(const dsv_attn_shape* sh, const FwdParams<T>& prm, cudaStream_t stream) {
  constexpr int LD = D + 8;
  const size_t smem =
      (size_t)(BM + 2 * NS * BN) * LD * sizeof(T) + (NS * BN + BM) * sizeof(int);
  auto kern = sparse_attn_fwd_kernel<T, D, BM, BN, NS, BLK>;
  if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) !=
      cudaSuccess)
    return DSV_ERR_CUDA;
  dim3 grid((unsigned)(prm.NG * prm.chunks), (unsigned)sh->heads, (unsigned)sh->batch);
  kern<<<grid, BM * 2, smem, stream>>>(prm);
  return cudaGetLastError() == cudaSuccess ? DSV_OK : DSV_ERR_CUDA;
}

template <typename T, int D, int BN, int NS, int MINB = 1, int BLK = 1, int WG = 1, bool UN = false>
static int launch_fwd_wg(const dsv_attn_shape* sh, const FwdParams<T>& prm, cudaStream_t stream) {
  const size_t smem =
      1024 + (size_t)(64 * WG + 2 * NS * BN) * D * sizeof(T) + NS * BN * sizeof(float) +
      64 * WG * sizeof(int);
  auto kern = sparse_attn_fwd_wg_kernel<T, D, BN, NS, MINB, BLK, WG, UN>;
  if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) !=
      cudaSuccess)
    return DSV_ERR_CUDA;
  dim3 grid((unsigned)(prm.NG * prm.chunks), (unsigned)sh->heads, (unsigned)sh->batch);
  kern<<<grid, 128 * WG, smem, stream>>>(prm);
  return cudaGetLastError() == cudaSuccess ? DSV_OK : DSV_ERR_CUDA;
}

/* Merged groups (merged_groups.cuh): the union of each 128-query block's lists
 * (union_build_kernel: V checked head-wide for non-finite elements), then the merged blocks on
 * the 128-row wgmma kernel with 32-key tiles over their unions. */
template <typename T, int D>
static int fwd_union_passes(const dsv_attn_shape* sh, FwdParams<T>& prm, cudaStream_t stream) {
  if (cudaMemsetAsync(prm.knf, 0, (size_t)sh->batch * prm.H * sizeof(int), stream) != cudaSuccess)
    return DSV_ERR_CUDA;
  UnionBuild ub = union_build_of(prm, D);
  ub.hc = prm.v, ub.hcb = prm.vb, ub.hcs = prm.vs, ub.hch = prm.vh;
  const int st = union_build_launch<T>(ub, (int)sh->batch, stream);
  if (st != DSV_OK) return st;
  return launch_fwd_wg<T, D, 32, 2, 2, 1, 2, true>(sh, union_launch_params(prm), stream);
}

/* The shipped key tiles: wgmma with 32 keys x 2 stages and 4 CTAs per SM (registers capped at
 * 128) where it applies (the tuning's wgmma: an sm_90a build on a 9.0 device; D 64 or 128,
 * G >= 64, K / V row strides below 4 GB; token lists in groups of a multiple of 128 queries
 * with the tuning's g128: two warpgroups per CTA, 2 CTAs per SM), else mma.sync with 32 keys x
 * 2 stages, BM = 32, 64 or 128 queries per CTA by the group size. The other tiles are in csrc/dev/attn_fwd_tiles.cu.
 * Block lists (BLK = kv_block 16 or 64) run the same kernels and tiles: a 32-key tile is two
 * 16-key blocks or half of a 64-key block, copied as contiguous rows (list_key). */
template <typename T, int D, int BLK = 1>
static int fwd_dispatch_bm(const dsv_attn_shape* sh, FwdParams<T>& prm, int wgmma,
                           cudaStream_t stream) {
  const int G = prm.G;
  if constexpr ((D == 64 || D == 128) && BLK == 1) {
    /* merged groups (prm.uidx set by fwd_entry): the unions, the merged blocks on the 128-row
     * kernel, then the other groups below (their CTAs skip the merged blocks) */
    if (prm.uidx && wgmma) {
      const int st = fwd_union_passes<T, D>(sh, prm, stream);
      if (st != DSV_OK) return st;
    } else {
      prm.ucnt = nullptr;
    }
  } else {
    prm.ucnt = nullptr;
  }
  if constexpr (D == 64 || D == 128) {
    const int64_t lim = (int64_t)UINT32_MAX / (int64_t)sizeof(T); /* KeyGather's 32-bit strides */
    if (wgmma && G >= 64 && prm.ks <= lim && prm.vs <= lim) {
      if constexpr (BLK == 1) {
        if (prm.g128 && G % 128 == 0) {
          prm.chunks = G / 128;
          return launch_fwd_wg<T, D, 32, 2, 2, 1, 2>(sh, prm, stream);
        }
      }
      prm.chunks = (G + 63) / 64;
      return launch_fwd_wg<T, D, 32, 2, 4, BLK>(sh, prm, stream);
    }
  }
  if constexpr (D == 256 && BLK == 1) {
    /* the tuning's wg256: 64 rows per CTA on wgmma, 2 CTAs per SM (98 KB of shared memory
     * each); its gathers copy two 16-byte chunks per thread and row (KeyGatherWide) */
    const int64_t lim = (int64_t)UINT32_MAX / (int64_t)sizeof(T);
    if (wgmma && prm.wg256 && G >= 64 && prm.ks <= lim && prm.vs <= lim) {
      prm.chunks = (G + 63) / 64;
      return launch_fwd_wg<T, D, 32, 2, 2>(sh, prm, stream);
    }
  }
  if (G <= 32) {
    prm.chunks = 1;
    return launch_fwd<T, D, 32, 32, 2, BLK>(sh, prm, stream);
  }
  if constexpr (D <= 128) {
    if (G % 128 == 0) {
      prm.chunks = G / 128;
      return launch_fwd<T, D, 128, 32, 2, BLK>(sh, prm, stream);
    }
  }
  prm.chunks = (G + 63) / 64;
  return launch_fwd<T, D, 64, 32, 2, BLK>(sh, prm, stream);
}

template <typename T, int BLK>
static int fwd_dispatch_d(const dsv_attn_shape* sh, FwdParams<T>& prm, int wgmma,
                          cudaStream_t stream) {
  switch (sh->head_dim) {
    case 64: return fwd_dispatch_bm<T, 64, BLK>(sh, prm, wgmma, stream);
    case 96: return fwd_dispatch_bm<T, 96, BLK>(sh, prm, wgmma, stream);
    case 128: return fwd_dispatch_bm<T, 128, BLK>(sh, prm, wgmma, stream);
    case 256: return fwd_dispatch_bm<T, 256, BLK>(sh, prm, wgmma, stream);
    default: return DSV_ERR_UNSUPPORTED;
  }
}

/* kv_block 1: token lists; 16 and 64: block lists (check_attn_args refused the others) */
template <typename T>
static int fwd_dispatch(const dsv_attn_shape* sh, FwdParams<T>& prm, int wgmma,
                        cudaStream_t stream) {
  switch (sh->kv_block) {
    case 1: return fwd_dispatch_d<T, 1>(sh, prm, wgmma, stream);
    case 16: return fwd_dispatch_d<T, 16>(sh, prm, wgmma, stream);
    case 64: return fwd_dispatch_d<T, 64>(sh, prm, wgmma, stream);
    default: return DSV_ERR_UNSUPPORTED;
  }
}

template <typename T>
static FwdParams<T> fwd_params(const dsv_attn_shape* sh, dsv_bshd q, dsv_bshd k, dsv_bshd v,
                               const int32_t* kv_index, const int32_t* kv_count, dsv_bshd out,
                               void* lse) {
  FwdParams<T> prm;
  prm.q = (const T*)q.data;
  prm.k = (const T*)k.data;
  prm.v = (const T*)v.data;
  prm.out = (T*)out.data;
  prm.lse = (float*)lse;
  prm.qb = q.stride_b; prm.qs = q.stride_s; prm.qh = q.stride_h;
  prm.kb = k.stride_b; prm.ks = k.stride_s; prm.kh = k.stride_h;
  prm.vb = v.stride_b; prm.vs = v.stride_s; prm.vh = v.stride_h;
  prm.ob = out.stride_b; prm.os = out.stride_s; prm.oh = out.stride_h;
  prm.kv_index = kv_index;
  prm.kv_count = kv_count;
  prm.S = (int)sh->seqlen;
  prm.H = (int)sh->heads;
  /* a group longer than the sequence is one group of S queries (num_groups 1, the same
   * result): clamped, so that grids and the key-major pass's query chunks per entry
   * (G / 64) follow S, not a huge G of the C API */
  prm.G = (int)(sh->group_size < sh->seqlen ? sh->group_size : sh->seqlen);
  prm.NG = (int)sh->num_groups;
  prm.kmax = (int)sh->kmax;
  prm.chunks = 1;
  prm.g128 = prm.wg256 = 0; /* fwd_entry: the tuning's */
  prm.uidx = prm.ucnt = prm.knf = nullptr; /* fwd_entry: where merging runs */
  prm.NSG = prm.ucap = 0;
  prm.ug = prm.G;
  prm.merge = 0.f;
  prm.scale_log2 = (float)(sh->scale * 1.4426950408889634);
  return prm;
}

/* The argument checks and the run; `tile` picks a variant of csrc/dev/ (nullptr: the shipped
 * dispatch). */
template <typename T>
using FwdDispatchFn = int (*)(const dsv_attn_shape*, FwdParams<T>&, int, const char*, cudaStream_t);

template <typename T>
static int fwd_shipped(const dsv_attn_shape* sh, FwdParams<T>& prm, int wgmma, const char* tile,
                       cudaStream_t stream) {
  (void)tile;
  return fwd_dispatch<T>(sh, prm, wgmma, stream);
}

/* Shared argument checks of forward and backward. Returns DSV_OK or an error. */
int check_attn_args(const dsv_attn_shape* p) {
  if (!p) return DSV_ERR_INVALID;
  if (p->batch < 0 || p->seqlen < 0 || p->heads < 0 || p->head_dim <= 0 || p->group_size <= 0 ||
      p->kmax < 0)
    return DSV_ERR_INVALID;
  if (p->num_groups != (p->seqlen == 0 ? 0 : (p->seqlen - 1) / p->group_size + 1))
    return DSV_ERR_INVALID;
  if (p->dtype != DSV_BFLOAT16 && p->dtype != DSV_FLOAT16) return DSV_ERR_UNSUPPORTED;
  if (p->head_dim != 64 && p->head_dim != 96 && p->head_dim != 128 && p->head_dim != 256)
    return DSV_ERR_UNSUPPORTED;
  if (p->seqlen > (int64_t)INT32_MAX / 2 || p->kmax > (int64_t)INT32_MAX / 2 ||
      p->heads > 65535 || p->batch > 65535 ||
      p->num_groups * ((p->group_size + 31) / 32) > (int64_t)INT32_MAX)
    return DSV_ERR_UNSUPPORTED;
  if (p->group_size > (int64_t)INT32_MAX / 2) return DSV_ERR_UNSUPPORTED;
  /* keys per list entry: 1 (token lists) or the block sizes compiled here; a list's keys
   * (kmax x kv_block) are counted in int */
  if (p->kv_block < 1) return DSV_ERR_INVALID;
  if (p->kv_block != 1 && p->kv_block != 16 && p->kv_block != 64) return DSV_ERR_UNSUPPORTED;
  if (p->kmax * p->kv_block > (int64_t)INT32_MAX / 2) return DSV_ERR_UNSUPPORTED;
  return DSV_OK;
}

}  // namespace dsv_attn

using namespace dsv_attn;

namespace dsv_attn {

/* Merged groups in the forward (the tuning's merge; merged_groups.cuh): the capacity of a
 * 128-query block's union where they may run, else 0. Token lists, groups of 16 or 32 queries,
 * the 128-row wgmma kernel (wgmma and g128 on, D 64 / 128, K / V row strides below 4 GB), and
 * union_capacity's sizes. */
static int64_t fwd_union_capacity(const dsv_attn_shape* p, const dsv_tuning* t, dsv_bshd k,
                                  dsv_bshd v) {
  const int64_t G = p->group_size < p->seqlen ? p->group_size : p->seqlen;
  const int64_t lim = (int64_t)UINT32_MAX / 2; /* KeyGather's 32-bit strides (16-bit elements) */
  if (!t->wgmma || !t->g128 || p->kv_block != 1 || (p->head_dim != 64 && p->head_dim != 128) ||
      G > 32 || k.stride_s > lim || v.stride_s > lim)
    return 0;
  return union_capacity(t->merge, p->seqlen, G, p->kmax);
}

static UnionLayout fwd_union_layout(const dsv_attn_shape* p, int64_t ucap) {
  return union_layout(p->batch * p->heads, (p->seqlen + 127) / 128, ucap);
}

}  // namespace dsv_attn

/* The forward's workspace: the merged groups' unions where they may run (the K / V strides are
 * not known here: the contiguous layout's, H D elements, are assumed; a call whose strides
 * rule merging out leaves the workspace unused), else 0. */
extern "C" size_t dsv_sparse_attention_fwd_workspace_cuda(const dsv_attn_shape* p) {
  if (check_attn_args(p) != DSV_OK) return 0;
  const dsv_tuning* tun = nullptr;
  if (dsv_tuning_current(&tun) != DSV_OK) return 0; /* the forward reports the error */
  dsv_bshd kv;
  kv.data = nullptr;
  kv.stride_b = kv.stride_s = kv.stride_h = 0;
  return fwd_union_layout(p, fwd_union_capacity(p, tun, kv, kv)).total;
}

namespace dsv_attn {

/* The merged groups' part of the forward's parameters: set where they may run and the
 * workspace holds them (a smaller or no workspace runs every group separately). */
template <typename T>
static void fwd_union_params(FwdParams<T>& prm, const dsv_attn_shape* p, const dsv_tuning* t,
                             dsv_bshd k, dsv_bshd v, void* workspace, size_t workspace_bytes) {
  const int64_t ucap = fwd_union_capacity(p, t, k, v);
  const UnionLayout L = fwd_union_layout(p, ucap);
  if (ucap <= 0 || !workspace || workspace_bytes < L.total) return;
  char* ws = (char*)workspace;
  prm.uidx = (int*)(ws + L.uidx);
  prm.ucnt = (int*)(ws + L.ucnt);
  prm.knf = (int*)(ws + L.knf);
  prm.NSG = (int)((p->seqlen + 127) / 128);
  prm.ucap = (int)ucap;
  prm.merge = t->merge;
}

static int fwd_entry(FwdDispatchFn<__half> f16, FwdDispatchFn<__nv_bfloat16> bf16,
                     const char* tile, const dsv_attn_shape* p, dsv_bshd q, dsv_bshd k,
                     dsv_bshd v, const int32_t* kv_index, const int32_t* kv_count, dsv_bshd out,
                     void* lse, void* workspace, size_t workspace_bytes, void* stream) {
  int st = check_attn_args(p);
  if (st != DSV_OK) return st;
  if (p->batch == 0 || p->seqlen == 0 || p->heads == 0) return DSV_OK;
  if (!check_bshd_aligned(q) || !check_bshd_aligned(k) || !check_bshd_aligned(v) ||
      !check_bshd_aligned(out))
    return DSV_ERR_UNSUPPORTED;
  if (!kv_count || !lse || (p->kmax > 0 && !kv_index)) return DSV_ERR_INVALID;
  const dsv_tuning* tun = nullptr;
  if ((st = dsv_tuning_current(&tun)) != DSV_OK) return st;
  cudaStream_t s = (cudaStream_t)stream;
  if (p->dtype == DSV_BFLOAT16) {
    FwdParams<__nv_bfloat16> prm =
        fwd_params<__nv_bfloat16>(p, q, k, v, kv_index, kv_count, out, lse);
    prm.g128 = tun->g128;
    prm.wg256 = tun->wg256;
    if (!tile) fwd_union_params(prm, p, tun, k, v, workspace, workspace_bytes);
    return bf16(p, prm, tun->wgmma, tile, s);
  }
  FwdParams<__half> prm = fwd_params<__half>(p, q, k, v, kv_index, kv_count, out, lse);
  prm.g128 = tun->g128;
  prm.wg256 = tun->wg256;
  if (!tile) fwd_union_params(prm, p, tun, k, v, workspace, workspace_bytes);
  return f16(p, prm, tun->wgmma, tile, s);
}

}  // namespace dsv_attn

extern "C" int dsv_sparse_attention_fwd_cuda(const dsv_attn_shape* p, dsv_bshd q, dsv_bshd k,
                                             dsv_bshd v, const int32_t* kv_index,
                                             const int32_t* kv_count, dsv_bshd out, void* lse,
                                             void* workspace, size_t workspace_bytes,
                                             void* stream) {
  return fwd_entry(fwd_shipped<__half>, fwd_shipped<__nv_bfloat16>, nullptr, p, q, k, v,
                   kv_index, kv_count, out, lse, workspace, workspace_bytes, stream);
}
