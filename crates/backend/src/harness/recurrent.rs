//! Cases of the recurrent ops: states, the causal convolutions, DeltaNet's gates, delta rule and
//! gated norm.

use super::*;

pub(crate) fn recurrent_ops<B: Backend>(h: &mut Harness<B>, rng: &mut Rng) {
    // Causal conv, continued across calls.
    let (c, kernel) = (24, 4);
    let w = rng.vec(c * kernel, 0.5);
    let r = h.be.new_state((kernel - 1) * c);
    let Some(mut st) = h.ok("new_state", r) else {
        return;
    };
    let Some(wt) = h.up(&w, kernel) else { return };
    let mut ref_state = vec![0.0f32; (kernel - 1) * c];
    for t in [5usize, 1, 2] {
        let x = rng.vec(t * c, 1.5);
        let Some(xt) = h.up(&x, c) else { return };
        let r = h.be.conv1d_silu(&xt, &mut st, &wt, kernel);
        let Some(o) = h.ok("conv1d_silu", r) else {
            return;
        };
        let (want, next) = refr::conv1d_silu(&x, &ref_state, &w, c, kernel);
        ref_state = next;
        if let Some(got) = h.read(&o) {
            h.expect_close(&format!("conv1d_silu {t} rows"), &got, &want, EXACT_REL);
        }
    }
    if h.be.state_bytes(&st) != 4 * (kernel - 1) * c {
        h.fail(
            "state_bytes",
            format!("{} for {} floats", h.be.state_bytes(&st), (kernel - 1) * c),
        );
    }
    let r = h.be.zero_state(&mut st);
    if h.ok("zero_state", r).is_some() {
        // After zeroing, one row convolves only itself: the reference from a zero state.
        let x = rng.vec(c, 1.0);
        if let Some(xt) = h.up(&x, c) {
            let r = h.be.conv1d_silu(&xt, &mut st, &wt, kernel);
            if let Some(o) = h.ok("conv1d_silu", r) {
                let (want, _) = refr::conv1d_silu(&x, &vec![0.0; (kernel - 1) * c], &w, c, kernel);
                if let Some(got) = h.read(&o) {
                    h.expect_close("zero_state then conv1d_silu", &got, &want, EXACT_REL);
                }
            }
        }
    }
    // Gates and the delta rule, continued across calls: a small shape (head_k_dim under a
    // warp) and Qwen 3.6 35B-A3B's (16 key heads, 32 value heads, 128 x 128 per head).
    for s in [
        DeltaShape {
            n_k_heads: 2,
            n_v_heads: 4,
            head_k_dim: 16,
            head_v_dim: 8,
        },
        DeltaShape {
            n_k_heads: 16,
            n_v_heads: 32,
            head_k_dim: 128,
            head_v_dim: 128,
        },
    ] {
        delta_rule_case(h, rng, s);
    }
}

/// `delta_gates` then `gated_delta_rule` over calls of 4, 1 and 3 rows of shape `s`, the state
/// carried from call to call, against the reference.
fn delta_rule_case<B: Backend>(h: &mut Harness<B>, rng: &mut Rng, s: DeltaShape) {
    let nv = s.n_v_heads;
    let a = rng
        .vec(nv, 1.0)
        .iter()
        .map(|v| v.abs() + 0.5)
        .collect::<Vec<_>>();
    let dt = rng.vec(nv, 0.5);
    let (Some(at), Some(dtt)) = (h.up(&a, nv), h.up(&dt, nv)) else {
        return;
    };
    let r = h.be.new_state(nv * s.head_v_dim * s.head_k_dim);
    let Some(mut ds) = h.ok("new_state", r) else {
        return;
    };
    let mut ref_ds = vec![0.0f32; nv * s.head_v_dim * s.head_k_dim];
    for t in [4usize, 1, 3] {
        let b = rng.vec(t * nv, 3.0);
        let alpha = rng.vec(t * nv, 3.0);
        let (Some(bt), Some(alt)) = (h.up(&b, nv), h.up(&alpha, nv)) else {
            return;
        };
        let r = h.be.delta_gates(&bt, &alt, &at, &dtt);
        let Some((beta, decay)) = h.ok("delta_gates", r) else {
            return;
        };
        let (want_b, want_d) = refr::delta_gates(&b, &alpha, &a, &dt);
        if let (Some(gb), Some(gd)) = (h.read(&beta), h.read(&decay)) {
            h.expect_close("delta_gates beta", &gb, &want_b, 1e-6);
            h.expect_close("delta_gates decay", &gd, &want_d, 1e-5);
        }
        let kd = s.n_k_heads * s.head_k_dim;
        // q and k L2-normalised per head, as the family feeds them.
        let unit = |rng: &mut Rng| -> Vec<f32> {
            let v = rng.vec(t * kd, 1.0);
            v.chunks_exact(s.head_k_dim)
                .flat_map(|hd| {
                    let n = hd.iter().map(|x| x * x).sum::<f32>().sqrt();
                    hd.iter().map(|x| x / n).collect::<Vec<_>>()
                })
                .collect()
        };
        let (q, k) = (unit(rng), unit(rng));
        let v = rng.vec(t * nv * s.head_v_dim, 1.0);
        let (Some(qt), Some(kt), Some(vt)) =
            (h.up(&q, kd), h.up(&k, kd), h.up(&v, nv * s.head_v_dim))
        else {
            return;
        };
        let r =
            h.be.gated_delta_rule(&qt, &kt, &vt, &decay, &beta, &mut ds, &s);
        let Some(o) = h.ok("gated_delta_rule", r) else {
            return;
        };
        let gd = h.read(&decay).unwrap_or_default();
        let gb = h.read(&beta).unwrap_or_default();
        let (want, next) = refr::gated_delta_rule(&q, &k, &v, &gd, &gb, &ref_ds, &s);
        ref_ds = next;
        if let Some(got) = h.read(&o) {
            h.expect_close(
                &format!("gated_delta_rule {t} rows, {s:?}"),
                &got,
                &want,
                EXACT_REL,
            );
        }
    }
}
