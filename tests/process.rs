//! The binary as an operator runs it: `kv-indexer serve` with no config file starts on the
//! embedded defaults (addresses overridden to ephemeral loopback ports), logs that it is ready,
//! and on SIGTERM stops intake, finishes and exits 0.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn serve_starts_without_config_and_exits_cleanly_on_sigterm() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kv-indexer"))
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
        .expect("the binary starts");
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
    // SAFETY: sending a signal to our own child process by its pid.
    let rc = unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    assert_eq!(rc, 0, "SIGTERM delivered");
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
