//! Crash-safe checkpoint writes (issue 17 item 4): the commands that write a model are killed
//! with SIGKILL at random instants; afterwards the output path holds nothing (or the empty
//! directory that was there) or the complete output, byte-identical to an uninterrupted run's,
//! never a partial one. `deco distill --resume` then continues from the last complete
//! checkpoint. Kill instants are drawn from a seeded RNG, one in each of n equal slices of 1.5x
//! the uninterrupted run's wall time, so some land before the first byte is written, most while
//! the model is read or written, some after.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use deco_formats::checkpoint::Checkpoint;
use deco_tests::{asset, smollm2_gguf};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn deco() -> Command {
    Command::new(env!("CARGO_BIN_EXE_deco"))
}

fn run_ok(mut cmd: Command) -> Duration {
    let t = Instant::now();
    let o = cmd.output().expect("run deco");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    t.elapsed()
}

/// Starts `cmd`, sends SIGKILL after `after`, waits; true when it finished before the kill.
fn kill_after(mut cmd: Command, after: Duration) -> bool {
    let mut child = cmd.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null()).spawn().expect("spawn deco");
    let t = Instant::now();
    while t.elapsed() < after {
        if child.try_wait().expect("try_wait").is_some() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let finished = child.try_wait().expect("try_wait").is_some();
    let _ = child.kill(); // SIGKILL on Unix
    let _ = child.wait();
    finished
}

