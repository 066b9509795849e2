// RMSNorm, alone and fused: with the residual add, with the next blocks' pre-norms, and per head
// with RoPE (after attention.cu in the translation unit: rms_norm_rope rotates with rope_pair).

// RMSNorm of each `dim` piece of src into x (the same buffer when in place), one block per
// piece: x <- src * rsqrt(mean(src^2) + eps) * s, mode 0 s = 1, 1 s = w, 2 s = 1 + w, 3 s = c
// (folded into the rsqrt first: c / sqrt(mean + eps)); w BF16 at w_off of the resident buffer.
// The piece's factor: c / sqrt(mean(q^2) + eps) for mode 3, else 1 / sqrt(...) (every thread
// of the block gets it).
__device__ __forceinline__ float rms_mean_sq(const float* q, int dim) {
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += q[i] * q[i];
    return block_sum(ss) / (float)dim;
}

__device__ __forceinline__ float rms_factor(const float* q, int dim, int mode, float c,
                                            float eps) {
    float ms = rms_mean_sq(q, dim);
    return (mode == 3 ? c : 1.0f) / sqrtf(ms + eps);
}

// Element i's scale s of a norm of `mode` (w BF16 at w_off of the resident buffer).
__device__ __forceinline__ float rms_scale(const unsigned char* base, u64 w_off, int mode, int i) {
    const u16* w = (const u16*)(base + w_off);
    if (mode == 1) return bf16_to_f32(w[i]);
    if (mode == 2) return 1.0f + bf16_to_f32(w[i]);
    return 1.0f;
}

extern "C" __global__ void rms_norm(const float* src, float* x, int dim, int mode,
                                    const unsigned char* base, u64 w_off, float c, float eps) {
    const float* q = src + (u64)blockIdx.x * dim;
    float* p = x + (u64)blockIdx.x * dim;
    float r = rms_factor(q, dim, mode, c, eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        p[i] = q[i] * (r * rms_scale(base, w_off, mode, i));
}

// x <- (x + rms_norm(src)) * s per `dim` piece (src unchanged, another buffer): rms_norm's value,
// rounded as it stores it, then add_scaled's arithmetic.
extern "C" __global__ void rms_norm_add(const float* src, float* x, int dim, int mode,
                                        const unsigned char* base, u64 w_off, float c, float eps,
                                        float s) {
    const float* q = src + (u64)blockIdx.x * dim;
    float* p = x + (u64)blockIdx.x * dim;
    float r = rms_factor(q, dim, mode, c, eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        p[i] = (p[i] + __fmul_rn(q[i], r * rms_scale(base, w_off, mode, i))) * s;
}

// The pre-norms of rms_norm_add_pre, up to PRE_NORMS: output o = rms_norm of the new x with
// mode[o] / w_off[o] / c[o] into out[o], then, with has_col[o], mul_cols by the BF16 vector at
// col_off[o] (one value per column of the `cols`-wide rows) times col_c[o].
#define PRE_NORMS 4
struct PreNorms {
    u64 out[PRE_NORMS];
    u64 w_off[PRE_NORMS];
    u64 col_off[PRE_NORMS];
    float c[PRE_NORMS];
    float col_c[PRE_NORMS];
    int mode[PRE_NORMS];
    int has_col[PRE_NORMS];
    int n;
};

// rms_norm_add (x <- (x + rms_norm(src)) * s per `dim` piece; mode -1: add_scaled's
// x <- (x + src) * s), then the pre-norms of the new x: each thread reads back the values it
// wrote, and every value is rounded as rms_norm and mul_cols round it, so the outputs are those
// of the separate kernels.
extern "C" __global__ void rms_norm_add_pre(const float* src, float* x, int dim, int mode,
                                            const unsigned char* base, u64 w_off, float c,
                                            float eps, float s, u64 cols, PreNorms pre) {
    const float* q = src + (u64)blockIdx.x * dim;
    float* p = x + (u64)blockIdx.x * dim;
    if (mode < 0) {
        for (int i = threadIdx.x; i < dim; i += blockDim.x) p[i] = (p[i] + q[i]) * s;
    } else {
        float r = rms_factor(q, dim, mode, c, eps);
        for (int i = threadIdx.x; i < dim; i += blockDim.x)
            p[i] = (p[i] + __fmul_rn(q[i], r * rms_scale(base, w_off, mode, i))) * s;
    }
    if (pre.n == 0) return;
    float ms = rms_mean_sq(p, dim);
    for (int o = 0; o < pre.n; ++o) {
        float f = (pre.mode[o] == 3 ? pre.c[o] : 1.0f) / sqrtf(ms + eps);
        float* out = (float*)pre.out[o] + (u64)blockIdx.x * dim;
        const u16* cw = (const u16*)(base + pre.col_off[o]);
        for (int i = threadIdx.x; i < dim; i += blockDim.x) {
            float v = p[i] * (f * rms_scale(base, pre.w_off[o], pre.mode[o], i));
            if (pre.has_col[o])
                v *= bf16_to_f32(cw[((u64)blockIdx.x * dim + i) % cols]) * pre.col_c[o];
            out[i] = v;
        }
    }
}

// rms_norm of each head (dim = head_dim, one block per (row, head), heads per row) then rope from
// pos0, in one pass: the normalized head is kept in shared memory (head_dim <= 512), each value
// rounded as rms_norm stores it and rotated with rope's arithmetic.
extern "C" __global__ void rms_norm_rope(float* x, int dim, int mode, const unsigned char* base,
                                         u64 w_off, float c, float eps, int heads, int rotated,
                                         int style, const float* inv_freq, int pos0,
                                         float mscale) {
    __shared__ float v[512];
    float* p = x + (u64)blockIdx.x * dim;
    int r = blockIdx.x / heads;
    float f = rms_factor(p, dim, mode, c, eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        v[i] = __fmul_rn(p[i], f * rms_scale(base, w_off, mode, i));
    __syncthreads();
    int half = rotated / 2;
    for (int i = threadIdx.x; i < half; i += blockDim.x)
        rope_pair(v, p, i, half, style, inv_freq, pos0 + r, mscale);
    for (int i = rotated + threadIdx.x; i < dim; i += blockDim.x) p[i] = v[i];
}
