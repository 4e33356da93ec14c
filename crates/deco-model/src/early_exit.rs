//! Entropy-threshold early exit (the seed's "early exit": Teerapittayanon et al. 2016, BranchyNet
//! §3.2 entropy criterion; applied to decoder LMs as in Schuster et al. 2022, "Confident
//! Adaptive Language Modeling" (CALM), §3 and §4.1 "softmax response"-style confidence, here
//! the entropy of the intermediate distribution).
//!
//! After layer `l` (at the check points of [`EarlyExitConfig`]) the final RMSNorm and the LM
//! head are applied to the residual stream; if the entropy of that distribution is below the
//! threshold, the token's forward stops there and those logits are used.
//!
//! **Skipped layers' keys and values.** Later tokens attend to every layer of this one, so the
//! skipped layers still get K/V for it: following CALM §4.2 ("we propagate the hidden state of
//! the exited layer to the skipped layers"), the exit hidden state is fed as the input of every
//! skipped layer and that layer's K/V are computed from it (`Llama::layer_kv_only`: its RMSNorm
//! and K/V projections only — Q, attention, output projection and MLP are skipped). The Q
//! projection is fused with K/V, so it is still computed; everything else of a skipped layer is
//! saved.


use crate::kv_cache::{KvCache, SeqId};
use crate::llama::{Llama, LogitsWanted, SeqInput};
use crate::{Error, Result};

/// When to test for an exit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EarlyExitConfig {
    /// Exit when the entropy (nats) of the intermediate next-token distribution is below this.
    pub entropy_threshold: f32,
    /// First layer count at which an exit is tested (`>= 1`).
    pub min_layers: usize,
    /// Test every `check_every` layers from `min_layers` on (`>= 1`; each test costs one LM-head
    /// product, about 8 layers' worth of FLOPs for SmolLM2's 49k vocabulary).
    pub check_every: usize,
}

impl Default for EarlyExitConfig {
    fn default() -> Self {
        Self { entropy_threshold: 1.0, min_layers: 8, check_every: 4 }
    }
}

/// Logits of one token and where it exited.
#[derive(Debug, Clone, PartialEq)]
pub struct EarlyExitStep {
    /// `[vocab]` logits (from the exit layer, or the full model).
    pub logits: Vec<f32>,
    /// Layers run at full depth before exiting (= `num_layers` when no exit).
    pub exit_layer: usize,
    /// Entropy (nats) of the distribution used.
    pub entropy: f32,
}

/// Aggregate counters over many tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EarlyExitStats {
    /// Tokens processed.
    pub tokens: usize,
    /// Sum over tokens of layers run before the exit.
    pub layers_run: usize,
    /// Sum over tokens of the model's depth.
    pub layers_total: usize,
}

impl EarlyExitStats {
    /// Adds one step.
    pub fn record(&mut self, step: &EarlyExitStep, num_layers: usize) {
        self.tokens += 1;
        self.layers_run += step.exit_layer;
        self.layers_total += num_layers;
    }

    /// Fraction of layer evaluations skipped, in `[0, 1]`.
    pub fn skipped_fraction(&self) -> f64 {
        if self.layers_total == 0 { 0.0 } else { 1.0 - self.layers_run as f64 / self.layers_total as f64 }
    }
}

/// Entropy in nats of `softmax(logits)`.
pub fn entropy(logits: &[f32]) -> f32 {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if m == f32::NEG_INFINITY {
        return 0.0;
    }
    let z: f64 = logits.iter().map(|&l| f64::from(l - m).exp()).sum();
    let lz = z.ln();
    let h: f64 = logits
        .iter()
        .filter(|l| **l > f32::NEG_INFINITY)
        .map(|&l| {
            let lp = f64::from(l - m) - lz;
            -lp.exp() * lp
        })
        .sum();
    h as f32
}

use crate::host::to_host as row;

impl Llama {
    /// Runs one new token of `seq` with entropy-based early exit (see the
    /// [module docs](crate::early_exit)); the cache gets K/V for every layer.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a `min_layers` or `check_every` of 0, and the errors of
    /// [`Llama::forward`].
    pub fn forward_early_exit(&self, seq: SeqId, token: u32, cache: &mut dyn KvCache, cfg: &EarlyExitConfig) -> Result<EarlyExitStep> {
        if cfg.min_layers == 0 || cfg.check_every == 0 {
            return Err(Error::InvalidInput("early exit: min_layers and check_every must be >= 1".into()));
        }
        if !cfg.entropy_threshold.is_finite() {
            return Err(Error::InvalidInput(format!("early exit: entropy_threshold must be finite, got {}", cfg.entropy_threshold)));
        }
        // On the CPU, run on a worker of the rayon pool (as `Llama::forward_rows`): the kernels
        // then fork from a worker instead of waking the pool from outside for every call.
        if *self.device() == burn::tensor::Device::flex() && rayon::current_thread_index().is_none() {
            return rayon::scope(|_| self.early_exit_step(seq, token, cache, cfg));
        }
        self.early_exit_step(seq, token, cache, cfg)
    }

