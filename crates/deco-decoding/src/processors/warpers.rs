//! Distribution warpers: temperature and the truncation filters (Hugging Face "logits warpers").

use super::{LogitsProcessor, ProcessContext, check_min_keep};
use crate::error::{Result, invalid};
use crate::math::{desc_then_id, kth_largest, log_sum_exp, max_logit, sum_exp_shifted, top_n};

/// Temperature scaling: `logits[i] / temperature`.
///
/// Source: transformers `TemperatureLogitsWarper`.
///
/// - `temperature` must be finite and `>= 0`; negative, NaN or infinite values are rejected.
/// - `temperature == 1` leaves the row unchanged.
/// - `temperature == 0` is the limit `T -> 0`: every token whose logit equals the row maximum
///   is kept unchanged and all others are set to `-inf` (Hugging Face rejects 0; here 0 means
///   greedy, and the [`Sampler`](crate::Sampler) does not even build this processor for it,
///   it takes the argmax directly).
/// - For tiny temperatures where `max / temperature` would overflow `f32`, the row is shifted by
///   its maximum first (`(l - max) / T`), which leaves the distribution unchanged and avoids
///   `+inf` (and so NaN in softmax).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Temperature {
    temperature: f32,
}

impl Temperature {
    /// Validates `temperature` (finite, `>= 0`).
    ///
    /// # Errors
    /// [`InvalidParameter`](crate::DecodingError::InvalidParameter) for negative, NaN or
    /// infinite values.
    pub fn new(temperature: f32) -> Result<Self> {
        if !(temperature.is_finite() && temperature >= 0.0) {
            return Err(invalid(
                "temperature",
                "must be a finite number >= 0",
                temperature,
            ));
        }
        Ok(Self { temperature })
    }

    /// The temperature.
    pub fn temperature(&self) -> f32 {
        self.temperature
    }
}

impl LogitsProcessor for Temperature {
    fn process(&self, _ctx: &ProcessContext<'_>, logits: &mut [f32]) -> Result<()> {
        let t = self.temperature;
        if t == 1.0 {
            return Ok(());
        }
        let m = max_logit(logits);
        if m == f32::NEG_INFINITY {
            return Ok(());
        }
        if t == 0.0 {
            for x in logits.iter_mut() {
                if *x < m {
                    *x = f32::NEG_INFINITY;
                }
            }
            return Ok(());
        }
        if (m / t).is_finite() {
            for x in logits.iter_mut() {
                *x /= t;
            }
        } else {
            for x in logits.iter_mut() {
                *x = (*x - m) / t;
            }
        }
        Ok(())
    }

    fn name(&self) -> &'static str {
        "temperature"
    }
}

/// Top-k filtering: keeps the `top_k` largest logits, sets the rest to `-inf`.
///
/// Source: transformers `TopKLogitsWarper` (Fan et al. 2018, "Hierarchical Neural Story
/// Generation").
///
/// - `top_k == 0` disables the filter (as in Hugging Face's `generate`, which does not build the
///   warper for 0).
/// - The effective k is `max(top_k, min_tokens_to_keep)`.
/// - **Ties:** like Hugging Face (`scores < topk(...)[-1]` is removed), every token whose logit
///   equals the k-th largest value is kept, so more than k tokens survive when there is a tie
///   at the boundary. Tokens already at `-inf` stay there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TopK {
    top_k: usize,
    min_tokens_to_keep: usize,
}

impl TopK {
    /// Top-k with `min_tokens_to_keep = 1`. Any `usize` is valid (0 disables).
    pub fn new(top_k: usize) -> Result<Self> {
        Self::with_min_tokens_to_keep(top_k, 1)
    }

    /// Top-k keeping at least `min_tokens_to_keep` tokens (>= 1; Hugging Face uses 2 or more for
    /// beam sampling).
    ///
    /// # Errors
    /// `min_tokens_to_keep == 0`.
    pub fn with_min_tokens_to_keep(top_k: usize, min_tokens_to_keep: usize) -> Result<Self> {
        Ok(Self {
            top_k,
            min_tokens_to_keep: check_min_keep(min_tokens_to_keep)?,
        })
    }

    /// The configured `top_k`.
    pub fn top_k(&self) -> usize {
        self.top_k
    }
}

