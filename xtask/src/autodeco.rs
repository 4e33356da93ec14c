//! `cargo xtask bench autodeco`: GSM accuracy of greedy, default sampling, the best static
//! (temperature, top_p) from a grid (an oracle: chosen on the eval problems themselves) and
//! AutoDeco heads, plus the heads' latency overhead and the meta-instruction shift of the
//! predicted T and P. Writes `docs/autodeco.md` (table), `docs/autodeco/*.svg` (plots) and
//! `<cache>/autodeco/results/*.json` (one file per run, reused when its options match, so an
//! interrupted benchmark resumes).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::{bench, fetch, util};

/// Options of `bench autodeco`.
pub struct Options {
    pub cache: PathBuf,
    pub no_mirror: bool,
    /// Problems for greedy (the first N of gsm_eval.jsonl).
    pub problems: usize,
    /// Problems for the sampled configurations.
    pub sample_problems: usize,
    /// Samples per problem for the sampled configurations.
    pub n: usize,
    pub max_new_tokens: usize,
    pub batch: usize,
    /// Training steps / examples of the heads (trained once, cached).
    pub steps: usize,
    pub train_examples: usize,
    /// Grid of static temperatures and top-ps for the oracle.
    pub grid_temperatures: Vec<f32>,
    pub grid_top_ps: Vec<f32>,
    /// Problems of the oracle grid search (n = 1 each).
    pub grid_problems: usize,
    /// Problems of the meta-instruction measurement.
    pub meta_problems: usize,
    /// Skip the SmolLM2-135M part (its block of docs/autodeco.md stays as it is).
    pub skip_smollm2: bool,
    /// Qwen2.5-Coder-0.5B scored problems (the first N of gsm_eval; 0 = skip).
    pub qwen_problems: usize,
    /// Qwen: samples per problem of the sampled configurations.
    pub qwen_n: usize,
    /// Qwen: maximum new tokens per answer.
    pub qwen_max_new_tokens: usize,
    /// Qwen: tuning grid (temperatures x top-ps) and its problems (gsm_train from 200 on,
    /// disjoint from the scored problems and from the heads' training problems).
    pub qwen_grid_temperatures: Vec<f32>,
    pub qwen_grid_top_ps: Vec<f32>,
    pub qwen_grid_problems: usize,
    /// Qwen: steps of the meta-instruction ranking stage.
    pub meta_steps: usize,
    /// Qwen2.5-Coder-1.5B: scored problems (0 = skip), samples per problem, head training
    /// examples and steps (no tuning grid or meta stage: the CPU time goes to the table).
    pub qwen15b_problems: usize,
    pub qwen15b_n: usize,
    pub qwen15b_train_examples: usize,
    pub qwen15b_steps: usize,
    /// Qwen heads: training examples and steps.
    pub qwen_train_examples: usize,
    pub qwen_steps: usize,
    pub deco_bin: Option<PathBuf>,
}

pub(crate) struct Runner {
    pub(crate) bin: PathBuf,
    pub(crate) results: PathBuf,
    pub(crate) data: PathBuf,
}

impl Runner {
    /// Runs `deco autodeco eval` with `args` unless `<results>/<label>.json` holds a summary of
    /// the same arguments; returns the summary.
    pub(crate) fn eval(&self, label: &str, model: &Path, args: &[String]) -> Result<Value> {
        let file = self.results.join(format!("{label}.json"));
        let key = json!({"model": model, "args": args});
        if let Ok(text) = fs::read_to_string(&file)
            && let Ok(v) = serde_json::from_str::<Value>(&text)
            && v["key"] == key
        {
            eprintln!("bench autodeco: {label}: cached ({})", file.display());
            return Ok(v["summary"].clone());
        }
        let mut cmd = Command::new(&self.bin);
        cmd.args(["autodeco", "eval", "--model"]).arg(model).arg("--data").arg(&self.data);
        cmd.args(["--label", label]).args(args);
        cmd.arg("--outputs").arg(self.results.join(format!("{label}.outputs.jsonl")));
        eprintln!("bench autodeco: {}", util::show(&cmd));
        let out = cmd.stderr(std::process::Stdio::inherit()).output().with_context(|| format!("running {}", self.bin.display()))?;
        if !out.status.success() {
            bail!("deco autodeco eval ({label}) failed: {}", out.status);
        }
        let stdout = String::from_utf8_lossy(&out.stdout);
        let line = stdout.lines().rev().find(|l| l.starts_with('{')).context("no JSON summary from deco autodeco eval")?;
        let summary: Value = serde_json::from_str(line).context("invalid JSON summary")?;
        let tmp = file.with_extension("json.tmp");
        fs::write(&tmp, serde_json::to_string_pretty(&json!({"key": key, "summary": summary}))?)?;
        fs::rename(&tmp, &file)?;
        Ok(summary)
    }
}

