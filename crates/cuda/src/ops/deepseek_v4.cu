// DeepSeek-V4's own kernels (the math: transformers `modeling_deepseek_v4.py`; the f64 twins in
// crates/backend/src/reference/deepseek_v4.rs): the grouped product's column join, the manifold-constrained hyper-connections (mHC), the KV compressor's window
// pooling and the Lightning indexer's scores. RoPE at given positions is attention.cu's `rope`
// with `positions`, sparse attention its split kernel with `SparseArgs`.

// dst[t, col0 + c] = src[t, c] for src [t_rows, c_src] and dst rows of c_dst.
extern "C" __global__ void place_cols(const float* src, u64 t_rows, int c_src, float* dst,
                                      int c_dst, int col0) {
    grid_dep_wait();
    FOR_EACH(i, t_rows * (u64)c_src) {
        u64 t = i / c_src, c = i % c_src;
        dst[t * c_dst + col0 + c] = src[i];
    }
}

// Most mixes per mHC row: (2 + n) * n for n <= 6 streams.
#define HC_MAX_MIX 48
// Columns of an mHC row per hc_mix_parts block (256 threads: each warp takes every column of
// the block, 8 per lane, for its share of the mixes).
#define HC_SPLIT 256

// The mHC entry's products, split over the columns: block (s, row) sums, over its HC_SPLIT
// columns c of the row of x ([T, cols]), f[i, c] * x[c] for the m rows of f and x[c]^2, into
// parts[(row * splits + s) * (m + 1) + i] (i = m: the squares). Warp w takes mixes w, w + 8, ..:
// a lane's 8 columns (8 loads in flight per mix), then a warp sum.
extern "C" __global__ void hc_mix_parts(const float* x, int cols, const float* f, int m,
                                        float* parts) {
    grid_dep_wait();
    int s = blockIdx.x, row = blockIdx.y, splits = gridDim.x;
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const float* xr = x + (u64)row * cols;
    float xv[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        int c = s * HC_SPLIT + lane + 32 * k;
        xv[k] = c < cols ? xr[c] : 0.0f;
    }
    // Every warp runs the same number of rounds (the CPU emulation's shuffles are block-wide).
    for (int i0 = 0; i0 <= m; i0 += 8) {
        int i = i0 + w;
        float a = 0.0f;
        if (i < m) {
            const float* fr = f + (u64)i * cols;
            float fv[8];
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                int c = s * HC_SPLIT + lane + 32 * k;
                fv[k] = c < cols ? fr[c] : 0.0f;
            }
#pragma unroll
            for (int k = 0; k < 8; ++k) a = fmaf(fv[k], xv[k], a);
        } else if (i == m) {
#pragma unroll
            for (int k = 0; k < 8; ++k) a = fmaf(xv[k], xv[k], a);
        }
        a = warp_sum(a);
        if (lane == 0 && i <= m) parts[((u64)row * splits + s) * (m + 1) + i] = a;
    }
}

// Columns of col per hc_pre_row block (one per thread).
#define HC_COLS 256

