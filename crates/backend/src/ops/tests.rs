//! The capability table against the default bodies: a backend that implements no op must report
//! each [`Op`] missing under [`Op::name`], and [`missing_ops`] must follow `supports`.

use super::*;
use crate::{
    Act, AttnShape, DeltaShape, HcSpec, KvDtype, KvState, Mlp, Norm, OpError, OpResult, QRef,
    RelBias, Rope, RouterSpec, Scoring, SinkRouter, Tensor, Unary, VRef, Weights,
};

/// A backend with every group at its defaults.
struct Null;
struct NullTensor;
struct NullKv;

impl Tensor for NullTensor {
    fn rows(&self) -> usize {
        1
    }
    fn cols(&self) -> usize {
        1
    }
}

impl KvState for NullKv {
    fn rows(&self) -> usize {
        0
    }
    fn is_ring(&self) -> bool {
        false
    }
    fn bytes(&self) -> usize {
        0
    }
}

impl CoreOps for Null {
    type Tensor = NullTensor;
    type Kv = NullKv;
    type State = ();
    fn name(&self) -> String {
        "null".into()
    }
    fn kernels(&self) -> &'static str {
        "null"
    }
    fn supports(op: Op) -> bool {
        matches!(op, Op::Upload | Op::Route)
    }
}
impl RecurrentOps for Null {}
impl DeepSeekV4Ops for Null {}
impl InklingOps for Null {}
impl DeviceExpertOps for Null {}

