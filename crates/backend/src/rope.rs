//! Rotary position embedding tables (host constants, built once at load; backends apply them).

/// Which dimensions of a head form the rotated pairs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// "Rotate half": dimension `i` pairs with `i + rotated/2` (HF / NeoX, mlx `traditional=False`).
    NeoX,
    /// Adjacent pairs `(2i, 2i + 1)` (GPT-J, mlx `traditional=True`; DeepSeek's rotary dims).
    Interleaved,
}

/// RoPE for one layer kind: the first `rotated` dimensions of each head turn, pair `i` at
/// `inv_freq[i]` rad/token, and the rotated values are scaled by `mscale` (YaRN's attention factor;
/// 1 otherwise). `inv_freq[i] = 0` leaves a pair unrotated (Gemma 4's proportional RoPE).
///
/// Source: transformers `modeling_rope_utils.py` (`default`, `proportional`, `yarn`),
/// mlx-lm `gemma4_text.py` (Gemma 4), `qwen3_5.py` (Qwen partial), transformers
/// `modeling_deepseek_v4.py` (DeepSeek-V4 YaRN).
#[derive(Clone, Debug, PartialEq)]
pub struct Rope {
    pub inv_freq: Vec<f32>,
    /// Dimensions at the start of each head that take part (`2 · inv_freq.len()`).
    pub rotated: usize,
    pub style: RopeStyle,
    pub mscale: f32,
}

/// YaRN context extension (`rope_type: yarn`): HF `_compute_yarn_parameters`.
#[derive(Clone, Copy, Debug)]
pub struct Yarn {
    pub factor: f64,
    pub original_max_position_embeddings: f64,
    pub beta_fast: f64,
    pub beta_slow: f64,
    /// The attention factor applied to cos and sin (HF `attention_factor`; default
    /// `0.1·ln(factor) + 1`).
    pub attention_factor: Option<f64>,
}

impl Rope {
    /// Full or partial NeoX RoPE over the first `rotated` dims: `inv_freq[i] = theta^(-2i/rotated)`.
    pub fn neox(rotated: usize, theta: f64) -> Self {
        Self::proportional(rotated, rotated, theta)
    }

    /// Gemma 4's proportional RoPE: every NeoX pair of a `head_dim` head, the frequencies of a
    /// `head_dim` rotation (`theta^(-2i/head_dim)`) for the first `rotated_dims/2` pairs, 0 after.
    pub fn proportional(head_dim: usize, rotated_dims: usize, theta: f64) -> Self {
        let inv_freq = (0..head_dim / 2)
            .map(|i| {
                if 2 * i < rotated_dims {
                    theta.powf(-(2.0 * i as f64) / head_dim as f64) as f32
                } else {
                    0.0
                }
            })
            .collect();
        Self {
            inv_freq,
            rotated: head_dim,
            style: RopeStyle::NeoX,
            mscale: 1.0,
        }
    }

    /// Interleaved RoPE over the first `rotated` dims: `inv_freq[i] = theta^(-2i/rotated)`.
    pub fn interleaved(rotated: usize, theta: f64) -> Self {
        Self {
            style: RopeStyle::Interleaved,
            ..Self::neox(rotated, theta)
        }
    }

    /// These frequencies stretched by YaRN: pairs whose wavelength is long relative to the
    /// original context are interpolated by `1/factor`, short ones kept, with a linear ramp
    /// between the correction range `[low, high]`; `mscale` becomes the attention factor.
    pub fn yarn(mut self, y: &Yarn, theta: f64) -> Self {
        let dim = self.rotated as f64;
        let half = self.inv_freq.len();
        let correction_dim = |rotations: f64| {
            dim * (y.original_max_position_embeddings / (rotations * 2.0 * std::f64::consts::PI))
                .ln()
                / (2.0 * theta.ln())
        };
        let low = correction_dim(y.beta_fast).floor().max(0.0);
        let high = correction_dim(y.beta_slow).ceil().min(dim - 1.0);
        let high = if low == high { high + 0.001 } else { high };
        for (i, f) in self.inv_freq.iter_mut().enumerate().take(half) {
            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
            let extrapolation = 1.0 - ramp;
            let fe = *f as f64;
            *f = (fe / y.factor * (1.0 - extrapolation) + fe * extrapolation) as f32;
        }
        self.mscale = y.attention_factor.unwrap_or(0.1 * y.factor.ln() + 1.0) as f32;
        self
    }

    /// Rotates the first `rotated` dims of every `head_dim` head of one row at position `pos`.
    pub fn apply(&self, x: &mut [f32], head_dim: usize, pos: usize) {
        let half = self.rotated / 2;
        let cs: Vec<(f32, f32)> = self
            .inv_freq
            .iter()
            .map(|&f| {
                let (s, c) = (pos as f32 * f).sin_cos();
                if self.mscale == 1.0 {
                    (c, s)
                } else {
                    (c * self.mscale, s * self.mscale)
                }
            })
            .collect();
        for head in x.chunks_exact_mut(head_dim) {
            let head = &mut head[..self.rotated];
            match self.style {
                RopeStyle::NeoX => {
                    let (a, b) = head.split_at_mut(half);
                    for i in 0..half {
                        let (c, s) = cs[i];
                        let (x1, x2) = (a[i], b[i]);
                        a[i] = x1 * c - x2 * s;
                        b[i] = x1 * s + x2 * c;
                    }
                }
                RopeStyle::Interleaved => {
                    for (i, p) in head.chunks_exact_mut(2).enumerate() {
                        let (c, s) = cs[i];
                        let (x1, x2) = (p[0], p[1]);
                        p[0] = x1 * c - x2 * s;
                        p[1] = x1 * s + x2 * c;
                    }
                }
            }
        }
    }
}
