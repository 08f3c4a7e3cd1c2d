/*
 * sparse_attention_bwd_wg.cuh - the query-major backward of sparse grouped attention on Hopper
 * warpgroup MMAs (wgmma, sm_90a). Included by sparse_attention_bwd_qmajor.cu (the kernel is
 * templated on its BwdParams), which launches it (bwd_wg_launch_one) for the dQ-only pass of the
 * key-major heads where it applies (the tuning's wgmma: an sm_90a build on a compute capability
 * 9.0 device; bwd_wg_applies: D = 64 or 128, G >= 64, row strides of k and v below 4 GB). The
 * pass with dK / dV reductions (ATOMIC) is the same kernel; it ships on mma.sync (csrc/dev/
 * attn_bwd_variants.cu launches it on wgmma, with NORED a measurement without the reductions).
 *
 * One warpgroup (4 warps, 128 threads) per chunk of 64 queries of a group, the forward's recipe
 * (sparse_attn_fwd_wg_kernel): Q and dO tiles and the gathered K / V tiles (64 keys, 2 cp.async
 * stages, KeyGather's fixed per-thread plan; at D = 128 the next tile's gather is issued while S
 * and dP run) stored 128-byte swizzled (wgmma.cuh). Per key tile:
 *   S = Q K^T, dP = dO V^T     m64n64k16 x D / 16 each, both operands K-major in shared memory
 *   P = exp2(S scale log2e - lse log2e), dS = P (dP - delta)    in registers, as mma.sync does
 *   dQ += dS K                 m64nDk16 x 4, dS from registers, K the transposed (MN-major) B
 * and with reductions (ATOMIC, the heads of the query-major dK / dV path):
 *   P -> shared memory ([query][key], swizzled, 8 KB), dV_t = P^T dO (m64nDk16 x 4, A = P read
 *   key-major: the transposed-A flag, B = dO MN-major); then dS -> the same 8 KB,
 *   dK_t = dS^T Q the same way, issued before dV_t's reductions so that they overlap it;
 *   dV_t, dK_t (64 keys x D, fp32 in registers) go to the fp32 accumulators with 16-byte
 *   red.global.add.v4.f32 (pairs of lanes swap halves).
 * P and dS are rounded to the input type for the products, as in the mma.sync kernels. A NaN
 * score gives NaN P and dS, which reach dq, dk and dv (no guards). Key ranges (nranges > 1) are
 * handled as in bwd_qmajor_kernel (binary search of the sorted list, dQ reduced in fp32).
 * Shared memory (D = 128): Q, dO 2 x 16 KB, K / V 2 stages x 2 x 16 KB, P / dS 8 KB, ~106 KB:
 * 2 CTAs per SM (8 warps, as the mma.sync kernel), 243 registers (dq, dV_t, dK_t 64 each).
 *
 * bwd_wg128_kernel (below, launched by qmajor_passes for groups of a multiple of 128 queries
 * with the tuning's g128): the pass with reductions for 128 rows per CTA on two warpgroups that
 * share the key tiles, forming dV_t and dK_t over all 128 rows (one each) and reducing every key
 * once per 128 rows (PERF_LOG kernels v15), the warpgroups out of step (v25), at D = 128 its
 * reductions through a shared-memory slab per warp as whole 128-byte lines (v30).
 */
#ifndef DSV_SPARSE_ATTENTION_BWD_WG_CUH
#define DSV_SPARSE_ATTENTION_BWD_WG_CUH

#include "attention_common.cuh"
#include "wgmma.cuh"

namespace dsv_attn {

/* d (m64 x N, fp32) = A B (+ d if acc), A and B both from shared memory and both MN-major
 * (transposed): A (64 x 16) stored [k][m] (64 m elements = one 128-byte row of a swizzled tile),
 * B (16 x N) stored [k][n] (as V in the forward's P V). Descriptors as wgmma.cuh's MN-major
 * operand: LBO = rows x 128 (the next 64 elements of M or N), SBO = 1024; step k16 = 2048 bytes. */
template <typename T, int N>
struct WgmmaTT {
  static __device__ __forceinline__ void ss(float* d, uint64_t a, uint64_t b, int acc);
};
#define DSV_WGMMA_SS_TT(T, TY, N, R, DL, PA, PB, PC)                                          \
  template <>                                                                                 \
  __device__ __forceinline__ void WgmmaTT<T, N>::ss(float* d, uint64_t a, uint64_t b,         \
                                                    int acc) {                                \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " PC ", 0;\n"                              \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " {" R "}, " PA  \
                 ", " PB ", p, 1, 1, 1, 1;\n}\n"                                                \
                 : DL                                                                         \
                 : "l"(a), "l"(b), "r"(acc));                                                 \
  }
DSV_WGMMA_SS_TT(__nv_bfloat16, "bf16", 64, DSV_WG_R32, DSV_WG_D32, "%32", "%33", "%34")
DSV_WGMMA_SS_TT(__nv_bfloat16, "bf16", 128, DSV_WG_R64, DSV_WG_D64, "%64", "%65", "%66")
DSV_WGMMA_SS_TT(__half, "f16", 64, DSV_WG_R32, DSV_WG_D32, "%32", "%33", "%34")
DSV_WGMMA_SS_TT(__half, "f16", 128, DSV_WG_R64, DSV_WG_D64, "%64", "%65", "%66")

/* acc (64 x BN scores) = A B^T over D: A, B K-major swizzled tiles of 64 and BN rows. */
template <typename T, int D, int BN>
__device__ __forceinline__ void bwg_scores(float (&s)[BN / 8][4], uint64_t adesc, uint64_t bdesc) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const uint32_t ao = (kk >> 2) * (64 * 128) + (kk & 3) * 32;
    const uint32_t bo = (kk >> 2) * (BN * 128) + (kk & 3) * 32;
    Wgmma<T, BN>::ss(&s[0][0], wg_desc_add(adesc, ao), wg_desc_add(bdesc, bo), kk > 0);
  }
}

