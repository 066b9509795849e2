// RoPE, the KV cache write and causal attention over it.

// Rotates the first `rotated` dims of every `head_dim` head of row r of x ([T, cols]) by position
// pos0 + r: pair i turns by (pos0 + r) * inv_freq[i] (the angle formed in f32, as on the host),
// cos and sin scaled by mscale. style 0: NeoX (i, i + rotated/2); 1: interleaved (2i, 2i + 1).
// Pair i (of half = rotated / 2) of one head turned by position pos: read from src, written to
// dst (the same head, or its normalized copy and the head).
__device__ __forceinline__ void rope_pair(const float* src, float* dst, int i, int half,
                                          int style, const float* inv_freq, int pos,
                                          float mscale) {
    float ang = (float)pos * inv_freq[i];
    float s, c;
    sincosf(ang, &s, &c);
    if (mscale != 1.0f) { c *= mscale; s *= mscale; }
    int ia = style == 0 ? i : 2 * i;
    int ib = style == 0 ? i + half : 2 * i + 1;
    float x1 = src[ia], x2 = src[ib];
    dst[ia] = x1 * c - x2 * s;
    dst[ib] = x1 * s + x2 * c;
}

// Row r at position pos0 + r, or at positions[r] when given (DeepSeek-V4's rope_at: compressed
// entries sit at rate * w, not at consecutive positions).
extern "C" __global__ void rope(float* x, u64 t_rows, int cols, int head_dim, int rotated,
                                int style, const float* inv_freq, int pos0,
                                const int* positions, float mscale) {
    grid_dep_wait();
    int half = rotated / 2;
    int heads = cols / head_dim;
    FOR_EACH(idx, t_rows * (u64)heads * half) {
        int i = (int)(idx % half);
        u64 rh = idx / half;                 // row * heads + head
        float* h = x + rh * head_dim;
        int r = (int)(rh / heads);
        rope_pair(h, h, i, half, style, inv_freq, positions ? positions[r] : pos0 + r, mscale);
    }
}

// Row r of k and v ([T, width]) into the store row of position pos0 + r (pos % rows in a ring).
// When a ring is shorter than the chunk, only the last writer of each store row writes, so the
// result is the host's sequential one.
template <typename S, typename Conv>
__device__ void kv_write_impl(S* ks, S* vs, const float* k, const float* v, int t_rows,
                              int width, int rows, int ring, int pos0, Conv conv) {
    FOR_EACH(i, (u64)t_rows * width) {
        int r = (int)(i / width), e = (int)(i % width);
        if (ring && r + rows < t_rows) continue;
        int pos = pos0 + r;
        u64 row = ring ? (u64)(pos % rows) : (u64)pos;
        ks[row * width + e] = conv(k[i]);
        vs[row * width + e] = conv(v[i]);
    }
}

struct ToF16 { __device__ u16 operator()(float x) const { return f32_to_f16(x); } };
struct ToF32 { __device__ float operator()(float x) const { return x; } };

extern "C" __global__ void kv_write_f16(u16* ks, u16* vs, const float* k, const float* v,
                                        int t_rows, int width, int rows, int ring, int pos0) {
    grid_dep_wait();
    kv_write_impl(ks, vs, k, v, t_rows, width, rows, ring, pos0, ToF16());
}

extern "C" __global__ void kv_write_f32(float* ks, float* vs, const float* k, const float* v,
                                        int t_rows, int width, int rows, int ring, int pos0) {
    grid_dep_wait();
    kv_write_impl(ks, vs, k, v, t_rows, width, rows, ring, pos0, ToF32());
}

__device__ __forceinline__ float load_kv(const u16* p, u64 i) { return f16_to_f32(p[i]); }
__device__ __forceinline__ float load_kv(const float* p, u64 i) { return p[i]; }

// Dimensions of a head one lane holds (head_dim <= 32 * ATTN_PER_LANE).
#define ATTN_PER_LANE 16
// Warps per (query row, head): each takes every ATTN_WARPS-th visible position.
#define ATTN_WARPS 16

