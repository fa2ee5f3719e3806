// Fused CPU Adam: picks the kernel table for the active SIMD level, checks what the kernels
// assume, splits the elements over threads (thread_pool.h), and computes the per-step constants.
#include "adam/adam_dispatch.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <stdexcept>
#include <string>
#include <thread>

#include "adam/thread_pool.h"
#include "cpu_features.h"
#include "io/aligned_buffer.h"

namespace offloadpp {
namespace adam {
namespace {

// Work is cut into chunks (of the segments laid end to end) that the calling thread and pool
// threads take in turn (thread_pool.h): about 64 of them, between kMinChunk and kMaxChunk
// elements, multiples of 64 elements (no cache line shared between chunks, whatever the type).
// Big enough that taking one costs nothing (64K: ~1.8 MB of traffic for an fp32 step), small
// enough that a thread held up by the OS, or a helper that wakes late and takes the last chunk,
// delays the call by little. The size depends on the total only, never on the thread count, so
// squared_norm's per-chunk partial sums give the same result on any number of threads.
constexpr size_t kMinChunk = size_t{1} << 13;
constexpr size_t kMaxChunk = size_t{1} << 16;

size_t chunk_for(size_t total) {
  const size_t c = (total / 64 + 63) / 64 * 64;
  return std::min(kMaxChunk, std::max(kMinChunk, c));
}
// half_out copies at least this large are written with non-temporal stores (auto mode): they
// are not read again by this step, and skipping the read-for-ownership saves 2 B a param.
constexpr size_t kStreamMinBytes = size_t{4} << 20;

const IsaTable& active_table() {
  switch (active_simd_level()) {
    case SimdLevel::kAVX512: return avx512_table();
    case SimdLevel::kAVX2: return avx2_table();
    default: return scalar_table();
  }
}

size_t elem_size(DType t) {
  switch (t) {
    case DType::kF32: return 4;
    case DType::kBF16:
    case DType::kF16: return 2;
    default: return 0;
  }
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "float32";
    case DType::kBF16: return "bfloat16";
    case DType::kF16: return "float16";
    default: return "none";
  }
}

[[noreturn]] void bad(const std::string& what) { throw std::invalid_argument(what); }

void check_ptr(const void* p, size_t n, DType t, const char* name, size_t index) {
  if (n == 0) return;
  if (p == nullptr) bad(std::string(name) + " of segment " + std::to_string(index) + " is null");
  if (reinterpret_cast<uintptr_t>(p) % elem_size(t) != 0)
    bad(std::string(name) + " of segment " + std::to_string(index) + " is not aligned to its " +
        dtype_name(t) + " elements");
}

int threads_of(int requested) { return requested > 0 ? requested : default_threads(); }

// The segments laid end to end: prefix offsets, to map a chunk to the segments it covers.
struct Layout {
  std::vector<size_t> start;  // start[s] = elements before segment s; start.back() = total
  size_t chunk;
  explicit Layout(const std::vector<size_t>& sizes) : start(sizes.size() + 1, 0) {
    for (size_t s = 0; s < sizes.size(); ++s) start[s + 1] = start[s] + sizes[s];
    chunk = chunk_for(total());
  }
  size_t total() const { return start.back(); }
  size_t chunks() const { return (total() + chunk - 1) / chunk; }
  // fn(segment, begin, end) for every segment piece inside chunk c.
  template <class Fn>
  void for_chunk(size_t c, Fn&& fn) const {
    const size_t lo = c * chunk, hi = std::min(total(), lo + chunk);
    size_t s = static_cast<size_t>(std::upper_bound(start.begin(), start.end(), lo) - start.begin()) - 1;
    for (; s + 1 < start.size() && start[s] < hi; ++s) {
      const size_t b = std::max(lo, start[s]), e = std::min(hi, start[s + 1]);
      if (b < e) fn(s, b - start[s], e - start[s]);
    }
  }
};

bool scan_finite(const std::vector<Buffer>& buffers, float mult, int num_threads) {
  const IsaTable& isa = active_table();
  std::vector<size_t> sizes;
  std::vector<FiniteRangeFn> fns;
  for (size_t i = 0; i < buffers.size(); ++i) {
    check_ptr(buffers[i].data, buffers[i].n, buffers[i].dtype, "buffer", i);
    FiniteRangeFn f = isa.finite(buffers[i].dtype);
    if (f == nullptr) bad("unsupported dtype for the finite check: " + std::string(dtype_name(buffers[i].dtype)));
    sizes.push_back(buffers[i].n);
    fns.push_back(f);
  }
  std::atomic<bool> ok{true};
  const Layout layout(sizes);
  run_chunks(layout.chunks(), threads_of(num_threads), [&](size_t c) {
    if (!ok.load(std::memory_order_relaxed)) return;  // early exit: the verdict is in
    layout.for_chunk(c, [&](size_t s, size_t b, size_t e) {
      if (!fns[s](buffers[s].data, b, e, mult)) ok.store(false, std::memory_order_relaxed);
    });
  });
  return ok.load();
}

void check_hyper(const Hyper& h, int64_t step, double grad_mult) {
  auto finite = [](double x) { return std::isfinite(x); };
  if (!finite(h.lr) || h.lr < 0) bad("lr must be finite and >= 0, got " + std::to_string(h.lr));
  if (!finite(h.beta1) || h.beta1 < 0 || h.beta1 >= 1) bad("beta1 must be in [0, 1), got " + std::to_string(h.beta1));
  if (!finite(h.beta2) || h.beta2 < 0 || h.beta2 >= 1) bad("beta2 must be in [0, 1), got " + std::to_string(h.beta2));
  if (!finite(h.eps) || h.eps < 0) bad("eps must be finite and >= 0, got " + std::to_string(h.eps));
  if (!finite(h.weight_decay) || h.weight_decay < 0)
    bad("weight_decay must be finite and >= 0, got " + std::to_string(h.weight_decay));
  if (step < 1) bad("step must be >= 1, got " + std::to_string(step));
  if (!finite(grad_mult)) bad("grad_mult (clip_coef / grad_scale) must be finite, got " + std::to_string(grad_mult));
}

}  // namespace

int default_threads() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

const char* active_isa_name() { return active_table().name; }

const uint64_t* crc_fold_constants() {
  // x^(8*64+32) and x^(8*64-32) mod P, bit-reflected and shifted left by one: the registers of
  // the CRC's reflected domain (io::crc32c_shift gives x^(8n)) as the carry-less multiply wants
  // them (adam_avx512.cpp, the folding Note).
  static const uint64_t k[2] = {static_cast<uint64_t>(io::crc32c_shift(68)) << 1,
                                static_cast<uint64_t>(io::crc32c_shift(60)) << 1};
  return k;
}

namespace {
// What adam_step_crc asks of run_adam: the streams, and where each segment's CRCs go.
struct CrcRequest {
  unsigned mask = 0;
  std::vector<uint32_t>* out = nullptr;  // kCrcStreams per segment
};

// One piece of a chunk (a segment's elements inside it) and its CRCs, joined in order after
// the chunks ran (they may run on any thread, in any order).
struct CrcPiece {
  size_t seg, n;
  uint32_t crc[kCrcStreams];
};

void join_crcs(const std::vector<std::vector<CrcPiece>>& per_chunk, const Types& types, size_t nseg,
               const CrcRequest& req) {
  const size_t bytes[kCrcStreams] = {elem_size(types.state), elem_size(types.state), elem_size(types.param),
                                     elem_size(types.state), elem_size(types.state)};
  std::vector<uint32_t>& out = *req.out;
  out.assign(nseg * kCrcStreams, 0u);
  std::vector<bool> started(nseg, false);
  // Most pieces are one chunk long: the shift for a length is computed once per length.
  uint64_t last_len[kCrcStreams] = {};
  uint32_t last_shift[kCrcStreams] = {};
  for (const auto& pieces : per_chunk) {
    for (const CrcPiece& pc : pieces) {
      for (unsigned k = 0; k < kCrcStreams; ++k) {
        if (!(req.mask & (1u << k))) continue;
        uint32_t& dst = out[pc.seg * kCrcStreams + k];
        if (!started[pc.seg]) {
          dst = pc.crc[k];
          continue;
        }
        const uint64_t len = pc.n * bytes[k];
        if (len != last_len[k]) {
          last_len[k] = len;
          last_shift[k] = io::crc32c_shift(len);
        }
        dst = io::crc32c_combine(dst, pc.crc[k], last_shift[k]);
      }
      started[pc.seg] = true;
    }
  }
}

// adam_step, adam_step_norm and adam_step_crc: grad_sq non-null takes the grads' squared norm
// chunk by chunk; crc non-null takes the CRCs it asks for in the same pass.
bool run_adam(const std::vector<Segment>& segments, const Types& types, const Hyper& h, int64_t step,
              double grad_mult, bool check_finite, const RunOptions& run, double* grad_sq,
              const CrcRequest* crc = nullptr) {
  check_hyper(h, step, grad_mult);
  const IsaTable& isa = active_table();
  const AdamRangeFn kernel = isa.adam(types);
  if (kernel == nullptr)
    bad(std::string("unsupported dtype combination: params ") + dtype_name(types.param) + ", grads " +
        dtype_name(types.grad) + ", states " + dtype_name(types.state) + ", half_out " + dtype_name(types.out));
  std::vector<size_t> sizes;
  sizes.reserve(segments.size());
  size_t out_bytes = 0;
  for (size_t i = 0; i < segments.size(); ++i) {
    const Segment& s = segments[i];
    check_ptr(s.param, s.n, types.param, "params", i);
    check_ptr(s.grad, s.n, types.grad, "grads", i);
    check_ptr(s.exp_avg, s.n, types.state, "exp_avg", i);
    check_ptr(s.exp_avg_sq, s.n, types.state, "exp_avg_sq", i);
    if (types.out != DType::kNone) check_ptr(s.half_out, s.n, types.out, "half_out", i);
    else if (s.half_out != nullptr) bad("half_out of segment " + std::to_string(i) + " given without its dtype");
    sizes.push_back(s.n);
    out_bytes += s.n * elem_size(types.out);
  }
  if (check_finite) {
    std::vector<Buffer> grads;
    grads.reserve(segments.size());
    for (const Segment& s : segments) grads.push_back({s.grad, s.n, types.grad});
    if (!scan_finite(grads, static_cast<float>(grad_mult), run.num_threads)) return false;
  }

  // Note: constants in double, rounded once to float, as torch computes its scalars in Python
  // floats and its CPU kernels take them as float.
  StepConsts c{};
  double bc1 = 1.0, bc2 = 1.0;
  if (h.bias_correction) {
    bc1 = 1.0 - std::pow(h.beta1, static_cast<double>(step));
    bc2 = 1.0 - std::pow(h.beta2, static_cast<double>(step));
  }
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  c.eps = static_cast<float>(h.eps);
  c.grad_mult = static_cast<float>(grad_mult);
  c.decay = h.adamw_mode ? static_cast<float>(1.0 - h.lr * h.weight_decay) : 1.0f;
  c.use_l2 = !h.adamw_mode && h.weight_decay != 0.0;
  c.l2 = c.use_l2 ? static_cast<float>(h.weight_decay) : 0.0f;
  c.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  c.neg_step_size = static_cast<float>(-h.lr / bc1);
  c.stream_out = types.out != DType::kNone &&
                 (run.stream_out > 0 || (run.stream_out < 0 && out_bytes >= kStreamMinBytes));

  // After the finite pre-scan, the last grads it read are the ones still in cache: update from
  // the end, so a shard whose grads fit in the last-level cache reads them from DRAM only once.
  const Layout layout(sizes);
  const size_t chunks = layout.chunks();
  if (crc != nullptr) {
    // The SIMD files' _crc kernels use the crc32 instruction; a CPU without SSE4.2 (none with
    // AVX2 is known, but nothing is assumed) runs the scalar file's, which checksums by table.
    const IsaTable& ct = io::crc32c_hardware() ? isa : scalar_table();
    CrcRequest req = *crc;
    if (&ct == &avx512_table() && crc_fold_available()) req.mask |= 1u << kCrcFold;
    const AdamCrcRangeFn ckernel = ct.adam_crc(types);
    if (ckernel == nullptr) bad("unsupported dtype combination for the CRC kernel");
    const SqNormRangeFn sq = grad_sq != nullptr ? isa.sqnorm(types.grad) : nullptr;
    if (grad_sq != nullptr && sq == nullptr)
      bad("unsupported dtype for squared_norm: " + std::string(dtype_name(types.grad)));
    std::vector<std::vector<CrcPiece>> per_chunk(chunks);
    std::vector<double> partial(chunks, 0.0);
    run_chunks(chunks, threads_of(run.num_threads), [&](size_t chunk) {
      double sum = 0.0;
      layout.for_chunk(chunk, [&](size_t s, size_t b, size_t e) {
        if (sq != nullptr) sum += sq(segments[s].grad, b, e);
        CrcPiece pc{s, e - b, {}};
        ckernel(segments[s], b, e, c, req.mask, pc.crc);
        per_chunk[chunk].push_back(pc);
      });
      partial[chunk] = sum;
    });
    join_crcs(per_chunk, types, segments.size(), *crc);
    if (grad_sq != nullptr) {
      double total = 0.0;
      for (double x : partial) total += x;
      *grad_sq = total;
    }
    return true;
  }
  if (grad_sq != nullptr) {
    const SqNormRangeFn sq = isa.sqnorm(types.grad);
    if (sq == nullptr) bad("unsupported dtype for squared_norm: " + std::string(dtype_name(types.grad)));
    // One partial sum per chunk, added in chunk order, as squared_norm does.
    std::vector<double> partial(chunks, 0.0);
    run_chunks(chunks, threads_of(run.num_threads), [&](size_t chunk) {
      double sum = 0.0;
      layout.for_chunk(chunk, [&](size_t s, size_t b, size_t e) {
        sum += sq(segments[s].grad, b, e);
        kernel(segments[s], b, e, c);
      });
      partial[chunk] = sum;
    });
    double total = 0.0;
    for (double x : partial) total += x;
    *grad_sq = total;
    return true;
  }
  run_chunks(chunks, threads_of(run.num_threads), [&](size_t chunk) {
    layout.for_chunk(check_finite ? chunks - 1 - chunk : chunk,
                     [&](size_t s, size_t b, size_t e) { kernel(segments[s], b, e, c); });
  });
  return true;
}
}  // namespace

bool adam_step(const std::vector<Segment>& segments, const Types& types, const Hyper& h, int64_t step,
               double grad_mult, bool check_finite, const RunOptions& run) {
  return run_adam(segments, types, h, step, grad_mult, check_finite, run, nullptr);
}

double adam_step_norm(const std::vector<Segment>& segments, const Types& types, const Hyper& h, int64_t step,
                      double grad_mult, const RunOptions& run) {
  double sq = 0.0;
  run_adam(segments, types, h, step, grad_mult, false, run, &sq);
  return sq;
}

double adam_step_crc(const std::vector<Segment>& segments, const Types& types, const Hyper& h, int64_t step,
                     double grad_mult, const RunOptions& run, unsigned crc_mask, bool with_norm,
                     std::vector<uint32_t>* crc_out) {
  if (crc_mask >= (1u << kCrcStreams)) bad("crc_mask names a stream that does not exist: " + std::to_string(crc_mask));
  const CrcRequest req{crc_mask, crc_out};
  double sq = 0.0;
  run_adam(segments, types, h, step, grad_mult, false, run, with_norm ? &sq : nullptr, &req);
  return sq;
}

bool all_finite(const std::vector<Buffer>& buffers, double mult, int num_threads) {
  if (!std::isfinite(mult)) bad("mult must be finite, got " + std::to_string(mult));
  return scan_finite(buffers, static_cast<float>(mult), num_threads);
}

double squared_norm(const std::vector<Buffer>& buffers, int num_threads) {
  const IsaTable& isa = active_table();
  std::vector<size_t> sizes;
  std::vector<SqNormRangeFn> fns;
  for (size_t i = 0; i < buffers.size(); ++i) {
    check_ptr(buffers[i].data, buffers[i].n, buffers[i].dtype, "buffer", i);
    SqNormRangeFn f = isa.sqnorm(buffers[i].dtype);
    if (f == nullptr) bad("unsupported dtype for squared_norm: " + std::string(dtype_name(buffers[i].dtype)));
    sizes.push_back(buffers[i].n);
    fns.push_back(f);
  }
  // One partial sum per chunk, added in chunk order: the result does not depend on the number
  // of threads or on which thread ran which chunk.
  const Layout layout(sizes);
  std::vector<double> partial(layout.chunks(), 0.0);
  run_chunks(layout.chunks(), threads_of(num_threads), [&](size_t c) {
    double sum = 0.0;
    layout.for_chunk(c, [&](size_t s, size_t b, size_t e) { sum += fns[s](buffers[s].data, b, e); });
    partial[c] = sum;
  });
  double total = 0.0;
  for (double x : partial) total += x;
  return total;
}

void convert(const Buffer& src, void* dst, DType dst_dtype, int num_threads) {
  check_ptr(src.data, src.n, src.dtype, "src", 0);
  check_ptr(dst, src.n, dst_dtype, "dst", 0);
  const ConvertRangeFn f = active_table().convert(src.dtype, dst_dtype);
  if (f == nullptr) bad("unsupported conversion " + std::string(dtype_name(src.dtype)) + " -> " + dtype_name(dst_dtype));
  const Layout layout(std::vector<size_t>{src.n});
  run_chunks(layout.chunks(), threads_of(num_threads), [&](size_t c) {
    layout.for_chunk(c, [&](size_t, size_t b, size_t e) { f(src.data, dst, b, e); });
  });
}

void sum_parts(const std::vector<SumSegment>& segments, DType src_dtype, DType dst_dtype, int num_threads) {
  const SumRangeFn f = active_table().sum(src_dtype, dst_dtype);
  if (f == nullptr) bad("unsupported sum " + std::string(dtype_name(src_dtype)) + " -> " + dtype_name(dst_dtype));
  std::vector<size_t> sizes;
  for (size_t i = 0; i < segments.size(); ++i) {
    const SumSegment& s = segments[i];
    if (s.srcs.empty()) bad("sum segment " + std::to_string(i) + " has no sources");
    check_ptr(s.dst, s.n, dst_dtype, "dst", i);
    for (const void* p : s.srcs) check_ptr(p, s.n, src_dtype, "source", i);
    sizes.push_back(s.n);
  }
  const Layout layout(sizes);
  run_chunks(layout.chunks(), threads_of(num_threads), [&](size_t c) {
    layout.for_chunk(c, [&](size_t s, size_t b, size_t e) {
      f(segments[s].srcs.data(), segments[s].srcs.size(), segments[s].dst, b, e);
    });
  });
}

void bandwidth_floor(const std::vector<Segment>& segments, int stream_out, int num_threads) {
  std::vector<size_t> sizes;
  size_t out_bytes = 0;
  for (size_t i = 0; i < segments.size(); ++i) {
    const Segment& s = segments[i];
    check_ptr(s.param, s.n, DType::kF32, "params", i);
    check_ptr(s.grad, s.n, DType::kF32, "grads", i);
    check_ptr(s.exp_avg, s.n, DType::kF32, "exp_avg", i);
    check_ptr(s.exp_avg_sq, s.n, DType::kF32, "exp_avg_sq", i);
    if (s.half_out != nullptr) {
      check_ptr(s.half_out, s.n, DType::kBF16, "half_out", i);
      out_bytes += 2 * s.n;
    }
    sizes.push_back(s.n);
  }
  const bool stream = out_bytes > 0 && (stream_out > 0 || (stream_out < 0 && out_bytes >= kStreamMinBytes));
  const FloorRangeFn f = active_table().floor;
  const Layout layout(sizes);
  run_chunks(layout.chunks(), threads_of(num_threads), [&](size_t c) {
    layout.for_chunk(c, [&](size_t s, size_t b, size_t e) { f(segments[s], b, e, stream); });
  });
}

}  // namespace adam
}  // namespace offloadpp
