//! Medusa decoding (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with
//! Multiple Decoding Heads").


/// Draft heads on the target's final hidden state (Medusa-1 heads: `deco_autodeco::medusa`).
///
/// At the position of token `x_t`, whose final hidden state is `h_t` (after the last RMSNorm),
/// the base LM head predicts `x_{t+1}` and head `k` (1-based, `k = 1..=num_heads`) predicts
/// `x_{t+1+k}`.
pub trait DraftHeads: Send + Sync + std::fmt::Debug {
    /// Number of heads `K`.
    fn num_heads(&self) -> usize;

    /// Raw logits of every head for one final hidden state `hidden` `[hidden_size]`:
    /// `num_heads × [vocab]`, head 1 first.
    ///
    /// # Errors
    /// A wrong `hidden` length; the LM head kernel's errors.
    fn head_logits(&self, hidden: &[f32]) -> Result<Vec<Vec<f32>>>;

    /// The logits of heads `1..=heads` only (`min(heads, num_heads) × [vocab]`): a candidate
    /// tree of depth `d` reads heads `1..=d`, and on a CPU each head's LM-head row costs time.
    /// The default computes every head and drops the rest; implementations skip them.
    ///
    /// # Errors
    /// As [`DraftHeads::head_logits`].
    fn first_head_logits(&self, hidden: &[f32], heads: usize) -> Result<Vec<Vec<f32>>> {
        let mut all = self.head_logits(hidden)?;
        all.truncate(heads);
        Ok(all)
    }
}

use std::sync::Arc;

use deco_decoding::{FinishReason, LogitsProcessorList, Sampler, SamplingParams, StoppingCriteria};

use crate::error::{GenerateError, Result, invalid};
use crate::speculative::Processing;
use crate::step::{Choice, Op, Role, SeqRows, Step, StepMachine};

/// The reference's `posterior_threshold` (ε of the typical acceptance, Cai et al. 2024 §2.3.1).
pub const DEFAULT_POSTERIOR_THRESHOLD: f32 = 0.09;
/// The reference's `posterior_alpha` (δ of the typical acceptance).
pub const DEFAULT_POSTERIOR_ALPHA: f32 = 0.3;

/// deco's default candidate tree (in the reference's `medusa_choices` notation, see
/// [`MedusaTree`]): head 1's top token after the root (a chain of depth 1), the fastest tree
/// measured on a 2-core CPU (`cargo xtask bench medusa`, docs/decoding.md): there each extra
/// node of the verification forward costs 0.12–0.2 of a decode token, while the reference's
/// GPU trees (`mc_sim_7b_63`: 63 nodes) are nearly free on a GPU. [`SMALL_TREE`] and wider
/// trees through `--medusa-choices`.
pub const DEFAULT_CHOICES: &[&[usize]] = &[&[0]];

/// A small tree of 8 candidates + the root (deco's default before the seventeenth session):
/// head 1's top three tokens, two children of the first and one of the second, and a chain to
/// depth 4.
pub const SMALL_TREE: &[&[usize]] = &[&[0], &[1], &[2], &[0, 0], &[0, 1], &[1, 0], &[0, 0, 0], &[0, 0, 0, 0]];

/// [`DEFAULT_CHOICES`] without the paths deeper than `num_heads`.
pub fn default_choices(num_heads: usize) -> Vec<Vec<usize>> {
    choices_up_to(DEFAULT_CHOICES, num_heads)
}

/// The paths of `tree` no deeper than `num_heads`.
pub fn choices_up_to(tree: &[&[usize]], num_heads: usize) -> Vec<Vec<usize>> {
    tree.iter().filter(|c| c.len() <= num_heads).map(|c| c.to_vec()).collect()
}

