/*
 * attn_g128.cu - G = 128 (and multiples) with two consumer warpgroups per CTA on the same key
 * tiles (measurement variant; the shipped kernels split a group of 128 into two CTAs of 64 rows,
 * each gathering the group's K / V and reducing its own dK / dV). Design and prediction:
 * benchmarks/PERF_LOG.md (v15).
 *
 *   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
 *        -DDSV_WGMMA -Icsrc -Xcompiler -fPIC -shared csrc/dev/attn_g128.cu -o g128.so
 *
 * One CTA of 256 threads per 128 consecutive queries of a group: warpgroup w (warps 4 w ..
 * 4 w + 3) owns rows 64 w .. 64 w + 63 (its own 64-row Q tile, like the shipped wgmma kernels).
 *  - forward (g128_fwd_kernel): the shipped sparse_attn_fwd_wg_kernel with both warpgroups on
 *    one K / V pipeline (32-key tiles x 2 cp.async stages, gathered once by all 256 threads with
 *    the shipped KeyGather): each tile is copied once for 128 rows instead of twice; each
 *    warpgroup runs its own S = Q K^T, online softmax, O += P V and epilogue (store_out_lse).
 *    2 CTAs per SM (registers capped at 128, as the shipped 4 x 128 threads).
 *  - backward, query-major pass with reductions (g128_bwd_kernel, heads of path 0): the shipped
 *    wgmma kernel of v8 (bwd_wg_kernel: 64-key tiles x 2 stages) with one key pipeline for both
 *    warpgroups; each computes S, dP, P and dS for its rows, writes P and dS to its half of two
 *    shared [128 query][64 key] tiles, issues dQ += dS K, and after one CTA barrier warpgroup 0
 *    forms dV_t = P^T dO and warpgroup 1 dK_t = dS^T Q over all 128 rows (8 k16 steps: the sum
 *    of the two halves happens in the tensor cores), each then adds its 64 x D tile to the fp32
 *    accumulator once (16-byte red.global.add from registers, bwg_reduce_rows): one reduction
 *    per key and 128 rows instead of two. The dK / dV MMA work per warpgroup is that of the
 *    shipped kernel (8 k16 steps), the registers fewer (one 64 x D tile instead of two).
 *    1 CTA per SM (8 warps, as the shipped 2 x 4). Key ranges as the shipped kernel (a binary
 *    search of the ascending list per range, dQ reduced in fp32 over the ranges). The dQ-only
 *    pass of the key-major heads, the key-major pass and everything else run shipped.
 * Applies to token lists (kv_block 1), D = 64 / 128, G (clamped to S, as the shipped kernels
 * do) a multiple of 128, where the shipped code would run wgmma (an sm_90a build on a 9.0
 * device, K / V row strides below 4 GB); every other call runs the shipped kernels, so the
 * library passes the shipped tests as DSV_ATTN_LIB. The contract is the shipped one (masking of
 * entries outside [0, S) and past the count, trailing -1 trimmed, duplicates count twice, empty
 * lists give zeros and lse -inf, an all -inf row NaN, NaN in means NaN out as in the shipped
 * kernels; in the backward the rows past a partial last group's end give P = dS = 0 by selects,
 * so a non-finite K / V row cannot reach dK / dV through them). Not bit-equal to the shipped
 * kernels (dK / dV sum 128 rows per reduction).
 *
 * The library exports the shipped C API (dsv_sparse_attention_fwd_cuda / _bwd_cuda run the
 * variant; the workspaces are the shipped ones) and
 *   int dsv_dev_sparse_attention_fwd_g128_cuda(int g128, <dsv_sparse_attention_fwd_cuda's args>)
 *   int dsv_dev_sparse_attention_bwd_g128_cuda(int g128, <dsv_sparse_attention_bwd_cuda's args>)
 * (g128 0: the shipped kernels, 1: the variant) and
 *   long long dsv_dev_g128_runs(int which)   launches of the variant's forward (0) / backward (1)
 *                                            kernels so far (the tests check that it ran).
 * Not thread-safe (the mode of the running call is a global).
 */
#include <string.h>

#define dsv_sparse_attention_fwd_cuda dsv_shipped_sparse_attention_fwd_cuda
#define dsv_sparse_attention_bwd_cuda dsv_shipped_sparse_attention_bwd_cuda
#include "cuda/tuning.cu"
#include "cuda/sparse_attention_fwd.cu"
#include "cuda/sparse_attention_bwd.cu"
#undef dsv_sparse_attention_fwd_cuda
#undef dsv_sparse_attention_bwd_cuda
#include "cuda/sparse_attention_bwd_index.cu"
#include "cuda/sparse_attention_bwd_kmajor.cu"
#include "cuda/sparse_attention_bwd_qmajor.cu"

