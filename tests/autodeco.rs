//! AutoDeco on the real SmolLM2-135M-Instruct: a short training run on GSM train data lowers the
//! held-out loss and leaves the base untouched; decoding with heads keeps per-sequence seeds
//! independent of the batch, leaves greedy decoding unchanged and applies T × temperature,
//! clamp(P × top_p).

use burn::tensor::Device;
use deco_autodeco::data::{chat_example, collect_tokens, read_gsm_jsonl, strip_calculator};
use deco_autodeco::decode::{SeqRequest, combine, generate_batch};
use deco_autodeco::heads::{AutoDecoConfig, AutoDecoHeads};
use deco_autodeco::train::{FrozenHead, TrainConfig, train};
use deco_decoding::{SamplerOrder, SamplingParams};
use deco_formats::chat_template::ChatTemplate;
use deco_formats::checkpoint::Checkpoint;
use deco_formats::gguf::GgufFile;
use deco_formats::tokenizer::Tokenizer;
use deco_generate::LlamaSession;
use deco_model::Llama;
use deco_model::host::to_host;
use deco_tests::{asset, smollm2_gguf};

fn load() -> (Llama, Tokenizer) {
    let path = smollm2_gguf();
    let model = Llama::load(&Checkpoint::open(&path).expect("open"), &Device::flex(), Some(2048)).expect("load");
    let tok = Tokenizer::from_gguf(&GgufFile::open(&path).expect("gguf")).expect("tokenizer");
    (model, tok)
}

#[test]
fn short_training_lowers_heldout_loss_and_keeps_the_base_frozen() {
    let (model, tok) = load();
    let template = ChatTemplate::new(tok.chat_template().expect("template")).expect("template");
    let items = read_gsm_jsonl(&asset("data/gsm_train.jsonl")).expect("data");
    let examples: Vec<_> = items
        .iter()
        .take(14)
        .map(|it| chat_example(&tok, &template, &it.question, &strip_calculator(&it.answer)).expect("example"))
        .collect();
    // The answer ends with the template's end-of-turn token.
    assert!(examples.iter().all(|e| tok.is_eos(*e.answer.last().expect("answer"))));
    let train_pool = collect_tokens(&model, &examples[..10], &mut |_, _| {}).expect("train pool");
    let held_pool = collect_tokens(&model, &examples[10..], &mut |_, _| {}).expect("held pool");
    assert!(train_pool.len() > 500 && held_pool.len() > 100, "{} / {}", train_pool.len(), held_pool.len());
    let head_before = to_host(model.lm_head().clone()).expect("lm head");
    let cfg = AutoDecoConfig::new(model.config.hidden_size, model.config.vocab_size);
    let tc = TrainConfig { steps: 40, batch_size: 16, eval_every: 0, max_heldout: 128, ..TrainConfig::default() };
    let head = FrozenHead { weight: model.lm_head().clone(), device: model.device().clone() };
    let (heads, log) = train(&cfg, &tc, &train_pool, &held_pool, &head, &mut |_| {}).expect("train");
    let first = log.first().expect("log");
    let last = log.last().expect("log");
    let before = first.heldout_temp + first.heldout_top_p;
    let after = last.heldout_temp + last.heldout_top_p;
    assert!(after < 0.9 * before, "held-out loss {before} -> {after}");
    assert_eq!(to_host(model.lm_head().clone()).expect("lm head"), head_before, "the base must stay frozen");
    assert_eq!(heads.config().num_params(), cfg.num_params());
    assert_eq!(cfg.num_params(), 576 * 256 + 256 + 256 + 1 + 581 * 256 + 256 + 256 + 1);
}

