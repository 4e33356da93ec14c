//! Meta-instruction control: the second training stage of AutoDeco (Wang et al. 2025, the
//! section on emergent instruction-based decoding control and its targeted training with a
//! ranking objective), in which a ranking loss teaches the heads that a
//! prompt asking for low randomness should get a lower temperature (and top-p) than the same
//! prompt without an instruction, and a prompt asking for creativity a higher one.
//!
//! Data: each question is rendered three times with the model's chat template: as it is, with a
//! "low randomness" phrasing appended ([`LOW_TRAIN`]) and with a "high creativity" phrasing
//! appended ([`HIGH_TRAIN`]); the same reference answer follows each. The frozen base gives the final hidden state of the first `max_positions` answer
//! positions of every variant ([`collect_meta`]); the answer tokens are identical, so position
//! `j` of the three variants is a matched triple.
//!
//! Loss (heads only; the base and its LM head stay frozen). Each step draws questions and, per
//! question, `K` answer positions (the same in the three variants); `T̄_low, T̄_none, T̄_high` are
//! a question's mean predictions over them (likewise `P̄`):
//!
//! ```text
//! rank_T = relu(m_T − (T̄_none − T̄_low)) + relu(m_T − (T̄_high − T̄_none))
//! rank_P = relu(m_P − (P̄_none − P̄_low)) + relu(m_P − (P̄_high − P̄_none))
//! anchor = (T_none − T⁰_none)² + (P_none − P⁰_none)²          (per position)
//! loss   = mean(rank_T) + mean(rank_P) + λ · mean(anchor)
//! ```
//!
//! where `T⁰, P⁰` are the stage-one heads' predictions: the anchor keeps the behaviour without an
//! instruction where stage one put it. Ranking per-question means (not single positions) is what
//! the measurement reports; `m_P = 0` leaves the top-p head out. The margin ranking form is the
//! standard pairwise loss (as `torch.nn.MarginRankingLoss`); the paper states a ranking objective on the (T, P) of
//! instruction pairs and gives no formula, so margins and the anchor are deco's choice
//! (`MetaConfig`).
//!
//! Measurement ([`measure`]): on held-out questions and held-out phrasings, each prompt's mean
//! predicted T and P over its answer positions (teacher-forced on the reference answer), the mean
//! change against no instruction, and the fraction of (question, phrasing) pairs where
//! `T_low < T_none` (resp. `T_high > T_none`) and where the full order
//! `T_low < T_none < T_high` holds.

use deco_formats::chat_template::ChatTemplate;
use deco_formats::tokenizer::Tokenizer;
use deco_model::host::to_host;
use deco_model::{DenseKvCache, Llama, SeqInput};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::data::{GsmItem, chat_example, strip_calculator};
use crate::error::{Error, Result, invalid};
use crate::heads::HostHeads;

/// "Low randomness" phrasings used in training.
pub const LOW_TRAIN: &[&str] = &[
    "Please answer with low randomness.",
    "Be as deterministic as you can.",
    "Answer conservatively and precisely, without any creativity.",
    "Give only the single most likely answer.",
    "Keep your answer focused and predictable.",
    "Avoid any randomness in your reply.",
];

/// "Low randomness" phrasings held out from training (measurement only).
pub const LOW_HELDOUT: &[&str] = &[
    "Please reduce the randomness of your output.",
    "Respond in a careful, deterministic way.",
    "Stick to the most probable wording.",
];

/// "High creativity" phrasings used in training.
pub const HIGH_TRAIN: &[&str] = &[
    "Be creative.",
    "Please answer with high creativity.",
    "Make your answer diverse and imaginative.",
    "Feel free to be original and surprising.",
    "Use varied, colorful language.",
    "Be as inventive as possible.",
];

/// "High creativity" phrasings held out from training (measurement only).
pub const HIGH_HELDOUT: &[&str] = &[
    "Please ensure your answer is diverse and creative.",
    "Respond in an unexpected, playful way.",
    "Let your imagination run wild.",
];

