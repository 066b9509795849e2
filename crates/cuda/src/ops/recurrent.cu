// Gated DeltaNet's recurrent pieces: the causal conv, the gates and the delta rule.

// Depthwise causal conv over x ([T, C]) continuing state ([kernel-1, C], the last pre-conv rows):
// out[r, c] = act(sum_j w[c, j] * seq[r + j, c]) with seq = state ++ x, act SiLU (silu != 0:
// Gated DeltaNet's conv1d_silu) or none (Inkling's short convolutions, conv1d); then state <- the
// last kernel-1 rows of seq.

// out[r, c] (conv_out's arithmetic in every kernel below, so decode's and prefill's bits agree).
__device__ __forceinline__ float conv_out(const float* x, const float* state, const float* w,
                                          int r, int c, int channels, int kernel, int silu) {
    int keep = kernel - 1;
    float acc = 0.0f;
    for (int j = 0; j < kernel; ++j) {
        int s = r + j;
        float v = s < keep ? state[(u64)s * channels + c] : x[(u64)(s - keep) * channels + c];
        acc += w[c * kernel + j] * v;
    }
    return silu ? silu_f(acc) : acc;
}

// state <- the last kernel-1 rows of state ++ x, for channel c (ascending i reads seq row
// t_rows + i > i before row i is overwritten).
__device__ __forceinline__ void conv_keep(const float* x, float* state, int t_rows, int c,
                                          int channels, int kernel) {
    int keep = kernel - 1;
    for (int i = 0; i < keep; ++i) {
        int s = t_rows + i;
        state[(u64)i * channels + c] = s < keep ? state[(u64)s * channels + c]
                                                : x[(u64)(s - keep) * channels + c];
    }
}

// Both, one thread per channel over the rows (decode's one row).
extern "C" __global__ void conv1d_causal(const float* x, float* state, const float* w,
                                         int t_rows, int channels, int kernel, int silu,
                                         float* out) {
    grid_dep_wait();
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    for (int r = 0; r < t_rows; ++r)
        out[(u64)r * channels + c] = conv_out(x, state, w, r, c, channels, kernel, silu);
    conv_keep(x, state, t_rows, c, channels, kernel);
}

// The outputs only, one thread per (row, channel) (a prefill chunk; conv1d_keep then moves the
// state, in a second launch, after every output has read it).
extern "C" __global__ void conv1d_causal_rows(const float* x, const float* state,
                                              const float* w, int t_rows, int channels,
                                              int kernel, int silu, float* out) {
    grid_dep_wait();
    FOR_EACH(i, (u64)t_rows * channels) {
        int r = (int)(i / channels), c = (int)(i % channels);
        out[i] = conv_out(x, state, w, r, c, channels, kernel, silu);
    }
}

extern "C" __global__ void conv1d_keep(const float* x, float* state, int t_rows, int channels,
                                       int kernel) {
    grid_dep_wait();
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    conv_keep(x, state, t_rows, c, channels, kernel);
}

// beta = sigmoid(b), decay = exp(-a[h] * softplus(alpha + dt_bias[h])) over [T, nv].
extern "C" __global__ void delta_gates(const float* b, const float* alpha, const float* a,
                                       const float* dt_bias, u64 n, int nv, float* beta,
                                       float* decay) {
    grid_dep_wait();
    FOR_EACH(i, n) {
        int h = (int)(i % nv);
        beta[i] = sigmoid_f(b[i]);
        decay[i] = expf(-a[h] * softplus_f(alpha[i] + dt_bias[h]));
    }
}

