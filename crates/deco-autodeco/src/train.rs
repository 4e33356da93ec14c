//! Training the heads on a frozen base with burn autodiff and Adam.
//!
//! Each step samples `batch_size` positions from the [`TokenPool`] (seeded), recomputes their
//! logits through the frozen LM head on the host device (`[n, H] · [H, V]`, no gradient), sorts
//! them ([`SortedBatch`]), runs both heads on the autodiff device and takes one Adam step on
//! `temp_loss + top_p_loss` ([`crate::loss`]). Every `eval_every` steps the held-out losses are
//! computed on a fixed set of held-out positions (easy-token masking off there, so the number is
//! comparable across steps).
//!
//! Differences from the reference trainer (`trl_train.py`, full sequences through the whole
//! model with the base frozen): deco precomputes the base's hidden states once and samples
//! positions, which gives the same gradients for the heads at a fraction of the cost.

use burn::module::Module;
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::{Device, Tensor, TensorData};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::data::TokenPool;
use crate::error::{Error, Result, invalid};
use crate::heads::{AutoDecoConfig, AutoDecoHeads, HostHeads};
use crate::loss::{LossConfig, SortedBatch, easy_token_keep, losses};
use crate::stats::{NUM_STATS, prob_stats};

/// Training options (names follow the reference's `trl_train.py` where it has one).
#[derive(Debug, Clone, PartialEq)]
pub struct TrainConfig {
    /// Optimizer steps.
    pub steps: usize,
    /// Positions per step.
    pub batch_size: usize,
    /// Adam learning rate.
    pub learning_rate: f64,
    /// Seed of head initialization, position sampling and easy-token masking.
    pub seed: u64,
    /// Probability of dropping an easy position (base argmax = label) from the temperature loss.
    pub easy_token_drop_prob: f64,
    /// Loss options.
    pub loss: LossConfig,
    /// Held-out evaluation period in steps (0: only at the end).
    pub eval_every: usize,
    /// Maximum held-out positions evaluated.
    pub max_heldout: usize,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            steps: 400,
            batch_size: 32,
            learning_rate: 1e-3,
            seed: 0,
            easy_token_drop_prob: 0.6,
            loss: LossConfig::default(),
            eval_every: 50,
            max_heldout: 256,
        }
    }
}

impl TrainConfig {
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
        if !(self.learning_rate.is_finite() && self.learning_rate > 0.0) {
            return Err(invalid("learning_rate", format!("must be a positive number, got {}", self.learning_rate)));
        }
        if !(0.0..=1.0).contains(&self.easy_token_drop_prob) {
            return Err(invalid("easy_token_drop_prob", format!("must be in [0, 1], got {}", self.easy_token_drop_prob)));
        }
        if !(self.loss.alpha.is_finite() && self.loss.alpha > 0.0) {
            return Err(invalid("alpha", format!("must be positive, got {}", self.loss.alpha)));
        }
        Ok(())
    }
}

/// One row of the loss curve.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct LogRow {
    /// Step (1-based; 0 = before training, held-out only).
    pub step: usize,
    /// Training temperature loss of this step's batch.
    pub train_temp: f64,
    /// Training top-p loss of this step's batch.
    pub train_top_p: f64,
    /// Held-out temperature loss (NaN when not evaluated at this step).
    pub heldout_temp: f64,
    /// Held-out top-p loss (NaN when not evaluated at this step).
    pub heldout_top_p: f64,
    /// Mean predicted temperature on the batch.
    pub mean_temperature: f64,
    /// Mean predicted top-p on the batch.
    pub mean_top_p: f64,
    /// Fraction of the batch kept by easy-token masking.
    pub kept_fraction: f64,
}

/// The frozen LM head on the host device, for logit recomputation.
pub struct FrozenHead {
    /// `[H, V]` weight on the base's device.
    pub weight: Tensor<2>,
    /// Device of `weight`.
    pub device: Device,
}

impl FrozenHead {
    /// Logits of `hidden` (`[n, H]`, row-major) as a host `[n, V]` buffer.
    ///
    /// # Errors
    /// [`Error::TensorRead`] on a device read failure; [`Error::Shape`] for a wrong length.
    pub fn logits(&self, hidden: &[f32], n: usize) -> Result<Vec<f32>> {
        let [h, _v] = self.weight.dims();
        if hidden.len() != n * h {
            return Err(Error::Shape(format!("{} hidden values for {n} rows of {h}", hidden.len())));
        }
        let x = Tensor::<2>::from_data(TensorData::new(hidden.to_vec(), [n, h]), &self.device);
        x.matmul(self.weight.clone()).try_into_vec_as::<f32>().map_err(|e| Error::TensorRead(format!("{e:?}")))
    }
}

