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

// Up to QG_JOBS products of one matrix shape (blockIdx.y = job; a layer's routed experts of a
// prefill chunk in one or two launches): job j's matrix codes, scales and biases at w[j], s[j],
// b[j] (as qmatmul's jobs, quant.cu), t_rows[j] rows of x ([t_rows[j], cols] f32 at x[j])
// writing [splits, t_rows[j], rows] f32 at y[j]. Passed by value (11 KB: kernel parameters may
// take 32 KB from CUDA 12.1).
#define QG_JOBS 256
struct QGJobs {
    u64 w[QG_JOBS];
    u64 s[QG_JOBS];
    u64 b[QG_JOBS];
    u64 x[QG_JOBS];
    u64 y[QG_JOBS];
    int t_rows[QG_JOBS];
};

// One output tile of job `job` (rows r0 .. r0 + QG_BM of w, rows t0 .. t0 + BN of x) over column
// steps kb .. ke, into plane `split` of its y. Every thread of the block calls it with the same
// arguments.
template <int BITS, int BN>
__device__ __forceinline__ void qgemm_tile(float* sm, const QGJobs& q, int job, int rows, int cols,
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
__device__ __forceinline__ void qgemm_bits(float* sm, const QGJobs& q, int job, int bits, int rows,
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
    grid_dep_wait();
    __shared__ __align__(16) float sm[2 * (QG_BM + QG_BN_MAX) * QG_LD];
    int j = blockIdx.y;
    int t_rows = jobs.t_rows[j];
    int r0 = blockIdx.x * QG_BM;
    int split = blockIdx.z % splits;
    int kb = split * per, ke = min(cols / QG_BK, kb + per);
    int tiles = (t_rows + bn - 1) / bn;
    for (int tile = blockIdx.z / splits; tile < tiles; tile += gridDim.z / splits) {
        if (bn == 32)
            qgemm_bits<32>(sm, jobs, j, bits, rows, cols, group, t_rows, tile * 32, r0, kb, ke,
                           split);
        else
            qgemm_bits<64>(sm, jobs, j, bits, rows, cols, group, t_rows, tile * 64, r0, kb, ke,
                           split);
    }
}

// y[j][i] = sum over s < splits, in order, of part[j][s * n[j] + i] for i < n[j]
// (blockIdx.y = job): the split sums of qgemm added into the jobs' outputs.
struct QGSums {
    u64 part[QG_JOBS];
    u64 y[QG_JOBS];
    u64 n[QG_JOBS];
};

extern "C" __global__ void qgemm_sum(QGSums sums, int splits) {
    grid_dep_wait();
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

// ---------------------------------------------------------------------------------------------
// qgemm_tc: the same products on the tensor cores (mma.sync m16n8k16, BF16 in, f32 accumulate).
//
// A product is split by the affine form of the weights: over the columns of one scale group,
// sum_c (s q_c + b) x_c = s (q' . x) + b' sum(x) with the codes centred, q' = q - m (m =
// 2^(BITS-1)) and b' = b + s m (in f32), so that s (q' . x) and b' sum(x) do not cancel. The
// centred codes (integers in [-128, 128)) are exact in BF16, so the tensor cores compute q' . x
// with x as three BF16 terms, x = hi + mid + lo (each the rounding of what the previous terms
// leave: x to about 24 significant bits), and f32 accumulation. Per group (or the part of a
// group in a column split) the partial sum P = q' . x is folded into the output by one fma
// each: acc += s P + b' X, with X the f32 sum of the group's x in a fixed order. So the result
// keeps f32-like accuracy (the tensor cores' f32 accumulation truncates; measured within the
// op harness's f32 budget) where one BF16 rounding of x or of the dequantized weight would give
// ~4e-3.
//
// A block of 4 warps computes QT_BM rows of w by QT_BT rows of x (a warp: 32 w rows = 2 m16
// tiles, by all 32 x rows = 4 n8 tiles), stepping QT_BK columns at a time: per step the threads
// load the next step's codes and x into registers, then run this step's mma on shared memory,
// then store the registers (codes as BF16, x as hi / lo BF16 and per-row sums) into the other
// buffer; one barrier per step. Shared rows are QT_LD BF16 (80 bytes) apart, so the 8 rows of an
// ldmatrix fall in distinct banks.
//
// Numerics: an output depends on the codes, scales, biases, x, the split count and the group
// size only: the tiling is fixed (no variant changes where a row of x or of w sits in a tile),
// and the order of the k steps and of the folds is the columns' order. Where the matrix lies
// (slot, staging buffer, resident copy) and what else the launch holds change nothing.

#define QT_BM 128
#define QT_BT 32
#define QT_BK 32
#define QT_LD 40
#define QT_THREADS 128
// BF16 terms of x (compile.rs defines it from `MFERENCE_CUDA_QT_TERMS`): 3 keeps ~24 significant
// bits of x (the f32 budget above), 2 ~16 and 1 ~8 (x rounded once to BF16, as a BF16 model's
// activations are): fewer terms, fewer mma and shared-memory reads per step.
#ifndef QT_TERMS
#define QT_TERMS 3
#endif

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

__device__ __forceinline__ void mma_bf16(float* d, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// f32 -> BF16, round to nearest even (finite inputs; an infinity stays one).
__device__ __forceinline__ u32 f32_to_bf16_rn(float f) {
    u32 u = __float_as_uint(f);
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

// x's 4 floats as QT_TERMS BF16 terms each, tb[k][e] the rounding of what terms 0 .. k - 1 of
// v[e] leave (x = hi + mid + lo for 3).
__device__ __forceinline__ void qt_split4(const float (&v)[4], u32 (&tb)[QT_TERMS][4]) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        float rest = v[e];
#pragma unroll
        for (int k = 0; k < QT_TERMS; ++k) {
            tb[k][e] = f32_to_bf16_rn(rest);
            rest -= __uint_as_float(tb[k][e] << 16);
        }
    }
}

// A warp's accumulators over its 32 w rows (2 m16 tiles) by the tile's 32 x rows (4 n8 tiles),
// shared by qgemm_tc and qgemm_tc4: `part` the current group's q' . x, `acc` the folded outputs,
// `xsum` the group's sums of x per row, `sv` / `bv` the group's scale and b' = b + s m per w row
// (m tile, g / g + 8).
struct QtAcc {
    float acc[2][4][4], part[2][4][4], xsum[4][2];
    float sv[2][2], bv[2][2];

    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[i][j][e] = part[i][j][e] = 0.0f;
#pragma unroll
        for (int j = 0; j < 4; ++j) xsum[j][0] = xsum[j][1] = 0.0f;
    }

    // The scales and biases of group `gi` for w rows rw + 16 i + 8 hh (rw = the warp's first row
    // + g), codes centred on `mid`.
    __device__ __forceinline__ void scales(const u16* sc, const u16* bi, u64 groups, u64 gi, int rw,
                                           int rows, int mid) {
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                int r = rw + i * 16 + 8 * hh;
                float sg = r < rows ? bf16_to_f32(sc[(u64)r * groups + gi]) : 0.0f;
                float bg = r < rows ? bf16_to_f32(bi[(u64)r * groups + gi]) : 0.0f;
                sv[i][hh] = sg;
                bv[i][hh] = fmaf(sg, (float)mid, bg);
            }
    }

    // part += A (the warp's codes, af) times the 16 columns at `kc` of the x tile's QT_TERMS
    // planes (x3: [QT_TERMS][QT_BT * QT_LD] BF16 in shared memory), term after term.
    __device__ __forceinline__ void mma_terms(const u32 (&af)[2][4], const u16* x3, int kc,
                                              int lane) {
#pragma unroll
        for (int term = 0; term < QT_TERMS; ++term) {
            const u16* xb = x3 + term * QT_BT * QT_LD;
            u32 bf[4][2];
#pragma unroll
            for (int np = 0; np < 2; ++np) {
                int mi = lane >> 3;
                const u16* p =
                    xb + (np * 16 + (mi >> 1) * 8 + (lane & 7)) * QT_LD + kc + (mi & 1) * 8;
                ldsm_x4(smem_addr(p), bf[2 * np][0], bf[2 * np][1], bf[2 * np + 1][0],
                        bf[2 * np + 1][1]);
            }
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) mma_bf16(part[i][j], af[i], bf[j][0], bf[j][1]);
        }
    }

    // The step's sums of x (xs: QT_BT floats in shared memory) into the group's.
    __device__ __forceinline__ void add_sums(const float* xs, int tig) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            xsum[j][0] += xs[j * 8 + 2 * tig];
            xsum[j][1] += xs[j * 8 + 2 * tig + 1];
        }
    }

    // acc += s P + b' X for the group just ended, then a new group.
    __device__ __forceinline__ void fold() {
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float sc_ = sv[i][e >> 1], b_ = bv[i][e >> 1];
                    acc[i][j][e] = fmaf(b_, xsum[j][e & 1], fmaf(sc_, part[i][j][e], acc[i][j][e]));
                    part[i][j][e] = 0.0f;
                }