impl LogitsProcessor for TopK {
    fn process(&self, _ctx: &ProcessContext<'_>, logits: &mut [f32]) -> Result<()> {
        if self.top_k == 0 {
            return Ok(());
        }
        let k = self.top_k.max(self.min_tokens_to_keep);
        if k >= logits.len() {
            return Ok(());
        }
        let kth = kth_largest(logits, k);
        for x in logits.iter_mut() {
            if *x < kth {
                *x = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    fn name(&self) -> &'static str {
        "top_k"
    }
}

/// Probability mass within which the mass before a token counts as equal to `top_p` (see
/// [`TopP`]): `f32::EPSILON`, the relative precision of the `f32` `top_p` and of the `f32`
/// logits the probabilities come from.
const TOP_P_TIE_TOLERANCE: f64 = f32::EPSILON as f64;

/// Nucleus (top-p) filtering: keeps the smallest set of most probable tokens whose total
/// probability reaches `top_p`.
///
/// Source: transformers `TopPLogitsWarper` (Holtzman et al. 2019, "The Curious Case of Neural
/// Text Degeneration").
///
/// Rule: sort tokens by probability, descending (ties: lower token id first); token at rank `r`
/// is kept iff the mass of the tokens ranked before it is `< top_p`, or `r < min_tokens_to_keep`.
/// So the token whose addition crosses `top_p` is kept. This is the same set as Hugging Face's
/// "remove where ascending cumulative mass `<= 1 - top_p`", computed in `f64`.
///
/// Ties at the threshold: a mass before the token that equals `top_p` up to rounding (within
/// `f32::EPSILON` ≈ 1.2e-7, the precision of an `f32` `top_p` and of `f32` logits) counts as
/// having reached it, so the token is removed, as in Hugging Face
/// where the remaining mass is then `<= 1 - top_p`: `top_p = 0.8` on `[0.3, 0.1, 0.1, 0.5]`
/// keeps `{0.5, 0.3}` (the `f32` value of 0.8 is 0.80000001, which an exact comparison against
/// a sum of 0.79999999 would take as not yet reached).
///
/// - `top_p` must be in `[0, 1]`.
/// - `top_p == 1` disables the filter; `top_p == 0` keeps only the most probable token
///   (greedy), thanks to `min_tokens_to_keep >= 1`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TopP {
    top_p: f32,
    min_tokens_to_keep: usize,
}

impl TopP {
    /// Top-p with `min_tokens_to_keep = 1`.
    ///
    /// # Errors
    /// `top_p` outside `[0, 1]` or NaN.
    pub fn new(top_p: f32) -> Result<Self> {
        Self::with_min_tokens_to_keep(top_p, 1)
    }

    /// Top-p keeping at least `min_tokens_to_keep` tokens.
    ///
    /// # Errors
    /// `top_p` outside `[0, 1]` or NaN; `min_tokens_to_keep == 0`.
    pub fn with_min_tokens_to_keep(top_p: f32, min_tokens_to_keep: usize) -> Result<Self> {
        if !(0.0..=1.0).contains(&top_p) {
            return Err(invalid("top_p", "must be in [0, 1]", top_p));
        }
        Ok(Self {
            top_p,
            min_tokens_to_keep: check_min_keep(min_tokens_to_keep)?,
        })
    }

    /// The configured `top_p`.
    pub fn top_p(&self) -> f32 {
        self.top_p
    }
}

impl LogitsProcessor for TopP {
    fn process(&self, _ctx: &ProcessContext<'_>, logits: &mut [f32]) -> Result<()> {
        if self.top_p >= 1.0 {
            return Ok(());
        }
        let m = max_logit(logits);
        if m == f32::NEG_INFINITY {
            return Ok(());
        }
        let weight = |x: f32| f64::from((x - m).exp());
        let total = sum_exp_shifted(logits, m);
        let target = f64::from(self.top_p) * total;
        // Only a prefix of the sorted order can be kept, so sort just the tokens whose weight
        // is at least `tau` (relative to the top token's weight 1) once they hold the target
        // mass and enough tokens; lower `tau` until they do (tau = 0: every candidate).
        let mut tau = 1e-4f32;
        let mut order = loop {
            let floor = if tau > 0.0 {
                m + tau.ln()
            } else {
                f32::NEG_INFINITY
            };
            let cand: Vec<usize> = (0..logits.len())
                .filter(|&i| logits[i] > f32::NEG_INFINITY && logits[i] >= floor)
                .collect();
            let mass: f64 = cand.iter().map(|&i| weight(logits[i])).sum();
            if tau == 0.0 || (mass >= target && cand.len() >= self.min_tokens_to_keep) {
                break cand;
            }
            tau = if tau > 1e-30 { tau * 1e-6 } else { 0.0 };
        };
        order.sort_unstable_by(|&a, &b| desc_then_id(logits, a, b));
        // Equal to the target up to rounding counts as reached (see the type's docs).
        let reached = target - TOP_P_TIE_TOLERANCE * total;
        let mut before = 0.0f64;
        let mut cut = order.len();
        for (rank, &i) in order.iter().enumerate() {
            if rank >= self.min_tokens_to_keep && before >= reached {
                cut = rank;
                break;
            }
            before += weight(logits[i]);
        }
        let kept: Vec<(usize, f32)> = order[..cut].iter().map(|&i| (i, logits[i])).collect();
        logits.fill(f32::NEG_INFINITY);
        for (i, x) in kept {
            logits[i] = x;
        }
        Ok(())
    }

