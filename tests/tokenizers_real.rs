//! The real Qwen3 and Llama-3 tokenizers (from `../shared/tokenizers/`, too large to copy in):
//! token ids with and without special tokens, chat rendering byte for byte, and chat token ids,
//! against `samples.json` (produced with Python `tokenizers` and a HuggingFace-style Jinja2).
//!
//! Without `../shared/` these tests print SKIPPED and why; under CI (`CI=true`), which has it,
//! a missing directory is a failure.

mod support;

use kv_tokenize::LoadedTokenizer;
use kv_tokenize::{ChatInput, ChatMessage};
use serde_json::Value;

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("ids")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

fn check(name: &str, model: &str) {
    let Some(dir) = support::shared_tokenizer(name) else {
        return;
    };
    let samples: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("samples.json")).expect("samples.json"),
    )
    .expect("json");
    let tok = LoadedTokenizer::from_files(model, &dir.join("tokenizer.json")).expect("loads");
    let mut checked = 0;
    for s in samples["samples"].as_array().expect("samples") {
        let text = s["text"].as_str().expect("text");
        let sample = s["name"].as_str().expect("name");
        assert_eq!(
            tok.encode(text, false).expect("encodes").ids,
            ids(&s["ids_no_special"]),
            "{name}/{sample}: no special tokens"
        );
        assert_eq!(
            tok.encode_prompt(text).expect("encodes").ids,
            ids(&s["ids_with_special"]),
            "{name}/{sample}: completion prompt"
        );
        checked += 1;
    }
    let chat = &samples["chat"];
    let messages = chat["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .map(|m| ChatMessage {
            role: m["role"].as_str().expect("role").into(),
            content: m["content"].as_str().expect("content").into(),
        })
        .collect();
    let mut kwargs = chat["template_kwargs"].as_object().expect("kwargs").clone();
    let add_generation_prompt = kwargs
        .remove("add_generation_prompt")
        .and_then(|v| v.as_bool())
        .unwrap_or(false);
    let input = ChatInput {
        messages,
        add_generation_prompt,
        template_kwargs: kwargs,
        tools: None,
        cut: None,
    };
    let (rendered, encoded) = tok.encode_chat(&input).expect("renders and encodes");
    assert_eq!(
        rendered,
        chat["rendered"].as_str().expect("rendered"),
        "{name}: rendered chat"
    );
    assert_eq!(encoded.ids, ids(&chat["ids"]), "{name}: chat ids");
    assert_eq!(checked, 8, "{name}: every sample checked");
}

#[test]
fn qwen3_samples_and_chat() {
    check("qwen3", "Qwen/Qwen3-8B");
}

#[test]
fn llama3_samples_bos_and_chat() {
    check("llama3", "meta-llama/Meta-Llama-3-8B-Instruct");
}

#[test]
fn qwen3_template_renders_tools_and_thinking_switches() {
    let Some(dir) = support::shared_tokenizer("qwen3") else {
        return;
    };
    let tok =
        LoadedTokenizer::from_files("Qwen/Qwen3-8B", &dir.join("tokenizer.json")).expect("loads");
    let input = ChatInput::from_request(
        vec![ChatMessage { role: "user".into(), content: "Weather in Paris?".into() }],
        true,
        r#"{"enable_thinking": false}"#,
        r#"[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]"#,
    )
    .expect("valid JSON");
    let rendered = tok.render_chat(&input).expect("renders");
    assert!(rendered.contains("<tools>"), "{rendered}");
    // HuggingFace's tojson is json.dumps(ensure_ascii=False): ", " and ": " separators.
    assert!(
        rendered.contains(r#"{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}"#),
        "{rendered}"
    );
    assert!(
        rendered.ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"),
        "thinking off: {rendered:?}"
    );
    let thinking = ChatInput::from_request(
        vec![ChatMessage {
            role: "user".into(),
            content: "Hi".into(),
        }],
        true,
        r#"{"enable_thinking": true}"#,
        "",
    )
    .expect("valid");
    let rendered = tok.render_chat(&thinking).expect("renders");
    assert!(
        rendered.ends_with("<|im_start|>assistant\n"),
        "thinking on: {rendered:?}"
    );
}
