/*
 * profile_attention.cu - attention profile on sampled rows (sm_90a).
 *
 * For sampled row i of (b, h): P_j = softmax_j(scale * q_i . k_j) over all S keys; c_i = size of
 * the smallest set of keys whose probabilities reach theta; sparsity = 1 - mean_i c_i / S; with
 * an index, recall = mean_i of the mass of the distinct entries of the row's list.
 * Rows outside [0, S) are left out of the means; no usable row gives NaN. A row whose logits
 * contain NaN or +inf (or are all -inf) has no defined softmax: it makes its (b, h) NaN.
 *
 * Kernels (per chunk of row tiles, so the workspace stays bounded, about 256 MB at most):
 *  1. logits: tensor-core MMA (bf16/fp16, fp32 accumulate) of 64 sampled rows x a chunk of keys,
 *     the fp32 logits written to the workspace, with per-(row, key chunk) online max / sum-exp.
 *  2. select: one CTA per row; merges the partial max / sum, then an MSB-first radix select
 *     (11 + 11 + 10 bits) on the order-preserving logit key whose histograms count elements and
 *     sum probability mass, to find the exact c_i; recall from a shared-memory bitmap of keys.
 *  3. finalize: per (b, h) means in a fixed order.
 */
#include "cuda_common.cuh"

#define PA_WARPS 4
#define PA_THREADS (32 * PA_WARPS)
#define PA_ROWS 64 /* rows per logits CTA */
#define PA_TILE 64 /* keys per staged tile */
#define PA_KC 2048 /* keys per logits CTA */
#define PA_SEL_THREADS 256
#define PA_WS_CAP ((size_t)256 << 20)

struct dsv_pa_args {
  const void* q;
  const void* k;
  int64_t q_sb, q_ss, q_sh, k_sb, k_ss, k_sh;
  const int32_t* rows;
  const int32_t* kv_index;
  const int32_t* kv_count;
  int64_t S, H, D, R, G, NG, kmax;
  float scale, theta;
  int tiles_per_bh; /* ceil(R / 64) */
  int nkc;          /* key chunks */
  int64_t first_tile;
  int kvec;
  float* logits;  /* [tiles in launch][64][S] */
  float2* part;   /* [tiles in launch][64][nkc] (max, sumexp) */
  float* row_c;   /* [BH * R] c_i, -1 for an unusable row */
  float* row_rec; /* [BH * R] */
};

