//! End-to-end tests of `server.tls`: the real binary with SmolLM2 on the CPU, HTTPS on loopback
//! with the test CA of `tests/fixtures/tls` (see its `make.sh`), rustls' own client speaking
//! HTTP/1.1. Each test starts its own server.

mod common;

use std::io::{BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use common::{
    logged_port, model_path, read_response_from, serve, switchyard, wait_exit, Response, Server,
    TempDir,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};

/// A fixture of `tests/fixtures/tls`.
fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tls")
        .join(name)
}

/// The DER of the first certificate of a PEM fixture.
fn leaf_der(name: &str) -> Vec<u8> {
    CertificateDer::from_pem_file(fixture(name))
        .expect("a PEM certificate")
        .to_vec()
}

/// Asserts that `leaf` is the certificate of the fixture `name`.
fn assert_leaf(leaf: &[u8], name: &str) {
    assert!(
        leaf == leaf_der(name).as_slice(),
        "the server's certificate is not {name}'s"
    );
}

/// A client that trusts only the test CA and offers h2 then http/1.1.
fn client() -> Arc<rustls::ClientConfig> {
    client_at(Arc::new(rustls::time_provider::DefaultTimeProvider))
}

/// The clock of a client that believes it is always `self.0`.
#[derive(Debug)]
struct FixedTime(UnixTime);

impl rustls::time_provider::TimeProvider for FixedTime {
    fn current_time(&self) -> Option<UnixTime> {
        Some(self.0)
    }
}

/// [`client`], verifying certificates as at the time `clock` gives.
fn client_at(clock: Arc<dyn rustls::time_provider::TimeProvider>) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_file(fixture("ca.pem")).expect("the CA"))
        .expect("a CA certificate");
    let mut config = rustls::ClientConfig::builder_with_details(
        Arc::new(rustls::crypto::ring::default_provider()),
        clock,
    )
    .with_safe_default_protocol_versions()
    .expect("protocol versions")
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Arc::new(config)
}

/// What one HTTPS request gave: the response, the server's leaf certificate and the protocol
/// ALPN chose.
struct Answer {
    response: Response,
    leaf: Vec<u8>,
    alpn: Option<Vec<u8>>,
}

/// One request over a new HTTPS connection to `localhost` (the name the certificates carry).
fn https(port: u16, method: &str, path: &str, body: Option<&str>) -> std::io::Result<Answer> {
    https_as(client(), port, method, path, body)
}

/// [`https`] with the client `config`.
fn https_as(
    config: Arc<rustls::ClientConfig>,
    port: u16,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> std::io::Result<Answer> {
    let name = ServerName::try_from("localhost").expect("a name");
    let conn = rustls::ClientConnection::new(config, name).map_err(std::io::Error::other)?;
    let sock = TcpStream::connect(("127.0.0.1", port))?;
    sock.set_read_timeout(Some(Duration::from_secs(300)))?;
    let mut stream = rustls::StreamOwned::new(conn, sock);
    let mut request =
        format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n");
    if let Some(b) = body {
        request.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            b.len()
        ));
    }
    request.push_str("\r\n");
    request.push_str(body.unwrap_or(""));
    stream.write_all(request.as_bytes())?;
    stream.flush()?;
    let mut reader = BufReader::new(stream);
    let response = read_response_from(&mut reader)?;
    let conn = &reader.get_ref().conn;
    let leaf = conn
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| c.to_vec())
        .unwrap_or_default();
    let alpn = conn.alpn_protocol().map(<[u8]>::to_vec);
    Ok(Answer {
        response,
        leaf,
        alpn,
    })
}

/// Writes `config.yaml` into `dir`: the embedded model on port 0 (a free port the server binds
/// itself, read back from its log by [`start`]), with `server_lines`.
fn write_config(dir: &Path, server_lines: &str) {
    let yaml = format!(
        "model:\n  path: {}\n  threads: 2\nserver:\n  host: 127.0.0.1\n  port: 0\n  drain_timeout_s: 5\n{server_lines}",
        model_path().display()
    );
    std::fs::write(dir.join("config.yaml"), yaml).expect("write config");
}

/// The `server.tls` lines for `cert` and `key`.
fn tls_lines(cert: &Path, key: &Path) -> String {
    format!(
        "  tls:\n    cert_file: {}\n    key_file: {}\n",
        cert.display(),
        key.display()
    )
}

/// Starts `serve` on `dir`'s `config.yaml` and waits until `/ready` answers 200 over HTTPS on
/// the port it logs.
fn start(dir: &Path) -> Server {
    let child = serve(&dir.join("config.yaml"), dir)
        .spawn()
        .expect("start switchyard serve");
    let mut server = Server {
        port: 0,
        child,
        dir: dir.to_path_buf(),
    };
    server.wait_ready_by(|s| {
        https(s.port, "GET", "/ready", None).is_ok_and(|a| a.response.status == 200)
    });
    server
}

