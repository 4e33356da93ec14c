//! Knowledge distillation of a frozen teacher into a trainable [`StudentModel`] (burn autodiff,
//! Adam), for post-pruning recovery.
//!
//! Objectives ([`Objective`]):
//!
//! | objective | loss | reference |
//! |---|---|---|
//! | [`Objective::Kd`] | `α · τ² · KL(softmax(t/τ) ‖ softmax(s/τ)) + (1-α) · CE(labels)` per token, averaged ([`forward_kl_loss`], [`cross_entropy_weighted`]) | Hinton et al. 2015 §2 (the τ² factor keeps gradient magnitudes comparable across τ) |
//! | [`Objective::ReverseKl`] | `KL(softmax(s/τ) ‖ softmax(t/τ))` per token, exact over the vocabulary, on sequences the *student* samples (prompt: the first half of a data window, continuation sampled at temperature 1) ([`reverse_kl_loss`]) | MiniLLM (Gu et al. 2024) eq. 1: the token-level reverse KL on student samples; the policy-gradient / length-normalization / teacher-mix parts of MiniLLM §2.2 are not implemented |
//! | [`Objective::Cot`] | `CE(answer tokens) + λ · CE(rationale tokens)`, each a mean over its tokens ([`cot_loss`]) on GSM8K-style records (`question`, `answer` = rationale + `#### N`); the rationales are the data set's, not teacher-generated | chain-of-thought distillation, "Distilling step-by-step" (Hsieh et al. 2023) eq. 3 `L = L_label + λ L_rationale` |
//!
//! `s`, `t` are student and teacher logits at the same positions. The teacher runs on the plain
//! device ([`Teacher`]); its logits enter the loss as constants (detached), so no gradient
//! reaches it. Each step's batch is drawn from a seed derived from `(seed, step)`, so a resumed
//! run sees the same batches as an uninterrupted one (the Adam moments restart on resume).

use std::time::Instant;

use burn::optim::{AdamConfig, GradientsParams};
use burn::optim::grad_clipping::GradientClippingConfig;
use burn::tensor::activation::log_softmax;
use burn::tensor::{Device, Int, Tensor, TensorData};
use deco_formats::config::ModelConfig;
use deco_model::{DenseKvCache, Llama, LogitsWanted, SeqInput};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::student::StudentModel;
use crate::{Error, Result, invalid};

/// Distillation objective (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Objective {
    /// Forward KL on logits with temperature (Hinton et al. 2015), optionally mixed with CE.
    Kd,
    /// Per-token reverse KL on student samples (MiniLLM, Gu et al. 2024).
    ReverseKl,
    /// Chain-of-thought: `CE(answer) + λ · CE(rationale)`.
    Cot,
}

impl std::str::FromStr for Objective {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "kd" => Ok(Self::Kd),
            "reverse-kl" => Ok(Self::ReverseKl),
            "cot" => Ok(Self::Cot),
            _ => Err(invalid("objective", format!("`{s}` is not one of kd, reverse-kl, cot"))),
        }
    }
}

/// Options of [`distill`].
#[derive(Debug, Clone, PartialEq)]
pub struct DistillConfig {
    /// The loss.
    pub objective: Objective,
    /// Total optimizer steps (a resumed run continues up to this number).
    pub steps: usize,
    /// Sequences per step.
    pub batch_size: usize,
    /// Tokens per sequence.
    pub seqlen: usize,
    /// Adam learning rate, in `(0, 1]`.
    pub lr: f64,
    /// Softmax temperature τ of the KL objectives, in `(0, 100]`.
    pub temperature: f64,
    /// Weight `1 - α` of the label cross-entropy mixed into [`Objective::Kd`], in `[0, 1]`.
    pub ce_weight: f64,
    /// λ: weight of the rationale tokens in [`Objective::Cot`], `>= 0`.
    pub rationale_weight: f64,
    /// Seed of batch sampling and student sampling.
    pub seed: u64,
    /// Keep the (tied) embedding / LM head fixed: cheaper steps, decoder-only recovery.
    pub freeze_embeddings: bool,
    /// Gradient clipping by norm (per parameter tensor); `None` disables it.
    pub clip_norm: Option<f32>,
}

impl Default for DistillConfig {
    fn default() -> Self {
        Self {
            objective: Objective::Kd,
            steps: 100,
            batch_size: 4,
            seqlen: 128,
            lr: 2e-4,
            temperature: 1.0,
            ce_weight: 0.0,
            rationale_weight: 1.0,
            seed: 0,
            freeze_embeddings: false,
            clip_norm: Some(1.0),
        }
    }
}

