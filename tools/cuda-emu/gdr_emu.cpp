// ops/recurrent.cu's gated_delta_rule run on the CPU (emu.h) against a double-precision delta rule
// (mlx-lm gated_delta.py's recurrence): several head shapes (head_k_dim under, at and over a warp,
// not a multiple of 32, up to 256), the state carried over calls of 4, 1 and 3 rows, and those
// calls bit-equal to one call of all 8 rows (a row's result does not depend on its chunk).
// Build: g++ -std=c++20 -O1 -pthread -I crates/cuda/src/ops tools/cuda-emu/gdr_emu.cpp
// Prints one line per case; exits non-zero when any case fails.
#include "emu.h"
inline float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }
inline float softplus_f(float x) { return x > 20.0f ? x : log1pf(expf(x)); }
#include "recurrent.cu"
#include <cstdio>
#include <random>
struct Shape { int nk, nv, dk, dv; };
// One launch over t rows, as ops/recurrent.rs launches it (rows a multiple of GDR_WARPS here, so
// that every lane of a block shuffles).
static void launch(const float* q, const float* k, const float* v, const float* g, const float* b,
                   float* state, int t, Shape s, float* out) {
  int rows = s.nv * s.dv, bx = (rows + GDR_WARPS - 1) / GDR_WARPS;
  for (int blk = 0; blk < bx; ++blk) {
    std::barrier<> br(GDR_WARPS * 32); bar = &br; std::vector<std::thread> ts;
    for (int th = 0; th < GDR_WARPS * 32; ++th) ts.emplace_back([&, th] {
      threadIdx = {(unsigned)th, 0, 0}; blockIdx = {(unsigned)blk, 0, 0};
      gated_delta_rule(q, k, v, g, b, state, t, s.nk, s.nv, s.dk, s.dv, out); });
    for (auto& x : ts) x.join();
  }
}
int main() {
  std::mt19937 rng(11); std::uniform_real_distribution<float> U(-1, 1), G(0.3f, 1.0f);
  Shape shapes[] = {{2, 4, 16, 8}, {1, 2, 64, 8}, {2, 4, 128, 4}, {1, 1, 256, 8}, {1, 2, 40, 8}};
  int fails = 0;
  for (Shape s : shapes) {
    const int T = 8, kd = s.nk * s.dk, vd = s.nv * s.dv;
    std::vector<float> q(T * kd), k(T * kd), v(T * vd), g(T * s.nv), b(T * s.nv);
    for (auto* x : {&q, &k}) {  // unit rows per head, as the family feeds them
      for (auto& e : *x) e = U(rng);
      for (int r = 0; r < T * s.nk; ++r) {
        double n = 0; for (int c = 0; c < s.dk; ++c) n += (double)(*x)[r * s.dk + c] * (*x)[r * s.dk + c];
        for (int c = 0; c < s.dk; ++c) (*x)[r * s.dk + c] /= (float)sqrt(n);
      }
    }
    for (auto& e : v) e = U(rng);
    for (auto& e : g) e = G(rng);
    for (auto& e : b) e = G(rng);
    // The reference over all T rows, from a random state.
    size_t n_state = (size_t)s.nv * s.dv * s.dk;
    std::vector<float> st0(n_state); for (auto& e : st0) e = 0.5f * U(rng);
    std::vector<double> S(st0.begin(), st0.end()), want(T * vd);
    for (int r = 0; r < T; ++r) for (int h = 0; h < s.nv; ++h) {
      int kh = h / (s.nv / s.nk);
      const float* kr = &k[(r * s.nk + kh) * s.dk]; const float* qr = &q[(r * s.nk + kh) * s.dk];
      for (int i = 0; i < s.dv; ++i) {
        double* row = &S[((size_t)h * s.dv + i) * s.dk]; double sk = 0;
        for (int c = 0; c < s.dk; ++c) { row[c] *= g[r * s.nv + h]; sk += row[c] * kr[c]; }
        double u = (v[(r * s.nv + h) * s.dv + i] - sk) * b[r * s.nv + h], o = 0;
        for (int c = 0; c < s.dk; ++c) { row[c] += u * kr[c]; o += row[c] * qr[c]; }
        want[(r * s.nv + h) * s.dv + i] = o;
      }
    }
    // Calls of 4, 1 and 3 rows, and one call of all 8.
    std::vector<float> st_a = st0, st_b = st0, out_a(T * vd), out_b(T * vd);
    int r0 = 0;
    for (int t : {4, 1, 3}) {
      launch(&q[r0 * kd], &k[r0 * kd], &v[r0 * vd], &g[r0 * s.nv], &b[r0 * s.nv], st_a.data(), t, s, &out_a[r0 * vd]);
      r0 += t;
    }
    launch(q.data(), k.data(), v.data(), g.data(), b.data(), st_b.data(), T, s, out_b.data());
    double scale = 0, err = 0, serr = 0;
    for (int i = 0; i < T * vd; ++i) { scale = fmax(scale, fabs(want[i])); err = fmax(err, fabs(out_a[i] - want[i])); }
    for (size_t i = 0; i < n_state; ++i) serr = fmax(serr, fabs(st_a[i] - S[i]));
    bool same = memcmp(out_a.data(), out_b.data(), 4 * out_a.size()) == 0 &&
                memcmp(st_a.data(), st_b.data(), 4 * n_state) == 0;
    bool ok = err <= 2e-5 * fmax(scale, 1.0) && serr <= 2e-5 && same;
    printf("%s nk %d nv %d dk %d dv %d: max err %.3g (of %.3g), state err %.3g, chunked %s one call\n",
           ok ? "ok" : "FAIL", s.nk, s.nv, s.dk, s.dv, err, scale, serr, same ? "==" : "!=");
    fails += !ok;
  }
  return fails != 0;
}
