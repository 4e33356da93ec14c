//! `cargo xtask bench generate`: deco vs llama.cpp on the same GGUF, same prompt, same threads.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::fetch::{self, What};
use crate::python;
use crate::util::{self, run, show};

/// The llama-cpp-python release the llama.cpp side is built from (vendored llama.cpp sources).
pub const LLAMA_CPP_PYTHON: &str = "llama-cpp-python==0.3.36";

/// Options of `bench generate`.
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    /// The cache directory.
    pub cache: PathBuf,
    /// Ignore the local mirror.
    pub no_mirror: bool,
    /// Threads for both engines.
    pub threads: usize,
    /// Measured repeats per engine.
    pub repeats: usize,
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub decode_tokens: usize,
    /// Only run llama.cpp.
    pub skip_deco: bool,
    /// Only run deco.
    pub skip_llama: bool,
    /// Use this deco binary instead of building `deco-cli` in release mode.
    pub deco_bin: Option<PathBuf>,
}

/// Throughput numbers of one run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Stats {
    /// Prompt tokens evaluated.
    pub prompt_tokens: u64,
    /// Prefill throughput.
    pub prompt_tok_s: f64,
    /// Generated tokens.
    pub decode_tokens: u64,
    /// Decode throughput.
    pub decode_tok_s: f64,
}

/// Parses deco's last stderr line:
/// `[stats] prompt_tokens=N prompt_tok_s=X.XX decode_tokens=M decode_tok_s=Y.YY`.
/// Looks at the last line starting with `[stats]`.
pub fn parse_stats(stderr: &str) -> Result<Stats> {
    let line = stderr
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| l.starts_with("[stats]"))
        .context("no `[stats]` line on deco's stderr")?;
    let mut prompt_tokens = None;
    let mut prompt_tok_s = None;
    let mut decode_tokens = None;
    let mut decode_tok_s = None;
    for kv in line["[stats]".len()..].split_whitespace() {
        let (k, v) = kv
            .split_once('=')
            .with_context(|| format!("bad field `{kv}` in `{line}`"))?;
        let bad = || format!("bad value in `{kv}` of `{line}`");
        match k {
            "prompt_tokens" => prompt_tokens = Some(v.parse::<u64>().with_context(bad)?),
            "prompt_tok_s" => prompt_tok_s = Some(v.parse::<f64>().with_context(bad)?),
            "decode_tokens" => decode_tokens = Some(v.parse::<u64>().with_context(bad)?),
            "decode_tok_s" => decode_tok_s = Some(v.parse::<f64>().with_context(bad)?),
            _ => {} // tolerate extra fields
        }
    }
    let missing = |n: &str| format!("`{line}` has no {n}=");
    Ok(Stats {
        prompt_tokens: prompt_tokens.with_context(|| missing("prompt_tokens"))?,
        prompt_tok_s: prompt_tok_s.with_context(|| missing("prompt_tok_s"))?,
        decode_tokens: decode_tokens.with_context(|| missing("decode_tokens"))?,
        decode_tok_s: decode_tok_s.with_context(|| missing("decode_tok_s"))?,
    })
}

/// min, median, max of a non-empty sample.
pub fn min_med_max(xs: &[f64]) -> Option<(f64, f64, f64)> {
    if xs.is_empty() {
        return None;
    }
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let med = if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    };
    Some((v[0], med, v[n - 1]))
}

