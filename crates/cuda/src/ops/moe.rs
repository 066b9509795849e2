//! A decode row's routed experts in two launches: gate and up with the GLU over every expert
//! (`qmv_glu`, or `qmv_glu_ids` from device-side ids), then the down products with the weighted
//! combine into the accumulator (`qmv_down_combine`, kernels: moe.cu).

use crate::*;

/// Most experts of one `qmv_down_combine` launch (`DC_MAX_K` in ops/moe.cu).
pub(crate) const DC_MAX_K: usize = QM_JOBS / 2;

/// The `DcWeights` argument of `qmv_down_combine`: each expert's combine weight, in job order.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct DcWeights {
    pub(crate) w: [f32; DC_MAX_K],
}

// SAFETY: a plain `repr(C)` f32 array, laid out as `struct DcWeights` in ops/moe.cu.
unsafe impl Scalar for DcWeights {}

/// The grid of a down-combine launch of down matrix `w` over `k` experts (ops/moe.cu: a block
/// covers `P · DC_R` rows of every expert, [`compile::dc_rows`]) and its `int` arguments k, rows, cols, group, lanes.
fn dc_launch(w: &QRef, k: usize) -> (LaunchConfig, [i32; 5]) {
    let lanes = qmv_lanes(w.cols, w.bits as usize);
    let groups = QV_WARPS * 32 / lanes;
    let per_block = (groups / k).max(1) * compile::dc_rows(w.bits as usize);
    let cfg = LaunchConfig {
        grid_dim: (w.rows.div_ceil(per_block) as u32, 1, 1),
        block_dim: (32 * QV_WARPS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let ints = [k, w.rows, w.cols, w.group_size, lanes].map(|v| v as i32);
    (cfg, ints)
}

impl CudaBackend {
    pub(crate) fn glu_mlp_combine(
        &self,
        mlp: &Mlp,
        act: Act,
        srcs: &[Weights],
        weights: &[f32],
        x: &CudaTensor,
        acc: &mut CudaTensor,
    ) -> OpResult<()> {
        let op = "glu_mlp_combine";
        check_glu_combine(op, mlp, srcs.len(), weights.len(), x, acc)?;
        let k = srcs.len();
        if k == 0 {
            return Ok(());
        }
        check(op, k <= DC_MAX_K, || {
            format!("{k} experts in one row (at most {DC_MAX_K})")
        })?;
        let src = self.sources(op, srcs)?;
        let at = &src.at;
        let inner = mlp.gate_proj.rows;
        let mut g = self.uninit_tensor(op, k, inner)?;
        let u = self.uninit_tensor(op, k, inner)?;
        let (xa, ga, ua) = (self.addr(&*x.buf), self.addr(&*g.buf), self.addr(&*u.buf));
        let row = |base: u64, r: usize| base + (4 * r * inner) as u64;
        let job = |w, (buf, len): (u64, usize), x, y| QJob { w, buf, len, x, y };
        let mut gate_up = Vec::with_capacity(2 * k);
        for (j, &a) in at.iter().enumerate() {
            gate_up.push(job(&mlp.gate_proj, a, xa, row(ga, j)));
            gate_up.push(job(&mlp.up_proj, a, xa, row(ua, j)));
        }
        self.gated(op, act, &gate_up, 1, &mut g, &u)?;
        let down: Vec<QJob> = at
            .iter()
            .enumerate()
            .map(|(j, &a)| job(&mlp.down_proj, a, row(ga, j), 0))
            .collect();
        let a = qjobs(op, down.iter())?;
        let mut cw = DcWeights { w: [0.0; DC_MAX_K] };
        cw.w[..k].copy_from_slice(weights);
        let w = &mlp.down_proj;
        check_qshape(op, w)?;
        let (cfg, [ki, ri, ci, gi, li]) = dc_launch(w, k);
        launch!(
            self,
            op,
            [
                "qmv_down_combine2",
                "qmv_down_combine4",
                "qmv_down_combine8"
            ][w.bits as usize / 4],
            cfg,
            &a,
            &cw,
            &ki,
            &mut *acc.buf,
            &ri,
            &ci,
            &gi,
            &li
        )?;
        self.after_reads(op, src)
    }

    /// The down products of the `k` experts whose ids are at device address `ids` (their blobs
    /// at the addresses by id at `slots`, `stride` bytes each), row `j` of `g` (`[k, inner]`)
    /// times expert `ids[j]`'s down matrix, added into `acc` times the weights at `wts`, in
    /// ascending id: one `qmv_down_combine_ids` launch.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn down_combine_by_id(
        &self,
        op: &'static str,
        down: &QRef,
        g: &CudaTensor,
        slots: u64,
        ids: u64,
        wts: u64,
        stride: usize,
        acc: &mut CudaTensor,
    ) -> OpResult<()> {
        let k = g.rows;
        check(
            op,
            (1..=DC_MAX_K).contains(&k) && g.cols == down.cols,
            || {
                format!(
                    "{k} experts (1 to {DC_MAX_K}) of [{}, {}] rows",
                    g.rows, g.cols
                )
            },
        )?;
        check_qshape(op, down)?;
        let mut a = QIdJobs::default();
        [a.w_off[0], a.s_off[0], a.b_off[0]] = qref_offsets(op, down, stride)?;
        let ga = self.addr(&*g.buf);
        for j in 0..k {
            a.x[j] = ga + (4 * j * down.cols) as u64;
            a.pick[j] = j as i32;
        }
        let (cfg, [ki, ri, ci, gi, li]) = dc_launch(down, k);
        launch!(
            self,
            op,
            [
                "qmv_down_combine_ids2",
                "qmv_down_combine_ids4",
                "qmv_down_combine_ids8"
            ][down.bits as usize / 4],
            cfg,
            &a,
            &slots,
            &ids,
            &wts,
            &ki,
            &mut *acc.buf,
            &ri,
            &ci,
            &gi,
            &li
        )
    }
}
