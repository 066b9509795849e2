//! Cases of the router's readback (every scoring but DeepSeek-V4's, per-expert scale, forced ids).

use crate::harness::*;

/// A router's readback against the reference's per-row `(expert, weight)` pairs (ids exactly,
/// weights within 1e-6).
pub(crate) fn check_routes<B: Backend>(
    h: &mut Harness<B>,
    name: &str,
    routes: &crate::Routes,
    want: &[Vec<(usize, f32)>],
) {
    let mut got: Vec<Vec<(usize, f32)>> = vec![Vec::new(); want.len()];
    for (&e, rows) in &routes.experts {
        for &(row, wt) in rows {
            got[row].push((e, wt));
        }
    }
    for (row, (g, wnt)) in got.iter().zip(want).enumerate() {
        let ids_g: Vec<usize> = g.iter().map(|p| p.0).collect();
        let ids_w: Vec<usize> = wnt.iter().map(|p| p.0).collect();
        if ids_g != ids_w {
            h.fail(
                name,
                format!("row {row}: experts {ids_g:?}, reference {ids_w:?}"),
            );
            continue;
        }
        let gw: Vec<f32> = g.iter().map(|p| p.1).collect();
        let ww: Vec<f32> = wnt.iter().map(|p| p.1).collect();
        h.expect_close(name, &gw, &ww, 1e-6);
    }
}

pub(crate) fn router_ops<B: Backend>(h: &mut Harness<B>, rng: &mut Rng, w: &TestWeights) {
    let buf = h.buf;
    let n_exp = 16;
    let t = 6;
    let logits = rng.vec(t * n_exp, 4.0);
    let Some(lt) = h.up(&logits, n_exp) else {
        return;
    };
    let specs = [
        (Scoring::SoftmaxOfTopK, Some(&w.pes), 4),
        (
            Scoring::TopKOfSoftmax {
                norm_topk_prob: true,
            },
            None,
            8,
        ),
        (
            Scoring::TopKOfSoftmax {
                norm_topk_prob: false,
            },
            None,
            2,
        ),
    ];
    // A replayed trace: distinct ids per row, not the top-k.
    let forced: Vec<usize> = (0..t)
        .flat_map(|r| [(3 * r) % n_exp, (3 * r + 5) % n_exp, 15 - r])
        .collect();
    let specs = specs.into_iter().map(|(s, p, k)| (s, p, k, None)).chain([
        (Scoring::SoftmaxOfTopK, Some(&w.pes), 3, Some(&forced[..])),
        (
            Scoring::TopKOfSoftmax {
                norm_topk_prob: true,
            },
            None,
            3,
            Some(&forced[..]),
        ),
    ]);
    for (scoring, pes, k, forced) in specs {
        let spec = RouterSpec {
            scoring,
            top_k: k,
            per_expert_scale: pes,
            trace: true,
            forced,
        };
        let r = h.be.route(&lt, &spec);
        let Some(routes) = h.ok("route", r) else {
            continue;
        };
        let name = format!("route {scoring:?} top-{k} forced {}", forced.is_some());
        check_routes(h, &name, &routes, &refr::route(&logits, n_exp, &spec, buf));
        // Margins: the k-th minus the (k+1)-th largest raw logit.
        let want_m: Vec<f32> = logits
            .chunks_exact(n_exp)
            .map(|r| {
                let mut v = r.to_vec();
                v.sort_by(|a, b| b.total_cmp(a));
                v[k - 1] - v[k]
            })
            .collect();
        if routes.margins != want_m {
            h.fail(
                &name,
                format!("margins {:?}, want {want_m:?}", routes.margins),
            );
        }
        // Each row alone, untraced (a decode step; a GPU may run it on another kernel): the
        // same ids and weight bits as in the batch.
        for row in 0..t {
            let one = &logits[row * n_exp..(row + 1) * n_exp];
            let Some(ot) = h.up(one, n_exp) else { return };
            let spec = RouterSpec {
                trace: false,
                forced: forced.map(|f| &f[row * k..(row + 1) * k]),
                ..spec
            };
            let r = h.be.route(&ot, &spec);
            let Some(alone) = h.ok("route", r) else {
                continue;
            };
            let mut want: Vec<(usize, u32)> = routes
                .experts
                .iter()
                .flat_map(|(&e, rs)| {
                    rs.iter()
                        .filter(|p| p.0 == row)
                        .map(move |p| (e, p.1.to_bits()))
                })
                .collect();
            want.sort_unstable();
            let got: Vec<(usize, u32)> = alone
                .experts
                .iter()
                .flat_map(|(&e, rs)| rs.iter().map(move |p| (e, p.1.to_bits())))
                .collect();
            if got != want || alone.experts.values().any(|rs| rs.iter().any(|p| p.0 != 0)) {
                h.fail(
                    &name,
                    format!("row {row} alone: {got:?}, in the batch {want:?}"),
                );
            }
        }
    }
}
