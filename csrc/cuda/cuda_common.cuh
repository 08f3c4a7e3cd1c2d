/*
 * cuda_common.cuh - small helpers shared by the non-attention CUDA kernels of dsv-ext
 * (topk_estimate.cu, predictor_loss.cu, profile_attention.cu, rows.cu).
 *
 * Everything here is prefixed dsv_ and static/inline so that it can be included next to
 * attention_common.cuh without clashes; the PTX wrappers (mma16816, cp_async16, ...) are ptx.cuh's. C-style CUDA: no STL, templates only for dtypes/tiles.
 */
#ifndef DSV_CUDA_COMMON_CUH
#define DSV_CUDA_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "dsv.h"
#include "ptx.cuh"

/* Return DSV_ERR_CUDA from the enclosing function when the last launch / call failed. */
#define DSV_CUDA_TRY(call)                          \
  do {                                              \
    if ((call) != cudaSuccess) return DSV_ERR_CUDA; \
  } while (0)
#define DSV_CUDA_CHECK_LAUNCH()                                 \
  do {                                                          \
    if (cudaPeekAtLastError() != cudaSuccess) {                 \
      (void)cudaGetLastError();                                 \
      return DSV_ERR_CUDA;                                      \
    }                                                           \
  } while (0)

#define DSV_FULL_MASK 0xffffffffu

/* ceil(a / b) for a >= 0, b > 0, without the overflow of a + b - 1 */
static inline int64_t dsv_cdiv64(int64_t a, int64_t b) { return a <= 0 ? 0 : (a - 1) / b + 1; }
static inline size_t dsv_align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }
static inline int dsv_ptr_aligned(const void* p, size_t a) {
  return ((uintptr_t)p % a) == 0;
}
/* A [B, S, H, *] view whose rows (b, s, h) all start on 16 bytes: base aligned and every
 * stride a multiple of 16 / elem_size elements. */
static inline int dsv_bshd_rows_aligned16(dsv_bshd t, int elem_size) {
  const int64_t m = 16 / elem_size;
  return dsv_ptr_aligned(t.data, 16) && t.stride_b % m == 0 && t.stride_s % m == 0 &&
         t.stride_h % m == 0;
}
static inline int dsv_elem_size(dsv_dtype dt) {
  switch (dt) {
    case DSV_FLOAT32: return 4;
    case DSV_FLOAT64: return 8;
    case DSV_FLOAT16: return 2;
    case DSV_BFLOAT16: return 2;
  }
  return 0;
}

/* ---- scalar conversions ---- */
static __device__ __forceinline__ float dsv_to_float(float x) { return x; }
static __device__ __forceinline__ float dsv_to_float(double x) { return (float)x; }
static __device__ __forceinline__ float dsv_to_float(__half x) { return __half2float(x); }
static __device__ __forceinline__ float dsv_to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> struct dsv_cvt;
template <> struct dsv_cvt<float> {
  static __device__ __forceinline__ float from(float x) { return x; }
};
template <> struct dsv_cvt<double> {
  static __device__ __forceinline__ double from(float x) { return (double)x; }
};
template <> struct dsv_cvt<__half> {
  static __device__ __forceinline__ __half from(float x) { return __float2half_rn(x); }
};
template <> struct dsv_cvt<__nv_bfloat16> {
  static __device__ __forceinline__ __nv_bfloat16 from(float x) { return __float2bfloat16_rn(x); }
};

template <typename T> struct dsv_is_bf16 { enum { value = 0 }; };
template <> struct dsv_is_bf16<__nv_bfloat16> { enum { value = 1 }; };

