// One-element ops `S` for adam_impl.h: the scalar ISA's whole kernel, and every other ISA's
// heads and tails. Included (no include guard, on purpose) inside an ISA file's namespace after
// its `#pragma GCC target`; define OFFLOADPP_ADAM_F16C before including where F16C is enabled.
//
// fma is a true fused multiply-add (__builtin_fmaf: one instruction where FMA is enabled, glibc's
// correctly rounded fmaf otherwise), so the tails round exactly like the vector lanes.

struct S {
  using F = float;
  using D = double;
  static constexpr size_t W = 1;
  static constexpr int kUnroll = 1;
  static F set1(float x) { return x; }
  static F add(F a, F b) { return a + b; }
  static F sub(F a, F b) { return a - b; }
  static F mul(F a, F b) { return a * b; }
  static F div(F a, F b) { return a / b; }
  static F sqrt(F a) { return __builtin_sqrtf(a); }
  static F fma(F a, F b, F c) { return __builtin_fmaf(a, b, c); }
  static F hsum(F a) { return a; }

  static F load(const float* p) { return *p; }
  static F load(const bf16_t* p) { return bf16_bits_to_f32(p->bits); }
  static void store(float* p, F x) { *p = x; }
  static void store(bf16_t* p, F x) { p->bits = f32_to_bf16_bits(x); }
#ifdef OFFLOADPP_ADAM_F16C
  static F load(const f16_t* p) { return _cvtsh_ss(p->bits); }
  static void store(f16_t* p, F x) {
    p->bits = static_cast<uint16_t>(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
#else
  static F load(const f16_t* p) { return f16_bits_to_f32_sw(p->bits); }
  static void store(f16_t* p, F x) { p->bits = f32_to_f16_bits_sw(x); }
#endif
  template <class T>
  static void stream(T* p, F x) {
    store(p, x);
  }
  static void fence() {}
  // No CRC folding here (adam_avx512.cpp has it): the _crc kernels use crc_raw alone.
  static constexpr bool kFold = false;
  struct FoldAcc {
    bool on = false;
  };
  static void fold_block(FoldAcc&, uint32_t&, const void*, const uint64_t*) {}
  static void fold_flush(FoldAcc&, uint32_t&) {}

  static D dzero() { return 0.0; }
  static D dacc_sq(D acc, F x) {
    const double e = x;
    return __builtin_fma(e, e, acc);
  }
  static D dadd(D a, D b) { return a + b; }
  static double dsum(D a) { return a; }
};