    fn name(&self) -> &'static str {
        "top_p"
    }
}

/// Min-p filtering: removes tokens whose probability is below `min_p` times the probability of
/// the most likely token.
///
/// Source: transformers `MinPLogitsWarper` (Nguyen et al. 2024, "Turning Up the Heat: Min-p
/// Sampling for Creative and Coherent LLM Outputs"); llama.cpp `llama_sampler_init_min_p`.
///
/// Rule: keep token `i` iff `p_i >= min_p * p_max`, i.e. `exp(l_i - l_max) >= min_p`, or it is
/// among the `min_tokens_to_keep` most probable (ties: lower id first). `min_p` must be in
/// `[0, 1]`; 0 disables, 1 keeps only the tokens tied with the maximum.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MinP {
    min_p: f32,
    min_tokens_to_keep: usize,
}

impl MinP {
    /// Min-p with `min_tokens_to_keep = 1`.
    ///
    /// # Errors
    /// `min_p` outside `[0, 1]` or NaN.
    pub fn new(min_p: f32) -> Result<Self> {
        Self::with_min_tokens_to_keep(min_p, 1)
    }

    /// Min-p keeping at least `min_tokens_to_keep` tokens.
    ///
    /// # Errors
    /// `min_p` outside `[0, 1]` or NaN; `min_tokens_to_keep == 0`.
    pub fn with_min_tokens_to_keep(min_p: f32, min_tokens_to_keep: usize) -> Result<Self> {
        if !(0.0..=1.0).contains(&min_p) {
            return Err(invalid("min_p", "must be in [0, 1]", min_p));
        }
        Ok(Self {
            min_p,
            min_tokens_to_keep: check_min_keep(min_tokens_to_keep)?,
        })
    }

    /// The configured `min_p`.
    pub fn min_p(&self) -> f32 {
        self.min_p
    }
}

impl LogitsProcessor for MinP {
    fn process(&self, _ctx: &ProcessContext<'_>, logits: &mut [f32]) -> Result<()> {
        if self.min_p <= 0.0 {
            return Ok(());
        }
        let m = max_logit(logits);
        if m == f32::NEG_INFINITY {
            return Ok(());
        }
        let min_p = f64::from(self.min_p);
        // The `min_tokens_to_keep` best tokens (ties: lower id) survive whatever their ratio.
        let protected = top_n(logits, self.min_tokens_to_keep);
        let saved: Vec<(usize, f32)> = protected.iter().map(|&i| (i, logits[i])).collect();
        for x in logits.iter_mut() {
            if f64::from((*x - m).exp()) < min_p {
                *x = f32::NEG_INFINITY;
            }
        }
        for (i, x) in saved {
            logits[i] = x;
        }
        Ok(())
    }

    fn name(&self) -> &'static str {
        "min_p"
    }
}

/// Probabilities and log-probabilities (f64) of the entries that are not `-inf`.
/// Returns `None` for an all-`-inf` row.
fn log_probs(logits: &[f32]) -> Option<Vec<(usize, f64)>> {
    let lse = log_sum_exp(logits);
    if lse == f64::NEG_INFINITY {
        return None;
    }
    Some(
        logits
            .iter()
            .enumerate()
            .filter(|(_, x)| **x > f32::NEG_INFINITY)
            .map(|(i, &x)| (i, f64::from(x) - lse))
            .collect(),
    )
}

/// Shannon entropy in nats of the distribution `softmax(logits)`, `0 * log 0` taken as 0.
/// `None` for an all-`-inf` row.
fn entropy(lp: &[(usize, f64)]) -> f64 {
    -lp.iter().map(|&(_, l)| l.exp() * l).sum::<f64>()
}

