//! AutoDeco heads and losses against hand computations and independent references.

use burn::module::Module;
use burn::tensor::{Device, Tensor, TensorData};
use deco_autodeco::heads::{AutoDecoConfig, AutoDecoHeads, HostHeads};
use deco_autodeco::loss::{LossConfig, SortedBatch, easy_token_keep, losses, temp_loss_reference, top_p_loss_reference};
use deco_autodeco::stats::prob_stats;
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn col(v: &[f32], device: &Device) -> Tensor<2> {
    Tensor::from_data(TensorData::new(v.to_vec(), [v.len(), 1]), device)
}

fn scalar(t: Tensor<1>) -> f64 {
    f64::from(t.detach().try_into_vec_as::<f32>().expect("read")[0])
}

fn random_logits(rng: &mut ChaCha8Rng, n: usize, vocab: usize, scale: f32) -> Vec<f32> {
    (0..n * vocab).map(|_| rng.random_range(-scale..scale)).collect()
}

#[test]
fn soft_top_p_loss_by_hand() {
    // p = softmax(ln[1,2,3,4]) = [.1,.2,.3,.4]; sorted [.4,.3,.2,.1], c = [.4,.7,.9,1.0].
    // P = 0.5, α = 30: m = [1, e^-6, e^-12, e^-15] in sorted order.
    let logits: Vec<f32> = [1.0f32, 2.0, 3.0, 4.0].iter().map(|x| x.ln()).collect();
    let m = [(-15.0f64).exp(), (-12.0f64).exp(), (-6.0f64).exp(), 1.0]; // vocabulary order
    let p = [0.1, 0.2, 0.3, 0.4];
    let z: f64 = p.iter().zip(&m).map(|(a, b)| a * b).sum();
    for label in 0..4u32 {
        let want = -((p[label as usize] * m[label as usize] / (z + 1e-9)) + 1e-9).ln();
        let got_ref = top_p_loss_reference(&logits, label, 1.0, 0.5, 30.0);
        assert!((got_ref - want).abs() < 1e-6 * want.max(1.0), "reference {got_ref} vs hand {want}");
        let device = Device::flex();
        let b = SortedBatch::new(&logits, 4, &[label]);
        let cfg = LossConfig { alpha: 30.0, weight_by_base_prob: false, mask_top_p: false };
        let l = losses(&b, col(&[1.0], &device), col(&[0.5], &device), &[true], &cfg, &device);
        let got = scalar(l.top_p);
        assert!((got - want).abs() < 1e-4 * want.max(1.0), "label {label}: {got} vs {want}");
        // Temperature loss = CE = -ln p_label.
        let ce = scalar(l.temp);
        assert!((ce + p[label as usize].ln()).abs() < 1e-5, "temp loss {ce}");
    }
}

#[test]
fn losses_match_reference_on_random_rows() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let (n, vocab) = (6, 300);
    let logits = random_logits(&mut rng, n, vocab, 6.0);
    let labels: Vec<u32> = (0..n).map(|_| rng.random_range(0..vocab as u32)).collect();
    let t: Vec<f32> = (0..n).map(|_| rng.random_range(0.005f32..1.9)).collect();
    let p: Vec<f32> = (0..n).map(|_| rng.random_range(0.05f32..0.99)).collect();
    let keep = vec![true, false, true, true, false, true];
    let device = Device::flex();
    let b = SortedBatch::new(&logits, vocab, &labels);
    for weight in [false, true] {
        let cfg = LossConfig { alpha: 30.0, weight_by_base_prob: weight, mask_top_p: false };
        let l = losses(&b, col(&t, &device), col(&p, &device), &keep, &cfg, &device);
        let mut want_t = 0.0;
        let mut want_p = 0.0;
        for i in 0..n {
            let row = &logits[i * vocab..(i + 1) * vocab];
            let w = if weight { f64::from(b.base_prob[i]) } else { 1.0 };
            if keep[i] {
                want_t += w * temp_loss_reference(row, labels[i], f64::from(t[i]));
            }
            want_p += w * top_p_loss_reference(row, labels[i], f64::from(t[i]), f64::from(p[i]), 30.0);
        }
        let kept = keep.iter().filter(|&&k| k).count() as f64;
        want_t /= kept;
        want_p /= n as f64;
        let (gt, gp) = (scalar(l.temp), scalar(l.top_p));
        assert!((gt - want_t).abs() < 1e-4 * want_t.abs().max(1.0), "temp {gt} vs {want_t}");
        assert!((gp - want_p).abs() < 1e-4 * want_p.abs().max(1.0), "top_p {gp} vs {want_p}");
    }
    // The base probability is softmax(z)_y.
    let row0 = &logits[..vocab];
    let want = (-temp_loss_reference(row0, labels[0], 1.0)).exp();
    assert!((f64::from(b.base_prob[0]) - want).abs() < 1e-6);
}