namespace dsv_attn {

static int g_g128_on = 1;
static long long g_g128_runs[2] = {0, 0};

/* Whether a call runs the variant: token lists, D 64 / 128, G a multiple of 128, wgmma, K / V
 * row strides below 4 GB (KeyGather's 32-bit row offsets). */
template <typename T>
static bool g128_applies(const dsv_attn_shape* sh, int G, int64_t ks, int64_t vs, int wgmma) {
  const int64_t lim = (int64_t)UINT32_MAX / (int64_t)sizeof(T);
  return g_g128_on && wgmma && sh->kv_block == 1 && (sh->head_dim == 64 || sh->head_dim == 128) &&
         G >= 128 && G % 128 == 0 && ks <= lim && vs <= lim;
}

/* ---------------------------------------------------------------------------------------- */
/* forward */

/* Shared memory of the forward (bytes, with the 1024-byte alignment pad). */
template <typename T, int D, int BN, int NS>
constexpr size_t g128_fwd_smem() {
  return 1024 + (size_t)(128 + 2 * NS * BN) * D * sizeof(T) + NS * BN * sizeof(float) +
         128 * sizeof(int);
}

template <typename T, int D, int BN, int NS, int MINB>
__global__ void __launch_bounds__(256, MINB) g128_fwd_kernel(const FwdParams<T> p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int BM = 128, NT = 256;
  constexpr int QE = 64 * D, KE = BN * D;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  T* Qs = reinterpret_cast<T*>(smem);                    /* [2][64 x D]: one per warpgroup */
  T* Ks = Qs + 2 * QE;                                   /* [NS][BN x D] */
  T* Vs = Ks + NS * KE;                                  /* [NS][BN x D] */
  float* kbias = reinterpret_cast<float*>(Vs + NS * KE); /* [NS][BN]: 0 or -inf per key */
  int* qidx = reinterpret_cast<int*>(kbias + NS * BN);   /* [BM] */

  FwdChunk<T> c;
  if (!fwd_chunk<T, BM>(p, c)) return; /* uniform per CTA */
  fwd_chunk_list<T, NT>(p, c);
  const int tid = threadIdx.x, lane = tid & 31, wg = tid >> 7, warp = (tid >> 5) & 3;
  for (int r = tid; r < BM; r += NT) qidx[r] = r < c.nrows ? c.row0 + r : -1;
  __syncthreads();
  gather_rows_async<T, D, NT, 64, true>(Qs, c.qbase, p.qs, qidx, 64);
  gather_rows_async<T, D, NT, 64, true>(Qs + QE, c.qbase, p.qs, qidx + 64, 64);
  const int nkeys = c.count;
  const int ntiles = (nkeys + BN - 1) / BN;
  /* the shipped pipeline, 256 threads gathering: group s of the prologue holds tile s (group 0
   * also both Q tiles), one group committed per tile, list entries one tile ahead */
  KeyGather<T, D, NT, BN, true, float, false, 1> ix;
  ix.init(c.kbase, p.ks, c.vbase, p.vs);
  const uint32_t ks0 = smem_u32(Ks), vs0 = smem_u32(Vs);
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
  const uint64_t qdesc = wg_desc(smem_u32(Qs + wg * QE), 16, 1024);
  const uint64_t kdesc0 = wg_desc(ks0, 16, 1024);
  const uint64_t vdesc0 = wg_desc(vs0, BN * 128, 1024);

  for (int t = 0; t < ntiles; ++t) {
    const int buf = t % NS;
    cp_async_wait<NS - 2>();
    fence_proxy_async_smem(); /* this thread's cp.async writes -> visible to the tensor cores */
    __syncthreads();          /* tile t landed for both warpgroups; both are done with the
                                 stage refilled below (each waited for its MMAs of tile t - 1) */
    {
      const int tn = t + NS - 1;
      if (tn < ntiles) {
        const int nb = tn % NS;
        ix.issue(ks0 + nb * KE * 2, vs0 + nb * KE * 2, 0, p.S, kbias + nb * BN);
        ix.load(c.list, (tn + 1) * BN, nkeys);
      }
      cp_async_commit();
    }
    wg_fence();
    wg_scores<T, D, BN>(s, qdesc, wg_desc_add(kdesc0, buf * KE * 2));
    wg_commit();
    wg_wait<0>();
    wg_fence_regs<BN / 2>(&s[0][0]);
    float a0, a1;
    softmax_tile<BN>(s, kbias + buf * BN, p.scale_log2, lane, m0, m1, l0, l1, a0, a1);
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
                      lane, c.list, c.count, p.S);
#endif
}

template <typename T, int D>
static int launch_g128_fwd(const dsv_attn_shape* sh, FwdParams<T>& prm, cudaStream_t stream) {
  constexpr int BN = 32, NS = 2, MINB = 2;
  const size_t smem = g128_fwd_smem<T, D, BN, NS>();
  auto kern = g128_fwd_kernel<T, D, BN, NS, MINB>;
  if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) !=
      cudaSuccess)
    return DSV_ERR_CUDA;
  prm.chunks = prm.G / 128;
  dim3 grid((unsigned)(prm.NG * prm.chunks), (unsigned)sh->heads, (unsigned)sh->batch);
  kern<<<grid, 256, smem, stream>>>(prm);
  if (cudaGetLastError() != cudaSuccess) return DSV_ERR_CUDA;
  ++g_g128_runs[0];
  return DSV_OK;
}

