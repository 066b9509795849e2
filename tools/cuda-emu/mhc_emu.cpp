// ops/deepseek_v4.cu's mHC entry (hc_mix_parts, then hc_pre_row) and exit (hc_post), and
// ops/elementwise.cu's `linear` and `matmul_bf16`, run on the CPU (emu.h) against double-precision twins of
// crates/backend/src/reference/deepseek_v4.rs `hc_pre` / `hc_post` and `linear`: 4 streams of 32,
// 300 (a partial split) and 4096 (64 splits, DeepSeek-V4-Flash) columns per stream, 24 and 4
// mixes, 1 and 3 rows; linear and matmul_bf16 at 40, 4096 and 2048 columns (the 16-byte paths and
// their tails) and 30, the BF16 weights also at an offset that is not 16-byte aligned.
// Build: g++ -std=c++20 -O1 -pthread -I crates/cuda/src/ops tools/cuda-emu/mhc_emu.cpp
// Prints one line per case; exits non-zero when any case fails.
#include "emu.h"
// These kernels share shared memory between the threads of a block (emu.h keeps it per thread);
// blocks run one after the other, so one static copy is a block's.
#undef __shared__
#define __shared__ static
#define F32_INF __int_as_float(0x7f800000)
inline bool finite_f32(float x) { return std::isfinite(x); }
inline float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
#include "elementwise.cu"
#include "deepseek_v4.cu"
#include <cstdio>
#include <functional>
#include <random>

// Runs `body` as `grid` blocks of `threads` threads, one block after the other.
static void launch(dim3e grid, unsigned threads, const std::function<void()>& body) {
  gridDim = grid; blockDim = {threads, 1, 1};
  for (unsigned by = 0; by < grid.y; ++by)
    for (unsigned bx = 0; bx < grid.x; ++bx) {
      std::barrier<> br(threads); bar = &br; std::vector<std::thread> ts;
      for (unsigned th = 0; th < threads; ++th) ts.emplace_back([&, th] {
        threadIdx = {th, 0, 0}; blockIdx = {bx, by, 0}; body(); });
      for (auto& x : ts) x.join();
    }
}

static double max_rel(const std::vector<float>& got, const std::vector<double>& want) {
  double scale = 1e-3, err = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    scale = fmax(scale, fabs(want[i])); err = fmax(err, fabs(got[i] - want[i]));
  }
  return err / scale;
}

