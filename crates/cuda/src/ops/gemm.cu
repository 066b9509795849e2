// Prefill products of MLX affine quantized matrices: a tiled GEMM over jobs like qmatmul's.
//
// y[t, r] = sum_c w[r, c] x[t, c] for tens to hundreds of rows t of x (prefill chunks, the rows
// routed to an expert), w[r, c] = s * q + b dequantized from 2/4/8-bit codes in groups of 32, 64
// or 128 columns (MLX affine quantization; the layout is at the top of quant.cu).
//
// A block computes the outputs of QG_BM rows of w by BN rows of x (BN = 32 or 64, 4 * BN
// threads), stepping over the columns QG_BK at a time. Per step the threads dequantize the
// tile's codes to f32 into shared memory (ws, [QG_BM][QG_LD], k contiguous) and copy the x
// tile beside it (xs, [BN][QG_LD]); thread (tm, tn) = (tid % 16, tid / 16) then accumulates a
// 4 x 4 register tile: rows tm + 16 i of the block's w rows by rows tn + BN/4 j of its x rows
// (strided, so the float4 reads of a quarter warp fall in distinct banks and the stores of y
// by 16 consecutive threads are consecutive floats). QG_BK is 32, so a step's columns of one row
// lie in one scale group. Shared memory is double-buffered: the next step's codes and x are
// loaded into registers before this step's products and stored after them, one barrier a step.
//
// The columns may be split in `splits` ranges of `per` steps (blockIdx.z % splits), each
// written to its own [t_rows, rows] plane of y (the launch points y at a scratch buffer) and
// added in split order by qgemm_sum, so a product of few output tiles still fills the device.
//
// Numerics: w = fma(s, q, b) in f32, and each output an f32 sum, one fma per column in
// ascending column order (per split, then the splits in order): it depends on the codes,
// scales, biases, x and the split count only, never on where the matrix lies, on BN or on the
// other jobs of the launch. Codes are read as u16 pieces (tensors are only 2-byte aligned); x
// rows are read as float4 (cols is a multiple of 32 and x starts 16-byte aligned: a device
// allocation or whole rows into one).

#define QG_BM 64
#define QG_BK 32
// Floats per shared row: 4 more than a step, so rows 16 bytes apart start 4 banks apart.
#define QG_LD (QG_BK + 4)
// Largest BN: shared memory is sized for it.
#define QG_BN_MAX 64

// Up to QM_JOBS products of one matrix shape (blockIdx.y = job): qmatmul's jobs (quant.cu), job
// j of t_rows[j] rows of x ([t_rows[j], cols] f32 at q.x[j]) writing [splits, t_rows[j], rows]
// f32 at q.y[j]. Passed by value.
struct QGJobs {
    QJobs q;
    int t_rows[QM_JOBS];
};

// One output tile of job `job` (rows r0 .. r0 + QG_BM of w, rows t0 .. t0 + BN of x) over column
// steps kb .. ke, into plane `split` of its y. Every thread of the block calls it with the same
// arguments.
template <int BITS, int BN>
__device__ __forceinline__ void qgemm_tile(float* sm, const QJobs& q, int job, int rows, int cols,
                                           int group, int t_rows, int t0, int r0, int kb, int ke,
                                           int split) {
    const int PER = 16 / BITS;          // codes per u16 piece
    const int PPR = QG_BK / PER;        // pieces per tile row per step
    const int NT = 4 * BN;              // threads
    const int NPW = QG_BM * PPR / NT;   // pieces each thread loads per step
    const int RSTEP = NT / PPR;         // tile rows between a thread's pieces
    const u32 mask = (1u << BITS) - 1u;
    float* ws = sm;                       // [2][QG_BM][QG_LD]
    float* xs = sm + 2 * QG_BM * QG_LD;   // [2][BN][QG_LD]
    const int tid = threadIdx.x;
    const int tm = tid & 15, tn = tid >> 4;
    // This thread's loads: piece p of tile rows pm + RSTEP h; float4 xq of x rows xn, xn + BN/2.
    const int p = tid % PPR, pm = tid / PPR;
    const int xq = tid & 7, xn = tid >> 3;
    const u64 n16 = (u64)(cols / PER), groups = (u64)(cols / group);
    const u16* wq = (const u16*)q.w[job];
    const u16* sc = (const u16*)q.s[job];
    const u16* bi = (const u16*)q.b[job];
    const float* x = (const float*)q.x[job];

    u32 wp[NPW];
    u16 ss[NPW], bs[NPW];
    float4 xv[2];
    // Step kt's codes (and, at a group's first step or the first step, its scales and biases)
    // and x into registers; rows past the matrix or past t_rows read nothing and give zeros.
    auto load = [&](int kt, bool fresh) {
        int k0 = kt * QG_BK;
#pragma unroll
        for (int h = 0; h < NPW; ++h) {
            int r = r0 + pm + RSTEP * h;
            bool in = r < rows;
            wp[h] = in ? (u32)wq[(u64)r * n16 + (u64)(k0 / PER + p)] : 0u;
            if (fresh) {
                u64 g = (u64)r * groups + (u64)(k0 / group);
                ss[h] = in ? sc[g] : (u16)0;
                bs[h] = in ? bi[g] : (u16)0;
            }
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            int t = t0 + xn + (BN / 2) * h;
            xv[h] = t < t_rows ? *(const float4*)(x + (u64)t * cols + k0 + 4 * xq)
                               : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
    };
    // The registers, dequantized, into buffer `buf`.
    auto store = [&](int buf) {
        float* wb = ws + buf * (QG_BM * QG_LD);
#pragma unroll
        for (int h = 0; h < NPW; ++h) {
            float s = bf16_to_f32(ss[h]), b = bf16_to_f32(bs[h]);
            float v[PER];
#pragma unroll
            for (int e = 0; e < PER; ++e) v[e] = fmaf(s, (float)((wp[h] >> (BITS * e)) & mask), b);
            float* dst = wb + (pm + RSTEP * h) * QG_LD + p * PER;
            if (PER == 2) {
                *(float2*)dst = make_float2(v[0], v[1]);
            } else {
#pragma unroll
                for (int f = 0; f < PER / 4; ++f)
                    *(float4*)(dst + 4 * f) =
                        make_float4(v[4 * f], v[4 * f + 1], v[4 * f + 2], v[4 * f + 3]);
            }
        }
        float* xb = xs + buf * (BN * QG_LD);
#pragma unroll
        for (int h = 0; h < 2; ++h) *(float4*)(xb + (xn + (BN / 2) * h) * QG_LD + 4 * xq) = xv[h];
    };

    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;

    if (kb < ke) {
        load(kb, true);
        store(0);
        __syncthreads();
        int cur = 0;
        for (int kt = kb; kt < ke; ++kt) {
            bool more = kt + 1 < ke;
            if (more) load(kt + 1, (((kt + 1) * QG_BK) & (group - 1)) == 0);
            const float* wb = ws + cur * (QG_BM * QG_LD);
            const float* xb = xs + cur * (BN * QG_LD);
#pragma unroll
            for (int kk = 0; kk < QG_BK; kk += 4) {
                float4 a[4], c[4];
#pragma unroll
                for (int i = 0; i < 4; ++i) a[i] = *(const float4*)(wb + (tm + 16 * i) * QG_LD + kk);
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    c[j] = *(const float4*)(xb + (tn + (BN / 4) * j) * QG_LD + kk);
#pragma unroll
                for (int i = 0; i < 4; ++i)
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        float v = acc[i][j];
                        v = fmaf(a[i].x, c[j].x, v);
                        v = fmaf(a[i].y, c[j].y, v);
                        v = fmaf(a[i].z, c[j].z, v);
                        v = fmaf(a[i].w, c[j].w, v);
                        acc[i][j] = v;
                    }
            }
            // Buffer cur ^ 1 was last read before the previous barrier.
            if (more) store(cur ^ 1);
            // Also orders this step's reads before the next tile's first store.
            __syncthreads();
            cur ^= 1;
        }
    }

    float* y = (float*)q.y[job] + (u64)split * t_rows * rows;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        int t = t0 + tn + (BN / 4) * j;
        if (t >= t_rows) continue;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            int r = r0 + tm + 16 * i;
            if (r < rows) y[(u64)t * rows + r] = acc[i][j];
        }
    }
}

