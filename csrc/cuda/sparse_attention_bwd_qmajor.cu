/*
 * sparse_attention_bwd_qmajor.cu - the query-major passes of the sparse attention backward: one
 * CTA per chunk of a group's queries, keys gathered per tile as in the forward, S, P, dP, dS
 * recomputed, dQ accumulated in registers; for the heads of the query-major dK / dV path also
 * dV_t = P^T dO and dK_t = dS^T Q per key tile, added to fp32 accumulators (TMA bulk
 * reductions), optionally split into key ranges (see sparse_attention_bwd.cu). The dQ-only pass
 * runs on wgmma where it applies (sparse_attention_bwd_wg.cuh).
 */
#include "sparse_attention_bwd.cuh"
#include "sparse_attention_bwd_wg.cuh" /* the query-major backward on wgmma (sm_90a) */

namespace dsv_attn {

/* Query-major kernel: dQ for every head of its path; with ATOMIC also dK/dV by reductions.
 * BLK > 1: block lists (kv_block), dQ only (their dK / dV are key-major): the key tiles are
 * read through list_key as in the forward. */
template <typename T, int D, int BM, int BN, int NS, bool ATOMIC, bool BULK, int BLK = 1>
__global__ void __launch_bounds__(BM * 2) bwd_qmajor_kernel(const BwdParams<T> p) {
  static_assert(BLK == 1 || !ATOMIC, "block lists: dQ only");
  constexpr int NT = BM * 2, NW = BM / 16;
  constexpr int LD = D + 8;
  constexpr int LDP = BN + 8;
  constexpr int LDF = D + 4; /* fp32 staging rows: 16-byte aligned, float2 stores conflict-free */
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* Qs = reinterpret_cast<T*>(smem_raw);
  T* dOs = Qs + BM * LD;
  T* Ks = dOs + BM * LD;      /* [NS][BN][LD] */
  T* Vs = Ks + NS * BN * LD;  /* [NS][BN][LD] */
  T* Ps = Vs + NS * BN * LD;  /* [BM][LDP], ATOMIC only */
  T* dSs = Ps + (ATOMIC ? BM * LDP : 0);
  float* dVst = reinterpret_cast<float*>(dSs + (ATOMIC ? BM * LDP : 0)); /* [BN][LDF], BULK */
  float* dKst = dVst + (ATOMIC && BULK ? BN * LDF : 0);                  /* [BN][LDF], BULK */
  float* lse2 = dKst + (ATOMIC && BULK ? BN * LDF : 0);                  /* [BM] */
  float* dlt = lse2 + BM;                                                 /* [BM] */
  int* kidx = reinterpret_cast<int*>(dlt + BM);                           /* [NS][BN] */
  int* qidx = kidx + NS * BN;                                             /* [BM] */

  /* With ATOMIC and nranges R > 1, blockIdx.y = h * R + r: the CTA handles only the keys of
   * its group's list in range r of [0, S) (a contiguous run of the sorted list, found by
   * binary search; unsorted lists are masked instead), so the CTAs running at one time touch
   * one range's K, V and dK / dV accumulators, which then stay in L2; dQ is reduced over the
   * ranges with vector reductions into an fp32 buffer. */
  const int RG = ATOMIC ? p.nranges : 1; /* ranges in the grid */
  const int h = blockIdx.y / RG, rr = blockIdx.y - h * RG, b = blockIdx.z;
  const size_t bh = (size_t)b * p.H + h;
  if (p.path[bh] != (ATOMIC ? 0 : 1)) return;
  const int R = ATOMIC ? p.nrh[bh] : 1; /* this head's ranges */
  if (rr >= R) return;
  const int g = blockIdx.x / p.chunks;
  const int chunk = blockIdx.x - g * p.chunks;
  const int row0 = g * p.G + chunk * BM;
  const int row_end = min(g * p.G + p.G, p.S);
  const int nrows = min(BM, row_end - row0);
  if (nrows <= 0) return;
  /* a merged 128-query block (the tuning's merge): bwd_wg128_kernel has its rows */
  if (ATOMIC && p.ucnt && __ldg(p.ucnt + bh * p.NSG + row0 / 128) >= 0 && !__ldg(p.knf + bh))
    return;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  const int* list = p.kv_index + (bh * p.NG + g) * p.kmax;
  const int count = trim_count<NT>(list, clamp_count(__ldg(p.kv_count + bh), p.kmax));
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
    float l = valid ? p.lse[bh * p.S + row0 + r] : INFINITY;
    lse2[r] = l == -INFINITY ? INFINITY : l * DSV_LOG2E;
    dlt[r] = valid ? p.delta[bh * p.S + row0 + r] : 0.f;
  }
  __syncthreads();
  gather_rows_async<T, D, NT>(Qs, p.q + b * p.qb + h * p.qh, p.qs, qidx, BM);
  gather_rows_async<T, D, NT>(dOs, p.dout + b * p.gb + h * p.gh, p.gs, qidx, BM);
  const int ntiles = (j1 - j0 + BN - 1) / BN;
  /* NS-stage pipeline, as in the forward (group 0 also holds the Q and dO tiles) */
  PaddedKeyGather<T, D, NT, BN, BLK> ix; /* list entries loaded one tile ahead, as in the forward */
  ix.init(kbase, p.ks, vbase, p.vs);
#pragma unroll
  for (int st = 0; st < NS - 1; ++st) {
    if (st < ntiles) {
      ix.load(list, j0 + st * BN, j1);
      ix.issue(Ks + st * BN * LD, Vs + st * BN * LD, klo, khi, kidx + st * BN);
    }
    cp_async_commit();
  }
  ix.load(list, j0 + (NS - 1) * BN, j1);

