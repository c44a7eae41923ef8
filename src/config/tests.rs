//! The configuration's unit tests: defaults, parsing, validation errors by field, redaction.

use super::*;

#[test]
fn empty_config_is_the_embedded_default() {
    let c = Config::from_yaml("", "empty").expect("empty is fine");
    assert_eq!(c, Config::default());
    c.validate().expect("defaults are valid");
    assert_eq!(c.kv_events_config.zmq_endpoint, "tcp://127.0.0.1:5557");
    assert_eq!(c.server.grpc_addr, "0.0.0.0:50051");
}

#[test]
fn the_llm_d_shape_parses() {
    let text = r#"
indexerConfig:
  prefixStoreConfig: {cacheSize: 500000, blockSize: 256}
  tokenProcessorConfig: {blockSize: 16, hashSeed: "12345"}
  kvBlockIndexConfig: {inMemoryConfig: {size: 100000000, podCacheSize: 10}, enableMetrics: true}
  tokenizersPoolConfig: {workersCount: 8, minPrefixOverlapRatio: 0.8, huggingFaceToken: "", tokenizersCacheDir: "/tmp"}
kvEventsConfig: {zmqEndpoint: "tcp://*:5557", topicFilter: "kv@", concurrency: 16}
"#;
    let c = Config::from_yaml(text, "llm-d").expect("parses");
    c.validate().expect("valid");
    assert_eq!(
        c.indexer_config.token_processor_config.hash_seed.as_deref(),
        Some("12345")
    );
}

#[test]
fn unknown_fields_and_bad_values_name_the_field() {
    let e = Config::from_yaml(
        "indexerConfig:\n  tokenProcessorConfig: {blokSize: 16}\n",
        "f",
    )
    .expect_err("typo");
    assert!(e.to_string().contains("blokSize"), "{e}");
    let c = Config::from_yaml(
        "indexerConfig:\n  tokenProcessorConfig: {blockSize: 0}\n",
        "f",
    )
    .expect("parses");
    let e = c.validate().expect_err("zero block size");
    assert!(
        e.to_string()
            .contains("indexerConfig.tokenProcessorConfig.blockSize"),
        "{e}"
    );
    let c = Config::from_yaml("server: {grpcAddr: nonsense}\n", "f").expect("parses");
    assert!(c
        .validate()
        .expect_err("bad addr")
        .to_string()
        .contains("server.grpcAddr"));
    let c =
        Config::from_yaml("kvEventsConfig: {zmqEndpoint: \"ipc:///x\"}\n", "f").expect("parses");
    assert!(c
        .validate()
        .expect_err("ipc")
        .to_string()
        .contains("zmqEndpoint"));
}

#[test]
fn the_retired_engine_setting_is_refused_as_nodes_and_warned_about_as_runs() {
    let yaml = |mem: &str| {
        format!("indexerConfig:\n  kvBlockIndexConfig: {{inMemoryConfig: {{{mem}}}}}\n")
    };
    let field = "indexerConfig.kvBlockIndexConfig.inMemoryConfig.engine";
    let c = Config::from_yaml(&yaml("engine: runs"), "f").expect("parses");
    c.validate().expect("runs is accepted");
    let warned = c.warnings();
    assert!(
        warned
            .iter()
            .any(|w| w.field == field && w.message.contains("no longer a choice")),
        "{warned:?}"
    );
    let c = Config::from_yaml(&yaml("engine: nodes"), "f").expect("parses");
    let e = c.validate().expect_err("the node index is gone");
    assert!(
        e.to_string().contains("retired") && e.to_string().contains(field),
        "{e}"
    );
    let quiet = Config::from_yaml(&yaml("size: 1000"), "f").expect("parses");
    assert!(
        quiet.warnings().iter().all(|w| w.field != field),
        "no engine, no warning"
    );
    let e = Config::from_yaml(&yaml("engine: radix"), "f").expect_err("unknown engine");
    assert!(e.to_string().contains("radix"), "{e}");
    let c = Config::from_yaml(&yaml("podCacheSize: 10"), "f").expect("parses");
    c.validate().expect("podCacheSize");
    assert_eq!(c.indexer_settings().index.pod_cache_size, Some(10));
    let c = Config::from_yaml(&yaml("podCacheSize: 0"), "f").expect("parses");
    let e = c.validate().expect_err("a bound of 0");
    assert!(e.to_string().contains("podCacheSize"), "{e}");
}

