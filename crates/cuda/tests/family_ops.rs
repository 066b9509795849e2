//! Inkling's and DeepSeek-V4's ops on the CUDA backend at the real models' sizes (issue 30 item 1:
//! the harness's cases are small), against the f64 reference: Inkling-Small's attention with the
//! relative-position bias (32 / 8 heads of 128, d_rel 16; a sliding ring with extent 512 and a
//! global layer with extent 1024 and the log position scale, prefill chunks on the tiled kernel
//! and decode rows on the split one), its 4096-wide router (`linear`, 256 + 2 sink experts) and
//! short convolution; DeepSeek-V4-Flash's mHC over 4 streams of 4096, the compressor's pooling
//! (CSA rate 4 with overlap and a prior, HCA rate 128), sparse attention (64 heads of 512 over a
//! 96-position window and 300 entries), the indexer (64 heads of 128 over 1000 keys, top 512), the
//! grouped output product (8 groups of [1024, 4096]) and RoPE at compressed positions.
//!
//! Without a CUDA driver each test says it skipped and passes (CI has no GPU).

mod common;

use std::sync::Arc;

use common::*;

use mference_backend::harness::{kv_rounded, Rng, EXACT_REL, F16_KV_REL};
use mference_backend::reference as refr;
use mference_backend::{
    AttnShape, CoreOps, DeepSeekV4Ops, HcSpec, InklingOps, KvDtype, LogScaling, RecurrentOps,
    RelBias, Rope, RouterSpec, Scoring, SinkRouter, Weights,
};