/// 64-bit FNV-1a of a file's bytes (a digest for equality, not for security).
fn digest(path: &Path) -> (u64, u64) {
    let mut f = std::fs::File::open(path).expect("open");
    let mut buf = vec![0u8; 1 << 20];
    let (mut h, mut n) = (0xcbf2_9ce4_8422_2325u64, 0u64);
    loop {
        let k = f.read(&mut buf).expect("read");
        if k == 0 {
            return (n, h);
        }
        for &b in &buf[..k] {
            h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
        n += k as u64;
    }
}

/// Every file under `path` (or `path` itself) with its size and digest.
fn tree(path: &Path) -> BTreeMap<String, (u64, u64)> {
    let mut m = BTreeMap::new();
    if path.is_file() {
        m.insert(String::new(), digest(path));
        return m;
    }
    for e in std::fs::read_dir(path).expect("read_dir") {
        let p = e.expect("entry").path();
        assert!(p.is_file(), "{}: unexpected subdirectory", p.display());
        m.insert(p.file_name().expect("name").to_string_lossy().into_owned(), digest(&p));
    }
    m
}

/// The visible entries of `dir` (names not starting with '.').
fn visible(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .expect("read_dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with('.'))
        .collect();
    v.sort();
    v
}

/// Kills `make(out)` at `n` random instants; after each, `out` is absent or empty, or equal to
/// `want`. Returns (killed with nothing at `out`, killed after the output was complete).
fn kill_loop(make: &dyn Fn(&Path) -> Command, out: &Path, want: &BTreeMap<String, (u64, u64)>, wall: Duration, n: usize, seed: u64) -> (usize, usize) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (mut none, mut whole) = (0, 0);
    // Stratified: kill i lands in the i-th of n equal slices of [0, 1.5 x wall). On a loaded
    // machine a run may take longer than the measured one, so if no kill landed after the end,
    // later kills double the delay until one does (the output must then be complete).
    let delays = (0..n).map(|i| wall.mul_f64(1.5 * (i as f64 + rng.random_range(0.0..1.0)) / n as f64)).collect::<Vec<_>>();
    let mut extra = (1..=8).map(|k| wall.mul_f64(1.5 * f64::from(1u32 << k)));
    let mut i = 0;
    loop {
        let at = match delays.get(i) {
            Some(&d) => d,
            None if whole == 0 => match extra.next() {
                Some(d) => d,
                None => break,
            },
            None => break,
        };
        i += 1;
        let finished = kill_after(make(out), at);
        let present = out.exists() && (out.is_file() || !visible(out).is_empty());
        if present {
            assert_eq!(&tree(out), want, "kill {i} at {at:?}: {} is not the complete output", out.display());
            whole += 1;
        } else {
            assert!(!finished, "kill {i}: the run finished but {} is missing", out.display());
            none += 1;
        }
        if out.is_dir() {
            std::fs::remove_dir_all(out).expect("clean");
        } else if out.exists() {
            std::fs::remove_file(out).expect("clean");
        }
    }
    (none, whole)
}

#[test]
fn convert_and_quantize_killed_at_random_leave_nothing_or_the_whole_output() {
    let m = smollm2_gguf();
    let tmp = tempfile::tempdir().expect("tmp");
    let convert = |out: &Path| {
        let mut c = deco();
        c.arg("convert").arg(&m).arg(out);
        c
    };
    let quantize = |out: &Path| {
        let mut c = deco();
        c.args(["quantize", "--format", "gguf-q8_0", "--bits", "8", "--model"]).arg(&m).arg("--out").arg(out);
        c
    };
    for (name, make, out_name) in [("convert", &convert as &dyn Fn(&Path) -> Command, "hf"), ("quantize", &quantize, "q8.gguf")] {
        let reference = tmp.path().join(format!("reference-{out_name}"));
        let wall = run_ok(make(&reference));
        let want = tree(&reference);
        assert!(!want.is_empty());
        let dir = tmp.path().join(name);
        std::fs::create_dir(&dir).expect("mkdir");
        let out = dir.join(out_name);
        let (none, whole) = kill_loop(make, &out, &want, wall, 10, 17);
        eprintln!("{name}: uninterrupted {wall:?}; {} kills: {none} left nothing, {whole} the complete output, 0 partial", none + whole);
        assert!(none > 0 && whole > 0, "{name}: the kills did not cover both sides of the write");
        // Temporaries of killed runs are hidden, and the next run to the same path removes them.
        run_ok(make(&out));
        assert_eq!(tree(&out), want);
        let left: Vec<String> = std::fs::read_dir(&dir).expect("read_dir").map(|e| e.expect("e").file_name().to_string_lossy().into_owned()).collect();
        assert_eq!(left, vec![out_name.to_string()], "{name}: temporaries left after a complete run");
        std::fs::remove_dir_all(&reference).or_else(|_| std::fs::remove_file(&reference)).expect("clean");
    }
}

fn checkpoints(out: &Path) -> Vec<PathBuf> {
    if !out.is_dir() {
        return Vec::new();
    }
    let mut v: Vec<PathBuf> = visible(out).into_iter().filter(|n| n.starts_with("checkpoint-")).map(|n| out.join(n)).collect();
    v.sort();
    v
}

/// `deco ARGS --steps STEPS --model MODEL --data DATA --out OUT [--resume]`.
fn train_cmd(args: &[&str], steps: usize, model: &Path, data: &Path, out: &Path, resume: bool) -> Command {
    let mut c = deco();
    c.args(args).arg("--steps").arg(steps.to_string()).arg("--model").arg(model).arg("--data").arg(data).arg("--out").arg(out);
    if resume {
        c.arg("--resume");
    }
    c
}

/// The resume loop of the training commands: up to 12 runs of `train(out, resume)`, each killed
/// at a seeded random instant in [0.3, 0.9) x `wall` and resuming from the last checkpoint when
/// there is one; after every kill, `check` runs on each visible checkpoint. `prepare` runs before
/// each start (a command may need an OUT with nothing to resume cleared). If no run finished
/// (`done`), one more runs to the end. Returns the steps of the checkpoints resumed from.
fn kill_and_resume(
    train: &dyn Fn(&Path, bool) -> Command,
    out: &Path,
    wall: Duration,
    seed: u64,
    done: &dyn Fn(&Path) -> bool,
    prepare: &dyn Fn(&Path),
    check: &dyn Fn(&Path),
) -> Vec<usize> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut resumed_from = Vec::new();
    for _ in 0..12 {
        prepare(out);
        let last = checkpoints(out).last().cloned();
        if let Some(ck) = &last {
            resumed_from.push(checkpoint_step(ck));
        }
        let finished = kill_after(train(out, last.is_some()), wall.mul_f64(rng.random_range(0.3..0.9)));
        for ck in checkpoints(out) {
            check(&ck);
        }
        if finished && done(out) {
            break;
        }
    }
    if !done(out) {
        prepare(out);
        run_ok(train(out, !checkpoints(out).is_empty()));
    }
    resumed_from
}

/// The step of a `checkpoint-NNNNNN` directory.
fn checkpoint_step(ck: &Path) -> usize {
    ck.file_name().and_then(|n| n.to_str()?.strip_prefix("checkpoint-")?.parse().ok()).expect("checkpoint step")
}