/// A Medusa candidate tree (the reference's `medusa_choices`, `medusa/model/medusa_choices.py`):
/// each node after the root is a path `[r_1, .., r_d]` meaning "the `r_1`-th most likely token
/// of head 1, then the `r_2`-th of head 2, ..": a node at depth `d` holds head `d`'s `r_d`-th
/// token and its parent is the node `[r_1, .., r_{d-1}]` (the root for `d = 1`). The root is the
/// newest token, sampled from the base model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MedusaTree {
    /// Paths in node order (every parent before its children).
    choices: Vec<Vec<usize>>,
    /// Parent node of each choice (0 = the root; choice `j` is node `j + 1`).
    parents: Vec<usize>,
    /// Most candidates read from each head (`1 + max rank` at that depth).
    top: Vec<usize>,
}

impl MedusaTree {
    /// A tree from the reference's `medusa_choices` (sorted here by depth then by path, as the
    /// reference's `generate_medusa_buffers` does), for heads `1..=num_heads`.
    ///
    /// # Errors
    /// [`GenerateError::InvalidInput`] for an empty path, a path deeper than `num_heads` (heads
    /// trained for fewer positions than the tree asks), a path whose parent path is missing, or
    /// a repeated path.
    pub fn new(choices: &[Vec<usize>], num_heads: usize) -> Result<Self> {
        let mut sorted: Vec<Vec<usize>> = choices.to_vec();
        sorted.sort_by(|a, b| a.len().cmp(&b.len()).then_with(|| a.cmp(b)));
        let mut parents = Vec::with_capacity(sorted.len());
        let mut top = Vec::new();
        for (j, c) in sorted.iter().enumerate() {
            if c.is_empty() {
                return Err(GenerateError::InvalidInput("medusa_choices: an empty path".into()));
            }
            if c.len() > num_heads {
                return Err(GenerateError::InvalidInput(format!(
                    "medusa_choices: path {c:?} needs {} heads, the Medusa heads have {num_heads}",
                    c.len()
                )));
            }
            if j > 0 && sorted[j - 1] == *c {
                return Err(GenerateError::InvalidInput(format!("medusa_choices: path {c:?} is repeated")));
            }
            let parent = if c.len() == 1 {
                0
            } else {
                let p = &c[..c.len() - 1];
                1 + sorted[..j].iter().position(|x| x.as_slice() == p).ok_or_else(|| {
                    GenerateError::InvalidInput(format!("medusa_choices: path {c:?} has no parent path {p:?}"))
                })?
            };
            parents.push(parent);
            let d = c.len() - 1;
            if top.len() <= d {
                top.resize(d + 1, 0);
            }
            top[d] = top[d].max(c[d] + 1);
        }
        Ok(Self { choices: sorted, parents, top })
    }

    /// A chain of `depth` nodes, each head's most likely token: `[[0], [0, 0], ..]`.
    ///
    /// # Errors
    /// As [`MedusaTree::new`].
    pub fn chain(depth: usize, num_heads: usize) -> Result<Self> {
        Self::new(&(1..=depth).map(|d| vec![0; d]).collect::<Vec<_>>(), num_heads)
    }

    /// Nodes, the root included.
    pub fn num_nodes(&self) -> usize {
        self.choices.len() + 1
    }

    /// Deepest path length.
    pub fn depth(&self) -> usize {
        self.choices.last().map_or(0, Vec::len)
    }

    /// The paths in node order.
    pub fn choices(&self) -> &[Vec<usize>] {
        &self.choices
    }
}

/// The acceptance rule of candidate tokens when sampling (Cai et al. 2024 §2.3.1, "typical
/// acceptance"; the reference's `evaluate_posterior`): a candidate `x` after a node whose
/// processed next-token distribution is `p` is accepted when
/// `p(x) > min(posterior_threshold, posterior_alpha · exp(-H(p)))`. The longest accepted path
/// wins, ties by the highest sum of `log p`. At temperature 0 `p` is one-hot and the rule is
/// exact match: the output equals greedy decoding token for token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TypicalAcceptance {
    /// ε, the hard threshold.
    pub posterior_threshold: f32,
    /// δ, the entropy-scaled threshold's factor.
    pub posterior_alpha: f32,
}

impl Default for TypicalAcceptance {
    fn default() -> Self {
        Self { posterior_threshold: DEFAULT_POSTERIOR_THRESHOLD, posterior_alpha: DEFAULT_POSTERIOR_ALPHA }
    }
}

