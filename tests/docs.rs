//! The documents' checkable claims against the code: every command line of README.md uses
//! only flags its subcommand's `--help` lists, every configuration key the documents name is
//! one the server or a simulation spec reads, and ARCHITECTURE.md's dependency table explains
//! every dependency the workspace's manifests declare, and nothing else.

mod common;

use common::{succeeds, switchyard};
use std::collections::BTreeSet;
use std::path::Path;

fn read(rel: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(rel))
        .unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// The `--flags` a text names.
fn flags(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("--") {
        let name: String = rest[i + 2..]
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-')
            .collect();
        if name.starts_with(|c: char| c.is_ascii_lowercase()) {
            out.insert(format!("--{name}"));
        }
        rest = &rest[i + 2 + name.len()..];
    }
    out
}

#[test]
fn every_readme_command_line_uses_flags_its_subcommand_has() {
    // Subcommands, longest first so that `bench serve` is not read as `serve`.
    const SUBCOMMANDS: [&str; 9] = [
        "bench throughput",
        "bench serve",
        "config check",
        "model fetch",
        "calibrate",
        "generate",
        "simulate",
        "run-batch",
        "serve",
    ];
    // A table cell's escaped pipes (`random\|sharegpt`) and a shell line's continuations.
    let readme = read("README.md").replace("\\|", "/").replace("\\\n", " ");
    let mut seen = BTreeSet::new();
    let mut wrong = Vec::new();
    let mut undocumented = Vec::new();
    for sub in SUBCOMMANDS {
        let before = seen.len();
        let help = succeeds(switchyard().args(sub.split(' ')).arg("--help"));
        let known = flags(&help);
        let needle = format!("switchyard {sub}");
        let mut at = 0;
        while let Some(i) = readme[at..].find(&needle) {
            let start = at + i;
            at = start + needle.len();
            // The word must end there (`serve` is not `server`), and a longer subcommand
            // (`bench serve`) has had its turn.
            if readme[at..].starts_with(|c: char| c.is_ascii_alphanumeric() || c == '-')
                || !seen.insert(start + needle.len())
            {
                continue;
            }
            // The command line: up to the end of its code span, table cell or line.
            let end = readme[at..]
                .find(['`', '|', '\n'])
                .map_or(readme.len(), |e| at + e);
            for flag in flags(&readme[at..end]) {
                if !known.contains(&flag) {
                    wrong.push(format!("`{}`: {flag}", &readme[start..end]));
                }
            }
        }
        // Each subcommand has a command line the check read (none: the README lost it, or
        // this reader no longer finds command lines).
        if seen.len() == before {
            undocumented.push(sub);
        }
    }
    assert!(
        wrong.is_empty(),
        "README command lines name flags their subcommand does not have:\n{}",
        wrong.join("\n")
    );
    assert!(
        undocumented.is_empty(),
        "no README command line found for: {undocumented:?}"
    );
}

/// The dependency names a Cargo.toml declares in `[dependencies]`, `[dev-dependencies]` and
/// `[build-dependencies]`, platform-specific ones (`[target.'cfg(unix)'.dependencies]`)
/// included, and in tables of one dependency (`[dependencies.name]`) (`workspace` true: the
/// table `[workspace.dependencies]`), less the workspace's own crates.
fn declared(manifest: &str, workspace: bool) -> BTreeSet<String> {
    const KINDS: [&str; 3] = ["dependencies", "dev-dependencies", "build-dependencies"];
    let mut out = BTreeSet::new();
    let mut inside = false;
    for line in manifest.lines() {
        let line = line.trim();
        if let Some(header) = line.strip_prefix('[') {
            let header = header.trim_end_matches(']');
            let table = if workspace {
                header.strip_prefix("workspace.")
            } else if header.starts_with("workspace.") {
                None
            } else {
                // `target.'cfg(...)'.dependencies`: the table after the platform.
                Some(match header.strip_prefix("target.") {
                    Some(rest) => match rest.rfind(['\'', '"']) {
                        Some(q) => rest[q + 1..].trim_start_matches('.'),
                        None => rest.split_once('.').map_or(rest, |(_, t)| t),
                    },
                    None => header,
                })
            };
            inside = false;
            if let Some(table) = table {
                let (kind, one) = table.split_once('.').unwrap_or((table, ""));
                if KINDS.contains(&kind) && (!workspace || kind == "dependencies") {
                    if one.is_empty() {
                        inside = true;
                    } else if !one.starts_with("switchyard") {
                        out.insert(one.to_owned());
                    }
                }
            }
            continue;
        }
        if !inside || line.is_empty() || line.starts_with('#') {
            continue;
        }
        let name: String = line
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
            .collect();
        if !name.is_empty() && !name.starts_with("switchyard") {
            out.insert(name);
        }
    }
    out
}

