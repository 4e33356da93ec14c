//! AutoDeco's training losses on a frozen base.
//!
//! Source: AutoDeco `model/templlm_auto.py`, `_compute_temp_loss` and `_compute_top_p_loss`
//! (arXiv 2510.26697 §3.2). For position `i` with raw logits `z` (constant: the base is frozen),
//! label `y`, predicted temperature `T` and top-p `P`:
//!
//! - **temperature loss**: `CE(y, softmax(z / max(T, 1e-2)))`, averaged over the kept positions;
//! - **soft top-p loss**: `p = softmax(z / T)`, sorted descending, `c = cumsum(p)`,
//!   `m = exp(-α · relu(c − P))` (α = 30), `p' = p·m / (Σ p·m + 1e-9)` with `m` scattered back to
//!   vocabulary order, loss `−ln(p'_y + 1e-9)`; `T` is **not** detached here, so this loss also
//!   trains the temperature head;
//! - **easy-token masking** ([`easy_token_keep`]): positions where the base's argmax equals the
//!   label are dropped from the temperature loss with probability 0.6;
//! - **weighting** (optional, on in the reference): each position's loss is multiplied by the
//!   base model's probability of the label, `softmax(z)_y` (a constant).
//!
//! The total is the sum of the two losses. Implementation: the rows are sorted once on the host
//! (the order of `z / T` is the order of `z` since `T > 0`), so the device sees the sorted logits
//! and the label's rank; gathering `p·m` at the label's rank equals scattering `m` back and
//! gathering at the label. [`temp_loss_reference`] and [`top_p_loss_reference`] compute the same
//! quantities the reference's way (scatter) in f64 on the host, for tests.
//!
//! Where deco differs from the reference: the reference applies the easy-token mask to the
//! temperature loss only; deco does the same by default and can also apply it to the top-p loss
//! ([`LossConfig::mask_top_p`]).

use burn::tensor::activation::{log_softmax, relu, softmax};
use burn::tensor::{Device, Int, Tensor, TensorData};
use rand::Rng;
use rayon::prelude::*;

/// Options of the losses.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossConfig {
    /// Steepness α of the soft top-p mask (30 in the paper).
    pub alpha: f32,
    /// Multiply each position's loss by the base's probability of the label (reference: on).
    pub weight_by_base_prob: bool,
    /// Also drop masked easy tokens from the top-p loss (reference: off).
    pub mask_top_p: bool,
}

impl Default for LossConfig {
    fn default() -> Self {
        Self { alpha: 30.0, weight_by_base_prob: true, mask_top_p: false }
    }
}

/// Which positions the temperature loss keeps: a position whose base argmax equals its label is
/// dropped with probability `drop_prob` (one uniform draw from `rng` per such position).
pub fn easy_token_keep(argmax: &[u32], labels: &[u32], drop_prob: f64, rng: &mut impl Rng) -> Vec<bool> {
    argmax
        .iter()
        .zip(labels)
        .map(|(a, y)| !(a == y && rng.random::<f64>() < drop_prob))
        .collect()
}

/// A batch of positions prepared for the losses: sorted logits and label ranks (host work).
#[derive(Debug, Clone)]
pub struct SortedBatch {
    /// Rows.
    pub n: usize,
    /// Vocabulary.
    pub vocab: usize,
    /// `[n, vocab]` raw logits sorted descending per row.
    pub sorted: Vec<f32>,
    /// `[n]` the label's position in its sorted row.
    pub rank: Vec<i64>,
    /// `[n]` base probability of the label, `softmax(z)_y`.
    pub base_prob: Vec<f32>,
}

impl SortedBatch {
    /// Sorts `logits` (`[n, vocab]` row-major) per row, descending, and locates each label.
    ///
    /// # Panics
    /// Never for consistent input; callers pass `labels.len() == n` and labels `< vocab`.
    pub fn new(logits: &[f32], vocab: usize, labels: &[u32]) -> Self {
        let n = labels.len();
        let rows: Vec<(Vec<f32>, i64, f32)> = logits
            .par_chunks(vocab)
            .zip(labels.par_iter())
            .map(|(row, &y)| {
                let mut idx: Vec<u32> = (0..vocab as u32).collect();
                idx.sort_unstable_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
                let rank = idx.iter().position(|&i| i == y).unwrap_or(0) as i64;
                let sorted: Vec<f32> = idx.iter().map(|&i| row[i as usize]).collect();
                let max = f64::from(sorted[0]);
                let lse = max + row.iter().map(|&z| (f64::from(z) - max).exp()).sum::<f64>().ln();
                let p = (f64::from(row[y as usize]) - lse).exp() as f32;
                (sorted, rank, p)
            })
            .collect();
        let mut sorted = Vec::with_capacity(n * vocab);
        let mut rank = Vec::with_capacity(n);
        let mut base_prob = Vec::with_capacity(n);
        for (s, r, p) in rows {
            sorted.extend_from_slice(&s);
            rank.push(r);
            base_prob.push(p);
        }
        Self { n, vocab, sorted, rank, base_prob }
    }
}