template <typename T>
static int fwd_g128(const dsv_attn_shape* sh, FwdParams<T>& prm, int wgmma, const char* tile,
                    cudaStream_t stream) {
  (void)tile;
  if (g128_applies<T>(sh, prm.G, prm.ks, prm.vs, wgmma)) {
    if (sh->head_dim == 64) return launch_g128_fwd<T, 64>(sh, prm, stream);
    return launch_g128_fwd<T, 128>(sh, prm, stream);
  }
  return fwd_dispatch<T>(sh, prm, wgmma, stream);
}

/* ---------------------------------------------------------------------------------------- */
/* backward: the query-major pass with dK / dV reductions */

template <typename T, int D, int NS>
constexpr size_t g128_bwd_smem() {
  constexpr int BM = 128, BN = 64;
  return 1024 + (size_t)(2 * BM + 2 * NS * BN) * D * sizeof(T) + (size_t)2 * BM * BN * sizeof(T) +
         2 * BM * sizeof(float) + (size_t)(NS * BN + BM) * sizeof(int);
}

template <typename T, int D, int NS, int MINB>
__global__ void __launch_bounds__(256, MINB) g128_bwd_kernel(const BwdParams<T> p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int BM = 128, BN = 64, NT = 256;
  constexpr int QE = 64 * D, KE = BN * D, PE = 64 * BN;
  static_assert(PE * 2 == 4 * 2048, "the two P (dS) tiles are one run of 8 k16 steps");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  T* Qs = reinterpret_cast<T*>(smem); /* [2][64 x D]: one per warpgroup */
  T* dOs = Qs + 2 * QE;               /* [2][64 x D] */
  T* Ks = dOs + 2 * QE;               /* [NS][BN x D] */
  T* Vs = Ks + NS * KE;               /* [NS][BN x D] */
  T* Ps = Vs + NS * KE;               /* [2][64 x BN]: P of warpgroup 0's rows, then 1's */
  T* dSs = Ps + 2 * PE;               /* [2][64 x BN]: dS likewise */
  float* lse2 = reinterpret_cast<float*>(dSs + 2 * PE); /* [BM] */
  float* dlt = lse2 + BM;                               /* [BM] */
  int* kidx = reinterpret_cast<int*>(dlt + BM);         /* [NS][BN] */
  int* qidx = kidx + NS * BN;                           /* [BM] */

  const int RG = p.nranges;
  const int h = blockIdx.y / RG, rr = blockIdx.y - h * RG, b = blockIdx.z;
  const size_t bh = (size_t)b * p.H + h;
  if (p.path[bh] != 0) return;
  const int R = p.nrh[bh];
  if (rr >= R) return;
  const int g = blockIdx.x / p.chunks;
  const int chunk = blockIdx.x - g * p.chunks;
  const int row0 = g * p.G + chunk * BM;
  const int row_end = min(g * p.G + p.G, p.S);
  const int nrows = min(BM, row_end - row0);
  if (nrows <= 0) return;
  const int tid = threadIdx.x, lane = tid & 31, wg = tid >> 7, warp = (tid >> 5) & 3;

  const int* list = p.kv_index + (bh * p.NG + g) * p.kmax;
  const int count = trim_count<NT>(list, clamp_count(__ldg(p.kv_count + bh), p.kmax));
  const T* kbase = p.k + b * p.kb + h * p.kh;
  const T* vbase = p.v + b * p.vb + h * p.vh;
  int klo = 0, khi = p.S, j0 = 0, j1 = count;
  if (R > 1) {
    const int rlen = (p.S + R - 1) / R;
    klo = rr * rlen;
    khi = min(p.S, klo + rlen);
    if (p.flags[bh] == 0) { /* strictly ascending, in range: binary search */
      j0 = list_lower_bound(list, 0, count, klo);
      j1 = list_lower_bound(list, j0, count, khi);
    }
    if (j1 <= j0) return; /* uniform per CTA */
  }

  for (int r = tid; r < BM; r += NT) {
    const bool valid = r < nrows;
    qidx[r] = valid ? row0 + r : -1;
    const float l = valid ? p.lse[bh * p.S + row0 + r] : INFINITY;
    lse2[r] = l == -INFINITY ? INFINITY : l * DSV_LOG2E;
    dlt[r] = valid ? p.delta[bh * p.S + row0 + r] : 0.f;
  }
  __syncthreads();
  {
    const T* qb = p.q + b * p.qb + h * p.qh;
    const T* gb = p.dout + b * p.gb + h * p.gh;
    gather_rows_async<T, D, NT, 64, true>(Qs, qb, p.qs, qidx, 64);
    gather_rows_async<T, D, NT, 64, true>(Qs + QE, qb, p.qs, qidx + 64, 64);
    gather_rows_async<T, D, NT, 64, true>(dOs, gb, p.gs, qidx, 64);
    gather_rows_async<T, D, NT, 64, true>(dOs + QE, gb, p.gs, qidx + 64, 64);
  }
  const int ntiles = (j1 - j0 + BN - 1) / BN;
  KeyGather<T, D, NT, BN, true, int, false, 1> ix;
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

  float dq[D / 8][4], acc[D / 8][4];
  float s[BN / 8][4], dp[BN / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.f;
#pragma unroll
  for (int i = 0; i < BN / 8; ++i) {
    s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
    dp[i][0] = dp[i][1] = dp[i][2] = dp[i][3] = 0.f;
  }
  const int wl0 = warp * 16 + (lane >> 2);  /* the lane's first row in its warpgroup's 64 */
  const int lr0 = 64 * wg + wl0, lr1 = lr0 + 8; /* ... in the CTA's 128 */
  const uint64_t qdesc = wg_desc(smem_u32(Qs + wg * QE), 16, 1024);
  const uint64_t dodesc = wg_desc(smem_u32(dOs + wg * QE), 16, 1024);
  const uint64_t kdesc0 = wg_desc(ks0, 16, 1024);
  const uint64_t vdesc0 = wg_desc(vs0, 16, 1024);
  const uint64_t ktdesc0 = wg_desc(ks0, BN * 128, 1024);
  /* the 128-row products: warpgroup 0 dV_t = P^T dO, warpgroup 1 dK_t = dS^T Q; A = the P (dS)
   * tiles read key-major (MN-major), B = the two dO (Q) tiles MN-major; k16 step kk reads rows
   * 16 kk .. 16 kk + 15 of the 128 */
  const uint64_t adesc0 = wg_desc(smem_u32(wg ? dSs : Ps), BN * 128, 1024);
  const uint64_t bdesc0 = wg_desc(smem_u32(wg ? Qs : dOs), 64 * 128, 1024);
  float* red = (wg ? p.dkacc : p.dvacc) + bh * (size_t)p.S * D;

  for (int t = 0; t < ntiles; ++t) {
    const int buf = t % NS;
    cp_async_wait<NS - 2>();
    fence_proxy_async_smem(); /* this thread's cp.async writes -> visible to the tensor cores */
    __syncthreads();          /* tile t landed for all; both warpgroups' MMAs of tile t - 1
                                 (readers of stage buf ^ 1 and of the P / dS tiles) are done */
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

    /* P = exp(scale s - lse), dS = P (dP - delta) (without the scale factor), packed. Rows
     * past the group's end (zero Q and dO rows; a whole warpgroup of them in a partial last
     * group) give P = dS = 0 by selects, so that a non-finite K or V row (0 x inf) cannot
     * reach the 128-row dK / dV products through them. */
    const float ls0 = lse2[lr0], ls1 = lse2[lr1];
    const float dl0 = dlt[lr0], dl1 = dlt[lr1];
    const bool rv0 = lr0 < nrows, rv1 = lr1 < nrows;
    uint32_t pa[BN / 16][4], da[BN / 16][4];
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt) {
      const int col = nt * 8 + (lane & 3) * 2;
      const bool v0 = ki[col] >= 0, v1 = ki[col + 1] >= 0;
      const float p0 = v0 && rv0 ? fast_exp2(s[nt][0] * p.scale_log2 - ls0) : 0.f;
      const float p1 = v1 && rv0 ? fast_exp2(s[nt][1] * p.scale_log2 - ls0) : 0.f;
      const float p2 = v0 && rv1 ? fast_exp2(s[nt][2] * p.scale_log2 - ls1) : 0.f;
      const float p3 = v1 && rv1 ? fast_exp2(s[nt][3] * p.scale_log2 - ls1) : 0.f;
      const int kk = nt >> 1, hf = (nt & 1) * 2;
      pa[kk][hf] = Elem<T>::pack(p0, p1);
      pa[kk][hf + 1] = Elem<T>::pack(p2, p3);
      da[kk][hf] = rv0 ? Elem<T>::pack(p0 * (dp[nt][0] - dl0), p1 * (dp[nt][1] - dl0)) : 0u;
      da[kk][hf + 1] = rv1 ? Elem<T>::pack(p2 * (dp[nt][2] - dl1), p3 * (dp[nt][3] - dl1)) : 0u;
    }
    /* this warpgroup's halves of P and dS to shared memory (the previous tile's readers
     * finished before this tile's top barrier), before dQ += dS K is issued: da is that MMA's A
     * operand, and a wgmma's A registers may not be accessed (read either) until a wait_group
     * covers it (PTX ISA, wgmma.mma_async) */
    bwg_store_frag<T, BN>(Ps + wg * PE, pa, wl0, lane);
    bwg_store_frag<T, BN>(dSs + wg * PE, da, wl0, lane);
    fence_proxy_async_smem();
    /* dQ += dS K (this warpgroup's rows), in flight across the barrier */
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
      Wgmma<T, D>::rs_bt(&dq[0][0], da[kk], wg_desc_add(ktdesc0, toff + kk * 2048), 1);
    wg_commit();
    __syncthreads(); /* both warpgroups' halves written */
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk)
      WgmmaTT<T, D>::ss(&acc[0][0], wg_desc_add(adesc0, kk * 2048),
                        wg_desc_add(bdesc0, (kk >> 2) * (QE * 2) + (kk & 3) * 2048), kk > 0);
    wg_commit();
    wg_wait<0>(); /* dQ and the 128-row product; before the next top barrier */
    wg_fence_regs<D / 2>(&dq[0][0]);
    wg_fence_regs<D / 2>(&acc[0][0]);
    bwg_reduce_rows<D>(red, acc, ki, warp, lane);
  }
  cp_async_wait<0>();

  const int row0w = row0 + 64 * wg, nrw = nrows - 64 * wg; /* this warpgroup's rows */
  if (RG > 1) {
    float* dqa = p.dqacc + bh * (size_t)p.S * D;
    const int tq = lane & 3;
    const bool even = (tq & 1) == 0;
    const int lrow = even ? wl0 : wl0 + 8;
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      const float x0 = __shfl_xor_sync(0xffffffffu, even ? dq[i][2] : dq[i][0], 1);
      const float x1 = __shfl_xor_sync(0xffffffffu, even ? dq[i][3] : dq[i][1], 1);
      const float4 val = even ? make_float4(dq[i][0], dq[i][1], x0, x1)
                              : make_float4(x0, x1, dq[i][2], dq[i][3]);
      if (lrow < nrw)
        atomicAdd(reinterpret_cast<float4*>(dqa + (size_t)(row0w + lrow) * D + i * 8 +
                                            (tq >> 1) * 4),
                  val);
    }
    return;
  }
  dq_store<T, D>(p, b, h, row0w, wl0, wl0 + 8, nrw, lane, dq);