/// The manifest reader finds dependencies however a manifest's tables declare them.
#[test]
fn declared_reads_every_form_of_dependency_table() {
    let manifest = r#"
[package]
name = "x"
[dependencies]
serde = { workspace = true }
anyhow.workspace = true
switchyard-config = { path = "config" }
[dependencies.rayon]
version = "1"
[dev-dependencies]
tempfile = "3"
[target.'cfg(unix)'.dependencies]
libc = "0.2"
[target."cfg(windows)".build-dependencies.winres]
version = "0.1"
[target.x86_64-unknown-linux-gnu.dev-dependencies]
nix = "0.29"
[features]
cuda = ["dep:cudarc"]
[workspace.dependencies]
tokio = "1"
"#;
    let names = |s: &BTreeSet<String>| s.iter().cloned().collect::<Vec<_>>();
    assert_eq!(
        names(&declared(manifest, false)),
        ["anyhow", "libc", "nix", "rayon", "serde", "tempfile", "winres"]
    );
    assert_eq!(names(&declared(manifest, true)), ["tokio"]);
}

#[test]
fn architecture_explains_every_dependency_and_only_those() {
    let root = read("Cargo.toml");
    let members = ["config", "policies", "simulator", "gpu", "actors", "api"];
    let mut used = declared(&root, false);
    for m in members {
        used.extend(declared(&read(&format!("{m}/Cargo.toml")), false));
    }
    assert!(
        root.contains(&format!("members = {members:?}")),
        "the workspace's members changed: update this test"
    );
    let pinned = declared(&root, true);
    let unused: Vec<&String> = pinned.difference(&used).collect();
    assert!(
        unused.is_empty(),
        "[workspace.dependencies] pins crates no member uses: {unused:?}"
    );

    let arch = read("ARCHITECTURE.md");
    let table = arch
        .split("## Why each dependency is there")
        .nth(1)
        .expect("ARCHITECTURE.md has its dependency table");
    let mut explained = BTreeSet::new();
    for row in table.lines().filter(|l| l.starts_with("| ")).skip(1) {
        let cell = row.split('|').nth(1).unwrap_or_default();
        // `tokio (sync, time; ...)`, `thiserror / anyhow`, `actix-web's `rustls-0_23``: the
        // crate names are the words before any parenthesis, apostrophe or space.
        let mut depth = 0;
        let bare: String = cell
            .chars()
            .filter(|&c| {
                match c {
                    '(' => depth += 1,
                    ')' => depth -= 1,
                    _ => return depth == 0,
                }
                false
            })
            .collect();
        for part in bare.split([',', '/']) {
            let name: String = part
                .trim()
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
                .collect();
            if !name.is_empty() {
                explained.insert(name);
            }
        }
    }
    let unexplained: Vec<&String> = used.difference(&explained).collect();
    let gone: Vec<&String> = explained.difference(&used).collect();
    assert!(
        unexplained.is_empty(),
        "dependencies ARCHITECTURE.md does not explain: {unexplained:?}"
    );
    assert!(
        gone.is_empty(),
        "ARCHITECTURE.md explains crates no manifest declares: {gone:?}"
    );
}

/// The dotted configuration keys (`server.max_body_bytes`, `tiers.<name>.weight`,
/// `lora.adapters[i].pinned`) a text names in its code spans, file names aside.
fn config_keys(text: &str) -> BTreeSet<String> {
    const SECTIONS: [&str; 13] = [
        "model",
        "server",
        "cache",
        "scheduler",
        "tiers",
        "logging",
        "lora",
        "speculative",
        "hardware",
        "workload",
        "policies",
        "calibration",
        "seed",
    ];
    const FILES: [&str; 10] = [
        ".rs", ".md", ".yaml", ".yml", ".json", ".jsonl", ".csv", ".py", ".sh", ".txt",
    ];
    let mut out = BTreeSet::new();
    for span in text.split('`').skip(1).step_by(2) {
        let token_char =
            |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || "_.<>[]{}".contains(c);
        for token in span.split(|c: char| !token_char(c)) {
            let token = token.trim_end_matches('.');
            let Some((first, _)) = token.split_once('.') else {
                continue;
            };
            if SECTIONS.contains(&first) && !FILES.iter().any(|f| token.ends_with(f)) {
                out.insert(token.to_owned());
            }
        }
    }
    out
}

