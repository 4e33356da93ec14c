//! `cargo xtask bench autodeco --qwen-problems N`: AutoDeco on Qwen2.5-Coder-0.5B-Instruct, a
//! model that solves a real fraction of the GSM-Symbolic problems.
//!
//! - heads trained on gsm_train (cached);
//! - a tuning grid of static (T, top_p) on GSM8K train problems (**disjoint** from the scored
//!   GSM-Symbolic ones and from the heads' training problems), whose best point is the "best
//!   static" row;
//! - greedy, default sampling, best static and AutoDeco on the first N problems, pass@k with 95%
//!   bootstrap intervals over problems and paired bootstrap intervals of the differences;
//! - the meta-instruction ranking stage (`deco autodeco meta-train`), measured before and after,
//!   teacher-forced and during generation;
//! - the heads' cost at batch 1 and 16.
//!
//! Writes the block between `<!-- bench autodeco qwen begin/end -->` of docs/autodeco.md and
//! `docs/autodeco/qwen-*.svg`.

use std::fs;
use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::autodeco::{Options, Runner, date, grid_table, s, write_block};
use crate::{fetch, util};

/// Bootstrap resamples.
const BOOT: usize = 4000;

/// First gsm_train problem of the tuning split.
const TUNE_OFFSET: usize = 200;

/// Held-out phrasings used for the generation-time check (the first of each list of
/// `deco_autodeco::meta`; kept in sync by hand, the bench passes them as text).
const LOW_HELDOUT: &str = "Please reduce the randomness of your output.";
const HIGH_HELDOUT: &str = "Please ensure your answer is diverse and creative.";

/// Unbiased pass@k (Chen et al. 2021): `1 − C(n − c, k) / C(n, k)`.
pub fn pass_at_k(n: usize, c: usize, k: usize) -> f64 {
    if k > n {
        return f64::NAN;
    }
    if n - c < k {
        return 1.0;
    }
    let mut prod = 1.0;
    for i in (n - c + 1)..=n {
        prod *= 1.0 - k as f64 / i as f64;
    }
    1.0 - prod
}

/// Correct samples per problem from an outputs file of `deco autodeco eval`
/// (`problem` is absolute; `offset` is the first problem).
fn correct_counts(path: &Path, offset: usize, problems: usize, n: usize) -> Result<Vec<usize>> {
    let text = fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut c = vec![0usize; problems];
    let mut seen = vec![0usize; problems];
    for l in text.lines().filter(|l| !l.trim().is_empty()) {
        let v: Value = serde_json::from_str(l).with_context(|| format!("{}: bad line", path.display()))?;
        let p = v["problem"].as_u64().context("no problem index")? as usize;
        let i = p.checked_sub(offset).filter(|&i| i < problems).with_context(|| format!("{}: problem {p} outside {offset}..{}", path.display(), offset + problems))?;
        seen[i] += 1;
        c[i] += usize::from(v["correct"].as_bool().unwrap_or(false));
    }
    if seen.iter().any(|&k| k != n) {
        bail!("{}: expected {n} samples for each of {problems} problems", path.display());
    }
    Ok(c)
}

/// SplitMix64: the bootstrap's index stream (seeded, reproducible).
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Mean of `x` and its 95% percentile bootstrap interval over the entries (problems).
pub fn bootstrap_ci(x: &[f64], seed: u64) -> (f64, f64, f64) {
    let n = x.len();
    let mean = x.iter().sum::<f64>() / n as f64;
    let mut rng = SplitMix(seed);
    let mut means: Vec<f64> = (0..BOOT).map(|_| (0..n).map(|_| x[rng.below(n)]).sum::<f64>() / n as f64).collect();
    means.sort_by(f64::total_cmp);
    (mean, means[(BOOT as f64 * 0.025) as usize], means[(BOOT as f64 * 0.975) as usize - 1])
}

struct Config {
    name: String,
    what: String,
    n: usize,
    counts: Vec<usize>,
    summary: Value,
}

