//! The Helm chart (`deploy/helm/kv-indexer`), rendered by this test's own Go-template renderer
//! (`helm_chart/render.rs`: gtmpl plus the Helm functions the chart uses), since no helm binary
//! is available here. Every rendered manifest must deserialize into the Kubernetes API types
//! (`k8s-openapi`; the Prometheus Operator's kinds are checked field by field), and the
//! configuration the chart writes must be one kv-indexer accepts, for the default values and
//! each mode. The example manifests of `deploy/examples` are checked too: the vLLM ones for
//! kv-indexer's settings, the InferencePool one against the Gateway API Inference Extension's
//! CRD (vendored in `tests/fixtures/gie`, checked by `helm_chart/openapi.rs`) and against the
//! Service the chart renders with the endpoint picker on.

use std::collections::HashMap;
use std::path::PathBuf;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Secret, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kv_indexer::config::Config;
use serde::Deserialize;
use serde_json::json;

#[path = "helm_chart/openapi.rs"]
mod openapi;
#[path = "helm_chart/render.rs"]
mod render;
#[path = "helm_chart/tls.rs"]
mod tls;
use render::{chart_dir, render};

/// Deserializes each manifest into its Kubernetes type; returns them by kind.
fn check_types(docs: &[(String, serde_json::Value)]) -> HashMap<String, serde_json::Value> {
    let mut by_kind = HashMap::new();
    for (file, doc) in docs {
        let kind = doc["kind"]
            .as_str()
            .unwrap_or_else(|| panic!("{file}: no kind"))
            .to_owned();
        let ok = match kind.as_str() {
            "Deployment" => serde_json::from_value::<Deployment>(doc.clone()).map(|_| ()),
            "Service" => serde_json::from_value::<Service>(doc.clone()).map(|_| ()),
            "ConfigMap" => serde_json::from_value::<ConfigMap>(doc.clone()).map(|_| ()),
            "Secret" => serde_json::from_value::<Secret>(doc.clone()).map(|_| ()),
            "ServiceAccount" => serde_json::from_value::<ServiceAccount>(doc.clone()).map(|_| ()),
            "Role" => serde_json::from_value::<Role>(doc.clone()).map(|_| ()),
            "RoleBinding" => serde_json::from_value::<RoleBinding>(doc.clone()).map(|_| ()),
            "NetworkPolicy" => serde_json::from_value::<NetworkPolicy>(doc.clone()).map(|_| ()),
            "PodDisruptionBudget" => {
                serde_json::from_value::<PodDisruptionBudget>(doc.clone()).map(|_| ())
            }
            "ServiceMonitor" => {
                assert_eq!(doc["apiVersion"], "monitoring.coreos.com/v1", "{file}");
                assert_eq!(doc["spec"]["endpoints"][0]["path"], "/metrics", "{file}");
                Ok(())
            }
            "PrometheusRule" => {
                assert_eq!(doc["apiVersion"], "monitoring.coreos.com/v1", "{file}");
                let groups = doc["spec"]["groups"].as_array().expect("spec.groups");
                let rules = groups
                    .iter()
                    .flat_map(|g| g["rules"].as_array().expect("rules"));
                for r in rules {
                    let ok = r["alert"].is_string() && r["expr"].is_string();
                    assert!(ok && r["labels"]["severity"].is_string(), "{file}: {r}");
                }
                Ok(())
            }
            other => panic!("{file}: unexpected kind {other}"),
        };
        ok.unwrap_or_else(|e| panic!("{file} ({kind}) does not deserialize: {e}\n{doc:#}"));
        // The first of a kind: the configuration's ConfigMap comes before the dashboard's. The
        // events Service is a kind of its own here ("Service/events"), beside the main one.
        let events = doc["metadata"]["name"]
            .as_str()
            .is_some_and(|n| n.ends_with("-events"));
        let key = match events {
            true => format!("{kind}/events"),
            false => kind,
        };
        by_kind.entry(key).or_insert_with(|| doc.clone());
    }
    by_kind
}

fn embedded_config(by_kind: &HashMap<String, serde_json::Value>) -> Config {
    let text = by_kind["ConfigMap"]["data"]["kv-indexer.yaml"]
        .as_str()
        .expect("config text");
    let mut c = Config::from_yaml(text, "ConfigMap").unwrap_or_else(|e| panic!("{e}\n{text}"));
    // The environment the Deployment gives the container (a Secret's value stands in).
    let env = by_kind
        .get("Deployment")
        .map(|d| d.to_string())
        .unwrap_or_default();
    c.apply_env(|k| match k {
        "KVINDEXER_ADMIN_TOKEN" if env.contains(k) => Some("x".repeat(32)),
        "KVINDEXER_REDIS_URL" if env.contains(k) => Some("redis://:pw@redis:6379".into()),
        _ => None,
    });
    c.validate().unwrap_or_else(|e| panic!("{e}\n{text}"));
    c
}

