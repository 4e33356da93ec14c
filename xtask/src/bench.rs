//! `cargo xtask bench generate`: deco vs llama.cpp on the same GGUF, same prompt, same threads,
//! for Q4_1, Q8_0 and F32 (issue 5, item 4).
//!
//! The Q4_1 file is the fetched `SmolLM2-135M-Instruct.Q4_1.gguf`; the Q8_0 and F32 files are
//! made from it once by `deco quantize` (`--format gguf-q8_0`: the dequantized Q4_1 linears
//! requantized with ggml's Q8_0 quantizer; `--format gguf-f32`: every quantized tensor
//! dequantized) and cached in `<cache>/bench/`, so the three files hold the same network. Each
//! repeat runs llama.cpp (llama-cpp-python, `xtask/scripts/llama_bench.py`) and `deco generate`
//! on every type, interleaved, so drifts of a shared machine hit both engines alike.
//! `--llama-bench` adds llama.cpp's own `llama-bench` (built from the same vendored sources with
//! cmake, [`build_llama_bench`]) to each repeat, `--isa avx2` holds both engines to AVX2, and
//! `--types qwen-0.5b,qwen-1.5b` adds the published Qwen2.5-Coder Q4_K_M files.
//!
//! Next to the throughput it prints the physical decode limit: the weight bytes one decode step
//! reads (from the GGUF tensor table, [`decode_weight_bytes`]) divided by a read bandwidth the
//! same run measures (a streaming sum over a 256 MiB and a 64 MiB buffer with the benchmark's
//! threads; a small Rust program compiled with `rustc -O -C target-cpu=native`, since xtask
//! itself is a debug build). Writes the section between `<!-- bench generate begin -->` and
//! `<!-- bench generate end -->` of `docs/performance.md`, the plot
//! `docs/performance/generate.svg`, and the raw numbers to `<cache>/bench/generate-last.json`.

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

/// The markers of the generated section of `docs/performance.md`.
pub const DOC_BEGIN: &str = "<!-- bench generate begin -->";
/// See [`DOC_BEGIN`].
pub const DOC_END: &str = "<!-- bench generate end -->";

/// Buffer sizes of the read-bandwidth probe (MiB): a DRAM-sized one and a 64 MiB one.
pub const BANDWIDTH_MIB: [usize; 2] = [256, 64];

/// A GGUF weight type compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BenchType {
    /// The fetched Q4_1 file.
    Q4_1,
    /// The Q4_1 linears requantized to Q8_0 (`deco quantize --format gguf-q8_0`).
    Q8_0,
    /// Every quantized tensor dequantized to F32 (`deco quantize --format gguf-f32`).
    F32,
    /// Qwen2.5-Coder-0.5B-Instruct Q4_K_M as published (`cargo xtask fetch --what qwen-0.5b`).
    Qwen05bQ4KM,
    /// Qwen2.5-Coder-1.5B-Instruct Q4_K_M as published (`cargo xtask fetch --what qwen-1.5b`).
    Qwen15bQ4KM,
}

impl BenchType {
    /// Every type `--types` accepts.
    pub const KNOWN: [BenchType; 5] =
        [BenchType::Q4_1, BenchType::Q8_0, BenchType::F32, BenchType::Qwen05bQ4KM, BenchType::Qwen15bQ4KM];

    /// ggml's name (`Q4_1`), with the model for the Qwen files.
    pub fn name(self) -> &'static str {
        match self {
            BenchType::Q4_1 => "Q4_1",
            BenchType::Q8_0 => "Q8_0",
            BenchType::F32 => "F32",
            BenchType::Qwen05bQ4KM => "Qwen-0.5B Q4_K_M",
            BenchType::Qwen15bQ4KM => "Qwen-1.5B Q4_K_M",
        }
    }

    /// The `--types` spelling (`q4_1`).
    pub fn flag(self) -> &'static str {
        match self {
            BenchType::Q4_1 => "q4_1",
            BenchType::Q8_0 => "q8_0",
            BenchType::F32 => "f32",
            BenchType::Qwen05bQ4KM => "qwen-0.5b",
            BenchType::Qwen15bQ4KM => "qwen-1.5b",
        }
    }

    /// A fetched model file used as it is (the Qwen files), with what fetches it.
    fn fetched(self) -> Option<(&'static str, What)> {
        match self {
            BenchType::Qwen05bQ4KM => Some(("models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", What::Qwen05b)),
            BenchType::Qwen15bQ4KM => Some(("models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", What::Qwen15b)),
            _ => None,
        }
    }

    /// Issue 19's decode goal: deco / llama.cpp decode tok/s at least this.
    pub fn decode_goal(self) -> f64 {
        match self {
            BenchType::F32 => 1.0,
            _ => 1.2,
        }
    }

    /// Issue 5's prefill goal (512-token prompt): deco / llama.cpp at least this.
    pub fn prefill_goal(self) -> f64 {
        1.0
    }

    /// The `deco quantize` arguments that make this type's file from the Q4_1 one (`None`: the
    /// Q4_1 file itself).
    fn quantize_args(self) -> Option<[&'static str; 6]> {
        match self {
            BenchType::Q4_1 | BenchType::Qwen05bQ4KM | BenchType::Qwen15bQ4KM => None,
            BenchType::Q8_0 => Some(["--method", "rtn", "--bits", "8", "--format", "gguf-q8_0"]),
            BenchType::F32 => Some(["--method", "rtn", "--bits", "8", "--format", "gguf-f32"]),
        }
    }
}

/// Parses `--types`: comma-separated `q4_1`, `q8_0`, `f32` (any case), in the given order,
/// duplicates dropped.
pub fn parse_types(s: &str) -> Result<Vec<BenchType>> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let t = BenchType::KNOWN
            .into_iter()
            .find(|t| t.flag().eq_ignore_ascii_case(part))
            .with_context(|| {
                format!("--types: unknown type `{part}` (expected a comma-separated list of q4_1, q8_0, f32, qwen-0.5b, qwen-1.5b)")
            })?;
        if !out.contains(&t) {
            out.push(t);
        }
    }
    if out.is_empty() {
        bail!("--types is empty (expected a comma-separated list of q4_1, q8_0, f32, qwen-0.5b, qwen-1.5b)");
    }
    Ok(out)
}

/// Options of `bench generate`.
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    /// The cache directory.
    pub cache: PathBuf,
    /// Ignore the local mirror.
    pub no_mirror: bool,
    /// Weight types, in table order.
    pub types: Vec<BenchType>,
    /// Threads for both engines (and the bandwidth probe).
    pub threads: usize,
    /// Measured repeats per engine and type.
    pub repeats: usize,
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub decode_tokens: usize,
    /// Only run llama.cpp.
    pub skip_deco: bool,
    /// Only run deco.
    pub skip_llama: bool,
    /// Do not write docs/performance.md and the plot.
    pub no_docs: bool,
    /// Use this deco binary instead of building `deco-cli` in release mode.
    pub deco_bin: Option<PathBuf>,
    /// Run deco with `--q8-activations`.
    pub q8_activations: bool,
    /// Run deco with `--kv-cache-dtype f16` (llama.cpp's default KV type).
    pub kv_f16: bool,
    /// Also run llama.cpp's own `llama-bench`, built from the vendored sources with cmake.
    pub llama_bench: bool,
    /// The instruction set both engines may use.
    pub isa: BenchIsa,
}

/// The instruction set a `bench generate` run lets both engines use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchIsa {
    /// Whatever the CPU has: deco's run-time dispatch, llama.cpp's `GGML_NATIVE=ON`
    /// (`-march=native`).
    Native,
    /// AVX2 + FMA + F16C, no AVX-512: deco with `DECO_KERNELS=avx2`, llama-bench built with
    /// `GGML_NATIVE=OFF` (ggml's portable x86 set: SSE4.2, AVX, AVX2, BMI2, FMA, F16C).
    Avx2,
}

impl BenchIsa {
    /// The `--isa` spelling.
    pub fn name(self) -> &'static str {
        match self {
            BenchIsa::Native => "native",
            BenchIsa::Avx2 => "avx2",
        }
    }
}

impl GenerateOptions {
    /// The command line that reproduces this run.
    pub fn command_line(&self) -> String {
        let mut s = format!(
            "cargo xtask bench generate --types {} --threads {} --repeats {} --prompt-tokens {} --decode-tokens {}",
            self.types
                .iter()
                .map(|t| t.flag())
                .collect::<Vec<_>>()
                .join(","),
            self.threads,
            self.repeats,
            self.prompt_tokens,
            self.decode_tokens
        );
        if self.skip_deco {
            s.push_str(" --skip-deco");
        }
        if self.skip_llama {
            s.push_str(" --skip-llama");
        }
        if self.q8_activations {
            s.push_str(" --q8-activations");
        }
        if self.kv_f16 {
            s.push_str(" --kv-cache-dtype f16");
        }
        if self.llama_bench {
            s.push_str(" --llama-bench");
        }
        if self.isa != BenchIsa::Native {
            s.push_str(&format!(" --isa {}", self.isa.name()));
        }
        s
    }
}

/// One `llama-bench` run of one file (`-r 1`, after llama-bench's own warm-up): tok/s of the
/// prompt test (`pp`) and the generation test (`tg`), at depth 0 and at depth = prompt length.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LlamaBenchStats {
    /// pp at depth 0.
    pub pp_d0: f64,
    /// tg at depth 0.
    pub tg_d0: f64,
    /// pp at depth = prompt tokens.
    pub pp_dp: f64,
    /// tg at depth = prompt tokens (what deco's decode measures: the generated tokens follow a
    /// prompt of that length).
    pub tg_dp: f64,
}

