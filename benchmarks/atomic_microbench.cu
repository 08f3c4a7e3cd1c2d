/*
 * atomic_microbench.cu - what scattered fp32 reductions cost on this card.
 *
 * Pattern of the sparse-attention backward: rows of 128 floats (one head's dK row) picked at
 * random out of `rows` rows, every row update a full 512-byte row. Variants:
 *   scalar : 128 x red.global.add.f32 per row update (32 lanes x 4)
 *   v4     : 32 x red.global.add.v4.f32 (atomicAdd(float4*)) per row update
 *   store  : 32 x 16-byte plain stores (no reduction), the bandwidth ceiling of the pattern
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
    const char* names[3] = {"scalar red.f32", "v4 red.f32", "plain v4 store"};
    for (int v = 0; v < 3; ++v) {
      float best = 1e30f;
      for (int it = 0; it < 4; ++it) {
        CK(cudaEventRecord(e0));
        if (v == 0) k_scalar<<<132 * 8, 256>>>(tab, rows, nupd);
        if (v == 1) k_v4<<<132 * 8, 256>>>(tab, rows, nupd);
        if (v == 2) k_store<<<132 * 8, 256>>>(tab, rows, nupd);
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