#[test]
fn discovery_settings_are_checked_and_the_error_names_the_field() {
    let check = |services: &str, expect: &str| {
        let yaml = format!("kvEventsConfig:\n  discovery:\n{services}");
        let c = Config::from_yaml(&yaml, "f").expect("parses");
        match c.validate() {
            Ok(()) => assert!(expect.is_empty(), "{yaml} accepted"),
            Err(e) => assert!(
                !expect.is_empty() && e.to_string().contains(expect),
                "{yaml}: {e}"
            ),
        }
    };
    check(
        "    services: [{name: vllm.ns.svc.cluster.local, dataParallelSize: 4, pod: \"{ip}:8000\"}]\n",
        "",
    );
    check("    services: [{name: \"\"}]\n", "services[0].name");
    check(
        "    services: [{name: v, publisherPort: 65535, dataParallelSize: 2}]\n",
        "services[0].publisherPort",
    );
    check(
        "    services: [{name: v, replayPort: 65535, dataParallelSize: 2}]\n",
        "services[0].replayPort",
    );
    check(
        "    services: [{name: v, dataParallelSize: 0}]\n",
        "dataParallelSize",
    );
    check(
        "    services: [{name: v, pod: \"{host}:8000\"}]\n",
        "services[0].pod",
    );
    check("    nameservers: [kube-dns]\n", "nameservers[0]");
    check("    nameservers: [\"10.96.0.10\", \"[fd00::a]:53\"]\n", "");
    check("    refreshInterval: 10ms\n", "refreshInterval");
    let e = Config::from_yaml(
        "kvEventsConfig:\n  discovery:\n    services: [{name: v, port: 1}]\n",
        "f",
    )
    .expect_err("typo");
    assert!(e.to_string().contains("port"), "{e}");
}

#[test]
fn env_overrides_win_and_secrets_are_redacted() {
    let mut c = Config::from_yaml(
        "indexerConfig:\n  tokenProcessorConfig: {hashSeed: \"1\"}\n  tokenizersPoolConfig: {huggingFaceToken: file}\n",
        "f",
    )
    .expect("parses");
    c.apply_env(|k| match k {
        "HF_TOKEN" => Some("hf_secret".into()),
        "PYTHONHASHSEED" => Some("42".into()),
        _ => None,
    });
    assert_eq!(
        c.indexer_config.token_processor_config.hash_seed.as_deref(),
        Some("42")
    );
    let printed = c.redacted().to_yaml();
    assert!(!printed.contains("hf_secret"), "{printed}");
    assert!(printed.contains("<redacted>"));
}

#[test]
fn the_redis_url_comes_from_the_environment_and_its_password_is_never_printed() {
    let mut c = Config::from_yaml(
        "replication: {enabled: true, redisUrl: \"redis://file-host:6379\", snapshotInterval: 500ms}\n",
        "f",
    )
    .expect("parses");
    c.apply_env(|k| {
        (k == "KVINDEXER_REDIS_URL").then(|| "rediss://kv:s3cr3t-pw@redis.prod:6380/2".into())
    });
    c.validate().expect("valid");
    assert_eq!(c.replication.snapshot_interval.0.as_millis(), 500);
    let printed = c.redacted().to_yaml();
    assert!(!printed.contains("s3cr3t-pw"), "{printed}");
    assert!(
        printed.contains("rediss://kv:<redacted>@redis.prod:6380/2"),
        "{printed}"
    );
    assert_eq!(redact_url("redis://h:1"), "redis://h:1");
    assert_eq!(redact_url("redis://:pw@h:1"), "redis://:<redacted>@h:1");
    let mut off = Config::default();
    off.replication.enabled = true;
    let e = off.validate().expect_err("no url");
    assert!(e.to_string().contains("replication.redisUrl"), "{e}");
    let e = Config::from_yaml("replication: {snapshotInterval: 30}\n", "f").expect_err("unit");
    assert!(
        e.to_string().contains("unit") || e.to_string().contains("duration"),
        "{e}"
    );
}

