// One decode step of a small Llama-shaped decoder in one call: the token's embedding row, every layer (RMSNorm,
// q/k/v projections, rotary embedding, the new key and value written into the layer's cache, grouped-query
// attention over the cache, the output projection, RMSNorm, the gated MLP) and the final norm and head, for a few
// rows of one new token each. Why: at tiny sizes (d_model 64, 2 layers) XLA:CPU's decode loop runs ~81 kernels per
// step, each a thunk of ~0.2-0.4 us whatever its size; the arithmetic of the whole step is a few microseconds on
// weights that sit in L2. Here it is one call. The arithmetic is the model's (meshtrain/models/decoder.py:
// `Block.cached`, `cache_attention`, `rope`, `RMSNorm`) in f32; only the order of sums differs from XLA's.
// Built by meshtrain/kernels/decode_step.py with the host's compiler; called through XLA's FFI.
//
// Arguments: tokens (B,) s32, index () s32 (the slot the token goes to), pad (B,) s32 (each row's left padding),
// inv_freq (H/2,) f32, embedding (V, D), final norm (D,), head (D, V) (tied: the embedding (V, D)), then per
// layer 9 weights: attn norm (D,), wq (D, N*H), wk (D, K*H), wv (D, K*H), wo (N*H, D), mlp norm (D,),
// gate (D, F), up (D, F), down (F, D); then per layer the key and value caches (B, S, K, H).
// Results: logits (B, V) f32, the greedy token (B,) s32 and its log-probability (B,) f32, then the 2L caches
// (aliased to the inputs: only slot `index` is written).
// Weights are all f32 or all bf16 (read as stored, widened exactly to f32).
#include <atomic>
#include <bit>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>
#include <unistd.h>
#include "xla/ffi/api/ffi.h"
namespace ffi = xla::ffi;

namespace {

inline float widen(float v) { return v; }
inline float widen(uint16_t v) { return std::bit_cast<float>(uint32_t(v) << 16); }

// f32 -> the nearest bf16 (ties to even), as XLA's convert; bf16_bits: its 16 bits, to_bf16: widened back
inline uint16_t bf16_bits(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
inline float to_bf16(float f) {  // (the same without the 16-bit trip: vectorises)
  const uint32_t u = std::bit_cast<uint32_t>(f);
  return std::bit_cast<float>((u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u);
}

// a bf16 model's activations are bf16 where the XLA step's are (R: the weights are bf16): every projection's
// output, the norms', the rotary embedding's, the residual stream, the attention's probabilities and output
template <bool R>
inline void round_all(float* x, int64_t n) {
  if constexpr (R) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) x[i] = to_bf16(x[i]);
  }
}
// x += a; a bf16 model adds the two rounded in f32 and keeps the sum unrounded for the norm that reads it next (XLA
// elides that convert: excess precision), rounding it where the next add reads it
template <bool R>
inline void residual(float* x, const float* a, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] = R ? to_bf16(x[i]) + to_bf16(a[i]) : x[i] + a[i];
}
inline void store(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void store(uint16_t* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_bits(src[i]);
}

// y[o0 .. o0+BLK) = sum_k x[k] * w[k, o] for w stored (in, out) row-major: BLK outputs stay in registers over the
// whole sum (adding into y in memory made every step wait on its own store: 4x slower), the inner loop one
// contiguous piece of a row
template <int BLK, typename W>
inline void matvec_block(const float* x, const W* w, float* y, int64_t in, int64_t out, int64_t o0) {
  float acc[BLK];
  for (int j = 0; j < BLK; ++j) acc[j] = 0.f;
  for (int64_t k = 0; k < in; ++k) {
    const float xk = x[k];
    const W* row = w + k * out + o0;
#pragma omp simd
    for (int j = 0; j < BLK; ++j) acc[j] += xk * widen(row[j]);
  }
  for (int j = 0; j < BLK; ++j) y[o0 + j] = acc[j];
}

// the same over a weight read from memory (a larger model): row by row, four rows at once, each row's share one
// contiguous stream; the share of y (a few KB) stays in L1. The register blocks above read 64 outputs' worth of
// every row in turn, a strided walk the prefetcher does not follow: ~8 GB/s from memory against ~15 for this
template <typename W>
void matvec_stream(const float* x, const W* w, float* y, int64_t in, int64_t out, int64_t o_lo, int64_t o_hi) {
  float* yo = y + o_lo;
  const int64_t n = o_hi - o_lo;
  for (int64_t j = 0; j < n; ++j) yo[j] = 0.f;
  int64_t k = 0;
  for (; k + 4 <= in; k += 4) {
    const float x0 = x[k], x1 = x[k + 1], x2 = x[k + 2], x3 = x[k + 3];
    const W *r0 = w + k * out + o_lo, *r1 = r0 + out, *r2 = r1 + out, *r3 = r2 + out;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j)
      yo[j] += (x0 * widen(r0[j]) + x1 * widen(r1[j])) + (x2 * widen(r2[j]) + x3 * widen(r3[j]));
  }
  for (; k < in; ++k) {
    const float xk = x[k];
    const W* r = w + k * out + o_lo;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) yo[j] += xk * widen(r[j]);
  }
}