/// Calls `op`'s method on `be` with throwaway operands; `Err` carries what it reported.
fn call(be: &Null, op: Op) -> OpResult<()> {
    let t = NullTensor;
    let mut m = NullTensor;
    let kv = NullKv;
    let mut kvm = NullKv;
    let mut st = ();
    let q = QRef::from_parts("q", 1, 64, (0, 32), (32, 2), (34, 2), 64).expect("a 4-bit row");
    let v = VRef::at(0, 1);
    let mlp = Mlp {
        gate_proj: q,
        up_proj: q,
        down_proj: q,
    };
    let rope = Rope::neox(2, 10000.0);
    let shape = AttnShape {
        n_heads: 1,
        n_kv_heads: 1,
        head_dim: 1,
        window: None,
        scale: 1.0,
        sinks: None,
    };
    let spec = |scoring| RouterSpec {
        scoring,
        top_k: 1,
        per_expert_scale: None,
        trace: false,
        forced: None,
    };
    let softmax = spec(Scoring::SoftmaxOfTopK);
    let _ = &mlp;
    match op {
        Op::Upload => be.upload(&[0.0], 1).map(drop),
        Op::Zeros => be.zeros(1, 1).map(drop),
        Op::Copy => be.copy(&t).map(drop),
        Op::Read => be.read(&t).map(drop),
        Op::AllFinite => be.all_finite(&t).map(drop),
        Op::GatherRows => be.gather_rows(&t, &[0]).map(drop),
        Op::Split => be.split(&t, 1, &[1]).map(drop),
        Op::SetRows => be.set_rows(&mut m, 0, &t),
        Op::Embed => be.embed(&q, &[0], None).map(drop),
        Op::Matmul => be.matmul(&[&q], Weights::Resident, &t).map(drop),
        Op::MatmulBf16 => be.matmul_bf16(&v, 1, &t).map(drop),
        Op::Linear => be.linear(&t, &t).map(drop),
        Op::GluMlp => be.glu_mlp(&mlp, Act::Silu, Weights::Resident, &t).map(drop),
        Op::HeadArgmax => be.head_argmax(&q, &t).map(drop),
        Op::RmsNorm => be.rms_norm(&mut m, 1, Norm::NoScale, 1e-6),
        Op::Unary => be.unary(&mut m, Unary::Silu),
        Op::MulCols => be.mul_cols(&mut m, &v, 1.0),
        Op::MulSigmoid => be.mul_sigmoid(&mut m, &t),
        Op::MulRowsSigmoid => be.mul_rows_sigmoid(&mut m, &t),
        Op::Add => be.add(&mut m, &t, 1.0),
        Op::ScatterAdd => be.scatter_add(&mut m, &t, &[(0, 1.0)]),
        Op::NewKv => be.new_kv(1, false, 1, 1, KvDtype::F32).map(drop),
        Op::Rope => be.rope(&mut m, &rope, 2, 0),
        Op::KvWrite => be.kv_write(&mut kvm, 0, &t, &t),
        Op::KvClone => be.kv_clone(&kv).map(drop),
        Op::Attention => be.attention(&t, &kv, 0, &shape).map(drop),
        Op::Route => be.route(&t, &softmax).map(drop),
        Op::RouteSqrtSoftplus => be
            .route(
                &t,
                &spec(Scoring::SqrtSoftplus {
                    routed_scaling_factor: 1.0,
                    correction_bias: None,
                }),
            )
            .map(drop),
        Op::NewState => be.new_state(1).map(drop),
        Op::ZeroState => be.zero_state(&mut st),
        Op::Conv1dSilu => be.conv1d_silu(&t, &mut st, &t, 2).map(drop),
        Op::Conv1d => be.conv1d(&t, &mut st, &t, 2).map(drop),
        Op::DeltaGates => be.delta_gates(&t, &t, &t, &t).map(drop),
        Op::GatedDeltaRule => {
            let ds = DeltaShape {
                n_k_heads: 1,
                n_v_heads: 1,
                head_k_dim: 1,
                head_v_dim: 1,
            };
            be.gated_delta_rule(&t, &t, &t, &t, &t, &mut st, &ds)
                .map(drop)
        }
        Op::RmsNormGated => be.rms_norm_gated(&mut m, 1, &v, &t, 1e-6),
        Op::RopeAt => be.rope_at(&mut m, &rope, 2, &[0]),
        Op::MatmulGrouped => be.matmul_grouped(&q, 1, Weights::Resident, &t).map(drop),
        Op::HcPre => {
            let hc = HcSpec {
                streams: 1,
                sinkhorn_iters: 1,
                hc_eps: 1e-6,
                norm_eps: 1e-6,
            };
            be.hc_pre(&t, &t, &[0.0], &[1.0], &hc).map(drop)
        }
        Op::HcPost => be.hc_post(&t, &t, &t, &t).map(drop),
        Op::CompressPool => be.compress_pool(&t, &t, &t, 1, false, None).map(drop),
        Op::AttentionSparse => be
            .attention_sparse(&t, &kv, 0, &shape, &t, &[vec![0]])
            .map(drop),
        Op::IndexTopK => be.index_top_k(&t, &t, &t, 1, &[1], 1).map(drop),
        Op::AttentionRel => {
            let bias = RelBias {
                rel: &t,
                proj: &t,
                log_scaling: None,
            };
            be.attention_rel(&t, &kv, 0, &shape, &bias).map(drop)
        }
        Op::RouteSinks => {
            let router = SinkRouter {
                bias: &t,
                n_shared: 1,
                scale: 1.0,
            };
            be.route_sinks(&t, &router, &softmax).map(drop)
        }
    }
}

#[test]
fn every_default_body_reports_its_op_by_name() {
    for &op in Op::ALL {
        // A backend without `route` lacks every scoring of it.
        let want = match op {
            Op::RouteSqrtSoftplus => Op::Route.name(),
            _ => op.name(),
        };
        assert_eq!(
            call(&Null, op),
            Err(OpError::Missing {
                backend: "null".into(),
                op: want,
            }),
            "{op:?}"
        );
    }
}

#[test]
fn names_are_distinct() {
    for (i, a) in Op::ALL.iter().enumerate() {
        for b in &Op::ALL[..i] {
            assert_ne!(a.name(), b.name(), "{a:?} and {b:?}");
        }
    }
}

#[test]
fn missing_ops_keeps_the_unsupported_in_order() {
    let required = [Op::HcPost, Op::Route, Op::Upload, Op::Read];
    assert_eq!(missing_ops::<Null>(&required), vec![Op::HcPost, Op::Read]);
    assert!(missing_ops::<Null>(&[Op::Upload]).is_empty());
}