/* Writes a 64 x BN tile held as m16n8k16 A fragments (f[kk] = columns 16 kk .. 16 kk + 15 of
 * the warp's rows lr0 and lr0 + 8) into a swizzled [64][BN] tile in shared memory
 * (conflict-free: the 8 rows of a store fall on 8 distinct 16-byte chunk positions). */
template <typename T, int BN>
__device__ __forceinline__ void bwg_store_frag(T* tile, const uint32_t (&f)[BN / 16][4], int lr0,
                                               int lane) {
  const int e = (lane & 3) * 2;
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int c = 2 * kk + h;
      *reinterpret_cast<uint32_t*>(tile + tile_off<BN, 64, true>(lr0, c) + e) = f[kk][2 * h];
      *reinterpret_cast<uint32_t*>(tile + tile_off<BN, 64, true>(lr0 + 8, c) + e) =
          f[kk][2 * h + 1];
    }
}

/* The key of the accumulator row that the lane reduces (bwg_reduce_part): warp w holds key rows
 * 16 w + lane / 4 and + 8 of a 64-key tile, lanes of even lane & 3 reduce the first. KM > 0:
 * packed entries (merged groups), the key is entry & KM. */
template <int KM = 0>
__device__ __forceinline__ int bwg_reduce_key(const int* ki, int warp, int lane) {
  const int e = ki[warp * 16 + (lane >> 2) + ((lane & 1) == 0 ? 0 : 8)];
  return KM && e >= 0 ? e & KM : e;
}

/* Adds columns 8 J0 .. 8 J1 - 1 of a 64-key x D fp32 tile (wgmma accumulator) into
 * acc[key][D] with 16-byte reductions, pairs of lanes swapping halves; kid: the lane's row's key
 * (bwg_reduce_key), nothing when it is < 0. */
template <int D, int J0, int J1>
__device__ __forceinline__ void bwg_reduce_part(float* acc, const float (&a)[D / 8][4], int kid,
                                                int lane) {
  const int tq = lane & 3;
  const bool even = (tq & 1) == 0;
  float* row = acc + (size_t)(kid < 0 ? 0 : kid) * D + (tq >> 1) * 4;
#pragma unroll
  for (int j = J0; j < J1; ++j) {
    const float x0 = __shfl_xor_sync(0xffffffffu, even ? a[j][2] : a[j][0], 1);
    const float x1 = __shfl_xor_sync(0xffffffffu, even ? a[j][3] : a[j][1], 1);
    const float4 v = even ? make_float4(a[j][0], a[j][1], x0, x1)
                          : make_float4(x0, x1, a[j][2], a[j][3]);
    if (kid >= 0) atomicAdd(reinterpret_cast<float4*>(row + j * 8), v);
  }
}

/* The whole 64-key x D tile (bwg_reduce_part over all columns); rows whose key entry in ki is
 * < 0 are skipped. */
template <int D>
__device__ __forceinline__ void bwg_reduce_rows(float* acc, const float (&a)[D / 8][4],
                                                const int* ki, int warp, int lane) {
  bwg_reduce_part<D, 0, D / 8>(acc, a, bwg_reduce_key(ki, warp, lane), lane);
}

/* Line reductions (bwd_wg128_kernel and bwd_wg_kernel, PERF_LOG v30, v34): a 64-key x D tile
 * added into acc[key][D] through a 16-row x 32-column fp32 slab of shared memory per warp
 * (slab: 2 KB, its 16-byte chunks XOR-swizzled by 2 row mod 8: a 64-bit store is served half a
 * warp at a time, and the half-warp's fragment (rows g..g + 3, two chunks each) then covers all
 * 8 chunks, so both the fragment stores and the row loads are conflict-free; PERF_LOG v31), so
 * that every red.global.add.v4.f32 covers 4 rows x 128 contiguous bytes: four whole L2 lines
 * (4-sector requests) instead of 16 rows x one 32-byte sector each (16 requests);
 * csrc/dev/atomic_microbench.cu measures both patterns (lines against frag). kid[i]: the key of
 * the warp's row 4 i + lane / 8 (bwg_tile_keys), nothing where it is < 0. */
template <int D>
__device__ __forceinline__ void bwg_reduce_lines(float* acc, const float (&a)[D / 8][4],
                                                 const int (&kid)[4], float* slab, int lane) {
  const int g = lane >> 2, c0 = (lane & 3) >> 1, w = (lane & 1) * 2; /* fragment rows g, g + 8 */
  const int sw = (2 * g) & 7; /* rows g and g + 8: chunk swizzle 2 row mod 8 */
  const int rr = lane >> 3, ch = lane & 7;                             /* row loads */
#pragma unroll
  for (int m = 0; m < D / 32; ++m) {
    __syncwarp(); /* the previous slab's loads done */
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      const int c = ((2 * jj + c0) ^ sw) * 4 + w; /* columns 8 jj + 2 (lane & 3) + {0, 1} */
      *reinterpret_cast<float2*>(slab + g * 32 + c) = make_float2(a[4 * m + jj][0], a[4 * m + jj][1]);
      *reinterpret_cast<float2*>(slab + (g + 8) * 32 + c) =
          make_float2(a[4 * m + jj][2], a[4 * m + jj][3]);
    }
    __syncwarp();
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = 4 * i + rr;
      const float4 v = *reinterpret_cast<const float4*>(slab + r * 32 + ((ch ^ ((2 * r) & 7)) * 4));
      if (kid[i] >= 0)
        atomicAdd(reinterpret_cast<float4*>(acc + (size_t)kid[i] * D + 32 * m + 4 * ch), v);
    }
  }
}