#[test]
fn default_values_render_a_secure_standalone_deployment() {
    let by_kind = check_types(&render(json!({})));
    let mut kinds: Vec<_> = by_kind.keys().cloned().collect();
    kinds.sort();
    assert_eq!(
        kinds,
        [
            "ConfigMap",
            "Deployment",
            "NetworkPolicy",
            "Service",
            "Service/events"
        ]
    );
    // Closed by default: only the vLLM pods reach ZMQ, only the EPP reaches gRPC.
    let np: NetworkPolicy =
        serde_json::from_value(by_kind["NetworkPolicy"].clone()).expect("typed");
    let rules = np.spec.expect("spec").ingress.expect("ingress rules");
    let rule_for = |port: i32| {
        rules
            .iter()
            .find(|r| {
                r.ports.iter().flatten().any(|p| {
                    p.port
                        == Some(
                            k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(port),
                        )
                })
            })
            .unwrap_or_else(|| panic!("a rule for port {port}"))
    };
    let peer_label = |port: i32| {
        rule_for(port).from.as_ref().expect("from")[0]
            .pod_selector
            .as_ref()
            .and_then(|s| s.match_labels.as_ref())
            .and_then(|l| l.get("app.kubernetes.io/name").cloned())
    };
    assert_eq!(peer_label(5557).as_deref(), Some("vllm"));
    assert_eq!(peer_label(50051).as_deref(), Some("epp"));
    let d: Deployment = serde_json::from_value(by_kind["Deployment"].clone()).expect("typed");
    let pod = d.spec.expect("spec").template.spec.expect("pod spec");
    let c = &pod.containers[0];
    let sc = c
        .security_context
        .as_ref()
        .expect("container security context");
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(
        pod.security_context
            .as_ref()
            .and_then(|s| s.run_as_non_root),
        Some(true)
    );
    let ready = c
        .readiness_probe
        .as_ref()
        .and_then(|p| p.http_get.as_ref())
        .expect("readiness");
    assert_eq!(ready.path.as_deref(), Some("/readyz"));
    let live = c
        .liveness_probe
        .as_ref()
        .and_then(|p| p.http_get.as_ref())
        .expect("liveness");
    assert_eq!(live.path.as_deref(), Some("/healthz"));
    let ports: Vec<i32> = c.ports.iter().flatten().map(|p| p.container_port).collect();
    assert_eq!(ports, [50051, 9090, 5557]);
    let svc: Service = serde_json::from_value(by_kind["Service"].clone()).expect("typed");
    let svc_ports: Vec<i32> = svc
        .spec
        .expect("spec")
        .ports
        .into_iter()
        .flatten()
        .map(|p| p.port)
        .collect();
    assert_eq!(
        svc_ports,
        [50051, 9090],
        "the event port has a Service of its own"
    );
    let config = embedded_config(&by_kind);
    assert_eq!(config.kv_events_config.zmq_endpoint, "tcp://*:5557");
    assert_eq!(
        config
            .indexer_config
            .token_processor_config
            .hash_seed
            .as_deref(),
        Some("12345")
    );
    assert_eq!(config.server.grpc_addr, "0.0.0.0:50051");
    assert!(
        !config.server.enable_admin_rpcs,
        "admin RPCs are off by default"
    );
}

/// The events Service (`<release>-kv-indexer-events`) of a rendering, its ports and whether it
/// lists pods that are not Ready.
fn events_service(by_kind: &HashMap<String, serde_json::Value>) -> Option<(Vec<i32>, bool)> {
    let svc: Service = serde_json::from_value(by_kind.get("Service/events")?.clone()).ok()?;
    let spec = svc.spec.expect("spec");
    let ports = spec.ports.iter().flatten().map(|p| p.port).collect();
    Some((ports, spec.publish_not_ready_addresses == Some(true)))
}

#[test]
fn the_event_port_stays_reachable_while_no_replica_is_ready() {
    // Readiness (/readyz) gates gRPC and the picker; publishers reach the event port through a
    // Service that lists every replica, Ready or not, in bind mode, standalone or sidecar.
    for values in [json!({}), json!({"mode": "sidecar"})] {
        let by_kind = check_types(&render(values.clone()));
        let (ports, not_ready_too) = events_service(&by_kind).expect("an events Service");
        assert_eq!(ports, [5557], "{values}");
        assert!(not_ready_too, "publishNotReadyAddresses: {values}");
        let main = &by_kind["Service"]["spec"];
        assert_eq!(
            by_kind["Service/events"]["spec"]["selector"], main["selector"],
            "the same pods: {values}"
        );
        assert!(!main["ports"].to_string().contains("5557"), "{values}");
    }
    let d: Deployment =
        serde_json::from_value(check_types(&render(json!({})))["Deployment"].clone())
            .expect("typed");
    let labels = d
        .spec
        .expect("spec")
        .template
        .metadata
        .expect("meta")
        .labels;
    let by_kind = check_types(&render(json!({})));
    for (k, v) in by_kind["Service/events"]["spec"]["selector"]
        .as_object()
        .expect("selector")
    {
        assert_eq!(
            labels.as_ref().and_then(|l| l.get(k)).map(String::as_str),
            v.as_str()
        );
    }
    // The vLLM example publishes to it.
    let vllm = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("deploy/examples/vllm-deployment.yaml"),
    )
    .expect("example");
    assert!(vllm.contains("tcp://kvi-kv-indexer-events.inference.svc:5557"));
    // Negative control: connect mode binds no event port, so has no events Service.
    let connect = check_types(&render(json!({"events": {"mode": "connect",
        "endpoints": [{"endpoint": "tcp://10.0.0.7:5557"}]}})));
    assert_eq!(events_service(&connect), None);
}

#[test]
fn admin_rpcs_take_their_token_from_a_secret_and_refuse_to_render_without_one() {
    let by_kind = check_types(&render(json!({
        "adminRpcs": {"enabled": true, "existingSecret": "kvi-admin"},
    })));
    let config = embedded_config(&by_kind);
    assert!(config.server.enable_admin_rpcs);
    let d: Deployment = serde_json::from_value(by_kind["Deployment"].clone()).expect("typed");
    let env = d.spec.expect("spec").template.spec.expect("pod").containers[0]
        .env
        .clone()
        .unwrap_or_default();
    let token = env
        .iter()
        .find(|e| e.name == "KVINDEXER_ADMIN_TOKEN")
        .expect("the token comes from the environment");
    let secret = token
        .value_from
        .as_ref()
        .and_then(|v| v.secret_key_ref.as_ref())
        .expect("from a Secret");
    assert_eq!(
        (secret.name.as_str(), secret.key.as_str()),
        ("kvi-admin", "ADMIN_TOKEN")
    );
    assert!(token.value.is_none(), "never inline");
    let refused = std::panic::catch_unwind(|| render(json!({"adminRpcs": {"enabled": true}})));
    assert!(refused.is_err(), "enabled without a Secret must not render");
}

#[test]
fn token_secret_service_monitor_and_pdb() {
    let by_kind = check_types(&render(json!({
        "hfToken": {"value": "hf_abc"},
        "serviceMonitor": {"enabled": true, "labels": {"release": "prom"}},
        "podDisruptionBudget": {"enabled": true},
    })));
    for kind in ["Secret", "ServiceMonitor", "PodDisruptionBudget"] {
        assert!(by_kind.contains_key(kind), "{kind} rendered");
    }
    assert_eq!(
        by_kind["ServiceMonitor"]["metadata"]["labels"]["release"],
        "prom"
    );
    let d = &by_kind["Deployment"]["spec"]["template"]["spec"]["containers"][0]["env"];
    assert_eq!(
        d[1]["valueFrom"]["secretKeyRef"]["name"],
        "kvi-kv-indexer-hf"
    );
    // An existing Secret instead: none created, the container points at it.
    let by_kind = check_types(&render(json!({"hfToken": {"existingSecret": "hf"}})));
    assert!(!by_kind.contains_key("Secret"));
    let d = &by_kind["Deployment"]["spec"]["template"]["spec"]["containers"][0]["env"];
    assert_eq!(d[1]["valueFrom"]["secretKeyRef"]["name"], "hf");
}

