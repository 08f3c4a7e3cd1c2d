/*
 * cpu_common.h - helpers shared by the C11 reference kernels in csrc/cpu/.
 *
 * Dtype-generic code: each kernel file includes itself twice (guarded by DSV_T being defined)
 * with DSV_T = float / double and DSV_SUF = f32 / f64; DSV_FN(name) then makes name_f32 / name_f64.
 * The "acc" type of dsv.h is DSV_T itself (float32 -> float32, float64 -> float64).
 */
#ifndef DSV_CPU_COMMON_H
#define DSV_CPU_COMMON_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dsv.h"

#ifdef _OPENMP
#include <omp.h>
#define DSV_PRAGMA(x) _Pragma(#x)
#define DSV_OMP(x) DSV_PRAGMA(omp x)
static inline int dsv_thread_num(void) { return omp_get_thread_num(); }
static inline int dsv_max_threads(void) { return omp_get_max_threads(); }
#else
#define DSV_OMP(x)
static inline int dsv_thread_num(void) { return 0; }
static inline int dsv_max_threads(void) { return 1; }
#endif

#define DSV_CAT2(a, b) a##_##b
#define DSV_CAT(a, b) DSV_CAT2(a, b)
#define DSV_FN(name) DSV_CAT(name, DSV_SUF)

#define DSV_MIN(a, b) ((a) < (b) ? (a) : (b))
#define DSV_MAX(a, b) ((a) > (b) ? (a) : (b))

/* Element offset of (b, s, h, 0) in a strided [B, S, H, D] view. */
static inline int64_t dsv_off(const dsv_bshd* t, int64_t b, int64_t s, int64_t h) {
  return b * t->stride_b + s * t->stride_s + h * t->stride_h;
}

/* *out = a * b for a, b >= 0; DSV_ERR_INVALID when the product does not fit in int64 (the
 * size checks of every entry point use this: no size computation may wrap). */
static inline int dsv_mul_ok(int64_t a, int64_t b, int64_t* out) {
  if (a < 0 || b < 0) return DSV_ERR_INVALID;
  if (a != 0 && b > INT64_MAX / a) return DSV_ERR_INVALID;
  *out = a * b;
  return DSV_OK;
}

/* A count clamped to [0, kmax] as dsv.h requires. */
static inline int64_t dsv_clamp_count(int32_t c, int64_t kmax) {
  int64_t v = (int64_t)c;
  if (v < 0) v = 0;
  if (v > kmax) v = kmax;
  return v;
}

static inline int dsv_is_float_dtype(dsv_dtype dt) {
  return dt == DSV_FLOAT32 || dt == DSV_FLOAT64;
}

/* Size in bytes of one element of a dtype (0 for an unknown dtype). */
static inline size_t dsv_dtype_size(dsv_dtype dt) {
  switch (dt) {
    case DSV_FLOAT32: return 4;
    case DSV_FLOAT64: return 8;
    case DSV_FLOAT16: return 2;
    case DSV_BFLOAT16: return 2;
    default: return 0;
  }
}

/* Half-type conversions (used by the row helpers only; other kernels see float32/float64). */
static inline float dsv_bf16_to_float(uint16_t h) {
  uint32_t u = ((uint32_t)h) << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static inline float dsv_fp16_to_float(uint16_t h) {
  uint32_t sign = ((uint32_t)(h & 0x8000u)) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else { /* subnormal: value = man * 2^-24 */
      float f = (float)man * 5.9604644775390625e-8f;
      memcpy(&u, &f, sizeof u);
      u |= sign;
    }
  } else if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);
  } else {
    u = sign | ((exp + 112u) << 23) | (man << 13);
  }
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

#endif /* DSV_CPU_COMMON_H */