#[test]
fn per_model_settings_inherit_the_defaults() {
    let c = Config::from_yaml(
        "indexerConfig:\n  tokenProcessorConfig: {hashSeed: \"7\", blockSize: 32}\nmodels:\n  m1: {loraAdapters: {sql: /a/sql}}\n  m2: {blockSize: 16, extraKeysFormat: untagged}\n",
        "f",
    )
    .expect("parses");
    c.validate().expect("valid");
    let s = c.indexer_settings();
    assert_eq!(s.models["m1"].token_processor.block_size, 32);
    assert_eq!(
        s.models["m1"].token_processor.hash_seed.as_deref(),
        Some("7")
    );
    assert_eq!(s.models["m1"].lora_paths["sql"], "/a/sql");
    assert_eq!(s.models["m2"].token_processor.block_size, 16);
    assert_eq!(
        s.models["m2"].token_processor.extra_keys_format,
        ExtraKeysFormat::Untagged
    );
}

#[test]
fn a_models_attention_chunk_and_hybrid_flag_are_passed_on_and_checked() {
    let c = Config::from_yaml(
        "models:\n  llama4: {attentionChunkSize: 8192, hybrid: true}\n",
        "f",
    )
    .expect("parses");
    c.validate().expect("valid");
    let s = c.indexer_settings();
    assert_eq!(s.models["llama4"].attention_chunk_size, Some(8192));
    assert!(s.models["llama4"].hybrid && !s.default_model.hybrid);
    assert_eq!(s.default_model.attention_chunk_size, None);
    for bad in ["0", "100"] {
        let c = Config::from_yaml(
            &format!("models:\n  m: {{attentionChunkSize: {bad}}}\n"),
            "f",
        )
        .expect("parses");
        let e = c.validate().expect_err("not a multiple of blockSize 16");
        assert!(e.to_string().contains("models.m.attentionChunkSize"), "{e}");
    }
}

#[test]
fn replication_settings_without_enabled_are_an_error_naming_them() {
    let c = Config::from_yaml(
        "replication: {redisUrl: \"redis://r:6379\", keyPrefix: shared}\n",
        "f",
    )
    .expect("parses");
    let e = c
        .validate()
        .expect_err("three replicas would keep three partial views");
    let text = e.to_string();
    assert!(text.contains("replication.enabled"), "{text}");
    assert!(
        text.contains("replication.redisUrl, replication.keyPrefix"),
        "{text}"
    );
    // The same through the environment (a Secret mounted without enabling replication).
    let mut c = Config::default();
    c.apply_env(|k| (k == "KVINDEXER_REDIS_URL").then(|| "redis://r:6379".to_owned()));
    assert!(c.validate().is_err());
    let mut on = c.clone();
    on.replication.enabled = true;
    on.validate().expect("with enabled: true it is replication");
}

#[test]
fn settings_that_do_nothing_are_warned_about_by_field() {
    assert!(Config::default().warnings().is_empty());
    let cases: &[(&str, &str)] = &[
        (
            "kvEventsConfig: {queueDepth: 1024}",
            "kvEventsConfig.queueDepth",
        ),
        (
            "kvEventsConfig: {zmqEndpoint: \"\", replayEndpointTemplate: \"tcp://{ip}:5558\"}",
            "kvEventsConfig.replayEndpointTemplate",
        ),
        (
            "kvEventsConfig: {discovery: {nameservers: [\"10.0.0.10\"]}}",
            "kvEventsConfig.discovery.nameservers",
        ),
        (
            "server: {adminToken: \"0123456789abcdef\"}",
            "server.adminToken",
        ),
        ("scoring: {speculativeTtl: 5s}", "scoring.speculativeTtl"),
        (
            "indexerConfig: {kvBlockIndexConfig: {enableMetrics: false}}",
            "indexerConfig.kvBlockIndexConfig.enableMetrics",
        ),
        (
            "indexerConfig: {tokenizersPoolConfig: {offline: true, huggingFaceToken: hf_x}}",
            "indexerConfig.tokenizersPoolConfig.huggingFaceToken",
        ),
        (
            "kvEventsConfig: {allowedModels: [a]}\nmodels: {b: {}}",
            "models.b",
        ),
    ];
    for (yaml, field) in cases {
        let c = Config::from_yaml(yaml, "f").unwrap_or_else(|e| panic!("{yaml}: {e}"));
        c.validate().unwrap_or_else(|e| panic!("{yaml}: {e}"));
        let warnings = c.warnings();
        assert!(
            warnings.iter().any(|w| w.field == *field),
            "{yaml}: {warnings:?}"
        );
        assert!(
            !warnings.iter().any(|w| w.message.contains("hf_x")),
            "a secret is never in a warning"
        );
    }
}
