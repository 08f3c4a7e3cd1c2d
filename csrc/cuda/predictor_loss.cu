/*
 * predictor_loss.cu - low-rank predictor loss on sampled rows, forward and backward (sm_90a).
 *
 * Semantics (dsv.h): for sampled row i of (b, h), z_j = scale * q_i . k_j, p_j = q_lr_i . k_lr_j
 * over all keys j < S; Szp, Szz, Spp; loss_i = cw (1 - Szp / (nz np)) + nw (np / nz - 1)^2;
 * loss[b, h] = mean_i loss_i. Backward (q, k constant), with g = dloss / R:
 *   dL_i/dp_j = a_i z_j + c_i p_j,  a_i = -g cw / (nz np),
 *   c_i = g (cw Szp / (nz np^3) + 2 nw (np / nz - 1) / (nz np)).
 * Rows outside [0, S) are ignored (stats 0, no gradient).
 *
 * All dot products run on tensor cores (m16n8k16, bf16/fp16 inputs, fp32 accumulation: every
 * product of two 16-bit inputs is exact). No S x S or R x S matrix is stored.
 *  forward : CTA = 64 sampled rows x a chunk of keys; per-row partial sums go to the workspace
 *            per key chunk and are reduced in a fixed order (deterministic).
 *  backward: dq_lr = G K_lr (row-major pass, key chunks reduced in a fixed order, rows sampled
 *            twice summed through a duplicate chain); dk_lr = G^T Q_lr (key-major pass: each key
 *            owned by one warp, written once, no atomics). G is rebuilt from recomputed z, p in
 *            fp32 and fed to the MMA as a hi + lo pair of 16-bit values (about 2^-17 relative
 *            error), after a per-(b, h) power-of-two scaling bounded by |g_ij| <= |a_i| nz_i +
 *            |c_i| np_i so that fp16 neither overflows nor underflows.
 */
#include <string.h>

#include "cuda_common.cuh"

#define PL_WARPS 4
#define PL_THREADS (32 * PL_WARPS)
#define PL_ROWS 64
#define PL_KCHUNK_MIN 4096
#define PL_MAX_SPLIT 8
#define PL_EPS 1e-12

struct dsv_pl_args {
  const void* q;
  const void* k;
  const void* ql;
  const void* kl;
  int64_t q_sb, q_ss, q_sh, k_sb, k_ss, k_sh;
  int64_t ql_sb, ql_ss, ql_sh, kl_sb, kl_ss, kl_sh;
  const int32_t* rows;
  int64_t S, H, D, r, R, BH;
  float scale;
  double cw, nw;
  int row_tiles, nsplit;
  int64_t kchunk;
  int kvec, klvec, qvec, qlvec;
  float* part;      /* fwd: [nsplit][BH][R][3] */
  float* coef;      /* bwd: [BH][R][2] scaled a_i, c_i */
  float* inv_scale; /* bwd: [BH] */
  float* dqp;       /* bwd: [nsplit][BH][R][RP] */
  int32_t* pos2i;   /* bwd: [S] canonical sampled index of a position, or -1 */
  int32_t* nxt;     /* bwd: [R] next sampled index with the same position, or -1 */
  void* dk;
  int64_t dk_sb, dk_ss, dk_sh;
  void* dq;
  int64_t dq_sb, dq_ss, dq_sh;
  int RPs; /* padded rank used for dqp */
};

enum { PL_MODE_FWD = 0, PL_MODE_DQ = 1 };

/* Load the A fragments (16 x DP, rows rA / rB) of a [B, S, H, dim] view straight from global. */
template <typename T, int KS>
static __device__ __forceinline__ void dsv_pl_load_a(uint32_t (&A)[KS][4], const T* base,
                                                     int64_t row_stride, int64_t rA, int64_t rB,
                                                     int dim, int j4) {
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int col = ks * 16 + j4 * 2 + half * 8;
      float x[4] = {0.f, 0.f, 0.f, 0.f};
      if (rA >= 0 && col < dim) x[0] = dsv_to_float(base[rA * row_stride + col]);
      if (rA >= 0 && col + 1 < dim) x[1] = dsv_to_float(base[rA * row_stride + col + 1]);
      if (rB >= 0 && col < dim) x[2] = dsv_to_float(base[rB * row_stride + col]);
      if (rB >= 0 && col + 1 < dim) x[3] = dsv_to_float(base[rB * row_stride + col + 1]);
      A[ks][half * 2 + 0] = dsv_pack2<T>(x[0], x[1]);
      A[ks][half * 2 + 1] = dsv_pack2<T>(x[2], x[3]);
    }
  }
}

/* Two 16-bit smem elements (rows k0, k0 + 1, column n) of a [rows][sw words] tile, packed. */
static __device__ __forceinline__ uint32_t dsv_pl_pair_col(const uint32_t* tile, int sw, int k0,
                                                           int n) {
  const unsigned short* t16 = reinterpret_cast<const unsigned short*>(tile);
  const uint32_t lo = t16[k0 * 2 * sw + n], hi = t16[(k0 + 1) * 2 * sw + n];
  return lo | (hi << 16);
}

