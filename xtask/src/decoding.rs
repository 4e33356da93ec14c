//! `cargo xtask bench decoding`: speculative decoding (speedup over greedy, acceptance rate,
//! T=0 exactness) on real chat and code prompts — SmolLM2 self-speculative (first k layers as
//! the draft) and prompt lookup, Qwen2.5-Coder-1.5B with the 0.5B as the draft —, beam search
//! cost vs `num_beams`, and entropy-threshold early exit (layers skipped vs teacher-forced
//! perplexity and top-1 agreement with the full model on wiki_test, and its decode speed).
//!
//! Every measurement is one `deco` process (`deco generate ...` or `deco eval early-exit ...`);
//! its parsed result is cached in `<cache>/decoding/results/<label>.json` together with its
//! arguments, so an interrupted run resumes and a re-run only re-renders. Writes the section
//! between `<!-- bench decoding begin -->` and `<!-- bench decoding end -->` of
//! `docs/decoding.md` and `docs/decoding/decoding.svg`.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::{bench, fetch, util};

/// Options of `bench decoding`.
pub struct Options {
    pub cache: PathBuf,
    pub no_mirror: bool,
    /// Interleaved repeats of the SmolLM2 speed measurements (median).
    pub repeats: usize,
    /// Generated tokens per SmolLM2 run.
    pub max_new_tokens: usize,
    /// Generated tokens per Qwen2.5-Coder-1.5B run.
    pub qwen_max_new_tokens: usize,
    /// Repeats of the Qwen runs.
    pub qwen_repeats: usize,
    /// Generated tokens per beam-search run.
    pub beam_max_new_tokens: usize,
    /// Teacher-forced early-exit windows of 256 tokens of wiki_test.
    pub ee_windows: usize,
    pub threads: usize,
    pub skip_qwen: bool,
    /// Only run measurements whose label contains one of these (comma-separated); the others
    /// are taken from the cache when present.
    pub only: Option<String>,
    pub deco_bin: Option<PathBuf>,
}

/// The deco binary: `--deco-bin`, else a fresh release build of deco-cli.
/// A prompt of the benchmark (always wrapped in the model's chat template).
pub(crate) struct Prompt {
    pub(crate) name: &'static str,
    pub(crate) text: &'static str,
}

const MOVING_AVERAGE: &str = "def moving_average(xs, k):\n    out = []\n    s = 0\n    for i, x in enumerate(xs):\n        s += x\n        if i >= k:\n            s -= xs[i - k]\n        if i >= k - 1:\n            out.append(s / k)\n    return out\n";

pub(crate) fn smol_prompts() -> Vec<Prompt> {
    vec![
        Prompt { name: "chat-days", text: "List the days of the week and the months of the year." },
        Prompt { name: "chat-sky", text: "Explain in a short paragraph why the sky is blue." },
        Prompt { name: "code-fib", text: "Write a Python function that returns the n-th Fibonacci number." },
        Prompt { name: "code-comment", text: leak(format!("Rewrite this Python function with a docstring and a comment on every line:\n\n```python\n{MOVING_AVERAGE}```")) },
    ]
}

pub(crate) fn qwen_prompts() -> Vec<Prompt> {
    vec![
        Prompt { name: "code-comment", text: leak(format!("Rewrite this Python function with a docstring and a comment on every line:\n\n```python\n{MOVING_AVERAGE}```")) },
        Prompt { name: "code-rename", text: leak(format!("Rename the variable `s` to `window_sum` and `out` to `averages` in this function. Reply with the whole function only.\n\n```python\n{MOVING_AVERAGE}```")) },
    ]
}

pub(crate) fn leak(s: String) -> &'static str {
    Box::leak(s.into_boxed_str())
}

/// Result of one `deco generate` run.
#[derive(Debug, Clone)]
pub(crate) struct Gen {
    pub(crate) text: String,
    pub(crate) tokens: f64,
    /// Generation time without model loading: prefill + decode.
    pub(crate) gen_s: f64,
    /// `[strategy]` fields.
    pub(crate) fields: BTreeMap<String, String>,
    /// Wall time of the whole process (model loading included).
    pub(crate) wall_s: f64,
}

impl Gen {
    pub(crate) fn from_json(v: &Value) -> Result<Self> {
        let fields = v["fields"]
            .as_object()
            .map(|m| m.iter().map(|(k, x)| (k.clone(), x.as_str().unwrap_or_default().to_string())).collect())
            .unwrap_or_default();
        Ok(Self {
            text: v["text"].as_str().context("text")?.to_string(),
            tokens: v["tokens"].as_f64().context("tokens")?,
            gen_s: v["gen_s"].as_f64().context("gen_s")?,
            fields,
            wall_s: v["wall_s"].as_f64().unwrap_or(f64::NAN),
        })
    }

    pub(crate) fn field(&self, k: &str) -> f64 {
        self.fields.get(k).and_then(|v| v.parse().ok()).unwrap_or(f64::NAN)
    }

