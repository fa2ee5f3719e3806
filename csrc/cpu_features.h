// Run-time CPU feature detection (CPUID), so SIMD kernels are compiled together
// and picked when the process starts, never by -march=native at build time.
#pragma once
#include <string>

namespace offloadpp {
enum class SimdLevel { kScalar = 0, kAVX2 = 1, kAVX512 = 2 };
SimdLevel detected_simd_level();  // what the CPU and OS support
SimdLevel active_simd_level();    // detected, lowered by OFFLOADPP_SIMD=scalar|avx2 for tests
const char* simd_level_name(SimdLevel level);
// VPCLMULQDQ (carry-less multiply on 512-bit vectors): the Adam kernels' CRC folding; lowered to
// false by OFFLOADPP_CRC_FOLD=0 (read on every call) so tests can run the kernels without it.
bool crc_fold_available();
}  // namespace offloadpp