impl TypicalAcceptance {
    /// The acceptance threshold of distribution `p`.
    pub fn threshold(&self, p: &[f32]) -> f32 {
        let entropy: f64 = p.iter().filter(|&&x| x > 0.0).map(|&x| -f64::from(x) * f64::from(x).ln()).sum();
        self.posterior_threshold.min((f64::from(self.posterior_alpha) * (-entropy).exp()) as f32)
    }
}

/// Counters of a Medusa run.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct MedusaStats {
    /// Tree forwards (after the prefill).
    pub rounds: usize,
    /// Candidate tokens accepted over all rounds.
    pub accepted: usize,
    /// Tree nodes fed over all rounds (root included).
    pub nodes: usize,
}

impl MedusaStats {
    /// Mean tokens produced per tree forward: accepted candidates plus the bonus token
    /// (the paper's "acceleration rate" / mean accepted length).
    pub fn mean_accepted_length(&self) -> f64 {
        if self.rounds == 0 { 0.0 } else { (self.accepted + self.rounds) as f64 / self.rounds as f64 }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Start,
    Verifying,
}

/// Medusa decoding of one sequence as a [`StepMachine`] (Cai et al. 2024, Medusa-1; the
/// reference's `MedusaModel.medusa_generate`).
///
/// The first token is drawn from the prompt's row (the base model's processed distribution,
/// greedy at temperature 0). Each round, with `t` the newest token (not yet computed): the
/// heads read the final hidden state of the position before `t` and propose their top tokens;
/// the candidate tree of [`MedusaTree`] rooted at `t` is computed in one forward with tree
/// attention ([`Op::FeedTree`]), every node's logits and hidden state returned. The longest
/// path of candidates that the base model accepts ([`TypicalAcceptance`]; exact match at
/// temperature 0) is kept with its keys and values ([`Op::KeepTreePath`]), the rest of the tree
/// dropped, and one more token (the bonus) is drawn from the base model's distribution after
/// that path; it is the next round's root, and the heads read the hidden state of the path's
/// last node. Each round thus releases between 1 and `depth + 1` tokens for one forward.
#[derive(Debug)]
pub struct Medusa {
    prompt: Vec<u32>,
    processing: Processing,
    stopping: StoppingCriteria,
    eos: Vec<u32>,
    rng: Sampler,
    heads: Arc<dyn DraftHeads>,
    tree: MedusaTree,
    acceptance: TypicalAcceptance,
    budget: usize,
    max_context: usize,
    /// Generated tokens; the last one (the root of the pending tree) is not yet computed.
    output: Vec<u32>,
    /// The pending tree: each node's token and parent (`None` for the root).
    nodes: Vec<(u32, Option<usize>)>,
    phase: Phase,
    stats: MedusaStats,
}

impl Medusa {
    /// Medusa decoding of `prompt` (prefilled as sequence 0 with its last hidden state) with
    /// `heads` over candidate tree `tree`, for a model of context `max_context`.
    ///
    /// # Errors
    /// Invalid `params`; an empty or too long prompt; a tree deeper than the heads.
    pub fn new(
        prompt: &[u32],
        params: &SamplingParams,
        heads: Arc<dyn DraftHeads>,
        tree: MedusaTree,
        acceptance: TypicalAcceptance,
        eos_token_ids: &[u32],
        max_context: usize,
    ) -> Result<Self> {
        if tree.depth() > heads.num_heads() {
            return Err(invalid("medusa_choices", "must not be deeper than the number of Medusa heads", tree.depth()));
        }
        if !(acceptance.posterior_threshold.is_finite() && acceptance.posterior_alpha.is_finite()) {
            return Err(invalid("posterior_threshold", "and posterior_alpha must be finite", acceptance.posterior_threshold));
        }
        Ok(Self {
            prompt: prompt.to_vec(),
            processing: Processing::new(params)?,
            stopping: StoppingCriteria::from_params(params, eos_token_ids)?,
            eos: eos_token_ids.to_vec(),
            rng: Sampler::from_processors(LogitsProcessorList::new(), false, params.seed, None)?,
            heads,
            tree,
            acceptance,
            budget: crate::sample::budget(max_context, prompt, params)?,
            max_context,
            output: Vec::new(),
            nodes: Vec::new(),
            phase: Phase::Start,
            stats: MedusaStats::default(),
        })
    }

