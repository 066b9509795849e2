// Data movement and elementwise maps over row-major [rows, cols] f32 activations (the norms are in
// norm.cu).

// flag <- 1 if any of x[0..n) is NaN or infinite (flag starts at 0; every writer writes 1).
extern "C" __global__ void all_finite(const float* x, u64 n, int* flag) {
    grid_dep_wait();
    FOR_EACH(i, n) {
        if (!finite_f32(x[i])) *flag = 1;
    }
}

// out[j, :] = x[rows[j], :].
extern "C" __global__ void gather_rows(const float* x, u64 cols, const u32* rows, u64 n_rows,
                                       float* out) {
    grid_dep_wait();
    FOR_EACH(i, n_rows * cols) {
        u64 j = i / cols, c = i % cols;
        out[i] = x[(u64)rows[j] * cols + c];
    }
}

// gather_rows for many outputs in one launch: row j of the stacked rows (n_rows of them) is x's
// row tab[n_rows + j], written to the row at device address tab[j].
extern "C" __global__ void gather_rows_many(const float* x, u64 cols, const u64* tab, u64 n_rows) {
    grid_dep_wait();
    FOR_EACH(i, n_rows * cols) {
        u64 j = i / cols, c = i % cols;
        ((float*)tab[j])[c] = x[tab[n_rows + j] * cols + c];
    }
}

// Many buffers joined into one (for one readback): tab holds n device addresses, then n + 1
// offsets into out; buffer b's tab[n + b + 1] - tab[n + b] floats go to out + tab[n + b].
extern "C" __global__ void join_parts(const u64* tab, u64 n, float* out) {
    grid_dep_wait();
    for (u64 b = blockIdx.x; b < n; b += gridDim.x) {
        const float* src = (const float*)tab[b];
        u64 off = tab[n + b], len = tab[n + b + 1] - off;
        for (u64 i = threadIdx.x; i < len; i += blockDim.x) out[off + i] = src[i];
    }
}

// Up to SPLIT_PARTS parts of every group of `group` columns of x in one launch: part p (columns
// off[p] .. off[p] + len[p] of each group) into out[p] (its groups one after another). One thread
// per element of x.
#define SPLIT_PARTS 4
struct SplitParts {
    u64 out[SPLIT_PARTS];
    int off[SPLIT_PARTS];
    int len[SPLIT_PARTS];
    int n;
};
extern "C" __global__ void split_parts(const float* x, u64 n_groups, int group, SplitParts sp) {
    grid_dep_wait();
    FOR_EACH(i, n_groups * (u64)group) {
        u64 g = i / group;
        int c = (int)(i % group);
        for (int p = 0; p < sp.n; ++p) {
            if (c >= sp.off[p] && c < sp.off[p] + sp.len[p]) {
                ((float*)sp.out[p])[g * sp.len[p] + (c - sp.off[p])] = x[i];
                break;
            }
        }
    }
}

// x <- op(x): 0 scale(a), 1 softcap(a), 2 clamp(a, b), 3 silu, 4 gelu-tanh, 5 sigmoid.
extern "C" __global__ void unary(float* x, u64 n, int op, float a, float b) {
    grid_dep_wait();
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
    grid_dep_wait();
    const u16* w = (const u16*)(base + w_off);
    FOR_EACH(i, n) { x[i] *= bf16_to_f32(w[i % cols]) * c; }
}

__device__ __forceinline__ float dot4(float4 a, float4 b) {
    return fmaf(a.x, b.x, fmaf(a.y, b.y, fmaf(a.z, b.z, a.w * b.w)));
}

// Threads of a block of the one-output-per-block products below (`linear`, `matmul_bf16`).
#define DOT_THREADS 128

