//! `cargo xtask bench compress`: pruning results on SmolLM2-135M through the `deco` CLI.
//!
//! For each configuration: `deco prune` (timed, calibration tokens from its `[prune]` line), then
//! `deco eval ppl` on the first 20,000 characters of `wiki_test.txt` and of
//! `shakespeare/test.txt` (non-overlapping 256-token windows, no BOS), the output's file size and,
//! for the dense baseline and the structured models, `deco generate` decode tok/s. The heads +
//! neurons model is also recovered by `deco distill --objective kd` from the dense teacher and
//! measured again (row `... + KD`; its calib-tokens / minutes columns are the training tokens and
//! the distillation minutes). The table goes
//! to stdout and between the `bench:compress` markers of `docs/compression.md` (the rest of that
//! file is prose and is kept), with an SVG plot `docs/compression.svg`.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, Result};

use crate::bench::{deco_binary, min_med_max, parse_stats};
use crate::fetch::{self, What};
use crate::util::{self, output, run};

/// Options of `bench compress`.
#[derive(Debug, Clone)]
pub struct Options {
    /// The cache directory.
    pub cache: PathBuf,
    /// Ignore the local mirror.
    pub no_mirror: bool,
    /// Calibration windows.
    pub nsamples: usize,
    /// Tokens per calibration window.
    pub seqlen: usize,
    /// Perplexity windows per text (256 tokens each).
    pub ppl_windows: usize,
    /// CPU threads for every deco run.
    pub threads: usize,
    /// Decode-speed repeats.
    pub repeats: usize,
    /// Only rows whose label contains one of these (comma-separated).
    pub only: Option<String>,
    /// Use this deco binary instead of building deco-cli.
    pub deco_bin: Option<PathBuf>,
}

const BEGIN: &str = "<!-- bench:compress:begin -->";
const END: &str = "<!-- bench:compress:end -->";

struct Row {
    label: String,
    kind: &'static str,
    pattern: String,
    wiki: f64,
    shakespeare: f64,
    params: String,
    file_mib: f64,
    calib_tokens: usize,
    minutes: f64,
    decode_tok_s: Option<f64>,
}

/// `key=value` of the last line of `text` starting with `prefix`.
fn field(text: &str, prefix: &str, key: &str) -> Option<String> {
    let line = text.lines().rev().find(|l| l.starts_with(prefix))?;
    line.split_whitespace().find_map(|kv| kv.strip_prefix(&format!("{key}=")).map(str::to_string))
}

fn dir_size(dir: &Path) -> u64 {
    fs::read_dir(dir)
        .map(|d| d.filter_map(|e| e.ok()).filter(|e| e.file_name().to_string_lossy().ends_with(".safetensors")).filter_map(|e| e.metadata().ok()).map(|m| m.len()).sum())
        .unwrap_or(0)
}

fn ppl(bin: &Path, model: &Path, text: &Path, o: &Options) -> Result<f64> {
    let (so, _) = output(
        Command::new(bin)
            .args(["eval", "ppl", "--model"])
            .arg(model)
            .arg("--text")
            .arg(text)
            .args(["--seqlen", "256", "--max-windows", &o.ppl_windows.to_string(), "--max-chars", "20000", "--threads", &o.threads.to_string()]),
    )?;
    field(&so, "ppl=", "ppl").and_then(|v| v.parse().ok()).context("no ppl= line")
}

fn decode_speed(bin: &Path, model: &Path, o: &Options) -> Result<f64> {
    let mut v = Vec::new();
    for _ in 0..o.repeats.max(1) {
        let (_, se) = output(
            Command::new(bin)
                .args(["generate", "--model"])
                .arg(model)
                .args(["--prompt", "The history of the city begins", "--ignore-eos", "--max-new-tokens", "64", "--temperature", "0", "--threads", &o.threads.to_string()])
                .stdout(Stdio::null()),
        )?;
        v.push(parse_stats(&se)?.decode_tok_s);
    }
    Ok(min_med_max(&v).map_or(0.0, |m| m.1))
}

