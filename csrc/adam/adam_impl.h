// The fused Adam kernel, written once over an "ops" type and instantiated per ISA.
//
// Included (no include guard, on purpose) by adam_avx512.cpp, adam_avx2.cpp and adam_scalar.cpp
// inside each file's own namespace and after its `#pragma GCC target`, so every function here
// is compiled for that file's instruction set only. Each includer defines two ops types first:
//   V: the vector (W lanes) and S: one element (W == 1), used for heads and tails.
// Both provide set1/add/sub/mul/div/sqrt/fma(a,b,c)=a*b+c, load/store/stream for float, bf16_t
// and f16_t, fence(), and a double accumulator D with dzero/dacc_sq/dadd/dsum.
//
// Note: every ISA runs the same sequence of IEEE operations per element (mul, fma, sqrt, div;
// no reciprocal estimates, fp-contract off), so the AVX-512, AVX2 and scalar variants, and any
// split of the work over threads, give bit-identical params and moments. Tests rely on it.
//
// Note: the math. With g = grad * grad_mult (clip_coef / grad_scale):
//   Adam (L2):  g += weight_decay * p        AdamW:  p *= 1 - lr * weight_decay
//   m = m + (1 - beta1) * (g - m)            (torch's lerp form)
//   v = beta2 * v + (1 - beta2) * g * g
//   p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// which is torch.optim.Adam/AdamW's single-tensor algorithm, with 1/sqrt(bc2) multiplied in
// rather than divided (one rounding of difference, far below the 1e-6 bar).

// ---- the fused Adam update ----

template <class O>
struct Consts {
  typename O::F beta2, omb1, omb2, eps, mult, decay, l2, inv_sqrt_bc2, neg_step;
  explicit Consts(const StepConsts& c)
      : beta2(O::set1(c.beta2)),
        omb1(O::set1(c.one_minus_beta1)),
        omb2(O::set1(c.one_minus_beta2)),
        eps(O::set1(c.eps)),
        mult(O::set1(c.grad_mult)),
        decay(O::set1(c.decay)),
        l2(O::set1(c.l2)),
        inv_sqrt_bc2(O::set1(c.inv_sqrt_bc2)),
        neg_step(O::set1(c.neg_step_size)) {}
};

// U vectors (U * O::W elements) per call. All loads of the block are issued before any store:
// torch allocates every large tensor at the same offset within a page, so p[i], g[i], m[i] and
// v[i] share their low 12 address bits, and a load issued behind a store to another stream at
// the same page offset can wait on a false (4K-alias) dependency. Blocking also keeps more
// cache-line misses in flight per thread. Measured on the dev machine (2-core EPYC): never
// slower than one vector at a time, and up to 1.2x faster in some buffer layouts.
template <class O, int U, bool kStream, class P, class G, class St, class Out>
__attribute__((always_inline)) inline void adam_block(P* p, const G* g, St* m, St* v, Out* o,
                                                      const Consts<O>& k, bool use_l2) {
  constexpr size_t W = O::W;
  typename O::F gv[U], pv[U], mv[U], vv[U];
  for (int u = 0; u < U; ++u) gv[u] = O::load(g + u * W);
  for (int u = 0; u < U; ++u) pv[u] = O::load(p + u * W);
  for (int u = 0; u < U; ++u) mv[u] = O::load(m + u * W);
  for (int u = 0; u < U; ++u) vv[u] = O::load(v + u * W);
  for (int u = 0; u < U; ++u) {
    gv[u] = O::mul(gv[u], k.mult);
    if (use_l2) gv[u] = O::fma(pv[u], k.l2, gv[u]);
    pv[u] = O::mul(pv[u], k.decay);
    mv[u] = O::fma(k.omb1, O::sub(gv[u], mv[u]), mv[u]);
    vv[u] = O::fma(k.omb2, O::mul(gv[u], gv[u]), O::mul(vv[u], k.beta2));
    const auto denom = O::fma(O::sqrt(vv[u]), k.inv_sqrt_bc2, k.eps);
    pv[u] = O::fma(k.neg_step, O::div(mv[u], denom), pv[u]);
  }
  for (int u = 0; u < U; ++u) O::store(p + u * W, pv[u]);
  for (int u = 0; u < U; ++u) O::store(m + u * W, mv[u]);
  for (int u = 0; u < U; ++u) O::store(v + u * W, vv[u]);
  if constexpr (!std::is_same<Out, NoOut>::value) {
    // The copy is the updated fp32 value rounded once to its type (for 16-bit params of the
    // same type: exactly the stored param).
    for (int u = 0; u < U; ++u) {
      if constexpr (kStream) {
        O::stream(o + u * W, pv[u]);
      } else {
        O::store(o + u * W, pv[u]);
      }
    }
  }
}

