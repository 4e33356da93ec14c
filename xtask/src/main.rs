//! `cargo xtask`: developer tasks for deco.
//!
//! * `fetch`  — fill the cache (`--cache-dir`, `$DECO_CACHE`, or `<workspace>/.cache`) with the
//!   model, data, golden files and tokenizer tests; mirror (`../shared`) first, registry otherwise.
//! * `demo`   — fetch the model and chat with it through the `deco` CLI.
//! * `test`   — fetch, then run the workspace tests (and the wgpu tier).
//! * `build --cuda` — the release `deco` with the CUDA backend, LLVM from the package registry
//!   (`--check`: type-check only, as CI does).
//! * `device-check` — prepare the one-shot GPU check (`device-check/`, run there with
//!   `bash device-check/run.sh`).
//! * `interop` — deco's exports read by transformers + gptqmodel / compressed-tensors and
//!   compared with llama-quantize (its own venv; not part of `test`).
//! * `bench generate` — deco vs llama.cpp prefill/decode throughput on the same GGUF.
//! * `bench autodeco` — GSM pass@k of greedy / sampling / oracle static / AutoDeco into docs/autodeco.md.
//! * `bench compress` — pruning results (perplexity, size, speed) into docs/compression.md.
//! * `bench serve` — serving throughput at 1-64 streams, latency, load test into docs/serving.md.

mod autodeco;
mod autodeco_qwen;
mod bench;
mod compress;
mod cuda;
mod decoding;
mod device_check;
mod fetch;
mod fuzz;
mod interop;
mod manifest;
mod medusa;
mod python;
mod quant;
mod serve;
mod util;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};

use fetch::What;

#[derive(Parser)]
#[command(
    name = "xtask",
    bin_name = "cargo xtask",
    about = "Developer tasks for deco"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Args, Clone)]
struct CacheArgs {
    /// Cache directory (default: $DECO_CACHE, else <workspace>/.cache).
    #[arg(long, value_name = "DIR")]
    cache_dir: Option<PathBuf>,
    /// Do not use the local mirror (<workspace>/../shared) even when present.
    #[arg(long)]
    no_mirror: bool,
}

