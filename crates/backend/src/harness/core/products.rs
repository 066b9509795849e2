//! Cases of the quantized products: embed, matmul, the GLU MLP (one expert, several, stacked rows),
//! the BF16 matmul and the head's argmax.

use crate::harness::*;

/// `glu_mlp_experts` of two experts (the blob twice: two staged copies on a GPU) on the rows
/// `xt`: each bit for bit `glu_mlp`'s `want` from that blob.
pub(crate) fn glu_experts<B: Backend>(
    h: &mut Harness<B>,
    mlp: &Mlp,
    act: Act,
    blob: &[u8],
    xt: &B::Tensor,
    want: &[f32],
) {
    let r =
        h.be.glu_mlp_experts(mlp, act, &[Weights::Blob(blob); 2], &[xt, xt]);
    let Some(ys) = h.ok("glu_mlp_experts", r) else {
        return;
    };
    for (j, y) in ys.iter().enumerate() {
        if let Some(got) = h.read(y) {
            if got
                .iter()
                .map(|v| v.to_bits())
                .ne(want.iter().map(|v| v.to_bits()))
            {
                h.fail(
                    "glu_mlp_experts",
                    format!(
                        "{act:?} x {} rows, expert {j}: not glu_mlp's bits",
                        xt.rows()
                    ),
                );
            }
        }
    }
}

/// `glu_mlp_rows`: three experts (a blob, the resident bytes, the blob again) of one row into
/// rows 2, 0, 3 of a 4-row stack whose row 1 must stay zero.
pub(crate) fn glu_rows<B: Backend>(
    h: &mut Harness<B>,
    w: &TestWeights,
    blob: &[u8],
    x: &[f32],
    xt: &B::Tensor,
) {
    let buf = h.buf;
    for (i, mlp) in w.mlps.iter().enumerate() {
        let want = refr::glu_mlp(
            &mlp.gate_proj,
            &mlp.up_proj,
            &mlp.down_proj,
            Act::Silu,
            buf,
            x,
        );
        let r = h.be.zeros(4, 256);
        let Some(mut out) = h.ok("zeros", r) else {
            return;
        };
        let srcs = [Weights::Blob(blob), Weights::Resident, Weights::Blob(blob)];
        let r =
            h.be.glu_mlp_rows(mlp, Act::Silu, &srcs, xt, &mut out, &[2, 0, 3]);
        if h.ok("glu_mlp_rows", r).is_none() {
            continue;
        }
        let Some(got) = h.read(&out) else { continue };
        let budget = h.budget_glu(1);
        for row in [2, 0, 3] {
            let op = format!("glu_mlp_rows {i} row {row}");
            h.expect_close(&op, &got[row * 256..(row + 1) * 256], &want, budget);
        }
        if got[256..512].iter().any(|&v| v != 0.0) {
            h.fail(
                "glu_mlp_rows",
                format!("mlp {i}: an unnamed row was written"),
            );
        }
        // Rows out of range or named twice are refused.
        for bad in [[2usize, 0, 4], [2, 2, 3]] {
            if h.be
                .glu_mlp_rows(mlp, Act::Silu, &srcs, xt, &mut out, &bad)
                .is_ok()
            {
                h.fail("glu_mlp_rows", format!("rows {bad:?} were accepted"));
            }
        }
    }
}

/// `glu_mlp_combine`: three weighted experts (a blob, the resident bytes, the blob again: one
/// matrix set) of one row added into an accumulator, against the f64 reference and bit for bit
/// against `glu_mlp_rows` into a stack followed by `scatter_add`, the composition it replaces.
pub(crate) fn glu_combine<B: Backend>(
    h: &mut Harness<B>,
    w: &TestWeights,
    blob: &[u8],
    x: &[f32],
    xt: &B::Tensor,
) {
    let buf = h.buf;
    let weights = [0.625f32, -1.25, 0.375];
    let acc0: Vec<f32> = (0..256)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 64.0)
        .collect();
    let srcs = [Weights::Blob(blob), Weights::Resident, Weights::Blob(blob)];
    for (i, mlp) in w.mlps.iter().enumerate() {
        let (g, u, d) = (&mlp.gate_proj, &mlp.up_proj, &mlp.down_proj);
        let y = refr::glu_mlp(g, u, d, Act::Silu, buf, x);
        let sw: f64 = weights.iter().map(|&v| v as f64).sum();
        let want: Vec<f32> = acc0
            .iter()
            .zip(&y)
            .map(|(&a, &v)| (a as f64 + sw * v as f64) as f32)
            .collect();
        let Some(mut acc) = h.up(&acc0, 256) else {
            return;
        };
        let r =
            h.be.glu_mlp_combine(mlp, Act::Silu, &srcs, &weights, xt, &mut acc);
        if h.ok("glu_mlp_combine", r).is_none() {
            continue;
        }
        let Some(got) = h.read(&acc) else { continue };
        let budget = h.budget_glu(1);
        h.expect_close(&format!("glu_mlp_combine {i}"), &got, &want, budget);
        // The composition: a stack of the three, then the weighted adds in order.
        let (Some(mut stack), Some(mut acc2)) = (h.up(&[0.0; 3 * 256], 256), h.up(&acc0, 256))
        else {
            return;
        };
        let r =
            h.be.glu_mlp_rows(mlp, Act::Silu, &srcs, xt, &mut stack, &[0, 1, 2]);
        let pairs: Vec<(usize, f32)> = weights.iter().map(|&v| (0, v)).collect();
        let r = r.and_then(|_| h.be.scatter_add(&mut acc2, &stack, &pairs));
        if h.ok("glu_mlp_rows + scatter_add", r).is_none() {
            continue;
        }
        if let Some(then) = h.read(&acc2) {
            if then
                .iter()
                .map(|v| v.to_bits())
                .ne(got.iter().map(|v| v.to_bits()))
            {
                h.fail(
                    "glu_mlp_combine",
                    format!("mlp {i}: not the bits of glu_mlp_rows + scatter_add"),
                );
            }
        }
        // One weight per expert.
        if h.be
            .glu_mlp_combine(mlp, Act::Silu, &srcs, &weights[..2], xt, &mut acc)
            .is_ok()
        {
            h.fail(
                "glu_mlp_combine",
                "two weights for three experts were accepted".into(),
            );
        }
    }
}