#[test]
fn sidecar_mode_renders_no_deployment_and_selects_the_epp() {
    let by_kind = check_types(&render(json!({
        "mode": "sidecar",
        "sidecar": {"eppSelector": {"app.kubernetes.io/name": "my-epp"}},
    })));
    assert!(!by_kind.contains_key("Deployment"));
    assert_eq!(
        by_kind["Service"]["spec"]["selector"]["app.kubernetes.io/name"],
        "my-epp"
    );
    embedded_config(&by_kind);
}

#[test]
fn connect_mode_dials_every_pod_of_a_statefulset_and_a_static_list() {
    let by_kind = check_types(&render(json!({
        "replicaCount": 2,
        "events": {
            "mode": "connect",
            "endpoints": [{"endpoint": "tcp://10.0.0.7:5557", "replayEndpoint": "tcp://10.0.0.7:5558"}],
            "statefulSet": {"name": "vllm", "service": "vllm-headless", "replicas": 3},
        },
    })));
    let config = embedded_config(&by_kind);
    assert_eq!(config.kv_events_config.zmq_endpoint, "");
    let eps: Vec<&str> = config
        .kv_events_config
        .endpoints
        .iter()
        .map(|e| e.endpoint.as_str())
        .collect();
    assert_eq!(
        eps,
        [
            "tcp://10.0.0.7:5557",
            "tcp://vllm-0.vllm-headless:5557",
            "tcp://vllm-1.vllm-headless:5557",
            "tcp://vllm-2.vllm-headless:5557",
        ]
    );
    assert_eq!(
        config.kv_events_config.endpoints[2].replay_endpoint,
        "tcp://vllm-1.vllm-headless:5558"
    );
    let ports = by_kind["Service"]["spec"]["ports"]
        .as_array()
        .expect("ports")
        .len();
    assert_eq!(ports, 2, "no ZMQ port on the Service in connect mode");
    assert_eq!(by_kind["Deployment"]["spec"]["replicas"], 2);
}

#[test]
fn connect_mode_discovers_a_deployment_by_its_headless_service() {
    let by_kind = check_types(&render(json!({
        "replicaCount": 3,
        "events": {
            "mode": "connect",
            "discovery": {
                "service": "vllm-headless.llm.svc.cluster.local",
                "dataParallelSize": 2,
                "pod": "{ip}:8000",
            },
        },
    })));
    let config = embedded_config(&by_kind);
    let events = &config.kv_events_config;
    assert_eq!(events.zmq_endpoint, "");
    assert!(events.endpoints.is_empty(), "{:?}", events.endpoints);
    assert_eq!(events.discovery.refresh_interval.to_string(), "5s");
    let [service] = events.discovery.services.as_slice() else {
        panic!("one discovered service: {:?}", events.discovery.services);
    };
    assert_eq!(service.name, "vllm-headless.llm.svc.cluster.local");
    assert_eq!(
        (
            service.publisher_port,
            service.replay_port,
            service.data_parallel_size
        ),
        (5557, 5558, 2)
    );
    assert_eq!(service.pod, "{ip}:8000");
    assert_eq!(service.model, "", "the model from the topic");
    config.validate().expect("the rendered config is valid");
    assert_eq!(by_kind["Deployment"]["spec"]["replicas"], 3);
}

/// The vLLM examples of `deploy/examples`, checked below; `examples/inferencepool.yaml` is
/// checked by the endpoint picker's tests, `examples/envoy.yaml` run by a real Envoy in
/// `tests/gateway_envoy.rs`. A new example must be added to one of them.
const VLLM_EXAMPLES: [&str; 3] = [
    "examples/vllm-deployment.yaml",
    "examples/vllm-statefulset-connect.yaml",
    "examples/vllm-deployment-connect.yaml",
];
const INFERENCEPOOL_EXAMPLE: &str = "examples/inferencepool.yaml";
const ENVOY_EXAMPLE: &str = "examples/envoy.yaml";

/// The documents of a (multi-document) YAML file under `deploy/`.
fn deploy_docs(file: &str) -> Vec<serde_json::Value> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("deploy")
        .join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{file}: {e}"));
    serde_yaml::Deserializer::from_str(&text)
        .map(|doc| {
            let v = serde_yaml::Value::deserialize(doc).unwrap_or_else(|e| panic!("{file}: {e}"));
            serde_json::to_value(v).expect("json")
        })
        .filter(|v| !v.is_null())
        .collect()
}

#[test]
fn every_example_manifest_is_checked() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("deploy/examples");
    let mut found: Vec<String> = std::fs::read_dir(dir)
        .expect("deploy/examples")
        .flatten()
        .map(|e| format!("examples/{}", e.file_name().to_string_lossy()))
        .collect();
    found.sort();
    let mut checked: Vec<String> = VLLM_EXAMPLES
        .iter()
        .chain([&INFERENCEPOOL_EXAMPLE, &ENVOY_EXAMPLE])
        .map(|f| f.to_string())
        .collect();
    checked.sort();
    assert_eq!(found, checked);
}