// kCrc: the _crc kernel (see the CRC Note in adam_kernel.h); crc_raw is the includer's raw
// CRC-32C register update (the crc32 instruction, or a table in the scalar file).
template <class P, class G, class St, class Out, bool kCrc>
void adam_range_impl(const Segment& s, size_t begin, size_t end, const StepConsts& c, unsigned mask, uint32_t* crc) {
  P* p = static_cast<P*>(s.param);
  const G* g = static_cast<const G*>(s.grad);
  St* m = static_cast<St*>(s.exp_avg);
  St* v = static_cast<St*>(s.exp_avg_sq);
  Out* o = static_cast<Out*>(s.half_out);
  const Consts<V> kv(c);
  const Consts<S> ks(c);
  const bool l2 = c.use_l2;
  constexpr int U = V::kUnroll;
  constexpr size_t B = U * V::W;  // elements per block
  uint32_t r[kCrcStreams] = {~0u, ~0u, ~0u, ~0u, ~0u};
  // The streams the mask names, walked side by side where they have the same length (the
  // Note in adam_crc_hw.h); a lone stream, or params of another width, on its own.
  uint32_t* in_regs[2];
  int n_in = 0;
  for (unsigned k = kCrcExpAvgIn; k <= kCrcExpAvgSqIn; ++k)
    if (mask & (1u << k)) in_regs[n_in++] = &r[k];
  uint32_t* out_regs[3];
  int n_out = 0;
  const bool p_apart = (mask & (1u << kCrcParamOut)) && sizeof(P) != sizeof(St);
  for (unsigned k = kCrcParamOut; k <= kCrcExpAvgSqOut; ++k)
    if ((mask & (1u << k)) && !(k == kCrcParamOut && p_apart)) out_regs[n_out++] = &r[k];
  // Folding (adam_avx512.cpp, the folding Note): whole blocks of fp32 streams, where allowed.
  const bool fold = V::kFold && (mask & (1u << kCrcFold)) && sizeof(St) == 4 && B * sizeof(St) == 256;
  const bool fold_p = fold && sizeof(P) == 4;
  const uint64_t* fk = fold ? crc_fold_constants() : nullptr;
  typename V::FoldAcc fa[kCrcStreams] = {};
  auto flush = [&]() {
    if constexpr (kCrc) {
      for (unsigned s = 0; s < kCrcStreams; ++s) V::fold_flush(fa[s], r[s]);
    }
  };
  auto fold_one = [&](unsigned s, const void* p_) {
    if (mask & (1u << s)) V::fold_block(fa[s], r[s], p_, fk);
  };
  auto in = [&](size_t i, size_t k) {
    if constexpr (kCrc) {
      if (fold && k == B) {
        fold_one(kCrcExpAvgIn, m + i);
        fold_one(kCrcExpAvgSqIn, v + i);
        return;
      }
      flush();
      const void* src[2] = {};
      int j = 0;
      if (mask & (1u << kCrcExpAvgIn)) src[j++] = m + i;
      if (mask & (1u << kCrcExpAvgSqIn)) src[j++] = v + i;
      if (n_in == 2) crc_raw_n<2>(in_regs, src, k * sizeof(St));
      if (n_in == 1) crc_raw_n<1>(in_regs, src, k * sizeof(St));
    }
  };
  auto out = [&](size_t i, size_t k) {
    if constexpr (kCrc) {
      if (fold && k == B) {
        if (fold_p) fold_one(kCrcParamOut, p + i);
        else if (mask & (1u << kCrcParamOut)) r[kCrcParamOut] = crc_raw(r[kCrcParamOut], p + i, k * sizeof(P));
        fold_one(kCrcExpAvgOut, m + i);
        fold_one(kCrcExpAvgSqOut, v + i);
        return;
      }
      flush();
      const void* src[3] = {};
      int j = 0;
      if ((mask & (1u << kCrcParamOut)) && !p_apart) src[j++] = p + i;
      if (mask & (1u << kCrcExpAvgOut)) src[j++] = m + i;
      if (mask & (1u << kCrcExpAvgSqOut)) src[j++] = v + i;
      if (n_out == 3) crc_raw_n<3>(out_regs, src, k * sizeof(St));
      if (n_out == 2) crc_raw_n<2>(out_regs, src, k * sizeof(St));
      if (n_out == 1) crc_raw_n<1>(out_regs, src, k * sizeof(St));
      if (p_apart) r[kCrcParamOut] = crc_raw(r[kCrcParamOut], p + i, k * sizeof(P));
    }
  };
  size_t i = begin;
  bool done = false;
  if constexpr (!std::is_same<Out, NoOut>::value) {
    if (c.stream_out && V::W > 1) {
      // Non-temporal stores want whole, aligned cache lines of the copy: align `o + i` to 64 B
      // element by element; a block then writes whole lines (B * 2 bytes, a multiple of 64).
      for (; i < end && (reinterpret_cast<uintptr_t>(o + i) & 63u) != 0; ++i) {
        in(i, 1);
        adam_block<S, 1, false>(p + i, g + i, m + i, v + i, o + i, ks, l2);
        out(i, 1);
      }
      for (; i + B <= end; i += B) {
        in(i, B);
        adam_block<V, U, true>(p + i, g + i, m + i, v + i, o + i, kv, l2);
        out(i, B);
      }
      for (; i < end; ++i) {
        in(i, 1);
        adam_block<S, 1, false>(p + i, g + i, m + i, v + i, o + i, ks, l2);
        out(i, 1);
      }
      V::fence();
      done = true;
    }
  }
  if (!done) {
    for (; i + B <= end; i += B) {
      in(i, B);
      adam_block<V, U, false>(p + i, g + i, m + i, v + i, o + i, kv, l2);
      out(i, B);
    }
    for (; i + V::W <= end; i += V::W) {
      in(i, V::W);
      adam_block<V, 1, false>(p + i, g + i, m + i, v + i, o + i, kv, l2);
      out(i, V::W);
    }
    for (; i < end; ++i) {
      in(i, 1);
      adam_block<S, 1, false>(p + i, g + i, m + i, v + i, o + i, ks, l2);
      out(i, 1);
    }
  }
  if constexpr (kCrc) {
    flush();
    for (unsigned k = 0; k < kCrcStreams; ++k) crc[k] = ~r[k];
  }
}