// Parsed once per run: the size of the largest variant (bench autodeco's options) costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Cmd {
    /// Fetch model/data/golden/tokenizer-test files into the cache (sha256 checked).
    Fetch {
        #[command(flatten)]
        cache: CacheArgs,
        /// What to fetch (comma-separated or repeated).
        #[arg(long, value_enum, value_delimiter = ',', default_value = "all")]
        what: Vec<What>,
    },
    /// Build the libFuzzer targets of fuzz/ (nightly, ASan) and run one for --time seconds.
    Fuzz {
        #[command(flatten)]
        cache: CacheArgs,
        /// The target.
        #[arg(value_enum)]
        target: fuzz::Target,
        /// Seconds to fuzz.
        #[arg(long, default_value_t = 60)]
        time: u64,
    },
    /// The interop tier: deco's GPTQ / AWQ / compressed-tensors exports loaded by transformers
    /// + gptqmodel (perplexity within 0.02 %), GGUF Q8_0 byte-identical to `llama-quantize
    /// --pure` (installs its own ~6 GB venv; not part of `test`).
    Interop {
        #[command(flatten)]
        cache: CacheArgs,
        /// Use this deco binary instead of building deco-cli (release).
        #[arg(long, value_name = "PATH")]
        deco_bin: Option<PathBuf>,
    },
    /// Fetch the model if needed and run a chat generation with the deco CLI.
    Demo {
        #[command(flatten)]
        cache: CacheArgs,
        /// The user message.
        #[arg(
            long,
            default_value = "What is the capital of France? Answer in one sentence."
        )]
        prompt: String,
        /// Maximum generated tokens.
        #[arg(long, default_value_t = 64)]
        max_new_tokens: usize,
    },
    /// Fetch (mirror first), then run the test tiers.
    Test {
        #[command(flatten)]
        cache: CacheArgs,
        /// default: `cargo test --workspace --release`; wgpu: deco-kernels and deco-model with the
        /// wgpu feature (CubeCL kernels and the model on Mesa lavapipe) and deco-serve's device
        /// paged cache test; all: both.
        #[arg(long, value_enum, default_value = "all")]
        tier: Tier,
        /// Extra arguments for the test binaries (after `--`).
        #[arg(last = true)]
        test_args: Vec<String>,
    },
    /// Build the release `deco` binary; `--cuda`: with burn's CUDA backend, LLVM 23 supplied
    /// from PyPI (mlc-llvm-static) instead of the bundler's download (see xtask/src/cuda.rs).
    Build {
        #[command(flatten)]
        cache: CacheArgs,
        /// Build with `--features cuda`.
        #[arg(long)]
        cuda: bool,
        /// Type-check only (`cargo check`), with the real build scripts.
        #[arg(long, requires = "cuda")]
        check: bool,
        /// Target directory of the CUDA build (default: <cache>/cuda/target).
        #[arg(long, value_name = "DIR", requires = "cuda")]
        target_dir: Option<PathBuf>,
        /// cudarc's CUDA version for its bindings (CUDARC_CUDA_VERSION), e.g. 12080 = 12.8.
        #[arg(long, default_value = cuda::DEFAULT_CUDA_VERSION, requires = "cuda")]
        cuda_version: String,
    },
    /// Prepare the one-shot GPU check of issue 13 in device-check/ (the CUDA binary, shape
    /// clones' headers, prompts, scripts; under the device tool's 64 MiB), run on a device
    /// machine with `bash device-check/run.sh`.
    DeviceCheck {
        #[command(flatten)]
        cache: CacheArgs,
        /// Use this CUDA deco binary instead of `cargo xtask build --cuda`.
        #[arg(long, value_name = "PATH")]
        deco_bin: Option<PathBuf>,
        /// cudarc's CUDA version for the build (CUDARC_CUDA_VERSION).
        #[arg(long, default_value = cuda::DEFAULT_CUDA_VERSION)]
        cuda_version: String,
        /// Instead of preparing: write the results of a run (the folder its $OUT came back
        /// to) into docs/performance.md.
        #[arg(long, value_name = "DIR")]
        record: Option<PathBuf>,
    },
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        which: BenchCmd,
    },
}