// The gated delta rule (mlx-lm gated_delta.py): per row, S <- g S; u = (v - S k) beta;
// S <- S + u k^T; o = S q. The dv rows of a head's state are independent of each other, so each
// is one warp's: lane l keeps columns l, l + 32, ... (head_k_dim <= 32 * GDR_COLS) in registers
// for all t_rows steps, and S k and S q are a lane's partial sums then a butterfly over the warp
// (the same operations at every step, whatever t_rows: a row's result does not depend on the
// chunk it was computed in). The next step's k, q, v and gates are loaded before this step's
// reductions. state [nv, dv, dk], q/k [T, nk, dk], v/out [T, nv, dv], g/beta [T, nv]; one warp
// per (head, state row), blocks of GDR_WARPS warps.
#define GDR_COLS 8
#define GDR_WARPS 8
template <int C>
__device__ __forceinline__ void gdr_row(const float* q, const float* k, const float* v,
                                        const float* g, const float* beta, float* state,
                                        int t_rows, int nk, int nv, int dk, int dv, float* out,
                                        int w, int lane) {
    int h = w / dv, i = w % dv;
    int kh = h / (nv / nk);
    float* row = state + ((u64)h * dv + i) * dk;
    float s[C], kc[C], qc[C];
#pragma unroll
    for (int j = 0; j < C; ++j) {
        int c = lane + 32 * j;
        s[j] = c < dk ? row[c] : 0.0f;
    }
    // Step r's operands, loaded one step ahead.
    auto load = [&](int r, float* kr, float* qr, float& gr, float& br, float& vr) {
        const float* kp = k + ((u64)r * nk + kh) * dk;
        const float* qp = q + ((u64)r * nk + kh) * dk;
#pragma unroll
        for (int j = 0; j < C; ++j) {
            int c = lane + 32 * j;
            kr[j] = c < dk ? kp[c] : 0.0f;
            qr[j] = c < dk ? qp[c] : 0.0f;
        }
        gr = g[(u64)r * nv + h];
        br = beta[(u64)r * nv + h];
        vr = v[((u64)r * nv + h) * dv + i];
    };
    float gr = 0.0f, br = 0.0f, vr = 0.0f;
    if (t_rows > 0) load(0, kc, qc, gr, br, vr);
    for (int r = 0; r < t_rows; ++r) {
        float kn[C], qn[C], gn = 0.0f, bn = 0.0f, vn = 0.0f;
        if (r + 1 < t_rows) load(r + 1, kn, qn, gn, bn, vn);
        float sk = 0.0f;
#pragma unroll
        for (int j = 0; j < C; ++j) {
            s[j] *= gr;
            sk = fmaf(s[j], kc[j], sk);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) sk += __shfl_xor_sync(0xffffffffu, sk, o);
        float u = (vr - sk) * br;
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < C; ++j) {
            s[j] = fmaf(u, kc[j], s[j]);
            acc = fmaf(s[j], qc[j], acc);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (lane == 0) out[((u64)r * nv + h) * dv + i] = acc;
        if (r + 1 < t_rows) {
#pragma unroll
            for (int j = 0; j < C; ++j) {
                kc[j] = kn[j];
                qc[j] = qn[j];
            }
            gr = gn;
            br = bn;
            vr = vn;
        }
    }
#pragma unroll
    for (int j = 0; j < C; ++j) {
        int c = lane + 32 * j;
        if (c < dk) row[c] = s[j];
    }
}

// C = the columns a lane keeps: head_k_dim / 32 rounded up to 1, 2, 4 or 8 (checked on the host).
extern "C" __global__ void __launch_bounds__(GDR_WARPS * 32)
    gated_delta_rule(const float* q, const float* k, const float* v, const float* g,
                     const float* beta, float* state, int t_rows, int nk, int nv, int dk, int dv,
                     float* out) {
    grid_dep_wait();
    int w = blockIdx.x * GDR_WARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (w >= nv * dv) return;
    int cols = (dk + 31) / 32;
    if (cols <= 1) gdr_row<1>(q, k, v, g, beta, state, t_rows, nk, nv, dk, dv, out, w, lane);
    else if (cols <= 2) gdr_row<2>(q, k, v, g, beta, state, t_rows, nk, nv, dk, dv, out, w, lane);
    else if (cols <= 4) gdr_row<4>(q, k, v, g, beta, state, t_rows, nk, nv, dk, dv, out, w, lane);
    else gdr_row<8>(q, k, v, g, beta, state, t_rows, nk, nv, dk, dv, out, w, lane);
}
