//! The models side of the family registry ([`mference_format::family`]): [`load`] opens an
//! install, checks the options against its [`Family`], picks the device and hands the engine and
//! backend to that family's loader.

use mference_kernels::Kernels;
use std::path::Path;

use mference_backend::{missing_ops, Backend, Op};
use mference_format::family::config_model_type;
use mference_format::{Family, Install};

use crate::{
    deepseek_v4, gemma4, inkling, maple, qwen3_5_moe, Device, Engine, GpuExpertBudget, LoadOptions,
    MissSplit, Model, ModelError,
};

/// Opens the install at `dir` and loads its family.
///
/// Errors: any install check (`mference_format`, an unknown `model_type` among them), an option
/// the family does not take, or a tensor that does not match the config.
pub fn load(dir: &Path, opts: &LoadOptions) -> Result<Box<dyn Model>, ModelError> {
    load_install(Install::open(dir, opts.verify)?, opts)
}

/// [`load`] of an install the caller has opened (with `opts.verify`), so that the install's
/// checks can run while the caller does other work (`run` builds its tokenizer meanwhile).
///
/// Errors: those of [`load`] after the install checks.
pub fn load_install(install: Install, opts: &LoadOptions) -> Result<Box<dyn Model>, ModelError> {
    let family = Family::from_config(&install.config_json)?;
    let model_type = config_model_type(&install.config_json).to_string();
    check_flags(family, &model_type, opts.flash_head, opts.router_lookahead)?;
    // What CUDA lacks is named before the weights are read; `auto` decides here.
    let auto_cpu = check_device(opts.device, Some(family))?;
    let gpu_only =
        opts.gpu_expert_budget.is_some() || opts.gpu_force_miss || opts.gpu_miss_split.is_some();
    if let Some(why) = auto_cpu.as_ref().filter(|_| gpu_only) {
        // The GPU-only settings would be dropped without a word: refuse them instead.
        return Err(ModelError::Device(format!(
            "--device auto found no usable CUDA ({why}), and --gpu-expert-budget / \
             --gpu-miss-split / --gpu-force-miss apply only on CUDA: drop them, or fix CUDA and use --device cuda"
        )));
    }
    check_kernels(opts.kernels.as_deref(), family)?;
    // `auto` kernels: the int16-activation tables where the family was checked with them (the
    // load line names the rounding); the other families keep the exact table, and where this CPU
    // has a faster int16 one the load line says why it was not taken.
    let (int16, exact) = (Kernels::detect_int16(), Kernels::detect());
    // The host CPU's share of the GPU misses runs the exact table unless one was asked for: its
    // products join the GPU's exact ones.
    let host_kernels = match opts.kernels {
        Some(_) => None,
        None => Some(exact),
    };
    let chosen;
    let opts = if opts.kernels.is_none() && family.int8_prefill() {
        chosen = LoadOptions {
            kernels: Some(int16.name().to_string()),
            ..opts.clone()
        };
        &chosen
    } else {
        opts
    };
    let mut engine = Engine::new(install, opts)?;
    if opts.kernels.is_none() && !std::ptr::eq(int16, exact) {
        engine.kernels_note = Some(format!(
            "exact: {} is for {} only, it misses this family's golden fixtures",
            int16.name(),
            Family::display_names_where(Family::int8_prefill, " and ")
        ));
    }
    let cuda = |n: usize, engine: &Engine| {
        let host = mference_backend::cpu::CpuBackend::new(
            host_kernels.unwrap_or(engine.kernels),
            engine.threads,
            engine.map.clone(),
        );
        mference_cuda::CudaBackend::new(n, engine.map.clone())
            .and_then(|be| be.with_expert_cache(gpu_expert_cache(engine, opts)))
            .map(|be| be.with_host_experts(host, opts.gpu_miss_split.unwrap_or(MissSplit::Auto)))
            .map_err(|e| ModelError::Device(format!("cuda:{n}: {e}")))
    };
    match opts.device {
        Device::Cpu => {
            let be = engine.cpu_backend();
            load_family(family, engine, be, opts)
        }
        Device::Cuda(n) => {
            let be = cuda(n, &engine)?;
            load_family(family, engine, be, opts)
        }
        Device::Auto => match auto_cpu {
            Some(why) => {
                engine.device_fallback = Some(why);
                let be = engine.cpu_backend();
                load_family(family, engine, be, opts)
            }
            None => {
                let be = cuda(0, &engine)?;
                load_family(family, engine, be, opts)
            }
        },
    }
}