/// Parses `llama-bench -o json`: an array of tests, each with `n_prompt`, `n_gen`, `n_depth`
/// and `avg_ts`. Needs the four tests pp/tg at depth 0 and at depth `prompt`.
pub fn parse_llama_bench(json_text: &str, prompt: u64, generated: u64) -> Result<LlamaBenchStats> {
    let v: Value = serde_json::from_str(json_text.trim()).context("llama-bench printed no JSON array")?;
    let tests = v.as_array().context("llama-bench's JSON is not an array")?;
    let find = |n_prompt: u64, n_gen: u64, depth: u64| -> Result<f64> {
        tests
            .iter()
            .find(|t| {
                t["n_prompt"].as_u64() == Some(n_prompt)
                    && t["n_gen"].as_u64() == Some(n_gen)
                    && t["n_depth"].as_u64().unwrap_or(0) == depth
            })
            .and_then(|t| t["avg_ts"].as_f64())
            .with_context(|| format!("llama-bench's JSON has no test n_prompt={n_prompt} n_gen={n_gen} n_depth={depth}"))
    };
    Ok(LlamaBenchStats {
        pp_d0: find(prompt, 0, 0)?,
        tg_d0: find(0, generated, 0)?,
        pp_dp: find(prompt, 0, prompt)?,
        tg_dp: find(0, generated, prompt)?,
    })
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

/// One row of a GGUF tensor table (as `deco inspect` prints it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorRow {
    /// GGUF tensor name (`blk.0.attn_q.weight`).
    pub name: String,
    /// ggml type name (`Q4_1`).
    pub ty: String,
    /// Row-major shape.
    pub shape: Vec<u64>,
    /// Bytes of the tensor's data.
    pub bytes: u64,
}

/// Parses the `tensors:` table of `deco inspect` (`  name  TYPE  [d0, d1]  bytes` per line,
/// after a header line, up to the first blank line).
pub fn parse_inspect_tensors(text: &str) -> Result<Vec<TensorRow>> {
    let mut lines = text.lines().skip_while(|l| l.trim() != "tensors:").skip(1);
    match lines.next() {
        Some(h) if h.split_whitespace().next() == Some("name") => {}
        _ => bail!("`deco inspect` printed no tensor table (no `tensors:` header)"),
    }
    let mut rows = Vec::new();
    for line in lines.take_while(|l| !l.trim().is_empty()) {
        let bad = || format!("bad tensor line `{}` in `deco inspect` output", line.trim());
        let (open, close) = match (line.find('['), line.rfind(']')) {
            (Some(o), Some(c)) if c > o => (o, c),
            _ => bail!("{}", bad()),
        };
        let mut head = line[..open].split_whitespace();
        let (name, ty) = match (head.next(), head.next(), head.next()) {
            (Some(n), Some(t), None) => (n.to_owned(), t.to_owned()),
            _ => bail!("{}", bad()),
        };
        let shape = line[open + 1..close]
            .split(',')
            .map(str::trim)
            .filter(|d| !d.is_empty())
            .map(|d| d.parse::<u64>())
            .collect::<std::result::Result<Vec<_>, _>>()
            .with_context(bad)?;
        let bytes = line[close + 1..].trim().parse::<u64>().with_context(bad)?;
        rows.push(TensorRow {
            name,
            ty,
            shape,
            bytes,
        });
    }
    if rows.is_empty() {
        bail!("`deco inspect` printed an empty tensor table");
    }
    Ok(rows)
}

/// The weight bytes one decode step reads, by kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WeightBytes {
    /// Every 2-D `blk.*` tensor (the decoder linears), whole.
    pub linears: u64,
    /// The LM head, whole: `output.weight`, or `token_embd.weight` when the embedding is tied.
    pub head: u64,
    /// One row of `token_embd.weight` (the embedding lookup of the new token).
    pub embed_row: u64,
    /// The 1-D tensors (RMSNorm weights), whole.
    pub norms: u64,
}

impl WeightBytes {
    /// All of it.
    pub fn total(&self) -> u64 {
        self.linears + self.head + self.embed_row + self.norms
    }
}

/// What a decode step reads from the weights of a llama-style GGUF: every decoder linear, the
/// LM head (the whole `output.weight`, or the whole `token_embd.weight` if tied), one
/// `token_embd` row, and the norms. Not counted: the KV cache and activations.
pub fn decode_weight_bytes(tensors: &[TensorRow]) -> Result<WeightBytes> {
    let embd = tensors
        .iter()
        .find(|t| t.name == "token_embd.weight")
        .context("the GGUF has no token_embd.weight")?;
    let rows = embd.shape.first().copied().filter(|&r| r > 0).unwrap_or(1);
    let mut w = WeightBytes {
        embed_row: embd.bytes / rows,
        ..WeightBytes::default()
    };
    let output = tensors.iter().find(|t| t.name == "output.weight");
    w.head = output.unwrap_or(embd).bytes;
    for t in tensors {
        if t.name.starts_with("blk.") && t.shape.len() >= 2 {
            w.linears += t.bytes;
        } else if t.shape.len() == 1 {
            w.norms += t.bytes;
        }
    }
    Ok(w)
}

/// Decode tok/s the memory system allows: `bandwidth_gb_s` (1e9 bytes/s) over `bytes_per_token`.
pub fn limit_tok_s(bytes_per_token: u64, bandwidth_gb_s: f64) -> f64 {
    if bytes_per_token == 0 {
        return f64::NAN;
    }
    bandwidth_gb_s * 1e9 / bytes_per_token as f64
}

/// Read bandwidth samples (GB/s, one per pass) for each buffer size of [`BANDWIDTH_MIB`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Bandwidth {
    /// (buffer MiB, GB/s of each pass).
    pub by_size: Vec<(usize, Vec<f64>)>,
}

impl Bandwidth {
    /// The samples of one buffer size.
    pub fn samples(&self, mib: usize) -> &[f64] {
        self.by_size
            .iter()
            .find(|(m, _)| *m == mib)
            .map_or(&[], |(_, v)| v.as_slice())
    }

    /// Median GB/s of one buffer size (NaN without samples).
    pub fn median(&self, mib: usize) -> f64 {
        min_med_max(self.samples(mib)).map_or(f64::NAN, |x| x.1)
    }

    fn add(&mut self, mib: usize, samples: Vec<f64>) {
        match self.by_size.iter_mut().find(|(m, _)| *m == mib) {
            Some((_, v)) => v.extend(samples),
            None => self.by_size.push((mib, samples)),
        }
    }
}

/// The source of the read-bandwidth probe. `probe MIB THREADS PASSES`: each thread allocates and
/// first-touches MIB/THREADS of u64, then every pass (all threads released together by a
/// barrier) sums its part (a vectorized integer reduction: loads only, nothing written); a pass
/// lasts from the first thread's start to the last one's end. Prints
/// `probe mib=M threads=T gb_s=X,Y,...` (1e9 bytes/s per pass).
const PROBE_SRC: &str = r#"// Generated by `cargo xtask bench generate` (xtask/src/bench.rs); read-bandwidth probe.
use std::sync::Barrier;
use std::time::Instant;

#[inline(never)]
fn sum(c: &[u64]) -> u64 {
    // An integer reduction: LLVM vectorizes it with several vector accumulators.
    c.iter().fold(0u64, |a, &x| a.wrapping_add(x))
}

fn main() {
    let a: Vec<usize> = std::env::args().skip(1).filter_map(|s| s.parse().ok()).collect();
    if a.len() != 3 || a.iter().any(|&x| x == 0) {
        eprintln!("usage: probe MIB THREADS PASSES (all > 0)");
        std::process::exit(2);
    }
    let (mib, threads, passes) = (a[0], a[1], a[2]);
    let per = mib * 1024 * 1024 / 8 / threads;
    let bar = Barrier::new(threads);
    // Each thread stamps its own start and end of every pass (threads released together by the
    // barrier); a pass lasts from the first start to the last end.
    let times: Vec<Vec<(Instant, Instant)>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|t| {
                let bar = &bar;
                s.spawn(move || {
                    let part: Vec<u64> = (0..per).map(|i| (i ^ t) as u64).collect();
                    let mut sink = 0u64;
                    let mut out = Vec::with_capacity(passes);
                    for _ in 0..passes {
                        bar.wait();
                        let t0 = Instant::now();
                        sink = sink.wrapping_add(sum(std::hint::black_box(&part)));
                        out.push((t0, Instant::now()));
                    }
                    std::hint::black_box(sink);
                    out
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap_or_default()).collect()
    });
    let mut list = Vec::with_capacity(passes);
    for p in 0..passes {
        let start = times.iter().filter_map(|v| v.get(p)).map(|x| x.0).min();
        let end = times.iter().filter_map(|v| v.get(p)).map(|x| x.1).max();
        if let (Some(s), Some(e)) = (start, end) {
            let gb_s = (per * threads * 8) as f64 / (e - s).as_secs_f64() / 1e9;
            list.push(format!("{gb_s:.3}"));
        }
    }
    println!("probe mib={mib} threads={threads} gb_s={}", list.join(","));
}
"#;

/// Parses the probe's line `probe mib=M threads=T gb_s=X,Y,...` into (M, samples).
pub fn parse_probe(stdout: &str) -> Result<(usize, Vec<f64>)> {
    let line = stdout
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| l.starts_with("probe "))
        .context("the bandwidth probe printed no `probe ...` line")?;
    let mut mib = None;
    let mut gb_s = None;
    for kv in line["probe ".len()..].split_whitespace() {
        let bad = || format!("bad field `{kv}` in `{line}`");
        match kv.split_once('=').with_context(bad)? {
            ("mib", v) => mib = Some(v.parse::<usize>().with_context(bad)?),
            ("gb_s", v) => {
                let xs = v
                    .split(',')
                    .map(str::parse::<f64>)
                    .collect::<std::result::Result<Vec<_>, _>>()
                    .with_context(bad)?;
                gb_s = Some(xs);
            }
            _ => {}
        }
    }
    match (mib, gb_s) {
        (Some(m), Some(v)) if !v.is_empty() => Ok((m, v)),
        _ => bail!("`{line}` lacks mib= or gb_s="),
    }
}

/// Compiles the probe into `<dir>/bandwidth_probe` (again only when its source changed).
fn build_probe(dir: &Path) -> Result<PathBuf> {
    let src = dir.join("bandwidth_probe.rs");
    let bin = dir.join("bandwidth_probe");
    let same = fs::read_to_string(&src).is_ok_and(|s| s == PROBE_SRC);
    if same && bin.is_file() {
        return Ok(bin);
    }
    fs::write(&src, PROBE_SRC).with_context(|| format!("cannot write {}", src.display()))?;
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let mut cmd = Command::new(rustc);
    cmd.args([
        "--edition",
        "2021",
        "-C",
        "opt-level=3",
        "-C",
        "target-cpu=native",
        "-o",
    ])
    .arg(&bin)
    .arg(&src);
    run(&mut cmd)
        .context("cannot compile the read-bandwidth probe (needs rustc on PATH or $RUSTC)")?;
    Ok(bin)
}

