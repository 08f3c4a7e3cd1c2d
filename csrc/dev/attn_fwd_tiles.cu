/*
 * attn_fwd_tiles.cu - the sparse attention forward's key-tile variants that lost to the shipped
 * ones (wgmma 32 keys x 2 stages where it applies, else mma.sync 32 x 2; csrc/cuda/
 * sparse_attention_fwd.cu), built from the shipped kernel templates so that they stay in step.
 * Numbers: benchmarks/PERF_LOG.md (v4, v6).
 *
 *   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
 *        -DDSV_WGMMA -Icsrc -Xcompiler -fPIC -shared csrc/dev/attn_fwd_tiles.cu -o fwd_tiles.so
 *
 * The library also exports the shipped C API (dsv_sparse_attention_fwd_cuda, ...) and
 *   int dsv_dev_sparse_attention_fwd_tile_cuda(const char* tile, <dsv_sparse_attention_fwd_cuda's
 *                                              arguments without the workspace>)
 * with tile "w32x2" "w32x3" "w64x2" "w32x4" (wgmma: BN keys x NS stages; where wgmma does not
 * apply the mma.sync 32x2 kernel runs) or "32x2" "64x2" "32x3" "32x4" "32x5" (mma.sync, D <= 128).
 */
#include <string.h>

#include "cuda/sparse_attention_fwd.cu"
#include "cuda/tuning.cu"

namespace dsv_attn {

template <typename T, int D, int BM>
static int dev_fwd_mma(const dsv_attn_shape* sh, const FwdParams<T>& prm, const char* t,
                       cudaStream_t stream) {
  if constexpr (D <= 128) {
    if (!strcmp(t, "64x2")) return launch_fwd<T, D, BM, 64, 2>(sh, prm, stream);
    if (!strcmp(t, "32x3")) return launch_fwd<T, D, BM, 32, 3>(sh, prm, stream);
    if (!strcmp(t, "32x4")) return launch_fwd<T, D, BM, 32, 4>(sh, prm, stream);
    if (!strcmp(t, "32x5")) return launch_fwd<T, D, BM, 32, 5>(sh, prm, stream);
  }
  return launch_fwd<T, D, BM, 32, 2>(sh, prm, stream);
}

template <typename T, int D>
static int dev_fwd_bm(const dsv_attn_shape* sh, FwdParams<T>& prm, int wgmma, const char* t,
                      cudaStream_t stream) {
  const int G = prm.G;
  if constexpr (D == 64 || D == 128) {
    const int64_t lim = (int64_t)UINT32_MAX / (int64_t)sizeof(T);
    if (t[0] == 'w' && wgmma && G >= 64 && prm.ks <= lim && prm.vs <= lim) {
      prm.chunks = (G + 63) / 64;
      if (!strcmp(t, "w32x3")) return launch_fwd_wg<T, D, 32, 3>(sh, prm, stream);
      if (!strcmp(t, "w64x2")) return launch_fwd_wg<T, D, 64, 2>(sh, prm, stream);
      if (!strcmp(t, "w32x4")) return launch_fwd_wg<T, D, 32, 4>(sh, prm, stream);
      return launch_fwd_wg<T, D, 32, 2, 4>(sh, prm, stream);
    }
  }
  if (G <= 32) {
    prm.chunks = 1;
    return dev_fwd_mma<T, D, 32>(sh, prm, t, stream);
  }
  if constexpr (D <= 128) {
    if (G % 128 == 0) {
      prm.chunks = G / 128;
      return dev_fwd_mma<T, D, 128>(sh, prm, t, stream);
    }
  }
  prm.chunks = (G + 63) / 64;
  return dev_fwd_mma<T, D, 64>(sh, prm, t, stream);
}

template <typename T>
static int dev_fwd(const dsv_attn_shape* sh, FwdParams<T>& prm, int wgmma, const char* t,
                   cudaStream_t stream) {
  switch (sh->head_dim) {
    case 64: return dev_fwd_bm<T, 64>(sh, prm, wgmma, t, stream);
    case 96: return dev_fwd_bm<T, 96>(sh, prm, wgmma, t, stream);
    case 128: return dev_fwd_bm<T, 128>(sh, prm, wgmma, t, stream);
    case 256: return dev_fwd_bm<T, 256>(sh, prm, wgmma, t, stream);
    default: return DSV_ERR_UNSUPPORTED;
  }
}

}  // namespace dsv_attn

extern "C" int dsv_dev_sparse_attention_fwd_tile_cuda(const char* tile, const dsv_attn_shape* p,
                                                      dsv_bshd q, dsv_bshd k, dsv_bshd v,
                                                      const int32_t* kv_index,
                                                      const int32_t* kv_count, dsv_bshd out,
                                                      void* lse, void* stream) {
  if (!tile) return DSV_ERR_INVALID;
  return fwd_entry(dev_fwd<__half>, dev_fwd<__nv_bfloat16>, tile, p, q, k, v, kv_index, kv_count,
                   out, lse, nullptr, 0, stream);
}