    pub(crate) fn tok_s(&self) -> f64 {
        self.tokens / self.gen_s
    }
}

pub(crate) struct Runner {
    pub(crate) bin: PathBuf,
    pub(crate) results: PathBuf,
    pub(crate) threads: usize,
    pub(crate) only: Vec<String>,
}

impl Runner {
    fn selected(&self, label: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|o| label.contains(o.as_str()))
    }

    /// Runs `deco <args>` unless `<results>/<label>.json` holds a result of the same arguments
    /// (or the label is filtered out by `--only`: then the cached result or `None`).
    pub(crate) fn cached(&self, label: &str, args: &[String], parse: impl Fn(&str, &str, f64) -> Result<Value>) -> Result<Option<Value>> {
        let file = self.results.join(format!("{label}.json"));
        let key = json!({"args": args, "threads": self.threads});
        if let Ok(text) = fs::read_to_string(&file)
            && let Ok(v) = serde_json::from_str::<Value>(&text)
            && v["key"] == key
        {
            return Ok(Some(v["result"].clone()));
        }
        if !self.selected(label) {
            return Ok(None);
        }
        let mut cmd = Command::new(&self.bin);
        cmd.args(args).args(["--threads", &self.threads.to_string()]);
        eprintln!("bench decoding: {label}: {}", util::show(&cmd));
        let t0 = Instant::now();
        let out = cmd.stdin(Stdio::null()).output().with_context(|| format!("running {}", self.bin.display()))?;
        let wall = t0.elapsed().as_secs_f64();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        if !out.status.success() {
            bail!("{label}: deco failed ({}):\n{stderr}", out.status);
        }
        let result = parse(&stdout, &stderr, wall)?;
        let tmp = file.with_extension("json.tmp");
        fs::write(&tmp, serde_json::to_string_pretty(&json!({"key": key, "result": result}))?)?;
        fs::rename(&tmp, &file)?;
        Ok(Some(result))
    }

    /// `deco generate --chat --temperature 0` with extra arguments.
    pub(crate) fn generate(&self, label: &str, model: &Path, prompt: &str, max_new: usize, extra: &[String]) -> Result<Option<Gen>> {
        let mut args: Vec<String> = vec!["generate".into(), "--model".into(), model.display().to_string(), "--chat".into(), "--prompt".into(), prompt.into()];
        args.extend(["--max-new-tokens".into(), max_new.to_string(), "--temperature".into(), "0".into()]);
        args.extend(extra.iter().cloned());
        let beam = extra.iter().any(|a| a == "beam");
        let v = self.cached(label, &args, |stdout, stderr, wall| {
            let st = bench::parse_stats(stderr)?;
            // Prefill = time to the first streamed token; beam search streams nothing until
            // the end, so both rates use the total time there.
            let prefill_s = st.prompt_tokens as f64 / st.prompt_tok_s;
            let decode_s = if beam || st.decode_tokens <= 1 { 0.0 } else { (st.decode_tokens - 1) as f64 / st.decode_tok_s };
            let mut fields = serde_json::Map::new();
            if let Some(line) = stderr.lines().rev().find(|l| l.starts_with("[strategy]")) {
                for kv in line.split_whitespace().skip(2) {
                    if let Some((k, v)) = kv.split_once('=') {
                        fields.insert(k.to_string(), json!(v));
                    }
                }
            }
            let text = stdout.strip_suffix('\n').unwrap_or(stdout);
            Ok(json!({"text": text, "tokens": st.decode_tokens, "prompt_tokens": st.prompt_tokens, "gen_s": prefill_s + decode_s, "fields": fields, "wall_s": wall}))
        })?;
        v.map(|v| Gen::from_json(&v)).transpose()
    }
}

pub(crate) fn median(v: &mut [f64]) -> f64 {
    let mut v: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 { v[n / 2] } else { 0.5 * (v[n / 2 - 1] + v[n / 2]) }
}

/// Characters of `b` that agree with `a` from the start, over `a`'s length.
fn prefix_agreement(a: &str, b: &str) -> f64 {
    let n = a.chars().zip(b.chars()).take_while(|(x, y)| x == y).count();
    n as f64 / a.chars().count().max(1) as f64
}

/// One speculative configuration.
struct SpecConfig {
    label: String,
    desc: String,
    args: Vec<String>,
}

/// Aggregated row of the speculative table.
struct SpecRow {
    model: &'static str,
    prompt: &'static str,
    config: String,
    tokens: f64,
    acceptance: f64,
    target_forwards: f64,
    greedy_tok_s: f64,
    spec_tok_s: f64,
    speedup: f64,
    exact: bool,
    repeats: usize,
}

pub(crate) fn s(x: impl ToString) -> String {
    x.to_string()
}

