//! Continuous-batching scheduler (Yu et al. 2022, "Orca: A Distributed Serving System for
//! Transformer-Based Generative Models", OSDI: iteration-level scheduling) with vLLM's policies
//! (Kwon et al. 2023; vLLM v1 `Scheduler`): chunked prefill under a token budget, FCFS
//! admission, preemption by recompute when blocks run out.
//!
//! The scheduler knows sequences only as token lists with a count of tokens already in the KV
//! cache (`num_computed`). Each [`Scheduler::schedule`] call builds one step:
//! 1. **Running** sequences, oldest first, each get the tokens they still need (1 for a decode,
//!    the rest of the prompt for a prefill), capped by the remaining
//!    `max_num_batched_tokens` budget (chunked prefill). If the cache cannot supply their blocks,
//!    the *newest* running sequence is preempted (its blocks freed, its computed count reset to 0,
//!    moved to the front of the waiting queue) until it can; a sequence that must preempt
//!    itself waits for the next step.
//! 2. **Waiting** sequences are admitted in arrival order (FCFS; the head blocks the queue)
//!    while budget, `max_num_seqs` and blocks allow, reusing cached prefix blocks first. No
//!    admission happens in a step that preempted.
//!
//! Cost per step: O(running + admitted) plus the cache's block operations.

use std::collections::VecDeque;

use deco_model::SeqId;

use crate::paged_cache::PagedKvCache;

/// Scheduler limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Most sequences in one step (vLLM `max_num_seqs`).
    pub max_num_seqs: usize,
    /// Most tokens (prefill chunks plus decodes) in one step (vLLM `max_num_batched_tokens`).
    pub max_num_batched_tokens: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self { max_num_seqs: 64, max_num_batched_tokens: 512 }
    }
}

/// A sequence as the scheduler sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedSeq {
    /// Its id (also its id in the KV cache).
    pub id: SeqId,
    /// Prompt followed by the generated tokens.
    pub tokens: Vec<u32>,
    /// Tokens whose keys and values are in the cache.
    pub num_computed: usize,
    /// A token tree at the end of `tokens` (Medusa's candidates, [`Scheduler::set_tree`]):
    /// scheduled as one chunk of its own with tree attention, never split.
    pub tree: Option<TreeTail>,
}

/// The last tokens of a sequence that form a token tree rather than a continuation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TreeTail {
    /// Index of the tree's first node in the sequence's tokens.
    pub start: usize,
    /// Parent of each node among the tree's nodes (`deco_model::SeqInput::tree`).
    pub parents: Vec<Option<usize>>,
}

/// One sequence's share of a step: compute `tokens[start..start + len]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    /// The sequence.
    pub seq: SeqId,
    /// First position computed (equals the cached length before the step).
    pub start: usize,
    /// The token ids to compute.
    pub tokens: Vec<u32>,
    /// True when the chunk reaches the end of the sequence's tokens: its last logits row samples
    /// the next token. False for a non-final prefill chunk.
    pub samples: bool,
    /// The parents of the chunk's tokens when the chunk is a whole token tree.
    pub tree: Option<Vec<Option<usize>>>,
}

/// What one step does.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepPlan {
    /// Chunks in batch order (running sequences first, then newly admitted ones).
    pub chunks: Vec<Chunk>,
    /// Sequences preempted in this step (their blocks were freed; they will recompute).
    pub preempted: Vec<SeqId>,
}

/// Waiting and running queues with the step policy of the [module docs](self).
#[derive(Debug, Default)]
pub struct Scheduler {
    config: SchedulerConfig,
    waiting: VecDeque<SchedSeq>,
    running: Vec<SchedSeq>,
    preemptions: u64,
    prefix_cache_queries: u64,
    prefix_cache_hits: u64,
    /// Sequences admitted without the prefix cache ([`Scheduler::add_uncached`]).
    uncached: std::collections::HashSet<SeqId>,
}

