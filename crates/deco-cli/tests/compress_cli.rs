//! `deco prune` end to end on the real model: magnitude pruning writes a model with exactly the
//! requested sparsity that loads back; a sparse fine-tune (fixed and moving-average masks) keeps
//! 2:4 exactly; `--method sheared` writes the target architecture; bad input gives clean errors
//! and no output.

use std::process::{Command, Output};

use deco_formats::checkpoint::Checkpoint;
use deco_tests::smollm2_gguf;

fn deco(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_deco")).args(args).output().expect("run deco")
}

fn assert_clean_error(o: &Output, needles: &[&str]) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "expected exit 1, got {:?}; stderr: {err}", o.status);
    assert!(!err.contains("panicked"), "panic instead of an error: {err}");
    for n in needles {
        assert!(err.contains(n), "stderr does not mention {n:?}: {err}");
    }
}

#[test]
fn magnitude_and_sheared_outputs_load_with_the_requested_shape() {
    let m = smollm2_gguf();
    let m = m.to_str().expect("path");
    let tmp = tempfile::tempdir().expect("tmp");
    let mag = tmp.path().join("mag");
    let o = deco(&["prune", "--model", m, "--method", "magnitude", "--sparsity", "0.5", "--out", mag.to_str().expect("p")]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let ck = Checkpoint::open(&mag).expect("pruned model loads");
    let (shape, w) = ck.tensor("model.layers.3.mlp.down_proj.weight").expect("tensor");
    assert_eq!(shape, vec![576, 1536]);
    let zeros = w.iter().filter(|&&x| x == 0.0).count();
    assert_eq!(zeros, w.len() / 2, "magnitude 50% (per layer) zeroes exactly half");

    let sh = tmp.path().join("sheared");
    let o = deco(&[
        "prune", "--model", m, "--method", "sheared", "--target", "28,6,1024,576", "--steps", "2", "--batch-size", "1", "--seqlen", "32",
        "--out", sh.to_str().expect("p"),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let ck = Checkpoint::open(&sh).expect("sheared model loads");
    assert_eq!(
        (ck.config.num_hidden_layers, ck.config.num_attention_heads, ck.config.intermediate_size, ck.config.hidden_size),
        (28, 6, 1024, 576)
    );
    let (shape, _) = ck.tensor("model.layers.27.self_attn.q_proj.weight").expect("tensor");
    assert_eq!(shape, vec![6 * 64, 576]);
    let o = deco(&["generate", "--model", sh.to_str().expect("p"), "--prompt", "Hello", "--max-new-tokens", "3"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn sparse_finetune_keeps_the_pattern_on_the_real_model() {
    let m = smollm2_gguf();
    let m = m.to_str().expect("path");
    let tmp = tempfile::tempdir().expect("tmp");
    for (update, extra) in [("fixed", &[][..]), ("ema", &["--mask-update-every", "1"][..])] {
        let out = tmp.path().join(update);
        let mut args = vec![
            "prune", "--model", m, "--method", "magnitude", "--nm", "2:4", "--finetune-steps", "2", "--batch-size", "1", "--seqlen", "32", "--calib-chars", "20000",
            "--mask-update", update, "--out", out.to_str().expect("p"),
        ];
        args.extend_from_slice(extra);
        let o = deco(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let line = String::from_utf8_lossy(&o.stdout).lines().find(|l| l.starts_with("[prune]")).expect("[prune] line").to_string();
        assert!(line.contains("finetune_steps=2") && line.contains(&format!("mask_update={update}")), "{line}");
        let ck = Checkpoint::open(&out).expect("fine-tuned model loads");
        for name in ["model.layers.0.self_attn.q_proj.weight", "model.layers.29.mlp.down_proj.weight"] {
            let (_, w) = ck.tensor(name).expect("tensor");
            for g in w.chunks(4) {
                assert_eq!(g.iter().filter(|&&x| x != 0.0).count(), 2, "{update} {name}: a group of 4 is not 2:4: {g:?}");
            }
        }
    }
}

#[test]
fn bad_prune_input_gives_clean_errors() {
    let m = smollm2_gguf();
    let m = m.to_str().expect("path");
    let tmp = tempfile::tempdir().expect("tmp");
    let out = tmp.path().join("out");
    let o = out.to_str().expect("p");
    assert_clean_error(&deco(&["prune", "--model", m, "--method", "sheared", "--out", o]), &["--target"]);
    assert_clean_error(&deco(&["prune", "--model", m, "--method", "sheared", "--target", "30,6,640", "--out", o]), &["four numbers"]);
    assert_clean_error(&deco(&["prune", "--model", m, "--method", "sheared,heads", "--target", "30,6,640,576", "--out", o]), &["cannot be combined"]);
    assert_clean_error(&deco(&["prune", "--model", m, "--method", "sheared", "--target", "31,6,640,576", "--out", o]), &["layers"]);
    assert_clean_error(&deco(&["prune", "--model", m, "--method", "wanda", "--sparsity", "1.5", "--out", o]), &["--sparsity"]);
    assert_clean_error(&deco(&["prune", "--model", m, "--method", "wanda,heads", "--out", o]), &["cannot be combined"]);
    assert_clean_error(&deco(&["prune", "--model", m, "--method", "wanda", "--mask-update", "ema", "--out", o]), &["--finetune-steps"]);
    assert_clean_error(&deco(&["prune", "--model", m, "--method", "heads", "--finetune-steps", "2", "--out", o]), &["--finetune-steps", "deco distill"]);
    assert_clean_error(&deco(&["prune", "--model", m, "--method", "magnitude", "--finetune-steps", "2", "--mask-update", "ema", "--mask-ema", "1", "--out", o]), &["mask_ema"]);
    assert!(!out.exists(), "no output on failure");
}