pub(crate) fn s(x: impl ToString) -> String {
    x.to_string()
}

fn pass(v: &Value, k: usize) -> f64 {
    v["pass"][format!("pass@{k}")].as_f64().unwrap_or(f64::NAN)
}

pub fn run(o: &Options) -> Result<()> {
    fetch::fetch(&fetch::Options { cache: o.cache.clone(), no_mirror: o.no_mirror, what: vec![fetch::What::Model, fetch::What::Data] })?;
    let bin = bench::deco_binary(o.deco_bin.as_deref())?;
    if !o.skip_smollm2 {
        run_smollm2(o, &bin)?;
    }
    if o.qwen_problems > 0 {
        crate::autodeco_qwen::run(o, &bin, &crate::autodeco_qwen::QwenRun::small(o))?;
    }
    if o.qwen15b_problems > 0 {
        crate::autodeco_qwen::run(o, &bin, &crate::autodeco_qwen::QwenRun::large(o))?;
    }
    Ok(())
}

/// Replaces the text between `begin` and `end` in `path` with `md` (appends the block when the
/// markers are missing).
pub(crate) fn write_block(path: &Path, begin: &str, end: &str, md: &str) -> Result<()> {
    let old = fs::read_to_string(path).unwrap_or_default();
    let new = match (old.find(begin), old.find(end)) {
        (Some(b), Some(e)) if e > b => format!("{}{begin}\n{md}\n{}", &old[..b], &old[e..]),
        _ => format!("{old}\n{begin}\n{md}\n{end}\n"),
    };
    let tmp = path.with_extension("md.tmp");
    fs::write(&tmp, new)?;
    fs::rename(&tmp, path)?;
    Ok(())
}