#[test]
fn the_sidecar_patch_and_vllm_examples_are_valid_and_configured_for_kv_indexer() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("deploy");
    let patch: serde_json::Value = serde_yaml::from_str(
        &std::fs::read_to_string(root.join("sidecar/epp-patch.yaml")).expect("patch"),
    )
    .expect("yaml");
    let d: Deployment = serde_json::from_value(patch).expect("the patch is a Deployment");
    let c = &d.spec.expect("spec").template.spec.expect("pod").containers[0];
    assert_eq!(c.name, "kv-indexer");
    for file in VLLM_EXAMPLES {
        for v in deploy_docs(file) {
            match v["kind"].as_str() {
                Some("Deployment") | Some("StatefulSet") => {
                    let args = v["spec"]["template"]["spec"]["containers"][0]["args"].to_string();
                    for flag in [
                        "--enable-prefix-caching",
                        "--prefix-caching-hash-algo=sha256_cbor",
                        "--block-size=16",
                        "enable_kv_cache_events",
                        "replay_endpoint",
                        "kv@$(POD_IP):$(POD_PORT)@",
                    ] {
                        assert!(args.contains(flag), "{file}: {flag} missing from {args}");
                    }
                    let env = v["spec"]["template"]["spec"]["containers"][0]["env"].to_string();
                    assert!(env.contains("PYTHONHASHSEED"), "{file}");
                    if v["kind"] == "Deployment" {
                        serde_json::from_value::<Deployment>(v.clone()).expect("Deployment");
                    } else {
                        serde_json::from_value::<k8s_openapi::api::apps::v1::StatefulSet>(
                            v.clone(),
                        )
                        .expect("StatefulSet");
                    }
                }
                Some("Service") => {
                    serde_json::from_value::<Service>(v.clone()).expect("Service");
                }
                other => panic!("{file}: unexpected {other:?}"),
            }
        }
    }
}

