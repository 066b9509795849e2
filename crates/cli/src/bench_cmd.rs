//! `bench`: fixed prompts (short, medium, long) each in a fresh process, one table and one JSON
//! document. The parent re-executes this binary with the hidden `--child` flag; the child loads the
//! model, runs one prompt, and prints one JSON line (peak RSS is the child's VmHWM, and the peaks of
//! its anonymous and file-backed parts, sampled: [`crate::rss_peak`]).
//!
//! Prompts are deterministic pseudo-random token ids inside the vocabulary (no tokenizer involved),
//! as llama-bench uses random ids: both engines then see the same kind of input. Decode feeds the
//! greedy token back (`--decode greedy`) or, like llama-bench's tg test, a pseudo-random id each
//! step (`--decode forced`); every step computes the full head either way.

use crate::notes::say;
use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::{json, Value};

use mference_models::{Logits, Want};
use mference_runtime::StreamerStats;

use crate::flags::{count, ModelArgs};
use crate::load_options::load_options;

/// Named prompt lengths (tokens): about the original's community prompts (61 / 430 / 3,015),
/// rounded to sizes that fit `--max-context 4096` with room to decode.
const NAMED: [(&str, usize); 3] = [("short", 64), ("medium", 512), ("long", 2048)];

/// `mference bench`: the model flags with bench's own defaults (16 expert-cache slots, and
/// `--verify trusted-receipt` so no layer hashing lands in the timed prefill), then its own.
#[derive(Args, Debug)]
#[command(
    mut_arg("expert_cache_slots", |a| a.default_value("16")),
    mut_arg("verify", |a| a.default_value("trusted-receipt")),
)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prefill chunk rows: 32 … 4096, or auto (the prompt length rounded up to an allowed chunk, at most 512).
    #[arg(long, default_value = "auto", value_parser = crate::run_cmd::prefill_chunk_flag())]
    pub prefill_chunk: String,
    /// Positions the KV cache holds.
    #[arg(long, default_value_t = 4096, value_parser = count(1, usize::MAX))]
    pub max_context: usize,
    /// Tokens to decode after each prompt (at least 1).
    #[arg(long, default_value_t = 64, value_parser = count(1, usize::MAX))]
    pub gen: usize,
    /// Comma-separated prompts: short (64), medium (512), long (2048), or token counts.
    #[arg(long, default_value = "short,medium,long")]
    pub prompts: String,
    /// Measured runs per prompt (each a fresh process); the table shows medians.
    #[arg(long, default_value_t = 1, value_parser = count(1, usize::MAX))]
    pub repeats: usize,
    /// Discarded runs per prompt before the measured ones.
    #[arg(long, default_value_t = 0)]
    pub warmup: usize,
    /// Decode input: greedy (the argmax fed back) or forced (pseudo-random ids, as llama-bench tg).
    #[arg(long, default_value = "greedy")]
    pub decode: String,
    /// Replay this recorded expert routing (`.npy`, uint8 [tokens, layers, top_k], e.g.
    /// assets/traces/gemma4-26b-a4b-routing.npy) as the routers' choice: realistic cache hit rates
    /// on synthetic checkpoints, whose random routers pick near-uniformly.
    #[arg(long)]
    pub routing_trace: Option<PathBuf>,
    /// DeepSeek-V4's shadow prefetch of the next layer's predicted experts in decode: on or off
    /// (other families have none; the output is the same either way).
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    pub shadow_prefetch: String,
    /// Also write the JSON document to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Internal: run one prompt of this many tokens in this process and print one JSON line.
    #[arg(long, hide = true)]
    pub child: Option<usize>,
}