/* The warp's part of a 64-key x D tile into acc by line reductions (D 64 and 128: measured
 * against pairs of lanes, PERF_LOG v30 and v33), or with NORED (a measurement of their cost)
 * nothing but what keeps the products that feed them. kid: bwg_tile_keys. */
template <int D, bool NORED>
__device__ __forceinline__ void bwg_reduce_out(float* acc, const float (&a)[D / 8][4],
                                               const int (&kid)[4], float* slab, int lane,
                                               float (&dq)[D / 8][4]) {
  if constexpr (NORED) {
    if (a[0][0] == 1.2345e-30f) dq[0][0] += 1.f;
  } else {
    bwg_reduce_lines<D>(acc, a, kid, slab, lane);
  }
}

/* The keys of the warp's rows 4 i + lane / 8 of the next tile (bwg_reduce_lines); KM as
 * bwg_reduce_key. */
template <int KM>
__device__ __forceinline__ void bwg_tile_keys(int (&kid)[4], const int* ki, int warp, int lane) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int e = ki[warp * 16 + 4 * i + (lane >> 3)];
    kid[i] = KM && e >= 0 ? e & KM : e;
  }
}

/* S and dP of the warpgroup's rows over the tile just computed, waited for (their registers
 * fenced) */
template <int BN>
__device__ __forceinline__ void bwg_scores_wait(float (&s)[BN / 8][4], float (&dp)[BN / 8][4]) {
  wg_wait<0>();
  wg_fence_regs<BN / 2>(&s[0][0]);
  wg_fence_regs<BN / 2>(&dp[0][0]);
}

/* The top of key tile t of a query-major wgmma pass: waits for tile t (its own cp.async groups,
 * fenced to the async proxy, then a CTA barrier: tile t landed for all threads and every
 * warpgroup's MMAs of tile t - 1 are done), refills the stage freed by tile t - 1 with tile
 * t + NS - 1 and loads the list entries of the tile after it (one group committed per tile),
 * then S = Q K^T and dP = dO V^T of the warpgroup's rows over tile t, waited for. */
template <typename T, int D, int BN, int NS, typename IX>
__device__ __forceinline__ void bwg_tile_scores(IX& ix, const int* list, int j0, int j1, int klo,
                                                int khi, int t, int ntiles, uint32_t ks0,
                                                uint32_t vs0, int* kidx, uint64_t qdesc,
                                                uint64_t dodesc, uint64_t kdesc0, uint64_t vdesc0,
                                                float (&s)[BN / 8][4], float (&dp)[BN / 8][4]) {
  constexpr uint32_t KB = BN * D * 2; /* bytes of a K or V tile */
  /* tile t + NS - 1 into the stage of tile t - 1 (its products finished before this tile's
   * barrier); at D = 128 issued after S and dP, so that its address work runs under them (at
   * D = 64 before them: there the registers it holds during the products would cost a CTA per
   * SM) */
  constexpr bool LATE = D == 128;
  auto next_tile = [&]() {
    const int tn = t + NS - 1;
    if (tn < ntiles) {
      const int nb = tn % NS;
      ix.issue(ks0 + nb * KB, vs0 + nb * KB, klo, khi, kidx + nb * BN);
      ix.load(list, j0 + (tn + 1) * BN, j1);
    }
    cp_async_commit();
  };
  cp_async_wait<NS - 2>();
  fence_proxy_async_smem(); /* this thread's cp.async writes -> visible to the tensor cores */
  __syncthreads();
  if constexpr (!LATE) next_tile();
  const uint32_t toff = (t % NS) * KB;
  wg_fence();
  bwg_scores<T, D, BN>(s, qdesc, wg_desc_add(kdesc0, toff));
  bwg_scores<T, D, BN>(dp, dodesc, wg_desc_add(vdesc0, toff));
  wg_commit();
  if constexpr (LATE) next_tile();
  bwg_scores_wait<BN>(s, dp);
}

/* P = exp(scale s - lse) and dS = P (dP - delta) (without the scale factor) of one 64 x BN
 * tile, packed as the A fragments of the next MMAs (pa, da), for the lane's rows lr0 and lr1;
 * keys whose entry ki is < 0 give 0, and with UN (merged groups: packed entries) those whose
 * member bit ush is clear (dS by a select too). ROWV: rows past the group's end (rv0 / rv1
 * false) give P = dS = 0 by selects, so that a non-finite K or V row cannot reach dK / dV
 * through them (their Q and dO rows are zero: 0 x inf). */
template <typename T, int BN, bool ROWV, bool UN = false>
__device__ __forceinline__ void bwg_p_ds(const float (&s)[BN / 8][4], const float (&dp)[BN / 8][4],
                                         const int* ki, float scale_log2, float ls0, float ls1,
                                         float dl0, float dl1, bool rv0, bool rv1, int lane,
                                         uint32_t (&pa)[BN / 16][4], uint32_t (&da)[BN / 16][4],
                                         int ush = 0) {
#pragma unroll
  for (int nt = 0; nt < BN / 8; ++nt) {
    const int col = nt * 8 + (lane & 3) * 2;
    const int e0 = ki[col], e1 = ki[col + 1];
    const bool v0 = e0 >= 0 && (!UN || ((e0 >> ush) & 1));
    const bool v1 = e1 >= 0 && (!UN || ((e1 >> ush) & 1));
    const bool r0 = !ROWV || rv0, r1 = !ROWV || rv1;
    const float p0 = v0 && r0 ? fast_exp2(s[nt][0] * scale_log2 - ls0) : 0.f;
    const float p1 = v1 && r0 ? fast_exp2(s[nt][1] * scale_log2 - ls0) : 0.f;
    const float p2 = v0 && r1 ? fast_exp2(s[nt][2] * scale_log2 - ls1) : 0.f;
    const float p3 = v1 && r1 ? fast_exp2(s[nt][3] * scale_log2 - ls1) : 0.f;
    const int kk = nt >> 1, hf = (nt & 1) * 2;
    pa[kk][hf] = Elem<T>::pack(p0, p1);
    pa[kk][hf + 1] = Elem<T>::pack(p2, p3);
    float d[4] = {p0 * (dp[nt][0] - dl0), p1 * (dp[nt][1] - dl0), p2 * (dp[nt][2] - dl1),
                  p3 * (dp[nt][3] - dl1)};
    if (UN) { /* a key of another group's list: its dP may be non-finite (0 x inf) */
      d[0] = v0 ? d[0] : 0.f;
      d[1] = v1 ? d[1] : 0.f;
      d[2] = v0 ? d[2] : 0.f;
      d[3] = v1 ? d[3] : 0.f;
    }
    const uint32_t d0 = Elem<T>::pack(d[0], d[1]);
    const uint32_t d1 = Elem<T>::pack(d[2], d[3]);
    da[kk][hf] = r0 ? d0 : 0u;
    da[kk][hf + 1] = r1 ? d1 : 0u;
  }
}