  float dq[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.f;
  const int lr0 = warp * 16 + (lane >> 2), lr1 = lr0 + 8;

  for (int t = 0; t < ntiles; ++t) {
    const int buf = t % NS;
    cp_async_wait<NS - 2>();
    __syncthreads(); /* tile t visible to all; stage (t - 1) % NS and Ps / dSs free again */
    {
      const int tn = t + NS - 1;
      if (tn < ntiles) {
        const int nb = tn % NS;
        ix.issue(Ks + nb * BN * LD, Vs + nb * BN * LD, klo, khi, kidx + nb * BN);
        ix.load(list, j0 + (tn + 1) * BN, j1);
      }
      cp_async_commit();
    }
    const T* Kt = Ks + buf * BN * LD;
    const T* Vt = Vs + buf * BN * LD;
    const int* ki = kidx + buf * BN;
    const float ls0 = lse2[lr0], ls1 = lse2[lr1];
    const float dl0 = dlt[lr0], dl1 = dlt[lr1];

    float s[BN / 8][4], dp[BN / 8][4];
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) {
      s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
      dp[i][0] = dp[i][1] = dp[i][2] = dp[i][3] = 0.f;
    }
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t qa[4], ga[4];
      load_a<LD>(qa, Qs, warp * 16, kk * 16, lane);
      load_a<LD>(ga, dOs, warp * 16, kk * 16, lane);
#pragma unroll
      for (int np = 0; np < BN / 16; ++np) {
        uint32_t kf[4], vf[4];
        load_b<LD>(kf, Kt, np * 16, kk * 16, lane);
        mma16816<T>(s[2 * np], qa, kf);
        mma16816<T>(s[2 * np + 1], qa, kf + 2);
        load_b<LD>(vf, Vt, np * 16, kk * 16, lane);
        mma16816<T>(dp[2 * np], ga, vf);
        mma16816<T>(dp[2 * np + 1], ga, vf + 2);
      }
    }
    /* P = exp(scale * s - lse), dS = P * (dP - delta) (dS without the scale factor) */
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt) {
      const int col = nt * 8 + (lane & 3) * 2;
      const bool v0 = ki[col] >= 0, v1 = ki[col + 1] >= 0;
      const float p0 = v0 ? fast_exp2(s[nt][0] * p.scale_log2 - ls0) : 0.f;
      const float p1 = v1 ? fast_exp2(s[nt][1] * p.scale_log2 - ls0) : 0.f;
      const float p2 = v0 ? fast_exp2(s[nt][2] * p.scale_log2 - ls1) : 0.f;
      const float p3 = v1 ? fast_exp2(s[nt][3] * p.scale_log2 - ls1) : 0.f;
      s[nt][0] = p0; s[nt][1] = p1; s[nt][2] = p2; s[nt][3] = p3;
      dp[nt][0] = p0 * (dp[nt][0] - dl0);
      dp[nt][1] = p1 * (dp[nt][1] - dl0);
      dp[nt][2] = p2 * (dp[nt][2] - dl1);
      dp[nt][3] = p3 * (dp[nt][3] - dl1);
    }
    /* dQ += dS K */
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t da[4];
      da[0] = Elem<T>::pack(dp[2 * kk][0], dp[2 * kk][1]);
      da[1] = Elem<T>::pack(dp[2 * kk][2], dp[2 * kk][3]);
      da[2] = Elem<T>::pack(dp[2 * kk + 1][0], dp[2 * kk + 1][1]);
      da[3] = Elem<T>::pack(dp[2 * kk + 1][2], dp[2 * kk + 1][3]);