/// `mference bench`.
pub fn bench(a: BenchArgs) -> Result<()> {
    validate(&a)?;
    if let Some(n) = a.child {
        let r = child(&a, n)?;
        println!("{r}");
        return Ok(());
    }
    // What the children would only find out one by one, checked once up front.
    crate::run_cmd::check_install_dir(&a.model.model)?;
    if let Some(m) = crate::run_cmd::max_positions(&a.model.model)? {
        if a.max_context > m {
            bail!(
                "--max-context {} exceeds the model's max_position_embeddings {m}",
                a.max_context
            );
        }
    }
    if let Some(dir) = a.json.as_ref().and_then(|p| p.parent()) {
        if !dir.as_os_str().is_empty() && !dir.is_dir() {
            bail!(
                "--json {}: {} is not a directory",
                a.json.as_ref().unwrap().display(),
                dir.display()
            );
        }
    }
    let prompts = parse_prompts(&a.prompts)?;
    let exe = std::env::current_exe().context("locating the mference binary")?;
    let mut runs: Vec<Value> = Vec::new();
    for (name, n) in &prompts {
        for i in 0..a.warmup + a.repeats {
            let warm = i < a.warmup;
            say!(
                "[bench] {name} ({n} tokens) {} {}/{}",
                if warm { "warmup" } else { "run" },
                if warm { i + 1 } else { i - a.warmup + 1 },
                if warm { a.warmup } else { a.repeats }
            );
            let mut r = spawn_child(&exe, &a, *n)?;
            if !warm {
                r["prompt"] = json!(name);
                runs.push(r);
            }
        }
    }
    let summary: Vec<Value> = prompts
        .iter()
        .map(|(name, _)| median_row(name, &runs))
        .collect();
    let first = &runs[0];
    // The chunk each prompt really ran with (`auto` picks one per prompt length).
    let effective: serde_json::Map<String, Value> = prompts
        .iter()
        .filter_map(|(name, _)| {
            let r = runs.iter().find(|r| r["prompt"] == json!(name))?;
            Some((name.clone(), r["prefill_chunk"].clone()))
        })
        .collect();
    let doc = json!({
        "model": a.model.model.display().to_string(),
        "settings": {
            "slots": first["slots"], "expert_cache_policy": first["expert_cache_policy"],
            "expert_cache": first["expert_cache"], "threads": first["threads"], "direct_io": first["direct_io"],
            "prefill_chunk": a.prefill_chunk, "prefill_chunk_effective": effective, "ctx": a.max_context, "gen": a.gen, "decode": a.decode,
            "repeats": a.repeats, "warmup": a.warmup, "kernels": first["kernels"],
            "routing": first["routing"], "device": first["device"], "flash_head": a.model.flash_head,
            "router_lookahead": a.model.router_lookahead,
        },
        "summary": summary,
        "runs": runs,
    });
    print_table(&doc);
    let text = serde_json::to_string(&doc)?;
    if let Some(p) = &a.json {
        std::fs::write(p, format!("{text}\n"))
            .with_context(|| format!("writing {}", p.display()))?;
    }
    println!("{text}");
    Ok(())
}

fn validate(a: &BenchArgs) -> Result<()> {
    if !matches!(a.decode.as_str(), "greedy" | "forced") {
        bail!(
            "invalid --decode '{}': allowed values are greedy, forced",
            a.decode
        );
    }
    // Each flag's own value is checked by clap; what it cannot check alone is here.
    crate::load_options::device_flags(&a.model)?;
    for (_, n) in parse_prompts(&a.prompts)? {
        if n + a.gen > a.max_context {
            bail!(
                "a {n}-token prompt plus --gen {} does not fit --max-context {}",
                a.gen,
                a.max_context
            );
        }
    }
    Ok(())
}

fn parse_prompts(s: &str) -> Result<Vec<(String, usize)>> {
    if s.trim().is_empty() {
        bail!("--prompts is empty");
    }
    let mut out = Vec::new();
    for p in s.split(',').map(str::trim) {
        if p.is_empty() {
            bail!("invalid --prompts '{s}': an empty entry between commas");
        }
        let n = match NAMED.iter().find(|(k, _)| *k == p) {
            Some((_, n)) => *n,
            None => match p.parse::<usize>() {
                Ok(n) if n > 0 => n,
                _ => {
                    bail!("invalid --prompts entry '{p}': use short, medium, long or a token count")
                }
            },
        };
        out.push((p.to_string(), n));
    }
    Ok(out)
}

