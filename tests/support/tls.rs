//! Test certificates, made with `openssl` (tests/tls.rs, tests/gateway_envoy.rs): a self-signed
//! CA, and a `localhost` server certificate and a client certificate it signs, as PEM files.

use std::path::Path;
use std::process::Command;

/// Makes `ca.pem`, `server.pem`/`server.key` and `client.pem`/`client.key` (P-256, valid two
/// days, `subjectAltName=DNS:localhost`) in `dir`; `false` when openssl cannot.
pub fn certificates(dir: &Path) -> bool {
    let run = |args: &[&str]| {
        Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .is_ok_and(|o| o.status.success())
    };
    let ext = dir.join("ext.cnf");
    std::fs::write(&ext, "subjectAltName=DNS:localhost\n").expect("ext");
    run(&[
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=kv-indexer test CA",
    ]) && ["server", "client"].iter().all(|who| {
        run(&[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            &format!("{who}.key"),
            "-out",
            &format!("{who}.csr"),
            "-subj",
            "/CN=localhost",
        ]) && run(&[
            "x509",
            "-req",
            "-in",
            &format!("{who}.csr"),
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            &format!("{who}.pem"),
            "-days",
            "2",
            "-extfile",
            "ext.cnf",
        ])
    })
}

/// The test certificates in `dir`; `false` (after saying so) where openssl cannot make them,
/// which CI does not accept.
pub fn certificates_or_skip(dir: &Path) -> bool {
    if certificates(dir) {
        return true;
    }
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("CI must have openssl to make the test certificates");
    }
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr().lock(),
        "SKIPPED {}: no openssl to make test certificates (CI has it)",
        std::thread::current().name().unwrap_or("a TLS test")
    );
    false
}
