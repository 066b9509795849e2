// Decode products: y[r] = sum_c w[r, c] x[c] for one row of x, MLX affine quantized w (the layout
// of quant.cu: u16 pieces of 16 / BITS codes, lowest bits first, column c of row r dequantizes
// to s[g] * q + b[g]).
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

// Warps per block and rows per lane group per pass (the launch in lib.rs uses the same numbers;
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
// and their alignment modulo 8), with the act of glu_f for NM = 2.
struct QvMats {
    u64 w[2], s[2], b[2];
    int act;
    float limit;
};

// Rows r0 .. r0 + QV_R / NM (those below `rows`) of each of the NM matrices, by the LPR lanes of a
// lane group (sl = lane within the group): y[r] = the row's product (NM = 1) or
// glu_f(gate row, up row) (NM = 2). Every lane of the warp runs the reduction, whatever its rows.
template <int BITS, int LPR, int NM>
__device__ void qmv_rows(const QvMats& mat, const float* x, float* y, int r0, int rows, int cols,
                         int group, int sl) {
    const int PER = 16 / BITS;
    const int RG = QV_R / NM;         // rows of each matrix
    int n16 = cols / PER;             // pieces per row
    int groups = cols / group;
    int gshift = 31 - __clz(group);   // a power of two (checked by the launch)
    u64 a0[NM];                       // the 8-byte word holding each matrix's first piece
#pragma unroll
    for (int mi = 0; mi < NM; ++mi) a0[mi] = mat.w[mi] & ~(u64)7;
    int m = (int)(mat.w[0] - a0[0]) / 2;  // pieces of that word before the matrix
    int words = (m + n16 + 3) / 4;    // words a row touches
    u64 row_bytes = (u64)n16 * 2;     // a multiple of 8
    int nr = min(RG, rows - r0);      // rows of this group (none past the end)
    float acc[QV_R];
#pragma unroll
    for (int rr = 0; rr < QV_R; ++rr) acc[rr] = 0.0f;
    for (int k0 = sl; k0 < words; k0 += LPR * QV_U) {
        uint2 vu[QV_U][QV_R];
#pragma unroll
        for (int u = 0; u < QV_U; ++u) {
            int k = k0 + u * LPR;
#pragma unroll
            for (int rr = 0; rr < QV_R; ++rr)
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
#pragma unroll
            for (int rr = 0; rr < QV_R; ++rr) {
                if (rr % RG >= nr) continue;
                const u16* sc = (const u16*)mat.s[rr / RG];
                const u16* bi = (const u16*)mat.b[rr / RG];
                u64 gr = (u64)(r0 + rr % RG) * groups;
                float s0 = bf16_to_f32(sc[gr + g0]), b0 = bf16_to_f32(bi[gr + g0]);
                float s3 = s0, b3 = b0;
                if (g3 != g0) {
                    s3 = bf16_to_f32(sc[gr + g3]);
                    b3 = bf16_to_f32(bi[gr + g3]);
                }
#pragma unroll
                for (int p = 0; p < 4; ++p) {
                    u32 pc = (p < 2 ? v[rr].x : v[rr].y) >> (16 * (p & 1));
                    float d = piece_dot<BITS>(pc, xv[p]);
                    acc[rr] += (hi[p] ? s3 : s0) * d + (hi[p] ? b3 : b0) * xsum[p];
                }
            }
        }
    }
#pragma unroll
    for (int rr = 0; rr < QV_R; ++rr) {
#pragma unroll
        for (int o = LPR / 2; o > 0; o >>= 1) acc[rr] += __shfl_xor_sync(0xffffffffu, acc[rr], o);
    }
    if (sl != 0) return;
#pragma unroll
    for (int rr = 0; rr < RG; ++rr) {
        if (rr >= nr) continue;
        y[r0 + rr] = NM == 1 ? acc[rr] : glu_f(acc[rr], acc[rr + RG], mat.act, mat.limit);
    }
}

