//! Whether this machine makes unprivileged user and PID namespaces, for the tests that run
//! `switchyard` (or a test's own process) as PID 1 of one, as a container's entry point runs.
//!
//! One file for the binary's unit tests (`commands::serve::engine_life`) and the end-to-end
//! tests' `tests/common/pid1.rs`, each including it as a test-only module by its path
//! (`#[path]`), as `scratch.rs` is.

use std::process::{Command, Stdio};

/// Whether `unshare -Urpf true` succeeds here (unprivileged user and PID namespaces). Where it
/// does not (unprivileged user namespaces off by a sysctl or a container's seccomp profile, or
/// no `unshare`), this says so on stderr, starting `SKIPPED`, and a PID-1 test returns without
/// checking anything.
pub fn pid_namespaces_work() -> bool {
    let out = Command::new("unshare")
        .args(["-Urpf", "true"])
        .stdin(Stdio::null())
        .output();
    let why = match out {
        Ok(out) if out.status.success() => return true,
        Ok(out) => format!(
            "`unshare -Urpf true` failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ),
        Err(e) => format!("cannot run `unshare`: {e}"),
    };
    eprintln!("SKIPPED, not checked: this machine makes no user and PID namespace: {why}");
    false
}