/// Runs the probe once per size of [`BANDWIDTH_MIB`] and adds the passes to `bw`.
fn measure_bandwidth(probe: &Path, threads: usize, bw: &mut Bandwidth) -> Result<()> {
    for mib in BANDWIDTH_MIB {
        // ~0.2-0.5 s per size at 20-50 GB/s.
        let passes = (4096 / mib).clamp(8, 64);
        let mut cmd = Command::new(probe);
        cmd.args([mib, threads, passes].map(|x| x.to_string()));
        let shown = show(&cmd);
        let (stdout, _) = util::output(&mut cmd)?;
        let (m, samples) = parse_probe(&stdout).with_context(|| format!("`{shown}`"))?;
        let s = min_med_max(&samples).unwrap_or((f64::NAN, f64::NAN, f64::NAN));
        eprintln!(
            "read bandwidth, {m} MiB, {threads} thread(s): {:.1} / {:.1} / {:.1} GB/s (min / median / max of {} passes)",
            s.0,
            s.1,
            s.2,
            samples.len()
        );
        bw.add(m, samples);
    }
    Ok(())
}

/// The GGUF of `ty`: the fetched Q4_1 file, or one made from it by `deco quantize` into
/// `out_dir` (reused when present and newer than the Q4_1 file; the writer is atomic, so a file
/// that exists is complete).
fn ensure_model(
    deco: &Path,
    q4_1: &Path,
    out_dir: &Path,
    ty: BenchType,
    o: &GenerateOptions,
) -> Result<PathBuf> {
    let threads = o.threads;
    if let Some((rel, what)) = ty.fetched() {
        fetch::fetch(&fetch::Options { cache: o.cache.clone(), no_mirror: o.no_mirror, what: vec![what] })?;
        return Ok(o.cache.join(rel));
    }
    let Some(args) = ty.quantize_args() else {
        return Ok(q4_1.to_path_buf());
    };
    let out = out_dir.join(format!("SmolLM2-135M-Instruct.{}.gguf", ty.name()));
    let mtime = |p: &Path| fs::metadata(p).and_then(|m| m.modified()).ok();
    if out.is_file() && mtime(&out) >= mtime(q4_1) {
        eprintln!("{}: reusing {}", ty.name(), out.display());
        return Ok(out);
    }
    if out.exists() {
        fs::remove_file(&out).with_context(|| format!("cannot remove stale {}", out.display()))?;
    }
    let mut cmd = Command::new(deco);
    cmd.arg("quantize")
        .arg("--model")
        .arg(q4_1)
        .args(args)
        .args(["--threads", &threads.to_string()])
        .arg("--out")
        .arg(&out)
        .stdout(Stdio::null());
    run(&mut cmd).with_context(|| format!("cannot make the {} GGUF", ty.name()))?;
    Ok(out)
}

/// `deco inspect MODEL`'s tensor table.
fn gguf_tensors(deco: &Path, model: &Path) -> Result<Vec<TensorRow>> {
    let mut cmd = Command::new(deco);
    cmd.arg("inspect").arg(model);
    let shown = show(&cmd);
    let (stdout, _) = util::output(&mut cmd)?;
    parse_inspect_tensors(&stdout).with_context(|| format!("`{shown}`"))
}

/// Everything measured for one type.
#[derive(Debug, Clone)]
pub struct TypeResult {
    /// The type.
    pub ty: BenchType,
    /// Its GGUF.
    pub model: PathBuf,
    /// Bytes of the GGUF file.
    pub file_bytes: u64,
    /// Weight bytes read per decode step.
    pub weights: WeightBytes,
    /// llama.cpp's runs.
    pub llama: Vec<Stats>,
    /// deco's runs.
    pub deco: Vec<Stats>,
    /// llama-bench's runs (`--llama-bench`).
    pub llama_bench: Vec<LlamaBenchStats>,
}

