//! `cargo xtask bench serve`: the serving benchmark and load test of issue 6.
//!
//! Builds and runs the `serve_bench` example of deco-serve (`crates/deco-serve/examples/
//! serve_bench.rs`: the OpenAI-compatible server in-process on a loopback port, raw HTTP/1.1
//! streaming clients) `--repeats` times on SmolLM2-135M-Instruct Q4_1, parses its table
//! (aggregate tok/s, TTFT and inter-token latency p50/p99 at 1, 4, 16 and 64 concurrent
//! streams), its load-test line (1,000 requests from 64 clients, failures, KV blocks left in use)
//! and its peak RSS, and prints the medians with the ratio of each aggregate throughput to the
//! single-stream one (goal: ≥ 4× at 16 streams). Writes the section between
//! `<!-- bench serve begin -->` and `<!-- bench serve end -->` of `docs/serving.md` and the plot
//! `docs/serving/throughput.svg`; each run's raw output is kept in `<cache>/serve/run-<i>.txt`.
//!
//! `cargo xtask bench serve --soak` instead builds the release `deco` and deco-cli's
//! `serve_soak` example (`crates/deco-cli/tests/soak/mod.rs`), runs the soak and fault test
//! against the real `deco serve` process and writes its report between `<!-- soak begin -->` and
//! `<!-- soak end -->` of `docs/reliability.md` (JSON and server log in `<cache>/soak/`).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};

use crate::fetch::{self, What};
use crate::{bench, util};

/// Options of `bench serve`.
pub struct Options {
    pub cache: PathBuf,
    pub no_mirror: bool,
    /// Runs of the whole benchmark (medians are reported).
    pub repeats: usize,
    /// One request per stream and 128 load-test requests (a smoke run; not for the docs).
    pub quick: bool,
    /// Do not rewrite docs/serving.md and the plot.
    pub no_docs: bool,
    /// Use this serve_bench binary instead of building the example.
    pub bench_bin: Option<PathBuf>,
    /// 8-bit activations in the packed matmuls (`deco serve --q8-activations`).
    pub q8_activations: bool,
}

/// Options of `bench serve --soak`.
pub struct SoakOptions {
    pub cache: PathBuf,
    pub no_mirror: bool,
    pub requests: usize,
    pub clients: usize,
    pub seed: u64,
    pub kv_cache_mib: usize,
    /// Do not rewrite docs/reliability.md.
    pub no_docs: bool,
}

/// Replaces the text between `begin` and `end` of the file at `path` (appends the section when
/// the markers are missing).
fn splice_file(path: &Path, begin: &str, end: &str, md: &str) -> Result<()> {
    let old = match fs::read_to_string(path) {
        Ok(s) => s,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    };
    let new = match (old.find(begin), old.find(end)) {
        (Some(b), Some(e)) if e > b => format!("{}{begin}\n{md}\n{}", &old[..b], &old[e..]),
        _ => format!("{old}\n{begin}\n{md}\n{end}\n"),
    };
    fs::write(path, new).with_context(|| format!("cannot write {}", path.display()))
}