fn spec_configs_smol() -> Vec<SpecConfig> {
    let mut v = Vec::new();
    for (k, g) in [(16usize, 2usize), (16, 4), (24, 2), (24, 4)] {
        v.push(SpecConfig {
            label: format!("self-k{k}-g{g}"),
            desc: format!("self-speculative, first {k}/30 layers, γ={g}"),
            args: vec![s("--strategy"), s("speculative"), s("--draft-layers"), s(k), s("--num-speculative-tokens"), s(g)],
        });
    }
    for g in [2usize, 4] {
        v.push(SpecConfig {
            label: format!("lookup-g{g}"),
            desc: format!("prompt lookup (ngram 2), γ={g}"),
            args: vec![s("--strategy"), s("speculative"), s("--prompt-lookup"), s("--num-speculative-tokens"), s(g)],
        });
    }
    v
}

/// Runs the speculative grid for one model: per repeat, per prompt, greedy then every config.
#[allow(clippy::too_many_arguments)]
fn run_spec(r: &Runner, model_name: &'static str, tag: &str, model: &Path, prompts: &[Prompt], configs: &[SpecConfig], max_new: usize, repeats: usize) -> Result<(Vec<SpecRow>, f64)> {
    // results[prompt][config or "greedy"] = per-repeat Gen
    let mut greedy: Vec<Vec<Gen>> = vec![Vec::new(); prompts.len()];
    let mut spec: Vec<Vec<Vec<Gen>>> = vec![vec![Vec::new(); configs.len()]; prompts.len()];
    let mut wall = 0.0;
    for rep in 0..repeats {
        for (pi, p) in prompts.iter().enumerate() {
            let g = r.generate(&format!("{tag}-{}-greedy-r{rep}", p.name), model, p.text, max_new, &[s("--strategy"), s("greedy")])?;
            let Some(g) = g else { continue };
            wall += g.wall_s;
            for (ci, c) in configs.iter().enumerate() {
                if let Some(x) = r.generate(&format!("{tag}-{}-{}-r{rep}", p.name, c.label), model, p.text, max_new, &c.args)? {
                    wall += x.wall_s;
                    spec[pi][ci].push(x);
                }
            }
            greedy[pi].push(g);
        }
    }
    let mut rows = Vec::new();
    for (pi, p) in prompts.iter().enumerate() {
        if greedy[pi].is_empty() {
            continue;
        }
        for (ci, c) in configs.iter().enumerate() {
            let runs = &spec[pi][ci];
            if runs.is_empty() {
                continue;
            }
            let n = runs.len().min(greedy[pi].len());
            let exact = runs.iter().zip(&greedy[pi]).all(|(a, b)| a.text == b.text);
            if !exact {
                eprintln!("bench decoding: WARNING {model_name} {} {}: speculative output differs from greedy", p.name, c.label);
            }
            rows.push(SpecRow {
                model: model_name,
                prompt: p.name,
                config: c.desc.clone(),
                tokens: runs[0].tokens,
                acceptance: runs[0].field("acceptance_rate"),
                target_forwards: runs[0].field("target_forwards"),
                greedy_tok_s: median(&mut greedy[pi].iter().map(Gen::tok_s).collect::<Vec<_>>()),
                spec_tok_s: median(&mut runs.iter().map(Gen::tok_s).collect::<Vec<_>>()),
                speedup: median(&mut (0..n).map(|i| greedy[pi][i].gen_s / runs[i].gen_s).collect::<Vec<_>>()),
                exact,
                repeats: n,
            });
        }
    }
    Ok((rows, wall))
}

struct BeamRow {
    prompt: &'static str,
    num_beams: usize,
    time_s: f64,
    tokens: f64,
    sum_logprobs: f64,
    score: f64,
    forward_calls: f64,
    same_as_greedy: bool,
}

struct EeEvalRow {
    threshold: f32,
    min_layers: usize,
    check_every: usize,
    v: Value,
}

struct EeGenRow {
    prompt: &'static str,
    threshold: f32,
    skipped: f64,
    tok_s: f64,
    greedy_tok_s: f64,
    agreement: f64,
}

const EE_CONFIGS: [(f32, usize, usize); 7] = [(0.1, 8, 4), (0.25, 8, 4), (0.5, 8, 4), (1.0, 8, 4), (0.5, 16, 4), (1.0, 16, 4), (2.0, 20, 5)];
const EE_GEN_THRESHOLDS: [f32; 3] = [0.1, 0.5, 1.0];
const BEAMS: [usize; 4] = [1, 2, 4, 8];