/// Runs the benchmark, prints the tables, writes the JSON and (unless `no_docs`) the docs.
pub fn generate(o: &GenerateOptions) -> Result<()> {
    if o.repeats == 0 {
        bail!("--repeats must be at least 1");
    }
    if o.prompt_tokens < 8 {
        bail!(
            "--prompt-tokens must be at least 8, got {}",
            o.prompt_tokens
        );
    }
    if o.decode_tokens == 0 {
        bail!("--decode-tokens must be at least 1");
    }
    if o.threads == 0 {
        bail!("--threads must be at least 1");
    }
    if o.types.is_empty() {
        bail!("--types is empty");
    }
    if o.isa == BenchIsa::Avx2 && !o.skip_llama {
        bail!(
            "--isa avx2: llama-cpp-python is compiled by pip for this CPU (-march=native) and \
             cannot be held to AVX2; run with --llama-bench --skip-llama (llama-bench is then \
             built with GGML_NATIVE=OFF: AVX2, no AVX-512)"
        );
    }
    if o.isa == BenchIsa::Avx2 && !o.llama_bench {
        bail!("--isa avx2 compares deco with llama-bench: add --llama-bench (and --skip-llama)");
    }
    if o.isa == BenchIsa::Avx2 && !has_avx2_fma_f16c() {
        bail!("--isa avx2: this CPU lacks AVX2, FMA or F16C (deco's AVX2 kernels need all three)");
    }
    if o.skip_deco && o.skip_llama && !o.llama_bench {
        bail!("--skip-deco and --skip-llama together leave nothing to run");
    }
    fetch::fetch(&fetch::Options {
        cache: o.cache.clone(),
        no_mirror: o.no_mirror,
        what: vec![What::Model, What::Data],
    })?;
    let q4_1 = o.cache.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let text = o.cache.join("data/wiki_test.txt");
    let out_dir = o.cache.join("bench");
    fs::create_dir_all(&out_dir).with_context(|| format!("cannot create {}", out_dir.display()))?;
    let prompt_file = out_dir.join(format!("prompt-{}.txt", o.prompt_tokens));

    // deco makes the Q8_0 / F32 files and reads the tensor tables, so it is needed even with
    // --skip-deco.
    let deco = deco_binary(o.deco_bin.as_deref())
        .context("building or finding the deco binary (--deco-bin)")?;
    let probe = build_probe(&out_dir)?;
    let mut results = Vec::new();
    for &ty in &o.types {
        let model = ensure_model(&deco, &q4_1, &out_dir, ty, o)?;
        let weights = decode_weight_bytes(&gguf_tensors(&deco, &model)?)
            .with_context(|| format!("tensor table of {}", model.display()))?;
        results.push(TypeResult {
            ty,
            file_bytes: util::file_size(&model).unwrap_or(0),
            model,
            weights,
            llama: Vec::new(),
            deco: Vec::new(),
            llama_bench: Vec::new(),
        });
    }
    let llama_bench = if o.llama_bench { Some(build_llama_bench(&o.cache, o.isa)?) } else { None };

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

    // Without llama_bench.py (which writes a prompt of exactly N llama.cpp tokens), deco's
    // prompt is a prefix of the text that deco's own tokenizer makes exactly N tokens, per model.
    let own_prompts: Vec<Option<String>> = if py.is_none() && !o.skip_deco {
        results
            .iter()
            .map(|r| exact_prompt(&deco, &r.model, &text, o.prompt_tokens, &out_dir).map(Some))
            .collect::<Result<_>>()?
    } else {
        vec![None; results.len()]
    };

    let loadavg = fs::read_to_string("/proc/loadavg").unwrap_or_default();
    eprintln!("load average before the benchmark: {}", loadavg.trim());
    warn_if_busy(&loadavg);
    // The load average lags by minutes; the CPU time other processes use right now is what
    // disturbs the engines.
    let cpu_busy = cpu_busy_fraction(std::time::Duration::from_secs(3));
    if let Some(b) = cpu_busy {
        eprintln!("CPU busy (all processes) over 3 s before the benchmark: {:.0} %", 100.0 * b);
    }
    let mut bw = Bandwidth::default();
    measure_bandwidth(&probe, o.threads, &mut bw)?;

    let mut llama_info = Value::Null;
    // Interleave engines and types so slow drifts of a shared machine hit all alike.
    for r in 0..o.repeats {
        for (i, res) in results.iter_mut().enumerate() {
            let tag = format!("[{}/{}] {:<4}", r + 1, o.repeats, res.ty.name());
            if let Some(py) = &py {
                let v = run_llama(py, &res.model, &text, &prompt_file, o)?;
                let run0 = &v["runs"][0];
                let s = Stats {
                    prompt_tokens: v["prompt_tokens"].as_u64().unwrap_or(0),
                    prompt_tok_s: run0["prefill_tok_s"].as_f64().unwrap_or(f64::NAN),
                    decode_tokens: v["decode_tokens"].as_u64().unwrap_or(0),
                    decode_tok_s: run0["decode_tok_s"].as_f64().unwrap_or(f64::NAN),
                };
                eprintln!(
                    "{tag} llama.cpp prefill {:.2} tok/s ({} tokens), decode {:.2} tok/s ({} tokens)",
                    s.prompt_tok_s, s.prompt_tokens, s.decode_tok_s, s.decode_tokens
                );
                res.llama.push(s);
                llama_info = v;
            }
            if let Some(bin) = &llama_bench {
                let v = run_llama_bench(bin, &res.model, o)?;
                eprintln!(
                    "{tag} llama-bench pp{p} {:.2} tok/s, pp{p}@d{p} {:.2}, tg{n} {:.2}, tg{n}@d{p} {:.2}",
                    v.pp_d0,
                    v.pp_dp,
                    v.tg_d0,
                    v.tg_dp,
                    p = o.prompt_tokens,
                    n = o.decode_tokens
                );
                res.llama_bench.push(v);
            }
            if !o.skip_deco {
                let prompt = match &own_prompts[i] {
                    Some(p) => p.clone(),
                    None => prompt_text(&prompt_file, py.is_some(), &text, o.prompt_tokens)?,
                };
                if r == 0 {
                    // Unmeasured warm-up, like llama_bench.py's (page cache, first-touch effects).
                    let w = run_deco(&deco, &res.model, &prompt, o)?;
                    eprintln!(
                        "{tag} deco warm-up prefill {:.2} tok/s, decode {:.2} tok/s (not counted)",
                        w.prompt_tok_s, w.decode_tok_s
                    );
                }
                let s = run_deco(&deco, &res.model, &prompt, o)?;
                eprintln!(
                    "{tag} deco      prefill {:.2} tok/s ({} tokens), decode {:.2} tok/s ({} tokens)",
                    s.prompt_tok_s, s.prompt_tokens, s.decode_tok_s, s.decode_tokens
                );
                if s.prompt_tokens != o.prompt_tokens as u64 {
                    eprintln!(
                        "warning: deco counted {} prompt tokens, {} expected; {}",
                        s.prompt_tokens,
                        o.prompt_tokens,
                        if own_prompts[i].is_some() {
                            "`deco tokenize` and `deco generate` disagree on this prompt"
                        } else {
                            "deco's and llama.cpp's tokenizers disagree on this text"
                        }
                    );
                }
                res.deco.push(s);
            }
        }
    }
    measure_bandwidth(&probe, o.threads, &mut bw)?;

    let loadavg_after = fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let meta = RunMeta {
        date: command_stdout("date", &["-u", "+%Y-%m-%d %H:%M UTC"]),
        commit: command_stdout("git", &["rev-parse", "--short", "HEAD"]),
        loadavg_before: loadavg.trim().to_owned(),
        loadavg_after: loadavg_after.trim().to_owned(),
        busy: cpu_busy.map_or(load1(&loadavg) > 0.5, |b| b > BUSY_CPU_FRACTION),
    };
    let standalone_llama_bench = o.skip_llama && o.llama_bench;
    let md = if standalone_llama_bench {
        render_llama_bench(o, &results, &meta, true)
    } else if o.llama_bench {
        render_markdown(o, &results, &bw, &meta) + "\n" + &render_llama_bench(o, &results, &meta, false)
    } else {
        render_markdown(o, &results, &bw, &meta)
    };
    println!("\n{md}");
    warn_if_busy(&loadavg);

    let result = json!({
        "threads": o.threads,
        "repeats": o.repeats,
        "prompt_tokens": o.prompt_tokens,
        "decode_tokens": o.decode_tokens,
        "loadavg_before": meta.loadavg_before,
        "loadavg_after": meta.loadavg_after,
        "omp_wait_policy": std::env::var("OMP_WAIT_POLICY").ok(),
        "isa": o.isa.name(),
        "cpu": cpu_description(),
        "date": meta.date,
        "commit": meta.commit,
        "bandwidth_gb_s": bw.by_size.iter().map(|(m, v)| json!({"mib": m, "passes": v})).collect::<Vec<_>>(),
        "llama_cpp": {
            "package": LLAMA_CPP_PYTHON,
            "system_info": llama_info.get("system_info"),
        },
        "types": results.iter().map(|r| json!({
            "type": r.ty.name(),
            "model": r.model,
            "file_bytes": r.file_bytes,
            "weight_bytes_per_token": {
                "linears": r.weights.linears,
                "head": r.weights.head,
                "embed_row": r.weights.embed_row,
                "norms": r.weights.norms,
                "total": r.weights.total(),
            },
            "llama_cpp": r.llama.iter().map(stats_json).collect::<Vec<_>>(),
            "llama_bench": r.llama_bench.iter().map(|b| json!({
                "pp_d0": b.pp_d0, "tg_d0": b.tg_d0, "pp_dp": b.pp_dp, "tg_dp": b.tg_dp,
            })).collect::<Vec<_>>(),
            "deco": r.deco.iter().map(stats_json).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
    });
    let json_path = out_dir.join("generate-last.json");
    write_replacing(&json_path, serde_json::to_string_pretty(&result)? + "\n")?;
    eprintln!("results: {}", json_path.display());

    if o.no_docs {
        return Ok(());
    }
    if standalone_llama_bench && !o.skip_deco {
        // deco against llama-bench only: its own section, one per ISA.
        let path = util::workspace_root().join("docs/performance.md");
        let old = fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
        let (begin, end) = llama_bench_markers(o.isa);
        write_replacing(&path, splice_section_with(&old, &md, &begin, &end))?;
        eprintln!("wrote {}", path.display());
        return Ok(());
    }
    if o.skip_deco || o.skip_llama {
        eprintln!("not updating docs/performance.md: a --skip-* run has no ratios");
        return Ok(());
    }
    let docs = util::workspace_root().join("docs");
    fs::create_dir_all(docs.join("performance"))?;
    let svg = docs.join("performance/generate.svg");
    plot(&svg, &results, &bw)?;
    let path = docs.join("performance.md");
    let old =
        fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
    write_replacing(&path, splice_section(&old, &md))?;
    eprintln!("wrote {} and {}", path.display(), svg.display());
    Ok(())
}

/// Trimmed standard output of `prog args` run in the workspace root; empty when it fails.
pub fn command_stdout(prog: &str, args: &[&str]) -> String {
    Command::new(prog)
        .args(args)
        .current_dir(util::workspace_root())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}

/// Whether the CPU has what deco's AVX2 kernels (and ggml's `GGML_NATIVE=OFF` build) need.
fn has_avx2_fma_f16c() -> bool {
    #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
    {
        std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(any(target_arch = "x86", target_arch = "x86_64")))]
    {
        false
    }
}

/// Writes `bytes` to `path` through a temporary file in the same directory and a rename, so
/// that `path` holds either its old or its new content.
fn write_replacing(path: &Path, bytes: impl AsRef<[u8]>) -> Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    fs::write(&tmp, bytes).with_context(|| format!("cannot write {}", tmp.display()))?;
    fs::rename(&tmp, path).with_context(|| format!("cannot replace {}", path.display()))
}

/// The markers of the section a `--llama-bench --skip-llama` run writes for `isa`.
pub fn llama_bench_markers(isa: BenchIsa) -> (String, String) {
    (
        format!("<!-- bench generate llama-bench {} begin -->", isa.name()),
        format!("<!-- bench generate llama-bench {} end -->", isa.name()),
    )
}

/// Puts `md` between [`DOC_BEGIN`] and [`DOC_END`] of `doc`; without the markers, inserts them
/// after the first paragraph block (the first run of non-blank, non-heading lines).
pub fn splice_section(doc: &str, md: &str) -> String {
    splice_section_with(doc, md, DOC_BEGIN, DOC_END)
}

/// [`splice_section`] with other markers.
pub fn splice_section_with(doc: &str, md: &str, begin: &str, end: &str) -> String {
    let block = format!("{begin}\n{}\n{end}", md.trim_end());
    if let (Some(b), Some(e)) = (doc.find(begin), doc.find(end))
        && e > b
    {
        return format!("{}{block}{}", &doc[..b], &doc[e + end.len()..]);
    }
    let lines: Vec<&str> = doc.split_inclusive('\n').collect();
    let is_text = |l: &str| !l.trim().is_empty() && !l.trim_start().starts_with('#');
    let insert_at = match lines.iter().position(|l| is_text(l)) {
        Some(first) => {
            first
                + lines[first..]
                    .iter()
                    .take_while(|l| !l.trim().is_empty())
                    .count()
        }
        None => lines.len(),
    };
    let mut out: String = lines[..insert_at].concat();
    if !out.is_empty() && !out.ends_with('\n') {
        out.push('\n');
    }
    out.push('\n');
    out.push_str(&block);
    out.push('\n');
    let rest = lines[insert_at..].concat();
    if !rest.is_empty() && !rest.starts_with('\n') {
        out.push('\n');
    }
    out.push_str(&rest);
    out
}

/// When and where a run happened.
#[derive(Debug, Clone, Default)]
pub struct RunMeta {
    /// `date -u`.
    pub date: String,
    /// Short commit.
    pub commit: String,
    /// `/proc/loadavg` before.
    pub loadavg_before: String,
    /// `/proc/loadavg` after.
    pub loadavg_after: String,
    /// Whether other work ran: more than `BUSY_CPU_FRACTION` of the CPU time busy in the 3 s
    /// before the run (`/proc/stat`; the 1-minute load > 0.5 where that is unreadable). Work
    /// that starts during the run is not detected.
    pub busy: bool,
}

/// Above this fraction of all CPU time used by other processes just before the run, the report
/// is labelled a smoke test.
const BUSY_CPU_FRACTION: f64 = 0.15;

/// Fraction of all CPUs' time that was not idle over `window` (from `/proc/stat`'s first line:
/// user nice system idle iowait irq softirq steal …); `None` where `/proc/stat` is unreadable.
fn cpu_busy_fraction(window: std::time::Duration) -> Option<f64> {
    fn sample() -> Option<(u64, u64)> {
        let text = fs::read_to_string("/proc/stat").ok()?;
        let v: Vec<u64> = text.lines().next()?.split_whitespace().skip(1).filter_map(|x| x.parse().ok()).collect();
        if v.len() < 5 {
            return None;
        }
        let idle = v[3] + v[4];
        Some((v.iter().take(8).sum(), idle))
    }
    let (t0, i0) = sample()?;
    std::thread::sleep(window);
    let (t1, i1) = sample()?;
    let total = t1.checked_sub(t0)?;
    if total == 0 {
        return None;
    }
    Some(1.0 - (i1.saturating_sub(i0)) as f64 / total as f64)
}

fn load1(loadavg: &str) -> f64 {
    loadavg
        .split_whitespace()
        .next()
        .and_then(|x| x.parse().ok())
        .unwrap_or(0.0)
}

/// Warns when other processes already use the CPUs: llama.cpp's OpenMP threads spin-wait and
/// lose badly when oversubscribed, so such numbers say little about either engine.
fn warn_if_busy(loadavg: &str) {
    let load1 = load1(loadavg);
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

type Mmm = Option<(f64, f64, f64)>;

fn prefill_mmm(s: &[Stats]) -> Mmm {
    min_med_max(&s.iter().map(|x| x.prompt_tok_s).collect::<Vec<_>>())
}

fn decode_mmm(s: &[Stats]) -> Mmm {
    min_med_max(&s.iter().map(|x| x.decode_tok_s).collect::<Vec<_>>())
}

fn fmt_mmm(x: Mmm, p: usize) -> String {
    match x {
        Some((a, b, c)) => format!("{a:.p$} / **{b:.p$}** / {c:.p$}"),
        None => "–".to_owned(),
    }
}

/// deco / llama.cpp of the medians, and min / max of the per-repeat ratios (repeat i of deco
/// over repeat i of llama.cpp: the interleaved pairs).
pub fn ratios(deco: &[f64], llama: &[f64]) -> Option<(f64, f64, f64)> {
    let d = min_med_max(deco)?.1;
    let l = min_med_max(llama)?.1;
    let paired: Vec<f64> = deco.iter().zip(llama).map(|(d, l)| d / l).collect();
    let (lo, _, hi) = min_med_max(&paired)?;
    Some((lo, d / l, hi))
}

/// "met" or how far the ratio is below the goal.
pub fn verdict(ratio: f64, goal: f64) -> String {
    if !ratio.is_finite() {
        "–".to_owned()
    } else if ratio >= goal {
        "met".to_owned()
    } else {
        format!("missed by {:.0} %", (1.0 - ratio / goal) * 100.0)
    }
}

fn fmt_ratio(r: Option<(f64, f64, f64)>, goal: f64) -> (String, String) {
    match r {
        Some((lo, med, hi)) => (
            format!("**{med:.2}×** ({lo:.2}–{hi:.2})"),
            format!("≥ {goal:.1}×: {}", verdict(med, goal)),
        ),
        None => ("–".to_owned(), format!("≥ {goal:.1}×")),
    }
}

fn pct(x: f64) -> String {
    if x.is_finite() {
        format!("{:.0} %", 100.0 * x)
    } else {
        "–".to_owned()
    }
}

/// `model name` of the first CPU in `/proc/cpuinfo`, and which of AVX2 / AVX-512F / AVX-512
/// VNNI it has.
pub fn cpu_description() -> String {
    let info = fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |k: &str| {
        info.lines()
            .find(|l| l.split(':').next().is_some_and(|n| n.trim() == k))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_owned())
            .unwrap_or_default()
    };
    let flags = field("flags");
    let has = |f: &str| flags.split_whitespace().any(|x| x == f);
    let isa: Vec<&str> = [("avx2", "AVX2"), ("avx512f", "AVX-512F"), ("avx512_vnni", "AVX-512 VNNI")]
        .into_iter()
        .filter(|(f, _)| has(f))
        .map(|(_, n)| n)
        .collect();
    let name = field("model name");
    format!("{} ({})", if name.is_empty() { "unknown CPU" } else { &name }, if isa.is_empty() { "no AVX2".to_owned() } else { isa.join(", ") })
}

/// The sentence that labels a run a smoke test (other work ran, or fewer than 3 repeats);
/// empty otherwise.
fn smoke_test_warning(o: &GenerateOptions, meta: &RunMeta) -> &'static str {
    if meta.busy || o.repeats < 3 {
        " **Other work ran on the machine and/or there were fewer than 3 repeats: a smoke \
         test, not a measurement; do not draw conclusions from these numbers.**"
    } else {
        ""
    }
}