/// A batch's host inputs: hidden rows, labels, argmax, sorted logits.
struct Prepared {
    hidden: Vec<f32>,
    argmax: Vec<u32>,
    labels: Vec<u32>,
    logits: Vec<f32>,
    sorted: SortedBatch,
}

fn prepare(pool: &TokenPool, rows: &[usize], head: &FrozenHead, vocab: usize) -> Result<Prepared> {
    let h = pool.hidden_size;
    let mut hidden = Vec::with_capacity(rows.len() * h);
    for &r in rows {
        hidden.extend_from_slice(&pool.hidden[r * h..(r + 1) * h]);
    }
    let labels: Vec<u32> = rows.iter().map(|&r| pool.labels[r]).collect();
    let argmax: Vec<u32> = rows.iter().map(|&r| pool.argmax[r]).collect();
    let logits = head.logits(&hidden, rows.len())?;
    let sorted = SortedBatch::new(&logits, vocab, &labels);
    Ok(Prepared { hidden, argmax, labels, logits, sorted })
}

/// Runs both heads and the losses on a prepared batch. Returns the losses and the head outputs.
fn step_losses(
    heads: &AutoDecoHeads,
    cfg: &AutoDecoConfig,
    b: &Prepared,
    keep: &[bool],
    loss_cfg: &LossConfig,
    device: &Device,
) -> Result<(crate::loss::Losses, Vec<f32>, Vec<f32>)> {
    let n = b.labels.len();
    let h = cfg.hidden_size;
    let x = Tensor::<2>::from_data(TensorData::new(b.hidden.clone(), [n, h]), device);
    let t = heads.temperature(x.clone());
    let t_host = t.clone().detach().try_into_vec_as::<f32>().map_err(|e| Error::TensorRead(format!("{e:?}")))?;
    let stats = if cfg.use_enhanced_features {
        let mut s = Vec::with_capacity(n * NUM_STATS);
        for (row, &t) in b.logits.chunks_exact(cfg.vocab_size).zip(&t_host) {
            s.extend_from_slice(&prob_stats(row, t));
        }
        Some(Tensor::<2>::from_data(TensorData::new(s, [n, NUM_STATS]), device))
    } else {
        None
    };
    let p = heads.top_p(x, t.clone(), stats);
    let p_host = p.clone().detach().try_into_vec_as::<f32>().map_err(|e| Error::TensorRead(format!("{e:?}")))?;
    Ok((losses(&b.sorted, t, p, keep, loss_cfg, device), t_host, p_host))
}

fn scalar(t: Tensor<1>) -> Result<f64> {
    let v = t.detach().try_into_vec_as::<f32>().map_err(|e| Error::TensorRead(format!("{e:?}")))?;
    Ok(f64::from(v.first().copied().unwrap_or(f32::NAN)))
}

/// Held-out losses `(temp, top_p)` of `heads` on the given positions (no masking, batches of 64).
///
/// # Errors
/// As [`train`].
pub fn evaluate(heads: &AutoDecoHeads, cfg: &AutoDecoConfig, pool: &TokenPool, rows: &[usize], head: &FrozenHead, loss_cfg: &LossConfig, device: &Device) -> Result<(f64, f64)> {
    let mut st = 0.0;
    let mut sp = 0.0;
    let mut n = 0usize;
    for chunk in rows.chunks(64) {
        let b = prepare(pool, chunk, head, cfg.vocab_size)?;
        let keep = vec![true; chunk.len()];
        let lc = LossConfig { mask_top_p: false, ..*loss_cfg };
        let (l, _, _) = step_losses(heads, cfg, &b, &keep, &lc, device)?;
        st += scalar(l.temp)? * chunk.len() as f64;
        sp += scalar(l.top_p)? * chunk.len() as f64;
        n += chunk.len();
    }
    Ok((st / n.max(1) as f64, sp / n.max(1) as f64))
}

/// Where a resumed run starts (`deco autodeco train --resume`).
#[derive(Debug, Clone)]
pub struct ResumeFrom {
    /// Optimizer steps already done.
    pub step: usize,
    /// The heads after `step` steps (a checkpoint).
    pub heads: HostHeads,
}

