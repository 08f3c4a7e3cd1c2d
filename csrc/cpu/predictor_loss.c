/*
 * predictor_loss.c - C11 reference kernels of the low-rank predictor loss (forward + backward).
 *
 * For sampled row i of (b, h) (query position rows[i]), over all keys j < S:
 *   z_j = scale * q_i . k_j, p_j = q_lr_i . k_lr_j,
 *   Szp = sum z_j p_j, Szz = sum z_j^2, Spp = sum p_j^2, nz = sqrt(Szz + eps), np = sqrt(Spp + eps)
 *   loss_i = cw * (1 - Szp / (nz np)) + nw * (np / nz - 1)^2,  loss[b, h] = mean_i loss_i.
 * Forward: one pass over the keys per row, keeping the three sums (row_stats).
 * Backward (q, k constant): with g = dloss[b, h] / R,
 *   dloss_i/dp_j = a_i z_j + c_i p_j,  a_i = -g cw / (nz np),
 *   c_i = g (cw Szp / (nz np^3) + 2 nw (np / nz - 1) / (nz np)),
 *   dq_lr[rows[i]] += sum_j (a_i z_j + c_i p_j) k_lr_j,   dk_lr[j] = sum_i (a_i z_j + c_i p_j) q_lr_i.
 * Two passes recompute z and p (one per row for dq_lr, one per key for dk_lr), so no S x S or
 * R x S matrix is stored and no two threads write the same element. Sums are kept in double.
 * Rows outside [0, S) are ignored (stats 0, no gradient); the Python layer rejects them.
 *
 * This file includes itself twice (DSV_T = float, then double) to instantiate both dtypes.
 */
#ifndef DSV_T

#include "cpu_common.h"

#define DSV_PL_EPS 1e-12

#define DSV_T float
#define DSV_SUF f32
#include "predictor_loss.c"
#undef DSV_T
#undef DSV_SUF

#define DSV_T double
#define DSV_SUF f64
#include "predictor_loss.c"
#undef DSV_T
#undef DSV_SUF

static int dsv_pl_check(const dsv_predictor_shape* p) {
  if (!p) return DSV_ERR_INVALID;
  if (p->batch < 0 || p->seqlen < 0 || p->heads < 0 || p->head_dim <= 0 || p->rank <= 0 ||
      p->num_rows < 0)
    return DSV_ERR_INVALID;
  if (!dsv_is_float_dtype(p->dtype)) return DSV_ERR_UNSUPPORTED;
  /* sizes of the activations and of the per-row scratch (B H num_rows (rank + 3) doubles) */
  int64_t bh = 0, n = 0;
  const int64_t wide = DSV_MAX(p->head_dim, p->rank);
  if (dsv_mul_ok(p->batch, p->heads, &bh) != DSV_OK || dsv_mul_ok(bh, p->seqlen, &n) != DSV_OK ||
      dsv_mul_ok(n, wide, &n) != DSV_OK || dsv_mul_ok(n, 8, &n) != DSV_OK)
    return DSV_ERR_INVALID;
  if (p->rank > INT64_MAX - 3 || dsv_mul_ok(bh, p->num_rows, &n) != DSV_OK ||
      dsv_mul_ok(n, p->rank + 3, &n) != DSV_OK || dsv_mul_ok(n, 8, &n) != DSV_OK)
    return DSV_ERR_INVALID;
  return DSV_OK;
}

int dsv_predictor_loss_fwd_cpu(const dsv_predictor_shape* p, dsv_bshd q, dsv_bshd k,
                               dsv_bshd q_lr, dsv_bshd k_lr, const int32_t* rows, void* loss,
                               void* row_stats) {
  int st = dsv_pl_check(p);
  if (st != DSV_OK) return st;
  if (p->batch == 0 || p->heads == 0) return DSV_OK;
  if (!loss || (p->num_rows > 0 && (!rows || !row_stats))) return DSV_ERR_INVALID;
  if (p->seqlen > 0 && p->num_rows > 0 && (!q.data || !k.data || !q_lr.data || !k_lr.data))
    return DSV_ERR_INVALID;
  if (p->dtype == DSV_FLOAT32)
    return pl_fwd_f32(p, &q, &k, &q_lr, &k_lr, rows, (float*)loss, (float*)row_stats);
  return pl_fwd_f64(p, &q, &k, &q_lr, &k_lr, rows, (double*)loss, (double*)row_stats);
}