/* hi + lo split of two fp32 values into packed 16-bit pairs */
template <typename T>
static __device__ __forceinline__ void dsv_pl_split2(float x0, float x1, uint32_t& hi,
                                                     uint32_t& lo) {
  const float h0 = dsv_round_to<T>(x0), h1 = dsv_round_to<T>(x1);
  hi = dsv_pack2<T>(h0, h1);
  lo = dsv_pack2<T>(x0 - h0, x1 - h1);
}

/* ---- row-major pass: forward partial sums, or dq_lr partials ---- */
template <typename T, int DP, int RP, int MODE>
__global__ void __launch_bounds__(PL_THREADS) dsv_pl_rows_kernel(const dsv_pl_args a) {
  constexpr int KSD = DP / 16, KSR = RP / 16, NBR = RP / 8;
  constexpr int SWD = DP / 2 + 4, SWR = RP / 2 + 4;
  constexpr int TL = DP >= 192 ? 32 : 64;
  __shared__ __align__(16) uint32_t kt[2 * TL * SWD];
  __shared__ __align__(16) uint32_t klt[2 * TL * SWR];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, j4 = lane & 3;
  const int split = blockIdx.x % a.nsplit;
  const int64_t t = blockIdx.x / a.nsplit;
  const int64_t bh = t / a.row_tiles, rt = t - bh * a.row_tiles;
  const int64_t b = bh / a.H, h = bh - b * a.H;
  const int64_t S = a.S, R = a.R;
  const int64_t iA = rt * PL_ROWS + warp * 16 + (lane >> 2), iB = iA + 8;
  int64_t posA = iA < R ? a.rows[iA] : -1, posB = iB < R ? a.rows[iB] : -1;
  if (posA >= S) posA = -1;
  if (posB >= S) posB = -1;
  if (posA < 0) posA = -1;
  if (posB < 0) posB = -1;

  uint32_t AQ[KSD][4], AL[KSR][4];
  dsv_pl_load_a<T, KSD>(AQ, reinterpret_cast<const T*>(a.q) + b * a.q_sb + h * a.q_sh, a.q_ss,
                        posA, posB, (int)a.D, j4);
  dsv_pl_load_a<T, KSR>(AL, reinterpret_cast<const T*>(a.ql) + b * a.ql_sb + h * a.ql_sh,
                        a.ql_ss, posA, posB, (int)a.r, j4);
  float caA = 0.f, ccA = 0.f, caB = 0.f, ccB = 0.f;
  if (MODE == PL_MODE_DQ) {
    if (iA < R) {
      caA = a.coef[(bh * R + iA) * 2];
      ccA = a.coef[(bh * R + iA) * 2 + 1];
    }
    if (iB < R) {
      caB = a.coef[(bh * R + iB) * 2];
      ccB = a.coef[(bh * R + iB) * 2 + 1];
    }
  }
  float szpA = 0.f, szzA = 0.f, sppA = 0.f, szpB = 0.f, szzB = 0.f, sppB = 0.f;
  float acc[NBR][4];
#pragma unroll
  for (int nb = 0; nb < NBR; ++nb) acc[nb][0] = acc[nb][1] = acc[nb][2] = acc[nb][3] = 0.f;

  const T* kb = reinterpret_cast<const T*>(a.k) + b * a.k_sb + h * a.k_sh;
  const T* klb = reinterpret_cast<const T*>(a.kl) + b * a.kl_sb + h * a.kl_sh;
  const int64_t kbeg = (int64_t)split * a.kchunk;
  const int64_t kend = (kbeg + a.kchunk) < S ? (kbeg + a.kchunk) : S;
  const int ntiles = kend > kbeg ? (int)((kend - kbeg + TL - 1) / TL) : 0;
  const float scale = a.scale;

  if (ntiles > 0) {
    dsv_stage_rows16<T>(kt, SWD, kb, a.k_ss, kbeg, TL, kend, (int)a.D, DP, a.kvec, tid,
                        PL_THREADS);
    dsv_stage_rows16<T>(klt, SWR, klb, a.kl_ss, kbeg, TL, kend, (int)a.r, RP, a.klvec, tid,
                        PL_THREADS);
  }
  cp_async_commit();
  for (int it = 0; it < ntiles; ++it) {
    cp_async_wait_all();
    __syncthreads();
    if (it + 1 < ntiles) {
      const int64_t r0 = kbeg + (int64_t)(it + 1) * TL;
      dsv_stage_rows16<T>(kt + ((it + 1) & 1) * TL * SWD, SWD, kb, a.k_ss, r0, TL, kend,
                          (int)a.D, DP, a.kvec, tid, PL_THREADS);
      dsv_stage_rows16<T>(klt + ((it + 1) & 1) * TL * SWR, SWR, klb, a.kl_ss, r0, TL, kend,
                          (int)a.r, RP, a.klvec, tid, PL_THREADS);
    }
    cp_async_commit();
    const uint32_t* ktc = kt + (it & 1) * TL * SWD;
    const uint32_t* kltc = klt + (it & 1) * TL * SWR;
    float gprev[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 2
    for (int blk = 0; blk < TL / 8; ++blk) {
      const int n = blk * 8 + (lane >> 2);
      float d[4] = {0.f, 0.f, 0.f, 0.f}, e[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int ks = 0; ks < KSD; ++ks)
        mma16816<T>(d, AQ[ks][0], AQ[ks][1], AQ[ks][2], AQ[ks][3], ktc[n * SWD + ks * 8 + j4],
                   ktc[n * SWD + ks * 8 + j4 + 4]);
#pragma unroll
      for (int ks = 0; ks < KSR; ++ks)
        mma16816<T>(e, AL[ks][0], AL[ks][1], AL[ks][2], AL[ks][3], kltc[n * SWR + ks * 8 + j4],
                   kltc[n * SWR + ks * 8 + j4 + 4]);
      /* keys beyond kend are zero rows: z = p = 0 contributes nothing */
      const float z0 = d[0] * scale, z1 = d[1] * scale, z2 = d[2] * scale, z3 = d[3] * scale;
      if (MODE == PL_MODE_FWD) {
        szpA += z0 * e[0] + z1 * e[1];
        szzA += z0 * z0 + z1 * z1;
        sppA += e[0] * e[0] + e[1] * e[1];
        szpB += z2 * e[2] + z3 * e[3];
        szzB += z2 * z2 + z3 * z3;
        sppB += e[2] * e[2] + e[3] * e[3];
      } else {
        float g[4];
        g[0] = caA * z0 + ccA * e[0];
        g[1] = caA * z1 + ccA * e[1];
        g[2] = caB * z2 + ccB * e[2];
        g[3] = caB * z3 + ccB * e[3];
        if (blk & 1) {
          uint32_t ah[4], al[4];
          dsv_pl_split2<T>(gprev[0], gprev[1], ah[0], al[0]);
          dsv_pl_split2<T>(gprev[2], gprev[3], ah[1], al[1]);
          dsv_pl_split2<T>(g[0], g[1], ah[2], al[2]);
          dsv_pl_split2<T>(g[2], g[3], ah[3], al[3]);
          const int kbase = (blk - 1) * 8 + 2 * j4;
#pragma unroll
          for (int nb = 0; nb < NBR; ++nb) {
            const int col = nb * 8 + (lane >> 2);
            const uint32_t b0 = dsv_pl_pair_col(kltc, SWR, kbase, col);
            const uint32_t b1 = dsv_pl_pair_col(kltc, SWR, kbase + 8, col);
            mma16816<T>(acc[nb], al[0], al[1], al[2], al[3], b0, b1);
            mma16816<T>(acc[nb], ah[0], ah[1], ah[2], ah[3], b0, b1);
          }
        } else {
          gprev[0] = g[0];
          gprev[1] = g[1];
          gprev[2] = g[2];
          gprev[3] = g[3];
        }
      }
    }
  }

  if (MODE == PL_MODE_FWD) {
#pragma unroll
    for (int o = 1; o < 4; o <<= 1) {
      szpA += __shfl_xor_sync(DSV_FULL_MASK, szpA, o);
      szzA += __shfl_xor_sync(DSV_FULL_MASK, szzA, o);
      sppA += __shfl_xor_sync(DSV_FULL_MASK, sppA, o);
      szpB += __shfl_xor_sync(DSV_FULL_MASK, szpB, o);
      szzB += __shfl_xor_sync(DSV_FULL_MASK, szzB, o);
      sppB += __shfl_xor_sync(DSV_FULL_MASK, sppB, o);
    }
    if (j4 == 0) {
      float* pb = a.part + ((int64_t)split * a.BH + bh) * R * 3;
      if (iA < R) {
        pb[iA * 3 + 0] = szpA;
        pb[iA * 3 + 1] = szzA;
        pb[iA * 3 + 2] = sppA;
      }
      if (iB < R) {
        pb[iB * 3 + 0] = szpB;
        pb[iB * 3 + 1] = szzB;
        pb[iB * 3 + 2] = sppB;
      }
    }
  } else {
    float* qb = a.dqp + ((int64_t)split * a.BH + bh) * R * RP;
#pragma unroll
    for (int nb = 0; nb < NBR; ++nb) {
      const int col = nb * 8 + 2 * j4;
      if (iA < R) *reinterpret_cast<float2*>(qb + iA * RP + col) = make_float2(acc[nb][0], acc[nb][1]);
      if (iB < R) *reinterpret_cast<float2*>(qb + iB * RP + col) = make_float2(acc[nb][2], acc[nb][3]);
    }
  }
}

/* ---- key-major pass: dk_lr = G^T Q_lr ---- */
template <typename T, int DP, int RP>
__global__ void __launch_bounds__(PL_THREADS) dsv_pl_dk_kernel(const dsv_pl_args a) {
  constexpr int KSD = DP / 16, KSR = RP / 16, NBR = RP / 8;
  constexpr int SWD = DP / 2 + 4, SWR = RP / 2 + 4;
  constexpr int TL = DP >= 192 ? 32 : 64;
  __shared__ __align__(16) uint32_t qt[2 * TL * SWD];
  __shared__ __align__(16) uint32_t qlt[2 * TL * SWR];
  __shared__ __align__(16) float2 ct[2 * TL];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, j4 = lane & 3;
  const int64_t ktiles = (a.S + PL_ROWS - 1) / PL_ROWS;
  const int64_t bh = blockIdx.x / ktiles, ktile = blockIdx.x - bh * ktiles;
  const int64_t b = bh / a.H, h = bh - b * a.H;
  const int64_t S = a.S, R = a.R;
  const int64_t kA = ktile * PL_ROWS + warp * 16 + (lane >> 2), kB = kA + 8;
  const int64_t rA = kA < S ? kA : -1, rB = kB < S ? kB : -1;

  uint32_t AK[KSD][4], AKL[KSR][4];
  dsv_pl_load_a<T, KSD>(AK, reinterpret_cast<const T*>(a.k) + b * a.k_sb + h * a.k_sh, a.k_ss,
                        rA, rB, (int)a.D, j4);
  dsv_pl_load_a<T, KSR>(AKL, reinterpret_cast<const T*>(a.kl) + b * a.kl_sb + h * a.kl_sh,
                        a.kl_ss, rA, rB, (int)a.r, j4);
  float acc[NBR][4];
#pragma unroll
  for (int nb = 0; nb < NBR; ++nb) acc[nb][0] = acc[nb][1] = acc[nb][2] = acc[nb][3] = 0.f;

  const T* qb = reinterpret_cast<const T*>(a.q) + b * a.q_sb + h * a.q_sh;
  const T* qlb = reinterpret_cast<const T*>(a.ql) + b * a.ql_sb + h * a.ql_sh;
  const float* coef = a.coef + bh * R * 2;
  const int ntiles = (int)((R + TL - 1) / TL);
  const float scale = a.scale;

#define DSV_PL_STAGE_Q(buf, r0)                                                                  \
  do {                                                                                           \
    dsv_stage_rows16_idx<T>(qt + (buf) * TL * SWD, SWD, qb, a.q_ss, a.rows, (r0), TL, R, S,     \
                            (int)a.D, DP, a.qvec, tid, PL_THREADS);                              \
    dsv_stage_rows16_idx<T>(qlt + (buf) * TL * SWR, SWR, qlb, a.ql_ss, a.rows, (r0), TL, R, S,  \
                            (int)a.r, RP, a.qlvec, tid, PL_THREADS);                             \
    for (int x = tid; x < TL; x += PL_THREADS) {                                                 \
      const int64_t ii = (r0) + x;                                                               \
      ct[(buf) * TL + x] = ii < R ? make_float2(coef[ii * 2], coef[ii * 2 + 1])                  \
                                  : make_float2(0.f, 0.f);                                       \
    }                                                                                            \
  } while (0)

  if (ntiles > 0) DSV_PL_STAGE_Q(0, 0);
  cp_async_commit();
  for (int it = 0; it < ntiles; ++it) {
    cp_async_wait_all();
    __syncthreads();
    if (it + 1 < ntiles) DSV_PL_STAGE_Q((it + 1) & 1, (int64_t)(it + 1) * TL);
    cp_async_commit();
    const uint32_t* qtc = qt + (it & 1) * TL * SWD;
    const uint32_t* qltc = qlt + (it & 1) * TL * SWR;
    const float2* ctc = ct + (it & 1) * TL;
    float gprev[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 2
    for (int blk = 0; blk < TL / 8; ++blk) {
      const int n = blk * 8 + (lane >> 2);
      float d[4] = {0.f, 0.f, 0.f, 0.f}, e[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int ks = 0; ks < KSD; ++ks)
        mma16816<T>(d, AK[ks][0], AK[ks][1], AK[ks][2], AK[ks][3], qtc[n * SWD + ks * 8 + j4],
                   qtc[n * SWD + ks * 8 + j4 + 4]);
#pragma unroll
      for (int ks = 0; ks < KSR; ++ks)
        mma16816<T>(e, AKL[ks][0], AKL[ks][1], AKL[ks][2], AKL[ks][3], qltc[n * SWR + ks * 8 + j4],
                   qltc[n * SWR + ks * 8 + j4 + 4]);
      /* columns are sampled rows blk*8 + 2*j4 + {0, 1} */
      const float2 c0 = ctc[blk * 8 + 2 * j4], c1 = ctc[blk * 8 + 2 * j4 + 1];
      float g[4];
      g[0] = c0.x * (d[0] * scale) + c0.y * e[0];
      g[1] = c1.x * (d[1] * scale) + c1.y * e[1];
      g[2] = c0.x * (d[2] * scale) + c0.y * e[2];
      g[3] = c1.x * (d[3] * scale) + c1.y * e[3];
      if (blk & 1) {
        uint32_t ah[4], al[4];
        dsv_pl_split2<T>(gprev[0], gprev[1], ah[0], al[0]);
        dsv_pl_split2<T>(gprev[2], gprev[3], ah[1], al[1]);
        dsv_pl_split2<T>(g[0], g[1], ah[2], al[2]);
        dsv_pl_split2<T>(g[2], g[3], ah[3], al[3]);
        const int kbase = (blk - 1) * 8 + 2 * j4;
#pragma unroll
        for (int nb = 0; nb < NBR; ++nb) {
          const int col = nb * 8 + (lane >> 2);
          const uint32_t b0 = dsv_pl_pair_col(qltc, SWR, kbase, col);
          const uint32_t b1 = dsv_pl_pair_col(qltc, SWR, kbase + 8, col);
          mma16816<T>(acc[nb], al[0], al[1], al[2], al[3], b0, b1);
          mma16816<T>(acc[nb], ah[0], ah[1], ah[2], ah[3], b0, b1);
        }
      } else {
        gprev[0] = g[0];
        gprev[1] = g[1];
        gprev[2] = g[2];
        gprev[3] = g[3];
      }
    }
  }
#undef DSV_PL_STAGE_Q
  const float inv = a.inv_scale[bh];
  T* dkb = reinterpret_cast<T*>(a.dk) + b * a.dk_sb + h * a.dk_sh;
#pragma unroll
  for (int nb = 0; nb < NBR; ++nb) {
    const int col = nb * 8 + 2 * j4;
    if (rA >= 0) {
      if (col < a.r) dkb[rA * a.dk_ss + col] = dsv_cvt<T>::from(acc[nb][0] * inv);
      if (col + 1 < a.r) dkb[rA * a.dk_ss + col + 1] = dsv_cvt<T>::from(acc[nb][1] * inv);
    }
    if (rB >= 0) {
      if (col < a.r) dkb[rB * a.dk_ss + col] = dsv_cvt<T>::from(acc[nb][2] * inv);
      if (col + 1 < a.r) dkb[rB * a.dk_ss + col + 1] = dsv_cvt<T>::from(acc[nb][3] * inv);
    }
  }
}

/* ---- small kernels ---- */
/* forward: reduce the key-chunk partials (fixed order), row_stats and the mean loss; one warp
 * per (b, h) */
__global__ void dsv_pl_fwd_finalize_kernel(const dsv_pl_args a, float* loss, float* row_stats) {
  const int64_t bh = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (bh >= a.BH) return;
  const int64_t R = a.R;
  double lsum = 0;
  for (int64_t i = lane; i < R; i += 32) {
    float s0 = 0.f, s1 = 0.f, s2 = 0.f;
    for (int sp = 0; sp < a.nsplit; ++sp) {
      const float* pp = a.part + (((int64_t)sp * a.BH + bh) * R + i) * 3;
      s0 += pp[0];
      s1 += pp[1];
      s2 += pp[2];
    }
    const int64_t pos = a.rows[i];
    if (pos < 0 || pos >= a.S) s0 = s1 = s2 = NAN; /* a row outside [0, S): NaN loss (as on the CPU) */
    float* rs = row_stats + (bh * R + i) * 3;
    rs[0] = s0;
    rs[1] = s1;
    rs[2] = s2;
    const double nz = sqrt((double)s1 + PL_EPS), np = sqrt((double)s2 + PL_EPS);
    const double rr = np / nz - 1.0;
    lsum += a.cw * (1.0 - (double)s0 / (nz * np)) + a.nw * rr * rr;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) lsum += __shfl_xor_sync(DSV_FULL_MASK, lsum, o);
  if (lane == 0) loss[bh] = (float)(R > 0 ? lsum / (double)R : 0.0);
}

/* backward: scaled coefficients per (b, h, i) and the per-(b, h) scale; one CTA per (b, h) */
__global__ void __launch_bounds__(256) dsv_pl_coef_kernel(const dsv_pl_args a, const float* dloss,
                                                          const float* row_stats) {
  __shared__ float red[8];
  __shared__ float sc;
  const int64_t bh = blockIdx.x;
  const int64_t R = a.R;
  const double g = (R > 0) ? (double)dloss[bh] / (double)R : 0.0;
  float mb = 0.f;
  for (int64_t i = threadIdx.x; i < R; i += blockDim.x) {
    const int64_t pos = a.rows[i];
    const float* rs = row_stats + (bh * R + i) * 3;
    double ca = 0, cc = 0, bound = 0;
    if (pos >= 0 && pos < a.S) {
      const double nz = sqrt((double)rs[1] + PL_EPS), np = sqrt((double)rs[2] + PL_EPS);
      ca = -g * a.cw / (nz * np);
      cc = g * (a.cw * (double)rs[0] / (nz * np * np * np) + 2.0 * a.nw * (np / nz - 1.0) / (nz * np));
      bound = fabs(ca) * nz + fabs(cc) * np;
    }
    a.coef[(bh * R + i) * 2] = (float)ca;
    a.coef[(bh * R + i) * 2 + 1] = (float)cc;
    const float bf = (float)bound;
    if (bf > mb && bf < INFINITY) mb = bf;
  }
  mb = dsv_warp_max(mb);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = mb;
  __syncthreads();
  if (threadIdx.x == 0) {
    float m = 0.f;
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) m = fmaxf(m, red[w]);
    int e = 0;
    if (m > 0.f) {
      frexpf(m, &e);
      e = 14 - e;
      e = e > 120 ? 120 : (e < -120 ? -120 : e);
    }
    sc = ldexpf(1.f, e);
    a.inv_scale[bh] = ldexpf(1.f, -e);
  }
  __syncthreads();
  const float s = sc;
  for (int64_t i = threadIdx.x; i < R; i += blockDim.x) {
    a.coef[(bh * R + i) * 2] *= s;
    a.coef[(bh * R + i) * 2 + 1] *= s;
  }
}

/* duplicate chains of the sampled rows (independent of (b, h)) */
__global__ void dsv_pl_rows_prep_kernel(const int32_t* rows, int64_t R, int64_t S, int32_t* pos2i,
                                        int32_t* nxt) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= R) return;
  const int32_t p = rows[i];
  int32_t nx = -1;
  bool canonical = true;
  for (int64_t t = 0; t < R; ++t) {
    if (rows[t] != p) continue;
    if (t < i) canonical = false;
    if (t > i) {
      nx = (int32_t)t;
      break;
    }
  }
  nxt[i] = nx;
  if (canonical && p >= 0 && (int64_t)p < S) pos2i[p] = (int32_t)i;
}

