//! The binary as an operator runs it: `kv-indexer serve` with no config file starts on the
//! embedded defaults (addresses overridden to ephemeral loopback ports), logs that it is ready,
//! and on SIGTERM stops intake, finishes and exits 0.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// `kv-indexer serve` with no config file, on ephemeral loopback ports, logging to a pipe.
fn serve_on_ephemeral_ports() -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_kv-indexer"))
        .args([
            "serve",
            "--grpc-addr",
            "127.0.0.1:0",
            "--metrics-addr",
            "127.0.0.1:0",
            "--zmq-endpoint",
            "tcp://127.0.0.1:0",
        ])
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("the binary starts")
}

#[test]
fn serve_starts_without_config_and_exits_cleanly_on_sigterm() {
    let mut child = serve_on_ephemeral_ports();
    let stderr = child.stderr.take().expect("piped");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut ready = false;
    while Instant::now() < deadline {
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(line) if line.contains("kv-indexer ready") => {
                ready = true;
                break;
            }
            _ => {}
        }
    }
    assert!(ready, "the daemon never logged that it was ready");
    sigterm(&child);
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "no exit within 10 s of SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "exit status {status:?}");
    let rest: Vec<String> = rx.try_iter().collect();
    assert!(
        rest.iter().any(|l| l.contains("kv-indexer stopped")),
        "{rest:?}"
    );
}

/// Starts `kv-indexer serve` on ephemeral loopback ports; returns the child and its
/// (gRPC, metrics, ZMQ) addresses read from the ready log line.
fn spawn_daemon() -> (std::process::Child, String, String, String) {
    let mut child = serve_on_ephemeral_ports();
    let stderr = child.stderr.take().expect("piped");
    let mut lines = BufReader::new(stderr).lines();
    let ready = loop {
        match lines.next() {
            Some(Ok(line)) if line.contains("kv-indexer ready") => break line,
            Some(_) => {}
            None => panic!("the daemon exited before it was ready"),
        }
    };
    std::thread::spawn(move || for _ in lines {});
    let field = |name: &str| {
        ready
            .split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{name}=")))
            .map(|v| {
                v.trim_start_matches("Some(\"")
                    .trim_end_matches("\")")
                    .to_owned()
            })
            .unwrap_or_else(|| panic!("no {name} in {ready}"))
    };
    (child, field("grpc"), field("metrics"), field("zmq"))
}

#[test]
fn the_readme_quickstart_feeds_events_and_scores_a_prompt() {
    let (mut daemon, grpc, metrics, zmq) = spawn_daemon();
    let dir = std::env::temp_dir().join(format!("kvi-quickstart-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp");
    let request = dir.join("score.json");
    let bin = env!("CARGO_BIN_EXE_kv-indexer");
    let load = Command::new(bin)
        .args([
            "loadgen",
            "--pods",
            "4",
            "--documents",
            "4",
            "--duration",
            "0",
            "--baseline",
            "0",
        ])
        .args([
            "--zmq-endpoint",
            &zmq,
            "--grpc",
            &format!("http://{grpc}"),
            "--metrics",
            &metrics,
        ])
        .arg("--dump-request")
        .arg(&request)
        .output()
        .expect("loadgen runs");
    assert!(
        load.status.success(),
        "{}",
        String::from_utf8_lossy(&load.stderr)
    );
    let score = Command::new(bin)
        .args(["score", "--grpc", &format!("http://{grpc}"), "--request"])
        .arg(&request)
        .output()
        .expect("score runs");
    let out = String::from_utf8_lossy(&score.stdout);
    assert!(
        score.status.success(),
        "{}",
        String::from_utf8_lossy(&score.stderr)
    );
    assert!(out.contains("8000 prompt tokens, 500 full blocks"), "{out}");
    let first = out.lines().nth(2).expect("a score row");
    assert!(
        // All 500 blocks held; vLLM reuses at most all but the prompt's last token: 499.
        first.starts_with("10.200.0.0:8000") && first.trim_end().ends_with("499"),
        "{out}"
    );
    sigterm(&daemon);
    assert!(daemon.wait().expect("exits").success());
}

/// Sends SIGTERM to a child, as Kubernetes does, with the system's `kill` (no unsafe code).
fn sigterm(child: &std::process::Child) {
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "SIGTERM delivered");
}