/// A checkpoint's `loss.csv` ends at the checkpoint's step.
fn assert_log_ends_at_its_step(ck: &Path) {
    let step = checkpoint_step(ck);
    let log = std::fs::read_to_string(ck.join("loss.csv")).expect("checkpoint loss.csv");
    assert_eq!(log.lines().last().and_then(|l| l.split(',').next()), Some(step.to_string().as_str()), "{}", ck.display());
}

/// `log` (a `step,...` CSV with a step-0 row) holds steps 0..=steps once each, and equals
/// `reference` digit for digit up to the first checkpoint resumed from (after it, Adam restarts).
fn assert_resumed_log(log: &str, reference: &str, steps: usize, resumed_from: &[usize]) {
    let steps_logged: Vec<usize> = log.lines().skip(1).map(|l| l.split(',').next().expect("step").parse().expect("step number")).collect();
    assert_eq!(steps_logged, (0..=steps).collect::<Vec<_>>(), "loss.csv:\n{log}");
    let first_resume = resumed_from.iter().copied().min().unwrap_or(steps);
    let head = |t: &str| t.lines().take(first_resume + 2).map(str::to_string).collect::<Vec<_>>();
    assert_eq!(head(log), head(reference), "the resumed run's log differs from the uninterrupted one before step {first_resume}");
    assert!(!resumed_from.is_empty(), "no kill landed after a checkpoint: the resume path was not exercised");
}

#[test]
fn distill_killed_at_random_keeps_complete_checkpoints_and_resumes() {
    let m = smollm2_gguf();
    let tmp = tempfile::tempdir().expect("tmp");
    let student = tmp.path().join("student");
    run_ok({
        let mut c = deco();
        c.arg("convert").arg(&m).arg(&student);
        c
    });
    let wiki = asset("data/wiki_test.txt");
    let out = tmp.path().join("distill");
    let steps = 6;
    let distill = |resume: bool| {
        let mut c = deco();
        c.args(["distill", "--objective", "kd", "--batch-size", "1", "--seqlen", "16", "--checkpoint-every", "2", "--data-chars", "4000"])
            .args(["--steps", &steps.to_string(), "--teacher"])
            .arg(&m)
            .arg("--student")
            .arg(&student)
            .arg("--data")
            .arg(&wiki)
            .arg("--out")
            .arg(&out);
        if resume {
            c.arg("--resume");
        }
        c
    };
    // Learn how long a fresh run takes, then start over.
    let wall = run_ok(distill(false));
    std::fs::remove_dir_all(&out).expect("clean");
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let mut resumed_from = Vec::new();
    let mut started = false;
    for _ in 0..12 {
        let resume = started && !checkpoints(&out).is_empty();
        if !resume && out.exists() {
            // Killed before the first checkpoint: a fresh run needs an empty --out.
            std::fs::remove_dir_all(&out).expect("clean");
        }
        if let Some(last) = checkpoints(&out).last().filter(|_| resume) {
            resumed_from.push(last.file_name().expect("name").to_string_lossy().into_owned());
        }
        let finished = kill_after(distill(resume), wall.mul_f64(rng.random_range(0.2..0.7)));
        started = true;
        // Every visible checkpoint is complete: it loads, with every tensor readable.
        for ck in checkpoints(&out) {
            let c = Checkpoint::open(&ck).unwrap_or_else(|e| panic!("{} is not a complete checkpoint: {e}", ck.display()));
            c.tensor("model.layers.29.mlp.down_proj.weight").unwrap_or_else(|e| panic!("{}: {e}", ck.display()));
        }
        if finished || checkpoints(&out).last().is_some_and(|p| p.ends_with(format!("checkpoint-{steps:06}"))) {
            break;
        }
    }
    // Finish with --resume, uninterrupted, from wherever the kills left it.
    if checkpoints(&out).last().is_none_or(|p| !p.ends_with(format!("checkpoint-{steps:06}"))) {
        let resume = !checkpoints(&out).is_empty();
        if !resume && out.exists() {
            std::fs::remove_dir_all(&out).expect("clean");
        }
        run_ok(distill(resume));
    }
    let last = checkpoints(&out).last().cloned().expect("a final checkpoint");
    assert!(last.ends_with(format!("checkpoint-{steps:06}")), "{}", last.display());
    Checkpoint::open(&last).expect("final checkpoint loads");
    // The log holds each step once, in order, whatever the kills interrupted.
    let log = std::fs::read_to_string(out.join("distill_log.csv")).expect("log");
    let logged: Vec<usize> = log.lines().skip(1).map(|l| l.split(',').next().expect("step").parse().expect("step number")).collect();
    assert_eq!(logged, (1..=steps).collect::<Vec<_>>(), "distill_log.csv:\n{log}");
    eprintln!("distill: uninterrupted {wall:?}; resumed from {resumed_from:?}");
    assert!(!resumed_from.is_empty(), "no kill landed after a checkpoint: the resume path was not exercised");
}

