//! A real Prometheus for the monitoring tests (`tests/monitoring.rs`): `promtool` checks and
//! unit-tests the shipped rules, and a `prometheus` server, started on a free loopback port in
//! its own temporary directory, scrapes daemons started in the test every second and evaluates
//! rules every second; it is killed when dropped. Under `CI=true` a missing binary fails the
//! test (`.ci/run` installs Debian's `prometheus`, which brings `promtool`); elsewhere the test
//! says loudly that it was skipped and why.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// Whether `prometheus` and `promtool` are on `PATH`. When not: a failure under CI, else a
/// `SKIPPED` line on stderr (written directly: the harness captures `eprintln!` of passing
/// tests, and a skip must not be silent).
pub fn available(test: &str) -> bool {
    let runs = |bin: &str| {
        Command::new(bin)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    let missing: Vec<&str> = ["prometheus", "promtool"]
        .into_iter()
        .filter(|b| !runs(b))
        .collect();
    if missing.is_empty() {
        return true;
    }
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("CI must provide {missing:?} (.ci/run installs Debian's prometheus) for {test}");
    }
    let _ = writeln!(
        std::io::stderr().lock(),
        "SKIPPED {test}: {missing:?} not found on PATH (install them, e.g. apt-get install prometheus; CI runs this test)"
    );
    false
}

/// Runs `promtool ARGS` in `dir`; `Err` with its output when it fails.
pub fn promtool(dir: &Path, args: &[&str]) -> Result<String, String> {
    let out = Command::new("promtool")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("promtool runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if out.status.success() {
        Ok(text)
    } else {
        Err(text)
    }
}

/// A running `prometheus`.
pub struct PrometheusServer {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
}

impl PrometheusServer {
    /// Starts a server that scrapes `targets` (`host:port`, path `/metrics`) every second as
    /// job `kv-indexer`, with `labels` added to every series (as a Kubernetes scrape adds
    /// `namespace`) and `honor_labels: true` (the chart's ServiceMonitor sets it), and evaluates
    /// `rules` (a rules file's text) every second. Waits until it is ready.
    pub async fn start(targets: &[String], labels: &[(&str, &str)], rules: &str) -> Self {
        let dir = super::temp_dir("prometheus");
        std::fs::write(dir.join("rules.yaml"), rules).expect("rules written");
        let labels: serde_json::Map<String, Value> = labels
            .iter()
            .map(|(k, v)| (k.to_string(), Value::from(*v)))
            .collect();
        // JSON is YAML: the configuration without a YAML writer.
        let config = serde_json::json!({
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": ["rules.yaml"],
            "scrape_configs": [{
                "job_name": "kv-indexer",
                "honor_labels": true,
                "static_configs": [{"targets": targets, "labels": labels}],
            }],
        });
        std::fs::write(dir.join("prometheus.yml"), config.to_string()).expect("config written");
        let port = super::redis::free_port();
        let log = std::fs::File::create(dir.join("prometheus.log")).expect("log file");
        let child = Command::new("prometheus")
            .arg(format!(
                "--config.file={}",
                dir.join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--storage.tsdb.retention.time=1h")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("prometheus starts");
        let server = Self {
            child: Some(child),
            port,
            dir,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if server
                .http("/-/ready")
                .await
                .is_some_and(|(code, _)| code == 200)
            {
                return server;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("prometheus never became ready:\n{}", server.log());
    }

    /// Its log so far (for failure messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("prometheus.log")).unwrap_or_default()
    }

    /// `GET path` on the server: status and body.
    async fn http(&self, path: &str) -> Option<(u16, String)> {
        super::http_get(self.port, path).await
    }

    /// `GET /api/v1/<path>` with `params` (encoded here): the `data` of a `success` answer,
    /// else `Err` with the error Prometheus gave.
    pub async fn api(&self, path: &str, params: &[(&str, &str)]) -> Result<Value, String> {
        let query: Vec<String> = params
            .iter()
            .map(|(k, v)| format!("{}={}", encode(k), encode(v)))
            .collect();
        let url = format!("/api/v1/{path}?{}", query.join("&"));
        let (code, body) = self
            .http(&url)
            .await
            .ok_or_else(|| format!("GET {url}: no answer"))?;
        let v: Value =
            serde_json::from_str(&body).map_err(|e| format!("GET {url}: {code} {e}: {body}"))?;
        if v["status"] != "success" {
            return Err(format!("{}: {}", v["errorType"], v["error"]));
        }
        Ok(v["data"].clone())
    }

    /// An instant query's result (its series), or the error.
    pub async fn query(&self, promql: &str) -> Result<Vec<Value>, String> {
        let data = self.api("query", &[("query", promql)]).await?;
        Ok(data["result"].as_array().cloned().unwrap_or_default())
    }

    /// The alerts pending or firing now.
    pub async fn alerts(&self) -> Vec<Value> {
        self.api("alerts", &[])
            .await
            .map(|d| d["alerts"].as_array().cloned().unwrap_or_default())
            .unwrap_or_default()
    }

    /// Every alerting rule with its state, health and last error.
    pub async fn rules(&self) -> Vec<Value> {
        let data = self.api("rules", &[("type", "alert")]).await;
        data.map(|d| {
            d["groups"]
                .as_array()
                .into_iter()
                .flatten()
                .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
                .collect()
        })
        .unwrap_or_default()
    }
}

/// Percent-encodes everything but unreserved characters.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

impl Drop for PrometheusServer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
