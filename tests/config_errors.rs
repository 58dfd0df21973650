//! `switchyard config check`'s errors as an operator reads them: the file and the line of the
//! value at fault, or the override that set it, and the field. The real binary; no model.

mod common;

use common::{temp_dir, TempDir};
use std::path::{Path, PathBuf};
use std::process::Command;

const EXAMPLE: &str = "config/examples/default.yaml";

/// `config check FILE ARGS...` with `env`; its exit status and stderr.
fn check(file: &Path, args: &[&str], env: &[(&str, &str)]) -> (bool, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_switchyard"));
    cmd.current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["config", "check"])
        .arg(file)
        .args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run switchyard config check");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The error `config check` prints (it must fail).
fn refused(file: &Path, args: &[&str], env: &[(&str, &str)]) -> String {
    let (ok, err) = check(file, args, env);
    assert!(!ok, "accepted: {err}");
    err
}

/// The example file with `find` replaced by `replace` (which must occur), written apart: the
/// file, in the directory that holds it (removed when dropped).
fn edited(name: &str, find: &str, replace: &str) -> (TempDir, PathBuf) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join(EXAMPLE)).expect("the example");
    assert!(text.contains(find), "`{find}` is not in the example");
    let dir = temp_dir("config-errors", name);
    let path = dir.join(format!("{name}.yaml"));
    std::fs::write(&path, text.replacen(find, replace, 1)).expect("write");
    (dir, path)
}

/// The line of the example that holds `find` (1-based): the example changes, the errors'
/// lines follow it.
fn line_of(find: &str) -> usize {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join(EXAMPLE)).expect("the example");
    text.lines()
        .position(|l| l.contains(find))
        .unwrap_or_else(|| panic!("`{find}` is not in the example"))
        + 1
}

#[test]
fn a_value_out_of_range_names_its_own_field_and_line() {
    for (find, replace, expected) in [
        (
            "kv_cache_mb: 256",
            "kv_cache_mb: 0",
            "cache.kv_cache_mb: 0 is out of range 1..=1048576 at line",
        ),
        (
            "port: 8000",
            "port: 99999",
            "server.port: 99999 is out of range 0..=65535 at line",
        ),
        (
            "max_loras: 4",
            "max_loras: 0",
            "lora.max_loras: 0 is out of range 1..=1024 at line",
        ),
        (
            "max_num_batched_tokens: 2048",
            "max_num_batched_tokens: 0",
            "scheduler.max_num_batched_tokens: 0 is out of range 1..=1048576 at line",
        ),
        (
            "# step_timeout_s: 300",
            "step_timeout_s: 86401",
            "scheduler.step_timeout_s: 86401 is out of range 0..=86400 at line",
        ),
    ] {
        let (_dir, file) = edited("range", find, replace);
        let err = refused(&file, &[], &[]);
        let line = line_of(find);
        assert!(
            err.starts_with(&format!(
                "error: {}:{line}: {expected} {line}",
                file.display()
            )),
            "{replace}: {err}"
        );
    }
}

#[test]
fn a_policy_error_names_the_override_that_set_it_or_the_files_line() {
    let example = Path::new(EXAMPLE);
    let unknown = "scheduler.policy.name: unknown scheduling policy `nope`; known policies: fcfs";
    let err = refused(example, &["--set", "scheduler.policy.name=nope"], &[]);
    assert!(
        err.starts_with(&format!(
            "error: override `--set scheduler.policy.name=nope`: {unknown}"
        )),
        "{err}"
    );
    assert!(!err.contains("default.yaml"), "{err}");
    let err = refused(
        example,
        &[],
        &[("SWITCHYARD__SCHEDULER__POLICY__NAME", "nope")],
    );
    assert!(
        err.starts_with(&format!(
            "error: override `SWITCHYARD__SCHEDULER__POLICY__NAME=nope`: {unknown}"
        )),
        "{err}"
    );
    // Set by the file (a flow mapping): the file's line.
    let (_dir, file) = edited("policy", "{ name: fcfs }", "{ name: nope }");
    let err = refused(&file, &[], &[]);
    assert!(
        err.starts_with(&format!(
            "error: {}:{}: {unknown}",
            file.display(),
            line_of("{ name: fcfs }")
        )),
        "{err}"
    );
    // A parameter: the value as written.
    let err = refused(
        example,
        &[
            "--set",
            "scheduler.policy.name=chunked-prefill",
            "--set",
            "scheduler.policy.params.token_budget=-1",
        ],
        &[],
    );
    assert!(
        err.starts_with(
            "error: override `--set scheduler.policy.params.token_budget=-1`: \
             scheduler.policy.params.token_budget: policy `chunked-prefill`: parameter \
             `token_budget`: expected a non-negative integer, got -1"
        ),
        "{err}"
    );
    // prefix-aware's starvation bound is bounded: 0 would age every request at once.
    let err = refused(
        example,
        &[
            "--set",
            "scheduler.policy.name=prefix-aware",
            "--set",
            "scheduler.policy.params.max_wait_ms=0",
        ],
        &[],
    );
    assert!(
        err.contains(
            "scheduler.policy.params.max_wait_ms: policy `prefix-aware`: parameter \
             `max_wait_ms`: must be in 1..=3600000, got 0"
        ),
        "{err}"
    );
}

