// Fused CPU Adam: types shared by the per-ISA kernels (adam_avx512.cpp, adam_avx2.cpp,
// adam_scalar.cpp), the dispatcher (adam_dispatch.cpp) and the bindings.
//
// Note: why per-ISA files with `#pragma GCC target` and no -march. setup.py compiles every file
// with the same baseline x86-64 flags. Each ISA file turns on its instruction set for the code it
// defines after the pragma, and keeps that code in its own namespace, so no inline function
// compiled for AVX-512 can be merged by the linker into a caller on a CPU without it. The
// dispatcher picks a table of function pointers by `active_simd_level()` on every call.
#pragma once
#include <cstddef>
#include <cstdint>

namespace offloadpp {
namespace adam {

// Element types crossing the boundary; the Python layer maps torch dtypes onto these codes.
enum class DType : int { kF32 = 0, kBF16 = 1, kF16 = 2, kNone = 3 };

// Storage tags for 16-bit floats (plain bits; arithmetic is always in fp32).
struct bf16_t {
  uint16_t bits;
};
struct f16_t {
  uint16_t bits;
};
struct NoOut {};  // "no half copy" in kernel templates

// One flat run of elements: a tensor, or a shard holding many parameters back to back.
struct Segment {
  void* param = nullptr;
  const void* grad = nullptr;
  void* exp_avg = nullptr;
  void* exp_avg_sq = nullptr;
  void* half_out = nullptr;  // optional low-precision copy of the updated params
  size_t n = 0;
};

struct Types {
  DType param = DType::kF32;
  DType grad = DType::kF32;
  DType state = DType::kF32;
  DType out = DType::kNone;
};

// Per-step constants, computed once in double and rounded to float (see adam_dispatch.cpp).
struct StepConsts {
  float beta2;
  float one_minus_beta1;
  float one_minus_beta2;
  float eps;
  float grad_mult;      // clip_coef / grad_scale (1 leaves grads bit-identical)
  float decay;          // AdamW: 1 - lr * weight_decay; Adam: 1
  float l2;             // Adam: weight_decay added to the grad as wd * p; AdamW: 0
  bool use_l2;
  float inv_sqrt_bc2;   // 1 / sqrt(1 - beta2^step), or 1 without bias correction
  float neg_step_size;  // -lr / (1 - beta1^step), or -lr
  bool stream_out;      // non-temporal stores for half_out (large buffers only)
};

// Kernels over the elements [begin, end) of one segment / buffer.
using AdamRangeFn = void (*)(const Segment& seg, size_t begin, size_t end, const StepConsts& c);

// Note: CRC-32C in the Adam pass. The store checksums every payload it reads and writes
// (docs/io.md); for optimizer state that is a second pass over bytes the Adam kernel reads and
// writes anyway. The _crc kernels take, in the same loop, the CRC-32C (standard: init ~0, final
// ~) of the range's bytes of each stream the mask names: the moments as they were read (before
// the update: what the store's header of the read must match) and the params and moments as
// they are written (what the header of the put is sealed with). Each block's input bytes are
// checksummed just before the block loads them and its output bytes just after it stores them,
// from L1, so the CRC instructions (integer port) overlap the update's memory stalls; measured
// on the dev machine it costs a fraction of a separate pass (docs/performance.md).
enum CrcStream : unsigned {
  kCrcExpAvgIn = 0,
  kCrcExpAvgSqIn = 1,
  kCrcParamOut = 2,
  kCrcExpAvgOut = 3,
  kCrcExpAvgSqOut = 4,
  kCrcStreams = 5,
  // Not a stream: set by the dispatcher where the CPU has VPCLMULQDQ and the kernel can fold
  // (adam_avx512.cpp, the folding Note): whole blocks of fp32 streams are folded, not crc32'd.
  kCrcFold = 5,
};
// The fold-by-64-bytes constants of the folding kernels, computed once (adam_dispatch.cpp).
const uint64_t* crc_fold_constants();
// crc[kCrcStreams]: the CRC of each stream whose bit (1 << CrcStream) is set in mask.
using AdamCrcRangeFn = void (*)(const Segment& seg, size_t begin, size_t end, const StepConsts& c, unsigned mask,
                                uint32_t* crc);
// Returns false if any grad * mult is inf or nan.
using FiniteRangeFn = bool (*)(const void* grad, size_t begin, size_t end, float mult);
// Sum of squares in fp64.
using SqNormRangeFn = double (*)(const void* x, size_t begin, size_t end);
// Element-wise dtype conversion (round to nearest even).
using ConvertRangeFn = void (*)(const void* src, void* dst, size_t begin, size_t end);
// dst[i] = (((src[0][i] + src[1][i]) + src[2][i]) + ... + src[k-1][i]), added in fp32 in that
// order and rounded once to dst's type (a vertical window's gradient sums: sum_parts).
using SumRangeFn = void (*)(const void* const* srcs, size_t k, void* dst, size_t begin, size_t end);
// Memory-bandwidth floor: the same loads and stores as the Adam kernel for fp32 p/g/m/v
// (optionally a bf16 copy), with no arithmetic worth the name.
using FloorRangeFn = void (*)(const Segment& seg, size_t begin, size_t end, bool stream_out);

// One instruction set's kernels. Lookups return nullptr for unsupported type combinations.
struct IsaTable {
  const char* name;
  AdamRangeFn (*adam)(const Types& t);
  AdamCrcRangeFn (*adam_crc)(const Types& t);
  FiniteRangeFn (*finite)(DType grad);
  SqNormRangeFn (*sqnorm)(DType x);
  ConvertRangeFn (*convert)(DType src, DType dst);
  FloorRangeFn floor;
  SumRangeFn (*sum)(DType src, DType dst);
};

const IsaTable& scalar_table();
const IsaTable& avx2_table();
const IsaTable& avx512_table();

}  // namespace adam
}  // namespace offloadpp
