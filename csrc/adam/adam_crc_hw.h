// The raw CRC-32C register updates with the SSE4.2 crc32 instruction, for adam_impl.h's _crc
// kernels (the CRC Note in adam_kernel.h). Included (no include guard, on purpose) inside an ISA
// file's namespace after a `#pragma GCC target` that enables sse4.2; the dispatcher only picks
// those files' _crc kernels where the CPU has it (io::crc32c_hardware), the scalar file's else.
//
// Note: why several streams at once. crc32 has a latency of 3 cycles and a throughput of 1: one
// stream's chain alone runs at a third of the unit's rate. A block's streams of the same length
// (the two moments read; params and moments written) are therefore walked side by side.

static inline uint32_t crc_raw_tail(uint32_t c32, const unsigned char* b, size_t n) {
  for (; n >= 2; n -= 2, b += 2) {
    uint16_t x;
    std::memcpy(&x, b, 2);
    c32 = _mm_crc32_u16(c32, x);
  }
  if (n) c32 = _mm_crc32_u8(c32, *b);
  return c32;
}

static inline uint32_t crc_raw(uint32_t reg, const void* data, size_t n) {
  const unsigned char* b = static_cast<const unsigned char*>(data);
  uint64_t c = reg;
  for (; n >= 8; n -= 8, b += 8) {
    uint64_t x;
    std::memcpy(&x, b, 8);
    c = _mm_crc32_u64(c, x);
  }
  return crc_raw_tail(static_cast<uint32_t>(c), b, n);
}

// K streams of n bytes each: regs[k] over data[k].
template <int K>
static inline void crc_raw_n(uint32_t* const* regs, const void* const* data, size_t n) {
  uint64_t c[K];
  const unsigned char* b[K];
  for (int k = 0; k < K; ++k) {
    c[k] = *regs[k];
    b[k] = static_cast<const unsigned char*>(data[k]);
  }
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int k = 0; k < K; ++k) {
      uint64_t x;
      std::memcpy(&x, b[k] + i, 8);
      c[k] = _mm_crc32_u64(c[k], x);
    }
  }
  for (int k = 0; k < K; ++k) *regs[k] = crc_raw_tail(static_cast<uint32_t>(c[k]), b[k] + i, n - i);
}