/// Trains fresh heads (`cfg`) on `train` positions, evaluating on `heldout` positions, and returns
/// the trained heads (host copy) and the loss curve. `progress` is called after every step.
///
/// `device` is the base's device (e.g. `Device::flex()`); training runs on its autodiff wrapper.
/// The base is untouched: only [`FrozenHead`] reads its LM head, without gradient.
///
/// # Errors
/// Invalid `tc` / `cfg`, an empty pool, a hidden-size mismatch, device read failures.
pub fn train(
    cfg: &AutoDecoConfig,
    tc: &TrainConfig,
    train: &TokenPool,
    heldout: &TokenPool,
    head: &FrozenHead,
    progress: &mut dyn FnMut(&LogRow),
) -> Result<(HostHeads, Vec<LogRow>)> {
    train_from(cfg, tc, train, heldout, head, None, 0, progress, &mut |_, _| Ok(()))
}

/// [`train`], optionally continued from a checkpoint (`resume`), handing the heads to `save`
/// every `checkpoint_every` steps and after the last one (`checkpoint_every` 0: never).
///
/// A resumed run draws the same batches and easy-token masks as the uninterrupted run would
/// (the random draws of the steps already done are replayed; they need only the pool's labels),
/// and its log starts at step `resume.step + 1` (no step-0 row). Its Adam moments restart from
/// zero, since a checkpoint holds the heads only (as `deco distill --resume`): a resumed run
/// is deterministic, but not bit-identical to an uninterrupted one. When `resume.step` equals
/// `tc.steps` nothing is trained and the checkpoint's heads are returned.
///
/// # Errors
/// As [`train`]; a `resume` beyond `tc.steps` or with another configuration than `cfg`; the
/// errors of `save`.
#[allow(clippy::too_many_arguments)]
pub fn train_from(
    cfg: &AutoDecoConfig,
    tc: &TrainConfig,
    train: &TokenPool,
    heldout: &TokenPool,
    head: &FrozenHead,
    resume: Option<ResumeFrom>,
    checkpoint_every: usize,
    progress: &mut dyn FnMut(&LogRow),
    save: &mut dyn FnMut(usize, &HostHeads) -> Result<()>,
) -> Result<(HostHeads, Vec<LogRow>)> {
    tc.validate()?;
    cfg.validate()?;
    if train.is_empty() {
        return Err(Error::Data("no training positions".into()));
    }
    if train.hidden_size != cfg.hidden_size {
        return Err(Error::Shape(format!("pool hidden size {} != heads hidden size {}", train.hidden_size, cfg.hidden_size)));
    }
    let start = resume.as_ref().map_or(0, |r| r.step);
    if let Some(r) = &resume {
        if r.step > tc.steps {
            return Err(invalid("resume", format!("the checkpoint is at step {}, beyond --steps {}", r.step, tc.steps)));
        }
        if r.heads.config().without_base_model() != cfg.without_base_model() {
            return Err(invalid("resume", format!("the checkpoint's heads ({:?}) do not match this run's ({cfg:?})", r.heads.config())));
        }
        if r.step == tc.steps {
            return Ok((r.heads.clone(), Vec::new()));
        }
    }
    let ad = head.device.clone().autodiff();
    ad.seed(tc.seed);
    let mut heads = match &resume {
        Some(r) => r.heads.to_module(&ad),
        None => AutoDecoHeads::init(cfg, &ad)?,
    };
    let mut optim = AdamConfig::new().init();
    let mut rng = ChaCha8Rng::seed_from_u64(tc.seed);
    // Replay the draws of the steps already done (the same calls as below, in the same order).
    for _ in 0..start {
        let rows: Vec<usize> = (0..tc.batch_size).map(|_| rng.random_range(0..train.len())).collect();
        let argmax: Vec<u32> = rows.iter().map(|&r| train.argmax[r]).collect();
        let labels: Vec<u32> = rows.iter().map(|&r| train.labels[r]).collect();
        let _ = easy_token_keep(&argmax, &labels, tc.easy_token_drop_prob, &mut rng);
    }
    let mut held_rows: Vec<usize> = (0..heldout.len()).collect();
    held_rows.shuffle(&mut ChaCha8Rng::seed_from_u64(tc.seed ^ 0x5eed));
    held_rows.truncate(tc.max_heldout);
    let mut log = Vec::new();
    let eval = |heads: &AutoDecoHeads| -> Result<(f64, f64)> {
        if held_rows.is_empty() {
            return Ok((f64::NAN, f64::NAN));
        }
        evaluate(heads, cfg, heldout, &held_rows, head, &tc.loss, &head.device)
    };
    if resume.is_none() {
        let (ht, hp) = eval(&heads.valid())?;
        let row0 = LogRow { step: 0, train_temp: f64::NAN, train_top_p: f64::NAN, heldout_temp: ht, heldout_top_p: hp, mean_temperature: f64::NAN, mean_top_p: f64::NAN, kept_fraction: f64::NAN };
        progress(&row0);
        log.push(row0);
    }
    for step in start + 1..=tc.steps {
        let rows: Vec<usize> = (0..tc.batch_size).map(|_| rng.random_range(0..train.len())).collect();
        let b = prepare(train, &rows, head, cfg.vocab_size)?;
        let keep = easy_token_keep(&b.argmax, &b.labels, tc.easy_token_drop_prob, &mut rng);
        let (l, t, p) = step_losses(&heads, cfg, &b, &keep, &tc.loss, &ad)?;
        let (lt, lp) = (scalar(l.temp.clone())?, scalar(l.top_p.clone())?);
        let grads = l.total().backward();
        let grads = GradientsParams::from_grads(grads, &heads);
        heads = optim.step(tc.learning_rate, heads, grads);
        let mut row = LogRow {
            step,
            train_temp: lt,
            train_top_p: lp,
            heldout_temp: f64::NAN,
            heldout_top_p: f64::NAN,
            mean_temperature: t.iter().map(|&x| f64::from(x)).sum::<f64>() / t.len() as f64,
            mean_top_p: p.iter().map(|&x| f64::from(x)).sum::<f64>() / p.len() as f64,
            kept_fraction: keep.iter().filter(|&&k| k).count() as f64 / keep.len() as f64,
        };
        if step == tc.steps || (tc.eval_every > 0 && step % tc.eval_every == 0) {
            let (ht, hp) = eval(&heads.valid())?;
            row.heldout_temp = ht;
            row.heldout_top_p = hp;
        }
        progress(&row);
        log.push(row);
        if checkpoint_every > 0 && (step % checkpoint_every == 0 || step == tc.steps) {
            save(step, &heads.valid().to_host(cfg)?)?;
        }
    }
    let host = heads.valid().to_host(cfg)?;
    Ok((host, log))
}

