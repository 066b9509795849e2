// MLX affine quantized products (2/4/8-bit, groups of 32/64/128 columns).
//
// Layout (mlx `quantize`): row r of a [rows, cols] matrix is cols*bits/8 bytes of little-endian
// u32 words holding 32/bits codes each, lowest bits first; column c of row r dequantizes to
// s[g] * q + b[g] with g = r * (cols / group) + c / group, s and b BF16. Tensors of the install
// are only 2-byte aligned, so codes are read as u16 pieces (2/4/8 codes, never straddling a
// group) and nothing assumes a 4-byte-aligned word.

// Threads per output row of qmatmul (a multiple of 32; the launch in lib.rs uses the same).
#define QM_THREADS 256

// y[t, r] = sum_c w[r, c] * x[t, c]: one block of QM_THREADS threads per output row r, rows of x
// over grid.y. Each thread sums a strided share of the row's u16 pieces; the warps' sums are added
// in warp order, so the result is deterministic (and independent of which slot holds the bytes).
// A block per row keeps enough warps in flight to hide the load latency of small expert matrices.
extern "C" __global__ void qmatmul(const unsigned char* base, u64 w_off, u64 s_off, u64 b_off,
                                   int rows, int cols, int bits, int group, const float* x,
                                   int t_rows, float* y) {
    __shared__ float part[QM_THREADS / 32];
    int r = blockIdx.x;
    if (r >= rows) return;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int per = 16 / bits;              // codes per u16
    int n16 = cols / per;             // u16 pieces per row
    u32 mask = (1u << bits) - 1u;
    int groups = cols / group;
    const u16* w = (const u16*)(base + w_off) + (u64)r * n16;
    const u16* sc = (const u16*)(base + s_off) + (u64)r * groups;
    const u16* bi = (const u16*)(base + b_off) + (u64)r * groups;
    for (int t = blockIdx.y; t < t_rows; t += gridDim.y) {
        const float* xr = x + (u64)t * cols;
        float acc = 0.0f;
        for (int i = threadIdx.x; i < n16; i += QM_THREADS) {
            u32 v = w[i];
            int c0 = i * per;
            int g = c0 / group;
            float s = bf16_to_f32(sc[g]), b = bf16_to_f32(bi[g]);
            for (int j = 0; j < per; ++j) {
                float q = (float)((v >> (j * bits)) & mask);
                acc += (s * q + b) * xr[c0 + j];
            }
        }
        acc = warp_sum(acc);
        if (lane == 0) part[warp] = acc;
        __syncthreads();
        if (threadIdx.x == 0) {
            float sum = 0.0f;
            for (int k = 0; k < QM_THREADS / 32; ++k) sum += part[k];
            y[(u64)t * rows + r] = sum;
        }
        __syncthreads();
    }
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

// The index and value of the largest of v[0..n) (ties to the lower index, NaN skipped); one
// block of 1024 threads. out = {id, value bits}; id = 0xffffffff when every value is NaN.
extern "C" __global__ void argmax(const float* v, int n, u32* out) {
    __shared__ float bv[1024];
    __shared__ u32 bi[1024];
    float best = 0.0f;
    u32 id = 0xffffffffu;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float x = v[i];
        if (x != x) continue;
        if (id == 0xffffffffu || x > best) { best = x; id = (u32)i; }
    }
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