impl DistillConfig {
    /// Checks the ranges.
    ///
    /// # Errors
    /// [`Error::InvalidParameter`] naming the parameter.
    pub fn validate(&self) -> Result<()> {
        check_schedule("steps", self.steps, self.batch_size, self.seqlen, self.lr)?;
        if !(self.temperature.is_finite() && self.temperature > 0.0 && self.temperature <= 100.0) {
            return Err(invalid("temperature", format!("must be in (0, 100], got {}", self.temperature)));
        }
        if !(0.0..=1.0).contains(&self.ce_weight) {
            return Err(invalid("ce_weight", format!("must be in [0, 1], got {}", self.ce_weight)));
        }
        if !(self.rationale_weight.is_finite() && self.rationale_weight >= 0.0) {
            return Err(invalid("rationale_weight", format!("must be >= 0, got {}", self.rationale_weight)));
        }
        Ok(())
    }
}

/// The ranges every training loop of this crate shares: at least one step (`steps_name` names
/// the step count's parameter), one sequence per step, two tokens per sequence, a learning rate
/// in `(0, 1]`.
///
/// # Errors
/// [`Error::InvalidParameter`] naming the parameter.
pub(crate) fn check_schedule(steps_name: &'static str, steps: usize, batch_size: usize, seqlen: usize, lr: f64) -> Result<()> {
    if steps == 0 {
        return Err(invalid(steps_name, "must be at least 1"));
    }
    if batch_size == 0 {
        return Err(invalid("batch_size", "must be at least 1"));
    }
    if seqlen < 2 {
        return Err(invalid("seqlen", "must be at least 2"));
    }
    if !(lr.is_finite() && lr > 0.0 && lr <= 1.0) {
        return Err(invalid("lr", format!("must be in (0, 1], got {lr}")));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Losses
// ---------------------------------------------------------------------------------------------

/// Forward (Hinton) distillation loss, `τ² · mean_rows KL(softmax(t/τ) ‖ softmax(s/τ))` in nats.
///
/// Hinton et al. 2015 §2. The teacher logits are detached.
///
/// # Shapes
/// `student`, `teacher`: `[rows, vocab]`; output `[1]`.
pub fn forward_kl_loss(student: Tensor<2>, teacher: Tensor<2>, temperature: f64) -> Tensor<1> {
    let ls = log_softmax(student.div_scalar(temperature), 1);
    let lt = log_softmax(teacher.detach().div_scalar(temperature), 1);
    let pt = lt.clone().exp();
    pt.mul(lt.sub(ls)).sum_dim(1).mean().mul_scalar(temperature * temperature)
}

/// Reverse KL, `mean_rows KL(softmax(s/τ) ‖ softmax(t/τ))` in nats, exact over the vocabulary
/// (MiniLLM, Gu et al. 2024, eq. 1 at the token level). The teacher logits are detached; the
/// gradient flows through both the student's probabilities and log-probabilities.
///
/// # Shapes
/// `student`, `teacher`: `[rows, vocab]`; output `[1]`.
pub fn reverse_kl_loss(student: Tensor<2>, teacher: Tensor<2>, temperature: f64) -> Tensor<1> {
    let ls = log_softmax(student.div_scalar(temperature), 1);
    let lt = log_softmax(teacher.detach().div_scalar(temperature), 1);
    let ps = ls.clone().exp();
    ps.mul(ls.sub(lt)).sum_dim(1).mean()
}

/// Weighted cross-entropy `Σ_i w_i · (-log softmax(logits_i)[label_i])` in nats (the weights
/// are used as given: pass `1/n` each for a mean).
///
/// # Shapes
/// `logits`: `[rows, vocab]`; `labels`, `weights`: `rows` each; output `[1]`.
///
/// # Errors
/// [`Error::Shape`] when the lengths differ from `rows`; [`Error::InvalidParameter`] for a label
/// outside the vocabulary.
pub fn cross_entropy_weighted(logits: Tensor<2>, labels: &[u32], weights: &[f32]) -> Result<Tensor<1>> {
    let [rows, vocab] = logits.dims();
    if labels.len() != rows || weights.len() != rows {
        return Err(Error::Shape(format!("{} labels, {} weights for {rows} rows", labels.len(), weights.len())));
    }
    if let Some(&l) = labels.iter().find(|&&l| l as usize >= vocab) {
        return Err(invalid("labels", format!("label {l} outside the vocabulary of {vocab}")));
    }
    let device = logits.device();
    let idx: Tensor<2, Int> = Tensor::from_data(TensorData::new(labels.iter().map(|&l| l as i64).collect::<Vec<_>>(), [rows, 1]), &device);
    let w: Tensor<2> = Tensor::from_data(TensorData::new(weights.to_vec(), [rows, 1]), &device);
    let lp = log_softmax(logits, 1).gather(1, idx); // [rows, 1]
    Ok(lp.mul(w).sum().neg())
}

/// Labels and weights of the mean next-token cross-entropy over `ids` (equal-length sequences,
/// concatenated as in [`StudentModel::forward`]): row `j` of sequence `i` predicts `ids[i][j + 1]`
/// with weight `1 / (batch · (seq - 1))`; each sequence's last row is unscored (label 0, weight 0).
/// The inputs of [`cross_entropy_weighted`].
pub fn next_token_labels(ids: &[Vec<u32>]) -> (Vec<u32>, Vec<f32>) {
    let n: usize = ids.iter().map(|s| s.len().saturating_sub(1)).sum();
    let per = (1.0 / n.max(1) as f64) as f32;
    ids.iter().flat_map(|s| (0..s.len()).map(move |j| if j + 1 < s.len() { (s[j + 1], per) } else { (0, 0.0) })).unzip()
}

/// Role of a token position in a chain-of-thought example.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenKind {
    /// Not scored (question, padding).
    Ignore,
    /// A token of the worked rationale.
    Rationale,
    /// A token of the final answer (`#### N`).
    Answer,
}

/// Per-position weights of [`cot_loss`]: `1 / n_answer` for answer tokens and
/// `λ / n_rationale` for rationale tokens, 0 elsewhere (an absent kind contributes 0).
pub fn cot_weights(kinds: &[TokenKind], rationale_weight: f64) -> Vec<f32> {
    let na = kinds.iter().filter(|&&k| k == TokenKind::Answer).count();
    let nr = kinds.iter().filter(|&&k| k == TokenKind::Rationale).count();
    kinds
        .iter()
        .map(|k| match k {
            TokenKind::Answer => (1.0 / na as f64) as f32,
            TokenKind::Rationale => (rationale_weight / nr as f64) as f32,
            TokenKind::Ignore => 0.0,
        })
        .collect()
}

/// Chain-of-thought loss `CE(answer tokens) + λ · CE(rationale tokens)`, each CE the mean over
/// its tokens ("Distilling step-by-step", Hsieh et al. 2023, eq. 3). Row `i` of `logits` predicts
/// `labels[i]`, whose role is `kinds[i]`.
///
/// # Shapes
/// `logits`: `[rows, vocab]`; `labels`, `kinds`: `rows` each; output `[1]`.
///
/// # Errors
/// As [`cross_entropy_weighted`].
pub fn cot_loss(logits: Tensor<2>, labels: &[u32], kinds: &[TokenKind], rationale_weight: f64) -> Result<Tensor<1>> {
    cross_entropy_weighted(logits, labels, &cot_weights(kinds, rationale_weight))
}

// ---------------------------------------------------------------------------------------------
// Teacher, data
// ---------------------------------------------------------------------------------------------

/// A frozen model that gives logits for full sequences.
pub trait Teacher {
    /// Vocabulary size.
    fn vocab(&self) -> usize;
    /// Logits of every position of each sequence, `[Σ len, vocab]` row-major on the host.
    ///
    /// # Errors
    /// The model's errors.
    fn logits(&self, ids: &[Vec<u32>]) -> Result<Vec<f32>>;
}

impl Teacher for Llama {
    fn vocab(&self) -> usize {
        self.config.vocab_size
    }
    fn logits(&self, ids: &[Vec<u32>]) -> Result<Vec<f32>> {
        let inputs: Vec<SeqInput<'_>> = ids.iter().enumerate().map(|(i, t)| SeqInput { seq: i as u64, tokens: t, tree: None }).collect();
        let mut cache = DenseKvCache::new(self.num_layers());
        let out = self.forward(&inputs, &mut cache, LogitsWanted::All)?;
        Ok(deco_model::host::to_host(out.logits)?)
    }
}

/// One GSM8K-style example: `question`, worked `rationale` and final `answer` (`#### N`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CotExample {
    /// The question.
    pub question: String,
    /// The worked steps (the data set's `answer` before `####`).
    pub rationale: String,
    /// The final part, `#### N`.
    pub answer: String,
}

