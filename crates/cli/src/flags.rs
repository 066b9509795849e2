//! The model flags: one typed table ([`ModelArgs`]) flattened into every subcommand that loads a
//! model (run, perplexity, logits, serve, bench), its value types, and its one conversion to a
//! `bench` child's argument list ([`ModelArgs::child_args`]). The conversion to the models' load
//! options is [`crate::load_options::load_options`].
//!
//! A new load option is a field here (its doc, default and type) and one line in `load_options`;
//! `bench` forwards it to its children through `Serialize`, as `--flag=value`.

use std::ffi::{OsStr, OsString};
use std::path::PathBuf;

use clap::builder::TypedValueParser;
use clap::error::ErrorKind;
use clap::{Args, ValueEnum};
use serde::{Serialize, Serializer};

use mference_format::VerifyPolicy;
use mference_kernels::Kernels;
use mference_models::{Device, GpuExpertBudget, MissSplit};
use mference_runtime::{CacheSlots, ExpertPolicy, KvDtype};

/// Options shared by every command that loads a model. `bench` sets its own defaults for
/// `--expert-cache-slots` and `--verify` ([`crate::bench_cmd::BenchArgs`]).
#[derive(Args, Clone, Debug, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct ModelArgs {
    /// The installed model directory (`<name>.gturbo`).
    #[arg(long)]
    #[serde(skip)]
    pub model: PathBuf,
    /// Expert cache slots per layer: 8, 16, 24, 32, 64, 96, 128, resident, or auto (by family and RAM).
    #[arg(long, visible_alias = "slots", default_value = "auto", value_parser = typed(Slots::parse))]
    pub expert_cache_slots: Slots,
    /// Host expert-cache policy: lfu (per-layer slots, least frequently used leaves), lru
    /// (per-layer, least recently used leaves) or pool (every layer's slots in one LFU pool, so
    /// hot layers hold more). The same total slots and the same outputs under each.
    #[arg(long, value_enum, default_value_t = Policy::Lfu)]
    pub expert_cache_policy: Policy,
    /// Integrity check at load: full-sha256 or trusted-receipt.
    #[arg(long, value_enum, default_value_t = Verify::FullSha256, hide_possible_values = true)]
    pub verify: Verify,
    /// Read experts with O_DIRECT (no second copy in the page cache).
    #[arg(long)]
    pub direct_io: bool,
    /// Kernel worker threads, 1 up to 4x the cores (default: all cores).
    #[arg(long, value_parser = typed(threads))]
    pub threads: Option<usize>,
    /// KV cache element type: f16 (half the memory) or f32 (K and V kept exactly).
    #[arg(long, value_enum, default_value_t = KvCache::F16, hide_possible_values = true)]
    pub kv_cache: KvCache,
    /// Kernel table: auto (Gemma 4 and Qwen 3.6: amx, else avx512i16, else avx2i16, where this CPU
    /// has them; otherwise and for the other families the fastest exact one), scalar, avx2, avx512 (the
    /// exact f32 tables), avx512i16 (int16 activations in every 4-bit product: ~2x the prompt
    /// products and ~13% faster decode products than avx512, perplexity within 0.01% of it on
    /// the bundled models, but off mlx-lm by up to 0.8 of max|logit| on random-weight Gemma
    /// checkpoints), amx
    /// (avx512i16's bits with its prompt products on AMX tiles, Intel Xeon from Sapphire Rapids
    /// on), avx2i16 (avx512i16's rounding on AVX2 CPUs: prompts 1.3-2.2x and decode 0.96-1.25x
    /// the avx2 table's on an AMD Zen 3, perplexity within 0.006% of it), or avx512vnni (int8 activations in
    /// prefill: 1.5-2.2x the prompt speed on Gemma 26B, perplexity +0.1-0.4% on the bundled models; a
    /// prompt row's logits then depend on the chunk, so a seeded reply can change with the prompt
    /// cache). The rounded ones only for Gemma 4 and Qwen 3.6.
    #[arg(long, default_value = "auto", value_parser = typed(KernelTable::parse))]
    pub kernels: KernelTable,
    /// Where the ops run: cpu, cuda, cuda:N, or auto (the first CUDA device when a driver and
    /// NVRTC are present, else the CPU). On CUDA, routed experts live in GPU slots
    /// (--gpu-expert-budget) fed from the host tier.
    #[arg(long, default_value = "cpu", value_parser = typed(Device::parse))]
    #[serde(serialize_with = "device_text")]
    pub device: Device,
    /// CUDA: device memory for routed experts, over all layers: auto (what is free after the
    /// weights and KV, less 1 GiB or 5%; at least 3 x top-k slots per layer), resident (every
    /// expert), or bytes (24G, 512M; at least top-k slots per layer).
    /// Not given: auto on CUDA (typed on the CPU, even as `auto`, it is refused).
    #[arg(long, value_parser = typed(gpu_expert_budget))]
    #[serde(serialize_with = "budget_text")]
    pub gpu_expert_budget: Option<GpuExpertBudget>,
    /// The host tier below the GPU slots (page-locked on CUDA), in bytes over all layers (16G,
    /// 512M); instead of --expert-cache-slots.
    #[arg(long, conflicts_with = "expert_cache_slots", value_parser = typed(host_expert_cache))]
    pub host_expert_cache: Option<u64>,
    /// CUDA tests: count every expert use as a GPU miss and copy it in again.
    #[arg(long, hide = true)]
    pub gpu_force_miss: bool,
    /// CUDA under a GPU expert budget below every expert: the share of each token's GPU misses
    /// computed on the CPU (--threads) from the host tier while the rest are copied in: auto
    /// (the default: the balance of one expert's copy and CPU time, measured at load and printed
    /// on the load line), a percentage (0 to 100) to reproduce a run, or off. Not bit-identical
    /// to off (the CPU rounds differently); the same setting gives the same tokens run to run.
    #[arg(long, value_parser = typed(gpu_miss_split))]
    #[serde(serialize_with = "split_text")]
    pub gpu_miss_split: Option<MissSplit>,
    /// Maple only: FlashHead in single-token decode (score the centroids, exact logits for the
    /// probed clusters and the forced tokens, the rest -inf; approximate). Prefill keeps the exact
    /// head.
    #[arg(long)]
    pub flash_head: bool,
    /// Gemma 4 and Qwen 3.6 decode: layer L+1's router on layer L's post-attention state starts
    /// non-blocking reads of its N heaviest predicted experts not yet cached; on CUDA under a GPU
    /// expert budget, copies of those in the host tier into GPU slots (0 = off; the output is the
    /// same either way, on CUDA with --gpu-miss-split off).
    #[arg(long, default_value_t = 0)]
    pub router_lookahead: usize,
}