#pragma unroll
        for (int j = 0; j < 4; ++j) xsum[j][0] = xsum[j][1] = 0.0f;
    }

    // The outputs into y ([t_rows, rows] f32): w rows rw + ..., x rows t0 + ...
    __device__ __forceinline__ void store(float* y, int rows, int t_rows, int rw, int t0,
                                          int tig) const {
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    int r = rw + i * 16 + 8 * (e >> 1);
                    int t = t0 + j * 8 + 2 * tig + (e & 1);
                    if (r < rows && t < t_rows) y[(u64)t * rows + r] = acc[i][j][e];
                }
    }
};

// The shared buffers of one step.
struct QtStage {
    u16 a[QT_BM * QT_LD];   // codes of the block's w rows, BF16, k contiguous
    u16 x3[QT_TERMS][QT_BT * QT_LD];  // x rows as QT_TERMS BF16 terms (hi, mid, lo)
    float xs[QT_BT];        // sum of each x row over the step's columns
};

// One output tile (w rows r0 .. r0 + QT_BM, x rows t0 .. t0 + QT_BT) of job `job` over column
// steps kb .. ke into plane `split`. WB: bytes per code load (2, or 4 when the job's codes are
// 4-byte aligned: rows of a matrix are a multiple of 8 bytes apart, so every row is).
template <int BITS, int WB>
__device__ __forceinline__ void qgemm_tc_tile(QtStage* st, const QGJobs& q, int job, int rows,
                                              int cols, int group, int t_rows, int t0, int r0,
                                              int kb, int ke, int split) {
    const int CPU = WB * 8 / BITS;          // codes per load unit
    const int UPR = QT_BK / CPU;            // units per tile row per step
    const int NU = QT_BM * UPR / QT_THREADS;  // units each thread loads per step
    const int RSTEP = QT_THREADS / UPR;     // tile rows between a thread's units
    const u32 mask = (1u << BITS) - 1u;
    const int mid = 1 << (BITS - 1);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, tig = lane & 3;
    const int up = tid % UPR, um = tid / UPR;   // this thread's unit column and first row
    const int xq = tid & 7, xn = tid >> 3;      // float4 xq of x rows xn, xn + 16
    const u64 row_bytes = (u64)cols * BITS / 8, groups = (u64)(cols / group);
    const unsigned char* wq = (const unsigned char*)q.w[job];
    const u16* sc = (const u16*)q.s[job];
    const u16* bi = (const u16*)q.b[job];
    const float* x = (const float*)q.x[job];

    u32 wu[NU];
    float4 xv[2];
    auto load = [&](int kt) {
        u64 off = (u64)kt * (QT_BK * BITS / 8) + (u64)up * WB;
#pragma unroll
        for (int h = 0; h < NU; ++h) {
            int r = r0 + um + RSTEP * h;
            const unsigned char* p = wq + (u64)r * row_bytes + off;
            wu[h] = r < rows ? (WB == 4 ? *(const u32*)p : (u32)*(const u16*)p) : 0u;
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            int t = t0 + xn + 16 * h;
            xv[h] = t < t_rows ? *(const float4*)(x + (u64)t * cols + kt * QT_BK + 4 * xq)
                               : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
    };
    auto store = [&](QtStage* s) {
#pragma unroll
        for (int h = 0; h < NU; ++h) {
            u32* dst = (u32*)(s->a + (um + RSTEP * h) * QT_LD + up * CPU);
#pragma unroll
            for (int e = 0; e < CPU; e += 2) {
                u32 lo = __float_as_uint((float)((int)((wu[h] >> (BITS * e)) & mask) - mid)) >> 16;
                u32 hi =
                    __float_as_uint((float)((int)((wu[h] >> (BITS * (e + 1))) & mask) - mid)) >> 16;
                dst[e / 2] = lo | (hi << 16);
            }
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float v[4] = {xv[h].x, xv[h].y, xv[h].z, xv[h].w};
            u32 tb[QT_TERMS][4];
            qt_split4(v, tb);
            int t = xn + 16 * h;
#pragma unroll
            for (int k = 0; k < QT_TERMS; ++k)
                *(uint2*)(s->x3[k] + t * QT_LD + 4 * xq) =
                    make_uint2(tb[k][0] | (tb[k][1] << 16), tb[k][2] | (tb[k][3] << 16));
            float sum = ((v[0] + v[1]) + v[2]) + v[3];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            sum += __shfl_xor_sync(0xffffffffu, sum, 4);
            if (xq == 0) s->xs[t] = sum;
        }
    };

    QtAcc qa;
    qa.zero();
    const int rw = r0 + warp * 32 + g;
    if (kb < ke) {
        load(kb);
        store(st);
        __syncthreads();
        int cur = 0;
        for (int kt = kb; kt < ke; ++kt) {
            bool more = kt + 1 < ke;
            // The group's scales and biases, at its first step (or the split's first).
            if (kt == kb || ((kt * QT_BK) & (group - 1)) == 0)
                qa.scales(sc, bi, groups, (u64)(kt * QT_BK / group), rw, rows, mid);
            if (more) load(kt + 1);
            const QtStage* s = st + cur;
#pragma unroll
            for (int kk = 0; kk < QT_BK; kk += 16) {
                u32 af[2][4];
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    const u16* p = s->a + (warp * 32 + i * 16 + (lane & 15)) * QT_LD + kk +
                                   (lane >> 4) * 8;
                    ldsm_x4(smem_addr(p), af[i][0], af[i][1], af[i][2], af[i][3]);
                }
                qa.mma_terms(af, s->x3[0], kk, lane);
            }
            qa.add_sums(s->xs, tig);
            // Fold at the group's last step (or the split's last).
            if (!more || (((kt + 1) * QT_BK) & (group - 1)) == 0) qa.fold();
            if (more) store(st + (cur ^ 1));
            __syncthreads();
            cur ^= 1;
        }
    }
    qa.store((float*)q.y[job] + (u64)split * t_rows * rows, rows, t_rows, rw, t0, tig);
}