/// Runs the soak (see the module docs); fails when a check fails, after writing the report.
pub fn soak(o: &SoakOptions) -> Result<()> {
    fetch::fetch(&fetch::Options { cache: o.cache.clone(), no_mirror: o.no_mirror, what: vec![What::Model] })?;
    let model = o.cache.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    util::run(util::cargo().args(["build", "--release", "-p", "deco-cli", "--bin", "deco", "--example", "serve_soak"]))
        .context("cannot build deco and the serve_soak example of deco-cli")?;
    let release = bench::target_dir()?.join("release");
    let work = o.cache.join("soak");
    fs::create_dir_all(&work)?;
    let loadavg = fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let json = work.join("report.json");
    let mut cmd = Command::new(release.join("examples/serve_soak"));
    cmd.arg("--deco").arg(release.join("deco")).arg("--model").arg(&model);
    cmd.args(["--requests", &o.requests.to_string(), "--clients", &o.clients.to_string(), "--seed", &o.seed.to_string()]);
    cmd.args(["--kv-cache-mib", &o.kv_cache_mib.to_string()]).arg("--out").arg(&json).arg("--log").arg(work.join("serve.log"));
    cmd.stderr(Stdio::inherit());
    eprintln!("+ {}", util::show(&cmd));
    let out = cmd.output().context("cannot run serve_soak")?;
    let report = String::from_utf8_lossy(&out.stdout).into_owned();
    println!("{report}");
    if !matches!(out.status.code(), Some(0 | 1)) {
        bail!("serve_soak could not run ({}); see {}", out.status, work.join("serve.log").display());
    }
    let date = bench::command_stdout("date", &["-u", "+%Y-%m-%d %H:%M UTC"]);
    let commit = bench::command_stdout("git", &["rev-parse", "--short", "HEAD"]);
    let cpu = fs::read_to_string("/proc/cpuinfo").ok().and_then(|c| c.lines().find_map(|l| l.strip_prefix("model name")?.split(':').nth(1).map(|s| s.trim().to_string()))).unwrap_or_default();
    let md = format!(
        "Measured by `cargo xtask bench serve --soak --requests {} --clients {} --seed {} --kv-cache-mib {}` on {date} at commit `{commit}`, {} ({} cores; load average before: {}). \
         Server: `deco serve` (release) on SmolLM2-135M-Instruct Q4_1, flex CPU backend, defaults otherwise (block size 16, `max_num_seqs` 64, `max_num_batched_tokens` 512).\n\n{report}",
        o.requests, o.clients, o.seed, o.kv_cache_mib, cpu, std::thread::available_parallelism().map_or(0, |n| n.get()), loadavg.trim()
    );
    if !o.no_docs {
        let path = util::workspace_root().join("docs/reliability.md");
        splice_file(&path, "<!-- soak begin -->", "<!-- soak end -->", md.trim_end())?;
        eprintln!("wrote {}", path.display());
    }
    if out.status.code() != Some(0) {
        bail!("the soak failed a check (report above, JSON in {})", json.display());
    }
    Ok(())
}

/// One row of serve_bench's table.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub streams: usize,
    pub requests: usize,
    pub tokens: usize,
    pub wall_s: f64,
    pub tok_s: f64,
    pub ttft_p50: f64,
    pub ttft_p99: f64,
    pub itl_p50: f64,
    pub itl_p99: f64,
}

/// Everything one serve_bench run printed.
#[derive(Debug, Clone, PartialEq)]
pub struct Run {
    pub rows: Vec<Row>,
    /// The load-test line, verbatim.
    pub load_test: String,
    /// The structured-output line (`structured output (json_object): ...`), if printed.
    pub structured: String,
    pub failed: Option<usize>,
    pub blocks_used: Option<usize>,
    pub peak_rss_mib: Option<f64>,
}

/// Parses serve_bench's standard output.
///
/// # Errors
/// When the table has no data row or a row has the wrong number of cells.
pub fn parse(out: &str) -> Result<Run> {
    let mut rows = Vec::new();
    for line in out.lines() {
        let cells: Vec<&str> = line.trim().trim_matches('|').split('|').map(str::trim).collect();
        if !line.trim_start().starts_with('|') || cells.first().is_none_or(|c| c.parse::<usize>().is_err()) {
            continue;
        }
        if cells.len() != 9 {
            bail!("serve_bench row with {} cells instead of 9: {line}", cells.len());
        }
        let f = |i: usize| cells[i].parse::<f64>().with_context(|| format!("cell {i} of `{line}` is not a number"));
        rows.push(Row {
            streams: cells[0].parse()?,
            requests: cells[1].parse()?,
            tokens: cells[2].parse()?,
            wall_s: f(3)?,
            tok_s: f(4)?,
            ttft_p50: f(5)?,
            ttft_p99: f(6)?,
            itl_p50: f(7)?,
            itl_p99: f(8)?,
        });
    }
    if rows.is_empty() {
        bail!("serve_bench printed no table rows");
    }
    let load_test = out.lines().find(|l| l.starts_with("load test:")).unwrap_or("").to_string();
    let structured = out.lines().find(|l| l.starts_with("structured output")).unwrap_or("").to_string();
    let number_before = |s: &str, word: &str| -> Option<usize> {
        let i = s.find(word)?;
        s[..i].split_whitespace().last()?.parse().ok()
    };
    let failed = number_before(&load_test, " failed");
    let blocks_used = load_test
        .split("deco_kv_blocks_used ")
        .nth(1)
        .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok());
    let peak_rss_mib = out
        .lines()
        .find_map(|l| l.strip_prefix("peak RSS (VmHWM): "))
        .and_then(|r| r.split_whitespace().next()?.parse().ok());
    Ok(Run { rows, load_test, structured, failed, blocks_used, peak_rss_mib })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.retain(|x| x.is_finite());
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 }
}

