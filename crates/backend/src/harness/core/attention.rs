//! Cases of RoPE, KV writes and clones, and causal attention (rings, linear, FP16/FP32, GQA, sinks).

use crate::harness::*;

pub(crate) fn rope_ops<B: Backend>(h: &mut Harness<B>, rng: &mut Rng, w: &TestWeights) {
    let yarn = Yarn {
        factor: 16.0,
        original_max_position_embeddings: 4096.0,
        beta_fast: 32.0,
        beta_slow: 1.0,
        attention_factor: None,
    };
    let ropes = [
        ("neox full", Rope::neox(64, 10000.0)),
        ("neox partial 16 of 64", Rope::neox(16, 1e7)),
        ("proportional 16 of 64", Rope::proportional(64, 16, 1e6)),
        ("interleaved 32 of 64", Rope::interleaved(32, 10000.0)),
        (
            "yarn interleaved",
            Rope::interleaved(64, 10000.0).yarn(&yarn, 10000.0),
        ),
    ];
    for (name, rope) in ropes {
        let (t, cols, pos0) = (4, 4 * 64, 1000 + rng.below(3000));
        let x = rng.vec(t * cols, 1.0);
        let Some(mut xt) = h.up(&x, cols) else { return };
        let r = h.be.rope(&mut xt, &rope, 64, pos0);
        if h.ok("rope", r).is_some() {
            let want = refr::rope(&x, cols, &rope, 64, pos0);
            if let Some(got) = h.read(&xt) {
                // Angles of ~3000 rad are formed in f32 on both sides; sin/cos differ by ulps.
                h.expect_close(&format!("rope {name}"), &got, &want, 2e-6);
            }
        }
    }
    // The per-head norm and the rotation in one op.
    let fused = [
        (
            "neox 32, weight",
            Rope::neox(32, 10000.0),
            32,
            Norm::Weight(&w.w32),
        ),
        (
            "interleaved 16 of 32, 1 + w",
            Rope::interleaved(16, 10000.0),
            32,
            Norm::OnePlusWeight(&w.w32),
        ),
        (
            "neox 16 of 64, no scale",
            Rope::neox(16, 1e7),
            64,
            Norm::NoScale,
        ),
    ];
    for (name, rope, d, norm) in fused {
        let (t, cols, pos0) = (3, 4 * d, 1000 + rng.below(3000));
        let x = rng.vec(t * cols, 2.0);
        let Some(mut xt) = h.up(&x, cols) else { return };
        let r = h.be.rms_norm_rope(&mut xt, norm, 1e-6, &rope, d, pos0);
        if h.ok("rms_norm_rope", r).is_some() {
            let normed = refr::rms_norm(&x, d, norm, h.buf, 1e-6);
            let want = refr::rope(&normed, cols, &rope, d, pos0);
            if let Some(got) = h.read(&xt) {
                h.expect_close(&format!("rms_norm_rope {name}"), &got, &want, 2e-6);
            }
        }
    }
}

/// `x` as the KV cache stores it (`dtype`'s rounding).
pub fn kv_rounded(dtype: KvDtype, x: &[f32]) -> Vec<f32> {
    match dtype {
        KvDtype::F16 => x.iter().map(|&a| half::f16::from_f32(a).to_f32()).collect(),
        KvDtype::F32 => x.to_vec(),
    }
}

