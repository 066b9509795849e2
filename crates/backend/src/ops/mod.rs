//! The op layer, in groups: [`CoreOps`] (what every family uses) and one trait per family-specific
//! group ([`RecurrentOps`], [`DeepSeekV4Ops`], [`InklingOps`]) and for a backend's own expert cache
//! ([`DeviceExpertOps`]). Families are written against [`Backend`], which is all of them.
//!
//! A backend says which ops it has through [`CoreOps::supports`] (an associated function: no
//! instance, no device context needed), so a loader can compare a family's required [`Op`]s
//! ([`missing_ops`]) before any weight moves. The op harness ([`crate::harness`]) checks that
//! the answer agrees with what the backend's ops do.

mod core;
mod deepseek_v4;
mod device_experts;
mod inkling;
mod recurrent;

pub use self::core::CoreOps;
pub use deepseek_v4::{checks as deepseek_v4_checks, DeepSeekV4Ops};
pub use device_experts::DeviceExpertOps;
pub use inkling::InklingOps;
pub use recurrent::RecurrentOps;

/// The whole op vocabulary of the five families: every group. Implemented for every type that
/// implements the groups (a backend lacking a group's ops implements it empty, and answers
/// `false` in [`CoreOps::supports`] for them).
pub trait Backend: CoreOps + RecurrentOps + DeepSeekV4Ops + InklingOps + DeviceExpertOps {}

impl<B> Backend for B where B: CoreOps + RecurrentOps + DeepSeekV4Ops + InklingOps + DeviceExpertOps {}

/// Declares [`Op`], its list [`Op::ALL`] and [`Op::name`] from one table, so the three cannot
/// disagree.
macro_rules! ops {
    ($($(#[$doc:meta])* $v:ident => $name:literal,)*) => {
        /// An op a backend may lack (its default body fails with [`crate::OpError::Missing`]),
        /// named after the method. The device expert-cache hooks are not here: their defaults
        /// are a backend without a cache, and `routed_experts_held` runs only after
        /// `routes_on_device` said yes.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub enum Op {
            $($(#[$doc])* $v,)*
        }

        impl Op {
            /// Every op, in the order of the groups.
            pub const ALL: &'static [Op] = &[$(Op::$v,)*];

            /// The name [`crate::OpError::Missing`] reports for this op (the method's name).
            pub fn name(self) -> &'static str {
                match self {
                    $(Op::$v => $name,)*
                }
            }
        }
    };
}

ops! {
    // CoreOps
    Upload => "upload",
    Zeros => "zeros",
    Copy => "copy",
    Read => "read",
    AllFinite => "all_finite",
    GatherRows => "gather_rows",
    Split => "split",
    SetRows => "set_rows",
    Embed => "embed",
    Matmul => "matmul",
    MatmulBf16 => "matmul_bf16",
    Linear => "linear",
    GluMlp => "glu_mlp",
    HeadArgmax => "head_argmax",
    RmsNorm => "rms_norm",
    Unary => "unary",
    MulCols => "mul_cols",
    MulSigmoid => "mul_sigmoid",
    MulRowsSigmoid => "mul_rows_sigmoid",
    Add => "add",
    ScatterAdd => "scatter_add",
    NewKv => "new_kv",
    Rope => "rope",
    KvWrite => "kv_write",
    KvClone => "kv_clone",
    Attention => "attention",
    Route => "route",
    /// [`CoreOps::route`] with [`crate::Scoring::SqrtSoftplus`] (DeepSeek-V4's router): a
    /// backend may have `route` for the other scorings only.
    RouteSqrtSoftplus => "route (sqrt-softplus)",
    // RecurrentOps
    NewState => "new_state",
    ZeroState => "zero_state",
    Conv1dSilu => "conv1d_silu",
    Conv1d => "conv1d",
    DeltaGates => "delta_gates",
    GatedDeltaRule => "gated_delta_rule",
    RmsNormGated => "rms_norm_gated",
    // DeepSeekV4Ops
    RopeAt => "rope_at",
    MatmulGrouped => "matmul_grouped",
    HcPre => "hc_pre",
    HcPost => "hc_post",
    CompressPool => "compress_pool",
    AttentionSparse => "attention_sparse",
    IndexTopK => "index_top_k",
    // InklingOps
    AttentionRel => "attention_rel",
    RouteSinks => "route_sinks",
}

/// The ops of `required` that backend type `B` lacks, in `required`'s order (empty: `B` can run
/// a family that requires them). Needs no instance: ask before any device context exists.
pub fn missing_ops<B: Backend>(required: &[Op]) -> Vec<Op> {
    required
        .iter()
        .copied()
        .filter(|&op| !B::supports(op))
        .collect()
}

#[cfg(test)]
mod tests;