#endif
}

template <typename T, int D>
static int launch_g128_bwd(const dsv_attn_shape* sh, BwdParams<T>& prm, cudaStream_t stream) {
  constexpr int NS = 2, MINB = 1;
  const size_t smem = g128_bwd_smem<T, D, NS>();
  auto kern = g128_bwd_kernel<T, D, NS, MINB>;
  if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) !=
      cudaSuccess)
    return DSV_ERR_CUDA;
  prm.chunks = prm.G / 128;
  dim3 grid((unsigned)(prm.NG * prm.chunks), (unsigned)(sh->heads * prm.nranges),
            (unsigned)sh->batch);
  kern<<<grid, 256, smem, stream>>>(prm);
  if (cudaGetLastError() != cudaSuccess) return DSV_ERR_CUDA;
  ++g_g128_runs[1];
  return DSV_OK;
}

/* The query-major passes: where the variant applies, the shipped dQ-only pass of the key-major
 * heads (wgmma), then the variant for the heads of path 0; else the shipped passes. */
template <typename T, int D>
static int g128_qmajor_d(const dsv_attn_shape* sh, BwdParams<T>& prm, int wgmma,
                         cudaStream_t stream) {
  if (g128_applies<T>(sh, prm.G, prm.ks, prm.vs, wgmma)) {
    if (prm.km_enabled) {
      const int st = bwd_wg_launch_one<T, D, false>(sh, prm, stream);
      if (st != DSV_OK) return st;
    }
    return launch_g128_bwd<T, D>(sh, prm, stream);
  }
  return qmajor_passes<T, D>(sh, prm, wgmma, stream);
}