// The block's sum of `a` (each thread's partial): warp sums, then the warps' sums in order; every
// thread gets it. Ends with a barrier, so the block may call it again.
__device__ __forceinline__ float block_dot_sum(float a) {
    __shared__ float ws[DOT_THREADS / 32];
    a = warp_sum(a);
    if ((threadIdx.x & 31) == 0) ws[threadIdx.x >> 5] = a;
    __syncthreads();
    float s = (ws[0] + ws[1]) + (ws[2] + ws[3]);
    __syncthreads();
    return s;
}

// y[t, r] = sum_c x[t, c] * w[r, c] for an f32 weight w [rows, cols] held on the device (an
// unquantized router, 256 x 4096 per layer): a block of DOT_THREADS per output, so that a few
// hundred outputs still keep every SM loading. With cols % 4 == 0 each thread reads 16-byte
// pieces, four of them in flight (four partial sums, added in a fixed order); the block's sums
// are added by block_dot_sum.
extern "C" __global__ void linear(const float* x, const float* w, u64 t, u64 rows, u64 cols,
                                  float* y) {
    grid_dep_wait();
    int th = threadIdx.x;
    for (u64 i = blockIdx.x; i < t * rows; i += gridDim.x) {
        const float* xr = x + (i / rows) * cols;
        const float* wr = w + (i % rows) * cols;
        float acc = 0.0f;
        if ((cols & 3) == 0) {
            const float4* x4 = (const float4*)xr;
            const float4* w4 = (const float4*)wr;
            u64 n4 = cols / 4, c = th;
            float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            for (; c + 3 * DOT_THREADS < n4; c += 4 * DOT_THREADS) {
                float4 xv[4], wv[4];
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    xv[k] = x4[c + DOT_THREADS * k];
                    wv[k] = w4[c + DOT_THREADS * k];
                }
#pragma unroll
                for (int k = 0; k < 4; ++k) a[k] += dot4(xv[k], wv[k]);
            }
            for (; c < n4; c += DOT_THREADS) a[0] += dot4(x4[c], w4[c]);
            acc = (a[0] + a[1]) + (a[2] + a[3]);
        } else {
            for (u64 c = th; c < cols; c += DOT_THREADS) acc = fmaf(xr[c], wr[c], acc);
        }
        acc = block_dot_sum(acc);
        if (th == 0) y[i] = acc;
    }
}

// y[t, r] = sum_c x[t, c] * w[r, c], w BF16 [rows, cols] at byte offset w_off of the resident
// buffer, f32 accumulation (an unquantized router, FlashHead's centroids): a block of
// DOT_THREADS per output as `linear`. With cols % 8 == 0 and w 16-byte aligned each thread reads
// 8 weights (16 bytes) and their 8 columns of x per step, two steps in flight.
extern "C" __global__ void matmul_bf16(const float* x, u64 t, u64 rows, u64 cols,
                                       const unsigned char* base, u64 w_off, float* y) {
    grid_dep_wait();
    const u16* w = (const u16*)(base + w_off);
    int th = threadIdx.x;
    bool wide = (cols & 7) == 0 && (w_off & 15) == 0;
    for (u64 i = blockIdx.x; i < t * rows; i += gridDim.x) {
        const float* xr = x + (i / rows) * cols;
        const u16* wr = w + (i % rows) * cols;
        float acc = 0.0f;
        if (wide) {
            const uint4* w8 = (const uint4*)wr;
            const float4* x4 = (const float4*)xr;
            u64 n8 = cols / 8, c = th;
            float a[2] = {0.0f, 0.0f};
            for (; c < n8; c += 2 * DOT_THREADS) {
#pragma unroll
                for (int k = 0; k < 2; ++k) {
                    u64 cc = c + DOT_THREADS * k;
                    if (cc >= n8) break;
                    uint4 wv = w8[cc];
                    float4 lo = x4[2 * cc], hi = x4[2 * cc + 1];
                    // Weight 2i is word i's low half, 2i + 1 its high half.
                    float4 wl = make_float4(__uint_as_float(wv.x << 16),
                                            __uint_as_float(wv.x & 0xffff0000u),
                                            __uint_as_float(wv.y << 16),
                                            __uint_as_float(wv.y & 0xffff0000u));
                    float4 wh = make_float4(__uint_as_float(wv.z << 16),
                                            __uint_as_float(wv.z & 0xffff0000u),
                                            __uint_as_float(wv.w << 16),
                                            __uint_as_float(wv.w & 0xffff0000u));
                    a[k] += dot4(lo, wl) + dot4(hi, wh);
                }
            }
            acc = a[0] + a[1];
        } else {
            for (u64 c = th; c < cols; c += DOT_THREADS) acc = fmaf(xr[c], bf16_to_f32(wr[c]), acc);
        }
        acc = block_dot_sum(acc);
        if (th == 0) y[i] = acc;
    }
}