/// The panic message of a render that must be refused.
fn refusal(overrides: serde_json::Value) -> String {
    let refused = std::panic::catch_unwind(|| render(overrides));
    let Err(payload) = refused else {
        panic!("rendered, but must be refused");
    };
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

#[test]
fn several_replicas_in_bind_mode_need_replication_and_get_redis_a_pdb_and_spreading() {
    let why = refusal(json!({"replicaCount": 3}));
    assert!(why.contains("needs replication.enabled"), "{why}");
    let why = refusal(json!({"mode": "sidecar", "sidecar": {"eppReplicas": 2}}));
    assert!(why.contains("needs replication.enabled"), "{why}");
    let why = refusal(json!({"replicaCount": 3, "replication": {"enabled": true}}));
    assert!(why.contains("REDIS_URL"), "{why}");

    let by_kind = check_types(&render(json!({
        "replicaCount": 3,
        "replication": {"enabled": true, "existingSecret": "redis-auth"},
    })));
    let spec = &by_kind["Deployment"]["spec"]["template"]["spec"];
    let env = &spec["containers"][0]["env"];
    let redis = env
        .as_array()
        .expect("env")
        .iter()
        .find(|e| e["name"] == "KVINDEXER_REDIS_URL")
        .expect("the Redis URL comes from the Secret");
    assert_eq!(redis["valueFrom"]["secretKeyRef"]["name"], "redis-auth");
    assert_eq!(redis["valueFrom"]["secretKeyRef"]["key"], "REDIS_URL");
    let keys: Vec<&str> = spec["topologySpreadConstraints"]
        .as_array()
        .expect("spread")
        .iter()
        .filter_map(|c| c["topologyKey"].as_str())
        .collect();
    assert_eq!(
        keys,
        ["topology.kubernetes.io/zone", "kubernetes.io/hostname"]
    );
    assert_eq!(by_kind["PodDisruptionBudget"]["spec"]["minAvailable"], 1);
    let c = embedded_config(&by_kind);
    assert!(c.replication.enabled);
    assert_eq!(c.replication.key_prefix, "kvi-kv-indexer");
    assert_eq!(c.replication.redis_url, "redis://:pw@redis:6379");
    let text = by_kind["ConfigMap"]["data"]["kv-indexer.yaml"].to_string();
    assert!(
        !text.contains("redisUrl"),
        "the URL stays in the Secret: {text}"
    );

    // A URL without a password may be a plain value; connect mode may run several replicas
    // without replication (every replica dials every pod).
    let by_kind = check_types(&render(json!({
        "replicaCount": 2,
        "replication": {"enabled": true, "redisUrl": "redis://redis:6379"},
    })));
    assert_eq!(
        embedded_config(&by_kind).replication.redis_url,
        "redis://redis:6379"
    );
    let by_kind = check_types(&render(json!({
        "replicaCount": 2,
        "events": {"mode": "connect", "endpoints": [{"endpoint": "tcp://10.0.0.7:5557"}]},
    })));
    assert!(!embedded_config(&by_kind).replication.enabled);
}

#[test]
fn alerts_and_the_dashboard_render_from_deploy_monitoring_when_enabled() {
    let monitoring = chart_dir().join("../../monitoring");
    let defaults = check_types(&render(json!({})));
    assert!(!defaults.contains_key("PrometheusRule"), "off by default");
    let docs = render(json!({
        "serviceMonitor": {"enabled": true},
        "prometheusRule": {
            "enabled": true,
            "labels": {"release": "prom"},
            "runbookBaseUrl": "https://example.com/kv-indexer/",
        },
        "grafanaDashboard": {
            "enabled": true,
            "namespace": "monitoring",
            "annotations": {"grafana_folder": "kv-indexer"},
        },
    }));
    let by_kind = check_types(&docs);
    embedded_config(&by_kind);
    let endpoint = &by_kind["ServiceMonitor"]["spec"]["endpoints"][0];
    assert_eq!(endpoint["honorLabels"], true, "the vLLM pod stays `pod`");

    // The rules file's groups, runbook links made absolute.
    let rule = &by_kind["PrometheusRule"];
    assert_eq!(rule["metadata"]["labels"]["release"], "prom");
    let text = std::fs::read_to_string(monitoring.join("kv-indexer-rules.yaml")).expect("rules");
    let file: serde_json::Value = serde_yaml::from_str(&text).expect("YAML");
    let relative = file["groups"].to_string();
    let absolute = relative.replace(
        "\"docs/operations.md#",
        "\"https://example.com/kv-indexer/docs/operations.md#",
    );
    assert_ne!(relative, absolute);
    let expected: serde_json::Value = serde_json::from_str(&absolute).expect("JSON");
    assert_eq!(rule["spec"]["groups"], expected);

    // The dashboard, byte for byte, in a ConfigMap labelled for Grafana's sidecar.
    let (_, board) = docs
        .iter()
        .find(|(file, _)| file == "grafana-dashboard.yaml")
        .expect("the dashboard's ConfigMap");
    serde_json::from_value::<ConfigMap>(board.clone()).expect("a ConfigMap");
    let meta = &board["metadata"];
    assert_eq!(meta["labels"]["grafana_dashboard"], "1");
    assert_eq!(meta["namespace"], "monitoring");
    assert_eq!(meta["annotations"]["grafana_folder"], "kv-indexer");
    let json = std::fs::read_to_string(monitoring.join("kv-indexer-dashboard.json")).expect("json");
    assert_eq!(board["data"]["kv-indexer.json"], json.trim_end());
}

/// The `endpointPicker` section of the configuration the chart writes, if any.
fn picker_section(by_kind: &HashMap<String, serde_json::Value>) -> Option<serde_json::Value> {
    let text = by_kind["ConfigMap"]["data"]["kv-indexer.yaml"]
        .as_str()
        .expect("config text");
    let config: serde_json::Value = serde_yaml::from_str(text).expect("YAML");
    config.get("endpointPicker").cloned()
}

/// The `from` peers of the NetworkPolicy's rule for `port`, if it has one.
fn peers_of(by_kind: &HashMap<String, serde_json::Value>, port: u16) -> Option<serde_json::Value> {
    let rules = by_kind["NetworkPolicy"]["spec"]["ingress"].as_array()?;
    let rule = rules.iter().find(|r| {
        let mut ports = r["ports"].as_array().into_iter().flatten();
        ports.any(|p| p["port"] == port)
    })?;
    Some(rule["from"].clone())
}

#[test]
fn the_endpoint_picker_port_and_configuration_appear_only_when_enabled() {
    // By default nothing of it: no port, no peers, no configuration.
    let docs = render(json!({}));
    let text = serde_json::to_string(&docs).expect("json");
    for word in [
        "endpointPicker",
        "grpc-ext-proc",
        "9002",
        "h2c",
        "gateway-name",
    ] {
        assert!(!text.contains(word), "{word} rendered by default");
    }
    let by_kind = check_types(&docs);
    assert_eq!(picker_section(&by_kind), None);
    assert_eq!(peers_of(&by_kind, 9002), None, "closed by default");
    assert!(!embedded_config(&by_kind).endpoint_picker.enabled);

    let by_kind = check_types(&render(json!({"endpointPicker": {"enabled": true}})));
    assert_eq!(
        picker_section(&by_kind),
        Some(json!({
            "enabled": true,
            "addr": "0.0.0.0:9002",
            "metricsUrlTemplate": "http://{pod}/metrics",
            "metricsInterval": "50ms",
            "metricsMaxScrapesPerSecond": 2000,
            "weights": {"prefix": 3, "queue": 2, "kvCacheUtilization": 2},
            "metricsStaleAfter": "500ms",
            "maxBodyBytes": 10485760,
            "maxBufferedBodyBytes": 536870912,
            "maxInFlight": 1024,
            "maxStreams": 16384,
            "fallbacks": 0,
            "scrapeFailuresToLeave": 3,
            "health": {"maxEjectionPercent": 50, "panicThresholdPercent": 50},
            "pd": {"threshold": 0, "minPromptTokens": 0},
            "tls": {"mode": "selfSigned"},
        }))
    );
    let d: Deployment = serde_json::from_value(by_kind["Deployment"].clone()).expect("typed");
    let c = &d.spec.expect("spec").template.spec.expect("pod").containers[0];
    let ports: Vec<(Option<&str>, i32)> = c
        .ports
        .iter()
        .flatten()
        .map(|p| (p.name.as_deref(), p.container_port))
        .collect();
    assert_eq!(ports.last(), Some(&(Some("grpc-ext-proc"), 9002)));
    // The daemon's HTTP health stays the probes' (the metrics port).
    let ready = c.readiness_probe.as_ref().and_then(|p| p.http_get.as_ref());
    assert_eq!(ready.and_then(|h| h.path.as_deref()), Some("/readyz"));
    let svc: Service = serde_json::from_value(by_kind["Service"].clone()).expect("typed");
    let ports = svc.spec.expect("spec").ports.unwrap_or_default();
    let ext_proc = ports
        .iter()
        .find(|p| p.name.as_deref() == Some("grpc-ext-proc"))
        .expect("the Service's ext_proc port");
    assert_eq!(ext_proc.port, 9002);
    // TLS by default (a self-signed certificate, as GIE's EPP): HTTP/2 by ALPN, no h2c.
    assert_eq!(ext_proc.app_protocol.as_deref(), None);
    assert_eq!(
        ext_proc.target_port,
        Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(9002))
    );
    // Opened to the gateway's proxies only; the other rules as before.
    let peers = peers_of(&by_kind, 9002).expect("a rule for the picker's port");
    assert_eq!(
        peers,
        json!([{
            "namespaceSelector": {},
            "podSelector": {"matchLabels": {"gateway.networking.k8s.io/gateway-name": "inference-gateway"}},
        }])
    );
    assert_eq!(
        peers_of(&by_kind, 50051).expect("gRPC")[0]["podSelector"]["matchLabels"]
            ["app.kubernetes.io/name"],
        "epp"
    );

    // kv-indexer reads the section as written.
    let picker = embedded_config(&by_kind).endpoint_picker;
    assert!(picker.enabled);
    assert_eq!(picker.addr, "0.0.0.0:9002");
    assert_eq!(picker.metrics_url_template, "http://{pod}/metrics");
    assert_eq!(picker.metrics_interval.to_string(), "50ms");
    let w = &picker.weights;
    assert_eq!(w.0, [3.0, 2.0, 2.0], "prefix, queue, kvCacheUtilization");

    // Its settings follow the values.
    let by_kind = check_types(&render(json!({"endpointPicker": {
        "enabled": true,
        "port": 9102,
        "metricsUrlTemplate": "http://{pod}/custom-metrics",
        "metricsInterval": "200ms",
        "weights": {"prefix": 1, "queue": 0, "kvCacheUtilization": 0},
        "metricsStaleAfter": "2s",
        "maxBodyBytes": 4096,
        "maxInFlight": 8,
        "fallbacks": 2,
        "tls": "plaintext",
        "pd": {"threshold": 16, "minPromptTokens": 64},
    }})));
    assert_eq!(
        picker_section(&by_kind),
        Some(json!({
            "enabled": true,
            "addr": "0.0.0.0:9102",
            "metricsUrlTemplate": "http://{pod}/custom-metrics",
            "metricsInterval": "200ms",
            "metricsMaxScrapesPerSecond": 2000,
            "weights": {"prefix": 1, "queue": 0, "kvCacheUtilization": 0},
            "metricsStaleAfter": "2s",
            "maxBodyBytes": 4096,
            "maxBufferedBodyBytes": 536870912,
            "maxInFlight": 8,
            "maxStreams": 16384,
            "fallbacks": 2,
            "scrapeFailuresToLeave": 3,
            "health": {"maxEjectionPercent": 50, "panicThresholdPercent": 50},
            "pd": {"threshold": 16, "minPromptTokens": 64},
            "tls": {"mode": "plaintext"},
        }))
    );
    let picker = embedded_config(&by_kind).endpoint_picker;
    assert_eq!((picker.max_body_bytes, picker.max_in_flight), (4096, 8));
    assert_eq!(picker.fallbacks, 2);
    assert_eq!(
        picker.tls.mode,
        kv_indexer::config::PickerTlsMode::Plaintext
    );
    let plain = by_kind["Service"]["spec"]["ports"]
        .as_array()
        .and_then(|p| p.iter().find(|p| p["name"] == "grpc-ext-proc").cloned())
        .expect("the picker's port");
    assert_eq!(
        plain["appProtocol"], "kubernetes.io/h2c",
        "plaintext is h2c"
    );
    assert_eq!(picker.metrics_stale_after.to_string(), "2s");
    assert_eq!(picker.addr, "0.0.0.0:9102");
    assert_eq!(picker.weights.get("queue"), Some(0.0));
    assert_eq!(picker.metrics_interval.to_string(), "200ms");
    let ports = by_kind["Service"]["spec"]["ports"].to_string();
    assert!(ports.contains("9102") && !ports.contains("9002"), "{ports}");
    assert!(peers_of(&by_kind, 9102).is_some());

    // The certificate of tls.existingSecret, as gRPC's; without the Secret, refused.
    let by_kind = check_types(&render(json!({
        "tls": {"existingSecret": "kvi-tls"},
        "endpointPicker": {"enabled": true, "tls": "secret"},
    })));
    let picker = embedded_config(&by_kind).endpoint_picker;
    assert_eq!(picker.tls.mode, kv_indexer::config::PickerTlsMode::Inherit);
    for (values, why) in [
        (
            json!({"endpointPicker": {"enabled": true, "tls": "secret"}}),
            "needs tls.existingSecret",
        ),
        (
            json!({"endpointPicker": {"enabled": true, "tls": "on"}}),
            "must be selfSigned, secret or plaintext",
        ),
    ] {
        let refused = refusal(values);
        assert!(refused.contains(why), "{refused}");
    }

    // In sidecar mode the EPP kv-indexer runs in is the picker.
    let why = refusal(json!({"mode": "sidecar", "endpointPicker": {"enabled": true}}));
    assert!(why.contains("needs mode: standalone"), "{why}");
}

