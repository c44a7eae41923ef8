//! The configuration files shipped in `config/` parse, validate, and mean what they say.

use kv_indexer::config::Config;

fn load(name: &str) -> Config {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("config")
        .join(name);
    let c = Config::load(&path).unwrap_or_else(|e| panic!("{name}: {e}"));
    c.validate().unwrap_or_else(|e| panic!("{name}: {e}"));
    c
}

#[test]
fn the_commented_example_is_exactly_the_defaults() {
    assert_eq!(load("kv-indexer.yaml"), Config::default());
}

#[test]
fn the_shipped_configs_set_nothing_that_does_nothing() {
    for name in [
        "kv-indexer.yaml",
        "llm-d-example.yaml",
        "endpoint-picker.yaml",
    ] {
        assert_eq!(load(name).warnings(), Vec::new(), "{name}");
    }
}

#[test]
fn the_endpoint_picker_quickstart_serves_the_picker_where_the_example_gateway_dials_it() {
    let c = load("endpoint-picker.yaml");
    assert!(c.endpoint_picker.enabled);
    assert_eq!(c.endpoint_picker.addr, "127.0.0.1:9002");
    assert!(
        !c.server.tls.enabled(),
        "plaintext, as the example's h2c cluster dials it"
    );
    let envoy = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/examples/envoy.yaml"),
    )
    .expect("deploy/examples/envoy.yaml");
    assert!(
        envoy.contains("port_value: 9002"),
        "the example dials the picker"
    );
}

#[test]
fn check_config_names_a_setting_that_does_nothing_and_refuses_replication_half_set() {
    let bin = env!("CARGO_BIN_EXE_kv-indexer");
    let dir = std::env::temp_dir().join(format!("kvi-loud-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp");
    // `check-config` on a file holding `yaml`.
    let check = |name: &str, yaml: &str| {
        let file = dir.join(name);
        std::fs::write(&file, yaml).expect("write");
        std::process::Command::new(bin)
            .args(["check-config", "--config"])
            .arg(&file)
            .output()
            .expect("runs")
    };
    let out = check(
        "inert.yaml",
        "server: {adminToken: \"0123456789abcdef-secret\"}\nkvEventsConfig: {queueDepth: 1024}\n",
    );
    assert!(out.status.success(), "inert settings are warnings");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("warning: server.adminToken"), "{err}");
    assert!(err.contains("warning: kvEventsConfig.queueDepth"), "{err}");
    assert!(!err.contains("0123456789abcdef-secret"), "{err}");
    let out = check(
        "half.yaml",
        "replication: {redisUrl: \"redis://:pw-secret@r:6379\"}\n",
    );
    assert!(!out.status.success(), "replication half set is an error");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("replication.enabled") && err.contains("replication.redisUrl"),
        "{err}"
    );
    assert!(!err.contains("pw-secret"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_llm_d_example_is_accepted() {
    let c = load("llm-d-example.yaml");
    assert_eq!(
        c.indexer_config.token_processor_config.hash_seed.as_deref(),
        Some("12345")
    );
    assert_eq!(c.kv_events_config.concurrency, 16);
}

#[test]
fn check_config_prints_the_effective_config_and_rejects_typos() {
    let bin = env!("CARGO_BIN_EXE_kv-indexer");
    let ok = std::process::Command::new(bin)
        .args(["check-config", "--config", "config/llm-d-example.yaml"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("HF_TOKEN", "hf_do_not_print")
        .env_remove("PYTHONHASHSEED")
        .output()
        .expect("runs");
    assert!(ok.status.success());
    let out = String::from_utf8_lossy(&ok.stdout);
    assert!(
        out.contains("hashSeed: '12345'") || out.contains("hashSeed: \"12345\""),
        "{out}"
    );
    assert!(
        !out.contains("hf_do_not_print"),
        "the token must not be printed"
    );
    let dir = std::env::temp_dir().join(format!("kvi-typo-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp");
    let bad = dir.join("typo.yaml");
    std::fs::write(&bad, "kvEventsConfig: {zmqEndpont: \"tcp://*:1\"}\n").expect("write");
    let err = std::process::Command::new(bin)
        .args(["check-config", "--config"])
        .arg(&bad)
        .output()
        .expect("runs");
    assert!(!err.status.success());
    let msg = String::from_utf8_lossy(&err.stderr);
    assert!(msg.contains("zmqEndpont"), "{msg}");
}