template <int BN>
__device__ __forceinline__ void qgemm_bits(float* sm, const QJobs& q, int job, int bits, int rows,
                                           int cols, int group, int t_rows, int t0, int r0,
                                           int kb, int ke, int split) {
    switch (bits) {
        case 2: qgemm_tile<2, BN>(sm, q, job, rows, cols, group, t_rows, t0, r0, kb, ke, split); break;
        case 4: qgemm_tile<4, BN>(sm, q, job, rows, cols, group, t_rows, t0, r0, kb, ke, split); break;
        default: qgemm_tile<8, BN>(sm, q, job, rows, cols, group, t_rows, t0, r0, kb, ke, split); break;
    }
}

// The jobs of one launch: blockIdx.x = tile of QG_BM output rows, blockIdx.y = job, blockIdx.z
// = (tile of bn rows of x) * splits + split, x tiles strided by gridDim.z / splits (gridDim.z a
// multiple of splits). blockDim.x = 4 * bn, bn 32 or 64; bits 2, 4 or 8; cols a multiple of
// QG_BK; group a power of two, at least QG_BK; split s covers column steps s * per ..
// min((s + 1) * per, cols / QG_BK).
extern "C" __global__ void __launch_bounds__(4 * QG_BN_MAX)
    qgemm(QGJobs jobs, int rows, int cols, int bits, int group, int bn, int splits, int per) {
    __shared__ __align__(16) float sm[2 * (QG_BM + QG_BN_MAX) * QG_LD];
    int j = blockIdx.y;
    int t_rows = jobs.t_rows[j];
    int r0 = blockIdx.x * QG_BM;
    int split = blockIdx.z % splits;
    int kb = split * per, ke = min(cols / QG_BK, kb + per);
    int tiles = (t_rows + bn - 1) / bn;
    for (int tile = blockIdx.z / splits; tile < tiles; tile += gridDim.z / splits) {
        if (bn == 32)
            qgemm_bits<32>(sm, jobs.q, j, bits, rows, cols, group, t_rows, tile * 32, r0, kb, ke,
                           split);
        else
            qgemm_bits<64>(sm, jobs.q, j, bits, rows, cols, group, t_rows, tile * 64, r0, kb, ke,
                           split);
    }
}

// y[j][i] = sum over s < splits, in order, of part[j][s * n[j] + i] for i < n[j]
// (blockIdx.y = job): the split sums of qgemm added into the jobs' outputs.
struct QGSums {
    u64 part[QM_JOBS];
    u64 y[QM_JOBS];
    u64 n[QM_JOBS];
};

extern "C" __global__ void qgemm_sum(QGSums sums, int splits) {
    int j = blockIdx.y;
    const float* part = (const float*)sums.part[j];
    float* y = (float*)sums.y[j];
    u64 n = sums.n[j];
    FOR_EACH(i, n) {
        float v = part[i];
        for (int s = 1; s < splits; ++s) v += part[(u64)s * n + i];
        y[i] = v;
    }
}
