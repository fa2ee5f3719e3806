// Python bindings of the fused CPU Adam (offloadpp._C.adam_*). Raw addresses (tensor.data_ptr())
// and sizes cross the boundary; offloadpp/optim validates tensors before calling. Every entry
// point releases the GIL while it runs; argument errors raise ValueError.
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "adam/adam_dispatch.h"
#include "bindings.h"

namespace py = pybind11;

namespace offloadpp {
namespace {
using adam::Buffer;
using adam::DType;
using adam::Segment;

DType to_dtype(int code, bool allow_none, const char* name) {
  if (code >= 0 && code <= 2) return static_cast<DType>(code);
  if (allow_none && code == 3) return DType::kNone;
  throw py::value_error(std::string(name) + ": unknown dtype code " + std::to_string(code));
}

void* as_ptr(uint64_t v) { return reinterpret_cast<void*>(static_cast<uintptr_t>(v)); }

// [param, grad, exp_avg, exp_avg_sq, half_out, n] * k
std::vector<Segment> to_segments(const std::vector<uint64_t>& flat) {
  if (flat.size() % 6 != 0) throw py::value_error("segments: expected 6 integers per segment");
  std::vector<Segment> out(flat.size() / 6);
  for (size_t i = 0; i < out.size(); ++i) {
    const uint64_t* f = &flat[6 * i];
    out[i] = Segment{as_ptr(f[0]), as_ptr(f[1]), as_ptr(f[2]), as_ptr(f[3]), as_ptr(f[4]), static_cast<size_t>(f[5])};
  }
  return out;
}

// [data, n, dtype] * k
std::vector<Buffer> to_buffers(const std::vector<uint64_t>& flat) {
  if (flat.size() % 3 != 0) throw py::value_error("buffers: expected 3 integers per buffer");
  std::vector<Buffer> out(flat.size() / 3);
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = Buffer{as_ptr(flat[3 * i]), static_cast<size_t>(flat[3 * i + 1]),
                    to_dtype(static_cast<int>(flat[3 * i + 2]), false, "buffers")};
  }
  return out;
}
}  // namespace