/// One question's matched hidden states.
#[derive(Debug, Clone)]
pub struct MetaPrompt {
    /// Index of the question in its source file.
    pub item: usize,
    /// Answer positions kept (`1..=max_positions`).
    pub rows: usize,
    /// Hidden states of the question alone: `[rows, H]`, row-major.
    pub none: Vec<f32>,
    /// One `[rows, H]` block per low phrasing of this prompt, with the phrasing's index.
    pub low: Vec<(usize, Vec<f32>)>,
    /// One `[rows, H]` block per high phrasing of this prompt, with the phrasing's index.
    pub high: Vec<(usize, Vec<f32>)>,
}

/// Final hidden states of `model` at the first `max_positions` answer positions of
/// `question + " " + instruction` (or the question alone) followed by `answer`.
fn answer_hidden(model: &Llama, tok: &Tokenizer, template: &ChatTemplate, question: &str, instruction: Option<&str>, answer: &str, max_positions: usize) -> Result<(Vec<u32>, Vec<f32>)> {
    let q = match instruction {
        Some(i) => format!("{question} {i}"),
        None => question.to_string(),
    };
    let ex = chat_example(tok, template, &q, answer)?;
    let rows = ex.answer.len().min(max_positions);
    if rows == 0 {
        return Err(Error::Data("an empty answer".into()));
    }
    // The prompt and the answer's first rows − 1 tokens: the last `rows` positions predict
    // answer[0..rows].
    let ids: Vec<u32> = ex.prompt.iter().chain(&ex.answer[..rows - 1]).copied().collect();
    if ids.len() > model.max_context() {
        return Err(Error::Data(format!("{} tokens exceed the model's context", ids.len())));
    }
    let mut cache = DenseKvCache::new(model.num_layers());
    let out = model.forward_rows(&[SeqInput { seq: 0, tokens: &ids, tree: None }], &mut cache, &[rows], model.num_layers())?;
    let hidden = to_host(out.hidden)?;
    Ok((ex.answer[..rows].to_vec(), hidden))
}

/// The frozen LM head as a function: `[rows, H]` hidden states (row-major) and `rows` to
/// `[rows, V]` logits.
pub type LogitsFn<'a> = &'a dyn Fn(&[f32], usize) -> Result<Vec<f32>>;

/// A block's mean predicted T and P and its per-position `(T, P)`.
type BlockTp = (f64, f64, Vec<(f32, f32)>);

/// Phrasings of one kind for one prompt: `(index in its list, text)`.
type Chosen = Vec<(usize, &'static str)>;

/// Which phrasings each prompt gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phrasings {
    /// One training phrasing of each kind per prompt, drawn with the seed.
    TrainOnePerPrompt,
    /// Every held-out phrasing of each kind.
    HeldOutAll,
}

