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

// rms_norm_add of one `dim` piece q into p (p <- (p + rms_norm(q)) * s; mode -1: add_scaled's
// p <- (p + q) * s), then the pre-norms of the new p (piece `piece` of the outputs): each thread
// reads back the values it wrote, and every value is rounded as rms_norm and mul_cols round it,
// so the outputs are those of the separate kernels.
__device__ __forceinline__ void add_pre_piece(const float* q, float* p, u64 piece, int dim,
                                              int mode, const unsigned char* base, u64 w_off,
                                              float c, float eps, float s, u64 cols,
                                              const PreNorms& pre) {
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
        float* out = (float*)pre.out[o] + piece * dim;
        const u16* cw = (const u16*)(base + pre.col_off[o]);
        for (int i = threadIdx.x; i < dim; i += blockDim.x) {
            float v = p[i] * (f * rms_scale(base, pre.w_off[o], pre.mode[o], i));
            if (pre.has_col[o]) v *= bf16_to_f32(cw[(piece * dim + i) % cols]) * pre.col_c[o];
            out[i] = v;
        }
    }
}

// add_pre_piece over every `dim` piece of src and x, one block each.
extern "C" __global__ void rms_norm_add_pre(const float* src, float* x, int dim, int mode,
                                            const unsigned char* base, u64 w_off, float c,
                                            float eps, float s, u64 cols, PreNorms pre) {
    u64 b = blockIdx.x;
    add_pre_piece(src + b * dim, x + b * dim, b, dim, mode, base, w_off, c, eps, s, cols, pre);
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
    u64 blk = blockIdx.x;
    float* pa = a + blk * dim;
    const float* pb = b + blk * dim;
    float ra = rms_factor(pa, dim, a_mode, a_c, eps);
    float rb = rms_factor(pb, dim, b_mode, b_c, eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = __fmul_rn(pa[i], ra * rms_scale(base, a_off, a_mode, i));
        pa[i] = (v + __fmul_rn(pb[i], rb * rms_scale(base, b_off, b_mode, i))) * 1.0f;
    }
    add_pre_piece(pa, x + blk * dim, blk, dim, mode, base, w_off, c, eps, s, cols, pre);
}

// rms_norm of the head at p (dim = head_dim <= 512) then rope at position `pos`, by one block: the
// normalized head is kept in v (shared memory), each value rounded as rms_norm stores it and
// rotated with rope's arithmetic.
__device__ __forceinline__ void norm_rope_head(float* p, float* v, int dim, int mode,
                                               const unsigned char* base, u64 w_off, float c,
                                               float eps, int rotated, int style,
                                               const float* inv_freq, int pos, float mscale) {
    float f = rms_factor(p, dim, mode, c, eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        v[i] = __fmul_rn(p[i], f * rms_scale(base, w_off, mode, i));
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
        float f = rms_factor(pv, dim, n.mode[2], n.c[2], eps);
        for (int i = threadIdx.x; i < dim; i += blockDim.x)
            pv[i] = pv[i] * (f * rms_scale(base, n.w_off[2], n.mode[2], i));
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
        norm_rope_kv(q, k, v, dim, hq, hk, n, base, eps, rotated, style, inv_freq, pos0, mscale, \
                     ks, vs, t_rows, rows, ring, CONV());                                        \
    }

NORM_ROPE_KV(rms_norm_rope_kv_f16, u16, ToF16)
NORM_ROPE_KV(rms_norm_rope_kv_f32, float, ToF32)