/// `root` with `key` (dotted, `<name>` or `{name}` a map's entry, `[i]` a list's) set to null
/// under it, the mappings and lists on its way made (a preset's name becomes a mapping).
fn with_key(root: &serde_yaml::Value, key: &str) -> serde_yaml::Value {
    use serde_yaml::{Mapping, Value};
    let mut root = root.clone();
    let mut at = &mut root;
    for part in key.split('.') {
        let (name, list) = match part.split_once('[') {
            Some((name, _)) => (name, true),
            None => (part, false),
        };
        let name = if name.starts_with(['<', '{']) {
            "t"
        } else {
            name
        };
        if !at.is_mapping() {
            *at = Value::Mapping(Mapping::new());
        }
        let map = at.as_mapping_mut().expect("made a mapping");
        let mut entry = map
            .remove(name)
            .filter(|v| !v.is_null())
            .unwrap_or(Value::Null);
        if list && !matches!(&entry, Value::Sequence(s) if !s.is_empty()) {
            entry = Value::Sequence(vec![Value::Mapping(Mapping::new())]);
        }
        map.insert(Value::String(name.to_owned()), entry);
        at = map.get_mut(name).expect("inserted");
        if let Value::Sequence(items) = at {
            at = &mut items[0];
        }
    }
    *at = Value::Null;
    root
}

/// Whether the server's configuration `base`, with `key` set (to null), is refused for an
/// unknown field.
fn server_calls_unknown(base: &serde_yaml::Value, key: &str) -> bool {
    let text = serde_yaml::to_string(&with_key(base, key)).expect("YAML");
    switchyard_config::Config::from_yaml_str(&text, "probe")
        .is_err_and(|e| e.to_string().contains("unknown field"))
}

/// Whether the simulation spec `base`, with `key` set (to null), is refused for an unknown
/// field.
fn spec_calls_unknown(base: &serde_yaml::Value, key: &str) -> bool {
    let text = serde_yaml::to_string(&with_key(base, key)).expect("YAML");
    switchyard_simulator::SimulationSpec::from_yaml_str(&text, Path::new("probe"))
        .is_err_and(|e| e.to_string().contains("unknown field"))
}

/// Every configuration key the documents name is one the server's configuration or a
/// simulation spec reads: set (to null) in a shipped example, it is refused for its value or
/// accepted, never as an unknown field.
#[test]
fn every_documented_config_key_is_read() {
    let parse = |rel: &str| -> serde_yaml::Value {
        serde_yaml::from_str(&read(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
    };
    let server = parse("config/examples/multi-tenant.yaml");
    let spec = parse("config/examples/sim-jsonl.yaml");
    let mut docs = vec!["README.md".to_owned(), "ARCHITECTURE.md".to_owned()];
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/examples");
    for entry in std::fs::read_dir(&examples).expect("config/examples") {
        let name = entry.expect("an entry").file_name();
        let name = name.to_string_lossy();
        if name.ends_with(".yaml") {
            docs.push(format!("config/examples/{name}"));
        }
    }
    let mut checked = 0;
    let mut wrong = Vec::new();
    for doc in &docs {
        for key in config_keys(&read(doc)) {
            checked += 1;
            if server_calls_unknown(&server, &key) && spec_calls_unknown(&spec, &key) {
                wrong.push(format!("{doc}: `{key}`"));
            }
        }
    }
    assert!(
        checked > 100,
        "only {checked} keys found: the reader lost them"
    );
    assert!(
        wrong.is_empty(),
        "documents name configuration keys neither the server nor a simulation spec reads:\n{}",
        wrong.join("\n")
    );
}

/// The probe tells a misspelt key from a real one, in both kinds of file.
#[test]
fn the_key_probe_refuses_an_unknown_key() {
    let server: serde_yaml::Value =
        serde_yaml::from_str(&read("config/examples/default.yaml")).expect("YAML");
    let spec: serde_yaml::Value =
        serde_yaml::from_str(&read("config/examples/sim-jsonl.yaml")).expect("YAML");
    for (calls_unknown, base, misspelt, right) in [
        (
            server_calls_unknown as fn(&serde_yaml::Value, &str) -> bool,
            &server,
            &[
                "server.max_body_byte",
                "tiers.<name>.max_kv_fractions",
                "lora.adapters[i].pined",
                "server.tls.cert",
            ][..],
            &[
                "server.max_body_bytes",
                "tiers.<name>.max_kv_fraction",
                "lora.adapters[i].pinned",
                "server.tls.cert_file",
            ][..],
        ),
        (
            spec_calls_unknown,
            &spec,
            &[
                "workload.start",
                "hardware.peak_flop",
                "scheduler.lora_memory.load",
            ],
            &[
                "workload.start_s",
                "hardware.peak_flops",
                "scheduler.lora_memory.load_ms",
            ],
        ),
    ] {
        for key in misspelt {
            assert!(calls_unknown(base, key), "{key}");
        }
        for key in right {
            assert!(!calls_unknown(base, key), "{key}");
        }
    }
    assert_eq!(
        config_keys("`cache.block_size` and `tiers.<name>.weight`, not `sim-jsonl.yaml`"),
        BTreeSet::from([
            "cache.block_size".to_owned(),
            "tiers.<name>.weight".to_owned()
        ])
    );
}