/* dq_lr for every (b, s, h): zero or the sum of the sampled rows' partials */
template <typename T>
__global__ void dsv_pl_dq_final_kernel(const dsv_pl_args a) {
  const int64_t row = (int64_t)blockIdx.x * blockDim.y + threadIdx.y; /* bh * S + s */
  const int c = threadIdx.x;
  if (row >= a.BH * a.S || c >= a.r) return;
  const int64_t bh = row / a.S, s = row - bh * a.S;
  const int64_t b = bh / a.H, h = bh - b * a.H;
  float v = 0.f;
  int32_t i = a.pos2i[s];
  const int RP = a.RPs;
  while (i >= 0) {
    for (int sp = 0; sp < a.nsplit; ++sp) v += a.dqp[(((int64_t)sp * a.BH + bh) * a.R + i) * RP + c];
    i = a.nxt[i];
  }
  T* dq = reinterpret_cast<T*>(a.dq);
  dq[b * a.dq_sb + s * a.dq_ss + h * a.dq_sh + c] = dsv_cvt<T>::from(v * a.inv_scale[bh]);
}

/* ---- host ---- */
static int dsv_pl_dp(int64_t D) {
  if (D <= 64) return 64;
  if (D <= 96) return 96;
  if (D <= 128) return 128;
  if (D <= 256) return 256;
  return 0;
}
static int dsv_pl_rp(int64_t r) {
  if (r <= 16) return 16;
  if (r <= 32) return 32;
  if (r <= 64) return 64;
  return 0;
}
static void dsv_pl_split(const dsv_predictor_shape* p, int* nsplit, int64_t* kchunk) {
  int64_t ns = dsv_cdiv64(p->seqlen, PL_KCHUNK_MIN);
  if (ns > PL_MAX_SPLIT) ns = PL_MAX_SPLIT;
  if (ns < 1) ns = 1;
  int64_t kc = dsv_cdiv64(p->seqlen, ns);
  kc = dsv_cdiv64(kc, 64) * 64;
  if (kc < 64) kc = 64;
  *nsplit = (int)ns;
  *kchunk = kc;
}

