// Portable variant of the fused Adam kernels for CPUs without AVX2/FMA/F16C: one element at a
// time, baseline x86-64 flags, software fp16 conversion. Same operation sequence as the SIMD
// variants (true fma), so results are bit-identical to them.
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "adam/adam_kernel.h"
#include "io/aligned_buffer.h"

namespace offloadpp {
namespace adam {
namespace isa_scalar {

#include "adam/adam_scalar_convert.h"
#include "adam/adam_ops_scalar.h"

using V = S;

// The raw CRC-32C register update, through the io layer's crc32c (the crc32 instruction where
// the CPU has SSE4.2, a table otherwise): this file assumes no instruction set.
static inline uint32_t crc_raw(uint32_t reg, const void* p, size_t n) { return ~io::crc32c(p, n, ~reg); }
template <int K>
static inline void crc_raw_n(uint32_t* const* regs, const void* const* data, size_t n) {
  for (int k = 0; k < K; ++k) *regs[k] = crc_raw(*regs[k], data[k], n);
}

#include "adam/adam_impl.h"

}  // namespace isa_scalar

const IsaTable& scalar_table() {
  static const IsaTable table{"scalar", &isa_scalar::lookup_adam, &isa_scalar::lookup_adam_crc,
                              &isa_scalar::lookup_finite,
                              &isa_scalar::lookup_sqnorm, &isa_scalar::lookup_convert,
                              &isa_scalar::floor_range, &isa_scalar::lookup_sum};
  return table;
}

}  // namespace adam
}  // namespace offloadpp