    /// Counters so far.
    pub fn stats(&self) -> MedusaStats {
        self.stats
    }

    /// Appends a committed token; `Some(reason)` when it ends the sequence.
    fn commit(&mut self, token: u32) -> Option<FinishReason> {
        self.output.push(token);
        let n = self.output.len();
        self.stopping.check(token, n).or((n >= self.budget).then_some(FinishReason::Length))
    }

    fn finish(tokens: Vec<u32>, reason: FinishReason, mut step: Step) -> Step {
        step.ops.push(Op::Remove(0));
        step.output.push(Choice { index: 0, tokens, finish: Some(reason), cumulative_logprob: None });
        step
    }

    /// Draws the token after `output ++ path` from `logits` (greedy or the seeded sampler).
    fn draw(&mut self, path: &[u32], logits: Vec<f32>) -> Result<u32> {
        let ctx: Vec<u32> = self.output.iter().chain(path).copied().collect();
        let p = self.processing.probs(&self.prompt, &ctx, &self.eos, logits)?;
        if self.processing.is_greedy() {
            return Ok(p.iter().position(|&x| x == 1.0).unwrap_or(0) as u32);
        }
        Ok(self.rng.sample_weights(&p)?)
    }

    /// Builds the tree rooted at the newest token from the heads' logits at `hidden` and feeds it.
    fn round(&mut self, hidden: &[f32], mut step: Step) -> Result<Step> {
        let root = self.output[self.output.len() - 1];
        let ctx_len = self.prompt.len() + self.output.len();
        // Candidates that could still be released, and nodes that fit in the context (the
        // tree's keys occupy positions `ctx_len - 1 ..` until one path is kept).
        let depth_room = self.budget.saturating_sub(self.output.len());
        let node_room = self.max_context.saturating_sub(ctx_len - 1);
        self.nodes = vec![(root, None)];
        if depth_room > 0 && node_room > 1 {
            // Heads deeper than the tokens still allowed would only feed cut-off candidates.
            let logits = self.heads.first_head_logits(hidden, self.tree.top.len().min(depth_room))?;
            let top: Vec<Vec<u32>> = self.tree.top.iter().zip(&logits).map(|(&k, l)| top_k(l, k)).collect();
            for (c, &parent) in self.tree.choices.iter().zip(&self.tree.parents) {
                if self.nodes.len() >= node_room {
                    break;
                }
                // Choices are sorted by depth: the first too deep ends the tree.
                if c.len() > depth_room {
                    break;
                }
                let Some(&token) = top.get(c.len() - 1).and_then(|t| t.get(c[c.len() - 1])) else { continue };
                self.nodes.push((token, Some(parent)));
            }
        }
        step.ops.push(Op::FeedTree {
            seq: 0,
            tokens: self.nodes.iter().map(|n| n.0).collect(),
            parents: self.nodes.iter().map(|n| n.1).collect(),
        });
        self.phase = Phase::Verifying;
        Ok(step)
    }

