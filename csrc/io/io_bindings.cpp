// Python bindings of the I/O engine. Raw pointers (ints) and sizes cross the boundary; the
// Python side (offloadpp/io) keeps the tensors behind them alive until the handle completes.
// Every call that can block releases the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings.h"
#include "io/aligned_buffer.h"
#include "io/engine.h"
#include "io/file.h"
#include "io/probe.h"

namespace py = pybind11;
using namespace pybind11::literals;

namespace offloadpp {
namespace {

using io::AlignedBuffer;
using io::Engine;
using io::File;
using io::Handle;
using io::IoError;
using io::RequestSpec;

char* as_ptr(uint64_t p) { return reinterpret_cast<char*>(static_cast<uintptr_t>(p)); }

// IoError -> offloadpp.io.errors.SwapIOError(errno, message, path) with .offset and .op set.
void translate_io_error(const IoError& e) {
  py::object cls;
  try {
    cls = py::module_::import("offloadpp.io.errors").attr("SwapIOError");
  } catch (py::error_already_set&) {
    cls = py::reinterpret_borrow<py::object>(PyExc_OSError);
  }
  py::object path = e.path().empty() ? py::object(py::none()) : py::object(py::str(e.path()));
  py::object exc = cls(e.err(), py::str(e.what()), path);
  try {
    exc.attr("offset") = e.offset() >= 0 ? py::object(py::int_(e.offset())) : py::object(py::none());
    exc.attr("op") = py::str(e.op());
  } catch (py::error_already_set&) {
  }
  PyErr_SetObject(cls.ptr(), exc.ptr());
}

RequestSpec spec_from_tuple(const py::handle& t) {
  auto tup = py::reinterpret_borrow<py::tuple>(t);
  if (tup.size() != 6 && tup.size() != 7 && tup.size() != 10) {
    throw py::value_error(
        "request must be (write, file, ptr, nbytes, offset, required[, crc_len[, seal_src, seal_len, seal_at]]), "
        "got " + std::to_string(tup.size()) + " fields");
  }
  RequestSpec s;
  s.write = tup[0].cast<bool>();
  s.file = tup[1].cast<std::shared_ptr<File>>();
  s.buf = as_ptr(tup[2].cast<uint64_t>());
  s.len = tup[3].cast<uint64_t>();
  s.offset = tup[4].cast<int64_t>();
  s.required = tup[5].cast<uint64_t>();
  if (tup.size() >= 7) s.crc_len = tup[6].cast<uint64_t>();
  if (tup.size() == 10) {
    s.seal_src = as_ptr(tup[7].cast<uint64_t>());
    s.seal_len = tup[8].cast<uint64_t>();
    s.seal_at = tup[9].cast<int64_t>();
  }
  return s;
}

py::dict stats_dict(const io::EngineStats& s) {
  return py::dict("bytes_read"_a = s.bytes_read, "bytes_written"_a = s.bytes_written,
                  "read_seconds"_a = s.read_seconds, "write_seconds"_a = s.write_seconds, "reads"_a = s.reads,
                  "writes"_a = s.writes);
}

}  // namespace

void register_io(py::module_& m) {
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const IoError& e) {
      translate_io_error(e);
    }
  });

  m.attr("ALIGNMENT") = io::kAlignment;

  m.def(
      "io_build_info",
      [] {
        return py::dict("libaio"_a = io::backend_compiled(io::BackendKind::LIBAIO),
                        "io_uring"_a = io::backend_compiled(io::BackendKind::URING),
                        "threadpool"_a = io::backend_compiled(io::BackendKind::THREADPOOL),
                        "alignment"_a = io::kAlignment, "crc32c_hardware"_a = io::crc32c_hardware(),
                        "engine_checksums"_a = true);  // reads' crc_len, writes' seal_* (engine.h)
      },
      "Which I/O backends are compiled in.");

  m.def(
      "probe_backend",
      [](const std::string& name, const std::string& directory, bool direct) {
        const io::BackendKind kind = io::backend_from_name(name);
        io::ProbeResult r;
        {
          py::gil_scoped_release release;
          r = io::probe_backend(kind, directory, direct);
        }
        return py::make_tuple(r.name, r.compiled, r.works, r.err, r.detail);
      },
      "name"_a, "directory"_a, "direct"_a = true,
      "Write and read back 256 KiB through one backend in `directory`: (name, compiled, works, errno, detail).");

  m.def(
      "crc32c", [](uint64_t ptr, uint64_t nbytes, uint32_t seed) { return io::crc32c(as_ptr(ptr), nbytes, seed); },
      "ptr"_a, "nbytes"_a, "seed"_a = 0, py::call_guard<py::gil_scoped_release>(), "CRC-32C of raw memory.");
  m.def(
      "crc32c_combine",
      [](uint32_t crc_a, uint32_t crc_b, uint64_t len_b) { return io::crc32c_combine(crc_a, crc_b, io::crc32c_shift(len_b)); },
      "crc_a"_a, "crc_b"_a, "len_b"_a, "The CRC-32C of A followed by B, from crc(A), crc(B) and B's length in bytes.");

  py::class_<AlignedBuffer, std::shared_ptr<AlignedBuffer>>(m, "AlignedBuffer", py::buffer_protocol(),
                                                           "Host memory aligned to ALIGNMENT bytes, capacity "
                                                           "rounded up to ALIGNMENT; exposes the buffer protocol.")
      .def(py::init<uint64_t, bool>(), "nbytes"_a, "zero"_a = false, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("ptr", [](const AlignedBuffer& b) { return reinterpret_cast<uintptr_t>(b.data()); })
      .def_property_readonly("size", &AlignedBuffer::size)
      .def_property_readonly("capacity", &AlignedBuffer::capacity)
      .def_buffer([](AlignedBuffer& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.capacity())}, {static_cast<py::ssize_t>(1)});
      });

  py::class_<File, std::shared_ptr<File>>(m, "File", "An open file descriptor (closed when the last user drops it).")
      .def(py::init<std::string, bool, bool, bool, bool, bool>(), "path"_a, "read"_a = true, "write"_a = false,
           "create"_a = false, "direct"_a = true, "exclusive"_a = false, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("fd", &File::fd)
      .def_property_readonly("path", &File::path)
      .def_property_readonly("direct", &File::direct)
      .def_property_readonly("closed", &File::closed)
      .def("size", &File::size, py::call_guard<py::gil_scoped_release>())
      .def("allocated_bytes", &File::allocated_bytes, py::call_guard<py::gil_scoped_release>())
      .def("allocate", &File::allocate, "nbytes"_a, py::call_guard<py::gil_scoped_release>())
      .def("truncate", &File::truncate, "nbytes"_a, py::call_guard<py::gil_scoped_release>())
      .def("sync", &File::sync, py::call_guard<py::gil_scoped_release>())
      .def("close", &File::close, py::call_guard<py::gil_scoped_release>())
      .def(
          "pread_into", [](const File& f, uint64_t ptr, uint64_t n, int64_t off) { f.pread_all(as_ptr(ptr), n, off); },
          "ptr"_a, "nbytes"_a, "offset"_a, py::call_guard<py::gil_scoped_release>())
      .def(
          "pwrite_from",
          [](const File& f, uint64_t ptr, uint64_t n, int64_t off) { f.pwrite_all(as_ptr(ptr), n, off); }, "ptr"_a,
          "nbytes"_a, "offset"_a, py::call_guard<py::gil_scoped_release>())
      .def("__repr__", [](const File& f) {
        return "<offloadpp._C.File " + f.path() + (f.direct() ? " O_DIRECT" : "") + (f.closed() ? " closed>" : ">");
      });

  py::class_<Handle, std::shared_ptr<Handle>>(m, "IoHandle", "One asynchronous submission.")
      .def_property_readonly("nbytes", &Handle::nbytes)
      .def_property_readonly("is_write", &Handle::is_write)
      .def_property_readonly("elapsed_seconds", &Handle::elapsed_seconds)
      .def("done", &Handle::done, "Non-blocking: True once every byte has completed or failed.")
      .def("failed", &Handle::failed)
      .def_property_readonly("crcs", [](const Handle& h) {
        if (!h.done() || h.failed()) throw py::value_error("crcs: the handle is not done, or it failed");
        return h.crcs();
      }, "CRC-32C of each read that asked for one (its crc_len), in submission order, once done.")
      .def(
          "wait",
          [](Handle& h, py::object timeout) {
            const double t = timeout.is_none() ? -1.0 : timeout.cast<double>();
            bool ok;
            {
              py::gil_scoped_release release;
              ok = h.wait_for(t);
            }
            if (!ok) {
              PyErr_SetString(PyExc_TimeoutError, "I/O not complete within the timeout");
              throw py::error_already_set();
            }
            return h.nbytes();
          },
          "timeout"_a = py::none(),
          "Block (GIL released) until complete; returns the byte count or raises SwapIOError.");

  py::class_<io::BusyClock, std::shared_ptr<io::BusyClock>>(
      m, "BusyClock", "Busy wall time per direction, shared by engines whose time should be a union.")
      .def(py::init<>())
      .def_property_readonly("read_seconds", [](const io::BusyClock& c) { return c.seconds(false); })
      .def_property_readonly("write_seconds", [](const io::BusyClock& c) { return c.seconds(true); });

  py::class_<Engine, std::shared_ptr<Engine>>(m, "Engine", "Block-splitting asynchronous I/O engine over one backend.")
      .def(py::init([](const std::string& backend, uint64_t block_size, unsigned queue_depth, unsigned num_threads,
                       std::shared_ptr<io::BusyClock> clock) {
             const io::BackendKind kind = io::backend_from_name(backend);
             py::gil_scoped_release release;
             return std::make_shared<Engine>(kind, block_size, queue_depth, num_threads, std::move(clock));
           }),
           "backend"_a, "block_size"_a = 1 << 20, "queue_depth"_a = 8, "num_threads"_a = 1, "clock"_a = nullptr)
      .def_property_readonly("backend", &Engine::backend_name_str)
      .def_property_readonly("block_size", &Engine::block_size)
      .def_property_readonly("queue_depth", &Engine::queue_depth)
      .def_property_readonly("num_threads", &Engine::num_threads)
      .def_property_readonly("outstanding", &Engine::outstanding)
      .def(
          "submit",
          [](Engine& e, const py::list& chains, bool write, uint64_t nbytes) {
            std::vector<io::ChainSpec> specs;
            specs.reserve(chains.size());
            for (const auto& chain : chains) {
              io::ChainSpec cs;
              for (const auto& stage : chain) {
                io::StageSpec ss;
                for (const auto& req : stage) ss.push_back(spec_from_tuple(req));
                cs.push_back(std::move(ss));
              }
              specs.push_back(std::move(cs));
            }
            return e.submit(std::move(specs), write, nbytes);
          },
          "chains"_a, "write"_a, "nbytes"_a,
          "Submit chains (lists of stages, each a list of (write, file, ptr, nbytes, offset, required[, crc_len])); "
          "a read's crc_len: the engine computes the CRC-32C of its first crc_len bytes (IoHandle.crcs).")
      .def(
          "read",
          [](Engine& e, std::shared_ptr<File> f, uint64_t ptr, uint64_t n, int64_t off, py::object required) {
            const uint64_t req = required.is_none() ? n : required.cast<uint64_t>();
            return e.submit_one(RequestSpec{false, std::move(f), as_ptr(ptr), n, off, req});
          },
          "file"_a, "ptr"_a, "nbytes"_a, "offset"_a = 0, "required"_a = py::none())
      .def(
          "write",
          [](Engine& e, std::shared_ptr<File> f, uint64_t ptr, uint64_t n, int64_t off) {
            return e.submit_one(RequestSpec{true, std::move(f), as_ptr(ptr), n, off, 0});
          },
          "file"_a, "ptr"_a, "nbytes"_a, "offset"_a = 0)
      .def("wait_all", &Engine::wait_all, py::call_guard<py::gil_scoped_release>())
      .def("close", &Engine::close, py::call_guard<py::gil_scoped_release>())
      .def("stats", [](const Engine& e) { return stats_dict(e.stats()); })
      .def("_inject_fault", &Engine::inject_fault, "after_blocks"_a, "err"_a, "short_bytes"_a = 0,
           "Test hook: make a future block completion fail (err > 0) or come back short.");
}

}  // namespace offloadpp