// q . k for one position: the lane's dims, summed over the warp.
template <typename S>
__device__ __forceinline__ float attn_dot(const float* qv, const S* ks, u64 base, int d, int lane) {
    float dot = 0.0f;
#pragma unroll
    for (int k = 0; k < ATTN_PER_LANE; ++k) {
        int c = lane + 32 * k;
        if (c < d) dot += qv[k] * load_kv(ks, base + c);
    }
    return warp_sum(dot);
}

// One online-softmax step: position with logit s and value row at base.
template <typename S>
__device__ __forceinline__ void attn_step(float s, const S* vs, u64 base, int d, int lane, float& m,
                                          float& l, float* o) {
    float mn = fmaxf(m, s);
    float corr = m == -F32_INF ? 0.0f : expf(m - mn);
    float e = expf(s - mn);
    l = l * corr + e;
#pragma unroll
    for (int k = 0; k < ATTN_PER_LANE; ++k) {
        int c = lane + 32 * k;
        if (c < d) o[k] = o[k] * corr + e * load_kv(vs, base + c);
    }
    m = mn;
}

// Inkling's relative-position bias (attention_rel; `rel` = 0 for plain attention): the logit of
// query item (row, head) at position p against the key at distance dist = p - j becomes
// tau_p * (q . k * scale + sum_i rel[item, i] * proj[i, dist]), the sum only for dist < extent;
// rel [T, nh, d_rel] (d_rel <= 32) and proj [d_rel, extent] f32 at device addresses;
// tau_p = 1 + alpha * ln(max((p + 1) / n_floor, 1)) on global layers (n_floor 0: tau_p = 1).
struct RelArgs {
    u64 rel;
    u64 proj;
    int d_rel;
    int extent;
    float alpha;
    float n_floor;
};

__device__ __forceinline__ float rel_tau(const RelArgs& ra, int p) {
    return ra.n_floor > 0.0f ? 1.0f + ra.alpha * logf(fmaxf((float)(p + 1) / ra.n_floor, 1.0f))
                             : 1.0f;
}

// The biased logit of one key for a warp whose lane i < d_rel holds rc = rel[item, i] (every lane
// of the warp calls it: the bias is a warp sum).
__device__ __forceinline__ float rel_logit(const RelArgs& ra, float rc, float s, int dist,
                                           int lane, float tau) {
    const float* proj = (const float*)ra.proj;
    float b = lane < ra.d_rel && dist < ra.extent ? rc * proj[(u64)lane * ra.extent + dist] : 0.0f;
    return (s + warp_sum(b)) * tau;
}

// DeepSeek-V4's sparse attention (attention_sparse; `ent` = 0 for plain attention): query row r
// also attends to the rows vis_idx[vis_off[r] .. vis_off[r + 1]) of the compressed entries `ent`
// ([N, nkv * d] f32, K = V), in one more part (blockIdx.y == splits) merged with the others.
struct SparseArgs {
    u64 ent;
    u64 vis_off;
    u64 vis_idx;
};

