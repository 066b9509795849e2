//! Cases of Inkling's ops.

use super::*;

/// Inkling's ops: the f32 `linear`, the plain causal `conv1d` continued across calls,
/// `attention_rel` (extent shorter and longer than what a query sees, sliding ring and linear
/// layers, FP16/FP32 KV, GQA, the log position scale active from position 3) and `route_sinks`.
pub(crate) fn inkling_ops<B: Backend>(h: &mut Harness<B>, rng: &mut Rng) {
    // linear
    let (t, cols, rows) = (5, 40, 7);
    let x = rng.vec(t * cols, 1.5);
    let w = rng.vec(rows * cols, 0.5);
    if let (Some(xt), Some(wt)) = (h.up(&x, cols), h.up(&w, cols)) {
        let r = h.be.linear(&xt, &wt);
        if let Some(got) = h.ok("linear", r).and_then(|y| h.read(&y)) {
            let want = refr::linear(&x, &w, cols);
            h.expect_close("linear", &got, &want, EXACT_REL);
        }
    }
    // conv1d, continued across calls
    let (c, kernel) = (20, 4);
    let w = rng.vec(c * kernel, 0.5);
    let r = h.be.new_state((kernel - 1) * c);
    let (Some(mut st), Some(wt)) = (h.ok("new_state", r), h.up(&w, kernel)) else {
        return;
    };
    let mut ref_state = vec![0.0f32; (kernel - 1) * c];
    for t in [4usize, 1, 3] {
        let x = rng.vec(t * c, 1.5);
        let Some(xt) = h.up(&x, c) else { return };
        let r = h.be.conv1d(&xt, &mut st, &wt, kernel);
        let Some(o) = h.ok("conv1d", r) else { return };
        let (want, next) = refr::conv1d(&x, &ref_state, &w, c, kernel);
        ref_state = next;
        if let Some(got) = h.read(&o) {
            h.expect_close(&format!("conv1d {t} rows"), &got, &want, EXACT_REL);
        }
    }
    // attention_rel: (dtype, window, extent, heads, head_dim, d_rel, log scaling, chunks). The
    // 48-row chunks give 192 (row, head) items: a GPU's prefill (tiled) kernel, not decode's.
    let log = Some(LogScaling {
        n_floor: 3.0,
        alpha: 0.3,
    });
    let (short, long): (&[usize], &[usize]) = (&[5, 1, 3, 1], &[48, 1, 2, 48]);
    let cases = [
        (KvDtype::F32, None, 6, (4, 2), 16, 5, log, short),
        (KvDtype::F32, Some(5), 3, (2, 1), 16, 5, None, short),
        (KvDtype::F16, Some(4), 4, (4, 2), 16, 5, None, short),
        (KvDtype::F16, None, 20, (3, 3), 16, 5, log, short),
        (KvDtype::F32, None, 40, (4, 2), 64, 16, log, long),
        (KvDtype::F16, Some(32), 32, (4, 1), 128, 16, None, long),
    ];
    for (dtype, window, extent, (nh, nkv), d, d_rel, log_scaling, chunks) in cases {
        let (kv_rows, ring) = match window {
            Some(w) => (w + chunks.iter().max().unwrap_or(&1), true),
            None => (chunks.iter().sum(), false),
        };
        let r = h.be.new_kv(kv_rows, ring, nkv, d, dtype);
        let Some(mut kv) = h.ok("new_kv", r) else {
            return;
        };
        let shape = AttnShape {
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: d,
            window,
            scale: 1.0 / d as f32,
            sinks: None,
        };
        let proj = rng.vec(d_rel * extent, 1.0);
        let Some(pt) = h.up(&proj, extent) else {
            return;
        };
        let (mut hk, mut hv) = (Vec::new(), Vec::new());
        let mut pos0 = 0;
        for &t in chunks {
            let k = rng.vec(t * nkv * d, 2.0);
            let v = rng.vec(t * nkv * d, 1.0);
            let q = rng.vec(t * nh * d, 2.0);
            let rel = rng.vec(t * nh * d_rel, 1.0);
            hk.extend(kv_rounded(dtype, &k));
            hv.extend(kv_rounded(dtype, &v));
            let (Some(kt), Some(vt), Some(qt), Some(rt)) = (
                h.up(&k, nkv * d),
                h.up(&v, nkv * d),
                h.up(&q, nh * d),
                h.up(&rel, nh * d_rel),
            ) else {
                return;
            };
            let r = h.be.kv_write(&mut kv, pos0, &kt, &vt);
            if h.ok("kv_write", r).is_none() {
                return;
            }
            let bias = RelBias {
                rel: &rt,
                proj: &pt,
                log_scaling,
            };
            let r = h.be.attention_rel(&qt, &kv, pos0, &shape, &bias);
            if let Some(got) = h.ok("attention_rel", r).and_then(|o| h.read(&o)) {
                let want = refr::attention_rel(
                    &q,
                    &hk,
                    &hv,
                    pos0,
                    &shape,
                    &rel,
                    &proj,
                    d_rel,
                    log_scaling,
                );
                let budget = if dtype == KvDtype::F16 {
                    F16_KV_REL
                } else {
                    EXACT_REL
                };
                let name = format!(
                    "attention_rel {dtype:?} window {window:?} extent {extent} heads {nh}/{nkv} \
                     log {} at {pos0}",
                    log_scaling.is_some()
                );
                h.expect_close(&name, &got, &want, budget);
            }
            pos0 += t;
        }
    }
    // route_sinks: 12 routed + 2 shared, plain and forced.
    let (n_routed, n_shared, t) = (12, 2, 5);
    let n_all = n_routed + n_shared;
    let logits = rng.vec(t * n_all, 4.0);
    let bias = rng.vec(n_routed, 0.3);
    let forced: Vec<usize> = (0..t).flat_map(|r| [r % n_routed, 11 - r, 6]).collect();
    let (Some(lt), Some(bt)) = (h.up(&logits, n_all), h.up(&bias, n_routed)) else {
        return;
    };
    let router = SinkRouter {
        bias: &bt,
        n_shared,
        scale: 2.5,
    };
    for (k, forced) in [(6, None), (3, Some(&forced[..]))] {
        let spec = RouterSpec {
            scoring: Scoring::SoftmaxOfTopK,
            top_k: k,
            per_expert_scale: None,
            trace: true,
            forced,
        };
        let r = h.be.route_sinks(&lt, &router, &spec);
        let Some(routes) = h.ok("route_sinks", r) else {
            continue;
        };
        let want = refr::route_sinks(&logits, n_all, &bias, router.scale, &spec);
        let name = format!("route_sinks top-{k} forced {}", forced.is_some());
        check_routes(h, &name, &routes, &want);
        // Margins: the k-th minus the (k+1)-th largest selection score.
        let want_m: Vec<f32> = logits
            .chunks_exact(n_all)
            .map(|r| {
                let mut v: Vec<f32> = r[..n_routed]
                    .iter()
                    .zip(&bias)
                    .map(|(&l, &b)| 1.0 / (1.0 + (-l).exp()) + b)
                    .collect();
                v.sort_by(|a, b| b.total_cmp(a));
                v[k - 1] - v[k]
            })
            .collect();
        let close = routes.margins.len() == want_m.len()
            && routes
                .margins
                .iter()
                .zip(&want_m)
                .all(|(a, b)| (a - b).abs() <= 1e-6);
        if !close {
            h.fail(
                &name,
                format!("margins {:?}, want {want_m:?}", routes.margins),
            );
        }
    }
}