extern "C" size_t dsv_predictor_loss_workspace_cuda(const dsv_predictor_shape* p) {
  if (!p || p->batch <= 0 || p->heads <= 0 || p->seqlen <= 0) return 256;
  int ns;
  int64_t kc;
  dsv_pl_split(p, &ns, &kc);
  const int RP = dsv_pl_rp(p->rank) ? dsv_pl_rp(p->rank) : 64;
  const size_t BH = (size_t)(p->batch * p->heads), R = (size_t)(p->num_rows > 0 ? p->num_rows : 1);
  const size_t fwd = dsv_align_up((size_t)ns * BH * R * 3 * 4, 256);
  size_t bwd = 0;
  bwd += dsv_align_up((size_t)p->seqlen * 4, 256);          /* pos2i */
  bwd += dsv_align_up(R * 4, 256);                           /* nxt */
  bwd += dsv_align_up(BH * R * 2 * 4, 256);                  /* coef */
  bwd += dsv_align_up(BH * 4, 256);                          /* inv_scale */
  bwd += dsv_align_up((size_t)ns * BH * R * RP * 4, 256);    /* dqp */
  return fwd > bwd ? fwd : bwd;
}

static int dsv_pl_fill(const dsv_predictor_shape* p, dsv_bshd q, dsv_bshd k, dsv_bshd q_lr,
                       dsv_bshd k_lr, const int32_t* rows, dsv_pl_args* a) {
  if (!p) return DSV_ERR_INVALID;
  if (p->batch < 0 || p->seqlen < 0 || p->heads < 0 || p->head_dim <= 0 || p->rank <= 0 ||
      p->num_rows < 0 || p->seqlen > 0x7fffffffLL || p->num_rows > 0x7fffffffLL)
    return DSV_ERR_INVALID;
  if (p->dtype != DSV_BFLOAT16 && p->dtype != DSV_FLOAT16) return DSV_ERR_UNSUPPORTED;
  if (!dsv_pl_dp(p->head_dim) || !dsv_pl_rp(p->rank)) return DSV_ERR_UNSUPPORTED;
  memset(a, 0, sizeof(*a));
  a->q = q.data;
  a->k = k.data;
  a->ql = q_lr.data;
  a->kl = k_lr.data;
  a->q_sb = q.stride_b;
  a->q_ss = q.stride_s;
  a->q_sh = q.stride_h;
  a->k_sb = k.stride_b;
  a->k_ss = k.stride_s;
  a->k_sh = k.stride_h;
  a->ql_sb = q_lr.stride_b;
  a->ql_ss = q_lr.stride_s;
  a->ql_sh = q_lr.stride_h;
  a->kl_sb = k_lr.stride_b;
  a->kl_ss = k_lr.stride_s;
  a->kl_sh = k_lr.stride_h;
  a->rows = rows;
  a->S = p->seqlen;
  a->H = p->heads;
  a->D = p->head_dim;
  a->r = p->rank;
  a->R = p->num_rows;
  a->BH = p->batch * p->heads;
  a->scale = (float)p->scale;
  a->cw = p->cos_weight;
  a->nw = p->norm_weight;
  a->row_tiles = (int)dsv_cdiv64(p->num_rows, PL_ROWS);
  dsv_pl_split(p, &a->nsplit, &a->kchunk);
  a->kvec = dsv_bshd_rows_aligned16(k, 2);
  a->klvec = dsv_bshd_rows_aligned16(k_lr, 2);
  a->qvec = dsv_bshd_rows_aligned16(q, 2);
  a->qlvec = dsv_bshd_rows_aligned16(q_lr, 2);
  a->RPs = dsv_pl_rp(p->rank);
  return DSV_OK;
}

