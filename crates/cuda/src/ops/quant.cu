// MLX affine quantized products (2/4/8-bit, groups of 32/64/128 columns).
//
// Layout (mlx `quantize`): row r of a [rows, cols] matrix is cols*bits/8 bytes of little-endian
// u32 words holding 32/bits codes each, lowest bits first; column c of row r dequantizes to
// s[g] * q + b[g] with g = r * (cols / group) + c / group, s and b BF16. Tensors of the install
// are only 2-byte aligned, so codes are read as u16 pieces (2/4/8 codes, never straddling a
// group) and nothing assumes a 4-byte-aligned word.

// Rows per qmatmul block (one warp each), jobs per launch, rows of x per pass over a weight row
// (the launch in launch.rs uses the same numbers).
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
// QM_TT rows of x per pass. One row of x (decode) goes to qmv (below) instead.
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
    grid_dep_wait();
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
    grid_dep_wait();
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
    grid_dep_wait();
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
    grid_dep_wait();
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

// Decode products: y[r] = sum_c w[r, c] x[c] for one row of x, MLX affine quantized w (the layout
// at the top of this file: u16 pieces of 16 / BITS codes, lowest bits first, column c of row r
// dequantizes to s[g] * q + b[g]).
//
// Per piece of PER = 16 / BITS codes the sum is s * (q . x) + b * sum(x), as in qmatmul_row. Two
// things make it cheaper than qmatmul's per-row loop:
// - x is read once per group of QV_R rows (2): a lane owns the same 8-byte words of every row (rows
//   of a matrix start a whole number of words apart, cols % 32 == 0), keeps those columns of x in
//   registers and multiplies QV_R rows by them;
// - a code becomes a float without a conversion instruction: OR-ing the code, left at its place
//   2^(BITS * e) in the piece, into the mantissa of 2^23 gives 2^23 + q * 2^(BITS * e) exactly,
//   and subtracting 2^23 leaves q * 2^(BITS * e). The x it multiplies was scaled by
//   2^-(BITS * e) beforehand (exact: a power of two), so each product is q * x to the last bit.
// Short rows (the down product's, a few hundred bytes) are split over LPR < 32 lanes, so that
// every lane has several words; the LPR lanes of a row are added by shuffles in a fixed order, so
// a result depends only on the bytes, their alignment modulo 8 and the shape.
//
// x staged in shared memory (QV_STAGE bits or fewer, when the block's x fits: qv_stage_bytes): a
// lane needs the
// 4 * PER columns of x under each word it holds (128 bytes of f32 at 2 bits), so a warp's load of
// x from global memory touches 32 different 128-byte lines, one L1 wavefront each, for 16 bytes
// of every line: at 2 bits the L1 delivered ~2 bytes of codes per cycle per SM (DeepSeek-V4's
// experts ran at ~0.37 TB/s). Staged, the block first writes its x once, already scaled and with
// each piece's sum (the same operations in the same order as the per-lane loads, so the same
// bits), as chunks of 4 floats laid chunk-major over the words (chunk c of word k at c * W + k):
// the lanes of a warp read consecutive 16-byte chunks, 4 wavefronts per 512 bytes. The block
// then takes one or more passes over its lane groups' rows (the launch's `passes`), so the
// staging is shared by more rows.

// Warps per block and rows per lane group per pass (the launch in launch.rs uses the same numbers;
// compile.rs defines QV_R).
#define QV_WARPS 4
#ifndef QV_R
#define QV_R 2
#endif
// Words a lane loads (for each of its rows) before it multiplies any of them: the loads of one
// pass are in flight together instead of one word's latency per step. The words are still added
// in the same order, so the result does not depend on QV_U (compile.rs defines it).
#ifndef QV_U
#define QV_U 2
#endif
// x staged in shared memory for products of at most QV_STAGE bits (2: DeepSeek-V4's 2-bit
// experts, where it measured faster; 0: none, 8: all), else read from global memory by every
// lane (compile.rs defines it, the launch sizes the shared memory by the same rule).
#ifndef QV_STAGE
#define QV_STAGE 8
#endif
// The most dynamic shared memory a staged launch takes (without the opt-in attribute).
#define QV_SMEM_MAX 49152
// Whether the resident one-row products prefetch their rows before grid_dep_wait (qv_prefetch;
// compile.rs defines it).
#ifndef QV_PF
#define QV_PF 1
#endif