/// Checks a checkpoint's `config.json` as the load will (its family, then the family's `Config`:
/// features this runtime lacks, sizes of 0, a top-k past the experts), so an installer can refuse
/// it before copying any weights.
///
/// Errors: [`ModelError::Config`] (or the family error) saying what is wrong.
pub fn check_config(config: &serde_json::Value) -> Result<Family, ModelError> {
    let family = Family::from_config(config)?;
    match family {
        Family::Gemma4 => gemma4::Config::from_config_json(config).map(drop),
        Family::Qwen3_5Moe => qwen3_5_moe::Config::from_config_json(config).map(drop),
        Family::DeepseekV4 => deepseek_v4::Config::from_config_json(config).map(drop),
        Family::Maple => maple::Config::from_config_json(config).map(drop),
        Family::Inkling => inkling::Config::from_config_json(config).map(drop),
    }?;
    Ok(family)
}

/// Refuses the options `family` does not take: `--flash-head` and `--router-lookahead N > 0`
/// ([`mference_format::FamilySpec::flash_head`], [`mference_format::FamilySpec::router_lookahead`]);
/// `model_type` is the install's, for the message. Cheap: the CLI calls it before anything is
/// read, [`load`] again.
pub fn check_flags(
    family: Family,
    model_type: &str,
    flash_head: bool,
    router_lookahead: usize,
) -> Result<(), ModelError> {
    if flash_head && !family.flash_head() {
        return Err(ModelError::Config(format!(
            "--flash-head is a {} option; this install is {model_type}",
            Family::display_names_where(Family::flash_head, " / "),
        )));
    }
    if router_lookahead > 0 && !family.router_lookahead() {
        let own = match family {
            Family::DeepseekV4 => " (DeepSeek-V4 has its own shadow prefetch)",
            _ => "",
        };
        return Err(ModelError::Config(format!(
            "--router-lookahead is a {} option; this install is {model_type}{own}",
            Family::display_names_where(Family::router_lookahead, " / "),
        )));
    }
    Ok(())
}

/// Checks `device` for `family` before anything is read or moved: first the ops the family needs
/// ([`required_ops`]) that the CUDA backend has no kernel for, then the driver, device and NVRTC
/// ([`probe_device`]; also alone when the family is not known yet). `cuda:N` is refused naming
/// what is missing; for `auto`, `Some(why it takes the CPU)`, `None` when it takes `cuda:0`.
pub fn check_device(device: Device, family: Option<Family>) -> Result<Option<String>, ModelError> {
    match (device, family.and_then(cuda_lacks)) {
        (Device::Cuda(n), Some(why)) => Err(ModelError::Device(format!(
            "cuda:{n}: {why}: use --device cpu (or auto, which takes the CPU for it)"
        ))),
        (Device::Auto, Some(why)) => Ok(Some(why)),
        _ => probe_device(device),
    }
}

/// Refuses a kernel table that rounds activations (`kernels`, `--kernels`; or, for `None`,
/// what `MFERENCE_KERNELS` forces) for a family whose golden fixtures it misses
/// ([`mference_format::FamilySpec::int8_prefill`]), rather than mislead. Cheap: the CLI
/// calls it before anything is read, [`load`] again.
pub fn check_kernels(kernels: Option<&str>, family: Family) -> Result<(), ModelError> {
    let (table, from) = match kernels {
        Some(name) => (Kernels::by_name(name), "--kernels"),
        None => (Some(Kernels::detect()), "MFERENCE_KERNELS="),
    };
    match table {
        Some(t) if !t.is_exact() && !family.int8_prefill() => Err(ModelError::Config(format!(
            "{from}{}{} (rounded activations) is for {} only: on {} its logits miss the \
             reference fixtures' tolerance (docs/BENCHMARKS.md): use --kernels {}{}",
            if from == "--kernels" { " " } else { "" },
            t.name(),
            Family::display_names_where(Family::int8_prefill, " and "),
            family.display_name(),
            Kernels::best_exact().name(),
            // `auto` is what reads MFERENCE_KERNELS, so it is advice only for the flag.
            if from == "--kernels" {
                " (or auto)"
            } else {
                ", or unset MFERENCE_KERNELS"
            },
        ))),
        _ => Ok(()),
    }
}

