// Run-time CPU feature detection (CPUID), so SIMD kernels are compiled together
// and picked when the process starts, never by -march=native at build time.
#pragma once
#include <string>

namespace offloadpp {
enum class SimdLevel { kScalar = 0, kAVX2 = 1, kAVX512 = 2 };
SimdLevel detected_simd_level();  // what the CPU and OS support
SimdLevel active_simd_level();    // detected, lowered by OFFLOADPP_SIMD=scalar|avx2 for tests
const char* simd_level_name(SimdLevel level);
}  // namespace offloadpp