/// Runs the benchmark and prints the table.
pub fn generate(o: &GenerateOptions) -> Result<()> {
    if o.repeats == 0 || o.prompt_tokens < 8 || o.decode_tokens == 0 || o.threads == 0 {
        bail!("need --repeats >= 1, --prompt-tokens >= 8, --decode-tokens >= 1, --threads >= 1");
    }
    fetch::fetch(&fetch::Options {
        cache: o.cache.clone(),
        no_mirror: o.no_mirror,
        what: vec![What::Model, What::Data],
    })?;
    let model = o.cache.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let text = o.cache.join("data/wiki_test.txt");
    let out_dir = o.cache.join("bench");
    fs::create_dir_all(&out_dir)?;
    let prompt_file = out_dir.join(format!("prompt-{}.txt", o.prompt_tokens));
    let loadavg = fs::read_to_string("/proc/loadavg").unwrap_or_default();
    eprintln!("load average before the benchmark: {}", loadavg.trim());
    warn_if_busy(&loadavg);

    let py = if o.skip_llama {
        None
    } else {
        let py = python::venv_python(&o.cache)?;
        eprintln!(
            "llama.cpp side: {LLAMA_CPP_PYTHON} in {} (first install compiles llama.cpp from \
             source: 10+ minutes on 2 cores)",
            py.display()
        );
        python::ensure_packages(
            &py,
            "import llama_cpp, numpy; assert llama_cpp.__version__ == '0.3.36'",
            &["--no-cache-dir", LLAMA_CPP_PYTHON],
            &[("CMAKE_BUILD_PARALLEL_LEVEL", &o.threads.to_string())],
        )?;
        Some(py)
    };
    let deco = if o.skip_deco {
        None
    } else {
        Some(deco_binary(o.deco_bin.as_deref()).context("use --skip-deco to run llama.cpp only")?)
    };

    let mut llama_runs: Vec<Stats> = Vec::new();
    let mut deco_runs: Vec<Stats> = Vec::new();
    let mut llama_info = Value::Null;
    // Interleave the engines so slow drifts of a shared machine hit both alike.
    for r in 0..o.repeats {
        if let Some(py) = &py {
            let v = run_llama(py, &model, &text, &prompt_file, o)?;
            let run0 = &v["runs"][0];
            let s = Stats {
                prompt_tokens: v["prompt_tokens"].as_u64().unwrap_or(0),
                prompt_tok_s: run0["prefill_tok_s"].as_f64().unwrap_or(f64::NAN),
                decode_tokens: v["decode_tokens"].as_u64().unwrap_or(0),
                decode_tok_s: run0["decode_tok_s"].as_f64().unwrap_or(f64::NAN),
            };
            eprintln!(
                "[{}/{}] llama.cpp prefill {:.2} tok/s ({} tokens), decode {:.2} tok/s ({} tokens)",
                r + 1,
                o.repeats,
                s.prompt_tok_s,
                s.prompt_tokens,
                s.decode_tok_s,
                s.decode_tokens
            );
            llama_runs.push(s);
            llama_info = v;
        }
        if let Some(bin) = &deco {
            let prompt = prompt_text(&prompt_file, py.is_some(), &text, o.prompt_tokens)?;
            if r == 0 {
                // Unmeasured warm-up, like llama_bench.py's (page cache, first-touch effects).
                let w = run_deco(bin, &model, &prompt, o)?;
                eprintln!(
                    "[warm-up] deco prefill {:.2} tok/s, decode {:.2} tok/s (not counted)",
                    w.prompt_tok_s, w.decode_tok_s
                );
            }
            let s = run_deco(bin, &model, &prompt, o)?;
            eprintln!(
                "[{}/{}] deco      prefill {:.2} tok/s ({} tokens), decode {:.2} tok/s ({} tokens)",
                r + 1,
                o.repeats,
                s.prompt_tok_s,
                s.prompt_tokens,
                s.decode_tok_s,
                s.decode_tokens
            );
            if s.prompt_tokens != o.prompt_tokens as u64 {
                eprintln!(
                    "warning: deco counted {} prompt tokens, llama.cpp {}; the tokenizers disagree \
                     on this text",
                    s.prompt_tokens, o.prompt_tokens
                );
            }
            deco_runs.push(s);
        }
    }

    let loadavg_after = fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let table = render_table(o, &llama_runs, &deco_runs);
    println!("{table}");
    println!(
        "load average before: {}   after (includes the benchmark itself): {}",
        loadavg.trim(),
        loadavg_after.trim()
    );
    warn_if_busy(&loadavg);
    let result = json!({
        "threads": o.threads,
        "repeats": o.repeats,
        "prompt_tokens": o.prompt_tokens,
        "decode_tokens": o.decode_tokens,
        "model": model,
        "loadavg_before": loadavg.trim(),
        "loadavg_after": loadavg_after.trim(),
        "omp_wait_policy": std::env::var("OMP_WAIT_POLICY").ok(),
        "llama_cpp": {
            "package": LLAMA_CPP_PYTHON,
            "system_info": llama_info.get("system_info"),
            "runs": llama_runs.iter().map(stats_json).collect::<Vec<_>>(),
        },
        "deco": { "runs": deco_runs.iter().map(stats_json).collect::<Vec<_>>() },
    });
    let json_path = out_dir.join("generate-last.json");
    fs::write(&json_path, serde_json::to_string_pretty(&result)? + "\n")
        .with_context(|| format!("cannot write {}", json_path.display()))?;
    eprintln!("results: {}", json_path.display());
    Ok(())
}

/// Warns when other processes already use the CPUs: llama.cpp's OpenMP threads spin-wait and
/// lose badly when oversubscribed, so such numbers say little about either engine.
fn warn_if_busy(loadavg: &str) {
    let load1: f64 = loadavg
        .split_whitespace()
        .next()
        .and_then(|x| x.parse().ok())
        .unwrap_or(0.0);
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1) as f64;
    if load1 > 0.5 {
        eprintln!(
            "warning: 1-minute load average {load1:.2} on {cpus} CPU(s): other work is running; \
             throughput numbers (llama.cpp's especially) will be low and noisy"
        );
    }
}