int dsv_predictor_loss_bwd_cpu(const dsv_predictor_shape* p, dsv_bshd q, dsv_bshd k,
                               dsv_bshd q_lr, dsv_bshd k_lr, const int32_t* rows,
                               const void* dloss, const void* row_stats, dsv_bshd dq_lr,
                               dsv_bshd dk_lr) {
  int st = dsv_pl_check(p);
  if (st != DSV_OK) return st;
  if (p->batch == 0 || p->heads == 0 || p->seqlen == 0) return DSV_OK;
  if (!dloss || !dq_lr.data || !dk_lr.data || (p->num_rows > 0 && (!rows || !row_stats)))
    return DSV_ERR_INVALID;
  if (!q.data || !k.data || !q_lr.data || !k_lr.data) return DSV_ERR_INVALID;
  if (p->dtype == DSV_FLOAT32)
    return pl_bwd_f32(p, &q, &k, &q_lr, &k_lr, rows, (const float*)dloss,
                      (const float*)row_stats, &dq_lr, &dk_lr);
  return pl_bwd_f64(p, &q, &k, &q_lr, &k_lr, rows, (const double*)dloss,
                    (const double*)row_stats, &dq_lr, &dk_lr);
}

#else /* ---------------- dtype-generic part (DSV_T defined) ---------------- */

static inline double DSV_FN(pl_dot)(const DSV_T* a, const DSV_T* b, int64_t n) {
  double s = 0;
  for (int64_t d = 0; d < n; ++d) s += (double)a[d] * (double)b[d];
  return s;
}

static int DSV_FN(pl_fwd)(const dsv_predictor_shape* p, const dsv_bshd* q, const dsv_bshd* k,
                          const dsv_bshd* q_lr, const dsv_bshd* k_lr, const int32_t* rows,
                          DSV_T* loss, DSV_T* row_stats) {
  const int64_t B = p->batch, S = p->seqlen, H = p->heads, D = p->head_dim, R = p->rank,
                NR = p->num_rows;
  const double scale = p->scale, cw = p->cos_weight, nw = p->norm_weight;
  const DSV_T* qd = (const DSV_T*)q->data;
  const DSV_T* kd = (const DSV_T*)k->data;
  const DSV_T* qld = (const DSV_T*)q_lr->data;
  const DSV_T* kld = (const DSV_T*)k_lr->data;
  const int64_t ntasks = B * H * NR;

  DSV_OMP(parallel for schedule(dynamic, 1))
  for (int64_t t = 0; t < ntasks; ++t) {
    const int64_t bh = t / NR, i = t % NR;
    const int64_t b = bh / H, h = bh % H;
    const int64_t row = rows[i];
    /* a row outside [0, S) (given with check_rows=False) has no loss: NaN, which makes the
     * mean NaN rather than counting it as some value */
    double szp = NAN, szz = NAN, spp = NAN;
    if (row >= 0 && row < S) {
      szp = szz = spp = 0;
      const DSV_T* qi = qd + dsv_off(q, b, row, h);
      const DSV_T* qli = qld + dsv_off(q_lr, b, row, h);
      for (int64_t j = 0; j < S; ++j) {
        const double z = scale * DSV_FN(pl_dot)(qi, kd + dsv_off(k, b, j, h), D);
        const double pj = DSV_FN(pl_dot)(qli, kld + dsv_off(k_lr, b, j, h), R);
        szp += z * pj;
        szz += z * z;
        spp += pj * pj;
      }
    }
    DSV_T* rs = row_stats + t * 3;
    rs[0] = (DSV_T)szp;
    rs[1] = (DSV_T)szz;
    rs[2] = (DSV_T)spp;
  }

  DSV_OMP(parallel for schedule(static))
  for (int64_t bh = 0; bh < B * H; ++bh) {
    double acc = 0;
    for (int64_t i = 0; i < NR; ++i) {
      const DSV_T* rs = row_stats + (bh * NR + i) * 3;
      const double nz = sqrt((double)rs[1] + DSV_PL_EPS);
      const double np = sqrt((double)rs[2] + DSV_PL_EPS);
      const double r = np / nz - 1.0;
      acc += cw * (1.0 - (double)rs[0] / (nz * np)) + nw * r * r;
    }
    loss[bh] = (DSV_T)(NR > 0 ? acc / (double)NR : 0.0);
  }
  return DSV_OK;
}

