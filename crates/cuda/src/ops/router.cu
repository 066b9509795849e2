// The router: each row's top-k experts and their combine weights, computed on the device so
// only ids and weights cross to the host.

// f32 as an i32 in total order (Rust's f32::total_cmp).
__device__ __forceinline__ int total_key(float v) {
    int b = __float_as_int(v);
    return b ^ (int)(((u32)(b >> 31)) >> 1);
}

// Largest-first order with ties to the lower index: (ka, ia) comes before (kb, ib).
__device__ __forceinline__ bool before(int ka, int ia, int kb, int ib) {
    return ka > kb || (ka == kb && ia < ib);
}

#define ROUTE_MAX_K 64

// How a row's experts are scored (`RouteScoring` in router.rs). scoring 0: top-k of the raw
// logits, softmax over the k chosen (Gemma 4). 1: softmax over all, top-k of the probabilities,
// divided by their sum when norm (Qwen 3.6). 2: DeepSeek-V4's sqrt(softplus(logit)), top-k of the
// score plus the f32 correction bias at bias_off (2-byte aligned) of the resident buffer when
// has_bias, each chosen score over their sum (+ 1e-20) times rsf (routed_scaling_factor). With
// has_pes each weight is then multiplied by the BF16 per-expert scale at pes_off.
struct RouteScoring {
    int scoring, norm, has_pes, has_bias;
    u64 pes_off, bias_off;
    float rsf;
};

// DeepSeek-V4's expert score (scoring 2): sqrt(softplus(x)), softplus as max(x, 0) +
// log1p(exp(-|x|)).
__device__ __forceinline__ float sqrt_softplus_f(float x) {
    return sqrtf(fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x))));
}

// The key expert e is chosen by under scoring 2: its score plus the correction bias (f32 read as
// two 16-bit halves: the resident buffer's tensors are only 2-byte aligned).
__device__ __forceinline__ float biased_score(float p, int e, const RouteScoring& sc,
                                              const unsigned char* base) {
    if (!sc.has_bias) return p;
    const u16* h = (const u16*)(base + sc.bias_off) + 2 * e;
    return p + __uint_as_float((u32)h[0] | ((u32)h[1] << 16));
}

// One candidate e of pick j of a row's top-k search: its key (the raw logit for scoring 0, its
// probability exp(lg[e] - m) / z for scoring 1, the biased score for scoring 2) in total order;
// taken as (best, bk) when it comes after the previous pick (pk, pi) and before the best so far.
__device__ __forceinline__ void route_consider(const float* lg, int e, const RouteScoring& sc,
                                               const unsigned char* base, float m, float z, int j,
                                               int pk, int pi, int& best, int& bk) {
    float p = sc.scoring == 1   ? expf(lg[e] - m) / z
              : sc.scoring == 2 ? biased_score(sqrt_softplus_f(lg[e]), e, sc, base)
                                : lg[e];
    int ke = total_key(p);
    if (j > 0 && !before(pk, pi, ke, e)) return;
    if (best < 0 || before(ke, e, bk, best)) { best = e; bk = ke; }
}

// The combine weights of the k experts `pick` of one row, before any per-expert scale, into w
// (lg its logits; m, z the max and the softmax denominator of scoring 1).
__device__ void route_weights(const float* lg, int k, const RouteScoring& sc, float m, float z,
                              const int* pick, float* w) {
    if (sc.scoring == 2) {
        float zz = 0.0f;
        for (int j = 0; j < k; ++j) { w[j] = sqrt_softplus_f(lg[pick[j]]); zz += w[j]; }
        zz += 1e-20f;
        for (int j = 0; j < k; ++j) w[j] = w[j] / zz * sc.rsf;
    } else if (sc.scoring == 0) {
        float mm = -F32_INF, zz = 0.0f;
        for (int j = 0; j < k; ++j) mm = fmaxf(mm, lg[pick[j]]);
        for (int j = 0; j < k; ++j) { w[j] = expf(lg[pick[j]] - mm); zz += w[j]; }
        for (int j = 0; j < k; ++j) w[j] /= zz;
    } else {
        float zz = 0.0f;
        for (int j = 0; j < k; ++j) { w[j] = expf(lg[pick[j]] - m) / z; zz += w[j]; }
        if (!sc.norm) zz = 1.0f;
        for (int j = 0; j < k; ++j) w[j] /= zz;
    }
}