template <int WB>
__device__ __forceinline__ void qgemm_tc_bits(QtStage* st, const QGJobs& q, int job, int bits,
                                              int rows, int cols, int group, int t_rows, int t0,
                                              int r0, int kb, int ke, int split) {
    switch (bits) {
        case 2: qgemm_tc_tile<2, WB>(st, q, job, rows, cols, group, t_rows, t0, r0, kb, ke, split); break;
        case 4: qgemm_tc_tile<4, WB>(st, q, job, rows, cols, group, t_rows, t0, r0, kb, ke, split); break;
        default: qgemm_tc_tile<8, WB>(st, q, job, rows, cols, group, t_rows, t0, r0, kb, ke, split); break;
    }
}

// The jobs of one launch, as qgemm's: blockIdx.x = tile of QT_BM w rows, blockIdx.y = job,
// blockIdx.z = (tile of QT_BT x rows) * splits + split. 128 threads; bits 2, 4 or 8; cols a
// multiple of QT_BK; group a power of two, at least QT_BK.
extern "C" __global__ void __launch_bounds__(QT_THREADS)
    qgemm_tc(QGJobs jobs, int rows, int cols, int bits, int group, int splits, int per) {
    grid_dep_wait();
    __shared__ __align__(16) QtStage st[2];
    int j = blockIdx.y;
    int t_rows = jobs.t_rows[j];
    int r0 = blockIdx.x * QT_BM;
    int split = blockIdx.z % splits;
    int kb = split * per, ke = min(cols / QT_BK, kb + per);
    int tiles = (t_rows + QT_BT - 1) / QT_BT;
    bool w4 = (jobs.w[j] & 3) == 0;
    for (int tile = blockIdx.z / splits; tile < tiles; tile += gridDim.z / splits) {
        if (w4)
            qgemm_tc_bits<4>(st, jobs, j, bits, rows, cols, group, t_rows, tile * QT_BT, r0, kb,
                             ke, split);
        else
            qgemm_tc_bits<2>(st, jobs, j, bits, rows, cols, group, t_rows, tile * QT_BT, r0, kb,
                             ke, split);
    }
}