/// The two losses of one batch, as scalar tensors (`[1]`) on the training device.
#[derive(Debug, Clone)]
pub struct Losses {
    /// Temperature loss.
    pub temp: Tensor<1>,
    /// Soft top-p loss.
    pub top_p: Tensor<1>,
}

impl Losses {
    /// `temp + top_p`.
    pub fn total(&self) -> Tensor<1> {
        self.temp.clone() + self.top_p.clone()
    }
}

/// Computes both losses.
///
/// # Shapes
/// - `batch`: `n` rows; `temperature`, `top_p`: `[n, 1]` head outputs (on `device`, tracked);
/// - `temp_keep`: `[n]` easy-token mask (true = keep).
pub fn losses(batch: &SortedBatch, temperature: Tensor<2>, top_p: Tensor<2>, temp_keep: &[bool], cfg: &LossConfig, device: &Device) -> Losses {
    let n = batch.n;
    let sorted = Tensor::<2>::from_data(TensorData::new(batch.sorted.clone(), [n, batch.vocab]), device);
    let rank = Tensor::<2, Int>::from_data(TensorData::new(batch.rank.clone(), [n, 1]), device);
    let w: Vec<f32> = if cfg.weight_by_base_prob { batch.base_prob.clone() } else { vec![1.0; n] };
    let keep_t: Vec<f32> = temp_keep.iter().zip(&w).map(|(&k, &w)| if k { w } else { 0.0 }).collect();
    let kept = temp_keep.iter().filter(|&&k| k).count();
    let keep_p: Vec<f32> = if cfg.mask_top_p { keep_t.clone() } else { w.clone() };
    let kept_p = if cfg.mask_top_p { kept } else { n };

    // Temperature loss: CE under softmax(z / max(T, 1e-2)).
    let scaled = sorted.clone() / temperature.clone().clamp_min(1e-2);
    let ce = -log_softmax(scaled, 1).gather(1, rank.clone()); // [n, 1]
    let wt = Tensor::<2>::from_data(TensorData::new(keep_t, [n, 1]), device);
    let temp = (ce * wt).sum() / (kept.max(1) as f32);

    // Soft top-p loss (T not detached).
    let probs = softmax(sorted / temperature.clamp_min(1e-8), 1);
    let cum = probs.clone().cumsum(1);
    let decay = (relu(cum - top_p) * (-cfg.alpha)).exp();
    let masked = probs * decay;
    let denom = masked.clone().sum_dim(1) + 1e-9;
    let p_label = masked.gather(1, rank) / denom;
    let nll = -(p_label + 1e-9).log();
    let wp = Tensor::<2>::from_data(TensorData::new(keep_p, [n, 1]), device);
    let top_p_loss = (nll * wp).sum() / (kept_p.max(1) as f32);
    Losses { temp, top_p: top_p_loss }
}

/// The temperature loss of one position, the reference's way, in f64: cross-entropy of `label`
/// under `softmax(logits / max(t, 1e-2))` (unweighted).
pub fn temp_loss_reference(logits: &[f32], label: u32, t: f64) -> f64 {
    let t = t.max(1e-2);
    let s: Vec<f64> = logits.iter().map(|&z| f64::from(z) / t).collect();
    let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let lse = m + s.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
    lse - s[label as usize]
}

/// The soft top-p loss of one position, the reference's way, in f64: softmax, sort, cumulative
/// sum, decay mask scattered back to vocabulary order, renormalize, `−ln(p'_label + 1e-9)`
/// (unweighted).
pub fn top_p_loss_reference(logits: &[f32], label: u32, t: f64, p: f64, alpha: f64) -> f64 {
    let s: Vec<f64> = logits.iter().map(|&z| f64::from(z) / t.max(1e-8)).collect();
    let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
    let sum: f64 = e.iter().sum();
    let probs: Vec<f64> = e.iter().map(|x| x / sum).collect();
    let mut idx: Vec<usize> = (0..probs.len()).collect();
    idx.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
    let mut mask = vec![0.0; probs.len()];
    let mut c = 0.0;
    for &i in &idx {
        c += probs[i];
        mask[i] = (-alpha * (c - p).max(0.0)).exp();
    }
    let masked: Vec<f64> = probs.iter().zip(&mask).map(|(a, b)| a * b).collect();
    let total: f64 = masked.iter().sum();
    -((masked[label as usize] / (total + 1e-9)) + 1e-9).ln()
}