/* ---- 1. logits ---- */
template <typename T, int DP>
__global__ void __launch_bounds__(PA_THREADS) dsv_pa_logits_kernel(const dsv_pa_args a) {
  constexpr int KS = DP / 16;
  constexpr int SW = DP / 2 + 4;
  constexpr int TL = DP >= 192 ? 32 : 64; /* keys per staged tile (static smem < 48 KB) */
  __shared__ __align__(16) uint32_t ktile[2 * TL * SW];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, j4 = lane & 3;
  const int tl = blockIdx.x / a.nkc, kc = blockIdx.x - tl * a.nkc;
  const int64_t tile_id = a.first_tile + tl;
  const int64_t bh = tile_id / a.tiles_per_bh;
  const int64_t rt = tile_id - bh * a.tiles_per_bh;
  const int64_t b = bh / a.H, h = bh - b * a.H;
  const int64_t S = a.S;
  const int rlA = warp * 16 + (lane >> 2), rlB = rlA + 8; /* rows within the tile */

  /* A fragments of the two rows of this lane */
  uint32_t A[KS][4];
  {
    const T* qb = reinterpret_cast<const T*>(a.q) + b * a.q_sb + h * a.q_sh;
    int64_t posA = -1, posB = -1;
    const int64_t iA = rt * PA_ROWS + rlA, iB = rt * PA_ROWS + rlB;
    if (iA < a.R) posA = a.rows[iA];
    if (iB < a.R) posB = a.rows[iB];
    const bool okA = posA >= 0 && posA < S, okB = posB >= 0 && posB < S;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int col = ks * 16 + j4 * 2 + half * 8;
        float x[4] = {0.f, 0.f, 0.f, 0.f};
        if (okA && col < a.D) x[0] = dsv_to_float(qb[posA * a.q_ss + col]);
        if (okA && col + 1 < a.D) x[1] = dsv_to_float(qb[posA * a.q_ss + col + 1]);
        if (okB && col < a.D) x[2] = dsv_to_float(qb[posB * a.q_ss + col]);
        if (okB && col + 1 < a.D) x[3] = dsv_to_float(qb[posB * a.q_ss + col + 1]);
        A[ks][half * 2 + 0] = dsv_pack2<T>(x[0], x[1]);
        A[ks][half * 2 + 1] = dsv_pack2<T>(x[2], x[3]);
      }
    }
  }

  const T* kb = reinterpret_cast<const T*>(a.k) + b * a.k_sb + h * a.k_sh;
  const int64_t kbeg = (int64_t)kc * PA_KC;
  const int64_t kend = (kbeg + PA_KC) < S ? (kbeg + PA_KC) : S;
  const int ntiles = (int)((kend - kbeg + TL - 1) / TL);
  float* outA = a.logits + ((int64_t)tl * PA_ROWS + rlA) * S;
  float* outB = a.logits + ((int64_t)tl * PA_ROWS + rlB) * S;
  float mA = -INFINITY, sA = 0.f, mB = -INFINITY, sB = 0.f;
  const float scale = a.scale;

  dsv_stage_rows16<T>(ktile, SW, kb, a.k_ss, kbeg, TL, kend, (int)a.D, DP, a.kvec, tid,
                      PA_THREADS);
  cp_async_commit();
  for (int it = 0; it < ntiles; ++it) {
    cp_async_wait_all();
    __syncthreads();
    if (it + 1 < ntiles)
      dsv_stage_rows16<T>(ktile + ((it + 1) & 1) * TL * SW, SW, kb, a.k_ss,
                          kbeg + (int64_t)(it + 1) * TL, TL, kend, (int)a.D, DP,
                          a.kvec, tid, PA_THREADS);
    cp_async_commit();
    const uint32_t* kt = ktile + (it & 1) * TL * SW;
    const int64_t t0 = kbeg + (int64_t)it * TL;
#pragma unroll 2
    for (int blk = 0; blk < TL / 8; ++blk) {
      const int n = blk * 8 + (lane >> 2);
      float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        const uint32_t b0 = kt[n * SW + ks * 8 + j4], b1 = kt[n * SW + ks * 8 + j4 + 4];
        mma16816<T>(d, A[ks][0], A[ks][1], A[ks][2], A[ks][3], b0, b1);
      }
      const int64_t key0 = t0 + blk * 8 + j4 * 2;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int64_t key = key0 + e;
        if (key < kend) {
          const float la = d[e] * scale, lb = d[2 + e] * scale;
          outA[key] = la;
          outB[key] = lb;
          float mn = fmaxf(mA, la);
          sA = sA * expf(mA - mn) + expf(la - mn);
          mA = mn;
          mn = fmaxf(mB, lb);
          sB = sB * expf(mB - mn) + expf(lb - mn);
          mB = mn;
        }
      }
    }
  }
  /* quad merge of (max, sum) */
#pragma unroll
  for (int o = 1; o < 4; o <<= 1) {
    float om = __shfl_xor_sync(DSV_FULL_MASK, mA, o), os = __shfl_xor_sync(DSV_FULL_MASK, sA, o);
    float mn = fmaxf(mA, om);
    if (mn == -INFINITY) {
      sA = 0.f;
    } else {
      sA = sA * expf(mA - mn) + os * expf(om - mn);
    }
    mA = mn;
    om = __shfl_xor_sync(DSV_FULL_MASK, mB, o);
    os = __shfl_xor_sync(DSV_FULL_MASK, sB, o);
    mn = fmaxf(mB, om);
    if (mn == -INFINITY) {
      sB = 0.f;
    } else {
      sB = sB * expf(mB - mn) + os * expf(om - mn);
    }
    mB = mn;
  }
  if (j4 == 0) {
    a.part[((int64_t)tl * PA_ROWS + rlA) * a.nkc + kc] = make_float2(mA, sA);
    a.part[((int64_t)tl * PA_ROWS + rlB) * a.nkc + kc] = make_float2(mB, sB);
  }
}