#[test]
fn dummy_weights_are_refused_as_serve_refuses_them() {
    let (_dir, file) = edited(
        "dummy",
        "  backend: auto",
        "  load_format: dummy\n  architecture: foo\n  backend: auto",
    );
    let err = refused(&file, &[], &[]);
    assert!(
        err.starts_with(&format!(
            "error: {}:{}: model.load_format: dummy is for benchmarks",
            file.display(),
            line_of("  backend: auto")
        )),
        "{err}"
    );
    assert!(err.contains("serve needs real weights"), "{err}");
    for arch in ["smollm2-135m", "llama-3-8b", "qwen2.5-0.5b", "qwen3-0.6b"] {
        assert!(err.contains(arch), "{arch} not listed: {err}");
    }
    let err = refused(
        Path::new(EXAMPLE),
        &[
            "--set",
            "model.load_format=dummy",
            "--set",
            "model.architecture=llama-3-8b",
        ],
        &[],
    );
    assert!(
        err.starts_with("error: override `--set model.load_format=dummy`: model.load_format:"),
        "{err}"
    );
}

#[test]
fn a_missing_file_and_a_section_set_to_a_scalar_are_said_once_and_in_words() {
    let err = refused(Path::new("/nonexistent.yaml"), &[], &[]);
    assert_eq!(
        err.trim_end(),
        format!(
            "error: cannot read /nonexistent.yaml: {}",
            std::io::Error::from_raw_os_error(2)
        )
    );
    let err = refused(Path::new(EXAMPLE), &["--set", "server=3"], &[]);
    assert_eq!(
        err.trim_end(),
        "error: override `--set server=3`: field `server`: invalid type: integer `3`, expected \
         a mapping (the server section)"
    );
    let (ok, err) = check(Path::new(EXAMPLE), &[], &[]);
    assert!(ok, "{err}");
}

/// A `model.path` that is not there is refused without loading anything, naming the key and
/// its line (or its override); the empty path (the embedded model, fetched later) is not.
#[test]
fn a_missing_model_path_is_refused_naming_the_key_and_its_line() {
    let (_dir, file) = edited(
        "missing-model",
        "  path: \"\"",
        "  path: /nonexistent/model.gguf",
    );
    let err = refused(&file, &[], &[]);
    assert_eq!(
        err.trim_end(),
        format!(
            "error: {}:{}: model.path: cannot read `/nonexistent/model.gguf`: no such file or \
             directory",
            file.display(),
            line_of("  path: \"\"")
        )
    );
    let err = refused(
        Path::new(EXAMPLE),
        &["--set", "model.path=/nonexistent/model.gguf"],
        &[],
    );
    assert!(
        err.starts_with(
            "error: override `--set model.path=/nonexistent/model.gguf`: model.path: cannot read"
        ),
        "{err}"
    );
    let (ok, err) = check(Path::new(EXAMPLE), &[], &[]);
    assert!(ok, "the example's empty model.path was refused: {err}");
}

/// An error about an item of a list written in flow style on one line (`api_keys: [{...}]`)
/// names the line of that list, as one about a `- ` item names the item's line (it used to
/// name no line at all).
#[test]
fn an_item_of_a_one_line_flow_list_is_located() {
    let (_dir, file) = edited(
        "flow-list",
        "  # api_keys_file: /etc/switchyard/keys.yaml",
        "  api_keys: [{ key: sk-12345678, tenant: acme, tier: gold }]",
    );
    let err = refused(&file, &[], &[]);
    assert!(
        err.starts_with(&format!(
            "error: {}:{}: server.api_keys[0].tier: unknown tier `gold`",
            file.display(),
            line_of("  # api_keys_file: /etc/switchyard/keys.yaml")
        )),
        "{err}"
    );
}