// y[o] = sum_k x[k] * wt[o, k] for o in o_lo .. o_hi-1, the weight stored (out, in) (a larger model, the engine's
// row layout): a member's outputs are one contiguous block of the weight, read eight rows at once (7 % faster
// than four on llama-114m's shapes, 2 threads: fewer passes over x, longer runs of independent sums)
template <typename W>
void matvec_rows(const float* x, const W* wt, float* y, int64_t in, int64_t o_lo, int64_t o_hi) {
  int64_t o = o_lo;
  for (; o + 8 <= o_hi; o += 8) {
    const W *r0 = wt + o * in, *r1 = r0 + in, *r2 = r1 + in, *r3 = r2 + in, *r4 = r3 + in, *r5 = r4 + in,
            *r6 = r5 + in, *r7 = r6 + in;
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f, s4 = 0.f, s5 = 0.f, s6 = 0.f, s7 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3, s4, s5, s6, s7)
    for (int64_t k = 0; k < in; ++k) {
      const float xk = x[k];
      s0 += xk * widen(r0[k]);
      s1 += xk * widen(r1[k]);
      s2 += xk * widen(r2[k]);
      s3 += xk * widen(r3[k]);
      s4 += xk * widen(r4[k]);
      s5 += xk * widen(r5[k]);
      s6 += xk * widen(r6[k]);
      s7 += xk * widen(r7[k]);
    }
    y[o] = s0;
    y[o + 1] = s1;
    y[o + 2] = s2;
    y[o + 3] = s3;
    y[o + 4] = s4;
    y[o + 5] = s5;
    y[o + 6] = s6;
    y[o + 7] = s7;
  }
  for (; o + 4 <= o_hi; o += 4) {
    const W *r0 = wt + o * in, *r1 = r0 + in, *r2 = r1 + in, *r3 = r2 + in;
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t k = 0; k < in; ++k) {
      const float xk = x[k];
      s0 += xk * widen(r0[k]);
      s1 += xk * widen(r1[k]);
      s2 += xk * widen(r2[k]);
      s3 += xk * widen(r3[k]);
    }
    y[o] = s0;
    y[o + 1] = s1;
    y[o + 2] = s2;
    y[o + 3] = s3;
  }
  for (; o < o_hi; ++o) {
    const W* r = wt + o * in;
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t k = 0; k < in; ++k) acc += x[k] * widen(r[k]);
    y[o] = acc;
  }
}

//: a weight of at least this many elements is read by matvec_stream (it does not fit in L2: 1 MiB here)
constexpr int64_t STREAM_MIN = int64_t(1) << 17;

// outputs o_lo .. o_hi-1 (a team member's share; each output's sum runs in the same order whatever the share)
template <typename W>
void matvec(const float* x, const W* w, float* y, int64_t in, int64_t out, int64_t o_lo, int64_t o_hi) {
  if (in * out >= STREAM_MIN) return matvec_stream(x, w, y, in, out, o_lo, o_hi);
  int64_t o = o_lo;
  for (; o + 64 <= o_hi; o += 64) matvec_block<64>(x, w, y, in, out, o);
  for (; o + 16 <= o_hi; o += 16) matvec_block<16>(x, w, y, in, out, o);
  for (; o < o_hi; ++o) {
    float s = 0.f;
    for (int64_t k = 0; k < in; ++k) s += x[k] * widen(w[k * out + o]);
    y[o] = s;
  }
}

