//! Host f32 matmul (`deco_kernels::dense::matmul`) at SmolLM2-135M's prefill shapes: GFLOP/s,
//! median of 15 calls after 3 warm-ups; then the Gram matrix `xᵀx` (`dense::gram`) at its two
//! widths, median of 6 calls. `DECO_KERNELS=avx2` runs the `gemm` crate's path on an
//! AVX-512 CPU, for an A/B of the same binary.
//!
//! `cargo run --release -p deco-kernels --example dense_bench -- [tokens]`

use std::time::Instant;

fn main() {
    let n: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(512);
    println!("isa {:?}, {} threads, {n} tokens", deco_kernels::quant::Isa::detect(), rayon::current_num_threads());
    for (inner, out, what) in [(576, 576, "q/o"), (576, 192, "k/v"), (576, 1536, "gate/up"), (1536, 576, "down")] {
        let x: Vec<f32> = (0..n * inner).map(|i| ((i * 7919) % 1000) as f32 * 1e-3 - 0.5).collect();
        let w: Vec<f32> = (0..inner * out).map(|i| ((i * 104_729) % 1000) as f32 * 1e-3 - 0.5).collect();
        let mut y = vec![0.0f32; n * out];
        let mut times = Vec::new();
        for r in 0..18 {
            let t = Instant::now();
            deco_kernels::dense::matmul(&x, n, &w, inner, out, &mut y).expect("matmul");
            if r >= 3 {
                times.push(t.elapsed().as_secs_f64());
            }
        }
        times.sort_by(f64::total_cmp);
        let med = times[times.len() / 2];
        println!("{what:8} {inner:5} x {out:5}: {:7.3} ms  {:6.1} GFLOP/s", med * 1e3, 2.0 * (n * inner * out) as f64 / med * 1e-9);
    }
    // The calibration Hessians of GPTQ / SparseGPT at the given token count, rated on the
    // n · cols² flops of the lower half's multiply-adds.
    for cols in [576, 1536] {
        let x: Vec<f32> = (0..n * cols).map(|i| ((i * 7919) % 1000) as f32 * 1e-3 - 0.5).collect();
        let mut times = Vec::new();
        for r in 0..8 {
            let t = Instant::now();
            std::hint::black_box(deco_kernels::dense::gram(&x, n, cols).expect("gram"));
            if r >= 2 {
                times.push(t.elapsed().as_secs_f64());
            }
        }
        times.sort_by(f64::total_cmp);
        let med = times[times.len() / 2];
        println!("gram     {n:5} x {cols:5}: {:7.3} ms  {:6.1} GFLOP/s", med * 1e3, (n * cols * cols) as f64 / med * 1e-9);
    }
}
