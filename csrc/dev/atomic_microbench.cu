/*
 * atomic_microbench.cu - what scattered fp32 reductions cost on this card.
 *
 * Pattern of the sparse-attention backward: rows of 128 floats (one head's dK row) picked at
 * random out of `rows` rows, every row update a full 512-byte row. Variants:
 *   scalar : 128 x red.global.add.f32 per row update (32 lanes x 4)
 *   v4     : 32 x red.global.add.v4.f32 (atomicAdd(float4*)) per row update
 *   bulk   : one 512-byte cp.reduce.async.bulk (TMA) per row update from a shared-memory row
 *   store  : 32 x 16-byte plain stores (no reduction), the bandwidth ceiling of the pattern
 *   frag   : the 128-row backward's pattern (bwg_reduce_part): a warp reduces 16 rows at a time,
 *            each red.v4 instruction 16 rows x 32 bytes (two lanes' 16 bytes per 32-byte sector)
 *   frag2  : the same 16 rows, each lane both 16-byte halves of a sector back to back
 *   lines  : the same 16 rows, each instruction 4 rows x 128 contiguous bytes (v30's pattern)
 * (run under Nsight Compute with lts__t_requests_op_red.sum / lts__t_sectors_op_red.sum to see
 * how many sectors each pattern's requests take: PERF_LOG What next 0000)
 * for a table that fits L2 (64k rows = 32 MB) and one that does not (24 x 64k rows = 768 MB).
 * Prints G floats/s.
 */
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
  printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__); exit(1); } } while (0)

__global__ void k_scalar(float* tab, const int* rows, int nupd) {
  int w = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
  int nw = (gridDim.x * blockDim.x) >> 5;
  for (int u = w; u < nupd; u += nw) {
    float* r = tab + (size_t)rows[u] * 128;
#pragma unroll
    for (int j = 0; j < 4; ++j) atomicAdd(r + j * 32 + lane, 1.0f);
  }
}
__global__ void k_v4(float* tab, const int* rows, int nupd) {
  int w = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
  int nw = (gridDim.x * blockDim.x) >> 5;
  for (int u = w; u < nupd; u += nw) {
    float4* r = reinterpret_cast<float4*>(tab + (size_t)rows[u] * 128);
    atomicAdd(r + lane, make_float4(1.f, 1.f, 1.f, 1.f));
  }
}
__global__ void k_store(float* tab, const int* rows, int nupd) {
  int w = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
  int nw = (gridDim.x * blockDim.x) >> 5;
  for (int u = w; u < nupd; u += nw) {
    float4* r = reinterpret_cast<float4*>(tab + (size_t)rows[u] * 128);
    r[lane] = make_float4(1.f, 1.f, 1.f, (float)u);
  }
}

/* 16 rows per warp and step: lane -> row (lane >> 2) + 8 (lane & 1), columns 4 ((lane >> 1) & 1)
 * of each 8-column block, as the wgmma accumulator after the pair swap */
__global__ void k_frag(float* tab, const int* rows, int nupd) {
  int w = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
  int nw = (gridDim.x * blockDim.x) >> 5;
  for (int u = w; u < nupd / 16; u += nw) {
    const int r = rows[16 * u + (lane >> 2) + ((lane & 1) ? 8 : 0)];
    float* row = tab + (size_t)r * 128 + ((lane >> 1) & 1) * 4;
#pragma unroll
    for (int j = 0; j < 16; ++j)
      atomicAdd(reinterpret_cast<float4*>(row + j * 8), make_float4(1.f, 1.f, 1.f, 1.f));
  }
}
/* 16 rows per warp and step: lane -> row lane >> 1, the 8-column blocks of parity lane & 1,
 * both halves of each 32-byte sector from one lane */
__global__ void k_frag2(float* tab, const int* rows, int nupd) {
  int w = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
  int nw = (gridDim.x * blockDim.x) >> 5;
  for (int u = w; u < nupd / 16; u += nw) {
    const int r = rows[16 * u + (lane >> 1)];
    float* row = tab + (size_t)r * 128 + (lane & 1) * 8;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      atomicAdd(reinterpret_cast<float4*>(row + j * 16), make_float4(1.f, 1.f, 1.f, 1.f));
      atomicAdd(reinterpret_cast<float4*>(row + j * 16 + 4), make_float4(1.f, 1.f, 1.f, 1.f));
    }
  }
}