/// A scratch directory for one test.
fn temp_dir(name: &str) -> TempDir {
    common::temp_dir("tls", name)
}

/// Asserts that a 4-token completion is served over HTTPS.
fn assert_serves_https(s: &Server) {
    let body = serde_json::json!({"prompt": "Hi", "max_tokens": 4, "ignore_eos": true});
    let a = https(s.port, "POST", "/v1/completions", Some(&body.to_string())).expect("HTTPS");
    assert_eq!(a.response.status, 200, "{}", a.response.body);
    let v: serde_json::Value = serde_json::from_str(&a.response.body).expect("json");
    assert_eq!(v["usage"]["completion_tokens"], 4, "{v}");
}

/// The port a server on `port: 0` is waited on comes from its first whole `serving` line, of
/// either scheme: never from a line the server is still writing (its port cut short would be
/// another port, waited on until the deadline).
#[test]
fn the_logged_port_is_read_from_whole_serving_lines_only() {
    let before = " INFO switchyard::commands::serve: loading model path=/m\n";
    let serving = |scheme: &str, port: &str| {
        format!(" INFO switchyard::commands::serve: serving url={scheme}://127.0.0.1:{port}")
    };
    assert_eq!(logged_port(before), None);
    // Written up to the port's first digit, or to its last without the line's end.
    for cut in ["4", "45123"] {
        let log = format!("{before}{}", serving("http", cut));
        assert_eq!(logged_port(&log), None, "{log:?}");
    }
    let log = format!("{before}{}\n", serving("http", "45123"));
    assert_eq!(logged_port(&log), Some(45123));
    let log = format!(
        "{before}{}\n{}\n",
        serving("https", "8443"),
        serving("http", "1")
    );
    assert_eq!(logged_port(&log), Some(8443));
}

#[test]
fn https_serves_completions_and_plain_http_to_the_port_fails_cleanly() {
    let dir = temp_dir("serve");
    write_config(
        &dir,
        &tls_lines(&fixture("server.pem"), &fixture("server.key")),
    );
    let s = start(&dir);
    let port = s.port;
    s.assert_logged(&["serving", &format!("https://127.0.0.1:{port}")]);
    assert_serves_https(&s);
    let a = https(port, "GET", "/health", None).expect("HTTPS");
    assert_leaf(&a.leaf, "server.pem");
    // HTTP/1.1 is what ALPN settles on, though the client offers h2 first.
    assert_eq!(a.alpn.as_deref(), Some(&b"http/1.1"[..]));

    // Plain HTTP to the HTTPS port: no HTTP answer, the connection ends (an alert at most).
    let mut plain = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    plain
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    plain
        .write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        .expect("send");
    let mut got = Vec::new();
    let _ = plain.read_to_end(&mut got);
    assert!(
        !got.starts_with(b"HTTP/"),
        "plain HTTP was answered: {:?}",
        String::from_utf8_lossy(&got)
    );
    assert!(got.len() < 64, "{got:?}");
    // The server goes on serving.
    assert_serves_https(&s);
}

#[test]
fn a_key_of_another_certificate_is_refused_at_start_naming_the_field() {
    let dir = temp_dir("mismatch");
    write_config(
        &dir,
        &tls_lines(&fixture("server.pem"), &fixture("rotated.key")),
    );
    let mut child = serve(&dir.join("config.yaml"), &dir)
        .spawn()
        .expect("run serve");
    let status = wait_exit(
        &mut child,
        Duration::from_secs(60),
        "serve did not refuse the key",
    );
    let stderr = std::fs::read_to_string(dir.join("server.log")).unwrap_or_default();
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains("config.yaml:10: server.tls.key_file")
            && stderr.contains("rotated.key` is not the key of")
            && stderr.contains("does not match the certificate"),
        "{stderr}"
    );
    // Refused before the model loads.
    assert!(!stderr.contains("loading model"), "{stderr}");

    // `config check` refuses what `serve` refuses, each error naming its field.
    let check = |server_lines: &str| {
        write_config(&dir, server_lines);
        let out = switchyard()
            .args(["config", "check"])
            .arg(dir.join("config.yaml"))
            .output()
            .expect("run config check");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, e) = check(&tls_lines(&fixture("server.pem"), &fixture("rotated.key")));
    assert!(!ok && e.contains("server.tls.key_file"), "{e}");
    let (ok, e) = check(&tls_lines(&dir.join("missing.pem"), &fixture("server.key")));
    assert!(
        !ok && e.contains("server.tls.cert_file") && e.contains("missing.pem"),
        "{e}"
    );
    // Files swapped: no certificate where the chain should be.
    let (ok, e) = check(&tls_lines(&fixture("server.key"), &fixture("server.pem")));
    assert!(
        !ok && e.contains("server.tls.cert_file") && e.contains("no certificate in it"),
        "{e}"
    );
    let (ok, e) = check(&tls_lines(&fixture("server.pem"), &fixture("ca.pem")));
    assert!(
        !ok && e.contains("server.tls.key_file") && e.contains("no private key in it"),
        "{e}"
    );
    let (ok, e) = check(&tls_lines(&fixture("rotated.pem"), &fixture("rotated.key")));
    assert!(
        ok && e.contains("HTTPS with 1 certificate(s)") && e.contains("valid until 2126-11-10T"),
        "{e}"
    );
    // An expired certificate is served (the operator decides), and said to be expired.
    let (ok, e) = check(&tls_lines(&fixture("expired.pem"), &fixture("expired.key")));
    assert!(ok && e.contains("EXPIRED at 2001-01-01T00:00:00Z"), "{e}");
}