// The mHC entry of row blockIdx.x of x ([T, n * d]) from hc_mix_parts' sums (`splits` parts per
// row): r = 1 / sqrt(mean(x^2) + norm_eps); mix[i] = r * sum_c f[i, c] x[c] for the m rows of f;
// pre_j = sigmoid(mix[j] * scale[0] + base[j]) + hc_eps and col = sum_j pre_j x_j ([T, d]),
// HC_COLS columns of it per block (blockIdx.y). With m = (2 + n) * n the first block of a row also
// writes post_j = 2 sigmoid(mix[n + j] * scale[1] + base[n + j]) ([T, n]) and the comb matrix
// ([T, n * n], row j = softmax_k(mix[2n + j n + k] * scale[2] + base[..]) + hc_eps, columns
// normalised, then sinkhorn - 1 rounds of rows then columns, every denominator + hc_eps: the
// f32 twin of the CPU's hc_weights, whose sums add hc_eps last where these start from it).
// Every block sums the parts (warp w takes mixes w, w + 8, ..; lanes the splits; the same order
// in every block), then thread e < n * n holds comb entry e (j = e / n, k = e % n) and reads its
// row's or column's entries from shared memory in the order of the sequential rule, so each
// entry's bits are those of one thread doing it all.
extern "C" __global__ void hc_pre_row(const float* x, int cols, int n, const float* parts,
                                      int splits, int m, const float* base, const float* scale,
                                      float hc_eps, float norm_eps, int sinkhorn, float* col,
                                      float* post, float* comb) {
    grid_dep_wait();
    __shared__ float mix[HC_MAX_MIX + 1];
    __shared__ float pre[8];
    __shared__ float cs[2][HC_MAX_MIX];
    int row = blockIdx.x, d = cols / n, t = threadIdx.x, nn = n * n;
    int lane = t & 31, w = t >> 5;
    const float* xr = x + (u64)row * cols;
    const float* pr = parts + (u64)row * splits * (m + 1);
    // Every warp runs the same number of rounds (the CPU emulation's shuffles are block-wide).
    for (int i0 = 0; i0 <= m; i0 += 8) {
        int i = i0 + w;
        float a = 0.0f;
        if (i <= m)
            for (int s = lane; s < splits; s += 32) a += pr[s * (m + 1) + i];
        a = warp_sum(a);
        if (lane == 0 && i <= m) mix[i] = a;
    }
    __syncthreads();
    float r = 1.0f / sqrtf(mix[m] / (float)cols + norm_eps);
    if (t < n) pre[t] = sigmoid_f(mix[t] * r * scale[0] + base[t]) + hc_eps;
    if (blockIdx.y == 0 && m != n) {
        if (t < n)
            post[(u64)row * n + t] = 2.0f * sigmoid_f(mix[n + t] * r * scale[1] + base[n + t]);
        int j = t / n, k = t % n;
        float v = 0.0f;
        if (t < nn) {
            v = mix[2 * n + t] * r * scale[2] + base[2 * n + t];
            cs[0][t] = v;
        }
        __syncthreads();
        if (t < nn) {
            float mx = -F32_INF;
            for (int q = 0; q < n; ++q) mx = fmaxf(mx, cs[0][j * n + q]);
            v = expf(v - mx);
            cs[1][t] = v;
        }
        __syncthreads();
        if (t < nn) {
            float z = 0.0f;
            for (int q = 0; q < n; ++q) z += cs[1][j * n + q];
            v = v / z + hc_eps;
            cs[0][t] = v;
        }
        __syncthreads();
        // Half-rounds: the columns, then (rows, columns) sinkhorn - 1 times. Each reads buffer b
        // and writes the other: one barrier per half-round.
        int b = 0;
        for (int h = 0; h < 2 * max(sinkhorn, 1) - 1; ++h) {
            if (t < nn) {
                bool rows = h & 1;
                const float* line = rows ? &cs[b][j * n] : &cs[b][k];
                int step = rows ? 1 : n;
                float z = hc_eps;
                for (int q = 0; q < n; ++q) z += line[q * step];
                v /= z;
                cs[b ^ 1][t] = v;
            }
            b ^= 1;
            __syncthreads();
        }
        if (t < nn) comb[(u64)row * nn + t] = v;
    }
    __syncthreads();
    int end = min(d, (int)(blockIdx.y + 1) * HC_COLS);
    for (int i = blockIdx.y * HC_COLS + t; i < end; i += blockDim.x) {
        float a = 0.0f;
        for (int q = 0; q < n; ++q) a += pre[q] * xr[q * d + i];
        col[(u64)row * d + i] = a;
    }
}

// The mHC exit: y[t, k, i] = post[t, k] * out[t, i] + sum_j comb[t, j, k] * x[t, j, i] for x
// [T, n * d], out [T, d], post [T, n], comb [T, n * n].
extern "C" __global__ void hc_post(const float* x, const float* out, const float* post,
                                   const float* comb, u64 t_rows, int n, int d, float* y) {
    grid_dep_wait();
    FOR_EACH(idx, t_rows * (u64)n * d) {
        int i = (int)(idx % d);
        u64 rk = idx / d;
        int k = (int)(rk % n);
        u64 r = rk / n;
        const float* xr = x + r * n * d;
        const float* cr = comb + r * n * n;
        float mix = 0.0f;
        for (int j = 0; j < n; ++j) mix += cr[j * n + k] * xr[(u64)j * d + i];
        y[idx] = post[r * n + k] * out[r * d + i] + mix;
    }
}

