//! Live statistics of the generation thread, for `GET /v1/stats` (the chat page's HUD) and
//! `GET /metrics` ([`crate::metrics`]).
//!
//! Every figure is read from a real counter: token counts from the request, times from the
//! generation thread's clock at the end of prefill and of each decode forward, expert-cache hits,
//! misses and bytes read from the model's streamers ([`Model::expert_stats`]), KV bytes from
//! [`Model::kv_bytes`], resident weights from the mapped `model_weights.bin`, and the process RSS
//! from `/proc/self/status`. The generation thread writes under a mutex held for a few field
//! updates; the HTTP handlers only read, so a poll never waits for a forward pass.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Instant;

use serde::Serialize;

use mference_models::Model;
use mference_runtime::CacheSlots;

use crate::PromptCacheMode;

/// Upper bounds (seconds) of the TTFT histogram buckets: vLLM's
/// `vllm:time_to_first_token_seconds` buckets up to 10 s, then a few longer ones for prompts that
/// stream experts from disk.
pub(crate) const TTFT_BUCKETS: [f64; 18] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    30.0, 60.0,
];

/// Expert-cache counters summed over every MoE layer (cumulative since the model was loaded).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Experts {
    /// Routed experts found in a slot.
    pub hits: u64,
    /// Routed experts read from their layer file.
    pub misses: u64,
    /// Bytes read from the layer files (speculative prefetches included).
    pub bytes_read: u64,
    /// Seconds the compute thread waited for expert reads.
    pub read_wait_s: f64,
}

impl Experts {
    /// The counts between `earlier` and `self`.
    fn since(self, earlier: Experts) -> Experts {
        Experts {
            hits: self.hits.saturating_sub(earlier.hits),
            misses: self.misses.saturating_sub(earlier.misses),
            bytes_read: self.bytes_read.saturating_sub(earlier.bytes_read),
            read_wait_s: (self.read_wait_s - earlier.read_wait_s).max(0.0),
        }
    }

    /// `hits / (hits + misses)`, `None` before any expert was routed.
    pub fn hit_rate(&self) -> Option<f64> {
        let n = self.hits + self.misses;
        (n > 0).then(|| self.hits as f64 / n as f64)
    }
}

/// The model-wide figures, read from the model outside the lock at every hook.
#[derive(Clone, Copy, Default)]
struct Reading {
    /// Expert counters summed over the layers.
    experts: Experts,
    /// MoE layers whose streamer has been used (its slab allocated).
    opened_layers: usize,
    kv_bytes: u64,
    /// Positions in the KV cache.
    kv_tokens: u64,
}

impl Reading {
    fn of(model: &dyn Model) -> Self {
        let mut r = Reading {
            kv_bytes: model.kv_bytes() as u64,
            kv_tokens: model.position() as u64,
            ..Default::default()
        };
        for s in model.expert_stats() {
            r.experts.hits += s.hits;
            r.experts.misses += s.misses;
            r.experts.bytes_read += s.bytes_read;
            r.experts.read_wait_s += s.read_wait.as_secs_f64();
            r.opened_layers += usize::from(s.hits + s.misses > 0);
        }
        r
    }
}