/// Runs the frozen base over `items` (worked answers with calculator annotations removed) in the
/// variants `phrasings` asks for, keeping the first `max_positions` answer positions.
/// `progress(done, total)` is called after each question.
///
/// # Errors
/// Model / template errors; [`Error::Data`] when the answer tokens differ between the variants of
/// a question (a template that tokenizes the answer differently after an instruction) or no
/// question yields a position; `max_positions` 0.
#[allow(clippy::too_many_arguments)]
pub fn collect_meta(
    model: &Llama,
    tok: &Tokenizer,
    template: &ChatTemplate,
    items: &[(usize, &GsmItem)],
    phrasings: Phrasings,
    max_positions: usize,
    seed: u64,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Vec<MetaPrompt>> {
    if max_positions == 0 {
        return Err(invalid("max_positions", "must be at least 1"));
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut out = Vec::with_capacity(items.len());
    for (k, &(item, it)) in items.iter().enumerate() {
        let answer = strip_calculator(&it.answer);
        let (lows, highs): (Chosen, Chosen) = match phrasings {
            Phrasings::TrainOnePerPrompt => {
                let l = rng.random_range(0..LOW_TRAIN.len());
                let h = rng.random_range(0..HIGH_TRAIN.len());
                (vec![(l, LOW_TRAIN[l])], vec![(h, HIGH_TRAIN[h])])
            }
            Phrasings::HeldOutAll => (LOW_HELDOUT.iter().copied().enumerate().collect(), HIGH_HELDOUT.iter().copied().enumerate().collect()),
        };
        let (labels, none) = answer_hidden(model, tok, template, &it.question, None, &answer, max_positions)?;
        let rows = labels.len();
        let one = |ins: &str| -> Result<Vec<f32>> {
            let (l, h) = answer_hidden(model, tok, template, &it.question, Some(ins), &answer, max_positions)?;
            if l != labels {
                return Err(Error::Data(format!("question {item}: the answer tokenizes differently after the instruction \"{ins}\"")));
            }
            Ok(h)
        };
        let low = lows.iter().map(|&(i, s)| Ok((i, one(s)?))).collect::<Result<Vec<_>>>()?;
        let high = highs.iter().map(|&(i, s)| Ok((i, one(s)?))).collect::<Result<Vec<_>>>()?;
        out.push(MetaPrompt { item, rows, none, low, high });
        progress(k + 1, items.len());
    }
    if out.is_empty() {
        return Err(Error::Data("no questions for the meta-instruction stage".into()));
    }
    Ok(out)
}

/// One question of a pool file: `(item, rows, low phrasing indices, high phrasing indices)`.
type QuestionShape = (usize, usize, Vec<usize>, Vec<usize>);

/// Layout of a pool file ([`save_pools`]): a JSON header line, then the f32 values.
#[derive(serde::Serialize, serde::Deserialize)]
struct PoolHeader {
    key: String,
    hidden_size: usize,
    /// Per pool, per question.
    pools: Vec<Vec<QuestionShape>>,
}

/// Writes pools of hidden states (e.g. the training and held-out pools of one run) to `path`
/// (atomically), tagged with `key` (what produced them: model, data, options), so that a rerun
/// of the stage with other loss settings skips the base model ([`load_pools`]).
///
/// # Errors
/// [`Error::Io`].
pub fn save_pools(path: &std::path::Path, key: &str, hidden_size: usize, pools: &[&[MetaPrompt]]) -> Result<()> {
    let header = PoolHeader {
        key: key.to_string(),
        hidden_size,
        pools: pools.iter().map(|p| p.iter().map(|q| (q.item, q.rows, q.low.iter().map(|l| l.0).collect(), q.high.iter().map(|h| h.0).collect())).collect()).collect(),
    };
    let mut bytes = serde_json::to_vec(&header).map_err(|e| Error::Data(format!("pool header: {e}")))?;
    bytes.push(b'\n');
    for p in pools {
        for q in *p {
            for block in std::iter::once(&q.none).chain(q.low.iter().map(|l| &l.1)).chain(q.high.iter().map(|h| &h.1)) {
                for v in block {
                    bytes.extend_from_slice(&v.to_le_bytes());
                }
            }
        }
    }
    crate::write_atomic(path, &bytes)
}

/// Reads pools written by [`save_pools`] if `path` exists and its key and hidden size match;
/// `Ok(None)` otherwise (missing file, other key).
///
/// # Errors
/// [`Error::Data`] for a file that says it holds these pools but is truncated or malformed.
pub fn load_pools(path: &std::path::Path, key: &str, hidden_size: usize) -> Result<Option<Vec<Vec<MetaPrompt>>>> {
    let Ok(bytes) = std::fs::read(path) else { return Ok(None) };
    let Some(nl) = bytes.iter().position(|&b| b == b'\n') else { return Ok(None) };
    let Ok(header) = serde_json::from_slice::<PoolHeader>(&bytes[..nl]) else { return Ok(None) };
    if header.key != key || header.hidden_size != hidden_size {
        return Ok(None);
    }
    let bad = || Error::Data(format!("{}: truncated or malformed pool file", path.display()));
    let mut data = bytes[nl + 1..].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
    let mut take = |n: usize| -> Result<Vec<f32>> {
        let v: Vec<f32> = data.by_ref().take(n).collect();
        if v.len() == n { Ok(v) } else { Err(bad()) }
    };
    let mut out = Vec::new();
    for p in &header.pools {
        let mut pool = Vec::with_capacity(p.len());
        for (item, rows, lows, highs) in p {
            let n = rows.checked_mul(hidden_size).ok_or_else(bad)?;
            let none = take(n)?;
            let low = lows.iter().map(|&i| Ok((i, take(n)?))).collect::<Result<Vec<_>>>()?;
            let high = highs.iter().map(|&i| Ok((i, take(n)?))).collect::<Result<Vec<_>>>()?;
            pool.push(MetaPrompt { item: *item, rows: *rows, none, low, high });
        }
        out.push(pool);
    }
    if data.next().is_some() {
        return Err(bad());
    }
    Ok(Some(out))
}

/// Mean predicted `(T, P)` of a `[rows, H]` block, the logits coming from `logits(hidden, rows)`.
fn mean_tp(heads: &HostHeads, hidden: &[f32], rows: usize, logits: LogitsFn<'_>) -> Result<BlockTp> {
    let h = heads.config().hidden_size;
    let v = heads.config().vocab_size;
    if hidden.len() != rows * h {
        return Err(Error::Shape(format!("{} hidden values for {rows} rows of {h}", hidden.len())));
    }
    let z = logits(hidden, rows)?;
    let mut trace = Vec::with_capacity(rows);
    let (mut st, mut sp) = (0.0, 0.0);
    for r in 0..rows {
        let o = heads.predict(&hidden[r * h..(r + 1) * h], &z[r * v..(r + 1) * v])?;
        st += f64::from(o.temperature);
        sp += f64::from(o.top_p);
        trace.push((o.temperature, o.top_p));
    }
    Ok((st / rows as f64, sp / rows as f64, trace))
}

/// What [`measure`] reports (all means over (question, phrasing) pairs; T and P are each prompt's
/// mean over its answer positions).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct MetaReport {
    /// Questions measured.
    pub questions: usize,
    /// (question, phrasing) pairs of each kind.
    pub pairs: usize,
    /// Mean T and P without an instruction.
    pub mean_t_none: f64,
    /// Mean P without an instruction.
    pub mean_p_none: f64,
    /// Mean `T_low − T_none`.
    pub delta_t_low: f64,
    /// Mean `T_high − T_none`.
    pub delta_t_high: f64,
    /// Mean `P_low − P_none`.
    pub delta_p_low: f64,
    /// Mean `P_high − P_none`.
    pub delta_p_high: f64,
    /// Fraction of pairs with `T_low < T_none`.
    pub frac_t_low_below: f64,
    /// Fraction of pairs with `T_high > T_none`.
    pub frac_t_high_above: f64,
    /// Fraction of (question, low phrasing, high phrasing) triples with `T_low < T_none < T_high`.
    pub frac_t_order: f64,
    /// Fraction of triples with `P_low < P_none < P_high`.
    pub frac_p_order: f64,
}

/// Per-position `(T, P)` of one question's variants (for plots): none, first low, first high.
pub type MetaTrace = [Vec<(f32, f32)>; 3];

/// Measures `heads` on `pool`: see [`MetaReport`]. `logits(hidden, rows)` is the frozen LM head
/// (`[rows, H] -> [rows, V]`). Returns the report and the trace of the first question.
///
/// # Errors
/// Shape mismatches between the pool and the heads; errors of `logits`; an empty pool.
pub fn measure(heads: &HostHeads, pool: &[MetaPrompt], logits: LogitsFn<'_>) -> Result<(MetaReport, MetaTrace)> {
    if pool.is_empty() {
        return Err(Error::Data("no questions to measure".into()));
    }
    let mut r = MetaReport { questions: pool.len(), ..Default::default() };
    let (mut n_low, mut n_high, mut n_tri) = (0usize, 0usize, 0usize);
    let mut trace: MetaTrace = Default::default();
    for (qi, q) in pool.iter().enumerate() {
        let (tn, pn, tr_n) = mean_tp(heads, &q.none, q.rows, logits)?;
        r.mean_t_none += tn;
        r.mean_p_none += pn;
        let mut lows = Vec::new();
        for (_, h) in &q.low {
            let (t, p, tr) = mean_tp(heads, h, q.rows, logits)?;
            if qi == 0 && trace[1].is_empty() {
                trace[1] = tr;
            }
            r.delta_t_low += t - tn;
            r.delta_p_low += p - pn;
            r.frac_t_low_below += f64::from(u8::from(t < tn));
            n_low += 1;
            lows.push((t, p));
        }
        let mut highs = Vec::new();
        for (_, h) in &q.high {
            let (t, p, tr) = mean_tp(heads, h, q.rows, logits)?;
            if qi == 0 && trace[2].is_empty() {
                trace[2] = tr;
            }
            r.delta_t_high += t - tn;
            r.delta_p_high += p - pn;
            r.frac_t_high_above += f64::from(u8::from(t > tn));
            n_high += 1;
            highs.push((t, p));
        }
        for &(tl, pl) in &lows {
            for &(th, ph) in &highs {
                r.frac_t_order += f64::from(u8::from(tl < tn && tn < th));
                r.frac_p_order += f64::from(u8::from(pl < pn && pn < ph));
                n_tri += 1;
            }
        }
        if qi == 0 {
            trace[0] = tr_n;
        }
    }
    let q = pool.len() as f64;
    r.mean_t_none /= q;
    r.mean_p_none /= q;
    r.pairs = n_low.min(n_high);
    let d = |x: &mut f64, n: usize| *x /= n.max(1) as f64;
    d(&mut r.delta_t_low, n_low);
    d(&mut r.delta_p_low, n_low);
    d(&mut r.frac_t_low_below, n_low);
    d(&mut r.delta_t_high, n_high);
    d(&mut r.delta_p_high, n_high);
    d(&mut r.frac_t_high_above, n_high);
    d(&mut r.frac_t_order, n_tri);
    d(&mut r.frac_p_order, n_tri);
    Ok((r, trace))
}

/// Options of the ranking stage.
#[derive(Debug, Clone, PartialEq)]
pub struct MetaConfig {
    /// Optimizer steps.
    pub steps: usize,
    /// Questions per step (three variants each).
    pub batch_size: usize,
    /// Answer positions drawn per question and step (with replacement); the ranking compares
    /// the variants' mean T (and P) over them, the per-question mean that [`measure`] reports.
    pub positions_per_question: usize,
    /// Adam learning rate.
    pub learning_rate: f64,
    /// Margin `m_T` of the temperature ranking.
    pub margin_t: f32,
    /// Margin `m_P` of the top-p ranking; 0 leaves the top-p head out of the stage (no logits
    /// are computed; its input T still follows the temperature head). Heads whose top-p output
    /// is saturated at 1 (as deco's stage-one heads are) get no gradient from it anyway.
    pub margin_p: f32,
    /// Weight `λ` of the anchor to the stage-one predictions without an instruction.
    pub anchor_weight: f32,
    /// Seed of the sampling of questions and positions.
    pub seed: u64,
}

impl Default for MetaConfig {
    fn default() -> Self {
        Self { steps: 2000, batch_size: 16, positions_per_question: 8, learning_rate: 2e-3, margin_t: 0.25, margin_p: 0.02, anchor_weight: 30.0, seed: 0 }
    }
}

impl MetaConfig {
    /// Checks the ranges.
    ///
    /// # Errors
    /// [`Error::InvalidParameter`] naming the parameter.
    pub fn validate(&self) -> Result<()> {
        if self.steps == 0 {
            return Err(invalid("steps", "must be at least 1"));
        }
        if self.batch_size == 0 {
            return Err(invalid("batch_size", "must be at least 1"));
        }
        if self.positions_per_question == 0 {
            return Err(invalid("positions_per_question", "must be at least 1"));
        }
        if !(self.learning_rate.is_finite() && self.learning_rate > 0.0) {
            return Err(invalid("learning_rate", format!("must be a positive number, got {}", self.learning_rate)));
        }
        for (name, v) in [("margin_t", self.margin_t), ("margin_p", self.margin_p), ("anchor_weight", self.anchor_weight)] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(invalid(name, format!("must be a non-negative number, got {v}")));
            }
        }
        Ok(())
    }
}

