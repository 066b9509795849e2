//! The router: top-k and weights on the device, only ids and weights read back (kernels: router.cu).

use crate::*;

impl CudaBackend {
    pub(crate) fn route(&self, logits: &CudaTensor, spec: &RouterSpec) -> OpResult<Routes> {
        Ok(self.route_reading("route", logits, spec, None)?.0)
    }

    /// [`CudaBackend::route`], and with `row` its values too, in the same readback (after the
    /// routing's words): a decode step that computes some experts on the host needs both.
    pub(crate) fn route_reading(
        &self,
        op: &'static str,
        logits: &CudaTensor,
        spec: &RouterSpec,
        row: Option<&CudaTensor>,
    ) -> OpResult<(Routes, Vec<f32>)> {
        let (t, n_exp, k) = (logits.rows, logits.cols, spec.top_k);
        self.route_args(op, spec, t, n_exp)?;
        // One readback: ids, then weight bits, then margin bits, then the row's bits.
        let extra = row.map_or(0, |r| r.len());
        let out = self
            .stream
            .alloc_zeros::<u32>(2 * t * k + t.max(1) + extra)
            .map_err(|e| self.dev(op, e))?;
        let base = self.addr(&out);
        let (ids_at, wts_at, margins_at) =
            (base, base + (4 * t * k) as u64, base + (8 * t * k) as u64);
        if t == 1 && !spec.trace && n_exp <= ROUTE_ONE_MAX_N {
            // One decode row: the warp kernel of the device-routed path (the same bits as
            // `route`'s one thread per row, faster), forced ids by value.
            self.route_one(op, logits, spec, ids_at, wts_at)?;
        } else {
            self.route_rows(op, logits, spec, base, ids_at, wts_at, margins_at)?;
        }
        if let Some(r) = row {
            let at = base + (4 * (2 * t * k + t.max(1))) as u64;
            // SAFETY: `extra` words at `at` lie in `out`; the copy reads `r` whole and is
            // ordered on the stream after the kernels that wrote it.
            unsafe {
                cudarc::driver::result::memcpy_dtod_async(
                    at,
                    self.addr(&*r.buf),
                    4 * extra,
                    self.stream.cu_stream(),
                )
            }
            .map_err(|e| self.dev(op, e))?;
        }
        let back = self.to_host(op, &out)?;
        let (routing, row_bits) = back.split_at(2 * t * k + t.max(1));
        let (ids, rest) = routing.split_at(t * k);
        let (wts, margins) = rest.split_at(t * k);
        let wts: Vec<f32> = wts.iter().map(|&b| f32::from_bits(b)).collect();
        let mut experts: BTreeMap<usize, Vec<(usize, f32)>> = BTreeMap::new();
        for (row, (ri, rw)) in ids.chunks_exact(k).zip(wts.chunks_exact(k)).enumerate() {
            for (&e, &w) in ri.iter().zip(rw) {
                experts.entry(e as usize).or_default().push((row, w));
            }
        }
        let margins = if spec.trace {
            margins.iter().map(|&b| f32::from_bits(b)).collect()
        } else {
            Vec::new()
        };
        let row = row_bits.iter().map(|&b| f32::from_bits(b)).collect();
        Ok((Routes { experts, margins }, row))
    }