#[test]
fn a_pool_gets_namespace_scoped_rbac_and_its_values() {
    // No pool: no identity, no token mounted.
    let docs = render(json!({"endpointPicker": {"enabled": true}}));
    let kinds: Vec<&str> = docs
        .iter()
        .filter_map(|(_, d)| d["kind"].as_str())
        .collect();
    for kind in ["ServiceAccount", "Role", "RoleBinding"] {
        assert!(!kinds.contains(&kind), "{kind} without a pool");
    }
    let by_kind = check_types(&docs);
    let pod = &by_kind["Deployment"]["spec"]["template"]["spec"];
    assert_eq!(pod["automountServiceAccountToken"], false);
    assert!(embedded_config(&by_kind).endpoint_picker.pool.is_none());

    let by_kind = check_types(&render(json!({"endpointPicker": {
        "enabled": true, "pool": {"name": "vllm-pool", "namespace": "llm", "requestTimeout": "3s"},
        "scrapeFailuresToLeave": 5, "health": {"maxEjectionPercent": 30, "panicThresholdPercent": 20},
        "maxBufferedBodyBytes": 268435456, "maxStreams": 4096, "metricsMaxScrapesPerSecond": 500,
    }})));
    let picker = embedded_config(&by_kind).endpoint_picker;
    let pool = picker.pool.expect("the pool");
    assert_eq!(
        (pool.name.as_str(), pool.namespace.as_str()),
        ("vllm-pool", "llm")
    );
    assert_eq!(pool.request_timeout.0, std::time::Duration::from_secs(3));
    assert_eq!(picker.scrape_failures_to_leave, 5);
    assert_eq!(
        (
            picker.health.max_ejection_percent,
            picker.health.panic_threshold_percent
        ),
        (30, 20)
    );
    assert_eq!(
        (
            picker.max_buffered_body_bytes,
            picker.max_streams,
            picker.metrics_max_scrapes_per_second
        ),
        (256 << 20, 4096, 500)
    );
    let role: Role = serde_json::from_value(by_kind["Role"].clone()).expect("typed");
    assert_eq!(
        role.metadata.namespace.as_deref(),
        Some("llm"),
        "the pool's namespace"
    );
    let rules: Vec<(Vec<String>, Vec<String>, Vec<String>)> = role
        .rules
        .unwrap_or_default()
        .into_iter()
        .map(|r| {
            (
                r.api_groups.unwrap_or_default(),
                r.resources.unwrap_or_default(),
                r.verbs,
            )
        })
        .collect();
    let read = vec!["get".to_owned(), "list".into(), "watch".into()];
    assert_eq!(
        rules,
        [
            (
                vec!["inference.networking.k8s.io".to_owned()],
                vec!["inferencepools".to_owned()],
                read.clone()
            ),
            (vec![String::new()], vec!["pods".to_owned()], read),
        ],
        "get, list and watch of the pool and its pods, nothing else"
    );
    let binding: RoleBinding =
        serde_json::from_value(by_kind["RoleBinding"].clone()).expect("typed");
    assert_eq!(binding.metadata.namespace.as_deref(), Some("llm"));
    assert_eq!(binding.role_ref.name, "kvi-kv-indexer-pool");
    let subject = &binding.subjects.expect("a subject")[0];
    assert_eq!(
        (
            subject.kind.as_str(),
            subject.name.as_str(),
            subject.namespace.as_deref()
        ),
        ("ServiceAccount", "kvi-kv-indexer", Some("inference"))
    );
    assert_eq!(
        by_kind["ServiceAccount"]["metadata"]["name"],
        "kvi-kv-indexer"
    );
    let pod = &by_kind["Deployment"]["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], "kvi-kv-indexer");
    assert_eq!(pod["automountServiceAccountToken"], true);

    // The release's namespace by default; a static list instead; not both.
    let by_kind = check_types(&render(json!({"endpointPicker": {
        "enabled": true, "pool": {"name": "vllm-pool"}}})));
    assert_eq!(by_kind["Role"]["metadata"]["namespace"], "inference");
    let pool = embedded_config(&by_kind)
        .endpoint_picker
        .pool
        .expect("the pool");
    assert_eq!(pool.namespace, "inference");
    let by_kind = check_types(&render(json!({"endpointPicker": {
        "enabled": true, "endpoints": ["10.0.0.1:8000", "10.0.0.2:8000"]}})));
    assert_eq!(embedded_config(&by_kind).endpoint_picker.endpoints.len(), 2);
    assert!(!by_kind.contains_key("Role"));
    // Prefill/decode: the split's values, and a static entry's role.
    let by_kind = check_types(&render(json!({"endpointPicker": {
        "enabled": true, "pd": {"threshold": 16, "minPromptTokens": 64},
        "endpoints": ["10.0.0.1:8000", {"address": "10.0.0.2:8000", "role": "prefill"}]}})));
    let picker = embedded_config(&by_kind).endpoint_picker;
    assert_eq!((picker.pd.threshold, picker.pd.min_prompt_tokens), (16, 64));
    assert_eq!(picker.endpoints[1].role(), Some("prefill"));
    let off = embedded_config(&check_types(&render(
        json!({"endpointPicker": {"enabled": true}}),
    )));
    assert_eq!(off.endpoint_picker.pd.threshold, 0, "off by default");
    let why = refusal(json!({"endpointPicker": {
        "enabled": true, "pool": {"name": "p"}, "endpoints": ["10.0.0.1:8000"]}}));
    assert!(why.contains("not both"), "{why}");
}

/// The Gateway API Inference Extension's InferencePool CRD (`tests/fixtures/gie/ORIGIN.md`).
fn inferencepool_crd() -> serde_json::Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/gie/inference.networking.k8s.io_inferencepools.yaml");
    serde_yaml::from_str(&std::fs::read_to_string(path).expect("CRD")).expect("YAML")
}