// ---------------------------------------------------------------------------------------------
// qgemm_tc4: qgemm_tc's products for 4-bit matrices, the same bits, pipelined. x is split into
// its BF16 terms once per product by qt_split_x (qgemm_tc splits it again in every block of w
// rows), and the codes, the terms and the step sums of x cross into shared memory by cp.async,
// Q4_STAGES - 1 steps ahead of the tensor cores; each warp builds its mma A fragments straight
// from the raw codes (a byte holds the two codes of a fragment register: (128 + q) as BF16 is
// 0x4300 | q, less 136 in one BF16 fma, exact), where qgemm_tc converts every code to BF16 in
// shared memory and reads it back with ldmatrix. A tensor starts only 2-byte aligned, so each
// row's 16 bytes of a step come in the two aligned 16-byte pieces around them (one where the
// codes are aligned) and are shifted into place from shared memory. The tile is blockDim.x rows
// of w (128 or 256: a warp per 32 rows, as in qgemm_tc) by QT_BT rows of x; the per-group fold,
// the k order, the mma sequence and the column splits are qgemm_tc's, so every output has the
// same bits on either kernel.

#define Q4_BM_MAX 256
#define Q4_STAGES 3

// job j's terms of x as qt_split_x writes them at q.y[j] (read by qgemm_tc4 at q.x[j]):
// QT_TERMS planes [t_rows, cols] of BF16, then the sums [cols / QT_BK, t_pad] f32 of each
// step's 32 columns of each row (t_pad = t_rows rounded up to QT_BT, the rows past t_rows 0).
__device__ __forceinline__ int qt_pad(int t_rows) { return (t_rows + QT_BT - 1) / QT_BT * QT_BT; }