/// Locally typical sampling: keeps the tokens whose surprisal `-log p_i` is closest to the
/// entropy `H` of the distribution, until their mass reaches `typical_p`.
///
/// Source: transformers `TypicalLogitsWarper` (Meister et al. 2022, "Locally Typical Sampling").
///
/// Rule (Hugging Face): `s_i = |(-log p_i) - H|`; sort tokens by `s_i` ascending (ties: lower id
/// first); let `c` be the first rank whose cumulative probability is `>= typical_p`; keep every
/// token with `s_i <= s_c` (so the crossing token and its ties are kept), plus the first
/// `min_tokens_to_keep` ranks. `typical_p` must be in `(0, 1]`; 1 disables (Hugging Face's
/// warper rejects 1, its `generate` skips it).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TypicalP {
    typical_p: f32,
    min_tokens_to_keep: usize,
}

impl TypicalP {
    /// Typical-p with `min_tokens_to_keep = 1`.
    ///
    /// # Errors
    /// `typical_p` outside `(0, 1]` or NaN.
    pub fn new(typical_p: f32) -> Result<Self> {
        Self::with_min_tokens_to_keep(typical_p, 1)
    }

    /// Typical-p keeping at least `min_tokens_to_keep` tokens.
    ///
    /// # Errors
    /// `typical_p` outside `(0, 1]` or NaN; `min_tokens_to_keep == 0`.
    pub fn with_min_tokens_to_keep(typical_p: f32, min_tokens_to_keep: usize) -> Result<Self> {
        if !(typical_p > 0.0 && typical_p <= 1.0) {
            return Err(invalid("typical_p", "must be in (0, 1]", typical_p));
        }
        Ok(Self {
            typical_p,
            min_tokens_to_keep: check_min_keep(min_tokens_to_keep)?,
        })
    }

    /// The configured `typical_p`.
    pub fn typical_p(&self) -> f32 {
        self.typical_p
    }
}

impl LogitsProcessor for TypicalP {
    fn process(&self, _ctx: &ProcessContext<'_>, logits: &mut [f32]) -> Result<()> {
        if self.typical_p >= 1.0 {
            return Ok(());
        }
        let Some(lp) = log_probs(logits) else {
            return Ok(());
        };
        let h = entropy(&lp);
        // (token, shifted score, prob)
        let mut scored: Vec<(usize, f64, f64)> = lp
            .iter()
            .map(|&(i, l)| (i, (-l - h).abs(), l.exp()))
            .collect();
        scored.sort_unstable_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)));
        let mass = f64::from(self.typical_p);
        let mut cum = 0.0;
        let mut crossing = scored.len() - 1;
        for (rank, &(_, _, p)) in scored.iter().enumerate() {
            cum += p;
            if cum >= mass {
                crossing = rank;
                break;
            }
        }
        let threshold = scored[crossing].1;
        for (rank, &(i, s, _)) in scored.iter().enumerate() {
            if rank >= self.min_tokens_to_keep && s > threshold {
                logits[i] = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    fn name(&self) -> &'static str {
        "typical_p"
    }
}

/// Keeps the `min_tokens_to_keep` best tokens (ties at the boundary kept) and removes the
/// others whose probability is below `threshold`.
fn cut_below(logits: &mut [f32], lp: &[(usize, f64)], threshold: f64, min_keep: usize) {
    let kth = kth_largest(logits, min_keep);
    for &(i, l) in lp {
        if l.exp() < threshold && logits[i] < kth {
            logits[i] = f32::NEG_INFINITY;
        }
    }
}

/// Epsilon sampling: removes tokens whose probability is below `epsilon_cutoff`.
///
/// Source: transformers `EpsilonLogitsWarper` (Hewitt et al. 2022, "Truncation Sampling as
/// Language Model Desmoothing").
///
/// Rule: keep `i` iff `p_i >= epsilon_cutoff` or its logit is `>=` the `min_tokens_to_keep`-th
/// largest. `epsilon_cutoff` must be in `[0, 1)`; 0 disables (Hugging Face's `generate` only
/// builds the warper for `0 < epsilon_cutoff < 1`; the paper suggests 3e-4 ... 9e-4).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EpsilonCutoff {
    epsilon_cutoff: f32,
    min_tokens_to_keep: usize,
}

