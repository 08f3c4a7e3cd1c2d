/*
 * rows.cu - row gather / scatter-add on the GPU (building blocks of the sparse all-to-all).
 *
 *   gather:      dst[i, :] = src[index[i], :]   for i < count (dst contiguous; rows out of range
 *                zero-filled); any dtype, copied as raw bytes with the widest aligned word.
 *   scatter-add: dst[index[i], :] += src[i, :]  into a caller-zeroed float32 (float64 for
 *                float64 src) table; rows out of range skipped; fp32 atomics (vector atomics
 *                of 4 floats where aligned, sm_90).
 * One warp per row, grid-stride over rows.
 */
#include "cuda_common.cuh"

#define DSV_ROWS_WARPS 8

template <typename W>
__global__ void __launch_bounds__(32 * DSV_ROWS_WARPS)
    dsv_gather_rows_kernel(const char* __restrict__ src, int64_t src_row_bytes, int64_t num_rows,
                           const int64_t* __restrict__ index, int64_t count, char* __restrict__ dst,
                           int64_t words_per_row) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t nwarps = (int64_t)gridDim.x * DSV_ROWS_WARPS;
  for (int64_t i = (int64_t)blockIdx.x * DSV_ROWS_WARPS + warp; i < count; i += nwarps) {
    const int64_t r = index[i];
    W* d = reinterpret_cast<W*>(dst + i * words_per_row * (int64_t)sizeof(W));
    if (r >= 0 && r < num_rows) {
      const W* s = reinterpret_cast<const W*>(src + r * src_row_bytes);
      for (int64_t w = lane; w < words_per_row; w += 32) d[w] = s[w];
    } else {
      W z;
      memset(&z, 0, sizeof(W));
      for (int64_t w = lane; w < words_per_row; w += 32) d[w] = z;
    }
  }
}

template <typename W>
static int dsv_launch_gather(int64_t row_bytes, const void* src, int64_t src_row_bytes,
                             int64_t num_rows, const int64_t* index, int64_t count, void* dst,
                             cudaStream_t st) {
  const int64_t wpr = row_bytes / (int64_t)sizeof(W);
  int64_t blocks = dsv_cdiv64(count, DSV_ROWS_WARPS);
  if (blocks > 65536) blocks = 65536;
  dsv_gather_rows_kernel<W><<<(unsigned)blocks, 32 * DSV_ROWS_WARPS, 0, st>>>(
      (const char*)src, src_row_bytes, num_rows, index, count, (char*)dst, wpr);
  DSV_CUDA_CHECK_LAUNCH();
  return DSV_OK;
}

extern "C" int dsv_gather_rows_cuda(dsv_dtype dtype, int64_t dim, const void* src,
                                    int64_t src_row_stride, int64_t num_rows,
                                    const int64_t* index, int64_t count, void* dst,
                                    void* stream) {
  const int es = dsv_elem_size(dtype);
  if (es == 0) return DSV_ERR_UNSUPPORTED;
  if (dim < 0 || count < 0 || num_rows < 0) return DSV_ERR_INVALID;
  if (count == 0 || dim == 0) return DSV_OK;
  if (!index || !dst || (num_rows > 0 && !src)) return DSV_ERR_INVALID;
  cudaStream_t st = (cudaStream_t)stream;
  const int64_t row_bytes = dim * es, src_row_bytes = src_row_stride * es;
  /* widest word that divides the row and keeps every access aligned */
  const uintptr_t align_bits = (uintptr_t)src | (uintptr_t)dst | (uintptr_t)row_bytes |
                               (uintptr_t)(num_rows > 1 ? src_row_bytes : 0);
  if ((align_bits & 15) == 0) return dsv_launch_gather<uint4>(row_bytes, src, src_row_bytes, num_rows, index, count, dst, st);
  if ((align_bits & 7) == 0) return dsv_launch_gather<uint2>(row_bytes, src, src_row_bytes, num_rows, index, count, dst, st);
  if ((align_bits & 3) == 0) return dsv_launch_gather<uint32_t>(row_bytes, src, src_row_bytes, num_rows, index, count, dst, st);
  if ((align_bits & 1) == 0) return dsv_launch_gather<unsigned short>(row_bytes, src, src_row_bytes, num_rows, index, count, dst, st);
  return dsv_launch_gather<unsigned char>(row_bytes, src, src_row_bytes, num_rows, index, count, dst, st);
}