impl Scheduler {
    /// An empty scheduler.
    pub fn new(config: SchedulerConfig) -> Self {
        Self { config, ..Self::default() }
    }

    /// The limits.
    pub fn config(&self) -> SchedulerConfig {
        self.config
    }

    /// Queues a new sequence (FCFS: behind every waiting one).
    pub fn add(&mut self, id: SeqId, tokens: Vec<u32>) {
        self.waiting.push_back(SchedSeq { id, tokens, num_computed: 0, tree: None });
    }

    /// Queues a new sequence whose every prompt position must be computed (its strategy reads
    /// rows of the whole prompt): the prefix cache is not used for it.
    pub fn add_uncached(&mut self, id: SeqId, tokens: Vec<u32>) {
        self.uncached.insert(id);
        self.add(id, tokens);
    }

    /// Adds a sequence that is already cached up to `num_computed` (a fork) to the running set.
    pub fn add_running(&mut self, seq: SchedSeq) {
        self.running.push(seq);
    }

    /// Sequences waiting for admission.
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Sequences admitted (holding cache blocks).
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Preemptions so far.
    pub fn preemptions(&self) -> u64 {
        self.preemptions
    }

    /// Tokens of the sequences admitted so far (a re-admission after preemption counts again):
    /// what was looked up in the prefix cache.
    pub fn prefix_cache_queries(&self) -> u64 {
        self.prefix_cache_queries
    }

    /// Tokens of those admissions found in the prefix cache (<= [`Self::prefix_cache_queries`]).
    pub fn prefix_cache_hits(&self) -> u64 {
        self.prefix_cache_hits
    }

    /// True when nothing waits or runs.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// The sequence `id`, waiting or running.
    pub fn get(&self, id: SeqId) -> Option<&SchedSeq> {
        self.running.iter().chain(self.waiting.iter()).find(|s| s.id == id)
    }

    fn get_mut(&mut self, id: SeqId) -> Option<&mut SchedSeq> {
        self.running.iter_mut().chain(self.waiting.iter_mut()).find(|s| s.id == id)
    }

    /// Records that a step computed `n` more tokens of `id`.
    pub fn computed(&mut self, id: SeqId, n: usize) {
        if let Some(s) = self.get_mut(id) {
            s.num_computed += n;
        }
    }

    /// Appends a generated token to `id`.
    pub fn push_token(&mut self, id: SeqId, token: u32) {
        if let Some(s) = self.get_mut(id) {
            s.tokens.push(token);
        }
    }

    /// Keeps the first `len` tokens of `id` (a strategy's rejected speculative tokens are
    /// dropped); computed tokens beyond `len` stop counting. The caller truncates the cache.
    pub fn truncate(&mut self, id: SeqId, len: usize) {
        if let Some(s) = self.get_mut(id) {
            s.tokens.truncate(len);
            s.num_computed = s.num_computed.min(len);
        }
    }

    /// Appends a token tree to `id`, whose tokens must all be computed: `tokens` with the parents
    /// of each node among them ([`TreeTail`]). Returns false (nothing changed) for an unknown
    /// sequence, one with uncomputed tokens or a tree already pending.
    pub fn set_tree(&mut self, id: SeqId, tokens: &[u32], parents: Vec<Option<usize>>) -> bool {
        let Some(s) = self.get_mut(id) else { return false };
        if s.tree.is_some() || s.num_computed != s.tokens.len() || parents.len() != tokens.len() {
            return false;
        }
        s.tree = Some(TreeTail { start: s.tokens.len(), parents });
        s.tokens.extend_from_slice(tokens);
        true
    }

