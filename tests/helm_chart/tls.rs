//! The chart's TLS (`tls.existingSecret`, `tls.mutual`): the Secret mounted read-only, the
//! daemon's `server.tls` pointing at its files (gRPC and the endpoint picker both serve it), and
//! the picker's Service port no longer claiming cleartext HTTP/2.

use super::*;

/// The Deployment's pod: (volume names, the container's mounts as (name, path, read-only)).
fn mounts(
    by_kind: &HashMap<String, serde_json::Value>,
) -> (Vec<String>, Vec<(String, String, bool)>) {
    let d: Deployment = serde_json::from_value(by_kind["Deployment"].clone()).expect("typed");
    let pod = d.spec.expect("spec").template.spec.expect("pod");
    let volumes = pod
        .volumes
        .iter()
        .flatten()
        .map(|v| v.name.clone())
        .collect();
    let mounts = pod.containers[0]
        .volume_mounts
        .iter()
        .flatten()
        .map(|m| {
            (
                m.name.clone(),
                m.mount_path.clone(),
                m.read_only == Some(true),
            )
        })
        .collect();
    (volumes, mounts)
}

fn picker_port(by_kind: &HashMap<String, serde_json::Value>) -> serde_json::Value {
    by_kind["Service"]["spec"]["ports"]
        .as_array()
        .expect("ports")
        .iter()
        .find(|p| p["name"] == "grpc-ext-proc")
        .cloned()
        .expect("the picker's port")
}

#[test]
fn tls_mounts_the_secret_and_points_the_daemon_at_it() {
    // By default no Secret is mounted and gRPC is plaintext; the picker serves TLS with a
    // certificate of its own (as GIE's EPP, which the gateways dial with TLS), so not h2c.
    let by_kind = check_types(&render(json!({"endpointPicker": {"enabled": true}})));
    let (volumes, _) = mounts(&by_kind);
    assert!(!volumes.iter().any(|v| v == "tls"), "{volumes:?}");
    let config = embedded_config(&by_kind);
    assert!(!config.server.tls.enabled());
    assert_eq!(
        config.endpoint_picker.tls.mode,
        kv_indexer::config::PickerTlsMode::SelfSigned
    );
    assert!(picker_port(&by_kind).get("appProtocol").is_none());

    let by_kind = check_types(&render(json!({
        "endpointPicker": {"enabled": true},
        "tls": {"existingSecret": "kv-indexer-tls"},
    })));
    let d = by_kind["Deployment"].to_string();
    assert!(d.contains("\"secretName\":\"kv-indexer-tls\""), "{d}");
    let (volumes, mounts) = mounts(&by_kind);
    assert!(volumes.iter().any(|v| v == "tls"), "{volumes:?}");
    assert!(
        mounts.contains(&("tls".into(), "/etc/kv-indexer-tls".into(), true)),
        "{mounts:?}"
    );
    let tls = embedded_config(&by_kind).server.tls;
    assert_eq!(
        (
            tls.cert_file.as_str(),
            tls.key_file.as_str(),
            tls.client_ca_file.as_str()
        ),
        (
            "/etc/kv-indexer-tls/tls.crt",
            "/etc/kv-indexer-tls/tls.key",
            ""
        )
    );
    let port = picker_port(&by_kind);
    assert!(port.get("appProtocol").is_none(), "TLS is not h2c: {port}");

    // Mutual TLS: clients need a certificate from the Secret's CA.
    let by_kind = check_types(&render(json!({
        "tls": {"existingSecret": "kv-indexer-tls", "mutual": true},
    })));
    let tls = embedded_config(&by_kind).server.tls;
    assert_eq!(tls.client_ca_file, "/etc/kv-indexer-tls/ca.crt");
}