template <class P, class G, class St, class Out>
void adam_range(const Segment& s, size_t begin, size_t end, const StepConsts& c) {
  adam_range_impl<P, G, St, Out, false>(s, begin, end, c, 0u, nullptr);
}

template <class P, class G, class St, class Out>
void adam_range_crc(const Segment& s, size_t begin, size_t end, const StepConsts& c, unsigned mask, uint32_t* crc) {
  adam_range_impl<P, G, St, Out, true>(s, begin, end, c, mask, crc);
}

// ---- finiteness, squared norm, conversion, bandwidth floor ----

// The read-only kernels walk four quarters of their range side by side: four streams per
// thread keep as many cache-line fills in flight as the Adam kernel's p/g/m/v (one stream alone
// reads at about half the bandwidth here).

// x * 0 is 0 for finite x and NaN for inf/NaN, so one add per vector accumulates the verdict.
template <class G>
bool finite_range(const void* gp, size_t begin, size_t end, float mult) {
  const G* g = static_cast<const G*>(gp) + begin;
  const size_t n = end - begin;
  constexpr size_t W = V::W;
  const size_t q = n / 4 / W * W;
  const auto mv = V::set1(mult);
  const auto zero = V::set1(0.0f);
  auto a0 = zero, a1 = zero, a2 = zero, a3 = zero;
  for (size_t i = 0; i < q; i += W) {
    a0 = V::add(a0, V::mul(V::mul(V::load(g + i), mv), zero));
    a1 = V::add(a1, V::mul(V::mul(V::load(g + q + i), mv), zero));
    a2 = V::add(a2, V::mul(V::mul(V::load(g + 2 * q + i), mv), zero));
    a3 = V::add(a3, V::mul(V::mul(V::load(g + 3 * q + i), mv), zero));
  }
  size_t i = 4 * q;
  for (; i + W <= n; i += W) a0 = V::add(a0, V::mul(V::mul(V::load(g + i), mv), zero));
  float tail = 0.0f;
  for (; i < n; ++i) tail = tail + S::load(g + i) * mult * 0.0f;
  const float sum = V::hsum(V::add(V::add(a0, a1), V::add(a2, a3))) + tail;
  return sum == sum;
}