/// What does not change while the server runs: the device, the cache configuration and the
/// sizes fixed at load.
#[derive(Debug, Clone, Serialize)]
pub struct ServerInfo {
    /// The id clients send as `model`.
    pub model: String,
    /// The backend as it names itself (`cpu avx512 x2`, `cuda:0 NVIDIA H200 sm_90`).
    pub device: String,
    /// Kernel worker threads (the caller included).
    pub threads: usize,
    /// KV cache positions.
    pub max_context: usize,
    /// Rows per prefill chunk.
    pub prefill_chunk: usize,
    /// `off` or `single-prefix`.
    pub prompt_cache: &'static str,
    /// `--expert-cache-slots` as resolved: a number or `resident`.
    pub expert_slots: String,
    /// `--expert-cache-policy`: `lfu`, `lru` or `pool` (every layer's slots in one LFU pool).
    pub expert_policy: &'static str,
    /// Slots per MoE layer (the number of experts for `resident`).
    pub slots_per_layer: usize,
    /// Experts per MoE layer.
    pub experts_per_layer: usize,
    /// Layers with routed experts (one layer file each).
    pub moe_layers: usize,
    /// Bytes of one expert slot (the install's expert stride).
    pub expert_stride_bytes: u64,
    /// How experts reach memory: `mmap` (resident, the page cache is the only copy), `o_direct`
    /// (reads into the slots bypass the page cache) or `pread` (buffered reads into the slots).
    pub io: &'static str,
    /// Bytes of the mapped `model_weights.bin` (the resident weights).
    pub resident_weights_bytes: u64,
}

impl ServerInfo {
    /// The figures of a loaded `model`.
    pub(crate) fn of(model: &dyn Model, model_id: &str, prompt_cache: PromptCacheMode) -> Self {
        let e = model.engine();
        let layout = &e.install.layout;
        let experts = layout.experts_per_layer;
        let mapped = e.slots == CacheSlots::Resident && !e.direct_io;
        ServerInfo {
            model: model_id.to_string(),
            // The backend's name, and on CUDA its GPU expert slots.
            device: model.device(),
            threads: e.threads,
            max_context: e.max_context,
            prefill_chunk: e.prefill_chunk,
            prompt_cache: match prompt_cache {
                PromptCacheMode::Off => "off",
                PromptCacheMode::SinglePrefix => "single-prefix",
            },
            expert_slots: match e.slots {
                CacheSlots::Fixed(n) => n.to_string(),
                CacheSlots::Resident => "resident".into(),
            },
            expert_policy: e.expert_policy.name(),
            slots_per_layer: e.slots.count(experts),
            experts_per_layer: experts,
            moe_layers: layout.layers.iter().filter(|l| l.blob.is_some()).count(),
            expert_stride_bytes: layout.expert_stride,
            io: match (mapped, e.direct_io) {
                (true, _) => "mmap",
                (false, true) => "o_direct",
                (false, false) => "pread",
            },
            resident_weights_bytes: e.map.len() as u64,
        }
    }

    /// Bytes of slot memory for `opened` MoE layers (a layer's slab is allocated when the layer is
    /// first used; mapped layer files have none).
    fn slot_bytes(&self, opened: usize) -> u64 {
        if self.io == "mmap" {
            return 0;
        }
        // A pool's one slab holds every layer's share from the first layer opened on.
        let opened = if self.expert_policy == "pool" && opened > 0 {
            self.moe_layers
        } else {
            opened
        };
        opened as u64 * self.slots_per_layer as u64 * self.expert_stride_bytes
    }
}

/// Where the latest request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Its prompt is being prefilled.
    Prefill,
    /// Tokens are being generated.
    Decode,
    /// It has finished (see `finish_reason`).
    Done,
}

/// Prefill or decode of one request or of the whole session.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Pass {
    /// Tokens run through the model: prompt tokens not taken from the prefix cache (prefill), or
    /// decode forwards, one token each (decode).
    pub tokens: u64,
    /// Seconds the generation thread spent in it.
    pub seconds: f64,
    /// `tokens / seconds`; `None` before any time has passed.
    pub tokens_per_s: Option<f64>,
    /// Expert-cache counters during it.
    pub experts: Experts,
    /// `experts.bytes_read / tokens`; `None` before any token.
    pub bytes_read_per_token: Option<f64>,
    /// `experts.hits / (hits + misses)`; `None` before any expert was routed.
    pub hit_rate: Option<f64>,
}

impl Pass {
    fn new(tokens: u64, seconds: f64, experts: Experts) -> Self {
        Pass {
            tokens,
            seconds,
            tokens_per_s: (seconds > 0.0).then(|| tokens as f64 / seconds),
            experts,
            bytes_read_per_token: (tokens > 0).then(|| experts.bytes_read as f64 / tokens as f64),
            hit_rate: experts.hit_rate(),
        }
    }
}

