// RMSNorm, alone and fused: with the residual add, with the next blocks' pre-norms, and per head
// with RoPE (after attention.cu in the translation unit: rms_norm_rope rotates with rope_pair).

// RMSNorm of each `dim` piece of src into x (the same buffer when in place), one block per
// piece: x <- src * rsqrt(mean(src^2) + eps) * s, mode 0 s = 1, 1 s = w, 2 s = 1 + w, 3 s = c
// (folded into the rsqrt first: c / sqrt(mean + eps)); w BF16 at w_off of the resident buffer.
//
// A thread holds the elements i = threadIdx.x + j * blockDim.x (j < NORM_J) of a piece in
// registers (the launches check dim <= NORM_J * blockDim.x: `norm_blocks` in norm.rs): every
// load of a pass is issued before any value is used, so a pass waits for memory once rather than
// once per element (a load after a store to global memory cannot be moved ahead of it). The sums
// are the strided loop's, in the same order.
#define NORM_J 16

// Whether element j of this thread lies in a piece of `dim`.
__device__ __forceinline__ bool norm_held(int j, int dim) {
    return (int)(threadIdx.x + j * blockDim.x) < dim;
}

// This thread's elements of the piece at q (0 past its end).
__device__ __forceinline__ void norm_load(const float* q, int dim, float* v) {
#pragma unroll
    for (int j = 0; j < NORM_J; ++j) v[j] = norm_held(j, dim) ? q[threadIdx.x + j * blockDim.x] : 0.0f;
}

// Element i's scale s of a norm of `mode` (w BF16 at w_off of the resident buffer).
__device__ __forceinline__ float rms_scale(const unsigned char* base, u64 w_off, int mode, int i) {
    const u16* w = (const u16*)(base + w_off);
    if (mode == 1) return bf16_to_f32(w[i]);
    if (mode == 2) return 1.0f + bf16_to_f32(w[i]);
    return 1.0f;
}

// This thread's scales of a norm of `mode` (rms_scale's values): the BF16 weights are all loaded
// before any is converted (a conversion inside the load's branch would wait for each load in
// turn).
__device__ __forceinline__ void norm_scales(const unsigned char* base, u64 w_off, int mode, int dim,
                                            float* s) {
    const u16* w = (const u16*)(base + w_off);
    bool weighted = mode == 1 || mode == 2;
    u16 raw[NORM_J];
#pragma unroll
    for (int j = 0; j < NORM_J; ++j)
        raw[j] = weighted && norm_held(j, dim) ? w[threadIdx.x + j * blockDim.x] : (u16)0;
#pragma unroll
    for (int j = 0; j < NORM_J; ++j)
        s[j] = mode == 1 ? bf16_to_f32(raw[j]) : mode == 2 ? 1.0f + bf16_to_f32(raw[j]) : 1.0f;
}

// mean(v^2) over the piece (every thread of the block gets it).
__device__ __forceinline__ float norm_mean_sq(const float* v, int dim) {
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < NORM_J; ++j)
        if (norm_held(j, dim)) ss += v[j] * v[j];
    return block_sum(ss) / (float)dim;
}

// The piece's factor: c / sqrt(mean(v^2) + eps) for mode 3, else 1 / sqrt(...).
__device__ __forceinline__ float rms_factor(const float* v, int dim, int mode, float c, float eps) {
    return (mode == 3 ? c : 1.0f) / sqrtf(norm_mean_sq(v, dim) + eps);
}

// This thread's elements v into the piece at p.
__device__ __forceinline__ void norm_store(float* p, int dim, const float* v) {
#pragma unroll
    for (int j = 0; j < NORM_J; ++j)
        if (norm_held(j, dim)) p[threadIdx.x + j * blockDim.x] = v[j];
}

extern "C" __global__ void rms_norm(const float* src, float* x, int dim, int mode,
                                    const unsigned char* base, u64 w_off, float c, float eps) {
    grid_dep_wait();
    float v[NORM_J], s[NORM_J];
    norm_load(src + (u64)blockIdx.x * dim, dim, v);
    norm_scales(base, w_off, mode, dim, s);
    float r = rms_factor(v, dim, mode, c, eps);
#pragma unroll
    for (int j = 0; j < NORM_J; ++j) v[j] = v[j] * (r * s[j]);
    norm_store(x + (u64)blockIdx.x * dim, dim, v);
}

