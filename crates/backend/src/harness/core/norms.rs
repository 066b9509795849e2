//! Cases of the norms (plain, fused with add, RoPE and pre-norms) and the elementwise ops.

use crate::harness::*;

pub(crate) fn norms_and_elementwise<B: Backend>(
    h: &mut Harness<B>,
    rng: &mut Rng,
    w: &TestWeights,
) {
    let buf = h.buf;
    let t = 3;
    let x = rng.vec(t * 256, 2.0);
    let cases: [(usize, Norm, &str); 5] = [
        (256, Norm::NoScale, "no-scale"),
        (256, Norm::Weight(&w.w256), "weight"),
        (32, Norm::Weight(&w.w32), "per-head weight"),
        (32, Norm::OnePlusWeight(&w.w32), "1+w per head"),
        (32, Norm::Scaled(0.125), "scaled (L2) per head"),
    ];
    for (dim, norm, name) in cases {
        let Some(mut xt) = h.up(&x, 256) else { return };
        let want = refr::rms_norm(&x, dim, norm, buf, 1e-6);
        // Out of place first: the source must come back unchanged.
        let r = h.be.rms_norm_to(&xt, dim, norm, 1e-6);
        if let Some(yt) = h.ok("rms_norm_to", r) {
            if let (Some(got), Some(src)) = (h.read(&yt), h.read(&xt)) {
                h.expect_close(&format!("rms_norm_to {name}"), &got, &want, EXACT_REL);
                if src != x {
                    h.fail("rms_norm_to", format!("{name}: the source was changed"));
                }
            }
        }
        let r = h.be.rms_norm(&mut xt, dim, norm, 1e-6);
        if h.ok("rms_norm", r).is_some() {
            if let Some(got) = h.read(&xt) {
                h.expect_close(&format!("rms_norm {name}"), &got, &want, EXACT_REL);
            }
        }
        // Into a residual: (r + norm(x)) · 0.75, x unchanged.
        let res = rng.vec(t * 256, 1.0);
        let (Some(mut rt), Some(xt)) = (h.up(&res, 256), h.up(&x, 256)) else {
            return;
        };
        let r = h.be.add_rms_norm(&mut rt, &xt, dim, norm, 1e-6, 0.75);
        if h.ok("add_rms_norm", r).is_some() {
            let want: Vec<f32> = res.iter().zip(&want).map(|(a, n)| (a + n) * 0.75).collect();
            if let (Some(got), Some(src)) = (h.read(&rt), h.read(&xt)) {
                h.expect_close(&format!("add_rms_norm {name}"), &got, &want, EXACT_REL);
                if src != x {
                    h.fail(
                        "add_rms_norm",
                        format!("{name}: the normed input was changed"),
                    );
                }
            }
        }
    }
    // A block's output into the residual (normed, or a plain add), then pre-norms of the new
    // residual (one with a column scale), over whole rows and over 32-wide pieces: against the
    // reference, and bit-equal to the ops it stands for on the same backend.
    for (dim, wd, normed) in [
        (256, &w.w256, true),
        (32, &w.w32, true),
        (256, &w.w256, false),
    ] {
        let post = normed.then_some(Norm::Weight(wd));
        let res = rng.vec(t * 256, 1.0);
        let pre = [
            PreNorm {
                norm: Norm::NoScale,
                cols: Some((&w.w256, 0.5)),
            },
            PreNorm {
                norm: Norm::Weight(wd),
                cols: None,
            },
            PreNorm {
                norm: Norm::Scaled(0.125),
                cols: None,
            },
        ];
        let (Some(mut rt), Some(xt), Some(mut st)) =
            (h.up(&res, 256), h.up(&x, 256), h.up(&res, 256))
        else {
            return;
        };
        let name = format!("add_rms_norm_pre (pieces of {dim}, normed {normed})");
        let r =
            h.be.add_rms_norm_pre(&mut rt, &xt, dim, post, 1e-6, 0.75, &pre);
        let Some(outs) = h.ok("add_rms_norm_pre", r) else {
            continue;
        };
        let n = match post {
            Some(post) => refr::rms_norm(&x, dim, post, buf, 1e-6),
            None => x.clone(),
        };
        let new_x: Vec<f32> = res.iter().zip(&n).map(|(a, n)| (a + n) * 0.75).collect();
        if let Some(got) = h.read(&rt) {
            h.expect_close(&format!("{name} residual"), &got, &new_x, EXACT_REL);
        }
        // The separate ops on a copy of the residual.
        let sep = match post {
            Some(post) => h.be.add_rms_norm(&mut st, &xt, dim, post, 1e-6, 0.75),
            None => h.be.add(&mut st, &xt, 0.75),
        };
        let sep_x = h.ok("add_rms_norm", sep).and_then(|_| h.read(&st));
        if let (Some(a), Some(b)) = (h.read(&rt), sep_x) {
            if a != b {
                h.fail(
                    "add_rms_norm_pre",
                    format!("{name}: residual differs from the separate op's"),
                );
            }
        }
        for (i, (p, out)) in pre.iter().zip(&outs).enumerate() {
            let mut want = refr::rms_norm(&new_x, dim, p.norm, buf, 1e-6);
            if let Some((cw, c)) = p.cols {
                for (j, v) in want.iter_mut().enumerate() {
                    *v = (*v as f64 * cw.get(buf, j % 256) as f64 * c as f64) as f32;
                }
            }
            let Some(got) = h.read(out) else { continue };
            h.expect_close(&format!("{name} output {i}"), &got, &want, EXACT_REL);
            let mut one = h.be.rms_norm_to(&st, dim, p.norm, 1e-6);
            if let (Ok(o), Some((cw, c))) = (&mut one, p.cols) {
                if let Err(e) = h.be.mul_cols(o, cw, c) {
                    h.fail("mul_cols", e.to_string());
                }
            }
            if let Some(sep) = h.ok("rms_norm_to", one).and_then(|o| h.read(&o)) {
                if sep != got {
                    h.fail(
                        "add_rms_norm_pre",
                        format!("{name}: output {i} differs from the separate ops'"),
                    );
                }
            }
        }
    }
    let z = rng.vec(t * 256, 3.0);
    if let (Some(mut xt), Some(zt)) = (h.up(&x, 256), h.up(&z, 256)) {
        let r = h.be.rms_norm_gated(&mut xt, 32, &w.w32, &zt, 1e-6);
        if h.ok("rms_norm_gated", r).is_some() {
            let n = refr::rms_norm(&x, 32, Norm::Weight(&w.w32), buf, 1e-6);
            let want: Vec<f32> = n
                .iter()
                .zip(&z)
                .map(|(&a, &g)| a * refr::unary(g, Unary::Silu))
                .collect();
            if let Some(got) = h.read(&xt) {
                h.expect_close("rms_norm_gated", &got, &want, EXACT_REL);
            }
        }
    }
    for op in [
        Unary::Scale(-1.7),
        Unary::Softcap(30.0),
        Unary::Clamp(-0.5, 1.25),
        Unary::Silu,
        Unary::GeluTanh,
        Unary::Sigmoid,
    ] {
        let v: Vec<f32> = rng.vec(200, 12.0);
        let Some(mut vt) = h.up(&v, 20) else { return };
        let r = h.be.unary(&mut vt, op);
        if h.ok("unary", r).is_some() {
            let want: Vec<f32> = v.iter().map(|&a| refr::unary(a, op)).collect();
            if let Some(got) = h.read(&vt) {
                h.expect_close(&format!("unary {op:?}"), &got, &want, 1e-6);
            }
        }
    }
    let y = rng.vec(t * 256, 1.0);
    let g = rng.vec(t, 4.0);
    type Case<'w> = (&'w str, fn(&[f32], &[f32], &[f32], f32) -> Vec<f32>);
    let _: Option<Case> = None;
    // mul_cols
    if let Some(mut xt) = h.up(&x, 256) {
        let r = h.be.mul_cols(&mut xt, &w.w256, 0.0625);
        if h.ok("mul_cols", r).is_some() {
            let want: Vec<f32> = x
                .iter()
                .enumerate()
                .map(|(i, &a)| (a as f64 * w.w256.get(buf, i % 256) as f64 * 0.0625) as f32)
                .collect();
            if let Some(got) = h.read(&xt) {
                h.expect_close("mul_cols", &got, &want, 1e-6);
            }
        }
    }
    if let (Some(mut xt), Some(yt)) = (h.up(&x, 256), h.up(&y, 256)) {
        let r = h.be.mul_sigmoid(&mut xt, &yt);
        if h.ok("mul_sigmoid", r).is_some() {
            let want: Vec<f32> = x
                .iter()
                .zip(&y)
                .map(|(&a, &b)| a * refr::unary(b, Unary::Sigmoid))
                .collect();
            if let Some(got) = h.read(&xt) {
                h.expect_close("mul_sigmoid", &got, &want, 1e-6);
            }
        }
    }
    if let (Some(mut xt), Some(gt)) = (h.up(&x, 256), h.up(&g, 1)) {
        let r = h.be.mul_rows_sigmoid(&mut xt, &gt);
        if h.ok("mul_rows_sigmoid", r).is_some() {
            let want: Vec<f32> = x
                .iter()
                .enumerate()
                .map(|(i, &a)| a * refr::unary(g[i / 256], Unary::Sigmoid))
                .collect();
            if let Some(got) = h.read(&xt) {
                h.expect_close("mul_rows_sigmoid", &got, &want, 1e-6);
            }
        }
    }
    for s in [1.0f32, 0.7] {
        if let (Some(mut xt), Some(yt)) = (h.up(&x, 256), h.up(&y, 256)) {
            let r = h.be.add(&mut xt, &yt, s);
            if h.ok("add", r).is_some() {
                let want: Vec<f32> = x
                    .iter()
                    .zip(&y)
                    .map(|(&a, &b)| ((a as f64 + b as f64) * s as f64) as f32)
                    .collect();
                if let Some(got) = h.read(&xt) {
                    h.expect_close(&format!("add s={s}"), &got, &want, 1e-6);
                }
            }
        }
    }
    // scatter_add: expert outputs for rows [2, 0, 2] of a 3-row accumulator.
    let rows = [(2usize, 0.25f32), (0, -1.5), (2, 0.75)];
    let ye = rng.vec(3 * 256, 1.0);
    if let (Some(mut acc), Some(yt)) = (h.up(&x, 256), h.up(&ye, 256)) {
        let r = h.be.scatter_add(&mut acc, &yt, &rows);
        if h.ok("scatter_add", r).is_some() {
            let mut want: Vec<f64> = x.iter().map(|&v| v as f64).collect();
            for (j, &(row, wt)) in rows.iter().enumerate() {
                for i in 0..256 {
                    want[row * 256 + i] += wt as f64 * ye[j * 256 + i] as f64;
                }
            }
            let want: Vec<f32> = want.into_iter().map(|v| v as f32).collect();
            if let Some(got) = h.read(&acc) {
                h.expect_close("scatter_add", &got, &want, 1e-6);
            }
        }
    }
    scatter_many(h, rng, &x);
}