fn run_smollm2(o: &Options, bin: &Path) -> Result<()> {
    let model = o.cache.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let train_data = o.cache.join("data/gsm_train.jsonl");
    let eval_data = o.cache.join("data/gsm_eval.jsonl");
    let bin = bin.to_path_buf();
    let root = o.cache.join("autodeco");
    let results = root.join("results");
    fs::create_dir_all(&results)?;
    let heads = root.join("smollm2-gsm");
    let stamp = root.join("smollm2-gsm.args.json");
    let train_args: Vec<String> = vec![
        s("--steps"), s(o.steps), s("--max-examples"), s(o.train_examples), s("--heldout-examples"), s(16), s("--eval-every"), s(25), s("--seed"), s(0),
    ];
    let fresh = fs::read_to_string(&stamp).ok().and_then(|t| serde_json::from_str::<Value>(&t).ok()) == Some(json!(train_args));
    if !(fresh && heads.join("autodeco_heads.safetensors").is_file()) {
        let mut cmd = Command::new(&bin);
        cmd.args(["autodeco", "train", "--model"]).arg(&model).arg("--data").arg(&train_data).arg("--out").arg(&heads).args(&train_args);
        eprintln!("bench autodeco: {}", util::show(&cmd));
        let st = cmd.status()?;
        if !st.success() {
            bail!("deco autodeco train failed: {st}");
        }
        fs::write(&stamp, serde_json::to_string(&train_args)?)?;
    }
    let r = Runner { bin: bin.clone(), results, data: eval_data };
    let common = |n: usize, problems: usize| -> Vec<String> {
        vec![s("-n"), s(n), s("--limit"), s(problems), s("--max-new-tokens"), s(o.max_new_tokens), s("--batch"), s(o.batch)]
    };
    let mut rows: Vec<(String, String, Value)> = Vec::new();
    // Greedy.
    let mut a = common(1, o.problems);
    a.extend([s("--temperature"), s(0)]);
    let greedy = r.eval("greedy", &model, &a)?;
    rows.push(("greedy".into(), format!("{} problems, n = 1", o.problems), greedy.clone()));
    if o.problems > o.sample_problems {
        // Greedy on the sampled configurations' problems, from the same outputs.
        let outputs = fs::read_to_string(r.results.join("greedy.outputs.jsonl")).unwrap_or_default();
        let (mut c, mut n) = (0usize, 0usize);
        for l in outputs.lines() {
            if let Ok(v) = serde_json::from_str::<Value>(l)
                && v["problem"].as_u64().is_some_and(|p| (p as usize) < o.sample_problems)
            {
                n += 1;
                c += usize::from(v["correct"].as_bool().unwrap_or(false));
            }
        }
        if n > 0 {
            let mut v = greedy.clone();
            v["pass"] = json!({"pass@1": c as f64 / n as f64});
            rows.push(("greedy".into(), format!("first {n} problems, n = 1 (same run)"), v));
        }
    }
    // Default sampling.
    let mut a = common(o.n, o.sample_problems);
    a.extend([s("--temperature"), s(1), s("--top-p"), s(1)]);
    let default = r.eval("default", &model, &a)?;
    rows.push(("default sampling (T = 1, top_p = 1)".into(), format!("{} problems, n = {}", o.sample_problems, o.n), default.clone()));
    // AutoDeco.
    let mut a = common(o.n, o.sample_problems);
    a.extend([s("--temperature"), s(1), s("--top-p"), s(1), s("--heads")]);
    a.push(heads.display().to_string());
    let auto = r.eval("autodeco", &model, &a)?;
    rows.push(("AutoDeco (user T = 1, top_p = 1)".into(), format!("{} problems, n = {}", o.sample_problems, o.n), auto.clone()));
    // Head latency on its own (small run): heads + statistics per token vs forward + sampling.
    let mut a = vec![s("-n"), s(1), s("--limit"), s(32), s("--max-new-tokens"), s(96), s("--batch"), s(o.batch), s("--heads")];
    a.push(heads.display().to_string());
    let latency = r.eval("latency-autodeco", &model, &a)?;
    // Meta-instructions.
    let mut meta = Vec::new();
    for (name, ins) in [("none", None), ("low randomness", Some("Please answer with low randomness.")), ("creative", Some("Be creative."))] {
        let mut a = vec![s("-n"), s(1), s("--limit"), s(o.meta_problems), s("--max-new-tokens"), s(64), s("--batch"), s(o.batch), s("--heads")];
        a.push(heads.display().to_string());
        if let Some(i) = ins {
            a.extend([s("--instruction"), s(i)]);
        }
        let v = r.eval(&format!("meta-{}", name.replace(' ', "-")), &model, &a)?;
        meta.push((name, ins, v));
    }
    // Oracle grid (n = 1 on grid_problems), then the best with n.
    let mut best: Option<(f32, f32, f64)> = None;
    let mut grid = Vec::new();
    for &t in &o.grid_temperatures {
        for &p in &o.grid_top_ps {
            let mut a = common(1, o.grid_problems);
            a.extend([s("--temperature"), s(t), s("--top-p"), s(p), s("--seed"), s(777)]);
            let v = r.eval(&format!("grid-t{t}-p{p}"), &model, &a)?;
            let acc = pass(&v, 1);
            grid.push((t, p, acc));
            if best.is_none_or(|b| acc > b.2) {
                best = Some((t, p, acc));
            }
        }
    }
    let (bt, bp, _) = best.context("empty grid")?;
    let mut a = common(o.n, o.sample_problems);
    a.extend([s("--temperature"), s(bt), s("--top-p"), s(bp)]);
    let oracle = r.eval("oracle", &model, &a)?;
    rows.push((format!("best static (T = {bt}, top_p = {bp}; oracle)"), format!("{} problems, n = {}", o.sample_problems, o.n), oracle.clone()));
    let md = render(o, &rows, &grid, &meta, &latency);
    let docs = util::workspace_root().join("docs");
    fs::create_dir_all(docs.join("autodeco"))?;
    let loss_svg = heads.join("loss.svg");
    if loss_svg.is_file() {
        fs::copy(&loss_svg, docs.join("autodeco/loss.svg"))?;
    }
    let loss_csv = heads.join("loss.csv");
    if loss_csv.is_file() {
        fs::copy(&loss_csv, docs.join("autodeco/loss.csv"))?;
    }
    plot_passk(&docs.join("autodeco/passk.svg"), &rows)?;
    write_block(&docs.join("autodeco.md"), "<!-- bench autodeco begin -->", "<!-- bench autodeco end -->", &md)?;
    println!("{md}");
    Ok(())
}