    fn early_exit_step(&self, seq: SeqId, token: u32, cache: &mut dyn KvCache, cfg: &EarlyExitConfig) -> Result<EarlyExitStep> {
        let tokens = [token];
        let inputs = [SeqInput { seq, tokens: &tokens, tree: None }];
        let batch = self.prepare(&inputs, &*cache)?;
        let n = self.num_layers();
        let mut x = self.embed_tokens(&batch);
        for li in 0..n {
            x = self.layer_forward(li, x, &batch, &inputs, cache)?;
            let done = li + 1;
            if done < n && done >= cfg.min_layers && (done - cfg.min_layers).is_multiple_of(cfg.check_every) {
                let logits = row(self.head(x.clone(), &batch, &[1]).logits)?;
                let h = entropy(&logits);
                if h < cfg.entropy_threshold {
                    for lj in done..n {
                        // K/V of the skipped layer from the exit hidden state; no attention, no MLP.
                        self.layer_kv_only(lj, x.clone(), &batch, &inputs, cache)?;
                    }
                    cache.advance(seq, 1);
                    return Ok(EarlyExitStep { logits, exit_layer: done, entropy: h });
                }
            }
        }
        cache.advance(seq, 1);
        let logits = row(self.head(x, &batch, &[1]).logits)?;
        let h = entropy(&logits);
        Ok(EarlyExitStep { logits, exit_layer: n, entropy: h })
    }
}

/// Teacher-forced quality of early exit on one token window (see [`score_early_exit`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EarlyExitScore {
    /// Next-token predictions scored (`window length - 1`).
    pub predictions: usize,
    /// Sum of negative log-likelihoods (nats) of the full model.
    pub full_nll: f64,
    /// Sum of negative log-likelihoods (nats) with early exit.
    pub exit_nll: f64,
    /// Predictions whose early-exit argmax equals the full model's argmax.
    pub top1_agree: usize,
    /// Layer counters of the early-exit pass.
    pub stats: EarlyExitStats,
}

impl EarlyExitScore {
    /// Adds another window's score.
    pub fn merge(&mut self, o: &Self) {
        self.predictions += o.predictions;
        self.full_nll += o.full_nll;
        self.exit_nll += o.exit_nll;
        self.top1_agree += o.top1_agree;
        self.stats.tokens += o.stats.tokens;
        self.stats.layers_run += o.stats.layers_run;
        self.stats.layers_total += o.stats.layers_total;
    }

    /// Perplexity of the full model.
    pub fn full_ppl(&self) -> f64 {
        (self.full_nll / self.predictions.max(1) as f64).exp()
    }

    /// Perplexity with early exit.
    pub fn exit_ppl(&self) -> f64 {
        (self.exit_nll / self.predictions.max(1) as f64).exp()
    }

    /// Fraction of predictions whose top-1 token equals the full model's.
    pub fn top1_agreement(&self) -> f64 {
        self.top1_agree as f64 / self.predictions.max(1) as f64
    }
}

/// `-log softmax(logits)[target]` in f64.
fn nll(logits: &[f32], target: u32) -> f64 {
    let m = f64::from(logits.iter().copied().fold(f32::NEG_INFINITY, f32::max));
    let z: f64 = logits.iter().map(|&l| (f64::from(l) - m).exp()).sum();
    z.ln() + m - logits.get(target as usize).map_or(f64::NEG_INFINITY, |&l| f64::from(l))
}

/// Index of the largest value (lowest index on ties).
fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