#[test]
fn inkling_ops_at_model_size_match_the_reference() {
    let bytes = Arc::new(vec![0u8; 64]);
    let Some(be) = start(&bytes) else { return };
    let mut rng = Rng(3030);
    let mut fails = Vec::new();
    let (nh, nkv, d, d_rel) = (32, 8, 128, 16);
    // (window, extent, log scaling, dtype): a sliding ring and a global layer.
    let log = Some(LogScaling {
        n_floor: 100.0,
        alpha: 0.1,
    });
    for (window, extent, log_scaling, dtype) in [
        (Some(512), 512, None, KvDtype::F16),
        (None, 1024, log, KvDtype::F32),
    ] {
        let chunks = [64usize, 64, 64, 1, 1];
        let total: usize = chunks.iter().sum();
        let (rows, ring) = match window {
            Some(w) => (w + 64, true),
            None => (total, false),
        };
        let mut kv = be.new_kv(rows, ring, nkv, d, dtype).expect("new_kv");
        let shape = AttnShape {
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: d,
            window,
            scale: 1.0 / d as f32,
            sinks: None,
        };
        let proj = vals(&mut rng, d_rel * extent, 0.5);
        let pt = be.upload(&proj, extent).expect("upload");
        let (mut hk, mut hv) = (Vec::new(), Vec::new());
        let mut pos0 = 0;
        for t in chunks {
            let k = vals(&mut rng, t * nkv * d, 2.0);
            let v = vals(&mut rng, t * nkv * d, 1.0);
            let q = vals(&mut rng, t * nh * d, 2.0);
            let rel = vals(&mut rng, t * nh * d_rel, 1.0);
            hk.extend(kv_rounded(dtype, &k));
            hv.extend(kv_rounded(dtype, &v));
            let kt = be.upload(&k, nkv * d).expect("upload");
            let vt = be.upload(&v, nkv * d).expect("upload");
            let qt = be.upload(&q, nh * d).expect("upload");
            let rt = be.upload(&rel, nh * d_rel).expect("upload");
            be.kv_write(&mut kv, pos0, &kt, &vt).expect("kv_write");
            let bias = RelBias {
                rel: &rt,
                proj: &pt,
                log_scaling,
            };
            let o = be
                .attention_rel(&qt, &kv, pos0, &shape, &bias)
                .expect("attention_rel");
            let want =
                refr::attention_rel(&q, &hk, &hv, pos0, &shape, &rel, &proj, d_rel, log_scaling);
            let budget = match dtype {
                KvDtype::F16 => F16_KV_REL,
                KvDtype::F32 => EXACT_REL,
            };
            let got = be.read(&o).expect("read");
            let name =
                format!("attention_rel window {window:?} extent {extent} {t} rows at {pos0}");
            expect(&mut fails, name, &got, &want, budget);
            pos0 += t;
        }
    }

    // The router: a 4096-wide linear into 256 routed + 2 shared logits, top-8 with the sinks.
    let (h, n_routed, n_shared) = (4096, 256, 2);
    let n_all = n_routed + n_shared;
    for t in [1usize, 33] {
        let x = vals(&mut rng, t * h, 1.0);
        let w = vals(&mut rng, n_all * h, 0.05);
        let (xt, wt) = (be.upload(&x, h).unwrap(), be.upload(&w, h).unwrap());
        let lt = be.linear(&xt, &wt).expect("linear");
        let lg = be.read(&lt).expect("read");
        expect(
            &mut fails,
            format!("linear [{n_all}, {h}] x {t} rows"),
            &lg,
            &refr::linear(&x, &w, h),
            EXACT_REL,
        );
        let bias = vals(&mut rng, n_routed, 0.05);
        let bt = be.upload(&bias, n_routed).unwrap();
        let router = SinkRouter {
            bias: &bt,
            n_shared,
            scale: 8.0,
        };
        let spec = RouterSpec {
            scoring: Scoring::SoftmaxOfTopK,
            top_k: 8,
            per_expert_scale: None,
            trace: false,
            forced: None,
        };
        let routes = be.route_sinks(&lt, &router, &spec).expect("route_sinks");
        // The routes follow the logits this backend computed, as the CPU would from them.
        let want = refr::route_sinks(&lg, n_all, &bias, 8.0, &spec);
        for (row, w) in want.iter().enumerate() {
            for &(e, wt) in w {
                let got = routes
                    .experts
                    .get(&e)
                    .and_then(|v| v.iter().find(|p| p.0 == row));
                if got.is_none_or(|&(_, g)| (g - wt).abs() > 1e-5 * wt.abs().max(1.0)) {
                    fails.push(format!(
                        "route_sinks row {row} expert {e}: {got:?}, want {wt}"
                    ));
                }
            }
        }
    }

    // A short convolution over 4096 channels, continued across a chunk and a decode row.
    let (c, kernel) = (4096, 4);
    let w = vals(&mut rng, c * kernel, 0.3);
    let wt = be.upload(&w, kernel).unwrap();
    let mut st = be.new_state((kernel - 1) * c).unwrap();
    let mut state = vec![0.0f32; (kernel - 1) * c];
    for t in [64usize, 1] {
        let x = vals(&mut rng, t * c, 1.0);
        let o = be
            .conv1d(&be.upload(&x, c).unwrap(), &mut st, &wt, kernel)
            .expect("conv1d");
        let (want, next) = refr::conv1d(&x, &state, &w, c, kernel);
        state = next;
        expect(
            &mut fails,
            format!("conv1d {t} rows"),
            &be.read(&o).unwrap(),
            &want,
            EXACT_REL,
        );
    }
    assert!(fails.is_empty(), "{}", fails.join("\n"));
}