impl Config {
    fn per_problem(&self, k: usize) -> Vec<f64> {
        self.counts.iter().map(|&c| pass_at_k(self.n, c, k)).collect()
    }
}

fn pct(x: f64) -> String {
    format!("{:.1}%", 100.0 * x)
}

fn ci_cell(x: &[f64], seed: u64) -> String {
    let (m, lo, hi) = bootstrap_ci(x, seed);
    format!("{} [{}, {}]", pct(m), pct(lo), pct(hi))
}

/// One Qwen model of the bench and what is run on it.
pub struct QwenRun {
    /// Short name of the heads' directories (`qwen05b`, `qwen15b`).
    pub key: &'static str,
    /// Prefix of the result labels and plot names (`qwen`, `qwen15b`).
    pub label: &'static str,
    /// Display name.
    pub name: &'static str,
    /// GGUF file under `<cache>/models`.
    pub file: &'static str,
    /// What `xtask fetch` calls it.
    pub what: fetch::What,
    /// Parameters of the base (millions), for the heads' share.
    pub base_params_m: f64,
    /// Scored problems, samples per problem.
    pub problems: usize,
    pub n: usize,
    /// Head training examples and steps.
    pub train_examples: usize,
    pub steps: usize,
    /// Also the tuning grid (best static row) and the meta-instruction stage.
    pub full: bool,
    /// Docs marker name (`<!-- bench autodeco {marker} begin -->`).
    pub marker: &'static str,
}

impl QwenRun {
    /// Qwen2.5-Coder-0.5B-Instruct with the options of `o`.
    pub fn small(o: &Options) -> Self {
        Self {
            key: "qwen05b",
            label: "qwen",
            name: "Qwen2.5-Coder-0.5B-Instruct",
            file: "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            what: fetch::What::Qwen05b,
            base_params_m: 494.0,
            problems: o.qwen_problems,
            n: o.qwen_n,
            train_examples: o.qwen_train_examples,
            steps: o.qwen_steps,
            full: true,
            marker: "qwen",
        }
    }

    /// Qwen2.5-Coder-1.5B-Instruct with the options of `o`.
    pub fn large(o: &Options) -> Self {
        Self {
            key: "qwen15b",
            label: "qwen15b",
            name: "Qwen2.5-Coder-1.5B-Instruct",
            file: "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            what: fetch::What::Qwen15b,
            base_params_m: 1544.0,
            problems: o.qwen15b_problems,
            n: o.qwen15b_n,
            train_examples: o.qwen15b_train_examples,
            steps: o.qwen15b_steps,
            full: false,
            marker: "qwen15b",
        }
    }
}

