//! Host f32 matmul (`deco_kernels::dense::matmul`) at SmolLM2-135M's prefill shapes: GFLOP/s,
//! median of 15 calls after 3 warm-ups; then the Gram matrix `xᵀx` (`dense::gram`) at its two
//! widths, median of 6 calls, next to the `gemm` crate's path (`gram_with(.., Isa::Scalar)`,
//! what ran before deco's AVX2 tile) in the same run. `DECO_KERNELS=avx2` holds an AVX-512 CPU
//! to the AVX2 kernels, for an A/B of the same binary. On CPUs with AVX-512 BF16 each line also gives
//! the bf16 products of the compression jobs' calibration (`deco_kernels::bf16`) on the same
//! inputs, measured in the same run; on CPUs with AVX2, the 16-bit integer products
//! (`deco_kernels::int16`) likewise.
//!
//! `cargo run --release -p deco-kernels --example dense_bench -- [tokens]`
//!
//! With 1-4 tokens, the decode (streaming) path instead: SmolLM2-135M's 30 layers of distinct
//! f32 weights and its 49,152-row LM head, the GB/s of weights read per pass (DRAM-bound).

use std::time::Instant;

/// Median wall time in seconds of `runs - warmup` calls of `f`, after `warmup` unmeasured ones.
fn median_secs(runs: usize, warmup: usize, mut f: impl FnMut()) -> f64 {
    let mut times: Vec<f64> = (0..runs)
        .filter_map(|r| {
            let t = Instant::now();
            f();
            (r >= warmup).then(|| t.elapsed().as_secs_f64())
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

fn main() {
    let n: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(512);
    if n <= deco_kernels::dense::SMALL_N {
        decode(n);
        return;
    }
    let bf16 = deco_kernels::bf16::available();
    let int16 = deco_kernels::int16::available();
    println!(
        "isa {:?}, {} threads, {n} tokens, bf16 products {}, int16 products {}",
        deco_kernels::quant::Isa::detect(),
        rayon::current_num_threads(),
        if bf16 { "too" } else { "not available" },
        if int16 { "too" } else { "not available" }
    );
    for (inner, out, what) in [(576, 576, "q/o"), (576, 192, "k/v"), (576, 960, "q+k+v"), (576, 1536, "gate/up"), (576, 3072, "gate+up"), (1536, 576, "down")] {
        let x: Vec<f32> = (0..n * inner).map(|i| ((i * 7919) % 1000) as f32 * 1e-3 - 0.5).collect();
        let w: Vec<f32> = (0..inner * out).map(|i| ((i * 104_729) % 1000) as f32 * 1e-3 - 0.5).collect();
        let mut y = vec![0.0f32; n * out];
        let flop = 2.0 * (n * inner * out) as f64;
        let med = median_secs(18, 3, || deco_kernels::dense::matmul(&x, n, &w, inner, out, &mut y).expect("matmul"));
        print!("{what:8} {inner:5} x {out:5}: {:7.3} ms  {:6.1} GFLOP/s", med * 1e3, flop / med * 1e-9);
        if bf16 {
            let p = deco_kernels::bf16::PackedBf16::new(&w, inner, out).expect("pack");
            let med = median_secs(18, 3, || deco_kernels::bf16::matmul(&x, n, &p, &mut y).expect("bf16 matmul"));
            print!("   bf16 {:7.3} ms  {:6.1} GFLOP/s", med * 1e3, flop / med * 1e-9);
        }
        if int16 {
            let p = deco_kernels::int16::PackedInt16::new(&w, inner, out).expect("pack");
            let med = median_secs(18, 3, || deco_kernels::int16::matmul(&x, n, &p, &mut y).expect("int16 matmul"));
            print!("   int16 {:7.3} ms  {:6.1} GFLOP/s", med * 1e3, flop / med * 1e-9);
        }
        println!();
    }
    // The calibration Hessians of GPTQ / SparseGPT at the given token count, rated on the
    // n · cols² flops of the lower half's multiply-adds.
    for cols in [576, 1536] {
        let x: Vec<f32> = (0..n * cols).map(|i| ((i * 7919) % 1000) as f32 * 1e-3 - 0.5).collect();
        let flop = (n * cols * cols) as f64;
        let med = median_secs(8, 2, || {
            std::hint::black_box(deco_kernels::dense::gram(&x, n, cols).expect("gram"));
        });
        print!("gram     {n:5} x {cols:5}: {:7.3} ms  {:6.1} GFLOP/s", med * 1e3, flop / med * 1e-9);
        let isa = deco_kernels::quant::Isa::Scalar;
        let med = median_secs(8, 2, || {
            std::hint::black_box(deco_kernels::dense::gram_with(&x, n, cols, isa).expect("gram"));
        });
        print!("   gemm crate {:7.3} ms  {:6.1} GFLOP/s", med * 1e3, flop / med * 1e-9);
        if bf16 {
            let med = median_secs(8, 2, || {
                std::hint::black_box(deco_kernels::bf16::gram(&x, n, cols).expect("bf16 gram"));
            });
            print!("   bf16 {:7.3} ms  {:6.1} GFLOP/s", med * 1e3, flop / med * 1e-9);
        }
        if int16 {
            let med = median_secs(8, 2, || {
                std::hint::black_box(deco_kernels::int16::gram(&x, n, cols).expect("int16 gram"));
            });
            print!("   int16 {:7.3} ms  {:6.1} GFLOP/s", med * 1e3, flop / med * 1e-9);
        }
        println!();
    }
}

/// SmolLM2-135M F32 decode: 30 layers of distinct `[inner, out]` weights (q/k/v fused, o,
/// gate/up fused, down) plus the LM head, `n` tokens, median of 9 passes, each on the pool's
/// spinning team (`deco_kernels::team::with_team`) as in a forward pass.
fn decode(n: usize) {
    let shapes = [(576, 960), (576, 576), (576, 3072), (1536, 576)];
    let layers: Vec<Vec<Vec<f32>>> = (0..30)
        .map(|l| shapes.iter().map(|&(i, o)| (0..i * o).map(|k| ((k * 7919 + l) % 1000) as f32 * 1e-3 - 0.5).collect()).collect())
        .collect();
    let head: Vec<f32> = (0..576 * 49_152).map(|k| ((k * 104_729) % 1000) as f32 * 1e-3 - 0.5).collect();
    let x: Vec<f32> = (0..n * 1536).map(|i| ((i * 7919) % 1000) as f32 * 1e-3 - 0.5).collect();
    let mut y = vec![0.0f32; n * 49_152];
    let layer_bytes: usize = layers.iter().flatten().map(|w| w.len() * 4).sum();
    let mut run = |what: &str, bytes: usize, f: &mut (dyn FnMut(&mut [f32]) + Send)| {
        // On a pool worker with the spinning team, as `Llama::forward` runs its pass.
        let med = median_secs(11, 2, || rayon::scope(|_| deco_kernels::team::with_team(|| f(&mut y))));
        println!("decode {what:12} {n} token(s): {:7.3} ms  {:6.1} GB/s", med * 1e3, bytes as f64 / med * 1e-9);
    };
    println!("isa {:?}, {} threads", deco_kernels::quant::Isa::detect(), rayon::current_num_threads());
    run("30 layers", layer_bytes, &mut |y| {
        for l in &layers {
            for (w, &(i, o)) in l.iter().zip(&shapes) {
                deco_kernels::dense::matmul(&x[..n * i], n, w, i, o, &mut y[..n * o]).expect("matmul");
            }
        }
    });
    for (si, &(i, o)) in shapes.iter().enumerate() {
        run(&format!("{i}x{o} x30"), i * o * 4 * 30, &mut |y| {
            for l in &layers {
                deco_kernels::dense::matmul(&x[..n * i], n, &l[si], i, o, &mut y[..n * o]).expect("matmul");
            }
        });
    }
    run("LM head", head.len() * 4, &mut |y| deco_kernels::dense::matmul(&x[..n * 576], n, &head, 576, 49_152, y).expect("matmul"));
}