pub(crate) fn attention_ops<B: Backend>(h: &mut Harness<B>, rng: &mut Rng) {
    // (dtype, ring rows / window, GQA heads, sinks, chunks); the long ones give one-row steps
    // over more than a hundred positions (a backend may split those over several blocks).
    let short: &[usize] = &[5, 1, 3, 1];
    let long: &[usize] = &[150, 1, 70, 1];
    // A ring of window + 5 rows takes chunks of at most 6 rows (a longer chunk overwrites rows
    // its own first queries still see): 121 positions in chunks of 6.
    let ring_long: &[usize] = &[
        6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 1,
    ];
    let ring_gqa: &[usize] = &[6, 6, 6, 6, 6, 1];
    let linear_gqa: &[usize] = &[40, 1, 30];
    let cases = [
        (KvDtype::F32, None, (4, 2), false, short),
        (KvDtype::F16, None, (4, 1), false, short),
        (KvDtype::F32, Some(5), (2, 2), false, short),
        (KvDtype::F16, Some(4), (6, 2), true, short),
        (KvDtype::F32, None, (3, 3), true, short),
        (KvDtype::F16, None, (4, 2), true, long),
        (KvDtype::F32, Some(100), (2, 1), false, ring_long),
        // Prefill-sized (row, head) counts (a GPU backend's tiled kernel): a ring with 8 query
        // heads per KV head, and a linear cache of 8 heads on one KV head.
        (KvDtype::F32, Some(20), (24, 3), true, ring_gqa),
        (KvDtype::F32, None, (8, 1), false, linear_gqa),
    ];
    for (dtype, window, (nh, nkv), sinks, chunks) in cases {
        let chunks = chunks.to_vec();
        let d = 32;
        let total: usize = chunks.iter().sum();
        let (rows, ring) = match window {
            Some(w) => (w + 5, true),
            None => (total, false),
        };
        let r = h.be.new_kv(rows, ring, nkv, d, dtype);
        let Some(mut kv) = h.ok("new_kv", r) else {
            return;
        };
        let shape = AttnShape {
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: d,
            window,
            scale: 1.0 / (d as f32).sqrt(),
            sinks: sinks.then(|| rng.vec(nh, 2.0)),
        };
        let (mut hk, mut hv) = (Vec::new(), Vec::new());
        let mut pos0 = 0;
        // A copy taken after the second chunk, with the host rows it holds.
        let mut snap = None;
        for (i, t) in chunks.into_iter().enumerate() {
            if i == 2 {
                let r = h.be.kv_clone(&kv);
                snap = h
                    .ok("kv_clone", r)
                    .map(|c| (c, pos0, hk.clone(), hv.clone()));
            }
            let name = format!(
                "attention {dtype:?} window {window:?} heads {nh}/{nkv} sinks {sinks} at {pos0}"
            );
            let rows = (&mut hk, &mut hv);
            if !write_and_attend(h, rng, &mut kv, rows, pos0, t, &shape, dtype, &name) {
                return;
            }
            pos0 += t;
        }
        // The copy still holds the state at its position, untouched by the later writes: a
        // row written there attends over exactly the rows the cache had then.
        if let Some((mut c, p, mut sk, mut sv)) = snap {
            let name = format!("kv_clone {dtype:?} window {window:?} at {p}");
            let rows = (&mut sk, &mut sv);
            write_and_attend(h, rng, &mut c, rows, p, 1, &shape, dtype, &name);
        }
    }
}

/// Writes `t` random K/V rows at `pos0` into `kv` (and their stored values into the host copies
/// `rows`), attends with `t` random queries and compares with the reference over the host rows.
/// `false` when an op failed (recorded).
#[allow(clippy::too_many_arguments)]
pub(crate) fn write_and_attend<B: Backend>(
    h: &mut Harness<B>,
    rng: &mut Rng,
    kv: &mut B::Kv,
    (hk, hv): (&mut Vec<f32>, &mut Vec<f32>),
    pos0: usize,
    t: usize,
    shape: &AttnShape,
    dtype: KvDtype,
    name: &str,
) -> bool {
    let (nh, nkv, d) = (shape.n_heads, shape.n_kv_heads, shape.head_dim);
    let k = rng.vec(t * nkv * d, 2.0);
    let v = rng.vec(t * nkv * d, 1.0);
    let q = rng.vec(t * nh * d, 2.0);
    hk.extend(kv_rounded(dtype, &k));
    hv.extend(kv_rounded(dtype, &v));
    let (Some(kt), Some(vt), Some(qt)) = (h.up(&k, nkv * d), h.up(&v, nkv * d), h.up(&q, nh * d))
    else {
        return false;
    };
    let r = h.be.kv_write(kv, pos0, &kt, &vt);
    if h.ok("kv_write", r).is_none() {
        return false;
    }
    let r = h.be.attention(&qt, kv, pos0, shape);
    if let Some(o) = h.ok("attention", r) {
        let want = refr::attention(&q, hk, hv, pos0, shape);
        let budget = if dtype == KvDtype::F16 {
            F16_KV_REL
        } else {
            EXACT_REL
        };
        if let Some(got) = h.read(&o) {
            h.expect_close(name, &got, &want, budget);
        }
    }
    true
}