#[test]
fn autodeco_train_killed_at_random_keeps_complete_checkpoints_and_resumes() {
    use deco_autodeco::heads::HostHeads;
    let m = smollm2_gguf();
    let data = asset("data/gsm_train.jsonl");
    let tmp = tempfile::tempdir().expect("tmp");
    let steps = 24;
    let args = ["autodeco", "train", "--max-examples", "3", "--heldout-examples", "1", "--batch-size", "8", "--eval-every", "8", "--checkpoint-every", "4"];
    let train = |out: &Path, resume: bool| train_cmd(&args, steps, &m, &data, out, resume);
    // An uninterrupted run: its time, and the log a resumed run must reproduce step for step.
    let reference = tmp.path().join("reference");
    let wall = run_ok(train(&reference, false));
    assert!(checkpoints(&reference).is_empty(), "the finished run left checkpoints: {:?}", visible(&reference));
    let ref_log = std::fs::read_to_string(reference.join("loss.csv")).expect("loss.csv");
    let out = tmp.path().join("heads");
    let check = |ck: &Path| {
        HostHeads::load(ck).unwrap_or_else(|e| panic!("{} is not a complete checkpoint: {e}", ck.display()));
        assert_log_ends_at_its_step(ck);
    };
    let resumed_from = kill_and_resume(&train, &out, wall, 11, &|o: &Path| o.join("loss.csv").is_file(), &|_: &Path| {}, &check);
    HostHeads::load(&out).expect("final heads load");
    assert!(checkpoints(&out).is_empty(), "the finished run left checkpoints: {:?}", visible(&out));
    // The log holds each step once, in order (held-out rows every 8 steps), and is the
    // uninterrupted run's up to the first checkpoint resumed from (same batches, masks, heads).
    assert_resumed_log(&std::fs::read_to_string(out.join("loss.csv")).expect("loss.csv"), &ref_log, steps, &resumed_from);
    eprintln!("autodeco train: uninterrupted {wall:?}; resumed from {resumed_from:?}");
}