fn small_cfg(enhanced: bool, norm: bool) -> AutoDecoConfig {
    AutoDecoConfig { use_enhanced_features: enhanced, temp_layer_norm: norm, head_hidden_size: 16, ..AutoDecoConfig::new(12, 40) }
}

/// Runs the heads on random inputs and returns the (temp, top_p) losses with gradients.
fn grads_of(which: &str) -> (bool, bool, bool) {
    let device = Device::flex().autodiff();
    device.seed(3);
    let cfg = small_cfg(true, false);
    let heads = AutoDecoHeads::init(&cfg, &device).expect("init");
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let n = 8;
    let hidden: Vec<f32> = (0..n * cfg.hidden_size).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let logits = random_logits(&mut rng, n, cfg.vocab_size, 4.0);
    let labels: Vec<u32> = (0..n).map(|_| rng.random_range(0..cfg.vocab_size as u32)).collect();
    let x = Tensor::<2>::from_data(TensorData::new(hidden, [n, cfg.hidden_size]), &device);
    let t = heads.temperature(x.clone());
    let tv = t.clone().detach().try_into_vec_as::<f32>().expect("t");
    let mut s = Vec::new();
    for i in 0..n {
        s.extend_from_slice(&prob_stats(&logits[i * cfg.vocab_size..(i + 1) * cfg.vocab_size], tv[i]));
    }
    let stats = Tensor::<2>::from_data(TensorData::new(s, [n, 4]), &device);
    let p = heads.top_p(x.clone(), t.clone(), Some(stats));
    let b = SortedBatch::new(&logits, cfg.vocab_size, &labels);
    let l = losses(&b, t, p, &vec![true; n], &LossConfig::default(), &device);
    let loss = if which == "temp" { l.temp } else { l.top_p };
    let g = loss.backward();
    let nz = |t: Option<Tensor<2>>| t.map(|t| t.abs().sum().into_scalar::<f32>() > 0.0).unwrap_or(false);
    (
        nz(heads.temp_head.fc1.weight.val().grad(&g)),
        nz(heads.top_p_head.fc1.weight.val().grad(&g)),
        x.grad(&g).is_some(),
    )
}

#[test]
fn soft_top_p_loss_trains_both_heads_and_not_the_input() {
    let (temp_grad, top_p_grad, input_grad) = grads_of("top_p");
    assert!(temp_grad, "the soft top-p loss must reach the temperature head (T not detached)");
    assert!(top_p_grad, "the soft top-p loss must reach the top-p head");
    assert!(!input_grad, "the frozen base's hidden states must get no gradient");
}

#[test]
fn temperature_loss_trains_only_the_temperature_head() {
    let (temp_grad, top_p_grad, input_grad) = grads_of("temp");
    assert!(temp_grad);
    assert!(!top_p_grad, "the top-p head sees T detached and is not in the temperature loss");
    assert!(!input_grad);
}