impl ModelArgs {
    /// Every flag as `--flag=value` (so a value starting with `-` stays the flag's), `--flag` for
    /// a set switch, nothing for an unset one: a child parsing them gets this same table back.
    /// `--host-expert-cache` replaces `--expert-cache-slots`, which clap refuses beside it.
    pub fn child_args(&self) -> Vec<OsString> {
        let mut model = OsString::from("--model=");
        model.push(&self.model);
        let mut out = vec![model];
        let serde_json::Value::Object(flags) =
            serde_json::to_value(self).expect("model flags serialize")
        else {
            unreachable!("a struct serializes to an object")
        };
        for (name, value) in flags {
            if name == "expert-cache-slots" && self.host_expert_cache.is_some() {
                continue;
            }
            match value {
                serde_json::Value::Null | serde_json::Value::Bool(false) => {}
                serde_json::Value::Bool(true) => out.push(format!("--{name}").into()),
                serde_json::Value::String(v) => out.push(format!("--{name}={v}").into()),
                v => out.push(format!("--{name}={v}").into()),
            }
        }
        out
    }
}

/// `--expert-cache-slots`: a fixed count, `resident`, or `auto` (sized to the memory here).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slots {
    Auto,
    Set(CacheSlots),
}

impl Slots {
    /// Parses `8|16|24|32|64|96|128|resident|auto`.
    pub fn parse(s: &str) -> Result<Self, String> {
        if s == "auto" {
            return Ok(Self::Auto);
        }
        CacheSlots::parse(s).map(Self::Set).map_err(|_| {
            format!("invalid expert cache slots '{s}': allowed values are 8, 16, 24, 32, 64, 96, 128, resident, auto")
        })
    }
}