/// `rms_norm_rope_kv`: q (4 heads) and k, v (2 heads) of 2 rows after 7 written positions, into
/// a linear FP32 cache and an FP16 ring that wraps: q, k and v against the reference norms and
/// partial RoPE, then attention over the cache against the reference over the host rows.
pub(crate) fn norm_rope_kv<B: Backend>(h: &mut Harness<B>, rng: &mut Rng, w: &TestWeights) {
    let buf = h.buf;
    let (d, nh, nkv, t, prior) = (32, 4, 2, 2, 7);
    let rope = Rope::neox(16, 10000.0);
    let (qn, kn) = (Norm::Weight(&w.w32), Norm::OnePlusWeight(&w.w32));
    for (dtype, window) in [(KvDtype::F32, None), (KvDtype::F16, Some(3))] {
        let name = format!("rms_norm_rope_kv {dtype:?} window {window:?}");
        let rows = window.map_or(prior + t, |w| w + 5);
        let r = h.be.new_kv(rows, window.is_some(), nkv, d, dtype);
        let Some(mut kv) = h.ok("new_kv", r) else {
            return;
        };
        let (pk, pv) = (rng.vec(prior * nkv * d, 2.0), rng.vec(prior * nkv * d, 1.0));
        let (q, k, v) = (
            rng.vec(t * nh * d, 2.0),
            rng.vec(t * nkv * d, 2.0),
            rng.vec(t * nkv * d, 1.5),
        );
        let ups =
            [(&pk, nkv), (&pv, nkv), (&q, nh), (&k, nkv), (&v, nkv)].map(|(x, n)| h.up(x, n * d));
        let [Some(pkt), Some(pvt), Some(mut qt), Some(mut kt), Some(mut vt)] = ups else {
            return;
        };
        let r = h.be.kv_write(&mut kv, 0, &pkt, &pvt);
        if h.ok("kv_write", r).is_none() {
            return;
        }
        let r = h.be.rms_norm_rope_kv(
            &mut qt,
            qn,
            &mut kt,
            kn,
            &mut vt,
            Some(Norm::NoScale),
            1e-6,
            &rope,
            d,
            prior,
            &mut kv,
        );
        if h.ok("rms_norm_rope_kv", r).is_none() {
            continue;
        }
        let want_q = refr::rope(
            &refr::rms_norm(&q, d, qn, buf, 1e-6),
            nh * d,
            &rope,
            d,
            prior,
        );
        let want_k = refr::rope(
            &refr::rms_norm(&k, d, kn, buf, 1e-6),
            nkv * d,
            &rope,
            d,
            prior,
        );
        let want_v = refr::rms_norm(&v, d, Norm::NoScale, buf, 1e-6);
        for (what, tensor, want) in [
            ("q", &qt, &want_q),
            ("k", &kt, &want_k),
            ("v", &vt, &want_v),
        ] {
            if let Some(got) = h.read(tensor) {
                h.expect_close(&format!("{name} {what}"), &got, want, 2e-6);
            }
        }
        let mut hk = kv_rounded(dtype, &pk);
        let mut hv = kv_rounded(dtype, &pv);
        hk.extend(kv_rounded(dtype, &want_k));
        hv.extend(kv_rounded(dtype, &want_v));
        let shape = AttnShape {
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: d,
            window,
            scale: 1.0 / (d as f32).sqrt(),
            sinks: None,
        };
        let qa = rng.vec(t * nh * d, 2.0);
        let Some(qat) = h.up(&qa, nh * d) else { return };
        let r = h.be.attention(&qat, &kv, prior, &shape);
        if let Some(o) = h.ok("attention", r) {
            let want = refr::attention(&qa, &hk, &hv, prior, &shape);
            let budget = if dtype == KvDtype::F16 {
                F16_KV_REL
            } else {
                EXACT_REL
            };
            if let Some(got) = h.read(&o) {
                h.expect_close(&format!("{name} attention"), &got, &want, budget);
            }
        }
    }
}