fn stats_json(s: &Stats) -> Value {
    json!({
        "prompt_tokens": s.prompt_tokens,
        "prompt_tok_s": s.prompt_tok_s,
        "decode_tokens": s.decode_tokens,
        "decode_tok_s": s.decode_tok_s,
    })
}

/// The table printed at the end of a run.
pub fn render_table(o: &GenerateOptions, llama: &[Stats], deco: &[Stats]) -> String {
    let mut t = String::new();
    t.push_str(&format!(
        "\nbench generate: SmolLM2-135M-Instruct Q4_1, {} threads, prompt {} tokens, decode {} \
         tokens, {} repeat(s); tok/s as min / median / max\n\n",
        o.threads, o.prompt_tokens, o.decode_tokens, o.repeats
    ));
    t.push_str(&format!(
        "{:<22} {:>28} {:>28}\n",
        "", "prefill tok/s", "decode tok/s"
    ));
    let fmt3 = |x: Option<(f64, f64, f64)>| match x {
        Some((a, b, c)) => format!("{a:>8.2} / {b:>8.2} / {c:>8.2}"),
        None => "n/a".to_owned(),
    };
    let pre = |s: &[Stats]| min_med_max(&s.iter().map(|x| x.prompt_tok_s).collect::<Vec<_>>());
    let dec = |s: &[Stats]| min_med_max(&s.iter().map(|x| x.decode_tok_s).collect::<Vec<_>>());
    t.push_str(&format!(
        "{:<22} {:>28} {:>28}\n",
        "llama.cpp",
        fmt3(pre(llama)),
        fmt3(dec(llama))
    ));
    t.push_str(&format!(
        "{:<22} {:>28} {:>28}\n",
        "deco",
        fmt3(pre(deco)),
        fmt3(dec(deco))
    ));
    let ratio = |d: Option<(f64, f64, f64)>, l: Option<(f64, f64, f64)>| match (d, l) {
        (Some(d), Some(l)) => format!(
            "{:>8.3} / {:>8.3} / {:>8.3}",
            d.0 / l.0,
            d.1 / l.1,
            d.2 / l.2
        ),
        _ => "n/a".to_owned(),
    };
    t.push_str(&format!(
        "{:<22} {:>28} {:>28}\n",
        "deco / llama.cpp",
        ratio(pre(deco), pre(llama)),
        ratio(dec(deco), dec(llama))
    ));
    t
}

