//! `deco eval kld`: mean KL(reference ‖ model) of the next-token distributions, top-1
//! agreement and both perplexities over the same non-overlapping windows as `deco eval ppl`.
//!
//! A model directory with `deco_act_quant.json` (written by `deco quantize --method smoothquant`
//! or `--method int8`) is run layer by layer through `deco_model::calibrate::Calibrator` with
//! that activation quantization applied to the input of every linear layer (per-token int8,
//! LLM.int8() outlier columns in float); `ppl_model` is then that model's perplexity.
//!
//! Diagnostics printed as well: the mean entropy of both distributions (nats), the model's
//! perplexity with its logits divided by a few temperatures (an over-confident model scores
//! better at T > 1), and the mean NLL gap `log p_ref(y) − log p_model(y)` split by whether the
//! reference's top-1 token is the target `y` (where a quantized model loses its perplexity).

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use deco_formats::checkpoint::Checkpoint;
use deco_model::{DenseKvCache, Llama, LogitsWanted, SeqInput};

use crate::ModelArgs;

/// Arguments of `deco eval kld`.
#[derive(Debug, Args)]
pub struct KldArgs {
    /// The (quantized) model to evaluate, with the device options.
    #[command(flatten)]
    model: ModelArgs,
    /// The reference (base) model: GGUF file or Hugging Face directory.
    #[arg(long)]
    reference: PathBuf,
    /// Device of the reference model (default: `--device`). `--reference M --reference-device
    /// flex` with `--model M --device cuda` checks a GPU path against the CPU on the same model.
    #[arg(long)]
    reference_device: Option<String>,
    /// UTF-8 text file to score.
    #[arg(long)]
    text: PathBuf,
    /// Tokens per window.
    #[arg(long, default_value_t = 256)]
    seqlen: usize,
    /// Score at most this many windows.
    #[arg(long)]
    max_windows: Option<usize>,
    /// Use only the first N characters of the file (the golden protocol uses 20000).
    #[arg(long)]
    max_chars: Option<usize>,
}

/// `log_softmax(row)` in f64.
fn log_softmax(row: &[f32]) -> Vec<f64> {
    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln() + m;
    row.iter().map(|&x| x as f64 - lse).collect()
}

/// `KL(p ‖ q) = Σ p (log p − log q)` from log-probabilities, in nats.
pub fn kl(lp: &[f64], lq: &[f64]) -> f64 {
    lp.iter().zip(lq).map(|(&a, &b)| if a == f64::NEG_INFINITY { 0.0 } else { a.exp() * (a - b) }).sum()
}