/// Recovery of the heads + neurons model by forward-KL distillation from the dense teacher
/// (`deco distill --objective kd`): steps, sequences per step, tokens per sequence, learning rate.
/// 60 × 4 × 128 = 30,720 training tokens, ~20 minutes on the 2 shared cores.
const DISTILL_STEPS: usize = 60;
const DISTILL_BATCH: usize = 4;
const DISTILL_SEQLEN: usize = 128;
const DISTILL_LR: &str = "3e-4";

/// `deco distill` of the pruned model `student` from the GGUF `teacher`, then the same
/// measurements as the pruned row. The calib-tokens column holds the training tokens and the
/// minutes column the distillation time.
fn distill_row(bin: &Path, teacher: &Path, student: &Path, label: &str, pattern: &str, params: &str, o: &Options) -> Result<Row> {
    let out = student.with_file_name(format!("{}-kd", student.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default()));
    let _ = fs::remove_dir_all(&out);
    let t0 = Instant::now();
    let (so, _) = output(
        Command::new(bin)
            .args(["distill", "--teacher"])
            .arg(teacher)
            .arg("--student")
            .arg(student)
            .args(["--objective", "kd", "--freeze-embeddings", "--seed", "0", "--checkpoint-every", "20"])
            .args(["--steps", &DISTILL_STEPS.to_string(), "--batch-size", &DISTILL_BATCH.to_string(), "--seqlen", &DISTILL_SEQLEN.to_string(), "--lr", DISTILL_LR])
            .args(["--threads", &o.threads.to_string()])
            .arg("--out")
            .arg(&out)
            .stderr(Stdio::inherit()),
    )?;
    let minutes = t0.elapsed().as_secs_f64() / 60.0;
    let tokens = field(&so, "[distill]", "tokens").and_then(|v| v.parse().ok()).unwrap_or(0);
    let model = out.join(format!("checkpoint-{DISTILL_STEPS:06}"));
    let wiki = o.cache.join("data/wiki_test.txt");
    let shakes = o.cache.join("data/shakespeare/test.txt");
    let row = Row {
        label: format!("{label} + KD {DISTILL_STEPS}×{DISTILL_BATCH}×{DISTILL_SEQLEN}"),
        kind: "structured + distill",
        pattern: pattern.to_string(),
        wiki: ppl(bin, &model, &wiki, o)?,
        shakespeare: ppl(bin, &model, &shakes, o)?,
        params: params.to_string(),
        file_mib: dir_size(&model) as f64 / 1048576.0,
        calib_tokens: tokens,
        minutes,
        decode_tok_s: Some(decode_speed(bin, &model, o)?),
    };
    let _ = fs::remove_dir_all(&out);
    Ok(row)
}