// The weights of the k experts `pick` of one row and their writing: route_row's second half.
__device__ void route_write(const float* lg, int k, const RouteScoring& sc, float m, float z,
                            const int* pick, const unsigned char* base, u32* ids, float* weights) {
    float w[ROUTE_MAX_K];
    route_weights(lg, k, sc, m, z, pick, w);
    const u16* pes = (const u16*)(base + sc.pes_off);
    for (int j = 0; j < k; ++j) {
        ids[j] = (u32)pick[j];
        weights[j] = sc.has_pes ? w[j] * bf16_to_f32(pes[pick[j]]) : w[j];
    }
}

// One row's routing, lg its n logits, scored as `sc` says (RouteScoring). *margin = (k-th
// largest raw logit) - (k+1-th) when trace. With has_forced, the ids are forced[0 .. k) (a
// replayed routing trace) instead of the top-k, weighted by the same scoring. Writes ids[0 .. k)
// and weights[0 .. k).
__device__ void route_row(const float* lg, int n, int k, const RouteScoring& sc,
                          const unsigned char* base, int trace, const u32* forced, int has_forced,
                          u32* ids, float* weights, float* margin) {
    float m = -F32_INF, z = 0.0f;
    if (sc.scoring == 1) {
        for (int e = 0; e < n; ++e) m = fmaxf(m, lg[e]);
        for (int e = 0; e < n; ++e) z += expf(lg[e] - m);
    }
    int pick[ROUTE_MAX_K];
    int pk = 0, pi = -1;
    for (int j = 0; j < k; ++j) {
        if (has_forced) {
            pick[j] = (int)forced[j];
            continue;
        }
        int best = -1, bk = 0;
        for (int e = 0; e < n; ++e) route_consider(lg, e, sc, base, m, z, j, pk, pi, best, bk);
        pick[j] = best;
        pk = bk;
        pi = best;
    }
    route_write(lg, k, sc, m, z, pick, base, ids, weights);
    if (trace) {
        // The k-th and (k+1)-th raw logits in total order.
        float kth = 0.0f, next = F32_INF;
        int qk = 0, qi = -1;
        for (int j = 0; j <= k && j < n; ++j) {
            int best = -1, bk = 0;
            for (int e = 0; e < n; ++e) {
                int ke = total_key(lg[e]);
                if (j > 0 && !before(qk, qi, ke, e)) continue;
                if (best < 0 || before(ke, e, bk, best)) { best = e; bk = ke; }
            }
            qk = bk;
            qi = best;
            if (j == k - 1) kth = lg[best];
            if (j == k) next = lg[best];
        }
        *margin = k < n ? kth - next : F32_INF;
    }
}

// route_row for every row of logits [t_rows, n], one thread per row.
extern "C" __global__ void route(const float* logits, int t_rows, int n, int k, RouteScoring sc,
                                 const unsigned char* base, int trace, const u32* forced,
                                 int has_forced, u32* ids, float* weights, float* margins) {
    grid_dep_wait();
    int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= t_rows) return;
    u64 at = (u64)row * k;
    route_row(logits + (u64)row * n, n, k, sc, base, trace, forced + (has_forced ? at : 0),
              has_forced, ids + at, weights + at, margins + row);
}

// Experts route_one holds in shared memory (routers with more are refused by the launch).
#define ROUTE_ONE_MAX_N 1024