/* The end of a query-major CTA: dQ of its warpgroup's rows [row0, row0 + nrows) (the lane's
 * rows lr0 and lr0 + 8): with key ranges in the grid (RG > 1) added to the fp32 dQ accumulator
 * with 16-byte reductions (pairs of lanes swap halves), else stored (dq_store). */
template <typename T, int D, typename Prm>
__device__ __forceinline__ void bwg_dq_out(const Prm& p, const float (&dq)[D / 8][4], int RG,
                                           size_t bh, int b, int h, int row0, int lr0, int nrows,
                                           int lane) {
  if (RG > 1) {
    float* dqa = p.dqacc + bh * (size_t)p.S * D;
    const int tq = lane & 3;
    const bool even = (tq & 1) == 0;
    const int lrow = even ? lr0 : lr0 + 8;
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      const float x0 = __shfl_xor_sync(0xffffffffu, even ? dq[i][2] : dq[i][0], 1);
      const float x1 = __shfl_xor_sync(0xffffffffu, even ? dq[i][3] : dq[i][1], 1);
      const float4 val = even ? make_float4(dq[i][0], dq[i][1], x0, x1)
                              : make_float4(x0, x1, dq[i][2], dq[i][3]);
      if (lrow < nrows)
        atomicAdd(reinterpret_cast<float4*>(dqa + (size_t)(row0 + lrow) * D + i * 8 +
                                            (tq >> 1) * 4),
                  val);
    }
    return;
  }
  dq_store<T, D>(p, b, h, row0, lr0, lr0 + 8, nrows, lane, dq);
}

/* The kernel. ATOMIC: dQ and the dK / dV reductions of the query-major heads (path 0; the
 * tuning's qm_wgmma, groups not on bwd_wg128_kernel), each warp's 16 key rows added as whole
 * 128-byte lines (bwg_reduce_lines) through a slab in the stage's V tile, and merged 128-query
 * blocks left to bwd_wg128_kernel; else dQ only, for the key-major heads (path 1). BLK > 1:
 * block lists (kv_block), dQ only, key tiles read through list_key. */
template <typename T, typename Prm, int D, int NS, int MINB, bool ATOMIC, bool NORED = false,
          int BLK = 1>
