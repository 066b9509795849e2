//! `GET /metrics`: the [`Snapshot`] in the Prometheus text exposition format (version 0.0.4,
//! <https://prometheus.io/docs/instrumenting/exposition_formats/>), every name prefixed
//! `mference_`. Names follow vLLM (`vllm:prompt_tokens_total`, `vllm:generation_tokens_total`,
//! `vllm:time_to_first_token_seconds`, `vllm:num_requests_running`) and llama-server
//! (`llamacpp:prompt_seconds_total`, `llamacpp:kv_cache_tokens`) where they have one, and
//! Prometheus' base units (seconds, bytes) and `_total` counters everywhere.

use std::fmt::Write;

use crate::stats::{Snapshot, TTFT_BUCKETS};

/// The `Content-Type` of the text format.
pub(crate) const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// One metric family being written.
struct Family<'a> {
    out: &'a mut String,
    name: &'static str,
}

impl Family<'_> {
    /// A sample of this family (`suffix` for a histogram's `_bucket`, `_sum`, `_count`).
    fn sample(&mut self, suffix: &str, labels: &[(&str, &str)], value: f64) -> &mut Self {
        self.out.push_str(self.name);
        self.out.push_str(suffix);
        if !labels.is_empty() {
            self.out.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                let _ = write!(self.out, "{k}=\"{}\"", escape(v, true));
            }
            self.out.push('}');
        }
        self.out.push(' ');
        self.out.push_str(&number(value));
        self.out.push('\n');
        self
    }

    fn value(&mut self, value: f64) -> &mut Self {
        self.sample("", &[], value)
    }
}

/// Starts the family `name` of `kind` (`counter`, `gauge`, `histogram`) with its help line.
fn family<'a>(out: &'a mut String, name: &'static str, kind: &str, help: &str) -> Family<'a> {
    let _ = writeln!(out, "# HELP {name} {}", escape(help, false));
    let _ = writeln!(out, "# TYPE {name} {kind}");
    Family { out, name }
}

/// The text format's escapes: `\\` and `\n` everywhere, `\"` in label values.
fn escape(s: &str, label: bool) -> String {
    let mut e = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\\' => e.push_str("\\\\"),
            '\n' => e.push_str("\\n"),
            '"' if label => e.push_str("\\\""),
            c => e.push(c),
        }
    }
    e
}

/// A sample value as Go's `ParseFloat` reads it: integers without a fraction, `+Inf`, `-Inf`,
/// `NaN`.
fn number(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.into()
    } else if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{v:.0}")
    } else {
        format!("{v}")
    }
}

