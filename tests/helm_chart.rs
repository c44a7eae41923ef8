//! The Helm chart (`deploy/helm/kv-indexer`), rendered by this test's own Go-template renderer
//! (gtmpl, plus the Helm functions the chart uses: `include`, `toYaml`, `nindent`, `quote`,
//! `default`, `until`, `int`), since no helm binary is available here. Every rendered manifest
//! must deserialize into the Kubernetes API types (`k8s-openapi`), and the configuration the
//! chart writes must be one kv-indexer accepts, for the default values and each mode.

use std::cell::RefCell;
use std::collections::HashMap;
use std::path::PathBuf;

use gtmpl_value::{FuncError, Number, Value};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Secret, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kv_indexer::config::Config;
use serde::Deserialize;
use serde_json::json;

fn chart_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("deploy/helm/kv-indexer")
}

fn to_gtmpl(v: &serde_json::Value) -> Value {
    match v {
        serde_json::Value::Null => Value::Nil,
        serde_json::Value::Bool(b) => Value::Bool(*b),
        serde_json::Value::Number(n) => match n.as_i64() {
            Some(i) => Value::Number(Number::from(i)),
            None => Value::Number(Number::from(n.as_f64().unwrap_or(0.0))),
        },
        serde_json::Value::String(s) => Value::String(s.clone()),
        serde_json::Value::Array(a) => Value::Array(a.iter().map(to_gtmpl).collect()),
        serde_json::Value::Object(o) => {
            Value::Map(o.iter().map(|(k, v)| (k.clone(), to_gtmpl(v))).collect())
        }
    }
}

fn to_json(v: &Value) -> serde_json::Value {
    match v {
        Value::Nil | Value::NoValue => serde_json::Value::Null,
        Value::Bool(b) => json!(b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => json!(i),
            None => json!(n.as_f64()),
        },
        Value::String(s) => json!(s),
        Value::Array(a) => serde_json::Value::Array(a.iter().map(to_json).collect()),
        Value::Map(m) | Value::Object(m) => {
            let mut keys: Vec<_> = m.keys().collect();
            keys.sort();
            serde_json::Value::Object(
                keys.into_iter()
                    .map(|k| (k.clone(), to_json(&m[k])))
                    .collect(),
            )
        }
        Value::Function(_) => serde_json::Value::Null,
    }
}

fn truthy(v: &Value) -> bool {
    match v {
        Value::Nil | Value::NoValue => false,
        Value::Bool(b) => *b,
        Value::String(s) => !s.is_empty(),
        Value::Number(n) => n.as_f64().is_some_and(|f| f != 0.0),
        Value::Array(a) => !a.is_empty(),
        Value::Map(m) | Value::Object(m) => !m.is_empty(),
        Value::Function(_) => true,
    }
}

thread_local! {
    /// Named templates (`define`) pre-rendered with the root context, for `include`.
    static INCLUDES: RefCell<HashMap<String, String>> = RefCell::new(HashMap::new());
}

fn include(args: &[Value]) -> Result<Value, FuncError> {
    let Some(Value::String(name)) = args.first() else {
        return Err(FuncError::Generic("include needs a template name".into()));
    };
    INCLUDES
        .with(|m| m.borrow().get(name).cloned())
        .map(Value::String)
        .ok_or_else(|| FuncError::Generic(format!("no template {name}")))
}

fn to_yaml(args: &[Value]) -> Result<Value, FuncError> {
    let v = args.last().map(to_json).unwrap_or(serde_json::Value::Null);
    if v.is_null() || v == json!({}) || v == json!([]) {
        return Ok(Value::String(if v.is_array() { "[]" } else { "{}" }.into()));
    }
    let text = serde_yaml::to_string(&v).map_err(|e| FuncError::Generic(e.to_string()))?;
    Ok(Value::String(text.trim_end().to_owned()))
}

fn nindent(args: &[Value]) -> Result<Value, FuncError> {
    let (Some(Value::Number(n)), Some(text)) = (args.first(), args.get(1)) else {
        return Err(FuncError::Generic("nindent N TEXT".into()));
    };
    let pad = " ".repeat(n.as_i64().unwrap_or(0) as usize);
    let text = match text {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let body: Vec<String> = text.lines().map(|l| format!("{pad}{l}")).collect();
    Ok(Value::String(format!("\n{}", body.join("\n"))))
}

fn quote(args: &[Value]) -> Result<Value, FuncError> {
    let s = match args.last() {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Nil) | Some(Value::NoValue) | None => String::new(),
        Some(other) => other.to_string(),
    };
    Ok(Value::String(serde_json::Value::String(s).to_string()))
}

fn default(args: &[Value]) -> Result<Value, FuncError> {
    match args {
        [fallback, given] if truthy(given) => Ok(given.clone()),
        [fallback, _] | [fallback] => Ok(fallback.clone()),
        _ => Err(FuncError::Generic("default FALLBACK VALUE".into())),
    }
}

fn until(args: &[Value]) -> Result<Value, FuncError> {
    let n = match args.first() {
        Some(Value::Number(n)) => n.as_i64().unwrap_or(0),
        _ => 0,
    };
    Ok(Value::Array(
        (0..n).map(|i| Value::Number(Number::from(i))).collect(),
    ))
}

fn int(args: &[Value]) -> Result<Value, FuncError> {
    match args.first() {
        Some(Value::Number(n)) => {
            let i = n
                .as_i64()
                .or_else(|| n.as_u64().map(|u| u as i64))
                .or_else(|| n.as_f64().map(|f| f as i64))
                .unwrap_or(0);
            Ok(Value::Number(Number::from(i)))
        }
        Some(Value::String(s)) => Ok(Value::Number(Number::from(s.parse::<i64>().unwrap_or(0)))),
        _ => Ok(Value::Number(Number::from(0i64))),
    }
}

