// Scalar fp32 <-> bf16/fp16 conversions (round to nearest even), shared by every ISA's tails.
// Included (no include guard, on purpose) inside an ISA file's namespace, before adam_ops_scalar.h.

static inline uint32_t f32_to_bits(float x) {
  uint32_t u;
  __builtin_memcpy(&u, &x, sizeof u);
  return u;
}

static inline float bits_to_f32(uint32_t u) {
  float x;
  __builtin_memcpy(&x, &u, sizeof x);
  return x;
}

// fp32 -> bf16, round to nearest even; every NaN becomes 0x7FC0 (what torch's c10::BFloat16 does).
static inline uint16_t f32_to_bf16_bits(float x) {
  const uint32_t u = f32_to_bits(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  const uint32_t rounding = ((u >> 16) & 1u) + 0x7FFFu;
  return static_cast<uint16_t>((u + rounding) >> 16);
}

static inline float bf16_bits_to_f32(uint16_t h) { return bits_to_f32(static_cast<uint32_t>(h) << 16); }

// Software IEEE fp32 -> fp16, round to nearest even, subnormals kept; NaN -> quiet NaN (0x7E00).
// The scalar ISA uses it; the F16C ISAs use vcvtps2ph, which rounds identically.
static inline uint16_t f32_to_f16_bits_sw(float f) {
  uint32_t x = f32_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7FFFFFFFu;
  if (x > 0x7F800000u) return sign | 0x7E00;       // NaN
  if (x >= 0x477FF000u) return sign | 0x7C00;      // rounds to (or is) infinity: >= 65520
  if (x >= 0x38800000u) {                           // normal half (>= 2^-14)
    const uint32_t r = x + 0xFFFu + ((x >> 13) & 1u);
    return static_cast<uint16_t>(sign | ((r - 0x38000000u) >> 13));
  }
  if (x <= 0x33000000u) return sign;               // <= 2^-25 rounds to zero (the tie is even)
  // Subnormal half: the value in units of 2^-24 is mant * 2^(e - 126), e in [102, 112].
  const uint32_t mant = (x & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126u - (x >> 23);         // 14..24
  uint32_t q = mant >> shift;
  const uint32_t rem = mant & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u))) ++q;  // may carry into the smallest normal: fine
  return static_cast<uint16_t>(sign | q);
}

static inline float f16_bits_to_f32_sw(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu;
  const uint32_t m = h & 0x3FFu;
  if (e == 0x1Fu) return bits_to_f32(sign | 0x7F800000u | (m << 13));
  if (e == 0) {
    const float mag = static_cast<float>(m) * 5.9604644775390625e-08f;  // m * 2^-24, exact
    return bits_to_f32(sign | f32_to_bits(mag));
  }
  return bits_to_f32(sign | ((e + 112u) << 23) | (m << 13));
}

