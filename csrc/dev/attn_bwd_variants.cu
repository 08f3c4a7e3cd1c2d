/*
 * attn_bwd_variants.cu - the sparse attention backward's query-major variants that lost to the
 * shipped ones (mma.sync, 32 keys x 2 stages, TMA bulk reductions; the dQ-only pass on wgmma where
 * it applies; csrc/cuda/sparse_attention_bwd_qmajor.cu), built from the shipped kernel templates
 * so that they stay in step. Numbers: benchmarks/PERF_LOG.md (v4, v5, v8, v30).
 *
 *   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
 *        -DDSV_WGMMA -Icsrc -Xcompiler -fPIC -shared csrc/dev/attn_bwd_variants.cu -o bwd_var.so
 *
 * The library also exports the shipped C API (dsv_sparse_attention_fwd_cuda, _bwd_cuda, ...) and
 *   int dsv_dev_sparse_attention_bwd_variant_cuda(const char* variant, <dsv_sparse_attention_bwd_
 *                                                 cuda's arguments>)
 * with variant
 *   "64x2" "32x3" "32x4"  mma.sync key tiles (BN x NS) for both query-major passes (D <= 128)
 *   "32x2"                mma.sync for both passes (the dQ-only pass too)
 *   "v4"                  dK / dV by 16-byte red.global.add.v4.f32 from registers, not TMA bulk
 *   "w64x2"               the wgmma kernel for both passes, its reductions from registers
 *   "w64x2_nored"         the same without the reductions (wrong dK / dV: measures their cost;
 *                         bf16, D = 128, else as "w64x2")
 *   "w128_nored"          groups of a multiple of 128 queries: the shipped 128-row kernel
 *                         (bwd_wg128_kernel) without its reductions (wrong dK / dV: measures
 *                         their cost; D 64 / 128); other groups as "w64x2"
 * Another name returns DSV_ERR_INVALID. Not thread-safe (the variant of the running call is a
 * global).
 */
#include <string.h>

#include "cuda/tuning.cu"
#include "cuda/sparse_attention_fwd.cu"
#include "cuda/sparse_attention_bwd.cu"
#include "cuda/sparse_attention_bwd_index.cu"
#include "cuda/sparse_attention_bwd_kmajor.cu"
#include "cuda/sparse_attention_bwd_qmajor.cu"

namespace dsv_attn {

static const char* g_dev_variant = "";

template <typename T, int D, int BM, bool ATOMIC>
static int dev_qmajor_cfg(const dsv_attn_shape* sh, BwdParams<T>& prm, const char* v,
                          cudaStream_t stream) {
  constexpr bool B = ATOMIC;
  if (ATOMIC && !strcmp(v, "v4")) return launch_qmajor<T, D, BM, 32, 2, ATOMIC, false>(sh, prm, stream);
  if constexpr (D <= 128) {
    if (!strcmp(v, "64x2")) return launch_qmajor<T, D, BM, 64, 2, ATOMIC, B>(sh, prm, stream);
    if (!strcmp(v, "32x3")) return launch_qmajor<T, D, BM, 32, 3, ATOMIC, B>(sh, prm, stream);
    if (!strcmp(v, "32x4")) return launch_qmajor<T, D, BM, 32, 4, ATOMIC, B>(sh, prm, stream);
  }
  return launch_qmajor<T, D, BM, 32, 2, ATOMIC, B>(sh, prm, stream);
}

template <typename T> struct DevIsBf16 { static constexpr bool value = false; };
template <> struct DevIsBf16<__nv_bfloat16> { static constexpr bool value = true; };

template <typename T, int D>
static int dev_qmajor_passes(const dsv_attn_shape* sh, BwdParams<T>& prm, int wgmma,
                             cudaStream_t stream) {
  const char* v = g_dev_variant;
  int st = DSV_OK;
  int wg = 0; /* 1: the dQ-only pass on wgmma, 2: both passes */
  if constexpr (D == 64 || D == 128)
    if (wgmma && bwd_wg_applies<T, D>(prm))
      wg = v[0] == 'w' ? 2 : (!strcmp(v, "v4") ? 1 : 0);
  if (prm.G <= 32) {
    if (prm.km_enabled && (st = dev_qmajor_cfg<T, D, 32, false>(sh, prm, v, stream)) != DSV_OK)
      return st;
    return dev_qmajor_cfg<T, D, 32, true>(sh, prm, v, stream);
  }
  if (prm.km_enabled) {
    if constexpr (D == 64 || D == 128)
      if (wg > 0) st = bwd_wg_launch_one<T, D, false>(sh, prm, stream);
    if (wg == 0) st = dev_qmajor_cfg<T, D, 64, false>(sh, prm, v, stream);
    if (st != DSV_OK) return st;
  }
  if constexpr (D == 64 || D == 128) {
    if (wg == 2) {
      if (!strcmp(v, "w128_nored") && prm.g128 && prm.G % 128 == 0)
        return bwd_wg128_launch<T, D, BwdParams<T>, false, true>(sh, prm, stream);
      if constexpr (D == 128 && DevIsBf16<T>::value)
        if (!strcmp(v, "w64x2_nored"))
          return bwd_wg_launch_one<T, D, true, BwdParams<T>, true>(sh, prm, stream);
      return bwd_wg_launch_one<T, D, true>(sh, prm, stream);
    }
  }
  return dev_qmajor_cfg<T, D, 64, true>(sh, prm, v, stream);
}

template <typename T>
static int dev_qmajor(const dsv_attn_shape* sh, BwdParams<T>& prm, int wgmma, cudaStream_t stream) {
  switch (sh->head_dim) {
    case 64: return dev_qmajor_passes<T, 64>(sh, prm, wgmma, stream);
    case 96: return dev_qmajor_passes<T, 96>(sh, prm, wgmma, stream);
    case 128: return dev_qmajor_passes<T, 128>(sh, prm, wgmma, stream);
    case 256: return dev_qmajor_passes<T, 256>(sh, prm, wgmma, stream);
    default: return DSV_ERR_UNSUPPORTED;
  }
}

}  // namespace dsv_attn

extern "C" int dsv_dev_sparse_attention_bwd_variant_cuda(
    const char* variant, const dsv_attn_shape* p, dsv_bshd q, dsv_bshd k, dsv_bshd v,
    dsv_bshd out, dsv_bshd dout, const void* lse, const int32_t* kv_index,
    const int32_t* kv_count, dsv_bshd dq, dsv_bshd dk, dsv_bshd dv, void* workspace,
    size_t workspace_bytes, void* stream) {
  /* an unknown name is an error, not the shipped kernels timed under a wrong label */
  static const char* const known[] = {"64x2", "32x3", "32x4", "32x2", "v4", "w64x2",
                                      "w64x2_nored", "w128_nored"};
  bool ok = false;
  for (size_t i = 0; variant && i < sizeof(known) / sizeof(known[0]); ++i)
    ok = ok || !strcmp(variant, known[i]);
  if (!ok) return DSV_ERR_INVALID;
  g_dev_variant = variant;
  const BwdQmajor qm = {dev_qmajor<__half>, dev_qmajor<__nv_bfloat16>};
  const int st = bwd_entry(qm, p, q, k, v, out, dout, lse, kv_index, kv_count, dq, dk, dv,
                           workspace, workspace_bytes, stream);
  g_dev_variant = "";
  return st;
}
