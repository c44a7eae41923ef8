use super::*;

fn ok(path: Option<&str>, body: &str) -> PickRequest {
    parse(path, body.as_bytes()).unwrap_or_else(|e| panic!("{body}: {e}"))
}

fn chat_of(r: &PickRequest) -> &ChatInput {
    match &r.prompt {
        Some(Prompt::Chat(c)) => c,
        other => panic!("not a chat: {other:?}"),
    }
}

const CHAT: Option<&str> = Some("/v1/chat/completions");
const COMPLETIONS: Option<&str> = Some("/v1/completions");

#[test]
fn chat_bodies_read_as_chats() {
    let r = ok(
        CHAT,
        r#"{"model":"m","cache_salt":"t1","messages":[
        {"role":"system","content":"be brief"},
        {"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},
        {"role":"assistant","content":null,"tool_calls":[],"refusal":null}],
        "tools":[{"type":"function"}],"chat_template_kwargs":{"x":1}}"#,
    );
    assert_eq!(r.model, "m");
    assert_eq!(r.cache_salt, "t1");
    assert_eq!(r.unscored, None);
    let c = chat_of(&r);
    assert_eq!(c.messages.len(), 3);
    assert_eq!(c.messages[1].content, "a\nb");
    assert_eq!(c.messages[2].content, "");
    assert_eq!(c.cut, None, "empty extras do not cut");
    assert!(c.add_generation_prompt);
    assert_eq!(c.tools, Some(serde_json::json!([{"type": "function"}])));
    assert_eq!(c.template_kwargs.get("x"), Some(&serde_json::json!(1)));
}

#[test]
fn a_chat_is_cut_where_its_text_stops_being_knowable() {
    // An image part: the prompt is knowable up to that message's content.
    let r = ok(
        CHAT,
        r#"{"model":"m","messages":[
        {"role":"system","content":"s"},
        {"role":"user","content":[{"type":"text","text":"look"},
            {"type":"image_url","image_url":{"url":"data:x"}}]},
        {"role":"user","content":"and then"}]}"#,
    );
    let c = chat_of(&r);
    assert_eq!(c.cut, Some(1));
    assert_eq!(c.messages.len(), 3, "every message stays for the template");
    // Tool calls, a name: rendered by the template in ways the daemon does not reproduce.
    let r = ok(
        CHAT,
        r#"{"model":"m","messages":[{"role":"user","content":"q"},
        {"role":"assistant","content":"","tool_calls":[{"id":"1","type":"function",
            "function":{"name":"f","arguments":"{}"}}]},
        {"role":"tool","content":"r","tool_call_id":"1"}]}"#,
    );
    assert_eq!(chat_of(&r).cut, Some(1));
    let r = ok(
        CHAT,
        r#"{"model":"m","messages":[{"role":"user","name":"ann","content":"q"}]}"#,
    );
    assert_eq!(chat_of(&r).cut, Some(0));
    // Input audio, a file: the same.
    for part in [
        r#"{"type":"input_audio","input_audio":{"data":"x","format":"wav"}}"#,
        r#"{"type":"file","file":{"file_id":"f"}}"#,
    ] {
        let body = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"a"}},
            {{"role":"user","content":[{part}]}}]}}"#
        );
        assert_eq!(chat_of(&ok(CHAT, &body)).cut, Some(1), "{part}");
    }
}

