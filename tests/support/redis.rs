//! A real `redis-server` for the replication tests: started on a free loopback port in its own
//! temporary directory, without persistence (a restart comes back empty, the harder case),
//! killed when dropped. Under `CI=true` a missing `redis-server` fails the test; elsewhere the
//! test says loudly that it was skipped and why.

use std::io::Write;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running `redis-server`.
pub struct RedisServer {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
}

/// A free loopback port (bound, then released).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

impl RedisServer {
    /// Starts a server, or returns `None` after saying why the caller is skipped (a failure
    /// under CI).
    pub fn start(test: &str) -> Option<Self> {
        let found = Command::new("redis-server")
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !found {
            if std::env::var("CI").as_deref() == Ok("true") {
                panic!("CI must provide redis-server (.ci/run installs it) for {test}");
            }
            let _ = writeln!(
                std::io::stderr().lock(),
                "SKIPPED {test}: redis-server not found on PATH (install it, e.g. apt-get install redis-server; CI runs this test)"
            );
            return None;
        }
        let mut server = Self {
            child: None,
            port: free_port(),
            dir: super::temp_dir(&format!("redis-{test}")),
        };
        server.launch();
        Some(server)
    }

    fn launch(&mut self) {
        let child = Command::new("redis-server")
            .args([
                "--port",
                &self.port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "yes",
                "--loglevel",
                "warning",
            ])
            .arg("--dir")
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server starts");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if self.ping() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("redis-server on port {} never answered PING", self.port);
    }

    fn ping(&self) -> bool {
        use std::io::{Read, Write};
        let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", self.port)) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
        let mut buf = [0u8; 16];
        s.write_all(b"PING\r\n").is_ok()
            && s.read(&mut buf)
                .is_ok_and(|n| buf[..n].starts_with(b"+PONG"))
    }

    /// `redis://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Kills the server (SIGKILL): what a crashed or partitioned Redis looks like.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port (empty: no persistence).
    pub fn restart(&mut self) {
        self.kill();
        self.launch();
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