// Part `sp` of `splits` of softmax(q k^T * scale) v for one (query row, head) per block of
// ATTN_WARPS warps: the visible positions lo..=p (p = pos0 + row; lo = p + 1 - window for a
// sliding window) are cut into `splits` runs of equal length, and this block takes run sp. Warp
// w runs an online softmax (running maximum) over positions w, w + ATTN_WARPS, ... of the run,
// two at a time; the warps' (maximum, sum, output) are merged in warp order into part_m, part_l
// and part_o (row item * splits + sp). An empty run gives m = -inf, l = 0, o = 0.
template <typename S>
__device__ void attention_impl(const float* q, const S* ks, const S* vs, int t_rows, int nh,
                               int nkv, int d, int rows, int ring, int pos0, int window,
                               float scale, int splits, RelArgs ra, SparseArgs sa,
                               float* part_m, float* part_l, float* part_o) {
    __shared__ float wm[ATTN_WARPS], wl[ATTN_WARPS];
    __shared__ float wo[ATTN_WARPS][32 * ATTN_PER_LANE];
    int item = blockIdx.x, sp = blockIdx.y;
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    if (item >= t_rows * nh) return;
    int r = item / nh, h = item % nh;
    int kvh = h / (nh / nkv);
    int p = pos0 + r;
    int lo = window > 0 ? max(0, p + 1 - window) : 0;
    int run = (p - lo + splits) / splits;  // ceil((p - lo + 1) / splits)
    int first = lo + sp * run, last = min(p, first + run - 1);
    const float* qh = q + (u64)item * d;
    float qv[ATTN_PER_LANE], o[ATTN_PER_LANE];
#pragma unroll
    for (int k = 0; k < ATTN_PER_LANE; ++k) {
        int c = lane + 32 * k;
        qv[k] = c < d ? qh[c] : 0.0f;
        o[k] = 0.0f;
    }
    float m = -F32_INF, l = 0.0f;
    float rc = ra.rel && lane < ra.d_rel ? ((const float*)ra.rel)[(u64)item * ra.d_rel + lane]
                                         : 0.0f;
    float tau = rel_tau(ra, p);
    if (sa.ent && sp == splits) {
        // The entries part: the row's visible compressed entries, one online softmax per warp.
        const float* ent = (const float*)sa.ent;
        const int* off = (const int*)sa.vis_off;
        const int* idx = (const int*)sa.vis_idx;
        for (int jj = off[r] + w; jj < off[r + 1]; jj += ATTN_WARPS) {
            u64 b = ((u64)idx[jj] * nkv + kvh) * d;
            attn_step(attn_dot(qv, ent, b, d, lane) * scale, ent, b, d, lane, m, l, o);
        }
        first = 1;
        last = 0;  // no positions in this part
    }
    for (int j = first + w; j <= last; j += 2 * ATTN_WARPS) {
        int j2 = j + ATTN_WARPS;
        u64 b1 = ((ring ? (u64)(j % rows) : (u64)j) * nkv + kvh) * d;
        u64 b2 = ((ring ? (u64)(j2 % rows) : (u64)j2) * nkv + kvh) * d;
        float s1 = attn_dot(qv, ks, b1, d, lane) * scale;
        float s2 = j2 <= last ? attn_dot(qv, ks, b2, d, lane) * scale : 0.0f;
        if (ra.rel) {
            s1 = rel_logit(ra, rc, s1, p - j, lane, tau);
            if (j2 <= last) s2 = rel_logit(ra, rc, s2, p - j2, lane, tau);
        }
        attn_step(s1, vs, b1, d, lane, m, l, o);
        if (j2 <= last) attn_step(s2, vs, b2, d, lane, m, l, o);
    }
    if (lane == 0) {
        wm[w] = m;
        wl[w] = l;
    }
#pragma unroll
    for (int k = 0; k < ATTN_PER_LANE; ++k) {
        int c = lane + 32 * k;
        if (c < d) wo[w][c] = o[k];
    }
    __syncthreads();
    float mt = -F32_INF;
    for (int x = 0; x < ATTN_WARPS; ++x) mt = fmaxf(mt, wm[x]);
    float lt = 0.0f;
    for (int x = 0; x < ATTN_WARPS; ++x) {
        if (wm[x] != -F32_INF) lt += wl[x] * expf(wm[x] - mt);
    }
    u64 part = (u64)item * gridDim.y + sp;
    if (threadIdx.x == 0) {
        part_m[part] = mt;
        part_l[part] = lt;
    }
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float acc = 0.0f;
        for (int x = 0; x < ATTN_WARPS; ++x) {
            if (wm[x] != -F32_INF) acc += wo[x][c] * expf(wm[x] - mt);
        }
        part_o[part * d + c] = acc;
    }
}

// out[item] = the parts of attention_impl merged in order, a sink logit (sinks[h]) adding
// e^(sink - m) to the sum once. One block per (row, head).
extern "C" __global__ void attention_merge(const float* part_m, const float* part_l,
                                           const float* part_o, int items, int nh, int d,
                                           int splits, const float* sinks, float* out) {
    grid_dep_wait();
    int item = blockIdx.x;
    if (item >= items) return;
    int h = item % nh;
    const float* pm = part_m + (u64)item * splits;
    const float* pl = part_l + (u64)item * splits;
    float mt = sinks ? sinks[h] : -F32_INF;
    for (int x = 0; x < splits; ++x) mt = fmaxf(mt, pm[x]);
    float lt = sinks ? expf(sinks[h] - mt) : 0.0f;
    for (int x = 0; x < splits; ++x) {
        if (pm[x] != -F32_INF) lt += pl[x] * expf(pm[x] - mt);
    }
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float acc = 0.0f;
        for (int x = 0; x < splits; ++x) {
            if (pm[x] != -F32_INF) acc += part_o[((u64)item * splits + x) * d + c] * expf(pm[x] - mt);
        }
        out[(u64)item * d + c] = acc / lt;
    }
}