impl Serialize for Slots {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Auto => s.serialize_str("auto"),
            Self::Set(CacheSlots::Resident) => s.serialize_str("resident"),
            Self::Set(CacheSlots::Fixed(n)) => s.serialize_u64(*n as u64),
        }
    }
}

/// `--expert-cache-policy`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    Lfu,
    Lru,
    Pool,
}

impl From<Policy> for ExpertPolicy {
    fn from(p: Policy) -> Self {
        match p {
            Policy::Lfu => Self::Lfu,
            Policy::Lru => Self::Lru,
            Policy::Pool => Self::Pool,
        }
    }
}

/// `--verify`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Verify {
    FullSha256,
    TrustedReceipt,
}

impl From<Verify> for VerifyPolicy {
    fn from(v: Verify) -> Self {
        match v {
            Verify::FullSha256 => Self::FullSha256,
            Verify::TrustedReceipt => Self::TrustedReceipt,
        }
    }
}

/// `--kv-cache`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum KvCache {
    F16,
    F32,
}

impl From<KvCache> for KvDtype {
    fn from(k: KvCache) -> Self {
        match k {
            KvCache::F16 => Self::F16,
            KvCache::F32 => Self::F32,
        }
    }
}

/// `--kernels`: `None` for `auto` (detection, or `MFERENCE_KERNELS`), else a table this CPU runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelTable(pub Option<&'static str>);

impl KernelTable {
    /// Parses `auto` or the name of a kernel table this CPU runs (`scalar`, `avx2`, `avx512`,
    /// `avx2i16`, `avx512i16`, `amx`, `avx512vnni`); the error lists the ones it does.
    pub fn parse(name: &str) -> Result<Self, String> {
        if name == "auto" {
            return Ok(Self(None));
        }
        let here: Vec<&'static str> = Kernels::available().iter().map(|k| k.name()).collect();
        match (here.iter().find(|&&k| k == name), Kernels::needs(name)) {
            (Some(&k), _) => Ok(Self(Some(k))),
            (None, Some(needs)) => Err(format!(
                "--kernels {name} needs {needs}, which this CPU lacks (this CPU runs auto, {})",
                here.join(", ")
            )),
            (None, None) => Err(format!(
                "invalid --kernels '{name}': this CPU runs auto, {}",
                here.join(", ")
            )),
        }
    }
}

impl Serialize for KernelTable {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.0.unwrap_or("auto"))
    }
}

/// `--gpu-expert-budget`: [`GpuExpertBudget::parse`], its error prefixed with the flag.
fn gpu_expert_budget(s: &str) -> Result<GpuExpertBudget, String> {
    GpuExpertBudget::parse(s).map_err(|e| format!("--gpu-expert-budget: {e}"))
}

/// `--gpu-miss-split` as [`MissSplit::parse`] reads it.
fn gpu_miss_split(s: &str) -> Result<MissSplit, String> {
    MissSplit::parse(s).map_err(|e| format!("--gpu-miss-split: {e}"))
}

/// `--gpu-miss-split` as [`MissSplit::parse`] reads it back.
fn split_text<S: Serializer>(m: &Option<MissSplit>, s: S) -> Result<S::Ok, S::Error> {
    match m {
        None => s.serialize_none(),
        Some(MissSplit::Off) => s.serialize_str("off"),
        Some(MissSplit::Auto) => s.serialize_str("auto"),
        Some(MissSplit::Percent(p)) => s.serialize_u32(*p),
    }
}