pub fn run(o: &Options, bin: &Path, m: &QwenRun) -> Result<()> {
    fetch::fetch(&fetch::Options { cache: o.cache.clone(), no_mirror: o.no_mirror, what: vec![m.what, fetch::What::Data] })?;
    let q = o.cache.join("models").join(m.file);
    let train_data = o.cache.join("data/gsm_train.jsonl");
    let eval_data = o.cache.join("data/gsm_eval.jsonl");
    let root = o.cache.join("autodeco");
    let results = root.join("results");
    fs::create_dir_all(&results)?;
    let t_start = std::time::Instant::now();

    // 1. Heads (stage one), cached by their arguments.
    let qheads = root.join(format!("{}-gsm", m.key));
    let qstamp = root.join(format!("{}-gsm.args.json", m.key));
    let train_log_path = root.join(format!("{}-gsm.train.log", m.key));
    let qargs: Vec<String> = vec![
        s("--steps"), s(m.steps), s("--max-examples"), s(m.train_examples), s("--heldout-examples"), s(8), s("--eval-every"), s(25), s("--seed"), s(0),
    ];
    let fresh = fs::read_to_string(&qstamp).ok().and_then(|t| serde_json::from_str::<Value>(&t).ok()) == Some(json!(qargs));
    if !(fresh && qheads.join("autodeco_heads.safetensors").is_file()) {
        let mut cmd = Command::new(bin);
        cmd.args(["autodeco", "train", "--model"]).arg(&q).arg("--data").arg(&train_data).arg("--out").arg(&qheads).args(&qargs);
        eprintln!("bench autodeco: {}", util::show(&cmd));
        let out = cmd.stderr(std::process::Stdio::piped()).output()?;
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        if !out.status.success() {
            bail!("deco autodeco train (qwen) failed: {}\n{err}", out.status);
        }
        fs::write(&train_log_path, &err)?;
        fs::write(&qstamp, serde_json::to_string(&qargs)?)?;
    }
    let train_log = fs::read_to_string(&train_log_path).unwrap_or_default();
    let line_with = |k: &str| train_log.lines().rev().find(|l| l.contains(k)).map(|l| l.trim().to_string()).unwrap_or_default();
    let train_line = line_with("heldout_loss_after");
    let hidden_line = line_with("training positions");
    let field = |k: &str| -> Option<f64> { train_line.split_whitespace().find_map(|w| w.strip_prefix(&format!("{k}=")).and_then(|v| v.parse().ok())) };

    let r = Runner { bin: bin.to_path_buf(), results: results.clone(), data: eval_data };
    // The tuning split: GSM8K train problems from TUNE_OFFSET on (past the heads' 96 and the
    // meta stage's 128). GSM-Symbolic eval problems come 10 per template, and the 32 right
    // after the scored ones were 3 templates this model never solves, which made every grid
    // point 0%; GSM8K train is varied.
    let tune = Runner { bin: bin.to_path_buf(), results: results.clone(), data: train_data.clone() };
    let p = m.problems;
    let n = m.n;
    let key = m.label;
    let common = |n: usize, limit: usize, offset: usize| -> Vec<String> {
        vec![s("-n"), s(n), s("--limit"), s(limit), s("--offset"), s(offset), s("--max-new-tokens"), s(o.qwen_max_new_tokens), s("--batch"), s(o.batch)]
    };
    let mut configs: Vec<Config> = Vec::new();
    let mut run_cfg = |label: &str, name: String, what: String, n: usize, args: Vec<String>| -> Result<()> {
        let summary = r.eval(label, &q, &args)?;
        let counts = correct_counts(&results.join(format!("{label}.outputs.jsonl")), 0, p, n)?;
        configs.push(Config { name, what, n, counts, summary });
        Ok(())
    };

    // 2. Greedy.
    let mut a = common(1, p, 0);
    a.extend([s("--temperature"), s(0)]);
    run_cfg(&format!("{key}-greedy"), "greedy".into(), format!("{p} problems, n = 1"), 1, a)?;

    // 3. Tuning grid on GSM train problems (disjoint from the scored ones), n = 1.
    let mut grid: Vec<(f32, f32, f64, f64)> = Vec::new();
    for &t in if m.full { &o.qwen_grid_temperatures[..] } else { &[] } {
        for &tp in &o.qwen_grid_top_ps {
            let mut a = common(1, o.qwen_grid_problems, TUNE_OFFSET);
            a.extend([s("--temperature"), s(t), s("--top-p"), s(tp), s("--seed"), s(777)]);
            let v = tune.eval(&format!("{key}-tune-t{t}-p{tp}"), &q, &a)?;
            grid.push((t, tp, v["pass"]["pass@1"].as_f64().unwrap_or(f64::NAN), v["wall_s"].as_f64().unwrap_or(0.0)));
        }
    }
    let best = grid.iter().copied().fold(None::<(f32, f32, f64, f64)>, |b, g| if b.is_none_or(|b| g.2 > b.2) { Some(g) } else { b });

    // 4. Sampled configurations on the scored problems.
    let mut a = common(n, p, 0);
    a.extend([s("--temperature"), s(1), s("--top-p"), s(1)]);
    run_cfg(&format!("{key}-default"), "default sampling (T = 1, top_p = 1)".into(), format!("{p} problems, n = {n}"), n, a)?;
    if let Some((bt, bp, _, _)) = best {
        let mut a = common(n, p, 0);
        a.extend([s("--temperature"), s(bt), s("--top-p"), s(bp)]);
        run_cfg(&format!("{key}-static"), format!("best static (T = {bt}, top_p = {bp}; tuned on GSM train)"), format!("{p} problems, n = {n}"), n, a)?;
    }
    let mut a = common(n, p, 0);
    a.extend([s("--temperature"), s(1), s("--top-p"), s(1), s("--heads")]);
    a.push(qheads.display().to_string());
    run_cfg(&format!("{key}-autodeco"), "AutoDeco (user T = 1, top_p = 1)".into(), format!("{p} problems, n = {n}"), n, a)?;

    // 5. Head cost at batch 16 and 1.
    let mut lat = Vec::new();
    for (batch, limit) in if m.full { vec![(16usize, 32usize), (1, 4)] } else { vec![(16, 16), (1, 2)] } {
        let mut a = vec![s("-n"), s(1), s("--limit"), s(limit), s("--max-new-tokens"), s(64), s("--batch"), s(batch), s("--heads")];
        a.push(qheads.display().to_string());
        lat.push((batch, limit, r.eval(&format!("{key}-latency-b{batch}"), &q, &a)?));
    }
    let docs = util::workspace_root().join("docs");
    fs::create_dir_all(docs.join("autodeco"))?;
    let passk_svg = format!("{key}-passk.svg");
    plot_passk_ci(&docs.join("autodeco").join(&passk_svg), &configs, n, m.name)?;
    if !m.full {
        let c = Common { configs: &configs, lat: &lat, hidden_line: &hidden_line, train_line: &train_line, params: field("params"), bytes: field("bytes"), elapsed: t_start.elapsed().as_secs_f64(), grid_wall: 0.0 };
        let md = render_short(o, m, &c, &passk_svg);
        write_block(&docs.join("autodeco.md"), &format!("<!-- bench autodeco {} begin -->", m.marker), &format!("<!-- bench autodeco {} end -->", m.marker), &md)?;
        println!("{md}");
        return Ok(());
    }
    let (bt, bp, _, _) = best.context("empty tuning grid")?;

    // 6. Meta-instruction stage.
    let meta_dir = root.join(format!("{}-gsm-meta", m.key));
    let meta_stamp = root.join(format!("{}-gsm-meta.args.json", m.key));
    // The top-p heads are saturated at P = 1 (see "Training" in docs/autodeco.md), so the
    // ranking leaves them out (`--margin-p 0`): no LM-head logits per step.
    let meta_args: Vec<String> = vec![
        s("--steps"), s(o.meta_steps), s("--learning-rate"), s("2e-3"), s("--anchor-weight"), s(30), s("--margin-t"), s(0.25), s("--margin-p"), s(0),
        s("--max-examples"), s(96), s("--heldout-examples"), s(32), s("--max-positions"), s(32), s("--seed"), s(0),
    ];
    let meta_key = json!({"args": meta_args, "heads_args": qargs});
    let fresh = fs::read_to_string(&meta_stamp).ok().and_then(|t| serde_json::from_str::<Value>(&t).ok()) == Some(meta_key.clone());
    if !(fresh && meta_dir.join("meta_report.json").is_file()) {
        let mut cmd = Command::new(bin);
        cmd.args(["autodeco", "meta-train", "--model"]).arg(&q).arg("--heads").arg(&qheads).arg("--data").arg(&train_data).arg("--out").arg(&meta_dir).args(&meta_args);
        cmd.arg("--pool-cache").arg(root.join(format!("{}-meta-pool.bin", m.key)));
        eprintln!("bench autodeco: {}", util::show(&cmd));
        let st = cmd.status()?;
        if !st.success() {
            bail!("deco autodeco meta-train failed: {st}");
        }
        fs::write(&meta_stamp, serde_json::to_string(&meta_key)?)?;
    }
    let meta: Value = serde_json::from_str(&fs::read_to_string(meta_dir.join("meta_report.json"))?)?;
    // During generation: mean T / P over 64 generated tokens of 16 problems, held-out phrasings.
    let mut gen_rows = Vec::new();
    for (stage, dir) in [("stage one", &qheads), ("after the ranking stage", &meta_dir)] {
        for (name, ins) in [("none", None), ("low", Some(LOW_HELDOUT)), ("high", Some(HIGH_HELDOUT))] {
            let mut a = vec![s("-n"), s(1), s("--limit"), s(16), s("--max-new-tokens"), s(64), s("--batch"), s(16), s("--heads")];
            a.push(dir.display().to_string());
            if let Some(i) = ins {
                a.extend([s("--instruction"), s(i)]);
            }
            let tag = if stage == "stage one" { "s1" } else { "meta" };
            let v = r.eval(&format!("{key}-gen-{tag}-{name}"), &q, &a)?;
            gen_rows.push((stage, name, ins, v));
        }
    }

    // Render.
    let svg = meta_dir.join("meta_trace.svg");
    if svg.is_file() {
        fs::copy(&svg, docs.join(format!("autodeco/{key}-meta-trace.svg")))?;
    }
    let grid_wall = grid.iter().map(|g| g.3).sum::<f64>();
    let c = Common { configs: &configs, lat: &lat, hidden_line: &hidden_line, train_line: &train_line, params: field("params"), bytes: field("bytes"), elapsed: t_start.elapsed().as_secs_f64(), grid_wall };
    let md = render(o, m, &c, &grid, (bt, bp), &meta, &gen_rows);
    write_block(&docs.join("autodeco.md"), &format!("<!-- bench autodeco {} begin -->", m.marker), &format!("<!-- bench autodeco {} end -->", m.marker), &md)?;
    println!("{md}");
    Ok(())
}

