// Decode products: y[r] = sum_c w[r, c] x[c] for one row of x, MLX affine quantized w (the layout
// of quant.cu: u16 pieces of 16 / BITS codes, lowest bits first, column c of row r dequantizes
// to s[g] * q + b[g]).
//
// Per piece of PER = 16 / BITS codes the sum is s * (q . x) + b * sum(x), as in qmatmul_row. Two
// things make it cheaper than qmatmul's per-row loop:
// - x is read once per group of QV_R rows: a lane owns the same 8-byte words of every row (rows
//   of a matrix start a whole number of words apart, cols % 32 == 0), keeps those columns of x in
//   registers and multiplies QV_R rows by them;
// - a code becomes a float without a conversion instruction: OR-ing the code, left at its place
//   2^(BITS * e) in the piece, into the mantissa of 2^23 gives 2^23 + q * 2^(BITS * e) exactly,
//   and subtracting 2^23 leaves q * 2^(BITS * e). The x it multiplies was scaled by
//   2^-(BITS * e) beforehand (exact: a power of two), so each product is q * x to the last bit.
// Short rows (the down product's, a few hundred bytes) are split over LPR < 32 lanes, so that
// every lane has several words; the LPR lanes of a row are added by shuffles in a fixed order, so
// a result depends only on the bytes, their alignment modulo 8 and the shape.

// Warps per block and rows per lane group per pass (the launch in lib.rs uses the same numbers;
// compile.rs defines QV_R).
#define QV_WARPS 4
#ifndef QV_R
#define QV_R 4
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

// Rows r0 .. r0 + QV_R (those below `rows`) of one product, by the LPR lanes of a lane group
// (sl = lane within the group). Every lane of the warp runs the reduction, whatever its rows.
template <int BITS, int LPR>
__device__ void qmv_rows(u64 w_at, u64 s_at, u64 b_at, const float* x, float* y, int r0,
                         int rows, int cols, int group, int sl) {
    const int PER = 16 / BITS;
    int n16 = cols / PER;             // pieces per row
    int groups = cols / group;
    int gshift = 31 - __clz(group);   // a power of two (checked by the launch)
    u64 a0 = w_at & ~(u64)7;          // the 8-byte word holding the matrix's first piece
    int m = (int)(w_at - a0) / 2;     // pieces of that word before the matrix
    int words = (m + n16 + 3) / 4;    // words a row touches
    u64 row_bytes = (u64)n16 * 2;     // a multiple of 8
    int nr = min(QV_R, rows - r0);    // rows of this group (none past the end)
    const u16* sc = (const u16*)s_at;
    const u16* bi = (const u16*)b_at;
    float acc[QV_R];
#pragma unroll
    for (int rr = 0; rr < QV_R; ++rr) acc[rr] = 0.0f;
    for (int k = sl; k < words; k += LPR) {
        // The word's columns of x (zero for pieces outside the row), their sums, scaled copies.
        float xv[4][PER], xsum[4];
        bool hi[4];
        int i0 = max(4 * k - m, 0), i3 = min(4 * k + 3 - m, n16 - 1);
        int g0 = (i0 * PER) >> gshift, g3 = (i3 * PER) >> gshift;
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
            hi[p] = ((max(i, 0) * PER) >> gshift) != g0;
        }
        uint2 v[QV_R];
#pragma unroll
        for (int rr = 0; rr < QV_R; ++rr)
            v[rr] = rr < nr ? *(const uint2*)(a0 + (u64)(r0 + rr) * row_bytes + 8 * (u64)k)
                            : make_uint2(0u, 0u);
#pragma unroll
        for (int rr = 0; rr < QV_R; ++rr) {
            if (rr >= nr) continue;
            u64 gr = (u64)(r0 + rr) * groups;
            float s0 = bf16_to_f32(sc[gr + g0]), b0 = bf16_to_f32(bi[gr + g0]);
            float s3 = s0, b3 = b0;
            if (g3 != g0) {
                s3 = bf16_to_f32(sc[gr + g3]);
                b3 = bf16_to_f32(bi[gr + g3]);
            }
#pragma unroll
            for (int p = 0; p < 4; ++p) {
                u32 u = (p < 2 ? v[rr].x : v[rr].y) >> (16 * (p & 1));
                float d = piece_dot<BITS>(u, xv[p]);
                acc[rr] += (hi[p] ? s3 : s0) * d + (hi[p] ? b3 : b0) * xsum[p];
            }
        }
    }