// Bytes of shared memory to stage x of `cols` columns at BITS bits (words a row can touch, each
// PER chunks of x and one of piece sums), 0 when it does not fit (x read from global memory).
// launch.rs `qv_stage_bytes` computes the same.
__device__ __forceinline__ int qv_stage_bytes(int cols, int bits) {
    int words = cols * bits / 64 + 1;
    int bytes = words * (16 / bits + 1) * 16;
    return bits <= QV_STAGE && bytes <= QV_SMEM_MAX ? bytes : 0;
}

// The block's dynamic shared memory (the launch sizes it).
#ifndef QV_SMEM_EMULATED
__device__ __forceinline__ float4* qv_smem() {
    extern __shared__ float4 qv_dyn[];
    return qv_dyn;
}
#endif

// q . x' over one piece: u holds the piece in its low 16 bits, xs[e] = x[e] * 2^-(BITS * e).
template <int BITS>
__device__ __forceinline__ float piece_dot(u32 u, const float* xs) {
    const int PER = 16 / BITS;
    const u32 mask = (1u << BITS) - 1u;
    float dot = 0.0f;
#pragma unroll
    for (int e = 0; e < PER; ++e) {
        float t = __uint_as_float((u & (mask << (BITS * e))) | 0x4B000000u) - 8388608.0f;
        dot = fmaf(t, xs[e], dot);
    }
    return dot;
}

// The matrices of a lane group: NM = 1 (a product) or 2 (a gated MLP's gate and up, sharing x
// and their alignment modulo 8, not always their group size), with the act of glu_f for NM = 2.
struct QvMats {
    u64 w[2], s[2], b[2];
    int act;
    float limit;
    int up_group;  // matrix 1's group when > 0 (DeepSeek-V4's gate in 32s, up in 64s), else `group`
};

// The columns of x under word k of a row whose word 0 holds m pieces before the row (n16 pieces):
// xv[p] = piece 4k + p - m's PER values (zero outside the row) scaled by 2^-(BITS * e), xsum[p]
// their sum before the scaling, added in order from 0.
template <int BITS>
__device__ __forceinline__ void qv_word_x(const float* x, int k, int m, int n16,
                                          float (*xv)[16 / BITS], float* xsum) {
    const int PER = 16 / BITS;
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        int i = 4 * k + p - m;
        if (i >= 0 && i < n16) {
            load_x<PER>(x + (u64)i * PER, xv[p]);
        } else {
#pragma unroll
            for (int e = 0; e < PER; ++e) xv[p][e] = 0.0f;
        }
        float sum = 0.0f;
#pragma unroll
        for (int e = 0; e < PER; ++e) sum += xv[p][e];
        xsum[p] = sum;
#pragma unroll
        for (int e = 0; e < PER; ++e) xv[p][e] *= __int_as_float((127 - BITS * e) << 23);
    }
}

// Stages x for rows laid as above (words per row) in xs, by every thread of the block (a
// __syncthreads must follow): the 4 * PER scaled values of word k as PER chunks at
// xs[c * words + k], its 4 piece sums at xs[PER * words + k].
template <int BITS>
__device__ void qv_stage(const float* x, int m, int n16, int words, float4* xs) {
    const int PER = 16 / BITS;
    for (int k = threadIdx.x; k < words; k += QV_WARPS * 32) {
        float xv[4][PER], xsum[4];
        qv_word_x<BITS>(x, k, m, n16, xv, xsum);
        const float* f = &xv[0][0];
#pragma unroll
        for (int c = 0; c < PER; ++c)
            xs[c * words + k] = make_float4(f[4 * c], f[4 * c + 1], f[4 * c + 2], f[4 * c + 3]);
        xs[PER * words + k] = make_float4(xsum[0], xsum[1], xsum[2], xsum[3]);
    }
}

