//! The configuration loader on arbitrary text: never a panic; a file that loads either
//! validates or names the field it rejects, and the redacted copy prints.
#![no_main]

use kv_indexer::config::Config;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(mut config) = Config::from_yaml(text, "fuzz") else {
        return;
    };
    config.apply_env(|_| None);
    if let Err(e) = config.validate() {
        assert!(!e.to_string().is_empty());
    }
    let _ = config.redacted().to_yaml();
});