#pragma unroll
      for (int dd = 0; dd < D / 16; ++dd) {
        uint32_t kf[4];
        load_b_t<LD>(kf, Kt, kk * 16, dd * 16, lane);
        mma16816<T>(dq[2 * dd], da, kf);
        mma16816<T>(dq[2 * dd + 1], da, kf + 2);
      }
    }
    if (ATOMIC) {
      /* stage P and dS (rows = queries, cols = keys) */
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt) {
        const int col = nt * 8 + (lane & 3) * 2;
        *reinterpret_cast<uint32_t*>(Ps + lr0 * LDP + col) = Elem<T>::pack(s[nt][0], s[nt][1]);
        *reinterpret_cast<uint32_t*>(Ps + lr1 * LDP + col) = Elem<T>::pack(s[nt][2], s[nt][3]);
        *reinterpret_cast<uint32_t*>(dSs + lr0 * LDP + col) = Elem<T>::pack(dp[nt][0], dp[nt][1]);
        *reinterpret_cast<uint32_t*>(dSs + lr1 * LDP + col) = Elem<T>::pack(dp[nt][2], dp[nt][3]);
      }
      /* the previous tile's bulk reductions must have read the fp32 staging tiles */
      if (BULK) bulk_wait_read0();
      __syncthreads();
      /* units of 16 MTP keys x 32 columns of D: dV_t = P^T dO, dK_t = dS^T Q. A warp's MTP
       * key blocks share the dO / Q fragments (fewer shared-memory reads). */
      constexpr int MT = BN / 16, DC = D / 32;
      constexpr int MTP = (MT % 2 == 0 && (MT / 2) * DC >= NW) ? 2 : 1;
      constexpr int NU = (MT / MTP) * DC;
      float* dva = p.dvacc + bh * (size_t)p.S * D;
      float* dka = p.dkacc + bh * (size_t)p.S * D;
      const int tq = lane & 3;
      for (int u = warp; u < NU; u += NW) {
        const int mp = u / DC, dc = u - mp * DC;
        float av[MTP][4][4], ak[MTP][4][4];
#pragma unroll
        for (int m = 0; m < MTP; ++m)
#pragma unroll
          for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) av[m][j][e] = ak[m][j][e] = 0.f;
#pragma unroll
        for (int kq = 0; kq < BM / 16; ++kq) {
          uint32_t bo[2][4], bq[2][4];
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            load_b_t<LD>(bo[hh], dOs, kq * 16, dc * 32 + hh * 16, lane);
            load_b_t<LD>(bq[hh], Qs, kq * 16, dc * 32 + hh * 16, lane);
          }
#pragma unroll
          for (int m = 0; m < MTP; ++m) {
            uint32_t pa[4], sa[4];
            load_a_t<LDP>(pa, Ps, kq * 16, (mp * MTP + m) * 16, lane);
            load_a_t<LDP>(sa, dSs, kq * 16, (mp * MTP + m) * 16, lane);
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
              mma16816<T>(av[m][2 * hh], pa, bo[hh]);
              mma16816<T>(av[m][2 * hh + 1], pa, bo[hh] + 2);
              mma16816<T>(ak[m][2 * hh], sa, bq[hh]);
              mma16816<T>(ak[m][2 * hh + 1], sa, bq[hh] + 2);
            }
          }
        }
