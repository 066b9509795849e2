//! The family registry: [`load`] opens an install, picks the device and hands the engine and
//! backend to the family that `model_type` names.

use std::path::Path;

use mference_backend::Backend;
use mference_format::Install;

use crate::{
    deepseek_v4, gemma4, inkling, maple, qwen3_5_moe, Device, Engine, GpuExpertBudget, LoadOptions,
    Model, ModelError,
};

/// Opens the install at `dir` and loads its family.
///
/// Errors: any install check (`mference_format`), an unknown family, or a tensor that does not match
/// the config.
pub fn load(dir: &Path, opts: &LoadOptions) -> Result<Box<dyn Model>, ModelError> {
    let install = Install::open(dir, opts.verify)?;
    let model_type = install
        .config_json
        .get("model_type")
        .and_then(|v| v.as_str())
        .unwrap_or("")
        .to_string();
    if !matches!(
        model_type.as_str(),
        "gemma4"
            | "gemma4_text"
            | "qwen3_5_moe"
            | "qwen3_5_moe_text"
            | "deepseek_v4"
            | "maple"
            | "inkling_mm_model"
    ) {
        return Err(ModelError::Family(model_type));
    }
    if opts.flash_head && model_type != "maple" {
        return Err(ModelError::Config(format!(
            "--flash-head is a Maple option; this install is {model_type}"
        )));
    }
    let lookahead_families = ["gemma4", "gemma4_text", "qwen3_5_moe", "qwen3_5_moe_text"];
    if opts.router_lookahead > 0 && !lookahead_families.contains(&model_type.as_str()) {
        return Err(ModelError::Config(format!(
            "--router-lookahead is a Gemma 4 / Qwen 3.6 option; this install is {model_type} \
             (DeepSeek-V4 has its own shadow prefetch)"
        )));
    }
    // What CUDA lacks is named before the weights are read; `auto` decides here.
    let auto_cpu = probe_device(opts.device)?;
    let gpu_only = opts.gpu_expert_budget != GpuExpertBudget::Auto || opts.gpu_force_miss;
    if let Some(why) = auto_cpu.as_ref().filter(|_| gpu_only) {
        // The GPU-only settings would be dropped without a word: refuse them instead.
        return Err(ModelError::Device(format!(
            "--device auto found no usable CUDA ({why}), and --gpu-expert-budget / \
             --gpu-force-miss apply only on CUDA: drop them, or fix CUDA and use --device cuda"
        )));
    }
    let mut engine = Engine::new(install, opts)?;
    // The int8 prefill (VNNI) rounds activations to int8; its cost is measured only on these two
    // families (README). Elsewhere it was found far off the reference: refuse rather than mislead.
    if !engine.kernels.is_exact()
        && !matches!(
            model_type.as_str(),
            "gemma4" | "gemma4_text" | "qwen3_5_moe" | "qwen3_5_moe_text"
        )
    {
        return Err(ModelError::Config(format!(
            "--kernels {} (int8 prefill) is checked only for Gemma 4 and Qwen 3.6; on {model_type} \
             it is far from the reference: use --kernels avx512 (or auto)",
            engine.kernels.name()
        )));
    }
    let cuda = |n: usize, engine: &Engine| {
        mference_cuda::CudaBackend::new(n, engine.map.clone())
            .and_then(|be| be.with_expert_cache(gpu_expert_cache(engine, opts)))
            .map_err(|e| ModelError::Device(format!("cuda:{n}: {e}")))
    };
    match opts.device {
        Device::Cpu => {
            let be = engine.cpu_backend();
            load_family(&model_type, engine, be, opts)
        }
        Device::Cuda(n) => {
            let be = cuda(n, &engine)?;
            load_family(&model_type, engine, be, opts)
        }
        Device::Auto => match auto_cpu {
            Some(why) => {
                engine.device_fallback = Some(why);
                let be = engine.cpu_backend();
                load_family(&model_type, engine, be, opts)
            }
            None => {
                let be = cuda(0, &engine)?;
                load_family(&model_type, engine, be, opts)
            }
        },
    }
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
        budget: opts.gpu_expert_budget,
        force_miss: opts.gpu_force_miss,
    }
}

/// The family registry: `model_type` → the family's loader, on backend `be`.
fn load_family<B: Backend + 'static>(
    model_type: &str,
    mut engine: Engine,
    be: B,
    opts: &LoadOptions,
) -> Result<Box<dyn Model>, ModelError> {
    engine.device = be.name();
    let config = &engine.install.config_json;
    let mut model: Box<dyn Model> = match model_type {
        "gemma4" | "gemma4_text" => {
            let cfg = gemma4::Config::from_config_json(config)?;
            Box::new(gemma4::Gemma4::load(engine, be, cfg, opts)?)
        }
        "qwen3_5_moe" | "qwen3_5_moe_text" => {
            let cfg = qwen3_5_moe::Config::from_config_json(config)?;
            Box::new(qwen3_5_moe::Qwen35Moe::load(engine, be, cfg, opts)?)
        }
        "deepseek_v4" => {
            let cfg = deepseek_v4::Config::from_config_json(config)?;
            Box::new(deepseek_v4::DeepseekV4::load(engine, be, cfg, opts)?)
        }
        "maple" => {
            let cfg = maple::Config::from_config_json(config)?;
            Box::new(maple::Maple::load(engine, be, cfg, opts)?)
        }
        "inkling_mm_model" => {
            let cfg = inkling::Config::from_config_json(config)?;
            Box::new(inkling::Inkling::load(engine, be, cfg, opts)?)
        }
        other => return Err(ModelError::Family(other.to_string())),
    };
    model.size_device_experts()?;
    model.preload_device_experts()?;
    Ok(model)
}