    /// Replaces the computed tree of `id` by the nodes `path` of it (root-to-node order): its
    /// tokens follow the tree's start and count as computed (the caller moves their keys and
    /// values, `deco_model::KvCache::keep_rows`). Returns the tree's start and the kept tokens;
    /// `None` (nothing changed) without a computed tree or for nodes out of range.
    pub fn keep_tree_path(&mut self, id: SeqId, path: &[usize]) -> Option<(usize, Vec<u32>)> {
        let s = self.get_mut(id)?;
        let tree = s.tree.as_ref()?;
        let start = tree.start;
        if s.num_computed != s.tokens.len() || path.iter().any(|&n| n >= tree.parents.len()) {
            return None;
        }
        let kept: Vec<u32> = path.iter().map(|&n| s.tokens[start + n]).collect();
        s.tokens.truncate(start);
        s.tokens.extend_from_slice(&kept);
        s.num_computed = s.tokens.len();
        s.tree = None;
        Some((start, kept))
    }

    /// Removes `id` (finished or aborted) from either queue and frees its blocks.
    pub fn remove(&mut self, id: SeqId, cache: &mut PagedKvCache) {
        self.uncached.remove(&id);
        self.running.retain(|s| s.id != id);
        self.waiting.retain(|s| s.id != id);
        let _ = cache.free_seq(id);
    }

    fn preempt(&mut self, mut seq: SchedSeq, cache: &mut PagedKvCache, plan: &mut StepPlan) {
        let _ = cache.free_seq(seq.id);
        seq.num_computed = 0;
        plan.preempted.push(seq.id);
        self.preemptions += 1;
        self.waiting.push_front(seq);
    }

    /// Plans one step; reserves the cache blocks of every scheduled chunk. See the
    /// [module docs](self).
    pub fn schedule(&mut self, cache: &mut PagedKvCache) -> StepPlan {
        let mut plan = StepPlan::default();
        let mut budget = self.config.max_num_batched_tokens;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let (id, done, total, tree_start) = {
                let s = &self.running[i];
                (s.id, s.num_computed, s.tokens.len(), s.tree.as_ref().map(|t| t.start))
            };
            // A pending tree is one chunk of its own: the tokens before it first, then the whole
            // tree when the budget takes it.
            let (end, is_tree) = match tree_start {
                Some(t) if done < t => (t, false),
                Some(_) => (total, true),
                None => (total, false),
            };
            let n = if is_tree && total - done > budget { 0 } else { (end - done).min(budget) };
            if n == 0 {
                i += 1;
                continue;
            }
            let mut self_preempted = false;
            while cache.reserve(id, done + n).is_err() {
                // Preempt the newest running sequence (possibly this one).
                let Some(victim) = self.running.pop() else { break };
                let is_self = victim.id == id;
                self.preempt(victim, cache, &mut plan);
                if is_self {
                    self_preempted = true;
                    break;
                }
            }
            if self_preempted {
                break;
            }
            let s = &self.running[i];
            let tree = if is_tree { s.tree.as_ref().map(|t| t.parents.clone()) } else { None };
            plan.chunks.push(Chunk { seq: id, start: done, tokens: s.tokens[done..done + n].to_vec(), samples: done + n == total, tree });
            budget -= n;
            i += 1;
        }
        if !plan.preempted.is_empty() {
            return plan;
        }
        while budget > 0 && self.running.len() < self.config.max_num_seqs {
            let Some(front) = self.waiting.front() else { break };
            let id = front.id;
            let tokens = front.tokens.clone();
            // A sequence preempted with a pending tree recomputes the tokens before it first.
            let end = front.tree.as_ref().map_or(tokens.len(), |t| t.start);
            let cached = if self.uncached.contains(&id) { 0 } else { cache.attach_prefix(id, &tokens[..end]).unwrap_or(0) };
            let n = (end - cached).min(budget);
            if cache.reserve(id, cached + n).is_err() {
                let _ = cache.free_seq(id);
                break;
            }
            let Some(mut seq) = self.waiting.pop_front() else { break };
            seq.num_computed = cached;
            self.prefix_cache_queries += tokens.len() as u64;
            self.prefix_cache_hits += cached as u64;
            plan.chunks.push(Chunk { seq: id, start: cached, tokens: tokens[cached..cached + n].to_vec(), samples: cached + n == tokens.len(), tree: None });
            budget -= n;
            self.running.push(seq);
        }
        plan
    }
}
