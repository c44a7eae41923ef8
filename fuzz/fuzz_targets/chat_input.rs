//! Chat input (messages, template arguments, tools) against a real chat template: never a
//! panic, and rendering always ends (the template runs on bounded fuel).
//!
//! Input layout: lines; line 0 is the `chat_template_kwargs` JSON, line 1 the tools JSON, then
//! alternating role and content lines.
#![no_main]

use kv_tokenize::{ChatInput, ChatMessage, ChatTemplate};
use libfuzzer_sys::fuzz_target;

/// Qwen-style: system prompt handling, tools rendered with tojson, a generation prompt.
const TEMPLATE: &str = r#"{%- if tools %}<|im_start|>system
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}<|im_end|>
{%- endif %}
{%- for message in messages %}
{%- if message.role == "system" and loop.first %}<|im_start|>system
{{ message.content.strip() }}<|im_end|>
{%- elif message.role in ["user", "assistant"] %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{%- else %}{{ raise_exception("unknown role " + message.role) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{%- if enable_thinking is defined and enable_thinking is false %}<think>

</think>
{%- endif %}
{%- endif %}"#;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let mut lines = text.lines();
    let kwargs = lines.next().unwrap_or("");
    let tools = lines.next().unwrap_or("");
    let rest: Vec<&str> = lines.collect();
    let messages = rest
        .chunks(2)
        .map(|pair| ChatMessage {
            role: pair[0].to_owned(),
            content: pair.get(1).copied().unwrap_or("").to_owned(),
        })
        .collect();
    let Ok(input) = ChatInput::from_request(messages, true, kwargs, tools) else {
        return;
    };
    let template =
        ChatTemplate::new(TEMPLATE, vec![("bos_token".into(), "<s>".into())]).expect("compiles");
    let _ = template.render(&input);
});