    /// The routing of `logits`' rows: ids, weight bits and margin bits at the device addresses
    /// `ids_at`, `wts_at`, `margins_at` (margins only with `spec.trace`); `route_warps` (a warp
    /// per row) without a trace, else `route` (a thread per row, margins too). `scratch` is a
    /// device address the kernels never read when no ids are forced.
    #[allow(clippy::too_many_arguments)]
    fn route_rows(
        &self,
        op: &'static str,
        logits: &CudaTensor,
        spec: &RouterSpec,
        scratch: u64,
        ids_at: u64,
        wts_at: u64,
        margins_at: u64,
    ) -> OpResult<()> {
        let (t, n_exp, k) = (logits.rows, logits.cols, spec.top_k);
        let sc = self.route_args(op, spec, t, n_exp)?;
        let forced = match spec.forced {
            Some(f) => {
                let v: Vec<u32> = f.iter().map(|&e| e as u32).collect();
                Some(self.to_device(op, &v)?)
            }
            None => None,
        };
        // Without forced ids the kernel never reads the pointer.
        let forced_at = forced.as_ref().map_or(scratch, |f| self.addr(f));
        let has_forced = spec.forced.is_some() as i32;
        let (ti, ni, ki) = (t as i32, n_exp as i32, k as i32);
        if !spec.trace && n_exp <= ROUTE_ONE_MAX_N {
            // A warp per row (route_row's bits), for every row of a prefill chunk.
            return launch!(
                self,
                op,
                "route_warps",
                blocks(t, 32),
                &*logits.buf,
                &ti,
                &ni,
                &ki,
                &sc,
                &self.resident,
                &forced_at,
                &has_forced,
                &ids_at,
                &wts_at
            );
        }
        let trace = spec.trace as i32;
        launch!(
            self,
            op,
            "route",
            LaunchConfig {
                grid_dim: (t.div_ceil(128) as u32, 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            },
            &*logits.buf,
            &ti,
            &ni,
            &ki,
            &sc,
            &self.resident,
            &trace,
            &forced_at,
            &has_forced,
            &ids_at,
            &wts_at,
            &margins_at
        )
    }

    /// The `route_one` kernel (one warp) over the one row of `logits`: ids and weight bits at
    /// the device addresses `ids`, `wts` (forced ids passed by value).
    pub(crate) fn route_one(
        &self,
        op: &'static str,
        logits: &CudaTensor,
        spec: &RouterSpec,
        ids: u64,
        wts: u64,
    ) -> OpResult<()> {
        let (n_exp, k) = (logits.cols, spec.top_k);
        let sc = self.route_args(op, spec, 1, n_exp)?;
        check(op, n_exp <= ROUTE_ONE_MAX_N, || {
            format!("{n_exp} experts (the device-routed decode holds at most {ROUTE_ONE_MAX_N})")
        })?;
        let mut forced = ForcedIds {
            ids: [0; ROUTE_MAX_K],
        };
        if let Some(f) = spec.forced {
            for (d, &e) in forced.ids.iter_mut().zip(f) {
                *d = e as u32;
            }
        }
        let has_forced = spec.forced.is_some() as i32;
        let (ni, ki) = (n_exp as i32, k as i32);
        launch!(
            self,
            op,
            "route_one",
            blocks(1, 32),
            &*logits.buf,
            &ni,
            &ki,
            &sc,
            &self.resident,
            &forced,
            &has_forced,
            &ids,
            &wts
        )
    }

    /// The `route` / `route_one` kernels' scoring (`RouteScoring`) for `spec` over `n_exp`
    /// experts, after checking top-k, the forced ids of `rows` rows and the resident offsets of
    /// the per-expert scale and the correction bias.
    pub(crate) fn route_args(
        &self,
        op: &'static str,
        spec: &RouterSpec,
        rows: usize,
        n_exp: usize,
    ) -> OpResult<RouteScoring> {
        let k = spec.top_k;
        check(op, k > 0 && k <= n_exp && k <= ROUTE_MAX_K, || {
            format!("top-{k} of {n_exp} experts (at most {ROUTE_MAX_K})")
        })?;
        let pes = match spec.per_expert_scale {
            Some(p) => Some(self.vref(op, p, n_exp)?),
            None => None,
        };
        check_forced(op, spec, rows, n_exp)?;
        let mut sc = RouteScoring {
            pes_off: pes.unwrap_or(0),
            has_pes: pes.is_some() as i32,
            ..RouteScoring::default()
        };
        match spec.scoring {
            Scoring::SoftmaxOfTopK => {}
            Scoring::TopKOfSoftmax { norm_topk_prob } => {
                sc.scoring = 1;
                sc.norm = norm_topk_prob as i32;
            }
            Scoring::SqrtSoftplus {
                routed_scaling_factor,
                correction_bias,
            } => {
                sc.scoring = 2;
                sc.rsf = routed_scaling_factor;
                if let Some(b) = correction_bias {
                    let off = b.offset();
                    check(
                        op,
                        b.len == n_exp
                            && off.is_multiple_of(2)
                            && off + 4 * n_exp <= self.resident.len(),
                        || {
                            format!(
                                "a correction bias of {} values at byte {off} for {n_exp} experts \
                                 (2-byte aligned, inside the {} resident bytes)",
                                b.len,
                                self.resident.len()
                            )
                        },
                    )?;
                    sc.has_bias = 1;
                    sc.bias_off = off as u64;
                }
            }
        }
        Ok(sc)
    }
}

/// How the router kernels score a row's experts (`struct RouteScoring` in ops/router.cu):
/// scoring 0 (softmax of the top-k logits), 1 (top-k of the softmax, renormalised when `norm`),
/// 2 (sqrt-softplus, top-k of the score plus the f32 correction bias at `bias_off` when
/// `has_bias`, weights renormalised times `rsf`); the BF16 per-expert scale at `pes_off` when
/// `has_pes`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct RouteScoring {
    scoring: i32,
    norm: i32,
    has_pes: i32,
    has_bias: i32,
    pes_off: u64,
    bias_off: u64,
    rsf: f32,
}

// SAFETY: a plain `repr(C)` struct of ints and a float, laid out as `struct RouteScoring` in
// ops/router.cu.
unsafe impl Scalar for RouteScoring {}
