//! `deco eval layer-error`: per-layer, per-linear relative output error of quantized models
//! against their base, on the base model's activations of a text (issue 20's diagnostic; see
//! `deco_quant::pipeline::layer_output_errors` and docs/quantization.md).

use std::path::PathBuf;

use anyhow::{Context, Result, ensure};
use clap::Args;
use deco_formats::checkpoint::Checkpoint;
use deco_model::calibrate::Linear;
use deco_quant::pipeline::{TensorFn, layer_output_errors};

use crate::ModelArgs;

/// Arguments of `deco eval layer-error`.
#[derive(Debug, Args)]
pub struct LayerErrorArgs {
    /// The base model (whose activations are used), with the device options.
    #[command(flatten)]
    model: ModelArgs,
    /// A quantized model of the same architecture (fake-quantized or any loadable directory);
    /// repeat for several, compared column by column.
    #[arg(long = "quantized", required = true)]
    quantized: Vec<PathBuf>,
    /// UTF-8 text whose base-model activations are the inputs (held-out text: not the
    /// calibration text).
    #[arg(long)]
    text: PathBuf,
    /// Tokens per window.
    #[arg(long, default_value_t = 256)]
    seqlen: usize,
    /// Use at most this many consecutive non-overlapping windows from the start of the text.
    #[arg(long, default_value_t = 8)]
    max_windows: usize,
    /// Print every layer (default: the per-linear summary and the layers where the last model's
    /// error exceeds the first's).
    #[arg(long)]
    all_layers: bool,
}

/// Runs the command.
pub fn run(args: &LayerErrorArgs) -> Result<()> {
    ensure!(args.seqlen >= 1, "--seqlen must be at least 1");
    ensure!(args.max_windows >= 1, "--max-windows must be at least 1");
    let text = std::fs::read_to_string(&args.text).with_context(|| format!("reading {}", args.text.display()))?;
    let device = crate::runtime::device(&args.model)?;
    let base = Checkpoint::open(&args.model.model)?;
    let cands: Vec<Checkpoint> = args.quantized.iter().map(Checkpoint::open).collect::<std::result::Result<_, _>>()?;
    for (c, p) in cands.iter().zip(&args.quantized) {
        ensure!(
            c.config.hidden_size == base.config.hidden_size
                && c.config.num_hidden_layers == base.config.num_hidden_layers
                && c.config.intermediate_size == base.config.intermediate_size,
            "{} is not the base's architecture (hidden/layers/intermediate differ)",
            p.display()
        );
    }
    let tok = crate::runtime::load_tokenizer(&args.model.model)?;
    let ids = tok.encode_with(&text, false, true)?;
    let n = crate::runtime::window_count(ids.len(), args.seqlen, Some(args.max_windows), &args.text)?;
    let windows: Vec<Vec<u32>> = (0..n).map(|w| ids[w * args.seqlen..(w + 1) * args.seqlen].to_vec()).collect();
    let base_src = |name: &str| -> deco_model::Result<(Vec<usize>, Vec<f32>)> { Ok(base.tensor(name)?) };
    let srcs: Vec<Box<TensorFn<'_>>> = cands
        .iter()
        .map(|c| Box::new(move |name: &str| -> deco_model::Result<(Vec<usize>, Vec<f32>)> { Ok(c.tensor(name)?) }) as Box<TensorFn<'_>>)
        .collect();
    let refs: Vec<&TensorFn<'_>> = srcs.iter().map(AsRef::as_ref).collect();
    let layers = base.config.num_hidden_layers;
    let rows = layer_output_errors(&base.config, &base_src, &refs, &device, &windows, &mut |li| {
        eprintln!("[layer-error] layer {}/{layers}", li + 1);
    })?;
    let names: Vec<String> = args.quantized.iter().map(|p| p.file_name().map_or_else(|| p.display().to_string(), |f| f.to_string_lossy().into_owned())).collect();
    println!("text={} windows={n} seqlen={}", args.text.display(), args.seqlen);
    println!("relative output error ||X (W - Q)^T||^2 / ||X W^T||^2 on the base model's activations");
    let header = |first: &str| {
        println!("| {first} | {} |", names.join(" | "));
        println!("|---|{}", "---|".repeat(names.len()));
    };
    let last = names.len() - 1;
    if args.all_layers || names.len() == 1 {
        header("layer.linear");
        for r in &rows {
            println!("| {}.{} | {} |", r.layer, short(r.linear), fmt_row(&r.rel));
        }
    } else {
        let worse: Vec<_> = rows.iter().filter(|r| r.rel[last] > r.rel[0]).collect();
        println!("linears where {} > {}: {} of {}", names[last], names[0], worse.len(), rows.len());
        header("layer.linear (worse)");
        for r in worse {
            println!("| {}.{} | {} |", r.layer, short(r.linear), fmt_row(&r.rel));
        }
    }
    header("linear: mean over layers");
    for l in Linear::ALL {
        let sel: Vec<&Vec<f64>> = rows.iter().filter(|r| r.linear == l).map(|r| &r.rel).collect();
        let mean: Vec<f64> = (0..names.len()).map(|c| sel.iter().map(|v| v[c]).sum::<f64>() / sel.len() as f64).collect();
        println!("| {} | {} |", short(l), fmt_row(&mean));
    }
    let all: Vec<f64> = (0..names.len()).map(|c| rows.iter().map(|r| r.rel[c]).sum::<f64>() / rows.len() as f64).collect();
    println!("| all | {} |", fmt_row(&all));
    Ok(())
}

fn short(l: Linear) -> &'static str {
    l.hf_suffix().rsplit('.').next().unwrap_or("?")
}

fn fmt_row(v: &[f64]) -> String {
    v.iter().map(|x| format!("{x:.5}")).collect::<Vec<_>>().join(" | ")
}