fn ks_of(n: usize) -> Vec<usize> {
    let mut ks = vec![1usize];
    while ks.last().copied().unwrap_or(1) * 2 <= n {
        ks.push(ks.last().copied().unwrap_or(1) * 2);
    }
    ks
}

/// What both the full and the short section show: header, pass@k table with intervals, paired
/// differences, head cost and memory.
struct Common<'a> {
    configs: &'a [Config],
    lat: &'a [(usize, usize, Value)],
    hidden_line: &'a str,
    train_line: &'a str,
    params: Option<f64>,
    bytes: Option<f64>,
    elapsed: f64,
    grid_wall: f64,
}

fn render_common(o: &Options, m: &QwenRun, c: &Common<'_>) -> String {
    let n = m.n;
    let ks = ks_of(n);
    let total_wall: f64 = c.configs.iter().map(|c| c.summary["wall_s"].as_f64().unwrap_or(0.0)).sum::<f64>() + c.grid_wall;
    let flag = if m.full { format!("--qwen-problems {}", m.problems) } else { format!("--qwen15b-problems {} --qwen15b-n {}", m.problems, m.n) };
    let mut md = format!(
        "Measured by `cargo xtask bench autodeco --skip-smollm2 {flag}` ({}), {} Q4_K_M, \
         gsm_eval.jsonl (GSM-Symbolic: 10 variants per template, so the first {} problems are {} templates), \
         max_new_tokens {}, batch {}, 2-core AVX-512 machine, CPU; answer = number after `####`, else in the last `\\boxed{{}}`, else the last number. \
         Generation time of the rows below{}: {:.0} min; this run of the bench (cached parts skipped): {:.0} min.\n\n",
        date(),
        m.name,
        m.problems,
        m.problems.div_ceil(10),
        o.qwen_max_new_tokens,
        o.batch,
        if m.full { " and the tuning grid" } else { "" },
        total_wall / 60.0,
        c.elapsed / 60.0
    );
    md.push_str(&format!("Heads: trained on the first {} GSM train problems, {} steps. `{}`; `{}`.\n\n", m.train_examples, m.steps, c.hidden_line, c.train_line));
    md.push_str("pass@k with 95% bootstrap intervals over problems (4,000 resamples):\n\n| decoding | problems, samples |");
    for k in &ks {
        md.push_str(&format!(" pass@{k} |"));
    }
    md.push_str(" mean T | mean P | tok/s | time |\n|---|---|");
    for _ in &ks {
        md.push_str("---|");
    }
    md.push_str("---|---|---|---|\n");
    for (i, cf) in c.configs.iter().enumerate() {
        md.push_str(&format!("| {} | {} |", cf.name, cf.what));
        for &k in &ks {
            md.push_str(&if k > cf.n { " – |".to_string() } else { format!(" {} |", ci_cell(&cf.per_problem(k), 1000 + i as u64 * 10 + k as u64)) });
        }
        let f = |key: &str| cf.summary[key].as_f64().map_or("–".to_string(), |x| format!("{x:.3}"));
        md.push_str(&format!(
            " {} | {} | {:.1} | {:.1} min |\n",
            f("mean_T"),
            f("mean_P"),
            cf.summary["tok_s"].as_f64().unwrap_or(f64::NAN),
            cf.summary["wall_s"].as_f64().unwrap_or(f64::NAN) / 60.0
        ));
    }
    md.push_str("\nPaired differences (same problems; 95% bootstrap interval of the mean difference over problems; significant when it excludes 0):\n\n| comparison | k | difference | significant |\n|---|---|---|---|\n");
    let find = |prefix: &str| c.configs.iter().find(|cf| cf.name.starts_with(prefix));
    let pairs = [("AutoDeco", "default sampling"), ("AutoDeco", "best static"), ("best static", "default sampling"), ("AutoDeco", "greedy"), ("best static", "greedy")];
    for (ai, (x, y)) in pairs.iter().enumerate() {
        let (Some(a), Some(b)) = (find(x), find(y)) else { continue };
        for &k in &ks {
            if k > a.n || k > b.n {
                continue;
            }
            let d: Vec<f64> = a.per_problem(k).iter().zip(b.per_problem(k)).map(|(u, v)| u - v).collect();
            let (mean, lo, hi) = bootstrap_ci(&d, 7000 + ai as u64 * 10 + k as u64);
            let sig = if lo > 0.0 || hi < 0.0 { "yes" } else { "no" };
            md.push_str(&format!("| {x} − {y} | {k} | {:+.1} points [{:+.1}, {:+.1}] | {sig} |\n", 100.0 * mean, 100.0 * lo, 100.0 * hi));
        }
    }
    md.push_str("\nHead cost (`deco autodeco eval --heads`, 64 new tokens; heads + statistics time over forward + sampling time, from the engine's counters):\n\n| batch | problems | heads per token | forward + sampling per token | overhead |\n|---|---|---|---|---|\n");
    for (batch, limit, v) in c.lat {
        let heads_s = v["heads_s"].as_f64().unwrap_or(f64::NAN);
        let rest = v["forward_s"].as_f64().unwrap_or(f64::NAN) + v["sample_s"].as_f64().unwrap_or(f64::NAN);
        let toks = v["tokens"].as_f64().unwrap_or(f64::NAN);
        md.push_str(&format!("| {batch} | {limit} | {:.3} ms | {:.2} ms | **{:.2}%** |\n", 1e3 * heads_s / toks, 1e3 * rest / toks, 100.0 * heads_s / rest));
    }
    if let (Some(pm), Some(b)) = (c.params, c.bytes) {
        md.push_str(&format!(
            "\nHead memory: {pm:.0} f32 parameters, {:.2} MB: {:.3}% of the base's {:.0} M parameters.\n",
            b / 1e6,
            100.0 * pm / (m.base_params_m * 1e6),
            m.base_params_m
        ));
    }
    md
}