// The block's share of one product (or gated pair): lane group threadIdx.x / LPR takes
// QV_R / NM rows.
template <int BITS, int LPR, int NM>
__device__ __forceinline__ void qmv_block(const QvMats& mat, u64 x, u64 y, int rows, int cols,
                                          int group) {
    int sub = threadIdx.x / LPR, sl = threadIdx.x % LPR;
    int r0 = (blockIdx.x * (QV_WARPS * 32 / LPR) + sub) * (QV_R / NM);
    qmv_rows<BITS, LPR, NM>(mat, (const float*)x, (float*)y, r0, rows, cols, group, sl);
}

template <int BITS, int NM>
__device__ __forceinline__ void qmv_lanes(int lpr, const QvMats& mat, u64 x, u64 y, int rows,
                                          int cols, int group) {
    switch (lpr) {
        case 32: qmv_block<BITS, 32, NM>(mat, x, y, rows, cols, group); break;
        case 16: qmv_block<BITS, 16, NM>(mat, x, y, rows, cols, group); break;
        case 8: qmv_block<BITS, 8, NM>(mat, x, y, rows, cols, group); break;
        default: qmv_block<BITS, 4, NM>(mat, x, y, rows, cols, group); break;
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
    return m;
}

// One kernel per bit width (fewer registers than one dispatching on it), blockIdx.y = job,
// blockIdx.x = the block's QV_WARPS * 32 / lpr lane groups; lpr (lanes per row) is 4, 8, 16 or
// 32, cols a multiple of 32 and of group.
// - qmv<BITS>: up to QM_JOBS products of one shape (the QJobs of qmatmul, one row of x each);
// - qmv_glu<BITS>: QM_JOBS / 2 gated pairs, jobs 2j (gate) and 2j + 1 (up) of one x, into the
//   y of job 2j: glu_f(gate, up) with the gate's and up's sums as qmv computes them;
// - qmv_ids<BITS> / qmv_glu_ids<BITS>: the same for experts named by device-side ids (decode's
//   routed experts without a readback), from the same bytes at the same addresses as a launch
//   on the readback path, so bit-identical results.
#define QMV_KERNELS(BITS)                                                                        \
    extern "C" __global__ void __launch_bounds__(QV_WARPS * 32)                                  \
        qmv##BITS(QJobs jobs, int rows, int cols, int group, int lpr) {                          \
        int j = blockIdx.y;                                                                      \
        qmv_lanes<BITS, 1>(lpr, qv_mats(jobs, j, 1, 0, 0.0f), jobs.x[j], jobs.y[j], rows, cols,  \
                           group);                                                               \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(QV_WARPS * 32)                                  \
        qmv_glu##BITS(QJobs jobs, int rows, int cols, int group, int lpr, int act,               \
                      float limit) {                                                             \
        int j = blockIdx.y;                                                                      \
        qmv_lanes<BITS, 2>(lpr, qv_mats(jobs, j, 2, act, limit), jobs.x[2 * j], jobs.y[2 * j],   \
                           rows, cols, group);                                                   \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(QV_WARPS * 32)                                  \
        qmv_ids##BITS(QIdJobs jobs, const u64* slots, const u32* ids, int rows, int cols,        \
                      int group, int lpr) {                                                      \
        int j = blockIdx.y;                                                                      \
        qmv_lanes<BITS, 1>(lpr, qv_id_mats(jobs, slots, ids, j, 1, 0, 0.0f), jobs.x[j],          \
                           jobs.y[j], rows, cols, group);                                        \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(QV_WARPS * 32)                                  \
        qmv_glu_ids##BITS(QIdJobs jobs, const u64* slots, const u32* ids, int rows, int cols,    \
                          int group, int lpr, int act, float limit) {                            \
        int j = blockIdx.y;                                                                      \
        qmv_lanes<BITS, 2>(lpr, qv_id_mats(jobs, slots, ids, j, 2, act, limit), jobs.x[j],       \
                           jobs.y[j], rows, cols, group);                                        \
    }

QMV_KERNELS(2)
QMV_KERNELS(4)
QMV_KERNELS(8)