#[test]
fn deepseek_v4_ops_at_model_size_match_the_reference() {
    let mut rng = Rng(4040);
    let mut buf = Vec::new();
    let wo_a = qmatrix(&mut buf, &mut rng, 8 * 1024, 4096, 4, 64);
    buf.extend([0u8; 64]);
    let bytes = Arc::new(buf);
    let Some(be) = start(&bytes) else { return };
    let mut fails = Vec::new();

    // The grouped output product: 8 groups of [1024, 4096] over rows of 8 x 4096.
    for t in [1usize, 5, 40] {
        let x = vals(&mut rng, t * 8 * 4096, 1.0);
        let xt = be.upload(&x, 8 * 4096).unwrap();
        let y = be
            .matmul_grouped(&wo_a, 8, Weights::Resident, &xt)
            .expect("matmul_grouped");
        let want = refr::matmul_grouped(&wo_a, 8, &bytes, &x);
        let name = format!("matmul_grouped 8 x [1024, 4096] x {t} rows");
        expect(&mut fails, name, &be.read(&y).unwrap(), &want, EXACT_REL);
    }

    // RoPE of 512-wide heads (64 rotated) at compressed positions.
    let mut rope = Rope::interleaved(64, 10000.0);
    rope.mscale = 1.25;
    let positions: Vec<usize> = (0..16).map(|w| 4 * w + 3).collect();
    let x = vals(&mut rng, 16 * 512, 1.0);
    let mut xt = be.upload(&x, 512).unwrap();
    be.rope_at(&mut xt, &rope, 512, &positions)
        .expect("rope_at");
    let want = refr::rope_at(&x, 512, &rope, 512, &positions);
    expect(
        &mut fails,
        "rope_at".into(),
        &be.read(&xt).unwrap(),
        &want,
        2e-6,
    );

    // mHC over 4 streams of 4096: the entry (24 mixes and the head's 4), the exit.
    let spec = HcSpec {
        streams: 4,
        sinkhorn_iters: 20,
        hc_eps: 1e-6,
        norm_eps: 1e-6,
    };
    let (t, dim) = (9, 4096);
    let x = vals(&mut rng, t * 4 * dim, 2.0);
    let xt = be.upload(&x, 4 * dim).unwrap();
    for m in [24usize, 4] {
        let f = vals(&mut rng, m * 4 * dim, 0.02);
        let base = vals(&mut rng, m, 0.5);
        let scale = vals(&mut rng, if m == 4 { 1 } else { 3 }, 1.0);
        let ft = be.upload(&f, 4 * dim).unwrap();
        let (col, rest) = be.hc_pre(&xt, &ft, &base, &scale, &spec).expect("hc_pre");
        let (wc, wrest) = refr::hc_pre(&x, 4 * dim, &f, &base, &scale, &spec);
        let got = be.read(&col).unwrap();
        expect(
            &mut fails,
            format!("hc_pre collapse, {m} mixes"),
            &got,
            &wc,
            EXACT_REL,
        );
        if let (Some((post, comb)), Some((wp, wcomb))) = (rest, wrest) {
            expect(
                &mut fails,
                "hc_pre post".into(),
                &be.read(&post).unwrap(),
                &wp,
                EXACT_REL,
            );
            let gc = be.read(&comb).unwrap();
            expect(&mut fails, "hc_pre comb".into(), &gc, &wcomb, EXACT_REL);
            let out = vals(&mut rng, t * dim, 1.0);
            let ot = be.upload(&out, dim).unwrap();
            let y = be.hc_post(&xt, &ot, &post, &comb).expect("hc_post");
            let want = refr::hc_post(&x, &out, &wp, &wcomb, 4);
            expect(
                &mut fails,
                "hc_post".into(),
                &be.read(&y).unwrap(),
                &want,
                EXACT_REL,
            );
        }
    }

    // The compressor: CSA (rate 4, overlap, 512 dims, with a prior) and HCA (rate 128).
    for (rate, overlap, n_win) in [(4usize, true, 32usize), (128, false, 2)] {
        let d = 512;
        let width = if overlap { 2 * d } else { d };
        let kv = vals(&mut rng, n_win * rate * width, 1.0);
        let gate = vals(&mut rng, n_win * rate * width, 3.0);
        let ape = vals(&mut rng, rate * width, 1.0);
        let (pk, pg) = (vals(&mut rng, rate * d, 1.0), vals(&mut rng, rate * d, 3.0));
        let up = |v: &[f32], c| be.upload(v, c).unwrap();
        let (kt, gt, at) = (up(&kv, width), up(&gate, width), up(&ape, width));
        let (pkt, pgt) = (up(&pk, d), up(&pg, d));
        let prior = overlap.then_some((&pkt, &pgt));
        let y = be
            .compress_pool(&kt, &gt, &at, rate, overlap, prior)
            .expect("compress_pool");
        let p = overlap.then_some((&pk[..], &pg[..]));
        let want = refr::compress_pool(&kv, &gate, &ape, rate, width, overlap, p);
        let name = format!("compress_pool rate {rate} overlap {overlap}");
        expect(&mut fails, name, &be.read(&y).unwrap(), &want, EXACT_REL);
    }

    // Sparse attention: 64 heads of 512 over a 96-position sliding ring (K = V) and 300 entries.
    let (nh, d, win, n_ent) = (64, 512, 96, 300);
    for dtype in [KvDtype::F16, KvDtype::F32] {
        let mut kv = be.new_kv(win + 64, true, 1, d, dtype).expect("new_kv");
        let shape = AttnShape {
            n_heads: nh,
            n_kv_heads: 1,
            head_dim: d,
            window: Some(win),
            scale: 1.0 / (d as f32).sqrt(),
            sinks: Some(vals(&mut rng, nh, 2.0)),
        };
        let entries = vals(&mut rng, n_ent * d, 2.0);
        let et = be.upload(&entries, d).unwrap();
        let mut hist = Vec::new();
        let mut pos0 = 0;
        for t in [64usize, 64, 1] {
            let k = vals(&mut rng, t * d, 2.0);
            hist.extend(kv_rounded(dtype, &k));
            let q = vals(&mut rng, t * nh * d, 1.0);
            let (kt, qt) = (be.upload(&k, d).unwrap(), be.upload(&q, nh * d).unwrap());
            be.kv_write(&mut kv, pos0, &kt, &kt).expect("kv_write");
            let visible: Vec<Vec<usize>> = (0..t)
                .map(|r| (0..n_ent).filter(|e| (e * 7 + r + pos0) % 3 == 0).collect())
                .collect();
            let y = be
                .attention_sparse(&qt, &kv, pos0, &shape, &et, &visible)
                .expect("attention_sparse");
            let want = refr::attention_sparse(&q, &hist, &hist, pos0, &shape, &entries, &visible);
            let budget = match dtype {
                KvDtype::F16 => F16_KV_REL,
                KvDtype::F32 => EXACT_REL,
            };
            let name = format!("attention_sparse {dtype:?} {t} rows at {pos0}");
            expect(&mut fails, name, &be.read(&y).unwrap(), &want, budget);
            pos0 += t;
        }
    }

    // The indexer: 64 heads of 128 over 1000 keys, top 512; a choice may differ from the f64
    // reference's only between scores within 1e-5 of the cut.
    let (t, nh, d, n) = (3, 64, 128, 1000);
    let q = vals(&mut rng, t * nh * d, 1.0);
    let keys = vals(&mut rng, n * d, 1.0);
    let wts = vals(&mut rng, t * nh, 1.0);
    let visible = [1000usize, 600, 37];
    let (qt, kt, wt) = (
        be.upload(&q, nh * d).unwrap(),
        be.upload(&keys, d).unwrap(),
        be.upload(&wts, nh).unwrap(),
    );
    let got = be
        .index_top_k(&qt, &kt, &wt, nh, &visible, 512)
        .expect("index_top_k");
    let want = refr::index_top_k(&q, &keys, &wts, nh, d, &visible, 512);
    for (row, (g, (w, scores))) in got.iter().zip(&want).enumerate() {
        let cut = w.iter().map(|&e| scores[e]).fold(f64::INFINITY, f64::min);
        let scale = scores.iter().fold(1e-3f64, |m, s| m.max(s.abs()));
        let near = |e: &usize| (scores[*e] - cut).abs() <= 1e-5 * scale;
        let odd = g
            .iter()
            .filter(|e| !w.contains(e))
            .chain(w.iter().filter(|e| !g.contains(e)));
        if g.len() != w.len() || !odd.clone().all(near) {
            fails.push(format!(
                "index_top_k row {row}: {} chosen vs {}, differing {:?}",
                g.len(),
                w.len(),
                odd.collect::<Vec<_>>()
            ));
        }
    }
    assert!(fails.is_empty(), "{}", fails.join("\n"));
}
