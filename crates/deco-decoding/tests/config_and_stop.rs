//! Request parameters (serde, validation, chain order), generation_config.json parsing and
//! merging, stop strings and stopping criteria.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use deco_decoding::{
    DecodingError, FinishReason, GenerationConfig, LogitsProcessorList, SamplerOrder,
    SamplingParams, StopStringMatcher, StoppingCriteria, TokenIds,
};
use proptest::prelude::*;

fn err(json: &str) -> String {
    SamplingParams::from_json_str(json)
        .expect_err(json)
        .to_string()
}

#[test]
fn invalid_params_are_rejected_with_the_parameter_named() {
    assert_eq!(err(r#"{"top_p": 1.5}"#), "top_p must be in [0, 1], got 1.5");
    assert_eq!(
        err(r#"{"top_p": -0.1}"#),
        "top_p must be in [0, 1], got -0.1"
    );
    assert_eq!(
        err(r#"{"temperature": -1}"#),
        "temperature must be a finite number >= 0, got -1"
    );
    assert_eq!(
        err(r#"{"top_k": -1}"#),
        "top_k must be >= 0 (0 disables top-k), got -1"
    );
    assert_eq!(
        err(r#"{"repetition_penalty": 0}"#),
        "repetition_penalty must be a finite number > 0, got 0"
    );
    assert!(err(r#"{"repetition_penalty": -1.1}"#).starts_with("repetition_penalty"));
    assert!(err(r#"{"min_p": 2}"#).starts_with("min_p must be in [0, 1]"));
    assert!(err(r#"{"typical_p": 0}"#).starts_with("typical_p must be in (0, 1]"));
    assert!(err(r#"{"epsilon_cutoff": 1}"#).starts_with("epsilon_cutoff must be in [0, 1)"));
    assert!(err(r#"{"eta_cutoff": 1.5}"#).starts_with("eta_cutoff"));
    assert_eq!(
        err(r#"{"frequency_penalty": 2.5}"#),
        "frequency_penalty must be in [-2, 2], got 2.5"
    );
    assert!(err(r#"{"presence_penalty": -3}"#).starts_with("presence_penalty"));
    assert_eq!(
        err(r#"{"logit_bias": {"7": 101}}"#),
        "logit_bias values must be in [-100, 100], got 101 for token 7"
    );
    assert!(err(r#"{"bad_words_ids": []}"#).starts_with("bad_words_ids"));
    assert!(err(r#"{"bad_words_ids": [[1], []]}"#).starts_with("bad_words_ids"));
    assert_eq!(
        err(r#"{"max_new_tokens": 0}"#),
        "max_new_tokens must be >= 1, got 0"
    );
    assert_eq!(
        err(r#"{"min_new_tokens": 5, "max_new_tokens": 4}"#),
        "min_new_tokens must be <= max_new_tokens, got 5 > 4"
    );
    assert!(err(r#"{"stop": ["ok", ""]}"#).starts_with("stop must not contain an empty string"));
    assert_eq!(err(r#"{"logprobs": 21}"#), "logprobs must be <= 20, got 21");
    // type errors come from serde, naming the field
    let e = SamplingParams::from_json_str(r#"{"max_new_tokens": -3}"#).unwrap_err();
    assert!(matches!(e, DecodingError::Json(_)));
    assert!(e.to_string().contains("-3"), "{e}");
    // programmatic NaN (JSON cannot carry one)
    let p = SamplingParams {
        top_p: Some(f32::NAN),
        ..Default::default()
    };
    assert!(p.validate().is_err());
    let p = SamplingParams {
        temperature: Some(f32::INFINITY),
        ..Default::default()
    };
    assert!(p.validate().is_err());
}

#[test]
fn valid_boundary_values_are_accepted() {
    for json in [
        r#"{"top_p": 0}"#,
        r#"{"top_p": 1}"#,
        r#"{"temperature": 0}"#,
        r#"{"top_k": 0}"#,
        r#"{"min_p": 1}"#,
        r#"{"typical_p": 1}"#,
        r#"{"epsilon_cutoff": 0}"#,
        r#"{"frequency_penalty": -2, "presence_penalty": 2}"#,
        r#"{"logit_bias": {"3": -100}}"#,
        r#"{"logprobs": 20}"#,
        r#"{"min_new_tokens": 4, "max_new_tokens": 4}"#,
    ] {
        SamplingParams::from_json_str(json).unwrap_or_else(|e| panic!("{json}: {e}"));
    }
}

#[test]
fn params_parse_openai_shapes_and_ignore_unknown_fields() {
    let p = SamplingParams::from_json_str(
        r#"{"model": "x", "messages": [], "stop": "\n\n", "logit_bias": {"50256": -100, "11": 2.5},
            "seed": 7, "max_new_tokens": 16}"#,
    )
    .unwrap();
    assert_eq!(p.stop, Some(vec!["\n\n".to_string()]));
    let bias = p.logit_bias.as_ref().unwrap();
    assert_eq!(bias.get(&50256), Some(&-100.0));
    assert_eq!(bias.get(&11), Some(&2.5));
    assert_eq!(p.seed, Some(7));
    let p = SamplingParams::from_json_str(r#"{"stop": ["a", "b"]}"#).unwrap();
    assert_eq!(p.stop, Some(vec!["a".to_string(), "b".to_string()]));
    // round trip keeps only what was set
    let json = serde_json::to_string(&SamplingParams {
        top_k: Some(5),
        ..Default::default()
    })
    .unwrap();
    assert_eq!(json, r#"{"top_k":5}"#);
}

/// `SamplingParams::FIELDS` is exactly the set of keys serde writes for a fully set value, so a
/// request parser that refuses other keys refuses nothing deco reads.
#[test]
fn fields_list_is_the_serde_field_set() {
    let full = SamplingParams {
        do_sample: Some(true),
        temperature: Some(1.0),
        top_k: Some(1),
        top_p: Some(1.0),
        min_p: Some(0.0),
        typical_p: Some(1.0),
        epsilon_cutoff: Some(0.0),
        eta_cutoff: Some(0.0),
        repetition_penalty: Some(1.0),
        frequency_penalty: Some(0.0),
        presence_penalty: Some(0.0),
        no_repeat_ngram_size: Some(0),
        logit_bias: Some(Default::default()),
        bad_words_ids: Some(vec![]),
        min_new_tokens: Some(0),
        max_new_tokens: Some(1),
        stop: Some(vec![]),
        stop_token_ids: Some(vec![]),
        include_stop_str_in_output: Some(false),
        seed: Some(0),
        ignore_eos: Some(false),
        logprobs: Some(0),
    };
    let v = serde_json::to_value(&full).unwrap();
    let mut keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
    let mut fields = SamplingParams::FIELDS.to_vec();
    keys.sort_unstable();
    fields.sort_unstable();
    assert_eq!(keys, fields);
}

#[test]
fn chain_order_follows_hugging_face_and_llama_cpp() {
    let p = SamplingParams::from_json_str(
        r#"{"temperature": 0.7, "top_k": 40, "top_p": 0.9, "min_p": 0.05, "typical_p": 0.95,
            "epsilon_cutoff": 0.0003, "eta_cutoff": 0.0009, "repetition_penalty": 1.1,
            "frequency_penalty": 0.5, "presence_penalty": 0.25, "no_repeat_ngram_size": 3,
            "logit_bias": {"1": 1}, "bad_words_ids": [[4, 5]], "min_new_tokens": 2}"#,
    )
    .unwrap();
    let history = [
        "logit_bias",
        "repetition_penalty",
        "frequency_penalty",
        "presence_penalty",
        "no_repeat_ngram_size",
        "bad_words_ids",
        "min_new_tokens",
    ];
    let hf = LogitsProcessorList::from_params(&p, SamplerOrder::HuggingFace).unwrap();
    let mut expect = history.to_vec();
    expect.extend([
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "typical_p",
        "epsilon_cutoff",
        "eta_cutoff",
    ]);
    assert_eq!(hf.names(), expect);
    let ll = LogitsProcessorList::from_params(&p, SamplerOrder::LlamaCpp).unwrap();
    let mut expect = history.to_vec();
    expect.extend([
        "top_k",
        "typical_p",
        "top_p",
        "min_p",
        "epsilon_cutoff",
        "eta_cutoff",
        "temperature",
    ]);
    assert_eq!(ll.names(), expect);
    // identity values add nothing
    let id = SamplingParams::from_json_str(
        r#"{"temperature": 1, "top_k": 0, "top_p": 1, "min_p": 0, "typical_p": 1,
            "repetition_penalty": 1, "frequency_penalty": 0, "no_repeat_ngram_size": 0}"#,
    )
    .unwrap();
    assert!(
        LogitsProcessorList::from_params(&id, SamplerOrder::HuggingFace)
            .unwrap()
            .is_empty()
    );
}

const QWEN2_5_INSTRUCT: &str = r#"{
  "bos_token_id": 151643,
  "pad_token_id": 151643,
  "do_sample": true,
  "eos_token_id": [151645, 151643],
  "repetition_penalty": 1.1,
  "temperature": 0.7,
  "top_p": 0.8,
  "top_k": 20,
  "transformers_version": "4.37.0"
}"#;

const SMOLLM2: &str = r#"{
  "_from_model_config": true,
  "bos_token_id": 1,
  "eos_token_id": 2,
  "pad_token_id": null,
  "transformers_version": "4.42.3"
}"#;

#[test]
fn generation_config_parses_real_files_and_applies_hf_defaults() {
    let q = GenerationConfig::from_json_str(QWEN2_5_INSTRUCT).unwrap();
    assert_eq!(q.eos_token_ids(), vec![151645, 151643]);
    assert_eq!(q.eos_token_id, Some(TokenIds::Many(vec![151645, 151643])));
    assert!(q.do_sample());
    assert_eq!((q.temperature(), q.top_k(), q.top_p()), (0.7, 20, 0.8));
    assert_eq!(q.repetition_penalty(), 1.1);

    let s = GenerationConfig::from_json_str(SMOLLM2).unwrap();
    assert_eq!(s.eos_token_ids(), vec![2]);
    assert_eq!(s.bos_token_id, Some(1));
    assert_eq!(s.pad_token_id, None);
    // Hugging Face class defaults
    assert!(!s.do_sample());
    assert_eq!((s.temperature(), s.top_k(), s.top_p()), (1.0, 50, 1.0));
    assert_eq!(s.max_length(), 20);
    assert_eq!(s.max_new_tokens_for(5), 15);
    assert_eq!(s.max_new_tokens_for(30), 0);

    assert!(matches!(
        GenerationConfig::from_json_str(r#"{"top_k": "many"}"#),
        Err(DecodingError::Json(_))
    ));
}

#[test]
fn generation_config_from_file_names_the_file_on_error() {
    let dir = std::env::temp_dir().join(format!("deco-decoding-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("generation_config.json");
    std::fs::write(&path, QWEN2_5_INSTRUCT).unwrap();
    let q = GenerationConfig::from_file(&path).unwrap();
    assert_eq!(q.top_k, Some(20));
    let missing = dir.join("nope.json");
    let e = GenerationConfig::from_file(&missing).unwrap_err();
    assert!(e.to_string().contains("nope.json"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn merge_applies_overrides_and_the_sampling_only_top_k_default() {
    let q = GenerationConfig::from_json_str(QWEN2_5_INSTRUCT).unwrap();
    let s = GenerationConfig::from_json_str(SMOLLM2).unwrap();

    // no overrides: the model's sampling setup
    let m = q.merge(&SamplingParams::default());
    assert_eq!(m.do_sample, Some(true));
    assert_eq!(
        (m.temperature, m.top_k, m.top_p, m.repetition_penalty),
        (Some(0.7), Some(20), Some(0.8), Some(1.1))
    );
    // request overrides win, the rest is kept
    let o = SamplingParams::from_json_str(r#"{"top_p": 0.5, "seed": 3, "stop": "x"}"#).unwrap();
    let m = q.merge(&o);
    assert_eq!((m.top_p, m.top_k, m.seed), (Some(0.5), Some(20), Some(3)));
    assert_eq!(m.stop, Some(vec!["x".into()]));
    // temperature 0 in the request means greedy
    let m = q.merge(&SamplingParams::from_json_str(r#"{"temperature": 0}"#).unwrap());
    assert!(m.is_greedy());

    // SmolLM2: greedy by default, and top_k's default 50 does not apply to greedy
    let m = s.merge(&SamplingParams::default());
    assert_eq!(m.do_sample, Some(false));
    assert_eq!(m.top_k, None);
    assert!(m.is_greedy());
    // a request temperature turns sampling on; then HF's top_k = 50 applies
    let m = s.merge(&SamplingParams::from_json_str(r#"{"temperature": 0.8}"#).unwrap());
    assert_eq!(
        (m.do_sample, m.temperature, m.top_k),
        (Some(true), Some(0.8), Some(50))
    );
    // explicit do_sample wins over the temperature rule, and top_k = 0 stays 0
    let m = s.merge(&SamplingParams::from_json_str(r#"{"do_sample": true, "top_k": 0}"#).unwrap());
    assert_eq!((m.do_sample, m.top_k), (Some(true), Some(0)));
    let m = s.merge(
        &SamplingParams::from_json_str(r#"{"do_sample": false, "temperature": 0.9}"#).unwrap(),
    );
    assert!(m.is_greedy());
    assert!(m.validate().is_ok());
}

#[test]
fn stop_string_split_across_tokens_is_never_streamed() {
    let mut m = StopStringMatcher::new(vec!["</s>".into(), "STOP".into()], false).unwrap();
    let mut out = String::new();
    let mut stop = None;
    for piece in ["Hello", " wor", "ld<", "/", "s", ">tail"] {
        let step = m.push(piece);
        // nothing streamed so far contains '<'
        assert!(!step.text.contains('<'), "{:?}", step.text);
        out.push_str(&step.text);
        if step.stop.is_some() {
            stop = step.stop;
            break;
        }
    }
    assert_eq!(out, "Hello world");
    assert_eq!(stop.as_deref(), Some("</s>"));
    assert!(m.is_stopped());
    assert_eq!(m.push("more").text, "");

    // a false start is released once it cannot match any more
    let mut m = StopStringMatcher::new(vec!["</s>".into()], false).unwrap();
    assert_eq!(m.push("a </").text, "a ");
    assert_eq!(m.held_back(), "</");
    assert_eq!(m.push("b").text, "</b");
    assert_eq!(m.push("c<").text, "c");
    assert_eq!(m.flush(), "<");
}

#[test]
fn include_stop_str_and_earliest_ending_match() {
    let mut m = StopStringMatcher::new(vec!["world".into()], true).unwrap();
    let s = m.push("hello world!");
    assert_eq!(
        (s.text.as_str(), s.stop.as_deref()),
        ("hello world", Some("world"))
    );
    // "bc" ends before "abcd": it wins whatever the chunking
    for chunks in [vec!["abcd"], vec!["a", "b", "c", "d"], vec!["ab", "cd"]] {
        let mut m = StopStringMatcher::new(vec!["abcd".into(), "bc".into()], false).unwrap();
        let mut out = String::new();
        let mut stop = None;
        for c in chunks {
            let s = m.push(c);
            out.push_str(&s.text);
            if s.stop.is_some() {
                stop = s.stop;
                break;
            }
        }
        assert_eq!((out.as_str(), stop.as_deref()), ("a", Some("bc")));
    }
    // multi-byte stop strings split inside characters' boundaries of the text pieces
    let mut m = StopStringMatcher::new(vec!["世界".into()], false).unwrap();
    assert_eq!(m.push("你好世").text, "你好");
    let s = m.push("界!");
    assert_eq!((s.text.as_str(), s.stop.as_deref()), ("", Some("世界")));
    assert!(StopStringMatcher::new(vec!["".into()], false).is_err());
}

/// Reference: the text before the earliest-ending (then longest) stop match, by brute force.
fn reference(text: &str, stops: &[String], include: bool) -> (String, Option<String>) {
    for end in (1..=text.len()).filter(|&e| text.is_char_boundary(e)) {
        let head = &text[..end];
        if let Some(s) = stops
            .iter()
            .filter(|s| head.ends_with(s.as_str()))
            .max_by_key(|s| s.len())
        {
            let cut = if include { end } else { end - s.len() };
            return (text[..cut].to_string(), Some(s.clone()));
        }
    }
    (text.to_string(), None)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    #[test]
    fn stop_matcher_is_chunking_independent_and_never_leaks(
        text in "[abé<>]{0,24}",
        stops in prop::collection::vec("[abé<>]{1,4}", 1..4),
        cuts in prop::collection::vec(0usize..30, 0..8),
        include in any::<bool>(),
    ) {
        let (expect, expect_stop) = reference(&text, &stops, include);
        // split `text` at the char boundaries chosen by `cuts`
        let bounds: Vec<usize> = text.char_indices().map(|(i, _)| i).collect();
        let mut at: Vec<usize> = cuts.iter().filter(|_| !bounds.is_empty()).map(|c| bounds[c % bounds.len()]).collect();
        at.push(0);
        at.push(text.len());
        at.sort_unstable();
        at.dedup();
        let mut m = StopStringMatcher::new(stops.clone(), include).unwrap();
        let mut streamed = String::new();
        let mut got_stop = None;
        for w in at.windows(2) {
            let step = m.push(&text[w[0]..w[1]]);
            streamed.push_str(&step.text);
            // streaming never gets ahead of the final answer
            prop_assert!(expect.starts_with(&streamed), "{:?} not a prefix of {:?}", streamed, expect);
            if step.stop.is_some() {
                got_stop = step.stop;
                break;
            }
        }
        if got_stop.is_none() {
            streamed.push_str(&m.flush());
        }
        prop_assert_eq!(&streamed, &expect);
        prop_assert_eq!(got_stop, expect_stop);
        if !include {
            for s in &stops {
                prop_assert!(!streamed.contains(s.as_str()));
            }
        }
    }
}

#[test]
fn stopping_criteria_reasons_and_precedence() {
    let c = StoppingCriteria::new(vec![2], vec![7], Some(3)).unwrap();
    assert_eq!(c.check(5, 1), None);
    assert_eq!(c.check(2, 1), Some(FinishReason::EosToken));
    assert_eq!(c.check(7, 2), Some(FinishReason::Stop));
    assert_eq!(c.check(5, 3), Some(FinishReason::Length));
    // EOS wins over length on the last allowed token
    assert_eq!(c.check(2, 3), Some(FinishReason::EosToken));
    assert_eq!(FinishReason::EosToken.as_openai_str(), "stop");
    assert_eq!(FinishReason::Length.as_openai_str(), "length");
    assert!(StoppingCriteria::new(vec![], vec![], Some(0)).is_err());
    let p =
        SamplingParams::from_json_str(r#"{"stop_token_ids": [9], "max_new_tokens": 1}"#).unwrap();
    let c = StoppingCriteria::from_params(&p, &[0]).unwrap();
    assert_eq!(c.check(9, 1), Some(FinishReason::Stop));
    assert_eq!(c.check(4, 1), Some(FinishReason::Length));
    assert_eq!(
        StoppingCriteria::new(vec![0], vec![], None)
            .unwrap()
            .check(4, 10_000),
        None
    );
}
