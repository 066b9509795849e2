//! Token sampling in mlx-lm's order (as the original Mference, github.com/NeelM0906/Mference, and mlx-lm's `sample_utils.py`): top-p over the full
//! distribution, then top-k over the survivors, then temperature on the final draw. Repetition
//! penalty follows the HF convention on the post-softcap logits.

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Sampling settings. `temperature == 0` means greedy.
#[derive(Clone, Debug)]
pub struct SamplerConfig {
    pub temperature: f32,
    /// 0 turns top-k off.
    pub top_k: usize,
    /// 1 turns top-p off.
    pub top_p: f32,
    pub repetition_penalty: f32,
    /// `None`: a clock seed.
    pub seed: Option<u64>,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        Self {
            temperature: 0.2,
            top_k: 64,
            top_p: 0.95,
            repetition_penalty: 1.0,
            seed: None,
        }
    }
}

impl SamplerConfig {
    /// Pure greedy: temperature 0 and no repetition penalty. The model may then take a fused
    /// argmax path that never materialises the full logits.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 && self.repetition_penalty == 1.0
    }
}

/// A sampler with its own reproducible random stream.
pub struct Sampler {
    cfg: SamplerConfig,
    seed: u64,
    scratch: Vec<(f32, u32)>,
}

/// splitmix64 finaliser: decorrelates `seed + position` into a per-position seed.
fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e3779b97f4a7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
    z ^ (z >> 31)
}

impl Sampler {
    /// Builds a sampler; a missing seed is taken from the clock.
    pub fn new(cfg: SamplerConfig) -> Self {
        let seed = cfg.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        });
        Self {
            cfg,
            seed,
            scratch: Vec::new(),
        }
    }

    /// The settings.
    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    /// Picks the next token from `logits` (`[vocab]`, post-softcap; modified in place by the
    /// repetition penalty). `history` is every token seen so far; `position` seeds the draw.
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32], position: usize) -> u32 {
        let p = self.cfg.repetition_penalty;
        if p != 1.0 {
            let mut seen = std::collections::HashSet::new();
            for &t in history {
                if seen.insert(t) {
                    if let Some(l) = logits.get_mut(t as usize) {
                        *l = if *l > 0.0 { *l / p } else { *l * p };
                    }
                }
            }
        }
        if self.cfg.temperature == 0.0 {
            return argmax(logits);
        }
        // Candidates in descending logit order (ties by token id, so the order is total). Only the
        // prefix that top-p and top-k can keep is ever sorted: it grows until the nucleus closes
        // inside it or it reaches top-k, which gives the same candidates as sorting everything.
        let s = &mut self.scratch;
        s.clear();
        s.extend(logits.iter().enumerate().map(|(i, &l)| (l, i as u32)));
        let max = s.iter().map(|x| x.0).fold(f32::NEG_INFINITY, f32::max);
        let cap = if self.cfg.top_k > 0 {
            self.cfg.top_k.min(s.len())
        } else {
            s.len()
        };
        // Top-p on the untempered distribution, as mlx-lm's apply_top_p does.
        let nucleus = (self.cfg.top_p < 1.0).then(|| {
            let z: f64 = s.iter().map(|x| ((x.0 - max) as f64).exp()).sum();
            self.cfg.top_p as f64 * z
        });
        let mut keep = cap;
        if self.cfg.top_k > 0 || nucleus.is_some() {
            let mut m = if nucleus.is_some() { cap.min(256) } else { cap };
            loop {
                if m < s.len() {
                    s.select_nth_unstable_by(m - 1, by_logit_desc);
                }
                s[..m].sort_unstable_by(by_logit_desc);
                let Some(mass) = nucleus else { break };
                // mlx-lm keeps tokens whose cumulative mass *before* them is below top_p.
                let mut cum = 0.0f64;
                let closed = s[..m].iter().position(|x| {
                    let done = cum >= mass;
                    cum += ((x.0 - max) as f64).exp();
                    done
                });
                match closed {
                    Some(k) => {
                        keep = k.max(1);
                        break;
                    }
                    None if m == cap => break,
                    None => m = (2 * m).min(cap),
                }
            }
        }
        let cand = &s[..keep];
        let t = self.cfg.temperature as f64;
        let weights: Vec<f64> = cand
            .iter()
            .map(|x| (((x.0 - max) as f64) / t).exp())
            .collect();
        let total: f64 = weights.iter().sum();
        let mut rng =
            ChaCha8Rng::seed_from_u64(splitmix64(self.seed.wrapping_add(position as u64)));
        let mut u = rng.random::<f64>() * total;
        for (w, x) in weights.iter().zip(cand) {
            if u < *w {
                return x.1;
            }
            u -= w;
        }
        // Rounding ran past the end: the last candidate that can be drawn (a masked `-inf`
        // logit, or one whose weight underflowed, never can).
        cand.iter()
            .zip(&weights)
            .rev()
            .find(|(_, w)| **w > 0.0)
            .map_or(cand[0].1, |(x, _)| x.1)
    }
}

/// Descending logit, then ascending token id: a total order, so candidate order never depends on
/// how a sort happened to break ties.
fn by_logit_desc(a: &(f32, u32), b: &(f32, u32)) -> std::cmp::Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