/* ---- 2. per-row selection ---- */
static __device__ __forceinline__ float dsv_block_sum(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = dsv_warp_sum(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float t = 0.f;
  for (int w = 0; w < nw; ++w) t += red[w];
  return t;
}

__global__ void __launch_bounds__(PA_SEL_THREADS) dsv_pa_select_kernel(const dsv_pa_args a) {
  extern __shared__ __align__(16) unsigned char dsv_pa_smem[];
  uint32_t* hcnt = reinterpret_cast<uint32_t*>(dsv_pa_smem); /* [2048] */
  float* hmass = reinterpret_cast<float*>(hcnt + 2048);       /* [2048] */
  float* red = hmass + 2048;                                  /* [32] */
  uint32_t* st = reinterpret_cast<uint32_t*>(red + 32);       /* [8] shared decisions */
  uint32_t* bitmap = st + 8;                                  /* [S / 32] with an index */
  const int tid = threadIdx.x, lane = tid & 31;
  const int tl = blockIdx.x / PA_ROWS, rl = blockIdx.x - tl * PA_ROWS;
  const int64_t tile_id = a.first_tile + tl;
  const int64_t bh = tile_id / a.tiles_per_bh;
  const int64_t rt = tile_id - bh * a.tiles_per_bh;
  const int64_t i = rt * PA_ROWS + rl;
  if (i >= a.R) return;
  const int64_t S = a.S;
  const int64_t pos = a.rows[i];
  float* outc = a.row_c + bh * a.R + i;
  float* outr = a.row_rec + bh * a.R + i;
  if (pos < 0 || pos >= S || S == 0) {
    if (tid == 0) {
      *outc = -1.f;
      *outr = 0.f;
    }
    return;
  }
  const float* L = a.logits + ((int64_t)tl * PA_ROWS + rl) * S;
  /* merge partial (max, sum) */
  const float2* pp = a.part + ((int64_t)tl * PA_ROWS + rl) * a.nkc;
  float M = -INFINITY;
  for (int c = 0; c < a.nkc; ++c) M = fmaxf(M, pp[c].x);
  float Z = 0.f;
  for (int c = 0; c < a.nkc; ++c)
    if (pp[c].x > -INFINITY) Z += pp[c].y * expf(pp[c].x - M);
  const float invZ = 1.f / Z;
  {
    /* a NaN or +inf logit (or all -inf) leaves the softmax undefined: NaN c_i and recall for
     * the row, hence NaN means for its (b, h), as on the CPU */
    bool bad = !(Z > 0.f) || isinf(Z);
    for (int64_t j = tid; j < S && !bad; j += PA_SEL_THREADS) {
      const float l = L[j];
      bad = isnan(l) || l == INFINITY;
    }
    if (__syncthreads_or(bad)) {
      if (tid == 0) {
        *outc = NAN;
        *outr = NAN;
      }
      return;
    }
  }

  /* recall */
  float rec = 0.f;
  if (a.kv_index) {
    const int64_t nwords = (S + 31) / 32;
    for (int64_t w = tid; w < nwords; w += PA_SEL_THREADS) bitmap[w] = 0;
    __syncthreads();
    int64_t cnt = a.kv_count[bh];
    cnt = cnt < 0 ? 0 : (cnt > a.kmax ? a.kmax : cnt);
    const int32_t* list = a.kv_index + (bh * a.NG + pos / a.G) * a.kmax;
    float racc = 0.f;
    for (int64_t e = tid; e < cnt; e += PA_SEL_THREADS) {
      const int32_t key = list[e];
      if (key < 0 || (int64_t)key >= S) continue;
      const uint32_t bit = 1u << (key & 31);
      const uint32_t old = atomicOr(bitmap + (key >> 5), bit);
      if (!(old & bit)) racc += expf(L[key] - M) * invZ;
    }
    rec = dsv_block_sum(racc, red);
  }

  /* c_i by radix select on the logit key, histograms of count and mass */
  float c_out;
  const float theta = a.theta;
  if (!(theta > 0.f)) {
    c_out = 0.f;
  } else {
    uint32_t prefix = 0, pmask = 0;
    float rem = theta;
    int64_t cnt_above = 0;
    bool done = false;
    int64_t cres = S;
    for (int pass = 0; pass < 3 && !done; ++pass) {
      const int shift = pass == 0 ? 21 : (pass == 1 ? 10 : 0);
      const int nb = pass == 2 ? 1024 : 2048;
      for (int t = tid; t < 2048; t += PA_SEL_THREADS) {
        hcnt[t] = 0;
        hmass[t] = 0.f;
      }
      __syncthreads();
      for (int64_t j = tid; j < S; j += PA_SEL_THREADS) {
        const float l = L[j];
        const uint32_t u = dsv_float_key(l);
        if ((u & pmask) == prefix) {
          const uint32_t bin = (u >> shift) & (uint32_t)(nb - 1);
          atomicAdd(hcnt + bin, 1u);
          atomicAdd(hmass + bin, expf(l - M) * invZ);
        }
      }
      __syncthreads();
      if (tid < 32) {
        /* warp 0: suffix scan over bins; lane owns nb/32 consecutive bins */
        const int per = nb / 32;
        float lm = 0.f;
        uint32_t lc = 0;
        for (int t = 0; t < per; ++t) {
          lm += hmass[lane * per + t];
          lc += hcnt[lane * per + t];
        }
        float sm = lm;
        uint32_t sc = lc;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
          const float tm = __shfl_down_sync(DSV_FULL_MASK, sm, off);
          const uint32_t tc = __shfl_down_sync(DSV_FULL_MASK, sc, off);
          if (lane + off < 32) {
            sm += tm;
            sc += tc;
          }
        }
        const uint32_t bal = __ballot_sync(DSV_FULL_MASK, sm >= rem);
        const uint32_t total = __shfl_sync(DSV_FULL_MASK, sc, 0);
        if (bal == 0) {
          /* the candidates' mass stays below what is left (rounding): take them all */
          if (lane == 0) {
            const int64_t cr = cnt_above + (int64_t)total;
            st[0] = 1;
            st[2] = (uint32_t)(cr & 0xffffffffLL);
            st[3] = (uint32_t)(cr >> 32);
          }
        } else {
          const int Ln = 31 - __clz((int)bal);
          float above_m = 0.f;
          uint32_t above_c = 0, bsel = 0, bcnt = 0;
          float bmass = 0.f;
          if (lane == Ln) {
            above_m = sm - lm;
            above_c = sc - lc;
            for (int t = per - 1; t >= 0; --t) {
              const float m = hmass[lane * per + t];
              const uint32_t c = hcnt[lane * per + t];
              if (above_m + m >= rem || t == 0) {
                bsel = (uint32_t)(lane * per + t);
                bcnt = c;
                bmass = m;
                break;
              }
              above_m += m;
              above_c += c;
            }
            st[0] = 0;
            st[1] = bsel;
            st[4] = above_c;
            st[5] = bcnt;
            st[6] = __float_as_uint(above_m);
            st[7] = __float_as_uint(bmass);
          }
          __syncwarp();
        }
      }
      __syncthreads();
      if (st[0] == 1) {
        cres = (int64_t)st[2] | ((int64_t)st[3] << 32);
        done = true;
      } else {
        const uint32_t bsel = st[1];
        const uint32_t bcnt = st[5];
        cnt_above += st[4];
        rem -= __uint_as_float(st[6]);
        prefix |= bsel << shift;
        pmask |= (uint32_t)(nb - 1) << shift;
        if (bcnt <= 1 || pass == 2) {
          /* every element of the bin has the same logit: take ceil(rem / p) of them */
          const float pv = expf(dsv_key_float(prefix) - M) * invZ;
          int64_t need = bcnt > 0 ? 1 : 0;
          if (bcnt > 1 && pv > 0.f) {
            const float q = rem / pv;
            need = (int64_t)ceilf(q);
            if (need < 1) need = 1;
            if (need > (int64_t)bcnt) need = bcnt;
          }
          cres = cnt_above + need;
          done = true;
        }
      }
      __syncthreads();
    }
    c_out = (float)cres;
  }
  if (tid == 0) {
    *outc = c_out;
    *outr = rec;
  }
}