/// Medians over runs, per stream count (the stream counts of the first run).
pub fn median_rows(runs: &[Run]) -> Vec<Row> {
    let Some(first) = runs.first() else { return Vec::new() };
    first
        .rows
        .iter()
        .map(|r0| {
            let same: Vec<&Row> = runs.iter().filter_map(|r| r.rows.iter().find(|x| x.streams == r0.streams)).collect();
            let m = |g: fn(&Row) -> f64| median(same.iter().map(|r| g(r)).collect());
            Row {
                streams: r0.streams,
                requests: r0.requests,
                tokens: r0.tokens,
                wall_s: m(|r| r.wall_s),
                tok_s: m(|r| r.tok_s),
                ttft_p50: m(|r| r.ttft_p50),
                ttft_p99: m(|r| r.ttft_p99),
                itl_p50: m(|r| r.itl_p50),
                itl_p99: m(|r| r.itl_p99),
            }
        })
        .collect()
}

/// Runs the benchmark, prints the table and (unless `no_docs`) updates docs/serving.md.
pub fn run(o: &Options) -> Result<()> {
    if o.repeats == 0 {
        bail!("--repeats must be at least 1");
    }
    fetch::fetch(&fetch::Options { cache: o.cache.clone(), no_mirror: o.no_mirror, what: vec![What::Model] })?;
    let model = o.cache.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let bin = match &o.bench_bin {
        Some(b) => b.clone(),
        None => {
            util::run(util::cargo().args(["build", "--release", "-p", "deco-serve", "--example", "serve_bench"]))
                .context("cannot build the serve_bench example of deco-serve")?;
            bench::target_dir()?.join("release/examples/serve_bench")
        }
    };
    if !bin.is_file() {
        bail!("{} not found after building it", bin.display());
    }
    let work = o.cache.join("serve");
    fs::create_dir_all(&work)?;
    let loadavg = fs::read_to_string("/proc/loadavg").unwrap_or_default();
    eprintln!("load average before the benchmark: {}", loadavg.trim());
    let mut runs = Vec::new();
    for i in 0..o.repeats {
        let mut cmd = Command::new(&bin);
        cmd.arg(&model).stderr(Stdio::inherit());
        if o.quick {
            cmd.arg("--quick");
        }
        if o.q8_activations {
            cmd.arg("--q8-activations");
        }
        eprintln!("[{}/{}] + {}", i + 1, o.repeats, util::show(&cmd));
        let out = cmd.output().with_context(|| format!("cannot run {}", bin.display()))?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        fs::write(work.join(format!("run-{i}.txt")), &text)?;
        if !out.status.success() {
            bail!("serve_bench failed ({}); its output:\n{text}", out.status);
        }
        let r = parse(&text)?;
        eprintln!("{text}");
        runs.push(r);
    }
    let md = render(o, &runs, loadavg.trim());
    println!("{md}");
    if !o.no_docs {
        let docs = util::workspace_root().join("docs");
        fs::create_dir_all(docs.join("serving"))?;
        plot(&docs.join("serving/throughput.svg"), &runs)?;
        let path = docs.join("serving.md");
        splice_file(&path, "<!-- bench serve begin -->", "<!-- bench serve end -->", &md)?;
        eprintln!("wrote {} and docs/serving/throughput.svg", path.display());
    }
    Ok(())
}

fn fmt(x: f64, p: usize) -> String {
    if x.is_finite() { format!("{x:.p$}") } else { "–".into() }
}