#[test]
fn easy_token_masking_rate() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let n = 200_000;
    let argmax: Vec<u32> = (0..n).map(|i| (i % 2) as u32).collect();
    let labels = vec![0u32; n]; // even positions are easy
    let keep = easy_token_keep(&argmax, &labels, 0.6, &mut rng);
    let easy_dropped = keep.iter().step_by(2).filter(|&&k| !k).count() as f64 / (n / 2) as f64;
    assert!((easy_dropped - 0.6).abs() < 0.01, "dropped {easy_dropped} of easy tokens");
    assert!(keep.iter().skip(1).step_by(2).all(|&k| k), "hard tokens are never dropped");
    let none = easy_token_keep(&argmax, &labels, 0.0, &mut rng);
    assert!(none.iter().all(|&k| k));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    #[test]
    fn head_ranges_and_host_equals_burn(seed in 0u64..1000, scale in 0.1f32..50.0, enhanced: bool, norm: bool) {
        let device = Device::flex();
        device.seed(seed);
        let cfg = small_cfg(enhanced, norm);
        let heads = AutoDecoHeads::init(&cfg, &device).expect("init");
        let host = heads.to_host(&cfg).expect("host");
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let n = 5;
        let hidden: Vec<f32> = (0..n * cfg.hidden_size).map(|_| rng.random_range(-scale..scale)).collect();
        let logits = random_logits(&mut rng, n, cfg.vocab_size, scale);
        let x = Tensor::<2>::from_data(TensorData::new(hidden.clone(), [n, cfg.hidden_size]), &device);
        let t = heads.temperature(x.clone());
        let tv = t.clone().try_into_vec_as::<f32>().expect("t");
        let mut s = Vec::new();
        for i in 0..n {
            s.extend_from_slice(&prob_stats(&logits[i * cfg.vocab_size..(i + 1) * cfg.vocab_size], tv[i]));
        }
        let stats = enhanced.then(|| Tensor::<2>::from_data(TensorData::new(s, [n, 4]), &device));
        let pv = heads.top_p(x, t, stats).try_into_vec_as::<f32>().expect("p");
        for i in 0..n {
            let o = host.predict(&hidden[i * cfg.hidden_size..(i + 1) * cfg.hidden_size], &logits[i * cfg.vocab_size..(i + 1) * cfg.vocab_size]).expect("predict");
            prop_assert!(o.temperature >= 0.0 && o.temperature <= 2.0);
            prop_assert!(o.top_p >= 0.0 && o.top_p <= 1.0);
            prop_assert!((o.temperature - tv[i]).abs() < 1e-5, "T host {} burn {}", o.temperature, tv[i]);
            prop_assert!((o.top_p - pv[i]).abs() < 1e-5, "P host {} burn {}", o.top_p, pv[i]);
        }
    }
}

#[test]
fn save_load_round_trip_and_bad_files() {
    let device = Device::flex();
    device.seed(9);
    for (enhanced, norm) in [(true, false), (false, true)] {
        let cfg = small_cfg(enhanced, norm);
        let host = AutoDecoHeads::init(&cfg, &device).expect("init").to_host(&cfg).expect("host");
        let dir = tempfile::tempdir().expect("tmp");
        let out = dir.path().join("heads");
        host.save(&out).expect("save");
        let back = HostHeads::load(&out).expect("load");
        assert_eq!(back, host);
        // to_module round trip too.
        assert_eq!(back.to_module(&device).to_host(&cfg).expect("host"), host);
        // Overwriting is atomic and allowed.
        host.save(&out).expect("save again");
        // Corrupt weights.
        std::fs::write(out.join("autodeco_heads.safetensors"), b"garbage").expect("write");
        let err = HostHeads::load(&out).expect_err("corrupt").to_string();
        assert!(err.contains("autodeco_heads.safetensors") && err.contains("safetensors"), "{err}");
        // Wrong config shape.
        host.save(&out).expect("save");
        let cpath = out.join("autodeco_config.json");
        let text = std::fs::read_to_string(&cpath).expect("read").replace("\"hidden_size\": 12", "\"hidden_size\": 13");
        std::fs::write(&cpath, text).expect("write");
        let err = HostHeads::load(&out).expect_err("shape").to_string();
        assert!(err.contains("shape"), "{err}");
        std::fs::write(&cpath, "{").expect("write");
        let err = HostHeads::load(&out).expect_err("json").to_string();
        assert!(err.contains("autodeco_config.json"), "{err}");
    }
    assert_eq!(small_cfg(true, false).num_params(), 12 * 16 + 16 + 16 + 1 + (12 + 5) * 16 + 16 + 16 + 1);
    let host = AutoDecoHeads::init(&small_cfg(true, false), &device).expect("init").to_host(&small_cfg(true, false)).expect("h");
    assert!(host.predict(&[0.0; 11], &[0.0; 40]).is_err());
    assert!(host.predict(&[0.0; 12], &[0.0; 39]).is_err());
    let _ = host.to_module(&device).valid();
}