template <class T>
double sqnorm_range(const void* xp, size_t begin, size_t end) {
  const T* x = static_cast<const T*>(xp) + begin;
  const size_t n = end - begin;
  constexpr size_t W = V::W;
  const size_t q = n / 4 / W * W;
  auto a0 = V::dzero(), a1 = V::dzero(), a2 = V::dzero(), a3 = V::dzero();
  for (size_t i = 0; i < q; i += W) {
    a0 = V::dacc_sq(a0, V::load(x + i));
    a1 = V::dacc_sq(a1, V::load(x + q + i));
    a2 = V::dacc_sq(a2, V::load(x + 2 * q + i));
    a3 = V::dacc_sq(a3, V::load(x + 3 * q + i));
  }
  size_t i = 4 * q;
  for (; i + W <= n; i += W) a0 = V::dacc_sq(a0, V::load(x + i));
  double sum = V::dsum(V::dadd(V::dadd(a0, a1), V::dadd(a2, a3)));
  for (; i < n; ++i) {
    const double e = static_cast<double>(S::load(x + i));
    sum += e * e;
  }
  return sum;
}

template <class Src, class Dst>
void convert_range(const void* sp, void* dp, size_t begin, size_t end) {
  const Src* s = static_cast<const Src*>(sp);
  Dst* d = static_cast<Dst*>(dp);
  constexpr size_t W = V::W;
  size_t i = begin;
  for (; i + W <= end; i += W) V::store(d + i, V::load(s + i));
  for (; i < end; ++i) S::store(d + i, S::load(s + i));
}