/// The figures of the latest request (running or finished).
#[derive(Debug, Clone, Serialize)]
pub struct ReplyStats {
    /// The response id (`chatcmpl-…`, `cmpl-…`): the `id` of its chunks.
    pub id: String,
    /// Prefill, decode or done.
    pub phase: Phase,
    /// Prompt tokens, cached ones included.
    pub prompt_tokens: u64,
    /// Prompt tokens whose KV came from the retained prefix (`None` until prefill ends).
    pub cached_tokens: Option<u64>,
    /// Generated tokens as in `usage.completion_tokens` (known when the request ends).
    pub completion_tokens: Option<u64>,
    /// Seconds from the request's arrival to the first token's logits (queue wait, prompt
    /// rendering and prefill).
    pub ttft_s: Option<f64>,
    /// Seconds the request waited in the queue.
    pub queue_s: f64,
    /// Its prefill (the prompt tokens not taken from the retained prefix).
    pub prefill: Pass,
    /// Its decode forwards.
    pub decode: Pass,
    /// `stop`, `length`, `tool_calls`, `cancelled` or `error` once done.
    pub finish_reason: Option<&'static str>,
}

/// Totals since the server started.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SessionStats {
    /// Finished requests, by finish reason.
    pub requests: BTreeMap<&'static str, u64>,
    /// Requests answered with an error status instead of a generation (400, 413, 415, 429, …), by
    /// status.
    pub rejected: BTreeMap<u16, u64>,
    /// Prompt tokens of finished requests, cached ones included.
    pub prompt_tokens: u64,
    /// Prompt tokens whose KV came from the retained prefix.
    pub cached_tokens: u64,
    /// Generated tokens of finished requests (`usage.completion_tokens`).
    pub completion_tokens: u64,
    /// Every prefill so far (a running request's once its prefill is complete).
    pub prefill: Pass,
    /// Every decode forward so far (a running request's included).
    pub decode: Pass,
    /// Mean TTFT of the finished requests that reached their first token.
    pub ttft_mean_s: Option<f64>,
    /// Every expert-cache counter since the model was loaded.
    pub experts: Experts,
}

/// Memory figures, bytes.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Memory {
    /// `VmRSS` of `/proc/self/status`; `None` where it cannot be read.
    pub rss_bytes: Option<u64>,
    /// `VmHWM` (peak RSS).
    pub peak_rss_bytes: Option<u64>,
    /// The mapped `model_weights.bin`.
    pub resident_weights_bytes: u64,
    /// Expert slots allocated so far (MoE layers used at least once × slots × stride; 0 when the
    /// layer files are mapped).
    pub expert_slot_bytes: u64,
    /// Expert slots once every MoE layer has been used.
    pub expert_slot_capacity_bytes: u64,
    /// The KV cache (and recurrent state) as last reported by the model.
    pub kv_cache_bytes: u64,
}

/// The queue as the HTTP side sees it.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Queue {
    /// Requests being generated (0 or 1).
    pub running: u64,
    /// Requests waiting behind it.
    pub waiting: u64,
}

/// Everything `GET /v1/stats` returns; `/metrics` renders the same numbers.
#[derive(Debug, Clone, Serialize)]
pub struct Snapshot {
    /// The device and the configuration.
    pub server: ServerInfo,
    /// Seconds since the server started.
    pub uptime_s: f64,
    /// Running and waiting requests.
    pub queue: Queue,
    /// Process and model memory.
    pub memory: Memory,
    /// Positions the KV cache holds (the retained prefix included).
    pub kv_cache_tokens: u64,
    /// The latest request; `None` before the first.
    pub last: Option<ReplyStats>,
    /// Totals since the server started.
    pub session: SessionStats,
    /// Cumulative TTFT histogram: per [`TTFT_BUCKETS`] bound, requests at or below it.
    #[serde(skip)]
    pub ttft_buckets: Vec<u64>,
    /// Sum of the TTFTs in the histogram, seconds.
    #[serde(skip)]
    pub ttft_sum_s: f64,
    /// Requests in the histogram.
    #[serde(skip)]
    pub ttft_count: u64,
}