// The sums of rows r0 .. r0 + R / NM (those below `rows`) of each of the NM matrices, by the
// LPR lanes of a lane group (sl = lane within the group), into acc (matrix mi's row r0 + rr at
// acc[mi * R / NM + rr], every lane of the group gets them; R is QV_R but in down_combine). Every
// lane of the warp runs the reduction, whatever its rows (rows <= r0: none, nothing of the
// matrices is read; x is). x comes from xs as qv_stage left it (STAGED) or from global memory.
template <int BITS, int LPR, int NM, bool STAGED, int R = QV_R>
__device__ __forceinline__ void qmv_sums(const QvMats& mat, const float* x, const float4* xs,
                                         int r0, int rows, int cols, int group, int sl,
                                         float* acc) {
    const int PER = 16 / BITS;
    const int RG = R / NM;            // rows of each matrix
    int n16 = cols / PER;             // pieces per row
    int gshift[NM], groups[NM];       // each matrix's group: a power of two (checked by the launch)
#pragma unroll
    for (int mi = 0; mi < NM; ++mi) {
        gshift[mi] = 31 - __clz(mi == 1 && mat.up_group > 0 ? mat.up_group : group);
        groups[mi] = cols >> gshift[mi];
    }
    u64 a0[NM];                       // the 8-byte word holding each matrix's first piece
#pragma unroll
    for (int mi = 0; mi < NM; ++mi) a0[mi] = mat.w[mi] & ~(u64)7;
    int m = (int)(mat.w[0] - a0[0]) / 2;  // pieces of that word before the matrix
    int words = (m + n16 + 3) / 4;    // words a row touches
    u64 row_bytes = (u64)n16 * 2;     // a multiple of 8
    int nr = min(RG, rows - r0);      // rows of this group (none past the end)
#pragma unroll
    for (int rr = 0; rr < R; ++rr) acc[rr] = 0.0f;
    for (int k0 = sl; k0 < words; k0 += LPR * QV_U) {
        uint2 vu[QV_U][R];
#pragma unroll
        for (int u = 0; u < QV_U; ++u) {
            int k = k0 + u * LPR;
#pragma unroll
            for (int rr = 0; rr < R; ++rr)
                vu[u][rr] = k < words && rr % RG < nr
                                ? *(const uint2*)(a0[rr / RG] + (u64)(r0 + rr % RG) * row_bytes +
                                                  8 * (u64)k)
                                : make_uint2(0u, 0u);
        }
#pragma unroll
        for (int u = 0; u < QV_U; ++u) {
            int k = k0 + u * LPR;
            if (k >= words) break;
            const uint2* v = vu[u];
            // The word's columns of x (zero for pieces outside the row), their sums, scaled copies;
            // each matrix's groups of its first and last piece (a word spans at most two).
            float xv[4][PER], xsum[4];
            if (STAGED) {
                float* f = &xv[0][0];
#pragma unroll
                for (int c = 0; c < PER; ++c) {
                    float4 a = xs[c * words + k];
                    f[4 * c] = a.x; f[4 * c + 1] = a.y; f[4 * c + 2] = a.z; f[4 * c + 3] = a.w;
                }
                float4 ps = xs[PER * words + k];
                xsum[0] = ps.x; xsum[1] = ps.y; xsum[2] = ps.z; xsum[3] = ps.w;
            } else {
                qv_word_x<BITS>(x, k, m, n16, xv, xsum);
            }
            bool hi[NM][4];
            int i0 = max(4 * k - m, 0), i3 = min(4 * k + 3 - m, n16 - 1);
            int g0[NM], g3[NM];
#pragma unroll
            for (int mi = 0; mi < NM; ++mi) {
                g0[mi] = (i0 * PER) >> gshift[mi];
                g3[mi] = (i3 * PER) >> gshift[mi];
            }
#pragma unroll
            for (int p = 0; p < 4; ++p) {
                int i = 4 * k + p - m;
#pragma unroll
                for (int mi = 0; mi < NM; ++mi)
                    hi[mi][p] = ((max(i, 0) * PER) >> gshift[mi]) != g0[mi];
            }
#pragma unroll
            for (int rr = 0; rr < R; ++rr) {
                if (rr % RG >= nr) continue;
                const int mi = rr / RG;
                const u16* sc = (const u16*)mat.s[mi];
                const u16* bi = (const u16*)mat.b[mi];
                u64 gr = (u64)(r0 + rr % RG) * groups[mi];
                float s0 = bf16_to_f32(sc[gr + g0[mi]]), b0 = bf16_to_f32(bi[gr + g0[mi]]);
                float s3 = s0, b3 = b0;
                if (g3[mi] != g0[mi]) {
                    s3 = bf16_to_f32(sc[gr + g3[mi]]);
                    b3 = bf16_to_f32(bi[gr + g3[mi]]);
                }
#pragma unroll
                for (int p = 0; p < 4; ++p) {
                    u32 pc = (p < 2 ? v[rr].x : v[rr].y) >> (16 * (p & 1));
                    float d = piece_dot<BITS>(pc, xv[p]);
                    acc[rr] += (hi[mi][p] ? s3 : s0) * d + (hi[mi][p] ? b3 : b0) * xsum[p];
                }
            }
        }
    }
#pragma unroll
    for (int rr = 0; rr < R; ++rr) {
#pragma unroll
        for (int o = LPR / 2; o > 0; o >>= 1) acc[rr] += __shfl_xor_sync(0xffffffffu, acc[rr], o);
    }
}