#[test]
fn completion_prompts_read_as_text_or_tokens_and_a_batch_by_its_first() {
    let prompt = |body: &str| ok(COMPLETIONS, body).prompt;
    assert!(matches!(
        prompt(r#"{"model":"m","prompt":"hello"}"#),
        Some(Prompt::Text(t)) if t == "hello"
    ));
    assert!(matches!(
        prompt(r#"{"model":"m","prompt":[1,2,3]}"#),
        Some(Prompt::Tokens(ids)) if ids == [1, 2, 3]
    ));
    assert!(matches!(
        prompt(r#"{"model":"m","prompt":["one","two"]}"#),
        Some(Prompt::Text(t)) if t == "one"
    ));
    // A list of token-id lists: GIE refuses it, vLLM serves it.
    assert!(matches!(
        prompt(r#"{"model":"m","prompt":[[7,8],[9]]}"#),
        Some(Prompt::Tokens(ids)) if ids == [7, 8]
    ));
}

#[test]
fn embeddings_read_their_input() {
    let path = Some("/v1/embeddings");
    for (body, want) in [
        (r#"{"model":"e","input":"text"}"#, "text"),
        (r#"{"model":"e","input":["first","second"]}"#, "first"),
    ] {
        let r = ok(path, body);
        assert!(
            matches!(&r.prompt, Some(Prompt::Text(t)) if t == want),
            "{body}: {r:?}"
        );
    }
    assert!(matches!(
        ok(path, r#"{"model":"e","input":[[5,6]]}"#).prompt,
        Some(Prompt::Tokens(ids)) if ids == [5, 6]
    ));
    assert!(matches!(
        ok(path, r#"{"model":"e","input":[5,6]}"#).prompt,
        Some(Prompt::Tokens(ids)) if ids == [5, 6]
    ));
}

#[test]
fn responses_read_as_the_chat_vllm_builds() {
    let path = Some("/v1/responses");
    let r = ok(
        path,
        r#"{"model":"m","instructions":"be brief","input":"hi","cache_salt":"s"}"#,
    );
    let c = chat_of(&r);
    let roles: Vec<&str> = c.messages.iter().map(|m| m.role.as_str()).collect();
    assert_eq!(roles, ["system", "user"]);
    assert_eq!(c.messages[0].content, "be brief");
    assert_eq!(c.messages[1].content, "hi");
    assert!(c.add_generation_prompt);
    assert_eq!(c.cut, None);
    assert_eq!(r.cache_salt, "s");
    let r = ok(
        path,
        r#"{"model":"m","input":[
        {"type":"message","role":"user","content":[{"type":"input_text","text":"q"}]},
        {"type":"function_call","call_id":"c","name":"f","arguments":"{}"},
        {"type":"function_call_output","call_id":"c","output":"r"}]}"#,
    );
    let c = chat_of(&r);
    assert_eq!(c.messages[0].content, "q");
    assert_eq!(c.cut, Some(1), "cut at the function call");
    for (body, reason) in [
        (
            r#"{"model":"m","input":"hi","previous_response_id":"r1"}"#,
            "stored_conversation",
        ),
        (
            r#"{"model":"m","input":"hi","conversation":"c1"}"#,
            "stored_conversation",
        ),
        (
            r#"{"model":"m","input":"hi","tools":[{"type":"function","name":"f"}]}"#,
            "responses_tools",
        ),
    ] {
        let r = ok(path, body);
        assert!(r.prompt.is_none(), "{body}");
        assert_eq!(r.unscored, Some(reason), "{body}");
    }
}

#[test]
fn other_paths_are_picked_on_load_and_no_path_reads_the_shape() {
    for (path, body, reason) in [
        (
            Some("/v1/conversations"),
            r#"{"model":"m","items":[{"type":"message","role":"user","content":"x"}]}"#,
            "conversations",
        ),
        (Some("/v1/rerank"), r#"{"model":"m","query":"q"}"#, "path"),
        (Some("/tokenize"), r#"{"model":"m","prompt":"p"}"#, "path"),
    ] {
        let r = ok(path, body);
        assert!(r.prompt.is_none(), "{body}");
        assert_eq!(r.unscored, Some(reason));
    }
    // No :path (NGINX Gateway Fabric's shim): the shape decides.
    assert!(chat_of(&ok(
        None,
        r#"{"model":"m","messages":[{"role":"user","content":"x"}]}"#
    ))
    .cut
    .is_none());
    assert!(matches!(
        ok(None, r#"{"model":"m","prompt":"p"}"#).prompt,
        Some(Prompt::Text(_))
    ));
    // A query string does not hide the API.
    assert!(matches!(
        ok(Some("/v1/completions?x=1"), r#"{"model":"m","prompt":"p"}"#).prompt,
        Some(Prompt::Text(_))
    ));
}

#[test]
fn what_gie_refuses_is_an_error() {
    for (path, body, reason) in [
        (COMPLETIONS, "\u{0}\u{1}garbage", "not_json"),
        (
            CHAT,
            r#"{"model":"m","messages":[{"role":"user","con"#,
            "not_json",
        ),
        (COMPLETIONS, "[1,2]", "not_object"),
        (COMPLETIONS, r#"{"prompt":"x"}"#, "no_model"),
        (Some("/v1/rerank"), r#"{"query":"x"}"#, "no_model"),
        (COMPLETIONS, r#"{"model":"","prompt":"x"}"#, "no_model"),
        (COMPLETIONS, r#"{"model":"m"}"#, "shape"),
        (CHAT, r#"{"model":"m"}"#, "shape"),
        (CHAT, r#"{"model":"m","messages":"hi"}"#, "shape"),
        (
            CHAT,
            r#"{"model":"m","messages":[{"content":"hi"}]}"#,
            "shape",
        ),
        (
            CHAT,
            r#"{"model":"m","messages":[{"role":"user","content":5}]}"#,
            "shape",
        ),
        (COMPLETIONS, r#"{"model":"m","prompt":[1,-2]}"#, "shape"),
        (COMPLETIONS, r#"{"model":"m","prompt":[]}"#, "shape"),
        (COMPLETIONS, r#"{"model":"m","prompt":""}"#, "shape"),
        (COMPLETIONS, r#"{"model":"m","prompt":{"a":1}}"#, "shape"),
        (
            COMPLETIONS,
            r#"{"model":"m","prompt":"x","cache_salt":5}"#,
            "shape",
        ),
        (
            Some("/v1/embeddings"),
            r#"{"model":"m","input":[]}"#,
            "shape",
        ),
        (Some("/v1/conversations"), r#"{"model":"m"}"#, "shape"),
        (Some("/v1/responses"), r#"{"model":"m","input":5}"#, "shape"),
    ] {
        match parse(path, body.as_bytes()) {
            Err(e) => assert_eq!(e.reason(), reason, "{body}: {e}"),
            Ok(r) => panic!("{body} was read: {r:?}"),
        }
    }
}
