//! The model flags ([`ModelArgs`]) to the models' load options: the one place each flag becomes
//! a [`LoadOptions`] field, with the expert-cache sizing behind `--expert-cache-slots auto` and
//! `--host-expert-cache`.

use anyhow::{bail, Result};

use mference_format::{Install, Manifest};
use mference_models::{Device, LoadOptions};
use mference_runtime::CacheSlots;

use crate::flags::{KvCache, ModelArgs, Slots};
use crate::notes::note;

/// `--device`, `--gpu-expert-budget`, `--gpu-miss-split` and `--gpu-force-miss` checked
/// together (run, perplexity, logits, serve, bench): the GPU-only flags are refused on the CPU,
/// not ignored, and a CUDA device that cannot start is named before anything is read.
pub fn device_flags(m: &ModelArgs) -> Result<()> {
    let man = read_manifest(&m.model);
    device_flags_for(
        m,
        man.as_ref().and_then(|b| Manifest::parse(b).ok()).as_ref(),
    )
}

/// [`device_flags`] with the install's manifest already read (`None`: not an install, which the
/// load reports).
fn device_flags_for(m: &ModelArgs, man: Option<&Manifest>) -> Result<()> {
    if m.device == Device::Cpu {
        // The GPU-only flags given, named as typed.
        let given: Vec<&str> = [
            (m.gpu_expert_budget.is_some(), "--gpu-expert-budget"),
            (m.gpu_miss_split.is_some(), "--gpu-miss-split"),
            (m.gpu_force_miss, "--gpu-force-miss"),
        ]
        .into_iter()
        .filter_map(|(on, name)| on.then_some(name))
        .collect();
        if !given.is_empty() {
            bail!(
                "{} applies only on CUDA: add --device cuda, or drop it",
                given.join(" and ")
            );
        }
    }
    // `--device cuda` without CUDA, or without a kernel for an op the install's family needs,
    // fails here, before the model is sized or read (the family from its manifest, when there
    // is one: a path that is not an install is reported by the load).
    mference_models::check_device(m.device, man.map(|man| man.arch.family))?;
    // A rounded kernel table for a family not checked with it, likewise before anything is read.
    if let Some(man) = man {
        let family = man.arch.family;
        mference_models::check_kernels(m.kernels.0, family)?;
        // Flags the family does not take, likewise (a bench would start its runs first).
        mference_models::check_flags(
            family,
            family.model_type(),
            m.flash_head,
            m.router_lookahead,
        )?;
    }
    Ok(())
}

/// The bytes of `dir/manifest.json`, if it can be read.
fn read_manifest(dir: &std::path::Path) -> Option<Vec<u8>> {
    std::fs::read(dir.join(mference_format::MANIFEST_FILE)).ok()
}

/// `run`'s start: the device flags checked, then the install opened with the load's checks
/// (`--verify`), so that the checks can run while the tokenizer is built. The load options
/// follow from [`load_options_for`] once the prompt (and so the prefill chunk) is known.
pub(crate) fn open_install(m: &ModelArgs) -> Result<Install> {
    device_flags(m)?;
    Ok(Install::open(&m.model, m.verify.into())?)
}

/// `--expert-cache-slots` and the I/O mode: an explicit value wins; `auto` sizes the slot cache
/// to the memory this process may use ([`mference_runtime::sizing::auto_slots`]: resident
/// weights, KV at `max_context` and scratch counted) and reads with O_DIRECT when the slots are
/// smaller than the expert files, and says on stderr what it chose and from which limit.
fn resolve_slots(
    m: &ModelArgs,
    man: Option<&Manifest>,
    prefill_chunk: usize,
    max_context: usize,
) -> Result<(CacheSlots, bool)> {
    let host_bytes = match (m.expert_cache_slots, m.host_expert_cache) {
        // clap refuses both flags given: beside --host-expert-cache the slots are the default.
        (_, Some(b)) => Some(b),
        (Slots::Set(s), None) => return Ok((clamp_slots(s, man), m.direct_io)),
        (Slots::Auto, None) => None,
    };
    let Some(man) = man else {
        // Not an install: the load reports it.
        return Ok((CacheSlots::Resident, m.direct_io));
    };
    if let Some(b) = host_bytes {
        return Ok((host_tier_slots(man, b)?, m.direct_io));
    }
    let size = |prefix: &str| -> u64 {
        man.files
            .iter()
            .filter(|(k, _)| k.starts_with(prefix))
            .map(|(_, f)| f.size)
            .sum()
    };
    let a = &man.arch;
    let kv_bytes: u64 = if m.kv_cache == KvCache::F32 { 4 } else { 2 };
    let kv: u64 = a
        .full_attention_layer_mask
        .iter()
        .map(|&t| {
            let (rows, width) = match t {
                0 => (
                    a.sliding_window + prefill_chunk as u64,
                    a.num_kv_heads * a.head_dim,
                ),
                1 => (max_context as u64, a.num_full_kv_heads * a.full_head_dim),
                // Compressed KV (DeepSeek-V4 CSA / HCA): a window plus 1/4 or 1/128 of the context.
                3 => (a.sliding_window + max_context as u64 / 4, a.head_dim),
                4 => (a.sliding_window + max_context as u64 / 128, a.head_dim),
                // Gated DeltaNet: a fixed recurrent state.
                _ => (
                    a.linear_key_head_dim * a.linear_num_v_heads,
                    a.linear_value_head_dim,
                ),
            };
            2 * rows * width * kv_bytes
        })
        .sum();
    let (limit, from) = mference_runtime::sizing::usable_memory();
    let input = mference_runtime::sizing::SizingInput {
        limit,
        resident_weights: size(mference_format::WEIGHTS_FILE),
        kv,
        // 256 MiB, plus ~400 KB per prefill row (measured on Gemma 26B: a 4,000-token prompt in
        // one 4,096-row chunk peaked 1.6 GB above chunk 256; at chunk 64 / 512 everything besides
        // the slots, KV and mapped weights was 70 / 150 MB), i.e. 36 f32 rows of the hidden size,
        // plus one head row: prefill computes the logits of the rows wanted, the last one here.
        scratch: (256 << 20) + prefill_chunk as u64 * a.hidden_size * 4 * 36 + a.vocab_size * 4,
        expert_files: size("packed_experts/layer_"),
        moe_layers: man.expert_layer_files() as u64,
        stride: man.expert_stride,
        experts_per_layer: man.experts_per_layer,
        top_k: a.top_k_experts as usize,
    };
    let s = mference_runtime::sizing::auto_slots(&input);
    let gb = |b: u64| b as f64 / 1e9;
    let slots = match s.slots {
        CacheSlots::Resident => "resident (layer files mapped)".to_string(),
        CacheSlots::Fixed(n) => format!("{n} slots per layer"),
    };
    note!(
        "[expert cache auto: {slots}{}; from {:.2} GB ({from}) - weights {:.2} GB - KV {:.2} GB - scratch {:.2} GB = {:.2} GB for {:.2} GB of expert files]",
        if s.direct_io || m.direct_io { ", O_DIRECT" } else { "" },
        gb(limit),
        gb(input.resident_weights),
        gb(input.kv),
        gb(input.scratch),
        gb(s.budget),
        gb(input.expert_files),
    );
    Ok((s.slots, s.direct_io || m.direct_io))
}

