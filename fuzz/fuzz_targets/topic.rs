//! The topic parser on arbitrary bytes: never a panic; what it accepts is within the bounds and
//! the grammar it promises, and glob matching never panics.
#![no_main]

use kv_indexer::topic::{glob_match, parse_topic, valid_model, valid_pod, MAX_TOPIC_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok((pod, model)) = parse_topic(data, "kv@") {
        assert!(data.len() <= MAX_TOPIC_LEN);
        assert!(valid_pod(pod) && valid_model(model));
    }
    if let Ok(text) = std::str::from_utf8(data) {
        let middle = text.char_indices().nth(text.chars().count() / 2).map_or(0, |(i, _)| i);
        let (pattern, subject) = text.split_at(middle);
        let _ = glob_match(pattern, subject);
        let _ = kv_indexer::topic::gap_fill_endpoint(pattern, subject, 3);
    }
});
