// Host memory aligned for O_DIRECT, and the payload checksum (CRC-32C).
#pragma once

#include <cstddef>
#include <cstdint>

namespace offloadpp {
namespace io {

// An owned, kAlignment-aligned allocation whose capacity is rounded up to kAlignment, so
// O_DIRECT transfers of the padded length stay inside it. Pinning (cudaHostRegister) is done
// by the Python side when CUDA is present; this class knows nothing about CUDA.
class AlignedBuffer {
 public:
  explicit AlignedBuffer(uint64_t nbytes, bool zero = false);
  ~AlignedBuffer();
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;

  char* data() const { return data_; }
  uint64_t size() const { return size_; }          // requested bytes
  uint64_t capacity() const { return capacity_; }  // allocated bytes (multiple of kAlignment)

 private:
  char* data_ = nullptr;
  uint64_t size_;
  uint64_t capacity_;
};

// CRC-32C (Castagnoli), SSE4.2 instruction when the CPU has it, table otherwise.
uint32_t crc32c(const void* data, uint64_t n, uint32_t seed = 0);
bool crc32c_hardware();
// Joining the CRC-32Cs of consecutive pieces A and B computed apart (zlib's crc32_combine):
// crc(A|B) = crc32c_combine(crc(A), crc(B), crc32c_shift(|B|)). The shift depends on |B| only,
// so a caller joining many pieces of one length computes it once.
uint32_t crc32c_shift(uint64_t nbytes);
uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint32_t shift_b);

}  // namespace io
}  // namespace offloadpp