template <typename T>
static int g128_qmajor(const dsv_attn_shape* sh, BwdParams<T>& prm, int wgmma,
                       cudaStream_t stream) {
  switch (sh->head_dim) {
    case 64: return g128_qmajor_d<T, 64>(sh, prm, wgmma, stream);
    case 128: return g128_qmajor_d<T, 128>(sh, prm, wgmma, stream);
    default: return bwd_qmajor_launch<T>(sh, prm, wgmma, stream);
  }
}

}  // namespace dsv_attn

extern "C" long long dsv_dev_g128_runs(int which) {
  return (which == 0 || which == 1) ? dsv_attn::g_g128_runs[which] : -1;
}

extern "C" int dsv_dev_sparse_attention_fwd_g128_cuda(int g128, const dsv_attn_shape* p,
                                                      dsv_bshd q, dsv_bshd k, dsv_bshd v,
                                                      const int32_t* kv_index,
                                                      const int32_t* kv_count, dsv_bshd out,
                                                      void* lse, void* workspace,
                                                      size_t workspace_bytes, void* stream) {
  (void)workspace;
  (void)workspace_bytes;
  g_g128_on = g128 != 0;
  const int st = fwd_entry(fwd_g128<__half>, fwd_g128<__nv_bfloat16>, nullptr, p, q, k, v,
                           kv_index, kv_count, out, lse, stream);
  g_g128_on = 1;
  return st;
}