void register_adam(py::module_& m) {
  // Arguments are converted with the GIL held; the kernels run without it.
  m.def(
      "adam_step",
      [](const std::vector<uint64_t>& segments, int param_dtype, int grad_dtype, int state_dtype, int out_dtype,
         double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw_mode,
         bool bias_correction, int64_t step, double grad_mult, bool check_finite, int num_threads,
         int stream_out) {
        const std::vector<Segment> segs = to_segments(segments);
        const adam::Types types{to_dtype(param_dtype, false, "param_dtype"), to_dtype(grad_dtype, false, "grad_dtype"),
                                to_dtype(state_dtype, false, "state_dtype"), to_dtype(out_dtype, true, "out_dtype")};
        const adam::Hyper hyper{lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction};
        py::gil_scoped_release release;
        return adam::adam_step(segs, types, hyper, step, grad_mult, check_finite,
                               adam::RunOptions{num_threads, stream_out});
      },
      py::arg("segments"), py::arg("param_dtype"), py::arg("grad_dtype"), py::arg("state_dtype"),
      py::arg("out_dtype"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
      py::arg("weight_decay"), py::arg("adamw_mode"), py::arg("bias_correction"), py::arg("step"),
      py::arg("grad_mult") = 1.0, py::arg("check_finite") = false, py::arg("num_threads") = 0,
      py::arg("stream_out") = -1,
      "One fused Adam step over flat segments [param, grad, exp_avg, exp_avg_sq, half_out, n]*k "
      "(addresses; dtype codes 0=f32 1=bf16 2=f16 3=none). Returns False (nothing written) if "
      "check_finite and any grad * grad_mult is inf/nan.");
  m.def(
      "adam_step_norm",
      [](const std::vector<uint64_t>& segments, int param_dtype, int grad_dtype, int state_dtype, int out_dtype,
         double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw_mode,
         bool bias_correction, int64_t step, double grad_mult, int num_threads, int stream_out) {
        const std::vector<Segment> segs = to_segments(segments);
        const adam::Types types{to_dtype(param_dtype, false, "param_dtype"), to_dtype(grad_dtype, false, "grad_dtype"),
                                to_dtype(state_dtype, false, "state_dtype"), to_dtype(out_dtype, true, "out_dtype")};
        const adam::Hyper hyper{lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction};
        py::gil_scoped_release release;
        return adam::adam_step_norm(segs, types, hyper, step, grad_mult, adam::RunOptions{num_threads, stream_out});
      },
      py::arg("segments"), py::arg("param_dtype"), py::arg("grad_dtype"), py::arg("state_dtype"),
      py::arg("out_dtype"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
      py::arg("weight_decay"), py::arg("adamw_mode"), py::arg("bias_correction"), py::arg("step"),
      py::arg("grad_mult") = 1.0, py::arg("num_threads") = 0, py::arg("stream_out") = -1,
      "adam_step (no finite check) returning the sum of squares of the raw grads, exactly as "
      "adam_squared_norm over the segments' grads gives it.");
  m.def(
      "adam_step_crc",
      [](const std::vector<uint64_t>& segments, int param_dtype, int grad_dtype, int state_dtype, int out_dtype,
         double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw_mode,
         bool bias_correction, int64_t step, double grad_mult, int num_threads, int stream_out,
         unsigned crc_mask, bool with_norm) {
        const std::vector<Segment> segs = to_segments(segments);
        const adam::Types types{to_dtype(param_dtype, false, "param_dtype"), to_dtype(grad_dtype, false, "grad_dtype"),
                                to_dtype(state_dtype, false, "state_dtype"), to_dtype(out_dtype, true, "out_dtype")};
        const adam::Hyper hyper{lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction};
        std::vector<uint32_t> crcs;
        double sq = 0.0;
        {
          py::gil_scoped_release release;
          sq = adam::adam_step_crc(segs, types, hyper, step, grad_mult, adam::RunOptions{num_threads, stream_out},
                                   crc_mask, with_norm, &crcs);
        }
        return py::make_tuple(sq, crcs);
      },
      py::arg("segments"), py::arg("param_dtype"), py::arg("grad_dtype"), py::arg("state_dtype"),
      py::arg("out_dtype"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
      py::arg("weight_decay"), py::arg("adamw_mode"), py::arg("bias_correction"), py::arg("step"),
      py::arg("grad_mult"), py::arg("num_threads"), py::arg("stream_out"), py::arg("crc_mask"),
      py::arg("with_norm"),
      "adam_step (no finite check) taking in the same pass the CRC-32C of the streams crc_mask names "
      "(bit k: 0 exp_avg read, 1 exp_avg_sq read, 2 params written, 3 exp_avg written, 4 exp_avg_sq "
      "written) over each segment; with_norm also the raw grads' sum of squares. Returns (sum of "
      "squares or 0, [5 CRCs per segment]).");
  m.def(
      "adam_all_finite",
      [](const std::vector<uint64_t>& buffers, double mult, int num_threads) {
        const std::vector<Buffer> bufs = to_buffers(buffers);
        py::gil_scoped_release release;
        return adam::all_finite(bufs, mult, num_threads);
      },
      py::arg("buffers"), py::arg("mult") = 1.0, py::arg("num_threads") = 0,
      "True if every element * mult of buffers [data, n, dtype]*k is finite.");
  m.def(
      "adam_squared_norm",
      [](const std::vector<uint64_t>& buffers, int num_threads) {
        const std::vector<Buffer> bufs = to_buffers(buffers);
        py::gil_scoped_release release;
        return adam::squared_norm(bufs, num_threads);
      },
      py::arg("buffers"), py::arg("num_threads") = 0,
      "Sum of squares of buffers [data, n, dtype]*k, fp64 accumulation; inf/nan propagate.");
  m.def(
      "adam_convert",
      [](uint64_t src, int src_dtype, uint64_t dst, int dst_dtype, uint64_t n, int num_threads) {
        const Buffer b{as_ptr(src), static_cast<size_t>(n), to_dtype(src_dtype, false, "src_dtype")};
        const DType d = to_dtype(dst_dtype, false, "dst_dtype");
        py::gil_scoped_release release;
        adam::convert(b, as_ptr(dst), d, num_threads);
      },
      py::arg("src"), py::arg("src_dtype"), py::arg("dst"), py::arg("dst_dtype"), py::arg("n"),
      py::arg("num_threads") = 0, "dst = src converted (round to nearest even), with the active SIMD kernels.");
  m.def(
      "adam_sum",
      [](const std::vector<uint64_t>& flat, int src_dtype, int dst_dtype, int num_threads) {
        // [dst, n, k, src_0 .. src_{k-1}] * segments
        std::vector<adam::SumSegment> segs;
        for (size_t at = 0; at < flat.size();) {
          if (at + 3 > flat.size()) throw py::value_error("segments: truncated [dst, n, k, sources...]");
          adam::SumSegment s;
          s.dst = as_ptr(flat[at]);
          s.n = static_cast<size_t>(flat[at + 1]);
          const size_t k = static_cast<size_t>(flat[at + 2]);
          at += 3;
          if (k > flat.size() - at) throw py::value_error("segments: fewer sources than k");
          for (size_t j = 0; j < k; ++j) s.srcs.push_back(as_ptr(flat[at + j]));
          at += k;
          segs.push_back(std::move(s));
        }
        const DType src = to_dtype(src_dtype, false, "src_dtype"), dst = to_dtype(dst_dtype, false, "dst_dtype");
        py::gil_scoped_release release;
        adam::sum_parts(segs, src, dst, num_threads);
      },
      py::arg("segments"), py::arg("src_dtype"), py::arg("dst_dtype"), py::arg("num_threads") = 0,
      "Per segment [dst, n, k, src_0..src_{k-1}]: dst = the k sources added in fp32 in order, rounded "
      "once to dst_dtype.");
  m.def(
      "adam_bandwidth_floor",
      [](const std::vector<uint64_t>& segments, int stream_out, int num_threads) {
        const std::vector<Segment> segs = to_segments(segments);
        py::gil_scoped_release release;
        adam::bandwidth_floor(segs, stream_out, num_threads);
      },
      py::arg("segments"), py::arg("stream_out") = -1, py::arg("num_threads") = 0,
      "Adam's memory traffic (fp32 p/g/m/v read, p/m/v written, optional bf16 copy) without its "
      "arithmetic: the bandwidth floor the bench compares against.");
  m.def("adam_default_threads", &adam::default_threads, "Threads used when num_threads <= 0 (CPU affinity).");
  m.def("adam_isa", [] { return std::string(adam::active_isa_name()); }, "Kernel variant in use now.");
}

}  // namespace offloadpp
