//! `cargo xtask bench medusa`: Medusa heads (Cai et al. 2024) on SmolLM2-135M-Instruct and
//! Qwen2.5-Coder-0.5B-Instruct (Q4_K_M): heads trained on self-distilled GSM-Symbolic train
//! prompts (`deco medusa train`, cached), their per-head top-1 / top-5 accuracy on self-distilled
//! held-out text (GSM-Symbolic eval prompts, `deco medusa eval`), and the decode speed of
//! `deco generate --medusa` against `deco generate --strategy greedy` at batch 1, per candidate
//! tree, interleaved repeats (median), with the output checked equal to greedy (T = 0).
//!
//! Every measurement is one `deco` process, cached in `<cache>/medusa/results/<label>.json`
//! (as `bench decoding`). Writes the section between `<!-- bench medusa begin -->` and
//! `<!-- bench medusa end -->` of `docs/decoding.md`.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::decoding::{Gen, Prompt, Runner, median, s};
use crate::{bench, fetch, util};

/// Options of `bench medusa`.
pub struct Options {
    pub cache: PathBuf,
    pub no_mirror: bool,
    /// Interleaved repeats of the speed runs (median).
    pub repeats: usize,
    /// Generated tokens per run.
    pub max_new_tokens: usize,
    /// Training steps of the SmolLM2 heads (128 positions each).
    pub train_steps: usize,
    /// Training prompts of the SmolLM2 heads (self-distilled responses).
    pub train_examples: usize,
    /// Training steps of the Qwen2.5-Coder-0.5B heads (64 positions each: its LM head is 3×
    /// SmolLM2's, its hidden size 1.6×).
    pub qwen_train_steps: usize,
    /// Training prompts of the Qwen2.5-Coder-0.5B heads.
    pub qwen_train_examples: usize,
    /// Held-out prompts of the accuracy report.
    pub eval_examples: usize,
    pub threads: usize,
    pub skip_qwen: bool,
    /// `--q8-activations` on every speed run.
    pub q8_activations: bool,
    /// Only run speed measurements whose label contains one of these (comma-separated).
    pub only: Option<String>,
    pub deco_bin: Option<PathBuf>,
}

/// Candidate trees measured (label, `medusa_choices`).
const TREES: [(&str, &str); 6] = [
    ("chain1", "[[0]]"),
    ("wide2", "[[0],[1]]"),
    ("chain2", "[[0],[0,0]]"),
    ("chain3", "[[0],[0,0],[0,0,0]]"),
    ("tree4", "[[0],[1],[0,0]]"),
    ("tree8", "[[0],[1],[2],[0,0],[0,1],[1,0],[0,0,0],[0,0,0,0]]"),
];

struct Model {
    name: &'static str,
    tag: &'static str,
    path: PathBuf,
    prompts: Vec<Prompt>,
    /// Training prompts file, steps, prompts, positions per step.
    train: (PathBuf, usize, usize, usize),
}

/// Writes `n` training prompts spread over the whole GSM train file (it is grouped by
/// template: its first lines cover a few templates only) to `out`.
fn pick_train_prompts(cache: &Path, n: usize, out: &Path) -> Result<()> {
    let all = fs::read_to_string(cache.join("data/gsm_train.jsonl")).context("reading gsm_train.jsonl")?;
    let lines: Vec<&str> = all.lines().filter(|l| !l.trim().is_empty()).collect();
    let stride = (lines.len() / n.max(1)).max(1);
    let picked: Vec<&str> = lines.iter().step_by(stride).take(n).copied().collect();
    fs::write(out, picked.join("\n") + "\n")?;
    Ok(())
}

/// One speed row: a model, a prompt, a tree.
struct Row {
    model: &'static str,
    prompt: &'static str,
    tree: &'static str,
    tokens: f64,
    mean_accepted: f64,
    greedy_tok_s: f64,
    medusa_tok_s: f64,
    speedup: f64,
    exact: bool,
    repeats: usize,
}