#[derive(Subcommand)]
enum BenchCmd {
    /// Medusa heads on SmolLM2-135M and Qwen2.5-Coder-0.5B: heads trained on self-distilled GSM
    /// prompts, per-head held-out accuracy, speed of every candidate tree against greedy at
    /// batch 1; updates docs/decoding.md.
    Medusa {
        #[command(flatten)]
        cache: CacheArgs,
        /// Interleaved repeats of the speed runs (median).
        #[arg(long, default_value_t = 3)]
        repeats: usize,
        /// Generated tokens per run.
        #[arg(long, default_value_t = 96)]
        max_new_tokens: usize,
        /// Training steps of the SmolLM2 heads (128 positions per step).
        #[arg(long, default_value_t = 1500)]
        train_steps: usize,
        /// Training prompts (self-distilled responses).
        #[arg(long, default_value_t = 512)]
        train_examples: usize,
        /// Training steps of the Qwen2.5-Coder-0.5B heads (64 positions per step).
        #[arg(long, default_value_t = 300)]
        qwen_train_steps: usize,
        /// Training prompts of the Qwen2.5-Coder-0.5B heads.
        #[arg(long, default_value_t = 128)]
        qwen_train_examples: usize,
        /// Held-out prompts of the accuracy report.
        #[arg(long, default_value_t = 48)]
        eval_examples: usize,
        /// CPU threads of every deco run.
        #[arg(long, default_value_t = 2)]
        threads: usize,
        /// Skip Qwen2.5-Coder-0.5B.
        #[arg(long)]
        skip_qwen: bool,
        /// 8-bit activations in the packed matmuls of every speed run, greedy and Medusa alike
        /// (`deco generate --q8-activations`).
        #[arg(long)]
        q8_activations: bool,
        /// Only run speed measurements whose label contains one of these (comma-separated).
        #[arg(long)]
        only: Option<String>,
        /// Use this deco binary instead of building deco-cli (release).
        #[arg(long)]
        deco_bin: Option<PathBuf>,
    },
    /// Decoding strategies: speculative speedup / acceptance (SmolLM2 self-speculative and prompt
    /// lookup, Qwen2.5-Coder 1.5B + 0.5B draft), beam cost vs num_beams, early exit; updates
    /// docs/decoding.md.
    Decoding {
        #[command(flatten)]
        cache: CacheArgs,
        /// Interleaved repeats of the SmolLM2 runs (median).
        #[arg(long, default_value_t = 3)]
        repeats: usize,
        /// Generated tokens per SmolLM2 run.
        #[arg(long, default_value_t = 64)]
        max_new_tokens: usize,
        /// Generated tokens per Qwen2.5-Coder-1.5B run.
        #[arg(long, default_value_t = 32)]
        qwen_max_new_tokens: usize,
        /// Repeats of the Qwen runs.
        #[arg(long, default_value_t = 3)]
        qwen_repeats: usize,
        /// Generated tokens per beam-search run.
        #[arg(long, default_value_t = 32)]
        beam_max_new_tokens: usize,
        /// Teacher-forced early-exit windows (256 tokens of wiki_test).
        #[arg(long, default_value_t = 2)]
        ee_windows: usize,
        /// CPU threads of every deco run.
        #[arg(long, default_value_t = 2)]
        threads: usize,
        /// Skip the Qwen2.5-Coder runs (no 1.6 GB fetch).
        #[arg(long)]
        skip_qwen: bool,
        /// Only run measurements whose label contains one of these (comma-separated).
        #[arg(long)]
        only: Option<String>,
        /// Use this deco binary instead of building deco-cli (release).
        #[arg(long, value_name = "PATH")]
        deco_bin: Option<PathBuf>,
    },
    /// Quantization of SmolLM2-135M (RTN / GPTQ / AWQ at W8, W4 g128, W4, W3 g128; SmoothQuant
    /// W8A8; LLM.int8(); NF4): perplexity, KLD, size, time; updates docs/quantization.md.
    Quant {
        #[command(flatten)]
        cache: CacheArgs,
        /// Calibration windows (wiki_train). 128 x 256 = 32,768 tokens, 21 per input of the
        /// widest linear (down_proj, 1,536): with 16 windows GPTQ over-fits its Hessians
        /// (docs/quantization.md, "GPTQ vs RTN at W4 g128 on text it was not calibrated on").
        #[arg(long, default_value_t = 128)]
        nsamples: usize,
        /// Tokens per calibration window.
        #[arg(long, default_value_t = 256)]
        seqlen: usize,
        /// Perplexity / KLD windows of 256 tokens per text (first 20,000 characters).
        #[arg(long, default_value_t = 4)]
        ppl_windows: usize,
        /// CPU threads of every deco run.
        #[arg(long, default_value_t = 2)]
        threads: usize,
        /// Only run rows whose label contains one of these (comma-separated), e.g. "awq,W3"; the
        /// cached results of the other rows stay in the table.
        #[arg(long)]
        only: Option<String>,
        /// Use this deco binary instead of building deco-cli (release).
        #[arg(long, value_name = "PATH")]
        deco_bin: Option<PathBuf>,
    },
    /// AutoDeco on GSM: trains the heads (cached), then pass@k of greedy, default sampling, the
    /// best static (T, top_p) of a grid (oracle) and AutoDeco; head overhead; meta-instructions.
    /// Updates docs/autodeco.md.
    Autodeco {
        #[command(flatten)]
        cache: CacheArgs,
        /// Problems decoded greedily (first N of gsm_eval.jsonl).
        #[arg(long, default_value_t = 200)]
        problems: usize,
        /// Problems of the sampled configurations.
        #[arg(long, default_value_t = 200)]
        sample_problems: usize,
        /// Samples per problem (pass@k up to n).
        #[arg(short = 'n', long, default_value_t = 4)]
        n: usize,
        /// Maximum new tokens per answer.
        #[arg(long, default_value_t = 192)]
        max_new_tokens: usize,
        /// Sequences decoded together.
        #[arg(long, default_value_t = 16)]
        batch: usize,
        /// Head training steps.
        #[arg(long, default_value_t = 400)]
        steps: usize,
        /// Head training examples (first N of gsm_train.jsonl).
        #[arg(long, default_value_t = 160)]
        train_examples: usize,
        /// Oracle grid temperatures.
        #[arg(long, value_delimiter = ',', default_value = "0.3,0.6,1.0")]
        grid_temperatures: Vec<f32>,
        /// Oracle grid top-ps.
        #[arg(long, value_delimiter = ',', default_value = "0.8,0.95,1.0")]
        grid_top_ps: Vec<f32>,
        /// Problems of each grid point (n = 1).
        #[arg(long, default_value_t = 100)]
        grid_problems: usize,
        /// Problems of the meta-instruction measurement.
        #[arg(long, default_value_t = 40)]
        meta_problems: usize,
        /// Skip the SmolLM2-135M part (its block of docs/autodeco.md stays).
        #[arg(long)]
        skip_smollm2: bool,
        /// Qwen2.5-Coder-0.5B: scored problems (the first N of gsm_eval) for greedy, default
        /// sampling, the tuned best static and AutoDeco, with bootstrap intervals; then the
        /// meta-instruction stage and the head cost (0 = skip; fetches ~0.5 GB).
        #[arg(long, default_value_t = 0)]
        qwen_problems: usize,
        /// Qwen: samples per problem.
        #[arg(long, default_value_t = 4)]
        qwen_n: usize,
        /// Qwen: maximum new tokens per answer (its worked answers run 200–300 tokens).
        #[arg(long, default_value_t = 320)]
        qwen_max_new_tokens: usize,
        /// Qwen tuning grid temperatures.
        #[arg(long, value_delimiter = ',', default_value = "0.3,0.6,1.0")]
        qwen_grid_temperatures: Vec<f32>,
        /// Qwen tuning grid top-ps.
        #[arg(long, value_delimiter = ',', default_value = "0.9,1.0")]
        qwen_grid_top_ps: Vec<f32>,
        /// Qwen tuning problems (n = 1 each): gsm_train problems from 200 on.
        #[arg(long, default_value_t = 40)]
        qwen_grid_problems: usize,
        /// Training examples of the Qwen heads.
        #[arg(long, default_value_t = 96)]
        qwen_train_examples: usize,
        /// Training steps of the Qwen heads.
        #[arg(long, default_value_t = 400)]
        qwen_steps: usize,
        /// Steps of the meta-instruction ranking stage (Qwen heads).
        #[arg(long, default_value_t = 2000)]
        meta_steps: usize,
        /// Qwen2.5-Coder-1.5B: scored problems for greedy, default sampling and AutoDeco (0 =
        /// skip; fetches ~1.1 GB and trains heads for it).
        #[arg(long, default_value_t = 0)]
        qwen15b_problems: usize,
        /// Qwen2.5-Coder-1.5B: samples per problem.
        #[arg(long, default_value_t = 2)]
        qwen15b_n: usize,
        /// Qwen2.5-Coder-1.5B: head training examples.
        #[arg(long, default_value_t = 48)]
        qwen15b_train_examples: usize,
        /// Qwen2.5-Coder-1.5B: head training steps.
        #[arg(long, default_value_t = 200)]
        qwen15b_steps: usize,
        /// Use this deco binary instead of building deco-cli (release).
        #[arg(long, value_name = "PATH")]
        deco_bin: Option<PathBuf>,
    },
    /// deco vs llama.cpp: prefill and decode tok/s on SmolLM2-135M as Q4_1, Q8_0 and F32 GGUF
    /// (the same network; Q8_0 / F32 made from the Q4_1 file by `deco quantize`), ratios vs
    /// issue 5's goals, the read-bandwidth decode limit; updates docs/performance.md.
    Generate {
        #[command(flatten)]
        cache: CacheArgs,
        /// Weight types, comma-separated: q4_1, q8_0, f32.
        #[arg(long, default_value = "q4_1,q8_0,f32")]
        types: String,
        /// Threads for both engines.
        #[arg(long, default_value_t = 2)]
        threads: usize,
        /// Measured runs per engine and type (interleaved).
        #[arg(long, default_value_t = 3)]
        repeats: usize,
        /// Prompt length in tokens (llama.cpp's tokenizer).
        #[arg(long, default_value_t = 512)]
        prompt_tokens: usize,
        /// Generated tokens (EOS ignored).
        #[arg(long, default_value_t = 128)]
        decode_tokens: usize,
        /// Run llama.cpp only.
        #[arg(long)]
        skip_deco: bool,
        /// Run deco only.
        #[arg(long)]
        skip_llama: bool,
        /// Do not update docs/performance.md and docs/performance/generate.svg.
        #[arg(long)]
        no_docs: bool,
        /// Use this deco binary instead of building deco-cli (release).
        #[arg(long, value_name = "PATH")]
        deco_bin: Option<PathBuf>,
        /// Run deco with `--q8-activations` (8-bit activations and integer dot products in
        /// the packed matmuls, as llama.cpp; needs AVX2).
        #[arg(long)]
        q8_activations: bool,
        /// Element type of deco's KV cache: `f32` (default) or `f16` (`deco generate
        /// --kv-cache-dtype f16`, llama.cpp's default KV type).
        #[arg(long, default_value = "f32", value_parser = ["f32", "f16"])]
        kv_cache_dtype: String,
        /// Also run llama.cpp's own `llama-bench` (built from the same vendored sources with
        /// cmake; pp and tg at depth 0 and at the prompt length), interleaved with the others.
        #[arg(long)]
        llama_bench: bool,
        /// Instruction set both engines may use: `native` (what the CPU has) or `avx2` (deco
        /// with `DECO_KERNELS=avx2`, llama-bench built with `GGML_NATIVE=OFF`: no AVX-512).
        /// `avx2` needs `--llama-bench --skip-llama` (pip compiles llama-cpp-python for the CPU).
        #[arg(long, value_enum, default_value_t = bench::BenchIsa::Native)]
        isa: bench::BenchIsa,
    },
    /// Pruning on SmolLM2-135M (magnitude / Wanda / SparseGPT, structured): perplexity, size,
    /// speed; updates docs/compression.md.
    Compress {
        #[command(flatten)]
        cache: CacheArgs,
        /// Calibration windows.
        #[arg(long, default_value_t = 32)]
        nsamples: usize,
        /// Tokens per calibration window.
        #[arg(long, default_value_t = 256)]
        seqlen: usize,
        /// Perplexity windows of 256 tokens per text (first 20,000 characters).
        #[arg(long, default_value_t = 4)]
        ppl_windows: usize,
        /// CPU threads of every deco run.
        #[arg(long, default_value_t = 2)]
        threads: usize,
        /// Decode-speed repeats (median).
        #[arg(long, default_value_t = 3)]
        repeats: usize,
        /// Only rows whose label contains one of these (comma-separated), e.g. "wanda,heads".
        #[arg(long)]
        only: Option<String>,
        /// Use this deco binary instead of building deco-cli (release).
        #[arg(long, value_name = "PATH")]
        deco_bin: Option<PathBuf>,
    },
    /// Serving: aggregate tok/s at 1, 4, 16, 64 concurrent streams, TTFT / inter-token latency,
    /// load test (1,000 requests, 64 clients); updates docs/serving.md and its plot.
    Serve {
        #[command(flatten)]
        cache: CacheArgs,
        /// Runs of the whole benchmark (medians).
        #[arg(long, default_value_t = 1)]
        repeats: usize,
        /// One request per stream and 128 load-test requests (smoke run).
        #[arg(long)]
        quick: bool,
        /// Print only; do not rewrite docs/serving.md.
        #[arg(long)]
        no_docs: bool,
        /// Use this serve_bench binary instead of building the deco-serve example (release).
        #[arg(long, value_name = "PATH")]
        bench_bin: Option<PathBuf>,
        /// 8-bit activations in the packed matmuls, as `deco serve --q8-activations`.
        #[arg(long)]
        q8_activations: bool,
        /// Instead of the throughput benchmark: the soak and fault test of `deco serve`
        /// (deco-cli's `serve_soak` example against the real binary; docs/reliability.md).
        #[arg(long)]
        soak: bool,
        /// Soak: requests.
        #[arg(long, default_value_t = 10_000, requires = "soak")]
        requests: usize,
        /// Soak: concurrent clients.
        #[arg(long, default_value_t = 64, requires = "soak")]
        clients: usize,
        /// Soak: seed of the request generator.
        #[arg(long, default_value_t = 1, requires = "soak")]
        seed: u64,
        /// Soak: the server's `--kv-cache-mib`.
        #[arg(long, default_value_t = 48, requires = "soak")]
        kv_cache_mib: usize,
    },
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Tier {
    Default,
    Wgpu,
    All,
}

fn main() -> ExitCode {
    match real_main() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn real_main() -> Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Bench {
            which:
                BenchCmd::Autodeco {
                    cache,
                    problems,
                    sample_problems,
                    n,
                    max_new_tokens,
                    batch,
                    steps,
                    train_examples,
                    grid_temperatures,
                    grid_top_ps,
                    grid_problems,
                    meta_problems,
                    skip_smollm2,
                    qwen_problems,
                    qwen_n,
                    qwen_max_new_tokens,
                    qwen_grid_temperatures,
                    qwen_grid_top_ps,
                    qwen_grid_problems,
                    qwen_train_examples,
                    qwen_steps,
                    meta_steps,
                    qwen15b_problems,
                    qwen15b_n,
                    qwen15b_train_examples,
                    qwen15b_steps,
                    deco_bin,
                },
        } => autodeco::run(&autodeco::Options {
            cache: util::cache_dir(cache.cache_dir.as_deref()),
            no_mirror: cache.no_mirror,
            problems,
            sample_problems,
            n,
            max_new_tokens,
            batch,
            steps,
            train_examples,
            grid_temperatures,
            grid_top_ps,
            grid_problems,
            meta_problems,
            skip_smollm2,
            qwen_problems,
            qwen_n,
            qwen_max_new_tokens,
            qwen_grid_temperatures,
            qwen_grid_top_ps,
            qwen_grid_problems,
            qwen_train_examples,
            qwen_steps,
            meta_steps,
            qwen15b_problems,
            qwen15b_n,
            qwen15b_train_examples,
            qwen15b_steps,
            deco_bin,
        }),
        Cmd::Bench { which: BenchCmd::Quant { cache, nsamples, seqlen, ppl_windows, threads, only, deco_bin } } => {
            quant::run(&quant::Options {
                cache: util::cache_dir(cache.cache_dir.as_deref()),
                no_mirror: cache.no_mirror,
                nsamples,
                seqlen,
                ppl_windows,
                threads,
                only,
                deco_bin,
            })
        }
        Cmd::Bench {
            which:
                BenchCmd::Decoding {
                    cache,
                    repeats,
                    max_new_tokens,
                    qwen_max_new_tokens,
                    qwen_repeats,
                    beam_max_new_tokens,
                    ee_windows,
                    threads,
                    skip_qwen,
                    only,
                    deco_bin,
                },
        } => decoding::run(&decoding::Options {
            cache: util::cache_dir(cache.cache_dir.as_deref()),
            no_mirror: cache.no_mirror,
            repeats,
            max_new_tokens,
            qwen_max_new_tokens,
            qwen_repeats,
            beam_max_new_tokens,
            ee_windows,
            threads,
            skip_qwen,
            only,
            deco_bin,
        }),
        Cmd::Bench {
            which: BenchCmd::Medusa {
                cache,
                repeats,
                max_new_tokens,
                train_steps,
                train_examples,
                qwen_train_steps,
                qwen_train_examples,
                eval_examples,
                threads,
                skip_qwen,
                q8_activations,
                only,
                deco_bin,
            },
        } => medusa::run(&medusa::Options {
            cache: util::cache_dir(cache.cache_dir.as_deref()),
            no_mirror: cache.no_mirror,
            repeats,
            max_new_tokens,
            train_steps,
            train_examples,
            qwen_train_steps,
            qwen_train_examples,
            eval_examples,
            threads,
            skip_qwen,
            q8_activations,
            only,
            deco_bin,
        }),
        Cmd::Build { cache, cuda: true, check, target_dir, cuda_version } => cuda::build(&cuda::Options {
            cache: util::cache_dir(cache.cache_dir.as_deref()),
            check,
            target_dir,
            cuda_version,
        }),
        Cmd::DeviceCheck { record: Some(dir), .. } => device_check::record(&dir),
        Cmd::DeviceCheck { cache, deco_bin, cuda_version, record: None } => device_check::prepare(&device_check::Options {
            cache: util::cache_dir(cache.cache_dir.as_deref()),
            no_mirror: cache.no_mirror,
            deco_bin,
            cuda_version,
        }),
        Cmd::Build { cuda: false, .. } => util::run(util::cargo().args(["build", "--release", "-p", "deco-cli"])),
        Cmd::Fuzz { cache, target, time } => fuzz::run(&fuzz::Options {
            cache: util::cache_dir(cache.cache_dir.as_deref()),
            no_mirror: cache.no_mirror,
            target,
            time,
        }),
        Cmd::Interop { cache, deco_bin } => interop::run_interop(&interop::Options {
            cache: util::cache_dir(cache.cache_dir.as_deref()),
            no_mirror: cache.no_mirror,
            deco_bin,
        }),
        Cmd::Fetch { cache, what } => {
            fetch::fetch(&fetch::Options {
                cache: util::cache_dir(cache.cache_dir.as_deref()),
                no_mirror: cache.no_mirror,
                what,
            })?;
            Ok(())
        }
        Cmd::Demo {
            cache,
            prompt,
            max_new_tokens,
        } => demo(&cache, &prompt, max_new_tokens),
        Cmd::Test {
            cache,
            tier,
            test_args,
        } => test(&cache, tier, &test_args),
        Cmd::Bench {
            which:
                BenchCmd::Generate {
                    cache,
                    types,
                    threads,
                    repeats,
                    prompt_tokens,
                    decode_tokens,
                    skip_deco,
                    skip_llama,
                    no_docs,
                    deco_bin,
                    q8_activations,
                    kv_cache_dtype,
                    llama_bench,
                    isa,
                },
        } => bench::generate(&bench::GenerateOptions {
            cache: util::cache_dir(cache.cache_dir.as_deref()),
            no_mirror: cache.no_mirror,
            types: bench::parse_types(&types)?,
            threads,
            repeats,
            prompt_tokens,
            decode_tokens,
            skip_deco,
            skip_llama,
            no_docs,
            deco_bin,
            q8_activations,
            kv_f16: kv_cache_dtype == "f16",
            llama_bench,
            isa,
        }),
        Cmd::Bench {
            which:
                BenchCmd::Compress {
                    cache,
                    nsamples,
                    seqlen,
                    ppl_windows,
                    threads,
                    repeats,
                    only,
                    deco_bin,
                },
        } => compress::run_bench(&compress::Options {
            cache: util::cache_dir(cache.cache_dir.as_deref()),
            no_mirror: cache.no_mirror,
            nsamples,
            seqlen,
            ppl_windows,
            threads,
            repeats,
            only,
            deco_bin,
        }),
        Cmd::Bench { which: BenchCmd::Serve { cache, soak: true, no_docs, requests, clients, seed, kv_cache_mib, .. } } => serve::soak(&serve::SoakOptions {
            cache: util::cache_dir(cache.cache_dir.as_deref()),
            no_mirror: cache.no_mirror,
            requests,
            clients,
            seed,
            kv_cache_mib,
            no_docs,
        }),
        Cmd::Bench { which: BenchCmd::Serve { cache, repeats, quick, no_docs, bench_bin, q8_activations, .. } } => serve::run(&serve::Options {
            cache: util::cache_dir(cache.cache_dir.as_deref()),
            no_mirror: cache.no_mirror,
            repeats,
            quick,
            no_docs,
            bench_bin,
            q8_activations,
        }),
    }
}

