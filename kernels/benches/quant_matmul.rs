//! Microbenchmark of the packed quantized matmul (`cargo bench -p deco-kernels --bench
//! quant_matmul`): SmolLM2-135M's projection shapes, decode (1 token) and prefill (64 tokens),
//! per block type and instruction set. Prints time per call, GB/s of packed weights read and
//! GMAC/s. Threads: `RAYON_NUM_THREADS` (default: all cores). Arguments after `--` keep only the
//! block types / instruction sets named (e.g. `-- Q4_1 Avx512`).
//!
//! The working set of one shape (≤ 2.2 MB packed) fits in cache, so the decode numbers are the
//! kernel's compute limit; the "all layers" line cycles through 30 layers' worth of distinct
//! matrices (~80 MB for Q4_1), which is what decode streams from DRAM per token.

use std::hint::black_box;
use std::time::Instant;

use deco_kernels::quant::{BlockType, Isa, PackedMatrix, q8_isa};

fn matrix(ty: BlockType, rows: usize, cols: usize, seed: u8) -> PackedMatrix {
    let bb = ty.block_bytes();
    let mut data = vec![0u8; rows * cols / ty.block_len() * bb];
    for (i, blk) in data.chunks_exact_mut(bb).enumerate() {
        if matches!(ty, BlockType::Q4_K | BlockType::Q6_K) {
            // Pseudo-random codes and scales; finite f16 super-block scales (d, dmin of Q4_K at
            // 0..4; d of Q6_K at 208).
            for (j, q) in blk.iter_mut().enumerate() {
                *q = (i as u8).wrapping_mul(31).wrapping_add(j as u8).wrapping_mul(seed | 1);
            }
            let at = if ty == BlockType::Q4_K { 0 } else { 208 };
            blk[at..at + 2].copy_from_slice(&0x2000u16.to_le_bytes());
            if ty == BlockType::Q4_K {
                blk[2..4].copy_from_slice(&0x2000u16.to_le_bytes());
            }
            continue;
        }
        // Scale 2^-7 (f16 0x2000), min -2^-4 (0xAC00), pseudo-random quants.
        blk[0..2].copy_from_slice(&0x2000u16.to_le_bytes());
        let q0 = if ty == BlockType::Q4_1 {
            blk[2..4].copy_from_slice(&0xAC00u16.to_le_bytes());
            4
        } else {
            2
        };
        for (j, q) in blk[q0..].iter_mut().enumerate() {
            *q = (i as u8).wrapping_mul(31).wrapping_add(j as u8).wrapping_mul(seed | 1);
        }
    }
    PackedMatrix::new(ty, rows, cols, data).expect("valid")
}

