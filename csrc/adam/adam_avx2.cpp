// AVX2 + FMA + F16C variant of the fused Adam kernels: 8 fp32 lanes.
// Standard and intrinsic headers come before the target pragma; everything after it lives in
// this file's namespace (see the note in adam_kernel.h).
#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "adam/adam_kernel.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,sse4.2")

namespace offloadpp {
namespace adam {
namespace isa_avx2 {

#define OFFLOADPP_ADAM_F16C 1
#include "adam/adam_scalar_convert.h"
#include "adam/adam_ops_scalar.h"
#undef OFFLOADPP_ADAM_F16C

struct V {
  using F = __m256;
  struct D {
    __m256d lo, hi;
  };
  static constexpr int kUnroll = 4;  // vectors per block: see adam_block
  static constexpr size_t W = 8;
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static float hsum(F a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }

  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F load(const bf16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static F load(const f16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

  // Round to nearest even, NaN -> 0x7FC0, as f32_to_bf16_bits.
  static __m128i to_bf16(F x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC00000), nan);
    r = _mm256_srli_epi32(r, 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  }
  static __m128i to_f16(F x) { return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static void store(bf16_t* p, F x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16(x)); }
  static void store(f16_t* p, F x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_f16(x)); }
  // Non-temporal: p must be 16-byte aligned (adam_range aligns the copy to 64 B first).
  static void stream(float* p, F x) { _mm256_stream_ps(p, x); }
  static void stream(bf16_t* p, F x) { _mm_stream_si128(reinterpret_cast<__m128i*>(p), to_bf16(x)); }
  static void stream(f16_t* p, F x) { _mm_stream_si128(reinterpret_cast<__m128i*>(p), to_f16(x)); }
  static void fence() { _mm_sfence(); }
  static constexpr bool kFold = false;  // (see adam_avx512.cpp)
  using FoldAcc = S::FoldAcc;
  static void fold_block(FoldAcc&, uint32_t&, const void*, const uint64_t*) {}
  static void fold_flush(FoldAcc&, uint32_t&) {}

  static D dzero() { return {_mm256_setzero_pd(), _mm256_setzero_pd()}; }
  static D dacc_sq(D acc, F x) {
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    return {_mm256_fmadd_pd(lo, lo, acc.lo), _mm256_fmadd_pd(hi, hi, acc.hi)};
  }
  static D dadd(D a, D b) { return {_mm256_add_pd(a.lo, b.lo), _mm256_add_pd(a.hi, b.hi)}; }
  static double dsum(D a) {
    const __m256d s = _mm256_add_pd(a.lo, a.hi);
    __m128d t = _mm_add_pd(_mm256_castpd256_pd128(s), _mm256_extractf128_pd(s, 1));
    t = _mm_add_sd(t, _mm_unpackhi_pd(t, t));
    return _mm_cvtsd_f64(t);
  }
};

#include "adam/adam_crc_hw.h"
#include "adam/adam_impl.h"

}  // namespace isa_avx2
}  // namespace adam
}  // namespace offloadpp

#pragma GCC pop_options

namespace offloadpp {
namespace adam {
// Compiled for the baseline ISA: callable on any CPU, only the kernels it points at need AVX2.
const IsaTable& avx2_table() {
  static const IsaTable table{"avx2", &isa_avx2::lookup_adam, &isa_avx2::lookup_adam_crc,
                              &isa_avx2::lookup_finite,
                              &isa_avx2::lookup_sqnorm, &isa_avx2::lookup_convert, &isa_avx2::floor_range,
                              &isa_avx2::lookup_sum};
  return table;
}
}  // namespace adam
}  // namespace offloadpp