/// The metrics of `s`.
pub(crate) fn render(s: &Snapshot) -> String {
    let mut o = String::new();
    let i = &s.server;
    family(
        &mut o,
        "mference_info",
        "gauge",
        "The loaded model, the device and the effective expert-cache configuration (value 1).",
    )
    .sample(
        "",
        &[
            ("model", &i.model),
            ("device", &i.device),
            ("expert_slots", &i.expert_slots),
            ("io", i.io),
            ("prompt_cache", i.prompt_cache),
        ],
        1.0,
    );
    let mut requests = family(
        &mut o,
        "mference_requests_total",
        "counter",
        "Requests the generation thread finished, by finish reason.",
    );
    for (reason, n) in &s.session.requests {
        requests.sample("", &[("finish_reason", reason)], *n as f64);
    }
    let mut rejected = family(
        &mut o,
        "mference_requests_rejected_total",
        "counter",
        "Requests answered with an error status instead of a generation, by status.",
    );
    for (status, n) in &s.session.rejected {
        rejected.sample("", &[("status", &status.to_string())], *n as f64);
    }
    let ss = &s.session;
    let mut h = family(
        &mut o,
        "mference_time_to_first_token_seconds",
        "histogram",
        "Seconds from a request's arrival to its first token's logits (queue wait included).",
    );
    for (le, n) in TTFT_BUCKETS.iter().zip(&s.ttft_buckets) {
        h.sample("_bucket", &[("le", &number(*le))], *n as f64);
    }
    h.sample("_bucket", &[("le", "+Inf")], s.ttft_count as f64)
        .sample("_sum", &[], s.ttft_sum_s)
        .sample("_count", &[], s.ttft_count as f64);
    let last = s.last.as_ref();
    let rate = |f: fn(&crate::stats::ReplyStats) -> Option<f64>| last.and_then(f).unwrap_or(0.0);
    let m = &s.memory;
    // Counters end in `_total`; the rest are gauges.
    let plain: [(&'static str, &str, f64); 24] = [
        (
            "mference_prompt_tokens_total",
            "Prompt tokens of finished requests, cached ones included.",
            ss.prompt_tokens as f64,
        ),
        (
            "mference_prompt_tokens_cached_total",
            "Prompt tokens whose KV came from the retained prefix.",
            ss.cached_tokens as f64,
        ),
        (
            "mference_generation_tokens_total",
            "Generated tokens of finished requests (usage.completion_tokens).",
            ss.completion_tokens as f64,
        ),
        (
            "mference_prefill_tokens_total",
            "Prompt tokens run through the model (not cached).",
            ss.prefill.tokens as f64,
        ),
        (
            "mference_prefill_seconds_total",
            "Seconds spent in prefill.",
            ss.prefill.seconds,
        ),
        (
            "mference_decode_tokens_total",
            "Decode forwards (one token each).",
            ss.decode.tokens as f64,
        ),
        (
            "mference_decode_seconds_total",
            "Seconds from the end of prefill to the last decode forward.",
            ss.decode.seconds,
        ),
        (
            "mference_expert_cache_hits_total",
            "Routed experts found in a slot.",
            ss.experts.hits as f64,
        ),
        (
            "mference_expert_cache_misses_total",
            "Routed experts read from their layer file.",
            ss.experts.misses as f64,
        ),
        (
            "mference_expert_bytes_read_total",
            "Bytes read from the expert layer files.",
            ss.experts.bytes_read as f64,
        ),
        (
            "mference_expert_read_wait_seconds_total",
            "Seconds the compute thread waited for expert reads.",
            ss.experts.read_wait_s,
        ),
        (
            "mference_requests_running",
            "Requests being generated.",
            s.queue.running as f64,
        ),
        (
            "mference_requests_waiting",
            "Requests waiting in the queue.",
            s.queue.waiting as f64,
        ),
        (
            "mference_prefill_tokens_per_second",
            "Prefill tokens per second of the latest request (0 before one).",
            rate(|r| r.prefill.tokens_per_s),
        ),
        (
            "mference_decode_tokens_per_second",
            "Decode tokens per second of the latest request (0 before one).",
            rate(|r| r.decode.tokens_per_s),
        ),
        (
            "mference_kv_cache_tokens",
            "Positions the KV cache holds.",
            s.kv_cache_tokens as f64,
        ),
        (
            "mference_kv_cache_bytes",
            "Bytes of KV cache and recurrent state.",
            m.kv_cache_bytes as f64,
        ),
        (
            "mference_process_resident_memory_bytes",
            "Resident set size of the process (VmRSS).",
            m.rss_bytes.unwrap_or(0) as f64,
        ),
        (
            "mference_process_peak_resident_memory_bytes",
            "Peak resident set size of the process (VmHWM).",
            m.peak_rss_bytes.unwrap_or(0) as f64,
        ),
        (
            "mference_resident_weights_bytes",
            "Bytes of the mapped resident weights (model_weights.bin).",
            m.resident_weights_bytes as f64,
        ),
        (
            "mference_expert_slot_bytes",
            "Bytes of expert slots allocated so far.",
            m.expert_slot_bytes as f64,
        ),
        (
            "mference_expert_slot_capacity_bytes",
            "Bytes of expert slots once every MoE layer is used.",
            m.expert_slot_capacity_bytes as f64,
        ),
        (
            "mference_expert_slots_per_layer",
            "Expert cache slots per MoE layer.",
            i.slots_per_layer as f64,
        ),
        (
            "mference_uptime_seconds",
            "Seconds since the server started.",
            s.uptime_s,
        ),
    ];
    for (name, help, v) in plain {
        let kind = if name.ends_with("_total") {
            "counter"
        } else {
            "gauge"
        };
        family(&mut o, name, kind, help).value(v);
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::{Live, ServerInfo};

    fn snapshot() -> Snapshot {
        let info = ServerInfo {
            model: "m".into(),
            device: "cpu avx2 x2".into(),
            threads: 2,
            max_context: 4096,
            prefill_chunk: 128,
            prompt_cache: "single-prefix",
            expert_slots: "16".into(),
            expert_policy: "lfu",
            slots_per_layer: 16,
            experts_per_layer: 128,
            moe_layers: 30,
            expert_stride_bytes: 1 << 20,
            io: "o_direct",
            resident_weights_bytes: 1 << 30,
        };
        let mut s = Live::new(info).snapshot(2);
        s.session.requests.insert("stop", 3);
        s.session.requests.insert("length", 1);
        s.session.rejected.insert(429, 2);
        s.session.prompt_tokens = 120;
        // TTFTs 0.05, 0.3, 0.3, 20 s: cumulative counts per bound.
        for t in [0.05, 0.3, 0.3, 20.0] {
            for (b, le) in s.ttft_buckets.iter_mut().zip(TTFT_BUCKETS) {
                *b += u64::from(t <= le);
            }
            s.ttft_sum_s += t;
            s.ttft_count += 1;
        }
        s
    }

    /// The exposition format's rules (prometheus.io, "Text-based format"): one HELP and one TYPE
    /// line per family before its samples, names `[a-zA-Z_:][a-zA-Z0-9_:]*`, counters `_total`,
    /// histogram buckets cumulative in increasing `le` ending with `+Inf` = `_count`.
    #[test]
    fn the_page_follows_the_text_format() {
        let text = render(&snapshot());
        let mut families: Vec<(String, String)> = Vec::new();
        let mut buckets: Vec<(f64, f64)> = Vec::new();
        let mut count = None;
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').unwrap();
                assert!(!families.iter().any(|(n, _)| n == name), "{name} twice");
                families.push((name.into(), kind.into()));
                continue;
            }
            if line.starts_with("# HELP ") {
                continue;
            }
            let (name, value) = line.rsplit_once(' ').unwrap();
            let value: f64 = value.parse().unwrap_or_else(|_| panic!("{line}"));
            let bare = name.split('{').next().unwrap();
            assert!(bare.starts_with("mference_"), "{line}");
            assert!(
                bare.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
                "{line}"
            );
            let (family, kind) = families.last().expect("a sample before its TYPE line");
            assert!(bare.starts_with(family.as_str()), "{line} under {family}");
            match kind.as_str() {
                "counter" => assert!(bare.ends_with("_total"), "{line}"),
                "histogram" if bare.ends_with("_bucket") => {
                    let le = name.split("le=\"").nth(1).unwrap().trim_end_matches("\"}");
                    let le = if le == "+Inf" {
                        f64::INFINITY
                    } else {
                        le.parse().unwrap()
                    };
                    buckets.push((le, value));
                }
                "histogram" if bare.ends_with("_count") => count = Some(value),
                _ => {}
            }
        }
        assert!(buckets
            .windows(2)
            .all(|w| w[0].0 < w[1].0 && w[0].1 <= w[1].1));
        assert_eq!(buckets.last().unwrap(), &(f64::INFINITY, 4.0));
        assert_eq!(count, Some(4.0));
        let at = |le: f64| buckets.iter().find(|b| b.0 == le).unwrap().1;
        assert_eq!(
            (at(0.04), at(0.06), at(0.25), at(0.5), at(10.0), at(30.0)),
            (0.0, 1.0, 1.0, 3.0, 3.0, 4.0)
        );
        assert!(text.contains("mference_requests_total{finish_reason=\"length\"} 1\n"));
        assert!(text.contains("mference_requests_total{finish_reason=\"stop\"} 3\n"));
        assert!(text.contains("mference_prompt_tokens_total 120\n"));
        assert!(text.contains("mference_requests_rejected_total{status=\"429\"} 2\n"));
        assert!(text.contains("mference_requests_waiting 2\n"));
        // 30 layers x 16 slots x 1 MiB.
        assert!(text.contains("mference_expert_slot_capacity_bytes 503316480\n"));
        assert!(text.contains("io=\"o_direct\""));
    }

    #[test]
    fn values_are_go_floats() {
        assert_eq!(number(3.0), "3");
        assert_eq!(number(0.25), "0.25");
        assert_eq!(number(f64::INFINITY), "+Inf");
        assert_eq!(number(f64::NEG_INFINITY), "-Inf");
        assert_eq!(number(f64::NAN), "NaN");
        assert_eq!(number(1e20), "100000000000000000000");
        assert_eq!(number(-2.5), "-2.5");
    }

    #[test]
    fn help_and_label_values_are_escaped() {
        let mut o = String::new();
        family(&mut o, "mference_x", "gauge", "a \\ b\nc \"q\"").sample(
            "",
            &[("device", "cpu \"x\" \\ \n"), ("io", "mmap")],
            1.0,
        );
        assert_eq!(
            o,
            "# HELP mference_x a \\\\ b\\nc \"q\"\n# TYPE mference_x gauge\n\
             mference_x{device=\"cpu \\\"x\\\" \\\\ \\n\",io=\"mmap\"} 1\n"
        );
    }
}