// Rows r0 .. r0 + QV_R / NM (those below `rows`) by a lane group (qmv_sums): y[r] = the row's
// product (NM = 1) or glu_f(gate row, up row) (NM = 2).
template <int BITS, int LPR, int NM, bool STAGED>
__device__ void qmv_rows(const QvMats& mat, const float* x, const float4* xs, float* y, int r0,
                         int rows, int cols, int group, int sl) {
    const int RG = QV_R / NM;
    int nr = min(RG, rows - r0);
    float acc[QV_R];
    qmv_sums<BITS, LPR, NM, STAGED>(mat, x, xs, r0, rows, cols, group, sl, acc);
    if (sl != 0) return;
#pragma unroll
    for (int rr = 0; rr < RG; ++rr) {
        if (rr >= nr) continue;
        y[r0 + rr] = NM == 1 ? acc[rr] : glu_f(acc[rr], acc[rr + RG], mat.act, mat.limit);
    }
}

// The block's share of one product (or gated pair): P passes in which lane group
// threadIdx.x / LPR takes QV_R / NM rows, x staged once for them where it fits (P > 1 only then).
template <int BITS, int LPR, int NM, int P>
__device__ __forceinline__ void qmv_block(const QvMats& mat, u64 x, u64 y, int rows, int cols,
                                          int group) {
    const int G = QV_WARPS * 32 / LPR, RG = QV_R / NM;
    int sub = threadIdx.x / LPR, sl = threadIdx.x % LPR;
    const float* xf = (const float*)x;
    if (qv_stage_bytes(cols, BITS) > 0) {
        int n16 = cols / (16 / BITS), m = (int)(mat.w[0] & 7) / 2;
        float4* xs = qv_smem();
        qv_stage<BITS>(xf, m, n16, (m + n16 + 3) / 4, xs);
        __syncthreads();
#pragma unroll 1
        for (int pass = 0; pass < P; ++pass) {
            int r0 = ((blockIdx.x * P + pass) * G + sub) * RG;
            qmv_rows<BITS, LPR, NM, true>(mat, xf, xs, (float*)y, r0, rows, cols, group, sl);
        }
    } else if (P == 1) {
        int r0 = (blockIdx.x * G + sub) * RG;
        qmv_rows<BITS, LPR, NM, false>(mat, xf, nullptr, (float*)y, r0, rows, cols, group, sl);
    }
}