// Note: why one pass in a fixed order. A vertical window's gradient sums (runtime/window_grads.py)
// read each micro-batch's 16-bit gradient once and write the rounded sum once: 2k + 2 bytes an
// element, where adding each into an fp32 sum as it arrives moves about 10 a gradient. Adding
// in the sources' order, one rounding to fp32 per add, gives the sequential sum's bits on every
// ISA (the lanes are independent elements, never a tree over the sources).
template <class Src, class Dst>
void sum_range(const void* const* sp, size_t k, void* dp, size_t begin, size_t end) {
  const Src* const* s = reinterpret_cast<const Src* const*>(sp);
  Dst* d = static_cast<Dst*>(dp);
  constexpr size_t W = V::W;
  size_t i = begin;
  for (; i + 2 * W <= end; i += 2 * W) {
    auto a0 = V::load(s[0] + i), a1 = V::load(s[0] + i + W);
    for (size_t j = 1; j < k; ++j) {
      a0 = V::add(a0, V::load(s[j] + i));
      a1 = V::add(a1, V::load(s[j] + i + W));
    }
    V::store(d + i, a0);
    V::store(d + i + W, a1);
  }
  for (; i < end; ++i) {
    float a = S::load(s[0] + i);
    for (size_t j = 1; j < k; ++j) a = S::add(a, S::load(s[j] + i));
    S::store(d + i, a);
  }
}

// Same loads and stores as adam_range<float, float, float, Out> (same blocking), arithmetic
// reduced to one add.
template <bool kOut, bool kStream>
void floor_impl(const Segment& s, size_t begin, size_t end) {
  float* p = static_cast<float*>(s.param);
  const float* g = static_cast<const float*>(s.grad);
  float* m = static_cast<float*>(s.exp_avg);
  float* v = static_cast<float*>(s.exp_avg_sq);
  bf16_t* o = static_cast<bf16_t*>(s.half_out);
  const auto zero = V::set1(0.0f);
  constexpr int U = V::kUnroll;
  constexpr size_t W = V::W, B = U * W;
  auto one = [&](size_t j) {
    const float d = g[j] * 0.0f;
    p[j] += d;
    m[j] += d;
    v[j] += d;
    if (kOut) S::store(o + j, p[j]);
  };
  size_t i = begin;
  if (kStream) {
    for (; i < end && (reinterpret_cast<uintptr_t>(o + i) & 63u) != 0; ++i) one(i);
  }
  for (; i + B <= end; i += B) {
    typename V::F gv[U], pv[U], mv[U], vv[U];
    for (int u = 0; u < U; ++u) gv[u] = V::mul(V::load(g + i + u * W), zero);
    for (int u = 0; u < U; ++u) pv[u] = V::load(p + i + u * W);
    for (int u = 0; u < U; ++u) mv[u] = V::load(m + i + u * W);
    for (int u = 0; u < U; ++u) vv[u] = V::load(v + i + u * W);
    for (int u = 0; u < U; ++u) V::store(p + i + u * W, V::add(pv[u], gv[u]));
    for (int u = 0; u < U; ++u) V::store(m + i + u * W, V::add(mv[u], gv[u]));
    for (int u = 0; u < U; ++u) V::store(v + i + u * W, V::add(vv[u], gv[u]));
    if (kOut) {
      for (int u = 0; u < U; ++u) {
        if (kStream) {
          V::stream(o + i + u * W, V::add(pv[u], gv[u]));
        } else {
          V::store(o + i + u * W, V::add(pv[u], gv[u]));
        }
      }
    }
  }
  for (; i < end; ++i) one(i);
  if (kStream) V::fence();
}

static void floor_range(const Segment& s, size_t begin, size_t end, bool stream_out) {
  if (s.half_out == nullptr) return floor_impl<false, false>(s, begin, end);
  if (stream_out && V::W > 1) return floor_impl<true, true>(s, begin, end);
  floor_impl<true, false>(s, begin, end);
}

// ---- lookup tables ----

template <bool kCrc>
using RangeFn = typename std::conditional<kCrc, AdamCrcRangeFn, AdamRangeFn>::type;

template <bool kCrc, class P, class G, class St, class Out>
RangeFn<kCrc> range_fn() {
  if constexpr (kCrc) {
    return &adam_range_crc<P, G, St, Out>;
  } else {
    return &adam_range<P, G, St, Out>;
  }
}

