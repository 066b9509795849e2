//! Misses computed on the host CPU (issue 29): of a decode row's routed experts that the GPU
//! slots do not hold, a share (the least used ones, `GpuExperts::least_used`) is computed by the
//! CPU backend's kernels straight from their host slots (the row goes down, one output row per expert comes back) while the others cross the
//! bus into GPU slots; the GPU adds every expert in expert order (`ops/moe.rs`, `combine`).
//!
//! The share is fixed at load, so the same request takes the same path run to run: a percentage
//! given with `--gpu-miss-split N`, or (`auto`) the balance of one expert's copy time against
//! its CPU time, measured once at load ([`HostExperts::calibrate`]): with `c` the copy and `h`
//! the host time of one expert, a row with `m` misses sends `round(m · c / (c + h))` to the host,
//! which makes the copies of the rest and the host's products end together.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use mference_backend::cpu::CpuBackend;
use mference_backend::{Act, CoreOps, Mlp, OpResult, Weights};

use crate::{CudaBackend, CudaTensor};

/// How a decode row's GPU misses are split between copies and the host CPU
/// (`--gpu-miss-split`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MissSplit {
    /// Every miss is copied into a GPU slot.
    Off,
    /// The share is calibrated at load (copy time against host time of one expert).
    Auto,
    /// This percentage of each row's misses (rounded to the nearest expert) runs on the host.
    Percent(u32),
}

impl MissSplit {
    /// Parses `off`, `auto`, or a percentage `0` to `100` (`0` is `off`).
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "off" => Ok(Self::Off),
            "auto" => Ok(Self::Auto),
            _ => match s.trim_end_matches('%').parse::<u32>() {
                Ok(0) => Ok(Self::Off),
                Ok(p) if p <= 100 => Ok(Self::Percent(p)),
                _ => Err(format!(
                    "invalid GPU miss split '{s}': expected off, auto, or the percentage of each \
                     token's GPU misses to compute on the CPU (0 to 100)"
                )),
            },
        }
    }

    /// Of `misses`, how many go to the host at `percent`: the nearest whole expert, halves up.
    pub fn host_count(percent: u32, misses: usize) -> usize {
        ((misses * percent as usize + 50) / 100).min(misses)
    }
}

/// What the host side has done and measured.
#[derive(Default)]
struct HostState {
    /// The percentage in effect (`None`: `auto` not calibrated yet, nothing goes to the host).
    share: Option<u32>,
    /// One expert's copy time and host time, as measured by [`HostExperts::calibrate`].
    calibration: Option<(Duration, Duration)>,
    computed: u64,
    time: Duration,
}

/// The CPU side of the split: the CPU backend (its kernel table and threads) and the share.
pub(crate) struct HostExperts {
    cpu: CpuBackend,
    split: MissSplit,
    state: Mutex<HostState>,
}

