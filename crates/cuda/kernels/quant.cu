// MLX affine quantized products (2/4/8-bit, groups of 32/64/128 columns).
//
// Layout (mlx `quantize`): row r of a [rows, cols] matrix is cols*bits/8 bytes of little-endian
// u32 words holding 32/bits codes each, lowest bits first; column c of row r dequantizes to
// s[g] * q + b[g] with g = r * (cols / group) + c / group, s and b BF16. Tensors of the install
// are only 2-byte aligned, so codes are read as u16 pieces (2/4/8 codes, never straddling a
// group) and nothing assumes a 4-byte-aligned word.

// Rows per qmatmul block (one warp each), jobs per launch, rows of x per pass over a weight row
// (the launch in lib.rs uses the same numbers).
#define QM_ROWS 8
#define QM_JOBS 32
#define QM_TT 4
// Words of codes each lane loads per step (lane l reads words l, l + 32, l + 64, ... in that
// order whatever the step, so the value changes only how many loads are in flight, never a
// result; MFERENCE_CUDA_QM_UNROLL sets it for measurements, compile.rs).
#ifndef QM_UNROLL
#define QM_UNROLL 4
#endif

// Up to QM_JOBS products of one shape in one launch (blockIdx.y = job): job j reads the matrix
// whose codes, BF16 scales and biases start at device addresses w[j], s[j], b[j], the rows of x
// at x[j] ([t_rows, cols] f32) and writes y[j] ([t_rows, rows] f32). Passed by value.
struct QJobs {
    u64 w[QM_JOBS];
    u64 s[QM_JOBS];
    u64 b[QM_JOBS];
    u64 x[QM_JOBS];
    u64 y[QM_JOBS];
};

// x[c .. c + PER) as floats (c a multiple of PER, x rows 16-byte aligned: cols % 32 == 0).
template <int PER>
__device__ __forceinline__ void load_x(const float* x, float* v) {
    if (PER == 2) {
        float2 a = *(const float2*)x;
        v[0] = a.x; v[1] = a.y;
    } else {
        for (int h = 0; h < PER / 4; ++h) {
            float4 a = *(const float4*)(x + 4 * h);
            v[4 * h] = a.x; v[4 * h + 1] = a.y; v[4 * h + 2] = a.z; v[4 * h + 3] = a.w;
        }
    }
}

// One warp computes y[t, r] = sum_c w[r, c] x[t, c] for its row r and every t of its share.
// The row's codes are read as 8-byte words from the 8-byte boundary at or below the row's start
// (tensors are only 2-byte aligned): word k holds u16 pieces 4k - m .. 4k - m + 3 of the row
// (m = pieces before the row in word 0); pieces outside the row are skipped. Each lane sums
// scale * (codes . x) + bias * sum(x) per piece in word order, the lanes are added by warp_sum:
// the result depends only on the bytes and their alignment modulo 8 (a slot, the staging buffer
// and the resident copy give an expert's matrices the same alignment).
// QM_TT rows of x per pass. One row of x (decode) goes to qmv (qmv.cu) instead.
template <int BITS>
__device__ void qmatmul_row(u64 w_at, u64 s_at, u64 b_at, u64 x_at, u64 y_at, int r, int rows,
                            int cols, int group, int t_rows, int lane) {
    const int TT = QM_TT;
    const int PER = 16 / BITS;
    const u32 mask = (1u << BITS) - 1u;
    int n16 = cols / PER;
    int groups = cols / group;
    int gshift = 31 - __clz(group);  // group is a power of two (checked by the launch)
    u64 row = w_at + (u64)r * n16 * 2;
    u64 a0 = row & ~(u64)7;
    int m = (int)(row - a0) / 2;
    int words = (m + n16 + 3) / 4;
    const uint2* wv = (const uint2*)a0;
    const u16* sc = (const u16*)s_at + (u64)r * groups;
    const u16* bi = (const u16*)b_at + (u64)r * groups;
    const float* x = (const float*)x_at;
    float* y = (float*)y_at;
    int tiles = (t_rows + TT - 1) / TT;
    for (int tile = blockIdx.z; tile < tiles; tile += gridDim.z) {
        int t0 = tile * TT;
        int nt = min(TT, t_rows - t0);
        float acc[TT];
#pragma unroll
        for (int tt = 0; tt < TT; ++tt) acc[tt] = 0.0f;
        // The group's scale and bias, loaded when the group changes (pieces come in order).
        int gp = -1;
        float s = 0.0f, b = 0.0f;
        // QM_UNROLL words per lane per step, every load issued before any is used.
        for (int k0 = lane; k0 < words; k0 += 32 * QM_UNROLL) {
            uint2 w2[QM_UNROLL];
#pragma unroll
            for (int h = 0; h < QM_UNROLL; ++h)
                w2[h] = k0 + 32 * h < words ? wv[k0 + 32 * h] : make_uint2(0u, 0u);
#pragma unroll
            for (int h = 0; h < QM_UNROLL; ++h) {
                int k = k0 + 32 * h;
                uint2 v = w2[h];
#pragma unroll
                for (int p = 0; p < 4; ++p) {
                    int i = 4 * k + p - m;
                    if (i < 0 || i >= n16) continue;
                    u32 piece = ((p < 2 ? v.x : v.y) >> (16 * (p & 1))) & 0xffffu;
                    int c0 = i * PER;
                    int g = c0 >> gshift;
                    if (g != gp) {
                        gp = g;
                        s = bf16_to_f32(sc[g]);
                        b = bf16_to_f32(bi[g]);
                    }
                    float q[PER];
                    for (int e = 0; e < PER; ++e) q[e] = (float)((piece >> (e * BITS)) & mask);
#pragma unroll
                    for (int tt = 0; tt < TT; ++tt) {
                        if (tt >= nt) continue;
                        float xv[PER];
                        load_x<PER>(x + (u64)(t0 + tt) * cols + c0, xv);
                        float dot = 0.0f, xs = 0.0f;
                        for (int e = 0; e < PER; ++e) {
                            dot += q[e] * xv[e];
                            xs += xv[e];
                        }
                        acc[tt] += s * dot + b * xs;
                    }
                }
            }
        }
#pragma unroll
        for (int tt = 0; tt < TT; ++tt) {
            if (tt >= nt) continue;
            float sum = warp_sum(acc[tt]);
            if (lane == 0) y[(u64)(t0 + tt) * rows + r] = sum;
        }
    }
}