#[test]
fn sighup_serves_a_new_certificate_to_new_connections_and_keeps_it_through_a_bad_one() {
    let dir = temp_dir("rotate");
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    let put = |c: &str, k: &str| {
        std::fs::copy(fixture(c), &cert).expect("copy cert");
        std::fs::copy(fixture(k), &key).expect("copy key");
    };
    put("server.pem", "server.key");
    write_config(&dir, &tls_lines(&cert, &key));
    let s = start(&dir);
    let port = s.port;
    assert_leaf(
        &https(port, "GET", "/health", None).unwrap().leaf,
        "server.pem",
    );

    // The same files: nothing changes.
    s.hang_up();
    s.wait_logged("SIGHUP: TLS certificate unchanged", 1);

    // A new certificate and key (RSA, PKCS#1) at the same paths.
    put("rotated.pem", "rotated.key");
    s.hang_up();
    s.wait_logged("SIGHUP: TLS certificate reloaded", 1);
    let a = https(port, "GET", "/health", None).expect("HTTPS");
    assert_leaf(&a.leaf, "rotated.pem");
    assert_serves_https(&s);

    // A key that is not the certificate's: the rotated certificate stays in force.
    std::fs::copy(fixture("server.key"), &key).expect("copy key");
    s.hang_up();
    s.wait_logged("the certificate in force is kept", 1);
    s.assert_logged(&["server.tls.key_file", "does not match"]);
    assert_leaf(
        &https(port, "GET", "/health", None).unwrap().leaf,
        "rotated.pem",
    );

    // Turning TLS off takes a restart: named, and HTTPS goes on.
    write_config(&dir, "");
    s.hang_up();
    s.wait_logged("SIGHUP: reload finished", 3);
    s.assert_logged(&["taking a restart", "server.tls"]);
    assert_serves_https(&s);
}

/// A client whose clock says 2000-06-03: the expired certificate was valid then (the CA, a
/// trust anchor, has no validity checked).
fn client_in_2000() -> Arc<rustls::ClientConfig> {
    let in_2000 = UnixTime::since_unix_epoch(Duration::from_secs(960_000_000));
    client_at(Arc::new(FixedTime(in_2000)))
}

/// The expiry gauge of `/metrics`, over HTTPS with the client `config`.
fn expiry_gauge(config: Arc<rustls::ClientConfig>, port: u16) -> Option<f64> {
    let a = https_as(config, port, "GET", "/metrics", None).expect("GET /metrics");
    a.response.body.lines().find_map(|l| {
        let (name, value) = l.rsplit_once(' ')?;
        (name == "switchyard:tls_certificate_expiry_timestamp_seconds")
            .then(|| value.parse().ok())?
    })
}

/// The `notAfter` of a fixture's certificate (`openssl x509 -enddate`), in Unix seconds.
fn not_after(name: &str) -> f64 {
    switchyard_api::tls::expiry::not_after(&leaf_der(name)).expect("a notAfter") as f64
}