/// Median seconds per call over `reps` calls after a warm-up.
fn time(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut v: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .collect();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let shapes = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536), ("lm_head", 49152, 576)];
    println!("threads={} isa={:?} q8_isa={:?}", rayon::current_num_threads(), Isa::detect(), q8_isa());
    println!("{:<6} {:<5} {:<8} {:>4} {:>10} {:>8} {:>8}", "type", "isa", "shape", "n", "us/call", "GB/s", "GMAC/s");
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let keep = |name: String| args.is_empty() || args.contains(&name);
    let any_isa = args.iter().all(|a| !a.starts_with("Avx") && a != "Scalar" && a != "Q8act");
    let any_ty = args.iter().all(|a| (!a.starts_with('Q') || a == "Q8act") && a != "kquant" && a != "kprefill");
    for ty in [BlockType::Q4_0, BlockType::Q4_1, BlockType::Q8_0] {
        if !any_ty && !keep(format!("{ty:?}")) {
            continue;
        }
        // `None`: the 8-bit-activation kernel of `q8_isa()` (`matmul_q8`), printed as isa `Q8act`.
        for isa in [Some(Isa::Scalar), Some(Isa::Avx2), Some(Isa::Avx512), None] {
            let name = isa.map_or("Q8act".to_string(), |i| format!("{i:?}"));
            let available = isa.is_none_or(|i| i.is_available());
            if !available || (!any_isa && !keep(name.clone())) {
                continue;
            }
            for &(shape, rows, cols) in &shapes {
                let m = matrix(ty, rows, cols, 7);
                for n in [1usize, 16, 64] {
                    let x: Vec<f32> = (0..n * cols).map(|i| ((i % 13) as f32 - 6.0) * 0.1).collect();
                    let mut y = vec![0.0f32; n * rows];
                    let reps = if n == 1 { 200 } else { 10 };
                    let s = time(reps, || match isa {
                        Some(isa) => m.matmul_with(black_box(&x), n, &mut y, isa).expect("matmul"),
                        None => m.matmul_q8(black_box(&x), n, &mut y).expect("matmul_q8"),
                    });
                    let gbs = m.as_bytes().len() as f64 / s / 1e9;
                    let gmac = (n * rows * cols) as f64 / s / 1e9;
                    println!("{:<6} {:<5} {:<8} {:>4} {:>10.1} {:>8.1} {:>8.1}", format!("{ty:?}"), name, shape, n, s * 1e6, gbs, gmac);
                }
            }
        }
        // Decode over 30 layers of distinct matrices + head: DRAM-streaming bandwidth.
        let layers: Vec<[PackedMatrix; 4]> = (0..30u8)
            .map(|l| [matrix(ty, 960, 576, l), matrix(ty, 576, 576, l), matrix(ty, 3072, 576, l), matrix(ty, 576, 1536, l)])
            .collect();
        let bytes: usize = layers.iter().flatten().map(|m| m.as_bytes().len()).sum();
        let x: Vec<f32> = (0..1536).map(|i| ((i % 13) as f32 - 6.0) * 0.1).collect();
        let mut y = vec![0.0f32; 3072];
        for q8 in [false, true] {
            let s = time(20, || {
                for l in &layers {
                    for m in l {
                        let (xs, ys) = (black_box(&x[..m.cols()]), &mut y[..m.rows()]);
                        if q8 { m.matmul_q8(xs, 1, ys).expect("matmul_q8") } else { m.matmul(xs, 1, ys).expect("matmul") }
                    }
                }
            });
            println!(
                "{:<6} all 30 layers, 1 token{}: {:.2} ms, {:.1} MB, {:.1} GB/s ({:.0} tok/s if nothing else ran)",
                format!("{ty:?}"),
                if q8 { ", Q8act" } else { "" },
                s * 1e3,
                bytes as f64 / 1e6,
                bytes as f64 / s / 1e9,
                1.0 / s
            );
        }
    }
    // Qwen2.5-Coder-1.5B Q4_K_M decode: 28 layers of distinct k-quant matrices (q/k/v, o,
    // gate/up Q4_K; down Q6_K), 8-bit activations, one token: ~830 MB streamed per pass.
    if args.is_empty() || args.iter().any(|a| a == "kquant") {
        let layers: Vec<[PackedMatrix; 4]> = (0..28u8)
            .map(|l| {
                [
                    matrix(BlockType::Q4_K, 2048, 1536, l),
                    matrix(BlockType::Q4_K, 1536, 1536, l),
                    matrix(BlockType::Q4_K, 17920, 1536, l),
                    matrix(BlockType::Q6_K, 1536, 8960, l),
                ]
            })
            .collect();
        let x: Vec<f32> = (0..8960).map(|i| ((i % 13) as f32 - 6.0) * 0.1).collect();
        let mut y = vec![0.0f32; 17920];
        // GGUF rows, then the layout the model loads with 8-bit activations (`interleave8`). On
        // a spinning thread team, as the model's forward pass runs its kernels.
        let all = [layers.clone(), layers.into_iter().map(|l| l.map(PackedMatrix::interleave8)).collect()];
        rayon::scope(|_| deco_kernels::team::with_team(|| for layers in all {
            let layout = if layers[0][0].is_interleaved() { "interleaved" } else { "GGUF rows" };
            for (what, pick) in [("all", [true; 4]), ("Q4_K only", [true, true, true, false]), ("Q6_K only", [false, false, false, true])] {
                let b: usize = layers.iter().flat_map(|l| l.iter().zip(pick).filter(|(_, p)| *p).map(|(m, _)| m.as_bytes().len())).sum();
                let s = time(10, || {
                    for l in &layers {
                        for (m, _) in l.iter().zip(pick).filter(|(_, p)| *p) {
                            m.matmul_q8(black_box(&x[..m.cols()]), 1, &mut y[..m.rows()]).expect("matmul_q8");
                        }
                    }
                });
                println!("Qwen-1.5B layers ({what}, {layout}), 1 token, Q8act: {:.2} ms, {:.1} MB, {:.1} GB/s", s * 1e3, b as f64 / 1e6, b as f64 / s / 1e9);
            }
            // The same kernels on one layer's matrices only (hot in L2/L3): the compute limit.
            let l = &layers[0];
            for m in l {
                let s = time(50, || m.matmul_q8(black_box(&x[..m.cols()]), 1, &mut y[..m.rows()]).expect("matmul_q8"));
                println!("{:?} {}x{} hot ({layout}), 1 token, Q8act: {:.1} us, {:.1} GB/s", m.ty(), m.rows(), m.cols(), s * 1e6, m.as_bytes().len() as f64 / s / 1e9);
            }
        }));
    }
    // Qwen2.5-Coder-1.5B Q4_K_M prefill: one layer's k-quant matrices with 128 tokens of
    // 8-bit activations (compute-bound; `DECO_KERNELS=avx2` for the AVX2 kernels,
    // `KPREFILL_N` for another token count).
    if args.is_empty() || args.iter().any(|a| a == "kprefill") {
        let n: usize = std::env::var("KPREFILL_N").ok().and_then(|v| v.parse().ok()).unwrap_or(128);
        let x: Vec<f32> = (0..n * 8960).map(|i| ((i % 13) as f32 - 6.0) * 0.1).collect();
        let mut y = vec![0.0f32; n * 17920];
        // Then SmolLM2-135M's Q4_1 / Q8_0 q/k/v, gate/up and down.
        let smol = [(960, 576), (3072, 576), (576, 1536)];
        let shapes = [(BlockType::Q4_K, 2048, 1536), (BlockType::Q4_K, 17920, 1536), (BlockType::Q6_K, 1536, 8960)]
            .into_iter()
            .chain([BlockType::Q4_1, BlockType::Q8_0].into_iter().flat_map(|ty| smol.map(|(r, c)| (ty, r, c))));
        for (ty, rows, cols) in shapes {
            let m = matrix(ty, rows, cols, 3);
            // The fastest of 9 (this kind of host's neighbours slow single runs by up to 2x).
            let s = (0..9).map(|_| time(1, || m.matmul_q8(black_box(&x[..n * cols]), n, &mut y[..n * rows]).expect("matmul_q8"))).fold(f64::INFINITY, f64::min);
            println!("{ty:?} {rows}x{cols}, {n} tokens, Q8act: {:.2} ms, {:.1} GMAC/s", s * 1e3, (n * rows * cols) as f64 / s / 1e9);
        }
    }
    // The dequantize + gemm alternative for prefill.
    let m = matrix(BlockType::Q4_1, 3072, 576, 7);
    for n in [16usize, 64, 512] {
        let x: Vec<f32> = (0..n * 576).map(|i| ((i % 13) as f32 - 6.0) * 0.1).collect();
        let mut y = vec![0.0f32; n * 3072];
        let fused = time(5, || m.matmul(black_box(&x), n, &mut y).expect("matmul"));
        let gemm = time(5, || m.matmul_dequant_gemm(black_box(&x), n, &mut y).expect("matmul"));
        let mac = (n * 3072 * 576) as f64;
        println!("Q4_1 gate_up n={n}: fused {:.1} GMAC/s, dequant+gemm {:.1} GMAC/s", mac / fused / 1e9, mac / gemm / 1e9);
    }
}