/* ---- 3. per-head means ---- */
template <typename TA>
__global__ void dsv_pa_finalize_kernel(const float* row_c, const float* row_rec, int64_t BH,
                                       int64_t R, int64_t S, int has_index, TA* sparsity,
                                       TA* recall) {
  const int64_t bh = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (bh >= BH) return;
  double cs = 0, rs = 0;
  int n = 0;
  for (int64_t i = lane; i < R; i += 32) {
    const float c = row_c[bh * R + i];
    if (c < 0.f) continue;
    cs += c;
    rs += row_rec[bh * R + i];
    ++n;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    cs += __shfl_xor_sync(DSV_FULL_MASK, cs, o);
    rs += __shfl_xor_sync(DSV_FULL_MASK, rs, o);
    n += __shfl_xor_sync(DSV_FULL_MASK, n, o);
  }
  if (lane == 0) {
    const double nan = __longlong_as_double(0x7ff8000000000000LL);
    sparsity[bh] = (TA)(n > 0 ? 1.0 - cs / ((double)n * (double)S) : nan);
    if (recall) recall[bh] = (TA)(has_index && n > 0 ? rs / (double)n : nan);
  }
}

/* ---- host ---- */
static int dsv_pa_tiles_per_launch(const dsv_profile_shape* p) {
  const int64_t per_tile = (int64_t)PA_ROWS * p->seqlen * 4;
  int64_t t = per_tile > 0 ? (int64_t)(PA_WS_CAP / (size_t)per_tile) : 1;
  if (t < 1) t = 1;
  const int64_t total = p->batch * p->heads * dsv_cdiv64(p->num_rows, PA_ROWS);
  if (t > total) t = total;
  if (t < 1) t = 1;
  return (int)t;
}