template <bool kCrc, class P, class G, class St>
RangeFn<kCrc> pick_out(DType out) {
  switch (out) {
    case DType::kNone: return range_fn<kCrc, P, G, St, NoOut>();
    case DType::kBF16: return range_fn<kCrc, P, G, St, bf16_t>();
    case DType::kF16: return range_fn<kCrc, P, G, St, f16_t>();
    default: return nullptr;
  }
}

template <bool kCrc, class P, class G>
RangeFn<kCrc> pick_state(DType state, DType out) {
  if (state == DType::kF32) return pick_out<kCrc, P, G, float>(out);
  // Moments in the params' own 16-bit type (DeepSpeed's fp32_optimizer_states=False); no copy.
  if (out != DType::kNone) return nullptr;
  if (state == DType::kBF16 && std::is_same<P, bf16_t>::value) return range_fn<kCrc, P, G, P, NoOut>();
  if (state == DType::kF16 && std::is_same<P, f16_t>::value) return range_fn<kCrc, P, G, P, NoOut>();
  return nullptr;
}

template <bool kCrc, class P>
RangeFn<kCrc> pick_grad(const Types& t) {
  switch (t.grad) {
    case DType::kF32: return pick_state<kCrc, P, float>(t.state, t.out);
    case DType::kBF16: return pick_state<kCrc, P, bf16_t>(t.state, t.out);
    case DType::kF16: return pick_state<kCrc, P, f16_t>(t.state, t.out);
    default: return nullptr;
  }
}

template <bool kCrc>
RangeFn<kCrc> lookup_range(const Types& t) {
  switch (t.param) {
    case DType::kF32: return pick_grad<kCrc, float>(t);
    case DType::kBF16: return pick_grad<kCrc, bf16_t>(t);
    case DType::kF16: return pick_grad<kCrc, f16_t>(t);
    default: return nullptr;
  }
}

static AdamRangeFn lookup_adam(const Types& t) { return lookup_range<false>(t); }
static AdamCrcRangeFn lookup_adam_crc(const Types& t) { return lookup_range<true>(t); }

static FiniteRangeFn lookup_finite(DType g) {
  switch (g) {
    case DType::kF32: return &finite_range<float>;
    case DType::kBF16: return &finite_range<bf16_t>;
    case DType::kF16: return &finite_range<f16_t>;
    default: return nullptr;
  }
}

static SqNormRangeFn lookup_sqnorm(DType x) {
  switch (x) {
    case DType::kF32: return &sqnorm_range<float>;
    case DType::kBF16: return &sqnorm_range<bf16_t>;
    case DType::kF16: return &sqnorm_range<f16_t>;
    default: return nullptr;
  }
}

template <class Src>
ConvertRangeFn pick_convert_dst(DType dst) {
  switch (dst) {
    case DType::kF32: return &convert_range<Src, float>;
    case DType::kBF16: return &convert_range<Src, bf16_t>;
    case DType::kF16: return &convert_range<Src, f16_t>;
    default: return nullptr;
  }
}

static ConvertRangeFn lookup_convert(DType src, DType dst) {
  switch (src) {
    case DType::kF32: return pick_convert_dst<float>(dst);
    case DType::kBF16: return pick_convert_dst<bf16_t>(dst);
    case DType::kF16: return pick_convert_dst<f16_t>(dst);
    default: return nullptr;
  }
}

template <class Src>
SumRangeFn pick_sum_dst(DType dst) {
  switch (dst) {
    case DType::kF32: return &sum_range<Src, float>;
    case DType::kBF16: return &sum_range<Src, bf16_t>;
    case DType::kF16: return &sum_range<Src, f16_t>;
    default: return nullptr;
  }
}

static SumRangeFn lookup_sum(DType src, DType dst) {
  switch (src) {
    case DType::kF32: return pick_sum_dst<float>(dst);
    case DType::kBF16: return pick_sum_dst<bf16_t>(dst);
    case DType::kF16: return pick_sum_dst<f16_t>(dst);
    default: return nullptr;
  }
}
