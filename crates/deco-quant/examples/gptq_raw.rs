//! Runs `gptq_quantize` on raw little-endian files, so that an independent implementation
//! (e.g. a numpy port of IST-DASLab/gptq `fasterquant`) can be compared with deco's on the
//! same weight and Hessian:
//!
//! ```sh
//! cargo run --release -p deco-quant --example gptq_raw -- W.f32 H.f64 ROWS COLS BITS GROUP DESC_ACT MSE SYM OUT.f32
//! ```
//!
//! `W.f32`: `[ROWS, COLS]` f32; `H.f64`: `[COLS, COLS]` f64 (`2 X Xᵀ / n`); `GROUP` 0 = per
//! channel; `DESC_ACT`, `SYM` 0/1; `MSE` the norm (0 = min-max). Writes the dequantized
//! `[ROWS, COLS]` f32 result to `OUT.f32`.

use deco_quant::gptq::{GptqConfig, Hessian, gptq_quantize};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a: Vec<String> = std::env::args().skip(1).collect();
    if a.len() != 10 {
        return Err("usage: gptq_raw W.f32 H.f64 ROWS COLS BITS GROUP DESC_ACT MSE SYM OUT.f32".into());
    }
    let (rows, cols): (usize, usize) = (a[2].parse()?, a[3].parse()?);
    let w: Vec<f32> = std::fs::read(&a[0])?.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    let h: Vec<f64> = std::fs::read(&a[1])?.chunks_exact(8).map(|b| f64::from_le_bytes(b.try_into().unwrap_or([0; 8]))).collect();
    if w.len() != rows * cols || h.len() != cols * cols {
        return Err(format!("{} weights for {rows}x{cols}, {} Hessian values for {cols}", w.len(), h.len()).into());
    }
    let group: usize = a[5].parse()?;
    let cfg = GptqConfig {
        bits: a[4].parse()?,
        group_size: (group > 0).then_some(group),
        desc_act: a[6] == "1",
        mse: a[7].parse()?,
        sym: a[8] == "1",
        ..GptqConfig::default()
    };
    let hess = Hessian { cols, h, n: 1 };
    let q = gptq_quantize(&w, rows, cols, &hess, &cfg)?.q.dequantize();
    let bytes: Vec<u8> = q.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(&a[9], bytes)?;
    Ok(())
}