/// The ops `family`'s forward pass calls (its own, the shared head and MoE step, and the default
/// bodies of the fused ops it uses): [`load`] checks them against the backend before any weight
/// moves. `SetRows` is left out of the MoE families' lists for the default `glu_mlp_rows` alone,
/// since a backend that holds experts overrides that op.
pub fn required_ops(family: Family) -> &'static [Op] {
    use Op::*;
    match family {
        Family::Gemma4 => &[
            Zeros, Copy, Read, AllFinite, GatherRows, Embed, Matmul, GluMlp, HeadArgmax, RmsNorm,
            Unary, MulCols, Add, ScatterAdd, NewKv, Rope, KvWrite, KvClone, Attention, Route,
        ],
        Family::Qwen3_5Moe => &[
            Upload,
            Zeros,
            Copy,
            Read,
            AllFinite,
            GatherRows,
            Split,
            Embed,
            Matmul,
            GluMlp,
            HeadArgmax,
            RmsNorm,
            Unary,
            MulCols,
            MulSigmoid,
            MulRowsSigmoid,
            Add,
            ScatterAdd,
            NewKv,
            Rope,
            KvWrite,
            Attention,
            Route,
            NewState,
            ZeroState,
            Conv1dSilu,
            DeltaGates,
            GatedDeltaRule,
            RmsNormGated,
        ],
        Family::DeepseekV4 => &[
            Upload,
            Zeros,
            Read,
            AllFinite,
            GatherRows,
            Split,
            SetRows,
            Embed,
            Matmul,
            Linear,
            GluMlp,
            HeadArgmax,
            RmsNorm,
            Unary,
            Add,
            ScatterAdd,
            NewKv,
            Rope,
            KvWrite,
            KvClone,
            Attention,
            Route,
            RouteSqrtSoftplus,
            RopeAt,
            MatmulGrouped,
            HcPre,
            HcPost,
            CompressPool,
            AttentionSparse,
            IndexTopK,
        ],
        Family::Inkling => &[
            Upload,
            Zeros,
            Copy,
            Read,
            AllFinite,
            GatherRows,
            Embed,
            Matmul,
            Linear,
            GluMlp,
            HeadArgmax,
            RmsNorm,
            Unary,
            Add,
            ScatterAdd,
            NewKv,
            KvWrite,
            NewState,
            ZeroState,
            Conv1d,
            AttentionRel,
            RouteSinks,
        ],
        Family::Maple => &[
            Zeros, Copy, Read, AllFinite, GatherRows, Embed, Matmul, MatmulBf16, GluMlp,
            HeadArgmax, RmsNorm, Unary, Add, ScatterAdd, NewKv, Rope, KvWrite, KvClone, Attention,
            Route,
        ],
    }
}

/// What the CUDA backend lacks for `family`, as a sentence naming the ops, or `None`.
fn cuda_lacks(family: Family) -> Option<String> {
    let missing = missing_ops::<mference_cuda::CudaBackend>(required_ops(family));
    (!missing.is_empty()).then(|| {
        let names: Vec<&str> = missing.iter().map(|op| op.name()).collect();
        format!(
            "the CUDA backend has no kernel for {} of the ops {} needs ({})",
            missing.len(),
            family.display_name(),
            names.join(", ")
        )
    })
}

/// Checks `device` before anything is read: `cuda:N` must have its driver, device and NVRTC
/// (else the error names what is missing). For `auto`, `Some(what CUDA lacks)` when it takes the
/// CPU; `None` when it takes `cuda:0` (or for `cpu`).
pub fn probe_device(device: Device) -> Result<Option<String>, ModelError> {
    match device {
        Device::Cpu => Ok(None),
        Device::Cuda(n) => mference_cuda::CudaBackend::probe(n)
            .map(|()| None)
            .map_err(|e| ModelError::Device(format!("cuda:{n}: {e}"))),
        Device::Auto => match mference_cuda::CudaBackend::probe(0) {
            Ok(()) => Ok(None),
            Err(e) if e.is_unavailable() => Ok(Some(e.to_string())),
            Err(e) => Err(ModelError::Device(format!("cuda:0: {e}"))),
        },
    }
}