/// The request in progress, with the counters taken at its phase boundaries.
struct Running {
    id: String,
    received: Instant,
    started: Instant,
    prompt: u64,
    cached: u64,
    prefilled_at: Option<Instant>,
    last_forward: Option<Instant>,
    ended_at: Option<Instant>,
    decode_tokens: u64,
    at_start: Experts,
    at_prefilled: Experts,
    now: Experts,
    completion: Option<u64>,
    finish: Option<&'static str>,
}

impl Running {
    fn reply(&self) -> ReplyStats {
        let prefill_end = self.prefilled_at;
        let prefill = match prefill_end {
            Some(p) => Pass::new(
                self.prompt.saturating_sub(self.cached),
                (p - self.started).as_secs_f64(),
                self.at_prefilled.since(self.at_start),
            ),
            // Still running (or failed): the time so far, no rate.
            None => Pass {
                seconds: (self.ended_at.unwrap_or_else(Instant::now) - self.started).as_secs_f64(),
                experts: self.now.since(self.at_start),
                ..Pass::default()
            },
        };
        let decode = match (prefill_end, self.last_forward) {
            (Some(p), Some(l)) => Pass::new(
                self.decode_tokens,
                (l - p).as_secs_f64(),
                self.now.since(self.at_prefilled),
            ),
            _ => Pass::default(),
        };
        ReplyStats {
            id: self.id.clone(),
            phase: match (self.finish, prefill_end) {
                (Some(_), _) => Phase::Done,
                (None, Some(_)) => Phase::Decode,
                (None, None) => Phase::Prefill,
            },
            prompt_tokens: self.prompt,
            cached_tokens: prefill_end.map(|_| self.cached),
            completion_tokens: self.completion,
            ttft_s: prefill_end.map(|p| (p - self.received).as_secs_f64()),
            queue_s: (self.started - self.received).as_secs_f64(),
            prefill,
            decode,
            finish_reason: self.finish,
        }
    }
}

#[derive(Default)]
struct Totals {
    requests: BTreeMap<&'static str, u64>,
    rejected: BTreeMap<u16, u64>,
    prompt: u64,
    cached: u64,
    completion: u64,
    prefill_tokens: u64,
    prefill_s: f64,
    prefill_experts: Experts,
    decode_tokens: u64,
    decode_s: f64,
    decode_experts: Experts,
    ttft_buckets: Vec<u64>,
    ttft_sum_s: f64,
    ttft_count: u64,
}

struct State {
    latest: Option<Running>,
    totals: Totals,
    /// The model at the latest hook.
    model: Reading,
}

/// The statistics shared by the generation thread (writer) and the HTTP handlers (readers).
pub(crate) struct Live {
    info: ServerInfo,
    since: Instant,
    state: Mutex<State>,
}