// Row r of one product, dispatched on the bit width (2, 4 or 8).
__device__ __forceinline__ void qmatmul_any(u64 w, u64 s, u64 b, u64 x, u64 y, int r, int rows,
                                            int cols, int bits, int group, int t_rows, int lane) {
    switch (bits) {
        case 2: qmatmul_row<2>(w, s, b, x, y, r, rows, cols, group, t_rows, lane); break;
        case 4: qmatmul_row<4>(w, s, b, x, y, r, rows, cols, group, t_rows, lane); break;
        default: qmatmul_row<8>(w, s, b, x, y, r, rows, cols, group, t_rows, lane); break;
    }
}

// The jobs of one launch: blockIdx.x * QM_ROWS + warp = output row, blockIdx.y = job,
// blockIdx.z = share of the x rows (tiles of QM_TT). bits 2, 4 or 8; cols a multiple of group.
extern "C" __global__ void qmatmul(QJobs jobs, int rows, int cols, int bits, int group,
                                   int t_rows) {
    int r = blockIdx.x * QM_ROWS + (threadIdx.x >> 5);
    if (r >= rows) return;
    int lane = threadIdx.x & 31, j = blockIdx.y;
    qmatmul_any(jobs.w[j], jobs.s[j], jobs.b[j], jobs.x[j], jobs.y[j], r, rows, cols, bits, group,
                t_rows, lane);
}

// out[j, c] = w[ids[j], c] * scale (dequantized embedding rows).
extern "C" __global__ void qembed(const unsigned char* base, u64 w_off, u64 s_off, u64 b_off,
                                  int cols, int bits, int group, const u32* ids, u64 n_ids,
                                  float scale, float* out) {
    const unsigned char* w = base + w_off;
    const u16* sc = (const u16*)(base + s_off);
    const u16* bi = (const u16*)(base + b_off);
    u32 mask = (1u << bits) - 1u;
    FOR_EACH(i, n_ids * (u64)cols) {
        u64 j = i / cols, c = i % cols;
        u64 e = (u64)ids[j] * cols + c;      // element index in the matrix
        u64 bit = e * bits;
        u32 q = ((u32)w[bit >> 3] >> (bit & 7)) & mask;
        u64 g = (u64)ids[j] * (cols / group) + c / group;
        out[i] = (bf16_to_f32(sc[g]) * (float)q + bf16_to_f32(bi[g])) * scale;
    }
}

// (value, index) pairs of an argmax, reduced over the block of 1024 threads: the largest value,
// ties to the lower index, index 0xffffffff for none (every value NaN). Thread 0 writes
// out = {id, value bits}.
__device__ void argmax_block(float best, u32 id, u32* out) {
    __shared__ float bv[1024];
    __shared__ u32 bi[1024];
    bv[threadIdx.x] = best;
    bi[threadIdx.x] = id;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s) {
            float ov = bv[threadIdx.x + s];
            u32 oi = bi[threadIdx.x + s];
            u32 mi = bi[threadIdx.x];
            float mv = bv[threadIdx.x];
            if (oi != 0xffffffffu &&
                (mi == 0xffffffffu || ov > mv || (ov == mv && oi < mi))) {
                bv[threadIdx.x] = ov;
                bi[threadIdx.x] = oi;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        out[0] = bi[0];
        out[1] = __float_as_uint(bv[0]);
    }
}

// The index and value of the largest of v[0..n) (ties to the lower index, NaN skipped), in two
// launches: argmax_parts, block b of 1024 threads over v[b * chunk ..][.. chunk] into
// parts[2b], parts[2b + 1]; then argmax over the parts, one block, into out = {id, value bits}
// (id = 0xffffffff when every value is NaN). Each stage keeps the lower index of equal values, so
// the result is the one-pass argmax's.
extern "C" __global__ void argmax_parts(const float* v, int n, int chunk, u32* parts) {
    float best = 0.0f;
    u32 id = 0xffffffffu;
    int lo = blockIdx.x * chunk, hi = min(n, lo + chunk);
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        float x = v[i];
        if (x != x) continue;
        if (id == 0xffffffffu || x > best) { best = x; id = (u32)i; }
    }
    argmax_block(best, id, parts + 2 * (u64)blockIdx.x);
}

extern "C" __global__ void argmax(const u32* parts, int nparts, u32* out) {
    float best = 0.0f;
    u32 id = 0xffffffffu;
    for (int p = threadIdx.x; p < nparts; p += blockDim.x) {
        u32 pi = parts[2 * p];
        float pv = __uint_as_float(parts[2 * p + 1]);
        if (pi == 0xffffffffu) continue;
        if (id == 0xffffffffu || pv > best) { best = pv; id = pi; }
    }
    argmax_block(best, id, out);
}