/* v30's line reductions (bwg_reduce_lines): 16 rows per warp and step, each instruction 4 rows
 * x 128 contiguous bytes (lane -> row 4 i + lane / 8, 16-byte chunk lane % 8 of a 32-column
 * slab), the staging in shared memory left out */
__global__ void k_lines(float* tab, const int* rows, int nupd) {
  int w = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
  int nw = (gridDim.x * blockDim.x) >> 5;
  for (int u = w; u < nupd / 16; u += nw) {
    int r[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) r[i] = rows[16 * u + 4 * i + (lane >> 3)];
#pragma unroll
    for (int m = 0; m < 4; ++m)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        atomicAdd(reinterpret_cast<float4*>(tab + (size_t)r[i] * 128 + 32 * m + 4 * (lane & 7)),
                  make_float4(1.f, 1.f, 1.f, 1.f));
  }
}

__global__ void k_bulk(float* tab, const int* rows, int nupd) {
  __shared__ __align__(16) float src[128];
  for (int i = threadIdx.x; i < 128; i += blockDim.x) src[i] = 1.0f;
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  const unsigned s = (unsigned)__cvta_generic_to_shared(src);
  for (int u = blockIdx.x * blockDim.x + threadIdx.x; u < nupd; u += gridDim.x * blockDim.x) {
    float* r = tab + (size_t)rows[u] * 128;
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], 512;\n"
                 ::"l"(r), "r"(s) : "memory");
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
    asm volatile("cp.async.bulk.wait_group.read 8;\n" ::: "memory");
  }
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

int main() {
  const int nupd = 16 * 1024 * 1024; /* 2G floats per run */
  const long long big_rows = 24LL * 65536;
  float* tab;
  int* rows;
  CK(cudaMalloc(&tab, big_rows * 128 * sizeof(float)));
  CK(cudaMalloc(&rows, nupd * sizeof(int)));
  int* h = (int*)malloc(nupd * sizeof(int));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (int pass = 0; pass < 2; ++pass) {
    long long nrows = pass == 0 ? 65536 : big_rows;
    srand(1234);
    for (int i = 0; i < nupd; ++i) h[i] = (int)(((long long)rand() * 32768 + rand()) % nrows);
    CK(cudaMemcpy(rows, h, nupd * sizeof(int), cudaMemcpyHostToDevice));
    CK(cudaMemset(tab, 0, nrows * 128 * sizeof(float)));
    const char* names[7] = {"scalar red.f32", "v4 red.f32", "plain v4 store", "bulk reduce",
                            "frag v4 red", "frag2 v4 red", "lines v4 red"};
    for (int v = 0; v < 7; ++v) {
      float best = 1e30f;
      for (int it = 0; it < 4; ++it) {
        CK(cudaEventRecord(e0));
        if (v == 0) k_scalar<<<132 * 8, 256>>>(tab, rows, nupd);
        if (v == 1) k_v4<<<132 * 8, 256>>>(tab, rows, nupd);
        if (v == 2) k_store<<<132 * 8, 256>>>(tab, rows, nupd);
        if (v == 3) k_bulk<<<132 * 8, 256>>>(tab, rows, nupd);
        if (v == 4) k_frag<<<132 * 8, 256>>>(tab, rows, nupd);
        if (v == 5) k_frag2<<<132 * 8, 256>>>(tab, rows, nupd);
        if (v == 6) k_lines<<<132 * 8, 256>>>(tab, rows, nupd);
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (it > 0 && ms < best) best = ms;
      }
      double gfl = (double)nupd * 128 / (best * 1e-3) / 1e9;
      printf("atomics: table %5lld MB  %-16s %8.3f ms  %7.1f G floats/s\n",
             nrows * 512 / (1 << 20), names[v], best, gfl);
    }
  }
  CK(cudaGetLastError());
  return 0;
}