/// `--host-expert-cache BYTES` ([`mference_runtime::parse_bytes`]).
fn host_expert_cache(s: &str) -> Result<u64, String> {
    mference_runtime::parse_bytes(s).ok_or_else(|| {
        format!("invalid --host-expert-cache '{s}': expected bytes such as 16G or 512M")
    })
}

/// `--device` as [`Device::parse`] reads it.
fn device_text<S: Serializer>(d: &Device, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Device::Cpu => s.serialize_str("cpu"),
        Device::Cuda(n) => s.serialize_str(&format!("cuda:{n}")),
        Device::Auto => s.serialize_str("auto"),
    }
}

/// `--gpu-expert-budget` as [`GpuExpertBudget::parse`] reads it.
fn budget_text<S: Serializer>(b: &Option<GpuExpertBudget>, s: S) -> Result<S::Ok, S::Error> {
    match b {
        None => s.serialize_none(),
        Some(GpuExpertBudget::Auto) => s.serialize_str("auto"),
        Some(GpuExpertBudget::Resident) => s.serialize_str("resident"),
        Some(GpuExpertBudget::Bytes(n)) => s.serialize_u64(*n),
    }
}

/// `--seed`: the sampler's seed, the whole u64 range (the server's `seed` takes the same).
pub(crate) fn seed_flag() -> Typed<u64> {
    typed(|s| {
        s.trim().parse().map_err(|_| {
            format!(
                "invalid --seed '{s}': the seed must be an integer from 0 to {}",
                u64::MAX
            )
        })
    })
}

/// A value parser from `parse`, whose error clap prints as it is (`error: invalid --kernels
/// 'x': ...`), not inside its own "invalid value for" sentence; the exit status is 2, as for
/// every flag error clap finds.
pub(crate) fn typed<T: Clone + Send + Sync + 'static>(
    parse: fn(&str) -> Result<T, String>,
) -> Typed<T> {
    Typed(parse)
}

/// See [`typed`].
#[derive(Clone)]
pub struct Typed<T>(fn(&str) -> Result<T, String>);

impl<T: Clone + Send + Sync + 'static> TypedValueParser for Typed<T> {
    type Value = T;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &OsStr,
    ) -> Result<T, clap::Error> {
        let text = clap::builder::StringValueParser::new().parse_ref(cmd, arg, value)?;
        (self.0)(&text).map_err(|e| clap::Error::raw(ErrorKind::ValueValidation, format!("{e}\n")))
    }
}

/// `--threads`: 1 up to 4x the cores this process may run on (more only adds overhead).
fn threads(s: &str) -> Result<usize, String> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    match s.trim().parse::<usize>() {
        Ok(0) => Err("invalid --threads '0': at least 1 thread is needed".into()),
        Ok(n) if n > 4 * cores => Err(format!(
            "--threads {n} is more than 4x the {cores} cores here; use at most {}",
            4 * cores
        )),
        Ok(n) => Ok(n),
        Err(_) => Err(format!(
            "invalid --threads '{s}': expected a whole number from 1 to {}",
            4 * cores
        )),
    }
}

/// A whole-number flag from `min` to `max` (`--max-new`, `--max-context`, `--top-k`, ...): clap
/// refuses any other value (`error: invalid --max-new '0': expected a whole number, at least 1`)
/// and exits 2, before anything is read, as it does a value that is not a number.
pub(crate) fn count(min: usize, max: usize) -> Count {
    Count { min, max }
}

/// See [`count`].
#[derive(Clone, Copy)]
pub struct Count {
    min: usize,
    max: usize,
}