template <typename T, int DP, int RP>
static int dsv_pl_launch3(const dsv_pl_args& a, int which, cudaStream_t st) {
  if (which == 0) {
    const int64_t grid = a.BH * a.row_tiles * a.nsplit;
    dsv_pl_rows_kernel<T, DP, RP, PL_MODE_FWD><<<(unsigned)grid, PL_THREADS, 0, st>>>(a);
  } else if (which == 1) {
    const int64_t grid = a.BH * a.row_tiles * a.nsplit;
    dsv_pl_rows_kernel<T, DP, RP, PL_MODE_DQ><<<(unsigned)grid, PL_THREADS, 0, st>>>(a);
  } else {
    const int64_t grid = a.BH * dsv_cdiv64(a.S, PL_ROWS);
    dsv_pl_dk_kernel<T, DP, RP><<<(unsigned)grid, PL_THREADS, 0, st>>>(a);
  }
  DSV_CUDA_CHECK_LAUNCH();
  return DSV_OK;
}
template <typename T, int DP>
static int dsv_pl_launch2(const dsv_pl_args& a, int which, cudaStream_t st) {
  switch (a.RPs) {
    case 16: return dsv_pl_launch3<T, DP, 16>(a, which, st);
    case 32: return dsv_pl_launch3<T, DP, 32>(a, which, st);
    case 64: return dsv_pl_launch3<T, DP, 64>(a, which, st);
  }
  return DSV_ERR_UNSUPPORTED;
}
template <typename T>
static int dsv_pl_launch1(const dsv_pl_args& a, int which, cudaStream_t st) {
  switch (dsv_pl_dp(a.D)) {
    case 64: return dsv_pl_launch2<T, 64>(a, which, st);
    case 96: return dsv_pl_launch2<T, 96>(a, which, st);
    case 128: return dsv_pl_launch2<T, 128>(a, which, st);
    case 256: return dsv_pl_launch2<T, 256>(a, which, st);
  }
  return DSV_ERR_UNSUPPORTED;
}
static int dsv_pl_launch(const dsv_pl_args& a, dsv_dtype dt, int which, cudaStream_t st) {
  if (dt == DSV_BFLOAT16) return dsv_pl_launch1<__nv_bfloat16>(a, which, st);
  return dsv_pl_launch1<__half>(a, which, st);
}