__global__ void __launch_bounds__(128, MINB) bwd_wg_kernel(const Prm p) {
  static_assert(BLK == 1 || !ATOMIC, "block lists: dQ only");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int BM = 64, BN = 64, NT = 128;
  constexpr int QE = BM * D, KE = BN * D, PE = BM * BN;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  T* Qs = reinterpret_cast<T*>(smem);
  T* dOs = Qs + QE;
  T* Ks = dOs + QE;      /* [NS][BN x D] */
  T* Vs = Ks + NS * KE;  /* [NS][BN x D] */
  T* PSs = Vs + NS * KE; /* [BM x BN]: P, then dS (ATOMIC only) */
  float* lse2 = reinterpret_cast<float*>(PSs + (ATOMIC ? PE : 0)); /* [BM] */
  float* dlt = lse2 + BM;                                            /* [BM] */
  int* kidx = reinterpret_cast<int*>(dlt + BM);                      /* [NS][BN] */
  int* qidx = kidx + NS * BN;                                        /* [BM] */

  const int RG = ATOMIC ? p.nranges : 1; /* ranges in the grid */
  QmajorCta c;
  if (!qmajor_cta<BM>(p, RG, ATOMIC ? 0 : 1, ATOMIC, c)) return;
  if constexpr (ATOMIC) /* a merged 128-query block (the tuning's merge): bwd_wg128_kernel's */
    if (p.ucnt && __ldg(p.ucnt + c.bh * p.NSG + c.row0 / 128) >= 0 && !__ldg(p.knf + c.bh)) return;
  const int b = c.b, h = c.h, row0 = c.row0, nrows = c.nrows;
  const size_t bh = c.bh;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  const int* list = p.kv_index + (bh * p.NG + c.g) * p.kmax;
  const int cnt = __ldg(p.kv_count + bh);
  const int count = trim_count<NT>(list, cnt < 0 ? 0 : (cnt > p.kmax ? p.kmax : cnt));
  const T* kbase = p.k + b * p.kb + h * p.kh;
  const T* vbase = p.v + b * p.vb + h * p.vh;
  int klo, khi, j0, j1; /* keys of the range, entries of the list */
  if (!qmajor_range<BLK>(p, bh, list, count, c.R, c.rr, klo, khi, j0, j1)) return;
  qmajor_rows<BM, NT>(p, bh, row0, nrows, qidx, lse2, dlt);
  __syncthreads();
  gather_rows_async<T, D, NT, BM, true>(Qs, p.q + b * p.qb + h * p.qh, p.qs, qidx, BM);
  gather_rows_async<T, D, NT, BM, true>(dOs, p.dout + b * p.gb + h * p.gh, p.gs, qidx, BM);
  const int ntiles = (j1 - j0 + BN - 1) / BN;
  KeyGather<T, D, NT, BN, true, int, false, BLK> ix;
  ix.init(kbase, p.ks, vbase, p.vs);
  const uint32_t ks0 = smem_u32(Ks), vs0 = smem_u32(Vs);
#pragma unroll
  for (int st = 0; st < NS - 1; ++st) {
    if (st < ntiles) {
      ix.load(list, j0 + st * BN, j1);
      ix.issue(ks0 + st * KE * 2, vs0 + st * KE * 2, klo, khi, kidx + st * BN);
    }
    cp_async_commit();
  }
  ix.load(list, j0 + (NS - 1) * BN, j1);

  float dq[D / 8][4];
  float s[BN / 8][4], dp[BN / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.f;
#pragma unroll
  for (int i = 0; i < BN / 8; ++i) {
    s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
    dp[i][0] = dp[i][1] = dp[i][2] = dp[i][3] = 0.f;
  }
  const int lr0 = warp * 16 + (lane >> 2), lr1 = lr0 + 8;
  /* descriptors: Q, dO, K, V K-major (scores); K, Q, dO MN-major (B of dQ, dK_t, dV_t); the
   * P / dS tile MN-major (A of dV_t, dK_t) */
  const uint64_t qdesc = wg_desc(smem_u32(Qs), 16, 1024);
  const uint64_t dodesc = wg_desc(smem_u32(dOs), 16, 1024);
  const uint64_t kdesc0 = wg_desc(ks0, 16, 1024);
  const uint64_t vdesc0 = wg_desc(vs0, 16, 1024);
  const uint64_t ktdesc0 = wg_desc(ks0, BN * 128, 1024);
  const uint64_t qtdesc = wg_desc(smem_u32(Qs), BM * 128, 1024);
  const uint64_t dotdesc = wg_desc(smem_u32(dOs), BM * 128, 1024);
  const uint64_t pdesc = wg_desc(smem_u32(PSs), BN * 128, 1024);
  float* dva = p.dvacc + bh * (size_t)p.S * D;
  float* dka = p.dkacc + bh * (size_t)p.S * D;

  for (int t = 0; t < ntiles; ++t) {
    /* tile t landed for all; the previous tile's MMAs are done */
    bwg_tile_scores<T, D, BN, NS>(ix, list, j0, j1, klo, khi, t, ntiles, ks0, vs0, kidx, qdesc,
                                  dodesc, kdesc0, vdesc0, s, dp);
    const uint32_t toff = (t % NS) * KE * 2;
    const int* ki = kidx + (t % NS) * BN;

    /* P and dS, packed */
    uint32_t pa[BN / 16][4], da[BN / 16][4];
    bwg_p_ds<T, BN, false>(s, dp, ki, p.scale_log2, lse2[lr0], lse2[lr1], dlt[lr0], dlt[lr1],
                           true, true, lane, pa, da);
    /* dQ += dS K */
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
      Wgmma<T, D>::rs_bt(&dq[0][0], da[kk], wg_desc_add(ktdesc0, toff + kk * 2048), 1);
    wg_commit();
    if constexpr (ATOMIC) {
      float dvt[D / 8][4], dkt[D / 8][4];
      /* dV_t = P^T dO */
      bwg_store_frag<T, BN>(PSs, pa, lr0, lane);
      fence_proxy_async_smem();
      __syncthreads();
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk)
        WgmmaTT<T, D>::ss(&dvt[0][0], wg_desc_add(pdesc, kk * 2048),
                          wg_desc_add(dotdesc, kk * 2048), kk > 0);
      wg_commit();
      wg_wait<0>();
      wg_fence_regs<D / 2>(&dq[0][0]);
      wg_fence_regs<D / 2>(&dvt[0][0]);
      __syncthreads(); /* every warp's part of dV_t has read P */
      /* dK_t = dS^T Q, issued before dV_t's reductions so that they overlap it */
      bwg_store_frag<T, BN>(PSs, da, lr0, lane);
      fence_proxy_async_smem();
      __syncthreads();
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk)
        WgmmaTT<T, D>::ss(&dkt[0][0], wg_desc_add(pdesc, kk * 2048),
                          wg_desc_add(qtdesc, kk * 2048), kk > 0);
      wg_commit();
      /* line reductions, each warp's slab (2 KB) in this stage's V tile: its last reader, dP,
       * is done (two barriers ago), and the gather of tile t + NS refills it only after the
       * next tile's barrier */
      float* slab = reinterpret_cast<float*>(Vs + (t % NS) * KE) + warp * 512;
      int kid[4];
      bwg_tile_keys<0>(kid, ki, warp, lane);
      if (!NORED) bwg_reduce_lines<D>(dva, dvt, kid, slab, lane);
      wg_wait<0>();
      wg_fence_regs<D / 2>(&dkt[0][0]);
      if (!NORED) bwg_reduce_lines<D>(dka, dkt, kid, slab, lane);
      if (NORED && dvt[0][0] + dkt[0][0] == 1.2345e-30f) dq[0][0] += 1.f; /* keeps the MMAs */
    } else {
      wg_wait<0>(); /* before the next barrier, after which stage buf may be refilled */
      wg_fence_regs<D / 2>(&dq[0][0]);
    }
  }
  cp_async_wait<0>();
  bwg_dq_out<T, D>(p, dq, RG, bh, b, h, row0, lr0, nrows, lane);
#endif
}

/* dQ += dS K, dS from the registers da (A fragments), K the stage's tile (ktdesc, MN-major) */
template <typename T, int D, int BN>
__device__ __forceinline__ void bwg_dq_mma(float (&dq)[D / 8][4], const uint32_t (&da)[BN / 16][4],
                                           uint64_t ktdesc) {
  wg_fence();
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk)
    Wgmma<T, D>::rs_bt(&dq[0][0], da[kk], wg_desc_add(ktdesc, kk * 2048), 1);
  wg_commit();
}

