/*
 * wgmma.cuh - Hopper warpgroup matrix multiply-accumulate (wgmma.mma_async, sm_90a) for the
 * sparse attention kernels: shared-memory descriptors of 128-byte-swizzled tiles, the fences,
 * and the instruction shapes the kernels use.
 *
 * Tile layout ("swizzled tile", written by gather_* with SWZ = true): R rows (R a multiple of 8)
 * of D elements (D a multiple of 64, 16-bit elements), stored as D / 64 column blocks of
 * R x 128 bytes, block after block; the 16-byte chunk c of row r lies in block c / 8, row r,
 * chunk position (c % 8) ^ (r % 8) (the 128-byte swizzle, which the tensor cores undo from the
 * address bits, so every tile starts on a 1024-byte boundary). The same tile serves as
 *   K-major operand (rows = M or N, the D elements = the reduction dimension): Q and K in
 *     S = Q K^T. Descriptor: SBO = 1024 (8 rows), LBO unused; the k16 step kk starts at
 *     block kk / 4, byte 32 (kk % 4).
 *   MN-major operand (rows = the reduction dimension, D = N), transposed B: V in O += P V.
 *     Descriptor: LBO = R x 128 (the next 64 elements of D), SBO = 1024 (the next 8 rows);
 *     the k16 step kk starts at byte 2048 kk.
 *
 * Accumulators (m64nN, fp32) are spread over the 4 warps of the warpgroup like mma.sync m16n8
 * fragments: warp w owns rows 16 w .. 16 w + 15, and d[4 j .. 4 j + 3] of a lane is the m16n8
 * C fragment of columns 8 j .. 8 j + 7. An A operand in registers (m64k16) is the m16n8k16 A
 * fragment of the warp's 16 rows. So the softmax code of the mma.sync kernels applies as is.
 */
#ifndef DSV_WGMMA_CUH
#define DSV_WGMMA_CUH

#include "attention_common.cuh"

namespace dsv_attn {

/* Shared-memory matrix descriptor of a 128-byte-swizzled operand at shared address `addr`. */
__device__ __forceinline__ uint64_t wg_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)((lbo & 0x3FFFF) >> 4) << 16) |
         ((uint64_t)((sbo & 0x3FFFF) >> 4) << 32) | ((uint64_t)1 << 62);
}

/* The descriptor of the operand `bytes` further on (the start address is the low 14 bits, in
 * 16-byte units, and shared addresses stay below 2^18, so the sum does not carry out). */
__device__ __forceinline__ uint64_t wg_desc_add(uint64_t desc, uint32_t bytes) {
  uint32_t lo, hi;
  asm("mov.b64 {%0, %1}, %2;" : "=r"(lo), "=r"(hi) : "l"(desc));
  lo += bytes >> 4;
  uint64_t r;
  asm("mov.b64 %0, {%1, %2};" : "=l"(r) : "r"(lo), "r"(hi));
  return r;
}

__device__ __forceinline__ void wg_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wg_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
/* Keeps the compiler from moving reads of accumulator registers above wg_wait. */
template <int N>
__device__ __forceinline__ void wg_fence_regs(float* r) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

/* d (m64 x N, fp32) = A B (+ d if acc): A 64x16 and B 16xN. ss: A and B K-major in shared
 * memory (descriptors a, b). rs_bt: A in registers (the m16n8k16 A fragment of each warp's 16
 * rows), B MN-major ("transposed") in shared memory. */
template <typename T, int N>
struct Wgmma {
  static __device__ __forceinline__ void ss(float* d, uint64_t a, uint64_t b, int acc);
  static __device__ __forceinline__ void rs_bt(float* d, const uint32_t* a, uint64_t b, int acc);
};

/* One wrapper per shape and element type, written out by the macros below: the accumulators
 * are bound register by register (operand lists of 16, 32 and 64 registers). */
#define DSV_WG_R16 "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15"
#define DSV_WG_R32 DSV_WG_R16 ",%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
#define DSV_WG_R64                                                                  \
  DSV_WG_R32 ",%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47"       \
             ",%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
#define DSV_WG_D16 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), \
  "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), \
  "+f"(d[14]), "+f"(d[15])
#define DSV_WG_D32 \
  DSV_WG_D16, "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), \
  "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), \
  "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define DSV_WG_D64 \
  DSV_WG_D32, "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), \
  "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), \
  "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), \
  "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), \
  "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

/* ss: d (N / 2 registers R, outputs DL), then the descriptors a, b and acc as operands ND,
 * ND + 1, ND + 2 (ND = N / 2, given as strings: PA, PB, PC). */
#define DSV_WGMMA_SS(T, TY, N, R, DL, PA, PB, PC)                                              \
  template <>                                                                                 \
  __device__ __forceinline__ void Wgmma<T, N>::ss(float* d, uint64_t a, uint64_t b, int acc) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " PC ", 0;\n"                              \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " {" R "}, " PA  \
                 ", " PB ", p, 1, 1, 0, 0;\n}\n"                                                \
                 : DL                                                                         \
                 : "l"(a), "l"(b), "r"(acc));                                                 \
  }
/* rs_bt: d, then the A fragment (4 registers from PA0), the descriptor b (PB) and acc (PC). */
#define DSV_WGMMA_RS(T, TY, N, R, DL, PA0, PA1, PA2, PA3, PB, PC)                              \
  template <>                                                                                 \
  __device__ __forceinline__ void Wgmma<T, N>::rs_bt(float* d, const uint32_t* a, uint64_t b,  \
                                                     int acc) {                              \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " PC ", 0;\n"                              \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " {" R "}, {" PA0 \
                 "," PA1 "," PA2 "," PA3 "}, " PB ", p, 1, 1, 1;\n}\n"                          \
                 : DL                                                                         \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc));             \
  }

DSV_WGMMA_SS(__nv_bfloat16, "bf16", 32, DSV_WG_R16, DSV_WG_D16, "%16", "%17", "%18")
DSV_WGMMA_SS(__nv_bfloat16, "bf16", 64, DSV_WG_R32, DSV_WG_D32, "%32", "%33", "%34")
DSV_WGMMA_SS(__half, "f16", 32, DSV_WG_R16, DSV_WG_D16, "%16", "%17", "%18")
DSV_WGMMA_SS(__half, "f16", 64, DSV_WG_R32, DSV_WG_D32, "%32", "%33", "%34")
DSV_WGMMA_RS(__nv_bfloat16, "bf16", 64, DSV_WG_R32, DSV_WG_D32, "%32", "%33", "%34", "%35", "%36",
             "%37")
DSV_WGMMA_RS(__nv_bfloat16, "bf16", 128, DSV_WG_R64, DSV_WG_D64, "%64", "%65", "%66", "%67", "%68",
             "%69")
DSV_WGMMA_RS(__half, "f16", 64, DSV_WG_R32, DSV_WG_D32, "%32", "%33", "%34", "%35", "%36", "%37")
DSV_WGMMA_RS(__half, "f16", 128, DSV_WG_R64, DSV_WG_D64, "%64", "%65", "%66", "%67", "%68", "%69")

}  // namespace dsv_attn

#endif /* DSV_WGMMA_CUH */