/// A `model.chat_template` that is missing or does not compile is refused by `config check`
/// naming the key and its line, and by `serve` before the model loads (it used to pass the
/// check and fail `serve` only once the model had loaded, without the file's line); a
/// template that compiles passes.
#[test]
fn a_chat_template_that_cannot_be_read_or_compiled_is_refused_before_the_model_loads() {
    let commented = "  # chat_template: /srv/templates/chat.jinja";
    let (_dir, file) = edited(
        "missing-template",
        commented,
        "  chat_template: /nonexistent/chat.jinja",
    );
    let err = refused(&file, &[], &[]);
    assert!(
        err.starts_with(&format!(
            "error: {}:{}: model.chat_template: ",
            file.display(),
            line_of(commented)
        )) && err.contains("/nonexistent/chat.jinja"),
        "{err}"
    );
    let serve = Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["serve", "--set", "server.port=0", "--config"])
        .arg(&file)
        .output()
        .expect("run switchyard serve");
    let log = String::from_utf8_lossy(&serve.stderr);
    assert!(!serve.status.success(), "{log}");
    assert!(
        log.contains("model.chat_template") && !log.contains("loading model"),
        "serve did not refuse the template before loading the model: {log}"
    );

    let dir = file.parent().expect("the edited file's directory");
    let broken = dir.join("broken.jinja");
    std::fs::write(&broken, "{% for m in messages %}{{ m.content }}").expect("write");
    let err = refused(
        Path::new(EXAMPLE),
        &[
            "--set",
            &format!("model.chat_template={}", broken.display()),
        ],
        &[],
    );
    assert!(
        err.starts_with("error: override `--set model.chat_template=")
            && err.contains("model.chat_template: "),
        "{err}"
    );

    let good = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3.jinja");
    let (ok, err) = check(
        Path::new(EXAMPLE),
        &["--set", &format!("model.chat_template={}", good.display())],
        &[],
    );
    assert!(ok, "a template that compiles was refused: {err}");
}

/// An entry of `lora.adapters` whose path is not a PEFT directory (missing, a file, a directory
/// without the adapter's files) is refused by `config check`, naming its index and what is
/// wrong, as `serve` refuses it before the model loads; the fixture's adapter passes.
#[test]
fn lora_adapters_paths_are_checked_before_the_model_loads() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let fixture = root.join("gpu/tests/fixtures/lora/smollm2-r4");
    let empty = temp_dir("config-errors", "empty-adapter");
    let set = |path: &Path| {
        vec![
            "--set".to_owned(),
            "lora.enabled=true".into(),
            "--set".into(),
            format!(
                "lora.adapters=[{{name: good, path: {}}}, {{name: tuned, path: {}}}]",
                fixture.display(),
                path.display()
            ),
        ]
    };
    let cases = [
        (
            PathBuf::from("/nonexistent/adapters/sql"),
            "lora.adapters[1].path: cannot read `/nonexistent/adapters/sql`: no such file",
        ),
        (fixture.join("adapter_config.json"), "is not a directory"),
        (empty.to_path_buf(), "adapter_config.json: no such file"),
    ];
    for (path, expected) in cases {
        let args = set(&path);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let err = refused(Path::new(EXAMPLE), &args, &[]);
        assert!(err.contains(expected), "{}: {err}", path.display());
        assert!(err.contains("lora.adapters[1].path"), "{err}");
    }
    let args = set(&fixture);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (ok, err) = check(Path::new(EXAMPLE), &args, &[]);
    assert!(ok, "{err}");
}

/// An entry of `lora.adapter_dirs` that is not a directory is refused before the model loads,
/// naming its index and what it is.
#[test]
fn lora_adapter_dirs_must_be_directories() {
    let set = |value: &str| {
        vec![
            "--set".to_owned(),
            "lora.enabled=true".into(),
            "--set".into(),
            format!("lora.adapter_dirs={value}"),
        ]
    };
    let args = set("[/nonexistent/adapters]");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let err = refused(Path::new(EXAMPLE), &args, &[]);
    assert!(
        err.contains("lora.adapter_dirs[0]: cannot read `/nonexistent/adapters`: no such file"),
        "{err}"
    );
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join(EXAMPLE);
    let args = set(&format!("[/tmp, {}]", file.display()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let err = refused(Path::new(EXAMPLE), &args, &[]);
    assert!(
        err.contains("lora.adapter_dirs[1]") && err.contains("is not a directory"),
        "{err}"
    );
    let args = set("[/tmp]");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (ok, err) = check(Path::new(EXAMPLE), &args, &[]);
    assert!(ok, "{err}");
}

/// A test's scratch directory goes with the test, failed as well as passed: the guard removes
/// it, and all it holds, as the panic unwinds.
#[test]
fn a_scratch_directory_is_removed_when_its_test_fails() {
    let mut kept = None;
    let failed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let dir = temp_dir("config-errors", "failing-test");
        std::fs::create_dir_all(dir.join("nested")).expect("nested dir");
        std::fs::write(dir.join("nested/file"), "x").expect("file");
        kept = Some(dir.to_path_buf());
        panic!("the test fails");
    }));
    assert!(failed.is_err());
    let dir = kept.expect("the directory was made");
    assert!(!dir.exists(), "{} is left behind", dir.display());
}