/* Pack two 16-bit values (lo = lower index) into one register of an MMA fragment. */
static __device__ __forceinline__ uint32_t dsv_pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
static __device__ __forceinline__ uint32_t dsv_pack_f16(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <typename T> static __device__ __forceinline__ uint32_t dsv_pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t dsv_pack2<__nv_bfloat16>(float lo, float hi) {
  return dsv_pack_bf16(lo, hi);
}
template <> __device__ __forceinline__ uint32_t dsv_pack2<__half>(float lo, float hi) {
  return dsv_pack_f16(lo, hi);
}
/* Round x to T and return the rounded value as float. */
template <typename T> static __device__ __forceinline__ float dsv_round_to(float x) {
  return dsv_to_float(dsv_cvt<T>::from(x));
}

/*
 * Stage rows [row0, row0 + nrows) of a [*, dim] view (row r at base + r * row_stride elements,
 * dim contiguous) into shared memory as 16-bit values, row-major with `sw` 32-bit words per row,
 * zero-filled for rows >= nvalid and columns >= dim up to dp (dp a multiple of 8). T is the
 * 16-bit storage type. vec: rows start on 16 bytes (cp.async 16-byte chunks allowed).
 * Called by all nthreads threads of the block.
 */
template <typename T>
static __device__ __forceinline__ void dsv_stage_rows16(uint32_t* smem, int sw, const T* base,
                                                        int64_t row_stride, int64_t row0,
                                                        int nrows, int64_t nvalid, int dim,
                                                        int dp, bool vec, int tid,
                                                        int nthreads) {
  const int cpr = dp / 8; /* 16-byte chunks per row */
  const int total = nrows * cpr;
  for (int c = tid; c < total; c += nthreads) {
    const int r = c / cpr, ch = c - r * cpr;
    const int64_t row = row0 + r;
    uint32_t* dst = smem + r * sw + ch * 4;
    const int e0 = ch * 8;
    if (row < nvalid && vec && e0 + 8 <= dim) {
      cp_async16(dst, base + row * row_stride + e0);
    } else {
      uint32_t w[4];
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        unsigned short lo = 0, hi = 0;
        if (row < nvalid) {
          const T* src = base + row * row_stride;
          if (e0 + 2 * t < dim) lo = *reinterpret_cast<const unsigned short*>(src + e0 + 2 * t);
          if (e0 + 2 * t + 1 < dim)
            hi = *reinterpret_cast<const unsigned short*>(src + e0 + 2 * t + 1);
        }
        w[t] = (uint32_t)lo | ((uint32_t)hi << 16);
      }
      *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
}

/* Like dsv_stage_rows16, but staged row r is source row idx[row0 + r] (valid when
 * row0 + r < nidx and 0 <= idx[.] < nsrc); invalid rows are zero-filled. */
template <typename T>
static __device__ __forceinline__ void dsv_stage_rows16_idx(uint32_t* smem, int sw, const T* base,
                                                            int64_t row_stride,
                                                            const int32_t* idx, int64_t row0,
                                                            int nrows, int64_t nidx, int64_t nsrc,
                                                            int dim, int dp, bool vec, int tid,
                                                            int nthreads) {
  const int cpr = dp / 8;
  const int total = nrows * cpr;
  for (int c = tid; c < total; c += nthreads) {
    const int r = c / cpr, ch = c - r * cpr;
    int64_t row = -1;
    if (row0 + r < nidx) {
      row = idx[row0 + r];
      if (row < 0 || row >= nsrc) row = -1;
    }
    uint32_t* dst = smem + r * sw + ch * 4;
    const int e0 = ch * 8;
    if (row >= 0 && vec && e0 + 8 <= dim) {
      cp_async16(dst, base + row * row_stride + e0);
    } else {
      uint32_t w[4];
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        unsigned short lo = 0, hi = 0;
        if (row >= 0) {
          const T* src = base + row * row_stride;
          if (e0 + 2 * t < dim) lo = *reinterpret_cast<const unsigned short*>(src + e0 + 2 * t);
          if (e0 + 2 * t + 1 < dim)
            hi = *reinterpret_cast<const unsigned short*>(src + e0 + 2 * t + 1);
        }
        w[t] = (uint32_t)lo | ((uint32_t)hi << 16);
      }
      *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
}

/* Order-preserving map of a float to uint32 (larger float -> larger key; -0 < +0). NaN maps to
 * the key of -inf: a NaN score ranks last, tied with -inf (as the CPU top-K ranks it). */
static __device__ __forceinline__ uint32_t dsv_float_key(float f) {
  /* NaN orders as -inf (key 0x007fffff): fmaxf returns the operand that is not NaN, one
   * instruction where a test and a select were two */
  const uint32_t u = __float_as_uint(fmaxf(f, -INFINITY));
  return u ^ ((uint32_t)((int32_t)u >> 31) | 0x80000000u);
}
static __device__ __forceinline__ float dsv_key_float(uint32_t k) {
  const uint32_t u = (k & 0x80000000u) ? (k ^ 0x80000000u) : ~k;
  return __uint_as_float(u);
}

static __device__ __forceinline__ float dsv_warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(DSV_FULL_MASK, x, o);
  return x;
}
static __device__ __forceinline__ float dsv_warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(DSV_FULL_MASK, x, o));
  return x;
}

#endif /* DSV_CUDA_COMMON_CUH */
