// Gated DeltaNet's recurrent pieces: the causal conv, the gates and the delta rule.

// Depthwise causal conv + SiLU over x ([T, C]) continuing state ([kernel-1, C], the last pre-conv
// rows): out[r, c] = silu(sum_j w[c, j] * seq[r + j, c]) with seq = state ++ x; then state <- the
// last kernel-1 rows of seq. One thread per channel.
extern "C" __global__ void conv1d_silu(const float* x, float* state, const float* w, int t_rows,
                                       int channels, int kernel, float* out) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    int keep = kernel - 1;
    for (int r = 0; r < t_rows; ++r) {
        float acc = 0.0f;
        for (int j = 0; j < kernel; ++j) {
            int s = r + j;
            float v = s < keep ? state[(u64)s * channels + c]
                               : x[(u64)(s - keep) * channels + c];
            acc += w[c * kernel + j] * v;
        }
        out[(u64)r * channels + c] = silu_f(acc);
    }
    // Ascending i reads seq row t_rows + i > i before row i is overwritten.
    for (int i = 0; i < keep; ++i) {
        int s = t_rows + i;
        state[(u64)i * channels + c] = s < keep ? state[(u64)s * channels + c]
                                                : x[(u64)(s - keep) * channels + c];
    }
}

// beta = sigmoid(b), decay = exp(-a[h] * softplus(alpha + dt_bias[h])) over [T, nv].
extern "C" __global__ void delta_gates(const float* b, const float* alpha, const float* a,
                                       const float* dt_bias, u64 n, int nv, float* beta,
                                       float* decay) {
    FOR_EACH(i, n) {
        int h = (int)(i % nv);
        beta[i] = sigmoid_f(b[i]);
        decay[i] = expf(-a[h] * softplus_f(alpha[i] + dt_bias[h]));
    }
}

// The gated delta rule (mlx-lm gated_delta.py): per row, S <- g S; u = (v - S k) beta;
// S <- S + u k^T; o = S q. One block per value head, one thread per state row (head_v_dim rows
// of head_k_dim); state [nv, dv, dk], q/k [T, nk, dk], v/out [T, nv, dv], g/beta [T, nv].
extern "C" __global__ void gated_delta_rule(const float* q, const float* k, const float* v,
                                            const float* g, const float* beta, float* state,
                                            int t_rows, int nk, int nv, int dk, int dv,
                                            float* out) {
    int h = blockIdx.x;
    int kh = h / (nv / nk);
    for (int i = threadIdx.x; i < dv; i += blockDim.x) {
        float* row = state + ((u64)h * dv + i) * dk;
        for (int r = 0; r < t_rows; ++r) {
            const float* qr = q + ((u64)r * nk + kh) * dk;
            const float* kr = k + ((u64)r * nk + kh) * dk;
            float gr = g[(u64)r * nv + h], br = beta[(u64)r * nv + h];
            float sk = 0.0f;
            for (int c = 0; c < dk; ++c) {
                float s = row[c] * gr;
                row[c] = s;
                sk += s * kr[c];
            }
            float u = (v[((u64)r * nv + h) * dv + i] - sk) * br;
            float o = 0.0f;
            for (int c = 0; c < dk; ++c) {
                float s = row[c] + u * kr[c];
                row[c] = s;
                o += s * qr[c];
            }
            out[((u64)r * nv + h) * dv + i] = o;
        }
    }
}