int main() {
  std::mt19937 rng(7); std::uniform_real_distribution<float> U(-1, 1);
  auto vec = [&](size_t n, float a) { std::vector<float> v(n); for (auto& e : v) e = a * U(rng); return v; };
  int fails = 0;
  const int n = 4, sinkhorn = 20; const float hc_eps = 1e-6f, norm_eps = 1e-6f;
  for (int d : {32, 300, 4096})
    for (int m : {24, 4})
      for (int t : {1, 3}) {
        int cols = n * d, splits = (cols + HC_SPLIT - 1) / HC_SPLIT;
        auto x = vec((size_t)t * cols, 2.0f), f = vec((size_t)m * cols, 0.05f);
        auto base = vec(m, 0.5f), scale = vec(m == n ? 1 : 3, 1.0f);
        std::vector<float> parts((size_t)t * splits * (m + 1)), col((size_t)t * d), post(t * n), comb(t * n * n);
        launch({(unsigned)splits, (unsigned)t, 1}, 256, [&] { hc_mix_parts(x.data(), cols, f.data(), m, parts.data()); });
        launch({(unsigned)t, (unsigned)((d + HC_COLS - 1) / HC_COLS), 1}, HC_COLS, [&] {
          hc_pre_row(x.data(), cols, n, parts.data(), splits, m, base.data(), scale.data(), hc_eps, norm_eps,
                     sinkhorn, col.data(), post.data(), comb.data()); });
        // The reference (f64): reference::hc_pre.
        std::vector<double> wcol, wpost, wcomb;
        for (int r = 0; r < t; ++r) {
          const float* xr = &x[(size_t)r * cols];
          double ms = 0; for (int c = 0; c < cols; ++c) ms += (double)xr[c] * xr[c];
          double rr = 1.0 / sqrt(ms / cols + norm_eps);
          std::vector<double> mix(m);
          for (int i = 0; i < m; ++i) { double a = 0; for (int c = 0; c < cols; ++c) a += (double)f[(size_t)i * cols + c] * xr[c] * rr; mix[i] = a; }
          auto sig = [](double v) { return 1.0 / (1.0 + exp(-v)); };
          std::vector<double> pre(n);
          for (int j = 0; j < n; ++j) pre[j] = sig(mix[j] * scale[0] + base[j]) + hc_eps;
          for (int i = 0; i < d; ++i) { double a = 0; for (int j = 0; j < n; ++j) a += pre[j] * xr[j * d + i]; wcol.push_back(a); }
          if (m == n) continue;
          for (int j = 0; j < n; ++j) wpost.push_back(2.0 * sig(mix[n + j] * scale[1] + base[n + j]));
          std::vector<double> c(n * n);
          for (int j = 0; j < n; ++j) {
            double mx = -INFINITY; for (int k = 0; k < n; ++k) mx = fmax(mx, mix[2 * n + j * n + k] * scale[2] + base[2 * n + j * n + k]);
            double z = 0; for (int k = 0; k < n; ++k) z += exp(mix[2 * n + j * n + k] * scale[2] + base[2 * n + j * n + k] - mx);
            for (int k = 0; k < n; ++k) c[j * n + k] = exp(mix[2 * n + j * n + k] * scale[2] + base[2 * n + j * n + k] - mx) / z + hc_eps;
          }
          auto cols_n = [&] { for (int k = 0; k < n; ++k) { double z = hc_eps; for (int j = 0; j < n; ++j) z += c[j * n + k]; for (int j = 0; j < n; ++j) c[j * n + k] /= z; } };
          cols_n();
          for (int it = 1; it < sinkhorn; ++it) {
            for (int j = 0; j < n; ++j) { double z = hc_eps; for (int k = 0; k < n; ++k) z += c[j * n + k]; for (int k = 0; k < n; ++k) c[j * n + k] /= z; }
            cols_n();
          }
          wcomb.insert(wcomb.end(), c.begin(), c.end());
        }
        double e = max_rel(col, wcol);
        if (m != n) {
          e = fmax(e, max_rel(post, wpost)); e = fmax(e, max_rel(comb, wcomb));
          // The exit with these post and comb.
          auto out = vec((size_t)t * d, 1.0f);
          std::vector<float> y((size_t)t * n * d);
          launch({1, 1, 1}, 1, [&] { hc_post(x.data(), out.data(), post.data(), comb.data(), t, n, d, y.data()); });
          std::vector<double> wy;
          for (int r = 0; r < t; ++r) for (int k = 0; k < n; ++k) for (int i = 0; i < d; ++i) {
            double a = 0; for (int j = 0; j < n; ++j) a += (double)comb[r * n * n + j * n + k] * x[(size_t)r * cols + j * d + i];
            wy.push_back((double)post[r * n + k] * out[(size_t)r * d + i] + a);
          }
          e = fmax(e, max_rel(y, wy));
        }
        bool ok = e <= 5e-5;
        printf("%s mHC d %d mixes %d rows %d: max rel err %.3g\n", ok ? "ok" : "FAIL", d, m, t, e);
        fails += !ok;
      }
  // linear and matmul_bf16: a block of DOT_THREADS per output.
  for (auto [t, rows, cols] : {std::tuple{2, 4, 40}, std::tuple{1, 16, 4096}, std::tuple{3, 8, 30}, std::tuple{1, 3, 2048}}) {
    auto x = vec((size_t)t * cols, 1.0f), w = vec((size_t)rows * cols, 0.5f);
    std::vector<float> y((size_t)t * rows);
    launch({(unsigned)(t * rows), 1, 1}, DOT_THREADS, [&] { linear(x.data(), w.data(), t, rows, cols, y.data()); });
    std::vector<double> want;
    for (int r = 0; r < t; ++r) for (int o = 0; o < rows; ++o) {
      double a = 0; for (int c = 0; c < cols; ++c) a += (double)x[(size_t)r * cols + c] * w[(size_t)o * cols + c];
      want.push_back(a);
    }
    double e = max_rel(y, want);
    bool ok = e <= 1e-5;
    printf("%s linear %d x [%d, %d]: max rel err %.3g\n", ok ? "ok" : "FAIL", t, rows, cols, e);
    fails += !ok;
    // The same product with w rounded to BF16 at a 16-byte offset (the wide path) and at 2 bytes.
    for (int off : {16, 2}) {
      std::vector<unsigned char> base(off + w.size() * 2);
      std::vector<double> wb(w.size());
      for (size_t i = 0; i < w.size(); ++i) {
        u32 u; memcpy(&u, &w[i], 4); u16 h = (u16)(u >> 16);
        memcpy(&base[off + 2 * i], &h, 2); wb[i] = bf16_to_f32(h);
      }
      launch({(unsigned)(t * rows), 1, 1}, DOT_THREADS, [&] { matmul_bf16(x.data(), t, rows, cols, base.data(), off, y.data()); });
      std::vector<double> wantb;
      for (int r = 0; r < t; ++r) for (int o = 0; o < rows; ++o) {
        double a = 0; for (int c = 0; c < cols; ++c) a += (double)x[(size_t)r * cols + c] * wb[(size_t)o * cols + c];
        wantb.push_back(a);
      }
      double eb = max_rel(y, wantb);
      bool okb = eb <= 1e-5;
      printf("%s matmul_bf16 %d x [%d, %d] at offset %d: max rel err %.3g\n", okb ? "ok" : "FAIL", t, rows, cols, off, eb);
      fails += !okb;
    }
  }
  return fails != 0;
}
