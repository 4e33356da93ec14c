//! `cargo xtask bench quant`: post-training quantization of SmolLM2-135M through the `deco` CLI.
//!
//! For each configuration: `deco quantize --format fake` (its `[quantize]` line gives bits per
//! weight, bytes and the quantization time), then `deco eval kld` against the base GGUF on the
//! first 20,000 characters of `wiki_test.txt` and of `shakespeare/test.txt` (non-overlapping
//! 256-token windows, no BOS): perplexity, mean KL(base ‖ quantized) and top-1 agreement.
//! W8A8 (SmoothQuant) and LLM.int8() directories carry `deco_act_quant.json`, which `deco eval
//! kld` applies at run time. Each row's result is cached in `<cache>/quant/results/<row>.json`
//! (reused when its arguments match), so an interrupted run resumes. The table goes between the
//! `bench quant` markers of `docs/quantization.md`, the plots to `docs/quantization/*.svg`.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::bench::deco_binary;
use crate::fetch::{self, What};
use crate::util;

/// Options of `bench quant`.
#[derive(Debug, Clone)]
pub struct Options {
    /// The cache directory.
    pub cache: PathBuf,
    /// Ignore the local mirror.
    pub no_mirror: bool,
    /// Calibration windows (GPTQ, AWQ, SmoothQuant).
    pub nsamples: usize,
    /// Tokens per calibration window.
    pub seqlen: usize,
    /// Perplexity / KLD windows of 256 tokens per text.
    pub ppl_windows: usize,
    /// CPU threads of every deco run.
    pub threads: usize,
    /// Only rows whose label contains one of these (comma-separated).
    pub only: Option<String>,
    /// Use this deco binary instead of building deco-cli.
    pub deco_bin: Option<PathBuf>,
}

const BEGIN: &str = "<!-- bench quant begin -->";
const END: &str = "<!-- bench quant end -->";

#[derive(Debug, Clone)]
struct Row {
    method: String,
    scheme: String,
    bpw: f64,
    model_mb: f64,
    wiki: f64,
    shakespeare: f64,
    kld_wiki: f64,
    kld_shakespeare: f64,
    top1: f64,
    seconds: f64,
}