// Splits x (f32 at q.x[j], t_rows[j] rows of cols) into qgemm_tc's BF16 terms and step sums,
// in its order (a step's 32 columns: 8 sums of 4, ((v0 + v1) + v2) + v3, then added as a tree).
// blockIdx.y = job; a thread per (row, step), the blocks of a job looping over its cells.
extern "C" __global__ void qt_split_x(QGJobs jobs, int cols) {
    grid_dep_wait();
    int j = blockIdx.y;
    int t_rows = jobs.t_rows[j], t_pad = qt_pad(t_rows), steps = cols / QT_BK;
    const float* x = (const float*)jobs.x[j];
    u16* xt = (u16*)jobs.y[j];
    u64 plane = (u64)t_rows * cols;
    float* sums = (float*)(xt + QT_TERMS * plane);
    for (u64 c = (u64)blockIdx.x * blockDim.x + threadIdx.x; c < (u64)t_pad * steps;
         c += (u64)gridDim.x * blockDim.x) {
        int t = (int)(c / steps), k = (int)(c % steps);
        if (t >= t_rows) {
            sums[(u64)k * t_pad + t] = 0.0f;
            continue;
        }
        const float4* src = (const float4*)(x + (u64)t * cols + k * QT_BK);
        float s4[8];
#pragma unroll
        for (int q = 0; q < 8; ++q) {
            float4 f = src[q];
            float v[4] = {f.x, f.y, f.z, f.w};
            u32 tb[QT_TERMS][4];
            qt_split4(v, tb);
#pragma unroll
            for (int term = 0; term < QT_TERMS; ++term)
                *(uint2*)(xt + term * plane + (u64)t * cols + k * QT_BK + 4 * q) =
                    make_uint2(tb[term][0] | (tb[term][1] << 16), tb[term][2] | (tb[term][3] << 16));
            s4[q] = ((v[0] + v[1]) + v[2]) + v[3];
        }
        sums[(u64)k * t_pad + t] =
            ((s4[0] + s4[1]) + (s4[2] + s4[3])) + ((s4[4] + s4[5]) + (s4[6] + s4[7]));
    }
}