fn run_llama(
    py: &Path,
    model: &Path,
    text: &Path,
    prompt_out: &Path,
    o: &GenerateOptions,
) -> Result<Value> {
    let mut cmd = Command::new(py);
    cmd.arg(python::script("llama_bench.py"))
        .arg("--model")
        .arg(model)
        .arg("--text")
        .arg(text)
        .arg("--prompt-out")
        .arg(prompt_out)
        .args(["--threads", &o.threads.to_string()])
        .args(["--prompt-tokens", &o.prompt_tokens.to_string()])
        .args(["--decode-tokens", &o.decode_tokens.to_string()])
        .args(["--repeats", "1", "--warmup", "1"])
        .stderr(Stdio::inherit());
    let shown = show(&cmd);
    let out = cmd
        .output()
        .with_context(|| format!("cannot start `{shown}`"))?;
    if !out.status.success() {
        bail!("`{shown}` failed ({})", out.status);
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .unwrap_or("");
    serde_json::from_str(line)
        .with_context(|| format!("xtask/scripts/llama_bench.py printed no JSON: {stdout}"))
}

/// The prompt text: the one llama_bench.py wrote (exactly N llama.cpp tokens), or, with
/// `--skip-llama` and no earlier file, a character-based approximation.
fn prompt_text(prompt_file: &Path, from_llama: bool, text: &Path, n: usize) -> Result<String> {
    if prompt_file.is_file() {
        return fs::read_to_string(prompt_file)
            .with_context(|| format!("cannot read {}", prompt_file.display()));
    }
    if from_llama {
        bail!(
            "{} was not written by llama_bench.py",
            prompt_file.display()
        );
    }
    eprintln!("warning: no llama.cpp prompt file yet; using ~{n} tokens worth of characters");
    let t = fs::read_to_string(text).with_context(|| format!("cannot read {}", text.display()))?;
    Ok(t.chars().take(n * 5).collect())
}

/// The `deco` binary: `explicit` if given, else `cargo build --release -p deco-cli` and the
/// binary in cargo's target directory. Shared by every `bench` subcommand.
pub fn deco_binary(explicit: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = explicit {
        return Ok(p.to_path_buf());
    }
    run(util::cargo().args(["build", "--release", "-p", "deco-cli"])).context("cannot build the deco CLI (crates/deco-cli)")?;
    let bin = target_dir()?.join("release").join("deco");
    if !bin.is_file() {
        bail!("{} not found after building deco-cli", bin.display());
    }
    Ok(bin)
}

/// Cargo's target directory (honours CARGO_TARGET_DIR and config).
pub fn target_dir() -> Result<PathBuf> {
    let out = util::cargo()
        .args(["metadata", "--format-version", "1", "--no-deps"])
        .stderr(Stdio::inherit())
        .output()
        .context("cannot run cargo metadata")?;
    if !out.status.success() {
        bail!("cargo metadata failed ({})", out.status);
    }
    let v: Value =
        serde_json::from_slice(&out.stdout).context("cargo metadata printed invalid JSON")?;
    v["target_directory"]
        .as_str()
        .map(PathBuf::from)
        .context("cargo metadata has no target_directory")
}

fn run_deco(bin: &Path, model: &Path, prompt: &str, o: &GenerateOptions) -> Result<Stats> {
    let mut cmd = Command::new(bin);
    cmd.arg("generate")
        .arg("--model")
        .arg(model)
        .args(["--prompt", prompt])
        .arg("--ignore-eos")
        .args(["--max-new-tokens", &o.decode_tokens.to_string()])
        .args(["--temperature", "0"])
        .args(["--threads", &o.threads.to_string()])
        .stdout(Stdio::null());
    let out = cmd
        .output()
        .with_context(|| format!("cannot start {}", bin.display()))?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        bail!(
            "{} generate failed ({}): {}",
            bin.display(),
            out.status,
            stderr.trim()
        );
    }
    parse_stats(&stderr).with_context(|| format!("{} generate", bin.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stats_line() -> Result<()> {
        let err = "loading model...\n[stats] prompt_tokens=128 prompt_tok_s=812.34 decode_tokens=64 decode_tok_s=95.10\n";
        let s = parse_stats(err)?;
        assert_eq!(
            s,
            Stats {
                prompt_tokens: 128,
                prompt_tok_s: 812.34,
                decode_tokens: 64,
                decode_tok_s: 95.10
            }
        );
        Ok(())
    }

    #[test]
    fn takes_the_last_stats_line_and_tolerates_extra_fields() -> Result<()> {
        let err = "[stats] prompt_tokens=1 prompt_tok_s=1.00 decode_tokens=1 decode_tok_s=1.00\n\
                   [stats] prompt_tokens=5 prompt_tok_s=2.50 decode_tokens=7 decode_tok_s=3.25 load_s=0.1";
        let s = parse_stats(err)?;
        assert_eq!(s.prompt_tokens, 5);
        assert_eq!(s.decode_tok_s, 3.25);
        Ok(())
    }

    #[test]
    fn rejects_bad_stats() {
        assert!(parse_stats("no stats here").is_err());
        assert!(
            parse_stats("[stats] prompt_tokens=x prompt_tok_s=1 decode_tokens=1 decode_tok_s=1")
                .is_err()
        );
        assert!(parse_stats("[stats] prompt_tokens=1 prompt_tok_s=1 decode_tokens=1").is_err());
    }

    #[test]
    fn min_median_max() {
        assert_eq!(min_med_max(&[3.0, 1.0, 2.0]), Some((1.0, 2.0, 3.0)));
        assert_eq!(min_med_max(&[4.0, 1.0]), Some((1.0, 2.5, 4.0)));
        assert_eq!(min_med_max(&[]), None);
    }

    #[test]
    fn table_has_ratios() {
        let o = GenerateOptions {
            cache: PathBuf::new(),
            no_mirror: false,
            threads: 2,
            repeats: 1,
            prompt_tokens: 128,
            decode_tokens: 64,
            skip_deco: false,
            skip_llama: false,
            deco_bin: None,
        };
        let l = Stats {
            prompt_tokens: 128,
            prompt_tok_s: 400.0,
            decode_tokens: 64,
            decode_tok_s: 100.0,
        };
        let d = Stats {
            prompt_tokens: 128,
            prompt_tok_s: 200.0,
            decode_tokens: 64,
            decode_tok_s: 50.0,
        };
        let t = render_table(&o, &[l], &[d]);
        assert!(t.contains("0.500 /    0.500 /    0.500"), "{t}");
    }
}
