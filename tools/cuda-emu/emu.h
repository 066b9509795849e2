// A CPU stand-in for the CUDA built-ins that ops/quant.cu uses, so that the kernel's own source
// runs on a machine without a GPU: one std::thread per CUDA thread of a block, a barrier for the
// warp shuffles (every lane of a block shuffles the same number of times), blocks one after the
// other. For checking the kernel's indexing and arithmetic (crates/cuda/tests/kernel_emulation.rs),
// not its speed.
#include <cstdint>
#include <cstring>
#include <cmath>
#include <thread>
#include <barrier>
#include <vector>
#include <algorithm>
using std::min; using std::max;
typedef unsigned long long u64; typedef unsigned int u32; typedef unsigned short u16;
#define __device__
#define __forceinline__ inline
#define __global__
#define __launch_bounds__(...)
// One block after another: nothing runs beside the kernel, so nothing to wait for.
inline void grid_dep_wait() {}
inline void prefetch_l2(u64, u64) {}
struct dim3e { unsigned x, y, z; };
thread_local dim3e threadIdx, blockIdx;
dim3e gridDim;
inline float __uint_as_float(u32 u) { float f; memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
struct uint2 { u32 x, y; };
inline uint2 make_uint2(u32 a, u32 b) { return {a, b}; }
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
struct uint4 { u32 x, y, z, w; };
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }
std::barrier<>* bar; float slot[1024];
inline float __shfl_xor_sync(u32, float v, int o) {
  int t = threadIdx.x; slot[t] = v; bar->arrive_and_wait();
  float r = slot[(t & ~31) | ((t & 31) ^ o)]; bar->arrive_and_wait(); return r;
}
inline float silu_f(float x) { return x / (1.0f + expf(-x)); }
inline float gelu_tanh_f(float x) { const float c = 0.7978845608028654f; return 0.5f * x * (1.0f + tanhf(c * (x + 0.044715f * x * x * x))); }
inline float glu_f(float a, float b, int act, float limit) {
  switch (act) { case 0: return gelu_tanh_f(a) * b; case 1: return silu_f(a) * b; default: return silu_f(fminf(a, limit)) * fminf(fmaxf(b, -limit), limit); } }
// Enough of the rest for quant.cu's other kernels (qmatmul, qembed, argmax) to compile beside the
// decode products; the emulation never runs them.
dim3e blockDim;
inline float warp_sum(float v) { for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o); return v; }
inline u32 __float_as_uint(float f) { u32 u; memcpy(&u, &f, 4); return u; }
inline void __syncthreads() { bar->arrive_and_wait(); }
#define __shared__ static thread_local
#define FOR_EACH(i, n) for (u64 i = 0; i < (u64)(n); ++i)