/// The child's arguments: the parent's model flags ([`ModelArgs::child_args`]) and bench flags,
/// plus `--child N`. Values go as `--flag=value`, so one that starts with `-` stays the flag's
/// value.
fn spawn_child(exe: &std::path::Path, a: &BenchArgs, n: usize) -> Result<Value> {
    let mut cmd = Command::new(exe);
    cmd.arg("bench")
        .args(a.model.child_args())
        .arg(format!("--prefill-chunk={}", a.prefill_chunk))
        .arg(format!("--max-context={}", a.max_context))
        .arg(format!("--gen={}", a.gen))
        .arg(format!("--prompts={n}"))
        .arg(format!("--decode={}", a.decode))
        .arg(format!("--shadow-prefetch={}", a.shadow_prefetch))
        .arg(format!("--child={n}"));
    if let Some(t) = &a.routing_trace {
        let mut arg = std::ffi::OsString::from("--routing-trace=");
        arg.push(t);
        cmd.arg(arg);
    }
    // The child dies with the parent (a killed bench leaves no measurement running).
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: between fork and exec the closure calls only async-signal-safe functions
    // (prctl, getppid, kill) and touches no memory of the parent.
    unsafe {
        use std::os::unix::process::CommandExt;
        cmd.pre_exec(move || {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            // The parent may have died before the prctl took hold.
            if libc::getppid() != parent {
                libc::kill(libc::getpid(), libc::SIGTERM);
            }
            Ok(())
        });
    }
    let out = cmd
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("starting the bench child process")?;
    if !out.status.success() {
        bail!("bench child for a {n}-token prompt failed ({})", out.status);
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .last()
        .context("the bench child printed nothing")?;
    serde_json::from_str(line).with_context(|| format!("bench child output is not JSON: {line}"))
}

/// Deterministic pseudo-random ids in `[lo, vocab)` (splitmix64): the same prompt for every run
/// and engine (`tools/bench` feeds llama.cpp the same ids).
pub fn prompt_ids(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let lo = 1000.min(vocab / 2) as u64;
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            (lo + z % (vocab as u64 - lo)) as u32
        })
        .collect()
}

fn sum(stats: &[StreamerStats]) -> StreamerStats {
    let mut t = StreamerStats::default();
    for s in stats {
        t.add(s);
    }
    t
}

