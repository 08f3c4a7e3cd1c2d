/*
 * rows.c - C11 row gather / scatter-add helpers (building blocks of the sparse all-to-all).
 *
 * gather:      dst[i, :] = src[index[i], :] for every dtype (a byte copy of dim elements);
 *              rows whose index is outside [0, num_rows) are zero-filled.
 * scatter-add: dst[index[i], :] += src[i, :] into a caller-zeroed acc-type dst (float64 for
 *              float64 src, float32 otherwise; half-type src is widened); indices outside
 *              [0, num_rows) are skipped. Parallel over column blocks, so duplicate indices
 *              never race and the sums are added in index order (deterministic).
 */
#include "cpu_common.h"

/* Byte sizes of the tables (rows x max(dim, stride) x element size) must fit in int64. */
static int dsv_rows_sizes_ok(int64_t dim, int64_t stride, int64_t count, int64_t num_rows,
                             int64_t es) {
  int64_t n = 0;
  const int64_t w = DSV_MAX(dim, stride);
  if (dsv_mul_ok(DSV_MAX(count, num_rows), w, &n) != DSV_OK || dsv_mul_ok(n, es, &n) != DSV_OK)
    return DSV_ERR_INVALID;
  return DSV_OK;
}

int dsv_gather_rows_cpu(dsv_dtype dtype, int64_t dim, const void* src, int64_t src_row_stride,
                        int64_t num_rows, const int64_t* index, int64_t count, void* dst) {
  const size_t es = dsv_dtype_size(dtype);
  if (es == 0) return DSV_ERR_UNSUPPORTED;
  if (dim < 0 || count < 0 || num_rows < 0 || src_row_stride < 0) return DSV_ERR_INVALID;
  if (dsv_rows_sizes_ok(dim, src_row_stride, count, num_rows, (int64_t)es) != DSV_OK)
    return DSV_ERR_INVALID;
  if (count == 0 || dim == 0) return DSV_OK;
  if (!index || !dst || (num_rows > 0 && !src)) return DSV_ERR_INVALID;
  const unsigned char* s = (const unsigned char*)src;
  unsigned char* d = (unsigned char*)dst;
  const size_t row_bytes = (size_t)dim * es;
  DSV_OMP(parallel for schedule(static) if (count * dim > 65536))
  for (int64_t i = 0; i < count; ++i) {
    const int64_t r = index[i];
    unsigned char* out = d + (size_t)i * row_bytes;
    if (r >= 0 && r < num_rows)
      memcpy(out, s + (size_t)r * (size_t)src_row_stride * es, row_bytes);
    else
      memset(out, 0, row_bytes);
  }
  return DSV_OK;
}

#define DSV_SCATTER_COLS 64

static inline float dsv_load_f(dsv_dtype dt, const void* base, size_t off) {
  switch (dt) {
    case DSV_FLOAT32: return ((const float*)base)[off];
    case DSV_FLOAT16: return dsv_fp16_to_float(((const uint16_t*)base)[off]);
    default: return dsv_bf16_to_float(((const uint16_t*)base)[off]);
  }
}

int dsv_scatter_add_rows_cpu(dsv_dtype dtype, int64_t dim, const void* src,
                             int64_t src_row_stride, const int64_t* index, int64_t count,
                             int64_t num_rows, void* dst) {
  if (dsv_dtype_size(dtype) == 0) return DSV_ERR_UNSUPPORTED;
  if (dim < 0 || count < 0 || num_rows < 0 || src_row_stride < 0) return DSV_ERR_INVALID;
  if (dsv_rows_sizes_ok(dim, src_row_stride, count, num_rows, 8) != DSV_OK)
    return DSV_ERR_INVALID;
  if (count == 0 || dim == 0 || num_rows == 0) return DSV_OK;
  if (!index || !dst || !src) return DSV_ERR_INVALID;
  const int64_t nblk = (dim + DSV_SCATTER_COLS - 1) / DSV_SCATTER_COLS;
  if (dtype == DSV_FLOAT64) {
    const double* s = (const double*)src;
    double* d = (double*)dst;
    DSV_OMP(parallel for schedule(static) if (count * dim > 65536))
    for (int64_t blk = 0; blk < nblk; ++blk) {
      const int64_t c0 = blk * DSV_SCATTER_COLS, c1 = DSV_MIN(dim, c0 + DSV_SCATTER_COLS);
      for (int64_t i = 0; i < count; ++i) {
        const int64_t r = index[i];
        if (r < 0 || r >= num_rows) continue;
        const double* si = s + i * src_row_stride;
        double* dr = d + r * dim;
        for (int64_t c = c0; c < c1; ++c) dr[c] += si[c];
      }
    }
  } else {
    float* d = (float*)dst;
    DSV_OMP(parallel for schedule(static) if (count * dim > 65536))
    for (int64_t blk = 0; blk < nblk; ++blk) {
      const int64_t c0 = blk * DSV_SCATTER_COLS, c1 = DSV_MIN(dim, c0 + DSV_SCATTER_COLS);
      for (int64_t i = 0; i < count; ++i) {
        const int64_t r = index[i];
        if (r < 0 || r >= num_rows) continue;
        float* dr = d + r * dim;
        const size_t base = (size_t)(i * src_row_stride);
        for (int64_t c = c0; c < c1; ++c) dr[c] += dsv_load_f(dtype, src, base + (size_t)c);
      }
    }
  }
  return DSV_OK;
}