/// The llama-bench comparison (`--llama-bench`): llama.cpp's own benchmark tool, as llama.cpp
/// users quote it, against deco's prefill (a prompt of P tokens from an empty cache: llama-bench's
/// pp at depth 0) and decode (N tokens after that prompt: tg at depth P). `standalone`: with the
/// heading and the run's description (a `--skip-llama` run).
pub fn render_llama_bench(o: &GenerateOptions, results: &[TypeResult], meta: &RunMeta, standalone: bool) -> String {
    let (p, n) = (o.prompt_tokens, o.decode_tokens);
    let mut s = String::new();
    if standalone {
        s.push_str(&format!("## deco vs llama-bench, ISA `{}` (`cargo xtask bench generate --llama-bench`)\n\n", o.isa.name()));
        s.push_str(&format!(
            "Measured by `{}` on {} at commit `{}`, CPU {}; load average before: {}, after: {}.{}\n\n",
            o.command_line(),
            if meta.date.is_empty() { "?" } else { &meta.date },
            if meta.commit.is_empty() { "?" } else { &meta.commit },
            cpu_description(),
            meta.loadavg_before,
            meta.loadavg_after,
            smoke_test_warning(o, meta)
        ));
    } else {
        s.push_str("### llama.cpp's own `llama-bench` (same run)\n\n");
    }
    if results.iter().any(|r| r.ty.fetched().is_some()) {
        s.push_str(
            "The Qwen rows are the published Qwen2.5-Coder-Instruct Q4_K_M files (fetched by \
             `cargo xtask fetch --what qwen`); the SmolLM2 Q8_0 and F32 files are made from its \
             Q4_1 file by `deco quantize`.\n\n",
        );
    }
    s.push_str(&format!(
        "The same GGUF files for both engines, {} threads. llama-bench is built from the same vendored llama.cpp \
         with cmake + ninja ({}; OpenMP as the compiler offers it, llama.cpp's defaults otherwise), \
         run as `llama-bench -p {p} -n {n} -d 0,{p} -r 1 -t {}` (its own warm-up first) once per \
         repeat, interleaved with deco. deco is `deco generate{}`{}: its prefill (a {p}-token \
         prompt into an empty cache) is compared with pp{p} at depth 0, its decode ({n} tokens \
         after that prompt) with tg{n} at depth {p}. tok/s as min / **median** / max over {} \
         repeat(s); ratios of the medians, in parentheses the range of the per-repeat ratios.\n\n",
        o.threads,
        match o.isa {
            BenchIsa::Native => "`GGML_NATIVE=ON`: -march=native",
            BenchIsa::Avx2 => "`GGML_NATIVE=OFF`: SSE4.2, AVX, AVX2, BMI2, FMA, F16C, no AVX-512",
        },
        o.threads,
        deco_flags(o),
        if o.isa == BenchIsa::Avx2 { " with `DECO_KERNELS=avx2` (AVX2 kernels only)" } else { "" },
        o.repeats
    ));
    s.push_str(&format!(
        "| type | llama-bench pp{p} | pp{p} @ d{p} | tg{n} | tg{n} @ d{p} | deco prefill | deco decode | prefill deco / pp{p} | goal | decode deco / tg{n} @ d{p} | goal |\n|---|---|---|---|---|---|---|---|---|---|---|\n"
    ));
    for r in results {
        let col = |f: fn(&LlamaBenchStats) -> f64| r.llama_bench.iter().map(f).collect::<Vec<_>>();
        let (pp0, ppd, tg0, tgd) = (col(|b| b.pp_d0), col(|b| b.pp_dp), col(|b| b.tg_d0), col(|b| b.tg_dp));
        let deco_p: Vec<f64> = r.deco.iter().map(|x| x.prompt_tok_s).collect();
        let deco_d: Vec<f64> = r.deco.iter().map(|x| x.decode_tok_s).collect();
        let (pr, pg) = fmt_ratio(ratios(&deco_p, &pp0), r.ty.prefill_goal());
        let (dr, dg) = fmt_ratio(ratios(&deco_d, &tgd), r.ty.decode_goal());
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {pr} | {pg} | {dr} | {dg} |\n",
            r.ty.name(),
            fmt_mmm(min_med_max(&pp0), 1),
            fmt_mmm(min_med_max(&ppd), 1),
            fmt_mmm(min_med_max(&tg0), 1),
            fmt_mmm(min_med_max(&tgd), 1),
            fmt_mmm(prefill_mmm(&r.deco), 1),
            fmt_mmm(decode_mmm(&r.deco), 1),
        ));
    }
    s
}