/// A `/proc/self/status` field given in kB (`VmHWM`, `RssAnon`, …), in bytes; 0 if missing.
fn status_bytes(key: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.strip_prefix(key).is_some_and(|r| r.starts_with(':')))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map(|kib| kib * 1024)
        .unwrap_or(0)
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// One prompt in this process: load, prefill, decode; returns the JSON line.
fn child(a: &BenchArgs, n: usize) -> Result<Value> {
    let rss = crate::rss_peak::PeakSampler::start(std::time::Duration::from_millis(20));
    let chunk = crate::run_cmd::parse_prefill_chunk(&a.prefill_chunk, Some(n))?;
    let mut opts = load_options(&a.model, chunk, a.max_context)?;
    opts.routing_trace = a.routing_trace.clone();
    opts.shadow_prefetch = a.shadow_prefetch == "on";
    let slots = match opts.slots {
        mference_runtime::CacheSlots::Fixed(k) => json!(k),
        mference_runtime::CacheSlots::Resident => json!("resident"),
    };
    let t_load = Instant::now();
    let mut model = mference_models::load(&a.model.model, &opts)?;
    let load_s = t_load.elapsed().as_secs_f64();
    say!(
        "[bench: loaded in {load_s:.2}s, device {}, expert cache {}, routing {}]",
        model.device(),
        model.engine().expert_cache(),
        model.engine().routing()
    );
    rss.sample_now();
    let vocab = model.vocab_size();
    let prompt = prompt_ids(n, vocab, 0x6D66_6572_656E_6365 ^ n as u64);

    let t0 = Instant::now();
    let Logits::Rows(last) = model.forward(&prompt, Want::Last)? else {
        bail!("the model returned no logits for the prompt")
    };
    let prefill_s = t0.elapsed().as_secs_f64();
    rss.sample_now();
    let mut finite = last.iter().all(|v| v.is_finite());
    let after_prefill = sum(&model.expert_stats());
    let gpu_prefill = model.device_expert_stats().unwrap_or_default();
    let (layers_prefill, times_prefill) = (model.expert_stats(), model.step_times());

    let mut next = argmax(&last);
    let mut generated = vec![next];
    let forced = prompt_ids(a.gen, vocab, 0x6465_636F_6465 ^ n as u64);
    let t1 = Instant::now();
    // gen tokens are produced: the first by the prefill, gen - 1 by decode steps; the last step
    // returns full logits so finiteness is checked at the end too.
    for i in 1..a.gen {
        let input = if a.decode == "forced" {
            forced[i - 1]
        } else {
            next
        };
        next = if i + 1 == a.gen {
            let Logits::Rows(l) = model.forward(&[input], Want::Last)? else {
                bail!("the model returned no logits")
            };
            // FlashHead leaves the logits outside its probed clusters at -inf by design.
            finite &= if a.model.flash_head {
                l.iter().all(|v| !v.is_nan() && *v != f32::INFINITY)
                    && l.iter().any(|v| v.is_finite())
            } else {
                l.iter().all(|v| v.is_finite())
            };
            argmax(&l)
        } else {
            match model.forward(&[input], Want::Argmax)? {
                Logits::Argmax(id) => id,
                Logits::Rows(l) => argmax(&l),
                Logits::None => bail!("the model returned no logits"),
            }
        };
        generated.push(next);
    }
    let decode_s = t1.elapsed().as_secs_f64();
    let peaks = rss.finish();
    let total = sum(&model.expert_stats());
    let gpu = model.device_expert_stats();
    let steps = (a.gen - 1) as f64;
    let layers = per_layer(
        &layers_prefill,
        &model.expert_stats(),
        &times_prefill,
        &model.step_times(),
        steps,
    );
    let dec_hits = total.hits - after_prefill.hits;
    let dec_misses = total.misses - after_prefill.misses;
    let dec_bytes = total.bytes_read - after_prefill.bytes_read;
    let dec_wait = (total.read_wait - after_prefill.read_wait).as_secs_f64();
    let rate = |h: u64, m: u64| {
        if h + m == 0 {
            0.0
        } else {
            h as f64 / (h + m) as f64
        }
    };
    let per = |x: f64| if steps > 0.0 { x / steps } else { 0.0 };
    // The GPU expert slots (CUDA only): decode hit rate, host-to-device bytes and the wait for
    // those copies per token.
    let gpu_json = gpu.map(|g| {
        json!({
            "slots_per_layer": g.slots_per_layer,
            "slab_bytes": g.slab_bytes,
            "staging_bytes": g.staging_bytes,
            "prefill_hit_rate": rate(gpu_prefill.hits, gpu_prefill.misses),
            "prefill_h2d_bytes": gpu_prefill.h2d_bytes,
            "hit_rate": rate(g.hits - gpu_prefill.hits, g.misses - gpu_prefill.misses),
            "h2d_bytes_per_token": per((g.h2d_bytes - gpu_prefill.h2d_bytes) as f64),
            "copy_wait_per_token_s": per((g.copy_wait - gpu_prefill.copy_wait).as_secs_f64()),
            "device_routed_layers_per_token": per((g.device_routed - gpu_prefill.device_routed) as f64),
            "launches_per_token": per((g.launches - gpu_prefill.launches) as f64),
            "host_share_percent": g.host_share,
            "host_experts_per_token": per((g.host_computed - gpu_prefill.host_computed) as f64),
            "host_time_per_token_s": per((g.host_time - gpu_prefill.host_time).as_secs_f64()),
            // Router lookahead copies, and the later uses they served.
            "prefetched_per_token": per((g.prefetched - gpu_prefill.prefetched) as f64),
            "prefetch_hits_per_token": per((g.prefetch_hits - gpu_prefill.prefetch_hits) as f64),
        })
    });
    Ok(json!({
        "pid": std::process::id(),
        "prompt_tokens": n,
        "gen_tokens": generated.len(),
        "load_s": load_s,
        "prefill_s": prefill_s,
        "prefill_tok_s": n as f64 / prefill_s,
        "ttft_s": prefill_s,
        "decode_s": decode_s,
        // No decode step (--gen 1: the first token comes from the prompt): no rate, not 0.
        "decode_tok_s": (steps > 0.0 && decode_s > 0.0).then(|| steps / decode_s),
        // Peak resident set (VmHWM), and what is resident at the end split into anonymous memory
        // (slots, KV cache, buffers) and mapped file pages (the resident weights: page cache the
        // kernel can drop and re-read, which macOS's footprint does not count).
        "peak_rss_bytes": status_bytes("VmHWM"),
        "rss_anon_bytes": status_bytes("RssAnon"),
        "rss_file_bytes": status_bytes("RssFile"),
        // The peaks of each part (sampled every 20 ms and at the end of load, prefill and decode;
        // not necessarily at the same moment).
        "peak_rss_anon_bytes": peaks.anon,
        "peak_rss_file_bytes": peaks.file,
        "rss_samples": peaks.samples,
        "kv_bytes": model.kv_bytes(),
        "prefill_hit_rate": rate(after_prefill.hits, after_prefill.misses),
        "prefill_bytes_read": after_prefill.bytes_read,
        "prefill_read_wait_s": after_prefill.read_wait.as_secs_f64(),
        "hit_rate": rate(dec_hits, dec_misses),
        "bytes_per_token": per(dec_bytes as f64),
        "read_wait_per_token_s": per(dec_wait),
        "compute_per_token_s": per(decode_s - dec_wait),
        "shadow_prefetch": opts.shadow_prefetch,
        "router_lookahead": opts.router_lookahead,
        "prefetch_reads_per_token": per((total.prefetch_reads - after_prefill.prefetch_reads) as f64),
        "prefetch_used_per_token": per((total.prefetch_used - after_prefill.prefetch_used) as f64),
        "layers": layers,
        "finite": finite,
        "generated": generated,
        "slots": slots,
        "expert_cache_policy": model.engine().expert_policy.name(),
        // Slots per layer, policy and I/O mode in words (what the load line prints).
        "expert_cache": model.engine().expert_cache(),
        "threads": model.engine().threads,
        // What the load used: `--slots auto` turns O_DIRECT on by itself under a cap.
        "direct_io": opts.direct_io,
        "prefill_chunk": chunk,
        "ctx": a.max_context,
        "decode": a.decode,
        "kernels": model.engine().kernels_label,
        "routing": model.engine().routing(),
        "device": model.engine().device,
        // What `--device auto` found missing when it ran on the CPU (null otherwise).
        "device_fallback": model.engine().device_fallback,
        "gpu_expert_cache": gpu_json,
    }))
}