// qmv_block for lpr lanes per row (4, 8, 16 or 32) and P passes.
template <int BITS, int NM, int P>
__device__ __forceinline__ void qmv_lanes(int lpr, const QvMats& mat, u64 x, u64 y, int rows,
                                          int cols, int group) {
    switch (lpr) {
        case 32: qmv_block<BITS, 32, NM, P>(mat, x, y, rows, cols, group); break;
        case 16: qmv_block<BITS, 16, NM, P>(mat, x, y, rows, cols, group); break;
        case 8: qmv_block<BITS, 8, NM, P>(mat, x, y, rows, cols, group); break;
        default: qmv_block<BITS, 4, NM, P>(mat, x, y, rows, cols, group); break;
    }
}

// The products of qmv_ids: matrix mat[j] (0 or 1: byte offsets w_off/s_off/b_off[mat[j]], the
// same in every expert blob) of expert ids[pick[j]], whose blob starts at slots[ids[pick[j]]],
// times the row at x[j] into y[j] (qmv_glu_ids: both matrices, mat[j] unused).
struct QIdJobs {
    u64 w_off[2];
    u64 s_off[2];
    u64 b_off[2];
    u64 x[QM_JOBS];
    u64 y[QM_JOBS];
    int pick[QM_JOBS];
    int mat[QM_JOBS];
};

// Matrix mi of job j of a QJobs (NM = 1: job j; NM = 2: jobs 2j and 2j + 1, gate then up).
__device__ __forceinline__ QvMats qv_mats(const QJobs& jobs, int j, int nm, int act, float limit) {
    QvMats m;
    for (int mi = 0; mi < nm; ++mi) {
        m.w[mi] = jobs.w[nm * j + mi];
        m.s[mi] = jobs.s[nm * j + mi];
        m.b[mi] = jobs.b[nm * j + mi];
    }
    m.act = act;
    m.limit = limit;
    m.up_group = 0;
    return m;
}

// The matrices of QIdJobs job j: mat[j] (nm = 1) or both (nm = 2) of its expert.
__device__ __forceinline__ QvMats qv_id_mats(const QIdJobs& jobs, const u64* slots,
                                             const u32* ids, int j, int nm, int act,
                                             float limit) {
    u64 base = slots[ids[jobs.pick[j]]];
    QvMats m;
    for (int mi = 0; mi < nm; ++mi) {
        int at = nm == 1 ? jobs.mat[j] : mi;
        m.w[mi] = base + jobs.w_off[at];
        m.s[mi] = base + jobs.s_off[at];
        m.b[mi] = base + jobs.b_off[at];
    }
    m.act = act;
    m.limit = limit;
    m.up_group = 0;
    return m;
}

// The output rows of each job of a qmv launch (its jobs share cols, bits and group, not rows:
// a block past its job's rows returns at once).
struct QvRows {
    int rows[QM_JOBS];
};

// The block's rows of each matrix of a resident product (codes, scales, biases) into L2, issued
// before grid_dep_wait: the previous kernel is still running then, and nothing a kernel writes is
// a resident weight, so this reads nothing the wait guards (a prefetch changes no value anyway).
// QV_PF = 0 (compile.rs) leaves it out.
template <int BITS, int NM, int P>
__device__ __forceinline__ void qv_prefetch(const QvMats& mat, int lpr, int rows, int cols,
                                            int group) {
    if (!QV_PF) return;
    int per_block = P * (QV_WARPS * 32 / lpr) * (QV_R / NM);
    int r0 = blockIdx.x * per_block, r1 = min(rows, r0 + per_block);
    if (r0 >= r1) return;
    u64 row_bytes = (u64)cols * BITS / 8;
#pragma unroll
    for (int mi = 0; mi < NM; ++mi) {
        u64 gb = (u64)(cols / (mi == 1 && mat.up_group > 0 ? mat.up_group : group)) * 2;
        prefetch_l2(mat.w[mi] + r0 * row_bytes, mat.w[mi] + r1 * row_bytes);
        prefetch_l2(mat.s[mi] + r0 * gb, mat.s[mi] + r1 * gb);
        prefetch_l2(mat.b[mi] + r0 * gb, mat.b[mi] + r1 * gb);
    }
}