/// The markdown section (also what the terminal shows): throughput per type and engine, the
/// ratios against issue 5's goals, and the physical decode limit.
pub fn render_markdown(
    o: &GenerateOptions,
    results: &[TypeResult],
    bw: &Bandwidth,
    meta: &RunMeta,
) -> String {
    let mut s = String::new();
    s.push_str("## deco vs llama.cpp, same GGUF (`cargo xtask bench generate`)\n\n");
    s.push_str(&format!(
        "Measured by `{}` on {} at commit `{}`; load average before: {}, after: {}.{}\n\n",
        o.command_line(),
        if meta.date.is_empty() {
            "?"
        } else {
            &meta.date
        },
        if meta.commit.is_empty() {
            "?"
        } else {
            &meta.commit
        },
        meta.loadavg_before,
        meta.loadavg_after,
        smoke_test_warning(o, meta)
    ));
    s.push_str(&format!(
        "SmolLM2-135M-Instruct, {} threads for both engines, a prompt of {} tokens (one prefill), \
         then {} greedy decode steps (EOS ignored); llama.cpp is {LLAMA_CPP_PYTHON} (vendored \
         llama.cpp, `xtask/scripts/llama_bench.py`, one unmeasured warm-up per run), deco is \
         `deco generate{}`{} (one unmeasured warm-up run per file). Engines and types are \
         interleaved in each repeat. The \
         Q8_0 and F32 files are made from the Q4_1 file by `deco quantize` (Q8_0: the dequantized \
         Q4_1 linears requantized with ggml's Q8_0 quantizer; F32: every quantized tensor \
         dequantized), so all three hold the same network up to Q8_0 rounding; the tied token \
         embedding / LM head stays Q8_0 in the Q4_1 and Q8_0 files. tok/s as min / **median** / \
         max over {} repeat(s).\n\n",
        o.threads,
        o.prompt_tokens,
        o.decode_tokens,
        deco_flags(o),
        match (o.q8_activations, o.kv_f16) {
            (true, true) => " (8-bit activations and integer dot products in the packed matmuls, and an f16 KV cache, as llama.cpp)",
            (true, false) => " (8-bit activations and integer dot products in the packed matmuls, as llama.cpp)",
            (false, true) => " (f32 activations, an f16 KV cache as llama.cpp)",
            (false, false) => " (f32 activations)",
        },
        o.repeats
    ));
    if results.iter().any(|r| r.ty.fetched().is_some()) {
        s.push_str(
            "The Qwen rows are the published Qwen2.5-Coder-Instruct Q4_K_M files (fetched by \
             `cargo xtask fetch --what qwen`), not made from SmolLM2.\n\n",
        );
    }
    s.push_str("| type | engine | prefill tok/s | decode tok/s |\n|---|---|---|---|\n");
    for r in results {
        for (name, runs) in [("llama.cpp", &r.llama), ("deco", &r.deco)] {
            s.push_str(&format!(
                "| {} | {name} | {} | {} |\n",
                r.ty.name(),
                fmt_mmm(prefill_mmm(runs), 1),
                fmt_mmm(decode_mmm(runs), 1)
            ));
        }
    }
    s.push_str(
        "\nRatios deco / llama.cpp: of the medians, in parentheses the range of the per-repeat \
         ratios (repeat i of deco over repeat i of llama.cpp); goals from issues 5 and 19.\n\n",
    );
    s.push_str("| type | prefill deco / llama.cpp | goal | decode deco / llama.cpp | goal |\n|---|---|---|---|---|\n");
    for r in results {
        let p = ratios(
            &r.deco.iter().map(|x| x.prompt_tok_s).collect::<Vec<_>>(),
            &r.llama.iter().map(|x| x.prompt_tok_s).collect::<Vec<_>>(),
        );
        let d = ratios(
            &r.deco.iter().map(|x| x.decode_tok_s).collect::<Vec<_>>(),
            &r.llama.iter().map(|x| x.decode_tok_s).collect::<Vec<_>>(),
        );
        let (pr, pg) = fmt_ratio(p, r.ty.prefill_goal());
        let (dr, dg) = fmt_ratio(d, r.ty.decode_goal());
        s.push_str(&format!(
            "| {} | {pr} | {pg} | {dr} | {dg} |\n",
            r.ty.name()
        ));
    }
    let [big, small] = BANDWIDTH_MIB;
    let bw_text = |mib: usize| match min_med_max(bw.samples(mib)) {
        Some((a, b, c)) => format!("{a:.1} / **{b:.1}** / {c:.1} GB/s"),
        None => "not measured".to_owned(),
    };
    s.push_str(&format!(
        "\nPhysical decode limit = weight bytes read per generated token / read bandwidth. Read \
         bandwidth, measured in this run before and after the engines (streaming sum of u64 with \
         {} threads, `rustc -O -C target-cpu=native`; min / **median** / max of the passes): \
         {big} MiB buffer {} (beyond the 32 MiB L3: DRAM), {small} MiB buffer {}. Bytes counted \
         per token (from the GGUF tensor table): every decoder linear (`blk.*` matrices), the \
         whole LM head (the tied `token_embd.weight`, or `output.weight`), one `token_embd` row \
         and the norms; not counted: the KV cache (grows with the position) and activations. \
         Limits use the median bandwidths; decode / limit uses the {big} MiB one.\n\n",
        o.threads,
        bw_text(big),
        bw_text(small)
    ));
    s.push_str(&format!(
        "| type | file MB | weight MB / token (linears + head) | limit tok/s @ {big} MiB bw | limit tok/s @ {small} MiB bw | llama.cpp decode / limit | deco decode / limit |\n|---|---|---|---|---|---|---|\n"
    ));
    for r in results {
        let total = r.weights.total();
        let lim = limit_tok_s(total, bw.median(big));
        let lim_small = limit_tok_s(total, bw.median(small));
        let med = |x: Mmm| x.map_or(f64::NAN, |x| x.1);
        s.push_str(&format!(
            "| {} | {:.1} | {:.1} ({:.1} + {:.1}) | {:.0} | {:.0} | {} | {} |\n",
            r.ty.name(),
            r.file_bytes as f64 / 1e6,
            total as f64 / 1e6,
            r.weights.linears as f64 / 1e6,
            r.weights.head as f64 / 1e6,
            lim,
            lim_small,
            pct(med(decode_mmm(&r.llama)) / lim),
            pct(med(decode_mmm(&r.deco)) / lim)
        ));
    }
    s.push_str(
        "\nReproduce: `cargo xtask bench generate` (defaults: `--types q4_1,q8_0,f32 --threads 2 \
         --repeats 3 --prompt-tokens 512 --decode-tokens 128`) on an otherwise idle machine; \
         raw numbers in `<cache>/bench/generate-last.json`.\n\n",
    );
    s.push_str(
        "![deco vs llama.cpp vs the read-bandwidth limit, per type](performance/generate.svg)\n",
    );
    s
}

fn plot(path: &Path, results: &[TypeResult], bw: &Bandwidth) -> Result<()> {
    use plotters::prelude::*;
    let n = results.len();
    let big = BANDWIDTH_MIB[0];
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (900, 420)).into_drawing_area();
        let draw = || -> std::result::Result<(), Box<dyn std::error::Error + '_>> {
            root.fill(&WHITE)?;
            let areas = root.split_evenly((1, 2));
            let names: Vec<&str> = results.iter().map(|r| r.ty.name()).collect();
            let label = move |v: &f64| {
                let i = v.round();
                if (v - i).abs() < 1e-6 && i >= 0.0 {
                    names.get(i as usize).copied().unwrap_or("").to_owned()
                } else {
                    String::new()
                }
            };
            type Runs = fn(&TypeResult) -> &[Stats];
            let engines: [(&str, RGBColor, Runs); 2] = [
                ("llama.cpp", RGBColor(230, 120, 30), |r| &r.llama),
                ("deco", RGBColor(40, 90, 200), |r| &r.deco),
            ];
            for (panel, (title, get, with_limit)) in [
                (
                    "Decode tok/s (median, min–max)",
                    (|s: &Stats| s.decode_tok_s) as fn(&Stats) -> f64,
                    true,
                ),
                (
                    "Prefill tok/s (median, min–max)",
                    |s: &Stats| s.prompt_tok_s,
                    false,
                ),
            ]
            .into_iter()
            .enumerate()
            {
                let lim = |r: &TypeResult| limit_tok_s(r.weights.total(), bw.median(big));
                let ymax = results
                    .iter()
                    .flat_map(|r| {
                        r.llama
                            .iter()
                            .chain(&r.deco)
                            .map(get)
                            .chain(with_limit.then(|| lim(r)))
                    })
                    .filter(|v| v.is_finite())
                    .fold(1.0f64, f64::max)
                    * 1.4; // headroom for the legend
                let mut chart = ChartBuilder::on(&areas[panel])
                    .caption(title, ("sans-serif", 16))
                    .margin(10)
                    .x_label_area_size(35)
                    .y_label_area_size(55)
                    .build_cartesian_2d(-0.5f64..n as f64 - 0.5, 0.0..ymax)?;
                chart
                    .configure_mesh()
                    .light_line_style(WHITE)
                    .x_labels(n)
                    .x_label_formatter(&label)
                    .y_desc("tok/s")
                    .draw()?;
                let width = if with_limit { 0.25 } else { 0.3 };
                for (k, (name, color, runs)) in engines.iter().enumerate() {
                    let x0 = |i: usize| {
                        i as f64 - if with_limit { 0.375 } else { 0.3 } + k as f64 * width
                    };
                    let stat =
                        |r: &TypeResult| min_med_max(&runs(r).iter().map(get).collect::<Vec<_>>());
                    chart
                        .draw_series(results.iter().enumerate().filter_map(|(i, r)| {
                            stat(r).map(|(_, m, _)| {
                                Rectangle::new([(x0(i), 0.0), (x0(i) + width, m)], color.filled())
                            })
                        }))?
                        .label(*name)
                        .legend(move |(x, y)| {
                            Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled())
                        });
                    for (i, r) in results.iter().enumerate() {
                        if let Some((lo, _, hi)) = stat(r) {
                            let xc = x0(i) + width / 2.0;
                            chart.draw_series(std::iter::once(PathElement::new(
                                vec![(xc, lo), (xc, hi)],
                                BLACK.stroke_width(1),
                            )))?;
                        }
                    }
                }
                if with_limit {
                    let x0 = |i: usize| i as f64 + 0.125;
                    chart
                        .draw_series(
                            results
                                .iter()
                                .enumerate()
                                .filter(|(_, r)| lim(r).is_finite())
                                .map(|(i, r)| {
                                    Rectangle::new(
                                        [(x0(i), 0.0), (x0(i) + width, lim(r))],
                                        RGBColor(150, 150, 150).mix(0.6).filled(),
                                    )
                                }),
                        )?
                        .label(format!("limit ({big} MiB read bandwidth)"))
                        .legend(|(x, y)| {
                            Rectangle::new(
                                [(x, y - 5), (x + 12, y + 5)],
                                RGBColor(150, 150, 150).mix(0.6).filled(),
                            )
                        });
                }
                chart
                    .configure_series_labels()
                    .position(SeriesLabelPosition::UpperRight)
                    .background_style(WHITE.mix(0.8))
                    .border_style(BLACK)
                    .draw()?;
            }
            root.present()?;
            Ok(())
        };
        draw().map_err(|e| anyhow::anyhow!("plot failed: {e}"))?;
    }
    fs::write(path, svg).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
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

/// llama.cpp's `llama-bench` for `isa`, built once from the llama-cpp-python sdist's vendored
/// sources with the venv's cmake + ninja (`xtask/scripts/llama_reference.py bench-build`, kept
/// in `<cache>/build/llama.cpp-VERSION/llama-bench-ISA/`; ~5 min on 2 cores).
fn build_llama_bench(cache: &Path, isa: BenchIsa) -> Result<PathBuf> {
    let py = python::venv_python(cache)?;
    python::ensure_packages(&py, "import cmake, ninja", &["cmake>=3.21,<5", "ninja>=1.11"], &[])?;
    let (package, version) = fetch::LLAMA_CPP_SDIST;
    let sdist = python::pip_download(cache, package, version, &[])?;
    let work = cache.join("build").join(format!("llama.cpp-{version}"));
    eprintln!("llama-bench ({}) from {} (built once: ~5 min on 2 cores)", isa.name(), sdist.display());
    let out = Command::new(&py)
        .arg(python::script("llama_reference.py"))
        .args(["bench-build", "--sdist"])
        .arg(&sdist)
        .arg("--work")
        .arg(&work)
        .args(["--isa", isa.name()])
        .stderr(Stdio::inherit())
        .output()
        .context("cannot run xtask/scripts/llama_reference.py bench-build")?;
    if !out.status.success() {
        bail!("building llama-bench failed ({}; xtask/scripts/llama_reference.py bench-build)", out.status);
    }
    let path = String::from_utf8_lossy(&out.stdout).lines().last().unwrap_or_default().trim().to_owned();
    let bin = PathBuf::from(path);
    if !bin.is_file() {
        bail!("llama_reference.py bench-build printed `{}`, which is not a file", bin.display());
    }
    Ok(bin)
}