extern "C" int dsv_sparse_attention_fwd_cuda(const dsv_attn_shape* p, dsv_bshd q, dsv_bshd k,
                                             dsv_bshd v, const int32_t* kv_index,
                                             const int32_t* kv_count, dsv_bshd out, void* lse,
                                             void* workspace, size_t workspace_bytes,
                                             void* stream) {
  return dsv_dev_sparse_attention_fwd_g128_cuda(1, p, q, k, v, kv_index, kv_count, out, lse,
                                                workspace, workspace_bytes, stream);
}

extern "C" int dsv_dev_sparse_attention_bwd_g128_cuda(
    int g128, const dsv_attn_shape* p, dsv_bshd q, dsv_bshd k, dsv_bshd v, dsv_bshd out,
    dsv_bshd dout, const void* lse, const int32_t* kv_index, const int32_t* kv_count,
    dsv_bshd dq, dsv_bshd dk, dsv_bshd dv, void* workspace, size_t workspace_bytes,
    void* stream) {
  g_g128_on = g128 != 0;
  const BwdQmajor qm = {g128_qmajor<__half>, g128_qmajor<__nv_bfloat16>};
  const int st = bwd_entry(qm, p, q, k, v, out, dout, lse, kv_index, kv_count, dq, dk, dv,
                           workspace, workspace_bytes, stream);
  g_g128_on = 1;
  return st;
}

extern "C" int dsv_sparse_attention_bwd_cuda(const dsv_attn_shape* p, dsv_bshd q, dsv_bshd k,
                                             dsv_bshd v, dsv_bshd out, dsv_bshd dout,
                                             const void* lse, const int32_t* kv_index,
                                             const int32_t* kv_count, dsv_bshd dq, dsv_bshd dk,
                                             dsv_bshd dv, void* workspace,
                                             size_t workspace_bytes, void* stream) {
  return dsv_dev_sparse_attention_bwd_g128_cuda(1, p, q, k, v, out, dout, lse, kv_index,
                                                kv_count, dq, dk, dv, workspace,
                                                workspace_bytes, stream);
}