pub fn run(o: &Options) -> Result<()> {
    let t_start = Instant::now();
    fetch::fetch(&fetch::Options { cache: o.cache.clone(), no_mirror: o.no_mirror, what: vec![fetch::What::Model, fetch::What::Data] })?;
    let smol = o.cache.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let wiki = o.cache.join("data/wiki_test.txt");
    let bin = bench::deco_binary(o.deco_bin.as_deref())?;
    let results = o.cache.join("decoding").join("results");
    fs::create_dir_all(&results)?;
    let only: Vec<String> = o.only.as_deref().unwrap_or("").split(',').map(str::trim).filter(|x| !x.is_empty()).map(String::from).collect();
    let r = Runner { bin, results: results.clone(), threads: o.threads, only };

    // 1. SmolLM2 speculative.
    let sp = smol_prompts();
    let (mut spec_rows, smol_spec_wall) = run_spec(&r, "SmolLM2-135M", "smol", &smol, &sp, &spec_configs_smol(), o.max_new_tokens, o.repeats)?;

    // 2. Beam search cost (repeated, interleaved; the sequences are deterministic).
    let beam_prompts = [&sp[0], &sp[2]];
    let mut beam_rows = Vec::new();
    let mut beam_runs: BTreeMap<(usize, usize), Vec<Gen>> = BTreeMap::new();
    for rep in 0..o.repeats {
        for (pi, p) in beam_prompts.iter().enumerate() {
            for nb in BEAMS {
                let args = [s("--strategy"), s("beam"), s("--num-beams"), s(nb), s("-n"), s(1)];
                if let Some(g) = r.generate(&format!("smol-beam-{}-b{nb}-r{rep}", p.name), &smol, p.text, o.beam_max_new_tokens, &args)? {
                    beam_runs.entry((pi, nb)).or_default().push(g);
                }
            }
        }
    }
    for (pi, p) in beam_prompts.iter().enumerate() {
        let greedy_text = beam_runs.get(&(pi, 1)).and_then(|v| v.first()).map(|g| g.text.clone());
        for nb in BEAMS {
            let Some(runs) = beam_runs.get(&(pi, nb)) else { continue };
            let g = &runs[0];
            beam_rows.push(BeamRow {
                prompt: p.name,
                num_beams: nb,
                time_s: median(&mut runs.iter().map(|x| x.gen_s).collect::<Vec<_>>()),
                tokens: g.field("best_tokens"),
                sum_logprobs: g.field("best_sum_logprobs"),
                score: g.field("best_score"),
                forward_calls: g.field("forward_calls"),
                same_as_greedy: greedy_text.as_deref() == Some(g.text.as_str()),
            });
        }
    }

    // 3. Early exit: teacher-forced quality on wiki_test, then decoding speed on the prompts.
    let mut ee_eval = Vec::new();
    for (thr, min_l, every) in EE_CONFIGS {
        let args: Vec<String> = vec![
            s("eval"), s("early-exit"), s("--model"), smol.display().to_string(), s("--text"), wiki.display().to_string(),
            s("--seqlen"), s(256), s("--max-windows"), s(o.ee_windows), s("--max-chars"), s(40000),
            s("--exit-entropy"), s(thr), s("--exit-min-layers"), s(min_l), s("--exit-check-every"), s(every),
        ];
        let label = format!("smol-ee-eval-t{thr}-m{min_l}-c{every}");
        let v = r.cached(&label, &args, |stdout, _, wall| {
            let line = stdout.lines().rev().find(|l| l.starts_with('{')).context("no JSON summary from deco eval early-exit")?;
            let mut v: Value = serde_json::from_str(line)?;
            v["wall_s"] = json!(wall);
            Ok(v)
        })?;
        if let Some(v) = v {
            ee_eval.push(EeEvalRow { threshold: thr, min_layers: min_l, check_every: every, v });
        }
    }
    let mut ee_gen = Vec::new();
    for (pi, p) in sp.iter().enumerate() {
        let greedy = r.generate(&format!("smol-{}-greedy-r0", p.name), &smol, p.text, o.max_new_tokens, &[s("--strategy"), s("greedy")])?;
        for thr in EE_GEN_THRESHOLDS {
            let args = [s("--strategy"), s("early-exit"), s("--exit-entropy"), s(thr), s("--exit-min-layers"), s(8), s("--exit-check-every"), s(4)];
            let mut runs = Vec::new();
            for rep in 0..o.repeats {
                if let Some(g) = r.generate(&format!("smol-ee-{}-t{thr}-r{rep}", p.name), &smol, p.text, o.max_new_tokens, &args)? {
                    runs.push(g);
                }
            }
            let (Some(g0), Some(gr)) = (runs.first(), greedy.as_ref()) else { continue };
            let greedy_all: Vec<f64> = (0..o.repeats)
                .filter_map(|rep| fs::read_to_string(results.join(format!("smol-{}-greedy-r{rep}.json", p.name))).ok())
                .filter_map(|t| serde_json::from_str::<Value>(&t).ok())
                .filter_map(|v| Gen::from_json(&v["result"]).ok())
                .map(|g| g.tok_s())
                .collect();
            let _ = pi;
            ee_gen.push(EeGenRow {
                prompt: p.name,
                threshold: thr,
                skipped: g0.field("layers_skipped"),
                tok_s: median(&mut runs.iter().map(Gen::tok_s).collect::<Vec<_>>()),
                greedy_tok_s: median(&mut greedy_all.clone()),
                agreement: prefix_agreement(&gr.text, &g0.text),
            });
        }
    }

    // 4. Qwen2.5-Coder 1.5B target, 0.5B draft (and prompt lookup).
    let mut qwen_wall = 0.0;
    let mut engine_md = String::new();
    if !o.skip_qwen {
        fetch::fetch(&fetch::Options { cache: o.cache.clone(), no_mirror: o.no_mirror, what: vec![fetch::What::Qwen] })?;
        let target = o.cache.join("models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf");
        let draft = o.cache.join("models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
        let g = 3usize;
        let configs = vec![
            SpecConfig {
                label: format!("draft05b-g{g}"),
                desc: format!("draft model Qwen2.5-Coder-0.5B, γ={g}"),
                args: vec![s("--strategy"), s("speculative"), s("--draft-model"), draft.display().to_string(), s("--num-speculative-tokens"), s(g)],
            },
            SpecConfig {
                label: format!("lookup-g{g}"),
                desc: format!("prompt lookup (ngram 2), γ={g}"),
                args: vec![s("--strategy"), s("speculative"), s("--prompt-lookup"), s("--num-speculative-tokens"), s(g)],
            },
        ];
        let (rows, wall) = run_spec(&r, "Qwen2.5-Coder-1.5B", "qwen15", &target, &qwen_prompts(), &configs, o.qwen_max_new_tokens, o.qwen_repeats)?;
        spec_rows.extend(rows);
        qwen_wall = wall;
        engine_md = engine_spec(o, &target, &draft, g)?;
    }

    let mut md = render(o, &spec_rows, smol_spec_wall, qwen_wall, &beam_rows, &ee_eval, &ee_gen, &results, t_start.elapsed().as_secs_f64());
    md.push_str(&engine_md);
    let docs = util::workspace_root().join("docs");
    fs::create_dir_all(docs.join("decoding"))?;
    plot(&docs.join("decoding/decoding.svg"), &spec_rows, &beam_rows, &ee_eval)?;
    let path = docs.join("decoding.md");
    let old = fs::read_to_string(&path).unwrap_or_default();
    let begin = "<!-- bench decoding begin -->";
    let end = "<!-- bench decoding end -->";
    let new = match (old.find(begin), old.find(end)) {
        (Some(b), Some(e)) if e > b => format!("{}{begin}\n{md}\n{}", &old[..b], &old[e..]),
        _ => format!("{old}\n{begin}\n{md}\n{end}\n"),
    };
    fs::write(&path, new)?;
    println!("{md}");
    Ok(())
}

/// Speculative decoding on the serving engine with 1 and 8 concurrent requests (the
/// `spec_bench` example of deco-serve): the markdown section of its results.
fn engine_spec(o: &Options, target: &Path, draft: &Path, gamma: usize) -> Result<String> {
    util::run(util::cargo().args(["build", "--release", "-p", "deco-serve", "--example", "spec_bench"])).context("cannot build the spec_bench example of deco-serve")?;
    let bin = bench::target_dir()?.join("release/examples/spec_bench");
    let mut cmd = Command::new(&bin);
    cmd.arg("--target").arg(target).arg("--draft").arg(draft);
    cmd.args(["--gamma", &gamma.to_string(), "--concurrency", "1,8", "--max-new-tokens", &o.qwen_max_new_tokens.to_string(), "--repeats", &o.qwen_repeats.to_string()]);
    for p in qwen_prompts() {
        cmd.args(["--prompt", p.text]);
    }
    eprintln!("bench decoding: engine speculative: {}", util::show(&cmd));
    let t0 = Instant::now();
    let out = cmd.stderr(Stdio::inherit()).output().with_context(|| format!("running {}", bin.display()))?;
    if !out.status.success() {
        bail!("spec_bench failed ({})", out.status);
    }
    let wall = t0.elapsed().as_secs_f64();
    let mut md = format!(
        "\n### Speculative decoding on the serving engine, 1 and 8 concurrent requests\n\n\
         Qwen2.5-Coder-1.5B-Instruct Q4_K_M, draft Qwen2.5-Coder-0.5B-Instruct Q4_K_M, γ = {gamma}, the {} code prompts of the table \
         above in turn, {} new tokens each, T = 0, {} repeat(s) (median), {:.0} s in all. `spec_bench` (crates/deco-serve/examples) \
         submits the requests at once to a fresh engine (the one `deco serve` and `deco generate` run); time = first submission to \
         last token. Speedup = plain time / strategy time; decode speedup excludes the time until every request had its first token. \
         \"= plain\": identical token ids.\n\n\
         | requests | configuration | tokens | time (s) | tok/s | speedup | decode speedup | acceptance | = plain |\n|---|---|---|---|---|---|---|---|---|\n",
        qwen_prompts().len(),
        o.qwen_max_new_tokens,
        o.qwen_repeats,
        wall
    );
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let v: serde_json::Value = serde_json::from_str(line).with_context(|| format!("spec_bench printed {line:?}"))?;
        let num = |k: &str| v[k].as_f64().unwrap_or(f64::NAN);
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            v["concurrency"],
            v["config"].as_str().unwrap_or("?"),
            v["tokens"],
            f(num("wall_s"), 1),
            f(num("tok_s"), 2),
            f(num("speedup"), 2),
            f(num("decode_speedup"), 2),
            f(num("acceptance"), 3),
            if v["equals_plain"].as_bool() == Some(true) { "yes" } else { "**no**" },
        ));
    }
    Ok(md)
}