#pragma unroll
        for (int m = 0; m < MTP; ++m) {
          const int mt = mp * MTP + m;
          if (BULK) {
            /* fp32 tiles to shared memory, rows = keys */
            const int r0 = mt * 16 + (lane >> 2);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const int col = dc * 32 + j * 8 + tq * 2;
              *reinterpret_cast<float2*>(dVst + r0 * LDF + col) = make_float2(av[m][j][0], av[m][j][1]);
              *reinterpret_cast<float2*>(dVst + (r0 + 8) * LDF + col) =
                  make_float2(av[m][j][2], av[m][j][3]);
              *reinterpret_cast<float2*>(dKst + r0 * LDF + col) = make_float2(ak[m][j][0], ak[m][j][1]);
              *reinterpret_cast<float2*>(dKst + (r0 + 8) * LDF + col) =
                  make_float2(ak[m][j][2], ak[m][j][3]);
            }
          } else {
            /* 16-byte reductions straight from registers (pairs of lanes swap halves) */
            const int krow = mt * 16 + (lane >> 2) + ((tq & 1) ? 8 : 0);
            const int kid = ki[krow];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const bool even = (tq & 1) == 0;
              float x0 = __shfl_xor_sync(0xffffffffu, even ? av[m][j][2] : av[m][j][0], 1);
              float x1 = __shfl_xor_sync(0xffffffffu, even ? av[m][j][3] : av[m][j][1], 1);
              float y0 = __shfl_xor_sync(0xffffffffu, even ? ak[m][j][2] : ak[m][j][0], 1);
              float y1 = __shfl_xor_sync(0xffffffffu, even ? ak[m][j][3] : ak[m][j][1], 1);
              const float4 vv = even ? make_float4(av[m][j][0], av[m][j][1], x0, x1)
                                     : make_float4(x0, x1, av[m][j][2], av[m][j][3]);
              const float4 kv = even ? make_float4(ak[m][j][0], ak[m][j][1], y0, y1)
                                     : make_float4(y0, y1, ak[m][j][2], ak[m][j][3]);
              const int col = dc * 32 + j * 8 + (tq >> 1) * 4;
              if (kid >= 0) {
                atomicAdd(reinterpret_cast<float4*>(dva + (size_t)kid * D + col), vv);
                atomicAdd(reinterpret_cast<float4*>(dka + (size_t)kid * D + col), kv);
              }
            }
          }
        }
      }
      if (BULK) {
        /* one bulk reduction per key row of dV and dK (D fp32 each), issued by 2 BN threads */
        fence_proxy_async_smem();
        __syncthreads();
        for (int i = tid; i < 2 * BN; i += NT) {
          const int row = i < BN ? i : i - BN;
          const int kid = ki[row];
          if (kid >= 0)
            bulk_reduce_add_f32((i < BN ? dva : dka) + (size_t)kid * D,
                                (i < BN ? dVst : dKst) + row * LDF, D * sizeof(float));
        }
        bulk_commit();
      }
    }
  }
  if (BULK) bulk_wait_read0(); /* shared memory must stay until the bulk reads are done */
  cp_async_wait<0>();

  if (RG > 1) {
    /* partial dQ of this key range (every head's, once the grid has ranges): 16-byte
     * reductions (pairs of lanes swap halves) */
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
        atomicAdd(reinterpret_cast<float4*>(dqa + (size_t)(row0 + lrow) * D + i * 8 + (tq >> 1) * 4),
                  val);
    }
    return;
  }

  dq_store<T, D>(p, b, h, row0, lr0, lr1, nrows, lane, dq);
}

template <typename T, int D, int BM, int BN, int NS, bool ATOMIC, bool BULK, int BLK = 1>
static int launch_qmajor(const dsv_attn_shape* sh, BwdParams<T>& prm, cudaStream_t stream) {
  constexpr int LD = D + 8, LDP = BN + 8, LDF = D + 4;
  const size_t smem = (size_t)(2 * BM + 2 * NS * BN) * LD * sizeof(T) +
                      (ATOMIC ? (size_t)2 * BM * LDP * sizeof(T) : 0) +
                      (ATOMIC && BULK ? (size_t)2 * BN * LDF * sizeof(float) : 0) +
                      (size_t)2 * BM * sizeof(float) + (size_t)(NS * BN + BM) * sizeof(int);
  auto kern = bwd_qmajor_kernel<T, D, BM, BN, NS, ATOMIC, BULK, BLK>;
  if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) !=
      cudaSuccess)
    return DSV_ERR_CUDA;
  prm.chunks = (prm.G + BM - 1) / BM;
  dim3 grid((unsigned)(prm.NG * prm.chunks), (unsigned)(sh->heads * (ATOMIC ? prm.nranges : 1)),
            (unsigned)sh->batch);
  kern<<<grid, BM * 2, smem, stream>>>(prm);
  return cudaGetLastError() == cudaSuccess ? DSV_OK : DSV_ERR_CUDA;
}