extern "C" int dsv_predictor_loss_fwd_cuda(const dsv_predictor_shape* p, dsv_bshd q, dsv_bshd k,
                                           dsv_bshd q_lr, dsv_bshd k_lr, const int32_t* rows,
                                           void* loss, void* row_stats, void* workspace,
                                           size_t workspace_bytes, void* stream) {
  dsv_pl_args a;
  int stc = dsv_pl_fill(p, q, k, q_lr, k_lr, rows, &a);
  if (stc != DSV_OK) return stc;
  if (a.BH == 0) return DSV_OK;
  if (!loss || (a.R > 0 && (!rows || !row_stats))) return DSV_ERR_INVALID;
  cudaStream_t st = (cudaStream_t)stream;
  if (a.R > 0 && a.S > 0) {
    if (!q.data || !k.data || !q_lr.data || !k_lr.data) return DSV_ERR_INVALID;
    if (!workspace || workspace_bytes < dsv_predictor_loss_workspace_cuda(p)) return DSV_ERR_NOMEM;
    a.part = (float*)workspace;
    stc = dsv_pl_launch(a, p->dtype, 0, st);
    if (stc != DSV_OK) return stc;
  } else if (a.R > 0) {
    /* S == 0: every sum is zero */
    if (!workspace || workspace_bytes < (size_t)a.BH * a.R * 3 * 4) return DSV_ERR_NOMEM;
    a.part = (float*)workspace;
    a.nsplit = 1;
    DSV_CUDA_TRY(cudaMemsetAsync(workspace, 0, (size_t)a.BH * a.R * 3 * 4, st));
  }
  dsv_pl_fwd_finalize_kernel<<<(unsigned)dsv_cdiv64(a.BH, 4), 128, 0, st>>>(a, (float*)loss,
                                                                            (float*)row_stats);
  DSV_CUDA_CHECK_LAUNCH();
  return DSV_OK;
}