/// Parses JSON lines with `question` and `answer` fields (GSM8K: the answer is the rationale
/// followed by `#### N`). Lines without `####` are skipped.
///
/// # Errors
/// [`Error::InvalidParameter`] for malformed JSON or no usable record.
pub fn parse_gsm_jsonl(text: &str) -> Result<Vec<CotExample>> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(line).map_err(|e| invalid("data", format!("line {}: {e}", i + 1)))?;
        let (Some(q), Some(a)) = (v["question"].as_str(), v["answer"].as_str()) else {
            return Err(invalid("data", format!("line {}: needs string fields `question` and `answer`", i + 1)));
        };
        if let Some(pos) = a.rfind("####") {
            out.push(CotExample { question: q.to_string(), rationale: a[..pos].to_string(), answer: a[pos..].trim_end().to_string() });
        }
    }
    if out.is_empty() {
        return Err(invalid("data", "no record with a `#### N` answer"));
    }
    Ok(out)
}

/// A tokenized chain-of-thought sequence: `ids` (`Question: q\nAnswer: ` + rationale + answer
/// [+ eos]) and the role of each token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CotSequence {
    /// Token ids.
    pub ids: Vec<u32>,
    /// Role of each token (`ids.len()` entries).
    pub kinds: Vec<TokenKind>,
}