/* ---- scatter-add ---- */
template <typename T>
__global__ void __launch_bounds__(32 * DSV_ROWS_WARPS)
    dsv_scatter_add_f32_kernel(const T* __restrict__ src, int64_t src_row_stride,
                               const int64_t* __restrict__ index, int64_t count, int64_t num_rows,
                               float* __restrict__ dst, int64_t dim, int vec4) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t nwarps = (int64_t)gridDim.x * DSV_ROWS_WARPS;
  for (int64_t i = (int64_t)blockIdx.x * DSV_ROWS_WARPS + warp; i < count; i += nwarps) {
    const int64_t r = index[i];
    if (r < 0 || r >= num_rows) continue;
    const T* s = src + i * src_row_stride;
    float* d = dst + r * dim;
    if (vec4) {
      for (int64_t c = (int64_t)lane * 4; c < dim; c += 128) {
        float4 v = make_float4(dsv_to_float(s[c]), dsv_to_float(s[c + 1]), dsv_to_float(s[c + 2]),
                               dsv_to_float(s[c + 3]));
        atomicAdd(reinterpret_cast<float4*>(d + c), v);
      }
    } else {
      for (int64_t c = lane; c < dim; c += 32) atomicAdd(d + c, dsv_to_float(s[c]));
    }
  }
}

__global__ void __launch_bounds__(32 * DSV_ROWS_WARPS)
    dsv_scatter_add_f64_kernel(const double* __restrict__ src, int64_t src_row_stride,
                               const int64_t* __restrict__ index, int64_t count, int64_t num_rows,
                               double* __restrict__ dst, int64_t dim) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t nwarps = (int64_t)gridDim.x * DSV_ROWS_WARPS;
  for (int64_t i = (int64_t)blockIdx.x * DSV_ROWS_WARPS + warp; i < count; i += nwarps) {
    const int64_t r = index[i];
    if (r < 0 || r >= num_rows) continue;
    const double* s = src + i * src_row_stride;
    double* d = dst + r * dim;
    for (int64_t c = lane; c < dim; c += 32) atomicAdd(d + c, s[c]);
  }
}

extern "C" int dsv_scatter_add_rows_cuda(dsv_dtype dtype, int64_t dim, const void* src,
                                         int64_t src_row_stride, const int64_t* index,
                                         int64_t count, int64_t num_rows, void* dst,
                                         void* stream) {
  if (dsv_elem_size(dtype) == 0) return DSV_ERR_UNSUPPORTED;
  if (dim < 0 || count < 0 || num_rows < 0) return DSV_ERR_INVALID;
  if (count == 0 || dim == 0 || num_rows == 0) return DSV_OK;
  if (!index || !dst || !src) return DSV_ERR_INVALID;
  cudaStream_t st = (cudaStream_t)stream;
  int64_t blocks = dsv_cdiv64(count, DSV_ROWS_WARPS);
  if (blocks > 65536) blocks = 65536;
  const int vec4 = (dim % 4 == 0) && dsv_ptr_aligned(dst, 16);
  switch (dtype) {
    case DSV_FLOAT32:
      dsv_scatter_add_f32_kernel<float><<<(unsigned)blocks, 32 * DSV_ROWS_WARPS, 0, st>>>(
          (const float*)src, src_row_stride, index, count, num_rows, (float*)dst, dim, vec4);
      break;
    case DSV_FLOAT16:
      dsv_scatter_add_f32_kernel<__half><<<(unsigned)blocks, 32 * DSV_ROWS_WARPS, 0, st>>>(
          (const __half*)src, src_row_stride, index, count, num_rows, (float*)dst, dim, vec4);
      break;
    case DSV_BFLOAT16:
      dsv_scatter_add_f32_kernel<__nv_bfloat16><<<(unsigned)blocks, 32 * DSV_ROWS_WARPS, 0, st>>>(
          (const __nv_bfloat16*)src, src_row_stride, index, count, num_rows, (float*)dst, dim,
          vec4);
      break;
    case DSV_FLOAT64:
      dsv_scatter_add_f64_kernel<<<(unsigned)blocks, 32 * DSV_ROWS_WARPS, 0, st>>>(
          (const double*)src, src_row_stride, index, count, num_rows, (double*)dst, dim);
      break;
  }
  DSV_CUDA_CHECK_LAUNCH();
  return DSV_OK;
}
