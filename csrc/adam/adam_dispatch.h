// Fused CPU Adam: the entry points behind the Python bindings. Each call picks the kernel table
// for the active SIMD level, splits the elements over threads and runs without the GIL.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "adam/adam_kernel.h"

namespace offloadpp {
namespace adam {

// Adam's hyper-parameters, as the optimizer owns them (validated again here: the bindings may
// be called directly).
struct Hyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool adamw_mode = true;
  bool bias_correction = true;
};

// How a step is run (not what it computes).
struct RunOptions {
  int num_threads = 0;     // <= 0: all cores of this process's affinity mask
  int stream_out = -1;     // half_out with non-temporal stores: -1 auto (large buffers), 0 no, 1 yes
};

// One Adam step over every segment, all of the same Types. grad_mult multiplies every grad
// (clip_coef / grad_scale). With check_finite, grads are scanned first and nothing is written
// if any grad * grad_mult is inf or nan; returns false then. Otherwise returns true.
bool adam_step(const std::vector<Segment>& segments, const Types& types, const Hyper& hyper, int64_t step,
               double grad_mult, bool check_finite, const RunOptions& run);

// adam_step without the finite check, returning the sum of squares of the raw grads (before
// grad_mult) in the same pass: each chunk's grads are summed just before the chunk is updated
// (the second read comes from cache). The sum is exactly squared_norm over buffers of the
// segments' grads with the same sizes (same chunks, same per-chunk partial sums, same order).
double adam_step_norm(const std::vector<Segment>& segments, const Types& types, const Hyper& hyper, int64_t step,
                      double grad_mult, const RunOptions& run);

// adam_step (no finite check) taking, in the same pass, the CRC-32C of the streams crc_mask
// names (1 << CrcStream, adam_kernel.h) over each segment: crc_out gets kCrcStreams values per
// segment, in segment order (0 where the mask's bit is off). With grad_sq non-null it also takes
// the grads' squared norm as adam_step_norm does. Returns the sum of squares (0 without).
double adam_step_crc(const std::vector<Segment>& segments, const Types& types, const Hyper& hyper, int64_t step,
                     double grad_mult, const RunOptions& run, unsigned crc_mask, bool with_norm,
                     std::vector<uint32_t>* crc_out);

// True if every element of every buffer times mult is finite.
struct Buffer {
  const void* data = nullptr;
  size_t n = 0;
  DType dtype = DType::kF32;
};
bool all_finite(const std::vector<Buffer>& buffers, double mult, int num_threads);

// Sum of squares over all buffers, accumulated in fp64; inf and nan propagate.
double squared_norm(const std::vector<Buffer>& buffers, int num_threads);

// dst[i] = src[i] converted (round to nearest even).
void convert(const Buffer& src, void* dst, DType dst_dtype, int num_threads);

// A sum over k sources into dst, n elements: one output of sum_parts.
struct SumSegment {
  void* dst = nullptr;
  std::vector<const void*> srcs;  // added in this order
  size_t n = 0;
};
// Each segment's dst = its sources added in fp32, in order, rounded once to dst_dtype (all
// sources of one call are src_dtype; no source may overlap another segment's dst).
void sum_parts(const std::vector<SumSegment>& segments, DType src_dtype, DType dst_dtype, int num_threads);

// The bandwidth floor for the Adam traffic pattern (fp32 p/g/m/v, optional bf16 copy).
void bandwidth_floor(const std::vector<Segment>& segments, int stream_out, int num_threads);

// Threads a call with num_threads <= 0 uses.
int default_threads();
// Name of the kernel table in use now ("avx512", "avx2", "scalar").
const char* active_isa_name();

}  // namespace adam
}  // namespace offloadpp