fn render(
    o: &Options,
    rows: &[(String, String, Value)],
    grid: &[(f32, f32, f64)],
    meta: &[(&str, Option<&str>, Value)],
    latency: &Value,
) -> String {
    let mut ks = vec![1usize];
    while ks.last().copied().unwrap_or(1) * 2 <= o.n {
        ks.push(ks.last().copied().unwrap_or(1) * 2);
    }
    let mut md = format!(
        "Measured by `cargo xtask bench autodeco` ({}), SmolLM2-135M-Instruct Q4_1, gsm_eval.jsonl, \
         max_new_tokens {}, batch {}; answer = number after `####`, else the last number.\n\n",
        date(),
        o.max_new_tokens,
        o.batch
    );
    md.push_str(&table(rows, o.n));
    md.push_str(&format!("\nOracle grid ({} problems, n = 1, seed 777), pass@1:\n\n", o.grid_problems));
    md.push_str(&grid_table(&o.grid_temperatures, &o.grid_top_ps, |t, p| grid.iter().find(|g| g.0 == t && g.1 == p).map_or(f64::NAN, |g| g.2)));
    let overhead = |v: &Value| {
        let heads_s = v["heads_s"].as_f64().unwrap_or(f64::NAN);
        let rest = v["forward_s"].as_f64().unwrap_or(f64::NAN) + v["sample_s"].as_f64().unwrap_or(f64::NAN);
        let toks = v["tokens"].as_f64().unwrap_or(f64::NAN);
        (1e3 * heads_s / toks, 1e3 * rest / toks, 100.0 * heads_s / rest)
    };
    let (h, f, pct) = overhead(latency);
    md.push_str(&format!(
        "\nHead overhead (32 problems, n = 1, 96 tokens, batch {}): {h:.3} ms per token for both heads and the \
         statistics against {f:.2} ms per token for the batched forward + sampling: **{pct:.2}%** (goal ≤ 2%). \
         Head memory: 297,218 f32 parameters, 1.19 MB.\n",
        o.batch
    ));
    if let Some((_, _, auto)) = rows.iter().find(|r| r.0.starts_with("AutoDeco")) {
        let (h, f, pct) = overhead(auto);
        md.push_str(&format!("In the AutoDeco row's run: {h:.3} ms vs {f:.2} ms per token ({pct:.2}%).\n"));
    }
    md.push_str(&format!("\nMeta-instructions ({} problems, n = 1, 64 tokens, AutoDeco heads; instruction appended to the question):\n\n| instruction | mean T | mean P |\n|---|---|---|\n", o.meta_problems));
    for (name, ins, v) in meta {
        md.push_str(&format!(
            "| {name}{} | {:.4} | {:.4} |\n",
            ins.map_or(String::new(), |i| format!(" (\"{i}\")")),
            v["mean_T"].as_f64().unwrap_or(f64::NAN),
            v["mean_P"].as_f64().unwrap_or(f64::NAN)
        ));
    }
    md.push_str("\nRaw summaries and every output: `<cache>/autodeco/results/` (`.cache/` or `$DECO_CACHE`).\n");
    md
}