    /// The kept path (node indices, root first) of a verified tree whose node `i` has
    /// `logits[i]`: the deepest accepted node, ties by likelihood.
    fn accepted_path(&self, logits: &[Vec<f32>]) -> Result<Vec<usize>> {
        let n = self.nodes.len();
        // Per node: accepted, depth, sum of log p of its path.
        let mut state: Vec<Option<(usize, f64)>> = vec![None; n];
        state[0] = Some((0, 0.0));
        let mut path_tokens: Vec<Vec<u32>> = vec![Vec::new(); n];
        let mut best = 0;
        for i in 0..n {
            let Some((depth, lp)) = state[i] else { continue };
            let children: Vec<usize> = (i + 1..n).filter(|&j| self.nodes[j].1 == Some(i)).collect();
            if children.is_empty() {
                continue;
            }
            let ctx: Vec<u32> = self.output.iter().chain(&path_tokens[i]).copied().collect();
            let p = self.processing.probs(&self.prompt, &ctx, &self.eos, logits[i].clone())?;
            let threshold = if self.processing.is_greedy() { 0.5 } else { self.acceptance.threshold(&p) };
            for j in children {
                let px = p.get(self.nodes[j].0 as usize).copied().unwrap_or(0.0);
                if px > threshold {
                    let s = (depth + 1, lp + f64::from(px).ln());
                    state[j] = Some(s);
                    let mut t = path_tokens[i].clone();
                    t.push(self.nodes[j].0);
                    path_tokens[j] = t;
                    let (bd, bl) = state[best].unwrap_or((0, 0.0));
                    if s.0 > bd || (s.0 == bd && s.1 > bl) {
                        best = j;
                    }
                }
            }
        }
        let mut path = vec![best];
        while let Some(p) = self.nodes[path[path.len() - 1]].1 {
            path.push(p);
        }
        path.reverse();
        Ok(path)
    }
}

/// Indices of the `k` largest values of `logits`, largest first (lowest id on ties).
fn top_k(logits: &[f32], k: usize) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    let k = k.min(idx.len());
    if k == 0 {
        return Vec::new();
    }
    let cmp = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
    idx.select_nth_unstable_by(k - 1, cmp);
    idx.truncate(k);
    idx.sort_by(cmp);
    idx
}

fn target_rows(rows: &[SeqRows]) -> Result<&SeqRows> {
    rows.iter().find(|r| r.seq == 0 && r.role == Role::Target).ok_or_else(|| GenerateError::InvalidInput("Medusa decoding: no target rows".into()))
}

impl StepMachine for Medusa {
    fn num_choices(&self) -> usize {
        1
    }

    fn prompt_rows(&self) -> (usize, bool) {
        (1, true)
    }

    fn advance(&mut self, rows: Vec<SeqRows>) -> Result<Step> {
        let step = Step::default();
        let r = target_rows(&rows)?;
        match self.phase {
            Phase::Start => {
                let (Some(logits), Some(hidden)) = (r.logits.last(), r.hidden.last()) else {
                    return Err(GenerateError::InvalidInput("Medusa decoding: the prompt row has no hidden state".into()));
                };
                let token = self.draw(&[], logits.clone())?;
                if let Some(reason) = self.commit(token) {
                    return Ok(Self::finish(vec![token], reason, step));
                }
                let mut step = step;
                step.output.push(Choice { index: 0, tokens: vec![token], finish: None, cumulative_logprob: None });
                self.round(&hidden.clone(), step)
            }
            Phase::Verifying => {
                let n = self.nodes.len();
                if r.logits.len() != n || r.hidden.len() != n {
                    return Err(GenerateError::InvalidInput(format!(
                        "Medusa decoding: {} rows and {} hidden states for a tree of {n} nodes",
                        r.logits.len(),
                        r.hidden.len()
                    )));
                }
                let path = self.accepted_path(&r.logits)?;
                let last = path[path.len() - 1];
                let accepted: Vec<u32> = path[1..].iter().map(|&i| self.nodes[i].0).collect();
                self.stats.rounds += 1;
                self.stats.nodes += n;
                self.stats.accepted += accepted.len();
                let mut step = step;
                step.drafted = self.tree.depth().min(n - 1);
                step.accepted = accepted.len();
                let mut released = Vec::with_capacity(accepted.len() + 1);
                for &t in &accepted {
                    released.push(t);
                    if let Some(reason) = self.commit(t) {
                        return Ok(Self::finish(released, reason, step));
                    }
                }
                let bonus = self.draw(&[], r.logits[last].clone())?;
                released.push(bonus);
                if let Some(reason) = self.commit(bonus) {
                    return Ok(Self::finish(released, reason, step));
                }
                step.ops.push(Op::KeepTreePath { seq: 0, path });
                step.output.push(Choice { index: 0, tokens: released, finish: None, cumulative_logprob: None });
                let hidden = r.hidden[last].clone();
                self.round(&hidden, step)
            }
        }
    }
}