/// A misspelt key or choice gets the known name nearest it ("did you mean"), in the file, in
/// an override and in an environment variable; a name near none gets serde's list alone.
#[test]
fn a_misspelt_key_or_choice_names_the_one_meant() {
    for (find, replace, expected, meant) in [
        (
            "port: 8000",
            "prot: 8000",
            "server: unknown field `prot`, expected one of `host`, `port`,",
            "port",
        ),
        (
            "max_num_seqs: 64",
            "max_num_seq: 64",
            "scheduler: unknown field `max_num_seq`, expected one of `max_num_seqs`,",
            "max_num_seqs",
        ),
        (
            "backend: auto ",
            "backend: cdua ",
            "model.backend: unknown variant `cdua`, expected one of `auto`, `cpu`, `cuda`",
            "cuda",
        ),
        (
            "# load_format: auto ",
            "load_format: safetensor ",
            "model.load_format: unknown variant `safetensor`, expected one of",
            "safetensors",
        ),
    ] {
        let (_dir, file) = edited("misspelt", find, replace);
        let err = refused(&file, &[], &[]);
        let at = format!("error: {}:{}: {expected}", file.display(), line_of(find));
        assert!(
            err.starts_with(&at) && err.contains(&format!("(did you mean `{meant}`?) at line")),
            "{replace}: {err}"
        );
    }
    // Nothing near: serde's list, no guess.
    let (_dir, file) = edited("far", "port: 8000", "colour: 8000");
    let err = refused(&file, &[], &[]);
    assert!(
        err.contains("unknown field `colour`, expected one of `host`, `port`"),
        "{err}"
    );
    assert!(!err.contains("did you mean"), "{err}");
    // The same through an override, named as the operator wrote it.
    let example = Path::new(EXAMPLE);
    let err = refused(example, &["--set", "server.prot=80"], &[]);
    assert!(
        err.starts_with("error: override `--set server.prot=80`: ")
            && err.contains("unknown field `prot`")
            && err.contains("(did you mean `port`?)"),
        "{err}"
    );
    let err = refused(example, &[], &[("SWITCHYARD__MODEL__BACKEND", "CUDA")]);
    assert!(
        err.starts_with("error: override `SWITCHYARD__MODEL__BACKEND=CUDA`: ")
            && err.contains("unknown variant `CUDA`")
            && err.contains("(did you mean `cuda`?)"),
        "{err}"
    );
}

/// A configuration of its own, `text`, written apart: the file, in the directory that holds
/// it (removed when dropped).
fn written(name: &str, text: &str) -> (TempDir, PathBuf) {
    let dir = temp_dir("config-errors", name);
    let path = dir.join(format!("{name}.yaml"));
    std::fs::write(&path, text).expect("write");
    (dir, path)
}