/// The markdown section: medians, ratios to one stream, every run's tok/s, the load tests.
pub fn render(o: &Options, runs: &[Run], loadavg: &str) -> String {
    let rows = median_rows(runs);
    let single = rows.iter().find(|r| r.streams == 1).map_or(f64::NAN, |r| r.tok_s);
    let date = bench::command_stdout("date", &["-u", "+%Y-%m-%d %H:%M UTC"]);
    let commit = bench::command_stdout("git", &["rev-parse", "--short", "HEAD"]);
    let mut s = String::new();
    s.push_str(&format!(
        "Measured by `cargo xtask bench serve{}{}{}` on {date} at commit `{commit}` ({} run{}, medians; load average before: {loadavg}). \
         SmolLM2-135M-Instruct Q4_1 (packed weights{}), flex CPU backend, all cores, block size 16, 1024 blocks, \
         `max_num_seqs` 64, `max_num_batched_tokens` 512; each request streams exactly 32 tokens (temperature 0.8, distinct seeds).\n\n",
        if o.quick { " --quick" } else { "" },
        if o.repeats != 1 { format!(" --repeats {}", o.repeats) } else { String::new() },
        if o.q8_activations { " --q8-activations" } else { "" },
        runs.len(),
        if runs.len() == 1 { "" } else { "s" },
        if o.q8_activations { ", 8-bit activations with integer dot products as `deco serve --q8-activations`" } else { ", f32 activations" }
    ));
    s.push_str("| streams | requests | aggregate tok/s | × 1 stream | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | tok/s of each run |\n");
    s.push_str("|---|---|---|---|---|---|---|---|---|\n");
    for r in &rows {
        let each: Vec<String> = runs.iter().filter_map(|x| x.rows.iter().find(|y| y.streams == r.streams)).map(|y| fmt(y.tok_s, 1)).collect();
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            r.streams,
            r.requests,
            fmt(r.tok_s, 1),
            fmt(r.tok_s / single, 2),
            fmt(r.ttft_p50, 0),
            fmt(r.ttft_p99, 0),
            fmt(r.itl_p50, 0),
            fmt(r.itl_p99, 0),
            each.join(", ")
        ));
    }
    if let Some(r16) = rows.iter().find(|r| r.streams == 16) {
        let ratio = r16.tok_s / single;
        let verdict = if !ratio.is_finite() {
            "no single-stream row to compare with".to_string()
        } else if ratio >= 4.0 {
            "met".to_string()
        } else {
            format!("missed by {} %", fmt(100.0 * (1.0 - ratio / 4.0), 0))
        };
        s.push_str(&format!(
            "\nGoal of issue 6: aggregate throughput at 16 streams ≥ 4× one stream. Measured: **{}×** ({verdict}).\n",
            fmt(ratio, 2),
        ));
    }
    let structured: Vec<&str> = runs.iter().map(|r| r.structured.as_str()).filter(|l| !l.is_empty()).collect();
    if !structured.is_empty() {
        s.push_str("\nStructured output, per-token cost of the grammar mask (one line per run; the mask is computed on the engine thread for each constrained sequence of a step, so at 16 streams its share is 16 masks per ITL):\n\n");
        for (i, l) in structured.iter().enumerate() {
            s.push_str(&format!("- run {}: {l}\n", i + 1));
        }
    }
    s.push_str("\nLoad tests (one per run):\n\n");
    for (i, r) in runs.iter().enumerate() {
        s.push_str(&format!(
            "- run {}: {} — failed requests: {}, KV blocks in use afterwards: {}, peak RSS {} MiB\n",
            i + 1,
            r.load_test.trim_start_matches("load test: "),
            r.failed.map_or("?".into(), |v| v.to_string()),
            r.blocks_used.map_or("?".into(), |v| v.to_string()),
            r.peak_rss_mib.map_or("?".into(), |v| fmt(v, 0))
        ));
    }
    s.push_str("\n![aggregate throughput vs concurrent streams](serving/throughput.svg)\n");
    s
}