extern "C" int dsv_predictor_loss_bwd_cuda(const dsv_predictor_shape* p, dsv_bshd q, dsv_bshd k,
                                           dsv_bshd q_lr, dsv_bshd k_lr, const int32_t* rows,
                                           const void* dloss, const void* row_stats,
                                           dsv_bshd dq_lr, dsv_bshd dk_lr, void* workspace,
                                           size_t workspace_bytes, void* stream) {
  dsv_pl_args a;
  int stc = dsv_pl_fill(p, q, k, q_lr, k_lr, rows, &a);
  if (stc != DSV_OK) return stc;
  if (a.BH == 0 || a.S == 0) return DSV_OK;
  if (!dloss || !dq_lr.data || !dk_lr.data || (a.R > 0 && (!rows || !row_stats)))
    return DSV_ERR_INVALID;
  if (!q.data || !k.data || !q_lr.data || !k_lr.data) return DSV_ERR_INVALID;
  if (!workspace || workspace_bytes < dsv_predictor_loss_workspace_cuda(p)) return DSV_ERR_NOMEM;
  cudaStream_t st = (cudaStream_t)stream;
  const size_t R1 = (size_t)(a.R > 0 ? a.R : 1);
  char* ws = (char*)workspace;
  a.pos2i = (int32_t*)ws;
  ws += dsv_align_up((size_t)a.S * 4, 256);
  a.nxt = (int32_t*)ws;
  ws += dsv_align_up(R1 * 4, 256);
  a.coef = (float*)ws;
  ws += dsv_align_up((size_t)a.BH * R1 * 2 * 4, 256);
  a.inv_scale = (float*)ws;
  ws += dsv_align_up((size_t)a.BH * 4, 256);
  a.dqp = (float*)ws;
  a.dk = dk_lr.data;
  a.dk_sb = dk_lr.stride_b;
  a.dk_ss = dk_lr.stride_s;
  a.dk_sh = dk_lr.stride_h;
  a.dq = dq_lr.data;
  a.dq_sb = dq_lr.stride_b;
  a.dq_ss = dq_lr.stride_s;
  a.dq_sh = dq_lr.stride_h;

  DSV_CUDA_TRY(cudaMemsetAsync(a.pos2i, 0xff, (size_t)a.S * 4, st));
  if (a.R > 0) {
    dsv_pl_rows_prep_kernel<<<(unsigned)dsv_cdiv64(a.R, 128), 128, 0, st>>>(rows, a.R, a.S,
                                                                           a.pos2i, a.nxt);
    DSV_CUDA_CHECK_LAUNCH();
  }
  dsv_pl_coef_kernel<<<(unsigned)a.BH, 256, 0, st>>>(a, (const float*)dloss,
                                                    (const float*)row_stats);
  DSV_CUDA_CHECK_LAUNCH();
  if (a.R > 0) {
    stc = dsv_pl_launch(a, p->dtype, 1, st);
    if (stc != DSV_OK) return stc;
  }
  stc = dsv_pl_launch(a, p->dtype, 2, st);
  if (stc != DSV_OK) return stc;
  {
    dim3 blk(64, 4);
    const int64_t nrows = a.BH * a.S;
    if (p->dtype == DSV_BFLOAT16)
      dsv_pl_dq_final_kernel<__nv_bfloat16><<<(unsigned)dsv_cdiv64(nrows, 4), blk, 0, st>>>(a);
    else
      dsv_pl_dq_final_kernel<__half><<<(unsigned)dsv_cdiv64(nrows, 4), blk, 0, st>>>(a);
    DSV_CUDA_CHECK_LAUNCH();
  }
  return DSV_OK;
}