/// Index of the largest value (the first one on ties).
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_is_argmax_and_penalty_follows_hf() {
        let mut s = Sampler::new(SamplerConfig {
            temperature: 0.0,
            repetition_penalty: 2.0,
            ..Default::default()
        });
        // Token 1 is the max (4.0) but penalised to 2.0; token 2 (3.0) wins.
        let mut l = vec![0.0, 4.0, 3.0, -1.0];
        assert_eq!(s.sample(&mut l, &[1, 3], 0), 2);
        assert_eq!(l[3], -2.0);
    }

    #[test]
    fn masked_logits_are_never_drawn() {
        // Three allowed tokens among 1000, top-k wider than that: a response-format mask.
        let mut base = vec![f32::NEG_INFINITY; 1000];
        for (i, l) in [(7usize, 0.5f32), (500, 0.0), (999, -0.5)] {
            base[i] = l;
        }
        for seed in 0..2000u64 {
            let mut s = Sampler::new(SamplerConfig {
                temperature: 1.5,
                top_k: 64,
                top_p: 1.0,
                repetition_penalty: 1.3,
                seed: Some(seed),
            });
            let id = s.sample(&mut base.clone(), &[7, 3], seed as usize);
            assert!([7, 500, 999].contains(&id), "seed {seed} drew {id}");
        }
    }

    #[test]
    fn top_k_one_is_greedy_and_seed_reproduces() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 100) as f32 / 10.0).collect();
        let mut s = Sampler::new(SamplerConfig {
            temperature: 1.0,
            top_k: 1,
            top_p: 1.0,
            repetition_penalty: 1.0,
            seed: Some(7),
        });
        assert_eq!(s.sample(&mut logits.clone(), &[], 3), argmax(&logits));
        let cfg = SamplerConfig {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            repetition_penalty: 1.0,
            seed: Some(9),
        };
        let a: Vec<u32> = (0..20)
            .map(|p| Sampler::new(cfg.clone()).sample(&mut logits.clone(), &[], p))
            .collect();
        let b: Vec<u32> = (0..20)
            .map(|p| Sampler::new(cfg.clone()).sample(&mut logits.clone(), &[], p))
            .collect();
        assert_eq!(a, b);
        assert!(
            a.iter().collect::<std::collections::HashSet<_>>().len() > 1,
            "draws never vary"
        );
    }

    #[test]
    fn top_p_keeps_only_the_nucleus() {
        // Probabilities ~ [0.6, 0.3, 0.1]: top-p 0.5 keeps only the first token.
        let base = [0.6f32.ln(), 0.3f32.ln(), 0.1f32.ln()];
        let mut s = Sampler::new(SamplerConfig {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.5,
            repetition_penalty: 1.0,
            seed: Some(1),
        });
        for p in 0..50 {
            assert_eq!(s.sample(&mut base.to_vec(), &[], p), 0);
        }
        let mut s = Sampler::new(SamplerConfig {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.85,
            repetition_penalty: 1.0,
            seed: Some(1),
        });
        let picks: std::collections::HashSet<u32> = (0..200)
            .map(|p| s.sample(&mut base.to_vec(), &[], p))
            .collect();
        assert!(picks.contains(&1) && !picks.contains(&2), "{picks:?}");
    }

    /// The definition, written plainly: sort everything, top-p prefix, then top-k, then the draw.
    fn full_sort_sample(cfg: &SamplerConfig, seed: u64, logits: &[f32], position: usize) -> u32 {
        let mut s: Vec<(f32, u32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (l, i as u32))
            .collect();
        s.sort_by(by_logit_desc);
        let max = s[0].0;
        let mut keep = s.len();
        if cfg.top_p < 1.0 {
            let z: f64 = s.iter().map(|x| ((x.0 - max) as f64).exp()).sum();
            let (mut cum, mut k) = (0.0f64, 0);
            for x in &s {
                if cum >= cfg.top_p as f64 * z && k > 0 {
                    break;
                }
                cum += ((x.0 - max) as f64).exp();
                k += 1;
            }
            keep = k;
        }
        if cfg.top_k > 0 {
            keep = keep.min(cfg.top_k);
        }
        let w: Vec<f64> = s[..keep]
            .iter()
            .map(|x| (((x.0 - max) as f64) / cfg.temperature as f64).exp())
            .collect();
        let mut rng = ChaCha8Rng::seed_from_u64(splitmix64(seed.wrapping_add(position as u64)));
        let mut u = rng.random::<f64>() * w.iter().sum::<f64>();
        for (wi, x) in w.iter().zip(&s) {
            if u < *wi {
                return x.1;
            }
            u -= wi;
        }
        s[keep - 1].1
    }

    #[test]
    fn partial_sort_draws_what_a_full_sort_draws() {
        let mut rng = ChaCha8Rng::seed_from_u64(42);
        for case in 0..300 {
            let vocab = [5usize, 300, 4096, 20_000][case % 4];
            // Flat, peaked and tied distributions: logits on a coarse grid make ties common.
            let spread = [0.5f32, 4.0, 12.0][case % 3];
            let logits: Vec<f32> = (0..vocab)
                .map(|_| (rng.random::<f32>() * spread * 8.0).round() / 8.0)
                .collect();
            let cfg = SamplerConfig {
                temperature: [0.2f32, 1.0, 1.7][case % 3],
                top_k: [0usize, 1, 64, 1000][(case / 3) % 4],
                top_p: [1.0f32, 0.95, 0.5, 0.999][(case / 12) % 4],
                repetition_penalty: 1.0,
                seed: Some(case as u64),
            };
            if cfg.top_k == 0 && cfg.top_p >= 1.0 {
                continue; // no candidate order at all: draws walk token ids
            }
            let mut s = Sampler::new(cfg.clone());
            for pos in 0..4 {
                let want = full_sort_sample(&cfg, case as u64, &logits, pos);
                assert_eq!(
                    s.sample(&mut logits.clone(), &[], pos),
                    want,
                    "case {case} {cfg:?} pos {pos}"
                );
            }
        }
    }
}