/* acc = the 128-row product (A: the P or dS tiles of both warpgroups, B: their dO or Q tiles) */
template <typename T, int D>
__device__ __forceinline__ void bwg_product(float (&acc)[D / 8][4], uint64_t adesc,
                                            uint64_t bdesc) {
  constexpr int QE = 64 * D;
  wg_fence();
#pragma unroll
  for (int kk = 0; kk < 8; ++kk)
    WgmmaTT<T, D>::ss(&acc[0][0], wg_desc_add(adesc, kk * 2048),
                      wg_desc_add(bdesc, (kk >> 2) * (QE * 2) + (kk & 3) * 2048), kk > 0);
  wg_commit();
}

/* The query-major pass with dK / dV reductions for groups of a multiple of 128 queries (the
 * tuning's g128; PERF_LOG kernels v15, v25): one CTA of 256 threads per 128 rows, warpgroup w
 * (warps 4 w .. 4 w + 3) owning rows 64 w .. 64 w + 63 with its own Q and dO tiles, both on one
 * key pipeline (64-key tiles x 2 stages). Per key tile each warpgroup computes S, dP, P and dS
 * for its rows and writes P and dS to its half of two shared [128 query][64 key] tiles; over
 * all 128 rows warpgroup 0 forms dV_t = P^T dO and warpgroup 1 dK_t = dS^T Q (8 k16 steps: the
 * two halves are summed in the tensor cores) and adds its 64 x D tile to the fp32 accumulator
 * once: one reduction per key and 128 rows instead of two, each warp's 16 rows through its
 * own 2 KB slab of shared memory as whole 128-byte lines (bwg_reduce_lines). The two
 * warpgroups run out of step:
 * the 128-row products of tile t are formed during tile t + 1 (P / dS double-buffered by tile
 * parity, so no barrier inside a tile), warpgroup 0 after its dQ (t + 1), warpgroup 1 before
 * its S / dP (t + 1) and together with its dQ (t), which runs one tile late (its dS fragments
 * kept in registers): one warpgroup's exponentials and stores meet the other's MMAs.
 * Warpgroup 1 gathers the key tiles alone (128 threads), issuing tile t + 1 into the stage of
 * tile t - 1 once its dQ (t - 1) has read it. One CTA barrier per tile. 1 CTA per SM. Key
 * ranges as bwd_wg_kernel. Rows past a partial last group's end (a whole warpgroup of them
 * possibly) give P = dS = 0 by selects (bwg_p_ds). UN: merged groups (PERF_LOG v26), launched
 * with G = 128 over the 128-query blocks: the CTA of block u walks its union (uidx, ucnt from
 * union_build_kernel; nothing where it was not merged), packed entries whose member bit of the
 * warp's group (16 rows of one group of ug >= 16) masks each row's scores. NORED: no
 * reductions (wrong dK / dV; csrc/dev measures their cost with it). */