/// What is wrong with the documents of an InferencePool example: the pool against GIE's CRD, and
/// what it names against what it must name: the chart's Service rendered with the endpoint
/// picker on (release `kvi`) and its ext_proc port, the pods of `vllm-deployment.yaml` and their
/// API port, an HTTPRoute sending `/v1/` to the pool through a Gateway of the file, and that
/// Gateway's proxies among the peers the chart's NetworkPolicy lets reach the picker.
fn inferencepool_problems(docs: &[serde_json::Value]) -> Vec<String> {
    let of_kind = |kind: &str| -> Vec<&serde_json::Value> {
        docs.iter().filter(|d| d["kind"] == kind).collect()
    };
    let [pool] = of_kind("InferencePool")[..] else {
        return vec!["not exactly one InferencePool".into()];
    };
    let mut problems = openapi::validate_against_crd(&inferencepool_crd(), pool);
    let spec = &pool["spec"];

    let chart = check_types(&render(json!({"endpointPicker": {"enabled": true}})));
    let picker = &spec["endpointPickerRef"];
    let service = &chart["Service"];
    if picker["name"] != service["metadata"]["name"] {
        problems.push(format!(
            "endpointPickerRef.name {} is not the chart's Service {}",
            picker["name"], service["metadata"]["name"]
        ));
    }
    let (kind, group) = (picker.get("kind"), picker.get("group"));
    if kind.is_some_and(|k| k != "Service") || group.is_some_and(|g| g != "") {
        problems.push(format!("endpointPickerRef is not a Service: {picker}"));
    }
    let ports = service["spec"]["ports"].as_array().expect("ports");
    let ext_proc = ports
        .iter()
        .find(|p| p["name"] == "grpc-ext-proc")
        .expect("the chart's Service has the picker's port");
    if picker["port"]["number"] != ext_proc["port"] {
        problems.push(format!(
            "endpointPickerRef.port.number {} is not the chart's Service port grpc-ext-proc {}",
            picker["port"]["number"], ext_proc["port"]
        ));
    }
    assert_eq!(
        ext_proc["appProtocol"],
        serde_json::Value::Null,
        "TLS by default"
    );

    let vllm = deploy_docs(VLLM_EXAMPLES[0])
        .into_iter()
        .find(|d| d["kind"] == "Deployment")
        .expect("the vLLM Deployment");
    let labels = &vllm["spec"]["template"]["metadata"]["labels"];
    let selects = spec["selector"]["matchLabels"]
        .as_object()
        .is_some_and(|m| !m.is_empty() && m.iter().all(|(k, v)| labels[k] == *v));
    if !selects {
        problems.push(format!(
            "spec.selector {} does not select the pods of {} ({labels})",
            spec["selector"], VLLM_EXAMPLES[0]
        ));
    }
    let api_port = vllm["spec"]["template"]["spec"]["containers"][0]["ports"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["name"] == "http")
        .map(|p| p["containerPort"].clone())
        .expect("vLLM's API port");
    if spec["targetPorts"] != json!([{"number": api_port}]) {
        problems.push(format!(
            "spec.targetPorts {} is not vLLM's API port {api_port}",
            spec["targetPorts"]
        ));
    }

    let gateways = of_kind("Gateway");
    let gateway_names: Vec<&serde_json::Value> =
        gateways.iter().map(|g| &g["metadata"]["name"]).collect();
    for g in &gateways {
        let ok = g["apiVersion"] == "gateway.networking.k8s.io/v1"
            && g["spec"]["gatewayClassName"]
                .as_str()
                .is_some_and(|c| !c.is_empty())
            && g["spec"]["listeners"]
                .as_array()
                .is_some_and(|l| !l.is_empty());
        if !ok {
            problems.push(format!("an incomplete Gateway: {g}"));
        }
    }
    let list = |v: &serde_json::Value| v.as_array().cloned().unwrap_or_default();
    let routed = of_kind("HTTPRoute").iter().any(|r| {
        let through_gateway = list(&r["spec"]["parentRefs"])
            .iter()
            .any(|p| p["kind"] == "Gateway" && gateway_names.contains(&&p["name"]));
        let to_pool = list(&r["spec"]["rules"]).iter().any(|rule| {
            let v1 = json!({"type": "PathPrefix", "value": "/v1/"});
            list(&rule["matches"]).iter().any(|m| m["path"] == v1)
                && list(&rule["backendRefs"]).iter().any(|b| {
                    b["group"] == "inference.networking.k8s.io"
                        && b["kind"] == "InferencePool"
                        && b["name"] == pool["metadata"]["name"]
                })
        });
        r["apiVersion"] == "gateway.networking.k8s.io/v1" && through_gateway && to_pool
    });
    if !routed {
        problems.push("no HTTPRoute sends /v1/ to the pool through a Gateway of the file".into());
    }
    let label = "gateway.networking.k8s.io/gateway-name";
    let port = ext_proc["port"].as_u64().expect("port") as u16;
    let admitted = list(&peers_of(&chart, port).expect("the picker's rule"))
        .iter()
        .any(|peer| gateway_names.contains(&&peer["podSelector"]["matchLabels"][label]));
    if !admitted {
        problems.push("the chart's NetworkPolicy does not admit the Gateway's proxies".into());
    }
    // Istio's DestinationRule: TLS, unverified, towards the chart's Service (which serves TLS
    // with its own certificate by default) in the namespace the example is applied to.
    let host = format!(
        "{}.inference.svc.cluster.local",
        service["metadata"]["name"].as_str().unwrap_or_default()
    );
    for dr in of_kind("DestinationRule") {
        let tls = &dr["spec"]["trafficPolicy"]["tls"];
        if dr["spec"]["host"] != host.as_str() || tls["mode"] != "SIMPLE" {
            problems.push(format!("the DestinationRule is not TLS to {host}: {dr}"));
        }
    }
    problems
}