#pragma unroll
    for (int rr = 0; rr < QV_R; ++rr) {
        float t = acc[rr];
#pragma unroll
        for (int o = LPR / 2; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
        if (sl == 0 && rr < nr) y[r0 + rr] = t;
    }
}

// The block's share of one product: lane group threadIdx.x / LPR takes QV_R rows.
template <int BITS, int LPR>
__device__ __forceinline__ void qmv_block(u64 w, u64 s, u64 b, u64 x, u64 y, int rows, int cols,
                                          int group) {
    int sub = threadIdx.x / LPR, sl = threadIdx.x % LPR;
    int r0 = (blockIdx.x * (QV_WARPS * 32 / LPR) + sub) * QV_R;
    qmv_rows<BITS, LPR>(w, s, b, (const float*)x, (float*)y, r0, rows, cols, group, sl);
}

template <int BITS>
__device__ __forceinline__ void qmv_lanes(int lpr, u64 w, u64 s, u64 b, u64 x, u64 y, int rows,
                                          int cols, int group) {
    switch (lpr) {
        case 32: qmv_block<BITS, 32>(w, s, b, x, y, rows, cols, group); break;
        case 16: qmv_block<BITS, 16>(w, s, b, x, y, rows, cols, group); break;
        case 8: qmv_block<BITS, 8>(w, s, b, x, y, rows, cols, group); break;
        default: qmv_block<BITS, 4>(w, s, b, x, y, rows, cols, group); break;
    }
}

// The products of qmv_ids: matrix mat[j] (0 or 1: byte offsets w_off/s_off/b_off[mat[j]], the
// same in every expert blob) of expert ids[pick[j]], whose blob starts at slots[ids[pick[j]]],
// times the row at x[j] into y[j].
struct QIdJobs {
    u64 w_off[2];
    u64 s_off[2];
    u64 b_off[2];
    u64 x[QM_JOBS];
    u64 y[QM_JOBS];
    int pick[QM_JOBS];
    int mat[QM_JOBS];
};

// One kernel per bit width (fewer registers than one dispatching on it): qmv<BITS> runs up to
// QM_JOBS products of one shape (the QJobs of qmatmul, one row of x each), blockIdx.y = job,
// blockIdx.x = the block's QV_WARPS * 32 / lpr * QV_R rows; qmv_ids<BITS> the same for experts
// named by device-side ids (decode's routed experts without a readback), from the same bytes at
// the same addresses as a qmv launch on the readback path, so bit-identical results. lpr (lanes
// per row) is 4, 8, 16 or 32; cols a multiple of 32 and of group.
#define QMV_KERNELS(BITS)                                                                       \
    extern "C" __global__ void __launch_bounds__(QV_WARPS * 32)                                 \
        qmv##BITS(QJobs jobs, int rows, int cols, int group, int lpr) {                         \
        int j = blockIdx.y;                                                                     \
        qmv_lanes<BITS>(lpr, jobs.w[j], jobs.s[j], jobs.b[j], jobs.x[j], jobs.y[j], rows, cols, \
                        group);                                                                 \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(QV_WARPS * 32)                                 \
        qmv_ids##BITS(QIdJobs jobs, const u64* slots, const u32* ids, int rows, int cols,       \
                      int group, int lpr) {                                                     \
        int j = blockIdx.y, m = jobs.mat[j];                                                    \
        u64 base = slots[ids[jobs.pick[j]]];                                                    \
        qmv_lanes<BITS>(lpr, base + jobs.w_off[m], base + jobs.s_off[m], base + jobs.b_off[m],  \
                        jobs.x[j], jobs.y[j], rows, cols, group);                               \
    }

QMV_KERNELS(2)
QMV_KERNELS(4)
QMV_KERNELS(8)