fn render_short(o: &Options, m: &QwenRun, c: &Common<'_>, passk_svg: &str) -> String {
    let mut md = render_common(o, m, c);
    md.push_str(&format!("\nPlot: [{passk_svg}](autodeco/{passk_svg}).\n"));
    md
}

fn render(o: &Options, m: &QwenRun, c: &Common<'_>, grid: &[(f32, f32, f64, f64)], best: (f32, f32), meta: &Value, gen_rows: &[(&str, &str, Option<&str>, Value)]) -> String {
    let mut md = render_common(o, m, c);
    md.push_str(&format!("\nTuning grid (gsm_train.jsonl problems {TUNE_OFFSET}–{}: GSM8K train, disjoint from the scored GSM-Symbolic problems and from the problems the heads trained on; n = 1, seed 777), pass@1; the best point, T = {} and top_p = {}, is the \"best static\" row:\n\n", TUNE_OFFSET + o.qwen_grid_problems - 1, best.0, best.1));
    md.push_str(&grid_table(&o.qwen_grid_temperatures, &o.qwen_grid_top_ps, |t, tp| grid.iter().find(|g| g.0 == t && g.1 == tp).map_or(f64::NAN, |g| g.2)));
    let mv = |stage: &str, k: &str| meta[stage][k].as_f64().unwrap_or(f64::NAN);
    md.push_str(&format!(
        "\nMeta-instruction stage (`deco autodeco meta-train`, {} steps, {} training questions with the training phrasings; measured on {} held-out questions × {} held-out phrasings of each kind, T and P averaged over the first {} answer positions, teacher-forced on the reference answer):\n\n\
         | heads | mean T (none) | ΔT low | ΔT creative | ΔP low | ΔP creative | T_low < T_none | T_creative > T_none | order T_low < T_none < T_creative | same order for P |\n|---|---|---|---|---|---|---|---|---|---|\n",
        meta["steps"], meta["train_questions"], meta["heldout_questions"], meta["low_heldout"].as_array().map_or(0, Vec::len), meta["max_positions"]
    ));
    for (stage, name) in [("before", "stage one"), ("after", "after the ranking stage")] {
        md.push_str(&format!(
            "| {name} | {:.3} | {:+.3} | {:+.3} | {:+.4} | {:+.4} | {} | {} | **{}** | {} |\n",
            mv(stage, "mean_t_none"),
            mv(stage, "delta_t_low"),
            mv(stage, "delta_t_high"),
            mv(stage, "delta_p_low"),
            mv(stage, "delta_p_high"),
            pct(mv(stage, "frac_t_low_below")),
            pct(mv(stage, "frac_t_high_above")),
            pct(mv(stage, "frac_t_order")),
            pct(mv(stage, "frac_p_order"))
        ));
    }
    md.push_str(&format!(
        "\nDuring generation (16 problems, n = 1, 64 new tokens, held-out phrasings \"{LOW_HELDOUT}\" / \"{HIGH_HELDOUT}\" appended to the question; mean over the generated tokens):\n\n| heads | instruction | mean T | mean P |\n|---|---|---|---|\n"
    ));
    for (stage, name, _, v) in gen_rows {
        md.push_str(&format!("| {stage} | {name} | {:.4} | {:.4} |\n", v["mean_T"].as_f64().unwrap_or(f64::NAN), v["mean_P"].as_f64().unwrap_or(f64::NAN)));
    }
    md.push_str(&format!(
        "\nPlots: [{k}-passk.svg](autodeco/{k}-passk.svg) (pass@k with the intervals), [{k}-meta-trace.svg](autodeco/{k}-meta-trace.svg) (predicted T along one held-out answer, each variant, before and after the ranking stage).\n",
        k = m.label
    ));
    md
}