/// Scores `window` (teacher forcing, no BOS added) twice: once with the full model (one
/// forward, all logits) and once token by token with [`Llama::forward_early_exit`] from an
/// empty cache (every token, the first included, may exit). Each of the `len - 1` next-token
/// predictions contributes its negative log-likelihood under both, and whether the two argmaxes
/// agree.
///
/// # Errors
/// A window shorter than 2 tokens ([`Error::InvalidInput`]) and the errors of
/// [`Llama::forward`] / [`Llama::forward_early_exit`].
pub fn score_early_exit(model: &Llama, window: &[u32], cfg: &EarlyExitConfig) -> Result<EarlyExitScore> {
    if window.len() < 2 {
        return Err(Error::InvalidInput(format!("early-exit scoring needs at least 2 tokens, got {}", window.len())));
    }
    let n = window.len() - 1;
    let mut cache = crate::kv_cache::DenseKvCache::new(model.num_layers());
    let full = model.forward(&[SeqInput { seq: 0, tokens: &window[..n], tree: None }], &mut cache, LogitsWanted::All)?.logits_rows()?;
    let mut cache = crate::kv_cache::DenseKvCache::new(model.num_layers());
    let mut score = EarlyExitScore { predictions: n, ..Default::default() };
    for (i, full_row) in full.iter().enumerate().take(n) {
        let step = model.forward_early_exit(0, window[i], &mut cache, cfg)?;
        score.stats.record(&step, model.num_layers());
        let target = window[i + 1];
        score.full_nll += nll(full_row, target);
        score.exit_nll += nll(&step.logits, target);
        if argmax(&step.logits) == argmax(full_row) {
            score.top1_agree += 1;
        }
    }
    Ok(score)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_cache::DenseKvCache;

    /// The K/V-only pass leaves exactly what a full layer call would leave in the cache: the next
    /// token's logits are identical either way (tiny Llama checkpoint of `tests/data/tiny`).
    #[test]
    fn kv_only_pass_fills_the_cache_like_a_full_layer() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/data/tiny/llama3");
        let ckpt = deco_formats::checkpoint::Checkpoint::open(dir).expect("tiny checkpoint");
        let model = Llama::load(&ckpt, &burn::tensor::Device::flex(), None).expect("load");
        let n = model.num_layers();
        assert!(n >= 2);
        let prompt = [5u32, 17, 42];
        let mut caches = [DenseKvCache::new(n), DenseKvCache::new(n)];
        for cache in caches.iter_mut() {
            model.forward(&[SeqInput { seq: 0, tokens: &prompt, tree: None }], cache, LogitsWanted::Last).expect("prompt");
        }
        // Token 9 exits after layer 1; the remaining layers get K/V from the exit state.
        let tokens = [9u32];
        let inputs = [SeqInput { seq: 0, tokens: &tokens, tree: None }];
        for (i, cache) in caches.iter_mut().enumerate() {
            let batch = model.prepare(&inputs, &*cache).expect("prepare");
            let x = model.layer_forward(0, model.embed_tokens(&batch), &batch, &inputs, cache).expect("layer 0");
            for lj in 1..n {
                if i == 0 {
                    model.layer_kv_only(lj, x.clone(), &batch, &inputs, cache).expect("kv only");
                } else {
                    let _ = model.layer_forward(lj, x.clone(), &batch, &inputs, cache).expect("full layer");
                }
            }
            cache.advance(0, 1);
        }
        let next: Vec<Vec<f32>> = caches
            .iter_mut()
            .map(|cache| {
                let out = model.forward(&[SeqInput { seq: 0, tokens: &[33], tree: None }], cache, LogitsWanted::Last).expect("next");
                out.logits_rows().expect("logits").remove(0)
            })
            .collect();
        assert_eq!(next[0], next[1]);
    }

    /// Threshold 0 never exits: the early-exit pass is the full model (same ppl, full
    /// agreement, nothing skipped); a huge threshold exits at `min_layers` every time.
    #[test]
    fn score_early_exit_limits() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/data/tiny/llama3");
        let ckpt = deco_formats::checkpoint::Checkpoint::open(dir).expect("tiny checkpoint");
        let model = Llama::load(&ckpt, &burn::tensor::Device::flex(), None).expect("load");
        let n = model.num_layers();
        let window = [5u32, 17, 42, 9, 33, 7, 21];
        let never = EarlyExitConfig { entropy_threshold: 0.0, min_layers: 1, check_every: 1 };
        let s = score_early_exit(&model, &window, &never).expect("score");
        assert_eq!(s.predictions, 6);
        assert_eq!(s.top1_agree, 6);
        assert_eq!(s.stats.skipped_fraction(), 0.0);
        assert!((s.full_ppl() - s.exit_ppl()).abs() < 1e-3 * s.full_ppl(), "{} vs {}", s.full_ppl(), s.exit_ppl());
        let always = EarlyExitConfig { entropy_threshold: 1e9, min_layers: 1, check_every: 1 };
        let s = score_early_exit(&model, &window, &always).expect("score");
        assert!((s.stats.skipped_fraction() - (n - 1) as f64 / n as f64).abs() < 1e-12);
        let mut m = s;
        m.merge(&s);
        assert_eq!(m.predictions, 12);
        assert!((m.exit_ppl() - s.exit_ppl()).abs() < 1e-9 * s.exit_ppl());
        assert!(score_early_exit(&model, &[1], &never).is_err());
    }

    #[test]
    fn entropy_by_hand() {
        // uniform over 4: ln 4
        assert!((entropy(&[0.0; 4]) - 4f32.ln()).abs() < 1e-6);
        // p = [0.5, 0.5, 0]: ln 2
        assert!((entropy(&[1.0, 1.0, f32::NEG_INFINITY]) - 2f32.ln()).abs() < 1e-6);
        // one-hot-ish: near 0
        assert!(entropy(&[100.0, 0.0]) < 1e-6);
    }

    #[test]
    fn stats_fraction() {
        let mut s = EarlyExitStats::default();
        let st = |l| EarlyExitStep { logits: vec![], exit_layer: l, entropy: 0.0 };
        s.record(&st(10), 30);
        s.record(&st(30), 30);
        assert!((s.skipped_fraction() - 20.0 / 60.0).abs() < 1e-12);
    }
}