/// `scatter_add_many` of three experts' outputs (rows of a 3-row accumulator, row 2 taking a
/// term from each): bit for bit the three `scatter_add`s in order.
fn scatter_many<B: Backend>(h: &mut Harness<B>, rng: &mut Rng, x: &[f32]) {
    let rows: [&[(usize, f32)]; 3] = [
        &[(0, 0.5), (2, -0.25)],
        &[(2, 1.25)],
        &[(1, 2.0), (2, 0.125)],
    ];
    let ys: Vec<Vec<f32>> = rows.iter().map(|r| rng.vec(r.len() * 256, 1.0)).collect();
    let (Some(mut one), Some(mut many)) = (h.up(x, 256), h.up(x, 256)) else {
        return;
    };
    let mut yts = Vec::new();
    for (y, r) in ys.iter().zip(rows) {
        let Some(yt) = h.up(y, 256) else { return };
        let res = h.be.scatter_add(&mut one, &yt, r);
        if h.ok("scatter_add", res).is_none() {
            return;
        }
        yts.push(yt);
    }
    let res =
        h.be.scatter_add_many(&mut many, &yts.iter().collect::<Vec<_>>(), &rows);
    if h.ok("scatter_add_many", res).is_none() {
        return;
    }
    if let (Some(a), Some(b)) = (h.read(&one), h.read(&many)) {
        if a.iter()
            .map(|v| v.to_bits())
            .ne(b.iter().map(|v| v.to_bits()))
        {
            h.fail(
                "scatter_add_many",
                "not the bits of scatter_add in order".into(),
            );
        }
    }
}

