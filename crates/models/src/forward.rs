//! What a forward pass returns and the pieces every family's forward shares: the chunked
//! prefill ([`run_chunked`]), the final norm and head ([`head`]) and the residual update.

use mference_backend::{Backend, Norm, PreNorm, QRef, Tensor, Unary, VRef, Weights};

use crate::ModelError;

/// Which logits a forward pass returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Want {
    /// None (a prefill chunk that is not the last).
    None,
    /// The last row's logits (`[vocab]`, post-softcap).
    Last,
    /// Every row's logits (`[T, vocab]`): parity tests.
    All,
    /// The logits of the last `n` rows (`[n, vocab]`): perplexity scores only the second half.
    Tail(usize),
    /// Only the argmax of the last row (pure greedy; full logits are never materialised).
    Argmax,
}

/// What one prefill chunk must return.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChunkWant {
    None,
    /// Logits of the chunk's rows from this row on.
    From(usize),
    Argmax,
}

/// Splits `tokens` (to be placed after `position` cached positions) into chunks of `chunk` rows and
/// runs `run(chunk_tokens, chunk_want)` on each in order, asking each chunk only for the logits `want`
/// needs; concatenates rows across chunks.
///
/// Errors: no tokens; [`ModelError::ContextFull`] when they would not fit in `max_context`.
pub fn run_chunked(
    tokens: &[u32],
    position: usize,
    chunk: usize,
    max_context: usize,
    want: Want,
    mut run: impl FnMut(&[u32], ChunkWant) -> Result<Logits, ModelError>,
) -> Result<Logits, ModelError> {
    if tokens.is_empty() {
        return Err(ModelError::Input("no tokens to run".into()));
    }
    let need = position + tokens.len();
    if need > max_context {
        return Err(ModelError::ContextFull {
            need,
            max: max_context,
        });
    }
    let total = tokens.len();
    let first = match want {
        Want::None => total,
        Want::All => 0,
        Want::Tail(n) => total - n.min(total),
        Want::Last | Want::Argmax => total - 1,
    };
    let mut rows = Vec::new();
    let mut last = Logits::None;
    for (i, c) in tokens.chunks(chunk).enumerate() {
        let (start, end) = (i * chunk, i * chunk + c.len());
        let w = if want == Want::Argmax && end == total {
            ChunkWant::Argmax
        } else if end > first {
            ChunkWant::From(first.saturating_sub(start))
        } else {
            ChunkWant::None
        };
        match run(c, w)? {
            Logits::Rows(r) => rows.extend(r),
            other => last = other,
        }
    }
    Ok(match want {
        Want::None | Want::Argmax => last,
        _ => Logits::Rows(rows),
    })
}

/// The result of a forward pass.
#[derive(Debug)]
pub enum Logits {
    None,
    /// Row-major `[rows, vocab]`.
    Rows(Vec<f32>),
    Argmax(u32),
}

/// The final norm and the head of a family.
pub struct Head<'a> {
    pub norm: &'a VRef,
    pub eps: f32,
    pub weight: &'a QRef,
    pub softcap: Option<f32>,
}

/// The final RMSNorm and the head over the rows of `x` (`[T, hidden]`) that `want` asks for:
/// the logits (`[rows, vocab]`, softcapped if the family does) read back to the host, or only the
/// fused greedy argmax of the last row.
///
/// Errors: [`ModelError::NonFinite`] when the residual stream of the chunk at positions `pos0..`
/// or the logits hold a NaN or an infinity.
pub fn head<B: Backend>(
    be: &B,
    x: &B::Tensor,
    pos0: usize,
    want: ChunkWant,
    head: &Head,
) -> Result<Logits, ModelError> {
    let t = x.rows();
    let non_finite = |what| ModelError::NonFinite {
        what,
        first: pos0,
        end: pos0 + t,
    };
    if !be.all_finite(x)? {
        return Err(non_finite("residual stream"));
    }
    let first = match want {
        ChunkWant::None => return Ok(Logits::None),
        ChunkWant::From(r) => r,
        ChunkWant::Argmax => t - 1,
    };
    let mut xf = be.gather_rows(x, &(first..t).collect::<Vec<_>>())?;
    be.rms_norm(&mut xf, x.cols(), Norm::Weight(head.norm), head.eps)?;
    if want == ChunkWant::Argmax {
        let (id, logit) = be.head_argmax(head.weight, &xf)?;
        if !logit.is_finite() {
            return Err(non_finite("logits"));
        }
        return Ok(Logits::Argmax(id));
    }
    let mut logits = one(be.matmul(&[head.weight], Weights::Resident, &xf)?); // [rows, vocab]
    if let Some(c) = head.softcap {
        be.unary(&mut logits, Unary::Softcap(c))?;
    }
    let rows = be.read(&logits)?;
    if rows.iter().any(|v| !v.is_finite()) {
        return Err(non_finite("logits"));
    }
    Ok(Logits::Rows(rows))
}

/// The single result of a one-matrix [`Backend::matmul`].
pub(crate) fn one<T>(mut v: Vec<T>) -> T {
    v.pop().expect("one product")
}

/// A layer's output `y` into the residual `x` (`post` and `s` as in
/// [`Backend::add_rms_norm_pre`]) and, by `next` (`None` after the last layer), the next layer's
/// input norm, in one op.
#[allow(clippy::too_many_arguments)]
pub(crate) fn into_residual<B: Backend>(
    be: &B,
    x: &mut B::Tensor,
    y: &B::Tensor,
    dim: usize,
    post: Option<Norm>,
    eps: f32,
    s: f32,
    next: Option<&VRef>,
) -> Result<Option<B::Tensor>, ModelError> {
    Ok(be
        .add_rms_norm_pre(x, y, dim, post, eps, s, &next_pre(next))?
        .pop())
}

/// The pre-norm list of a residual update that computes the next layer's input norm `next`
/// (none after the last layer).
pub(crate) fn next_pre(next: Option<&VRef>) -> Vec<PreNorm<'_>> {
    next.map(|w| PreNorm {
        norm: Norm::Weight(w),
        cols: None,
    })
    .into_iter()
    .collect()
}

/// Token ids must index the vocabulary.
pub(crate) fn check_ids(tokens: &[u32], vocab: usize) -> Result<(), ModelError> {
    match tokens.iter().find(|&&id| id as usize >= vocab) {
        Some(id) => Err(ModelError::Input(format!(
            "token id {id} is outside the vocabulary ({vocab})"
        ))),
        None => Ok(()),
    }
}
