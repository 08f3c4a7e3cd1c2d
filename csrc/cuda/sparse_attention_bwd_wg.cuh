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
 * stages, KeyGather's fixed per-thread plan) stored 128-byte swizzled (wgmma.cuh). Per key tile:
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

/* Adds a 64-key x D fp32 tile (wgmma accumulator: warp w holds key rows 16 w + lane / 4 and
 * + 8) into acc[key][D] with 16-byte reductions; rows whose key entry is < 0 are skipped. */
template <int D>
__device__ __forceinline__ void bwg_reduce_rows(float* acc, const float (&a)[D / 8][4],
                                                const int* ki, int warp, int lane) {
  const int tq = lane & 3;
  const bool even = (tq & 1) == 0;
  const int kid = ki[warp * 16 + (lane >> 2) + (even ? 0 : 8)];
  float* row = acc + (size_t)(kid < 0 ? 0 : kid) * D + (tq >> 1) * 4;
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    const float x0 = __shfl_xor_sync(0xffffffffu, even ? a[j][2] : a[j][0], 1);
    const float x1 = __shfl_xor_sync(0xffffffffu, even ? a[j][3] : a[j][1], 1);
    const float4 v = even ? make_float4(a[j][0], a[j][1], x0, x1)
                          : make_float4(x0, x1, a[j][2], a[j][3]);
    if (kid >= 0) atomicAdd(reinterpret_cast<float4*>(row + j * 8), v);
  }
}

