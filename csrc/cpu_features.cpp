#include "cpu_features.h"

#include <cpuid.h>
#include <cstdlib>
#include <cstring>

#include "bindings.h"

namespace offloadpp {
namespace {
unsigned long long xgetbv0() {
  unsigned int eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<unsigned long long>(edx) << 32) | eax;
}

SimdLevel detect() {
  unsigned int eax, ebx, ecx, edx;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return SimdLevel::kScalar;
  const bool osxsave = ecx & (1u << 27);
  const bool fma = ecx & (1u << 12);
  const bool f16c = ecx & (1u << 29);
  if (!osxsave) return SimdLevel::kScalar;
  const unsigned long long xcr0 = xgetbv0();
  const bool ymm_ok = (xcr0 & 0x6) == 0x6;      // SSE and AVX state saved by the OS
  const bool zmm_ok = (xcr0 & 0xe6) == 0xe6;    // plus opmask and upper ZMM state
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return SimdLevel::kScalar;
  const bool avx2 = ebx & (1u << 5);
  const bool avx512f = ebx & (1u << 16);
  const bool avx512bw = ebx & (1u << 30);
  const bool avx512vl = ebx & (1u << 31);
  const bool avx512dq = ebx & (1u << 17);
  if (zmm_ok && avx512f && avx512bw && avx512vl && avx512dq && fma && f16c) return SimdLevel::kAVX512;
  if (ymm_ok && avx2 && fma && f16c) return SimdLevel::kAVX2;
  return SimdLevel::kScalar;
}

bool detect_vpclmulqdq() {
  unsigned int eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  return ecx & (1u << 10);
}
}  // namespace

SimdLevel detected_simd_level() {
  static const SimdLevel level = detect();
  return level;
}

SimdLevel active_simd_level() {
  // Read on every call (cheap) so tests can force each variant in one process.
  SimdLevel level = detected_simd_level();
  const char* forced = std::getenv("OFFLOADPP_SIMD");
  if (forced == nullptr || *forced == '\0') return level;
  SimdLevel want = level;
  if (std::strcmp(forced, "scalar") == 0) want = SimdLevel::kScalar;
  else if (std::strcmp(forced, "avx2") == 0) want = SimdLevel::kAVX2;
  else if (std::strcmp(forced, "avx512") == 0) want = SimdLevel::kAVX512;
  // Never raise above what the CPU supports.
  return static_cast<int>(want) < static_cast<int>(level) ? want : level;
}

bool crc_fold_available() {
  static const bool has = detect_vpclmulqdq();
  const char* env = std::getenv("OFFLOADPP_CRC_FOLD");
  return has && active_simd_level() == SimdLevel::kAVX512 && !(env != nullptr && std::strcmp(env, "0") == 0);
}

const char* simd_level_name(SimdLevel level) {
  switch (level) {
    case SimdLevel::kAVX512: return "avx512";
    case SimdLevel::kAVX2: return "avx2";
    default: return "scalar";
  }
}

void register_cpu(pybind11::module_& m) {
  m.def("simd_level", [] { return std::string(simd_level_name(active_simd_level())); },
        "SIMD variant the kernels use now (after OFFLOADPP_SIMD lowering).");
  m.def("detected_simd_level", [] { return std::string(simd_level_name(detected_simd_level())); },
        "Best SIMD variant this CPU supports.");
}
}  // namespace offloadpp
