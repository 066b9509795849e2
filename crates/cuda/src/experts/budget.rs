//! The GPU expert cache's size: `--gpu-expert-budget` ([`GpuExpertBudget`]), what the cache
//! holds ([`ExpertGeometry`]) and the slots per layer a budget gives on a device ([`slots_for`]),
//! with its refusals.

/// How much device memory the expert slots may take (`--gpu-expert-budget`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuExpertBudget {
    /// What is free after the weights and the KV cache, less [`auto_margin`].
    Auto,
    /// This many bytes over all layers.
    Bytes(u64),
    /// Every expert of every layer.
    Resident,
}

impl GpuExpertBudget {
    /// Parses `auto`, `resident`, or a byte count with an optional `K`/`M`/`G`/`T` (powers of
    /// 1024) suffix (`12G`, `512MiB`, `3000000000`).
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "auto" => return Ok(Self::Auto),
            "resident" => return Ok(Self::Resident),
            _ => {}
        }
        mference_runtime::parse_bytes(s)
            .map(Self::Bytes)
            .ok_or_else(|| {
                format!(
                "invalid GPU expert budget '{s}': expected auto, resident, or a byte count such \
                 as 12G or 512M"
            )
            })
    }
}

/// Device memory the automatic budget leaves free for scratch and other processes: 1 GiB or
/// 5% of the device, whichever is more.
pub fn auto_margin(total: usize) -> usize {
    (1usize << 30).max(total / 20)
}

/// What the expert cache holds: the install's MoE layers and their blobs.
#[derive(Clone, Debug)]
pub struct ExpertGeometry {
    /// Layers with an expert file.
    pub layers: Vec<usize>,
    pub experts: usize,
    /// Bytes per expert blob (`expertStride`).
    pub stride: usize,
    /// Experts per token: the automatic budget gives no layer fewer than `3 · top_k` slots, an
    /// explicit one no fewer than `top_k`.
    pub top_k: usize,
}

/// The GPU expert cache's settings.
#[derive(Clone, Debug)]
pub struct ExpertCacheOptions {
    pub geometry: ExpertGeometry,
    pub budget: GpuExpertBudget,
    /// Treat every use as a miss (copy it in again): a test of the copy path's ordering.
    pub force_miss: bool,
}

/// Slots per layer for a budget, given the device's free and total bytes.
pub(crate) fn slots_for(
    g: &ExpertGeometry,
    budget: GpuExpertBudget,
    free: usize,
    total: usize,
) -> Result<usize, String> {
    if g.layers.is_empty() || g.stride == 0 {
        // No layer has routed experts (a dense-only model or cut): nothing to hold.
        return Ok(0);
    }
    let n_layers = g.layers.len();
    let per_slot_all_layers = g.stride * n_layers;
    // The automatic budget keeps 3 · top-k slots per layer; an explicit one may go down to
    // one token's experts (top-k), below which a decode step would evict its own experts.
    let floor = match budget {
        GpuExpertBudget::Auto => 3 * g.top_k,
        _ => g.top_k,
    }
    .min(g.experts);
    let slots = match budget {
        GpuExpertBudget::Resident => g.experts,
        GpuExpertBudget::Bytes(b) => (b as usize / per_slot_all_layers).min(g.experts),
        GpuExpertBudget::Auto => {
            (free.saturating_sub(auto_margin(total)) / per_slot_all_layers).min(g.experts)
        }
    };
    let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
    if slots < floor {
        let rule = if budget == GpuExpertBudget::Auto {
            "3 × top-k"
        } else {
            "top-k"
        };
        return Err(format!(
            "the GPU expert budget gives {slots} slots per layer, fewer than {rule} = \
             {floor} ({:.2} GiB over {n_layers} layers; {:.2} GiB free on the device): raise \
             --gpu-expert-budget, lower --max-context, or run on the CPU",
            gib(floor * per_slot_all_layers),
            gib(free)
        ));
    }
    let need = slots * per_slot_all_layers;
    if need > free {
        return Err(format!(
            "the GPU expert budget needs {:.2} GiB ({slots} slots × {n_layers} layers × {} \
             bytes) but the device has {:.2} GiB free",
            gib(need),
            g.stride,
            gib(free)
        ));
    }
    Ok(slots)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geometry() -> ExpertGeometry {
        ExpertGeometry {
            layers: (0..30).collect(),
            experts: 128,
            stride: 3_358_720,
            top_k: 8,
        }
    }

    #[test]
    fn budgets_parse_with_units() {
        assert_eq!(GpuExpertBudget::parse("auto"), Ok(GpuExpertBudget::Auto));
        assert_eq!(
            GpuExpertBudget::parse("resident"),
            Ok(GpuExpertBudget::Resident)
        );
        assert_eq!(
            GpuExpertBudget::parse("12G"),
            Ok(GpuExpertBudget::Bytes(12 << 30))
        );
        for bad in ["", "-1G", "0", "lots"] {
            let e = GpuExpertBudget::parse(bad).unwrap_err();
            assert!(e.contains("expected auto, resident"), "{bad}: {e}");
        }
    }

    #[test]
    fn slots_follow_the_budget_with_a_floor_of_three_top_k() {
        let g = geometry();
        let per = g.stride * g.layers.len();
        let big = 140usize << 30;
        assert_eq!(slots_for(&g, GpuExpertBudget::Resident, big, big), Ok(128));
        assert_eq!(
            slots_for(&g, GpuExpertBudget::Bytes((32 * per) as u64), big, big),
            Ok(32)
        );
        // A budget above every expert is clamped to resident.
        assert_eq!(
            slots_for(&g, GpuExpertBudget::Bytes(1 << 50), 1 << 51, 1 << 51),
            Ok(128)
        );
        // Auto keeps the margin free.
        let free = 40 * per + auto_margin(big);
        assert_eq!(slots_for(&g, GpuExpertBudget::Auto, free, big), Ok(40));
        // Auto never goes below 24 slots (3 × top-k); an explicit budget not below 8 (top-k).
        let free = 23 * per + auto_margin(big);
        let e = slots_for(&g, GpuExpertBudget::Auto, free, big).unwrap_err();
        assert!(e.contains("3 × top-k = 24"), "{e}");
        assert_eq!(
            slots_for(&g, GpuExpertBudget::Bytes((12 * per) as u64), big, big),
            Ok(12)
        );
        let e = slots_for(&g, GpuExpertBudget::Bytes((7 * per) as u64), big, big).unwrap_err();
        assert!(e.contains("top-k = 8"), "{e}");
        let e = slots_for(&g, GpuExpertBudget::Resident, 64 * per, big).unwrap_err();
        assert!(e.contains("the device has"), "{e}");
    }

    /// A model whose layers are all dense (an Inkling-Small cut of its dense layers) has no
    /// expert bytes: every budget gives 0 slots (the automatic one divided by 0 and panicked).
    #[test]
    fn a_model_without_expert_layers_needs_no_slots() {
        let big = 80usize << 30;
        for g in [
            ExpertGeometry {
                layers: Vec::new(),
                ..geometry()
            },
            ExpertGeometry {
                stride: 0,
                ..geometry()
            },
        ] {
            for b in [
                GpuExpertBudget::Auto,
                GpuExpertBudget::Resident,
                GpuExpertBudget::Bytes(1 << 30),
            ] {
                assert_eq!(slots_for(&g, b, big, big), Ok(0), "{b:?}");
            }
        }
    }
}
