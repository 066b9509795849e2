//! Cases of DeepSeek-V4's ops.

use super::*;

/// DeepSeek-V4's ops: dense products, row writes, RoPE at given positions, the grouped product,
/// both mHC sites (and the head's collapse), window pooling with and without overlap (and a prior
/// window), attention over a sliding ring plus selected entries, the indexer's top-k, and the
/// sqrt-softplus router with a selection bias and with forced (hash) ids.
pub(crate) fn dsv4_ops<B: Backend>(h: &mut Harness<B>, rng: &mut Rng, w: &TestWeights) {
    let buf = h.buf;
    // linear
    let (t, c, n) = (5, 96, 24);
    let (x, wd) = (rng.vec(t * c, 1.0), rng.vec(n * c, 0.5));
    if let (Some(xt), Some(wt)) = (h.up(&x, c), h.up(&wd, c)) {
        let r = h.be.linear(&xt, &wt);
        if let Some(got) = h.ok("linear", r).and_then(|y| h.read(&y)) {
            h.expect_close("linear", &got, &refr::linear(&x, &wd, c), EXACT_REL);
        }
    }
    // set_rows
    let (a, b) = (rng.vec(6 * 8, 1.0), rng.vec(2 * 8, 1.0));
    if let (Some(mut at), Some(bt)) = (h.up(&a, 8), h.up(&b, 8)) {
        let r = h.be.set_rows(&mut at, 3, &bt);
        if h.ok("set_rows", r).is_some() {
            let mut want = a.clone();
            want[24..40].copy_from_slice(&b);
            if let Some(got) = h.read(&at) {
                h.expect_close("set_rows", &got, &want, 0.0);
            }
        }
        if h.be.set_rows(&mut at, 5, &bt).is_ok() {
            h.fail("set_rows", "rows past the end were accepted".into());
        }
    }
    // rope_at (interleaved, the trailing half of each head rotated via zero frequencies)
    let mut rope = Rope::interleaved(16, 160000.0);
    rope.inv_freq = std::iter::repeat_n(0.0, 8).chain(rope.inv_freq).collect();
    rope.rotated = 32;
    let x = rng.vec(3 * 64, 1.0);
    let positions = [0usize, 4, 1024];
    if let Some(mut xt) = h.up(&x, 64) {
        let r = h.be.rope_at(&mut xt, &rope, 32, &positions);
        if h.ok("rope_at", r).is_some() {
            let want = refr::rope_at(&x, 64, &rope, 32, &positions);
            if let Some(got) = h.read(&xt) {
                h.expect_close("rope_at", &got, &want, 2e-6);
            }
        }
    }
    // matmul_grouped
    for t in [1, 7] {
        let x = rng.vec(t * 4 * 64, 1.0);
        let Some(xt) = h.up(&x, 4 * 64) else { return };
        let r = h.be.matmul_grouped(&w.grouped, 4, Weights::Resident, &xt);
        if let Some(got) = h.ok("matmul_grouped", r).and_then(|y| h.read(&y)) {
            let want = refr::matmul_grouped(&w.grouped, 4, buf, &x);
            let budget = h.budget_q(t);
            h.expect_close(&format!("matmul_grouped T={t}"), &got, &want, budget);
        }
    }
    // hc_pre / hc_post (and the head)
    let spec = HcSpec {
        streams: 4,
        sinkhorn_iters: 20,
        hc_eps: 1e-6,
        norm_eps: 1e-6,
    };
    let (t, d) = (3, 32);
    let x = rng.vec(t * 4 * d, 2.0);
    for m in [24, 4] {
        let f = rng.vec(m * 4 * d, 0.3);
        let base = rng.vec(m, 0.5);
        let scale = rng.vec(if m == 4 { 1 } else { 3 }, 1.0);
        let (Some(xt), Some(ft)) = (h.up(&x, 4 * d), h.up(&f, 4 * d)) else {
            return;
        };
        let r = h.be.hc_pre(&xt, &ft, &base, &scale, &spec);
        let Some((col, rest)) = h.ok("hc_pre", r) else {
            continue;
        };
        let (wc, wrest) = refr::hc_pre(&x, 4 * d, &f, &base, &scale, &spec);
        if let Some(got) = h.read(&col) {
            h.expect_close(&format!("hc_pre collapse rows_f {m}"), &got, &wc, EXACT_REL);
        }
        match (rest, wrest) {
            (None, None) => {}
            (Some((post, comb)), Some((wp, wcomb))) => {
                let (Some(gp), Some(gc)) = (h.read(&post), h.read(&comb)) else {
                    return;
                };
                h.expect_close("hc_pre post", &gp, &wp, EXACT_REL);
                h.expect_close("hc_pre comb", &gc, &wcomb, EXACT_REL);
                let out = rng.vec(t * d, 1.0);
                let Some(ot) = h.up(&out, d) else { return };
                let r = h.be.hc_post(&xt, &ot, &post, &comb);
                if let Some(got) = h.ok("hc_post", r).and_then(|y| h.read(&y)) {
                    let want = refr::hc_post(&x, &out, &wp, &wcomb, 4);
                    h.expect_close("hc_post", &got, &want, EXACT_REL);
                }
            }
            _ => h.fail("hc_pre", format!("rows_f {m}: post/comb presence differs")),
        }
    }
    // compress_pool: HCA-like (no overlap), CSA-like (overlap) without and with a prior window
    for (rate, overlap, with_prior) in [(8, false, false), (4, true, false), (4, true, true)] {
        let (d, n_win) = (16, 3);
        let width = if overlap { 2 * d } else { d };
        let kv = rng.vec(n_win * rate * width, 1.0);
        let gate = rng.vec(n_win * rate * width, 3.0);
        let ape = rng.vec(rate * width, 1.0);
        let (pk, pg) = (rng.vec(rate * d, 1.0), rng.vec(rate * d, 3.0));
        let (Some(kt), Some(gt), Some(at), Some(pkt), Some(pgt)) = (
            h.up(&kv, width),
            h.up(&gate, width),
            h.up(&ape, width),
            h.up(&pk, d),
            h.up(&pg, d),
        ) else {
            return;
        };
        let prior = with_prior.then_some((&pkt, &pgt));
        let r = h.be.compress_pool(&kt, &gt, &at, rate, overlap, prior);
        if let Some(got) = h.ok("compress_pool", r).and_then(|y| h.read(&y)) {
            let p = with_prior.then_some((&pk[..], &pg[..]));
            let want = refr::compress_pool(&kv, &gate, &ape, rate, width, overlap, p);
            let name = format!("compress_pool rate {rate} overlap {overlap} prior {with_prior}");
            h.expect_close(&name, &got, &want, EXACT_REL);
        }
    }
    // attention_sparse: a sliding FP32/FP16 ring (K = V as the family uses it) plus entries
    for dtype in [KvDtype::F32, KvDtype::F16] {
        let (nh, d, win) = (4, 32, 6);
        let Some(mut kv) = h.ok("new_kv", h.be.new_kv(win + 3, true, 1, d, dtype)) else {
            return;
        };
        let shape = AttnShape {
            n_heads: nh,
            n_kv_heads: 1,
            head_dim: d,
            window: Some(win),
            scale: 1.0 / (d as f32).sqrt(),
            sinks: Some(rng.vec(nh, 2.0)),
        };
        let entries = rng.vec(5 * d, 2.0);
        let Some(et) = h.up(&entries, d) else { return };
        let mut hist = Vec::new();
        let mut pos0 = 0;
        for t in [7usize, 1, 3] {
            let k = rng.vec(t * d, 2.0);
            hist.extend(kv_rounded(dtype, &k));
            let q = rng.vec(t * nh * d, 2.0);
            let (Some(kt), Some(qt)) = (h.up(&k, d), h.up(&q, nh * d)) else {
                return;
            };
            if h.ok("kv_write", h.be.kv_write(&mut kv, pos0, &kt, &kt))
                .is_none()
            {
                return;
            }
            let visible: Vec<Vec<usize>> = (0..t)
                .map(|r| (0..5).filter(|e| (e + r + pos0) % 3 != 0).collect())
                .collect();
            let r = h.be.attention_sparse(&qt, &kv, pos0, &shape, &et, &visible);
            if let Some(got) = h.ok("attention_sparse", r).and_then(|y| h.read(&y)) {
                let want =
                    refr::attention_sparse(&q, &hist, &hist, pos0, &shape, &entries, &visible);
                let budget = if dtype == KvDtype::F16 {
                    F16_KV_REL
                } else {
                    EXACT_REL
                };
                h.expect_close(
                    &format!("attention_sparse {dtype:?} at {pos0}"),
                    &got,
                    &want,
                    budget,
                );
            }
            pos0 += t;
        }
    }
    // index_top_k: truncating and not, rows seeing different numbers of entries
    let (t, nh, d, n) = (4, 3, 16, 9);
    let (q, keys, wts) = (
        rng.vec(t * nh * d, 1.0),
        rng.vec(n * d, 1.0),
        rng.vec(t * nh, 1.0),
    );
    let visible = [0usize, 2, 5, 9];
    if let (Some(qt), Some(kt), Some(wt)) = (h.up(&q, nh * d), h.up(&keys, d), h.up(&wts, nh)) {
        for top_k in [3, 16] {
            let r = h.be.index_top_k(&qt, &kt, &wt, nh, &visible, top_k);
            let Some(got) = h.ok("index_top_k", r) else {
                continue;
            };
            let want = refr::index_top_k(&q, &keys, &wts, nh, d, &visible, top_k);
            for (row, (g, (wi, _))) in got.iter().zip(&want).enumerate() {
                if g != wi {
                    h.fail(
                        "index_top_k",
                        format!("top-{top_k} row {row}: {g:?}, reference {wi:?}"),
                    );
                }
            }
        }
    }
    // route: sqrt-softplus with and without the selection bias, and forced (hash) ids; a prefill
    // chunk's rows and one decode row (a backend may route one row by another kernel)
    for t in [6, 1] {
        let n_exp = 16;
        let logits = rng.vec(t * n_exp, 4.0);
        let Some(lt) = h.up(&logits, n_exp) else {
            return;
        };
        let forced: Vec<usize> = (0..t)
            .flat_map(|r| {
                [
                    (5 * r + 1) % n_exp,
                    (5 * r + 2) % n_exp,
                    (5 * r + 3) % n_exp,
                ]
            })
            .collect();
        for (bias, forced) in [
            (Some(w.bias), None),
            (None, None),
            (None, Some(&forced[..])),
        ] {
            let spec = RouterSpec {
                scoring: Scoring::SqrtSoftplus {
                    routed_scaling_factor: 1.5,
                    correction_bias: bias,
                },
                top_k: if forced.is_some() { 3 } else { 6 },
                per_expert_scale: None,
                trace: false,
                forced,
            };
            let r = h.be.route(&lt, &spec);
            let Some(routes) = h.ok("route (sqrt-softplus)", r) else {
                continue;
            };
            let name = format!(
                "route sqrt-softplus rows {t} bias {} forced {}",
                bias.is_some(),
                forced.is_some()
            );
            check_routes(h, &name, &routes, &refr::route(&logits, n_exp, &spec, buf));
        }
    }
}