/// Runs the benchmark, prints the table and updates `docs/compression.md`.
pub fn run_bench(o: &Options) -> Result<()> {
    fetch::fetch(&fetch::Options { cache: o.cache.clone(), no_mirror: o.no_mirror, what: vec![What::Model, What::Data] })?;
    let model = o.cache.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let wiki = o.cache.join("data/wiki_test.txt");
    let shakes = o.cache.join("data/shakespeare/test.txt");
    let work = o.cache.join("bench/compress");
    fs::create_dir_all(&work)?;
    let bin = deco_binary(o.deco_bin.as_deref())?;
    let threads = o.threads.to_string();
    let wanted = |label: &str| o.only.as_deref().is_none_or(|only| only.split(',').any(|x| label.contains(x.trim())));

    let mut rows = Vec::new();
    let dense = work.join("dense-f32");
    if !dense.join("model.safetensors").is_file() {
        let _ = fs::remove_dir_all(&dense);
        run(Command::new(&bin).arg("convert").arg(&model).arg(&dense))?;
    }
    let dense_tok_s = decode_speed(&bin, &dense, o)?;
    rows.push(Row {
        label: "dense".into(),
        kind: "-",
        pattern: "-".into(),
        wiki: ppl(&bin, &dense, &wiki, o)?,
        shakespeare: ppl(&bin, &dense, &shakes, o)?,
        params: "134.5M (decoder 106.2M)".into(),
        file_mib: dir_size(&dense) as f64 / 1048576.0,
        calib_tokens: 0,
        minutes: 0.0,
        decode_tok_s: Some(dense_tok_s),
    });

    // (label, kind, args)
    let mut configs: Vec<(String, &'static str, Vec<String>)> = Vec::new();
    for m in ["magnitude", "wanda", "sparsegpt"] {
        configs.push((format!("{m} 50%"), "unstructured", vec!["--method".into(), m.into(), "--sparsity".into(), "0.5".into()]));
        configs.push((format!("{m} 2:4"), "N:M", vec!["--method".into(), m.into(), "--nm".into(), "2:4".into()]));
    }
    configs.push(("magnitude 50% sparse-format".into(), "storage", vec!["--method".into(), "magnitude".into(), "--sparsity".into(), "0.5".into(), "--format".into(), "sparse".into()]));
    configs.push(("magnitude 50% sparse-format bf16".into(), "storage", vec!["--method".into(), "magnitude".into(), "--sparsity".into(), "0.5".into(), "--format".into(), "sparse".into(), "--dtype".into(), "bf16".into()]));
    configs.push(("heads 6/9 + neurons 640/1536".into(), "structured", vec!["--method".into(), "heads,neurons".into(), "--sparsity".into(), "0.34,0.5834".into()]));
    configs.push(("layers 15/30".into(), "structured", vec!["--method".into(), "layers".into(), "--sparsity".into(), "0.5".into()]));
    for (label, kind, args) in configs {
        if !wanted(&label) {
            continue;
        }
        let out = work.join(label.replace([' ', '%', ':', '/', '+'], "_"));
        let _ = fs::remove_dir_all(&out);
        let t0 = Instant::now();
        let (so, _) = output(
            Command::new(&bin)
                .arg("prune")
                .arg("--model")
                .arg(&model)
                .args(&args)
                .args(["--nsamples", &o.nsamples.to_string(), "--seqlen", &o.seqlen.to_string(), "--seed", "0", "--calib", "wiki", "--threads", &threads])
                .arg("--out")
                .arg(&out)
                .stderr(Stdio::inherit()),
        )?;
        let minutes = t0.elapsed().as_secs_f64() / 60.0;
        let calib_tokens = field(&so, "[prune]", "calib_tokens").and_then(|v| v.parse().ok()).unwrap_or(0);
        let file_mib = dir_size(&out) as f64 / 1048576.0;
        let structured = kind == "structured";
        let storage = kind == "storage";
        let params = if structured {
            let p = field(&so, "[prune]", "params").unwrap_or_default();
            let d = field(&so, "[prune]", "decoder_params").unwrap_or_default();
            let m = |s: &str| s.split('/').next().and_then(|x| x.parse::<f64>().ok()).map_or("?".into(), |x| format!("{:.1}M", x / 1e6));
            format!("{} (decoder {})", m(&p), m(&d))
        } else {
            format!("134.5M, {} zero", field(&so, "[prune]", "sparsity").map_or("?".into(), |s| format!("{:.1}% decoder", s.parse::<f64>().unwrap_or(0.0) * 100.0)))
        };
        let (w, s) = if storage { (f64::NAN, f64::NAN) } else { (ppl(&bin, &out, &wiki, o)?, ppl(&bin, &out, &shakes, o)?) };
        let decode_tok_s = if structured { Some(decode_speed(&bin, &out, o)?) } else { None };
        let pattern = ["--nm", "--sparsity"].iter().find_map(|f| args.iter().position(|a| a == f).and_then(|i| args.get(i + 1))).cloned().unwrap_or_default();
        let recover = label.starts_with("heads 6/9 + neurons") && wanted(&format!("{label} + KD"));
        rows.push(Row { label: label.clone(), kind, pattern: pattern.clone(), wiki: w, shakespeare: s, params: params.clone(), file_mib, calib_tokens, minutes, decode_tok_s });
        if recover {
            rows.push(distill_row(&bin, &model, &out, &label, &pattern, &params, o)?);
        }
        let _ = fs::remove_dir_all(&out);
        eprintln!("{}", table(&rows));
    }
    let t = table(&rows);
    println!("{t}");
    let svg = plot(&rows);
    let root = util::workspace_root();
    fs::write(root.join("docs/compression.svg"), svg)?;
    let doc_path = root.join("docs/compression.md");
    let doc = fs::read_to_string(&doc_path).unwrap_or_else(|_| format!("# Compression\n\n{BEGIN}\n{END}\n"));
    let block = format!(
        "{BEGIN}\n<!-- generated by `cargo xtask bench compress` (nsamples {}, seqlen {}, {} ppl windows, {} threads) -->\n\n{t}\n![perplexity of pruned SmolLM2-135M](compression.svg)\n\n{END}",
        o.nsamples, o.seqlen, o.ppl_windows, o.threads
    );
    let new = match (doc.find(BEGIN), doc.find(END)) {
        (Some(a), Some(b)) if b > a => format!("{}{block}{}", &doc[..a], &doc[b + END.len()..]),
        _ => format!("{doc}\n{block}\n"),
    };
    fs::write(&doc_path, new)?;
    eprintln!("updated {}", doc_path.display());
    Ok(())
}

fn fmt(x: f64) -> String {
    if x.is_nan() { "-".into() } else { format!("{x:.2}") }
}

fn table(rows: &[Row]) -> String {
    let mut s = String::from("| model | kind | pattern | wiki ppl | shakespeare ppl | params | weights file (MiB) | calib tokens | minutes | decode tok/s |\n|---|---|---|---|---|---|---|---|---|---|\n");
    for r in rows {
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {:.0} | {} | {:.1} | {} |\n",
            r.label,
            r.kind,
            r.pattern,
            fmt(r.wiki),
            fmt(r.shakespeare),
            r.params,
            r.file_mib,
            r.calib_tokens,
            r.minutes,
            r.decode_tok_s.map_or("-".into(), |v| format!("{v:.1}"))
        ));
    }
    s
}