/* The kernel. ATOMIC: dQ and the dK / dV reductions of the query-major heads (path 0); else
 * dQ only, for the key-major heads (path 1). BLK > 1: block lists (kv_block), dQ only, key
 * tiles read through list_key. */
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
  const int h = blockIdx.y / RG, rr = blockIdx.y - h * RG, b = blockIdx.z;
  const size_t bh = (size_t)b * p.H + h;
  if (p.path[bh] != (ATOMIC ? 0 : 1)) return;
  const int R = ATOMIC ? p.nrh[bh] : 1;
  if (rr >= R) return;
  const int g = blockIdx.x / p.chunks;
  const int chunk = blockIdx.x - g * p.chunks;
  const int row0 = g * p.G + chunk * BM;
  const int row_end = min(g * p.G + p.G, p.S);
  const int nrows = min(BM, row_end - row0);
  if (nrows <= 0) return;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  const int* list = p.kv_index + (bh * p.NG + g) * p.kmax;
  const int cnt = __ldg(p.kv_count + bh);
  const int count = trim_count<NT>(list, cnt < 0 ? 0 : (cnt > p.kmax ? p.kmax : cnt));
  const T* kbase = p.k + b * p.kb + h * p.kh;
  const T* vbase = p.v + b * p.vb + h * p.vh;
  int klo = 0, khi = p.S, j0 = 0, j1 = count * BLK; /* keys of the list */
  if (R > 1) {
    const int rlen = (p.S + R - 1) / R;
    klo = rr * rlen;
    khi = min(p.S, klo + rlen);
    if (p.flags[bh] == 0) { /* strictly ascending, in range: binary search */
      j0 = list_lower_bound(list, 0, count, klo);
      j1 = list_lower_bound(list, j0, count, khi);
    }
    if (j1 <= j0) return; /* nothing of this group in this range (uniform per CTA) */
  }

  for (int r = tid; r < BM; r += NT) {
    const bool valid = r < nrows;
    qidx[r] = valid ? row0 + r : -1;
    const float l = valid ? p.lse[bh * p.S + row0 + r] : INFINITY;
    lse2[r] = l == -INFINITY ? INFINITY : l * DSV_LOG2E;
    dlt[r] = valid ? p.delta[bh * p.S + row0 + r] : 0.f;
  }
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
    const int buf = t % NS;
    cp_async_wait<NS - 2>();
    fence_proxy_async_smem(); /* this thread's cp.async writes -> visible to the tensor cores */
    __syncthreads();          /* tile t landed for all; the previous tile's MMAs are done */
    {
      const int tn = t + NS - 1;
      if (tn < ntiles) {
        const int nb = tn % NS;
        ix.issue(ks0 + nb * KE * 2, vs0 + nb * KE * 2, klo, khi, kidx + nb * BN);
        ix.load(list, j0 + (tn + 1) * BN, j1);
      }
      cp_async_commit();
    }
    const uint32_t toff = buf * KE * 2;
    const int* ki = kidx + buf * BN;
    wg_fence();
    bwg_scores<T, D, BN>(s, qdesc, wg_desc_add(kdesc0, toff));
    bwg_scores<T, D, BN>(dp, dodesc, wg_desc_add(vdesc0, toff));
    wg_commit();
    wg_wait<0>();
    wg_fence_regs<BN / 2>(&s[0][0]);
    wg_fence_regs<BN / 2>(&dp[0][0]);

    /* P = exp(scale s - lse), dS = P (dP - delta) (without the scale factor), packed */
    const float ls0 = lse2[lr0], ls1 = lse2[lr1];
    const float dl0 = dlt[lr0], dl1 = dlt[lr1];
    uint32_t pa[BN / 16][4], da[BN / 16][4];
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt) {
      const int col = nt * 8 + (lane & 3) * 2;
      const bool v0 = ki[col] >= 0, v1 = ki[col + 1] >= 0;
      const float p0 = v0 ? fast_exp2(s[nt][0] * p.scale_log2 - ls0) : 0.f;
      const float p1 = v1 ? fast_exp2(s[nt][1] * p.scale_log2 - ls0) : 0.f;
      const float p2 = v0 ? fast_exp2(s[nt][2] * p.scale_log2 - ls1) : 0.f;
      const float p3 = v1 ? fast_exp2(s[nt][3] * p.scale_log2 - ls1) : 0.f;
      const int kk = nt >> 1, hf = (nt & 1) * 2;
      pa[kk][hf] = Elem<T>::pack(p0, p1);
      pa[kk][hf + 1] = Elem<T>::pack(p2, p3);
      da[kk][hf] = Elem<T>::pack(p0 * (dp[nt][0] - dl0), p1 * (dp[nt][1] - dl0));
      da[kk][hf + 1] = Elem<T>::pack(p2 * (dp[nt][2] - dl1), p3 * (dp[nt][3] - dl1));
    }
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
      if (!NORED) bwg_reduce_rows<D>(dva, dvt, ki, warp, lane);
      wg_wait<0>();
      wg_fence_regs<D / 2>(&dkt[0][0]);
      if (!NORED) bwg_reduce_rows<D>(dka, dkt, ki, warp, lane);
      if (NORED && dvt[0][0] + dkt[0][0] == 1.2345e-30f) dq[0][0] += 1.f; /* keeps the MMAs */
    } else {
      wg_wait<0>(); /* before the next barrier, after which stage buf may be refilled */
      wg_fence_regs<D / 2>(&dq[0][0]);
    }
  }
  cp_async_wait<0>();

  if (RG > 1) {
    /* partial dQ of this key range: 16-byte reductions (pairs of lanes swap halves) */
    float* dqa = p.dqacc + bh * (size_t)p.S * D;
    const int tq = lane & 3;
    const bool even = (tq & 1) == 0;
    const int lrow = even ? lr0 : lr1;
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
  dq_store<T, D>(p, b, h, row0, lr0, lr1, nrows, lane, dq);
#endif
}

/* Whether the wgmma kernel applies to these parameters (the device side, an sm_90a build on a
 * 9.0 device, is the tuning's wgmma): D 64 or 128, G >= 64, K / V row strides below 4 GB. */
template <typename T, int D, typename Prm>
static bool bwd_wg_applies(const Prm& prm) {
  const int64_t lim = (int64_t)UINT32_MAX / (int64_t)sizeof(T); /* KeyGather's 32-bit strides */
  return (D == 64 || D == 128) && prm.G >= 64 && prm.ks <= lim && prm.vs <= lim;
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