impl HostExperts {
    pub(crate) fn new(cpu: CpuBackend, split: MissSplit) -> Self {
        let share = match split {
            MissSplit::Percent(p) => Some(p),
            _ => None,
        };
        Self {
            cpu,
            split,
            state: Mutex::new(HostState {
                share,
                ..HostState::default()
            }),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, HostState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn host_misses(&self, misses: usize) -> usize {
        self.state()
            .share
            .map_or(0, |p| MissSplit::host_count(p, misses))
    }

    /// Whether `auto` still waits for its calibration.
    pub(crate) fn wants_calibration(&self) -> bool {
        self.split == MissSplit::Auto && self.state().calibration.is_none()
    }

    /// `(share, calibration, experts computed, host time)` for the stats.
    pub(crate) fn report(&self) -> (Option<u32>, Option<(Duration, Duration)>, u64, Duration) {
        let s = self.state();
        (s.share, s.calibration, s.computed, s.time)
    }

    /// `auto`: times one expert copied from `blob` (page-locked host memory) into device memory
    /// and computed by the CPU backend (a quarter of four computed together, as a decode row
    /// sends several), the median of 9 after 3 warm-up passes each, and sets the share to the
    /// copy's part of their sum. Other settings: nothing.
    pub(crate) fn calibrate(&self, be: &CudaBackend, mlp: &Mlp, blob: &[u8]) -> OpResult<()> {
        if self.split != MissSplit::Auto || self.state().calibration.is_some() {
            return Ok(());
        }
        let op = "calibrate_host_misses";
        // Passes run before the timed ones (the threads' first wake-up and page-ins), and the
        // timed ones, of which the median counts (a few ms at load in all).
        const WARM: usize = 3;
        const TIMED: usize = 9;
        let median = |mut t: Vec<Duration>| {
            t.sort();
            t[t.len() / 2]
        };
        // SAFETY: the buffer is only written by the copies below and never read.
        let mut dst = unsafe { be.stream.alloc::<u8>(blob.len()) }.map_err(|e| be.dev(op, e))?;
        let mut copy = Vec::new();
        for i in 0..WARM + TIMED {
            let t0 = Instant::now();
            be.stream
                .memcpy_htod(blob, &mut dst)
                .and_then(|_| be.stream.synchronize())
                .map_err(|e| be.dev(op, e))?;
            if i >= WARM {
                copy.push(t0.elapsed());
            }
        }
        // A few experts at once, as a decode row sends them (one pass of the CPU's threads).
        const N: usize = 4;
        let x = self
            .cpu
            .upload(&vec![0.0; mlp.gate_proj.cols], mlp.gate_proj.cols)?;
        let mut out = self.cpu.zeros(N, mlp.down_proj.rows)?;
        let rows: Vec<usize> = (0..N).collect();
        let mut host = Vec::new();
        for i in 0..WARM + TIMED {
            let t0 = Instant::now();
            let srcs = [Weights::Blob(blob); N];
            self.cpu
                .glu_mlp_rows(mlp, Act::Silu, &srcs, &x, &mut out, &rows)?;
            if i >= WARM {
                host.push(t0.elapsed() / N as u32);
            }
        }
        let (c, h) = (median(copy), median(host));
        let share = (100.0 * c.as_secs_f64() / (c + h).as_secs_f64()).round() as u32;
        let mut s = self.state();
        s.calibration = Some((c, h));
        s.share = Some(share);
        Ok(())
    }

    /// The experts `blobs` (host bytes) on the row `x`, computed by the CPU backend, as a
    /// `[blobs.len(), down.rows]` device tensor (one upload).
    pub(crate) fn compute(
        &self,
        be: &CudaBackend,
        mlp: &Mlp,
        act: Act,
        blobs: &[Weights],
        x: &[f32],
    ) -> OpResult<CudaTensor> {
        let t0 = Instant::now();
        let xc = self.cpu.upload(x, x.len())?;
        // Every expert in one pass of the CPU's threads (its decode path, `glu_mlp_rows`).
        let mut ys = self.cpu.zeros(blobs.len(), mlp.down_proj.rows)?;
        let rows: Vec<usize> = (0..blobs.len()).collect();
        self.cpu
            .glu_mlp_rows(mlp, act, blobs, &xc, &mut ys, &rows)?;
        let out = be.upload(&self.cpu.read(&ys)?, mlp.down_proj.rows)?;
        let mut s = self.state();
        s.computed += blobs.len() as u64;
        s.time += t0.elapsed();
        Ok(out)
    }
}

impl CudaBackend {
    /// Computes a share of each decode row's GPU misses on the host CPU with `cpu` (its kernel
    /// table and threads), as `split` says, instead of copying them in (`host_experts.rs`).
    pub fn with_host_experts(mut self, cpu: CpuBackend, split: MissSplit) -> Self {
        self.host = (split != MissSplit::Off).then(|| HostExperts::new(cpu, split));
        self
    }

    /// [`HostExperts::compute`], or an error without a host side.
    pub(crate) fn host_experts(
        &self,
        op: &'static str,
        mlp: &Mlp,
        act: Act,
        blobs: &[Weights],
        x: &[f32],
    ) -> OpResult<CudaTensor> {
        match &self.host {
            Some(h) => h.compute(self, mlp, act, blobs, x),
            None => Err(self.missing(op)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_parse_and_round_to_whole_experts() {
        assert_eq!(MissSplit::parse("off"), Ok(MissSplit::Off));
        assert_eq!(MissSplit::parse("0"), Ok(MissSplit::Off));
        assert_eq!(MissSplit::parse("auto"), Ok(MissSplit::Auto));
        assert_eq!(MissSplit::parse("35"), Ok(MissSplit::Percent(35)));
        assert_eq!(MissSplit::parse("100%"), Ok(MissSplit::Percent(100)));
        for bad in ["", "101", "-5", "half", "1.5"] {
            let e = MissSplit::parse(bad).unwrap_err();
            assert!(e.contains("expected off, auto"), "{bad}: {e}");
        }
        // round(m · p / 100), halves up, never more than m.
        let counts: Vec<usize> = (0..=8).map(|m| MissSplit::host_count(35, m)).collect();
        assert_eq!(counts, [0, 0, 1, 1, 1, 2, 2, 2, 3]);
        assert_eq!(MissSplit::host_count(100, 5), 5);
        assert_eq!(MissSplit::host_count(50, 1), 1);
        assert_eq!(MissSplit::host_count(49, 1), 0);
    }
}
