// Shared vocabulary of the I/O engine: the alignment constant, the error type every
// failure becomes, and the block-level operation a backend executes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace offloadpp {
namespace io {

// O_DIRECT alignment for buffer addresses, lengths and file offsets. 4096 covers every
// logical block size in use (512e and 4Kn drives, tmpfs pages); checked at the API boundary.
constexpr uint64_t kAlignment = 4096;

inline bool is_aligned(uint64_t v) { return (v % kAlignment) == 0; }
inline uint64_t align_up(uint64_t v) { return (v + kAlignment - 1) / kAlignment * kAlignment; }
inline uint64_t align_down(uint64_t v) { return v / kAlignment * kAlignment; }

// Every runtime failure of the engine is an IoError: errno (0 when none applies), the path,
// the file offset (-1 when none applies) and what was being done. The bindings turn it into
// offloadpp.io.SwapIOError (an OSError subclass) with errno/filename/offset set.
class IoError : public std::runtime_error {
 public:
  IoError(int err, std::string what_op, std::string path, int64_t offset);
  int err() const { return err_; }
  const std::string& path() const { return path_; }
  int64_t offset() const { return offset_; }
  const std::string& op() const { return op_; }

 private:
  int err_;
  std::string op_;
  std::string path_;
  int64_t offset_;
};

// Formats "<op> failed on <path> at offset <off>: <strerror> (errno N)".
std::string format_io_error(int err, const std::string& op, const std::string& path, int64_t offset);

enum class BackendKind : int { AUTO = 0, LIBAIO = 1, URING = 2, THREADPOOL = 3 };

const char* backend_name(BackendKind kind);
BackendKind backend_from_name(const std::string& name);  // throws std::invalid_argument
bool backend_compiled(BackendKind kind);

// One block-sized operation handed to a backend. `tag` comes back in the completion.
struct BlockOp {
  bool write;
  int fd;
  char* buf;
  uint64_t len;
  int64_t offset;
  uint64_t tag;
};

// res: bytes transferred (>= 0) or -errno, exactly like io_event.res / cqe->res.
struct BlockCompletion {
  uint64_t tag;
  int64_t res;
};

}  // namespace io
}  // namespace offloadpp