/// Tokenizes an example with `encode` (no special tokens added), appending `eos` to the answer
/// when given.
///
/// # Errors
/// Whatever `encode` returns.
pub fn cot_sequence(ex: &CotExample, encode: &dyn Fn(&str) -> Result<Vec<u32>>, eos: Option<u32>) -> Result<CotSequence> {
    let prompt = encode(&format!("Question: {}\nAnswer: ", ex.question))?;
    let rat = encode(&ex.rationale)?;
    let mut ans = encode(&ex.answer)?;
    ans.extend(eos);
    let mut kinds = vec![TokenKind::Ignore; prompt.len()];
    kinds.extend(std::iter::repeat_n(TokenKind::Rationale, rat.len()));
    kinds.extend(std::iter::repeat_n(TokenKind::Answer, ans.len()));
    let mut ids = prompt;
    ids.extend(rat);
    ids.extend(ans);
    Ok(CotSequence { ids, kinds })
}

/// Training data of [`distill`].
#[derive(Debug, Clone)]
pub enum DistillData {
    /// A token stream, cut into random windows ([`Objective::Kd`], [`Objective::ReverseKl`]).
    Tokens(Vec<u32>),
    /// Chain-of-thought sequences ([`Objective::Cot`]); padded with `pad` to a common length.
    Cot {
        /// The sequences.
        seqs: Vec<CotSequence>,
        /// Padding token (not scored).
        pad: u32,
    },
}

// ---------------------------------------------------------------------------------------------
// Training
// ---------------------------------------------------------------------------------------------

/// One row of the training log.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepLog {
    /// Step, 1-based.
    pub step: usize,
    /// Loss of the step's batch (nats).
    pub loss: f64,
    /// Tokens through the student this step.
    pub tokens: usize,
    /// Wall seconds of the step.
    pub secs: f64,
}

