// RAII file descriptor with the path kept for error messages. Requests hold a shared_ptr
// to their File, so a descriptor stays open until the last in-flight block completes.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

namespace offloadpp {
namespace io {

class File : public std::enable_shared_from_this<File> {
 public:
  // read/write select O_RDONLY, O_WRONLY or O_RDWR; create adds O_CREAT (mode 0600),
  // exclusive O_EXCL; direct adds O_DIRECT. Throws IoError (ENOENT, EACCES, EINVAL when the
  // filesystem rejects O_DIRECT, ...) naming the path.
  File(std::string path, bool read, bool write, bool create, bool direct, bool exclusive = false);
  ~File();
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  int fd() const { return fd_; }
  const std::string& path() const { return path_; }
  bool direct() const { return direct_; }
  bool readable() const { return read_; }
  bool writable() const { return write_; }
  bool closed() const { return fd_ < 0; }

  int64_t size() const;                  // fstat st_size
  int64_t allocated_bytes() const;       // st_blocks * 512
  void allocate(int64_t length);         // reserve [0, length): ENOSPC shows up here, not mid-write
  void truncate(int64_t length);         // ftruncate
  void sync();                           // fdatasync
  void close();                          // explicit close; errors thrown (the destructor ignores them)

  // Synchronous helpers for small control-plane I/O (probe, tests): full transfer or IoError.
  void pread_all(char* buf, uint64_t len, int64_t offset) const;
  void pwrite_all(const char* buf, uint64_t len, int64_t offset) const;

 private:
  void require_open(const char* op) const;

  std::string path_;
  int fd_ = -1;
  bool read_;
  bool write_;
  bool direct_;
};

}  // namespace io
}  // namespace offloadpp