impl Live {
    pub(crate) fn new(info: ServerInfo) -> Self {
        Live {
            info,
            since: Instant::now(),
            state: Mutex::new(State {
                latest: None,
                totals: Totals {
                    ttft_buckets: vec![0; TTFT_BUCKETS.len()],
                    ..Default::default()
                },
                model: Reading::default(),
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The generation thread took request `id` (`prompt` tokens, arrived at `received`).
    pub(crate) fn begin(&self, id: &str, received: Instant, prompt: usize, model: &dyn Model) {
        let now = self.observe(model);
        let mut s = self.lock();
        s.latest = Some(Running {
            id: id.to_string(),
            received,
            started: Instant::now(),
            prompt: prompt as u64,
            cached: 0,
            prefilled_at: None,
            last_forward: None,
            ended_at: None,
            decode_tokens: 0,
            at_start: now,
            at_prefilled: now,
            now,
            completion: None,
            finish: None,
        });
    }

    /// The prompt is in the KV cache (`cached` of its tokens came from the retained prefix) and
    /// the first token's logits are ready.
    pub(crate) fn prefilled(&self, cached: usize, model: &dyn Model) {
        let now = self.observe(model);
        let mut s = self.lock();
        if let Some(r) = s.latest.as_mut() {
            r.cached = cached as u64;
            r.prefilled_at = Some(Instant::now());
            r.at_prefilled = now;
        }
    }

    /// One decode forward (one token) finished.
    pub(crate) fn decoded(&self, model: &dyn Model) {
        self.observe(model);
        let mut s = self.lock();
        if let Some(r) = s.latest.as_mut() {
            r.decode_tokens += 1;
            r.last_forward = Some(Instant::now());
        }
    }

    /// The request ended with `finish` (`stop`, `length`, `tool_calls`, `cancelled`, `error`)
    /// after `completion` generated tokens.
    pub(crate) fn end(&self, completion: usize, finish: &'static str, model: &dyn Model) {
        self.observe(model);
        let mut s = self.lock();
        let Some(r) = s.latest.as_mut() else { return };
        r.completion = Some(completion as u64);
        r.finish = Some(finish);
        r.ended_at = Some(Instant::now());
        let reply = r.reply();
        let t = &mut s.totals;
        *t.requests.entry(finish).or_default() += 1;
        t.prompt += reply.prompt_tokens;
        t.cached += reply.cached_tokens.unwrap_or(0);
        t.completion += completion as u64;
        t.prefill_tokens += reply.prefill.tokens;
        t.prefill_s += reply.prefill.seconds;
        add(&mut t.prefill_experts, reply.prefill.experts);
        t.decode_tokens += reply.decode.tokens;
        t.decode_s += reply.decode.seconds;
        add(&mut t.decode_experts, reply.decode.experts);
        if let Some(ttft) = reply.ttft_s {
            t.ttft_sum_s += ttft;
            t.ttft_count += 1;
            for (b, &le) in t.ttft_buckets.iter_mut().zip(TTFT_BUCKETS.iter()) {
                *b += u64::from(ttft <= le);
            }
        }
    }

    /// A request was answered with `status` instead of being generated.
    pub(crate) fn rejected(&self, status: u16) {
        *self.lock().totals.rejected.entry(status).or_default() += 1;
    }

    /// Reads the model and records it; returns its expert counters.
    fn observe(&self, model: &dyn Model) -> Experts {
        let reading = Reading::of(model);
        let mut s = self.lock();
        s.model = reading;
        if let Some(r) = s.latest.as_mut() {
            r.now = reading.experts;
        }
        reading.experts
    }

    /// The figures now, with `waiting` requests in the job queue.
    pub(crate) fn snapshot(&self, waiting: u64) -> Snapshot {
        let (rss, peak) = process_rss();
        let s = self.lock();
        let running = s.latest.as_ref().is_some_and(|r| r.finish.is_none());
        let queue = Queue {
            running: u64::from(running),
            waiting,
        };
        let t = &s.totals;
        let last = s.latest.as_ref().map(Running::reply);
        // A running request's prefill counts once it is complete, its decode as it goes.
        let live = last.as_ref().filter(|r| r.phase == Phase::Decode);
        let plus = |tokens: u64, secs: f64, x: Experts, f: fn(&ReplyStats) -> &Pass| {
            let (mut tokens, mut secs, mut x) = (tokens, secs, x);
            if let Some(p) = live.map(f) {
                tokens += p.tokens;
                secs += p.seconds;
                add(&mut x, p.experts);
            }
            Pass::new(tokens, secs, x)
        };
        let session = SessionStats {
            requests: t.requests.clone(),
            rejected: t.rejected.clone(),
            prompt_tokens: t.prompt,
            cached_tokens: t.cached,
            completion_tokens: t.completion,
            prefill: plus(t.prefill_tokens, t.prefill_s, t.prefill_experts, |r| {
                &r.prefill
            }),
            decode: plus(t.decode_tokens, t.decode_s, t.decode_experts, |r| &r.decode),
            ttft_mean_s: (t.ttft_count > 0).then(|| t.ttft_sum_s / t.ttft_count as f64),
            experts: s.model.experts,
        };
        Snapshot {
            uptime_s: self.since.elapsed().as_secs_f64(),
            queue,
            memory: Memory {
                rss_bytes: rss,
                peak_rss_bytes: peak,
                resident_weights_bytes: self.info.resident_weights_bytes,
                expert_slot_bytes: self.info.slot_bytes(s.model.opened_layers),
                expert_slot_capacity_bytes: self.info.slot_bytes(self.info.moe_layers),
                kv_cache_bytes: s.model.kv_bytes,
            },
            kv_cache_tokens: s.model.kv_tokens,
            last,
            session,
            ttft_buckets: t.ttft_buckets.clone(),
            ttft_sum_s: t.ttft_sum_s,
            ttft_count: t.ttft_count,
            server: self.info.clone(),
        }
    }
}

fn add(into: &mut Experts, x: Experts) {
    into.hits += x.hits;
    into.misses += x.misses;
    into.bytes_read += x.bytes_read;
    into.read_wait_s += x.read_wait_s;
}

/// `VmRSS` and `VmHWM` of `/proc/self/status`, bytes.
fn process_rss() -> (Option<u64>, Option<u64>) {
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
        return (None, None);
    };
    (
        status_kib(&status, "VmRSS:").map(|k| k * 1024),
        status_kib(&status, "VmHWM:").map(|k| k * 1024),
    )
}

/// The value of a `/proc/<pid>/status` line such as `VmRSS:  123456 kB`, in KiB.
fn status_kib(status: &str, key: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with(key))?;
    let mut words = line[key.len()..].split_whitespace();
    let n = words.next()?.parse().ok()?;
    (words.next() == Some("kB")).then_some(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_status_lines_parse_in_kib() {
        let s = "Name:\tmference\nVmHWM:\t  2048 kB\nVmRSS:\t    1500 kB\n";
        assert_eq!(status_kib(s, "VmRSS:"), Some(1500));
        assert_eq!(status_kib(s, "VmHWM:"), Some(2048));
        assert_eq!(status_kib(s, "VmSwap:"), None);
        assert_eq!(status_kib("VmRSS:\t12 pages\n", "VmRSS:"), None);
        let (rss, peak) = process_rss();
        let (rss, peak) = (rss.unwrap(), peak.unwrap());
        assert!(rss > 0 && peak >= rss, "rss {rss} peak {peak}");
    }

    #[test]
    fn passes_divide_only_when_they_can() {
        let x = Experts {
            hits: 3,
            misses: 1,
            bytes_read: 4096,
            read_wait_s: 0.5,
        };
        let p = Pass::new(8, 2.0, x);
        assert_eq!(p.tokens_per_s, Some(4.0));
        assert_eq!(p.bytes_read_per_token, Some(512.0));
        assert_eq!(p.hit_rate, Some(0.75));
        let empty = Pass::new(0, 0.0, Experts::default());
        assert_eq!(empty.tokens_per_s, None);
        assert_eq!(empty.bytes_read_per_token, None);
        assert_eq!(Experts::default().hit_rate(), None);
        let later = Experts {
            hits: 5,
            misses: 4,
            bytes_read: 9000,
            read_wait_s: 0.75,
        };
        let d = later.since(x);
        assert_eq!((d.hits, d.misses, d.bytes_read), (2, 3, 4904));
        assert!((d.read_wait_s - 0.25).abs() < 1e-12);
    }
}
