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
        self.combine(op, mlp, act, srcs, weights, x, None, acc)
    }

    /// The body of both combines: `host` = (which experts the host computes, the row they take).
    /// With host experts ([`DeviceExpertOps::glu_mlp_combine_split`]) the device experts' gate
    /// and up are queued first (behind their copies), then the host CPU computes its experts
    /// while those run, their outputs go up in one copy, and `qmv_down_combine` adds every
    /// expert in order, taking a host expert's output where a device one's down product goes.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn combine(
        &self,
        op: &'static str,
        mlp: &Mlp,
        act: Act,
        srcs: &[Weights],
        weights: &[f32],
        x: &CudaTensor,
        host: Option<(&[bool], &[f32])>,
        acc: &mut CudaTensor,
    ) -> OpResult<()> {
        let k = srcs.len();
        if k == 0 {
            return Ok(());
        }
        check(op, k <= DC_MAX_K, || {
            format!("{k} experts in one row (at most {DC_MAX_K})")
        })?;
        let on_host = |j: usize| host.is_some_and(|(h, _)| h[j]);
        let dev_srcs: Vec<Weights> = (0..k).filter(|&j| !on_host(j)).map(|j| srcs[j]).collect();
        let src = self.sources(op, &dev_srcs)?;
        let at = &src.at;
        let inner = mlp.gate_proj.rows;
        // At least one row: a host expert's down job points its (unread) x at row 0.
        let mut g = self.uninit_tensor(op, at.len().max(1), inner)?;
        let u = self.uninit_tensor(op, at.len().max(1), inner)?;
        let (xa, ga, ua) = (self.addr(&*x.buf), self.addr(&*g.buf), self.addr(&*u.buf));
        let row = |base: u64, r: usize| base + (4 * r * inner) as u64;
        let job = |w, (buf, len): (u64, usize), x, y| QJob { w, buf, len, x, y };
        if !at.is_empty() {
            let mut gate_up = Vec::with_capacity(2 * at.len());
            for (j, &a) in at.iter().enumerate() {
                gate_up.push(job(&mlp.gate_proj, a, xa, row(ga, j)));
                gate_up.push(job(&mlp.up_proj, a, xa, row(ua, j)));
            }
            self.gated(op, act, &gate_up, 1, &mut g, &u)?;
        }
        let down: Vec<QJob> = at
            .iter()
            .enumerate()
            .map(|(j, &a)| job(&mlp.down_proj, a, row(ga, j), 0))
            .collect();
        let dev = qjobs(op, down.iter())?;
        // The host's experts, computed while the device ones run, then uploaded in one copy.
        let host_out = match host {
            Some((flags, x_host)) => {
                let blobs: Vec<Weights> = (0..k).filter(|&j| flags[j]).map(|j| srcs[j]).collect();
                match self.host_experts(op, mlp, act, &blobs, x_host) {
                    Ok(out) => Some(out),
                    Err(e) => {
                        // The held slots are given back (their reads recorded) before the error.
                        self.after_reads(op, src)?;
                        return Err(e);
                    }
                }
            }
            None => None,
        };
        let mut a = dev;
        if let Some(out) = &host_out {
            // Job order is expert order: device jobs keep theirs, host ones (w = 0) read their
            // output row (y) instead of a down product.
            let oa = self.addr(&*out.buf);
            let (mut d, mut h) = (0, 0);
            a = QJobs::default();
            for j in 0..k {
                if on_host(j) {
                    (a.w[j], a.s[j], a.b[j], a.x[j]) = (0, 0, 0, ga);
                    a.y[j] = oa + (4 * h * out.cols) as u64;
                    h += 1;
                } else {
                    (a.w[j], a.s[j], a.b[j]) = (dev.w[d], dev.s[d], dev.b[d]);
                    (a.x[j], a.y[j]) = (dev.x[d], dev.y[d]);
                    d += 1;
                }
            }
        }
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
        drop(host_out);
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