// 16 bytes global -> shared, asynchronously; `bytes` 0 fills the 16 with zeros (nothing read).
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, u32 bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// The fragment register of two 4-bit codes: byte `sel & 3` of `word` (low nibble the lower
// column), each code q as the BF16 q - 8.
__device__ __forceinline__ u32 q4_pair(u32 word, u32 sel) {
    u32 b = __byte_perm(word, 0u, sel);
    u32 v = ((b * 0x1001u) & 0x000f000fu) | 0x43004300u;
    u32 r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(v), "r"(0x3f803f80u), "r"(0xc308c308u));
    return r;
}

struct Q4Stage {
    // Each w row's two aligned 16-byte pieces around its step's 32 codes, the pieces of rows
    // with bit 2 set swapped (so the 8 rows a warp reads at once fall in distinct banks).
    uint4 a[Q4_BM_MAX][2];
    u16 x3[QT_TERMS][QT_BT * QT_LD];  // as QtStage
    float xs[QT_BT];
};

// One output tile (w rows r0 .. r0 + blockDim.x, x rows t0 .. t0 + QT_BT) of job `job` over
// column steps kb .. ke into plane `split`: qgemm_tc_tile's results.
__device__ __forceinline__ void qgemm_tc4_tile(Q4Stage* st, const QGJobs& q, int job, int rows,
                                               int cols, int group, int t_rows, int t0, int r0,
                                               int kb, int ke, int split) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nt = blockDim.x;
    const int g = lane >> 2, tig = lane & 3;
    const u64 row_bytes = (u64)cols / 2, groups = (u64)(cols / group);
    const unsigned char* wq = (const unsigned char*)q.w[job];
    const u16* sc = (const u16*)q.s[job];
    const u16* bi = (const u16*)q.b[job];
    const u16* xt = (const u16*)q.x[job];
    const u64 plane = (u64)t_rows * cols;
    const int t_pad = qt_pad(t_rows);
    const float* xsums = (const float*)(xt + QT_TERMS * plane);
    const u32 sel = 0x4440u | (u32)tig;
    // The piece swap of this thread's rows (g and g + 8 share bit 2), in words.
    const u32 swz = 4 * ((g >> 2) & 1);

    // How far the codes start past a 16-byte boundary (every row and step alike: a row is a
    // multiple of 16 bytes): `mis` bytes, `mw` whole words and a shift of `sh` bits (0 or 16).
    const u32 mis = (u32)(q.w[job] & 15), mw = mis >> 2, sh = 8 * (mis & 3);
    auto load = [&](int kt, Q4Stage* s) {
        int r = r0 + tid;
        const unsigned char* at =
            r < rows ? wq - mis + (u64)r * row_bytes + (u64)kt * 16 : wq - mis;
        u32 swap = (tid >> 2) & 1;
        cp_async16(smem_addr(&s->a[tid][swap]), at, r < rows ? 16u : 0u);
        cp_async16(smem_addr(&s->a[tid][swap ^ 1]), at + 16, r < rows && mis ? 16u : 0u);
        for (int c = tid; c < QT_TERMS * QT_BT * 4; c += nt) {
            int term = c / (QT_BT * 4), row = (c >> 2) % QT_BT, ch = c & 3, t = t0 + row;
            const u16* src =
                t < t_rows ? xt + term * plane + (u64)t * cols + kt * QT_BK + ch * 8 : xt;
            cp_async16(smem_addr(s->x3[term] + row * QT_LD + ch * 8), src, t < t_rows ? 16u : 0u);
        }
        if (tid < QT_BT / 4)
            cp_async16(smem_addr(s->xs + 4 * tid), xsums + (u64)kt * t_pad + t0 + 4 * tid, 16u);
    };

    QtAcc qa;
    qa.zero();
    const int rw = r0 + warp * 32 + g;
    const int n = ke - kb;
