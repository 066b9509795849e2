//! The expert-cache hooks of the MoE step, over the GPU slots of `experts.rs`.

use crate::*;

impl DeviceExpertOps for CudaBackend {
    fn held_experts(&self, layer: usize, experts: &[usize]) -> OpResult<Vec<bool>> {
        match self.cache() {
            Some(mut c) => c
                .held(&self.stream, layer, experts)
                .map_err(|e| self.cache_err("held_experts", e)),
            None => Ok(vec![false; experts.len()]),
        }
    }

    fn load_expert<'a>(
        &self,
        layer: usize,
        expert: usize,
        blob: &'a [u8],
    ) -> OpResult<Weights<'a>> {
        match self.cache() {
            Some(mut c) => {
                c.load(layer, expert, blob)
                    .map_err(|e| self.cache_err("load_expert", e))?;
                Ok(Weights::Held { layer, expert })
            }
            None => Ok(Weights::Blob(blob)),
        }
    }

    fn prefetch_expert(&self, layer: usize, expert: usize, blob: &[u8]) -> OpResult<bool> {
        match self.cache() {
            Some(mut c) => c
                .prefetch(&self.stream, layer, expert, blob)
                .map_err(|e| self.cache_err("prefetch_expert", e)),
            None => Ok(false),
        }
    }

    fn expert_copies_done(&self) -> OpResult<()> {
        match self.cache() {
            Some(mut c) => c
                .copies_done()
                .map_err(|e| self.cache_err("expert_copies_done", e)),
            None => Ok(()),
        }
    }

    fn attach_host_slots(&self, layer: usize, slots: &[u8]) -> OpResult<()> {
        match self.cache() {
            Some(mut c) => c
                .pin_host(layer, slots)
                .map_err(|e| self.cache_err("attach_host_slots", e)),
            None => Ok(()),
        }
    }

    fn device_expert_stats(&self) -> Option<DeviceExpertStats> {
        let launches = self.launches.load(std::sync::atomic::Ordering::Relaxed);
        let (host_share, host_calibration, host_computed, host_time) = self
            .host
            .as_ref()
            .map_or((None, None, 0, Default::default()), |h| h.report());
        self.cache().map(|c| DeviceExpertStats {
            launches,
            host_share,
            host_calibration,
            host_computed,
            host_time,
            ..c.stats()
        })
    }

    fn splits_misses(&self) -> bool {
        self.host.as_ref().is_some_and(|h| h.host_misses(100) > 0)
    }

    fn route_and_read(
        &self,
        logits: &CudaTensor,
        spec: &RouterSpec,
        x: &CudaTensor,
    ) -> OpResult<(Routes, Vec<f32>)> {
        self.route_reading("route_and_read", logits, spec, Some(x))
    }

    fn host_misses(&self, layer: usize, misses: &[usize]) -> OpResult<Vec<bool>> {
        let n = self
            .host
            .as_ref()
            .map_or(0, |h| h.host_misses(misses.len()));
        if n == 0 {
            return Ok(vec![false; misses.len()]);
        }
        match self.cache() {
            Some(mut c) => {
                let pick = c.least_used(layer, misses, n);
                c.count_host_misses(pick.iter().filter(|&&h| h).count());
                Ok(pick)
            }
            None => Err(self.missing("host_misses (no GPU expert cache)")),
        }
    }

    fn glu_mlp_combine_split(
        &self,
        mlp: &Mlp,
        act: Act,
        srcs: &[Weights],
        weights: &[f32],
        on_host: &[bool],
        x: &CudaTensor,
        x_host: &[f32],
        acc: &mut CudaTensor,
    ) -> OpResult<()> {
        let op = "glu_mlp_combine_split";
        check_glu_combine(op, mlp, srcs.len(), weights.len(), x, acc)?;
        let host_blobs = srcs
            .iter()
            .zip(on_host)
            .all(|(s, &h)| !h || matches!(s, Weights::Blob(_)));
        check(
            op,
            on_host.len() == srcs.len() && x_host.len() == x.cols && host_blobs,
            || {
                format!(
                    "{} host flags for {} experts, a host row of {} for {} columns; every host \
                     expert a blob",
                    on_host.len(),
                    srcs.len(),
                    x_host.len(),
                    x.cols
                )
            },
        )?;
        let host = on_host.iter().any(|&h| h).then_some((on_host, x_host));
        self.combine(op, mlp, act, srcs, weights, x, host, acc)
    }

    fn begin_prefill_staging(&self, layer: usize) -> OpResult<bool> {
        match self.cache() {
            Some(mut c) => c
                .begin_staging(&self.stream, layer)
                .map_err(|e| self.cache_err("begin_prefill_staging", e)),
            None => Ok(false),
        }
    }

    fn end_prefill_staging(&self, layer: usize, uses: &[(usize, u64)]) -> OpResult<()> {
        match self.cache() {
            Some(mut c) => c
                .end_staging(&self.stream, layer, uses)
                .map_err(|e| self.cache_err("end_prefill_staging", e)),
            None => Ok(()),
        }
    }

    fn wants_host_calibration(&self) -> bool {
        self.host.as_ref().is_some_and(|h| h.wants_calibration())
    }

    fn calibrate_host_misses(&self, mlp: &Mlp, blob: &[u8]) -> OpResult<()> {
        match &self.host {
            Some(h) => h.calibrate(self, mlp, blob),
            None => Ok(()),
        }
    }

    fn experts_to_complete(&self, layer: usize) -> OpResult<Vec<usize>> {
        match self.cache() {
            Some(mut c) => c
                .not_yet_held(&self.stream, layer)
                .map_err(|e| self.cache_err("experts_to_complete", e)),
            None => Ok(Vec::new()),
        }
    }

    fn routes_on_device(&self, layer: usize, top_k: usize) -> OpResult<bool> {
        if 2 * top_k > QM_JOBS {
            return Ok(false);
        }
        match self.cache() {
            Some(mut c) => Ok(c
                .slots_by_id(&self.stream, layer)
                .map_err(|e| self.cache_err("routes_on_device", e))?
                .is_some()),
            None => Ok(false),
        }
    }

    fn routed_experts_held(
        &self,
        layer: usize,
        mlp: &Mlp,
        act: Act,
        x: &CudaTensor,
        logits: &CudaTensor,
        spec: &RouterSpec,
        acc: &mut CudaTensor,
    ) -> OpResult<()> {
        let op = "routed_experts_held";
        let (n_exp, k) = (logits.cols, spec.top_k);
        check_mlp(op, mlp, x.cols)?;
        let (inner, h) = (mlp.gate_proj.rows, mlp.down_proj.rows);
        check(
            op,
            x.rows == 1
                && logits.rows == 1
                && (acc.rows, acc.cols) == (1, h)
                && !spec.trace
                && 2 * k <= QM_JOBS,
            || {
                format!(
                    "one row of {} into [1, {h}] by [1, {n_exp}] logits, top-{k} (at most {}), \
                     no trace; got x [{}, {}], logits [{}, {n_exp}], acc [{}, {}]",
                    x.cols,
                    QM_JOBS / 2,
                    x.rows,
                    x.cols,
                    logits.rows,
                    acc.rows,
                    acc.cols
                )
            },
        )?;
        self.route_args(op, spec, 1, n_exp)?;
        let (slots, stride) = {
            let mut cache = self.cache();
            let Some(c) = cache.as_mut() else {
                return Err(self.missing("routed_experts_held (no GPU expert cache)"));
            };
            let slots = c
                .slots_by_id(&self.stream, layer)
                .map_err(|e| self.cache_err(op, e))?;
            let experts = c.experts();
            check(op, slots.is_some() && experts == n_exp, || {
                format!("layer {layer}: not every one of its {experts} experts is held for {n_exp} logits")
            })?;
            c.count_device_step(k);
            (slots.expect("checked"), c.stride())
        };
        // The chosen ids, then their weights' bits.
        // SAFETY: `route_one` writes all 2k values before anything reads them (stream order).
        let sel = unsafe { self.stream.alloc::<u32>(2 * k) }.map_err(|e| self.dev(op, e))?;
        let ids = self.addr(&sel);
        let wts = ids + 4 * k as u64;
        self.route_one(op, logits, spec, ids, wts)?;
        let mut g = self.uninit_tensor(op, k, inner)?;
        let u = self.uninit_tensor(op, k, inner)?;
        let (xa, ga, ua) = (self.addr(&*x.buf), self.addr(&*g.buf), self.addr(&*u.buf));
        let row = |base: u64, r: usize, width: usize| base + (4 * r * width) as u64;
        let (gate, up) = (&mlp.gate_proj, &mlp.up_proj);
        let gate_jobs: Vec<_> = (0..k).map(|i| (0, i, xa, row(ga, i, inner))).collect();
        let up_jobs: Vec<_> = (0..k).map(|i| (1, i, xa, row(ua, i, inner))).collect();
        let [gw, ..] = qref_offsets(op, gate, stride)?;
        let [uw, ..] = qref_offsets(op, up, stride)?;
        if pairs_fuse(gate, up, gw, uw) {
            self.products_by_id(op, &[gate, up], &gate_jobs, slots, ids, stride, Some(act))?;
        } else {
            if (gate.bits, gate.group_size) == (up.bits, up.group_size) {
                let both: Vec<_> = gate_jobs.iter().chain(&up_jobs).copied().collect();
                self.products_by_id(op, &[gate, up], &both, slots, ids, stride, None)?;
            } else {
                self.products_by_id(op, &[gate], &gate_jobs, slots, ids, stride, None)?;
                let up_jobs: Vec<_> = up_jobs.iter().map(|&(_, i, x, y)| (0, i, x, y)).collect();
                self.products_by_id(op, &[up], &up_jobs, slots, ids, stride, None)?;
            }
            self.glu_act(op, act, &mut g, &u)?;
        }
        self.down_combine_by_id(op, &mlp.down_proj, &g, slots, ids, wts, stride, acc)
    }

    fn size_expert_cache(&self) -> OpResult<()> {
        match self.cache() {
            Some(mut c) => c
                .ensure_sized(&self.stream)
                .map_err(|e| self.cache_err("size_expert_cache", e)),
            None => Ok(()),
        }
    }
}