#[test]
fn decoding_with_heads_is_batch_invariant_and_keeps_greedy() {
    let (model, tok) = load();
    let device = Device::flex();
    device.seed(1);
    let cfg = AutoDecoConfig::new(model.config.hidden_size, model.config.vocab_size);
    let heads = AutoDecoHeads::init(&cfg, &device).expect("init").to_host(&cfg).expect("host");
    let prompts: Vec<Vec<u32>> = ["The capital of France is", "Once upon a time", "1, 2, 3,"]
        .iter()
        .map(|p| tok.encode(p, true).expect("encode"))
        .collect();
    let eos = tok.eos_token_ids().to_vec();
    let sampled = |seed: u64| SamplingParams {
        temperature: Some(0.8),
        top_p: Some(0.9),
        seed: Some(seed),
        max_new_tokens: Some(12),
        ..Default::default()
    };
    let reqs: Vec<SeqRequest> = prompts.iter().enumerate().map(|(i, p)| SeqRequest { prompt: p.clone(), params: sampled(10 + i as u64) }).collect();
    let mut session = LlamaSession::new(&model);
    let batch = generate_batch(&mut session, Some(&heads), &reqs, &eos, 8, SamplerOrder::HuggingFace, &mut |_, _| false).expect("batch");
    let alone = generate_batch(&mut session, Some(&heads), &reqs[1..2], &eos, 8, SamplerOrder::HuggingFace, &mut |_, _| false).expect("alone");
    assert_eq!(batch[1].generation.tokens, alone[0].generation.tokens, "a seeded request must not depend on its batch");
    for r in &batch {
        assert_eq!(r.trace.len(), r.generation.tokens.len());
        for t in &r.trace {
            assert!(t.temperature > 0.0 && t.temperature < 2.0 && t.top_p > 0.0 && t.top_p < 1.0);
            assert!((t.final_temperature - (0.8 * t.temperature).max(1e-2)).abs() < 1e-6);
            assert!((t.final_top_p - (0.9 * t.top_p).clamp(0.0, 1.0)).abs() < 1e-6);
        }
    }
    // Greedy stays greedy: same tokens as plain greedy decoding.
    let greedy = SamplingParams { temperature: Some(0.0), max_new_tokens: Some(12), ..Default::default() };
    let g_req = [SeqRequest { prompt: prompts[0].clone(), params: greedy.clone() }];
    let with = generate_batch(&mut session, Some(&heads), &g_req, &eos, 1, SamplerOrder::HuggingFace, &mut |_, _| false).expect("greedy");
    let plain = deco_generate::generate(&mut session, &prompts[0], &greedy, &eos, &mut |_| false).expect("plain");
    assert_eq!(with[0].generation.tokens, plain.tokens);
    assert_eq!(combine(&greedy, with[0].trace.first().map(|t| deco_autodeco::HeadOutput { temperature: t.temperature, top_p: t.top_p }).expect("trace")), greedy);
}

/// The heads trained by `cargo xtask bench autodeco` and committed under `assets/` load, fit the
/// model, and on GSM eval answers (never seen in training) have a lower loss than the same
/// architecture freshly initialized.
#[test]
fn committed_smollm2_heads_beat_untrained_heads_on_eval_answers() {
    let (model, tok) = load();
    let dir = deco_tests::workspace_root().join("assets/autodeco/smollm2-135m-instruct-gsm");
    let trained = deco_autodeco::HostHeads::load(&dir).expect("committed heads");
    assert_eq!(trained.config().hidden_size, model.config.hidden_size);
    assert_eq!(trained.config().vocab_size, model.config.vocab_size);
    let template = ChatTemplate::new(tok.chat_template().expect("template")).expect("template");
    let items = read_gsm_jsonl(&asset("data/gsm_eval.jsonl")).expect("eval data");
    let examples: Vec<_> = items
        .iter()
        .take(3)
        .map(|it| chat_example(&tok, &template, &it.question, &strip_calculator(&it.answer)).expect("example"))
        .collect();
    let pool = collect_tokens(&model, &examples, &mut |_, _| {}).expect("pool");
    let head = FrozenHead { weight: model.lm_head().clone(), device: model.device().clone() };
    let rows: Vec<usize> = (0..pool.len()).collect();
    let cfg = trained.config().clone();
    let device = Device::flex();
    let lc = deco_autodeco::loss::LossConfig::default();
    let (tt, tp) = deco_autodeco::train::evaluate(&trained.to_module(&device), &cfg, &pool, &rows, &head, &lc, &device).expect("trained");
    device.seed(0);
    let fresh = AutoDecoHeads::init(&cfg, &device).expect("init");
    let (ft, fp) = deco_autodeco::train::evaluate(&fresh, &cfg, &pool, &rows, &head, &lc, &device).expect("fresh");
    assert!(tt + tp < 0.8 * (ft + fp), "trained {} vs untrained {}", tt + tp, ft + fp);
}