fn f(x: f64, p: usize) -> String {
    if x.is_finite() { format!("{x:.p$}") } else { "–".into() }
}

#[allow(clippy::too_many_arguments)]
fn render(o: &Options, spec: &[SpecRow], smol_wall: f64, qwen_wall: f64, beam: &[BeamRow], ee_eval: &[EeEvalRow], ee_gen: &[EeGenRow], results: &Path, total_s: f64) -> String {
    let mut md = format!(
        "Measured by `cargo xtask bench decoding` ({}; {} threads, flex CPU backend, chat template, T = 0). \
         Time = prefill + decode of one `deco generate` process, model loading excluded. Speedup = median over \
         interleaved repeats of greedy time / strategy time on the same prompt (same run). \"= greedy\" checks \
         that the speculative output text equals greedy's in every repeat.\n\n",
        date(),
        o.threads
    );
    md.push_str(&format!(
        "### Speculative decoding\n\nSmolLM2-135M-Instruct Q4_1: max_new_tokens {}, {} repeats ({:.0} s of processes). \
         Qwen2.5-Coder-1.5B-Instruct Q4_K_M target (packed Q4_K / Q6_K kernels), draft Qwen2.5-Coder-0.5B-Instruct Q4_K_M: max_new_tokens {}, {} repeat(s) \
         ({:.0} s of processes, model loading included).\n\n",
        o.max_new_tokens, o.repeats, smol_wall, o.qwen_max_new_tokens, o.qwen_repeats, qwen_wall
    ));
    md.push_str("| model | prompt | drafter | tokens | acceptance | target forwards | greedy tok/s | tok/s | speedup | = greedy |\n|---|---|---|---|---|---|---|---|---|---|\n");
    for x in spec {
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {}× | {} |\n",
            x.model,
            x.prompt,
            x.config,
            x.tokens,
            f(x.acceptance, 3),
            x.target_forwards,
            f(x.greedy_tok_s, 1),
            f(x.spec_tok_s, 1),
            f(x.speedup, 2),
            if x.exact { "yes".to_string() } else { format!("**no** ({} runs)", x.repeats) }
        ));
    }
    // Per-config summary.
    let mut by: BTreeMap<(String, String), (Vec<f64>, Vec<f64>)> = BTreeMap::new();
    for x in spec {
        let e = by.entry((x.model.to_string(), x.config.clone())).or_default();
        e.0.push(x.acceptance);
        e.1.push(x.speedup);
    }
    md.push_str("\nPer configuration (mean over prompts):\n\n| model | drafter | mean acceptance | mean speedup |\n|---|---|---|---|\n");
    for ((m, c), (a, sp)) in &by {
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
        md.push_str(&format!("| {m} | {c} | {} | {}× |\n", f(mean(a), 3), f(mean(sp), 2)));
    }
    md.push_str(&format!(
        "\n### Beam search cost\n\nSmolLM2, max_new_tokens {}, length_penalty 1, early_stopping false; `num_beams` = 1 is \
         greedy (same text). Time: median of {} repeats.\n\n\
         | prompt | num_beams | time (s) | × greedy time | target forwards | best tokens | best sum logprob | Δ vs greedy | best score | same text as greedy |\n|---|---|---|---|---|---|---|---|---|---|\n",
        o.beam_max_new_tokens, o.repeats
    ));
    for x in beam {
        let g = beam.iter().find(|b| b.prompt == x.prompt && b.num_beams == 1);
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            x.prompt,
            x.num_beams,
            f(x.time_s, 2),
            f(g.map_or(f64::NAN, |g| x.time_s / g.time_s), 2),
            x.forward_calls,
            x.tokens,
            f(x.sum_logprobs, 3),
            f(g.map_or(f64::NAN, |g| x.sum_logprobs - g.sum_logprobs), 3),
            f(x.score, 4),
            if x.same_as_greedy { "yes" } else { "no" }
        ));
    }
    let full = ee_eval.first().and_then(|e| e.v["full_ppl"].as_f64()).unwrap_or(f64::NAN);
    let preds = ee_eval.first().and_then(|e| e.v["predictions"].as_u64()).unwrap_or(0);
    md.push_str(&format!(
        "\n### Early exit\n\nTeacher-forced (`deco eval early-exit`): {} window(s) of 256 tokens of wiki_test.txt, no BOS, every \
         token may exit ({preds} next-token predictions). Full model: ppl {}. Time: the early-exit pass plus one full forward.\n\n\
         | entropy threshold (nats) | min_layers / check_every | layers skipped | ppl | ppl / full | top-1 agreement with full | time (s) |\n|---|---|---|---|---|---|---|\n",
        o.ee_windows,
        f(full, 3)
    ));
    for e in ee_eval {
        let g = |k: &str| e.v[k].as_f64().unwrap_or(f64::NAN);
        md.push_str(&format!(
            "| {} | {} / {} | {} | {} | {} | {} | {} |\n",
            e.threshold,
            e.min_layers,
            e.check_every,
            f(g("layers_skipped"), 3),
            f(g("exit_ppl"), 2),
            f(g("exit_ppl") / g("full_ppl"), 2),
            f(g("top1_agreement"), 3),
            f(g("seconds"), 1)
        ));
    }
    md.push_str(&format!(
        "\nDecoding with early exit (`deco generate --strategy early-exit`, min_layers 8, check_every 4; the prompt is \
         prefilled by the full model), max_new_tokens {}, tok/s median of {} repeats:\n\n\
         | prompt | entropy threshold | layers skipped | tok/s | greedy tok/s | output = greedy (fraction of greedy's text matched from the start) |\n|---|---|---|---|---|---|\n",
        o.max_new_tokens, o.repeats
    ));
    for x in ee_gen {
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} |\n",
            x.prompt,
            x.threshold,
            f(x.skipped, 3),
            f(x.tok_s, 1),
            f(x.greedy_tok_s, 1),
            f(x.agreement, 3)
        ));
    }
    // Sum of the process times of every cached result (the cost of a full, uncached run).
    let process_s: f64 = fs::read_dir(results)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
        .filter_map(|e| fs::read_to_string(e.path()).ok())
        .filter_map(|t| serde_json::from_str::<Value>(&t).ok())
        .filter_map(|v| v["result"]["wall_s"].as_f64())
        .sum();
    md.push_str(&format!(
        "\n![speculative speedup, acceptance, beam cost, early exit](decoding/decoding.svg)\n\n\
         A full run spends {:.0} min in `deco` processes (this render took {total_s:.0} s; cached runs cost nothing). \
         Raw results: `<cache>/decoding/results/*.json`.\n",
        process_s / 60.0
    ));
    md
}

