// Helpers shared by every kernel file; the crate prepends this to the concatenated sources.
// NVRTC runs without an include path (a driver-only host has no CUDA headers), so nothing here
// includes a header: f16 conversions are PTX `cvt`, BF16 is the top half of an f32, and the
// math functions (expf, tanhf, sincosf, ...) are NVRTC builtins, compiled without fast-math so
// they keep their documented ulp bounds.

typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;

#define F32_INF __int_as_float(0x7f800000)

// Device bytes [lo, hi) into L2, a 128-byte line per thread of the block per step (a hint: no
// value changes).
__device__ __forceinline__ void prefetch_l2(u64 lo, u64 hi) {
    for (u64 a = (lo & ~(u64)127) + 128 * (u64)threadIdx.x; a < hi; a += 128 * (u64)blockDim.x)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(a));
}

// Programmatic dependent launch (launch.rs `launch_kernel`): a kernel may be started while the
// stream's previous kernel still runs. Every kernel calls this first: it waits until that kernel
// has completed and its writes are visible, then lets the stream's next kernel be started in turn
// (which waits here the same way). A no-op before sm_90 and for a launch without the attribute.
__device__ __forceinline__ void grid_dep_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }

// Round to nearest even, as half::f16::from_f32 on the host.
__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ bool finite_f32(float x) {
    return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u;
}

// Sum over the 32 lanes of a warp; every lane gets the result.
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over a block of `blockDim.x` (a multiple of 32, at most 1024) threads; every thread gets it.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float part[32];
    __shared__ float total;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    if (lane == 0) part[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float s = lane < (int)(blockDim.x >> 5) ? part[lane] : 0.0f;
        s = warp_sum(s);
        if (lane == 0) total = s;
    }
    __syncthreads();
    float r = total;
    __syncthreads();
    return r;
}

__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }

// GELU, tanh approximation (gelu_pytorch_tanh).
__device__ __forceinline__ float gelu_tanh_f(float x) {
    const float c = 0.7978845608028654f; // sqrt(2/pi)
    return 0.5f * x * (1.0f + tanhf(c * (x + 0.044715f * x * x * x)));
}

// act(a) * b of a gated MLP: act 0 GeGLU (tanh), 1 SwiGLU, 2 SwiGLU with a <= limit and b in
// [-limit, limit].
__device__ __forceinline__ float glu_f(float a, float b, int act, float limit) {
    switch (act) {
        case 0: return gelu_tanh_f(a) * b;
        case 1: return silu_f(a) * b;
        default: return silu_f(fminf(a, limit)) * fminf(fmaxf(b, -limit), limit);
    }
}

// `log(1 + e^x)` as mlx's nn.softplus: max(x, 0) + log1p(e^-|x|).
__device__ __forceinline__ float softplus_f(float x) {
    return fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x)));
}

// Grid-stride loop over `n` elements.
#define FOR_EACH(i, n) \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (u64)gridDim.x * blockDim.x)