// exp(x) for x in [-87, 88] (clamped), within ~2 ulp (Cephes' expf polynomial), written so that the compiler
// vectorises a loop of it (libm's expf is a call per element: the softmax over the cache and SiLU spent most of
// a step in it)
inline float exp_approx(float x) {
  x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
  const float fn = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round to nearest
  float r = x - fn * 0.693359375f;
  r = r - fn * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (int32_t(fn) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

// y[v] = sum_d x[d] * e[v, d] (a tied head over the embedding (V, D)), rows v_lo .. v_hi-1
template <typename W>
void matvec_t(const float* x, const W* e, float* y, int64_t d, int64_t v_lo, int64_t v_hi) {
  for (int64_t i = v_lo; i < v_hi; ++i) {
    const W* row = e + i * d;
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t k = 0; k < d; ++k) s += x[k] * widen(row[k]);
    y[i] = s;
  }
}

template <typename W>
void rms_norm(const float* x, const W* scale, float* y, int64_t d, float eps, float offset) {
  float ss = 0.f;
  for (int64_t i = 0; i < d; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / float(d) + eps);
  for (int64_t i = 0; i < d; ++i) y[i] = x[i] * r * (widen(scale[i]) + offset);
}

// split-halves rotary embedding of `heads` heads of h in place (HuggingFace's rotate_half)
void rope(float* x, int64_t heads, int64_t h, const float* cos_, const float* sin_) {
  const int64_t half = h / 2;
  for (int64_t n = 0; n < heads; ++n) {
    float* p = x + n * h;
    for (int64_t i = 0; i < half; ++i) {
      const float a = p[i], b = p[i + half];
      p[i] = a * cos_[i] - b * sin_[i];
      p[i + half] = b * cos_[i] + a * sin_[i];
    }
  }
}

// grouped-query attention of one row's N query heads (q: (N, H)) over cache slots lo .. hi (kc, vc: (S, K, H)),
// query head n on KV head n / group: scores scaled after the dot, softmax in f32 (cache_attention's arithmetic).
// Each KV head's keys are first laid out (H, slots) in kt, so every score loop runs along the slots (one score per
// vector lane) and the group's query heads share them; a dot product per slot and head cost ~20 cycles
template <int HC, typename C>
void attend(const float* q, const C* kc, const C* vc, float* o, float* p, float* kt, int64_t kv_lo, int64_t kv_hi,
            int64_t group, int64_t KH, int64_t h_runtime, int64_t lo, int64_t hi) {
  constexpr bool R = sizeof(C) == 2;
  const int64_t H = HC ? HC : h_runtime, T = hi - lo + 1, TP = (T + 15) / 16 * 16;  // slots, padded to 16
  const float scale = float(1.0 / std::sqrt(double(H)));  // h ** -0.5 rounded once, as the model's
  for (int64_t kv = kv_lo; kv < kv_hi; ++kv) {
    for (int64_t t = 0; t < T; ++t) {
      const C* key = kc + (lo + t) * KH + kv * H;
      for (int64_t i = 0; i < H; ++i) kt[i * TP + t] = widen(key[i]);
    }
    for (int64_t i = 0; i < H; ++i)
      for (int64_t t = T; t < TP; ++t) kt[i * TP + t] = 0.f;
    for (int64_t n = kv * group; n < (kv + 1) * group; ++n) {
      const float* qn = q + n * H;
      for (int64_t t0 = 0; t0 < TP; t0 += 16) {  // 16 slots' scores in registers over the head's dims
        float acc[16];
        for (int j = 0; j < 16; ++j) acc[j] = 0.f;
        for (int64_t i = 0; i < H; ++i) {
          const float qi = qn[i];
          const float* row = kt + i * TP + t0;
#pragma omp simd
          for (int j = 0; j < 16; ++j) acc[j] += qi * row[j];
        }
        for (int j = 0; j < 16; ++j) p[t0 + j] = acc[j];
      }
      float top = -INFINITY;
#pragma omp simd reduction(max : top)
      for (int64_t t = 0; t < T; ++t) {
        p[t] *= scale;
        top = p[t] > top ? p[t] : top;
      }
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < T; ++t) {
        p[t] = exp_approx(p[t] - top);
        sum += p[t];
      }
      const float inv = 1.f / sum;
#pragma omp simd
      for (int64_t t = 0; t < T; ++t) p[t] = R ? to_bf16(p[t] * inv) : p[t] / sum;
      float* on = o + n * H;
      for (int64_t i = 0; i < H; ++i) on[i] = 0.f;
      for (int64_t t = 0; t < T; ++t) {
        const float pt = p[t];
        const C* vt = vc + (lo + t) * KH + kv * H;
#pragma omp simd
        for (int64_t i = 0; i < H; ++i) on[i] += pt * widen(vt[i]);
      }
      round_all<R>(on, H);
    }
  }
}