/// `add_rms_norm2_pre`: two block outputs normed (a weight, a 1 + w weight) and summed, into the
/// residual by a post-norm and a scale, then two pre-norms of the new residual (one with a column
/// scale), over whole rows and 32-wide pieces: against the reference, and bit for bit the ops it
/// stands for (`rms_norm`, `add_rms_norm`, `add_rms_norm_pre`) on the same backend.
pub(crate) fn two_into_residual<B: Backend>(h: &mut Harness<B>, rng: &mut Rng, w: &TestWeights) {
    let buf = h.buf;
    let t = 3;
    for (dim, wd) in [(256, &w.w256), (32, &w.w32)] {
        let (res, a, b) = (
            rng.vec(t * 256, 1.0),
            rng.vec(t * 256, 2.0),
            rng.vec(t * 256, 0.5),
        );
        let (an, bn, post) = (Norm::Weight(wd), Norm::OnePlusWeight(wd), Norm::Weight(wd));
        let pre = [
            PreNorm {
                norm: Norm::Weight(wd),
                cols: None,
            },
            PreNorm {
                norm: Norm::NoScale,
                cols: Some((&w.w256, 0.5)),
            },
        ];
        let name = format!("add_rms_norm2_pre (pieces of {dim})");
        let ups = [&res, &a, &b, &res, &a].map(|v| h.up(v, 256));
        let [Some(mut xt), Some(mut at), Some(bt), Some(mut xs), Some(mut a_sep)] = ups else {
            return;
        };
        let r = h.be.add_rms_norm2_pre(
            &mut xt,
            &mut at,
            an,
            &bt,
            bn,
            dim,
            Some(post),
            1e-6,
            0.75,
            &pre,
        );
        let Some(outs) = h.ok("add_rms_norm2_pre", r) else {
            continue;
        };
        let na = refr::rms_norm(&a, dim, an, buf, 1e-6);
        let nb = refr::rms_norm(&b, dim, bn, buf, 1e-6);
        let y: Vec<f32> = na.iter().zip(&nb).map(|(p, q)| p + q).collect();
        let ny = refr::rms_norm(&y, dim, post, buf, 1e-6);
        let new_x: Vec<f32> = res.iter().zip(&ny).map(|(r, n)| (r + n) * 0.75).collect();
        // The sum left in `a`, the residual, the pre-norms.
        let got: Vec<Option<Vec<f32>>> = [&at, &xt]
            .into_iter()
            .chain(outs.iter())
            .map(|t| h.read(t))
            .collect();
        let mut wants = vec![y.clone(), new_x.clone()];
        for p in &pre {
            let mut want = refr::rms_norm(&new_x, dim, p.norm, buf, 1e-6);
            if let Some((cw, c)) = p.cols {
                for (j, v) in want.iter_mut().enumerate() {
                    *v = (*v as f64 * cw.get(buf, j % 256) as f64 * c as f64) as f32;
                }
            }
            wants.push(want);
        }
        for (i, (g, want)) in got.iter().zip(&wants).enumerate() {
            if let Some(g) = g {
                h.expect_close(&format!("{name} tensor {i}"), g, want, EXACT_REL);
            }
        }
        // The separate ops.
        let r = h.be.rms_norm(&mut a_sep, dim, an, 1e-6);
        let r = r.and_then(|_| h.be.add_rms_norm(&mut a_sep, &bt, dim, bn, 1e-6, 1.0));
        let r = r.and_then(|_| {
            h.be.add_rms_norm_pre(&mut xs, &a_sep, dim, Some(post), 1e-6, 0.75, &pre)
        });
        let Some(sep_outs) = h.ok("add_rms_norm2_pre (separate ops)", r) else {
            continue;
        };
        let sep: Vec<Option<Vec<f32>>> = [&a_sep, &xs]
            .into_iter()
            .chain(sep_outs.iter())
            .map(|t| h.read(t))
            .collect();
        for (i, (g, s)) in got.iter().zip(&sep).enumerate() {
            if let (Some(g), Some(s)) = (g, s) {
                if g.iter()
                    .map(|v| v.to_bits())
                    .ne(s.iter().map(|v| v.to_bits()))
                {
                    h.fail(
                        "add_rms_norm2_pre",
                        format!("{name}: tensor {i} differs from the separate ops'"),
                    );
                }
            }
        }
    }
}