#[test]
fn the_inferencepool_example_is_valid_and_names_kv_indexer_as_its_endpoint_picker() {
    let docs = deploy_docs(INFERENCEPOOL_EXAMPLE);
    let kinds: Vec<&str> = docs.iter().filter_map(|d| d["kind"].as_str()).collect();
    assert_eq!(
        kinds,
        ["InferencePool", "Gateway", "HTTPRoute", "DestinationRule"]
    );
    let problems = inferencepool_problems(&docs);
    assert!(problems.is_empty(), "{problems:#?}");
}

/// Negative controls: each edit breaks the example, and the check must say how.
#[test]
fn a_broken_inferencepool_example_fails_the_check() {
    type Edit = fn(&mut serde_json::Value);
    fn pool(docs: &mut [serde_json::Value]) -> &mut serde_json::Value {
        docs.iter_mut()
            .find(|d| d["kind"] == "InferencePool")
            .expect("the pool")
    }
    let edits: [(&str, Edit); 12] = [
        ("Service port grpc-ext-proc", |p| {
            p["spec"]["endpointPickerRef"]["port"]["number"] = json!(9003)
        }),
        ("spec.selector: required", |p| {
            p["spec"].as_object_mut().expect("spec").remove("selector");
        }),
        (
            "endpointPickerRef.failureMode: \"FailSometimes\" is not one of",
            |p| p["spec"]["endpointPickerRef"]["failureMode"] = json!("FailSometimes"),
        ),
        ("appProtocol: \"http2\" is not one of", |p| {
            p["spec"]["appProtocol"] = json!("http2")
        }),
        ("port.number: \"9002\" is not an integer", |p| {
            p["spec"]["endpointPickerRef"]["port"]["number"] = json!("9002")
        }),
        ("port is required when kind is 'Service'", |p| {
            let r = p["spec"]["endpointPickerRef"].as_object_mut().expect("ref");
            r.remove("port");
        }),
        ("spec.endpointPickerref: unknown field", |p| {
            let spec = p["spec"].as_object_mut().expect("spec");
            let r = spec.remove("endpointPickerRef").expect("ref");
            spec.insert("endpointPickerref".into(), r);
        }),
        ("port number must be unique", |p| {
            p["spec"]["targetPorts"] = json!([{"number": 8000}, {"number": 8000}])
        }),
        ("70000 is above 65535", |p| {
            p["spec"]["targetPorts"] = json!([{"number": 70000}])
        }),
        ("does not select the pods", |p| {
            p["spec"]["selector"]["matchLabels"] = json!({"app": "vllm-llama"})
        }),
        ("is not the chart's Service", |p| {
            p["spec"]["endpointPickerRef"]["name"] = json!("kv-indexer")
        }),
        ("version v1alpha2 is not served", |p| {
            p["apiVersion"] = json!("inference.networking.k8s.io/v1alpha2")
        }),
    ];
    let example = deploy_docs(INFERENCEPOOL_EXAMPLE);
    for (expected, edit) in edits {
        let mut docs = example.clone();
        edit(pool(&mut docs));
        let problems = inferencepool_problems(&docs);
        assert!(
            problems.iter().any(|p| p.contains(expected)),
            "{expected:?} not among {problems:#?}"
        );
    }
    // Istio's DestinationRule must be TLS towards the chart's Service.
    for (field, value) in [
        ("host", json!("kv-indexer.inference.svc")),
        ("mode", json!("DISABLE")),
    ] {
        let mut docs = example.clone();
        for d in docs.iter_mut().filter(|d| d["kind"] == "DestinationRule") {
            match field {
                "host" => d["spec"]["host"] = value.clone(),
                _ => d["spec"]["trafficPolicy"]["tls"]["mode"] = value.clone(),
            }
        }
        let problems = inferencepool_problems(&docs);
        assert!(
            problems
                .iter()
                .any(|p| p.contains("DestinationRule is not TLS")),
            "{field}: {problems:#?}"
        );
    }
    // The route to the pool, and the Gateway the chart's NetworkPolicy admits.
    let mut docs = example.clone();
    pool(&mut docs)["metadata"]["name"] = json!("another-pool");
    let problems = inferencepool_problems(&docs);
    assert!(
        problems.iter().any(|p| p.contains("no HTTPRoute")),
        "{problems:#?}"
    );
    let mut docs = example;
    for d in docs.iter_mut().filter(|d| d["kind"] == "Gateway") {
        d["metadata"]["name"] = json!("another-gateway");
    }
    let problems = inferencepool_problems(&docs);
    assert!(
        problems.iter().any(|p| p.contains("no HTTPRoute")),
        "{problems:#?}"
    );
    assert!(
        problems.iter().any(|p| p.contains("does not admit")),
        "{problems:#?}"
    );
}