/* The shipped query-major configuration: 32 keys x 2 cp.async stages (BN x NS), dK / dV added
 * by TMA bulk reductions of fp32 tiles staged in shared memory (the other tiles and the
 * 16-byte register reductions are in csrc/dev/attn_bwd_variants.cu). */
template <typename T, int D, int BM, bool ATOMIC>
static int qmajor_cfg(const dsv_attn_shape* sh, BwdParams<T>& prm, cudaStream_t stream) {
  constexpr bool B = ATOMIC; /* the bulk form only matters where dK / dV are reduced */
  return launch_qmajor<T, D, BM, 32, 2, ATOMIC, B>(sh, prm, stream);
}

/* Merged groups (the tuning's merge, prm.uidx set by the host dispatch; merged_groups.cuh): the
 * union of each 128-query block's lists (union_build_kernel: heads of the query-major dK / dV
 * path, not scattered ones unless merge >= 1; K checked head-wide, Q and dO where merged), then
 * the merged blocks on bwd_wg128_kernel over their unions; the query-major kernel then skips
 * their groups. */
template <typename T, int D>
static int union_passes(const dsv_attn_shape* sh, BwdParams<T>& prm, cudaStream_t stream) {
  UnionBuild ub = union_build_of(prm, D);
  ub.path = prm.path, ub.kboff = prm.kboff, ub.kbcount = prm.kbcount, ub.nkb = prm.nkb;
  ub.hc = prm.k, ub.hcb = prm.kb, ub.hcs = prm.ks, ub.hch = prm.kh;
  ub.lc[0] = prm.q, ub.lcb[0] = prm.qb, ub.lcs[0] = prm.qs, ub.lch[0] = prm.qh;
  ub.lc[1] = prm.dout, ub.lcb[1] = prm.gb, ub.lcs[1] = prm.gs, ub.lch[1] = prm.gh;
  ub.nlc = 2;
  const int st = union_build_launch<T>(ub, (int)sh->batch, stream);
  if (st != DSV_OK) return st;
  BwdParams<T> pu = union_launch_params(prm);
  return bwd_wg128_launch<T, D, BwdParams<T>, true>(sh, pu, stream);
}

/* dQ of the key-major heads (no dK / dV), then dQ and the dK / dV reductions of the others.
 * With wgmma (an sm_90a build on a 9.0 device, the tuning's wgmma), D 64 / 128 and G >= 64, the
 * dQ-only pass runs on wgmma (sparse_attention_bwd_wg.cuh), and so does the pass with
 * reductions: groups of a multiple of 128 queries with the tuning's g128 on bwd_wg128_kernel
 * (one reduction per key and 128 rows), the others with the tuning's qm_wgmma on bwd_wg_kernel
 * (64 rows, reductions as whole lines; PERF_LOG v34), else on mma.sync. */
template <typename T, int D>
static int qmajor_passes(const dsv_attn_shape* sh, BwdParams<T>& prm, int wgmma, cudaStream_t stream) {
  int st = DSV_OK;
  int wg = 0; /* the dQ-only pass on wgmma */
  if constexpr (D == 64 || D == 128) wg = wgmma && bwd_wg_applies<T, D>(prm);
  bool un = false; /* merged groups */
  if constexpr (D == 64 || D == 128) un = wgmma && prm.uidx && bwd_wg_strides_fit<T>(prm);
  if (!un) prm.ucnt = nullptr;
  if (prm.G <= 32) {
    if (prm.km_enabled && (st = qmajor_cfg<T, D, 32, false>(sh, prm, stream)) != DSV_OK) return st;
    if constexpr (D == 64 || D == 128)
      if (un && (st = union_passes<T, D>(sh, prm, stream)) != DSV_OK) return st;
    if ((st = qmajor_cfg<T, D, 32, true>(sh, prm, stream)) != DSV_OK) return st;
  } else {
    if (prm.km_enabled) {
      if constexpr (D == 64 || D == 128)
        if (wg) st = bwd_wg_launch_one<T, D, false>(sh, prm, stream);
      if (!wg) st = qmajor_cfg<T, D, 64, false>(sh, prm, stream);
      if (st != DSV_OK) return st;
    }
    if constexpr (D == 64 || D == 128)
      if (un && (st = union_passes<T, D>(sh, prm, stream)) != DSV_OK) return st;
    if constexpr (D == 64 || D == 128) {
      if (wg && prm.g128 && prm.G % 128 == 0) return bwd_wg128_launch<T, D>(sh, prm, stream);
      if (wg && prm.qm_wgmma) return bwd_wg_launch_one<T, D, true>(sh, prm, stream);
    }
    if ((st = qmajor_cfg<T, D, 64, true>(sh, prm, stream)) != DSV_OK) return st;
  }
  return DSV_OK;
}