pub(crate) fn step_rng(seed: u64, step: usize) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed ^ (step as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

/// `n` random windows of `len` tokens.
pub(crate) fn windows(tokens: &[u32], n: usize, len: usize, rng: &mut ChaCha8Rng) -> Result<Vec<Vec<u32>>> {
    if tokens.len() <= len {
        return Err(invalid("data", format!("{} tokens, need more than seqlen {len}", tokens.len())));
    }
    Ok((0..n).map(|_| {
        let s = rng.random_range(0..tokens.len() - len);
        tokens[s..s + len].to_vec()
    }).collect())
}

fn tensor2(data: Vec<f32>, rows: usize, cols: usize, device: &Device) -> Tensor<2> {
    Tensor::from_data(TensorData::new(data, [rows, cols]), device)
}

/// Adam (burn-optim defaults) with gradient clipping by norm per parameter tensor when
/// `clip_norm` is given: the optimizer of every training loop of this crate.
pub(crate) fn adam_config(clip_norm: Option<f32>) -> AdamConfig {
    let adam = AdamConfig::new();
    match clip_norm {
        Some(c) => adam.with_grad_clipping(Some(GradientClippingConfig::Norm(c))),
        None => adam,
    }
}

/// The value of a training step's loss, or an error advising a lower learning rate when it is
/// not finite.
///
/// # Errors
/// [`Error::InvalidParameter`] (`lr`) for a NaN or infinite loss; a failed device read.
pub(crate) fn loss_value(loss: &Tensor<1>, step: usize) -> Result<f64> {
    let lv = scalar(loss.clone())?;
    if !lv.is_finite() {
        return Err(invalid("lr", format!("loss became {lv} at step {step}; lower the learning rate")));
    }
    Ok(lv)
}

pub(crate) fn scalar(t: Tensor<1>) -> Result<f64> {
    let v = deco_model::host::to_host(t.detach().reshape([1, 1]))?;
    Ok(f64::from(v.first().copied().unwrap_or(f32::NAN)))
}

/// Samples `new` tokens after each prompt from the model at temperature 1 (ancestral sampling
/// with the KV cache), returning the full sequences.
///
/// # Errors
/// The model's errors.
pub fn sample_continuations(model: &Llama, prompts: &[Vec<u32>], new: usize, rng: &mut ChaCha8Rng) -> Result<Vec<Vec<u32>>> {
    let mut seqs = prompts.to_vec();
    let mut cache = DenseKvCache::new(model.num_layers());
    let vocab = model.config.vocab_size;
    let mut pending: Vec<Vec<u32>> = prompts.to_vec();
    for _ in 0..new {
        let inputs: Vec<SeqInput<'_>> = pending.iter().enumerate().map(|(i, t)| SeqInput { seq: i as u64, tokens: t, tree: None }).collect();
        let out = model.forward(&inputs, &mut cache, LogitsWanted::Last)?;
        let rows = deco_model::host::to_host(out.logits)?;
        for (i, row) in rows.chunks_exact(vocab).enumerate() {
            let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let p: Vec<f64> = row.iter().map(|&x| f64::from(x - m).exp()).collect();
            let total: f64 = p.iter().sum();
            let mut u = rng.random::<f64>() * total;
            let mut tok = vocab - 1;
            for (j, &pj) in p.iter().enumerate() {
                u -= pj;
                if u <= 0.0 {
                    tok = j;
                    break;
                }
            }
            seqs[i].push(tok as u32);
            pending[i] = vec![tok as u32];
        }
    }
    Ok(seqs)
}

/// The loss of one batch for `student` (on an autodiff device for training, or a plain one for
/// evaluation), and the number of tokens through the student.
///
/// # Errors
/// Data or model errors.
pub fn batch_loss(
    student: &StudentModel,
    cfg: &ModelConfig,
    teacher: &dyn Teacher,
    data: &DistillData,
    dc: &DistillConfig,
    rng: &mut ChaCha8Rng,
) -> Result<(Tensor<1>, usize)> {
    let device = student.embed.val().device();
    let vocab = cfg.vocab_size;
    let (b, t) = (dc.batch_size, dc.seqlen);
    match (dc.objective, data) {
        (Objective::Kd, DistillData::Tokens(tokens)) => {
            let ids = windows(tokens, b, t, rng)?;
            let s = student.forward(cfg, &ids, dc.freeze_embeddings)?;
            let tl = tensor2(teacher.logits(&ids)?, b * t, vocab, &device);
            let mut loss = forward_kl_loss(s.clone(), tl, dc.temperature).mul_scalar(1.0 - dc.ce_weight);
            if dc.ce_weight > 0.0 {
                let (labels, w) = next_token_labels(&ids);
                loss = loss.add(cross_entropy_weighted(s, &labels, &w)?.mul_scalar(dc.ce_weight));
            }
            Ok((loss, b * t))
        }
        (Objective::ReverseKl, DistillData::Tokens(tokens)) => {
            let prompt = (t / 2).max(1);
            let prompts: Vec<Vec<u32>> = windows(tokens, b, prompt, rng)?;
            let host = student.to_hf_tensors(cfg)?;
            let sampler = Llama::load_from(
                cfg,
                &|n| host.get(n).cloned().ok_or_else(|| deco_model::Error::InvalidInput(format!("missing `{n}`"))),
                &Device::flex(),
                Some(t),
            )?;
            let ids = sample_continuations(&sampler, &prompts, t - prompt, rng)?;
            drop(sampler);
            // Rows prompt-1 ..= t-2 of each sequence predict the sampled tokens.
            let rows: Vec<i64> = (0..b).flat_map(|i| (prompt - 1..t - 1).map(move |j| (i * t + j) as i64)).collect();
            let nr = rows.len();
            let idx: Tensor<1, Int> = Tensor::from_data(TensorData::new(rows, [nr]), &device);
            let s = student.forward(cfg, &ids, dc.freeze_embeddings)?.select(0, idx.clone());
            let tl = tensor2(teacher.logits(&ids)?, b * t, vocab, &device).select(0, idx);
            Ok((reverse_kl_loss(s, tl, dc.temperature), b * t))
        }
        (Objective::Cot, DistillData::Cot { seqs, pad }) => {
            if seqs.is_empty() {
                return Err(invalid("data", "no chain-of-thought examples"));
            }
            let picked: Vec<&CotSequence> = (0..b).map(|_| &seqs[rng.random_range(0..seqs.len())]).collect();
            let len = picked.iter().map(|s| s.ids.len().min(t)).max().unwrap_or(2).max(2);
            let mut ids = Vec::with_capacity(b);
            let mut labels = Vec::with_capacity(b * len);
            let mut kinds = Vec::with_capacity(b * len);
            for s in picked {
                let mut x: Vec<u32> = s.ids.iter().copied().take(len).collect();
                let mut k: Vec<TokenKind> = s.kinds.iter().copied().take(len).collect();
                x.resize(len, *pad);
                k.resize(len, TokenKind::Ignore);
                for j in 0..len {
                    labels.push(if j + 1 < len { x[j + 1] } else { 0 });
                    kinds.push(if j + 1 < len { k[j + 1] } else { TokenKind::Ignore });
                }
                ids.push(x);
            }
            let s = student.forward(cfg, &ids, dc.freeze_embeddings)?;
            Ok((cot_loss(s, &labels, &kinds, dc.rationale_weight)?, b * len))
        }
        (o, _) => Err(invalid("data", format!("objective {o:?} does not match the data kind"))),
    }
}

/// Mean forward KL `KL(teacher ‖ student)` at τ = 1 (nats per token) over the given sequences:
/// the recovery metric (evaluated without gradient on the student's inner device).
///
/// # Errors
/// Model errors.
pub fn mean_kl(student: &StudentModel, cfg: &ModelConfig, teacher: &dyn Teacher, seqs: &[Vec<u32>]) -> Result<f64> {
    let mut total = 0.0;
    for s in seqs {
        let l = student.forward(cfg, std::slice::from_ref(s), false)?;
        let device = l.device();
        let tl = tensor2(teacher.logits(std::slice::from_ref(s))?, s.len(), cfg.vocab_size, &device);
        total += scalar(forward_kl_loss(l, tl, 1.0))?;
    }
    Ok(total / seqs.len().max(1) as f64)
}

/// Trains `student` (on an autodiff device) against the frozen `teacher` for steps
/// `start_step + 1 ..= dc.steps` with Adam (fresh moments), calling `progress` after every step
/// and `checkpoint(step, &student)` every `checkpoint_every` steps (0: never) and after the last.
///
/// # Errors
/// [`Error::InvalidParameter`] for a bad config, a student/teacher vocabulary mismatch, data of
/// the wrong kind or too short; model and checkpoint errors.
#[allow(clippy::too_many_arguments)]
pub fn distill(
    mut student: StudentModel,
    cfg: &ModelConfig,
    teacher: &dyn Teacher,
    data: &DistillData,
    dc: &DistillConfig,
    start_step: usize,
    checkpoint_every: usize,
    progress: &mut dyn FnMut(&StepLog),
    checkpoint: &mut dyn FnMut(usize, &StudentModel) -> Result<()>,
) -> Result<(StudentModel, Vec<StepLog>)> {
    dc.validate()?;
    if teacher.vocab() != cfg.vocab_size {
        return Err(invalid("teacher", format!("teacher vocabulary {} != student vocabulary {}", teacher.vocab(), cfg.vocab_size)));
    }
    let mut optim = adam_config(dc.clip_norm).init();
    let mut log = Vec::new();
    for step in start_step + 1..=dc.steps {
        let t0 = Instant::now();
        let mut rng = step_rng(dc.seed, step);
        let (loss, tokens) = batch_loss(&student, cfg, teacher, data, dc, &mut rng)?;
        let lv = loss_value(&loss, step)?;
        let grads = GradientsParams::from_grads(loss.backward(), &student);
        student = optim.step(dc.lr, student, grads);
        let row = StepLog { step, loss: lv, tokens, secs: t0.elapsed().as_secs_f64() };
        progress(&row);
        log.push(row);
        if step == dc.steps || (checkpoint_every > 0 && step % checkpoint_every == 0) {
            checkpoint(step, &student)?;
        }
    }
    Ok((student, log))
}