extern "C" __global__ void attention_f16(const float* q, const u16* ks, const u16* vs,
                                         int t_rows, int nh, int nkv, int d, int rows, int ring,
                                         int pos0, int window, float scale, int splits,
                                         RelArgs ra, SparseArgs sa, float* part_m,
                                         float* part_l, float* part_o) {
    grid_dep_wait();
    attention_impl(q, ks, vs, t_rows, nh, nkv, d, rows, ring, pos0, window, scale, splits, ra,
                   sa, part_m, part_l, part_o);
}

extern "C" __global__ void attention_f32(const float* q, const float* ks, const float* vs,
                                         int t_rows, int nh, int nkv, int d, int rows, int ring,
                                         int pos0, int window, float scale, int splits,
                                         RelArgs ra, SparseArgs sa, float* part_m,
                                         float* part_l, float* part_o) {
    grid_dep_wait();
    attention_impl(q, ks, vs, t_rows, nh, nkv, d, rows, ring, pos0, window, scale, splits, ra,
                   sa, part_m, part_l, part_o);
}

// Prefill attention, tiled: a block of AT_WARPS warps takes AT_ITEMS consecutive (row, head)
// items of one KV head's group (item i of the group: row i / G, head kvh * G + i % G, with G =
// nh / nkv query heads per KV head), so rows of one chunk and the heads that share a KV head read
// each K and V row from shared memory instead of each reading it from L2. Positions go in tiles
// of AT_POS (8): the block copies the tile's K and V rows (f32) into shared memory, then each
// warp, for its AT_ROWS (4) items:
// - q . k for its 4 items x 8 positions: each lane sums its dims (lane, lane + 32, ...), then a
//   reduce-scatter over the warp (16 + 8 + 4 + 2 + 1 shuffles for the 32 sums) leaves in lane L
//   the logit of item L / 8 and position L % 8;
// - an online softmax per item over its 8 lanes (running maximum m, sum l), positions outside
//   the item's causal / sliding window masked;
// - o[item] = o * correction + sum_pos p v[pos] over the lane's dims (p from its lane by shfl).
// At the end, a sink logit adds e^(sink - m) to l once; out = o / l. f32 throughout (K and V
// converted from the store); results agree with attention_impl's to f32 rounding, not bit for bit.
#define AT_WARPS 4
#define AT_ROWS 4
#define AT_ITEMS (AT_WARPS * AT_ROWS)
#define AT_POS 8

// Elements i .. i + 4 of a K or V store as floats (i a multiple of 4: d % 4 == 0).
__device__ __forceinline__ float4 load_kv4(const u16* p, u64 i) {
    uint2 u = *(const uint2*)(p + i);
    return make_float4(f16_to_f32((u16)(u.x & 0xffffu)), f16_to_f32((u16)(u.x >> 16)),
                       f16_to_f32((u16)(u.y & 0xffffu)), f16_to_f32((u16)(u.y >> 16)));
}
__device__ __forceinline__ float4 load_kv4(const float* p, u64 i) {
    return *(const float4*)(p + i);
}