fn date() -> String {
    Command::new("date").arg("-u").arg("+%Y-%m-%d").output().ok().map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string()).unwrap_or_default()
}

fn plot(path: &Path, spec: &[SpecRow], beam: &[BeamRow], ee: &[EeEvalRow]) -> Result<()> {
    use plotters::prelude::*;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (1100, 800)).into_drawing_area();
        let draw = || -> std::result::Result<(), Box<dyn std::error::Error + '_>> {
            root.fill(&WHITE)?;
            let areas = root.split_evenly((2, 2));
            // Configurations in table order.
            let mut configs: Vec<String> = Vec::new();
            for x in spec {
                let c = format!("{}: {}", if x.model.starts_with("Qwen") { "Qwen 1.5B" } else { "SmolLM2" }, x.config);
                if !configs.contains(&c) {
                    configs.push(c);
                }
            }
            let cfg_of = |x: &SpecRow| {
                let c = format!("{}: {}", if x.model.starts_with("Qwen") { "Qwen 1.5B" } else { "SmolLM2" }, x.config);
                configs.iter().position(|y| *y == c).unwrap_or(0)
            };
            let nc = configs.len().max(1) as f64;
            let short = |i: usize| -> String {
                configs.get(i).map_or(String::new(), |c| {
                    c.replace("self-speculative, first ", "self ").replace(" layers", "").replace("prompt lookup (ngram 2)", "lookup").replace("draft model Qwen2.5-Coder-0.5B", "0.5B draft")
                })
            };
            for (panel, (title, ylabel, get)) in [
                ("Speculative speedup vs greedy (T=0), per prompt", "speedup (×)", (|x: &SpecRow| x.speedup) as fn(&SpecRow) -> f64),
                ("Acceptance rate, per prompt", "accepted / drafted", |x: &SpecRow| x.acceptance),
            ]
            .into_iter()
            .enumerate()
            {
                let ymax = spec.iter().map(get).filter(|v| v.is_finite()).fold(1.1f64, f64::max) * 1.1;
                let mut chart = ChartBuilder::on(&areas[panel])
                    .caption(title, ("sans-serif", 16))
                    .margin(10)
                    .x_label_area_size(150)
                    .y_label_area_size(50)
                    .build_cartesian_2d(-0.5f64..nc - 0.5, 0.0..ymax)?;
                chart
                    .configure_mesh().light_line_style(WHITE)
                    .x_labels(configs.len() * 2 + 1)
                    .x_label_formatter(&|v| {
                        let i = v.round();
                        if (v - i).abs() < 1e-6 && i >= 0.0 { short(i as usize) } else { String::new() }
                    })
                    .x_label_style(("sans-serif", 10).into_font().transform(FontTransform::Rotate90))
                    .y_desc(ylabel)
                    .draw()?;
                if panel == 0 {
                    chart.draw_series(LineSeries::new(vec![(-0.5, 1.0), (nc - 0.5, 1.0)], BLACK.mix(0.5)))?;
                }
                let mut prompts: Vec<&str> = Vec::new();
                for x in spec {
                    if !prompts.contains(&x.prompt) {
                        prompts.push(x.prompt);
                    }
                }
                for (pi, p) in prompts.iter().enumerate() {
                    let c = Palette99::pick(pi).to_rgba();
                    let off = (pi as f64 - (prompts.len() as f64 - 1.0) / 2.0) * 0.1;
                    let pts: Vec<(f64, f64)> = spec.iter().filter(|x| x.prompt == *p).map(|x| (cfg_of(x) as f64 + off, get(x))).filter(|v| v.1.is_finite()).collect();
                    chart
                        .draw_series(pts.into_iter().map(move |pt| Circle::new(pt, 5, c.filled())))?
                        .label(*p)
                        .legend(move |(x, y)| Circle::new((x + 6, y), 5, c.filled()));
                }
                chart.configure_series_labels().position(SeriesLabelPosition::UpperLeft).background_style(WHITE.mix(0.8)).border_style(BLACK).label_font(("sans-serif", 11)).draw()?;
            }
            // Beam cost.
            {
                let tmax = beam.iter().map(|b| b.time_s).filter(|v| v.is_finite()).fold(0.1f64, f64::max) * 1.15;
                let mut chart = ChartBuilder::on(&areas[2])
                    .caption("Beam search: time vs num_beams (SmolLM2)", ("sans-serif", 16))
                    .margin(10)
                    .x_label_area_size(40)
                    .y_label_area_size(50)
                    .build_cartesian_2d(0.5f64..8.5, 0.0..tmax)?;
                chart.configure_mesh().light_line_style(WHITE).x_desc("num_beams").y_desc("time (s)").draw()?;
                let mut prompts: Vec<&str> = Vec::new();
                for b in beam {
                    if !prompts.contains(&b.prompt) {
                        prompts.push(b.prompt);
                    }
                }
                for (pi, p) in prompts.iter().enumerate() {
                    let c = Palette99::pick(pi + 5).to_rgba();
                    let pts: Vec<(f64, f64)> = beam.iter().filter(|b| b.prompt == *p).map(|b| (b.num_beams as f64, b.time_s)).collect();
                    chart
                        .draw_series(LineSeries::new(pts, c.stroke_width(2)).point_size(4))?
                        .label(*p)
                        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
                }
                chart.configure_series_labels().position(SeriesLabelPosition::UpperLeft).background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
            }
            // Early exit: skipped fraction vs agreement (and log10 ppl ratio).
            {
                let pts_a: Vec<(f64, f64)> = ee.iter().filter_map(|e| Some((e.v["layers_skipped"].as_f64()?, e.v["top1_agreement"].as_f64()?))).collect();
                let pts_p: Vec<(f64, f64)> = ee
                    .iter()
                    .filter_map(|e| Some((e.v["layers_skipped"].as_f64()?, (e.v["exit_ppl"].as_f64()? / e.v["full_ppl"].as_f64()?).log10())))
                    .collect();
                let xmax = pts_a.iter().map(|p| p.0).fold(0.05f64, f64::max) * 1.15;
                let ymax = pts_p.iter().map(|p| p.1).filter(|v| v.is_finite()).fold(1.0f64, f64::max) * 1.1;
                let mut chart = ChartBuilder::on(&areas[3])
                    .caption("Early exit (wiki_test, teacher-forced)", ("sans-serif", 16))
                    .margin(10)
                    .x_label_area_size(40)
                    .y_label_area_size(50)
                    .right_y_label_area_size(50)
                    .build_cartesian_2d(0.0f64..xmax, 0.0f64..1.0)?
                    .set_secondary_coord(0.0f64..xmax, 0.0f64..ymax);
                chart.configure_mesh().light_line_style(WHITE).x_desc("fraction of layers skipped").y_desc("top-1 agreement with full model").draw()?;
                chart.configure_secondary_axes().y_desc("log10(ppl / full ppl)").draw()?;
                let c1 = Palette99::pick(2).to_rgba();
                let c2 = Palette99::pick(3).to_rgba();
                chart
                    .draw_series(pts_a.iter().map(|&p| Circle::new(p, 5, c1.filled())))?
                    .label("top-1 agreement (left)")
                    .legend(move |(x, y)| Circle::new((x + 6, y), 5, c1.filled()));
                chart
                    .draw_secondary_series(pts_p.iter().map(|&p| TriangleMarker::new(p, 6, c2.filled())))?
                    .label("log10 ppl ratio (right)")
                    .legend(move |(x, y)| TriangleMarker::new((x + 6, y), 6, c2.filled()));
                chart.configure_series_labels().position(SeriesLabelPosition::UpperRight).background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
            }
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

    #[test]
    fn median_and_prefix() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&mut []).is_nan());
        assert_eq!(prefix_agreement("abcd", "abxd"), 0.5);
        assert_eq!(prefix_agreement("abcd", "abcd"), 1.0);
    }
}