// route_row (no trace) by the 32 lanes of one warp: the logits are copied to shared memory in one
// pass; with scoring 1, lane 0 takes their maximum and the softmax denominator serially (each
// exp computed by the lanes first, with route_row's arithmetic), so m and z are route_row's bits.
// Each expert's key (its raw logit, exp(lg[e] - m) / z, or its biased score) is computed once; each
// round's largest remaining key is found by the lanes over their experts and a shuffle reduction
// (the order is total: the same pick as the serial search), and the weights are route_row's
// arithmetic, so the results are route_row's bits.
__device__ void route_row_warp(const float* lg_in, int n, int k, const RouteScoring& sc,
                               const unsigned char* base, const u32* forced, int has_forced,
                               u32* ids, float* weights) {
    const unsigned FULL = 0xffffffffu;
    __shared__ float lg[ROUTE_ONE_MAX_N];
    __shared__ float ex[ROUTE_ONE_MAX_N];
    __shared__ int key[ROUTE_ONE_MAX_N];
    int lane = threadIdx.x & 31;
    for (int e = lane; e < n; e += 32) lg[e] = lg_in[e];
    __syncwarp();
    float m = -F32_INF, z = 0.0f;
    if (sc.scoring == 1) {
        if (lane == 0)
            for (int e = 0; e < n; ++e) m = fmaxf(m, lg[e]);
        m = __shfl_sync(FULL, m, 0);
        for (int e = lane; e < n; e += 32) ex[e] = expf(lg[e] - m);
        __syncwarp();
        if (lane == 0)
            for (int e = 0; e < n; ++e) z += ex[e];
        z = __shfl_sync(FULL, z, 0);
    }
    for (int e = lane; e < n; e += 32) {
        float p = sc.scoring == 1   ? ex[e] / z
                  : sc.scoring == 2 ? biased_score(sqrt_softplus_f(lg[e]), e, sc, base)
                                    : lg[e];
        key[e] = total_key(p);
    }
    __syncwarp();
    int pick[ROUTE_MAX_K];
    int pk = 0, pi = -1;
    for (int j = 0; j < k; ++j) {
        if (has_forced) {
            pick[j] = (int)forced[j];
            continue;
        }
        int best = -1, bk = 0;
        for (int e = lane; e < n; e += 32) {
            int ke = key[e];
            if (j > 0 && !before(pk, pi, ke, e)) continue;
            if (best < 0 || before(ke, e, bk, best)) { best = e; bk = ke; }
        }
        for (int o = 16; o > 0; o >>= 1) {
            int ob = __shfl_xor_sync(FULL, best, o), ok = __shfl_xor_sync(FULL, bk, o);
            if (ob >= 0 && (best < 0 || before(ok, ob, bk, best))) { best = ob; bk = ok; }
        }
        pick[j] = best;
        pk = bk;
        pi = best;
    }
    // Lane 0 computes the weights (serially, as route_row); lane j scales and writes pick j, so
    // the per-expert scales are loaded together.
    __shared__ float w[ROUTE_MAX_K];
    if (lane == 0) route_weights(lg, k, sc, m, z, pick, w);
    __syncwarp();
    const u16* pes = (const u16*)(base + sc.pes_off);
    for (int j = lane; j < k; j += 32) {
        ids[j] = (u32)pick[j];
        weights[j] = sc.has_pes ? w[j] * bf16_to_f32(pes[pick[j]]) : w[j];
    }
}

// The forced ids of one decode row, passed by value (no host-to-device copy).
struct ForcedIds {
    u32 ids[ROUTE_MAX_K];
};

// route for the one row of a decode step (one warp, no trace), its ids and weights left in
// device memory for qmv_glu_ids and qmv_down_combine_ids (moe.cu).
extern "C" __global__ void route_one(const float* logits, int n, int k, RouteScoring sc,
                                     const unsigned char* base, ForcedIds forced, int has_forced,
                                     u32* ids, float* weights) {
    grid_dep_wait();
    if (blockIdx.x != 0 || threadIdx.x >= 32) return;
    route_row_warp(logits, n, k, sc, base, forced.ids, has_forced, ids, weights);
}

// route (no trace) for rows of logits [t_rows, n], one warp (block) per row: route_row_warp, so
// route_row's bits (a prefill chunk's routing; `route`'s one thread per row left most of the
// device idle). forced: t_rows * k ids when has_forced.
extern "C" __global__ void route_warps(const float* logits, int t_rows, int n, int k,
                                       RouteScoring sc, const unsigned char* base,
                                       const u32* forced, int has_forced, u32* ids,
                                       float* weights) {
    grid_dep_wait();
    int row = blockIdx.x;
    if (row >= t_rows || threadIdx.x >= 32) return;
    u64 at = (u64)row * k;
    route_row_warp(logits + (u64)row * n, n, k, sc, base, forced + (has_forced ? at : 0),
                   has_forced, ids + at, weights + at);
}