// A team of T threads runs one step together (thread 0 the caller): each takes a share of every matmul's
// outputs and of the KV heads, the rest (norms, residual stream) every thread computes itself, and a barrier
// separates a matmul's writes from the reads of its full result. Why: a decode step of a ~100M model reads its
// weights once, and one core's loads (~15 GB/s here) leave half the host's read bandwidth unused.
struct Team {
  int T = 1;
  std::atomic<int> arrived{0};
  std::atomic<int> phase{0};
  void barrier() {
    if (T == 1) return;
    const int ph = phase.load(std::memory_order_acquire);
    if (arrived.fetch_add(1, std::memory_order_acq_rel) == T - 1) {
      arrived.store(0, std::memory_order_relaxed);
      phase.store(ph + 1, std::memory_order_release);
      return;
    }
    for (int spins = 0; phase.load(std::memory_order_acquire) == ph; ++spins)
      if (spins > 4000) std::this_thread::yield();  // a busy host: let the late thread run
  }
  // [lo, hi) of n items for member `t`, in pieces of `align`
  void share(int t, int64_t n, int64_t align, int64_t* lo, int64_t* hi) const {
    const int64_t pieces = (n + align - 1) / align;
    const int64_t a = pieces * t / T, b = pieces * (t + 1) / T;
    *lo = a * align < n ? a * align : n;
    *hi = b * align < n ? b * align : n;
  }
};

// The team's other members: threads kept for the process's life, asleep between steps.
class Workers {
 public:
  // run f(t) for t = 0 .. T-1, f(0) on the calling thread; returns false (running nothing) when another step
  // holds the workers (then the caller runs the step alone)
  bool run(int T, const std::function<void(int)>& f) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    {
      std::lock_guard<std::mutex> g(m_);
      while (started_ < T - 1) {
        const int t = ++started_;
        std::thread([this, t] { loop(t); }).detach();  // asleep between steps for the process's life
      }
      job_ = &f;
      team_ = T;
      left_.store(T - 1, std::memory_order_release);
      ++generation_;
    }
    cv_.notify_all();
    f(0);
    for (int spins = 0; left_.load(std::memory_order_acquire) > 0; ++spins)
      if (spins > 4000) std::this_thread::yield();
    return true;
  }

 private:
  void loop(int t) {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(int)>* job;
      int team;
      {
        std::unique_lock<std::mutex> g(m_);
        cv_.wait(g, [&] { return generation_ != seen; });
        seen = generation_;
        job = job_;
        team = team_;
      }
      if (t < team) {
        (*job)(t);
        left_.fetch_sub(1, std::memory_order_acq_rel);
      }
    }
  }
  std::mutex busy_, m_;
  std::condition_variable cv_;
  int started_ = 0;
  const std::function<void(int)>* job_ = nullptr;
  int team_ = 1;
  uint64_t generation_ = 0;
  std::atomic<int> left_{0};
};

