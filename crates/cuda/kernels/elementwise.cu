// Data movement, norms and elementwise maps over row-major [rows, cols] f32 activations.

// flag <- 1 if any of x[0..n) is NaN or infinite (flag starts at 0; every writer writes 1).
extern "C" __global__ void all_finite(const float* x, u64 n, int* flag) {
    FOR_EACH(i, n) {
        if (!finite_f32(x[i])) *flag = 1;
    }
}

// out[j, :] = x[rows[j], :].
extern "C" __global__ void gather_rows(const float* x, u64 cols, const u32* rows, u64 n_rows,
                                       float* out) {
    FOR_EACH(i, n_rows * cols) {
        u64 j = i / cols, c = i % cols;
        out[i] = x[(u64)rows[j] * cols + c];
    }
}

// Part `part` (at offset `off` inside each group of `group` columns) of every group of x:
// out[g, 0..part) = x[g, off..off+part) over the n_groups groups of all rows.
extern "C" __global__ void split_part(const float* x, u64 n_groups, int group, int off, int part,
                                      float* out) {
    FOR_EACH(i, n_groups * (u64)part) {
        u64 g = i / part, c = i % part;
        out[i] = x[g * group + off + c];
    }
}

// x <- op(x): 0 scale(a), 1 softcap(a), 2 clamp(a, b), 3 silu, 4 gelu-tanh, 5 sigmoid.
extern "C" __global__ void unary(float* x, u64 n, int op, float a, float b) {
    FOR_EACH(i, n) {
        float v = x[i];
        switch (op) {
            case 0: v = v * a; break;
            case 1: v = a * tanhf(v / a); break;
            case 2: v = fminf(fmaxf(v, a), b); break;
            case 3: v = silu_f(v); break;
            case 4: v = gelu_tanh_f(v); break;
            default: v = sigmoid_f(v); break;
        }
        x[i] = v;
    }
}

// x[r, i] <- x[r, i] * (w[i] * c), w BF16 at byte offset w_off of the resident buffer.
extern "C" __global__ void mul_cols(float* x, u64 n, u64 cols, const unsigned char* base,
                                    u64 w_off, float c) {
    const u16* w = (const u16*)(base + w_off);
    FOR_EACH(i, n) { x[i] *= bf16_to_f32(w[i % cols]) * c; }
}

// y[t, r] = sum_c x[t, c] * w[r, c], w BF16 [rows, cols] at byte offset w_off of the resident
// buffer, f32 accumulation (an unquantized router).
extern "C" __global__ void matmul_bf16(const float* x, u64 t, u64 rows, u64 cols,
                                       const unsigned char* base, u64 w_off, float* y) {
    const u16* w = (const u16*)(base + w_off);
    FOR_EACH(i, t * rows) {
        u64 tt = i / rows, r = i % rows;
        const float* xr = x + tt * cols;
        const u16* wr = w + r * cols;
        float acc = 0.0f;
        for (u64 c = 0; c < cols; ++c) acc += xr[c] * bf16_to_f32(wr[c]);
        y[i] = acc;
    }
}

// x <- x * sigmoid(g).
extern "C" __global__ void mul_sigmoid(float* x, const float* g, u64 n) {
    FOR_EACH(i, n) { x[i] *= sigmoid_f(g[i]); }
}

// x <- x * silu(z) (the gate of a gated RMSNorm).
extern "C" __global__ void mul_silu(float* x, const float* z, u64 n) {
    FOR_EACH(i, n) { x[i] *= silu_f(z[i]); }
}

// x[r, :] <- x[r, :] * sigmoid(g[r]).
extern "C" __global__ void mul_rows_sigmoid(float* x, const float* g, u64 n, u64 cols) {
    FOR_EACH(i, n) { x[i] *= sigmoid_f(g[i / cols]); }
}

// x <- (x + y) * s.
extern "C" __global__ void add_scaled(float* x, const float* y, u64 n, float s) {
    FOR_EACH(i, n) { x[i] = (x[i] + y[i]) * s; }
}

// Up to SCATTER_PAIRS (row, weight) pairs, passed by value.
#define SCATTER_PAIRS 64
struct Pairs {
    u32 rows[SCATTER_PAIRS];
    float w[SCATTER_PAIRS];
};

// acc[p.rows[j], c] += p.w[j] * y[j, c] for j < n_pairs in order (one thread per column, so rows
// routed to twice accumulate in the caller's order, as the CPU does).
extern "C" __global__ void scatter_add(float* acc, const float* y, Pairs p, int n_pairs,
                                       u64 cols) {
    FOR_EACH(c, cols) {
        for (int j = 0; j < n_pairs; ++j) {
            u64 o = (u64)p.rows[j] * cols + c;
            acc[o] += p.w[j] * y[(u64)j * cols + c];
        }
    }
}

// g <- act(g) * u: 0 GeGLU, 1 SwiGLU, 2 SwiGLU with gate <= limit and up in [-limit, limit].
extern "C" __global__ void glu_act(float* g, const float* u, u64 n, int act, float limit) {
    FOR_EACH(i, n) g[i] = glu_f(g[i], u[i], act, limit);
}

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