/// A grid of pass@1 values as a markdown table: a row per temperature, a column per top-p.
pub(crate) fn grid_table(temperatures: &[f32], top_ps: &[f32], acc: impl Fn(f32, f32) -> f64) -> String {
    let mut md = String::from("| T \\ top_p |");
    for p in top_ps {
        md.push_str(&format!(" {p} |"));
    }
    md.push_str("\n|---|");
    for _ in top_ps {
        md.push_str("---|");
    }
    md.push('\n');
    for &t in temperatures {
        md.push_str(&format!("| {t} |"));
        for &p in top_ps {
            md.push_str(&format!(" {:.1}% |", 100.0 * acc(t, p)));
        }
        md.push('\n');
    }
    md
}

fn table(rows: &[(String, String, Value)], n: usize) -> String {
    let mut ks = vec![1usize];
    while ks.last().copied().unwrap_or(1) * 2 <= n {
        ks.push(ks.last().copied().unwrap_or(1) * 2);
    }
    let mut md = String::from("| decoding | problems, samples |");
    for k in &ks {
        md.push_str(&format!(" pass@{k} |"));
    }
    md.push_str(" mean T | mean P | tok/s |\n|---|---|");
    for _ in &ks {
        md.push_str("---|");
    }
    md.push_str("---|---|---|\n");
    for (name, what, v) in rows {
        md.push_str(&format!("| {name} | {what} |"));
        for &k in &ks {
            let x = pass(v, k);
            md.push_str(&if x.is_nan() { " – |".to_string() } else { format!(" {:.1}% |", 100.0 * x) });
        }
        let f = |key: &str| v[key].as_f64().map_or("–".to_string(), |x| format!("{x:.3}"));
        md.push_str(&format!(" {} | {} | {:.1} |\n", f("mean_T"), f("mean_P"), v["tok_s"].as_f64().unwrap_or(f64::NAN)));
    }
    md
}

pub(crate) fn date() -> String {
    Command::new("date").arg("-u").arg("+%Y-%m-%d").output().ok().map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string()).unwrap_or_default()
}

fn plot_passk(path: &Path, rows: &[(String, String, Value)]) -> Result<()> {
    use plotters::prelude::*;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (800, 480)).into_drawing_area();
        let draw = || -> std::result::Result<(), Box<dyn std::error::Error + '_>> {
            root.fill(&WHITE)?;
            let mut ymax: f64 = 0.01;
            for (_, _, v) in rows {
                if let Some(m) = v["pass"].as_object() {
                    for x in m.values() {
                        ymax = ymax.max(x.as_f64().unwrap_or(0.0));
                    }
                }
            }
            let mut chart = ChartBuilder::on(&root)
                .caption("GSM pass@k, SmolLM2-135M-Instruct", ("sans-serif", 20))
                .margin(12)
                .x_label_area_size(40)
                .y_label_area_size(60)
                .build_cartesian_2d(0.9f64..17.0, 0.0..ymax * 1.15 * 100.0)?;
            chart.configure_mesh().x_desc("k").y_desc("pass@k (%)").draw()?;
            for (i, (name, _, v)) in rows.iter().enumerate() {
                let mut pts: Vec<(f64, f64)> = v["pass"]
                    .as_object()
                    .map(|m| m.iter().filter_map(|(k, x)| Some((k.trim_start_matches("pass@").parse::<f64>().ok()?, 100.0 * x.as_f64()?))).collect())
                    .unwrap_or_default();
                pts.sort_by(|a, b| a.0.total_cmp(&b.0));
                let c = Palette99::pick(i).to_rgba();
                chart
                    .draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)).point_size(4))?
                    .label(name.as_str())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
            }
            chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
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
