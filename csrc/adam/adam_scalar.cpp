// Portable variant of the fused Adam kernels for CPUs without AVX2/FMA/F16C: one element at a
// time, baseline x86-64 flags, software fp16 conversion. Same operation sequence as the SIMD
// variants (true fma), so results are bit-identical to them.
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "adam/adam_kernel.h"

namespace offloadpp {
namespace adam {
namespace isa_scalar {

#include "adam/adam_scalar_convert.h"
#include "adam/adam_ops_scalar.h"

using V = S;

#include "adam/adam_impl.h"

}  // namespace isa_scalar

const IsaTable& scalar_table() {
  static const IsaTable table{"scalar", &isa_scalar::lookup_adam, &isa_scalar::lookup_finite,
                              &isa_scalar::lookup_sqnorm, &isa_scalar::lookup_convert,
                              &isa_scalar::floor_range};
  return table;
}

}  // namespace adam
}  // namespace offloadpp