fn output(cmd: &mut Command) -> Result<String> {
    let shown = util::show(cmd);
    eprintln!("+ {shown}");
    let out = cmd.stdin(Stdio::null()).stderr(Stdio::inherit()).output().with_context(|| format!("cannot start `{shown}`"))?;
    if !out.status.success() {
        bail!("`{shown}` failed ({})", out.status);
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `key=value` of the last line of `text` containing `key=` (optionally starting with `prefix`).
fn field(text: &str, prefix: &str, key: &str) -> Option<f64> {
    let k = format!("{key}=");
    text.lines()
        .rev()
        .filter(|l| l.starts_with(prefix))
        .find_map(|l| l.split_whitespace().find_map(|kv| kv.strip_prefix(&k)))
        .and_then(|v| v.parse().ok())
}

struct Kld {
    ppl: f64,
    kld: f64,
    top1: f64,
}

fn kld(bin: &Path, model: &Path, reference: &Path, text: &Path, o: &Options) -> Result<Kld> {
    let so = output(
        Command::new(bin)
            .args(["eval", "kld", "--model"])
            .arg(model)
            .arg("--reference")
            .arg(reference)
            .arg("--text")
            .arg(text)
            .args(["--seqlen", "256", "--max-windows", &o.ppl_windows.to_string(), "--max-chars", "20000", "--threads", &o.threads.to_string()]),
    )?;
    Ok(Kld {
        ppl: field(&so, "ppl_model=", "ppl_model").context("no ppl_model= line")?,
        kld: field(&so, "kld=", "kld").context("no kld= line")?,
        top1: field(&so, "top1_agreement=", "top1_agreement").context("no top1_agreement= line")?,
    })
}

fn s(x: impl ToString) -> String {
    x.to_string()
}

/// The rows: (method, scheme, `deco quantize` arguments; empty = the f32 base).
fn configs() -> Vec<(&'static str, String, Vec<String>)> {
    let mut v: Vec<(&'static str, String, Vec<String>)> = vec![("f32", "-".into(), vec![])];
    // Most informative rows first (an interrupted run has them); the table keeps this order.
    for (scheme, bits, gs) in [("W4 g128", 4, 128i64), ("W3 g128", 3, 128)] {
        for m in ["rtn", "gptq", "awq"] {
            v.push((m, scheme.into(), vec![s("--method"), s(m), s("--bits"), s(bits), s("--group-size"), s(gs), s("--asym")]));
        }
        // GPTQ with act-order (`desc_act`): the ablation in docs/quantization.md shows that the
        // natural column order is what loses GPTQ its perplexity at W4 g128.
        v.push((
            "gptq",
            format!("{scheme} act-order"),
            vec![s("--method"), s("gptq"), s("--bits"), s(bits), s("--group-size"), s(gs), s("--asym"), s("--desc-act"), s("--mse"), s(0)],
        ));
        // + the MSE-optimal scale/zero search of GPTQModel's `mse` option (norm 2.4, deco's
        // default; the plain `gptq` rows have it too, the `act-order` row is min-max).
        v.push((
            "gptq",
            format!("{scheme} act-order mse"),
            vec![s("--method"), s("gptq"), s("--bits"), s(bits), s("--group-size"), s(gs), s("--asym"), s("--desc-act"), s("--mse"), s(2.4)],
        ));
    }
    v.push(("smoothquant", "W8A8 α=0.5".into(), vec![s("--method"), s("smoothquant"), s("--bits"), s(8), s("--alpha"), s(0.5)]));
    v.push(("llm.int8", "W8, |x|≥6 in float".into(), vec![s("--method"), s("int8"), s("--bits"), s(8), s("--threshold"), s(6.0)]));
    v.push(("nf4", "NF4 b64 DQ".into(), vec![s("--method"), s("nf4"), s("--bits"), s(4), s("--group-size"), s(64)]));
    for (scheme, bits, gs) in [("W4 per-channel", 4, -1i64), ("W8 per-channel", 8, -1)] {
        for m in ["rtn", "gptq", "awq"] {
            v.push((m, scheme.into(), vec![s("--method"), s(m), s("--bits"), s(bits), s("--group-size"), s(gs), s("--asym")]));
        }
    }
    v.push(("llm.int8", "W8, calib mean+3σ in float".into(), vec![s("--method"), s("int8"), s("--bits"), s(8), s("--auto-outliers")]));
    v
}

fn slug(method: &str, scheme: &str) -> String {
    format!("{method}-{scheme}").chars().map(|c| if c.is_ascii_alphanumeric() || c == '.' { c } else { '_' }).collect()
}

/// Runs the benchmark, prints the table and updates `docs/quantization.md` and its plots.
pub fn run(o: &Options) -> Result<()> {
    fetch::fetch(&fetch::Options { cache: o.cache.clone(), no_mirror: o.no_mirror, what: vec![What::Model, What::Data] })?;
    let model = o.cache.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let wiki = o.cache.join("data/wiki_test.txt");
    let shakes = o.cache.join("data/shakespeare/test.txt");
    let calib = o.cache.join("data/wiki_train.txt");
    let work = o.cache.join("quant");
    let results = work.join("results");
    fs::create_dir_all(&results)?;
    let bin = deco_binary(o.deco_bin.as_deref())?;
    let wanted = |label: &str| o.only.as_deref().is_none_or(|only| only.split(',').any(|x| label.contains(x.trim())));
    let mut rows = Vec::new();
    for (method, scheme, args) in configs() {
        let label = format!("{method} {scheme}");
        // Rows outside `--only` are not run, but their cached results stay in the table.
        let run_it = wanted(&label);
        let mut qargs = args.clone();
        if !args.is_empty() {
            qargs.extend([s("--calib"), calib.display().to_string(), s("--nsamples"), s(o.nsamples), s("--seqlen"), s(o.seqlen), s("--seed"), s(0)]);
            qargs.extend([s("--format"), s("fake"), s("--threads"), s(o.threads)]);
        }
        let key = json!({"args": qargs, "ppl_windows": o.ppl_windows, "model": model});
        let file = results.join(format!("{}.json", slug(method, &scheme)));
        if let Ok(text) = fs::read_to_string(&file)
            && let Ok(v) = serde_json::from_str::<Value>(&text)
            && v["key"] == key
        {
            eprintln!("bench quant: {label}: cached ({})", file.display());
            rows.push(row_of(method, &scheme, &v["row"]));
            continue;
        }
        if !run_it {
            continue;
        }
        let (bpw, model_mb, seconds, evaluated) = if args.is_empty() {
            (32.0, 0.0, 0.0, model.clone())
        } else {
            let out = work.join(slug(method, &scheme));
            let _ = fs::remove_dir_all(&out);
            let so = output(Command::new(&bin).arg("quantize").arg("--model").arg(&model).args(&qargs).arg("--out").arg(&out))?;
            let get = |k: &str| field(&so, "[quantize]", k).with_context(|| format!("no {k}= in deco quantize's [quantize] line"));
            (get("bits_per_weight")?, get("model_bytes")? / 1e6, get("seconds")?, out)
        };
        let kw = kld(&bin, &evaluated, &model, &wiki, o)?;
        let ks = kld(&bin, &evaluated, &model, &shakes, o)?;
        if evaluated != model {
            let _ = fs::remove_dir_all(&evaluated);
        }
        let model_mb = if args.is_empty() { f32_model_mb() } else { model_mb };
        let r = json!({
            "bpw": bpw, "model_mb": model_mb, "seconds": seconds,
            "wiki": kw.ppl, "shakespeare": ks.ppl, "kld_wiki": kw.kld, "kld_shakespeare": ks.kld,
            "top1": (kw.top1 + ks.top1) / 2.0,
        });
        let tmp = file.with_extension("json.tmp");
        fs::write(&tmp, serde_json::to_string_pretty(&json!({"key": key, "row": r}))?)?;
        fs::rename(&tmp, &file)?;
        rows.push(row_of(method, &scheme, &r));
        eprintln!("{}", table(&rows));
    }
    let t = table(&rows);
    println!("{t}");
    let root = util::workspace_root();
    let plot_dir = root.join("docs/quantization");
    fs::create_dir_all(&plot_dir)?;
    fs::write(plot_dir.join("ppl_vs_bits.svg"), plot(&rows, Metric::WikiPpl)?)?;
    fs::write(plot_dir.join("kld_vs_bits.svg"), plot(&rows, Metric::Kld)?)?;
    let doc_path = root.join("docs/quantization.md");
    let doc = fs::read_to_string(&doc_path).unwrap_or_else(|_| format!("# Quantization\n\n{BEGIN}\n{END}\n"));
    let block = format!(
        "{BEGIN}\n<!-- generated by `cargo xtask bench quant` (calibration {} × {} tokens of wiki_train, {} windows × 256 per text, {} threads) -->\n\n{t}\n![wiki perplexity vs bits per weight](quantization/ppl_vs_bits.svg)\n![KLD to the base vs bits per weight](quantization/kld_vs_bits.svg)\n\n{END}",
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

/// SmolLM2-135M in f32: 134.5M parameters × 4 bytes.
fn f32_model_mb() -> f64 {
    134_515_008.0 * 4.0 / 1e6
}

fn row_of(method: &str, scheme: &str, v: &Value) -> Row {
    let f = |k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    Row {
        method: method.into(),
        scheme: scheme.into(),
        bpw: f("bpw"),
        model_mb: f("model_mb"),
        wiki: f("wiki"),
        shakespeare: f("shakespeare"),
        kld_wiki: f("kld_wiki"),
        kld_shakespeare: f("kld_shakespeare"),
        top1: f("top1"),
        seconds: f("seconds"),
    }
}

fn table(rows: &[Row]) -> String {
    let mut t = String::from(
        "| method | scheme | bits/weight (linears) | model MB | wiki ppl | shakespeare ppl | KLD wiki | KLD shakespeare | top-1 | quant time (s) |\n|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        t.push_str(&format!(
            "| {} | {} | {:.3} | {:.1} | {:.3} | {:.3} | {:.4} | {:.4} | {:.3} | {} |\n",
            r.method,
            r.scheme,
            r.bpw,
            r.model_mb,
            r.wiki,
            r.shakespeare,
            r.kld_wiki,
            r.kld_shakespeare,
            r.top1,
            if r.method == "f32" { "-".into() } else { format!("{:.1}", r.seconds) }
        ));
    }
    t
}

#[derive(Clone, Copy, PartialEq)]
enum Metric {
    WikiPpl,
    Kld,
}

/// A scatter/line plot of `metric` (log scale) against bits per weight, one series per method.
fn plot(rows: &[Row], metric: Metric) -> Result<String> {
    use plotters::prelude::*;
    let val = |r: &Row| match metric {
        Metric::WikiPpl => r.wiki,
        Metric::Kld => (r.kld_wiki + r.kld_shakespeare) / 2.0,
    };
    let pts: Vec<&Row> = rows.iter().filter(|r| r.method != "f32" && val(r).is_finite() && val(r) > 0.0).collect();
    let (lo, hi) = pts.iter().map(|r| val(r)).fold((f64::MAX, f64::MIN), |(a, b), v| (a.min(v), b.max(v)));
    let (lo, hi) = if lo <= hi { (lo / 1.5, hi * 1.5) } else { (1.0, 10.0) };
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (800, 500)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| anyhow::anyhow!("{e:?}"))?;
        let title = match metric {
            Metric::WikiPpl => "SmolLM2-135M: wiki_test perplexity vs bits per weight",
            Metric::Kld => "SmolLM2-135M: mean KL(base || quantized) vs bits per weight",
        };
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(2.5f64..8.5f64, (lo..hi).log_scale())
            .map_err(|e| anyhow::anyhow!("{e:?}"))?;
        chart
            .configure_mesh()
            .x_desc("bits per weight (linears, parameters included)")
            .y_desc(if metric == Metric::WikiPpl { "perplexity (log)" } else { "KLD (log)" })
            .draw()
            .map_err(|e| anyhow::anyhow!("{e:?}"))?;
        if metric == Metric::WikiPpl
            && let Some(base) = rows.iter().find(|r| r.method == "f32")
        {
            let b = base.wiki;
            chart
                .draw_series(LineSeries::new(vec![(2.5, b), (8.5, b)], BLACK.stroke_width(1)))
                .map_err(|e| anyhow::anyhow!("{e:?}"))?
                .label(format!("f32 ({b:.2})"))
                .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], BLACK));
        }
        let series = ["rtn", "gptq", "awq", "nf4", "smoothquant", "llm.int8"];
        for (i, m) in series.iter().enumerate() {
            let c = Palette99::pick(i).to_rgba();
            // Per-channel and grouped points are separate lines (same colour, different marks).
            let mut p: Vec<(f64, f64)> = pts.iter().filter(|r| r.method == *m).map(|r| (r.bpw, val(r))).collect();
            if p.is_empty() {
                continue;
            }
            p.sort_by(|a, b| a.0.total_cmp(&b.0));
            chart
                .draw_series(p.iter().map(|&(x, y)| Circle::new((x, y), 5, c.filled())))
                .map_err(|e| anyhow::anyhow!("{e:?}"))?
                .label(*m)
                .legend(move |(x, y)| Circle::new((x + 9, y), 5, c.filled()));
            let grouped: Vec<(f64, f64)> =
                pts.iter().filter(|r| r.method == *m && !r.scheme.contains("per-channel")).map(|r| (r.bpw, val(r))).collect();
            if grouped.len() > 1 {
                let mut g = grouped;
                g.sort_by(|a, b| a.0.total_cmp(&b.0));
                chart.draw_series(LineSeries::new(g, c.stroke_width(2))).map_err(|e| anyhow::anyhow!("{e:?}"))?;
            }
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| anyhow::anyhow!("{e:?}"))?;
        root.present().map_err(|e| anyhow::anyhow!("{e:?}"))?;
    }
    Ok(svg)
}