// x <- (x + rms_norm(src)) * s per `dim` piece (src unchanged, another buffer): rms_norm's value,
// rounded as it stores it, then add_scaled's arithmetic.
extern "C" __global__ void rms_norm_add(const float* src, float* x, int dim, int mode,
                                        const unsigned char* base, u64 w_off, float c, float eps,
                                        float s) {
    grid_dep_wait();
    float q[NORM_J], p[NORM_J], w[NORM_J];
    float* at = x + (u64)blockIdx.x * dim;
    norm_load(src + (u64)blockIdx.x * dim, dim, q);
    norm_load(at, dim, p);
    norm_scales(base, w_off, mode, dim, w);
    float r = rms_factor(q, dim, mode, c, eps);
#pragma unroll
    for (int j = 0; j < NORM_J; ++j) p[j] = (p[j] + __fmul_rn(q[j], r * w[j])) * s;
    norm_store(at, dim, p);
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

// rms_norm_add of one `dim` piece (this thread's elements q, with the norm's scales w) into the
// piece at `at` (its elements p): p <- (p + rms_norm(q)) * s; mode -1: add_scaled's
// p <- (p + q) * s. Then the pre-norms of the new p (piece `piece` of the outputs). Every value is
// rounded as rms_norm, add_scaled and mul_cols round it, so the outputs are those of the separate
// kernels.
__device__ __forceinline__ void add_pre_piece(const float* q, const float* w, float* p, float* at,
                                              u64 piece, int dim, int mode,
                                              const unsigned char* base, float c, float eps,
                                              float s, u64 cols, const PreNorms& pre) {
    if (mode < 0) {
#pragma unroll
        for (int j = 0; j < NORM_J; ++j) p[j] = (p[j] + q[j]) * s;
    } else {
        float r = rms_factor(q, dim, mode, c, eps);
#pragma unroll
        for (int j = 0; j < NORM_J; ++j) p[j] = (p[j] + __fmul_rn(q[j], r * w[j])) * s;
    }
    norm_store(at, dim, p);
    if (pre.n == 0) return;
    float ms = norm_mean_sq(p, dim);
    for (int o = 0; o < pre.n; ++o) {
        float f = (pre.mode[o] == 3 ? pre.c[o] : 1.0f) / sqrtf(ms + eps);
        float sc[NORM_J], v[NORM_J];
        norm_scales(base, pre.w_off[o], pre.mode[o], dim, sc);
        const u16* cw = (const u16*)(base + pre.col_off[o]);
        u64 c0 = piece * dim % cols;  // column of the piece's first value (dim <= cols)
        bool has_col = pre.has_col[o];
        u16 col[NORM_J];  // loaded before any is used, as norm_scales does
#pragma unroll
        for (int j = 0; j < NORM_J; ++j) {
            u64 ci = c0 + threadIdx.x + j * blockDim.x;
            if (ci >= cols) ci -= cols;
            col[j] = has_col && norm_held(j, dim) ? cw[ci] : (u16)0;
        }
#pragma unroll
        for (int j = 0; j < NORM_J; ++j) {
            v[j] = p[j] * (f * sc[j]);
            if (has_col) v[j] *= bf16_to_f32(col[j]) * pre.col_c[o];
        }
        norm_store((float*)pre.out[o] + piece * dim, dim, v);
    }
}

// add_pre_piece over every `dim` piece of src and x, one block each.
extern "C" __global__ void rms_norm_add_pre(const float* src, float* x, int dim, int mode,
                                            const unsigned char* base, u64 w_off, float c,
                                            float eps, float s, u64 cols, PreNorms pre) {
    grid_dep_wait();
    u64 b = blockIdx.x;
    float q[NORM_J], p[NORM_J], w[NORM_J];
    norm_load(src + b * dim, dim, q);
    norm_load(x + b * dim, dim, p);
    norm_scales(base, w_off, mode, dim, w);
    add_pre_piece(q, w, p, x + b * dim, b, dim, mode, base, c, eps, s, cols, pre);
}

// Two block outputs into the residual (Gemma 4's shared MLP and routed experts): per `dim`
// piece a <- rms_norm(a) + rms_norm(b) (each rounded as rms_norm stores it, the sum as
// rms_norm_add's with s = 1), then rms_norm_add_pre's work with src = a: the separate kernels'
// values, in one launch.
extern "C" __global__ void rms_norm2_add_pre(float* a, const float* b, float* x, int dim,
                                             int a_mode, u64 a_off, float a_c, int b_mode,
                                             u64 b_off, float b_c, int mode,
                                             const unsigned char* base, u64 w_off, float c,
                                             float eps, float s, u64 cols, PreNorms pre) {
    grid_dep_wait();
    u64 blk = blockIdx.x;
    float av[NORM_J], bv[NORM_J], p[NORM_J], as[NORM_J], bs[NORM_J], w[NORM_J];
    norm_load(a + blk * dim, dim, av);
    norm_load(b + blk * dim, dim, bv);
    norm_load(x + blk * dim, dim, p);
    norm_scales(base, a_off, a_mode, dim, as);
    norm_scales(base, b_off, b_mode, dim, bs);
    norm_scales(base, w_off, mode, dim, w);
    float ra = rms_factor(av, dim, a_mode, a_c, eps);
    float rb = rms_factor(bv, dim, b_mode, b_c, eps);
#pragma unroll
    for (int j = 0; j < NORM_J; ++j) {
        float v = __fmul_rn(av[j], ra * as[j]);
        av[j] = (v + __fmul_rn(bv[j], rb * bs[j])) * 1.0f;
    }
    norm_store(a + blk * dim, dim, av);
    add_pre_piece(av, w, p, x + blk * dim, blk, dim, mode, base, c, eps, s, cols, pre);
}

// rms_norm of the head at p (dim = head_dim <= 512) then rope at position `pos`, by one block: the
// normalized head is kept in v (shared memory), each value rounded as rms_norm stores it and
// rotated with rope's arithmetic.
__device__ __forceinline__ void norm_rope_head(float* p, float* v, int dim, int mode,
                                               const unsigned char* base, u64 w_off, float c,
                                               float eps, int rotated, int style,
                                               const float* inv_freq, int pos, float mscale) {
    float x[NORM_J], w[NORM_J];
    norm_load(p, dim, x);
    norm_scales(base, w_off, mode, dim, w);
    float f = rms_factor(x, dim, mode, c, eps);
#pragma unroll
    for (int j = 0; j < NORM_J; ++j) x[j] = __fmul_rn(x[j], f * w[j]);
    norm_store(v, dim, x);
    __syncthreads();
    int half = rotated / 2;
    for (int i = threadIdx.x; i < half; i += blockDim.x)
        rope_pair(v, p, i, half, style, inv_freq, pos, mscale);
    for (int i = rotated + threadIdx.x; i < dim; i += blockDim.x) p[i] = v[i];
}

// rms_norm of each head (dim = head_dim, one block per (row, head), heads per row) then rope from
// pos0, in one pass (norm_rope_head).
extern "C" __global__ void rms_norm_rope(float* x, int dim, int mode, const unsigned char* base,
                                         u64 w_off, float c, float eps, int heads, int rotated,
                                         int style, const float* inv_freq, int pos0,
                                         float mscale) {
    grid_dep_wait();
    __shared__ float v[512];
    norm_rope_head(x + (u64)blockIdx.x * dim, v, dim, mode, base, w_off, c, eps, rotated, style,
                   inv_freq, pos0 + blockIdx.x / heads, mscale);
}

// The norms of a head of q, k and v ((mode, weight offset, constant) each; v_mode -1: v as it is).
struct QkvNorms {
    u64 w_off[3];
    float c[3];
    int mode[3];
};

// A layer's attention inputs into its KV cache, one block of 128 threads per (row, q or k head):
// blocks [0, hq) of a row run rms_norm_rope on q's heads; block hq + j on k's head j, then the
// no-rope norm of v's head j (n.mode[2] >= 0), and writes both at position pos0 + row of the
// cache (rows `rows`, a ring when `ring`; a ring row a later row of the chunk overwrites is
// skipped). The values are rms_norm_rope's and rms_norm's (as rounded), converted as kv_write
// converts them.
template <typename S, typename Conv>
__device__ void norm_rope_kv(float* q, float* k, float* v, int dim, int hq, int hk, QkvNorms n,
                             const unsigned char* base, float eps, int rotated, int style,
                             const float* inv_freq, int pos0, float mscale, S* ks, S* vs,
                             int t_rows, int rows, int ring, Conv conv) {
    __shared__ float sh[512];
    int per = hq + hk;
    int r = blockIdx.x / per, j = blockIdx.x % per;
    int o = j < hq ? 0 : 1, head = j < hq ? j : j - hq;
    float* p = o == 0 ? q + ((u64)r * hq + head) * dim : k + ((u64)r * hk + head) * dim;
    norm_rope_head(p, sh, dim, n.mode[o], base, n.w_off[o], n.c[o], eps, rotated, style, inv_freq,
                   pos0 + r, mscale);
    if (o == 0) return;
    __syncthreads();
    float* pv = v + ((u64)r * hk + head) * dim;
    if (n.mode[2] >= 0) {
        float x[NORM_J], w[NORM_J];
        norm_load(pv, dim, x);
        norm_scales(base, n.w_off[2], n.mode[2], dim, w);
        float f = rms_factor(x, dim, n.mode[2], n.c[2], eps);
#pragma unroll
        for (int j = 0; j < NORM_J; ++j) x[j] = x[j] * (f * w[j]);
        norm_store(pv, dim, x);
    }
    if (ring && r + rows < t_rows) return;
    int pos = pos0 + r;
    u64 at = (ring ? (u64)(pos % rows) : (u64)pos) * hk * dim + (u64)head * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        ks[at + i] = conv(p[i]);
        vs[at + i] = conv(pv[i]);
    }
}

#define NORM_ROPE_KV(NAME, S, CONV)                                                              \
    extern "C" __global__ void NAME(float* q, float* k, float* v, int dim, int hq, int hk,       \
                                    QkvNorms n, const unsigned char* base, float eps,            \
                                    int rotated, int style, const float* inv_freq, int pos0,     \
                                    float mscale, S* ks, S* vs, int t_rows, int rows, int ring) { \
        grid_dep_wait();                                                                         \
        norm_rope_kv(q, k, v, dim, hq, hk, n, base, eps, rotated, style, inv_freq, pos0, mscale, \
                     ks, vs, t_rows, rows, ring, CONV());                                        \
    }

NORM_ROPE_KV(rms_norm_rope_kv_f16, u16, ToF16)
NORM_ROPE_KV(rms_norm_rope_kv_f32, float, ToF32)