/// A `lora.adapters` entry whose `adapter_config.json` the adapter loader refuses (a rank
/// above `lora.max_lora_rank`, a file that is not a JSON object or is past its 1 MiB bound) is
/// refused by `config check` at the entry's line, for the loader's reason: it passed, and
/// `serve` refused it only once the model had loaded.
#[test]
fn an_adapter_s_configuration_is_read_as_its_load_reads_it() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let fixture = root.join("gpu/tests/fixtures/lora/smollm2-r4");
    let config = |rank: usize, path: &Path| {
        format!(
            "lora:\n  enabled: true\n  max_lora_rank: {rank}\n  adapters:\n    - name: tuned\n      path: {}\n",
            path.display()
        )
    };
    let (_dir, file) = written("adapter-rank", &config(2, &fixture));
    let err = refused(&file, &[], &[]);
    assert!(
        err.starts_with(&format!(
            "error: {}:6: lora.adapters[0].path: invalid LoRA adapter {}: rank 4 is outside \
             1..=2 (max_lora_rank)",
            file.display(),
            fixture.join("adapter_config.json").display()
        )),
        "{err}"
    );
    let (_dir, file) = written("adapter-rank-ok", &config(4, &fixture));
    let (ok, err) = check(&file, &[], &[]);
    assert!(ok, "{err}");

    let hostile = temp_dir("config-errors", "hostile-adapter");
    std::fs::write(hostile.join("adapter_model.safetensors"), b"").expect("write");
    for (text, why) in [
        ("[1, 2]".to_string(), "not a JSON object"),
        (" ".repeat(2 << 20), "too large"),
        ("{\"r\": 0}".to_string(), "rank 0 is outside"),
    ] {
        std::fs::write(hostile.join("adapter_config.json"), text).expect("write");
        let (_dir, file) = written("adapter-hostile", &config(64, &hostile));
        let err = refused(&file, &[], &[]);
        assert!(
            err.contains(":6: lora.adapters[0].path: invalid LoRA adapter ") && err.contains(why),
            "{why}: {err}"
        );
    }
}

/// A `model.path` that the loader would not read (a directory holding no model, such as
/// /tmp, or a file that is not GGUF) is refused by `config check` naming the field and its
/// line, for the loader's reason: it passed, and `serve` failed on `config.json: No such
/// file` after it had started.
#[test]
fn a_model_path_that_holds_no_model_is_refused_naming_its_line() {
    let empty = temp_dir("config-errors", "no-model");
    let text = empty.join("notes.txt");
    std::fs::write(&text, "not a model").expect("write");
    for (path, why) in [
        (
            empty.to_path_buf(),
            "a directory with neither a .gguf file nor config.json",
        ),
        (text.clone(), "not a GGUF file (bad magic)"),
    ] {
        let (_dir, file) = written(
            "no-model-config",
            &format!("model:\n  path: {}\n", path.display()),
        );
        let err = refused(&file, &[], &[]);
        assert!(
            err.starts_with(&format!("error: {}:2: model.path: ", file.display()))
                && err.contains(why),
            "{}: {err}",
            path.display()
        );
    }
    let (ok, err) = check(
        Path::new(EXAMPLE),
        &[
            "--set",
            &format!("model.path={}", common::model_path().display()),
        ],
        &[],
    );
    assert!(ok, "the embedded model was refused: {err}");
}

/// A relative path in the configuration is read against the working directory, not the
/// configuration file's: an error about a missing one says against which, for every kind
/// of path (`model.path`, an adapter, the API keys file, a TLS file).
#[test]
fn a_missing_relative_path_names_the_directory_it_was_read_against() {
    let cwd = env!("CARGO_MANIFEST_DIR");
    let note = format!("(relative to the working directory {cwd})");
    for (set, field) in [
        ("model.path=models/m.gguf", "model.path"),
        (
            "lora.adapters=[{name: tuned, path: adapters/tuned}]",
            "lora.adapters[0].path",
        ),
        ("server.api_keys_file=keys/api.yaml", "server.api_keys_file"),
        (
            "server.tls={cert_file: tls/cert.pem, key_file: tls/key.pem}",
            "server.tls.cert_file",
        ),
    ] {
        let err = refused(
            Path::new(EXAMPLE),
            &["--set", "lora.enabled=true", "--set", set],
            &[],
        );
        assert!(err.contains(field) && err.contains(&note), "{set}: {err}");
    }
    let err = refused(
        Path::new(EXAMPLE),
        &["--set", "model.path=/nonexistent/m.gguf"],
        &[],
    );
    assert!(!err.contains("relative"), "{err}");
}

/// A block size the KV cache does not take (7) is refused at its line naming the sizes it
/// takes; one of them (32) passes.
#[test]
fn a_block_size_that_is_not_a_power_of_two_is_refused_naming_the_sizes() {
    let (_dir, file) = edited("block-size", "  block_size: 16", "  block_size: 7");
    let err = refused(&file, &[], &[]);
    assert!(
        err.starts_with(&format!(
            "error: {}:{}: cache.block_size: 7 is not a block size: it takes a power of two, \
             one of 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024",
            file.display(),
            line_of("  block_size: 16")
        )),
        "{err}"
    );
    let (ok, err) = check(Path::new(EXAMPLE), &["--set", "cache.block_size=32"], &[]);
    assert!(ok, "{err}");
}