fn demo(cache: &CacheArgs, prompt: &str, max_new_tokens: usize) -> Result<()> {
    let dir = util::cache_dir(cache.cache_dir.as_deref());
    fetch::fetch(&fetch::Options {
        cache: dir.clone(),
        no_mirror: cache.no_mirror,
        what: vec![What::Model],
    })?;
    let model = dir.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    util::run(
        util::cargo()
            .args([
                "run",
                "--release",
                "-p",
                "deco-cli",
                "--",
                "generate",
                "--model",
            ])
            .arg(&model)
            .args([
                "--chat",
                "--prompt",
                prompt,
                "--max-new-tokens",
                &max_new_tokens.to_string(),
            ]),
    )
    .context("the demo generation failed")
}

fn test(cache: &CacheArgs, tier: Tier, test_args: &[String]) -> Result<()> {
    let dir = util::cache_dir(cache.cache_dir.as_deref());
    fetch::fetch(&fetch::Options {
        cache: dir.clone(),
        no_mirror: cache.no_mirror,
        // Qwen2.5-Coder-0.5B for the tool-call tests (crates/deco-serve/tests/tool_calls.rs).
        what: vec![What::All, What::Qwen05b],
    })?;
    let with_env = |c: &mut std::process::Command| {
        c.env("DECO_CACHE", &dir);
        // Tests that only know the mirror variable get the cache: same layout, verified files.
        if std::env::var_os("DECO_SHARED_DIR").is_none() {
            c.env("DECO_SHARED_DIR", &dir);
        }
    };
    if matches!(tier, Tier::Default | Tier::All) {
        eprintln!("== test tier: default (cargo test --workspace --release)");
        let mut c = util::cargo();
        c.args(["test", "--workspace", "--release"]);
        if !test_args.is_empty() {
            c.arg("--").args(test_args);
        }
        with_env(&mut c);
        util::run(&mut c).context("test tier `default` failed")?;
    }
    if matches!(tier, Tier::Wgpu | Tier::All) {
        let manifest = util::workspace_root().join("kernels").join("Cargo.toml");
        let text = std::fs::read_to_string(&manifest)
            .with_context(|| format!("cannot read {}", manifest.display()))?;
        if has_feature(&text, "wgpu") {
            eprintln!("== test tier: wgpu (cargo test -p deco-kernels -p deco-model --release --features wgpu)");
            let mut c = util::cargo();
            c.args([
                "test",
                "-p",
                "deco-kernels",
                "-p",
                "deco-model",
                "--release",
                "--features",
                "wgpu",
            ]);
            if !test_args.is_empty() {
                c.arg("--").args(test_args);
            }
            with_env(&mut c);
            util::run(&mut c).context("test tier `wgpu` failed")?;
            // The serving engine's paged KV cache with its blocks in device memory.
            eprintln!("== test tier: wgpu (cargo test -p deco-serve --release --features wgpu --test wgpu_paged)");
            let mut c = util::cargo();
            c.args(["test", "-p", "deco-serve", "--release", "--features", "wgpu", "--test", "wgpu_paged"]);
            if !test_args.is_empty() {
                c.arg("--").args(test_args);
            }
            with_env(&mut c);
            util::run(&mut c).context("test tier `wgpu` (deco-serve) failed")?;
        } else {
            eprintln!(
                "== test tier: wgpu SKIPPED: {} declares no `wgpu` feature yet",
                manifest.display()
            );
        }
    }
    Ok(())
}

/// Whether a Cargo.toml text declares feature `name` in its `[features]` table.
fn has_feature(cargo_toml: &str, name: &str) -> bool {
    let mut in_features = false;
    for line in cargo_toml.lines() {
        let l = line.trim();
        if l.starts_with('[') {
            in_features = l == "[features]";
            continue;
        }
        if in_features
            && let Some(rest) = l.strip_prefix(name)
            && rest.trim_start().starts_with('=')
        {
            return true;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::has_feature;

    #[test]
    fn detects_feature_lines() {
        let t = "[package]\nname = \"deco-kernels\"\n\n[dependencies]\nwgpu = { version = \"25\", optional = true }\n";
        assert!(!has_feature(t, "wgpu"));
        let t2 = format!("{t}\n[features]\ndefault = []\nwgpu = [\"dep:wgpu\"]\n");
        assert!(has_feature(&t2, "wgpu"));
        assert!(!has_feature("[features]\nwgpu-extra = []\n", "wgpu"));
        assert!(has_feature("[features]\n  wgpu=[]\n", "wgpu"));
    }
}
