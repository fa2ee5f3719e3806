// Backend probe: a real write + read-back through the backend in the target directory.
// AUTO picks the first backend whose probe works; `offloadpp doctor` prints every result.
#include "io/probe.h"

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "io/aligned_buffer.h"
#include "io/engine.h"
#include "io/file.h"

namespace offloadpp {
namespace io {

ProbeResult probe_backend(BackendKind kind, const std::string& directory, bool direct) {
  ProbeResult out;
  out.name = backend_name(kind);
  out.compiled = backend_compiled(kind);
  if (!out.compiled) {
    out.detail = "not compiled in (its development headers were missing at build time)";
    return out;
  }
  static std::atomic<unsigned> counter{0};
  const std::string path = directory + "/.offloadpp-probe-" + std::to_string(::getpid()) + "-" +
                           std::to_string(counter.fetch_add(1)) + "-" + out.name;
  constexpr uint64_t kBytes = 256 * 1024;  // 4 blocks of 64 KiB, kept in flight together
  bool created = false;
  try {
    Engine engine(kind, 64 * 1024, 4, 1);
    auto file = std::make_shared<File>(path, true, true, true, direct, true);
    created = true;
    AlignedBuffer src(kBytes), dst(kBytes, true);
    for (uint64_t i = 0; i < kBytes; ++i) src.data()[i] = static_cast<char>((i * 131 + 7) & 0xFF);
    engine.submit_one(RequestSpec{true, file, src.data(), kBytes, 0, 0})->wait();
    engine.submit_one(RequestSpec{false, file, dst.data(), kBytes, 0, kBytes})->wait();
    if (std::memcmp(src.data(), dst.data(), kBytes) != 0) {
      out.detail = "data read back differs from data written";
    } else {
      out.works = true;
      out.detail = std::string(direct ? "O_DIRECT" : "buffered") + " write + read-back of 256 KiB ok";
    }
  } catch (const IoError& e) {
    out.err = e.err();
    out.detail = e.what();
  }
  if (created && ::unlink(path.c_str()) != 0) {
    out.detail += "; " + format_io_error(errno, "removing the probe file", path, -1);
  }
  return out;
}

}  // namespace io
}  // namespace offloadpp
