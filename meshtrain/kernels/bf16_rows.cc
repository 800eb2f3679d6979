// y[m, n] = sum_k x[m, k] * wt[n, k]: a matmul of a few f32 rows by a bf16 weight stored (out, in), for decoding on
// CPU. Why: XLA:CPU has no bf16 matmul: it converts a bf16 weight to an f32 copy and multiplies that (reading
// 2 + writing 4 + reading 4 bytes per weight), and a matmul over the (in, out) layout with few rows reads the
// weight in strided pieces. Here every output row reads its own contiguous bf16 row once, so a decode step reads
// 2 bytes per weight. Accumulation is in f32 (bf16 -> f32 is exact), as XLA's converted dot; only the order of
// the sum differs. Built by meshtrain/kernels/bf16_rows.py with the host's compiler; called through XLA's FFI.
#include <cstdint>
#include <cstring>
#include <latch>
#include "xla/ffi/api/ffi.h"
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define MESHTRAIN_DPBF16 1
#endif
#ifndef MESHTRAIN_SPLIT_MIN
#define MESHTRAIN_SPLIT_MIN (int64_t(1) << 18)
#endif
namespace ffi = xla::ffi;

static inline float bf16_to_f32(uint16_t v) {
  uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// output rows n0 .. n1-1: each reads its contiguous bf16 row once per input row (the row stays in L1 across the
// M input rows); the compiler vectorises the inner sum (-O3 -fopenmp-simd: bf16 -> f32 is a widen and a shift)
static void rows(const float* x, const uint16_t* wt, float* y, int64_t M, int64_t K, int64_t N, int64_t n0,
                 int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* row = wt + n * K;
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * K;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t k = 0; k < K; ++k) s += xm[k] * bf16_to_f32(row[k]);
      y[m * N + n] = s;
    }
  }
}

// the same with bf16 activations (a bf16 model's residual stream): products of two bf16 are exact in f32, summed in
// f32 pairs by AVX512-BF16's vdpbf16ps (one instruction per 32 weights) where the CPU has it
static void rows_bf16(const uint16_t* x, const uint16_t* wt, float* y, int64_t M, int64_t K, int64_t N, int64_t n0,
                      int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* row = wt + n * K;
    for (int64_t m = 0; m < M; ++m) {
      const uint16_t* xm = x + m * K;
#ifdef MESHTRAIN_DPBF16
      __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
      int64_t k = 0;
      for (; k + 64 <= K; k += 64) {
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(row + k), (__m512bh)_mm512_loadu_si512(xm + k));
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(row + k + 32),
                              (__m512bh)_mm512_loadu_si512(xm + k + 32));
      }
      for (; k < K; k += 32) {
        __mmask32 mask = K - k >= 32 ? __mmask32(0xFFFFFFFFu) : __mmask32((1u << (K - k)) - 1);
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_maskz_loadu_epi16(mask, row + k),
                              (__m512bh)_mm512_maskz_loadu_epi16(mask, xm + k));
      }
      y[m * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
#else
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t k = 0; k < K; ++k) s += bf16_to_f32(xm[k]) * bf16_to_f32(row[k]);
      y[m * N + n] = s;
#endif
    }
  }
}

template <typename X, typename Rows>
static ffi::Error run(ffi::ThreadPool& pool, const X* xp, int64_t x_count, ffi::Buffer<ffi::BF16>& wt, float* yp,
                      Rows body) {
  auto dims = wt.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("bf16_rows: the weight must be 2-D (out, in)");
  const int64_t N = dims[0], K = dims[1];
  if (K == 0 || x_count % K) return ffi::Error::InvalidArgument("bf16_rows: x's last dim must equal K");
  const int64_t M = x_count / K;
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(wt.typed_data());
  // split the output rows over XLA's intra-op threads when the weight is large enough to pay for the hand-off
  int64_t parts = 1 + pool.num_threads();
  if (N * K < MESHTRAIN_SPLIT_MIN || parts < 2) {
    body(xp, wp, yp, M, K, N, 0, N);
    return ffi::Error::Success();
  }
  if (parts > 8) parts = 8;
  const int64_t chunk = (N + parts - 1) / parts;
  std::latch done(parts - 1);
  for (int64_t p = 1; p < parts; ++p) {
    int64_t n0 = p * chunk < N ? p * chunk : N, n1 = (p + 1) * chunk < N ? (p + 1) * chunk : N;
    pool.Schedule([=, &done] { body(xp, wp, yp, M, K, N, n0, n1); done.count_down(); });
  }
  body(xp, wp, yp, M, K, N, 0, chunk < N ? chunk : N);
  done.wait();
  return ffi::Error::Success();
}

static ffi::Error Bf16RowsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> wt,
                               ffi::ResultBuffer<ffi::F32> y) {
  return run(pool, x.typed_data(), x.element_count(), wt, y->typed_data(), rows);
}

static ffi::Error Bf16RowsBf16Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> wt,
                                   ffi::ResultBuffer<ffi::F32> y) {
  return run(pool, reinterpret_cast<const uint16_t*>(x.typed_data()), x.element_count(), wt, y->typed_data(),
             rows_bf16);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshtrainBf16Rows, Bf16RowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshtrainBf16RowsBf16, Bf16RowsBf16Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
