//! DeepSeek-V4 attention: low-rank Q, the shared K = V head over the sliding ring, the CSA / HCA
//! compressors and the Lightning indexer (transformers `DeepseekV4Attention`,
//! `DeepseekV4{CSA,HCA}Compressor`, `DeepseekV4Indexer`).

use mference_backend::Weights::Resident;
use mference_backend::{AttnShape, Backend, Norm, QRef, Rope, Tensor, Unary, VRef};

use super::{Config, Kind, Layer};
use crate::{one, CompressedKv, ModelError};

/// A KV compressor (`attn.compressor.*`, or the indexer's `attn.indexer.compressor.*`).
pub(super) struct Compressor<B: Backend> {
    pub(super) wkv: QRef,
    pub(super) wgate: QRef,
    /// `[rate, c·dim]` (`c = 2` with overlap).
    pub(super) ape: B::Tensor,
    /// The Ca half of `ape`, `[rate, dim]` (overlap only): added to the saved prior gate rows.
    pub(super) ape_ca: Option<B::Tensor>,
    pub(super) norm: VRef,
    pub(super) rate: usize,
    pub(super) dim: usize,
    pub(super) overlap: bool,
}

/// The Lightning indexer of a CSA layer.
pub(super) struct Indexer<B: Backend> {
    pub(super) compressor: Compressor<B>,
    pub(super) wq_b: QRef,
    pub(super) weights_proj: QRef,
}

pub(super) struct Attention<B: Backend> {
    pub(super) wq_a: QRef,
    pub(super) q_norm: VRef,
    pub(super) wq_b: QRef,
    pub(super) wkv: QRef,
    pub(super) kv_norm: VRef,
    pub(super) wo_a: QRef,
    pub(super) wo_b: QRef,
    pub(super) attn_sink: Vec<f32>,
    pub(super) compressor: Option<Compressor<B>>,
    pub(super) indexer: Option<Indexer<B>>,
}

/// The RoPE tables: main (sliding layers) and compress (CSA/HCA layers and the indexer), each as
/// a forward and an inverse rotation of the trailing `qk_rope_head_dim` dims of a head.
pub(super) struct Ropes {
    pub(super) main: (Rope, Rope),
    pub(super) compress: (Rope, Rope),
    /// The compress rope over an indexer head.
    pub(super) index: Rope,
}

/// Interleaved RoPE on the trailing `rope.rotated` dims of a `head_dim` head: the leading pairs
/// get frequency 0 (cos 1, sin 0: unchanged); `inverse` rotates by `−pos` (HF's `(cos, −sin)`).
pub(super) fn tail(rope: &Rope, head_dim: usize, inverse: bool) -> Rope {
    let lead = (head_dim - rope.rotated) / 2;
    let sign = if inverse { -1.0 } else { 1.0 };
    Rope {
        inv_freq: std::iter::repeat_n(0.0, lead)
            .chain(rope.inv_freq.iter().map(|f| sign * f))
            .collect(),
        rotated: head_dim,
        ..rope.clone()
    }
}

/// The attention block over the rows of `a` (`[T, hidden]`, the normed collapsed streams) at
/// positions `pos0..` (transformers `DeepseekV4Attention.forward`). Returns `[T, hidden]`.
#[allow(clippy::too_many_arguments)]
pub(super) fn attention<B: Backend>(
    cfg: &Config,
    be: &B,
    layer: &Layer<B>,
    ropes: &Ropes,
    kv: &mut B::Kv,
    cs: Option<&mut CompressedKv<B>>,
    is: Option<&mut CompressedKv<B>>,
    a: &B::Tensor,
    pos0: usize,
) -> Result<B::Tensor, ModelError> {
    let at = &layer.attn;
    let (nh, hd) = (cfg.num_attention_heads, cfg.head_dim);
    let eps = cfg.rms_norm_eps;
    let t = a.rows();
    let (rope, rope_inv) = match layer.kind {
        Kind::Sliding => &ropes.main,
        _ => &ropes.compress,
    };
    let mut p = be.matmul(&[&at.wq_a, &at.wkv], Resident, a)?;
    let mut kv_rows = p.pop().expect("wkv"); // [T, head_dim]
    let mut q_residual = p.pop().expect("wq_a"); // [T, q_lora_rank]
    be.rms_norm(
        &mut q_residual,
        cfg.q_lora_rank,
        Norm::Weight(&at.q_norm),
        eps,
    )?;
    let mut q = one(be.matmul(&[&at.wq_b], Resident, &q_residual)?); // [T, heads·head_dim]
    be.rms_norm(&mut q, hd, Norm::NoScale, eps)?;
    be.rope(&mut q, rope, hd, pos0)?;
    be.rms_norm(&mut kv_rows, hd, Norm::Weight(&at.kv_norm), eps)?;
    be.rope(&mut kv_rows, rope, hd, pos0)?;
    be.kv_write(kv, pos0, &kv_rows, &kv_rows)?;

    let shape = AttnShape {
        n_heads: nh,
        n_kv_heads: 1,
        head_dim: hd,
        window: Some(cfg.sliding_window),
        scale: (hd as f32).powf(-0.5),
        sinks: Some(at.attn_sink.clone()),
    };
    let mut o = match (&at.compressor, cs) {
        (Some(c), Some(st)) => {
            compress(cfg, be, c, st, &ropes.compress.0, hd, a)?;
            // Entry w covers positions rate·w .. rate·w + rate − 1: visible from position p iff
            // w < (p + 1) / rate.
            let n_vis: Vec<usize> = (0..t).map(|r| (pos0 + r + 1) / c.rate).collect();
            let every = || n_vis.iter().map(|&n| (0..n).collect()).collect();
            let visible: Vec<Vec<usize>> = match (&at.indexer, is) {
                (Some(ix), Some(ist)) => {
                    compress(
                        cfg,
                        be,
                        &ix.compressor,
                        ist,
                        &ropes.index,
                        cfg.index_head_dim,
                        a,
                    )?;
                    // The top index_topk of no more entries than that are all of them, whatever
                    // their scores: the indexer scores only when some row sees more.
                    if n_vis.iter().all(|&n| n <= cfg.index_topk) {
                        every()
                    } else {
                        let (ni, id) = (cfg.index_n_heads, cfg.index_head_dim);
                        let mut iq = one(be.matmul(&[&ix.wq_b], Resident, &q_residual)?); // [T, ni·id]
                        be.rope(&mut iq, &ropes.index, id, pos0)?;
                        let mut w = one(be.matmul(&[&ix.weights_proj], Resident, a)?); // [T, ni]
                        let scale = (ni as f32).powf(-0.5) * (id as f32).powf(-0.5);
                        be.unary(&mut w, Unary::Scale(scale))?;
                        be.index_top_k(&iq, &ist.entries, &w, ni, &n_vis, cfg.index_topk)?
                    }
                }
                _ => every(),
            };
            be.attention_sparse(&q, kv, pos0, &shape, &st.entries, &visible)?
        }
        _ => be.attention(&q, kv, pos0, &shape)?,
    };
    // K = V carried the rotation into the output: rotate it back by −pos.
    be.rope(&mut o, rope_inv, hd, pos0)?;
    let grouped = be.matmul_grouped(&at.wo_a, cfg.o_groups, Resident, &o)?; // [T, groups·o_lora]
    Ok(one(be.matmul(&[&at.wo_b], Resident, &grouped)?))
}