// The process's workers, never destroyed (detached threads outlive static destruction). A forked child (a data
// loader, a supervisor's worker) has none of its parent's threads: it starts its own set.
Workers& workers() {
  static std::atomic<Workers*> current{nullptr};
  static std::atomic<pid_t> owner{0};
  Workers* w = current.load(std::memory_order_acquire);
  if (w != nullptr && owner.load(std::memory_order_acquire) == getpid()) return *w;
  Workers* fresh = new Workers();
  if (current.compare_exchange_strong(w, fresh, std::memory_order_acq_rel)) {
    owner.store(getpid(), std::memory_order_release);
    return *fresh;
  }
  delete fresh;  // another thread installed one first
  return *current.load(std::memory_order_acquire);
}

struct Shape {
  int64_t B, V, D, N, K, H, F, S, L;
  float eps, offset, embed_scale, head_scale;
  bool tied, gelu, rows;  // rows: the layers' matmul weights and an untied head stored (out, in)
};

template <typename W>
const W* data(ffi::AnyBuffer b) {
  return reinterpret_cast<const W*>(b.untyped_data());
}

// Shared between a team's members: the matmuls' full results (each member writes its share of the outputs)
struct Shared {
  float *q, *k, *v, *o, *a, *g, *u;
};

// W: the weights' type; C: the cache's, which is the model's compute dtype (a bf16 model's weights may come widened
// to f32, exactly: the same arithmetic without a widening per weight and step)
template <typename W, typename C, typename HeadW>
void step(const Shape& s, const int32_t* tokens, int32_t index, const int32_t* pad, const float* inv_freq,
          const W* emb, const W* final_norm, const HeadW* head, ffi::RemainingArgs& layers, std::vector<C*>& caches,
          float* logits, int32_t* greedy, float* greedy_lp, Team& team, int t, const Shared& sh) {
  constexpr bool R = sizeof(C) == 2;  // a bf16 model: its activations rounded to bf16 where XLA's are
  const int64_t D = s.D, NH = s.N * s.H, KH = s.K * s.H, F = s.F, S = s.S, group = s.N / s.K, half = s.H / 2,
                H = s.H;
  thread_local std::vector<float> scratch;
  scratch.resize(2 * D + NH + 2 * KH + (S + 16) + s.H + (S + 16) * s.H);
  float *x = scratch.data(), *hn = x + D, *q = hn + D, *k = q + NH, *v = k + KH, *p = v + KH, *cs = p + S + 16,
        *sn = cs + half, *kt = sn + half;
  // this member's shares: outputs of each projection (pieces of 64: whole register blocks), KV heads, vocab rows
  int64_t q0, q1, k0, k1, d0, d1, f0, f1, kv0, kv1, v0, v1;
  team.share(t, NH, 64, &q0, &q1);
  team.share(t, KH, 64, &k0, &k1);
  team.share(t, D, 64, &d0, &d1);
  team.share(t, F, 64, &f0, &f1);
  team.share(t, s.K, 1, &kv0, &kv1);
  team.share(t, s.V, 64, &v0, &v1);
  const int64_t h0 = kv0 * group * H, h1 = kv1 * group * H, c0 = kv0 * H, c1 = kv1 * H;  // its heads' q, k/v
  auto mv = [&](const float* in_x, const W* wgt, float* y, int64_t in, int64_t out, int64_t lo, int64_t hi) {
    if (s.rows) matvec_rows(in_x, wgt, y, in, lo, hi);
    else matvec(in_x, wgt, y, in, out, lo, hi);
  };
  for (int64_t b = 0; b < s.B; ++b) {
    const W* e = emb + int64_t(tokens[b]) * D;
    for (int64_t i = 0; i < D; ++i) x[i] = widen(e[i]) * s.embed_scale;
    round_all<R>(x, D);
    const int32_t pos = index - pad[b] > 0 ? index - pad[b] : 0;
    for (int64_t i = 0; i < half; ++i) {
      const float angle = float(pos) * inv_freq[i];
      cs[i] = std::cos(angle);
      sn[i] = std::sin(angle);
    }
    for (int64_t l = 0; l < s.L; ++l) {
      auto w = [&](int64_t j) { return data<W>(layers.get<ffi::AnyBuffer>(9 * l + j).value()); };
      rms_norm(x, w(0), hn, D, s.eps, s.offset);
      round_all<R>(hn, D);
      mv(hn, w(1), sh.q, D, NH, q0, q1);
      mv(hn, w(2), sh.k, D, KH, k0, k1);
      mv(hn, w(3), sh.v, D, KH, k0, k1);
      team.barrier();
      // this member's KV heads and their query heads: rounded, rotated, written to the cache slot, attended
      std::memcpy(q + h0, sh.q + h0, (h1 - h0) * sizeof(float));
      std::memcpy(k + c0, sh.k + c0, (c1 - c0) * sizeof(float));
      std::memcpy(v + c0, sh.v + c0, (c1 - c0) * sizeof(float));
      round_all<R>(q + h0, h1 - h0);
      round_all<R>(k + c0, c1 - c0);
      round_all<R>(v + c0, c1 - c0);
      rope(q + h0, (h1 - h0) / H, H, cs, sn);
      rope(k + c0, kv1 - kv0, H, cs, sn);
      round_all<R>(q + h0, h1 - h0);
      round_all<R>(k + c0, c1 - c0);
      C* kc = caches[2 * l] + b * S * KH;
      C* vc = caches[2 * l + 1] + b * S * KH;
      if (index < S) {
        store(kc + int64_t(index) * KH + c0, k + c0, c1 - c0);
        store(vc + int64_t(index) * KH + c0, v + c0, c1 - c0);
      }
      // the slots this row's query sees: pad[b] .. index (cache_mask), its own slot always
      const int64_t lo = pad[b] <= index ? pad[b] : index, hi = index < S ? index : S - 1;
      switch (s.H) {  // head_dim known to the compiler: the per-slot dot products unroll (8 us -> 1 us on tiny)
        case 8: attend<8, C>(q, kc, vc, sh.o, p, kt, kv0, kv1, group, KH, 8, lo, hi); break;
        case 16: attend<16, C>(q, kc, vc, sh.o, p, kt, kv0, kv1, group, KH, 16, lo, hi); break;
        case 32: attend<32, C>(q, kc, vc, sh.o, p, kt, kv0, kv1, group, KH, 32, lo, hi); break;
        case 64: attend<64, C>(q, kc, vc, sh.o, p, kt, kv0, kv1, group, KH, 64, lo, hi); break;
        case 128: attend<128, C>(q, kc, vc, sh.o, p, kt, kv0, kv1, group, KH, 128, lo, hi); break;
        default: attend<0, C>(q, kc, vc, sh.o, p, kt, kv0, kv1, group, KH, s.H, lo, hi);
      }
      team.barrier();
      mv(sh.o, w(4), sh.a, NH, D, d0, d1);
      team.barrier();
      residual<R>(x, sh.a, D);
      rms_norm(x, w(5), hn, D, s.eps, s.offset);
      round_all<R>(hn, D);
      float *g = sh.g + f0, *u = sh.u + f0;  // this member's share of the MLP's hidden units
      const int64_t fn = f1 - f0;
      mv(hn, w(6), sh.g, D, F, f0, f1);
      mv(hn, w(7), sh.u, D, F, f0, f1);
      round_all<R>(g, fn);
      round_all<R>(u, fn);
      if (R && !s.gelu) {  // op by op, each rounded (XLA's bf16 elementwise ops: sigmoid = 1 / (1 + exp(-z)))
#pragma omp simd
        for (int64_t i = 0; i < fn; ++i) {
          const float z = g[i];
          g[i] = to_bf16(to_bf16(z * to_bf16(1.f / to_bf16(to_bf16(exp_approx(-z)) + 1.f))) * u[i]);
        }
      } else if (R) {
        for (int64_t i = 0; i < fn; ++i) {
          const float z = g[i];
          g[i] = to_bf16(to_bf16(0.5f * z * (1.f + std::tanh(0.7978845608028654f * (z + 0.044715f * z * z * z)))) * u[i]);
        }
      } else if (s.gelu) {
        for (int64_t i = 0; i < fn; ++i) {
          const float z = g[i];
          g[i] = 0.5f * z * (1.f + std::tanh(0.7978845608028654f * (z + 0.044715f * z * z * z))) * u[i];
        }
      } else {
#pragma omp simd
        for (int64_t i = 0; i < fn; ++i) g[i] = g[i] / (1.f + exp_approx(-g[i])) * u[i];
      }
      team.barrier();
      mv(sh.g, w(8), sh.a, F, D, d0, d1);
      team.barrier();
      residual<R>(x, sh.a, D);
    }
    rms_norm(x, final_norm, hn, D, s.eps, s.offset);
    round_all<R>(hn, D);
    float* y = logits + b * s.V;
    if (s.tied) {  // the tied head multiplies in the compute dtype (a bf16 model: bf16 logits, then the scale)
      matvec_t(hn, head, y, D, v0, v1);
      round_all<R>(y + v0, v1 - v0);
      if (s.head_scale != 1.f) {
        for (int64_t i = v0; i < v1; ++i) y[i] *= s.head_scale;
        round_all<R>(y + v0, v1 - v0);
      }
    } else if (s.rows) {  // an untied head's logits are f32 (the engine's); (V, D) in the row layout
      matvec_t(hn, head, y, D, v0, v1);
    } else {
      matvec(hn, head, y, D, s.V, v0, v1);
    }
    team.barrier();
    if (t == 0) {
      // the greedy choice and its log-probability (choose_with_logprobs: the first maximum; -log(sum(exp(l - max))))
      int64_t best = 0;
      for (int64_t i = 1; i < s.V; ++i) best = y[i] > y[best] ? i : best;
      const float top = y[best];
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < s.V; ++i) sum += exp_approx(y[i] - top);
      greedy[b] = int32_t(best);
      greedy_lp[b] = -std::log(sum);
    }
    team.barrier();  // the next row's shared buffers are written only after every member read these
  }
}