/// One row of the ranking stage's log.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct MetaLogRow {
    /// Step (1-based).
    pub step: usize,
    /// Temperature ranking loss of the batch.
    pub rank_t: f64,
    /// Top-p ranking loss of the batch (NaN when the top-p head is left out).
    pub rank_p: f64,
    /// Anchor loss of the batch.
    pub anchor: f64,
}

#[cfg(feature = "train")]
pub use train_impl::train_meta;

#[cfg(feature = "train")]
mod train_impl {
    use burn::module::Module;
    use burn::optim::{AdamConfig, GradientsParams};
    use burn::tensor::{Tensor, TensorData, activation::relu};

    use super::*;
    use crate::stats::{NUM_STATS, prob_stats};
    use crate::train::FrozenHead;

    fn vec_of(t: Tensor<2>) -> Result<Vec<f32>> {
        t.detach().try_into_vec_as::<f32>().map_err(|e| Error::TensorRead(format!("{e:?}")))
    }

    /// The ranking stage: starts from `stage_one` and returns the fine-tuned heads and the log.
    /// `progress` is called after every step.
    ///
    /// # Errors
    /// Invalid `mc`; an empty pool or one whose hidden size differs from the heads'; device read
    /// failures.
    pub fn train_meta(stage_one: &HostHeads, pool: &[MetaPrompt], head: &FrozenHead, mc: &MetaConfig, progress: &mut dyn FnMut(&MetaLogRow)) -> Result<(HostHeads, Vec<MetaLogRow>)> {
        mc.validate()?;
        let cfg = stage_one.config().clone();
        let h = cfg.hidden_size;
        let v = cfg.vocab_size;
        if pool.is_empty() {
            return Err(Error::Data("no questions for the meta-instruction stage".into()));
        }
        if let Some(q) = pool.iter().find(|q| q.none.len() != q.rows * h || q.low.is_empty() || q.high.is_empty()) {
            return Err(Error::Shape(format!("question {}: hidden states do not match the heads' hidden size {h} (or a variant is missing)", q.item)));
        }
        let ad = head.device.clone().autodiff();
        ad.seed(mc.seed);
        let mut heads = stage_one.to_module(&ad);
        let mut optim = AdamConfig::new().init();
        let mut rng = ChaCha8Rng::seed_from_u64(mc.seed);
        let frozen = stage_one.to_module(&head.device);
        let (b, kp) = (mc.batch_size, mc.positions_per_question);
        let with_p = mc.margin_p > 0.0;
        let n = b * kp;
        let mut log = Vec::with_capacity(mc.steps);
        for step in 1..=mc.steps {
            // Rows: [none, low, high] blocks of b questions × kp positions each (the same
            // positions in the three variants).
            let mut hidden = vec![0f32; 3 * n * h];
            for i in 0..b {
                let q = &pool[rng.random_range(0..pool.len())];
                let lo = &q.low[rng.random_range(0..q.low.len())].1;
                let hi = &q.high[rng.random_range(0..q.high.len())].1;
                for r in 0..kp {
                    let j = rng.random_range(0..q.rows);
                    for (k, src) in [&q.none, lo, hi].into_iter().enumerate() {
                        let row = k * n + i * kp + r;
                        hidden[row * h..(row + 1) * h].copy_from_slice(&src[j * h..(j + 1) * h]);
                    }
                }
            }
            let none_rows = Tensor::<2>::from_data(TensorData::new(hidden[..n * h].to_vec(), [n, h]), &head.device);
            let x = Tensor::<2>::from_data(TensorData::new(hidden.clone(), [3 * n, h]), &ad);
            let t = heads.temperature(x.clone());
            // Per question: the mean over its kp positions, `[b, 1]` per variant.
            let means = |y: Tensor<2>| -> [Tensor<2>; 3] {
                let y = y.reshape([3, b, kp]).mean_dim(2); // [3, b, 1]
                [0, 1, 2].map(|k| y.clone().slice([k..k + 1, 0..b, 0..1]).reshape([b, 1]))
            };
            let rank = |n: Tensor<2>, l: Tensor<2>, hh: Tensor<2>, m: f32| -> Tensor<1> {
                let a = relu((l - n.clone()) + m);
                let c = relu((n - hh) + m);
                (a + c).mean()
            };
            let scalar = |t: &Tensor<1>| -> Result<f64> {
                let v = t.clone().detach().try_into_vec_as::<f32>().map_err(|e| Error::TensorRead(format!("{e:?}")))?;
                Ok(f64::from(v.first().copied().unwrap_or(f32::NAN)))
            };
            let [tn, tl, th] = means(t.clone());
            let rank_t = rank(tn.clone(), tl, th, mc.margin_t);
            // The anchor: stage one's predictions without an instruction, per position.
            let t0 = frozen.temperature(none_rows.clone());
            let t0 = Tensor::<2>::from_data(TensorData::new(vec_of(t0.clone())?, [n, 1]), &ad);
            let dt = t.clone().slice([0..n, 0..1]) - t0;
            let mut anchor = (dt.clone() * dt).mean();
            let mut rank_p_value = f64::NAN;
            let mut total = rank_t.clone();
            if with_p {
                let logits = head.logits(&hidden, 3 * n)?;
                let t_host = vec_of(t.clone())?;
                let stats_of = |ts: &[f32], rows: usize| -> Option<Vec<f32>> {
                    cfg.use_enhanced_features.then(|| {
                        let mut s = Vec::with_capacity(rows * NUM_STATS);
                        for (row, &tt) in logits.chunks_exact(v).zip(ts) {
                            s.extend_from_slice(&prob_stats(row, tt));
                        }
                        s
                    })
                };
                let stats = stats_of(&t_host, 3 * n).map(|s| Tensor::<2>::from_data(TensorData::new(s, [3 * n, NUM_STATS]), &ad));
                let p = heads.top_p(x, t, stats);
                let [pn, pl, ph] = means(p.clone());
                let rank_p = rank(pn, pl, ph, mc.margin_p);
                rank_p_value = scalar(&rank_p)?;
                // Stage one's P without an instruction (its own T, its own statistics).
                let t0h = vec_of(frozen.temperature(none_rows.clone()))?;
                let s0 = stats_of(&t0h, n).map(|s| Tensor::<2>::from_data(TensorData::new(s, [n, NUM_STATS]), &head.device));
                let p0 = frozen.top_p(none_rows, Tensor::<2>::from_data(TensorData::new(t0h, [n, 1]), &head.device), s0);
                let p0 = Tensor::<2>::from_data(TensorData::new(vec_of(p0)?, [n, 1]), &ad);
                let dp = p.slice([0..n, 0..1]) - p0;
                anchor = anchor + (dp.clone() * dp).mean();
                total = total + rank_p;
            }
            let row = MetaLogRow { step, rank_t: scalar(&rank_t)?, rank_p: rank_p_value, anchor: scalar(&anchor)? };
            let total = total + anchor * mc.anchor_weight;
            let grads = GradientsParams::from_grads(total.backward(), &heads);
            heads = optim.step(mc.learning_rate, heads, grads);
            progress(&row);
            log.push(row);
        }
        Ok((heads.valid().to_host(&cfg)?, log))
    }
}