fn plot_passk_ci(path: &Path, configs: &[Config], n: usize, model: &str) -> Result<()> {
    use plotters::prelude::*;
    let ks = ks_of(n);
    let mut series = Vec::new();
    let mut ymax: f64 = 0.05;
    for (i, c) in configs.iter().enumerate() {
        let pts: Vec<(f64, f64, f64, f64)> = ks
            .iter()
            .filter(|&&k| k <= c.n)
            .map(|&k| {
                let (m, lo, hi) = bootstrap_ci(&c.per_problem(k), 1000 + i as u64 * 10 + k as u64);
                ymax = ymax.max(hi);
                // Offset the series a little along x so the intervals do not overlap.
                (k as f64 * (1.0 + 0.03 * (i as f64 - 1.5)), 100.0 * m, 100.0 * lo, 100.0 * hi)
            })
            .collect();
        series.push((c.name.clone(), pts));
    }
    let caption = format!("GSM-Symbolic pass@k, {model} (95% bootstrap intervals)");
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (820, 500)).into_drawing_area();
        let draw = || -> std::result::Result<(), Box<dyn std::error::Error + '_>> {
            root.fill(&WHITE)?;
            let mut chart = ChartBuilder::on(&root)
                .caption(caption.as_str(), ("sans-serif", 18))
                .margin(12)
                .x_label_area_size(40)
                .y_label_area_size(60)
                .build_cartesian_2d(0.8f64..(n as f64 * 1.15).max(1.5), 0.0..ymax * 1.1 * 100.0)?;
            chart.configure_mesh().x_desc("k").y_desc("pass@k (%)").draw()?;
            for (i, (name, pts)) in series.iter().enumerate() {
                let c = Palette99::pick(i).to_rgba();
                chart
                    .draw_series(LineSeries::new(pts.iter().map(|p| (p.0, p.1)), c.stroke_width(2)).point_size(4))?
                    .label(name.as_str())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
                chart.draw_series(pts.iter().map(|p| PathElement::new(vec![(p.0, p.2), (p.0, p.3)], c.stroke_width(1))))?;
            }
            chart.configure_series_labels().position(SeriesLabelPosition::LowerRight).background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
            root.present()?;
            Ok(())
        };
        draw().map_err(|e| anyhow::anyhow!("plot: {e}"))?;
    }
    let tmp = path.with_extension("svg.tmp");
    fs::write(&tmp, svg)?;
    fs::rename(&tmp, path)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// pass@k against its definition: the probability that k samples drawn without replacement
    /// from n (c correct) contain a correct one, by enumerating the subsets.
    #[test]
    fn pass_at_k_matches_subset_enumeration() {
        for n in 1..=8usize {
            for c in 0..=n {
                for k in 1..=n {
                    let (mut hit, mut all) = (0u64, 0u64);
                    for mask in 0u32..(1 << n) {
                        if mask.count_ones() as usize == k {
                            all += 1;
                            hit += u64::from(mask & ((1u32 << c) - 1) != 0);
                        }
                    }
                    let want = hit as f64 / all as f64;
                    assert!((pass_at_k(n, c, k) - want).abs() < 1e-12, "n {n} c {c} k {k}");
                }
            }
        }
    }

    /// The bootstrap interval holds the mean, and it is degenerate for constant data.
    #[test]
    fn bootstrap_interval_brackets_the_mean() {
        let x: Vec<f64> = (0..100).map(|i| if i % 4 == 0 { 1.0 } else { 0.0 }).collect();
        let (m, lo, hi) = bootstrap_ci(&x, 1);
        assert!((m - 0.25).abs() < 1e-12 && lo < m && m < hi);
        // Normal approximation: standard error sqrt(0.25 * 0.75 / 100) = 0.0433; the 95%
        // interval's half-width is about 1.96 of them.
        assert!(((hi - lo) / 2.0 - 1.96 * 0.0433).abs() < 0.015, "{lo} {hi}");
        let (m, lo, hi) = bootstrap_ci(&[0.5; 10], 2);
        assert_eq!((m, lo, hi), (0.5, 0.5, 0.5));
    }
}