/// The GPU expert cache's settings for this install: its expert layers, blob stride and top-k.
fn gpu_expert_cache(engine: &Engine, opts: &LoadOptions) -> mference_cuda::ExpertCacheOptions {
    let l = &engine.install.layout;
    mference_cuda::ExpertCacheOptions {
        geometry: mference_cuda::ExpertGeometry {
            layers: l
                .layers
                .iter()
                .filter(|x| x.blob.is_some())
                .map(|x| x.layer)
                .collect(),
            experts: l.experts_per_layer,
            stride: l.expert_stride as usize,
            top_k: engine.install.manifest.arch.top_k_experts as usize,
        },
        budget: opts.gpu_expert_budget.unwrap_or(GpuExpertBudget::Auto),
        force_miss: opts.gpu_force_miss,
    }
}

/// The family's loader, on backend `be`.
fn load_family<B: Backend + 'static>(
    family: Family,
    mut engine: Engine,
    be: B,
    opts: &LoadOptions,
) -> Result<Box<dyn Model>, ModelError> {
    engine.device = be.name();
    engine.kernels_label = be.kernels();
    let config = &engine.install.config_json;
    let mut model: Box<dyn Model> = match family {
        Family::Gemma4 => {
            let cfg = gemma4::Config::from_config_json(config)?;
            Box::new(gemma4::Gemma4::load(engine, be, cfg, opts)?)
        }
        Family::Qwen3_5Moe => {
            let cfg = qwen3_5_moe::Config::from_config_json(config)?;
            Box::new(qwen3_5_moe::Qwen35Moe::load(engine, be, cfg, opts)?)
        }
        Family::DeepseekV4 => {
            let cfg = deepseek_v4::Config::from_config_json(config)?;
            Box::new(deepseek_v4::DeepseekV4::load(engine, be, cfg, opts)?)
        }
        Family::Maple => {
            let cfg = maple::Config::from_config_json(config)?;
            Box::new(maple::Maple::load(engine, be, cfg, opts)?)
        }
        Family::Inkling => {
            let cfg = inkling::Config::from_config_json(config)?;
            Box::new(inkling::Inkling::load(engine, be, cfg, opts)?)
        }
    };
    model.size_device_experts()?;
    model.preload_device_experts()?;
    Ok(model)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(family: Family, opts: &LoadOptions) -> Option<String> {
        check_flags(
            family,
            family.model_type(),
            opts.flash_head,
            opts.router_lookahead,
        )
        .err()
        .map(|e| e.to_string())
    }

    /// Issue 30 item 3: the CUDA backend has every op of every family, so `--device auto` takes
    /// CUDA for all five where CUDA runs.
    #[test]
    fn cuda_has_every_op_of_every_family() {
        for f in Family::ALL {
            assert_eq!(cuda_lacks(f), None, "{f:?}");
        }
    }

    #[test]
    fn options_are_checked_against_the_registry() {
        let flash = LoadOptions {
            flash_head: true,
            ..LoadOptions::default()
        };
        let lookahead = LoadOptions {
            router_lookahead: 1,
            ..LoadOptions::default()
        };
        for f in Family::ALL {
            assert_eq!(refused(f, &LoadOptions::default()), None, "{f:?}");
            assert_eq!(refused(f, &flash).is_none(), f.flash_head(), "{f:?}");
            assert_eq!(
                refused(f, &lookahead).is_none(),
                f.router_lookahead(),
                "{f:?}"
            );
        }
    }

    #[test]
    fn option_messages_are_unchanged() {
        // The messages as they were written by hand before the registry built them.
        let flash = LoadOptions {
            flash_head: true,
            ..LoadOptions::default()
        };
        assert_eq!(
            refused(Family::Gemma4, &flash).unwrap(),
            "config: --flash-head is a Maple option; this install is gemma4"
        );
        let lookahead = LoadOptions {
            router_lookahead: 2,
            ..LoadOptions::default()
        };
        assert_eq!(
            refused(Family::DeepseekV4, &lookahead).unwrap(),
            "config: --router-lookahead is a Gemma 4 / Qwen 3.6 option; this install is \
             deepseek_v4 (DeepSeek-V4 has its own shadow prefetch)"
        );
        assert_eq!(
            refused(Family::Maple, &lookahead).unwrap(),
            "config: --router-lookahead is a Gemma 4 / Qwen 3.6 option; this install is maple"
        );
        assert_eq!(
            Family::display_names_where(Family::int8_prefill, " and "),
            "Gemma 4 and Qwen 3.6"
        );
    }
}