extern "C" size_t dsv_profile_attention_workspace_cuda(const dsv_profile_shape* p) {
  if (!p || p->seqlen <= 0 || p->num_rows <= 0 || p->batch <= 0 || p->heads <= 0) return 256;
  const int64_t tpl = dsv_pa_tiles_per_launch(p);
  const int64_t nkc = dsv_cdiv64(p->seqlen, PA_KC);
  size_t s = 0;
  s += dsv_align_up((size_t)tpl * PA_ROWS * p->seqlen * 4, 256);
  s += dsv_align_up((size_t)tpl * PA_ROWS * nkc * 8, 256);
  s += 2 * dsv_align_up((size_t)p->batch * p->heads * p->num_rows * 4, 256);
  return s;
}

template <typename T, int DP>
static int dsv_pa_launch_logits(const dsv_pa_args& a, int64_t grid, cudaStream_t st) {
  dsv_pa_logits_kernel<T, DP><<<(unsigned)grid, PA_THREADS, 0, st>>>(a);
  DSV_CUDA_CHECK_LAUNCH();
  return DSV_OK;
}
template <typename T>
static int dsv_pa_logits_dispatch(const dsv_pa_args& a, int DP, int64_t grid, cudaStream_t st) {
  switch (DP) {
    case 16: return dsv_pa_launch_logits<T, 16>(a, grid, st);
    case 32: return dsv_pa_launch_logits<T, 32>(a, grid, st);
    case 64: return dsv_pa_launch_logits<T, 64>(a, grid, st);
    case 96: return dsv_pa_launch_logits<T, 96>(a, grid, st);
    case 128: return dsv_pa_launch_logits<T, 128>(a, grid, st);
    case 192: return dsv_pa_launch_logits<T, 192>(a, grid, st);
    case 256: return dsv_pa_launch_logits<T, 256>(a, grid, st);
  }
  return DSV_ERR_UNSUPPORTED;
}