/// A horizontal bar chart of log10 perplexity (wiki and Shakespeare) per row, as plain SVG.
fn plot(rows: &[Row]) -> String {
    let rows: Vec<&Row> = rows.iter().filter(|r| r.wiki.is_finite()).collect();
    let (w, bar_h, left, top) = (760.0, 12.0, 250.0, 40.0);
    let h = top + rows.len() as f64 * (2.0 * bar_h + 10.0) + 40.0;
    let max = rows.iter().map(|r| r.wiki.max(r.shakespeare).log10()).fold(1.0f64, f64::max).ceil();
    let x = |v: f64| left + (v.log10() / max) * (w - left - 20.0);
    let mut s = format!("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n");
    s.push_str(&format!("<text x=\"{left}\" y=\"20\">perplexity (log scale): wiki (blue), Shakespeare (orange); SmolLM2-135M</text>\n"));
    for (i, r) in rows.iter().enumerate() {
        let y = top + i as f64 * (2.0 * bar_h + 10.0);
        s.push_str(&format!("<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text>\n", left - 6.0, y + bar_h + 4.0, r.label));
        for (j, (v, c)) in [(r.wiki, "#4878d0"), (r.shakespeare, "#ee854a")].iter().enumerate() {
            let yy = y + j as f64 * bar_h;
            s.push_str(&format!("<rect x=\"{left}\" y=\"{yy}\" width=\"{:.1}\" height=\"{}\" fill=\"{c}\"/>\n", (x(*v) - left).max(1.0), bar_h - 1.0));
            s.push_str(&format!("<text x=\"{:.1}\" y=\"{}\" font-size=\"10\">{v:.1}</text>\n", x(*v) + 3.0, yy + bar_h - 2.0));
        }
    }
    let ya = h - 30.0;
    for k in 0..=(max as i32) {
        let xv = x(10f64.powi(k));
        s.push_str(&format!("<line x1=\"{xv:.1}\" y1=\"{top}\" x2=\"{xv:.1}\" y2=\"{ya}\" stroke=\"#ccc\"/><text x=\"{xv:.1}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n", ya + 14.0, 10i64.pow(k as u32)));
    }
    s.push_str("</svg>\n");
    s
}