#[test]
fn lora_train_killed_at_random_keeps_complete_checkpoints_and_resumes() {
    use deco_compress::lora::HostAdapters;
    let m = smollm2_gguf();
    let cfg = Checkpoint::open(&m).expect("model").config;
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("gsm.jsonl");
    let lines: Vec<String> = (1..=4)
        .map(|i| serde_json::json!({"question": format!("Ann has {i} pens and buys 3 more. How many?"), "answer": format!("{i} + 3 = {}\n#### {}", i + 3, i + 3)}).to_string())
        .collect();
    std::fs::write(&data, lines.join("\n")).expect("data");
    let steps = 6;
    let args = ["lora", "train", "--quant", "none", "--target-modules", "q_proj,down_proj", "--r", "2", "--alpha", "4", "--batch-size", "1", "--seqlen", "48"];
    let args = [&args[..], &["--lr", "1e-3", "--checkpoint-every", "2"]].concat();
    let train = |out: &Path, resume: bool| train_cmd(&args, steps, &m, &data, out, resume);
    let losses = |log: &str| -> Vec<(usize, f64)> {
        log.lines().skip(1).map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            (f[0].parse().expect("step"), f[1].parse().expect("loss"))
        }).collect()
    };
    let reference = tmp.path().join("reference");
    let wall = run_ok(train(&reference, false));
    let ref_log = losses(&std::fs::read_to_string(reference.join("lora_log.csv")).expect("log"));
    let out = tmp.path().join("adapter");
    let done = |out: &Path| out.join(deco_compress::lora::ADAPTER_CONFIG).is_file();
    // A run killed before its first checkpoint leaves at most `lora_log.csv`: nothing to resume
    // from, and a fresh run refuses a non-empty OUT, so the user (and this loop) starts over.
    let restart_if_nothing_to_resume = |out: &Path| {
        if checkpoints(out).is_empty() && out.exists() {
            assert!(!done(out), "a final adapter without checkpoints: {:?}", visible(out));
            std::fs::remove_dir_all(out).expect("remove");
        }
    };
    // Every visible checkpoint is a complete adapter for this model.
    let check = |ck: &Path| {
        HostAdapters::load(ck, &cfg).unwrap_or_else(|e| panic!("{} is not a complete checkpoint: {e}", ck.display()));
    };
    let resumed_from = kill_and_resume(&train, &out, wall, 13, &done, &restart_if_nothing_to_resume, &check);
    let final_adapter = HostAdapters::load(&out, &cfg).expect("final adapter loads");
    assert_eq!(final_adapter.weights.len(), 2 * cfg.num_hidden_layers, "q_proj and down_proj adapters in every layer");
    // The log holds each step once, in order; up to the first checkpoint resumed from, the
    // losses are the uninterrupted run's (same batches, same adapters).
    let log = losses(&std::fs::read_to_string(out.join("lora_log.csv")).expect("log"));
    assert_eq!(log.iter().map(|r| r.0).collect::<Vec<_>>(), (1..=steps).collect::<Vec<_>>(), "lora_log.csv: {log:?}");
    let first_resume = resumed_from.iter().copied().min().unwrap_or(steps);
    for (a, b) in log.iter().zip(&ref_log).take(first_resume) {
        assert!((a.1 - b.1).abs() <= 1e-4 * b.1.abs().max(1.0), "step {}: loss {} vs the uninterrupted run's {}", a.0, a.1, b.1);
    }
    eprintln!("lora train: uninterrupted {wall:?}; resumed from {resumed_from:?}");
    assert!(!resumed_from.is_empty(), "no kill landed after a checkpoint: the resume path was not exercised");
}

/// `deco medusa train` killed at random instants: every visible checkpoint is a complete heads
/// directory whose log ends at its step; `--resume` continues from the last one on the saved
/// self-distilled sequences, and the final log equals the uninterrupted run's up to the first
/// checkpoint resumed from (same batches; Adam restarts after, as documented).
#[test]
fn medusa_train_killed_at_random_keeps_complete_checkpoints_and_resumes() {
    use deco_autodeco::medusa;
    let m = smollm2_gguf();
    let data = asset("data/gsm_train.jsonl");
    let tmp = tempfile::tempdir().expect("tmp");
    // Self-distillation and the hidden states take about 4 s before training starts; 48 steps make
    // training most of the run, so that most kill instants land after a checkpoint.
    let steps = 48;
    let args = ["medusa", "train", "--num-heads", "2", "--max-examples", "4", "--max-new-tokens", "8", "--heldout-fraction", "0.25"];
    let args = [&args[..], &["--batch-size", "8", "--eval-every", "8", "--checkpoint-every", "4"]].concat();
    let train = |out: &Path, resume: bool| train_cmd(&args, steps, &m, &data, out, resume);
    let reference = tmp.path().join("reference");
    let wall = run_ok(train(&reference, false));
    assert_eq!(
        visible(&reference),
        ["accuracy.json", "config.json", "loss.csv", "loss.svg", "medusa_lm_head.safetensors"],
        "the finished run left other files"
    );
    let ref_log = std::fs::read_to_string(reference.join("loss.csv")).expect("loss.csv");
    let out = tmp.path().join("heads");
    let check = |ck: &Path| {
        medusa::load_blocks(ck).unwrap_or_else(|e| panic!("{} is not a complete checkpoint: {e}", ck.display()));
        assert_log_ends_at_its_step(ck);
    };
    let resumed_from = kill_and_resume(&train, &out, wall, 13, &|o: &Path| o.join("accuracy.json").is_file(), &|_: &Path| {}, &check);
    medusa::load_blocks(&out).expect("final heads load");
    assert!(checkpoints(&out).is_empty() && !out.join("self_distilled.json").exists(), "the finished run left its checkpoints: {:?}", visible(&out));
    assert_resumed_log(&std::fs::read_to_string(out.join("loss.csv")).expect("loss.csv"), &ref_log, steps, &resumed_from);
    eprintln!("medusa train: uninterrupted {wall:?}; resumed from {resumed_from:?}");
}
