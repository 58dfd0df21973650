//! End-to-end tests of `server.tls`: the real binary with SmolLM2 on the CPU, HTTPS on loopback
//! with the test CA of `tests/fixtures/tls` (see its `make.sh`), rustls' own client speaking
//! HTTP/1.1. Each test starts its own server.

mod common;

use std::io::{BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{model_path, read_response_from, switchyard, Response, Server};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};

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
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_file(fixture("ca.pem")).expect("the CA"))
        .expect("a CA certificate");
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
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
    let name = ServerName::try_from("localhost").expect("a name");
    let conn = rustls::ClientConnection::new(client(), name).map_err(std::io::Error::other)?;
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

/// A scratch directory for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("switchyard-tls-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// Writes `config.yaml` into `dir`: the embedded model on `port`, with `server_lines`.
fn write_config(dir: &Path, port: u16, server_lines: &str) {
    let yaml = format!(
        "model:\n  path: {}\n  threads: 2\nserver:\n  host: 127.0.0.1\n  port: {port}\n  drain_timeout_s: 5\n{server_lines}",
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

/// Starts `serve` on `dir`'s `config.yaml` and waits until `/ready` answers 200 over HTTPS.
fn start(dir: PathBuf, port: u16) -> Server {
    let log = std::fs::File::create(dir.join("server.log")).expect("log file");
    let child = switchyard()
        .args(["serve", "--config"])
        .arg(dir.join("config.yaml"))
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("start switchyard serve");
    let mut server = Server { port, child, dir };
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Ok(a) = https(port, "GET", "/ready", None) {
            if a.response.status == 200 {
                return server;
            }
        }
        if let Some(status) = server.child.try_wait().expect("wait") {
            panic!("server exited ({status}); log:\n{}", server.log());
        }
        assert!(
            Instant::now() < deadline,
            "server did not become ready over HTTPS; log:\n{}",
            server.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Waits until the server's log holds `text` `n` times.
fn wait_log(s: &Server, text: &str, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while s.log().matches(text).count() < n {
        assert!(
            Instant::now() < deadline,
            "`{text}` not logged {n} times:\n{}",
            s.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Asserts that a 4-token completion is served over HTTPS.
fn assert_serves_https(s: &Server) {
    let body = serde_json::json!({"prompt": "Hi", "max_tokens": 4, "ignore_eos": true});
    let a = https(s.port, "POST", "/v1/completions", Some(&body.to_string())).expect("HTTPS");
    assert_eq!(a.response.status, 200, "{}", a.response.body);
    let v: serde_json::Value = serde_json::from_str(&a.response.body).expect("json");
    assert_eq!(v["usage"]["completion_tokens"], 4, "{v}");
}

#[test]
fn https_serves_completions_and_plain_http_to_the_port_fails_cleanly() {
    let dir = scratch("serve");
    let port = free_port();
    write_config(
        &dir,
        port,
        &tls_lines(&fixture("server.pem"), &fixture("server.key")),
    );
    let s = start(dir, port);
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
    let dir = scratch("mismatch");
    write_config(
        &dir,
        free_port(),
        &tls_lines(&fixture("server.pem"), &fixture("rotated.key")),
    );
    let log = std::fs::File::create(dir.join("server.log")).expect("log file");
    let mut child = switchyard()
        .args(["serve", "--config"])
        .arg(dir.join("config.yaml"))
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("run serve");
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("serve did not refuse the key");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
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
        write_config(&dir, 8000, server_lines);
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
    assert!(ok && e.contains("HTTPS with 1 certificate(s)"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn sighup_serves_a_new_certificate_to_new_connections_and_keeps_it_through_a_bad_one() {
    let dir = scratch("rotate");
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    let put = |c: &str, k: &str| {
        std::fs::copy(fixture(c), &cert).expect("copy cert");
        std::fs::copy(fixture(k), &key).expect("copy key");
    };
    put("server.pem", "server.key");
    let port = free_port();
    write_config(&dir, port, &tls_lines(&cert, &key));
    let s = start(dir.clone(), port);
    assert_leaf(
        &https(port, "GET", "/health", None).unwrap().leaf,
        "server.pem",
    );
    let hang_up = || {
        let status = Command::new("kill")
            .args(["-HUP", &s.child.id().to_string()])
            .status()
            .expect("kill");
        assert!(status.success());
    };

    // The same files: nothing changes.
    hang_up();
    wait_log(&s, "SIGHUP: TLS certificate unchanged", 1);

    // A new certificate and key (RSA, PKCS#1) at the same paths.
    put("rotated.pem", "rotated.key");
    hang_up();
    wait_log(&s, "SIGHUP: TLS certificate reloaded", 1);
    let a = https(port, "GET", "/health", None).expect("HTTPS");
    assert_leaf(&a.leaf, "rotated.pem");
    assert_serves_https(&s);

    // A key that is not the certificate's: the rotated certificate stays in force.
    std::fs::copy(fixture("server.key"), &key).expect("copy key");
    hang_up();
    wait_log(&s, "the certificate in force is kept", 1);
    s.assert_logged(&["server.tls.key_file", "does not match"]);
    assert_leaf(
        &https(port, "GET", "/health", None).unwrap().leaf,
        "rotated.pem",
    );

    // Turning TLS off takes a restart: named, and HTTPS goes on.
    write_config(&dir, port, "");
    hang_up();
    wait_log(&s, "SIGHUP: reload finished", 3);
    s.assert_logged(&["taking a restart", "server.tls"]);
    assert_serves_https(&s);
}