/// Per decode token and layer (families that record [`mference_models::StepTimes`]; else null):
/// attention and FFN milliseconds (the FFN's read-wait included), read-wait, MiB read and hits,
/// plus the head's milliseconds.
fn per_layer(
    stats_before: &[StreamerStats],
    stats_after: &[StreamerStats],
    before: &mference_models::StepTimes,
    after: &mference_models::StepTimes,
    steps: f64,
) -> Value {
    if after.layers.is_empty() || steps == 0.0 {
        return Value::Null;
    }
    let ms = |a: std::time::Duration, b: std::time::Duration| (a - b).as_secs_f64() * 1e3 / steps;
    let zero = StreamerStats::default();
    let rows: Vec<Value> = after
        .layers
        .iter()
        .zip(&before.layers)
        .enumerate()
        .map(|(l, (t, t0))| {
            let s = stats_after.get(l).unwrap_or(&zero);
            let s0 = stats_before.get(l).unwrap_or(&zero);
            let (hits, misses) = (s.hits - s0.hits, s.misses - s0.misses);
            json!({
                "layer": l,
                "attention_ms": ms(t[0], t0[0]),
                "ffn_ms": ms(t[1], t0[1]),
                "read_wait_ms": ms(s.read_wait, s0.read_wait),
                "mib_read": (s.bytes_read - s0.bytes_read) as f64 / steps / (1u64 << 20) as f64,
                "hit_rate": if hits + misses == 0 { 0.0 } else { hits as f64 / (hits + misses) as f64 },
            })
        })
        .collect();
    json!({"per_token": rows, "head_ms": ms(after.head, before.head)})
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn median_row(name: &str, runs: &[Value]) -> Value {
    let mine: Vec<&Value> = runs.iter().filter(|r| r["prompt"] == name).collect();
    let m = |k: &str| median(mine.iter().filter_map(|r| r[k].as_f64()).collect());
    let g = |k: &str| {
        median(
            mine.iter()
                .filter_map(|r| r["gpu_expert_cache"][k].as_f64())
                .collect(),
        )
    };
    let gpu = if mine[0]["gpu_expert_cache"].is_object() {
        json!({
            "slots_per_layer": mine[0]["gpu_expert_cache"]["slots_per_layer"],
            "prefill_hit_rate": g("prefill_hit_rate"),
            "hit_rate": g("hit_rate"),
            "h2d_bytes_per_token": g("h2d_bytes_per_token"),
            "copy_wait_per_token_s": g("copy_wait_per_token_s"),
            "device_routed_layers_per_token": g("device_routed_layers_per_token"),
            "launches_per_token": g("launches_per_token"),
            "host_share_percent": mine[0]["gpu_expert_cache"]["host_share_percent"],
            "host_experts_per_token": g("host_experts_per_token"),
            "host_time_per_token_s": g("host_time_per_token_s"),
            "prefetched_per_token": g("prefetched_per_token"),
            "prefetch_hits_per_token": g("prefetch_hits_per_token"),
        })
    } else {
        Value::Null
    };
    json!({
        "prompt": name,
        "runs": mine.len(),
        "prompt_tokens": mine[0]["prompt_tokens"],
        "gen_tokens": mine[0]["gen_tokens"],
        "prefill_s": m("prefill_s"),
        "prefill_tok_s": m("prefill_tok_s"),
        "ttft_s": m("ttft_s"),
        "decode_tok_s": mine
            .iter()
            .any(|r| r["decode_tok_s"].is_number())
            .then(|| m("decode_tok_s")),
        "peak_rss_bytes": m("peak_rss_bytes"),
        "rss_anon_bytes": m("rss_anon_bytes"),
        "rss_file_bytes": m("rss_file_bytes"),
        "peak_rss_anon_bytes": m("peak_rss_anon_bytes"),
        "peak_rss_file_bytes": m("peak_rss_file_bytes"),
        "hit_rate": m("hit_rate"),
        "bytes_per_token": m("bytes_per_token"),
        "read_wait_per_token_s": m("read_wait_per_token_s"),
        "compute_per_token_s": m("compute_per_token_s"),
        "gpu_expert_cache": gpu,
        "finite": mine.iter().all(|r| r["finite"] == true),
    })
}

fn print_table(doc: &Value) {
    let s = &doc["settings"];
    let mut chunk = s["prefill_chunk"].as_str().unwrap_or("").to_string();
    if let Some(eff) = s["prefill_chunk_effective"].as_object() {
        let each: Vec<String> = eff.iter().map(|(p, c)| format!("{p} {c}")).collect();
        if chunk == "auto" && !each.is_empty() {
            chunk = format!("auto ({})", each.join(", "));
        }
    }
    println!(
        "model {}  slots {}  policy {}  threads {}  direct-io {}  prefill-chunk {}  ctx {}  gen {}  decode {}  kernels {}  routing {}  device {}  router-lookahead {}  (medians of {} run(s))",
        doc["model"].as_str().unwrap_or(""),
        s["slots"].as_str().map_or(s["slots"].to_string(), str::to_string),
        s["expert_cache_policy"].as_str().unwrap_or(""),
        s["threads"],
        s["direct_io"],
        chunk,
        s["ctx"],
        s["gen"],
        s["decode"].as_str().unwrap_or(""),
        s["kernels"].as_str().unwrap_or(""),
        s["routing"].as_str().unwrap_or(""),
        s["device"].as_str().unwrap_or(""),
        s["router_lookahead"],
        s["repeats"]
    );
    println!(
        "{:<8} {:>7} {:>9} {:>10} {:>8} {:>10} {:>9} {:>9} {:>9} {:>6} {:>9} {:>10} {:>10}",
        "prompt",
        "tokens",
        "prefill_s",
        "prefill/s",
        "TTFT_s",
        "decode/s",
        "RSS_MiB",
        "anon_MiB",
        "file_MiB",
        "hit%",
        "MiB/tok",
        "wait_ms/t",
        "comp_ms/t"
    );
    for r in doc["summary"].as_array().into_iter().flatten() {
        let f = |k: &str| r[k].as_f64().unwrap_or(0.0);
        println!(
            "{:<8} {:>7} {:>9.3} {:>10.2} {:>8.3} {:>10} {:>9.0} {:>9.0} {:>9.0} {:>6.1} {:>9.1} {:>10.2} {:>10.2}{}",
            r["prompt"].as_str().unwrap_or(""),
            // A number, not a JSON value: a value's Display ignores the column width.
            r["prompt_tokens"].as_u64().unwrap_or(0),
            f("prefill_s"),
            f("prefill_tok_s"),
            f("ttft_s"),
            match r["decode_tok_s"].as_f64() {
                Some(v) => format!("{v:.3}"),
                None => "n/a".into(),
            },
            f("peak_rss_bytes") / 1048576.0,
            f("peak_rss_anon_bytes") / 1048576.0,
            f("peak_rss_file_bytes") / 1048576.0,
            f("hit_rate") * 100.0,
            f("bytes_per_token") / 1048576.0,
            f("read_wait_per_token_s") * 1e3,
            f("compute_per_token_s") * 1e3,
            if r["finite"] == true {
                ""
            } else {
                "  NON-FINITE LOGITS"
            }
        );
    }
}