#pragma unroll
    for (int s = 0; s < Q4_STAGES - 1; ++s) {
        if (s < n) load(kb + s, st + s);
        cp_async_commit();
    }
    for (int it = 0; it < n; ++it) {
        const int kt = kb + it;
        cp_async_wait<Q4_STAGES - 2>();
        __syncthreads();
        // The stage refilled here was read in the previous step, which every thread has left.
        if (it + Q4_STAGES - 1 < n) load(kt + Q4_STAGES - 1, st + (it + Q4_STAGES - 1) % Q4_STAGES);
        cp_async_commit();
        if (it == 0 || ((kt * QT_BK) & (group - 1)) == 0)
            qa.scales(sc, bi, groups, (u64)(kt * QT_BK / group), rw, rows, 8);
        const Q4Stage* s = st + it % Q4_STAGES;
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
            u32 af[2][4];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                u32 w[2][2];  // [row g / g + 8][bytes 0-3 / 4-7 of chunk kk]
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const u32* row = (const u32*)s->a[warp * 32 + i * 16 + g + 8 * hh];
                    u32 c[3];
#pragma unroll
                    for (int e = 0; e < 3; ++e) c[e] = row[(mw + 2 * kk + e) ^ swz];
                    w[hh][0] = __funnelshift_r(c[0], c[1], sh);
                    w[hh][1] = __funnelshift_r(c[1], c[2], sh);
                }
                af[i][0] = q4_pair(w[0][0], sel);
                af[i][1] = q4_pair(w[1][0], sel);
                af[i][2] = q4_pair(w[0][1], sel);
                af[i][3] = q4_pair(w[1][1], sel);
            }
            qa.mma_terms(af, s->x3[0], 16 * kk, lane);
        }
        qa.add_sums(s->xs, tig);
        if (it + 1 == n || (((kt + 1) * QT_BK) & (group - 1)) == 0) qa.fold();
    }
    // Every copy landed and every thread past its reads before the next tile refills the stages.
    cp_async_wait<0>();
    __syncthreads();
    qa.store((float*)q.y[job] + (u64)split * t_rows * rows, rows, t_rows, rw, t0, tig);
}

// The jobs of one launch, as qgemm_tc's, but blockIdx.x = tile of blockDim.x (128 or 256) w
// rows; every job 4-bit, q.x[j] its terms from qt_split_x.
extern "C" __global__ void __launch_bounds__(Q4_BM_MAX, 2)
    qgemm_tc4(QGJobs jobs, int rows, int cols, int group, int splits, int per) {
    grid_dep_wait();
    __shared__ __align__(16) Q4Stage st[Q4_STAGES];
    int j = blockIdx.y;
    int t_rows = jobs.t_rows[j];
    int r0 = blockIdx.x * blockDim.x;
    int split = blockIdx.z % splits;
    int kb = split * per, ke = min(cols / QT_BK, kb + per);
    int tiles = (t_rows + QT_BT - 1) / QT_BT;
    for (int tile = blockIdx.z / splits; tile < tiles; tile += gridDim.z / splits)
        qgemm_tc4_tile(st, jobs, j, rows, cols, group, t_rows, tile * QT_BT, r0, kb, ke, split);
}