// kt, vt: shared [AT_POS][32 * DK] each; blockDim.x = AT_WARPS * 32 = 16 * AT_POS; d % 4 == 0.
template <typename S, int DK>
__device__ void attention_tiled_impl(float (*kt)[32 * DK], float (*vt)[32 * DK], const float* q,
                                     const S* ks, const S* vs, int t_rows, int nh, int nkv, int d,
                                     int rows, int ring, int pos0, int window, float scale,
                                     const float* sinks, RelArgs ra, float* out) {
    const int G = nh / nkv;
    const int kvh = blockIdx.y;
    const int n_items = t_rows * G;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int i0 = blockIdx.x * AT_ITEMS;
    // The block's positions: from the first item's window start to the last item's position.
    int last_item = min(i0 + AT_ITEMS, n_items) - 1;
    int p_first = pos0 + i0 / G, p_last = pos0 + last_item / G;
    int j_lo = window > 0 ? max(0, p_first + 1 - window) : 0;

    // This warp's items: position p, head h, q in registers (lane's dims), masked when absent.
    float qv[AT_ROWS][DK], o[AT_ROWS][DK], m[AT_ROWS], l[AT_ROWS];
    int ip[AT_ROWS];
#pragma unroll
    for (int r = 0; r < AT_ROWS; ++r) {
        int it = i0 + w * AT_ROWS + r;
        bool in = it < n_items;
        int row = in ? it / G : 0, h = kvh * G + (in ? it % G : 0);
        ip[r] = in ? pos0 + row : -1;
        const float* qh = q + ((u64)row * nh + h) * d;
#pragma unroll
        for (int k = 0; k < DK; ++k) {
            int c = lane + 32 * k;
            qv[r][k] = in && c < d ? qh[c] * scale : 0.0f;
            o[r][k] = 0.0f;
        }
        m[r] = -F32_INF;
        l[r] = 0.0f;
    }
    for (int j0 = j_lo; j0 <= p_last; j0 += AT_POS) {
        __syncthreads();  // the previous tile's reads are done
        // 16 threads per position, 4 dims (16 bytes of f32, 8 of f16) per load.
        {
            int pj = threadIdx.x >> 4, j = j0 + pj;
            bool okj = j <= p_last;
            u64 rowb = okj ? ((ring ? (u64)(j % rows) : (u64)j) * nkv + kvh) * d : 0;
#pragma unroll
            for (int c = (threadIdx.x & 15) * 4; c < 32 * DK; c += 64) {
                float4 kk = make_float4(0.0f, 0.0f, 0.0f, 0.0f), vv = kk;
                if (okj && c < d) {
                    kk = load_kv4(ks, rowb + c);
                    vv = load_kv4(vs, rowb + c);
                }
                *(float4*)&kt[pj][c] = kk;
                *(float4*)&vt[pj][c] = vv;
            }
        }
        __syncthreads();
        // Partial dots, index r * 8 + pj.
        float s[32];
#pragma unroll
        for (int r = 0; r < AT_ROWS; ++r)
#pragma unroll
            for (int pj = 0; pj < AT_POS; ++pj) {
                float a = 0.0f;
#pragma unroll
                for (int k = 0; k < DK; ++k) a = fmaf(qv[r][k], kt[pj][lane + 32 * k], a);
                s[r * AT_POS + pj] = a;
            }
        // Reduce-scatter: after the step of offset b, lane L holds sums of the indices whose bit
        // b equals L's; at the end lane L holds index L.
#pragma unroll
        for (int b = 16; b >= 1; b >>= 1) {
            bool upper = (lane & b) != 0;
#pragma unroll
            for (int i = 0; i < b; ++i) {
                float send = upper ? s[i] : s[i + b];
                float keep = upper ? s[i + b] : s[i];
                s[i] = keep + __shfl_xor_sync(0xffffffffu, send, b);
            }
        }
        int r_me = lane >> 3, j_me = j0 + (lane & 7);
        // This lane's item and position: visible?
        int p_me = 0;
#pragma unroll
        for (int r = 0; r < AT_ROWS; ++r)
            if (r == r_me) p_me = ip[r];
        bool vis = p_me >= 0 && j_me <= p_me && (window <= 0 || j_me > p_me - window);
        float logit = vis ? s[0] : -F32_INF;
        if (ra.rel && vis) {
            // This lane's item and key: the bias summed in order, then the position scale.
            int it = i0 + w * AT_ROWS + r_me, dist = p_me - j_me;
            const float* rc =
                (const float*)ra.rel + ((u64)(it / G) * nh + kvh * G + it % G) * ra.d_rel;
            const float* proj = (const float*)ra.proj;
            float b = 0.0f;
            if (dist < ra.extent) {
                for (int i = 0; i < ra.d_rel; ++i) b += rc[i] * proj[(u64)i * ra.extent + dist];
            }
            logit = (logit + b) * rel_tau(ra, p_me);
        }
        // The lane's item: its new maximum over the tile's 8 lanes, and this position's weight.
        float mn_me = logit, m_me = -F32_INF;
#pragma unroll
        for (int b = 1; b < 8; b <<= 1) mn_me = fmaxf(mn_me, __shfl_xor_sync(0xffffffffu, mn_me, b));
#pragma unroll
        for (int r = 0; r < AT_ROWS; ++r)
            if (r == r_me) m_me = m[r];
        mn_me = fmaxf(mn_me, m_me);
        float pr = vis ? expf(logit - mn_me) : 0.0f;
        float ps = pr;
#pragma unroll
        for (int b = 1; b < 8; b <<= 1) ps += __shfl_xor_sync(0xffffffffu, ps, b);
        // Per item (every lane keeps all four: maxima and sums broadcast from lane 8r).
#pragma unroll
        for (int r = 0; r < AT_ROWS; ++r) {
            float mn = __shfl_sync(0xffffffffu, mn_me, r * 8);
            float corr = m[r] == -F32_INF ? (mn == -F32_INF ? 1.0f : 0.0f) : expf(m[r] - mn);
            float psum = __shfl_sync(0xffffffffu, ps, r * 8);
            l[r] = l[r] * corr + psum;
            m[r] = mn;
#pragma unroll
            for (int k = 0; k < DK; ++k) o[r][k] *= corr;
#pragma unroll
            for (int pj = 0; pj < AT_POS; ++pj) {
                float p = __shfl_sync(0xffffffffu, pr, r * 8 + pj);
#pragma unroll
                for (int k = 0; k < DK; ++k) o[r][k] = fmaf(p, vt[pj][lane + 32 * k], o[r][k]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < AT_ROWS; ++r) {
        int it = i0 + w * AT_ROWS + r;
        if (it >= n_items) continue;
        int row = it / G, h = kvh * G + it % G;
        float lt = l[r], mt = m[r];
        if (sinks) {
            float sk = sinks[h];
            float mn = fmaxf(mt, sk);
            float corr = mt == -F32_INF ? 0.0f : expf(mt - mn);
            lt = lt * corr + expf(sk - mn);
#pragma unroll
            for (int k = 0; k < DK; ++k) o[r][k] *= corr;
        }
        float* oh = out + ((u64)row * nh + h) * d;
#pragma unroll
        for (int k = 0; k < DK; ++k) {
            int c = lane + 32 * k;
            if (c < d) oh[c] = o[r][k] / lt;
        }
    }
}

// One kernel per store type and lane width (DK dims per lane: d <= 32 * DK), each with its own
// register allocation. grid (item tiles of AT_ITEMS, nkv), AT_WARPS * 32 threads.
#define ATTN_TILED(NAME, S, DK)                                                                 \
    extern "C" __global__ void __launch_bounds__(AT_WARPS * 32)                                 \
        NAME(const float* q, const S* ks, const S* vs, int t_rows, int nh, int nkv, int d,      \
             int rows, int ring, int pos0, int window, float scale, const float* sinks,        \
             RelArgs ra, float* out) { grid_dep_wait();                                         \
        __shared__ __align__(16) float kt[AT_POS][32 * DK];                                     \
        __shared__ __align__(16) float vt[AT_POS][32 * DK];                                     \
        attention_tiled_impl<S, DK>(kt, vt, q, ks, vs, t_rows, nh, nkv, d, rows, ring, pos0,    \
                                    window, scale, sinks, ra, out);                             \
    }

ATTN_TILED(attention_tiled4_f16, u16, 4)
ATTN_TILED(attention_tiled8_f16, u16, 8)
ATTN_TILED(attention_tiled16_f16, u16, 16)
ATTN_TILED(attention_tiled4_f32, float, 4)
ATTN_TILED(attention_tiled8_f32, float, 8)
ATTN_TILED(attention_tiled16_f32, float, 16)