ffi::Error DecodeStepImpl(ffi::Buffer<ffi::S32> tokens, ffi::Buffer<ffi::S32> index, ffi::Buffer<ffi::S32> pad,
                          ffi::Buffer<ffi::F32> inv_freq, ffi::AnyBuffer emb, ffi::AnyBuffer final_norm,
                          ffi::AnyBuffer head, ffi::RemainingArgs rest, ffi::ResultBuffer<ffi::F32> logits,
                          ffi::ResultBuffer<ffi::S32> greedy, ffi::ResultBuffer<ffi::F32> greedy_lp,
                          ffi::RemainingRets caches_out, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim,
                          float eps, float offset, float embed_scale, float head_scale, bool tied, bool gelu,
                          int64_t threads, bool rows) {
  const size_t n_rest = rest.size();
  if (n_rest % 11 || caches_out.size() * 11 != 2 * n_rest)
    return ffi::Error::InvalidArgument("decode_step: expected 9 weights and 2 caches per layer");
  Shape s{};
  s.L = int64_t(n_rest / 11);
  s.B = tokens.element_count();
  auto ed = emb.dimensions();
  s.D = ed[1];
  s.V = tied || rows ? head.dimensions()[0] : head.dimensions()[1];
  s.N = n_heads, s.K = n_kv_heads, s.H = head_dim;
  s.eps = eps, s.offset = offset, s.embed_scale = embed_scale, s.head_scale = head_scale, s.tied = tied,
  s.gelu = gelu;
  if (s.L == 0 || s.K == 0 || s.N % s.K || s.H % 2) return ffi::Error::InvalidArgument("decode_step: bad heads");
  s.rows = rows;
  s.F = rest.get<ffi::AnyBuffer>(6).value().dimensions()[rows ? 0 : 1];
  const ffi::DataType wtype = emb.element_type();
  if (wtype != ffi::F32 && wtype != ffi::BF16) return ffi::Error::InvalidArgument("decode_step: f32 or bf16 weights");
  for (size_t j = 0; j < 9 * size_t(s.L); ++j)
    if (rest.get<ffi::AnyBuffer>(j).value().element_type() != wtype || final_norm.element_type() != wtype)
      return ffi::Error::InvalidArgument("decode_step: every weight in the embedding's dtype");
  if (head.element_type() != ffi::F32 && head.element_type() != ffi::BF16)
    return ffi::Error::InvalidArgument("decode_step: an f32 or bf16 head");
  std::vector<void*> caches(2 * s.L);
  // the cache: the model's compute dtype; bf16 weights only with a bf16 cache (f32 ones: an f32 or a bf16 model)
  const ffi::DataType ctype = rest.get<ffi::AnyBuffer>(9 * s.L).value().element_type();
  if ((ctype != ffi::F32 && ctype != ffi::BF16) || (wtype == ffi::BF16 && ctype != ffi::BF16))
    return ffi::Error::InvalidArgument("decode_step: an f32 or bf16 cache, bf16 with bf16 weights");
  for (int64_t c = 0; c < 2 * s.L; ++c) {
    ffi::AnyBuffer in = rest.get<ffi::AnyBuffer>(9 * s.L + c).value();
    auto out = caches_out.get<ffi::AnyBuffer>(c).value();
    if (in.element_type() != ctype) return ffi::Error::InvalidArgument("decode_step: every cache in one dtype");
    s.S = in.dimensions()[1];
    caches[c] = out->untyped_data();
    if (caches[c] != in.untyped_data()) std::memcpy(caches[c], in.untyped_data(), in.size_bytes());
  }
  const int32_t at = index.typed_data()[0];
  auto run = [&](auto w_tag, auto c_tag, auto head_tag) {
    using W = decltype(w_tag);
    using C = decltype(c_tag);
    using HeadW = decltype(head_tag);
    std::vector<C*> typed(caches.size());
    for (size_t c = 0; c < caches.size(); ++c) typed[c] = static_cast<C*>(caches[c]);
    const int64_t NH = s.N * s.H, KH = s.K * s.H;
    std::vector<float> shared_buf(2 * NH + 2 * KH + s.D + 2 * s.F);
    float* base = shared_buf.data();
    const Shared sh{base, base + NH, base + NH + KH, base + NH + 2 * KH, base + 2 * NH + 2 * KH,
                    base + 2 * NH + 2 * KH + s.D, base + 2 * NH + 2 * KH + s.D + s.F};
    auto member = [&](Team& team, int t) {
      step<W, C, HeadW>(s, tokens.typed_data(), at, pad.typed_data(), inv_freq.typed_data(), data<W>(emb),
                     data<W>(final_norm), data<HeadW>(head), rest, typed, logits->typed_data(),
                     greedy->typed_data(), greedy_lp->typed_data(), team, t, sh);
    };
    Team team;
    team.T = int(threads < 1 ? 1 : (threads > 16 ? 16 : threads));
    if (team.T > 1 && workers().run(team.T, [&](int t) { member(team, t); })) return;
    Team alone;  // one thread (a small model, or another step holds the workers)
    member(alone, 0);
  };
  const bool head_f32 = head.element_type() == ffi::F32;
  if (wtype == ffi::BF16) {
    head_f32 ? run(uint16_t{}, uint16_t{}, float{}) : run(uint16_t{}, uint16_t{}, uint16_t{});
  } else if (ctype == ffi::F32) {
    head_f32 ? run(float{}, float{}, float{}) : run(float{}, float{}, uint16_t{});
  } else {  // a bf16 model's weights widened to f32
    head_f32 ? run(float{}, uint16_t{}, float{}) : run(float{}, uint16_t{}, uint16_t{});
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MeshtrainDecodeStep, DecodeStepImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .RemainingRets()
                                  .Attr<int64_t>("n_heads")
                                  .Attr<int64_t>("n_kv_heads")
                                  .Attr<int64_t>("head_dim")
                                  .Attr<float>("eps")
                                  .Attr<float>("offset")
                                  .Attr<float>("embed_scale")
                                  .Attr<float>("head_scale")
                                  .Attr<bool>("tied")
                                  .Attr<bool>("gelu")
                                  .Attr<int64_t>("threads")
                                  .Attr<bool>("rows"));