template <typename T, typename Prm, int D, int NS, bool UN = false, bool NORED = false>
__global__ void __launch_bounds__(256, 1) bwd_wg128_kernel(const Prm p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(NS == 2, "the stage of tile t - 1 is refilled with tile t + 1");
  constexpr int BM = 128, BN = 64, NT = 256;
  constexpr int QE = 64 * D, KE = BN * D, PE = 64 * BN;
  static_assert(PE * 2 == 4 * 2048, "the two P (dS) tiles are one run of 8 k16 steps");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  T* Qs = reinterpret_cast<T*>(smem); /* [2][64 x D]: one per warpgroup */
  T* dOs = Qs + 2 * QE;               /* [2][64 x D] */
  T* Ks = dOs + 2 * QE;               /* [NS][BN x D] */
  T* Vs = Ks + NS * KE;               /* [NS][BN x D] */
  T* Ps = Vs + NS * KE;               /* [2 tile parity][2 warpgroups][64 x BN] */
  T* dSs = Ps + 4 * PE;               /* [2][2][64 x BN] */
  float* slabs = reinterpret_cast<float*>(dSs + 4 * PE); /* [8 warps][16 x 32] */
  float* lse2 = slabs + 8 * 512;                        /* [BM] */
  float* dlt = lse2 + BM;                               /* [BM] */
  int* kidx = reinterpret_cast<int*>(dlt + BM);         /* [NS][BN] */
  int* qidx = kidx + NS * BN;                           /* [BM] */

  constexpr int KM = UN ? UKEY_MASK : 0; /* merged groups: packed entries */
  const int RG = p.nranges;
  QmajorCta c;
  if (!qmajor_cta<BM>(p, RG, 0, true, c)) return;
  const int tid = threadIdx.x, lane = tid & 31, warp = (tid >> 5) & 3;
  /* warp-uniform to the compiler (a shuffle): the descriptors stay in uniform registers */
  const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
  const int* list;
  int count;
  if constexpr (UN) { /* block c.g's union (union_build_kernel), if it was merged */
    count = __ldg(p.ucnt + c.bh * p.NSG + c.g);
    if (count < 0 || __ldg(p.knf + c.bh)) return;
    list = p.uidx + (c.bh * p.NSG + c.g) * (size_t)p.ucap;
  } else {
    list = p.kv_index + (c.bh * p.NG + c.g) * p.kmax;
    count = trim_count<NT>(list, clamp_count(__ldg(p.kv_count + c.bh), p.kmax));
  }
  int klo, khi, j0, j1;
  if (!qmajor_range<1, KM>(p, c.bh, list, count, c.R, c.rr, klo, khi, j0, j1)) return;
  qmajor_rows<BM, NT>(p, c.bh, c.row0, c.nrows, qidx, lse2, dlt);
  __syncthreads();
  {
    const T* qb = p.q + c.b * p.qb + c.h * p.qh;
    const T* gb = p.dout + c.b * p.gb + c.h * p.gh;
    gather_rows_async<T, D, NT, 64, true>(Qs, qb, p.qs, qidx, 64);
    gather_rows_async<T, D, NT, 64, true>(Qs + QE, qb, p.qs, qidx + 64, 64);
    gather_rows_async<T, D, NT, 64, true>(dOs, gb, p.gs, qidx, 64);
    gather_rows_async<T, D, NT, 64, true>(dOs + QE, gb, p.gs, qidx + 64, 64);
  }
  /* warp-uniform to the compiler (as wg): the tile loop's stage offsets in uniform registers */
  const int ntiles = __shfl_sync(0xffffffffu, (j1 - j0 + BN - 1) / BN, 0);
  /* warpgroup 1 gathers every key tile: tile 0 here (with the Q / dO group), tile t + 1 during
   * tile t */
  KeyGather<T, D, 128, BN, true, int, false, 1, KM> ix;
  const uint32_t ks0 = smem_u32(Ks), vs0 = smem_u32(Vs);
  if (wg == 1) {
    ix.init(p.k + c.b * p.kb + c.h * p.kh, p.ks, p.v + c.b * p.vb + c.h * p.vh, p.vs, tid - 128);
    if (ntiles > 0) {
      ix.load(list, j0, j1);
      ix.issue(ks0, vs0, klo, khi, kidx);
    }
    ix.load(list, j0 + BN, j1);
  }
  cp_async_commit();

  float dq[D / 8][4], acc[D / 8][4];
  float s[BN / 8][4], dp[BN / 8][4];
  uint32_t da[BN / 16][4]; /* dS of the tile (warpgroup 1: its dQ runs one tile late) */
#pragma unroll
  for (int i = 0; i < D / 8; ++i) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.f;
#pragma unroll
  for (int i = 0; i < BN / 8; ++i) {
    s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
    dp[i][0] = dp[i][1] = dp[i][2] = dp[i][3] = 0.f;
  }
#pragma unroll
  for (int i = 0; i < BN / 16; ++i) da[i][0] = da[i][1] = da[i][2] = da[i][3] = 0u;
  const int wl0 = warp * 16 + (lane >> 2);      /* the lane's first row in its warpgroup's 64 */
  const int lr0 = 64 * wg + wl0, lr1 = lr0 + 8; /* ... in the CTA's 128 */
  const uint64_t qdesc = wg_desc(smem_u32(Qs + wg * QE), 16, 1024);
  const uint64_t dodesc = wg_desc(smem_u32(dOs + wg * QE), 16, 1024);
  const uint64_t kdesc0 = wg_desc(ks0, 16, 1024);
  const uint64_t vdesc0 = wg_desc(vs0, 16, 1024);
  const uint64_t ktdesc0 = wg_desc(ks0, BN * 128, 1024);
  /* the 128-row products of tile parity b: A = the P (dS) tiles of parity b, 2 PE elements
   * further each parity */
  const uint64_t adesc0 = wg_desc(smem_u32(wg ? dSs : Ps), BN * 128, 1024);
  const uint64_t bdesc0 = wg_desc(smem_u32(wg ? Qs : dOs), 64 * 128, 1024);
  float* red = (wg ? p.dkacc : p.dvacc) + c.bh * (size_t)p.S * D;
  const float ls0 = lse2[lr0], ls1 = lse2[lr1], dl0 = dlt[lr0], dl1 = dlt[lr1];
  /* merged groups: the member bit of the warp's 16 rows (one group: ug >= 16) */
  const int ush = UN ? UKEY_BITS + (64 * wg + 16 * warp) / p.ug : 0;

  float* slab = slabs + (tid >> 5) * 512;
  int kid[4]; /* the keys of the lane's reduction rows in the previous tile */
#pragma unroll
  for (int i = 0; i < 4; ++i) kid[i] = -1;
  for (int t = 0; t < ntiles; ++t) {
    const int st = t % NS;
    cp_async_wait<0>(); /* tile t (this thread's part of it) */
    fence_proxy_async_smem();
    __syncthreads(); /* tile t landed; P / dS of tile t - 1 written by both warpgroups; the
                        readers of parity t % 2 (the products of tile t - 2) done */
    if (wg == 1 && t > 0) {
      /* dQ (t - 1) over the stage refilled below, and dK_t of tile t - 1 */
      bwg_dq_mma<T, D, BN>(dq, da, wg_desc_add(ktdesc0, (t - 1) % NS * KE * 2));
      bwg_product<T, D>(acc, wg_desc_add(adesc0, ((t - 1) & 1) * 2 * PE * 2), bdesc0);
      wg_wait<0>();
      wg_fence_regs<D / 2>(&dq[0][0]);
      wg_fence_regs<D / 2>(&acc[0][0]);
      bwg_reduce_out<D, NORED>(red, acc, kid, slab, lane, dq);
    }
    if (wg == 1) {
      if (t + 1 < ntiles) {
        ix.issue(ks0 + (t + 1) % NS * KE * 2, vs0 + (t + 1) % NS * KE * 2, klo, khi,
                 kidx + (t + 1) % NS * BN);
        ix.load(list, j0 + (t + 2) * BN, j1);
      }
      cp_async_commit();
    }
    const int* ki = kidx + st * BN;
    wg_fence();
    bwg_scores<T, D, BN>(s, qdesc, wg_desc_add(kdesc0, st * KE * 2));
    bwg_scores<T, D, BN>(dp, dodesc, wg_desc_add(vdesc0, st * KE * 2));
    wg_commit();
    bwg_scores_wait<BN>(s, dp);
    uint32_t pa[BN / 16][4];
    bwg_p_ds<T, BN, true, UN>(s, dp, ki, p.scale_log2, ls0, ls1, dl0, dl1, lr0 < c.nrows,
                              lr1 < c.nrows, lane, pa, da, ush);
    /* this warpgroup's halves of P and dS to shared memory before dQ += dS K is issued: da is
     * that MMA's A operand, and a wgmma's A registers may not be accessed (read either) until
     * a wait_group covers it (PTX ISA, wgmma.mma_async) */
    bwg_store_frag<T, BN>(Ps + ((t & 1) * 2 + wg) * PE, pa, wl0, lane);
    bwg_store_frag<T, BN>(dSs + ((t & 1) * 2 + wg) * PE, da, wl0, lane);
    fence_proxy_async_smem();
    if (wg == 0) {
      /* dQ (t), then dV_t of tile t - 1 */
      bwg_dq_mma<T, D, BN>(dq, da, wg_desc_add(ktdesc0, st * KE * 2));
      if (t > 0) bwg_product<T, D>(acc, wg_desc_add(adesc0, ((t - 1) & 1) * 2 * PE * 2), bdesc0);
      wg_wait<0>();
      wg_fence_regs<D / 2>(&dq[0][0]);
      if (t > 0) {
        wg_fence_regs<D / 2>(&acc[0][0]);
        bwg_reduce_out<D, NORED>(red, acc, kid, slab, lane, dq);
      }
    }
    bwg_tile_keys<KM>(kid, ki, warp, lane);
  }
  if (ntiles > 0) { /* the last tile's products (and warpgroup 1's last dQ) */
    __syncthreads();
    if (wg == 1) {
      bwg_dq_mma<T, D, BN>(dq, da, wg_desc_add(ktdesc0, (ntiles - 1) % NS * KE * 2));
      wg_wait<0>();
      wg_fence_regs<D / 2>(&dq[0][0]);
    }
    bwg_product<T, D>(acc, wg_desc_add(adesc0, ((ntiles - 1) & 1) * 2 * PE * 2), bdesc0);
    wg_wait<0>();
    wg_fence_regs<D / 2>(&acc[0][0]);
    bwg_reduce_out<D, NORED>(red, acc, kid, slab, lane, dq);
  }
  cp_async_wait<0>();
  bwg_dq_out<T, D>(p, dq, RG, c.bh, c.b, c.h, c.row0 + 64 * wg, wl0, c.nrows - 64 * wg, lane);
#endif
}