fn gsm_prompts(path: &Path, skip: usize, n: usize) -> Result<Vec<Prompt>> {
    let text = fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().filter(|l| !l.trim().is_empty()).skip(skip).take(n).enumerate() {
        let v: Value = serde_json::from_str(line).with_context(|| format!("{}: line {}", path.display(), i + 1))?;
        let q = v["question"].as_str().context("GSM line without a question")?;
        out.push(Prompt { name: crate::decoding::leak(format!("gsm-{}", skip + i)), text: crate::decoding::leak(q.to_string()) });
    }
    Ok(out)
}

/// Runs `deco` with `args` (no caching; training and evaluation), returns stdout.
fn deco(bin: &Path, args: &[String], threads: usize) -> Result<String> {
    let mut cmd = Command::new(bin);
    cmd.args(args).args(["--threads", &threads.to_string()]);
    eprintln!("bench medusa: {}", util::show(&cmd));
    let out = cmd.stdin(Stdio::null()).stderr(Stdio::inherit()).output().with_context(|| format!("running {}", bin.display()))?;
    if !out.status.success() {
        bail!("deco failed ({})", out.status);
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

pub fn run(o: &Options) -> Result<()> {
    let t_start = Instant::now();
    let mut what = vec![fetch::What::Model, fetch::What::Data];
    if !o.skip_qwen {
        what.push(fetch::What::Qwen05b);
    }
    fetch::fetch(&fetch::Options { cache: o.cache.clone(), no_mirror: o.no_mirror, what })?;
    let bin = bench::deco_binary(o.deco_bin.as_deref())?;
    let work = o.cache.join("medusa");
    let results = work.join("results");
    fs::create_dir_all(&results)?;
    let only: Vec<String> = o.only.as_deref().unwrap_or("").split(',').map(str::trim).filter(|x| !x.is_empty()).map(String::from).collect();
    let r = Runner { bin: bin.clone(), results, threads: o.threads, only };
    let gsm_train = work.join("train_prompts.jsonl");
    pick_train_prompts(&o.cache, o.train_examples, &gsm_train)?;
    let gsm_eval = o.cache.join("data/gsm_eval.jsonl");
    let mut models = vec![Model {
        name: "SmolLM2-135M",
        tag: "smol",
        path: o.cache.join("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
        prompts: crate::decoding::smol_prompts().into_iter().chain(gsm_prompts(&gsm_eval, 100, 2)?).collect(),
        train: (gsm_train, o.train_steps, o.train_examples, 128),
    }];
    if !o.skip_qwen {
        let qwen_train = work.join("train_prompts_qwen05.jsonl");
        pick_train_prompts(&o.cache, o.qwen_train_examples, &qwen_train)?;
        models.push(Model {
            name: "Qwen2.5-Coder-0.5B",
            tag: "qwen05",
            path: o.cache.join("models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
            prompts: crate::decoding::qwen_prompts().into_iter().chain(gsm_prompts(&gsm_eval, 100, 2)?).collect(),
            train: (qwen_train, o.qwen_train_steps, o.qwen_train_examples, 64),
        });
    }
    let mut accuracy = Vec::new();
    let mut rows = Vec::new();
    for m in &models {
        if !m.path.exists() {
            bail!("{} is missing (cargo xtask fetch)", m.path.display());
        }
        // 1. Heads (trained once, cached with their arguments).
        let heads = work.join(format!("{}-heads", m.tag));
        let (data, steps, examples, batch) = &m.train;
        let train_args: Vec<String> = vec![
            s("medusa"), s("train"), s("--model"), m.path.display().to_string(), s("--data"), data.display().to_string(),
            s("--out"), heads.display().to_string(), s("--steps"), s(steps), s("--max-examples"), s(examples),
            s("--max-new-tokens"), s(128), s("--seed"), s(0), s("--batch-size"), s(batch), s("--eval-every"), s(100),
        ];
        let stamp = work.join(format!("{}-heads.args.json", m.tag));
        let key = json!({"args": train_args, "threads": o.threads}).to_string();
        if !heads.join("config.json").exists() || fs::read_to_string(&stamp).ok().as_deref() != Some(key.as_str()) {
            let t = Instant::now();
            deco(&bin, &train_args, o.threads)?;
            eprintln!("bench medusa: {} heads trained in {:.0} s", m.name, t.elapsed().as_secs_f64());
            fs::write(&stamp, &key)?;
        }
        // 2. Per-head accuracy on held-out self-distilled text (GSM eval prompts).
        let eval_args: Vec<String> = vec![
            s("medusa"), s("eval"), s("--model"), m.path.display().to_string(), s("--medusa"), heads.display().to_string(),
            s("--data"), gsm_eval.display().to_string(), s("--max-examples"), s(o.eval_examples), s("--max-new-tokens"), s(128),
        ];
        let acc = r.cached(&format!("{}-eval", m.tag), &eval_args, |stdout, _, wall| {
            let line = stdout.lines().rev().find(|l| l.starts_with('{')).context("no JSON line from deco medusa eval")?;
            let mut v: Value = serde_json::from_str(line)?;
            v["wall_s"] = json!(wall);
            Ok(v)
        })?;
        if let Some(a) = acc {
            accuracy.push((m.name, a));
        }
        // 3. Speed: greedy and every tree, interleaved per repeat and prompt.
        // Labels of 8-bit-activation runs carry a suffix (their own cache entries).
        let (q8, q8_args): (&str, Vec<String>) = if o.q8_activations { ("-q8", vec![s("--q8-activations")]) } else { ("", Vec::new()) };
        for p in &m.prompts {
            let mut greedy: Vec<Gen> = Vec::new();
            let mut trees: Vec<Vec<Gen>> = vec![Vec::new(); TREES.len()];
            for rep in 0..o.repeats {
                let greedy_args: Vec<String> = [s("--strategy"), s("greedy")].into_iter().chain(q8_args.iter().cloned()).collect();
                let Some(g) = r.generate(&format!("{}-{}-greedy{q8}-r{rep}", m.tag, p.name), &m.path, p.text, o.max_new_tokens, &greedy_args)? else { continue };
                greedy.push(g);
                for (ti, (label, choices)) in TREES.iter().enumerate() {
                    let args: Vec<String> =
                        [s("--medusa"), heads.display().to_string(), s("--medusa-choices"), s(choices)].into_iter().chain(q8_args.iter().cloned()).collect();
                    if let Some(x) = r.generate(&format!("{}-{}-{label}{q8}-r{rep}", m.tag, p.name), &m.path, p.text, o.max_new_tokens, &args)? {
                        trees[ti].push(x);
                    }
                }
            }
            if greedy.is_empty() {
                continue;
            }
            for (ti, runs) in trees.iter().enumerate() {
                if runs.is_empty() {
                    continue;
                }
                let n = runs.len().min(greedy.len());
                let exact = runs.iter().zip(&greedy).all(|(a, b)| a.text == b.text);
                if !exact {
                    eprintln!("bench medusa: WARNING {} {} {}: Medusa output differs from greedy", m.name, p.name, TREES[ti].0);
                }
                rows.push(Row {
                    model: m.name,
                    prompt: p.name,
                    tree: TREES[ti].0,
                    tokens: runs[0].tokens,
                    mean_accepted: runs[0].field("mean_accepted_length"),
                    greedy_tok_s: median(&mut greedy.iter().map(Gen::tok_s).collect::<Vec<_>>()),
                    medusa_tok_s: median(&mut runs.iter().map(Gen::tok_s).collect::<Vec<_>>()),
                    speedup: median(&mut (0..n).map(|i| greedy[i].gen_s / runs[i].gen_s).collect::<Vec<_>>()),
                    exact,
                    repeats: n,
                });
            }
        }
    }
    let md = render(&accuracy, &rows, o, t_start.elapsed().as_secs_f64());
    println!("{md}");
    let path = util::workspace_root().join("docs/decoding.md");
    let old = fs::read_to_string(&path).unwrap_or_default();
    let (begin, end) = ("<!-- bench medusa begin -->", "<!-- bench medusa end -->");
    let new = match (old.find(begin), old.find(end)) {
        (Some(b), Some(e)) if e > b => format!("{}{begin}\n{md}\n{}", &old[..b], &old[e..]),
        _ => format!("{old}\n{begin}\n{md}\n{end}\n"),
    };
    let tmp = path.with_extension("md.tmp");
    fs::write(&tmp, new)?;
    fs::rename(&tmp, &path)?;
    eprintln!("bench medusa: wrote {}", path.display());
    Ok(())
}

/// The CPU model and the kernels' instruction set (AVX-512 when the CPU has it).
fn cpu_summary() -> String {
    let info = fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let name = info.lines().find_map(|l| l.strip_prefix("model name").and_then(|r| r.split(':').nth(1))).map_or("unknown CPU", str::trim).to_string();
    let isa = if info.contains("avx512f") { "AVX-512" } else if info.contains("avx2") { "AVX2" } else { "no AVX2" };
    format!("{name}, {isa}")
}

fn render(accuracy: &[(&str, Value)], rows: &[Row], o: &Options, wall: f64) -> String {
    let mut md = String::new();
    let qwen = if o.skip_qwen {
        String::new()
    } else {
        format!("; Qwen2.5-Coder-0.5B: {} steps of 64 positions on {} prompts", o.qwen_train_steps, o.qwen_train_examples)
    };
    md.push_str(&format!(
        "Measured by `cargo xtask bench medusa` ({} repeats interleaved, {} new tokens, {} threads, {}{}; heads: SmolLM2 {} steps of 128 positions on {} self-distilled GSM-Symbolic train prompts{qwen}).\n\n",
        o.repeats,
        o.max_new_tokens,
        o.threads,
        cpu_summary(),
        if o.q8_activations { ", 8-bit activations (`--q8-activations`) in greedy and Medusa runs alike" } else { "" },
        o.train_steps,
        o.train_examples
    ));
    let _ = wall;
    md.push_str("Per-head accuracy on self-distilled held-out text (GSM-Symbolic eval prompts, the base model's greedy answers): head k predicts the token k+1 positions ahead.\n\n");
    md.push_str("| model | positions | head 1 top-1 / top-5 | head 2 | head 3 | head 4 |\n|---|---|---|---|---|---|\n");
    for (name, v) in accuracy {
        let heads = v["heldout"].as_array().cloned().unwrap_or_default();
        let cell = |k: usize| {
            heads.get(k).map_or("–".to_string(), |h| format!("{:.1} % / {:.1} %", 100.0 * h["top1"].as_f64().unwrap_or(f64::NAN), 100.0 * h["top5"].as_f64().unwrap_or(f64::NAN)))
        };
        md.push_str(&format!("| {name} | {} | {} | {} | {} | {} |\n", v["positions"], cell(0), cell(1), cell(2), cell(3)));
    }
    md.push_str("\nSpeed at batch 1 against greedy decoding of the same run (tokens/s of generation, model loading excluded); `mean accepted` is tokens released per tree forward (accepted candidates + 1); `= greedy` checks the text.\n\n");
    md.push_str("| model | prompt | tree | tokens | mean accepted | greedy tok/s | Medusa tok/s | speedup | = greedy |\n|---|---|---|---|---|---|---|---|---|\n");
    for r in rows {
        md.push_str(&format!(
            "| {} | {} | {} | {:.0} | {:.2} | {:.1} | {:.1} | {:.2}× | {} |\n",
            r.model,
            r.prompt,
            r.tree,
            r.tokens,
            r.mean_accepted,
            r.greedy_tok_s,
            r.medusa_tok_s,
            r.speedup,
            if r.exact { "yes" } else { "**no**" }
        ));
    }
    // Geometric mean speedup per model and tree.
    md.push_str("\n| model | tree | geometric-mean speedup | mean accepted |\n|---|---|---|---|\n");
    let mut keys: Vec<(&str, &str)> = Vec::new();
    for r in rows {
        if !keys.contains(&(r.model, r.tree)) {
            keys.push((r.model, r.tree));
        }
    }
    for (m, t) in keys {
        let sel: Vec<&Row> = rows.iter().filter(|r| r.model == m && r.tree == t).collect();
        let g = (sel.iter().map(|r| r.speedup.ln()).sum::<f64>() / sel.len() as f64).exp();
        let a = sel.iter().map(|r| r.mean_accepted).sum::<f64>() / sel.len() as f64;
        md.push_str(&format!("| {m} | {t} | {g:.2}× | {a:.2} |\n"));
    }
    let _ = rows.iter().map(|r| r.repeats).max();
    md
}