impl EpsilonCutoff {
    /// Epsilon cutoff with `min_tokens_to_keep = 1`.
    ///
    /// # Errors
    /// `epsilon_cutoff` outside `[0, 1)` or NaN.
    pub fn new(epsilon_cutoff: f32) -> Result<Self> {
        Self::with_min_tokens_to_keep(epsilon_cutoff, 1)
    }

    /// Epsilon cutoff keeping at least `min_tokens_to_keep` tokens.
    ///
    /// # Errors
    /// `epsilon_cutoff` outside `[0, 1)` or NaN; `min_tokens_to_keep == 0`.
    pub fn with_min_tokens_to_keep(epsilon_cutoff: f32, min_tokens_to_keep: usize) -> Result<Self> {
        if !(0.0..1.0).contains(&epsilon_cutoff) {
            return Err(invalid(
                "epsilon_cutoff",
                "must be in [0, 1)",
                epsilon_cutoff,
            ));
        }
        Ok(Self {
            epsilon_cutoff,
            min_tokens_to_keep: check_min_keep(min_tokens_to_keep)?,
        })
    }

    /// The configured `epsilon_cutoff`.
    pub fn epsilon_cutoff(&self) -> f32 {
        self.epsilon_cutoff
    }
}

impl LogitsProcessor for EpsilonCutoff {
    fn process(&self, _ctx: &ProcessContext<'_>, logits: &mut [f32]) -> Result<()> {
        if self.epsilon_cutoff <= 0.0 {
            return Ok(());
        }
        let Some(lp) = log_probs(logits) else {
            return Ok(());
        };
        cut_below(
            logits,
            &lp,
            f64::from(self.epsilon_cutoff),
            self.min_tokens_to_keep,
        );
        Ok(())
    }

    fn name(&self) -> &'static str {
        "epsilon_cutoff"
    }
}

/// Eta sampling: an entropy-dependent epsilon cutoff.
///
/// Source: transformers `EtaLogitsWarper` (Hewitt et al. 2022, "Truncation Sampling as Language
/// Model Desmoothing").
///
/// Rule: with `H` the entropy (nats) of `softmax(logits)`,
/// `eta = min(eta_cutoff, sqrt(eta_cutoff) * exp(-H))`; keep `i` iff `p_i >= eta` or its logit
/// is `>=` the `min_tokens_to_keep`-th largest. `eta_cutoff` must be in `[0, 1)`; 0 disables
/// (the paper suggests 3e-4 ... 2e-3).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EtaCutoff {
    eta_cutoff: f32,
    min_tokens_to_keep: usize,
}

impl EtaCutoff {
    /// Eta cutoff with `min_tokens_to_keep = 1`.
    ///
    /// # Errors
    /// `eta_cutoff` outside `[0, 1)` or NaN.
    pub fn new(eta_cutoff: f32) -> Result<Self> {
        Self::with_min_tokens_to_keep(eta_cutoff, 1)
    }

    /// Eta cutoff keeping at least `min_tokens_to_keep` tokens.
    ///
    /// # Errors
    /// `eta_cutoff` outside `[0, 1)` or NaN; `min_tokens_to_keep == 0`.
    pub fn with_min_tokens_to_keep(eta_cutoff: f32, min_tokens_to_keep: usize) -> Result<Self> {
        if !(0.0..1.0).contains(&eta_cutoff) {
            return Err(invalid("eta_cutoff", "must be in [0, 1)", eta_cutoff));
        }
        Ok(Self {
            eta_cutoff,
            min_tokens_to_keep: check_min_keep(min_tokens_to_keep)?,
        })
    }

    /// The configured `eta_cutoff`.
    pub fn eta_cutoff(&self) -> f32 {
        self.eta_cutoff
    }

    /// The probability threshold `min(eta_cutoff, sqrt(eta_cutoff) * exp(-H))` for entropy `H`
    /// in nats.
    pub fn threshold(&self, entropy_nats: f64) -> f64 {
        let e = f64::from(self.eta_cutoff);
        e.min(e.sqrt() * (-entropy_nats).exp())
    }
}

impl LogitsProcessor for EtaCutoff {
    fn process(&self, _ctx: &ProcessContext<'_>, logits: &mut [f32]) -> Result<()> {
        if self.eta_cutoff <= 0.0 {
            return Ok(());
        }
        let Some(lp) = log_probs(logits) else {
            return Ok(());
        };
        let eta = self.threshold(entropy(&lp));
        cut_below(logits, &lp, eta, self.min_tokens_to_keep);
        Ok(())
    }

    fn name(&self) -> &'static str {
        "eta_cutoff"
    }
}