/// One `llama-bench` run: `-p P -n N -d 0,P -r 1 -t T -o json` (llama-bench warms up first).
fn run_llama_bench(bin: &Path, model: &Path, o: &GenerateOptions) -> Result<LlamaBenchStats> {
    let mut cmd = Command::new(bin);
    cmd.arg("-m")
        .arg(model)
        .args(["-t", &o.threads.to_string()])
        .args(["-p", &o.prompt_tokens.to_string()])
        .args(["-n", &o.decode_tokens.to_string()])
        .args(["-d", &format!("0,{}", o.prompt_tokens)])
        .args(["-r", "1", "-o", "json"]);
    let shown = show(&cmd);
    let out = cmd.output().with_context(|| format!("cannot start `{shown}`"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = err.lines().rev().take(10).collect::<Vec<_>>().into_iter().rev().collect();
        bail!("`{shown}` failed ({}):\n{}", out.status, tail.join("\n"));
    }
    parse_llama_bench(&String::from_utf8_lossy(&out.stdout), o.prompt_tokens as u64, o.decode_tokens as u64)
        .with_context(|| format!("`{shown}`"))
}

/// A prefix of the text in `text_path` that `deco tokenize` (the encoding `deco generate` uses)
/// turns into exactly `n` tokens with `model`'s tokenizer: the shortest prefix with at least
/// `n` tokens (bisection on the character count), then the next characters until the count is
/// `n`. Cached as `<out_dir>/prompt-N-<model stem>.txt`.
fn exact_prompt(deco: &Path, model: &Path, text_path: &Path, n: usize, out_dir: &Path) -> Result<String> {
    let stem = model.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let cached = out_dir.join(format!("prompt-{n}-{stem}.txt"));
    let tokens = |prompt: &str| -> Result<usize> {
        let mut cmd = Command::new(deco);
        cmd.args(["tokenize", "--model"]).arg(model).args(["--text", prompt]);
        let (stdout, _) = util::output(&mut cmd)?;
        let ids: Vec<u32> = serde_json::from_str(stdout.trim()).context("`deco tokenize` printed no JSON list")?;
        Ok(ids.len())
    };
    // A cached prompt is checked once (the tokenizer or the file may have changed since).
    if let Ok(t) = fs::read_to_string(&cached)
        && tokens(&t)? == n
    {
        return Ok(t);
    }
    let text = fs::read_to_string(text_path).with_context(|| format!("cannot read {}", text_path.display()))?;
    let chars: Vec<char> = text.chars().take(n.saturating_mul(20)).collect();
    let count = |len: usize| -> Result<usize> { tokens(&chars[..len].iter().collect::<String>()) };
    let (mut lo, mut hi) = (0, chars.len());
    if count(hi)? < n {
        bail!("{} has fewer than {n} tokens for {} in its first {hi} characters", text_path.display(), model.display());
    }
    while lo < hi {
        let mid = (lo + hi) / 2;
        if count(mid)? >= n {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    for len in hi..(hi + 16).min(chars.len() + 1) {
        if count(len)? == n {
            let prompt: String = chars[..len].iter().collect();
            write_replacing(&cached, &prompt)?;
            return Ok(prompt);
        }
    }
    bail!("no prefix of {} is exactly {n} tokens for {}", text_path.display(), model.display())
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
    run(util::cargo().args(["build", "--release", "-p", "deco-cli"]))
        .context("cannot build the deco CLI (crates/deco-cli)")?;
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

/// deco's options of a run as they appear on its command line (each with a leading space).
fn deco_flags(o: &GenerateOptions) -> String {
    let mut s = String::new();
    if o.q8_activations {
        s.push_str(" --q8-activations");
    }
    if o.kv_f16 {
        s.push_str(" --kv-cache-dtype f16");
    }
    s
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
        .args(o.q8_activations.then_some("--q8-activations"))
        .args(if o.kv_f16 { &["--kv-cache-dtype", "f16"][..] } else { &[] })
        .stdout(Stdio::null());
    if o.isa == BenchIsa::Avx2 {
        cmd.env("DECO_KERNELS", "avx2");
    }
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

    fn opts(repeats: usize) -> GenerateOptions {
        GenerateOptions {
            cache: PathBuf::new(),
            no_mirror: false,
            types: vec![BenchType::Q4_1, BenchType::Q8_0, BenchType::F32],
            threads: 2,
            repeats,
            prompt_tokens: 512,
            decode_tokens: 128,
            skip_deco: false,
            skip_llama: false,
            no_docs: true,
            deco_bin: None,
            q8_activations: false,
            kv_f16: false,
            llama_bench: false,
            isa: BenchIsa::Native,
        }
    }

    fn stats(prefill: f64, decode: f64) -> Stats {
        Stats {
            prompt_tokens: 512,
            prompt_tok_s: prefill,
            decode_tokens: 128,
            decode_tok_s: decode,
        }
    }

    #[test]
    fn parses_types() -> Result<()> {
        assert_eq!(parse_types("q4_1,q8_0,f32")?, vec![BenchType::Q4_1, BenchType::Q8_0, BenchType::F32]);
        assert_eq!(
            parse_types(" F32 , q4_1,f32,")?,
            vec![BenchType::F32, BenchType::Q4_1]
        );
        let err = |s: &str| {
            parse_types(s)
                .err()
                .map(|e| format!("{e:#}"))
                .unwrap_or_default()
        };
        let e = err("q4_1,q5_k");
        assert!(e.contains("--types") && e.contains("q5_k"), "{e}");
        assert!(err(" , ").contains("--types"));
        Ok(())
    }

    const INSPECT: &str = "file: x.gguf
GGUF v3, 98362432 bytes, 33 metadata keys, 272 tensors, alignment 32, data at offset 1785664

metadata:
  general.architecture                         string  \"llama\"
  tokenizer.ggml.tokens                        array   [string; 49152] [\"a\", \"b\", ...]

tensors:
  name                                 type                shape        bytes
  token_embd.weight                    Q8_0         [49152, 576]     30081024
  blk.0.attn_norm.weight               F32                 [576]         2304
  blk.0.ffn_down.weight                Q4_1          [576, 1536]       552960
  blk.0.attn_k.weight                  Q4_1           [192, 576]        69120
  output_norm.weight                   F32                 [576]         2304

134515008 parameters
  F32      61 tensors        34560 elements
";

    #[test]
    fn parses_the_inspect_tensor_table() -> Result<()> {
        let t = parse_inspect_tensors(INSPECT)?;
        assert_eq!(t.len(), 5);
        assert_eq!(
            t[0],
            TensorRow {
                name: "token_embd.weight".into(),
                ty: "Q8_0".into(),
                shape: vec![49152, 576],
                bytes: 30081024
            }
        );
        assert_eq!(t[1].shape, vec![576]);
        assert!(parse_inspect_tensors("metadata:\n  a u32 1\n").is_err());
        let bad = INSPECT.replace("552960", "lots");
        let e = parse_inspect_tensors(&bad)
            .err()
            .map(|e| format!("{e:#}"))
            .unwrap_or_default();
        assert!(e.contains("blk.0.ffn_down.weight"), "{e}");
        Ok(())
    }

    #[test]
    fn weight_bytes_and_limit_arithmetic() -> Result<()> {
        let t = parse_inspect_tensors(INSPECT)?;
        let w = decode_weight_bytes(&t)?;
        // Tied head: the whole token_embd; one of its 49152 rows for the lookup.
        assert_eq!(
            w,
            WeightBytes {
                linears: 552960 + 69120,
                head: 30081024,
                embed_row: 30081024 / 49152,
                norms: 2 * 2304
            }
        );
        assert_eq!(w.total(), 552960 + 69120 + 30081024 + 612 + 4608);
        // An untied output head replaces token_embd as the head.
        let mut untied = t.clone();
        untied.push(TensorRow {
            name: "output.weight".into(),
            ty: "Q6_K".into(),
            shape: vec![49152, 576],
            bytes: 1000,
        });
        assert_eq!(decode_weight_bytes(&untied)?.head, 1000);
        assert!(decode_weight_bytes(&t[1..]).is_err());
        // 100 MB per token at 20 GB/s: 200 tok/s.
        assert!((limit_tok_s(100_000_000, 20.0) - 200.0).abs() < 1e-9);
        assert!(limit_tok_s(0, 20.0).is_nan());
        Ok(())
    }

    #[test]
    fn parses_probe_output() -> Result<()> {
        let (m, v) = parse_probe("warming\nprobe mib=256 threads=2 gb_s=19.5,20.25,21.000\n")?;
        assert_eq!((m, v), (256, vec![19.5, 20.25, 21.0]));
        assert!(parse_probe("probe mib=256 threads=2").is_err());
        assert!(parse_probe("probe mib=x gb_s=1").is_err());
        assert!(parse_probe("nothing").is_err());
        Ok(())
    }

    #[test]
    fn ratios_and_verdicts() {
        // Medians 200 / 100; paired ratios 1.5, 2.0, 3.0.
        let (lo, med, hi) =
            ratios(&[150.0, 200.0, 300.0], &[100.0, 100.0, 100.0]).unwrap_or_default();
        assert_eq!((lo, med, hi), (1.5, 2.0, 3.0));
        assert_eq!(ratios(&[], &[1.0]), None);
        assert_eq!(verdict(1.25, 1.2), "met");
        assert_eq!(verdict(0.6, 1.2), "missed by 50 %");
        assert_eq!(verdict(f64::NAN, 1.0), "–");
    }

    fn fixture() -> (Vec<TypeResult>, Bandwidth) {
        let w = WeightBytes {
            linears: 60_000_000,
            head: 40_000_000,
            embed_row: 0,
            norms: 0,
        };
        let results = vec![
            TypeResult {
                ty: BenchType::Q4_1,
                model: PathBuf::from("q4_1.gguf"),
                file_bytes: 98_000_000,
                weights: w,
                llama: vec![stats(400.0, 100.0), stats(300.0, 80.0), stats(500.0, 90.0)],
                deco: vec![
                    stats(200.0, 120.0),
                    stats(150.0, 100.0),
                    stats(250.0, 116.0),
                ],
                llama_bench: vec![
                    LlamaBenchStats { pp_d0: 400.0, tg_d0: 110.0, pp_dp: 350.0, tg_dp: 100.0 },
                    LlamaBenchStats { pp_d0: 300.0, tg_d0: 100.0, pp_dp: 250.0, tg_dp: 80.0 },
                    LlamaBenchStats { pp_d0: 500.0, tg_d0: 105.0, pp_dp: 450.0, tg_dp: 90.0 },
                ],
            },
            TypeResult {
                ty: BenchType::F32,
                model: PathBuf::from("f32.gguf"),
                file_bytes: 540_000_000,
                weights: WeightBytes {
                    linears: 400_000_000,
                    ..w
                },
                llama: vec![stats(600.0, 36.0)],
                deco: vec![stats(660.0, 36.0)],
                llama_bench: Vec::new(),
            },
        ];
        let bw = Bandwidth {
            by_size: vec![(256, vec![19.0, 20.0, 30.0]), (64, vec![48.0])],
        };
        (results, bw)
    }

    /// `llama-bench -o json` output of this llama.cpp (fields trimmed to those read and a few
    /// neighbours): four tests, pp and tg at depth 0 and 512.
    const LLAMA_BENCH_JSON: &str = r#"[
  {"build_commit": "x", "n_threads": 2, "type_k": "f16", "n_prompt": 512, "n_gen": 0, "n_depth": 0, "avg_ts": 215.5, "stddev_ts": 0.0},
  {"build_commit": "x", "n_threads": 2, "type_k": "f16", "n_prompt": 0, "n_gen": 128, "n_depth": 0, "avg_ts": 80.25, "stddev_ts": 0.0},
  {"build_commit": "x", "n_threads": 2, "type_k": "f16", "n_prompt": 512, "n_gen": 0, "n_depth": 512, "avg_ts": 190.0, "stddev_ts": 0.0},
  {"build_commit": "x", "n_threads": 2, "type_k": "f16", "n_prompt": 0, "n_gen": 128, "n_depth": 512, "avg_ts": 72.5, "stddev_ts": 0.0}
]"#;

    #[test]
    fn parses_llama_bench_json() -> Result<()> {
        let b = parse_llama_bench(LLAMA_BENCH_JSON, 512, 128)?;
        assert_eq!(b, LlamaBenchStats { pp_d0: 215.5, tg_d0: 80.25, pp_dp: 190.0, tg_dp: 72.5 });
        // Another prompt length than the run's is missing, not guessed.
        let err = parse_llama_bench(LLAMA_BENCH_JSON, 256, 128).expect_err("no pp256 test in the output");
        assert!(format!("{err:#}").contains("n_prompt=256"), "{err:#}");
        assert!(parse_llama_bench("not json", 512, 128).is_err());
        assert!(parse_llama_bench("{}", 512, 128).is_err());
        Ok(())
    }

    #[test]
    fn llama_bench_table_has_ratios_against_pp_d0_and_tg_at_depth() {
        let (results, _) = fixture();
        let meta = RunMeta { date: "d".into(), commit: "c".into(), ..RunMeta::default() };
        let o = GenerateOptions { llama_bench: true, skip_llama: true, isa: BenchIsa::Avx2, ..opts(3) };
        let md = render_llama_bench(&o, &results, &meta, true);
        assert!(md.contains("ISA `avx2`"), "{md}");
        assert!(md.contains("--llama-bench --isa avx2"), "{md}");
        // Prefill: deco 200 / 150 / 250 over pp512@d0 400 / 300 / 500: medians 200 / 400 = 0.50.
        // Decode: deco 120 / 100 / 116 over tg128@d512 100 / 80 / 90: 116 / 90 = 1.29, paired
        // 1.20, 1.25, 1.29.
        assert!(
            md.contains("| Q4_1 | 300.0 / **400.0** / 500.0 | 250.0 / **350.0** / 450.0 | 100.0 / **105.0** / 110.0 | 80.0 / **90.0** / 100.0 | 150.0 / **200.0** / 250.0 | 100.0 / **116.0** / 120.0 | **0.50×** (0.50–0.50) | ≥ 1.0×: missed by 50 % | **1.29×** (1.20–1.29) | ≥ 1.2×: met |"),
            "{md}"
        );
        // A type without llama-bench runs has no ratio.
        assert!(md.contains("| F32 | – | – | – | – | 660.0 / **660.0** / 660.0 | 36.0 / **36.0** / 36.0 | – | ≥ 1.0× | – | ≥ 1.0× |"), "{md}");
    }

    #[test]
    fn llama_bench_sections_are_per_isa() {
        let doc = "# P\n\ntext\n";
        let (b, e) = llama_bench_markers(BenchIsa::Avx2);
        let once = splice_section_with(doc, "AVX2 TABLE", &b, &e);
        let (b2, e2) = llama_bench_markers(BenchIsa::Native);
        let both = splice_section_with(&once, "NATIVE TABLE", &b2, &e2);
        let again = splice_section_with(&both, "AVX2 NEW", &b, &e);
        assert!(again.contains("AVX2 NEW") && !again.contains("AVX2 TABLE") && again.contains("NATIVE TABLE"), "{again}");
    }

    #[test]
    fn markdown_has_ratios_goals_and_limits() {
        let (results, bw) = fixture();
        let meta = RunMeta {
            date: "2026-01-01 00:00 UTC".into(),
            commit: "abc1234".into(),
            loadavg_before: "0.10 0.1 0.1".into(),
            loadavg_after: "2.0 1 1".into(),
            busy: false,
        };
        let md = render_markdown(&opts(3), &results, &bw, &meta);
        // Throughput min / median / max.
        assert!(
            md.contains(
                "| Q4_1 | llama.cpp | 300.0 / **400.0** / 500.0 | 80.0 / **90.0** / 100.0 |"
            ),
            "{md}"
        );
        // Prefill 200 / 400 = 0.50 (paired 0.50..0.50), decode 116 / 90 = 1.29 (paired 1.20..1.29).
        assert!(md.contains("| Q4_1 | **0.50×** (0.50–0.50) | ≥ 1.0×: missed by 50 % | **1.29×** (1.20–1.29) | ≥ 1.2×: met |"), "{md}");
        assert!(md.contains("| F32 | **1.10×** (1.10–1.10) | ≥ 1.0×: met | **1.00×** (1.00–1.00) | ≥ 1.0×: met |"), "{md}");
        // Limits: 100 MB at the 20 GB/s median = 200 tok/s, at 48 GB/s = 480; llama.cpp
        // 90 / 200 = 45 %, deco 116 / 200 = 58 %. F32: 440 MB -> 45 tok/s; 36 / 45.45 = 79 %.
        assert!(
            md.contains("| Q4_1 | 98.0 | 100.0 (60.0 + 40.0) | 200 | 480 | 45 % | 58 % |"),
            "{md}"
        );
        assert!(
            md.contains("| F32 | 540.0 | 440.0 (400.0 + 40.0) | 45 | 109 | 79 % | 79 % |"),
            "{md}"
        );
        assert!(md.contains("19.0 / **20.0** / 30.0 GB/s"), "{md}");
        assert!(md.contains("--types q4_1,q8_0,f32 --threads 2 --repeats 3 --prompt-tokens 512 --decode-tokens 128"), "{md}");
        assert!(!md.contains("smoke test"), "{md}");
        assert!(render_markdown(&opts(1), &results, &bw, &meta).contains("smoke test"));
    }

    #[test]
    fn splices_the_section() {
        let doc = "# Title\n\nFirst paragraph\nstill first.\n\n## Next\n\ntext\n";
        let once = splice_section(doc, "TABLE 1\n");
        assert_eq!(
            once,
            "# Title\n\nFirst paragraph\nstill first.\n\n<!-- bench generate begin -->\nTABLE 1\n<!-- bench generate end -->\n\n## Next\n\ntext\n"
        );
        // Replaces between the markers, leaves the rest alone.
        let twice = splice_section(
            &(once.clone() + "\n## Appended by someone else\n"),
            "TABLE 2",
        );
        assert!(
            twice.contains("begin -->\nTABLE 2\n<!-- bench generate end -->\n\n## Next"),
            "{twice}"
        );
        assert!(!twice.contains("TABLE 1") && twice.ends_with("## Appended by someone else\n"));
        // A document that is one paragraph.
        assert_eq!(
            splice_section("only", "T"),
            "only\n\n<!-- bench generate begin -->\nT\n<!-- bench generate end -->\n"
        );
    }

    #[test]
    fn plot_has_every_type_and_the_limit() -> Result<()> {
        let (results, bw) = fixture();
        let path =
            std::env::temp_dir().join(format!("xtask-generate-plot-{}.svg", std::process::id()));
        plot(&path, &results, &bw)?;
        let svg = fs::read_to_string(&path)?;
        fs::remove_file(&path)?;
        for needle in [
            "Q4_1",
            "F32",
            "llama.cpp",
            "deco",
            "limit (256 MiB read bandwidth)",
            "Decode tok/s",
            "Prefill tok/s",
        ] {
            assert!(svg.contains(needle), "{needle} missing");
        }
        Ok(())
    }

    #[test]
    fn bandwidth_probe_compiles_and_reports_every_pass() -> Result<()> {
        let dir = std::env::temp_dir().join(format!("xtask-probe-{}", std::process::id()));
        fs::create_dir_all(&dir)?;
        let bin = build_probe(&dir)?;
        // Reused when the source is unchanged.
        let built = fs::metadata(&bin)?.modified()?;
        assert_eq!(fs::metadata(build_probe(&dir)?)?.modified()?, built);
        let out = Command::new(&bin).args(["8", "2", "3"]).output()?;
        assert!(out.status.success());
        let (mib, gb_s) = parse_probe(&String::from_utf8_lossy(&out.stdout))?;
        assert_eq!((mib, gb_s.len()), (8, 3));
        assert!(gb_s.iter().all(|x| x.is_finite() && *x > 0.0), "{gb_s:?}");
        assert!(
            !Command::new(&bin)
                .args(["8", "0", "3"])
                .output()?
                .status
                .success()
        );
        fs::remove_dir_all(&dir)?;
        Ok(())
    }
}