/// Runs a compressor over the rows of `a`: projects kv and gate, closes every window the pending
/// rows plus these complete, and appends the pooled, normed, rotated entries to `st` (transformers
/// `DeepseekV4{CSA,HCA}Compressor` with its cache: `store_compression_weights`,
/// `update_overlap_state`, `update_compressor_states`).
pub(super) fn compress<B: Backend>(
    cfg: &Config,
    be: &B,
    c: &Compressor<B>,
    st: &mut CompressedKv<B>,
    rope: &Rope,
    head_dim: usize,
    a: &B::Tensor,
) -> Result<(), ModelError> {
    let t = a.rows();
    let m = c.rate;
    let mut p = be.matmul(&[&c.wkv, &c.wgate], Resident, a)?;
    let gate = p.pop().expect("wgate"); // [T, c·dim]
    let kv = p.pop().expect("wkv");
    let total = st.pending + t;
    let n_win = total / m;
    if n_win == 0 {
        be.set_rows(&mut st.pending_kv, st.pending, &kv)?;
        be.set_rows(&mut st.pending_gate, st.pending, &gate)?;
        st.pending += t;
        return Ok(());
    }
    let usable = n_win * m;
    let from_chunk = usable - st.pending; // rows of this chunk inside closed windows
    let width = kv.cols();
    let windows = |pending: &B::Tensor, new: &B::Tensor| -> Result<B::Tensor, ModelError> {
        let mut w = be.zeros(usable, width)?;
        if st.pending > 0 {
            be.set_rows(
                &mut w,
                0,
                &be.gather_rows(pending, &(0..st.pending).collect::<Vec<_>>())?,
            )?;
        }
        be.set_rows(
            &mut w,
            st.pending,
            &be.gather_rows(new, &(0..from_chunk).collect::<Vec<_>>())?,
        )?;
        Ok(w)
    };
    let kv_w = windows(&st.pending_kv, &kv)?; // [usable, c·dim]
    let gate_w = windows(&st.pending_gate, &gate)?;
    let prior = st.prior.as_ref().map(|(k, g)| (k, g));
    let mut pooled = be.compress_pool(&kv_w, &gate_w, &c.ape, m, c.overlap, prior)?; // [W, dim]
    be.rms_norm(&mut pooled, c.dim, Norm::Weight(&c.norm), cfg.rms_norm_eps)?;
    let positions: Vec<usize> = (st.count..st.count + n_win).map(|w| w * m).collect();
    be.rope_at(&mut pooled, rope, head_dim, &positions)?;
    if st.count + n_win > st.entries.rows() {
        return Err(ModelError::ContextFull {
            need: (st.count + n_win) * m,
            max: st.entries.rows() * m,
        });
    }
    be.set_rows(&mut st.entries, st.count, &pooled)?;
    st.count += n_win;
    if let Some(ape_ca) = &c.ape_ca {
        // The last closed window's Ca slice (kv, and gate with its position bias) for entry
        // `count`'s overlap.
        let last: Vec<usize> = (usable - m..usable).collect();
        let ca = |x: &B::Tensor| -> Result<B::Tensor, ModelError> {
            let rows = be.gather_rows(x, &last)?;
            Ok(be.split(&rows, width, &[c.dim, c.dim])?.swap_remove(0))
        };
        let prior_kv = ca(&kv_w)?;
        let mut prior_gate = ca(&gate_w)?;
        be.add(&mut prior_gate, ape_ca, 1.0)?;
        st.prior = Some((prior_kv, prior_gate));
    }
    let rest: Vec<usize> = (from_chunk..t).collect();
    if !rest.is_empty() {
        be.set_rows(&mut st.pending_kv, 0, &be.gather_rows(&kv, &rest)?)?;
        be.set_rows(&mut st.pending_gate, 0, &be.gather_rows(&gate, &rest)?)?;
    }
    st.pending = rest.len();
    Ok(())
}
