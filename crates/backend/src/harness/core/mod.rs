//! The core ops' cases: data in and out here, then products, norms, attention and the router.

mod attention;
mod norms;
mod products;
mod router;

pub use attention::kv_rounded;
pub(crate) use attention::{attention_ops, norm_rope_kv, rope_ops};
pub(crate) use norms::{norms_and_elementwise, two_into_residual};
pub(crate) use products::products;
pub(crate) use router::{check_routes, router_ops};

use super::*;

pub(crate) fn data_ops<B: Backend>(h: &mut Harness<B>, rng: &mut Rng) {
    let d = rng.vec(5 * 12, 1.0);
    let Some(x) = h.up(&d, 12) else { return };
    if (x.rows(), x.cols()) != (5, 12) {
        h.fail("upload", format!("shape [{}, {}]", x.rows(), x.cols()));
    }
    if let Some(back) = h.read(&x) {
        if back != d {
            h.fail("read", "upload then read changed values".into());
        }
    }
    let r = h.be.zeros(3, 7);
    if let Some(z) = h.ok("zeros", r) {
        if h.read(&z) != Some(vec![0.0; 21]) {
            h.fail("zeros", "not 21 zeros".into());
        }
    }
    let r = h.be.all_finite(&x);
    if h.ok("all_finite", r) != Some(true) {
        h.fail("all_finite", "finite values reported non-finite".into());
    }
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut e = d.clone();
        let at = rng.below(e.len());
        e[at] = bad;
        if let Some(et) = h.up(&e, 12) {
            let r = h.be.all_finite(&et);
            if h.ok("all_finite", r) != Some(false) {
                h.fail("all_finite", format!("missed {bad}"));
            }
        }
    }
    let r = h.be.copy(&x);
    if let Some(c) = h.ok("copy", r) {
        if h.read(&c).as_deref() != Some(&d[..]) {
            h.fail("copy", "copy differs".into());
        }
    }
    // Several tensors of different shapes read back in one call: each one's `read`.
    let parts: Vec<Vec<f32>> = vec![d[..12].to_vec(), d[12..15].to_vec(), d[..36].to_vec()];
    let ups: Vec<_> = [(12, &parts[0]), (1, &parts[1]), (12, &parts[2])]
        .into_iter()
        .filter_map(|(cols, p)| h.up(p, cols))
        .collect();
    if ups.len() == parts.len() {
        let r = h.be.read_many(&ups.iter().collect::<Vec<_>>());
        if let Some(got) = h.ok("read_many", r) {
            if got != parts {
                h.fail("read_many", "a tensor read back differs".into());
            }
        }
    }
    let rows = [4usize, 0, 4, 2];
    let r = h.be.gather_rows(&x, &rows);
    if let Some(g) = h.ok("gather_rows", r) {
        let want: Vec<f32> = rows
            .iter()
            .flat_map(|&r| d[r * 12..(r + 1) * 12].to_vec())
            .collect();
        if h.read(&g) != Some(want) {
            h.fail("gather_rows", "rows differ".into());
        }
    }
    // Several lists in one call (an empty one among them): each list's gather_rows.
    let lists: [&[usize]; 3] = [&[4, 0], &[], &[2, 4, 1]];
    let r = h.be.gather_rows_many(&x, &lists);
    if let Some(gs) = h.ok("gather_rows_many", r) {
        for (j, (g, rows)) in gs.iter().zip(lists).enumerate() {
            let want: Vec<f32> = rows
                .iter()
                .flat_map(|&r| d[r * 12..(r + 1) * 12].to_vec())
                .collect();
            if g.rows() != rows.len() || h.read(g) != Some(want) {
                h.fail("gather_rows_many", format!("list {j} differs"));
            }
        }
    }
    // Rows of 12 = 2 groups of 6 = [2 | 1 | 3].
    let r = h.be.split(&x, 6, &[2, 1, 3]);
    if let Some(parts) = h.ok("split", r) {
        for (j, (p, (o, n))) in parts.iter().zip([(0, 2), (2, 1), (3, 3)]).enumerate() {
            let want: Vec<f32> = d
                .chunks_exact(6)
                .flat_map(|g| g[o..o + n].to_vec())
                .collect();
            if h.read(p) != Some(want) || p.cols() != 2 * n {
                h.fail("split", format!("part {j} differs"));
            }
        }
    }
}