/* UN: merged groups, prm with G = 128 and NG = NSG (union_passes); NORED as the kernel */
template <typename T, int D, typename Prm, bool UN = false, bool NORED = false>
static int bwd_wg128_launch(const dsv_attn_shape* sh, Prm& prm, cudaStream_t stream) {
  constexpr int NS = 2, BM = 128, BN = 64;
  const size_t smem = 1024 + (size_t)(2 * BM + 2 * NS * BN) * D * sizeof(T) +
                      (size_t)4 * BM * BN * sizeof(T) /* P, dS: two tiles each */ +
                      (size_t)8 * 512 * sizeof(float) /* slabs */ +
                      2 * BM * sizeof(float) + (size_t)(NS * BN + BM) * sizeof(int);
  auto kern = bwd_wg128_kernel<T, Prm, D, NS, UN, NORED>;
  if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) !=
      cudaSuccess)
    return DSV_ERR_CUDA;
  prm.chunks = prm.G / BM;
  dim3 grid((unsigned)(prm.NG * prm.chunks), (unsigned)(sh->heads * prm.nranges),
            (unsigned)sh->batch);
  kern<<<grid, 256, smem, stream>>>(prm);
  return cudaGetLastError() == cudaSuccess ? DSV_OK : DSV_ERR_CUDA;
}

/* Whether K / V row strides are below 4 GB (KeyGather's 32-bit strides). */
template <typename T, typename Prm>
static bool bwd_wg_strides_fit(const Prm& prm) {
  const int64_t lim = (int64_t)UINT32_MAX / (int64_t)sizeof(T);
  return prm.ks <= lim && prm.vs <= lim;
}

/* Whether the wgmma kernel applies to these parameters (the device side, an sm_90a build on a
 * 9.0 device, is the tuning's wgmma): D 64 or 128, G >= 64, K / V row strides below 4 GB. */
template <typename T, int D, typename Prm>
static bool bwd_wg_applies(const Prm& prm) {
  return (D == 64 || D == 128) && prm.G >= 64 && bwd_wg_strides_fit<T>(prm);
}

template <typename T, int D, bool ATOMIC, typename Prm, bool NORED = false, int BLK = 1>
static int bwd_wg_launch_one(const dsv_attn_shape* sh, Prm& prm, cudaStream_t stream) {
  constexpr int NS = 2, BM = 64, BN = 64;
  const size_t smem = 1024 + (size_t)(2 * BM + 2 * NS * BN) * D * sizeof(T) +
                      (ATOMIC ? (size_t)BM * BN * sizeof(T) : 0) + 2 * BM * sizeof(float) +
                      (size_t)(NS * BN + BM) * sizeof(int);
  auto kern = bwd_wg_kernel<T, Prm, D, NS, 2, ATOMIC, NORED, BLK>;
  if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) !=
      cudaSuccess)
    return DSV_ERR_CUDA;
  prm.chunks = (prm.G + BM - 1) / BM;
  dim3 grid((unsigned)(prm.NG * prm.chunks), (unsigned)(sh->heads * (ATOMIC ? prm.nranges : 1)),
            (unsigned)sh->batch);
  kern<<<grid, 128, smem, stream>>>(prm);
  return cudaGetLastError() == cudaSuccess ? DSV_OK : DSV_ERR_CUDA;
}

}  // namespace dsv_attn

#endif /* DSV_SPARSE_ATTENTION_BWD_WG_CUH */