static int DSV_FN(pl_bwd)(const dsv_predictor_shape* p, const dsv_bshd* q, const dsv_bshd* k,
                          const dsv_bshd* q_lr, const dsv_bshd* k_lr, const int32_t* rows,
                          const DSV_T* dloss, const DSV_T* row_stats, const dsv_bshd* dq_lr,
                          const dsv_bshd* dk_lr) {
  const int64_t B = p->batch, S = p->seqlen, H = p->heads, D = p->head_dim, R = p->rank,
                NR = p->num_rows;
  const double scale = p->scale, cw = p->cos_weight, nw = p->norm_weight;
  const DSV_T* qd = (const DSV_T*)q->data;
  const DSV_T* kd = (const DSV_T*)k->data;
  const DSV_T* qld = (const DSV_T*)q_lr->data;
  const DSV_T* kld = (const DSV_T*)k_lr->data;
  DSV_T* dqd = (DSV_T*)dq_lr->data;
  DSV_T* dkd = (DSV_T*)dk_lr->data;
  const int64_t nbh = B * H;

  /* Coefficients (a_i, c_i) per (b, h, i) and the per-row dq_lr contributions. */
  double* coef = (double*)malloc((size_t)DSV_MAX(nbh * NR * 2, 1) * sizeof(double));
  double* dqrow = (double*)malloc((size_t)DSV_MAX(nbh * NR * R, 1) * sizeof(double));
  if (!coef || !dqrow) {
    free(coef);
    free(dqrow);
    return DSV_ERR_NOMEM;
  }
  for (int64_t t = 0; t < nbh * NR; ++t) {
    const int64_t bh = t / NR;
    const DSV_T* rs = row_stats + t * 3;
    const double g = (double)dloss[bh] / (double)NR;
    const double nz = sqrt((double)rs[1] + DSV_PL_EPS);
    const double np = sqrt((double)rs[2] + DSV_PL_EPS);
    coef[2 * t] = -g * cw / (nz * np);
    coef[2 * t + 1] =
        g * (cw * (double)rs[0] / (nz * np * np * np) + 2.0 * nw * (np / nz - 1.0) / (nz * np));
  }

  /* Pass 1: per sampled row, dq contribution = sum_j dp_j k_lr_j. */
  DSV_OMP(parallel for schedule(dynamic, 1))
  for (int64_t t = 0; t < nbh * NR; ++t) {
    const int64_t bh = t / NR, i = t % NR;
    const int64_t b = bh / H, h = bh % H;
    const int64_t row = rows[i];
    double* acc = dqrow + t * R;
    for (int64_t r = 0; r < R; ++r) acc[r] = 0;
    if (row < 0 || row >= S) continue;
    const double a = coef[2 * t], c = coef[2 * t + 1];
    const DSV_T* qi = qd + dsv_off(q, b, row, h);
    const DSV_T* qli = qld + dsv_off(q_lr, b, row, h);
    for (int64_t j = 0; j < S; ++j) {
      const DSV_T* klj = kld + dsv_off(k_lr, b, j, h);
      const double z = scale * DSV_FN(pl_dot)(qi, kd + dsv_off(k, b, j, h), D);
      const double pj = DSV_FN(pl_dot)(qli, klj, R);
      const double dp = a * z + c * pj;
      for (int64_t r = 0; r < R; ++r) acc[r] += dp * (double)klj[r];
    }
  }

  /* dq_lr: zero every row, then add the sampled rows' contributions (serial within (b, h), so a
   * row sampled twice gets both contributions without a race). */
  DSV_OMP(parallel for schedule(static))
  for (int64_t bh = 0; bh < nbh; ++bh) {
    const int64_t b = bh / H, h = bh % H;
    for (int64_t s = 0; s < S; ++s) {
      DSV_T* dst = dqd + dsv_off(dq_lr, b, s, h);
      for (int64_t r = 0; r < R; ++r) dst[r] = 0;
    }
    for (int64_t i = 0; i < NR; ++i) {
      const int64_t row = rows[i];
      if (row < 0 || row >= S) continue;
      DSV_T* dst = dqd + dsv_off(dq_lr, b, row, h);
      const double* src = dqrow + (bh * NR + i) * R;
      for (int64_t r = 0; r < R; ++r) dst[r] += (DSV_T)src[r];
    }
  }

  /* Pass 2: per key, dk_lr_j = sum_i dp_ij q_lr_i. */
  DSV_OMP(parallel for schedule(static))
  for (int64_t t = 0; t < nbh * S; ++t) {
    const int64_t bh = t / S, j = t % S;
    const int64_t b = bh / H, h = bh % H;
    const DSV_T* kj = kd + dsv_off(k, b, j, h);
    const DSV_T* klj = kld + dsv_off(k_lr, b, j, h);
    double acc[64];
    double* accp = acc;
    double* heap_acc = NULL;
    if (R > 64) {
      heap_acc = (double*)calloc((size_t)R, sizeof(double));
      accp = heap_acc;
    }
    DSV_T* dst = dkd + dsv_off(dk_lr, b, j, h);
    if (!accp) { /* allocation failure: leave a defined value */
      for (int64_t r = 0; r < R; ++r) dst[r] = (DSV_T)NAN;
      continue;
    }
    for (int64_t r = 0; r < R; ++r) accp[r] = 0;
    for (int64_t i = 0; i < NR; ++i) {
      const int64_t row = rows[i];
      if (row < 0 || row >= S) continue;
      const int64_t ti = bh * NR + i;
      const DSV_T* qli = qld + dsv_off(q_lr, b, row, h);
      const double z = scale * DSV_FN(pl_dot)(qd + dsv_off(q, b, row, h), kj, D);
      const double pj = DSV_FN(pl_dot)(qli, klj, R);
      const double dp = coef[2 * ti] * z + coef[2 * ti + 1] * pj;
      for (int64_t r = 0; r < R; ++r) accp[r] += dp * (double)qli[r];
    }
    for (int64_t r = 0; r < R; ++r) dst[r] = (DSV_T)accp[r];
    free(heap_acc);
  }

  free(coef);
  free(dqrow);
  return DSV_OK;
}

#endif /* DSV_T */
