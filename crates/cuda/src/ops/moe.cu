// A decode row's routed experts, the down product and the weighted combine in one launch (after
// quant.cu and router.cu in the translation unit: it uses qmv_sums, QJobs, QIdJobs, qv_mats and
// qv_id_mats).
//
// acc[r] += w[i] * y_i[r] for the k experts i of the row, added in ascending expert id, where
// y_i = down_i . x_i is computed by qmv_sums exactly as a qmv / qmv_ids launch computes it (the
// same lanes per row, the same words per lane, the same shuffles), so the result is bit for bit
// that of qmv_ids (or qmv) into a stack followed by scatter_add (an fma per term, in that order).
//
// Block layout: the G = QV_WARPS * 32 / LPR lane groups of a block are split into P = max(1, G / k)
// row groups of KK = G / P lane groups; lane group g takes row group g / KK and experts
// g % KK, g % KK + KK, ... (every lane group of the block runs the same number of passes, an idle
// one over no rows, so the warp's shuffles stay converged). Each row group has DC_R rows (DC_R2
// at 2 bits, else QV_R), so a block covers P * DC_R rows of every expert; the sums go to shared
// memory, then one thread per
// row adds them into acc in expert order.

#define DC_MAX_K 16
// Rows of a 2-bit down_combine row group (compile.rs defines it; QV_R at 4 and 8 bits): each
// lane's loads of x serve that many rows (the sums are qmv's whatever the count).
#ifndef DC_R2
#define DC_R2 QV_R
#endif

// The weights of the by-address variant, passed by value, in the order of the jobs (ascending
// expert id).
struct DcWeights {
    float w[DC_MAX_K];
};

template <int BITS, int LPR, bool BY_ID, int DC_R = BITS == 2 ? DC_R2 : QV_R>
__device__ void down_combine(const QJobs& jobs, const DcWeights& cw, const QIdJobs& id_jobs,
                             const u64* slots, const u32* ids, const float* wts, int k,
                             float* acc, int rows, int cols, int group) {
    const int G = QV_WARPS * 32 / LPR;
    __shared__ float ys[DC_MAX_K][QV_WARPS * 32 / 4 * DC_R];
    __shared__ int order[DC_MAX_K];
    int P = max(1, G / k), KK = G / P;
    int g = threadIdx.x / LPR, sl = threadIdx.x % LPR;
    int p = g / KK, e0 = g % KK;
    int row0 = blockIdx.x * P * DC_R;
    if (threadIdx.x < k) {
        int i = threadIdx.x;
        if (BY_ID) {
            // Rank by id: the ids of a row are distinct.
            int rank = 0;
            for (int j = 0; j < k; ++j) rank += ids[j] < ids[i];
            order[rank] = i;
        } else {
            order[i] = i;
        }
    }
    int passes = (k + KK - 1) / KK;
    for (int pass = 0; pass < passes; ++pass) {
        int e = e0 + pass * KK;
        bool live = p < P && e < k;
        int ee = live ? e : 0;
        QvMats m = BY_ID ? qv_id_mats(id_jobs, slots, ids, ee, 1, 0, 0.0f)
                         : qv_mats(jobs, ee, 1, 0, 0.0f);
        u64 x = BY_ID ? id_jobs.x[ee] : jobs.x[ee];
        int r0 = row0 + (live ? p : 0) * DC_R;
        // A job of the by-address variant with no codes (w = 0) is an expert computed on the
        // host: its output rows are at y, nothing is read for it here (no rows, no columns).
        bool host = !BY_ID && live && jobs.w[ee] == 0;
        float s[DC_R];
        qmv_sums<BITS, LPR, 1, false, DC_R>(m, (const float*)x, nullptr, r0,
                                            live && !host ? rows : 0, host ? 0 : cols, group, sl, s);
        if (host) {
#pragma unroll
            for (int rr = 0; rr < DC_R; ++rr)
                s[rr] = r0 + rr < rows ? ((const float*)jobs.y[ee])[r0 + rr] : 0.0f;
        }
        if (live && sl == 0) {
#pragma unroll
            for (int rr = 0; rr < DC_R; ++rr) ys[e][p * DC_R + rr] = s[rr];
        }
    }
    __syncthreads();
    int t = threadIdx.x;
    if (t < P * DC_R && row0 + t < rows) {
        float a = acc[row0 + t];
        for (int j = 0; j < k; ++j) {
            int i = order[j];
            a = __fmaf_rn(BY_ID ? wts[i] : cw.w[i], ys[i][t], a);
        }
        acc[row0 + t] = a;
    }
}

template <int BITS, bool BY_ID>
__device__ __forceinline__ void down_combine_lanes(int lpr, const QJobs& jobs,
                                                   const DcWeights& cw, const QIdJobs& id_jobs,
                                                   const u64* slots, const u32* ids,
                                                   const float* wts, int k, float* acc, int rows,
                                                   int cols, int group) {
    switch (lpr) {
        case 32:
            down_combine<BITS, 32, BY_ID>(jobs, cw, id_jobs, slots, ids, wts, k, acc, rows, cols,
                                          group);
            break;
        case 16:
            down_combine<BITS, 16, BY_ID>(jobs, cw, id_jobs, slots, ids, wts, k, acc, rows, cols,
                                          group);
            break;
        case 8:
            down_combine<BITS, 8, BY_ID>(jobs, cw, id_jobs, slots, ids, wts, k, acc, rows, cols,
                                         group);
            break;
        default:
            down_combine<BITS, 4, BY_ID>(jobs, cw, id_jobs, slots, ids, wts, k, acc, rows, cols,
                                         group);
            break;
    }
}

// qmv_down_combine<BITS>: jobs 0 .. k of a QJobs (one per expert, in ascending expert id: its
// down matrix and its GLU row x[j]; y unused), weights cw.w[j]; a job with w[j] = 0 is an expert
// computed on the host, its output row (rows floats) at y[j].
// qmv_down_combine_ids<BITS>: the QIdJobs jobs 0 .. k (pick[j] = j, mat[j] = 0) of the experts at
// ids[0 .. k) (any order; added in ascending id), weights wts[0 .. k) on the device.
// Grid: rows / (P * DC_R) blocks of QV_WARPS warps; lpr as qmv's.
#define DOWN_COMBINE_KERNELS(BITS)                                                               \
    extern "C" __global__ void __launch_bounds__(QV_WARPS * 32)                                  \
        qmv_down_combine##BITS(QJobs jobs, DcWeights cw, int k, float* acc, int rows, int cols,  \
                               int group, int lpr) { grid_dep_wait();                            \
        QIdJobs none;                                                                            \
        down_combine_lanes<BITS, false>(lpr, jobs, cw, none, nullptr, nullptr, nullptr, k, acc,  \
                                        rows, cols, group);                                      \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(QV_WARPS * 32)                                  \
        qmv_down_combine_ids##BITS(QIdJobs jobs, const u64* slots, const u32* ids,               \
                                   const float* wts, int k, float* acc, int rows, int cols,      \
                                   int group, int lpr) { grid_dep_wait();                        \
        QJobs none;                                                                              \
        DcWeights nw;                                                                            \
        down_combine_lanes<BITS, true>(lpr, none, nw, jobs, slots, ids, wts, k, acc, rows, cols, \
                                       group);                                                   \
    }

DOWN_COMBINE_KERNELS(2)
DOWN_COMBINE_KERNELS(4)
DOWN_COMBINE_KERNELS(8)