/// Helm's `required MSG VALUE`: the value, or a render error with the message when it is empty.
fn required(args: &[Value]) -> Result<Value, FuncError> {
    match args {
        [Value::String(message), value] if !truthy(value) => {
            Err(FuncError::Generic(message.clone()))
        }
        [_, value] => Ok(value.clone()),
        _ => Err(FuncError::ExactlyXArgs("required".into(), 2)),
    }
}

/// Helm's `fail MSG`: a render error with the message.
fn fail(args: &[Value]) -> Result<Value, FuncError> {
    match args {
        [Value::String(message)] => Err(FuncError::Generic(message.clone())),
        _ => Err(FuncError::ExactlyXArgs("fail".into(), 1)),
    }
}

fn template(source: &str) -> gtmpl::Template {
    let mut t = gtmpl::Template::default();
    t.add_funcs(&[
        ("include", include as gtmpl::Func),
        ("toYaml", to_yaml as gtmpl::Func),
        ("nindent", nindent as gtmpl::Func),
        ("quote", quote as gtmpl::Func),
        ("default", default as gtmpl::Func),
        ("until", until as gtmpl::Func),
        ("int", int as gtmpl::Func),
        ("required", required as gtmpl::Func),
        ("fail", fail as gtmpl::Func),
    ]);
    t.parse(source)
        .unwrap_or_else(|e| panic!("template parse: {e}"));
    t
}

fn merge(base: &mut serde_json::Value, over: &serde_json::Value) {
    match (base, over) {
        (serde_json::Value::Object(b), serde_json::Value::Object(o)) => {
            for (k, v) in o {
                merge(b.entry(k.clone()).or_insert(serde_json::Value::Null), v);
            }
        }
        (b, o) => *b = o.clone(),
    }
}

/// Renders every template with `overrides` merged into values.yaml: (file, rendered YAML).
fn render(overrides: serde_json::Value) -> Vec<(String, serde_json::Value)> {
    let dir = chart_dir();
    let mut values: serde_json::Value =
        serde_yaml::from_str(&std::fs::read_to_string(dir.join("values.yaml")).expect("values"))
            .expect("yaml");
    merge(&mut values, &overrides);
    let chart: serde_json::Value =
        serde_yaml::from_str(&std::fs::read_to_string(dir.join("Chart.yaml")).expect("Chart"))
            .expect("yaml");
    let ctx = to_gtmpl(&json!({
        "Values": values,
        "Release": {"Name": "kvi", "Namespace": "inference", "Service": "Helm"},
        "Chart": {"Name": chart["name"], "Version": chart["version"], "AppVersion": chart["appVersion"]},
    }));
    let helpers = std::fs::read_to_string(dir.join("templates/_helpers.tpl")).expect("helpers");
    let names: Vec<String> = helpers
        .split("define \"")
        .skip(1)
        .filter_map(|s| s.split('"').next().map(str::to_owned))
        .collect();
    let pre: HashMap<String, String> = names
        .iter()
        .map(|n| {
            let t = template(&format!("{helpers}{{{{ template \"{n}\" . }}}}"));
            let out = t
                .render(&gtmpl::Context::from(ctx.clone()))
                .expect("helper renders");
            (n.clone(), out.trim().to_owned())
        })
        .collect();
    INCLUDES.with(|m| *m.borrow_mut() = pre);
    let mut out = Vec::new();
    let mut files: Vec<_> = std::fs::read_dir(dir.join("templates"))
        .expect("templates")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    for path in files {
        let name = path
            .file_name()
            .expect("name")
            .to_string_lossy()
            .into_owned();
        let source = std::fs::read_to_string(&path).expect("template");
        let t = template(&format!("{helpers}{source}"));
        let rendered = t
            .render(&gtmpl::Context::from(ctx.clone()))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        if rendered.trim().is_empty() {
            continue;
        }
        let doc: serde_json::Value = serde_yaml::from_str(&rendered)
            .unwrap_or_else(|e| panic!("{name} is not YAML: {e}\n{rendered}"));
        out.push((name, doc));
    }
    out
}

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
            "NetworkPolicy" => serde_json::from_value::<NetworkPolicy>(doc.clone()).map(|_| ()),
            "PodDisruptionBudget" => {
                serde_json::from_value::<PodDisruptionBudget>(doc.clone()).map(|_| ())
            }
            "ServiceMonitor" => {
                assert_eq!(doc["apiVersion"], "monitoring.coreos.com/v1", "{file}");
                assert_eq!(doc["spec"]["endpoints"][0]["path"], "/metrics", "{file}");
                Ok(())
            }
            other => panic!("{file}: unexpected kind {other}"),
        };
        ok.unwrap_or_else(|e| panic!("{file} ({kind}) does not deserialize: {e}\n{doc:#}"));
        by_kind.insert(kind, doc.clone());
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
        ["ConfigMap", "Deployment", "NetworkPolicy", "Service"]
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
    assert_eq!(svc_ports, [50051, 9090, 5557]);
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
    for file in [
        "examples/vllm-deployment.yaml",
        "examples/vllm-statefulset-connect.yaml",
        "examples/vllm-deployment-connect.yaml",
    ] {
        let text = std::fs::read_to_string(root.join(file)).expect("example");
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let v = serde_json::to_value(serde_yaml::Value::deserialize(doc).expect("yaml"))
                .expect("json");
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