pub(crate) fn products<B: Backend>(h: &mut Harness<B>, rng: &mut Rng, w: &TestWeights) {
    let buf = h.buf;
    // Embedding.
    let ids = [0u32, 49, 7, 7, 23];
    let r = h.be.embed(&w.table, &ids, Some(3.5));
    if let Some(e) = h.ok("embed", r) {
        let d = refr::dequantize(&w.table, buf);
        let want: Vec<f32> = ids
            .iter()
            .flat_map(|&i| {
                d[i as usize * 128..(i as usize + 1) * 128]
                    .iter()
                    .map(|v| (v * 3.5) as f32)
            })
            .collect();
        if let Some(got) = h.read(&e) {
            h.expect_close("embed", &got, &want, EXACT_REL);
        }
    }
    // Products, one by one and all sharing one input, for decode (1 row) and prefill rows (33:
    // a GPU GEMM's last tile of x rows holds one row).
    for t in [1usize, 3, 17, 33] {
        let x = rng.vec(t * 256, 1.0);
        let Some(xt) = h.up(&x, 256) else { return };
        let all: Vec<&QRef> = w.mats.iter().map(|m| &m.0).collect();
        let r = h.be.matmul(&all, Weights::Resident, &xt);
        let Some(ys) = h.ok("matmul", r) else {
            continue;
        };
        for ((m, bits, gs), y) in w.mats.iter().zip(&ys) {
            let want = refr::matmul(m, buf, &x);
            if let Some(got) = h.read(y) {
                let op = format!("matmul {bits}-bit g{gs} [{}, 256] x {t} rows", m.rows);
                let budget = h.budget_q(t);
                h.expect_close(&op, &got, &want, budget);
            }
        }
        // An unquantized BF16 matrix (exact on every table: no int8 prefill for it).
        let r = h.be.matmul_bf16(&w.dense, 16, &xt);
        if let Some(y) = h.ok("matmul_bf16", r) {
            let want = refr::matmul_bf16(&w.dense, buf, 16, &x);
            if let Some(got) = h.read(&y) {
                h.expect_close(&format!("matmul_bf16 x {t} rows"), &got, &want, EXACT_REL);
            }
        }
        // An expert blob: the same matrix read from a separate buffer at the same offsets.
        let blob = buf.to_vec();
        let r = h.be.matmul(&[&w.mats[0].0], Weights::Blob(&blob), &xt);
        if let Some(ys) = h.ok("matmul", r) {
            let want = refr::matmul(&w.mats[0].0, buf, &x);
            if let Some(got) = h.read(&ys[0]) {
                let budget = h.budget_q(t);
                h.expect_close("matmul (expert blob)", &got, &want, budget);
            }
        }
        for (i, mlp) in w.mlps.iter().enumerate() {
            for act in [Act::GeluTanh, Act::Silu, Act::SiluClamped(0.05)] {
                let r = h.be.glu_mlp(mlp, act, Weights::Blob(&blob), &xt);
                let Some(y) = h.ok("glu_mlp", r) else {
                    continue;
                };
                let want =
                    refr::glu_mlp(&mlp.gate_proj, &mlp.up_proj, &mlp.down_proj, act, buf, &x);
                if let Some(got) = h.read(&y) {
                    let budget = h.budget_glu(t);
                    h.expect_close(
                        &format!("glu_mlp {i} {act:?} x {t} rows"),
                        &got,
                        &want,
                        budget,
                    );
                    glu_experts(h, mlp, act, &blob, &xt, &got);
                }
            }
        }
        if t == 1 {
            glu_rows(h, w, &blob, &x, &xt);
            glu_combine(h, w, &blob, &x, &xt);
            for (m, bits, gs) in &w.mats {
                let r = h.be.head_argmax(m, &xt);
                let Some((id, _)) = h.ok("head_argmax", r) else {
                    continue;
                };
                let want = refr::matmul(m, buf, &x);
                let best = want.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let tol = EXACT_REL as f32 * want.iter().fold(1e-3f32, |a, v| a.max(v.abs()));
                if (id as usize) >= want.len() || want[id as usize] < best - tol {
                    h.fail(
                        "head_argmax",
                        format!("{bits}-bit g{gs}: id {id} is not the argmax"),
                    );
                }
            }
        }
    }
}