/// The CSV header of [`write_log_csv`].
pub const LOG_CSV_HEADER: &str = "step,train_temp,train_top_p,heldout_temp,heldout_top_p,mean_temperature,mean_top_p,kept_fraction";

/// Renders the loss curve as CSV text (see [`write_log_csv`]).
pub fn log_csv(log: &[LogRow]) -> String {
    let f = |x: f64| if x.is_nan() { String::new() } else { format!("{x:.6}") };
    let mut s = format!("{LOG_CSV_HEADER}\n");
    for r in log {
        s.push_str(&format!(
            "{},{},{},{},{},{},{},{}\n",
            r.step,
            f(r.train_temp),
            f(r.train_top_p),
            f(r.heldout_temp),
            f(r.heldout_top_p),
            f(r.mean_temperature),
            f(r.mean_top_p),
            f(r.kept_fraction)
        ));
    }
    s
}

/// Parses a loss curve written by [`write_log_csv`] (empty cells are NaN).
///
/// # Errors
/// [`Error::Data`] naming the line for another header, a wrong number of cells or a bad number.
pub fn parse_log_csv(text: &str) -> Result<Vec<LogRow>> {
    let mut lines = text.lines();
    if lines.next() != Some(LOG_CSV_HEADER) {
        return Err(Error::Data(format!("the loss log does not start with `{LOG_CSV_HEADER}`")));
    }
    let mut rows = Vec::new();
    for (i, l) in lines.enumerate() {
        let cells: Vec<&str> = l.split(',').collect();
        if cells.len() != 8 {
            return Err(Error::Data(format!("loss log line {}: {} cells instead of 8", i + 2, cells.len())));
        }
        let num = |c: &str| -> Result<f64> { if c.is_empty() { Ok(f64::NAN) } else { c.parse().map_err(|_| Error::Data(format!("loss log line {}: `{c}` is not a number", i + 2))) } };
        rows.push(LogRow {
            step: cells[0].parse().map_err(|_| Error::Data(format!("loss log line {}: bad step `{}`", i + 2, cells[0])))?,
            train_temp: num(cells[1])?,
            train_top_p: num(cells[2])?,
            heldout_temp: num(cells[3])?,
            heldout_top_p: num(cells[4])?,
            mean_temperature: num(cells[5])?,
            mean_top_p: num(cells[6])?,
            kept_fraction: num(cells[7])?,
        });
    }
    Ok(rows)
}

/// Writes the loss curve as CSV (`step,train_temp,train_top_p,heldout_temp,heldout_top_p,
/// mean_temperature,mean_top_p,kept_fraction`; empty cells for NaN), atomically.
///
/// # Errors
/// [`Error::Io`].
pub fn write_log_csv(path: &std::path::Path, log: &[LogRow]) -> Result<()> {
    crate::write_atomic(path, log_csv(log).as_bytes())
}