// x <- x * sigmoid(g).
extern "C" __global__ void mul_sigmoid(float* x, const float* g, u64 n) {
    grid_dep_wait();
    FOR_EACH(i, n) { x[i] *= sigmoid_f(g[i]); }
}

// x <- x * silu(z) (the gate of a gated RMSNorm).
extern "C" __global__ void mul_silu(float* x, const float* z, u64 n) {
    grid_dep_wait();
    FOR_EACH(i, n) { x[i] *= silu_f(z[i]); }
}

// x[r, :] <- x[r, :] * sigmoid(g[r]).
extern "C" __global__ void mul_rows_sigmoid(float* x, const float* g, u64 n, u64 cols) {
    grid_dep_wait();
    FOR_EACH(i, n) { x[i] *= sigmoid_f(g[i / cols]); }
}

// x <- (x + y) * s.
extern "C" __global__ void add_scaled(float* x, const float* y, u64 n, float s) {
    grid_dep_wait();
    FOR_EACH(i, n) { x[i] = (x[i] + y[i]) * s; }
}

// Up to SCATTER_PAIRS (row, weight) pairs, passed by value.
#define SCATTER_PAIRS 64
struct Pairs {
    u32 rows[SCATTER_PAIRS];
    float w[SCATTER_PAIRS];
};

// acc[p.rows[j], c] += p.w[j] * y[j, c] (one fma) for j < n_pairs in order (one thread per column, so rows
// routed to twice accumulate in the caller's order, as the CPU does).
extern "C" __global__ void scatter_add(float* acc, const float* y, Pairs p, int n_pairs,
                                       u64 cols) {
    grid_dep_wait();
    FOR_EACH(c, cols) {
        for (int j = 0; j < n_pairs; ++j) {
            u64 o = (u64)p.rows[j] * cols + c;
            acc[o] = __fmaf_rn(p.w[j], y[(u64)j * cols + c], acc[o]);
        }
    }
}

// scatter_add of many outputs in one launch, each row of acc by one thread per column: row t of
// acc ([n, cols]) gets w * y for its terms e = tab[t] .. tab[t + 1] in order (the row at device
// address tab[n + 1 + e], the weight's bits in tab[n + 1 + n_terms + e]), one fma each as
// scatter_add's, so the result is the scatter_adds' in the terms' order.
extern "C" __global__ void scatter_add_many(float* acc, u64 n, u64 cols, const u64* tab,
                                            u64 n_terms) {
    grid_dep_wait();
    const u64* at = tab + n + 1;
    const u64* wb = at + n_terms;
    FOR_EACH(i, n * cols) {
        u64 t = i / cols, c = i % cols;
        float a = acc[i];
        for (u64 e = tab[t]; e < tab[t + 1]; ++e) a += __uint_as_float((u32)wb[e]) * ((const float*)at[e])[c];
        acc[i] = a;
    }
}

// g <- act(g) * u: 0 GeGLU, 1 SwiGLU, 2 SwiGLU with gate <= limit and up in [-limit, limit].
extern "C" __global__ void glu_act(float* g, const float* u, u64 n, int act, float limit) {
    grid_dep_wait();
    FOR_EACH(i, n) g[i] = glu_f(g[i], u[i], act, limit);
}