fn plot(path: &Path, runs: &[Run]) -> Result<()> {
    use plotters::prelude::*;
    let rows = median_rows(runs);
    let single = rows.iter().find(|r| r.streams == 1).map_or(f64::NAN, |r| r.tok_s);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (900, 420)).into_drawing_area();
        let draw = || -> std::result::Result<(), Box<dyn std::error::Error + '_>> {
            root.fill(&WHITE)?;
            let areas = root.split_evenly((1, 2));
            let xs = |n: usize| (n as f64).log2();
            let ymax = runs.iter().flat_map(|r| r.rows.iter().map(|x| x.tok_s)).chain([4.0 * single]).filter(|v| v.is_finite()).fold(1.0f64, f64::max) * 1.15;
            let mut chart = ChartBuilder::on(&areas[0])
                .caption("Aggregate decode throughput", ("sans-serif", 16))
                .margin(10)
                .x_label_area_size(40)
                .y_label_area_size(55)
                .build_cartesian_2d(-0.3f64..6.3, 0.0..ymax)?;
            chart
                .configure_mesh()
                .light_line_style(WHITE)
                .x_labels(7)
                .x_label_formatter(&|v| format!("{}", 2f64.powf(v.round()) as usize))
                .x_desc("concurrent streams")
                .y_desc("generated tok/s")
                .draw()?;
            chart
                .draw_series(LineSeries::new(rows.iter().map(|r| (xs(r.streams), r.tok_s)), BLUE.stroke_width(2)).point_size(4))?
                .label("deco (median)")
                .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], BLUE.stroke_width(2)));
            for r in runs {
                chart.draw_series(r.rows.iter().map(|x| Circle::new((xs(x.streams), x.tok_s), 3, BLUE.mix(0.35).filled())))?;
            }
            chart
                .draw_series(LineSeries::new(vec![(-0.3, 4.0 * single), (6.3, 4.0 * single)], RED.mix(0.6)))?
                .label("goal: 4 × one stream")
                .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], RED.mix(0.6)));
            chart.configure_series_labels().position(SeriesLabelPosition::LowerRight).background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
            let lmax = rows.iter().map(|r| r.itl_p99.max(r.ttft_p50)).filter(|v| v.is_finite()).fold(1.0f64, f64::max) * 1.15;
            let mut lat = ChartBuilder::on(&areas[1])
                .caption("Latency", ("sans-serif", 16))
                .margin(10)
                .x_label_area_size(40)
                .y_label_area_size(55)
                .build_cartesian_2d(-0.3f64..6.3, 0.0..lmax)?;
            lat.configure_mesh()
                .light_line_style(WHITE)
                .x_labels(7)
                .x_label_formatter(&|v| format!("{}", 2f64.powf(v.round()) as usize))
                .x_desc("concurrent streams")
                .y_desc("ms")
                .draw()?;
            for (name, color, get) in [
                ("TTFT p50", GREEN, (|r: &Row| r.ttft_p50) as fn(&Row) -> f64),
                ("ITL p50", BLUE, |r: &Row| r.itl_p50),
                ("ITL p99", MAGENTA, |r: &Row| r.itl_p99),
            ] {
                lat.draw_series(LineSeries::new(rows.iter().map(|r| (xs(r.streams), get(r))), color.stroke_width(2)).point_size(3))?
                    .label(name)
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
            }
            lat.configure_series_labels().position(SeriesLabelPosition::UpperLeft).background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
            root.present()?;
            Ok(())
        };
        draw().map_err(|e| anyhow::anyhow!("plot failed: {e}"))?;
    }
    fs::write(path, svg).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const OUT: &str = "| streams | requests | generated tok | wall s | aggregate tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |
|---|---|---|---|---|---|---|---|---|
| 1 | 3 | 96 | 2.5 | 39.0 | 107 | 119 | 24 | 29 |
| 16 | 32 | 1024 | 13.6 | 75.5 | 1384 | 1909 | 143 | 268 |

load test: 1000 requests from 64 clients in 207.0 s: 1000 ok, 0 failed, 9000 streamed chunks (43.5/s); deco_kv_blocks_used 0; deco_preemptions_total 0; deco_prefix_cache_hit_tokens_total 5184
peak RSS (VmHWM): 988 MiB
";

    #[test]
    fn parses_table_and_load_test() {
        let r = parse(OUT).expect("parse");
        assert_eq!(r.rows.len(), 2);
        assert_eq!(r.rows[1].streams, 16);
        assert_eq!(r.rows[1].tok_s, 75.5);
        assert_eq!(r.rows[0].itl_p99, 29.0);
        assert_eq!(r.failed, Some(0));
        assert_eq!(r.blocks_used, Some(0));
        assert_eq!(r.peak_rss_mib, Some(988.0));
        assert!(parse("no table").is_err());
        assert!(parse("| 1 | 2 | 3 |").is_err());
    }

    #[test]
    fn medians_per_stream_count() {
        let a = parse(OUT).expect("parse");
        let mut b = a.clone();
        b.rows[1].tok_s = 80.5;
        let mut c = a.clone();
        c.rows[1].tok_s = 100.0;
        let m = median_rows(&[a, b, c]);
        assert_eq!(m[1].tok_s, 80.5);
        assert_eq!(m[0].tok_s, 39.0);
    }
}
