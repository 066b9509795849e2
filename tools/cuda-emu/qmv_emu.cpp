// ops/quant.cu run on the CPU (emu.h) against a double-precision dequantized product: every bit
// width, group size and lane count, each alignment of the codes modulo 8, one-matrix (qmv) and gated
// (qmv_glu) lane groups (also with the up matrix in other groups than the gate), and the gated
// output bit-equal to glu_f of the two one-matrix products.
// Build: g++ -std=c++20 -O1 -pthread -I crates/cuda/src/ops [-DQV_R=N] [-DQV_U=N] [-DQV_STAGE=0|1]
//   [-DQV_P=N] tools/cuda-emu/qmv_emu.cpp
// Prints one line per case and a digest of every output's bits (the same at every QV_R, QV_U,
// QV_STAGE and QV_P); exits non-zero when any case fails.
#include "emu.h"
// A block's shared memory is shared by its threads (emu.h keeps it per thread); blocks run one
// after the other, so one static copy is a block's, the dynamic one included.
#undef __shared__
#define __shared__ static
#define QV_SMEM_EMULATED
inline float4* qv_smem() { static float4 buf[49152 / 16]; return buf; }
#include "quant.cu"
// Passes of a block over its lane groups' rows (the launch's `passes`).
#ifndef QV_P
#define QV_P 1
#endif
#include <cstdio>
#include <random>
static u16 bf16(float f) { u32 u; memcpy(&u, &f, 4); return (u16)((u + 0x7fff + ((u >> 16) & 1)) >> 16); }
int lanes_for(int cols, int bits) { int words = cols * bits / 64, l = 32; while (l > 4 && words < 4 * l) l /= 2; return l; }
template <int BITS, int NM> void launch(QJobs a, int rows, int cols, int group, int lpr, int jobs, int act, int up_group = 0) {
  int rpb = QV_WARPS * 32 / lpr * (QV_R / NM) * QV_P; int bx = (rows + rpb - 1) / rpb;
  for (int j = 0; j < jobs; ++j) for (int b = 0; b < bx; ++b) {
    std::barrier<> br(QV_WARPS * 32); bar = &br; std::vector<std::thread> ts;
    for (int t = 0; t < QV_WARPS * 32; ++t) ts.emplace_back([&, t] { threadIdx = {(unsigned)t, 0, 0}; blockIdx = {(unsigned)b, (unsigned)j, 0};
      int jj = blockIdx.y; QvMats m = qv_mats(a, jj, NM, act, 7.0f); m.up_group = up_group;
      qmv_lanes<BITS, NM, QV_P>(lpr, m, a.x[NM * jj], a.y[NM * jj], rows, cols, group); });
    for (auto& t : ts) t.join();
  }
}
int main() {
  std::mt19937 rng(7); std::uniform_real_distribution<float> U(-1, 1);
  int fails = 0;
  u64 digest = 1469598103934665603ull;  // FNV-1a over the output bits
  auto mix = [&](const std::vector<float>& v) { for (float f : v) { u32 u; memcpy(&u, &f, 4); digest = (digest ^ u) * 1099511628211ull; } };
  // ug: the up (second) matrix's group when it differs (DeepSeek-V4's gate in 32s, up in 64s).
  struct C { int rows, cols, bits, group, ug; } cs[] = {{37,256,4,64,0},{37,256,2,32,0},{37,256,8,128,0},{19,704,4,64,0},{9,2816,4,64,0},{13,2048,2,128,0},{11,1536,8,32,0},{5,32,2,32,0},{70,512,4,32,0},{3,2816,8,64,0},{37,256,2,32,64},{13,2048,2,32,64},{19,704,4,64,32}};
  for (auto c : cs) for (int mis = 0; mis < 8; mis += 2) {
    int rb = c.cols * c.bits / 8;
    int gsz[2] = {c.group, c.ug ? c.ug : c.group}, gn[2] = {c.cols / gsz[0], c.cols / gsz[1]};
    std::vector<uint8_t> buf[2]; std::vector<u16> sc[2], bi[2]; std::vector<int> q[2]; uint8_t* base[2];
    for (int mi = 0; mi < 2; ++mi) {
    buf[mi].assign(64 + (size_t)c.rows * rb + 64, 0xAB);
    sc[mi].resize(c.rows * gn[mi] + 4); bi[mi].resize(c.rows * gn[mi] + 4);
    base[mi] = (uint8_t*)(((uintptr_t)buf[mi].data() + 15) & ~(uintptr_t)15) + 8 + mis;
    q[mi].resize((size_t)c.rows * c.cols);
    for (auto& v : q[mi]) v = rng() & ((1 << c.bits) - 1);
    for (int r = 0; r < c.rows; ++r) for (int col = 0; col < c.cols; ++col) {
      size_t e = (size_t)r * c.cols + col, bit = e * c.bits; base[mi][bit / 8] &= ~(((1 << c.bits) - 1) << (bit % 8)); base[mi][bit / 8] |= q[mi][e] << (bit % 8); }
    for (auto& v : sc[mi]) v = bf16(U(rng) * 0.1f); for (auto& v : bi[mi]) v = bf16(U(rng) * 0.05f);
    }
    std::vector<float> x(c.cols + 8); for (auto& v : x) v = U(rng);
    std::vector<float> y(c.rows, -999.f), yg(c.rows, -999.f);
    QJobs a{}; for (int mi = 0; mi < 2; ++mi) { a.w[mi] = (u64)base[mi]; a.s[mi] = (u64)sc[mi].data(); a.b[mi] = (u64)bi[mi].data(); a.x[mi] = (u64)x.data(); a.y[mi] = (u64)(mi ? y.data() : yg.data()); }
    int lpr = lanes_for(c.cols, c.bits);
    int act = mis / 2 % 3;
    if (c.bits == 2) { launch<2, 2>(a, c.rows, c.cols, c.group, lpr, 1, act, c.ug); } else if (c.bits == 4) { launch<4, 2>(a, c.rows, c.cols, c.group, lpr, 1, act, c.ug); } else { launch<8, 2>(a, c.rows, c.cols, c.group, lpr, 1, act, c.ug); }
    // NM = 1 on the up matrix alone (job 1 -> y), via a second QJobs
    QJobs a1{}; a1.w[0] = a.w[1]; a1.s[0] = a.s[1]; a1.b[0] = a.b[1]; a1.x[0] = a.x[1]; a1.y[0] = (u64)y.data();
    if (c.bits == 2) launch<2, 1>(a1, c.rows, c.cols, gsz[1], lpr, 1, 0); else if (c.bits == 4) launch<4, 1>(a1, c.rows, c.cols, gsz[1], lpr, 1, 0); else launch<8, 1>(a1, c.rows, c.cols, gsz[1], lpr, 1, 0);
    std::vector<float> g1(c.rows, -999.f);
    QJobs a2{}; a2.w[0] = a.w[0]; a2.s[0] = a.s[0]; a2.b[0] = a.b[0]; a2.x[0] = a.x[0]; a2.y[0] = (u64)g1.data();
    if (c.bits == 2) launch<2, 1>(a2, c.rows, c.cols, c.group, lpr, 1, 0); else if (c.bits == 4) launch<4, 1>(a2, c.rows, c.cols, c.group, lpr, 1, 0); else launch<8, 1>(a2, c.rows, c.cols, c.group, lpr, 1, 0);
    mix(y); mix(yg); mix(g1);
    int nonident = 0;
    for (int r = 0; r < c.rows; ++r) { float e = glu_f(g1[r], y[r], act, 7.0f); if (memcmp(&e, &yg[r], 4)) ++nonident; }
    if (nonident) { printf("NOT BIT-IDENTICAL %d rows\n", nonident); fails++; }
    double worst = 0;
    for (int r = 0; r < c.rows; ++r) { double ref[2] = {0, 0}, mag[2] = {0, 0};
      for (int mi = 0; mi < 2; ++mi) for (int col = 0; col < c.cols; ++col) { int g = r * gn[mi] + col / gsz[mi];
        double w = (double)bf16_to_f32(sc[mi][g]) * q[mi][(size_t)r * c.cols + col] + bf16_to_f32(bi[mi][g]); ref[mi] += w * x[col]; mag[mi] += fabs(w * x[col]); }
      worst = std::max(worst, fabs(y[r] - ref[1]) / (mag[1] + 1e-30));
      double gl = glu_f((float)ref[0], (float)ref[1], act, 7.0f);
      worst = std::max(worst, fabs(yg[r] - gl) / (fabs(gl) + 1e-3) * 1e-2); }
    bool bad = !(worst < 1e-5);
    fails += bad;
    printf("%s rows %d cols %d bits %d g %d up g %d mis %d lpr %d worst rel %.3g\n", bad ? "FAIL" : "ok  ", c.rows, c.cols, c.bits, c.group, gsz[1], mis, lpr, worst);
  }
  printf("digest %016llx\nfails %d\n", digest, fails); return fails != 0;
}