template <typename T>
int bwd_qmajor_launch(const dsv_attn_shape* sh, BwdParams<T>& prm, int wgmma, cudaStream_t stream) {
  switch (sh->head_dim) {
    case 64: return qmajor_passes<T, 64>(sh, prm, wgmma, stream);
    case 96: return qmajor_passes<T, 96>(sh, prm, wgmma, stream);
    case 128: return qmajor_passes<T, 128>(sh, prm, wgmma, stream);
    case 256: return qmajor_passes<T, 256>(sh, prm, wgmma, stream);
    default: return DSV_ERR_UNSUPPORTED;
  }
}

/* dQ of block lists (kv_block 16 or 64; head_dim <= 128, as their key-major dK / dV pass): the
 * dQ-only kernels of the token lists with their shipped tiles, wgmma where it applies (as in
 * qmajor_passes), else mma.sync (32 keys x 2 stages, 32 or 64 queries). */
template <typename T, int D, int BLK>
static int blocks_dq_d(const dsv_attn_shape* sh, BwdParams<T>& prm, int wgmma,
                       cudaStream_t stream) {
  if constexpr (D == 64 || D == 128)
    if (wgmma && bwd_wg_applies<T, D>(prm))
      return bwd_wg_launch_one<T, D, false, BwdParams<T>, false, BLK>(sh, prm, stream);
  if (prm.G <= 32) return launch_qmajor<T, D, 32, 32, 2, false, false, BLK>(sh, prm, stream);
  return launch_qmajor<T, D, 64, 32, 2, false, false, BLK>(sh, prm, stream);
}

template <typename T, int BLK>
static int blocks_dq_blk(const dsv_attn_shape* sh, BwdParams<T>& prm, int wgmma,
                         cudaStream_t stream) {
  switch (sh->head_dim) {
    case 64: return blocks_dq_d<T, 64, BLK>(sh, prm, wgmma, stream);
    case 96: return blocks_dq_d<T, 96, BLK>(sh, prm, wgmma, stream);
    case 128: return blocks_dq_d<T, 128, BLK>(sh, prm, wgmma, stream);
    default: return DSV_ERR_UNSUPPORTED;
  }
}

template <typename T>
int bwd_blocks_dq_launch(const dsv_attn_shape* sh, BwdParams<T>& prm, int wgmma,
                         cudaStream_t stream) {
  switch (sh->kv_block) {
    case 16: return blocks_dq_blk<T, 16>(sh, prm, wgmma, stream);
    case 64: return blocks_dq_blk<T, 64>(sh, prm, wgmma, stream);
    default: return DSV_ERR_UNSUPPORTED;
  }
}

template int bwd_blocks_dq_launch<__half>(const dsv_attn_shape*, BwdParams<__half>&, int,
                                          cudaStream_t);
template int bwd_blocks_dq_launch<__nv_bfloat16>(const dsv_attn_shape*, BwdParams<__nv_bfloat16>&,
                                                 int, cudaStream_t);

template int bwd_qmajor_launch<__half>(const dsv_attn_shape*, BwdParams<__half>&, int, cudaStream_t);
template int bwd_qmajor_launch<__nv_bfloat16>(const dsv_attn_shape*, BwdParams<__nv_bfloat16>&, int,
                                              cudaStream_t);

}  // namespace dsv_attn