// Slot s of entry w, channel c of compress_pool (below): its (kv, gate + ape); false when the
// slot takes no weight (window 0's overlap slots without a prior).
__device__ __forceinline__ bool pool_slot(const float* kv, const float* gate, const float* ape,
                                          int rate, int width, int overlap, const float* pk,
                                          const float* pg, u64 w, int c, int s, float* v,
                                          float* g) {
    int d = overlap ? width / 2 : width;
    if (overlap && s < rate) {
        if (w == 0) {
            if (!pk) return false;
            *v = pk[(u64)s * d + c];
            *g = pg[(u64)s * d + c];
            return true;
        }
        u64 at = ((w - 1) * rate + s) * width + c;
        *v = kv[at];
        *g = gate[at] + ape[(u64)s * width + c];
        return true;
    }
    int i = overlap ? s - rate : s;
    int col = (overlap ? d : 0) + c;
    u64 at = (w * rate + i) * width + col;
    *v = kv[at];
    *g = gate[at] + ape[(u64)i * width + col];
    return true;
}

// DeepSeek-V4's KV compressor pooling, one thread per (entry w, channel c): out[w, c] = sum over
// the entry's slots of softmax(g) * kv, slots as in DeepSeekV4Ops::compress_pool (overlap: rate
// slots of window w - 1's first d columns, or of the prior (pk, pg) [rate, d] for w = 0, then
// rate slots of window w's last d columns; else window w's rate rows).
extern "C" __global__ void compress_pool(const float* kv, const float* gate, const float* ape,
                                         int rate, int width, int overlap, const float* pk,
                                         const float* pg, u64 n_win, float* out) {
    grid_dep_wait();
    int d = overlap ? width / 2 : width;
    int slots = overlap ? 2 * rate : rate;
    FOR_EACH(idx, n_win * (u64)d) {
        u64 w = idx / d;
        int c = (int)(idx % d);
        float v, g, m = -F32_INF;
        for (int s = 0; s < slots; ++s)
            if (pool_slot(kv, gate, ape, rate, width, overlap, pk, pg, w, c, s, &v, &g))
                m = fmaxf(m, g);
        float z = 0.0f, acc = 0.0f;
        for (int s = 0; s < slots; ++s) {
            if (!pool_slot(kv, gate, ape, rate, width, overlap, pk, pg, w, c, s, &v, &g)) continue;
            float e = expf(g - m);
            z += e;
            acc += v * e;
        }
        out[idx] = acc / z;
    }
}

// The Lightning indexer's scores, a warp per (row r, entry e): scores[r, e] = sum_h weights[r, h]
// * relu(q[r, h] . keys[e]) for e < visible[r], -inf beyond (q [T, nh * d], keys [n_keys, d]).
extern "C" __global__ void index_scores(const float* q, const float* keys, const float* weights,
                                        int t_rows, int nh, int d, int n_keys,
                                        const int* visible, float* scores) {
    grid_dep_wait();
    u64 warps = ((u64)gridDim.x * blockDim.x) >> 5;
    u64 first = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    for (u64 i = first; i < (u64)t_rows * n_keys; i += warps) {
        int r = (int)(i / n_keys), e = (int)(i % n_keys);
        if (e >= visible[r]) {
            if (lane == 0) scores[i] = -F32_INF;
            continue;
        }
        const float* k = keys + (u64)e * d;
        float total = 0.0f;
        for (int h = 0; h < nh; ++h) {
            const float* qh = q + ((u64)r * nh + h) * d;
            float dot = 0.0f;
            for (int c = lane; c < d; c += 32) dot = fmaf(qh[c], k[c], dot);
            dot = warp_sum(dot);
            total += weights[(u64)r * nh + h] * fmaxf(dot, 0.0f);
        }
        if (lane == 0) scores[i] = total;
    }
}