fn argmax(v: &[f64]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

/// Runs the command.
pub fn run(args: &KldArgs) -> Result<()> {
    if args.seqlen < 2 {
        bail!("--seqlen must be at least 2, got {}", args.seqlen);
    }
    let bytes = std::fs::read(&args.text).with_context(|| format!("reading {}", args.text.display()))?;
    let text = String::from_utf8(bytes).map_err(|e| anyhow::anyhow!("{}: not valid UTF-8 ({e})", args.text.display()))?;
    let text: String = match args.max_chars {
        Some(n) => text.chars().take(n).collect(),
        None => text,
    };
    let device = crate::runtime::device(&args.model)?;
    let ref_device = match &args.reference_device {
        Some(name) => deco_kernels::select_device(name).with_context(|| format!("--reference-device {name}"))?,
        None => device.clone(),
    };
    let load = |p: &std::path::Path, device: &burn::tensor::Device| -> Result<Llama> {
        let ck = Checkpoint::open(p)?;
        Ok(Llama::load(&ck, device, None)?)
    };
    let reference = load(&args.reference, &ref_device)?;
    let model = load(&args.model.model, &device)?;
    let act_file = args.model.model.join(deco_quant::smooth::ACT_QUANT_FILE);
    let act = if act_file.is_file() {
        let text = std::fs::read_to_string(&act_file).with_context(|| format!("reading {}", act_file.display()))?;
        let aq = deco_quant::smooth::ActQuant::from_json(&serde_json::from_str(&text)?).with_context(|| format!("{}", act_file.display()))?;
        eprintln!("activation quantization from {}: {:?}", act_file.display(), aq.mode);
        let ck = Checkpoint::open(&args.model.model)?;
        let cfg = ck.config.clone();
        let layers = (0..cfg.num_hidden_layers)
            .map(|li| deco_model::calibrate::LayerWeights::fetch(&cfg, li, &|n: &str| Ok(ck.tensor(n)?)))
            .collect::<deco_model::Result<Vec<_>>>()?;
        let (_, embed) = ck.tensor("model.embed_tokens.weight")?;
        let (_, norm) = ck.tensor("model.norm.weight")?;
        let head = if cfg.tie_word_embeddings { embed.clone() } else { ck.tensor("lm_head.weight")?.1 };
        Some((aq, cfg, layers, embed, norm, head))
    } else {
        None
    };
    if reference.config.vocab_size != model.config.vocab_size {
        bail!("vocabulary sizes differ: reference {}, model {}", reference.config.vocab_size, model.config.vocab_size);
    }
    let tok = crate::runtime::load_tokenizer(&args.reference)?;
    let ids = tok.encode_with(&text, false, true)?;
    let ids_model = crate::runtime::load_tokenizer(&args.model.model)?.encode_with(&text, false, true)?;
    if ids != ids_model {
        bail!("the two models tokenize {} differently", args.text.display());
    }
    let windows = crate::runtime::window_count(ids.len(), args.seqlen, args.max_windows, &args.text)?;
    let (mut kl_sum, mut nll_ref, mut nll_model, mut agree, mut n) = (0.0f64, 0.0f64, 0.0f64, 0usize, 0usize);
    // Diagnostics: mean entropies; the model's NLL at other temperatures (is it over- or
    // under-confident relative to the reference?); the NLL gap split by whether the
    // reference's top-1 token is the target.
    let (mut ent_ref, mut ent_model) = (0.0f64, 0.0f64);
    let mut nll_t = [0.0f64; TEMPERATURES.len()];
    let (mut gap_right, mut n_right, mut gap_wrong) = (0.0f64, 0usize, 0.0f64);
    for w in 0..windows {
        let window = &ids[w * args.seqlen..(w + 1) * args.seqlen];
        let logits = |m: &Llama| -> Result<Vec<Vec<f32>>> {
            let mut cache = DenseKvCache::new(m.config.num_hidden_layers);
            Ok(m.forward(&[SeqInput { seq: 0, tokens: window, tree: None }], &mut cache, LogitsWanted::All)?.logits_rows()?)
        };
        let lm = match &act {
            Some((aq, cfg, layers, embed, norm, head)) => {
                let c = deco_model::calibrate::Calibrator::new(cfg, &device, &[window.len()])?;
                let t = c.forward_logits(&[window.to_vec()], embed, &mut |li| Ok(layers[li].clone()), norm, head, aq)?;
                let v = cfg.vocab_size;
                deco_model::host::to_host(t)?.chunks(v).map(<[f32]>::to_vec).collect()
            }
            None => logits(&model)?,
        };
        let lr = logits(&reference)?;
        for ((a, b), &target) in lr.iter().zip(&lm).zip(&window[1..]) {
            let (pa, pb) = (log_softmax(a), log_softmax(b));
            kl_sum += kl(&pa, &pb);
            nll_ref -= pa[target as usize];
            nll_model -= pb[target as usize];
            agree += usize::from(argmax(&pa) == argmax(&pb));
            n += 1;
            ent_ref -= pa.iter().map(|&l| if l == f64::NEG_INFINITY { 0.0 } else { l.exp() * l }).sum::<f64>();
            ent_model -= pb.iter().map(|&l| if l == f64::NEG_INFINITY { 0.0 } else { l.exp() * l }).sum::<f64>();
            for (acc, &t) in nll_t.iter_mut().zip(&TEMPERATURES) {
                let scaled: Vec<f32> = b.iter().map(|&x| (x as f64 / t) as f32).collect();
                *acc -= log_softmax(&scaled)[target as usize];
            }
            let gap = pa[target as usize] - pb[target as usize];
            if argmax(&pa) == target as usize {
                gap_right += gap;
                n_right += 1;
            } else {
                gap_wrong += gap;
            }
        }
        eprintln!("window {}/{windows}: mean KL so far {:.5}", w + 1, kl_sum / n as f64);
    }
    println!("tokens_scored={n} windows={windows} seqlen={}", args.seqlen);
    println!("ppl_reference={:.4}", (nll_ref / n as f64).exp());
    println!("ppl_model={:.4}", (nll_model / n as f64).exp());
    println!("top1_agreement={:.4}", agree as f64 / n as f64);
    println!("kld={:.6}", kl_sum / n as f64);
    println!("entropy_reference={:.4} entropy_model={:.4}", ent_ref / n as f64, ent_model / n as f64);
    let temps: Vec<String> = TEMPERATURES.iter().zip(&nll_t).map(|(t, v)| format!("{t}:{:.4}", (v / n as f64).exp())).collect();
    println!("ppl_model_at_temperature={}", temps.join(","));
    let n_wrong = n - n_right;
    println!(
        "nll_gap_reference_right={:.4} (n={n_right}) nll_gap_reference_wrong={:.4} (n={n_wrong})",
        gap_right / n_right.max(1) as f64,
        gap_wrong / n_wrong.max(1) as f64
    );
    Ok(())
}

/// Temperatures at which the model's perplexity is also reported (calibration diagnostic).
const TEMPERATURES: [f64; 5] = [0.8, 0.9, 1.0, 1.1, 1.25];
