// AVX-512 (F, BW, VL, DQ) + FMA + F16C variant of the fused Adam kernels: 16 fp32 lanes.
// Standard and intrinsic headers come before the target pragma; everything after it lives in
// this file's namespace (see the note in adam_kernel.h).
#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "adam/adam_kernel.h"

#pragma GCC push_options
// vpclmulqdq: only the CRC folding below uses it, and the dispatcher runs that only on a CPU that
// has it (the kCrcFold bit of the mask, adam_dispatch.cpp); no other code here emits it.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,sse4.2,vpclmulqdq")
// GCC 12 flags the _mm512_undefined_* placeholders inside its own intrinsics headers.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace offloadpp {
namespace adam {
namespace isa_avx512 {

#define OFFLOADPP_ADAM_F16C 1
#include "adam/adam_scalar_convert.h"
#include "adam/adam_ops_scalar.h"
#undef OFFLOADPP_ADAM_F16C

struct V {
  using F = __m512;
  struct D {
    __m512d lo, hi;
  };
  static constexpr int kUnroll = 4;  // vectors per block: see adam_block
  static constexpr size_t W = 16;
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static float hsum(F a) { return _mm512_reduce_add_ps(a); }

  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F load(const bf16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static F load(const f16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }

  // Round to nearest even, NaN -> 0x7FC0, as f32_to_bf16_bits.
  static __m256i to_bf16(F x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC00000));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
  }
  static __m256i to_f16(F x) { return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static void store(bf16_t* p, F x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(x)); }
  static void store(f16_t* p, F x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_f16(x)); }
  // Non-temporal: p must be 32-byte aligned (adam_range aligns the copy to 64 B first).
  static void stream(float* p, F x) { _mm512_stream_ps(p, x); }
  static void stream(bf16_t* p, F x) { _mm256_stream_si256(reinterpret_cast<__m256i*>(p), to_bf16(x)); }
  static void stream(f16_t* p, F x) { _mm256_stream_si256(reinterpret_cast<__m256i*>(p), to_f16(x)); }
  static void fence() { _mm_sfence(); }

  static D dzero() { return {_mm512_setzero_pd(), _mm512_setzero_pd()}; }
  static D dacc_sq(D acc, F x) {
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    return {_mm512_fmadd_pd(lo, lo, acc.lo), _mm512_fmadd_pd(hi, hi, acc.hi)};
  }
  static D dadd(D a, D b) { return {_mm512_add_pd(a.lo, b.lo), _mm512_add_pd(a.hi, b.hi)}; }
  static double dsum(D a) { return _mm512_reduce_add_pd(_mm512_add_pd(a.lo, a.hi)); }

  // Note: CRC-32C by folding (the _crc kernels, with kCrcFold). A 256-byte block of one fp32
  // stream is folded into a 64-byte accumulator with carry-less multiplies (two VPCLMULQDQ and a
  // ternary xor per 64 bytes, on the vector ports, about 2.5x the crc32 instruction's bytes per
  // cycle here), the register's running CRC xored into the first 4 bytes where folding starts.
  // The accumulator then stands for every byte folded so far as a 64-byte message of CRC
  // register 0; fold_flush checksums it with crc32 before bytes that are not a whole block.
  // k: the fold-by-64-bytes constants (x^(8*64+32), x^(8*64-32) mod P, bit-reflected, << 1).
  static constexpr bool kFold = true;
  struct FoldAcc {
    __m512i a;
    bool on = false;
  };
  static void fold_block(FoldAcc& f, uint32_t& reg, const void* data, const uint64_t* k) {
    const char* b = static_cast<const char*>(data);
    const __m512i K = _mm512_broadcast_i32x4(_mm_set_epi64x(static_cast<long long>(k[1]), static_cast<long long>(k[0])));
    int u = 0;
    if (!f.on) {
      f.a = _mm512_xor_si512(_mm512_loadu_si512(b), _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(reg))));
      f.on = true;
      u = 1;
    }
    for (; u < kUnroll; ++u)
      f.a = _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(f.a, K, 0x00), _mm512_clmulepi64_epi128(f.a, K, 0x11),
                                      _mm512_loadu_si512(b + 64 * u), 0x96);
  }
  static void fold_flush(FoldAcc& f, uint32_t& reg) {
    if (!f.on) return;
    alignas(64) uint64_t w[8];
    _mm512_store_si512(w, f.a);
    uint64_t c = 0;
    for (int i = 0; i < 8; ++i) c = _mm_crc32_u64(c, w[i]);
    reg = static_cast<uint32_t>(c);
    f.on = false;
  }
};

#include "adam/adam_crc_hw.h"
#include "adam/adam_impl.h"

}  // namespace isa_avx512
}  // namespace adam
}  // namespace offloadpp

#pragma GCC diagnostic pop
#pragma GCC pop_options

namespace offloadpp {
namespace adam {
// Compiled for the baseline ISA: callable on any CPU, only the kernels it points at need AVX-512.
const IsaTable& avx512_table() {
  static const IsaTable table{"avx512", &isa_avx512::lookup_adam, &isa_avx512::lookup_adam_crc,
                              &isa_avx512::lookup_finite,
                              &isa_avx512::lookup_sqnorm, &isa_avx512::lookup_convert,
                              &isa_avx512::floor_range, &isa_avx512::lookup_sum};
  return table;
}
}  // namespace adam
}  // namespace offloadpp