extern "C" int dsv_profile_attention_cuda(const dsv_profile_shape* p, dsv_bshd q, dsv_bshd k,
                                          const int32_t* rows, const int32_t* kv_index,
                                          const int32_t* kv_count, void* sparsity, void* recall,
                                          void* workspace, size_t workspace_bytes,
                                          void* stream) {
  if (!p) return DSV_ERR_INVALID;
  if (p->batch < 0 || p->seqlen < 0 || p->heads < 0 || p->head_dim <= 0 || p->num_rows < 0 ||
      p->seqlen > 0x7fffffffLL)
    return DSV_ERR_INVALID;
  if (kv_index) {
    if (!kv_count || p->group_size <= 0 || p->kmax < 0 ||
        p->num_groups != dsv_cdiv64(p->seqlen, p->group_size))
      return DSV_ERR_INVALID;
  }
  if (p->dtype != DSV_BFLOAT16 && p->dtype != DSV_FLOAT16) return DSV_ERR_UNSUPPORTED;
  const int64_t BH = p->batch * p->heads;
  if (BH == 0) return DSV_OK;
  if (!sparsity) return DSV_ERR_INVALID;
  cudaStream_t st = (cudaStream_t)stream;
  const int64_t S = p->seqlen, R = p->num_rows;
  int DP = (int)((p->head_dim + 15) / 16 * 16);
  if (DP == 48) DP = 64;
  if (DP == 80) DP = 96;
  if (DP == 112) DP = 128;
  if (DP > 128 && DP <= 192) DP = 192;
  if (DP > 192 && DP <= 256) DP = 256;
  if (p->head_dim > 256) return DSV_ERR_UNSUPPORTED;
  const size_t bitmap_bytes = kv_index ? (size_t)((S + 31) / 32) * 4 : 0;
  const size_t sel_smem = 2048 * 8 + 32 * 4 + 8 * 4 + bitmap_bytes;
  if (sel_smem > 220 * 1024) return DSV_ERR_UNSUPPORTED;

  if (S == 0 || R == 0) {
    /* no usable row: NaN means */
    dsv_pa_finalize_kernel<float><<<(unsigned)dsv_cdiv64(BH, 4), 128, 0, st>>>(
        NULL, NULL, BH, 0, S, kv_index != NULL, (float*)sparsity, (float*)recall);
    DSV_CUDA_CHECK_LAUNCH();
    return DSV_OK;
  }
  if (!q.data || !k.data || !rows) return DSV_ERR_INVALID;
  if (!workspace || workspace_bytes < dsv_profile_attention_workspace_cuda(p)) return DSV_ERR_NOMEM;

  dsv_pa_args a;
  a.q = q.data;
  a.k = k.data;
  a.q_sb = q.stride_b;
  a.q_ss = q.stride_s;
  a.q_sh = q.stride_h;
  a.k_sb = k.stride_b;
  a.k_ss = k.stride_s;
  a.k_sh = k.stride_h;
  a.rows = rows;
  a.kv_index = kv_index;
  a.kv_count = kv_count;
  a.S = S;
  a.H = p->heads;
  a.D = p->head_dim;
  a.R = R;
  a.G = kv_index ? p->group_size : 1;
  a.NG = p->num_groups;
  a.kmax = p->kmax;
  a.scale = (float)p->scale;
  a.theta = (float)p->theta;
  a.tiles_per_bh = (int)dsv_cdiv64(R, PA_ROWS);
  a.nkc = (int)dsv_cdiv64(S, PA_KC);
  a.kvec = dsv_bshd_rows_aligned16(k, 2);
  const int64_t tpl = dsv_pa_tiles_per_launch(p);
  char* ws = (char*)workspace;
  a.logits = (float*)ws;
  ws += dsv_align_up((size_t)tpl * PA_ROWS * S * 4, 256);
  a.part = (float2*)ws;
  ws += dsv_align_up((size_t)tpl * PA_ROWS * a.nkc * 8, 256);
  a.row_c = (float*)ws;
  ws += dsv_align_up((size_t)BH * R * 4, 256);
  a.row_rec = (float*)ws;

  DSV_CUDA_TRY(cudaFuncSetAttribute(dsv_pa_select_kernel,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sel_smem));
  const int64_t total_tiles = BH * a.tiles_per_bh;
  for (int64_t t0 = 0; t0 < total_tiles; t0 += tpl) {
    const int64_t nt = (total_tiles - t0) < tpl ? (total_tiles - t0) : tpl;
    a.first_tile = t0;
    int rc;
    if (p->dtype == DSV_BFLOAT16)
      rc = dsv_pa_logits_dispatch<__nv_bfloat16>(a, DP, nt * a.nkc, st);
    else
      rc = dsv_pa_logits_dispatch<__half>(a, DP, nt * a.nkc, st);
    if (rc != DSV_OK) return rc;
    dsv_pa_select_kernel<<<(unsigned)(nt * PA_ROWS), PA_SEL_THREADS, sel_smem, st>>>(a);
    DSV_CUDA_CHECK_LAUNCH();
  }
  dsv_pa_finalize_kernel<float><<<(unsigned)dsv_cdiv64(BH, 4), 128, 0, st>>>(
      a.row_c, a.row_rec, BH, R, S, kv_index != NULL, (float*)sparsity, (float*)recall);
  DSV_CUDA_CHECK_LAUNCH();
  return DSV_OK;
}