/// `--expert-cache-slots N` above the install's experts per layer is that many, with a note:
/// the extra slots would hold nothing.
fn clamp_slots(s: CacheSlots, man: Option<&Manifest>) -> CacheSlots {
    match (s, man.map(|m| m.experts_per_layer)) {
        (CacheSlots::Fixed(n), Some(experts)) if experts > 0 && n > experts => {
            note!(
                "[--expert-cache-slots {n} is more than this model's {experts} experts per layer: using {experts} slots per layer]"
            );
            CacheSlots::Fixed(experts)
        }
        _ => s,
    }
}

/// Slots per layer for `--host-expert-cache BYTES`: the bytes over every expert layer, at least
/// top-k per layer (one token's experts), at most every expert.
fn host_tier_slots(man: &Manifest, bytes: u64) -> Result<CacheSlots> {
    let layers = man.expert_layer_files() as u64;
    let per_slot = man.expert_stride * layers.max(1);
    let n = (bytes / per_slot) as usize;
    let top_k = man.arch.top_k_experts as usize;
    if n < top_k {
        bail!(
            "--host-expert-cache {bytes} bytes holds {n} experts per layer over {layers} layers, \
             fewer than top-k = {top_k}: give at least {} bytes",
            top_k as u64 * per_slot
        );
    }
    let n = n.min(man.experts_per_layer);
    note!(
        "[host expert cache: {n} slots per layer ({:.2} GB over {layers} layers)]",
        (n as u64 * per_slot) as f64 / 1e9
    );
    Ok(CacheSlots::Fixed(n))
}

/// The load options the model flags ask for, with the prefill chunk rows and KV positions the
/// command chose. Every flag is checked (the device probed) before the expert-cache sizing prints
/// its line; `manifest.json` is read once for both.
pub(crate) fn load_options(
    m: &ModelArgs,
    prefill_chunk: usize,
    max_context: usize,
) -> Result<LoadOptions> {
    let bytes = read_manifest(&m.model);
    device_flags_for(
        m,
        bytes
            .as_ref()
            .and_then(|b| Manifest::parse(b).ok())
            .as_ref(),
    )?;
    // A manifest that does not parse is an error only where the sizing needs it (the load
    // reports it otherwise).
    let man = match (&bytes, m.expert_cache_slots, m.host_expert_cache) {
        (Some(b), Slots::Auto, _) | (Some(b), _, Some(_)) => Some(Manifest::parse(b)?),
        (Some(b), Slots::Set(_), None) => Manifest::parse(b).ok(),
        _ => None,
    };
    options_for(m, man.as_ref(), prefill_chunk, max_context)
}

/// [`load_options`] for an install opened by [`open_install`] (flags checked, manifest parsed).
pub(crate) fn load_options_for(
    m: &ModelArgs,
    install: &Install,
    prefill_chunk: usize,
    max_context: usize,
) -> Result<LoadOptions> {
    options_for(m, Some(&install.manifest), prefill_chunk, max_context)
}

fn options_for(
    m: &ModelArgs,
    man: Option<&Manifest>,
    prefill_chunk: usize,
    max_context: usize,
) -> Result<LoadOptions> {
    // A chunk longer than the context is the whole prompt (which fits the context).
    let prefill_chunk = prefill_chunk.min(max_context);
    let (slots, direct_io) = resolve_slots(m, man, prefill_chunk, max_context)?;
    let mut o = LoadOptions {
        slots,
        expert_policy: m.expert_cache_policy.into(),
        direct_io,
        prefill_chunk,
        max_context,
        verify: m.verify.into(),
        kernels: m.kernels.0.map(str::to_string),
        kv_dtype: m.kv_cache.into(),
        device: m.device,
        gpu_expert_budget: m.gpu_expert_budget,
        gpu_force_miss: m.gpu_force_miss,
        gpu_miss_split: m.gpu_miss_split,
        flash_head: m.flash_head,
        router_lookahead: m.router_lookahead,
        ..Default::default()
    };
    if let Some(t) = m.threads {
        o.threads = t;
    }
    Ok(o)
}
