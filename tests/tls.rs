//! Optional TLS for gRPC (rustls), over real sockets: with `server.tls` set, a client that
//! trusts the certificate scores, a plaintext client is refused; with `clientCaFile`, a client
//! without a certificate is refused too; the endpoint picker's port (ext_proc and its health
//! service) is TLS the same way. The certificates: `support::tls` (made with `openssl`).

mod support;

use std::path::Path;

use kv_indexer::config::Config;
use kv_indexer::daemon;
use kv_proto::kvindexer_v1::{kv_indexer_client::KvIndexerClient, ListPodsRequest};
use support::tls::certificates_or_skip;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

fn tls_config(dir: &Path, mutual: bool) -> Config {
    let mut c = support::loopback_config();
    c.server.tls.cert_file = dir.join("server.pem").display().to_string();
    c.server.tls.key_file = dir.join("server.key").display().to_string();
    if mutual {
        c.server.tls.client_ca_file = dir.join("ca.pem").display().to_string();
    }
    c
}

/// A channel to `localhost:port`, over TLS when `tls` is given.
async fn channel(
    port: u16,
    tls: Option<ClientTlsConfig>,
) -> Result<tonic::transport::Channel, String> {
    let scheme = if tls.is_some() { "https" } else { "http" };
    let mut endpoint =
        Endpoint::from_shared(format!("{scheme}://localhost:{port}")).map_err(|e| e.to_string())?;
    if let Some(tls) = tls {
        endpoint = endpoint.tls_config(tls).map_err(|e| e.to_string())?;
    }
    endpoint.connect().await.map_err(|e| format!("{e:?}"))
}

async fn list_pods(port: u16, tls: Option<ClientTlsConfig>) -> Result<(), String> {
    KvIndexerClient::new(channel(port, tls).await?)
        .list_pods(ListPodsRequest::default())
        .await
        .map(|_| ())
        .map_err(|s| s.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_over_tls_and_mutual_tls() {
    let dir = support::temp_dir("tls");
    if !certificates_or_skip(&dir) {
        return;
    }
    let ca = Certificate::from_pem(std::fs::read(dir.join("ca.pem")).expect("ca"));
    let trusting = || {
        ClientTlsConfig::new()
            .ca_certificate(ca.clone())
            .domain_name("localhost")
    };

    let d = daemon::start(tls_config(&dir, false))
        .await
        .expect("daemon starts with TLS");
    let port = d.grpc_addr.port();
    list_pods(port, Some(trusting()))
        .await
        .expect("a trusting client is served");
    assert!(list_pods(port, None).await.is_err(), "plaintext is refused");
    d.shutdown().await;

    let d = daemon::start(tls_config(&dir, true))
        .await
        .expect("daemon starts with mTLS");
    let port = d.grpc_addr.port();
    assert!(
        list_pods(port, Some(trusting())).await.is_err(),
        "mutual TLS: a client without a certificate is refused"
    );
    let identity = Identity::from_pem(
        std::fs::read(dir.join("client.pem")).expect("client cert"),
        std::fs::read(dir.join("client.key")).expect("client key"),
    );
    list_pods(port, Some(trusting().identity(identity)))
        .await
        .expect("a client with a certificate from the CA is served");
    d.shutdown().await;

    let mut missing = tls_config(&dir, false);
    missing.server.tls.key_file = dir.join("nope.key").display().to_string();
    let e = daemon::start(missing)
        .await
        .err()
        .expect("a missing key file fails start-up");
    assert!(e.to_string().contains("server.tls.keyFile"), "{e}");
}

/// `grpc.health.v1.Health/Check` of `service` on `port`, over TLS when `tls` is given.
async fn health(port: u16, tls: Option<ClientTlsConfig>, service: &str) -> Result<i32, String> {
    use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};
    HealthClient::new(channel(port, tls).await?)
        .check(HealthCheckRequest {
            service: service.into(),
        })
        .await
        .map(|r| r.into_inner().status)
        .map_err(|s| s.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_endpoint_picker_serves_tls_as_the_grpc_port_does() {
    let dir = support::temp_dir("tls-picker");
    if !certificates_or_skip(&dir) {
        return;
    }
    let ca = Certificate::from_pem(std::fs::read(dir.join("ca.pem")).expect("ca"));
    let trusting = ClientTlsConfig::new()
        .ca_certificate(ca)
        .domain_name("localhost");
    let mut c = tls_config(&dir, false);
    c.endpoint_picker.enabled = true;
    c.endpoint_picker.addr = "127.0.0.1:0".into();
    let d = daemon::start(c).await.expect("daemon starts with TLS");
    let port = d.picker_addr.expect("the picker is on").port();
    assert_eq!(
        health(port, Some(trusting), "liveness").await,
        Ok(1),
        "a trusting client is served"
    );
    assert!(
        health(port, None, "liveness").await.is_err(),
        "plaintext is refused"
    );
    d.shutdown().await;
}

/// The certificate a TLS server at `127.0.0.1:port` presents (PEM), read with `openssl`.
fn presented_certificate(port: u16) -> Option<String> {
    let out = std::process::Command::new("openssl")
        .args(["s_client", "-connect", &format!("127.0.0.1:{port}")])
        .args(["-servername", "localhost", "-alpn", "h2"])
        .stdin(std::process::Stdio::null())
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let start = text.find("-----BEGIN CERTIFICATE-----")?;
    let end = text.find("-----END CERTIFICATE-----")? + "-----END CERTIFICATE-----".len();
    Some(text[start..end].to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_picker_serves_a_self_signed_certificate_or_plaintext_when_asked() {
    use kv_indexer::config::PickerTlsMode;
    let dir = support::temp_dir("tls-picker-modes");
    if !certificates_or_skip(&dir) {
        return;
    }
    // gRPC with TLS from files; the picker as GIE's EPP serves by default: its own certificate.
    let mut c = tls_config(&dir, false);
    c.endpoint_picker.enabled = true;
    c.endpoint_picker.addr = "127.0.0.1:0".into();
    c.endpoint_picker.tls.mode = PickerTlsMode::SelfSigned;
    let d = daemon::start(c.clone()).await.expect("daemon starts");
    let port = d.picker_addr.expect("the picker is on").port();
    let pem = presented_certificate(port).expect("a certificate is presented");
    let files_ca = std::fs::read_to_string(dir.join("server.pem")).expect("server.pem");
    assert_ne!(pem.trim(), files_ca.trim(), "not server.tls's certificate");
    let trusting = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(pem))
        .domain_name("localhost");
    assert_eq!(health(port, Some(trusting), "liveness").await, Ok(1));
    assert!(
        health(port, None, "liveness").await.is_err(),
        "plaintext refused"
    );
    d.shutdown().await;
    // Plaintext for the picker while gRPC keeps its TLS.
    c.endpoint_picker.tls.mode = PickerTlsMode::Plaintext;
    let d = daemon::start(c).await.expect("daemon starts");
    let port = d.picker_addr.expect("the picker is on").port();
    assert_eq!(health(port, None, "liveness").await, Ok(1), "h2c served");
    assert!(
        list_pods(d.grpc_addr.port(), None).await.is_err(),
        "gRPC still refuses plaintext"
    );
    d.shutdown().await;
}