// One kernel per bit width and pass count (fewer registers than one dispatching on them),
// blockIdx.y = job, blockIdx.x = the block's QV_WARPS * 32 / lpr lane groups (times P passes);
// lpr (lanes per row) is 4, 8, 16 or 32, cols a multiple of 32 and of group.
// - qmv<BITS>: up to QM_JOBS products of one row of x each (the QJobs of qmatmul) with the same
//   columns, bits and group, rows per job in jr;
// - qmv_glu<BITS>: QM_JOBS / 2 gated pairs, jobs 2j (gate, in groups of `group`) and 2j + 1 (up,
//   in groups of `up_group`) of one x, into the y of job 2j: glu_f(gate, up) with the gate's and
//   up's sums as qmv computes them;
// - qmv_ids<BITS> / qmv_glu_ids<BITS>: the same for experts named by device-side ids (decode's
//   routed experts without a readback), from the same bytes at the same addresses as a launch
//   on the readback path, so bit-identical results.
// The `_p` kernels take QV_PASSES passes per block over a staged x (launch.rs `qmv_grid` picks).
#define QV_PASSES 4
#define QMV_KERNELS_P(BITS, SUF, P)                                                              \
    extern "C" __global__ void __launch_bounds__(QV_WARPS * 32)                                  \
        qmv##BITS##SUF(QJobs jobs, QvRows jr, int cols, int group, int lpr) {                    \
        int j = blockIdx.y, rows = jr.rows[j];                                                   \
        if ((int)blockIdx.x * P * (QV_WARPS * 32 / lpr) * QV_R >= rows) return;                 \
        QvMats mat = qv_mats(jobs, j, 1, 0, 0.0f);                                               \
        qv_prefetch<BITS, 1, P>(mat, lpr, rows, cols, group);                                    \
        grid_dep_wait();                                                                         \
        qmv_lanes<BITS, 1, P>(lpr, mat, jobs.x[j], jobs.y[j], rows, cols, group);                \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(QV_WARPS * 32)                                  \
        qmv_glu##BITS##SUF(QJobs jobs, int rows, int cols, int group, int up_group, int lpr,     \
                           int act, float limit) {                                               \
        int j = blockIdx.y;                                                                      \
        QvMats mat = qv_mats(jobs, j, 2, act, limit);                                            \
        mat.up_group = up_group;                                                                 \
        qv_prefetch<BITS, 2, P>(mat, lpr, rows, cols, group);                                    \
        grid_dep_wait();                                                                         \
        qmv_lanes<BITS, 2, P>(lpr, mat, jobs.x[2 * j], jobs.y[2 * j], rows, cols, group);        \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(QV_WARPS * 32)                                  \
        qmv_ids##BITS##SUF(QIdJobs jobs, const u64* slots, const u32* ids, int rows, int cols,   \
                           int group, int lpr) { grid_dep_wait();                                \
        int j = blockIdx.y;                                                                      \
        qmv_lanes<BITS, 1, P>(lpr, qv_id_mats(jobs, slots, ids, j, 1, 0, 0.0f), jobs.x[j],       \
                              jobs.y[j], rows, cols, group);                                     \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(QV_WARPS * 32)                                  \
        qmv_glu_ids##BITS##SUF(QIdJobs jobs, const u64* slots, const u32* ids, int rows,         \
                               int cols, int group, int up_group, int lpr, int act,              \
                               float limit) { grid_dep_wait();                                   \
        int j = blockIdx.y;                                                                      \
        QvMats mat = qv_id_mats(jobs, slots, ids, j, 2, act, limit);                             \
        mat.up_group = up_group;                                                                 \
        qmv_lanes<BITS, 2, P>(lpr, mat, jobs.x[j], jobs.y[j], rows, cols, group);                \
    }
#define QMV_KERNELS(BITS) QMV_KERNELS_P(BITS, , 1) QMV_KERNELS_P(BITS, _p, QV_PASSES)

QMV_KERNELS(2)
QMV_KERNELS(4)
QMV_KERNELS(8)
