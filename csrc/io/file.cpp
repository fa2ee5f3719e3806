#include "io/file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "io/io_common.h"

namespace offloadpp {
namespace io {

namespace {
std::string open_flags_text(bool read, bool write, bool create, bool direct, bool exclusive) {
  std::string s = read && write ? "O_RDWR" : (write ? "O_WRONLY" : "O_RDONLY");
  if (create) s += "|O_CREAT";
  if (exclusive) s += "|O_EXCL";
  if (direct) s += "|O_DIRECT";
  return s;
}
}  // namespace

File::File(std::string path, bool read, bool write, bool create, bool direct, bool exclusive)
    : path_(std::move(path)), read_(read), write_(write), direct_(direct) {
  if (!read && !write) throw IoError(EINVAL, "open (neither read nor write requested)", path_, -1);
  int flags = read && write ? O_RDWR : (write ? O_WRONLY : O_RDONLY);
  flags |= O_CLOEXEC;
  if (create) flags |= O_CREAT;
  if (exclusive) flags |= O_EXCL;
  if (direct) flags |= O_DIRECT;
  for (;;) {
    fd_ = ::open(path_.c_str(), flags, 0600);
    if (fd_ >= 0) break;
    if (errno == EINTR) continue;
    const int err = errno;
    std::string op = "open(" + open_flags_text(read, write, create, direct, exclusive) + ")";
    if (err == EINVAL && direct) op += " [the filesystem may not support O_DIRECT]";
    throw IoError(err, op, path_, -1);
  }
}

File::~File() {
  if (fd_ >= 0) ::close(fd_);  // errors cannot be reported from a destructor; close() reports them
}

void File::require_open(const char* op) const {
  if (fd_ < 0) throw IoError(EBADF, std::string(op) + " on a closed file", path_, -1);
}

int64_t File::size() const {
  require_open("fstat");
  struct stat st;
  if (::fstat(fd_, &st) != 0) throw IoError(errno, "fstat", path_, -1);
  return static_cast<int64_t>(st.st_size);
}

int64_t File::allocated_bytes() const {
  require_open("fstat");
  struct stat st;
  if (::fstat(fd_, &st) != 0) throw IoError(errno, "fstat", path_, -1);
  return static_cast<int64_t>(st.st_blocks) * 512;
}

void File::allocate(int64_t length) {
  require_open("fallocate");
  if (length <= 0) return;
  for (;;) {
    const int rc = ::fallocate(fd_, 0, 0, length);
    if (rc == 0) return;
    if (errno == EINTR) continue;
    if (errno == EOPNOTSUPP || errno == ENOSYS) {
      // No preallocation here (some network/overlay filesystems): extend the size instead;
      // space errors then come from the writes themselves.
      if (size() < length) truncate(length);
      return;
    }
    throw IoError(errno, "fallocate(" + std::to_string(length) + " bytes)", path_, 0);
  }
}

void File::truncate(int64_t length) {
  require_open("ftruncate");
  for (;;) {
    if (::ftruncate(fd_, length) == 0) return;
    if (errno == EINTR) continue;
    throw IoError(errno, "ftruncate(" + std::to_string(length) + ")", path_, -1);
  }
}

void File::sync() {
  require_open("fdatasync");
  if (::fdatasync(fd_) != 0) throw IoError(errno, "fdatasync", path_, -1);
}

void File::close() {
  if (fd_ < 0) return;
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0 && errno != EINTR) throw IoError(errno, "close", path_, -1);
}

void File::pread_all(char* buf, uint64_t len, int64_t offset) const {
  require_open("pread");
  uint64_t done = 0;
  while (done < len) {
    const ssize_t rc = ::pread(fd_, buf + done, len - done, offset + static_cast<int64_t>(done));
    if (rc < 0) {
      if (errno == EINTR) continue;
      throw IoError(errno, "pread", path_, offset + static_cast<int64_t>(done));
    }
    if (rc == 0) {
      throw IoError(EIO, "pread (unexpected end of file after " + std::to_string(done) + " of " +
                             std::to_string(len) + " bytes)", path_, offset + static_cast<int64_t>(done));
    }
    done += static_cast<uint64_t>(rc);
  }
}

void File::pwrite_all(const char* buf, uint64_t len, int64_t offset) const {
  require_open("pwrite");
  uint64_t done = 0;
  while (done < len) {
    const ssize_t rc = ::pwrite(fd_, buf + done, len - done, offset + static_cast<int64_t>(done));
    if (rc < 0) {
      if (errno == EINTR) continue;
      throw IoError(errno, "pwrite", path_, offset + static_cast<int64_t>(done));
    }
    if (rc == 0) throw IoError(EIO, "pwrite (wrote 0 bytes)", path_, offset + static_cast<int64_t>(done));
    done += static_cast<uint64_t>(rc);
  }
}

}  // namespace io
}  // namespace offloadpp