#[test]
fn the_certificate_expiry_is_exported_and_an_expired_one_is_logged_and_still_served() {
    let dir = temp_dir("expiry");
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    let put = |name: &str| {
        std::fs::copy(fixture(&format!("{name}.pem")), &cert).expect("copy cert");
        std::fs::copy(fixture(&format!("{name}.key")), &key).expect("copy key");
    };
    put("server");
    write_config(&dir, &tls_lines(&cert, &key));
    let s = start(&dir);
    let port = s.port;
    // 2126: no warning, the gauge at its notAfter.
    assert_eq!(expiry_gauge(client(), port), Some(not_after("server.pem")));
    assert!(!s.log().contains("TLS: the certificate"), "{}", s.log());

    // SIGHUP to an expired certificate: an ERROR naming the date, the gauge follows, and it is
    // served all the same.
    put("expired");
    s.hang_up();
    s.wait_logged("SIGHUP: TLS certificate reloaded", 1);
    s.assert_logged(&[
        "ERROR",
        "TLS: the certificate expired",
        "2001-01-01T00:00:00Z",
    ]);
    assert_eq!(expiry_gauge(client_in_2000(), port), Some(978_307_200.0));
    let name = ServerName::try_from("localhost").expect("a name");
    let mut conn = rustls::ClientConnection::new(client(), name).expect("client");
    let mut sock = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    // A verifying client refuses it: the server did send it.
    let refused = loop {
        match conn.complete_io(&mut sock) {
            Ok(_) if conn.is_handshaking() => continue,
            Ok(_) => break None,
            Err(e) => break Some(e.to_string()),
        }
    };
    let refused = refused.expect("the expired certificate was accepted");
    assert!(refused.contains("expired"), "{refused}");

    // And back: the gauge moves again.
    put("server");
    s.hang_up();
    s.wait_logged("SIGHUP: TLS certificate reloaded", 2);
    assert_eq!(expiry_gauge(client(), port), Some(not_after("server.pem")));
    assert_serves_https(&s);
}

/// Runs `bench serve` with `args`; returns whether it succeeded and its stderr. It must end
/// within 120 s (a hang fails the test).
fn bench_serve(args: &[&str]) -> (bool, String) {
    let mut child = switchyard()
        .args(["bench", "serve"])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run bench serve");
    let mut stderr = child.stderr.take().expect("stderr");
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    let status = wait_exit(&mut child, Duration::from_secs(120), "bench serve");
    let stderr = reader.join().expect("stderr reader");
    assert!(!stderr.contains("panicked"), "{stderr}");
    (status.success(), stderr)
}

#[test]
fn bench_serve_runs_over_https_with_cacert_and_names_a_ca_that_did_not_sign() {
    let dir = temp_dir("bench");
    write_config(
        &dir,
        &tls_lines(&fixture("server.pem"), &fixture("server.key")),
    );
    let s = start(&dir);
    let port = s.port;
    let url = format!("https://localhost:{port}");
    let ca = fixture("ca.pem");
    let result = dir.join("result.json");
    let (ok, stderr) = bench_serve(&[
        "--base-url",
        &url,
        "--cacert",
        ca.to_str().expect("a UTF-8 path"),
        "--num-prompts",
        "4",
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--ignore-eos",
        "true",
        "--max-concurrency",
        "2",
        "--result-file",
        result.to_str().expect("a UTF-8 path"),
    ]);
    assert!(ok, "{stderr}\nlog:\n{}", s.log());
    assert!(
        stderr.contains("bench serve: 4/4 requests (0 failed)"),
        "{stderr}"
    );
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&result).expect("the result file"))
            .expect("JSON");
    assert_eq!(report["completed"], 4, "{report}");
    assert_eq!(report["failed"], 0, "{report}");
    assert_eq!(report["total_output_tokens"], 16, "{report}");

    // A CA that did not sign the server's certificate: refused at the handshake, named.
    let other = fixture("rotated.pem");
    let (ok, stderr) = bench_serve(&[
        "--base-url",
        &url,
        "--cacert",
        other.to_str().expect("a UTF-8 path"),
        "--num-prompts",
        "1",
    ]);
    assert!(!ok, "{stderr}");
    assert!(
        stderr.contains(&format!("TLS handshake with localhost:{port} failed"))
            && stderr.contains("UnknownIssuer")
            && stderr.contains("is --cacert the CA that signed the server's certificate?"),
        "{stderr}"
    );
    // The name checked is the URL's host: the certificate names 127.0.0.1 too.
    let (ok, stderr) = bench_serve(&[
        "--base-url",
        &format!("https://127.0.0.1:{port}"),
        "--cacert",
        ca.to_str().expect("a UTF-8 path"),
        "--num-prompts",
        "1",
        "--output-len",
        "1",
    ]);
    assert!(ok, "{stderr}");
    // https:// without --cacert: refused before anything is sent.
    let (ok, stderr) = bench_serve(&["--base-url", &url, "--num-prompts", "1"]);
    assert!(!ok && stderr.contains("needs --cacert"), "{stderr}");

    // An https:// URL on a port that speaks plain HTTP fails at once, saying so.
    let plain = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let plain_port = plain.local_addr().expect("addr").port();
    std::thread::spawn(move || {
        for conn in plain.incoming().take(2) {
            let Ok(mut conn) = conn else { continue };
            let _ = conn.write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n");
        }
    });
    let (ok, stderr) = bench_serve(&[
        "--base-url",
        &format!("https://localhost:{plain_port}"),
        "--cacert",
        ca.to_str().expect("a UTF-8 path"),
        "--num-prompts",
        "1",
    ]);
    assert!(
        !ok && stderr.contains("TLS handshake") && stderr.contains("speak TLS on this port"),
        "{stderr}"
    );
}