impl TypedValueParser for Count {
    type Value = usize;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &OsStr,
    ) -> Result<usize, clap::Error> {
        let text = clap::builder::StringValueParser::new().parse_ref(cmd, arg, value)?;
        match text.trim().parse::<usize>() {
            Ok(n) if (self.min..=self.max).contains(&n) => Ok(n),
            _ => {
                let flag = arg.and_then(|a| a.get_long()).unwrap_or("value");
                let range = if self.max == usize::MAX {
                    format!("at least {}", self.min)
                } else {
                    format!("from {} to {}", self.min, self.max)
                };
                Err(clap::Error::raw(
                    ErrorKind::ValueValidation,
                    format!("invalid --{flag} '{text}': expected a whole number, {range}\n"),
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct Probe {
        #[command(flatten)]
        model: ModelArgs,
    }

    fn parse(args: &[&str]) -> ModelArgs {
        Probe::try_parse_from(std::iter::once("probe").chain(args.iter().copied()))
            .unwrap_or_else(|e| panic!("{args:?}: {e}"))
            .model
    }

    /// The child's arguments parse back to the same flags, defaults and set values alike.
    #[test]
    fn child_args_parse_back_to_the_same_flags() {
        for args in [
            &["--model", "/m.gturbo"][..],
            &[
                "--model=/m.gturbo",
                "--slots",
                "resident",
                "--expert-cache-policy",
                "pool",
                "--verify",
                "trusted-receipt",
                "--direct-io",
                "--threads",
                "3",
                "--kv-cache",
                "f32",
                "--kernels",
                "scalar",
                "--device",
                "cuda:1",
                "--gpu-expert-budget",
                "512M",
                "--gpu-force-miss",
                "--flash-head",
                "--router-lookahead",
                "2",
            ][..],
            &[
                "--model",
                "/m",
                "--host-expert-cache",
                "16G",
                "--gpu-expert-budget=resident",
            ][..],
            &[
                "--model",
                "/m",
                "--expert-cache-slots",
                "24",
                "--device",
                "auto",
            ][..],
        ] {
            let m = parse(args);
            let child = m.child_args();
            let mut back = vec!["probe".into()];
            back.extend(child.iter().cloned());
            let again = Probe::try_parse_from(back)
                .unwrap_or_else(|e| panic!("{child:?}: {e}"))
                .model;
            assert_eq!(format!("{m:?}"), format!("{again:?}"), "{child:?}");
        }
    }

    /// The spellings each typed flag accepted as a string before it was typed.
    #[test]
    fn typed_flags_accept_the_documented_spellings() {
        let m = parse(&[
            "--model",
            "m",
            "--device",
            "cuda",
            "--gpu-expert-budget",
            "3000000000",
        ]);
        assert_eq!(m.device, Device::Cuda(0));
        assert_eq!(
            m.gpu_expert_budget,
            Some(GpuExpertBudget::Bytes(3_000_000_000))
        );
        assert_eq!(m.expert_cache_slots, Slots::Auto);
        assert_eq!(m.verify, Verify::FullSha256);
        assert_eq!(m.kv_cache, KvCache::F16);
        assert_eq!(m.expert_cache_policy, Policy::Lfu);
        assert_eq!(m.kernels, KernelTable(None));
        for p in ["lfu", "lru", "pool"] {
            let got = parse(&["--model", "m", "--expert-cache-policy", p]).expert_cache_policy;
            assert_eq!(ExpertPolicy::from(got).name(), p);
        }
        let e = Probe::try_parse_from(["probe", "--model", "m", "--kernels", "avx9000"])
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("error: invalid --kernels 'avx9000': this CPU runs auto, scalar"),
            "{e}"
        );
    }

    /// Every table name parses where this CPU runs it; elsewhere the error says what it needs.
    #[test]
    fn a_table_this_cpu_lacks_is_refused_with_what_it_needs() {
        for name in [
            "scalar",
            "avx2",
            "avx2i16",
            "avx512",
            "avx512i16",
            "avx512vnni",
            "amx",
        ] {
            match KernelTable::parse(name) {
                Ok(t) => assert_eq!(t.0, Some(name)),
                Err(e) => assert!(
                    e.starts_with(&format!("--kernels {name} needs "))
                        && e.contains("which this CPU lacks (this CPU runs auto, scalar"),
                    "{e}"
                ),
            }
        }
    }
}
